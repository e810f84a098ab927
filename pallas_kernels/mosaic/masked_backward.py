"""`mosaic_backward_masked`: the Mosaic backward with masks and any lengths.

The kernels are the backward's in their ranged form, as `masked.py` is the
forward's. Both read their loop ranges from plan rows built here, in XLA,
from ONE `masking.classify_blocks` map of [block_q, block_kv] tiles (the one
definition of the masks):

  dQ     grid over Q tiles: each 64-row Q block's row of the map, the K/V
         blocks it visits (the forward's plan, `masked.tile_plans`).
  dK/dV  grid over K/V tiles: each K/V block's column of the map (a row of
         its transpose), the Q blocks that visit it; the same for every
         query head of the GQA group (no ranged mask depends on the head).

    map (1 = visited)          dQ plan rows          dK/dV plan rows
         k0 k1 k2              q0: [k0, k1)          k0: [q0, q2)
    q0    1  0  0              q1: [k0, k2)          k1: [q1, q3)
    q1    1  1  0              q2: [k1, k3)          k2: [q2, q3)
    q2    0  1  1

Any lengths: rows of whole 128-byte swizzle tiles (d=64, 128, 256 in 16
bits) are read and written in place (`rows.rows_in_place`), others
zero-padded to the TMA row tiling (8); TMA reads past the end fill zeros
and writes past the end are dropped; keys past kv_len are
masked (`masking.keep`), and query rows past q_len get lse = +inf and
delta = 0 (P = 0, as for a row that attends to nothing), so that padding
contributes nothing to any gradient.

A bias enters every step of both kernels (the dK/dV kernel's tiles from its
transpose, a copy), and its gradient, dS itself, comes from a third launch:
the dQ kernel in its dbias form, which writes each visited tile's dS
instead of summing dS K. XLA drops that launch when nothing uses dbias.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from pallas_kernels import masking
from pallas_kernels.mosaic import backward, masked, plan
from pallas_kernels.mosaic.common import (alibi_columns,
                                         repeat_broadcast_axes, slope_rows)
from pallas_kernels.mosaic.dq import launch_dq
from pallas_kernels.mosaic.rows import rows_in_place
from pallas_kernels.mosaic.plan import BackwardConfig, planned_kv_copies


def mosaic_backward_masked(query, key, value, out, lse, d_out, d_lse=None, *,
                           scale: float, spec: masking.MaskSpec,
                           q_offset=None, q_lengths=None, kv_lengths=None,
                           q_segments=None, kv_segments=None,
                           alibi_slopes=None, dropout_seed=None,
                           block_mask=None, bias=None, dense_mask=None,
                           block_q: int = 64,
                           block_kv: int = 64,
                           max_concurrent_steps: int = 2,
                           overlap_softmax: bool = True,
                           prefetch_lse: bool = True,
                           lean_producer: bool = True,
                           kv_head_copies: int | None = None):
  """Gradients of `masked.mosaic_forward_masked`'s output for q, k and v.

  Args:
    query: [batch, q_len, num_heads, head_dim], bfloat16 or float16;
      head_dim a multiple of 16 from 64 to 256; any q_len.
    key, value: [batch, kv_len, num_kv_heads, head_dim], same dtype; any
      kv_len; num_heads % num_kv_heads == 0.
    out: the forward's output, like query.
    lse: float32 [batch, num_heads, q_len], the forward's natural-log
      logsumexp as `mosaic_forward_masked` returns it; -inf marks a row that
      attends to nothing (its gradients are zero).
    d_out: the cotangent of out, like query.
    d_lse: the cotangent of lse, like lse, or None (zero).
    scale: multiplies q·k in the forward.
    spec: `masking.MaskSpec` for (q_len, kv_len): is_causal, window,
      q_offset, q/kv lengths, segment ids, logits_soft_cap, ALiBi,
      score_fn (its derivative in score by `jax.jvp`, per tile), dropout_rate.
    q_offset, q_lengths, kv_lengths: int32 [batch] or None, as spec says.
    q_segments, kv_segments: int32 [batch, q_len] / [batch, kv_len] or None.
    alibi_slopes: float32 [batch, num_heads] or None, as spec says. ALiBi
      adds a term that does not depend on q or k: the steps recompute the
      forward's logits with it, and dS is as without it.
    dropout_seed: int32 [] or None, as spec says: each step regenerates the
      forward's kept weights (`masking.dropout_keep`'s bits); dV takes
      them, dP is dropped as they were, both scaled by 1 / (1 - rate).
    block_mask: `masking.BlockMask` of `spec.mask_fn` (`masked.tile_states`),
      or None: built here where it needs one (`masked.block_mask_of`).
    bias: [batch | 1, num_heads | 1, q_len | 1, kv_len | 1] in query's
      dtype (`spec.has_bias`) or None: added to the recomputed logits of
      both kernels (the dK/dV kernel's from its transpose, a copy; along
      a broadcast sequence axis a tile's extent,
      `common.repeat_broadcast_axes`); its gradient is returned.
    dense_mask: bool [batch | 1, num_heads | 1, q_len, kv_len]
      (`spec.has_dense_mask`) or None: streamed as int8 tiles of the
      masked steps, the dK/dV kernel's from its transpose (a copy), and
      classified like the forward's (`masked.tile_states`).
    block_q, block_kv, max_concurrent_steps, overlap_softmax,
      prefetch_lse, lean_producer, kv_head_copies: as
      `plan.BackwardConfig`'s (kv_head_copies None:
      `plan.planned_kv_copies`' choice). The defaults are the plain causal
      backward's: on a causal mask at 16k the three together took the
      backward from 441 to 469 TFLOP/s at d=128 and from 294 to 302 at
      d=256 (h200_mosaic_masked_backward_schedule.md).

  Returns:
    (dq, dk, dv, dbias): dq, dk, dv shaped and typed like (query, key,
    value); dbias like bias (summed over the axes it broadcasts), or None
    without one.

  Raises:
    NotImplementedError: for features outside `masked._RANGED_FEATURES`
      (sinks), a bias or dense mask the kernels do not stream
      (`masked.check_score_array`), a `block_mask` whose tile does not
      divide the kernels', and for what the kernels do not
      cover (dtype, head dim, tiles that do not fit), so that the caller
      falls back to the Triton backward.
  """
  masked.check_ranged_features(spec, "the masked Mosaic backward")
  spec = masked.kernel_spec(spec)
  masked.check_score_array("bias", spec.has_bias, bias, query, spec.kv_len,
                           dtype=query.dtype, broadcast=True)
  masked.check_score_array("dense_mask", spec.has_dense_mask, dense_mask,
                           query, spec.kv_len, dtype=jnp.bool_)
  masked.check_slopes(spec, alibi_slopes, query.shape)
  masked.check_dropout_seed(spec, dropout_seed)
  backward.check_supported(query, key, value, out, lse, d_out, d_lse,
                           block_q=block_q, block_kv=block_kv,
                           max_concurrent_steps=max_concurrent_steps,
                           any_lengths=True)
  q_len, kv_len = query.shape[1], key.shape[1]
  if (q_len, kv_len) != (spec.q_len, spec.kv_len):
    raise ValueError(f"spec is for q_len {spec.q_len}, kv_len {spec.kv_len}; "
                     f"got query {query.shape}, key {key.shape}")
  # Launched tile-fastest as the plain kernels: on a causal 1k window +1.5%
  # to +4.6% at seq 4k, less than 1% either way at 16k
  # (h200_mosaic_masked_order.md); the dQ grid's tiles heaviest first
  # (`masked.tile_plans`).
  config = BackwardConfig(block_q=block_q, block_kv=block_kv,
                          max_concurrent_steps=max_concurrent_steps,
                          overlap_softmax=overlap_softmax,
                          prefetch_lse=prefetch_lse,
                          lean_producer=lean_producer,
                          kv_head_copies=kv_head_copies)
  batch, _, num_heads, _ = query.shape
  config = dataclasses.replace(config, kv_head_copies=planned_kv_copies(
      config, batch=batch, num_kv_heads=key.shape[2],
      group=num_heads // key.shape[2], kv_len=kv_len))
  # Configuring raises for tiles that do not fit, before any work is traced.
  dq_config, dkdv_configs = backward.statics(
      query, key, scale=scale, is_causal=spec.is_causal, config=config,
      spec=spec)
  dbias_config = None
  if spec.has_bias:
    dbias_config = backward.dbias_static(
        query, key, scale=scale, config=config, spec=spec,
        dbias_dtype=_dbias_dtype(bias, batch=batch, num_heads=num_heads,
                                 q_len=q_len, kv_len=kv_len))
  block_mask = masked.block_mask_of(spec, block_mask, query.shape)
  states, plans = _classified(
      spec, batch, block_q=block_q, block_kv=block_kv, q_offset=q_offset,
      q_lengths=q_lengths, kv_lengths=kv_lengths, q_segments=q_segments,
      kv_segments=kv_segments, block_mask=block_mask, dense_mask=dense_mask,
      dropout_seed=dropout_seed)
  # dQ's plan rows per query head where a mask differs by head, dK/dV's
  # per K/V head (the union of its group's).
  dq_plan, plan_heads = plans(dq_config.num_consumers)
  dkdv_plan, kv_plan_heads = plans(
      dkdv_configs[0].num_consumers,
      kv_heads=num_heads // dkdv_configs[0].group)
  # Causal ALiBi as a term per key and one per query (`plan.
  # MASKED_ALIBI_COLUMNS`, as the masked forward).
  columns = plan.MASKED_ALIBI_COLUMNS and alibi_columns(spec)
  fold_cap = plan.MASKED_BACKWARD_SOFTCAP_FOLDED and masking.cap_only(spec)
  # Rows off the 8-row TMA tiling read and written in place, as the plain
  # kernels' (`rows.rows_in_place`), except on shared rows.
  in_place = (rows_in_place(q_len, kv_len, query.shape[-1], query.dtype)
              and not any(static.shared_rows for static in dkdv_configs))
  # A bias broadcast along a sequence axis: a tile's extent of it, read
  # from its start (the dK/dV kernel's own rows are the keys).
  repeats = ((False, False) if bias is None
             else (bias.shape[2] == 1, bias.shape[3] == 1))
  dq_config, dbias_config = (
      None if static is None else dataclasses.replace(
          static, plan_heads=plan_heads, alibi_columns=columns,
          fold_cap=fold_cap, rows_in_place=in_place, bias_repeats=repeats)
      for static in (dq_config, dbias_config))
  dkdv_configs = [dataclasses.replace(static, plan_heads=kv_plan_heads,
                                      alibi_columns=columns,
                                      fold_cap=fold_cap,
                                      cap_slope_ahead=backward.cap_slope_ahead(
                                          static, fold_cap),
                                      rows_in_place=in_place,
                                      bias_repeats=repeats[::-1])
                  for static in dkdv_configs]
  tile_extent = max(max(static.block_q, static.block_kv)
                    for static in (dq_config, dbias_config, *dkdv_configs)
                    if static)
  # The dQ grid's last tile reaches furthest down the query rows.
  rows_per_tile = max(static.q_rows_per_cta
                      for static in (dq_config, dbias_config) if static)
  stats = padded_statistics(out, lse, d_out, d_lse,
                            rows=-(-q_len // rows_per_tile) * rows_per_tile)
  if not in_place:
    query, key, value, d_out = (masked.pad_rows(x)
                                for x in (query, key, value, d_out))
  segments = None
  if spec.has_segments:  # whole 8-row tiles, like padded rows
    segments = (masked.pad_ids(q_segments), masked.pad_ids(kv_segments))
  slopes = slope_rows(alibi_slopes) if spec.has_alibi else None
  # The bias and the dense mask: [.., q, kv] for dQ, [.., kv, q] for dK/dV.
  score_arrays = {}
  for name, x in (("biases", bias), ("dense_masks", dense_mask)):
    if x is not None:
      if x.dtype == jnp.bool_:  # one byte an element, as TMA copies it
        x = x.astype(jnp.int8)
      else:
        x, _ = repeat_broadcast_axes(x, tile_extent)
      score_arrays[name] = (masked.pad_tiles(x, block_kv),
                            masked.pad_tiles(jnp.swapaxes(x, 2, 3), block_q))
  ranged = dict(segments=segments, slopes=slopes)
  dq, dk, dv = backward.gradients(query, key, value, d_out, stats, dq_config,
                                  dkdv_configs, dq_plan=dq_plan,
                                  dkdv_plan=dkdv_plan, **ranged,
                                  **score_arrays)
  dbias = None
  if spec.has_bias:
    ds = launch_dq(
        query, key, value, d_out, stats, dbias_config,
        plan=(dq_plan if dbias_config.num_consumers == dq_config.num_consumers
              else plans(dbias_config.num_consumers)[0]),
        bias=score_arrays["biases"][0],
        dense_mask=score_arrays.get("dense_masks", (None,))[0], **ranged)
    dbias = _reduced_dbias(ds, states if _masks_keys(spec) else None, bias,
                           q_len=q_len, kv_len=kv_len, block_q=block_q,
                           block_kv=block_kv)
  return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len], dbias


def _dbias_dtype(bias, *, batch: int, num_heads: int, q_len: int,
                 kv_len: int):
  """The dS tiles' dtype: the bias's where dbias is dS itself, float32
  where a sum over a broadcast axis follows."""
  if bias.shape == (batch, num_heads, q_len, kv_len):
    return bias.dtype
  return jnp.float32


def _masks_keys(spec: masking.MaskSpec) -> bool:
  """Whether a mask of `spec` can leave a tile with no key to attend (and
  so unvisited by the plan): every mask but the keys past kv_len, which
  leave the last tile partial."""
  return (spec.is_causal or spec.window is not None or spec.has_q_lengths
          or spec.has_kv_lengths or spec.has_segments
          or spec.mask_fn is not None or spec.has_dense_mask)


def _reduced_dbias(ds, states, bias, *, q_len: int, kv_len: int,
                   block_q: int, block_kv: int):
  """dbias like `bias` [B | 1, N | 1, q_len | 1, kv_len | 1] from the dbias
  kernel's dS [B, N, num_q_blocks * block_q, num_kv_blocks * block_kv]:
  zero on the tiles the plan skips (`states` [B | 1, N | 1, nq, nk]
  EMPTY, never written; None where no mask empties a tile), cut to the
  lengths, summed over the axes the bias broadcasts. One pass, fused by
  XLA, and none for an unmasked bias of whole tiles that takes dS as it
  is (the pass would read and write 2 bytes an element: 3.6 ms of the
  16k benchmark's 8.6 GB)."""
  batch, num_heads, rows, cols = ds.shape
  if states is not None:
    num_q_blocks, num_kv_blocks = rows // block_q, cols // block_kv
    tiles = ds.reshape(batch, num_heads, num_q_blocks, block_q,
                       num_kv_blocks, block_kv)
    visited = (states != masking.EMPTY)[:, :, :, None, :, None]
    ds = jnp.where(visited, tiles, 0).reshape(ds.shape)
  ds = ds[:, :, :q_len, :kv_len]
  axes = tuple(i for i in range(4) if bias.shape[i] == 1 < ds.shape[i])
  if axes:
    ds = ds.sum(axes, keepdims=True, dtype=jnp.float32)
  return ds.astype(bias.dtype)


def _classified(spec: masking.MaskSpec, batch: int, *, block_q: int,
                block_kv: int, q_offset, q_lengths, kv_lengths, q_segments,
                kv_segments, block_mask, dense_mask, dropout_seed):
  """(states, plans): the EMPTY / PARTIAL / FULL state of every
  [block_q, block_kv] tile, int32 [B | 1, N | 1, nq, nk]
  (`masked.tile_states`), and `plans(consumers, kv_heads=None)`, the plan
  rows of a kernel of that many consumers built from them (`_plans`)."""
  states = masked.tile_states(spec, block_q, block_kv, q_offset=q_offset,
                              q_lengths=q_lengths, kv_lengths=kv_lengths,
                              q_segments=q_segments, kv_segments=kv_segments,
                              block_mask=block_mask, dense_mask=dense_mask)
  return states, functools.partial(
      _plans, states, batch=batch, spec=spec, q_offset=q_offset,
      q_lengths=q_lengths, kv_lengths=kv_lengths, dropout_seed=dropout_seed)


def _plans(states, consumers: int, *, batch: int, spec, q_offset, q_lengths,
           kv_lengths, dropout_seed, kv_heads: int | None = None):
  """(plans, plan_heads), `masked.head_plans` of tile `states` [B | 1,
  N | 1, nq, nk] for a kernel of `consumers` consumers: ranges over K/V
  blocks per Q tile (the dQ kernel's, per query head where the states
  differ by head), or, given the dK/dV kernel's `kv_heads`, over Q blocks
  per K/V tile (per K/V head, united over its group's query heads). The
  dQ kernel's rows go heaviest first, the dK/dV kernel's in tile order
  (`masked.tile_plans`)."""
  if kv_heads is not None:
    states = jnp.swapaxes(masked.unite_heads(states, kv_heads), -1, -2)
  return masked.head_plans(states, spec=spec, batch=batch,
                           num_consumers=consumers,
                           num_cols=states.shape[-1], q_offset=q_offset,
                           q_lengths=q_lengths, kv_lengths=kv_lengths,
                           dropout_seed=dropout_seed,
                           heaviest_first=kv_heads is None)


def plan_rows(spec: masking.MaskSpec, batch: int, *, block_q: int,
              block_kv: int, dq_consumers: int, dkdv_consumers: int,
              q_offset=None, q_lengths=None, kv_lengths=None,
              q_segments=None, kv_segments=None, block_mask=None,
              dense_mask=None, dropout_seed=None, kv_heads: int = 1):
  """The two kernels' plan rows, from one classification of the tiles
  (`masked.tile_states`).

  Returns:
    (dq_plan int32 [batch * P, num_q_tiles, PLAN_WIDTH], ranges over K/V
    blocks; dkdv_plan int32 [batch * P', num_kv_tiles, PLAN_WIDTH], ranges
    over Q blocks), in `masked.tile_plans`' layout; a tile is
    `dq_consumers` Q blocks or `dkdv_consumers` K/V blocks. P and P' are 1
    unless a mask differs by head: then P is the query heads and P' the
    dK/dV kernel's `kv_heads` (`masked.head_plans`).
  """
  _, plans = _classified(
      spec, batch, block_q=block_q, block_kv=block_kv, q_offset=q_offset,
      q_lengths=q_lengths, kv_lengths=kv_lengths, q_segments=q_segments,
      kv_segments=kv_segments, block_mask=block_mask, dense_mask=dense_mask,
      dropout_seed=dropout_seed)
  return (plans(dq_consumers)[0],
          plans(dkdv_consumers, kv_heads=kv_heads)[0])


def padded_statistics(out, lse, d_out, d_lse, *, rows: int):
  """float32 [batch, num_heads, 2, rows]: `backward.row_statistics`, with the
  rows past q_len given lse +inf (P = exp2(s - lse) = 0) and delta 0.

  Every Q tile the kernels stream is then whole, and a padded row adds
  nothing to dK or dV whatever its (zero-filled) Q and dO rows hold.
  """
  stats = backward.row_statistics(out, lse, d_out, d_lse)
  batch, num_heads, _, q_len = stats.shape
  fill = jnp.broadcast_to(jnp.array([[jnp.inf], [0.0]], jnp.float32),
                          (batch, num_heads, 2, rows - q_len))
  return jnp.concatenate([stats, fill], axis=-1)
