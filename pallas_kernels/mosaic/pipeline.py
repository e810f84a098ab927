"""What the backward's kernels share: their statics and their pipeline.

`BackwardStatic` is everything a backward kernel body knows at trace time.
Every backward kernel runs the same pipeline: a producer warpgroup streams
the loop's tiles by TMA into a ring of `num_stages` shared-memory slots
(`produce`), and every consumer warpgroup walks every streamed step
(`Walk`, `walk_runs`, `walk_group`): computing it, masking it, or, where
its own rows need none of it, waiting for the tiles and releasing them at
once (`skip_step`), since Mosaic tracks each barrier's phase per thread and
a consumer that skipped a phase would wait on the wrong parity afterwards.
Barriers per ring slot:

  <tile>_arrived[s]   TMA completion, one per streamed tensor (producer ->
                      consumers)
  consumed[s]         every consumer is done with slot s (-> producer);
                      one arrival per consumer

On a persistent grid (`each_tile`) a CTA computes its tiles of
`common.persistent_schedule` in turn and the ring runs on from tile to
tile, step t of a tile in slot (base + t) % num_stages (`ring_slot`).

Also here: the step math both kernels share (`probabilities`,
`score_gradient`, the wgmma helpers), the dK/dV kernel's causal geometry
over Sᵀ tiles, and the masked (ranged) kernels' plan rows and segment ids.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import masking
from pallas_kernels.mosaic.common import (
    LOG2E, PLAN_DROPOUT_SEED, PLAN_SCALARS, PLAN_TILE, PLAN_UNION, PLAN_WIDTH,
    PlanRow, ScoreTiles, SlopeRows, launch_grid, per_column, per_row,
    persistent_schedule, read_plan, register_split, swizzled)
from pallas_kernels.mosaic.rows import copy_rows_in, wgmma, wgmma_count
from pallas_kernels.mosaic.softmax import capped_exp2


# The fused dQ's fourth warpgroup (the dQ writer) takes its registers from
# the producer: 2 * 232 + 24 + 24 = 512 per thread slot. 24 is setmaxnreg's
# least; both only issue TMA.
FUSED_PRODUCER_REGISTERS = 24
# How a consumer treats a run of streamed steps (see `walk_runs`).
SKIP, MASKED, UNMASKED = "skip", "masked", "unmasked"


@dataclasses.dataclass(frozen=True)
class BackwardStatic:
  """Everything a kernel body needs that is known at trace time."""
  block_q: int
  block_kv: int
  num_consumers: int
  num_stages: int
  num_q_blocks: int
  num_kv_blocks: int
  head_dim: int
  group: int             # query heads per K/V head (GQA)
  scale: float
  scale_log2: float      # scale * log2(e): scores enter exp2 directly
  is_causal: bool
  dtype: jnp.dtype
  outputs: tuple[str, ...]  # dK/dV kernel: ("dk", "dv"), ("dk",) or ("dv",)
  # P's exponentials run while the dP wgmma is on the tensor cores (both
  # kernels), and in the dK/dV kernel dS while the dV += Pᵀ dO wgmma is
  # (FlashAttention-3's intra-warpgroup overlap, §3.2, within one step).
  overlap_softmax: bool = False
  # dK/dV kernel: read lse before the step's wgmmas (delta when dS needs
  # it), so that the load P's first FFMAs wait on hides behind the
  # matmuls (Nsight Compute, the fused dQ at d=128: 10-12% of the
  # consumers' stall samples were those FFMAs waiting on the load,
  # h200_ncu_fused_d128_16k.md). Costs its registers while the matmuls run.
  prefetch_lse: bool = False
  # dK/dV kernel, plain consumers without a causal mask: step t + 1's
  # Sᵀ = K Qᵀ is issued once step t's dV is done but before its dK is, so
  # that the tensor cores run it right behind dK rather than after the
  # warpgroup has seen dK done, released the slot and issued it
  # (`walk_scores_ahead`). Nsight Compute of d=64's 4k backward: 7% of
  # the dK/dV kernel's samples waited for Sᵀ and 6.5% for dV and dK, back
  # to back (h200_ncu_fwd_bwd_d64_4k.md). Scheduling only: bitwise the plain
  # walk.
  scores_ahead: bool = False
  # Both kernels (not the fused dQ, whose four warpgroups have 512 registers
  # a thread slot shared 232/232/24/24): the producer at 24 registers (it
  # only issues TMA) and the consumers at 240, instead of 40 and 232
  # (`common.register_split`: 2 * 240 + 24 = 504, as 2 * 232 + 40), so
  # that lse read early has room. Bitwise the same.
  lean_producer: bool = False
  # Fused dQ: the consumers index their resident K and V rows each step
  # with a zero read from shared memory (the last scratch buffer; shared
  # memory, which the kernel's barriers and copies may write for all the
  # compiler knows), so that it cannot hoist those tiles' wgmma
  # descriptors out of the step loop. Hoisted, they are loop invariants
  # that hold registers across every matmul: at d=128 (Nsight Compute)
  # ptxas spilled them and reloaded them each step from L2, ~190 bytes per
  # thread per step, and the wgmma issues stalled on the reloads; opaque,
  # the fused kernel went 397 / 351 -> 470 / 458 TFLOP/s full / causal at
  # 16k (h200_mosaic_opaque.md). Where the zero's cell fits.
  opaque_resident: bool = False
  # Persistent grid: `num_ctas` CTAs (one per SM) walk the tiles in turn
  # (`common.persistent_schedule`), so that a tile's start (its resident
  # loads, the ring's fill) overlaps the previous tile's end. Plain form.
  persistent: bool = False
  num_ctas: int = 0
  # Fused dQ (dK/dV kernel only): each step also computes the CTA's dS K
  # for the Q tile, each consumer one piece of it, and a fourth warpgroup
  # adds it, in f32, to a dQ sum in global memory by TMA reduce-add, in a
  # fixed order (see `FusedDq`). 5 matmuls per tile pair instead of 7
  # (the dQ kernel's recomputed S and dP go). Launch grid, plain form.
  fused_dq: bool = False
  # Launch grid order (`common.launch_grid`): a head's tiles launched
  # together, the CTAs at work at once streaming the same Q and dO (dK/dV
  # kernel) or K and V (dQ kernel) through L2. The fused dQ's tiles launch
  # in its own order.
  tile_fastest: bool = False
  # Shared K/V rows (dK/dV kernel, plain form): the consumers share the
  # CTA's `block_kv` K/V rows instead of owning `block_kv` rows each.
  # Consumer c computes Sᵀ and dPᵀ for its part of the step's Q rows, and
  # dK and dV for its part of the head_dim columns; the parts of Pᵀ and
  # dSᵀ meet in shared memory (`dkdv_consume_shared`). So dK and dV fit
  # one pass where a consumer could not hold both whole (head_dim above
  # 128), with two consumers.
  shared_rows: bool = False
  # Plain form, d=64 rows off the 8-row TMA tiling read and written in
  # place (`rows.rows_in_place`): Q, K, V, dO and the gradients through
  # the (1, 64) views of their buffers (`rows.row_buffer`).
  rows_in_place: bool = False
  # Ranged kernels (`masked_backward`): the static `masking.MaskSpec`; loop
  # ranges come from a plan row per CTA instead of causal geometry.
  spec: Any = None
  # The dQ kernel's dbias form (a bias in the spec): each step writes its
  # dS tile, in this dtype, to a [batch, heads, q, kv] output instead of
  # adding dS K to dQ (a launch of its own, which XLA drops when nothing
  # uses the bias gradient). None: the dQ form.
  dbias_dtype: Any = None
  # Ranged: plan rows per batch (1) or per batch and head (the dQ
  # kernel's query heads, the dK/dV kernel's K/V heads), where a mask
  # differs by head (`masked.head_plans`).
  plan_heads: int = 1
  # Causal ALiBi without score_fn or soft cap (`common.alibi_columns`): P
  # from a term per key and one per query added to the scores and the LSE
  # (`tile_probabilities`' `alibi_terms`) instead of |q_pos - kv| per score
  # from two index tiles. Ranged: `plan.MASKED_ALIBI_COLUMNS`. Plain
  # kernels (top-left causal, `backward.mosaic_backward(alibi_slopes=)`):
  # the slopes come as the ranged ones' (`alibi`, `slope_refs`).
  alibi_columns: bool = False
  # Ranged, a soft cap the only score change (`masking.cap_only`): P and
  # the cap's slope from t = tanh(q·k * scale / cap), P = exp2(t * cap
  # log2(e) - lse) and slope 1 - t², the cap's multiplies folded into the
  # scales as in the forward (`plan.MASKED_BACKWARD_SOFTCAP_FOLDED`)
  # instead of `modify_scores` and its `jax.jvp`.
  fold_cap: bool = False
  # Plain kernels, a soft cap (`backward.mosaic_backward(soft_cap=)`,
  # `plan.PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS`): P and the slope as
  # `fold_cap`'s, of the cap alone; on the launch grid, never with shared
  # rows or `scores_ahead` (their walks take no slope) nor the fused dQ.
  soft_cap: float | None = None
  # A dK/dV kernel with a cap (`fold_cap` or `soft_cap`) and
  # `overlap_softmax`: while dPᵀ's wgmma runs, Pᵀ becomes dV's 16-bit
  # operand and Pᵀ ∘ slope (the slope 1 - t² >= 0, so dropout's sign code
  # holds), instead of Pᵀ and the slope in float32 both live across the
  # wait: 16 registers a thread fewer beside the dK, dV accumulators
  # (`backward.cap_slope_ahead`; benchmarks/NOTES.md, "The soft cap on the
  # plain backward").
  cap_slope_ahead: bool = False
  # Ranged, a bias broadcast along the queries or the keys: (own rows,
  # streamed) repeated to a tile's extent and read from its start
  # (`common.repeat_broadcast_axes`; the dK/dV kernel's own rows are keys).
  bias_repeats: tuple[bool, bool] = (False, False)

  @property
  def ranged(self) -> bool:
    return self.spec is not None

  @property
  def kv_rows_per_cta(self) -> int:
    """K/V rows of a dK/dV kernel's CTA tile."""
    return self.block_kv * (1 if self.shared_rows else self.num_consumers)

  @property
  def q_rows_per_cta(self) -> int:
    """Q rows of a dQ kernel's CTA tile."""
    return self.block_q * self.num_consumers

  @property
  def segmented(self) -> bool:
    return self.ranged and self.spec.has_segments

  @property
  def alibi(self) -> bool:
    """Whether the kernel reads ALiBi slopes (`common.slope_rows`)."""
    return self.spec.has_alibi if self.ranged else self.alibi_columns

  @property
  def dropout(self) -> bool:
    return self.ranged and bool(self.spec.dropout_rate)

  @property
  def biased(self) -> bool:
    """A bias, streamed as tiles of the kernel's own rows and its step's
    streamed ones (`common.ScoreTiles`), on every step."""
    return self.ranged and self.spec.has_bias

  @property
  def bias_grad(self) -> bool:
    """The dQ kernel's dbias form (`dbias_dtype`)."""
    return self.dbias_dtype is not None

  @property
  def dense(self) -> bool:
    """A dense mask, streamed as int8 tiles of the kernel's own rows and
    its step's streamed ones (`common.ScoreTiles`)."""
    return self.ranged and self.spec.has_dense_mask


