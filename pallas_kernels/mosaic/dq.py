"""The backward's dQ kernel.

Grid over Q tiles of `q_rows_per_cta` rows of one (batch, head):

  consumers   warpgroups 0 (and 1): each keeps `block_q` rows of Q and dO
              and their (lse, delta) in shared memory and walks the K/V
              tiles the rows see (`pipeline.Walk`), summing in order
              S = Q Kᵀ,  dP = dO Vᵀ,  dQ += dS K;  with `overlap_softmax`
              P runs while dP's wgmma does. Q is then dead: dQ leaves
              through its buffer.
  producer    the last warpgroup: streams K and V by TMA through the ring
              (`pipeline.produce`).

Under causal masking the tiles with the most K/V blocks launch first
(`common.tile_index`).
"""
from __future__ import annotations

import functools

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat as versions
from pallas_kernels import masking
from pallas_kernels.mosaic import compat, lowered_cache
from pallas_kernels.mosaic.common import (
    alibi_terms, causal_mask, chained_tiles, copy_slopes, dropout_key_hashes,
    dropout_kept, dropout_query_hashes, masked_steps, per_row, slope_reader,
    swizzled, tile_index, tile_indices, variant_mask)
from pallas_kernels.mosaic.rows import (
    RowViews, copy_rows_in, copy_rows_out, row_buffer, row_copies)
from pallas_kernels.mosaic.pipeline import (
    MASKED, SKIP, UNMASKED, BackwardStatic, Walk, dropout_delta,
    dropped_in_sign, ds_scale, each_tile, grid_args, ids_arrived,
    keep_scale, kernel_name,
    load_own_ids, produce, ranged_inputs, ranged_refs, ranged_scratch,
    ranged_walk, score_gradient, skip_step, slope_scratch, tile_probabilities,
    tile_values, walk_range, walk_runs, wgmma_accumulate, wgmma_fresh,
    wgmma_then)


def launch_dq(query, key, value, d_out, stats, static: BackwardStatic, *,
              plan=None, segments=None, slopes=None, bias=None,
              dense_mask=None):
  """Launches the dQ kernel; returns dq like query, or in its dbias form
  (`static.bias_grad`) dS, [batch, num_heads, num_q_blocks * block_q,
  num_kv_blocks * block_kv] in `static.dbias_dtype`, written on the tiles
  its rows visit (the others hold anything: `masked_backward` zeroes the
  tiles the plan skips).

  Ranged: `plan` int32 [batch, num_q_tiles, PLAN_WIDTH]; `segments`,
  `slopes`, `bias` and `dense_mask` (their [.., q_len, kv_len] forms) as
  `gradients` takes them.
  """
  batch, q_len, num_heads, head_dim = query.shape
  consumers, stages = static.num_consumers, static.num_stages
  resident = row_buffer((consumers, static.block_q, head_dim), static.dtype,
                        in_place=static.rows_in_place)
  streamed = row_buffer((stages, static.block_kv, head_dim), static.dtype,
                        in_place=static.rows_in_place)
  arrivals = row_copies(head_dim, static.dtype, in_place=static.rows_in_place)
  scratch = (
      resident,                                           # Q, then dQ
      resident,                                           # dO
      plgpu.SMEM((consumers, 2, static.block_q), jnp.float32),  # stats
      streamed,                                           # K ring
      streamed,                                           # V ring
      # q_arrived, do_arrived: one arrival a TMA copy (`row_copies`)
      *[plgpu.Barrier(num_barriers=consumers, num_arrivals=arrivals)] * 2,
      plgpu.Barrier(num_barriers=consumers),              # stats_arrived
      # k_arrived, v_arrived
      *[plgpu.Barrier(num_barriers=stages, num_arrivals=arrivals)] * 2,
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # consumed
  )
  inputs = (query, key, value, d_out, stats)
  if static.ranged:
    scratch += ranged_scratch(static, resident_rows=static.block_q,
                              streamed_rows=static.block_kv, slopes=slopes)
    inputs += ranged_inputs(plan, segments, slopes, bias, dense_mask)
  elif static.alibi:  # the plain kernel's ALiBi (`alibi_columns`)
    scratch += slope_scratch(static, slopes)
    inputs += (slopes,)
  out_shape, out_dtype = query.shape, query.dtype
  if static.bias_grad:  # each consumer's dS tile, on its way out
    out_shape = (batch, num_heads, static.num_q_blocks * static.block_q,
                 static.num_kv_blocks * static.block_kv)
    out_dtype = static.dbias_dtype
    scratch += (plgpu.SMEM((consumers, static.block_q, static.block_kv),
                           out_dtype,
                           transforms=swizzled(static.block_kv, out_dtype)),)
  return compat.vary_like(lowered_cache.kernel(
      functools.partial(_dq_kernel, static=static),
      out_type=versions.output_struct(out_shape, out_dtype, *inputs),
      scratch_types=scratch,
      **grid_args(static, (pl.cdiv(q_len, static.q_rows_per_cta),
                           num_heads, batch), ("q_tile", "head", "batch")),
      num_threads=consumers + 1,
      thread_name="wg",
      kernel_name=kernel_name(static, "dbias" if static.bias_grad else "dq"),
      compiler_params=compat.compiler_params(approx_math=True),
  )(*inputs), *inputs)


