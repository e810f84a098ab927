"""The forward on a persistent grid: one CTA per SM computes its query tiles
one after another (`persistent_kernel`), in the plain form and the ranged
(masked) one.

Against the launch grid (a CTA a tile) it saves each tile's prologue and
epilogue: a tile's Q load and O store overlap its neighbours' work, and
the K/V ring never drains between tiles. The producer streams the tiles'
K/V blocks through the ring as one running count `base`: block base + j
of a tile goes to slot (base + j) % num_stages, so every barrier's phases
run on across tiles. Both consumers wait for and release every block, so
that the producer always waits for both.

Which tiles a CTA computes:

  plain    `persistent_tiles`: each head's query tiles, paired first with
           last under causal masking (`common.persistent_schedule`).
  ranged   plan rows of every (batch, head, tile), sorted by cost and
           dealt out forwards and backwards (`masked.persistent_plan`,
           `_PlanRows`): about even shares whatever the mask, where the
           causal pairs leave a window's or documents' CTAs unevenly
           loaded (benchmarks/NOTES.md). Each warpgroup copies its next
           tile's plan row into the other of its two plan buffers while it
           computes this one, so that the next tile's Q (the consumers)
           and K/V blocks (the producer) are issued without waiting for
           it; a consumer loads the next tile's query ids and ALiBi
           slopes with its Q. The ring holds the blocks of each plan's
           union [first, total); bias and dense-mask tiles stream per
           tile, as on the launch grid.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.mosaic import turns
from pallas_kernels.mosaic.common import (
    PLAN_BATCH, PLAN_HEAD, PLAN_TILE, PLAN_UNION, SlopeRows, copy_slopes,
    persistent_schedule, register_split, slope_reader)
from pallas_kernels.mosaic.forward_kernel import (
    Tile, consume, consumer_rows, kernel_refs, load_kv_block, mask_operands,
    num_kv_steps, segment_refs_of, _kv_rows)
from pallas_kernels.mosaic.forward_static import KernelStatic
from pallas_kernels.mosaic.rows import RowViews, copy_rows_in


class _PersistentTiles(NamedTuple):
  """The plain forward's persistent schedule, in query rows."""
  count: Any    # tiles this CTA computes
  tile_of: Any  # n -> (batch, head, first query row) of its n-th tile
  blocks: Any   # first query row -> K/V blocks the tile streams


def persistent_tiles(q_shape, static: KernelStatic, cta) -> _PersistentTiles:
  """Which query tiles CTA `cta` computes (`persistent_schedule`; under
  causal masking query tile i reads i + 1 blocks, so tiles go in pairs)."""
  batch_size, q_len, num_heads, _ = q_shape
  tile_rows = static.tile_rows
  schedule = persistent_schedule(
      num_tiles=pl.cdiv(q_len, tile_rows), num_heads=num_heads,
      batch=batch_size, paired=static.is_causal, num_ctas=static.num_ctas,
      cta=cta)

  def tile_of(n):
    batch, head, q_tile = schedule.tile_of(n)
    return batch, head, q_tile * tile_rows

  def blocks(tile_start):  # the last consumer's rows reach furthest
    return num_kv_steps(
        consumer_rows(tile_start, static.num_consumers - 1, static), static)

  return _PersistentTiles(schedule.count, tile_of, blocks)


class _PlanRows:
  """The ranged form's plan rows on the persistent grid
  (`masked.persistent_plan`: one per (batch, head, tile), sorted by
  descending cost): CTA `cta` of N takes rows cta, 2N - 1 - cta, 2N + cta,
  ... (dealt forwards, then backwards). Warpgroup w holds its n-th in
  buffer (n % 2) * warpgroups + w: `fetch(n, w)` issues its copy,
  `wait(n, w)` waits for it (once a copy), `read(n, w)` reads it."""

  def __init__(self, refs, static: KernelStatic, cta):
    self._refs, self._static, self._cta = refs, static, cta
    self._warpgroups = static.num_consumers + 1
    total, num_ctas = refs.plan.shape[0], static.num_ctas
    rounds, rest = divmod(total, num_ctas)
    # The last, partial round goes forwards after an even number of
    # rounds, backwards after an odd one.
    last = cta < rest if rounds % 2 == 0 else cta >= num_ctas - rest
    self.count = rounds + jnp.where(last, 1, 0)

  def _row(self, n):
    num_ctas = self._static.num_ctas
    dealt = jnp.where(lax.rem(n, 2) == 0, self._cta,
                      num_ctas - 1 - self._cta)
    return n * num_ctas + dealt

  def _buffer(self, n, w):
    return lax.rem(n, 2) * self._warpgroups + w

  def fetch(self, n, w):
    smem, arrived = self._refs.plan_rows
    buffer = self._buffer(n, w)
    plgpu.copy_gmem_to_smem(self._refs.plan.at[self._row(n)],
                            smem.at[buffer], arrived.at[buffer])

  def wait(self, n, w):
    plgpu.barrier_wait(self._refs.plan_rows[1].at[self._buffer(n, w)])

  def read(self, n, w):
    row = self._refs.plan_rows[0].at[self._buffer(n, w)]
    return lambda i: row[i]


