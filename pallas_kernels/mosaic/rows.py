"""Q, K, V, dO and O rows in shared memory: their buffers, the views TMA
and wgmma take of them, their copies, and the products that read them.

Rows of whole 128-byte swizzle tiles (d=64, 128, 256 in 16 bits) are read
and written in place at any length (`rows_in_place`): TMA copies through a
view tiled one row at a time, wgmma reads the same bytes through the
(8, 64) tiling (`row_buffer`, `RowViews`). Rows wider than one swizzle
tile are stored column tile after column tile (`ColumnTiles`), one TMA
copy a tile (`copy_rows_in`, `copy_rows_out`), and every product that
reads them is split at the tiles (`wgmma`). Elsewhere a buffer is one
tiled, swizzled ref and these helpers pass it through unchanged.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.mosaic.common import SWIZZLES, ragged_lengths, swizzled


class RowViews(NamedTuple):
  """One shared-memory buffer of Q, K, V or O rows ([..., rows, columns]),
  as each use needs it: `mma` tiled and swizzled (`swizzled`: wgmma, and
  register stores), `tma` for the TMA copies to and from the global rows.
  The same ref twice, except for rows read in place (`row_buffer`);
  `split` where those rows are wider than a swizzle tile, stored column
  tile after column tile: `mma` is then `ColumnTiles`, and TMA moves one
  column tile at a time (`copy_rows_in`, `copy_rows_out`)."""
  tma: Any
  mma: Any
  split: bool = False

  @classmethod
  def of(cls, scratch, static) -> RowViews:
    """The views of a `row_buffer` as a kernel of `static` configuration
    (its `rows_in_place`, `head_dim` and `dtype`) receives it: a ref, or a
    `plgpu.RefUnion` of the (row-tiled, tiled) pair."""
    if not static.rows_in_place:
      return cls.plain(scratch)
    tma, mma = scratch
    if split_rows(static.head_dim, static.dtype):
      return cls(tma, ColumnTiles(mma), split=True)
    return cls(tma, mma)

  @classmethod
  def plain(cls, ref) -> RowViews:
    """A buffer that is not rows read in place (statistics, ids, FP8's O):
    one ref for both uses."""
    return cls(ref, ref)

  @property
  def at(self):
    return _RowViewsIndexer(self)

  def column_tile(self, piece: int):
    """The [rows, swizzle tile] TMA view of column tile `piece` of a split
    buffer."""
    return self.tma.at[piece]


class _RowViewsIndexer(NamedTuple):
  views: RowViews

  def __getitem__(self, index) -> RowViews:
    return RowViews(self.views.tma.at[index], self.views.mma.at[index],
                    self.views.split)


class ColumnTiles(NamedTuple):
  """A wgmma operand of [..., rows, tiles * width] stored column tile after
  column tile: `ref` is [..., tiles, rows, width], each tile tiled and
  swizzled as a buffer of its own (`row_buffer`'s split rows), or its
  transpose. It is indexed on its leading axes and rows (`.at`),
  transposed, stored into, and multiplied by `wgmma`, which splits each
  product at the tiles."""
  ref: Any
  transposed: bool = False

  @property
  def shape(self) -> tuple[int, ...]:
    *outer, tiles, rows, width = self.ref.shape
    last = (tiles * width, rows) if self.transposed else (rows, tiles * width)
    return (*outer, *last)

  @property
  def dtype(self):
    return self.ref.dtype

  @property
  def num_tiles(self) -> int:
    return self.ref.shape[-3]

  @property
  def width(self) -> int:
    return self.ref.shape[-1]

  @property
  def at(self):
    return _ColumnTilesIndexer(self)

  def transpose(self, permutation) -> ColumnTiles:
    if tuple(permutation) != (1, 0) or len(self.ref.shape) != 3:
      raise NotImplementedError(
          f"a [rows, columns] operand's transpose, not {permutation} of "
          f"{self.shape}")
    return self._replace(transposed=not self.transposed)

  def tile(self, piece: int):
    """Column tile `piece` ([rows, width]; its transpose if transposed)."""
    tile = self.ref.at[piece]
    return tile.transpose((1, 0)) if self.transposed else tile

  def __setitem__(self, index, value) -> None:
    """`ref[...] = value` for a register array of `shape`: stored a column
    tile at a time."""
    if index is not Ellipsis or self.transposed:
      raise NotImplementedError("only a whole, untransposed store")
    for piece in range(self.num_tiles):
      columns = slice(piece * self.width, (piece + 1) * self.width)
      self.ref.at[piece][...] = value[..., columns]


class _ColumnTilesIndexer(NamedTuple):
  tiles: ColumnTiles

  def __getitem__(self, index) -> ColumnTiles:
    index = index if isinstance(index, tuple) else (index,)
    ref, outer = self.tiles.ref, len(self.tiles.ref.shape) - 3
    if self.tiles.transposed or len(index) > outer + 1:
      raise NotImplementedError(
          f"indexing {self.tiles.shape} column tiles with {index}")
    if len(index) == outer + 1:  # rows too: every tile's
      index = (*index[:outer], slice(None), index[outer])
    return ColumnTiles(ref.at[index])


def wgmma(acc_ref, a, b) -> int:
  """`plgpu.wgmma(acc_ref, a, b)` where `a` ([m, k]) or `b` ([k, n]) may
  be `ColumnTiles`: split at their tiles into one wgmma each, b's columns
  into `acc_ref`'s column slices and the contraction (a's columns, a
  transposed b's rows) into partial sums. Returns the number of wgmmas
  issued (each its own commit group: the count that waits on the
  products after it must allow, `wgmma_count`)."""
  if isinstance(b, ColumnTiles) and not b.transposed:  # n split
    issued = 0
    for piece in range(b.num_tiles):
      columns = pl.ds(piece * b.width, b.width)
      issued += wgmma(acc_ref.at[:, columns], a, b.tile(piece))
    return issued
  if isinstance(a, ColumnTiles) and a.transposed:
    raise NotImplementedError("a transposed left operand in column tiles")
  split = a if isinstance(a, ColumnTiles) else b
  if not isinstance(split, ColumnTiles):
    plgpu.wgmma(acc_ref, a, b)
    return 1
  for piece in range(split.num_tiles):  # k split
    ks = pl.ds(piece * split.width, split.width)
    plgpu.wgmma(acc_ref, _contraction_tile(a, piece, ks, left=True),
                _contraction_tile(b, piece, ks, left=False))
  return split.num_tiles


def wgmma_count(a, b) -> int:
  """The wgmmas (commit groups) `wgmma(acc_ref, a, b)` issues."""
  if isinstance(b, ColumnTiles) and not b.transposed:
    return b.num_tiles * wgmma_count(a, b.tile(0))
  split = a if isinstance(a, ColumnTiles) else b
  return split.num_tiles if isinstance(split, ColumnTiles) else 1


def _contraction_tile(x, piece: int, ks, *, left: bool):
  """Contraction slice `ks` (tile `piece`) of a wgmma operand in shared
  memory (`ColumnTiles` or a ref): a's columns, b's rows."""
  if isinstance(x, ColumnTiles):
    return x.tile(piece)
  return x.at[:, ks] if left else x.at[ks, :]


def copy_rows_in(src, views: RowViews, barrier) -> None:
  """TMA of the global rows `src` ([rows, columns]) into `views`' buffer,
  arriving on `barrier`: one copy, or one per column tile of a split
  buffer (`row_copies` of them: the barrier's arrivals)."""
  if not views.split:
    plgpu.copy_gmem_to_smem(src, views.tma, barrier)
    return
  for piece, columns in _column_tiles(views.mma):
    plgpu.copy_gmem_to_smem(src.at[:, columns], views.column_tile(piece),
                            barrier)


def copy_rows_out(views: RowViews, dst) -> None:
  """TMA of `views`' buffer to the global rows `dst` ([rows, columns]);
  rows past the array's end are dropped, column tile by column tile where
  split."""
  if not views.split:
    plgpu.copy_smem_to_gmem(views.tma, dst)
    return
  for piece, columns in _column_tiles(views.mma):
    plgpu.copy_smem_to_gmem(views.column_tile(piece), dst.at[:, columns])


def _column_tiles(tiles: ColumnTiles):
  """(piece, global columns) of each column tile of `tiles`."""
  for piece in range(tiles.num_tiles):
    yield piece, pl.ds(piece * tiles.width, tiles.width)


def split_rows(columns: int, dtype) -> bool:
  """Whether rows of `columns` read in place are stored column tile after
  column tile (`row_buffer`): wider than one swizzle tile."""
  return columns * jnp.dtype(dtype).itemsize > SWIZZLES[0]


def row_copies(columns: int, dtype, *, in_place: bool) -> int:
  """TMA copies that fill a buffer of rows `columns` wide (`row_buffer`),
  the arrivals its barrier waits for: one per column tile of split rows
  (`split_rows`), else 1."""
  if not (in_place and split_rows(columns, dtype)):
    return 1
  return columns * jnp.dtype(dtype).itemsize // SWIZZLES[0]


def rows_in_place(q_len: int, kv_len: int, head_dim: int, dtype) -> bool:
  """Whether the kernels (plain and masked) read and write rows off the
  8-row TMA tiling (`ragged_lengths` false: ViT's 197 tokens, an LLM's
  prompt of 4097) in place, without a padded copy. Mosaic GPU tiles a TMA's global
  array like its shared buffer (the row axis as [rows / 8, 8],
  `TileTransform.transform_gmem_shape`), so a buffer tiled (8, 64) for
  wgmma cannot take such rows; one tiled (1, 64) with the same swizzle
  can, and where a row is one 128-byte swizzle tile (d=64 in 16 bits) the
  two tilings lay out the same bytes, so wgmma reads the (8, 64) view of
  what TMA wrote through the (1, 64) one (`row_buffer`). (A swizzle
  without a tiling is refused by Mosaic GPU's layout inference.) Rows of
  several swizzle tiles (d=128 and 256) are laid out column tile after
  column tile, each a d=64 buffer that TMA fills with one copy
  (`copy_rows_in`), and every product that reads them is split at the
  tiles (`ColumnTiles`, `wgmma`). 16-bit rows only (the FP8
  forward's V is transposed); rows of no whole number of swizzle tiles
  (own widths: d=80, 96, ...) are padded."""
  row_bytes = head_dim * jnp.dtype(dtype).itemsize
  return (not ragged_lengths(q_len, kv_len)
          and jnp.dtype(dtype).itemsize == 2
          and row_bytes % SWIZZLES[0] == 0)


def row_buffer(shape, dtype, *, in_place: bool):
  """SMEM of `shape` ([..., rows, columns]) for Q, K, V or O rows, tiled
  and swizzled (`swizzled`); with `in_place` (`rows_in_place`) a
  `plgpu.RefUnion` of a view tiled one row at a time with the same swizzle
  (for TMA) and the tiled one (for wgmma): two views of the same bytes,
  both at the union's start. Rows wider than a swizzle tile are stored
  column tile after column tile, [..., tiles, rows, width]
  (`column_tiles_shape`): both views so shaped, TMA filling one column
  tile at a time (`copy_rows_in`) and wgmma reading them as `ColumnTiles`.
  The kernel takes it apart with `RowViews.of`."""
  if in_place and split_rows(shape[-1], dtype):
    shape = column_tiles_shape(shape, dtype)
  tiled = plgpu.SMEM(shape, dtype, transforms=swizzled(shape[-1], dtype))
  if not in_place:
    return tiled
  width = SWIZZLES[0] // jnp.dtype(dtype).itemsize
  untiled = plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((1, width)),
      plgpu.SwizzleTransform(SWIZZLES[0])))
  return plgpu.RefUnion(untiled, tiled)


def column_tiles_shape(shape, dtype) -> tuple[int, ...]:
  """[..., rows, columns] as [..., tiles, rows, width]: split rows' column
  tiles of one 128-byte swizzle tile each (`split_rows`)."""
  *outer, rows, columns = shape
  width = SWIZZLES[0] // jnp.dtype(dtype).itemsize
  return (*outer, columns // width, rows, width)