def _dq_kernel(*refs, static: BackwardStatic):
  """Kernel body; refs: `launch_dq`'s inputs (q, k, v, dO, stats, then the
  ranged kernel's `ranged_inputs`), dq (or dbias), its scratch list. Launch
  or persistent grid as `_dkdv_kernel` (causal: query tile i reads i + 1
  K/V tiles, so persistent tiles go in pairs)."""
  num_inputs = (5 + static.ranged + 2 * static.segmented + static.alibi
                + static.biased + static.dense)
  inputs, dq_ref, scratch = (refs[:num_inputs], refs[num_inputs],
                             refs[num_inputs + 1:])
  wg = lax.axis_index("wg")
  batch_size, q_len, num_heads, _ = inputs[0].shape
  num_tiles = pl.cdiv(q_len, static.q_rows_per_cta)

  def tile(batch, head, q_tile, wg, base, consumer):
    if not static.persistent:
      # A ranged tile's cost is the plan's, not causal geometry: launched
      # in order.
      q_tile = tile_index("q_tile", num_tiles, reverse=(
          static.is_causal and not static.ranged))
    return _dq_tile(inputs, dq_ref, scratch, batch, head, q_tile, wg, base,
                    consumer, static=static)

  each_tile(tile, wg, static=static, tile_axes=("batch", "head", "q_tile"),
            num_tiles=num_tiles, num_heads=num_heads, batch=batch_size)