class Walk(NamedTuple):
  """A warpgroup's walk over the steps its CTA streams.

  The streamed blocks are [first, first + num_blocks) (per query head of
  the group in the dK/dV kernel); `runs` are (start, stop, kind) block
  ranges that cover them in order, kind one of SKIP, MASKED, UNMASKED;
  `values` are the ranged kernels' `masking.MaskValues` (None in the plain
  ones), `dropout_seed` theirs with dropout, `tile` a ranged consumer's
  tile (its plan row's `PLAN_TILE`).
  """
  first: Any
  num_blocks: Any
  runs: tuple
  values: Any
  dropout_seed: Any = None
  tile: Any = None


def walk_runs(runs, bodies, carry):
  """Runs `bodies[kind]` over each (start, stop, kind) run, in order."""
  for start, stop, kind in runs:
    carry = lax.fori_loop(start, stop, bodies[kind], carry)
  return carry


def walk_group(walk: Walk, step_body, arrived, consumed, slot_of,
               static: BackwardStatic, grads):
  """A dK/dV consumer's walk: for each query head g of the group, the runs
  of `walk`, skipped steps released at once, the others
  `step_body(i, grads, head_base=, group_index=g, masked=)`; step of walk
  position i of query head g is head_base + i."""
  def skip_body(i, grads, *, head_base):
    skip_step(arrived, consumed, slot_of(head_base + i))
    return grads

  def head_body(g, grads):
    head_base = g * walk.num_blocks - walk.first
    bodies = {
        SKIP: functools.partial(skip_body, head_base=head_base),
        MASKED: functools.partial(step_body, head_base=head_base,
                                  group_index=g, masked=True),
        UNMASKED: functools.partial(step_body, head_base=head_base,
                                    group_index=g, masked=False)}
    return walk_runs(walk.runs, bodies, grads)

  return lax.fori_loop(0, static.group, head_body, grads)


