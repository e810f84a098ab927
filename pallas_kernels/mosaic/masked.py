"""`mosaic_forward_masked`: the Mosaic forward with masks and any lengths.

The kernel is the forward's in its "ranged" form: each 64-row query block
reads its K/V loop ranges from a plan row built here, in XLA, by
`pallas_kernels.masking` (the one definition of the masks), and applies
`masking.keep` / `masking.modify_scores` on the tiles that need them, and
`masking.dropout_keep`'s hash with dropout.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from pallas_kernels import masking
from pallas_kernels.reciprocals import scalar_divisions_as_products
from pallas_kernels.mosaic import forward, plan
from pallas_kernels.mosaic.common import (PLAN_TILE, PLAN_WIDTH,
                                         TMA_ROW_TILE, alibi_columns,
                                         check_slope_shape,
                                         repeat_broadcast_axes, slope_rows,
                                         swizzled)


# What the masked kernels cover; the rest stays with the Triton kernels.
_RANGED_FEATURES = ("is_causal", "window", "has_q_offset", "has_q_lengths",
                    "has_kv_lengths", "has_segments", "logits_soft_cap",
                    "has_alibi", "dropout_rate", "score_fn", "mask_fn",
                    "has_bias", "has_dense_mask")


def mosaic_forward_masked(query, key, value, *, scale: float,
                          spec: masking.MaskSpec, q_offset=None,
                          q_lengths=None, kv_lengths=None, q_segments=None,
                          kv_segments=None, alibi_slopes=None,
                          dropout_seed=None, block_mask=None, bias=None,
                          dense_mask=None, sinks=None, block_q: int = 64,
                          block_kv: int | None = None,
                          max_concurrent_steps: int = 2,
                          lazy_rescale: bool | None = None):
  """`forward.mosaic_forward` with masks, score changes, dropout and any
  lengths.

  The masks, score changes and dropout are `pallas_kernels.masking`'s (the
  one definition): `spec` may use is_causal, window, q_offset, q/kv
  lengths, segment ids, logits_soft_cap, ALiBi, mask_fn and score_fn
  (called with the CTA's batch and query head) and dropout_rate. The K/V
  tiles each 64-row query
  block visits, and which of them need the mask, come from
  `masking.classify_blocks` (tiles that the masks empty are skipped, the
  unmasked run pays nothing for the mask; the score changes, which empty
  no tile, apply on every visited one). Lengths that are not multiples of
  the tiles are handled by TMA: reads past the end fill zeros (masked as
  keys past kv_len), writes past the end are dropped.

  Args:
    query, key, value, scale, block_q, block_kv, max_concurrent_steps: as
      `forward.mosaic_forward`; lengths may be anything.
    spec: `masking.MaskSpec` for (q_len, kv_len).
    q_offset, q_lengths, kv_lengths: int32 [batch] or None, as the spec says.
    q_segments, kv_segments: int32 [batch, q_len] / [batch, kv_len] or None.
    alibi_slopes: float32 [batch, num_heads] (`spec.has_alibi`) or None;
      each (batch, head)'s is one scalar of its CTAs.
    block_mask: `masking.BlockMask` of `spec.mask_fn` (its tiles skip
      and unmask the kernel's, `tile_states`), or None: built here where
      `spec.mask_fn` needs one (`block_mask_of`).
    bias: [batch | 1, num_heads | 1, q_len | 1, kv_len | 1] in query's
      dtype (`spec.has_bias`), added to the scaled logits, or None; each
      consumer streams the tile of its next step.
    dense_mask: bool [batch | 1, num_heads | 1, q_len, kv_len]
      (`spec.has_dense_mask`: True where a query sees a key) or None;
      streamed as int8 tiles like the bias, for the masked steps only.
      Its tiles are classified too (`masking.dense_block_states`): none
      kept, skipped; all kept, computed without the mask (its tile is not
      read).
    dropout_seed: int32 [] (`spec.dropout_rate` > 0) or None. P's weights
      are dropped by `masking.dropout_keep` (the Triton kernels' and the
      reference's bits) after the row sum, so that the LSE is dropout's
      (every weight counts in it), and O is scaled by 1 / (1 - rate).
    sinks: float32 [num_heads] or None: as `forward.mosaic_forward`'s.
    lazy_rescale: O rescaled only where a row's max moved by more than 8
      (log2 units, see `forward.KernelStatic`); the results change by
      rounding only. None: at `plan.MASKED_LAZY_RESCALE_HEAD_DIMS` (by
      `plan.plan_head_dim`).

  Returns:
    (out [batch, q_len, num_heads, head_dim], lse float32
    [batch, num_heads, q_len]), as `forward.mosaic_forward`.

  Raises:
    NotImplementedError: for features outside `_RANGED_FEATURES`,
      a bias of another dtype than query's, a dense mask broadcast along
      q_len or kv_len, a `block_mask` whose tile does not
      divide the kernel's, and what `forward.mosaic_forward` refuses.
  """
  check_ranged_features(spec, "the masked Mosaic forward")
  spec = kernel_spec(spec)
  check_score_array("bias", spec.has_bias, bias, query, spec.kv_len,
                    dtype=query.dtype, broadcast=True)
  check_score_array("dense_mask", spec.has_dense_mask, dense_mask, query,
                    spec.kv_len, dtype=jnp.bool_)
  if spec.logits_soft_cap is not None and not scale > 0:
    raise NotImplementedError("scale must be positive")
  check_slopes(spec, alibi_slopes, query.shape)
  check_dropout_seed(spec, dropout_seed)
  check = functools.partial(
      forward.check_supported, query, key, value, scale=scale,
      is_causal=spec.is_causal, block_q=block_q,
      max_concurrent_steps=max_concurrent_steps, spec=spec,
      sinks=sinks is not None)
  if block_kv is None:  # between d=128 and 256, a bias may not fit 128 keys
    block_kv = forward.fitting_block_kv(
        plan.default_block_kv(query.shape[-1]),
        lambda block_kv: check(block_kv=block_kv))
  static = check(block_kv=block_kv)
  if lazy_rescale is None:
    lazy_rescale = (plan.plan_head_dim(query.shape[-1])
                    in plan.MASKED_LAZY_RESCALE_HEAD_DIMS)
  # The soft cap is the last change to the scores (`masking.modify_scores`),
  # so |s| <= cap wherever a key is kept.
  no_running_max = plan.max_free_cap(spec.logits_soft_cap, query.dtype,
                                     query.shape[-1])
  # The plain causal forward's schedule: the split rendezvous, launched
  # tile-fastest (each head's tiles heaviest first, `tile_plans`): on the
  # causal forward at 16k 531 -> 563 TFLOP/s at d=128 (the plain kernel
  # 593), 605 -> 621 at d=256 (638; h200_mosaic_masked_heaviest_first.md).
  static = dataclasses.replace(
      static, split_handover=True,
      alibi_columns=(plan.MASKED_ALIBI_COLUMNS and alibi_columns(spec)
                     and sinks is None),
      max_free=no_running_max,
      fold_cap=(plan.MASKED_SOFTCAP_FOLDED
                and spec.logits_soft_cap is not None),
      **forward.rescale_fields(lazy_rescale))
  if no_running_max and plan.MAX_FREE_FIRST_STEP_MAX:
    static = dataclasses.replace(static, first_step_max=(
        plan.first_step_max_floor(spec.logits_soft_cap, query.dtype)))
  elif (no_running_max and plan.MAX_FREE_MMA_ROW_SUM
        and not spec.dropout_rate):  # P V's P is not the sum's under dropout
    static = forward.with_mma_row_sum(static) or static
  block_mask = block_mask_of(spec, block_mask, query.shape)
  rows, plan_heads = plan_rows(static, query.shape[0], q_offset=q_offset,
                               q_lengths=q_lengths, kv_lengths=kv_lengths,
                               q_segments=q_segments, kv_segments=kv_segments,
                               block_mask=block_mask, dense_mask=dense_mask,
                               dropout_seed=dropout_seed)
  static = dataclasses.replace(static, plan_heads=plan_heads)
  q_len = query.shape[1]
  if not static.rows_in_place:  # `rows.rows_in_place`: unpadded
    query, key, value = (pad_rows(x) for x in (query, key, value))
  segments = None
  if spec.has_segments:  # whole 8-row tiles, like padded rows
    segments = (pad_ids(q_segments), pad_ids(kv_segments))
  slopes = slope_rows(alibi_slopes) if spec.has_alibi else None
  if spec.has_bias:
    bias, repeats = repeat_broadcast_axes(
        bias, max(static.block_q, static.block_kv))
    static = dataclasses.replace(static, bias_repeats=repeats)
    bias = pad_tiles(bias, static.block_kv)
  if spec.has_dense_mask:  # one byte an element, as TMA copies it
    dense_mask = pad_tiles(dense_mask.astype(jnp.int8), static.block_kv)
  out, lse = forward.launch(static, query, key, value, plan=rows,
                            segments=segments, slopes=slopes, bias=bias,
                            dense_mask=dense_mask,
                            sinks=None if sinks is None
                            else forward.sink_rows(sinks))
  return out[:, :q_len], lse[..., :q_len]


def check_slopes(spec: masking.MaskSpec, alibi_slopes, q_shape):
  """ValueError unless `alibi_slopes` is float [batch, num_heads] exactly
  when `spec.has_alibi` (`validation` broadcasts [num_heads] ones)."""
  if not spec.has_alibi:
    if alibi_slopes is not None:
      raise ValueError("alibi_slopes given but spec.has_alibi is False")
    return
  check_slope_shape(alibi_slopes, q_shape)


def pad_tiles(x, tile_columns: int):
  """A bias or dense mask [B | 1, N | 1, rows, columns] zero-padded to
  whole tiles of its shared-memory layout for tiles `tile_columns` wide
  (TMA needs its last two axes to be: 8 rows, and the swizzle's columns,
  64 of 16 bits or 128 bytes at 128 columns); a copy, only for lengths
  that are not."""
  rows, columns = swizzled(tile_columns, x.dtype)[0].tiling
  pad = [(0, 0), (0, 0), (0, -x.shape[2] % rows), (0, -x.shape[3] % columns)]
  return jnp.pad(x, pad) if any(p for _, p in pad) else x


def check_score_array(name: str, expected: bool, x, query, kv_len: int, *,
                      dtype, broadcast: bool = False):
  """ValueError unless array `name` (the bias or the dense mask) is given
  exactly when the spec says (`expected`), [batch | 1, num_heads | 1, ...];
  NotImplementedError for one the kernel does not stream (another dtype
  than `dtype`, or, unless `broadcast`, broadcast along a sequence axis:
  the Triton kernels take those)."""
  if not expected:
    if x is not None:
      raise ValueError(f"{name} given but the spec has none")
    return
  batch, q_len, num_heads, _ = query.shape
  if x is None or x.ndim != 4 or x.shape[0] not in (1, batch) or (
      x.shape[1] not in (1, num_heads)):
    raise ValueError(
        f"{name} must be [batch | 1, num_heads | 1, q_len, kv_len] for "
        f"query {query.shape}; got {None if x is None else x.shape}")
  if any(n != length and not (broadcast and n == 1)
         for n, length in zip(x.shape[2:], (q_len, kv_len))):
    raise NotImplementedError(
        f"the masked Mosaic kernels stream {name} tiles of [q_len, kv_len] "
        f"= ({q_len}, {kv_len}); got {x.shape}")
  if x.dtype != dtype:
    raise NotImplementedError(
        f"the masked Mosaic kernels take {name} in {jnp.dtype(dtype).name}, "
        f"got {x.dtype}")


def check_dropout_seed(spec: masking.MaskSpec, dropout_seed):
  """ValueError unless an int32 [] `dropout_seed` is given exactly when
  `spec.dropout_rate` is not 0."""
  if not spec.dropout_rate:
    if dropout_seed is not None:
      raise ValueError("dropout_seed given but spec.dropout_rate is 0")
    return
  if dropout_seed is None or jnp.shape(dropout_seed) != ():
    raise ValueError(f"dropout_rate {spec.dropout_rate} needs an int32 [] "
                     f"dropout_seed; got {dropout_seed!r}")


def pad_rows(x, multiple: int = TMA_ROW_TILE):
  """Zero-pads axis 1 of [batch, len, heads, dim] to a multiple (of the TMA
  row tiling: a copy, only for such lengths; the kernels mask the pad rows
  or drop what they write there)."""
  pad = -x.shape[1] % multiple
  return x if not pad else jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))


def pad_ids(ids, length: int | None = None):
  """int32 segment ids [batch, n] zero-padded to [batch, length], by
  default to whole TMA row tiles (TMA's 16-byte strides; the ids of padded
  rows, or of rows read in place past their array's end, are never
  compared)."""
  if length is None:
    length = ids.shape[1] + -ids.shape[1] % TMA_ROW_TILE
  return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, length - ids.shape[1])))


def kernel_spec(spec: masking.MaskSpec) -> masking.MaskSpec:
  """`spec` as the masked kernels evaluate it: `score_fn`'s divisions by a
  scalar done as products (`reciprocals.scalar_divisions_as_products`;
  a division is ~15 SASS instructions a score, a product one)."""
  if spec.score_fn is None:
    return spec
  return dataclasses.replace(
      spec, score_fn=scalar_divisions_as_products(spec.score_fn))


def check_ranged_features(spec: masking.MaskSpec, kernel: str):
  """Raises NotImplementedError naming the features of `spec` outside
  `_RANGED_FEATURES` (the caller falls back to the Triton kernels)."""
  unsupported = [f.name for f in dataclasses.fields(spec)
                 if f.name not in ("q_len", "kv_len", *_RANGED_FEATURES)
                 and getattr(spec, f.name) != f.default]
  if unsupported:
    raise NotImplementedError(f"{kernel} does not support {unsupported}")


def plan_rows(static: forward.KernelStatic, batch: int, *, q_offset,
              q_lengths, kv_lengths, q_segments, kv_segments,
              block_mask=None, dense_mask=None, dropout_seed=None):
  """(plans, plan_heads): each tile's loop ranges over K/V blocks, int32
  [batch * plan_heads, num_q_tiles, PLAN_WIDTH] (`head_plans`): one row
  per batch, or per batch and query head where the masks differ by head
  (the kernel's `plan_heads`)."""
  spec = static.spec
  states = tile_states(spec, static.block_q, static.block_kv,
                       q_offset=q_offset, q_lengths=q_lengths,
                       kv_lengths=kv_lengths, q_segments=q_segments,
                       kv_segments=kv_segments, block_mask=block_mask,
                       dense_mask=dense_mask)
  return head_plans(states, spec=spec, batch=batch,
                    num_consumers=forward.NUM_CONSUMERS,
                    num_cols=static.num_kv_blocks, q_offset=q_offset,
                    q_lengths=q_lengths, kv_lengths=kv_lengths,
                    dropout_seed=dropout_seed)


def head_plans(states, *, spec: masking.MaskSpec, batch: int,
               num_consumers: int, num_cols: int, q_offset, q_lengths,
               kv_lengths, dropout_seed=None, heaviest_first: bool = True):
  """(plans, plan_heads) of tile `states` [B | 1, plan_heads, n_rows,
  n_cols] (`tile_states`, or `unite_heads` of them): `tile_plans` of each
  (batch, head)'s rows, int32 [batch * plan_heads, num_tiles, PLAN_WIDTH],
  row b * plan_heads + h for batch b and head h (plan_heads 1: one row
  per batch for all heads), in the grid's order (`heaviest_first`, as
  `tile_plans`)."""
  plan_heads = states.shape[1]
  if plan_heads == 1:
    ranges = masking.block_ranges(states[:, 0])          # [B|1, n_rows, 4]
  else:
    states = jnp.broadcast_to(states, (batch, *states.shape[1:]))
    ranges = masking.block_ranges(
        states.reshape(batch * plan_heads, *states.shape[2:]))

  def per_row(x):  # a per-batch operand, once per (batch, head) row
    if x is None or plan_heads == 1:
      return x
    return jnp.repeat(jnp.broadcast_to(x, (batch,)), plan_heads)

  plans = tile_plans(ranges, spec=spec, batch=batch * plan_heads,
                     num_consumers=num_consumers, num_cols=num_cols,
                     q_offset=per_row(q_offset), q_lengths=per_row(q_lengths),
                     kv_lengths=per_row(kv_lengths),
                     dropout_seed=dropout_seed, heaviest_first=heaviest_first)
  return plans, plan_heads


def unite_heads(states, groups: int):
  """Tile states [B | 1, P, nq, nk] united over each of `groups` runs of
  P / groups consecutive heads (the dK/dV kernel's K/V heads): [B | 1,
  groups, nq, nk], a tile empty or full for some heads of a run only
  PARTIAL. P = 1 (no mask differs by head) stays as it is."""
  if states.shape[1] == 1:
    return states
  b, heads, nq, nk = states.shape
  grouped = states.reshape(b, groups, heads // groups, nq, nk)
  least, most = grouped.min(2), grouped.max(2)
  return jnp.where(least == most, least, masking.PARTIAL)


def block_mask_of(spec: masking.MaskSpec, block_mask, q_shape):
  """`block_mask`, or `spec.mask_fn`'s `masking.BlockMask` for queries
  [batch, q_len, num_heads, dim] where it needs one and none is given."""
  if spec.mask_fn is None or block_mask is not None:
    return block_mask
  batch, _, num_heads, _ = q_shape
  return masking.BlockMask.for_call(spec.mask_fn, batch=batch,
                                    num_heads=num_heads, q_len=spec.q_len,
                                    kv_len=spec.kv_len)


def tile_states(spec: masking.MaskSpec, block_q: int, block_kv: int, *,
                q_offset=None, q_lengths=None, kv_lengths=None,
                q_segments=None, kv_segments=None, block_mask=None,
                dense_mask=None):
  """int32 [batch | 1, heads | 1, num_q_blocks, num_kv_blocks]: the EMPTY /
  PARTIAL / FULL state of every [block_q, block_kv] tile
  (`masking.classify_blocks`), per head where a mask differs by head
  (`mask_fn`'s `BlockMask` or a dense mask with a head axis), so that the
  plan rows skip and unmask each head's own tiles (`head_plans`).

  Raises:
    ValueError: `spec.mask_fn` without its `block_mask` (`block_mask_of`).
    NotImplementedError: a `block_mask` tile that neither divides the
      kernel's tiles nor is a multiple of them (`BlockMask.coarsen`).
  """
  if spec.mask_fn is not None:
    if block_mask is None:
      raise ValueError("mask_fn needs its BlockMask (block_mask=)")
    tile = block_mask.tile
    if any(block % tile and tile % block for block in (block_q, block_kv)):
      raise NotImplementedError(
          f"the BlockMask's tile {tile} neither divides the kernel's tiles "
          f"({block_q}, {block_kv}) nor is a multiple of them")
  states = masking.classify_blocks(
      spec, block_q, block_kv, q_offset=q_offset, q_lengths=q_lengths,
      kv_lengths=kv_lengths, q_segments=q_segments, kv_segments=kv_segments,
      fine_map=block_mask if spec.mask_fn is not None else None,
      dense_mask=dense_mask)
  return states


def tile_plans(ranges, *, spec: masking.MaskSpec, batch: int,
               num_consumers: int, num_cols: int, q_offset, q_lengths,
               kv_lengths, dropout_seed=None, heaviest_first: bool = True):
  """int32 [batch, num_tiles, PLAN_WIDTH]: the plan row of each CTA.

  A CTA tile is `num_consumers` (1 or 2) consecutive blocks of the grid's
  axis, one per consumer warpgroup. Its row (the layout `forward` reads):
  [lo, unmasked_lo, unmasked_hi, hi] of each consumer (zeros for a missing
  second one), the union [first, total) that the producer streams, then
  q_offset, q_length, kv_length and, with dropout, its seed
  (`common.PLAN_DROPOUT_SEED`), then the tile's index (`common.PLAN_TILE`);
  zero-padded to PLAN_WIDTH.

  The rows of each batch go in the grid's order: with `heaviest_first`
  (the forward's and dQ's grids) the tiles by descending union
  (`heaviest_first_order`), each kernel's CTA reading its tile from its
  row; else in tile order (the dK/dV kernel's, whose K/V tiles under the
  usual masks already grow lighter along the sequence).

  A consumer whose rows attend to nothing (or a block past the end) gets
  the empty range at the union's start, so that it walks the union's steps
  as skips.

  Args:
    ranges: int32 [batch | 1, num_blocks, 4], `masking.block_ranges` of each
      block's row of the classification, over `num_cols` blocks.
    q_offset, q_lengths, kv_lengths: int32 [batch] or None (the defaults:
      0, spec.q_len, spec.kv_len).
    dropout_seed: int32 [] where `spec.dropout_rate`, else None.
  """
  num_blocks = ranges.shape[1]
  num_tiles = -(-num_blocks // num_consumers)
  missing = num_tiles * num_consumers - num_blocks
  ranges = jnp.pad(jnp.broadcast_to(ranges, (batch, num_blocks, 4)),
                   ((0, 0), (0, missing), (0, 0)))
  ranges = ranges.reshape(batch, num_tiles, num_consumers, 4)
  lo, hi = ranges[..., 0], ranges[..., 3]
  nonempty = hi > lo
  union_lo = jnp.min(jnp.where(nonempty, lo, num_cols), -1)
  union_hi = jnp.max(jnp.where(nonempty, hi, 0), -1)
  union_lo = jnp.where(nonempty.any(-1), union_lo, 0)
  ranges = jnp.where(nonempty[..., None], ranges, union_lo[..., None, None])
  per_batch = lambda x, default: jnp.broadcast_to(
      jnp.asarray(default if x is None else x, jnp.int32), (batch,))
  scalars = [per_batch(q_offset, 0), per_batch(q_lengths, spec.q_len),
             per_batch(kv_lengths, spec.kv_len)]
  if spec.dropout_rate:
    scalars.append(per_batch(dropout_seed, 0))
  scalars = jnp.stack(scalars, -1)
  # A missing second consumer's range is zeros: the union stays at
  # `common.PLAN_UNION` whatever the number of consumers.
  absent = []
  if num_consumers < forward.NUM_CONSUMERS:
    absent.append(jnp.zeros(
        (batch, num_tiles, 4 * (forward.NUM_CONSUMERS - num_consumers)),
        jnp.int32))
  row = jnp.concatenate([
      ranges.reshape(batch, num_tiles, 4 * num_consumers), *absent,
      union_lo[..., None], union_hi[..., None],
      jnp.broadcast_to(scalars[:, None],
                       (batch, num_tiles, scalars.shape[-1]))], -1)
  row = jnp.pad(row.astype(jnp.int32),
                ((0, 0), (0, 0), (0, PLAN_TILE - row.shape[-1])))
  tiles = jnp.broadcast_to(jnp.arange(num_tiles, dtype=jnp.int32)[:, None],
                           (batch, num_tiles, 1))
  row = jnp.concatenate([row, tiles], -1)
  if heaviest_first:
    row = jnp.take_along_axis(
        row, heaviest_first_order(union_hi - union_lo)[..., None], axis=1)
  return jnp.pad(row, ((0, 0), (0, 0), (0, PLAN_WIDTH - row.shape[-1])))


def heaviest_first_order(steps):
  """int32 [batch, num_tiles]: the tiles by descending `steps` (each
  tile's K/V or Q blocks, [batch, num_tiles]), ties in tile order.

  Longest-processing-time-first: the kernels' grids launch the heaviest
  tiles first, so that the GPU ends on a tail of light CTAs rather than of
  heavy ones, whatever the mask (causal: the last query tiles; bottom-right
  causal, prefix masks, documents: wherever the plan says); the plain
  forward's reversed causal order gained 15-30% at 16k (`common.tile_index`).
  """
  return jnp.argsort(-steps, axis=-1, stable=True).astype(jnp.int32)