def _dq_tile(inputs, dq_ref, scratch, batch, head, q_tile, wg, base,
             consumer: bool, *, static: BackwardStatic):
  """Consumer `wg`'s or the producer's part of query tile `q_tile`; returns
  the tile's streamed steps (as `_dkdv_tile`)."""
  q_ref, k_ref, v_ref, do_ref, stats_ref = inputs[:5]
  (q_smem, do_smem, stats_smem, k_ring, v_ring, q_arrived, do_arrived,
   stats_arrived, k_arrived, v_arrived, consumed) = scratch[:11]
  q_smem, do_smem, k_ring, v_ring = (RowViews.of(x, static)
                                     for x in (q_smem, do_smem, k_ring, v_ring))
  plan, ids, slopes, bias, dense = ranged_refs(
      static, inputs[5:], scratch[11:], batch=batch, head=head, tile=q_tile,
      own_is_query=True)
  # Ranged: `q_tile` is the CTA's plan row, whose own tile a consumer reads
  # (heaviest first, `masked.tile_plans`); the producer needs only its
  # union.
  tile_start = None if plan is not None else q_tile * static.q_rows_per_cta
  num_steps = None
  if plan is None:
    # The last consumer's rows come last, so it sees the most K/V tiles.
    last_start = tile_start + (static.q_rows_per_cta - static.block_q)
    num_steps = _num_kv_blocks_seen(last_start, static)
  arrived = (k_arrived, v_arrived) + ids_arrived(ids)

  def _consumer():
    walk = None
    if slopes is not None:  # in flight while the plan row (or Q) loads
      copy_slopes(slopes, wg)
    if plan is not None:
      walk = ranged_walk(plan, wg, dropout=static.dropout)
    start = (tile_start if walk is None
             else walk.tile * static.q_rows_per_cta)
    q_start = start + wg * static.block_q
    q_rows = pl.ds(q_start, static.block_q)
    own_q, own_do, own_stats = q_smem.at[wg], do_smem.at[wg], stats_smem.at[wg]
    copy_rows_in(q_ref.at[batch, q_rows, head], own_q, q_arrived.at[wg])
    copy_rows_in(do_ref.at[batch, q_rows, head], own_do, do_arrived.at[wg])
    plgpu.copy_gmem_to_smem(stats_ref.at[batch, head, :, q_rows], own_stats,
                            stats_arrived.at[wg])
    for barrier in (q_arrived, do_arrived, stats_arrived):
      plgpu.barrier_wait(barrier.at[wg])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    lse_log2 = plgpu.layout_cast(own_stats[0], row_layout)
    delta = dropout_delta(plgpu.layout_cast(own_stats[1], row_layout),
                          static)
    kept_of = bias_of = write_ds = terms_of = None
    if plan is None:
      values = None
      if slopes is not None:  # `alibi_columns`: top-left causal
        values = masking.MaskValues(
            alibi_slope=slope_reader(slopes, wg)(head))
        terms_of = lambda step: functools.partial(
            alibi_terms, q_start=q_start, kv_start=step * static.block_kv,
            q_offset=0, block_q=static.block_q, block_kv=static.block_kv)
      walk = Walk(0, num_steps, _dq_causal_runs(q_start, num_steps, static),
                  values)
      tile_mask = lambda step, slot: causal_mask(q_start, step, static)
    else:
      if static.spec.reads_batch_and_head:  # mask_fn's, score_fn's b and h
        walk = walk._replace(values=walk.values._replace(batch=batch,
                                                         head=head))
      if slopes is not None:  # this head's, for every tile it visits
        walk = walk._replace(values=walk.values._replace(
            alibi_slope=slope_reader(slopes, wg)(head)))
      if static.alibi_columns:  # this tile's queries, the step's keys
        terms_of = lambda step: functools.partial(
            alibi_terms, q_start=q_start, kv_start=step * static.block_kv,
            q_offset=walk.values.q_offset, block_q=static.block_q,
            block_kv=static.block_kv)
      if static.dropout:  # the rows' half of the hash, once
        query_hashes = dropout_query_hashes(
            walk.dropout_seed, batch, head, q_start, static.block_q,
            plgpu.Layout.WGMMA.reduce(1))
        kept_of = lambda step: dropout_kept(
            query_hashes, dropout_key_hashes(
                step * static.block_kv, static.block_kv,
                plgpu.Layout.WGMMA.reduce(0)),
            (static.block_q, static.block_kv), static.spec.dropout_rate)
      own_ids = load_own_ids(ids, q_rows, wg)
      shape = (static.block_q, static.block_kv)

      def reader(tiles, first, next_of, end):
        """This consumer's tiles of `tiles`, K/V block `step` each."""
        return chained_tiles(
            tiles.smem.at[wg], tiles.arrived.at[wg],
            lambda step: tiles.source(head, q_rows, step * static.block_kv,
                                      static.block_kv),
            first=first, next_of=next_of, end=end)
      lo, _, _, hi = walk_range(walk)
      if bias is not None:  # every step of the range, in order
        bias_of = reader(bias, lo, lambda step: step + 1, hi)
      dense_tile = None
      if dense is not None:  # its tiles of the masked steps, in order
        dense_tile = reader(dense, *masked_steps(*walk_range(walk)))
      if static.bias_grad:
        write_ds = functools.partial(
            _write_ds, scratch[-1].at[wg],
            lambda step: dq_ref.at[batch, head, q_rows,
                                   pl.ds(step * static.block_kv,
                                         static.block_kv)])

      def tile_mask(step, slot):
        values = tile_values(walk.values, own_ids, ids, slot, shape,
                             own_is_query=True)
        if dense_tile is not None:
          values = values._replace(dense_mask=dense_tile(step) != 0)
        return variant_mask(q_start, step, static, values)
    dq = _dq_consume(own_q.mma, own_do.mma, lse_log2, delta, k_ring.mma,
                     v_ring.mma, arrived, consumed, walk=walk, tile_mask=tile_mask, static=static,
                     base=base, positions=functools.partial(
                         tile_indices, q_start, static=static),
                     alibi_terms=terms_of, kept_of=kept_of,
                     bias_of=bias_of, write_ds=write_ds)
    if write_ds is not None:  # the dS tiles have gone out step by step
      plgpu.wait_smem_to_gmem(0)
      return
    # Q is dead: dQ goes out through it
    own_q.mma[...] = dq.astype(static.dtype)
    plgpu.commit_smem()
    copy_rows_out(own_q, dq_ref.at[batch, q_rows, head])
    # Persistent: the next tile's Q may load once dQ has left.
    plgpu.wait_smem_to_gmem(0, wait_read_only=base is not None)

  def _producer():
    kv_head = head // static.group
    if plan is None:
      union_first, union_steps = None, num_steps
    else:
      walk = ranged_walk(plan, static.num_consumers, consumer=False)
      union_first, union_steps = walk.first, walk.num_blocks

    def kv_rows_of(step):
      block = step if union_first is None else union_first + step
      return pl.ds(block * static.block_kv, static.block_kv)

    def tile(ref):
      def source(step):
        return ref.at[batch, kv_rows_of(step), kv_head]
      return source

    streams = [(tile(k_ref), k_ring, k_arrived),
               (tile(v_ref), v_ring, v_arrived)]
    if ids is not None:  # key ids travel with their K/V tiles
      streams.append((lambda step: ids.streamed_gmem.at[kv_rows_of(step)],
                      RowViews.plain(ids.ring), ids.ring_arrived))
    produce(streams, consumed, union_steps, static, base=base)

  (_consumer if consumer else _producer)()
  return num_steps