def walk_range(walk: Walk):
  """(lo, unmasked_lo, unmasked_hi, hi) of a consumer's `ranged_walk`."""
  (lo, unmasked_lo, _), _, (unmasked_hi, hi, _) = walk.runs[1:4]
  return lo, unmasked_lo, unmasked_hi, hi


def ranged_walk(plan: PlanRow, slot, *, consumer: bool = True,
                dropout: bool = False) -> Walk:
  """Reads the CTA's plan row (see `masked.tile_plans`) into `slot`.

  A consumer (`slot` = its warpgroup) walks the union [first, total) in five
  runs: skips before its range [lo, hi), the masked edge up to the run of
  full tiles [unmasked_lo, unmasked_hi), that run, the other masked edge,
  skips after. All of them, in every consumer, so that every ring barrier
  goes through the same phases in every thread. The producer (`consumer`
  False) needs only the union; a consumer with `dropout` also its seed.
  """
  read = read_plan(plan, slot)
  first, total = read(PLAN_UNION), read(PLAN_UNION + 1)
  if not consumer:
    return Walk(first, total - first, (), None)
  lo, unmasked_lo, unmasked_hi, hi = (read(slot * 4 + i) for i in range(4))
  runs = ((first, lo, SKIP), (lo, unmasked_lo, MASKED),
          (unmasked_lo, unmasked_hi, UNMASKED), (unmasked_hi, hi, MASKED),
          (hi, total, SKIP))
  values = masking.MaskValues(q_offset=read(PLAN_SCALARS),
                              q_lengths=read(PLAN_SCALARS + 1),
                              kv_lengths=read(PLAN_SCALARS + 2))
  seed = read(PLAN_DROPOUT_SEED) if dropout else None
  return Walk(first, total - first, runs, values, seed, read(PLAN_TILE))