def persistent_kernel(*refs, static: KernelStatic):
  """The plain or ranged kernel on a persistent grid of `num_ctas` CTAs;
  refs as `forward_kernel.kernel_refs` names them (no FP8).

  A consumer issues the next tile's Q load as soon as its Q is dead, and
  leaves each O store in flight until its buffer is needed again. Under
  plain causal masking warpgroup 0 passes through the blocks only
  warpgroup 1 reads; the ranged consumers walk each plan's whole union.
  """
  refs = kernel_refs(refs, static)
  ranged = static.ranged
  q_ref, k_ref, v_ref = refs.q, refs.k, refs.v
  (q_smem, k_smem, v_smem, lse_smem, q_arrived, k_arrived, v_arrived,
   k_consumed, v_consumed, pingpong) = refs.common
  q_smem, k_smem, v_smem = (RowViews.of(x, static)
                            for x in (q_smem, k_smem, v_smem))
  o_smem = q_smem
  if static.stage_o_apart:
    o_smem = RowViews.of(refs.o_apart[0], static)
    lse_smem = refs.o_apart[1]
  stages = static.num_stages
  cta = lax.axis_index("cta")
  if ranged:
    plans = _PlanRows(refs, static, cta)
    count = plans.count
  else:
    tiles = persistent_tiles(q_ref.shape, static, cta)
    count = tiles.count
  wg = lax.axis_index("wg")

  def tile_of(n, w):
    """(batch, head, first query row, plan reader or None) of tile n; a
    ranged tile's plan row must have been waited for."""
    if not ranged:
      return (*tiles.tile_of(n), None)
    read = plans.read(n, w)
    return (read(PLAN_BATCH), read(PLAN_HEAD),
            read(PLAN_TILE) * static.tile_rows, read)

  def fetch_next(n, w):
    """Ranged: tile n + 1's plan row on its way, while n computes."""
    if ranged:
      pl.when(n + 1 < count)(lambda: plans.fetch(n + 1, w))

  consumer_registers, producer_registers = register_split(
      lean=False, num_consumers=static.num_consumers)

  @pl.when(wg < static.num_consumers)
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    turns.seed_turns(pingpong, wg, static)

    def load_q(n):
      """Tile n's Q rows; a ranged tile's query ids and ALiBi slopes too
      (`consume` waits for them), once the last tile's reads of their
      buffers are fenced from the copies."""
      if ranged:
        plans.wait(n, wg)
      batch, head, tile_start, _ = tile_of(n, wg)
      rows = pl.ds(consumer_rows(tile_start, wg, static), static.block_q)
      copy_rows_in(q_ref.at[batch, rows, head], q_smem.at[wg],
                   q_arrived.at[wg])
      masks = mask_operands(refs, static, batch) if ranged else {}
      segments, slopes = masks.get("segments"), masks.get("slopes")
      if segments is not None or slopes is not None:
        plgpu.commit_smem()
      if segments is not None:
        plgpu.copy_gmem_to_smem(segments.q_gmem.at[rows],
                                segments.q_smem.at[wg],
                                segments.q_arrived.at[wg])
      if slopes is not None:
        copy_slopes(slopes, wg)

    if ranged:
      plans.fetch(0, wg)
    load_q(0)
    sink_of = None
    if static.sinks:  # every head's, once: a tile reads its own
      sinks = SlopeRows(refs.sinks, *refs.sink_rows)
      copy_slopes(sinks, wg)
      sink_of = slope_reader(sinks, wg)

    def tile_body(n, base):
      fetch_next(n, wg)
      batch, head, tile_start, read = tile_of(n, wg)
      tile = Tile(base=base,
                  load_next_q=lambda: pl.when(n + 1 < count)(
                      lambda: load_q(n + 1)),
                  o_smem=o_smem.at[wg])
      masks = mask_operands(refs, static, batch) if ranged else {}
      consume(q_ref, refs.out, refs.lse, q_smem.at[wg], k_smem, v_smem,
              lse_smem.at[wg], q_arrived.at[wg], k_arrived, v_arrived,
              k_consumed, v_consumed, turns.turns_of(pingpong, static),
              batch=batch, head=head, wg=wg,
              tile_start=None if ranged else tile_start, static=static,
              fp8=None, plan=read, tile=tile, sink_of=sink_of, **masks)
      if not ranged:
        return base + tiles.blocks(tile_start)
      return base + read(PLAN_UNION + 1) - read(PLAN_UNION)

    lax.fori_loop(0, count, tile_body, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == static.producer)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")
    if ranged:
      plans.fetch(0, static.producer)

    def tile_body(n, base):
      segments = None
      if ranged:
        plans.wait(n, static.producer)
        fetch_next(n, static.producer)
      batch, head, tile_start, read = tile_of(n, static.producer)
      kv_head = lax.div(head, static.group)
      if ranged:
        first, total = read(PLAN_UNION), read(PLAN_UNION + 1)
        segments = segment_refs_of(refs, batch)
      else:
        first, total = 0, tiles.blocks(tile_start)

      @pl.loop(first, total)
      def _step(step):
        block = base + step if not ranged else base + step - first
        slot = lax.rem(block, stages)
        rows = (_kv_rows(step, static) if ranged
                else pl.ds(step * static.block_kv, static.block_kv))
        # K before V, as in `forward_kernel._produce`; a slot is refilled
        # once both consumers have released the block `stages` earlier.
        for ref, smem, arrived, consumed in (
            (k_ref, k_smem, k_arrived, k_consumed),
            (v_ref, v_smem, v_arrived, v_consumed)):
          @pl.when(block >= stages)
          def _wait(consumed=consumed):
            for w in range(static.num_consumers):
              plgpu.barrier_wait(consumed.at[w * stages + slot])

          load_kv_block(rows, slot, ref, smem, arrived, k_ref=k_ref,
                        batch=batch, kv_head=kv_head, static=static,
                        segments=segments)

      return base + total - first if ranged else base + total

    lax.fori_loop(0, count, tile_body, jnp.int32(0))
