"""FlashDecoding: a few query rows against a long dense or paged KV cache.

Decoding reads the whole cache to produce a handful of rows, so it is bound by
HBM bandwidth, not by matrix throughput: the kernel's job is to read each
cache byte once, with every SM busy.

- GQA packing: one program owns every query head of one K/V head (and, for
  q_len > 1, a block of query positions): its tile has `q_len * group` rows,
  ordered (position, head), so each K/V tile it loads serves all of them.
- Split-K (FlashDecoding): the cache positions a row block attends to are
  divided into `num_splits` spans, one program each; a span's normalised
  partial output and its log-sum-exp go to float32 buffers, merged by LSE
  afterwards (`merge_partials`). The number of splits fills the GPU from
  batch x K/V heads x row blocks (`DecodeTiling.for_call`).
- Pages: token t of sequence b is row `table[b, t // page_size] * page_size
  + t % page_size` of the cache viewed as [rows, kv_heads, head_dim]; a
  dense cache is the same with row `b * max_len + t`. One gather-load serves
  both, so pages of any size cost no more than the dense layout.
- Garbage: rows at or past a sequence's length are read as 0 (masked loads)
  and their logits are -inf, so NaN or Inf there never reaches the result;
  table entries past the length are clamped before use, never dereferenced
  out of bounds.

The masks (causal at a per-sequence offset, window, length) and score
changes (soft cap, ALiBi) are `pallas_kernels.masking`'s, the same functions
the training kernels and the reference call.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat, masking
from pallas_kernels.config import MIN_BLOCK, next_power_of_two
from pallas_kernels.masking import MaskSpec
from pallas_kernels.triton import common


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
  """Static schedule of one decode launch.

  Attributes:
    block_r: query rows (positions x heads of a K/V group) per program.
    block_k: cache positions per loop step.
    num_splits: spans the cache is divided into (FlashDecoding's split-K).
    num_warps, num_stages: Triton launch settings.
  """

  block_r: int
  block_k: int
  num_splits: int
  num_warps: int = 4
  num_stages: int = 3

  @classmethod
  def for_call(cls, *, batch: int, num_kv_heads: int, rows: int,
               head_dim: int, capacity: int, num_sms: int,
               paged: bool = False, itemsize: int = 2) -> "DecodeTiling":
    """The default schedule: every SM busy, each split a few tiles long.

    Args:
      rows: query rows per K/V head (q_len x group).
      head_dim: of the cache (its tiles are padded to a power of two).
      capacity: cache positions per sequence (the upper bound of a length).
      num_sms: streaming multiprocessors of the GPU.
      paged: the cache is paged (its rows gathered through a table).
      itemsize: bytes per cache element.
    """
    dp = common.KernelDims.for_head_dim(head_dim).head_dim_padded
    block_r = min(_MAX_BLOCK_R, max(MIN_BLOCK, next_power_of_two(rows)))
    block_k = common.clamp_block(min(_BLOCK_K, _TILE_ELEMENTS // dp),
                                 capacity)
    programs = batch * num_kv_heads * pl.cdiv(rows, block_r)
    tiles = pl.cdiv(capacity, block_k)
    # Every SM busy, in one wave: more programs than SMs would leave a
    # partial second wave (one program per SM fits in shared memory).
    splits = num_sms // programs
    if batch > 1:
      # Lengths may differ between sequences, and a sequence's spans are
      # as long as it is: more, shorter spans balance the SMs' work.
      splits = max(splits, min((_WAVES * num_sms) // programs,
                               tiles // _MIN_TILES_PER_SPLIT))
    elif paged:
      # A page's rows wait on a table read: two waves hide it better.
      splits = max(splits, (_PAGED_WAVES * num_sms) // programs)
    splits = max(1, min(splits, tiles // _MIN_TILES_PER_SHORT_SPLIT))
    # Triton buffers num_stages - 1 steps of K and V ahead.
    per_step = 2 * block_k * dp * itemsize
    resident = block_r * dp * itemsize
    stages = 1 + max(1, (common.SHARED_MEMORY_BYTES - resident) // per_step)
    return cls(block_r, block_k, splits, num_stages=min(_NUM_STAGES, stages))


# Defaults (see `DecodeTiling.for_call`), measured on the H200 (bf16,
# 32:8 heads, d=128, q_len 1; `python -m benchmarks.tune_decode`,
# results/h200_decode_splits.md and h200_decode_tiles.md). Query rows per
# program at most 64 (a 64 x 128 float32 accumulator in 4 warps); 128 cache
# positions a step (64 at d=256), three stages deep: Triton buffers two K
# and V tiles ahead, 128 KiB of shared memory, so one program per SM.
# Splits:
# - one wave when the batch is one sequence: 16 splits at 1 x 128k read
#   4.0 TB/s, 32 (two waves) 3.85, 66 3.6; 17 would start a second wave
#   for 4 programs;
# - one sequence in pages: two waves (33 splits at 1 x 128k: 3.81-3.84
#   TB/s in pages of 16-256, cuDNN's paged attention 3.54-3.63; in one
#   wave, 16 splits, 3.27-3.35: each tile's rows wait on a table read, and
#   more programs in flight hide it; results/h200_decode_two_wave_splits.md
#   against h200_decode.md, which ran the one-wave rule there);
# - with several sequences, up to four waves of spans at least 32 tiles
#   long: with ragged lengths (16 x 16k, lengths uniform in [2k, 16k]) 4
#   splits read 3.77 TB/s against 3.50 with 2 and 3.29 with one; with full
#   lengths it costs little (8 x 32k: 4.12 TB/s with 8 splits, 4.17-4.19
#   with 2-4; 64 x 4k stays at one split, 4.08).
# Splitting the capacity into equal spans instead of each sequence's length
# (empty spans past a length) was no faster anywhere (same tables).
_MAX_BLOCK_R = 64
_BLOCK_K = 128
_TILE_ELEMENTS = 16384
_NUM_STAGES = 3
_WAVES = 4
_PAGED_WAVES = 2
_MIN_TILES_PER_SPLIT = 32
_MIN_TILES_PER_SHORT_SPLIT = 4


def flash_decode(query, key_cache, value_cache, lengths, tables, slopes, *,
                 scale: float, spec: MaskSpec, page_size: int,
                 interpret: bool, tiling: DecodeTiling | None = None):
  """Attention of `query` against a KV cache, split-K, merged by LSE.

  Args:
    query: [batch, q_len, num_heads, head_dim].
    key_cache, value_cache: dense [batch, max_len, num_kv_heads, head_dim]
      (page_size 0) or paged [num_pages, page_size, num_kv_heads, head_dim].
    lengths: int32 [batch]: valid cache positions per sequence.
    tables: int32 [batch, pages_per_seq] (paged) or None (dense).
    slopes: float32 [batch, num_heads] ALiBi slopes, or None.
    scale: logit scale.
    spec: causal, with q_offset = lengths - q_len and kv lengths = lengths,
      kv_len = the cache's capacity; window, soft cap, ALiBi.
    page_size: rows per page, 0 for a dense cache.
    tiling: the schedule; None: `DecodeTiling.for_call`.

  Returns:
    out [batch, q_len, num_heads, head_dim] (query.dtype) and lse float32
    [batch, q_len, num_heads] (natural log, -inf for rows with nothing to
    attend to).
  """
  batch, q_len, num_heads, head_dim = query.shape
  num_kv_heads = key_cache.shape[2]
  group = num_heads // num_kv_heads
  rows = q_len * group
  if tiling is None:
    tiling = DecodeTiling.for_call(
        batch=batch, num_kv_heads=num_kv_heads, rows=rows, head_dim=head_dim,
        capacity=spec.kv_len, num_sms=compat.num_sms(),
        paged=bool(page_size), itemsize=jnp.dtype(key_cache.dtype).itemsize)
  with compat.quiet_triton_deprecation():
    partial_out, partial_lse = _decode_partials(
        query, key_cache, value_cache, lengths, tables, slopes, scale=scale,
        spec=spec, page_size=page_size, tiling=tiling, interpret=interpret)
  out, lse = merge_partials(partial_out, partial_lse)
  # [batch * kv_heads, (position, head), D] -> [batch, q_len, heads, D]
  out = out[..., :head_dim].reshape(batch, num_kv_heads, q_len, group,
                                    head_dim)
  out = out.transpose(0, 2, 1, 3, 4).reshape(query.shape)
  lse = lse.reshape(batch, num_kv_heads, q_len, group).transpose(0, 2, 1, 3)
  return out.astype(query.dtype), lse.reshape(batch, q_len, num_heads)


def merge_partials(partial_out, partial_lse):
  """Combines split-K partial results by their log-sum-exp.

  Args:
    partial_out: float32 [..., num_splits, rows, D], each split normalised
      over its own span (0 where the span was empty).
    partial_lse: float32 [..., num_splits, rows] (-inf for empty spans).

  Returns:
    out float32 [..., rows, D] and lse float32 [..., rows] (-inf and 0 for
    rows with nothing to attend to in any split).
  """
  if partial_lse.shape[-2] == 1:
    return partial_out[..., 0, :, :], partial_lse[..., 0, :]
  lse = jax.nn.logsumexp(partial_lse, axis=-2)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  weights = jnp.exp(partial_lse - safe[..., None, :])
  out = jnp.sum(weights[..., None] * partial_out, axis=-3)
  return out, lse


def _decode_partials(query, key_cache, value_cache, lengths, tables, slopes,
                     *, scale, spec, page_size, tiling: DecodeTiling,
                     interpret):
  """The kernel launch: partial (out, lse) per split.

  Returns:
    float32 [batch * kv_heads, num_splits, rows, head_dim_padded] outputs
    and float32 [batch * kv_heads, num_splits, rows] LSEs.
  """
  batch, q_len, num_heads, head_dim = query.shape
  num_kv_heads = key_cache.shape[2]
  group = num_heads // num_kv_heads
  rows = q_len * group
  dims = common.KernelDims.for_head_dim(head_dim)
  dp = dims.head_dim_padded
  # [B, T, K, G, D] -> [B * K, (T, G), D]: one K/V head's rows together.
  q = query.reshape(batch, q_len, num_kv_heads, group, head_dim)
  q = q.transpose(0, 2, 1, 3, 4).reshape(batch * num_kv_heads, rows,
                                         head_dim)
  # The caches as [rows, K, D]: a reshape of contiguous memory, no copy.
  flat_k = key_cache.reshape(-1, num_kv_heads, head_dim)
  flat_v = value_cache.reshape(-1, num_kv_heads, head_dim)
  cache_rows = flat_k.shape[0]
  if tables is None:
    tables = jnp.zeros((batch, 1), jnp.int32)  # unread; one layout
  if slopes is None:
    row_slopes = jnp.zeros((batch * num_kv_heads, rows), jnp.float32)
  else:  # per row: its head's slope
    row_slopes = slopes.reshape(batch, 1, num_kv_heads, group)
    row_slopes = jnp.broadcast_to(row_slopes, (batch, q_len, num_kv_heads,
                                               group))
    row_slopes = row_slopes.transpose(0, 2, 1, 3).reshape(
        batch * num_kv_heads, rows)
  block_r, splits = tiling.block_r, tiling.num_splits
  row_blocks = pl.cdiv(rows, block_r)
  kernel = functools.partial(
      _decode_kernel, scale=scale, spec=spec, dims=dims, tiling=tiling,
      group=group, rows=rows, num_kv_heads=num_kv_heads, page_size=page_size,
      max_len=0 if page_size else key_cache.shape[1],
      num_pages=key_cache.shape[0],
      precision=common.dot_precision(query.dtype, interpret))
  grid = (splits, row_blocks, batch * num_kv_heads)
  whole = lambda shape: pl.BlockSpec(shape, lambda s, r, bk: (0,) * len(shape))
  cache_spec = pl.BlockSpec((cache_rows, None, dp),
                            lambda s, r, bk: (0, bk % num_kv_heads, 0))
  in_specs = [
      pl.BlockSpec((None, block_r, dp), lambda s, r, bk: (bk, r, 0)),
      cache_spec, cache_spec,
      whole(lengths.shape), whole(tables.shape),
      pl.BlockSpec((None, block_r), lambda s, r, bk: (bk, r)),
  ]
  out_specs = [
      pl.BlockSpec((None, None, block_r, dp), lambda s, r, bk: (bk, s, r, 0)),
      pl.BlockSpec((None, None, block_r), lambda s, r, bk: (bk, s, r)),
  ]
  inputs = (q, flat_k, flat_v, lengths, tables, row_slopes)
  out_shape = [
      compat.output_struct((batch * num_kv_heads, splits, rows, dp),
                           jnp.float32, *inputs),
      compat.output_struct((batch * num_kv_heads, splits, rows), jnp.float32,
                           *inputs),
  ]
  return compat.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=common.compiler_params(tiling.num_warps,
                                             tiling.num_stages),
      interpret=interpret, name="flash_decode",
  )(*inputs)


def _decode_kernel(q_ref, k_ref, v_ref, lengths_ref, tables_ref, slopes_ref,
                   o_ref, lse_ref, *, scale: float, spec: MaskSpec,
                   dims: common.KernelDims, tiling: DecodeTiling, group: int,
                   rows: int, num_kv_heads: int, page_size: int, max_len: int,
                   num_pages: int, precision):
  """One (split, row block, batch x K/V head) program.

  q_ref [block_r, Dp]; k_ref, v_ref [cache_rows, Dp] (one K/V head);
  lengths_ref [batch]; tables_ref [batch, pages_per_seq]; slopes_ref
  [block_r]; o_ref [block_r, Dp] and lse_ref [block_r] of this split.
  """
  split, row_block, bk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_r, block_k = tiling.block_r, tiling.block_k
  b = bk // num_kv_heads
  length = lengths_ref[b]
  q_len = spec.q_len
  q_offset = length - q_len
  row0 = row_block * block_r
  rows_here = jnp.minimum(rows - row0, block_r)
  tile = pl.ds(0, block_r)
  rows_left = None if rows % block_r == 0 else rows - row0
  q = common.load_tile(q_ref, tile, dims, rows_left)
  q_idx = (row0 + lax.broadcasted_iota(jnp.int32, (block_r, 1), 0)) // group
  slope = slopes_ref[tile][:, None] if spec.has_alibi else None
  values = masking.MaskValues(q_offset=q_offset, kv_lengths=length,
                              alibi_slope=slope)

  # Cache positions this row block can attend to: [lo, hi).
  first_pos = q_offset + row0 // group
  last_pos = q_offset + (row0 + rows_here - 1) // group
  hi = jnp.clip(last_pos + 1, 0, length)
  lo = 0
  full_lo = 0  # first block that no window edge cuts
  if spec.window is not None:
    left = spec.window[0]
    lo = jnp.clip(first_pos - left, 0, hi)
    full_lo = pl.cdiv(jnp.maximum(last_pos - left, 0), block_k)
  lo_block, hi_block = lo // block_k, pl.cdiv(hi, block_k)
  per_split = pl.cdiv(hi_block - lo_block, tiling.num_splits)
  start = jnp.minimum(lo_block + split * per_split, hi_block)
  end = jnp.minimum(start + per_split, hi_block)
  # Blocks below every row's position (and inside every row's window) need
  # no mask; the rest (the diagonal, the window's edge, the length) do.
  full_hi = jnp.maximum(first_pos + 1, 0) // block_k
  unmasked_lo = jnp.clip(full_lo, start, end)
  unmasked_hi = jnp.clip(full_hi, unmasked_lo, end)

  def cache_rows(kv_start):
    """Rows of the [cache_rows, Dp] view that hold positions
    kv_start + [0, block_k) of sequence b."""
    pos = kv_start + jnp.arange(block_k, dtype=jnp.int32)
    if not page_size:
      return b * max_len + jnp.minimum(pos, max_len - 1)
    page_slot = jnp.minimum(pos // page_size, tables_ref.shape[1] - 1)
    page = jnp.clip(tables_ref[b, page_slot], 0, num_pages - 1)
    return page * page_size + pos % page_size

  cols = jnp.arange(dims.head_dim_padded, dtype=jnp.int32)

  def load(ref, rows_idx, kv_start, masked: bool):
    """A [block_k, Dp] gather of cache rows (array indices on both axes:
    the form both Triton and the interpreter take with a mask)."""
    index = (rows_idx[:, None], cols[None, :])
    mask = None
    if masked:  # positions past the length read 0, whatever the cache holds
      pos = kv_start + jnp.arange(block_k, dtype=jnp.int32)
      mask = (pos < length)[:, None]
    if dims.needs_column_mask:
      in_head = (cols < dims.head_dim)[None, :]
      mask = in_head if mask is None else mask & in_head
    if mask is None:
      return ref[index]
    return plgpu.load(ref.at[index], mask=mask, other=0.0)

  def body(j, carry, masked: bool):
    acc, m, l = carry
    kv_start = j * block_k
    idx = cache_rows(kv_start)
    k = load(k_ref, idx, kv_start, masked)
    kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    qk = common.matmul(q, k, precision, transpose_b=True)
    s = common.logits_base2(spec, qk, scale, q_idx, kv_idx, values, masked)
    m_new, correction, p, l = common.softmax_step(m, l, s, masked)
    v = load(v_ref, idx, kv_start, masked)
    acc = acc * correction[:, None] + common.matmul(p.astype(v.dtype), v,
                                                    precision)
    return acc, m_new, l

  carry = common.softmax_init(block_r, dims.head_dim_padded)
  acc, m, l = common.run_block_loop((start, unmasked_lo, unmasked_hi, end),
                                    body, carry)
  out, lse = common.softmax_finish(acc, m, l)  # an empty span: 0, -inf
  common.store_tile(o_ref, tile, out, dims, rows - row0)
  common.store_rows(lse_ref, tile, lse, rows - row0)


def cache_bytes_read(lengths, num_kv_heads: int, head_dim: int,
                     itemsize: int) -> int:
  """Bytes of K and V that a decode step must read: each sequence's valid
  positions, every K/V head, keys and values (the bandwidth numerator)."""
  return int(2 * sum(int(n) for n in lengths) * num_kv_heads * head_dim
             * itemsize)