def ring_slot(static: BackwardStatic, base=None):
  """step -> its ring slot; persistent: the ring counts on from `base`."""
  def slot_of(step):
    if base is None and isinstance(step, int):  # no arithmetic on constants
      return step % static.num_stages          # alone in the lowering
    return lax.rem(step if base is None else base + step, static.num_stages)
  return slot_of


def produce(streams, consumed, num_steps, static: BackwardStatic, base=None):
  """Producer warpgroup: TMA step t's tiles into ring slot t % num_stages.

  `streams` are (source, ring, arrived): `source(step)` is the GMEM view of
  that step's tile, `ring` its buffers' `RowViews` (`copy_rows_in`). A
  slot is refilled once every consumer released it.
  Persistent (`base` given): the ring runs on from the CTA's earlier tiles,
  step t going to slot (base + t) % num_stages, without a fill of its own.
  """
  stages = static.num_stages

  def load(step, slot):
    for source, ring, arrived in streams:
      copy_rows_in(source(step), ring.at[slot], arrived.at[slot])

  if base is not None:
    @pl.loop(0, num_steps)
    def _step(step):
      slot = lax.rem(base + step, stages)
      pl.when(base + step >= stages)(
          functools.partial(plgpu.barrier_wait, consumed.at[slot]))
      load(step, slot)
    return

  # Fill the ring. Under causal masking, or any plan, a tile may have fewer
  # steps than there are stages (or none).
  for step in range(stages):
    fill = functools.partial(load, step, step)
    if static.is_causal or static.ranged:
      pl.when(step < num_steps)(fill)
    else:
      fill()

  @pl.loop(stages, num_steps)
  def _refill(step):
    slot = lax.rem(step, stages)
    plgpu.barrier_wait(consumed.at[slot])
    load(step, slot)


def skip_step(arrived, consumed, slot):
  """Takes part in a step without computing: keeps this consumer's barrier
  phases in step with the ring, and releases the slot."""
  for barrier in arrived:
    plgpu.barrier_wait(barrier.at[slot])
  plgpu.barrier_arrive(consumed.at[slot])


def each_tile(tile, wg, *, static: BackwardStatic, tile_axes, num_tiles,
              num_heads, batch):
  """Runs `tile(batch, head, tile, wg, base, consumer)` in each warpgroup
  (consumers first raise their register budget, the producer, and the
  fused dQ's writer, lower theirs): once, on the launch grid's `tile_axes`
  with `base` None; on a persistent grid, for each of the CTA's tiles,
  `base` counting the streamed steps before it (`tile` returns its step
  count)."""
  def run(registers, action, consumer):
    plgpu.set_max_registers(registers, action=action)
    if not static.persistent:
      tile(*(lax.axis_index(axis) for axis in tile_axes), wg, None, consumer)
      return
    schedule = persistent_schedule(
        num_tiles=num_tiles, num_heads=num_heads, batch=batch,
        paired=static.is_causal, num_ctas=static.num_ctas,
        cta=lax.axis_index("cta"))
    lax.fori_loop(0, schedule.count, lambda n, base: base + tile(
        *schedule.tile_of(n), wg, base, consumer), jnp.int32(0))
    if consumer:  # the last tile's gradients reach memory
      plgpu.wait_smem_to_gmem(0)

  consumer_registers, producer_registers = register_split(
      lean=static.lean_producer)  # (see `BackwardStatic`)
  pl.when(wg < static.num_consumers)(
      lambda: run(consumer_registers, "increase", True))
  if static.fused_dq:  # the producer, and the dQ writer after it
    pl.when(wg >= static.num_consumers)(
        lambda: run(FUSED_PRODUCER_REGISTERS, "decrease", False))
  else:
    pl.when(wg == static.num_consumers)(
        lambda: run(producer_registers, "decrease", False))


