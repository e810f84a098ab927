"""What the Mosaic forward and backward kernels share.

Layout checks (`check_layout`, `check_tiles`, `check_shared_memory`), the
shared-memory tile layout (`swizzled`), the register split between consumer
and producer warpgroups (`register_split`), launch grids (`launch_grid`,
`tile_index`), persistent grids (`persistent_schedule`,
`persistent_num_ctas`), the masked kernels' plan rows of loop ranges
(`PlanRow`, `read_plan`) and ALiBi slopes (`SlopeRows`, `slope_reader`),
the per-tile helpers of both directions' softmax (`per_row`,
`per_column`, `tile_indices`, `causal_mask`, `variant_mask`) and dropout's
keep mask from row and column hashes (`dropout_kept`).
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_arrays
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from pallas_kernels import compat as versions
from pallas_kernels import masking

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The plans' head dims (`plan.FORWARD_PLAN`, `plan.BACKWARD_PLAN`), each
# measured. The 16-bit kernels compute any multiple of `HEAD_DIM_MULTIPLE`
# from the least to the greatest of them at its own width
# (`own_width_head_dim`), on the plan of the next of these
# (`plan.plan_head_dim`).
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# A head dim at its own width: a multiple of 16, since the contraction of
# S = Q Kᵀ over head_dim is whole swizzle tiles, and the narrowest swizzle
# wgmma takes, 32 bytes, is 16 16-bit elements (`swizzled`); P V's
# N = head_dim is then a multiple of wgmma's 8 and at most its 256. Below
# 64 a call is padded to 64 (the forward there is bound by the softmax's
# exponentials, not the matmuls: d=64 already needs three consumers to hide
# it); above 256 wgmma's N ends. TMA's 16-byte global strides ask only a
# multiple of 8.
HEAD_DIM_MULTIPLE = 16
LOG2E = math.log2(math.e)
THREADS_PER_WARPGROUP = 128
# Dynamic shared memory per CTA on sm90 (227 KiB), less a little for barriers.
SMEM_LIMIT_BYTES = 227 * 1024 - 1024
# The swizzles that TMA writes and wgmma reads, widest first (Mosaic GPU's
# wgmma takes no unswizzled operand).
SWIZZLES = (128, 64, 32)
# wgmma works on 64-row slabs (m64nNk16) and a 128-byte swizzle is 64 16-bit
# elements, so every tile dimension is a multiple of 64.
_TILE_MULTIPLE = 64
# Register reallocation (FlashAttention-3 §3.1, setmaxnreg) of a CTA with one
# producer warpgroup, (consumer, producer) registers a thread: 2 * 232 + 40 =
# 504 of a 512-per-thread-slot budget (64K registers / 128 threads). The
# producer only issues TMA; the consumers hold the accumulators. Four
# warpgroups launch at 128 a thread: 3 * 160 + 32 = 512 (at head_dim 64 a
# forward consumer holds O in 32 f32 registers, S in 64, P in 32).
_REGISTERS_BY_CONSUMERS = {2: (232, 40), 3: (160, 32)}
# Two consumers at 240 and the producer at setmaxnreg's least, 24
# (FlashAttention-3's split), 504 as well.
_LEAN_REGISTERS = (240, 24)
# The masked kernels' int32 plan row per (batch, tile), built by
# `masked.tile_plans`: [lo, unmasked_lo, unmasked_hi, hi] of consumer 0 and
# of consumer 1, the union [first, total) the producer streams, then
# q_offset, q_length, kv_length and, with dropout, its seed, then the tile
# the row is for (the forward and dQ kernels' grid takes the heaviest
# tiles first, `masked.tile_plans`); padded to 32 (128 bytes, one copy).
PLAN_WIDTH = 32
PLAN_UNION, PLAN_SCALARS = 8, 10
PLAN_DROPOUT_SEED = PLAN_SCALARS + 3
PLAN_TILE = PLAN_SCALARS + 4
# ALiBi slopes travel as rows of 32 floats (`slope_rows`).
SLOPE_ROW_WIDTH = 32


def register_split(*, lean: bool, num_consumers: int = 2) -> tuple[int, int]:
  """(consumer, producer) registers a thread after setmaxnreg, for
  `num_consumers` consumers and one producer warpgroup (`lean`: the
  producer at setmaxnreg's least, two consumers only)."""
  if lean:
    return _LEAN_REGISTERS
  return _REGISTERS_BY_CONSUMERS[num_consumers]


def swizzled(columns: int, dtype):
  """8-row tiles with the widest swizzle (128, 64 or 32 B) whose tile
  width divides a tile row of `columns` elements of `dtype`: the
  shared-memory layout that both TMA writes and wgmma reads without bank
  conflicts.

  A wgmma contracts over whole swizzle tiles, so their width must divide
  the row: a 16-bit row of head_dim 96 (192 B) takes 64-byte tiles (32
  elements), of 80 (160 B) 32-byte ones (16 elements); rows of a multiple
  of 128 B (the plans' head dims, tiles of 64 rows or more) take 128.
  """
  itemsize = jnp.dtype(dtype).itemsize
  row_bytes = columns * itemsize
  swizzle = next((s for s in SWIZZLES if row_bytes % s == 0), None)
  if swizzle is None:
    raise NotImplementedError(f"a shared-memory row of {row_bytes} bytes is "
                              f"no whole number of {SWIZZLES[-1]}-byte "
                              "swizzle tiles")
  return (plgpu.TilingTransform((8, swizzle // itemsize)),
          plgpu.SwizzleTransform(swizzle))


def own_width_head_dim(head_dim: int, dtype) -> bool:
  """Whether the kernels compute `head_dim` at its own width in `dtype`:
  in 16 bits a multiple of `HEAD_DIM_MULTIPLE` from 64 to 256; in FP8
  (whose transposed V and P tiles take other swizzles, not lowered at
  other widths) the plans' dims only."""
  if jnp.dtype(dtype).itemsize != 2:
    return head_dim in SUPPORTED_HEAD_DIMS
  return (SUPPORTED_HEAD_DIMS[0] <= head_dim <= SUPPORTED_HEAD_DIMS[-1]
          and head_dim % HEAD_DIM_MULTIPLE == 0)


# TMA reads a [rows, head_dim] tile through 8-row tiling, which this JAX
# applies to the whole sequence axis: the kernels take lengths that are
# multiples of it (the masked ones pad others, `masked.pad_rows`).
TMA_ROW_TILE = 8


def ragged_lengths(q_len: int, kv_len: int) -> bool:
  """Whether the plain kernels take lengths their tiles need not divide:
  whole TMA row tiles. Rows of a tile past either end load as zeros and
  stores past q_len are dropped, which is nearly all a ragged tail needs:
  a padded query row computes on zeros and is never written, and in the
  backward its zero dO and delta (its statistics load as zeros) give it
  zero dS and P dO, so nothing in dK and dV; a padded key has zero K and
  V, so it adds nothing to dQ or to a real row's dP, and its own dK and dV
  rows are dropped. Only the forward's softmax would count a padded key:
  `masks_key_tail`. (The plain backward was refused these lengths for a
  while after wrong dK on the H100 whose cause was the forward's LSE,
  benchmarks/NOTES.md, "Ragged lengths on the plain kernels".)"""
  return q_len % TMA_ROW_TILE == 0 and kv_len % TMA_ROW_TILE == 0


def masks_key_tail(q_len: int, kv_len: int, block_kv: int,
                   is_causal: bool) -> bool:
  """Whether the plain forward masks the keys past kv_len in its last K/V
  block (`ragged_lengths`): where that block is partial and a real query
  may see past kv_len. Not under top-left causal masking with q_len <=
  kv_len: query i sees keys up to i < q_len."""
  return bool(kv_len % block_kv) and not (is_causal and q_len <= kv_len)


def check_layout(query, key, value) -> tuple[int, int]:
  """(kv_len, num_kv_heads) of [batch, len, heads, dim] q, k, v that share
  batch, head dim and dtype, with heads a multiple of K/V heads; else a
  ValueError/TypeError naming the shapes."""
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError("query, key and value must be [batch, len, heads, dim]; "
                     f"got {query.shape}, {key.shape}, {value.shape}")
  batch, _, num_heads, head_dim = query.shape
  kv_shape = (batch, key.shape[1], key.shape[2], head_dim)
  if key.shape != kv_shape or value.shape != kv_shape:
    raise ValueError(f"key and value must both be {kv_shape} for query "
                     f"{query.shape}; got {key.shape}, {value.shape}")
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads {num_heads} is not a multiple of "
                     f"num_kv_heads {num_kv_heads}")
  if query.dtype != key.dtype or query.dtype != value.dtype:
    raise TypeError("query, key and value must share a dtype; got "
                    f"{query.dtype}, {key.dtype}, {value.dtype}")
  return kv_len, num_kv_heads


def check_tiles(block_q: int, block_kv: int, max_concurrent_steps: int):
  """Tile sizes whole in wgmma's 64 rows and a pipeline at least 1 deep."""
  if max_concurrent_steps < 1:
    raise ValueError(
        f"max_concurrent_steps must be >= 1, got {max_concurrent_steps}")
  if block_q % _TILE_MULTIPLE or block_kv % _TILE_MULTIPLE:
    raise NotImplementedError(f"block_q {block_q} and block_kv {block_kv} "
                              f"must be multiples of {_TILE_MULTIPLE}")


def check_shared_memory(needed: int, limit: int, tiles: str) -> None:
  """NotImplementedError (a dispatcher falls back) where `tiles` need more
  shared memory than `limit` bytes."""
  if needed > limit:
    raise NotImplementedError(f"{tiles} need {needed} bytes of shared "
                              f"memory; sm90 has {limit}")


def launch_grid(grid, names, *, tile_fastest: bool):
  """(grid, names) for `plgpu.kernel` from a launch grid written tile axis
  first. Pallas hands CUDA the grid reversed, so the first axis launches
  slowest; `tile_fastest` reverses it, so that it launches fastest: the
  CTAs at work at once are a head's tiles, streaming the same tiles of the
  other operands through L2."""
  if tile_fastest:
    return tuple(grid)[::-1], tuple(names)[::-1]
  return grid, names


def tile_index(axis_name: str, num_tiles: int, *, reverse: bool):
  """The tile a CTA computes: its grid index, or, reversed, the last first.

  Under causal masking query tile i reads i + 1 K/V blocks, so in order the
  heaviest tiles launch last and the GPU ends on a tail of long CTAs;
  heaviest first (longest-processing-time-first scheduling) ends it on
  short ones: 543 against 470 TFLOP/s at d=128 and 620 against 475 at
  d=256 (the forward at 16k, h200_mosaic_order.md).
  """
  index = lax.axis_index(axis_name)
  return num_tiles - 1 - index if reverse else index


class PersistentSchedule(NamedTuple):
  """A persistent CTA's share of a (batch, head, tile) space."""
  count: Any    # tiles this CTA computes
  tile_of: Any  # n -> (batch, head, tile) of its n-th tile


def persistent_schedule(*, num_tiles: int, num_heads: int, batch: int,
                        paired: bool, num_ctas: int, cta
                        ) -> PersistentSchedule:
  """Which tiles CTA `cta` of `num_ctas` computes, and in which order.

  Tiles of equal cost (`paired` False): CTA c takes tiles c, c + num_ctas,
  ... in tile-fastest order, so that CTAs at work at once share a head's
  streamed tiles in L2. Tiles whose cost falls or rises linearly with their
  index (causal masking: query tile i reads i + 1 K/V blocks, K/V tile j
  n - j Q blocks), where a round-robin of single tiles would load CTAs
  unevenly: each head's tiles are paired first with last, (n-1, 0),
  (n-2, 1), ..., every pair costing the same, and CTAs take pairs
  round-robin (num_ctas at most the number of pairs). With an odd
  `num_tiles` each head's middle tile, half a pair's cost, pairs with the
  next head's middle tile, those pairs after all the others, so that
  every pair still costs the same. (Pairing a head's last position with
  the next head's first instead made one pair in 16.5 cost 1.5 pairs at
  33 tiles, and with 132 CTAs, 4 x 33, those pairs all fell to 4 CTAs:
  the forward at 4,224 tokens ran 438 TFLOP/s against 556 at 4,096.) The
  last pair of an odd total has one tile.
  """
  heads = batch * num_heads
  total = heads * num_tiles
  if paired:
    num_pairs = pl.cdiv(total, 2)
    # Every CTA has a pair; the last pair of an odd total has one tile.
    num_local_pairs = lax.div(num_pairs - 1 - cta, num_ctas) + 1
    last_pair = cta + (num_local_pairs - 1) * num_ctas
    count = 2 * num_local_pairs - jnp.where(2 * last_pair + 1 >= total, 1, 0)
  else:
    count = lax.div(total - 1 - cta, num_ctas) + 1  # every CTA has a tile

  def tile_of(n):
    if not paired:
      linear = cta + n * num_ctas
      batch_head, tile = lax.div(linear, num_tiles), lax.rem(linear, num_tiles)
    else:
      pair, second = cta + lax.div(n, 2) * num_ctas, lax.rem(n, 2)
      per_head = num_tiles // 2         # a head's first-with-last pairs
      within = heads * per_head         # those of all heads, first
      own = jnp.minimum(pair, within - 1) if per_head else 0
      j = lax.rem(own, max(per_head, 1))
      middle = pair - within            # the middle tiles' pairs, after
      batch_head = jnp.where(pair < within, lax.div(own, max(per_head, 1)),
                             2 * middle + second)
      tile = jnp.where(pair < within,
                       jnp.where(second == 0, num_tiles - 1 - j, j),
                       per_head)
    return lax.div(batch_head, num_heads), lax.rem(batch_head, num_heads), tile

  return PersistentSchedule(count, tile_of)


def persistent_num_ctas(num_ctas: int | None, *, num_tiles: int,
                        paired: bool) -> int:
  """CTAs of a persistent grid over `num_tiles` tiles: `num_ctas` (None:
  one per SM), at most one per tile (per pair, when `paired`)."""
  if num_ctas is None:
    num_ctas = versions.num_sms()
  if num_ctas < 1:
    raise ValueError(f"num_ctas must be >= 1, got {num_ctas}")
  return min(num_ctas, pl.cdiv(num_tiles, 2) if paired else num_tiles)


class PlanRow(NamedTuple):
  """A masked kernel's plan row of one tile (see `masked.tile_plans`)."""
  gmem: Any       # int32 [PLAN_WIDTH] of this (batch, tile)
  smem: Any       # int32 [consumers + 1, PLAN_WIDTH]: one slot per warpgroup
  arrived: Any    # barriers [consumers + 1]


def read_plan(plan: PlanRow, slot):
  """Copies the tile's plan row into `slot`; returns a scalar reader."""
  row = plan.smem.at[slot]
  plgpu.copy_gmem_to_smem(plan.gmem, row, plan.arrived.at[slot])
  plgpu.barrier_wait(plan.arrived.at[slot])
  return lambda i: row[i]


def per_row(x, shape):
  """Broadcasts a per-row vector [rows] over the columns of `shape`."""
  return lax.broadcast_in_dim(x, shape, [0])


def per_column(x, shape):
  """Broadcasts a per-column vector [cols] over the rows of `shape`."""
  return lax.broadcast_in_dim(x, shape, [1])


def tile_indices(q_start, step, static):
  """(q_idx, kv_idx) [block_q, block_kv] of the tile of queries from
  q_start and keys from step * block_kv."""
  shape = (static.block_q, static.block_kv)
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  return rows + q_start, cols + step * static.block_kv


def variant_mask(q_start, step, static, values):
  """`masking.keep` on the [block_q, block_kv] tile of `tile_indices`."""
  return masking.keep(static.spec, *tile_indices(q_start, step, static),
                      values)


def dropout_query_hashes(seed, batch, head, q_start, rows: int, layout):
  """uint32 [rows] in `layout`: `masking.dropout_query_hash` of queries
  q_start + i in the stream of (seed, batch, head)."""
  q_idx = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=layout)
  return masking.dropout_query_hash(
      masking.dropout_stream(seed, batch, head), q_idx, q_start)


def dropout_key_hashes(kv_start, cols: int, layout):
  """uint32 [cols] in `layout`: `masking.dropout_key_hash` of keys
  kv_start + j."""
  kv_idx = plgpu.broadcasted_iota(jnp.int32, (cols,), 0, layout=layout)
  return masking.dropout_key_hash(kv_idx, kv_start)


def alibi_columns(spec) -> bool:
  """Whether ALiBi may enter a tile as a term per key and one per query:
  under causal masking every kept key sits at or before its query's
  position, so -slope * |q_pos - kv| = slope * (kv - q0 - q_offset) -
  slope * (q_idx - q0) for any row q0 (`alibi_column_terms`,
  `alibi_row_terms`). The query's term shifts its row's softmax by a
  constant: the forward leaves it out of P and takes it off the LSE at
  the end, the backward adds it to the row's LSE once. Only where nothing
  after it bends the logits (no score_fn, no soft cap)."""
  return (spec is not None and spec.has_alibi and spec.is_causal
          and spec.scores_shift_only)


def alibi_column_terms(slope, kv_start, q_start, q_offset, cols: int,
                       layout=plgpu.Layout.WGMMA.reduce(0)):
  """float32 [cols] in `layout` (an S tile's columns; an Sᵀ tile's rows
  take `Layout.WGMMA.reduce(1)`): slope * (kv - q_start - q_offset) of
  keys kv_start + j, for the queries from q_start."""
  kv_idx = plgpu.broadcasted_iota(jnp.int32, (cols,), 0, layout=layout)
  return slope * (kv_idx + (kv_start - q_start - q_offset)).astype(
      jnp.float32)


def alibi_row_terms(slope, rows: int, layout=plgpu.Layout.WGMMA.reduce(1)):
  """float32 [rows] in `layout` (an S tile's rows; an Sᵀ tile's columns
  take `Layout.WGMMA.reduce(0)`): slope * (q_idx - q_start) of queries
  q_start + i, what `alibi_column_terms` leave in each query's LSE."""
  q_idx = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=layout)
  return slope * q_idx.astype(jnp.float32)


