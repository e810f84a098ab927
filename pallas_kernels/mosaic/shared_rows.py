"""The dK/dV kernel's consumers on shared K/V rows (head_dim above 128).

Two f32 accumulators dK and dV of [64, 256] are 256 registers a thread (of
[64, 160], 160): one consumer cannot hold both beside its score tiles.
With shared rows the CTA keeps one copy of its `block_kv` K/V rows, in
column halves, and its two consumers divide the work of each streamed
step: consumer c computes Sᵀ and dPᵀ for its half of
the step's Q rows, stores its halves of Pᵀ and dSᵀ in shared memory
(`Exchange`), and sums dK and dV for its half of the head_dim columns from
both consumers' halves, in the order one consumer owning all the columns
would. One pass with two consumers where two passes (dK, dV) with one
would run: 310 / 312 -> 352 / 346 TFLOP/s full / causal at 16k
(h200_mosaic_shared_dkdv.md).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic.common import per_column, swizzled
from pallas_kernels.mosaic.pipeline import (
    BackwardStatic, Walk, causal_mask_t, ring_slot, score_gradient,
    tile_probabilities, walk_group, wgmma_accumulate_sums, wgmma_fresh,
    wgmma_then)

def shared_transforms(static: BackwardStatic):
  """The one layout of every 16-bit tile of the kernel with shared rows.

  Its wgmmas pair K's and V's column parts with the streamed Q and dO
  tiles (contracting over head_dim / n columns), and the exchanged Pᵀ and
  dSᵀ parts with Q's and dO's column parts (over block_q / n rows), and a
  wgmma's operands share one swizzle: so its tiles must divide both part
  widths. The widest that does (`common.swizzled`): at block_q 64, head_dim
  256 and 192 take 64 B (32 columns), 160 and 224 take 32 B (16).
  """
  consumers = static.num_consumers
  return swizzled(math.gcd(static.block_q // consumers,
                           static.head_dim // consumers), static.dtype)


def exchange_scratch(static: BackwardStatic, rows: int, part_columns: int, *,
                     kinds: int):
  """Shared rows' exchange (`Exchange`): `kinds` score tiles, each in one
  16-bit [rows, part_columns] part per consumer (a ref each, so that wgmma
  operands need no constant indices, which `pl.run_state` cannot take),
  then the barriers `exchanged` and `free`."""
  consumers = static.num_consumers
  part = plgpu.SMEM((rows, part_columns), static.dtype,
                    transforms=shared_transforms(static))
  return tuple(part for _ in range(kinds * consumers)) + tuple(
      plgpu.Barrier(num_arrivals=consumers, num_barriers=1)
      for _ in range(2))


class Exchange(NamedTuple):
  """How shared rows' consumers pass score parts to each other.

  Each step, consumer c stores its parts (`put`) and waits until every
  consumer has (`exchanged`), then reads all of them with its wgmmas, and
  says so once they are done (`release`, on `free`). Before storing it
  waits on `free` for the previous step's reads. `free` is seeded once a
  tile (`begin`) and its last phase awaited at the end (`end`), so that both
  barriers run through whole phases per tile (persistent grids), and no
  consumer leaves a tile before every consumer's last read.
  """
  parts: tuple     # parts[kind][consumer]: [rows, part_columns] refs
  exchanged: Any   # barrier: every consumer stored this step's parts
  free: Any        # barrier: every consumer's wgmmas read the last ones

  @classmethod
  def of(cls, refs, *, kinds: int, consumers: int) -> "Exchange":
    parts = tuple(tuple(refs[k * consumers:(k + 1) * consumers])
                  for k in range(kinds))
    exchanged, free = refs[kinds * consumers:kinds * consumers + 2]
    return cls(parts, exchanged.at[0], free.at[0])

  def begin(self):
    plgpu.barrier_arrive(self.free)  # the seed: nothing to read yet

  def put(self, c: int, values, dtype):
    """Stores consumer c's f32 `values`, one per kind, in `dtype`."""
    plgpu.barrier_wait(self.free)
    for parts, value in zip(self.parts, values):
      parts[c][...] = value.astype(dtype)
    plgpu.commit_smem()  # read by every consumer's wgmma
    plgpu.barrier_arrive(self.exchanged)
    plgpu.barrier_wait(self.exchanged)

  def release(self):
    plgpu.barrier_arrive(self.free)

  def end(self):
    plgpu.barrier_wait(self.free)