def grid_args(static: BackwardStatic, grid, names) -> dict:
  """`plgpu.kernel`'s grid arguments: the launch grid `grid` (tile axis
  first, so launched slowest; reversed with `static.tile_fastest`), or a
  persistent grid of `static.num_ctas` CTAs."""
  if static.persistent:
    return dict(grid=(static.num_ctas,), grid_names=("cta",))
  grid, names = launch_grid(grid, names, tile_fastest=static.tile_fastest)
  return dict(grid=grid, grid_names=names)


def kernel_name(static: BackwardStatic, outputs: str) -> str:
  return ("mosaic_flash_backward_" + ("masked_" if static.ranged else "")
          + outputs)


def tile_probabilities(s, lse_log2, broadcast, values, static: BackwardStatic,
                       positions=None, alibi_terms=None):
  """P = exp(final logit - lse) of a tile of raw q·k, and the slope of the
  final logit in scale·q·k (None without score changes, or where they only
  add a term: ALiBi).

  `broadcast` spreads the per-row `lse_log2` over `s`: `per_row` for S
  tiles, `per_column` for Sᵀ. Score changes (the soft cap, ALiBi) follow
  `modify_scores`, the one definition, and its derivative is that
  function's `jax.jvp`; `positions()` gives the tile's (q_idx, kv_idx)
  where they read them (`spec.scores_read_positions`). With
  `static.alibi_columns`, `alibi_terms(slope)` gives the tile's (query
  terms along `broadcast`'s axis, key terms along the other) of
  `common.alibi_columns`: a vector each, no index tiles.
  """
  if static.alibi_columns:  # plain or ranged (never with `fold_cap`)
    queries, keys = alibi_terms(values.alibi_slope)
    across = per_column if broadcast is per_row else per_row
    logits_log2 = s * static.scale_log2 + across(keys * LOG2E, s.shape)
    if static.ranged and static.spec.has_bias:
      logits_log2 = logits_log2 + values.bias * LOG2E
    return _weights(logits_log2 - broadcast(lse_log2 + queries * LOG2E,
                                            s.shape), static), None
  if static.soft_cap is not None:  # the plain kernels' (never ranged)
    cap_only = masking.MaskSpec(q_len=static.num_q_blocks * static.block_q,
                                kv_len=static.num_kv_blocks * static.block_kv,
                                logits_soft_cap=static.soft_cap)
    return _folded_cap_probabilities(s, lse_log2, broadcast, cap_only,
                                     values, static)
  if not (static.ranged and static.spec.modifies_scores):
    return jnp.exp2(s * static.scale_log2 - broadcast(lse_log2, s.shape)), None
  spec = static.spec
  if static.fold_cap:
    return _folded_cap_probabilities(s, lse_log2, broadcast, spec, values,
                                     static)
  q_idx, kv_idx = positions() if spec.scores_read_positions else (None, None)
  modify = lambda x: masking.modify_scores(spec, x, q_idx, kv_idx, values)
  if spec.scores_shift_only:  # slope 1: dS as without them
    logits, slope = modify(s * static.scale), None
  else:
    logits, slope = jax.jvp(modify, (s * static.scale,), (jnp.ones_like(s),))
  return _weights(logits * LOG2E - broadcast(lse_log2, s.shape), static), slope


def _weights(exponent, static: BackwardStatic):
  """P = exp2(exponent) of logit - lse (log2 units), capped at 0 where a
  bias or score_fn may take logits anywhere (`softmax.capped_exp2`)."""
  unbounded = static.ranged and static.spec.unbounded_scores
  return capped_exp2(exponent, 0.0 if unbounded else None)


def _folded_cap_probabilities(s, lse_log2, broadcast, spec, values,
                              static: BackwardStatic):
  """`tile_probabilities` of a soft cap alone (`spec`'s), folded: P from t
  = tanh(q·k * scale / cap) as exp2(t * cap log2(e) - lse), and its slope
  d(cap tanh(x / cap)) / dx = 1 - t²."""
  t, factor = masking.modify_scores_folded(spec, s, static.scale, None,
                                           None, values)
  p = jnp.exp2(t * (factor * LOG2E) - broadcast(lse_log2, s.shape))
  return p, 1.0 - t * t


def dropped_in_sign(p, kept):
  """P with the weights dropout drops negated (FlashAttention-2's
  encoding), or P as it is (`kept` None): the step's kept weights ride in
  P's sign bit from the hash to dV's operand (`kept_weights`) and dS
  (`score_gradient`), instead of a tile of booleans live beside P across
  the step's wgmma issues. P >= 0, so the sign loses nothing."""
  return p if kept is None else jnp.where(kept, p, -p)


