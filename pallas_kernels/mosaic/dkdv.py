"""The backward's dK/dV kernel (and, fused, its dQ).

Grid over K/V tiles of `kv_rows_per_cta` rows of one (batch, K/V head):

  consumers   warpgroups 0 (and 1): each keeps `block_kv` rows of K and V in
              shared memory and walks the Q tiles of every query head of the
              GQA group (`pipeline.Walk`), summing in order
              Sᵀ = K Qᵀ,  dPᵀ = V dOᵀ,  dV += Pᵀ dO,  dK += dSᵀ Q;
              with `overlap_softmax` P runs while dPᵀ's wgmma does and dSᵀ
              while dV's does (`_dkdv_accumulate_overlapped`); with
              `scores_ahead` each step's Sᵀ is issued right behind the step
              before's dK (`walk_scores_ahead`). K and V are then dead: dK
              and dV leave through their buffers.
  producer    the next warpgroup: streams Q, dO and the rows' (lse, delta)
              by TMA through the ring (`pipeline.produce`).
  dQ writer   fused dQ only, the last warpgroup (`fused_dq.write_dq`).

Above head_dim 128 the two consumers share one copy of the rows
(`shared_rows.dkdv_consume_shared`), or the kernel runs twice, once per
output (the plan's choice on the persistent grid; and where the halves of
head_dim are no whole swizzle tiles).
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
    THREADS_PER_WARPGROUP, ScoreTiles, alibi_terms, chained_tiles, copy_slopes,
    dropout_key_hashes, dropout_kept, dropout_query_hashes, masked_steps,
    per_column, slope_reader, swizzled)
from pallas_kernels.mosaic.rows import (
    RowViews, copy_rows_in, copy_rows_out, row_buffer, row_copies, wgmma)
from pallas_kernels.mosaic.fused_dq import (
    DQ_PIECE, PIECES_DONE_BARRIER, FusedDq, issue_dq_piece,
    num_dq_pieces, stage_dq_piece, stage_dq_pieces, write_dq)
from pallas_kernels.mosaic.pipeline import (
    MASKED, UNMASKED, BackwardStatic, Walk, causal_mask_t,
    column_statistic, dkdv_causal_runs, dropout_delta, dropped_in_sign,
    ds_scale, each_tile, first_q_block, first_unmasked_q_block, grid_args,
    ids_arrived, keep_scale, kept_weights, kernel_name, load_own_ids,
    produce,
    ranged_inputs, ranged_refs, ranged_scratch, ranged_walk, ring_slot,
    score_gradient, slope_scratch, tile_indices_t, tile_probabilities,
    tile_values,
    variant_mask_t, walk_group, walk_range, wgmma_accumulate, wgmma_fresh,
    wgmma_then)
from pallas_kernels.mosaic.shared_rows import (
    column_part, dkdv_consume_shared, exchange_scratch, load_column_parts,
    shared_transforms)


def launch_dkdv(query, key, value, d_out, stats, static: BackwardStatic, *,
                plan=None, segments=None, slopes=None, bias=None,
                dense_mask=None):
  """Launches the dK/dV kernel for `static.outputs`; returns them in order
  (fused dQ: the f32 [batch, q_len, num_heads, head_dim] sum of dS K, not
  yet scaled, first).

  Ranged: `plan` int32 [batch, num_kv_tiles, PLAN_WIDTH]; `segments`,
  `slopes`, `bias` and `dense_mask` (their transposed [.., kv_len, q_len]
  forms) as `gradients` takes them.
  """
  batch, kv_len, num_kv_heads, head_dim = key.shape
  consumers, stages = static.num_consumers, static.num_stages
  transforms = swizzled(head_dim, static.dtype)
  resident_shape = (consumers, static.block_kv, head_dim)
  if static.shared_rows:
    # One copy of the rows, in column parts (a TMA box must be contiguous
    # in shared memory); every tile in the swizzle of the exchange's and
    # the column parts' tiles, since a wgmma's operands share one.
    resident_shape = (consumers, static.block_kv, head_dim // consumers)
    transforms = shared_transforms(static)
  resident = plgpu.SMEM(resident_shape, static.dtype, transforms=transforms)
  streamed = plgpu.SMEM((stages, static.block_q, head_dim), static.dtype,
                        transforms=transforms)
  if static.rows_in_place:  # `rows.rows_in_place` (never shared rows)
    resident, streamed = (
        row_buffer(shape, static.dtype, in_place=True) for shape in
        (resident_shape, (stages, static.block_q, head_dim)))
  arrivals = row_copies(head_dim, static.dtype, in_place=static.rows_in_place)
  scratch = (
      resident,                                           # K, then dK
      resident,                                           # V, then dV
      streamed,                                           # Q ring
      streamed,                                           # dO ring
      plgpu.SMEM((stages, 2, static.block_q), jnp.float32),  # stats ring
      # k_arrived, v_arrived, q_arrived, do_arrived: one arrival a TMA
      # copy (`row_copies`)
      *[plgpu.Barrier(num_barriers=consumers, num_arrivals=arrivals)] * 2,
      *[plgpu.Barrier(num_barriers=stages, num_arrivals=arrivals)] * 2,
      plgpu.Barrier(num_barriers=stages),                 # stats_arrived
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # consumed
  )
  inputs = (query, key, value, d_out, stats)
  if static.ranged:
    scratch += ranged_scratch(static, resident_rows=static.block_kv,
                              streamed_rows=static.block_q, slopes=slopes)
    inputs += ranged_inputs(plan, segments, slopes, bias, dense_mask)
  elif static.alibi:  # the plain kernel's ALiBi (`alibi_columns`)
    scratch += slope_scratch(static, slopes)
    inputs += (slopes,)
  if static.shared_rows:
    scratch += exchange_scratch(static, static.block_kv,
                                static.block_q // consumers, kinds=2)
  out_type = tuple(versions.output_struct(key.shape, key.dtype, *inputs)
                   for _ in static.outputs)
  if static.fused_dq:
    # Two of each, by step parity: a step's are still read while the next
    # step's are written.
    scratch += (
        plgpu.SMEM((2, consumers, static.block_kv, static.block_q),
                   static.dtype, transforms=transforms),  # dSᵀ
        plgpu.Barrier(num_arrivals=consumers, num_barriers=2),  # ds_stored
        plgpu.SMEM((2, num_dq_pieces(static.block_q, head_dim), DQ_PIECE,
                    DQ_PIECE), jnp.float32,
                   transforms=swizzled(DQ_PIECE, jnp.float32)),  # dQ pieces
        plgpu.Barrier(num_arrivals=consumers, num_barriers=2),  # dq_staged
        plgpu.Barrier(num_barriers=2),                        # stage_free
        plgpu.Barrier(num_arrivals=consumers, num_barriers=2),  # ds_read
    )
    out_type = (versions.output_struct(query.shape, jnp.float32, *inputs),
                ) + out_type
  if static.opaque_resident:  # a zero (see `BackwardStatic.opaque_resident`)
    scratch += (plgpu.SMEM((1,), jnp.int32),)
  results = lowered_cache.kernel(
      functools.partial(_dkdv_kernel, static=static),
      out_type=out_type,
      scratch_types=scratch,
      # The tile axis launches fastest in the two kernels
      # (`BackwardStatic.tile_fastest`) and slowest in the fused dQ, which
      # relies on it: K/V tile j of a head launches after tile j - 1 (see
      # `FusedDq`).
      **grid_args(static, (pl.cdiv(kv_len, static.kv_rows_per_cta),
                           num_kv_heads, batch),
                  ("kv_tile", "kv_head", "batch")),
      num_threads=consumers + 1 + static.fused_dq,  # + the dQ writer
      thread_name="wg",
      kernel_name=kernel_name(
          static, "".join(("dq_",) * static.fused_dq + static.outputs)),
      compiler_params=compat.compiler_params(approx_math=True),
  )(*inputs)
  return tuple(compat.vary_like(results, *inputs))


def _dkdv_kernel(*refs, static: BackwardStatic):
  """Kernel body; refs: `launch_dkdv`'s inputs (q, k, v, dO, stats, then
  the ranged kernel's `ranged_inputs`), the outputs, its scratch list.

  Launch grid: one K/V tile per CTA. Persistent grid (`static.persistent`):
  each CTA computes its tiles of `persistent_schedule` in turn (causal:
  K/V tile j reads the Q tiles from j on, so tiles go in pairs), the ring
  of streamed steps running on across tiles (see `produce`).
  """
  num_inputs = (5 + static.ranged + 2 * static.segmented + static.alibi
                + static.biased + static.dense)
  names = ("dq_sum",) * static.fused_dq + static.outputs
  inputs = refs[:num_inputs]
  out_refs = dict(zip(names, refs[num_inputs:num_inputs + len(names)]))
  scratch = refs[num_inputs + len(names):]
  wg = lax.axis_index("wg")
  batch_size, kv_len, num_kv_heads, _ = inputs[1].shape
  tile = functools.partial(_dkdv_tile, inputs, out_refs, scratch,
                           static=static)
  each_tile(
      tile, wg, static=static, tile_axes=("batch", "kv_head", "kv_tile"),
      num_tiles=pl.cdiv(kv_len, static.kv_rows_per_cta),
      num_heads=num_kv_heads, batch=batch_size)


def _dkdv_tile(inputs, out_refs, scratch, batch, kv_head, kv_tile, wg, base,
               consumer: bool, *, static: BackwardStatic):
  """Consumer `wg`'s or the producer's part of K/V tile `kv_tile`; returns
  the tile's streamed steps. `base`: steps streamed before it on a
  persistent grid, or None."""
  q_ref, k_ref, v_ref, do_ref, stats_ref = inputs[:5]
  (k_smem, v_smem, q_ring, do_ring, stats_ring, k_arrived, v_arrived,
   q_arrived, do_arrived, stats_arrived, consumed) = scratch[:11]
  # TMA through `views[...].tma`, everything else through the wgmma views.
  views = {name: RowViews.of(ref, static) for name, ref in
           (("k", k_smem), ("v", v_smem), ("q", q_ring), ("do", do_ring))}
  k_smem, v_smem, q_ring, do_ring = (views[name].mma
                                     for name in ("k", "v", "q", "do"))
  tile_start = kv_tile * static.kv_rows_per_cta
  plan, ids, slopes, bias, dense = ranged_refs(
      static, inputs[5:], scratch[11:], batch=batch, head=kv_head,
      tile=kv_tile, own_is_query=False)
  num_steps = None
  if plan is None:
    # The union of the consumers' Q tiles, per query head of the group:
    # [first, num_q_blocks), where first is consumer 0's (it sees the most).
    first = first_q_block(tile_start, static)
    per_head = static.num_q_blocks - first
    num_steps = static.group * per_head
  arrived = (q_arrived, do_arrived, stats_arrived) + ids_arrived(ids)
  fused = None
  if static.fused_dq:
    fused = FusedDq(*scratch[11:16], k=k_smem, dq_sum=out_refs["dq_sum"],
                    turns=None,  # the writer's alone: `_writer`
                    ds_read=scratch[16])

  def _consumer():
    if static.shared_rows:  # static consumer numbers: static column slices
      for c in range(static.num_consumers):
        pl.when(wg == c)(functools.partial(_shared_consumer, c))
      return
    kv_start = tile_start + wg * static.block_kv
    kv_rows = pl.ds(kv_start, static.block_kv)
    own_k, own_v = k_smem.at[wg], v_smem.at[wg]
    copy_rows_in(k_ref.at[batch, kv_rows, kv_head], views["k"].at[wg],
                 k_arrived.at[wg])
    if "dk" in static.outputs:  # only dPᵀ = V dOᵀ reads V
      copy_rows_in(v_ref.at[batch, kv_rows, kv_head], views["v"].at[wg],
                   v_arrived.at[wg])
      plgpu.barrier_wait(v_arrived.at[wg])
    plgpu.barrier_wait(k_arrived.at[wg])
    q_of = head_values = positions = terms_of = kept_of = bias_of = None
    if slopes is not None:  # in flight while the plan row (or Q) loads
      copy_slopes(slopes, wg)
    if plan is None:
      if slopes is not None:  # `alibi_columns`: top-left causal
        terms_of = lambda q_block: functools.partial(
            alibi_terms, q_start=q_block * static.block_q, kv_start=kv_start,
            q_offset=0, block_q=static.block_q, block_kv=static.block_kv,
            transposed=True)
        head_values = functools.partial(
            _head_values, masking.MaskValues(), batch=batch, kv_head=kv_head,
            slope_of=slope_reader(slopes, wg), static=static)
      if fused is None:
        walk = Walk(first, per_head,
                    dkdv_causal_runs(kv_start, first, static), None)
      else:  # position p of the walk is Q tile `q_of(p)`
        q_of = functools.partial(_fused_q_block, first=first, static=static)
        walk = Walk(0, per_head, _fused_runs(kv_start, first, static), None)
      tile_mask = lambda i, slot, values, g: causal_mask_t(kv_start, i,
                                                          static)
    else:
      walk = ranged_walk(plan, wg, dropout=static.dropout)
      own_ids = load_own_ids(ids, kv_rows, wg)
      shape = (static.block_kv, static.block_q)
      tiles_t = functools.partial(_group_tiles_t, wg=wg, kv_rows=kv_rows,
                                  kv_head=kv_head, static=static)
      lo, _, _, hi = walk_range(walk)
      if bias is not None:  # every step of each head's range, in order
        bias_of = tiles_t(bias, (lo, lambda i: i + 1, hi))
      dense_tile = None
      if dense is not None:  # its tiles of the masked steps, in order
        dense_tile = tiles_t(dense, masked_steps(*walk_range(walk)))

      def tile_mask(i, slot, values, g):
        values = tile_values(values, own_ids, ids, slot, shape,
                             own_is_query=False)
        if dense_tile is not None:
          values = values._replace(dense_mask=dense_tile(i, g) != 0)
        return variant_mask_t(kv_start, i, static, values)
      positions = functools.partial(tile_indices_t, kv_start, static=static)
      if static.alibi_columns:  # the step's queries, this tile's keys
        terms_of = lambda q_block: functools.partial(
            alibi_terms, q_start=q_block * static.block_q, kv_start=kv_start,
            q_offset=walk.values.q_offset, block_q=static.block_q,
            block_kv=static.block_kv, transposed=True)
      if slopes is not None or static.spec.reads_batch_and_head:
        head_values = functools.partial(
            _head_values, walk.values, batch=batch, kv_head=kv_head,
            slope_of=None if slopes is None else slope_reader(slopes, wg),
            static=static)
      if static.dropout:  # the keys' half of the hash, once
        kept_of = functools.partial(
            _dropout_kept_t, seed=walk.dropout_seed, batch=batch,
            kv_head=kv_head, key_hashes=dropout_key_hashes(
                kv_start, static.block_kv, plgpu.Layout.WGMMA.reduce(1)),
            static=static)
    resident = None
    if static.opaque_resident:  # see `BackwardStatic.opaque_resident`
      zero_smem = scratch[-1]
      zero_smem[...] = jnp.zeros((1,), jnp.int32)

      def resident():
        zero = zero_smem[0]  # read each step: the compiler cannot fold it
        return k_smem.at[wg + zero], v_smem.at[wg + zero], zero
    if static.scores_ahead:
      # Every step unmasked: one walk a step ahead across the group's heads.
      grads = _dkdv_consume_ahead(own_k, own_v, q_ring, do_ring, stats_ring,
                                  arrived, consumed, num_steps=num_steps,
                                  slot_of=ring_slot(static, base),
                                  static=static)
    else:
      grads = _dkdv_consume(own_k, own_v, q_ring, do_ring, stats_ring,
                            arrived, consumed, walk=walk,
                            tile_mask=tile_mask, static=static, base=base,
                            fused=fused, wg=wg, q_of=q_of, resident=resident,
                            head_values=head_values, positions=positions,
                            alibi_terms=terms_of, kept_of=kept_of,
                            bias_of=bias_of)
    if fused is not None:
      # The other consumers' last dQ pieces read this one's K rows: every
      # consumer is past them before any overwrites its K with dK (a race
      # found by reading, never seen in a GPU test).
      compat.named_barrier("sync", PIECES_DONE_BARRIER,
                           static.num_consumers * THREADS_PER_WARPGROUP)
    # K and V are dead: write the gradients through their buffers.
    staged = {"dk": "k", "dv": "v"}
    for name, grad in zip(static.outputs, grads):
      views[staged[name]].mma.at[wg][...] = grad.astype(static.dtype)
    plgpu.commit_smem()
    for name in static.outputs:
      copy_rows_out(views[staged[name]].at[wg],
                    out_refs[name].at[batch, kv_rows, kv_head])
    # Persistent: the next tile's K and V may load once these have left.
    plgpu.wait_smem_to_gmem(0, wait_read_only=base is not None)

  def _shared_consumer(c: int):
    kv_rows = pl.ds(tile_start, static.block_kv)
    columns = column_part(c, static)
    # On a persistent grid, once its own stores from them have left (see
    # the end).
    load_column_parts(c, ((k_ref, k_smem, k_arrived),
                           (v_ref, v_smem, v_arrived)),
                      batch=batch, rows=kv_rows, head=kv_head, static=static)
    walk = Walk(first, per_head,
                dkdv_causal_runs(tile_start, first, static), None)
    grads = dkdv_consume_shared(
        c, k_smem, v_smem, q_ring, do_ring, stats_ring, arrived, consumed,
        scratch[11:], walk=walk, kv_start=tile_start, static=static,
        base=base)
    # Every consumer is past its last step (`dkdv_consume_shared`), so K
    # and V are dead: each writes its columns of dK and dV through its
    # parts of them.
    staged = {"dk": k_smem.at[c], "dv": v_smem.at[c]}
    for name, grad in zip(static.outputs, grads):
      staged[name][...] = grad.astype(static.dtype)
    plgpu.commit_smem()
    for name in static.outputs:
      plgpu.copy_smem_to_gmem(
          staged[name], out_refs[name].at[batch, kv_rows, kv_head, columns])
    plgpu.wait_smem_to_gmem(0, wait_read_only=base is not None)

  def q_tile_of(step, union_first, union_per_head):
    # Step -> (query head of the group, Q tile) for the union of Q tiles
    # [union_first, union_first + union_per_head) per head; union_per_head
    # > 0 whenever there is a step.
    divisor = jnp.maximum(union_per_head, 1)
    g, i = lax.div(step, divisor), lax.rem(step, divisor)
    head = kv_head * static.group + g
    q_block = (union_first + i if fused is None
               else _fused_q_block(i, first=first, static=static))
    return head, q_block

  def _producer():
    if plan is None:
      union_first, union_per_head, union_steps = first, per_head, num_steps
    else:
      walk = ranged_walk(plan, static.num_consumers, consumer=False)
      union_first, union_per_head = walk.first, walk.num_blocks
      union_steps = static.group * union_per_head

    def q_rows_of(step):
      head, q_block = q_tile_of(step, union_first, union_per_head)
      return head, pl.ds(q_block * static.block_q, static.block_q)

    def tile(ref):
      def source(step):
        head, rows = q_rows_of(step)
        return ref.at[batch, rows, head]
      return source

    def stats_tile(step):
      head, rows = q_rows_of(step)
      return stats_ref.at[batch, head, :, rows]

    streams = [(tile(q_ref), views["q"], q_arrived),
               (tile(do_ref), views["do"], do_arrived),
               (stats_tile, RowViews.plain(stats_ring), stats_arrived)]
    if ids is not None:  # query ids travel with their Q tiles
      streams.append((lambda step: ids.streamed_gmem.at[q_rows_of(step)[1]],
                      RowViews.plain(ids.ring), ids.ring_arrived))
    produce(streams, consumed, union_steps, static, base=base)

  def _writer():
    batch_size, _, num_heads, _ = q_ref.shape
    turns = pl.get_global(plgpu.SemaphoreType.REGULAR(
        (batch_size * num_heads * static.num_q_blocks,)))
    write_dq(fused._replace(turns=turns), batch=batch, order=kv_tile,
             num_steps=num_steps, static=static,
             head_and_block=functools.partial(
                  q_tile_of, union_first=first, union_per_head=per_head))

  if consumer:
    _consumer()
  elif fused is None:
    _producer()
  else:
    pl.when(wg == static.num_consumers)(_producer)
    pl.when(wg == static.num_consumers + 1)(_writer)
  return num_steps


def _head_values(values, g, *, batch, kv_head, slope_of,
                 static: BackwardStatic):
  """`values` of query head g of K/V head `kv_head`'s group: its ALiBi
  slope (`slope_of(head)`, or None without ALiBi) and, for `mask_fn` and
  `score_fn`, their (batch, head) arguments."""
  head = kv_head * static.group + g
  if slope_of is not None:  # each query head of the group has its own
    values = values._replace(alibi_slope=slope_of(head))
  if static.ranged and static.spec.reads_batch_and_head:
    values = values._replace(batch=batch, head=head)
  return values


def _group_tiles_t(tiles: ScoreTiles, steps, *, wg, kv_rows, kv_head,
                   static: BackwardStatic):
  """`read(i, g)`: the [block_kv, block_q] tile of a transposed bias or
  dense mask for consumer `wg`'s K/V rows, Q tile i and query head g of
  the group, for the steps (first, next_of, end) of each head's walk, in
  the walk's order (head after head; `common.chained_tiles` over
  positions g * num_q_blocks + i)."""
  stride = static.num_q_blocks
  first_i, next_i, hi = steps
  end = static.group * stride

  def next_of(position):
    g, i = lax.div(position, stride), lax.rem(position, stride)
    following = next_i(i)
    return jnp.where(following < hi, g * stride + following,
                     (g + 1) * stride + first_i)

  def source(position):
    g, i = lax.div(position, stride), lax.rem(position, stride)
    return tiles.source(kv_head * static.group + g, kv_rows,
                        i * static.block_q, static.block_q)

  read = chained_tiles(tiles.smem.at[wg], tiles.arrived.at[wg], source,
                       first=jnp.where(first_i < hi, first_i, end),
                       next_of=next_of, end=end)
  return lambda i, g: read(g * stride + i)


def _dropout_kept_t(q_block, g, *, seed, batch, kv_head, key_hashes,
                    static: BackwardStatic):
  """Dropout's kept weights of the Sᵀ tile of Q tile `q_block` of query
  head g of the group (keys down the rows, their hashes given)."""
  query_hashes = dropout_query_hashes(
      seed, batch, kv_head * static.group + g, q_block * static.block_q,
      static.block_q, plgpu.Layout.WGMMA.reduce(0))
  return dropout_kept(query_hashes, key_hashes,
                      (static.block_kv, static.block_q),
                      static.spec.dropout_rate, transposed=True)


def _fused_q_block(i, *, first, static: BackwardStatic):
  """The Q tile of position i of a fused dK/dV tile's walk over Q tiles
  [first, num_q_blocks): in order, or under causal masking from the last
  down. Each K/V tile adds to a Q tile's dQ after the one before it
  (`FusedDq`); walking down, every K/V tile reaches a Q tile at the same
  step, so that each needs only to trail the one before it by a step, as
  without a mask. Walking up, tile j would start at Q tile 2j, two steps
  before tile j - 1 reaches it, and so wait: the more, the later j."""
  if static.is_causal:
    return static.num_q_blocks - 1 - i
  return first + i


def _fused_runs(kv_start, first, static: BackwardStatic):
  """The fused kernel's runs over walk positions [0, num_q_blocks - first)
  (`_fused_q_block`) for K/V rows from kv_start. A consumer computes every
  step, its rows' or not (the pieces of dQ it computes need both
  consumers' dSᵀ): under causal masking, first the Q tiles wholly below the
  diagonal for these rows, then those at or above it, masked (wholly: to a
  zero dS)."""
  if not static.is_causal:
    return ((0, static.num_q_blocks, UNMASKED),)
  unmasked = static.num_q_blocks - first_unmasked_q_block(kv_start, static)
  return ((0, unmasked, UNMASKED),
          (unmasked, static.num_q_blocks - first, MASKED))


def _dkdv_consume(k_smem, v_smem, q_ring, do_ring, stats_ring, arrived,
                  consumed, *, walk: Walk, tile_mask, static: BackwardStatic,
                  base=None, fused: FusedDq | None = None, wg=None,
                  q_of=None, resident=None, head_values=None,
                  positions=None, alibi_terms=None, kept_of=None,
                  bias_of=None):
  """Consumer: dK, dV (f32, unscaled dK) of its `block_kv` K/V rows.

  Walks the producer's steps: for each query head of the group, Q tiles
  [walk.first, walk.first + walk.num_blocks), treated as `walk.runs` say
  (skipped, masked by `tile_mask(q_block, slot, values, g)`, or unmasked;
  `values` the step's head's `masking.MaskValues`). Persistent:
  the ring slots count on from `base`. Fused dQ (`fused`): each step also
  issues consumer `wg`'s piece of the CTA's dS K for the step before
  (`issue_dq_piece`), and the walk's positions are Q tiles
  `q_of(position)`. `resident` (`BackwardStatic.opaque_resident`): called
  each step, returns that step's views of the K and V rows and the zero
  that offsets them. Ranged: `head_values(g)` (ALiBi, `mask_fn`,
  `score_fn`) the `masking.MaskValues` of query head g of the group (else
  `walk.values`), `positions(q_block)` the Sᵀ tile's (q_idx, kv_idx),
  `alibi_terms(q_block)` (`static.alibi_columns`) its ALiBi terms'
  function (`pipeline.tile_probabilities`),
  `kept_of(q_block, g)` dropout's kept weights of the Sᵀ tile of query
  head g, or None, `bias_of(q_block, g)` its bias tile (each computed
  step's, in order), or None.
  """
  slot_of = ring_slot(static, base)
  zeros = plgpu.layout_cast(
      jnp.zeros((static.block_kv, static.head_dim), jnp.float32),
      plgpu.Layout.WGMMA)
  grads = tuple(zeros for _ in static.outputs)

  def step_body(i, grads, *, head_base, group_index, masked):
    step = head_base + i
    q_block = i if q_of is None else q_of(i)
    slot = slot_of(step)
    k_rows, v_rows, offset = (k_smem, v_smem, 0) if resident is None else (
        resident())
    for barrier in arrived:
      plgpu.barrier_wait(barrier.at[slot])
    q_tile, do_tile = q_ring.at[slot], do_ring.at[slot]
    products = [(k_rows, q_tile.transpose((1, 0)))]          # Sᵀ = K Qᵀ
    if "dk" in static.outputs:
      products.append((v_rows, do_tile.transpose((1, 0))))   # dPᵀ = V dOᵀ
    # Row statistic n (0: lse, 1: delta) of the step's Q rows, read from
    # the ring when the step needs it, lse up front with `prefetch_lse`.
    column_stat = functools.partial(column_statistic, stats_ring, slot)
    lse_log2 = column_stat(0) if static.prefetch_lse else None

    def probabilities(s_t):
      """(Pᵀ, its slope); with dropout Pᵀ's dropped weights negated
      (`pipeline.dropped_in_sign`) where `kept_of` says, hashed here,
      after Sᵀ is read, while dPᵀ's wgmma runs (benchmarks/NOTES.md,
      "Dropout's hash after S")."""
      lse = column_stat(0) if lse_log2 is None else lse_log2
      values = (walk.values if head_values is None
                else head_values(group_index))
      if bias_of is not None:
        values = values._replace(
            bias=bias_of(q_block, group_index).astype(jnp.float32))
      p_t, slope = tile_probabilities(
          s_t, lse, per_column, values, static,
          positions=lambda: positions(q_block),
          alibi_terms=None if alibi_terms is None else alibi_terms(q_block))
      if masked:
        p_t = jnp.where(tile_mask(q_block, slot, values, group_index), p_t,
                        0.0)
      kept = None if kept_of is None else kept_of(q_block, group_index)
      return dropped_in_sign(p_t, kept), slope

    store_ds = None
    if fused is not None:  # this step's dSᵀ, for every consumer to read
      ds_smem = fused.ds.at[lax.rem(step, 2), wg]

      def store_ds(ds_t):
        # Every consumer's piece of step - 2 has read the buffer.
        pl.when(step >= 2)(functools.partial(
            plgpu.barrier_wait, fused.ds_read.at[lax.rem(step, 2)]))
        ds_smem[...] = ds_t
    shape = (static.block_kv, static.block_q)
    if static.overlap_softmax:
      first, dv_operand = probabilities, None
      if static.cap_slope_ahead:
        first = functools.partial(_weights_and_sloped, probabilities, static)
      first_value, *dp_t = wgmma_then(shape, products, first)
      if static.cap_slope_ahead:  # Pᵀ ∘ slope in dS, dV's Pᵀ ready
        (dv_operand, p_t), slope = first_value, None
      else:
        p_t, slope = first_value
      piece = None
      if fused is not None:
        piece = functools.partial(issue_dq_piece, fused, wg, step=step,
                                  static=static, offset=offset)
      grads = _dkdv_accumulate_overlapped(
          grads, p_t, dp_t, slope, q_tile, do_tile, stats_ring.at[slot],
          static, store_ds=store_ds, piece=piece, dv_operand=dv_operand)
      plgpu.barrier_arrive(consumed.at[slot])
      if piece is not None:
        *grads, piece_value = grads
        stage_dq_piece(fused, wg, piece_value, step=step)
      return tuple(grads)
    s_t, *dp_t = wgmma_fresh(shape, products)
    p_t, slope = probabilities(s_t)
    updates = []
    for name in static.outputs:
      if name == "dv":
        weights = kept_weights(p_t, static.dropout)
        updates.append((weights.astype(static.dtype), do_tile))  # dV += Pᵀ dO
      else:
        ds_t = score_gradient(
            p_t, dp_t[0],
            per_column(dropout_delta(column_stat(1), static), s_t.shape),
            slope, static.dropout)
        updates.append((ds_t.astype(static.dtype), q_tile))  # dK += dSᵀ Q
    grads = wgmma_accumulate(grads, updates)
    plgpu.barrier_arrive(consumed.at[slot])
    return grads

  grads = walk_group(walk, step_body, arrived, consumed, slot_of, static,
                     grads)
  if fused is not None:  # the last step's pieces
    last = static.group * walk.num_blocks - 1 - walk.first
    offset = 0 if resident is None else resident()[2]
    pl.when(last >= 0)(functools.partial(
        stage_dq_pieces, fused, wg, step=last, static=static, offset=offset))
  factors = {"dk": ds_scale(static)}
  if static.dropout:  # the kept weights' 1 / (1 - rate), once
    factors["dv"] = keep_scale(static)
  return tuple(grad * factors[name] if name in factors else grad
               for name, grad in zip(static.outputs, grads))


def _weights_and_sloped(probabilities, static: BackwardStatic, s_t):
  """`cap_slope_ahead`'s step: (dV's 16-bit Pᵀ, Pᵀ ∘ slope) of
  `probabilities(s_t)`, 48 float32 registers a thread across dPᵀ's wait
  instead of Pᵀ's and the slope's 64."""
  p_t, slope = probabilities(s_t)
  return (kept_weights(p_t, static.dropout).astype(static.dtype),
          p_t * slope)


def _dkdv_accumulate_overlapped(grads, p_t, dp_t, slope, q_tile, do_tile,
                                stats, static: BackwardStatic, store_ds=None,
                                piece=None, dv_operand=None):
  """`grads` (in `static.outputs` order) plus this step's dV += Pᵀ dO and
  dK += dSᵀ Q, with dV's wgmma issued first, so that dS is computed while
  it runs. `dp_t` is [dPᵀ] when dK is an output, else []; `stats` is the
  step's [2, block_q] (lse, delta) slot, whose delta is read here;
  `store_ds` (fused dQ) takes dSᵀ while dK's wgmma runs. `piece(acc_ref)`
  (fused dQ) issues a [DQ_PIECE, DQ_PIECE] product after them, into a
  fresh accumulator returned after the gradients, all waited for at
  once. With dropout `p_t` carries the dropped weights negated
  (`pipeline.dropped_in_sign`). `dv_operand` (`cap_slope_ahead`): dV's
  16-bit Pᵀ, taken before, `p_t` then Pᵀ ∘ slope and `slope` None."""
  accs = [plgpu.ACC.init(grad) for grad in grads]
  if piece is not None:
    accs.append(plgpu.ACC.init(plgpu.layout_cast(
        jnp.zeros((DQ_PIECE, DQ_PIECE), jnp.float32), plgpu.Layout.WGMMA)))

  def issue(acc_refs):
    grad_refs = acc_refs[:len(grads)]
    named = dict(zip(static.outputs, grad_refs))
    if "dv" in named:
      wgmma(named["dv"],
            kept_weights(p_t, static.dropout).astype(static.dtype)
            if dv_operand is None else dv_operand, do_tile)
    if "dk" in named:
      delta = dropout_delta(
          plgpu.layout_cast(stats[1], plgpu.Layout.WGMMA.reduce(0)), static)
      ds_t = score_gradient(p_t, dp_t[0], per_column(delta, p_t.shape),
                            slope, static.dropout)
      ds_t = ds_t.astype(static.dtype)
      wgmma(named["dk"], ds_t, q_tile)
      if store_ds is not None:
        store_ds(ds_t)
    if piece is not None:
      piece(acc_refs[-1])

  return pl.run_state(issue)(tuple(accs))


def _dkdv_consume_ahead(k_rows, v_rows, q_ring, do_ring, stats_ring,
                        arrived, consumed, *, num_steps, slot_of,
                        static: BackwardStatic):
  """Consumer: (dK scaled, dV), f32, of its `block_kv` K/V rows over
  `num_steps` unmasked steps (step i in ring slot `slot_of(i)`), each
  step's Sᵀ issued before the step before has seen its dK done
  (`BackwardStatic.scores_ahead`, `walk_scores_ahead`).

  A step's products are Sᵀ = K Qᵀ and dPᵀ = V dOᵀ ([block_kv, block_q]),
  then dV += Pᵀ dO and dK += dSᵀ Q. The arithmetic is `_dkdv_consume`'s
  (overlapped) to the bit: lse is read once Sᵀ is done (before it, with
  `prefetch_lse`), delta once dV is issued.
  """
  column_stat = functools.partial(column_statistic, stats_ring)

  def with_accumulators(s_ref, dp_ref, dk_ref, dv_ref):
    def products(slot):
      return ((k_rows, q_ring.at[slot].transpose((1, 0))),
              (v_rows, do_ring.at[slot].transpose((1, 0))))

    def probabilities(slot, wait_scores):
      lse_log2 = column_stat(slot, 0) if static.prefetch_lse else None
      s_t = wait_scores()
      if lse_log2 is None:
        lse_log2 = column_stat(slot, 0)
      return tile_probabilities(s_t, lse_log2, per_column, None, static)[0]

    def gradients(slot, p_t, dp_t):
      wgmma(dv_ref, p_t.astype(static.dtype), do_ring.at[slot])
      delta = column_stat(slot, 1)
      ds_t = score_gradient(p_t, dp_t, per_column(delta, p_t.shape), None)
      return wgmma(dk_ref, ds_t.astype(static.dtype), q_ring.at[slot])

    walk_scores_ahead(s_ref, dp_ref, num_steps=num_steps, arrived=arrived,
                      consumed=consumed, slot_of=slot_of, products=products,
                      probabilities=probabilities, gradients=gradients)
    dk = plgpu.wgmma_accumulator_load(dk_ref, wait_n=0)
    return dk * static.scale, plgpu.wgmma_accumulator_load(dv_ref, wait_n=0)

  scores = (static.block_kv, static.block_q)
  shape = (static.block_kv, static.head_dim)
  return pl.run_scoped(with_accumulators, plgpu.ACC(scores, jnp.float32),
                       plgpu.ACC(scores, jnp.float32),
                       plgpu.ACC(shape, jnp.float32),
                       plgpu.ACC(shape, jnp.float32))


def walk_scores_ahead(s_ref, dp_ref, *, num_steps: int, arrived, consumed,
                      slot_of, products, probabilities, gradients):
  """A dK/dV consumer's `num_steps` unmasked steps, each step's scores
  issued before the step before has seen its gradients done
  (`BackwardStatic.scores_ahead`).

  A step issues Sᵀ (into `s_ref`) and dPᵀ (`dp_ref`), the two
  `products(slot)` ((a, b) pairs: Sᵀ = a b), computes
  Pᵀ = `probabilities(slot, wait_scores)` (`wait_scores()` waits for Sᵀ
  and returns it, while dPᵀ runs), reads dPᵀ, and issues its two gradient
  products, dV then dK (`gradients(slot, p, dp)`, returning dK's count of
  wgmmas, `rows.wgmma`: the waits below count wgmmas). Step t + 1's Sᵀ is
  issued right after those, once its tiles have arrived and dV_t is done
  (its 16-bit Pᵀ operand's registers: with them held, ptxas serialized
  every wgmma for registers, C7512), so the tensor cores run
  it as soon as dK_t is done, not after this warpgroup has seen that,
  released the slot and issued it. Then the warpgroup waits for dK_t
  (wgmmas complete in issue order: Sᵀ may still run), releases the slot
  and issues dPᵀ.

  The loop turns after dPᵀ is read, where no wgmma is in flight: with the
  gradients' or Sᵀ's accumulators in flight across the back edge, ptxas
  serialized every wgmma of the kernel (C7514). In flight
  together are at most dK_t, its 16-bit dSᵀ_t operand and Sᵀ_{t+1}.
  Returns once every wgmma is done and the last slot is released.
  """
  zeros = lambda: plgpu.layout_cast(jnp.zeros(s_ref.shape, jnp.float32),
                                    plgpu.Layout.WGMMA)

  def scores(step, *, fresh: bool, before_dp=None, dk_issued: int = 0):
    """Step's (Pᵀ, dPᵀ); nothing in flight after. Not `fresh`: the
    accumulators hold the step before's, and its dV and dK (`dk_issued`
    wgmmas) may run."""
    slot = slot_of(step)
    for barrier in arrived:
      plgpu.barrier_wait(barrier.at[slot])
    (s_a, s_b), (dp_a, dp_b) = products(slot)
    if not fresh:
      plgpu.wgmma_wait(dk_issued)  # dV of the step before
      s_ref[...] = zeros()
    s_issued = wgmma(s_ref, s_a, s_b)
    if before_dp is not None:
      before_dp(s_issued)
    if not fresh:
      dp_ref[...] = zeros()
    dp_issued = wgmma(dp_ref, dp_a, dp_b)
    p = probabilities(slot, lambda: plgpu.wgmma_accumulator_load(
        s_ref, wait_n=dp_issued))
    return p, plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)

  def release(step):
    plgpu.barrier_arrive(consumed.at[slot_of(step)])

  def step_body(t, carry):
    dk_issued = gradients(slot_of(t), *carry)

    def gradients_done(s_issued):  # dK_t; Sᵀ of step t + 1 may still run
      plgpu.wgmma_wait(s_issued)
      release(t)
    return scores(t + 1, fresh=False, before_dp=gradients_done,
                  dk_issued=dk_issued)

  carry = lax.fori_loop(0, num_steps - 1, step_body, scores(0, fresh=True))
  gradients(slot_of(num_steps - 1), *carry)
  plgpu.wgmma_wait(0)
  release(num_steps - 1)