def alibi_terms(slope, *, q_start, kv_start, q_offset, block_q: int,
                block_kv: int, transposed: bool = False):
  """(query terms [block_q], key terms [block_kv]) of `alibi_columns` for
  the tile of queries from q_start and keys from kv_start, along an S
  tile's rows and columns (`transposed`: an Sᵀ tile's columns and rows)."""
  rows, columns = (plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0))
  q_layout, kv_layout = (columns, rows) if transposed else (rows, columns)
  return (alibi_row_terms(slope, block_q, layout=q_layout),
          alibi_column_terms(slope, kv_start, q_start, q_offset, block_kv,
                             layout=kv_layout))


def dropout_kept(query_hashes, key_hashes, shape, rate: float, *,
                 transposed: bool = False):
  """bool `shape` in the WGMMA layout: `masking.dropout_keep` of every
  pair, queries down the rows and keys across the columns (transposed: the
  other way, an Sᵀ tile), from the words of the tile's queries and keys
  (`dropout_query_hashes`, `dropout_key_hashes`: [rows] in the WGMMA row
  layout, [cols] in its column layout). The bits of `masking.dropout_keep`,
  which the Triton kernels and the reference use.

  Each thread hashes each of its quads once (`quad_dropout_in_threads`);
  the tile's first query and first key must sit at multiples of 16, so
  that a thread's rows r, r + 8 and columns c, c + 8 are quads'."""
  row_layout, col_layout = (plgpu.Layout.WGMMA.reduce(1),
                            plgpu.Layout.WGMMA.reduce(0))
  return plgpu.inline_mgpu(
      arg_types=((col_layout, row_layout) if transposed
                 else (row_layout, col_layout)),
      return_type=plgpu.ShapeDtypeStruct(shape, jnp.bool_,
                                         plgpu.Layout.WGMMA),
  )(functools.partial(quad_dropout_in_threads, shape=tuple(shape),
                      threshold=masking.dropout_threshold(rate),
                      transposed=transposed))(query_hashes, key_hashes)