def kept_weights(p, dropout: bool):
  """The weights that multiplied V in the forward: P, without the ones
  dropout dropped (`dropped_in_sign`; their 1 / (1 - rate) comes at the
  end)."""
  return jnp.maximum(p, 0.0) if dropout else p


def score_gradient(p, dp, delta, slope, dropout: bool = False):
  """dS = P ∘ (dP - delta), times the score changes' slope when there is
  one; dS is then dL / d(scale·q·k), scaled once at the end.

  Dropout: `p` carries the dropped weights negated (`dropped_in_sign`),
  dP is the gradient of the weights that multiplied V, so it is dropped
  and scaled by 1 / (1 - rate) as they were, and `delta` comes times
  (1 - rate) (`dropout_delta`): this returns dS (1 - rate) = max(P, 0) ∘
  dP - |P| ∘ delta (1 - rate), which is (1 - rate) P ∘ (dP / (1 - rate) -
  delta) where kept and (1 - rate) P ∘ (0 - delta) where dropped; its
  1 / (1 - rate) joins the final scale (`ds_scale`), one multiply a score
  fewer."""
  if dropout:
    ds = jnp.maximum(p, 0.0) * dp - jnp.abs(p) * delta
  else:
    ds = p * (dp - delta)
  return ds if slope is None else ds * slope


def keep_scale(static: BackwardStatic) -> float | None:
  """1 / (1 - rate): the factor of the weights dropout keeps; None
  without dropout."""
  return 1.0 / (1.0 - static.spec.dropout_rate) if static.dropout else None


def dropout_delta(delta, static: BackwardStatic):
  """Rows' delta as `score_gradient` takes it: times 1 - rate under
  dropout."""
  return delta * (1.0 - static.spec.dropout_rate) if static.dropout else delta


def ds_scale(static: BackwardStatic) -> float:
  """The factor of the sums of `score_gradient`'s dS (dQ = dS K and dK =
  dSᵀ Q): the softmax scale, and under dropout 1 / (1 - rate)."""
  return static.scale * (keep_scale(static) if static.dropout else 1.0)


def column_statistic(stats_ring, slot, n):
  """Row statistic n (0: lse, 1: delta) of a dK/dV step's Q rows, from its
  ring slot, in the layout of an Sᵀ tile's columns."""
  return plgpu.layout_cast(stats_ring[slot, n], plgpu.Layout.WGMMA.reduce(0))


def dkdv_causal_runs(kv_start, first, static: BackwardStatic):
  """The plain kernel's runs over Q tiles [first, num_q_blocks) for K/V rows
  from kv_start: causal, skip the tiles wholly above the diagonal for these
  rows and mask those that straddle it."""
  if not static.is_causal:
    return ((0, static.num_q_blocks, UNMASKED),)
  own_first = first_q_block(kv_start, static)
  own_unmasked = first_unmasked_q_block(kv_start, static)
  return ((first, own_first, SKIP), (own_first, own_unmasked, MASKED),
          (own_unmasked, static.num_q_blocks, UNMASKED))


def first_q_block(kv_start, static: BackwardStatic):
  """First Q tile with a row that attends key kv_start (causal), clipped.

  Row r attends kv_start iff r >= kv_start, so tile i needs
  (i + 1) * block_q - 1 >= kv_start.
  """
  if not static.is_causal:
    return 0
  return jnp.minimum(kv_start // static.block_q, static.num_q_blocks)


def first_unmasked_q_block(kv_start, static: BackwardStatic):
  """First Q tile whose every row attends all of keys [kv_start, +block_kv).

  Needs i * block_q >= kv_start + block_kv - 1.
  """
  if not static.is_causal:
    return 0
  return jnp.minimum(pl.cdiv(kv_start + static.block_kv - 1, static.block_q),
                     static.num_q_blocks)


def tile_indices_t(kv_start, q_block, static: BackwardStatic, q_rows=None):
  """(query, key) indices of the [block_kv, block_q] Sᵀ tile of keys
  kv_start + r and queries q_block * block_q + c; `q_rows` = (offset,
  count): only that part of the tile's queries (shared K/V rows)."""
  offset, count = q_rows or (0, static.block_q)
  shape = (static.block_kv, count)
  keys = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  queries = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                   layout=plgpu.Layout.WGMMA)
  q_start = q_block * static.block_q
  if offset:
    q_start = q_start + offset
  return queries + q_start, keys + kv_start


def causal_mask_t(kv_start, q_block, static: BackwardStatic, q_rows=None):
  """[block_kv, block_q] (or the `q_rows` part's columns): True where key
  kv_start + r is seen by query q_block * block_q + c (the transposed
  layout of Sᵀ).

  Two whole index tiles, compared: at d=64 they spill 180 bytes, in the
  masked step only (SASS). A row against a column of indices
  spilled none but ran the backward 1.5% and 1.2% slower at 16k and 4k
  (8fbd8ee, results/h200_mosaic_mask_form.md), so this form stays."""
  queries, keys = tile_indices_t(kv_start, q_block, static, q_rows)
  return queries >= keys