def _dq_consume(q_smem, do_smem, lse_log2, delta, k_ring, v_ring, arrived,
                consumed, *, walk: Walk, tile_mask, static: BackwardStatic,
                base=None, positions=None, alibi_terms=None, kept_of=None,
                bias_of=None, write_ds=None):
  """Consumer: dQ (f32, scaled) of its `block_q` rows.

  `lse_log2` and `delta` are the rows' statistics. Walks the producer's
  steps, K/V tiles [walk.first, walk.first + walk.num_blocks), treated as
  `walk.runs` say (skipped, masked by `tile_mask(kv_block, slot)`, or
  unmasked); `positions(kv_block)`: the S tile's (q_idx, kv_idx);
  `alibi_terms(kv_block)` (`static.alibi_columns`): its ALiBi terms'
  function (`pipeline.tile_probabilities`);
  `kept_of(kv_block)`: dropout's kept weights of the S tile, or None;
  `bias_of(kv_block)`: the bias tile (each computed step's, in order), or
  None. `write_ds(kv_block, ds)` (the dbias form): each computed step's dS
  goes out through it instead of into dQ, and nothing is returned.
  """
  dq = None if write_ds is not None else plgpu.layout_cast(
      jnp.zeros((static.block_q, static.head_dim), jnp.float32),
      plgpu.Layout.WGMMA)

  def slot_of(step):
    # Ranged: the producer's step 0 is K/V block walk.first. Persistent:
    # `base` steps of earlier tiles went through the ring before.
    if static.ranged:
      step = step - walk.first
    return lax.rem(step if base is None else base + step, static.num_stages)

  def step_body(step, dq, *, masked):
    slot = slot_of(step)
    for barrier in arrived:
      plgpu.barrier_wait(barrier.at[slot])
    k_tile, v_tile = k_ring.at[slot], v_ring.at[slot]
    products = [(q_smem, k_tile.transpose((1, 0))),     # S = Q Kᵀ
                (do_smem, v_tile.transpose((1, 0)))]    # dP = dO Vᵀ

    def probabilities(s):
      """(P, its slope); with dropout P's dropped weights negated
      (`pipeline.dropped_in_sign`) where `kept_of` says, hashed here,
      after S is read, while dP's wgmma runs (benchmarks/NOTES.md,
      "Dropout's hash after S")."""
      values = walk.values
      if bias_of is not None:
        values = values._replace(bias=bias_of(step).astype(jnp.float32))
      p, slope = tile_probabilities(
          s, lse_log2, per_row, values, static,
          positions=lambda: positions(step),
          alibi_terms=None if alibi_terms is None else alibi_terms(step))
      if masked:
        p = jnp.where(tile_mask(step, slot), p, 0.0)
      kept = None if kept_of is None else kept_of(step)
      return dropped_in_sign(p, kept), slope

    shape = (static.block_q, static.block_kv)
    if static.overlap_softmax:
      (p, slope), dp = wgmma_then(shape, products, probabilities)
    else:
      s, dp = wgmma_fresh(shape, products)
      p, slope = probabilities(s)
    ds = score_gradient(p, dp, per_row(delta, p.shape), slope,
                        static.dropout)
    if write_ds is not None:
      plgpu.barrier_arrive(consumed.at[slot])  # K and V are not read again
      # dS itself: dbias takes it unscaled.
      write_ds(step, ds * keep_scale(static) if static.dropout else ds)
      return dq
    (dq,) = wgmma_accumulate((dq,), [(ds.astype(static.dtype), k_tile)])
    plgpu.barrier_arrive(consumed.at[slot])
    return dq

  def skip_body(step, dq):
    skip_step(arrived, consumed, slot_of(step))
    return dq

  dq = walk_runs(walk.runs, {
      SKIP: skip_body, UNMASKED: functools.partial(step_body, masked=False),
      MASKED: functools.partial(step_body, masked=True)}, dq)
  return None if dq is None else dq * ds_scale(static)


