"""The plain forward on a persistent grid: one CTA per SM computes its query
tiles one after another (`persistent_kernel`).

Against the launch grid (a CTA a tile) it saves each tile's prologue and
epilogue: a tile's Q load and O store overlap its neighbours' work, and
the K/V ring never drains between tiles. The producer streams the tiles'
K/V blocks through the ring as one running count `base`: block base + j
of a tile goes to slot (base + j) % num_stages, so every barrier's phases
run on across tiles. Both consumers wait for and release every block, so
that the producer always waits for both. Which tiles a CTA computes:
`persistent_tiles`, each head's query tiles, paired first with last under
causal masking (`common.persistent_schedule`). (The masked forward on this
grid lost to its launch grid: benchmarks/NOTES.md, "The masked forward on
the persistent grid".)
"""
from __future__ import annotations

from typing import Any, NamedTuple

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.mosaic import turns
from pallas_kernels.mosaic.common import (
    SlopeRows, copy_slopes, persistent_schedule, register_split,
    slope_reader)
from pallas_kernels.mosaic.forward_kernel import (
    Fp8Refs, Tile, consume, consumer_rows, kernel_refs, load_kv_block,
    num_kv_steps)
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


def persistent_kernel(*refs, static: KernelStatic):
  """The plain kernel on a persistent grid of `num_ctas` CTAs; refs as
  `forward_kernel.kernel_refs` names them (no ALiBi). FP8: each tile copies
  its (batch, head)'s descale row (`consume`), and O leaves through the FP8
  kernel's own O buffer, never Q's (`stage_o_apart` off).

  A consumer issues the next tile's Q load as soon as its Q is dead, and
  leaves each O store in flight until its buffer is needed again. Under
  causal masking warpgroup 0 passes through the blocks only warpgroup 1
  reads.
  """
  refs = kernel_refs(refs, static)
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
  tiles = persistent_tiles(q_ref.shape, static, cta)
  count = tiles.count
  wg = lax.axis_index("wg")

  consumer_registers, producer_registers = register_split(
      lean=False, num_consumers=static.num_consumers)

  @pl.when(wg < static.num_consumers)
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    turns.seed_turns(pingpong, wg, static)

    def load_q(n):
      """Tile n's Q rows."""
      batch, head, tile_start = tiles.tile_of(n)
      rows = pl.ds(consumer_rows(tile_start, wg, static), static.block_q)
      copy_rows_in(q_ref.at[batch, rows, head], q_smem.at[wg],
                   q_arrived.at[wg])

    load_q(0)
    sink_of = None
    if static.sinks:  # every head's, once: a tile reads its own
      sinks = SlopeRows(refs.sinks, *refs.sink_rows)
      copy_slopes(sinks, wg)
      sink_of = slope_reader(sinks, wg)

    def tile_body(n, base):
      batch, head, tile_start = tiles.tile_of(n)
      tile = Tile(base=base,
                  load_next_q=lambda: pl.when(n + 1 < count)(
                      lambda: load_q(n + 1)),
                  o_smem=o_smem.at[wg])
      fp8 = None
      if static.fp8:
        fp8_o, descale_smem, descale_arrived = refs.fp8
        fp8 = Fp8Refs(refs.descale.at[batch, head], descale_smem.at[wg],
                      descale_arrived.at[wg], fp8_o.at[wg])
      consume(q_ref, refs.out, refs.lse, q_smem.at[wg], k_smem, v_smem,
              lse_smem.at[wg], q_arrived.at[wg], k_arrived, v_arrived,
              k_consumed, v_consumed, turns.turns_of(pingpong, static),
              batch=batch, head=head, wg=wg, tile_start=tile_start,
              static=static, fp8=fp8, plan=None, tile=tile,
              sink_of=sink_of,
              ones=None if refs.ones is None else refs.ones.at[wg])
      return base + tiles.blocks(tile_start)

    lax.fori_loop(0, count, tile_body, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == static.producer)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")

    def tile_body(n, base):
      batch, head, tile_start = tiles.tile_of(n)
      kv_head = lax.div(head, static.group)
      total = tiles.blocks(tile_start)

      @pl.loop(0, total)
      def _step(step):
        block = base + step
        slot = lax.rem(block, stages)
        rows = pl.ds(step * static.block_kv, static.block_kv)
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
                        segments=None)

      return base + total

    lax.fori_loop(0, count, tile_body, jnp.int32(0))