def load_column_parts(c: int, tensors, *, batch, rows, head,
                      static: BackwardStatic):
  """Shared rows: consumer c loads its column part of each resident tensor
  ((gmem ref, smem parts, arrival barriers) in `tensors`) by TMA, then
  waits for every consumer's parts."""
  columns = column_part(c, static)
  for ref, smem, arrived in tensors:
    plgpu.copy_gmem_to_smem(ref.at[batch, rows, head, columns], smem.at[c],
                            arrived.at[c])
  for _, _, arrived in tensors:
    for other in range(static.num_consumers):
      plgpu.barrier_wait(arrived.at[other])


def column_part(c: int, static: BackwardStatic):
  """Consumer c's head_dim columns under shared K/V rows."""
  part = static.head_dim // static.num_consumers
  return pl.ds(c * part, part)


def dkdv_consume_shared(c: int, k_smem, v_smem, q_ring, do_ring, stats_ring,
                        arrived, consumed, exchange_refs, *, walk: Walk,
                        kv_start, static: BackwardStatic, base=None):
  """Consumer c under shared K/V rows (`BackwardStatic.shared_rows`): its
  columns of dK (f32, scaled) and dV, [block_kv, head_dim / num_consumers]
  each.

  Per step, with Q rows r_c (its part of the step's Q tile) and columns
  d_c (its part of head_dim):
    Sᵀ_c = K Q[r_c]ᵀ, dPᵀ_c = V dO[r_c]ᵀ      [block_kv, block_q / n]
    Pᵀ_c, dSᵀ_c  into the exchange; wait for every consumer's
    dV[:, d_c] += Σ_k Pᵀ_k dO[r_k, d_c],  dK[:, d_c] += Σ_k dSᵀ_k Q[r_k, d_c]
  so each consumer sums the same products in the same order as the
  consumer that owns all the columns would. `exchange_refs`: the
  `exchange_scratch` of Pᵀ's and dSᵀ's [block_kv, block_q / n] parts.
  """
  consumers = static.num_consumers
  exchange = Exchange.of(exchange_refs, kinds=2, consumers=consumers)
  p_parts, ds_parts = exchange.parts
  q_part = static.block_q // consumers
  rows = lambda k: pl.ds(k * q_part, q_part)
  columns = column_part(c, static)
  shape = (static.block_kv, q_part)
  slot_of = ring_slot(static, base)
  zeros = plgpu.layout_cast(
      jnp.zeros((static.block_kv, static.head_dim // consumers), jnp.float32),
      plgpu.Layout.WGMMA)
  column_stats = lambda stats, n: plgpu.layout_cast(
      stats[n, rows(c)], plgpu.Layout.WGMMA.reduce(0))

  def step_body(i, grads, *, head_base, group_index, masked):
    del group_index  # the plain form's: no score changes by head
    slot = slot_of(head_base + i)
    for barrier in arrived:
      plgpu.barrier_wait(barrier.at[slot])
    q_tile, do_tile = q_ring.at[slot], do_ring.at[slot]
    stats = stats_ring.at[slot]
    lse_log2 = column_stats(stats, 0) if static.prefetch_lse else None

    def probabilities(s_t):
      lse = column_stats(stats, 0) if lse_log2 is None else lse_log2
      p_t, _ = tile_probabilities(s_t, lse, per_column, None, static)
      if masked:
        p_t = jnp.where(causal_mask_t(kv_start, i, static,
                                      q_rows=(c * q_part, q_part)), p_t, 0.0)
      return p_t

    # K and V are in column parts p: Sᵀ_c = Σ_p K_p Q[r_c, d_p]ᵀ, and dPᵀ_c.
    products = [[(smem.at[p], tile.at[rows(c), column_part(p, static)]
                  .transpose((1, 0))) for p in range(consumers)]
                for smem, tile in ((k_smem, q_tile), (v_smem, do_tile))]
    if static.overlap_softmax:
      p_t, dp_t = wgmma_then(shape, products, probabilities)
    else:
      s_t, dp_t = wgmma_fresh(shape, products)
      p_t = probabilities(s_t)
    delta = column_stats(stats, 1)
    ds_t = score_gradient(p_t, dp_t, per_column(delta, shape), None)
    exchange.put(c, [p_t, ds_t], static.dtype)
    grads = wgmma_accumulate_sums(grads, [
        [(ds_parts[k], q_tile.at[rows(k), columns])   # dK
         for k in range(consumers)],
        [(p_parts[k], do_tile.at[rows(k), columns])    # dV
         for k in range(consumers)]])
    plgpu.barrier_arrive(consumed.at[slot])
    exchange.release()
    return grads

  exchange.begin()
  grads = walk_group(walk, step_body, arrived, consumed, slot_of, static,
                      (zeros, zeros))
  exchange.end()
  dk, dv = grads
  return dk * static.scale, dv