def _write_ds(smem, destination, step, ds):
  """The dbias form's step: dS (f32 [block_q, block_kv], dL/d(scale·q·k),
  which is dL/dbias) into this consumer's buffer `smem` and out by TMA to
  `destination(step)`, once the step before's copy has read the buffer."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  smem[...] = ds.astype(smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, destination(step))


def _dq_causal_runs(q_start, num_steps, static: BackwardStatic):
  """The plain kernel's runs over K/V tiles [0, num_steps) for rows from
  q_start: causal, mask the tiles that straddle the diagonal and skip those
  that only the other consumer's (later) rows see."""
  own_steps = _num_kv_blocks_seen(q_start, static)
  own_unmasked = _num_unmasked_kv_blocks(q_start, own_steps, static)
  runs = ((0, own_unmasked, UNMASKED),)
  if static.is_causal:
    runs += ((own_unmasked, own_steps, MASKED), (own_steps, num_steps, SKIP))
  return runs


def _num_kv_blocks_seen(q_start, static: BackwardStatic):
  """K/V tiles that rows [q_start, q_start + block_q) attend to."""
  if not static.is_causal:
    return static.num_kv_blocks
  return jnp.minimum(pl.cdiv(q_start + static.block_q, static.block_kv),
                     static.num_kv_blocks)


def _num_unmasked_kv_blocks(q_start, num_blocks, static: BackwardStatic):
  """Leading K/V tiles wholly at or below the diagonal: tile j's last key,
  (j + 1) * block_kv - 1, is at most the first row, q_start."""
  if not static.is_causal:
    return num_blocks
  return jnp.minimum((q_start + 1) // static.block_kv, num_blocks)
