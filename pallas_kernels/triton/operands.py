"""The optional inputs of the kernels: block ranges, masks, scores, dropout.

Outside the kernel, `prepare` turns a call's mask operands into arrays and
`BlockSpec`s for one kernel's tiling. Inside, `TileReader` reads them back for
one tile and hands `pallas_kernels.masking` the values it needs, so the kernels
never spell out a mask themselves.

Two tilings exist. "q-tiled" kernels (forward, dQ) own one query tile and walk
key tiles; "kv-tiled" (dK/dV) owns one key tile and walks query tiles of every
query head in its K/V head's group. Each array is blocked either to the owned
tile (read at offset 0) or to its whole axis (read at the walking offset).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import masking
from pallas_kernels.masking import MaskSpec
from pallas_kernels.triton import common

# Per-batch int32 scalars, packed into one [batch, 4] array.
_SCALARS = ("q_offset", "q_lengths", "kv_lengths", "dropout_seed")


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Static geometry of one kernel launch.

  Attributes:
    kv_tiled: True for dK/dV (grid over key blocks), False for forward / dQ.
    block_q, block_k: tile sizes.
    num_heads, group: query heads and query heads per K/V head.
    precision: of the kernel's dots (`common.dot_precision`).
  """

  kv_tiled: bool
  block_q: int
  block_k: int
  num_heads: int
  group: int
  precision: Any = None


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one optional input is blocked (static, hashable).

  `per_batch` / `per_head`: the array has a full batch / head axis rather than
  a broadcast one of size 1. `q_axis` / `kv_axis`: it has a full query / key
  axis.
  """

  name: str
  per_batch: bool = False
  per_head: bool = False
  q_axis: bool = False
  kv_axis: bool = False


class Launch(NamedTuple):
  """What every kernel launch derives from its inputs and tile sizes."""

  dims: common.KernelDims
  tiling: Tiling
  arrays: list       # the optional inputs ...
  block_specs: list  # ... their BlockSpecs ...
  layouts: tuple     # ... and their static layouts, in one order


def setup_launch(query, key, spec: MaskSpec, call_operands, bias, *,
                 kv_tiled: bool, block_q: int, block_k: int,
                 interpret: bool) -> Launch:
  """Tile sizes clamped to the sequences, and the optional inputs' blocks.

  query: [batch, q_len, num_heads, head_dim]; key: [batch, kv_len,
  num_kv_heads, head_dim].
  """
  batch, q_len, num_heads, head_dim = query.shape
  tiling = Tiling(kv_tiled=kv_tiled,
                  block_q=common.clamp_block(block_q, q_len),
                  block_k=common.clamp_block(block_k, spec.kv_len),
                  num_heads=num_heads, group=num_heads // key.shape[2],
                  precision=common.dot_precision(query.dtype, interpret))
  arrays, specs, layouts = prepare(spec, call_operands, tiling, batch=batch,
                                   bias=bias)
  return Launch(common.KernelDims.for_head_dim(head_dim), tiling, arrays,
                specs, layouts)


def _broadcast_flags(x, spec: MaskSpec):
  b, h, q, k = x.shape
  return dict(per_batch=b > 1, per_head=h > 1, q_axis=q == spec.q_len and q > 1,
              kv_axis=k == spec.kv_len and k > 1)


def prepare(spec: MaskSpec, operands, tiling: Tiling, *, batch: int,
            bias=None):
  """Arrays, BlockSpecs and static layouts of the optional inputs.

  Args:
    operands: `validation.Operands` of the call.
    bias: the bias array or None.

  Returns:
    (arrays, block_specs, layouts) for the kernel's optional inputs, in one
    order; the grid is (row block, batch, head) for q-tiled kernels and
    (row block, batch, K/V head) for kv-tiled ones.
  """
  bq, bk, g = tiling.block_q, tiling.block_k, tiling.group
  q_pad = pl.cdiv(spec.q_len, bq) * bq
  k_pad = pl.cdiv(spec.kv_len, bk) * bk
  entries = []  # (array, layout)

  # Block classification and the loop ranges derived from it.
  states = masking.classify_blocks(
      spec, bq, bk, q_offset=operands.q_offset, q_lengths=operands.q_lengths,
      kv_lengths=operands.kv_lengths, q_segments=operands.q_segments,
      kv_segments=operands.kv_segments, fine_map=_fine_map(spec, operands),
      dense_mask=operands.dense_mask)
  if tiling.kv_tiled:
    states = jnp.swapaxes(states, 2, 3)
  nb, nh = states.shape[:2]
  ranges = masking.block_ranges(states)
  entries.append((ranges, Layout("ranges", nb > 1, nh > 1)))
  if spec.needs_block_map:
    entries.append((states, Layout("block_map", nb > 1, nh > 1)))

  present = [getattr(operands, n) is not None for n in _SCALARS]
  if any(present):
    columns = [jnp.zeros((batch,), jnp.int32) if v is None
               else jnp.broadcast_to(v, (batch,)).astype(jnp.int32)
               for v in (getattr(operands, n) for n in _SCALARS)]
    entries.append((jnp.stack(columns, 1), Layout("scalars", per_batch=True)))
  if spec.has_segments:
    entries.append((operands.q_segments,
                    Layout("q_segments", per_batch=True, q_axis=True)))
    entries.append((operands.kv_segments,
                    Layout("kv_segments", per_batch=True, kv_axis=True)))
  if spec.has_alibi:
    slopes = operands.alibi_slopes.reshape(batch, tiling.num_heads // g, g)
    entries.append((slopes, Layout("alibi", per_batch=True, per_head=True)))
  if spec.has_bias:
    entries.append((bias, Layout("bias", **_broadcast_flags(bias, spec))))
  if spec.has_dense_mask:
    mask = operands.dense_mask
    entries.append((mask, Layout("dense_mask", **_broadcast_flags(mask, spec))))

  arrays, specs, layouts = [], [], []
  for array, layout in entries:
    arrays.append(array)
    specs.append(_block_spec(array, layout, tiling, q_pad, k_pad))
    layouts.append(layout)
  return arrays, specs, tuple(layouts)


def _fine_map(spec: MaskSpec, operands):
  if spec.mask_fn is None:
    return None
  if operands.block_mask is not None:
    return operands.block_mask
  raise ValueError("mask_fn needs its BlockMask here; api builds one")


def _block_spec(array, layout: Layout, tiling: Tiling, q_pad: int,
                k_pad: int):
  """BlockSpec of one optional input for the tiling's grid."""
  kv_tiled = tiling.kv_tiled
  name = layout.name
  if name in ("ranges", "block_map"):
    # [B', H', rows, 4 | cols]: the owned row, the head (group) axis.
    last = array.shape[-1]
    if kv_tiled:
      heads = tiling.group if layout.per_head else None
      return pl.BlockSpec(
          (None, heads, None, last) if heads else (None, None, None, last),
          lambda r, b, h: (b if layout.per_batch else 0,
                           h if layout.per_head else 0, r, 0))
    return pl.BlockSpec((None, None, None, last),
                        lambda r, b, h: (b if layout.per_batch else 0,
                                         h if layout.per_head else 0, r, 0))
  if name == "scalars":
    return pl.BlockSpec((None, array.shape[1]), lambda r, b, h: (b, 0))
  if name == "q_segments":
    if kv_tiled:
      return pl.BlockSpec((None, q_pad), lambda r, b, h: (b, 0))
    return pl.BlockSpec((None, tiling.block_q), lambda r, b, h: (b, r))
  if name == "kv_segments":
    if kv_tiled:
      return pl.BlockSpec((None, tiling.block_k), lambda r, b, h: (b, r))
    return pl.BlockSpec((None, k_pad), lambda r, b, h: (b, 0))
  if name == "alibi":
    # [B, K/V heads, group]: scalars read at the query head's group slot.
    return pl.BlockSpec((None, None, tiling.group),
                        lambda r, b, h: (b, h if kv_tiled
                                         else h // tiling.group, 0))
  # bias / dense_mask: [B|1, N|1, Tq|1, Tk|1].
  q_block = (tiling.block_q if not kv_tiled else q_pad) if layout.q_axis else 1
  k_block = (tiling.block_k if kv_tiled else k_pad) if layout.kv_axis else 1
  heads = tiling.group if (kv_tiled and layout.per_head) else None

  def index(r, b, h):
    return (b if layout.per_batch else 0,
            h if layout.per_head else 0,
            r if (layout.q_axis and not kv_tiled) else 0,
            r if (layout.kv_axis and kv_tiled) else 0)
  return pl.BlockSpec((None, heads, q_block, k_block), index)


class TileReader:
  """Reads the optional inputs inside a kernel, for one tile at a time.

  Args:
    refs: the optional input refs, in `prepare`'s order.
    layouts: their static layouts.
    spec, tiling: the call's MaskSpec and this kernel's Tiling.
    batch, head: program ids of the batch and (query or K/V) head.
  """

  def __init__(self, refs, layouts, spec: MaskSpec, tiling: Tiling, batch,
               head):
    self.refs = {layout.name: ref for layout, ref in zip(layouts, refs)}
    self.layouts = {layout.name: layout for layout in layouts}
    self.spec = spec
    self.tiling = tiling
    self.batch = batch
    self.head = head

  def _scalar(self, name: str):
    if "scalars" not in self.refs:
      return None
    return self.refs["scalars"][_SCALARS.index(name)]

  def _head_slot(self, name: str, group_index):
    """Index along a blocked head axis: the group member in kv-tiled kernels."""
    if self.tiling.kv_tiled and self.layouts[name].per_head:
      return (group_index,)
    return ()

  def ranges(self, group_index=None):
    """(lo, unmasked_lo, unmasked_hi, hi) of the owned row block."""
    ref = self.refs["ranges"]
    slot = self._head_slot("ranges", group_index)
    return tuple(ref[(*slot, i)] for i in range(4))

  def block_state(self, column, group_index=None):
    """EMPTY / PARTIAL / FULL of one walked block (only with mask_fn)."""
    ref = self.refs["block_map"]
    return ref[(*self._head_slot("block_map", group_index), column)]

  def dropout_seed(self):
    return self._scalar("dropout_seed")

  def values(self, q_start, kv_start, group_index=None) -> masking.MaskValues:
    """MaskValues of the [block_q, block_k] tile at (q_start, kv_start)."""
    spec, t = self.spec, self.tiling
    kv_tiled = t.kv_tiled
    head = (self.head * t.group + group_index) if kv_tiled else self.head
    # Arrays blocked to the owned tile are read at 0, whole axes at start.
    q_base = q_start if kv_tiled else 0
    kv_base = 0 if kv_tiled else kv_start
    q_rows = pl.ds(q_base, t.block_q)
    kv_rows = pl.ds(kv_base, t.block_k)
    q_valid = q_start + jnp.arange(t.block_q) < spec.q_len
    kv_valid = kv_start + jnp.arange(t.block_k) < spec.kv_len

    values: dict[str, Any] = dict(batch=self.batch, head=head)
    if spec.has_q_offset:
      values["q_offset"] = self._scalar("q_offset")
    if spec.has_q_lengths:
      values["q_lengths"] = self._scalar("q_lengths")
    if spec.has_kv_lengths:
      values["kv_lengths"] = self._scalar("kv_lengths")
    if spec.has_segments:
      q_seg = plgpu.load(self.refs["q_segments"].at[q_rows], mask=q_valid,
                         other=0)
      kv_seg = plgpu.load(self.refs["kv_segments"].at[kv_rows],
                          mask=kv_valid, other=0)
      values["q_segments"] = q_seg[:, None]
      values["kv_segments"] = kv_seg[None, :]
    if spec.has_alibi:
      slot = group_index if kv_tiled else self.head % t.group
      values["alibi_slope"] = self.refs["alibi"][slot]
    for name in ("bias", "dense_mask"):
      if name in self.refs:
        values[name] = self._pairwise_tile(name, q_rows, kv_rows, q_valid,
                                           kv_valid, group_index)
    return masking.MaskValues(**values)

  def _pairwise_tile(self, name, q_rows, kv_rows, q_valid, kv_valid,
                     group_index):
    """A [block_q | 1, block_k | 1] tile of a broadcastable pairwise array."""
    layout = self.layouts[name]
    rows = q_rows if layout.q_axis else pl.ds(0, 1)
    cols = kv_rows if layout.kv_axis else pl.ds(0, 1)
    mask = ((q_valid if layout.q_axis else jnp.ones((1,), bool))[:, None]
            & (kv_valid if layout.kv_axis else jnp.ones((1,), bool))[None, :])
    index = (*self._head_slot(name, group_index), rows, cols)
    ref = self.refs[name]
    other = False if ref.dtype == jnp.bool_ else 0.0
    tile = plgpu.load(ref.at[index], mask=mask, other=other)
    return tile if ref.dtype == jnp.bool_ else tile.astype(jnp.float32)