# A WGMMA register's index: [64-row block, 8-column block, 1, 1, row half
# (rows r and r + 8), 1, 1, 1, 1]; its two elements are columns 2t, 2t + 1.
_COLUMN_BLOCK, _ROW_HALF = 1, 4


def quad_registers(registers_shape, *, transposed: bool):
  """[(first, [(member, shift)] * 4)]: for each quad of a thread's WGMMA
  registers (`masking.dropout_keep`), the register of its first row and
  column, and each member's register with the left shift that brings its
  byte of the quad's hash to the top (`masking.dropout_byte_shift`; the
  tile's queries down the rows, or, `transposed`, across the columns)."""
  if (len(registers_shape) != 9 or registers_shape[_ROW_HALF] != 2
      or registers_shape[_COLUMN_BLOCK] % 2):
    raise NotImplementedError(f"quads of WGMMA registers {registers_shape}")
  quads = []
  for first in np.ndindex(registers_shape):
    if first[_COLUMN_BLOCK] % 2 or first[_ROW_HALF]:
      continue
    members = []
    for row_bit in (0, 1):
      for column_bit in (0, 1):
        member = list(first)
        member[_ROW_HALF] += row_bit
        member[_COLUMN_BLOCK] += column_bit
        q_bit, kv_bit = ((column_bit, row_bit) if transposed
                         else (row_bit, column_bit))
        members.append((tuple(member), 16 * q_bit + 8 * kv_bit))
    quads.append((first, members))
  return quads