def variant_mask_t(kv_start, q_block, static: BackwardStatic, values):
  """`masking.keep` on the Sᵀ tile of `tile_indices_t`."""
  return masking.keep(static.spec, *tile_indices_t(kv_start, q_block, static),
                      values)


class SegmentIds(NamedTuple):
  """A ranged kernel's segment ids (`spec.has_segments`), by role. The dQ
  kernel owns query rows and streams K/V tiles; the dK/dV kernel owns K/V
  rows and streams Q tiles."""
  own_gmem: Any        # int32 [len] of this batch, along the resident axis
  streamed_gmem: Any   # int32 [len] of this batch, along the streamed axis
  own_smem: Any        # int32 [consumers, rows]
  own_arrived: Any     # barriers [consumers]
  ring: Any            # int32 [stages, rows]: filled with each ring slot
  ring_arrived: Any    # barriers [stages]


def ranged_scratch(static: BackwardStatic, *, resident_rows, streamed_rows,
                   slopes=None):
  """The ranged kernels' scratch after the common list: plan rows (one per
  warpgroup), with segment ids `SegmentIds`' shared memory, with ALiBi
  each consumer's copy of `slopes` (`common.slope_rows`), with a bias each
  consumer's tile in its dtype (q's), with a dense mask each consumer's
  int8 tile (`common.ScoreTiles`)."""
  consumers, stages = static.num_consumers, static.num_stages
  scratch = (plgpu.SMEM((consumers + 1, PLAN_WIDTH), jnp.int32),
             plgpu.Barrier(num_barriers=consumers + 1))   # plan_arrived
  if static.segmented:
    scratch += (plgpu.SMEM((consumers, resident_rows), jnp.int32),
                plgpu.Barrier(num_barriers=consumers),
                plgpu.SMEM((stages, streamed_rows), jnp.int32),
                plgpu.Barrier(num_barriers=stages))
  if static.alibi:
    scratch += slope_scratch(static, slopes)
  for present, dtype in ((static.biased, static.dtype),
                         (static.dense, jnp.int8)):
    if present:
      scratch += (plgpu.SMEM((consumers, resident_rows, streamed_rows), dtype,
                             transforms=swizzled(streamed_rows, dtype)),
                  plgpu.Barrier(num_barriers=consumers))  # tile_arrived
  return scratch


def slope_scratch(static: BackwardStatic, slopes) -> tuple:
  """Each consumer's copy of `slopes` (`common.slope_rows`), and its
  barriers: the ranged kernels' with ALiBi, and the plain ones' with
  `alibi_columns` (their only scratch after the common list)."""
  return (plgpu.SMEM((static.num_consumers, *slopes.shape[1:]), jnp.float32),
          plgpu.Barrier(num_barriers=static.num_consumers))  # slopes_arrived


def ranged_inputs(plan, segments, slopes, bias=None, dense_mask=None
                  ) -> tuple:
  """The ranged kernels' inputs after the common five: plan rows, the
  segment ids (q, kv), the slope rows, the bias, the int8 dense mask;
  those absent left out."""
  return (plan, *(segments or ()),
          *(x for x in (slopes, bias, dense_mask) if x is not None))


class RangedRefs(NamedTuple):
  """A ranged kernel's refs beyond the common ones (None where absent)."""
  plan: PlanRow | None = None
  ids: SegmentIds | None = None
  slopes: SlopeRows | None = None
  # The dK/dV kernel's: the transposes.
  bias: ScoreTiles | None = None
  dense: ScoreTiles | None = None


def ranged_refs(static: BackwardStatic, inputs, scratch, *, batch, head,
                tile, own_is_query: bool) -> RangedRefs:
  """`RangedRefs` of a ranged kernel (all None in a plain one, but its
  ALiBi slopes with `alibi_columns`: inputs and scratch `slope_scratch`).

  `inputs` are the kernel's inputs after the common five
  (`ranged_inputs`), `scratch` its scratch after the common list
  (`ranged_scratch`); `head` the CTA's (query head in dQ, K/V head in
  dK/dV), for plan rows per head.
  """
  if not static.ranged:
    if not static.alibi:
      return RangedRefs()
    return RangedRefs(slopes=SlopeRows(inputs[0].at[batch], *scratch[:2]))
  plan_row = batch if static.plan_heads == 1 else (
      batch * static.plan_heads + head)
  plan = PlanRow(inputs[0].at[plan_row, tile], *scratch[:2])
  ids = slopes = None
  if static.segmented:
    q_ids, kv_ids = inputs[1].at[batch], inputs[2].at[batch]
    own, streamed = (q_ids, kv_ids) if own_is_query else (kv_ids, q_ids)
    ids = SegmentIds(own, streamed, *scratch[2:6])
  index, first = 1 + 2 * static.segmented, 2 + 4 * static.segmented
  if static.alibi:
    slopes = SlopeRows(inputs[index].at[batch], *scratch[first:first + 2])
    index, first = index + 1, first + 2
  tiles = {}
  for name, present in (("bias", static.biased), ("dense", static.dense)):
    if present:
      tiles[name] = ScoreTiles.of(
          inputs[index], scratch[first:], batch,
          static.bias_repeats if name == "bias" else (False, False))
      index, first = index + 1, first + 2
  return RangedRefs(plan, ids, slopes, **tiles)