def quad_dropout_in_threads(_, query_hashes, key_hashes, *, shape,
                            threshold: int, transposed: bool):
  """`dropout_kept` on Mosaic GPU fragments: for each quad of a thread's
  registers (`quad_registers`), one `masking.dropout_quad_hash` of the
  words of its first row and column, and each weight's byte of it against
  `threshold`. The words of the quads' second rows and columns go unused
  (the compiler drops their computation). Interpreted on a CPU as
  `quad_dropout_value` (tests/mosaic_interpret.py knows this function)."""
  layout = mgpu_arrays.WGMMA_LAYOUT
  q_dims, kv_dims = ((1,), (0,)) if transposed else ((0,), (1,))
  queries = query_hashes.broadcast_in_dim(shape, q_dims, layout)
  keys = key_hashes.broadcast_in_dim(shape, kv_dims, layout)
  vector_type = queries.registers.flat[0].type
  i32 = ir.IntegerType.get_signless(32)

  def const(value: int):  # a uint32 as the i32 of its bits, splat
    value = value - 2**32 if value >= 2**31 else value
    return vector.broadcast(vector_type, arith.constant(i32, value))

  def xor_shift(x, bits: int):
    return arith.xori(x, arith.shrui(x, const(bits)))

  def quad_hash(x):  # `masking.dropout_quad_hash` of the words' xor
    x = arith.muli(x, const(masking.DROPOUT_MIX_1))
    x = arith.muli(xor_shift(x, 13), const(masking.DROPOUT_MIX_2))
    return xor_shift(x, 16)

  kept = np.empty(queries.registers.shape, dtype=object)
  for first, members in quad_registers(kept.shape, transposed=transposed):
    quad = quad_hash(arith.xori(queries.registers[first],
                                keys.registers[first]))
    for member, shift in members:
      byte = arith.shli(quad, const(shift)) if shift else quad
      kept[member] = arith.cmpi(arith.CmpIPredicate.uge, byte,
                                const(threshold))
  return mgpu_arrays.FragmentedArray(_registers=kept, _layout=layout,
                                     _is_signed=False)