def ids_arrived(ids: SegmentIds | None):
  """The ids ring's barrier, awaited with the other streams' each step."""
  return () if ids is None else (ids.ring_arrived,)


def load_own_ids(ids: SegmentIds | None, rows, wg):
  """Segment ids of consumer `wg`'s own rows, [rows] in the layout of a
  tile's rows; None without segment ids."""
  if ids is None:
    return None
  own = ids.own_smem.at[wg]
  plgpu.copy_gmem_to_smem(ids.own_gmem.at[rows], own, ids.own_arrived.at[wg])
  plgpu.barrier_wait(ids.own_arrived.at[wg])
  return plgpu.layout_cast(own[...], plgpu.Layout.WGMMA.reduce(1))


def tile_values(values, own_ids, ids: SegmentIds | None, slot, shape, *,
                own_is_query: bool):
  """`values` with the segment id tiles of the step in ring `slot`: the own
  rows' ids down the rows, the streamed ones' across the columns (read
  before the step releases the slot)."""
  if ids is None:
    return values
  streamed = plgpu.layout_cast(ids.ring[slot], plgpu.Layout.WGMMA.reduce(0))
  rows, cols = per_row(own_ids, shape), per_column(streamed, shape)
  if own_is_query:
    return values._replace(q_segments=rows, kv_segments=cols)
  return values._replace(q_segments=cols, kv_segments=rows)


def _terms(product):
  """A product (a, b) as a one-term sum; a list of (a, b) is a sum."""
  return product if isinstance(product, list) else [product]


def wgmma_fresh(shape, products):
  """[a @ b for (a, b) in products] into fresh f32 accumulators of `shape`,
  issued together so that they share one wgmma wait (a product may be a
  list of (a, b): their sum, see `_terms`)."""
  def issue(*acc_refs):
    for acc_ref, product in zip(acc_refs, products):
      for a, b in _terms(product):
        wgmma(acc_ref, a, b)
    return tuple(acc_ref[...] for acc_ref in acc_refs)

  return pl.run_scoped(issue, *[plgpu.ACC(shape, jnp.float32)
                                for _ in products])


def wgmma_then(shape, products, first_fn):
  """(first_fn(a0 @ b0), a1 @ b1, ...) into fresh f32 accumulators: all
  issued together, and `first_fn` run on the first product as soon as it is
  done, while the others are still on the tensor cores (wgmmas complete in
  issue order). A product may be a list of (a, b), their sum (`_terms`).
  """
  def issue(first_ref, *acc_refs):
    for acc_ref, product in zip((first_ref, *acc_refs), products):
      for a, b in _terms(product):
        wgmma(acc_ref, a, b)
    later = sum(wgmma_count(a, b) for product in products[1:]
                for a, b in _terms(product))
    first = first_fn(plgpu.wgmma_accumulator_load(first_ref, wait_n=later))
    return (first, *(acc_ref[...] for acc_ref in acc_refs))

  return pl.run_scoped(issue, *[plgpu.ACC(shape, jnp.float32)
                                for _ in products])


def wgmma_sum(shape, products):
  """sum(a @ b for (a, b) in products) into one fresh f32 accumulator."""
  def issue(acc_ref):
    for a, b in products:
      wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(issue, plgpu.ACC(shape, jnp.float32))


def wgmma_accumulate_sums(accs, sums):
  """(acc + sum(a @ b for (a, b) in products) for acc, products in
  zip(accs, sums)), one wgmma wait."""
  def issue(acc_refs):
    for acc_ref, products in zip(acc_refs, sums):
      for a, b in products:
        wgmma(acc_ref, a, b)

  return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs))


def wgmma_accumulate(accs, products):
  """(acc + a @ b for acc, (a, b) in zip(accs, products)), one wgmma wait."""
  def issue(acc_refs):
    for acc_ref, (a, b) in zip(acc_refs, products):
      wgmma(acc_ref, a, b)

  return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs))