def quad_dropout_value(query_hashes, key_hashes, *, shape, threshold: int,
                       transposed: bool):
  """What `quad_dropout_in_threads` computes, as jnp: the tile's kept
  weights, from the words at each quad's first row and column."""
  rows, cols = (jnp.arange(n, dtype=jnp.uint32) for n in shape)
  row_words, col_words = ((key_hashes, query_hashes) if transposed
                          else (query_hashes, key_hashes))
  quad = masking.dropout_quad_hash(
      row_words[masking.quad_first(rows)][:, None],
      col_words[masking.quad_first(cols)][None, :])
  q_idx, kv_idx = ((cols[None, :], rows[:, None]) if transposed
                   else (rows[:, None], cols[None, :]))
  shift = masking.dropout_byte_shift(q_idx, kv_idx)
  return lax.shift_left(quad, shift) >= jnp.uint32(threshold)


class SlopeRows(NamedTuple):
  """A masked kernel's ALiBi slopes (`spec.has_alibi`), read once by each
  consumer (see `slope_rows`)."""
  gmem: Any       # float32 [rows, SLOPE_ROW_WIDTH]: this batch's, by head
  smem: Any       # float32 [consumers, rows, SLOPE_ROW_WIDTH]
  arrived: Any    # barriers [consumers]


def check_slope_shape(alibi_slopes, q_shape) -> None:
  """ValueError unless `alibi_slopes` is [batch, num_heads] of query's
  [batch, q_len, num_heads, head_dim] (`validation` broadcasts [num_heads]
  ones)."""
  batch, _, num_heads, _ = q_shape
  if alibi_slopes is None or alibi_slopes.shape != (batch, num_heads):
    raise ValueError(
        f"alibi_slopes must be [batch, num_heads] = ({batch}, {num_heads}) "
        f"for query {q_shape}; got "
        f"{None if alibi_slopes is None else alibi_slopes.shape}")


def slope_rows(alibi_slopes):
  """float32 [batch, ceil(heads / 32), 32] of slopes [batch, heads]: head h
  at [h // 32, h % 32]. Each batch's rows are one TMA copy of whole
  128-byte rows (a 1-D copy would need 16-byte multiples and at most 256
  heads)."""
  batch, num_heads = alibi_slopes.shape
  rows = -(-num_heads // SLOPE_ROW_WIDTH)
  padded = jnp.pad(alibi_slopes.astype(jnp.float32),
                   ((0, 0), (0, rows * SLOPE_ROW_WIDTH - num_heads)))
  return padded.reshape(batch, rows, SLOPE_ROW_WIDTH)


def slope_rows_bytes(num_heads: int) -> int:
  """Shared memory of one consumer's copy of `slope_rows`."""
  return -(-num_heads // SLOPE_ROW_WIDTH) * SLOPE_ROW_WIDTH * 4


def copy_slopes(slopes: SlopeRows, slot):
  """Starts copying the batch's slopes into `slot` (`slope_reader` waits)."""
  plgpu.copy_gmem_to_smem(slopes.gmem, slopes.smem.at[slot],
                          slopes.arrived.at[slot])


def slope_reader(slopes: SlopeRows, slot):
  """Waits for `copy_slopes` into `slot` (once); returns head -> its slope."""
  plgpu.barrier_wait(slopes.arrived.at[slot])
  own = slopes.smem.at[slot]
  return lambda head: own[head // SLOPE_ROW_WIDTH, head % SLOPE_ROW_WIDTH]


class ScoreTiles(NamedTuple):
  """A masked kernel's array over the scores (the bias, 16-bit; the dense
  mask, int8; the dK/dV kernel's is the mask's transpose) of one batch,
  each consumer's tiles copied into a buffer of its own
  (`chained_tiles`)."""
  gmem: Any          # [heads | 1, own len, streamed len] of this batch
  smem: Any          # [consumers, own rows, streamed rows]
  arrived: Any       # barriers [consumers]
  # (own, streamed): whether the array is the same along that axis and
  # holds one tile's extent of it (`repeat_broadcast_axes`), read from 0.
  repeats: tuple[bool, bool] = (False, False)

  @classmethod
  def of(cls, ref, scratch, batch,
         repeats: tuple[bool, bool] = (False, False)) -> "ScoreTiles":
    """Of `ref` [batch | 1, heads | 1, own len, streamed len] (batch
    broadcast where it has one) and the first two `scratch` refs."""
    return cls(ref.at[batch if ref.shape[0] > 1 else 0], *scratch[:2],
               repeats=repeats)

  def source(self, head, rows, start, count):
    """The GMEM tile of query head `head` (broadcast where the array has
    one head), own `rows` and streamed [start, start + count); along an
    axis the array repeats, its first rows or columns."""
    own, streamed = self.repeats
    return self.gmem.at[head if self.gmem.shape[0] > 1 else 0,
                        pl.ds(0, rows.size) if own else rows,
                        pl.ds(0 if streamed else start, count)]


def repeat_broadcast_axes(x, extent: int):
  """[B, N, R | q, C | kv] and (repeats q, repeats kv): `x` [B, N, q | 1,
  kv | 1] with each sequence axis of one element broadcast to `extent`
  rows or columns, at least a tile of the kernel reading it, which then
  reads its first rows or columns wherever its tile lies
  (`ScoreTiles.repeats`): a per-key or per-query bias costs a tile's
  extent, not q_len x kv_len."""
  repeats = (x.shape[2] == 1, x.shape[3] == 1)
  shape = (*x.shape[:2], *(extent if r else n
                           for r, n in zip(repeats, x.shape[2:])))
  return jnp.broadcast_to(x, shape), repeats


def chained_tiles(smem, arrived, source, *, first, next_of, end):
  """`read(position)`: a consumer's tiles of an array over the scores (a
  bias, a dense mask), one shared-memory buffer (`smem`, its barrier
  `arrived`) for positions `first`, `next_of(first)`, ... before `end`,
  read in that order; `source(position)` is the tile's GMEM view.

  The first copy is issued here, each later one as soon as every thread
  has read the one before (a fence and a warpgroup barrier: TMA writes
  through the async proxy), so that it lands under the rest of the step;
  TMA fills past the array's ends with zeros (those keys are masked, those
  rows dropped). Returns the tile in the WGMMA layout, in its dtype."""
  def copy(position):
    plgpu.copy_gmem_to_smem(source(position), smem, arrived)

  pl.when(first < end)(functools.partial(copy, first))

  def read(position):
    plgpu.barrier_wait(arrived)
    tile = plgpu.layout_cast(smem[...], plgpu.Layout.WGMMA)
    plgpu.commit_smem()  # every thread's reads, before TMA overwrites
    following = next_of(position)
    pl.when(following < end)(functools.partial(copy, following))
    return tile
  return read


def masked_steps(lo, unmasked_lo, unmasked_hi, hi):
  """(first, next_of, end) of `chained_tiles` over a plan range's masked
  steps: [lo, hi) less its unmasked run [unmasked_lo, unmasked_hi)."""
  first = jnp.where(lo < unmasked_lo, lo, unmasked_hi)
  next_of = lambda step: jnp.where(step + 1 == unmasked_lo, unmasked_hi,
                                   step + 1)
  return first, next_of, hi


def causal_mask(q_start, step, static):
  """[block_q, block_kv]: True where query q_start + r may attend key
  step * block_kv + c."""
  shape = (static.block_q, static.block_kv)
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  return rows + q_start >= cols + step * static.block_kv


# FP8 P as wgmma's register operand (the FP8 forward's P V). In the
# accumulator's layout (WGMMA) a thread holds, of each 16 columns of its two rows, the pairs 2t, 2t + 1 and 8 + 2t,
# 9 + 2t (t = lane % 4, two 8x8 core matrices); the 8-bit operand layout
# (WGMMA_8BIT) gives it 4t .. 4t + 3 of one 8x16 core matrix, rows alike.
# Regrouping the registers as they are (the two pairs, one vector of four)
# is a fixed permutation of P's columns within each 16; V's keys arrive in
# the same order, so that P V is unchanged: new key 4t + 2a + b of a
# 16-key block is old key 8a + 2t + b.
FP8_KEY_GROUP = 16


def fp8_operand(p):
  """P [rows, block_kv], float8_e4m3fn in the WGMMA layout, as the 8-bit
  register operand of P V (WGMMA_8BIT), its columns permuted within each
  16 as `interleave_fp8_keys` permutes V's keys. No data moves between
  threads: each thread's two 2-element vectors of a 16-column block
  become one of 4."""
  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(p.shape, p.dtype,
                                         layout=plgpu.Layout.WGMMA_8BIT))
  def regroup(_, p):
    sources = fp8_operand_sources(p.shape)
    grouped = np.empty(sources.shape, dtype=object)
    for index, pair in np.ndenumerate(sources):
      grouped[index] = mgpu_utils.vector_concat(
          [p.registers[source] for source in pair])
    return mgpu_arrays.FragmentedArray(
        _registers=grouped, _layout=mgpu_arrays.WGMMA_LAYOUT_8BIT,
        _is_signed=None)
  return regroup(p)


def fp8_operand_sources(shape) -> np.ndarray:
  """For each register of a WGMMA_8BIT array of `shape`, the two
  registers of the WGMMA array whose 2-vectors `fp8_operand` joins into
  its 4-vector: those of its row half at column blocks 2j and 2j + 1
  (index 1 counts 8-column blocks in WGMMA, 16-column ones in
  WGMMA_8BIT)."""
  registers = mgpu_arrays.WGMMA_LAYOUT_8BIT.registers_shape(shape)
  sources = np.empty(registers, dtype=object)
  for index in np.ndindex(registers):
    sources[index] = tuple((index[0], 2 * index[1] + half, *index[2:])
                           for half in (0, 1))
  return sources


def interleave_fp8_keys(value_t):
  """V transposed, [batch, heads, head_dim, kv_len] (kv_len a multiple of
  16), its keys reordered within each 16 as `fp8_operand` reorders P's
  columns: new 4t + 2a + b is old 8a + 2t + b."""
  *lead, kv_len = value_t.shape
  groups = value_t.reshape(*lead, kv_len // FP8_KEY_GROUP, 2, 4, 2)
  return jnp.swapaxes(groups, -3, -2).reshape(value_t.shape)
