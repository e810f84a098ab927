"""FlashAttention-2 backward for Hopper (sm90) in Pallas Mosaic GPU.

Recomputing backward (FlashAttention-2, Dao 2023, §3.2): nothing N x N is
stored; each kernel recomputes P = exp(scale * Q Kᵀ - lse) from Q, K and the
forward's LSE. Two kernels, so that every output is written by exactly one
CTA, in a fixed order (deterministic, no atomics):

  dK/dV  grid (kv_tile, kv_head, batch). Each consumer warpgroup owns
         `block_kv` rows of K and V, resident in shared memory, and loops
         over the Q tiles of every query head of its GQA group, summing in
         order:  Sᵀ = K Qᵀ,  dPᵀ = V dOᵀ,  dV += Pᵀ dO,  dK += dSᵀ Q.
  dQ     grid (q_tile, head, batch). Each consumer owns `block_q` rows of Q
         and dO and loops over K/V tiles:  S = Q Kᵀ,  dP = dO Vᵀ,  dQ += dS K.

with dS = P ∘ (dP - delta) and delta = rowsum(dO ∘ O) (less the cotangent of
the LSE, when there is one), computed first by a kernel of its own
(`triton.delta.row_delta`). Every matmul is
a `wgmma` (transposes are free: they are views of the swizzled shared-memory
tiles). The scale of dS is applied once, to the finished dK and dQ.

Warp specialisation as in the forward (FlashAttention-3, Shah et al. 2024,
§3.1): `num_consumers` (1 or 2) compute warpgroups, and one producer
warpgroup that streams the loop's tiles by TMA into a ring of `num_stages`
shared-memory slots. Barriers per ring slot:

  <tile>_arrived[s]   TMA completion, one per streamed tensor (producer ->
                      consumers)
  consumed[s]         every consumer is done with slot s (-> producer);
                      `num_consumers` arrivals

Every consumer walks every streamed step, also the steps its rows do not
need under causal masking (it waits for the tiles and releases them at
once): Mosaic tracks each barrier's phase per thread, so a consumer that
skipped a phase would wait on the wrong parity afterwards.

Within a step a consumer waits for all of its matmuls before the
elementwise work; `overlap_softmax` (the default of `mosaic_backward`) instead
computes P while dP's wgmma runs and dS while dV's does (`_wgmma_then`,
`_dkdv_accumulate_overlapped`), with bitwise the same results.

Persistent grid (`_Static.persistent`, the default where measured faster:
`persistent_by_default`): one CTA per SM computes its tiles of
`forward.persistent_schedule` in turn (paired first with last under causal
masking, where a tile's cost falls or rises with its index), the streamed
ring running on from tile to tile, so that a tile's start overlaps the
previous tile's end instead of costing a launch and a fill.

When the two f32 accumulators dK and dV of a consumer do not fit its
registers (head_dim 256: 2 * 64 x 256 f32 is 256 registers per thread), the
dK/dV kernel either runs twice, once per output (the dV pass then skips
dPᵀ), with one consumer; or, with shared rows (`_Static.shared_rows`, the
default at head_dim 256 on the launch grid), once, its two consumers
sharing one copy of the K/V rows: each computes the scores of half of the
step's Q rows and dK and dV for half of the columns, and the halves of Pᵀ
and dSᵀ meet in shared memory (`_Exchange`). The dQ kernel can share its
Q rows the same way (`shared_q_rows`; measured slower, off).

Causal (top-left aligned, as `jax.nn.dot_product_attention`): query i
attends keys j <= i. Tiles wholly above the diagonal are left out of the
loop bounds; only tiles that straddle it are masked.

Ranged form (`masked_backward.mosaic_backward_masked`: window, q_offset,
lengths, segment ids, soft cap, any lengths), chosen by `_Static.spec` at
trace time as in the forward (the plain form's code is untouched by it).
Each CTA reads a plan row built in XLA from `masking.classify_blocks` (the
one definition of the masks; see `masked.tile_plans`): per consumer the
range [lo, hi) of streamed blocks it computes and the run
[unmasked_lo, unmasked_hi) of them that need no mask, and the union
[first, total) that the producer streams. Every consumer walks every step
of the union, as in the plain form: the steps outside its range are skips.
Masked steps apply `masking.keep`, and score changes (the soft cap) enter
through `masking.modify_scores` and its derivative. Segment ids: those of a
consumer's own rows are resident; those of the streamed tiles travel in a
ring of their own, one more stream of the producer.
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
from pallas_kernels import compat as versions
from pallas_kernels.mosaic import compat
from pallas_kernels.mosaic.common import (
    LOG2E, PLAN_SCALARS, PLAN_UNION, PLAN_WIDTH, SMEM_LIMIT_BYTES,
    SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, SWIZZLE_BYTES, PlanRow,
    causal_mask, check_layout, check_shared_memory, check_tiles, launch_grid,
    per_column, per_row, persistent_num_ctas, persistent_schedule, read_plan,
    THREADS_PER_WARPGROUP, register_split, tile_index, variant_mask)
from pallas_kernels.mosaic.plan import BackwardConfig, backward_config
from pallas_kernels.triton.delta import row_delta

_MAX_CONSUMERS = 2
# f32 registers per consumer thread that the wgmma accumulators (the
# [rows, head_dim] dK/dV or dQ sums and the [rows, cols] S and dP tiles) may
# take of the consumers' 232; the rest holds P and dS in 16 bits, the
# softmax statistics and addresses. A [m, n] f32 accumulator of one
# warpgroup is m * n / 128 registers per thread.
_ACCUMULATOR_REGISTERS = 192
# The fused dQ's fourth warpgroup (the dQ writer) takes its registers from
# the producer: 2 * 232 + 24 + 24 = 512 per thread slot. 24 is setmaxnreg's
# least; both only issue TMA.
_FUSED_PRODUCER_REGISTERS = 24
# The fused dQ splits each Q tile's dQ into [_DQ_PIECE, _DQ_PIECE] pieces,
# one per consumer: 64 rows, a wgmma's height, by 64 columns, one 128-byte
# swizzle row of 16-bit K, so that a piece's slice of the resident K (and
# of dSᵀ) is whole swizzle tiles.
_DQ_PIECE = 64


# How a consumer treats a run of streamed steps (see `_walk_runs`).
_SKIP, _MASKED, _UNMASKED = "skip", "masked", "unmasked"


@dataclasses.dataclass(frozen=True)
class _Static:
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
  # (`_walk_scores_ahead`). Nsight Compute of d=64's 4k backward: 7% of
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
  # fixed order (see `_FusedDq`). 5 matmuls per tile pair instead of 7
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
  # dSᵀ meet in shared memory (`_dkdv_consume_shared`). So dK and dV fit
  # one pass where a consumer could not hold both whole (head_dim 256),
  # with two consumers.
  shared_rows: bool = False
  # Ranged kernels (`masked_backward`): the static `masking.MaskSpec`; loop
  # ranges come from a plan row per CTA instead of causal geometry.
  spec: Any = None

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


def mosaic_backward(query, key, value, out, lse, d_out, d_lse=None, *,
                    scale: float, is_causal: bool, **options):
  """Gradients of `mosaic_forward`'s output with respect to q, k and v.

  Args:
    query: [batch, q_len, num_heads, head_dim], bfloat16 or float16.
    key, value: [batch, kv_len, num_kv_heads, head_dim], same dtype;
      num_heads % num_kv_heads == 0 (query head h reads K/V head
      h // (num_heads // num_kv_heads)).
    out: the forward's output, like query.
    lse: float32 [batch, num_heads, q_len], the forward's natural-log
      logsumexp; -inf marks a row that attends to nothing (its gradients
      are zero).
    d_out: the cotangent of out, like query.
    d_lse: the cotangent of lse, like lse, or None (zero). Since
      d lse / d s = P, it only shifts delta: dS = P ∘ (dP - delta + d_lse).
    scale: multiplies q·k in the forward.
    is_causal: top-left aligned, query i attends keys j <= i (as
      `forward.mosaic_forward`, whose docstring draws it).
    **options: fields of `plan.BackwardConfig` replacing the plan's choice
      for this call (`plan.backward_config`): tiles, pipeline depth, the
      fused dQ, grid, shared rows, registers, when lse and Sᵀ are read and
      issued, the dQ kernel's own tiles.

  Returns:
    (dq, dk, dv), shaped and typed like (query, key, value).

  Raises:
    NotImplementedError: for calls these kernels do not cover (dtype, head
      dim, lengths not multiples of the tiles, tiles that do not fit in
      shared memory or registers), so that a dispatcher falls back.
  """
  config = _config(query, key, is_causal, options)
  check_supported(query, key, value, out, lse, d_out, d_lse,
                  block_q=config.block_q, block_kv=config.block_kv,
                  max_concurrent_steps=config.max_concurrent_steps)
  if config.dq_tiles is not None:
    check_tiles_divide(query.shape[1], key.shape[1],
                       block_q=config.dq_tiles[0],
                       block_kv=config.dq_tiles[1],
                       max_concurrent_steps=config.max_concurrent_steps)
  # Configuring raises for tiles that do not fit, before any work is traced.
  dq_config, dkdv_configs = statics(query, key, scale=scale,
                                    is_causal=is_causal, config=config)
  stats = row_statistics(out, lse, d_out, d_lse)
  return gradients(query, key, value, d_out, stats, dq_config, dkdv_configs)


def configure(query, key, *, scale: float, is_causal: bool, **options):
  """`mosaic_backward`'s kernels for these arguments: (`dq_static` or None
  when fused, [`dkdv_statics`' passes]), as `gradients` takes them. Raises
  NotImplementedError for tiles that do not fit."""
  return statics(query, key, scale=scale, is_causal=is_causal,
                 config=_config(query, key, is_causal, options))


def _config(query, key, is_causal: bool, options) -> BackwardConfig:
  """`plan.backward_config` of a call, its `dq_tiles` checked."""
  config = backward_config(head_dim=query.shape[-1], is_causal=is_causal,
                           q_len=query.shape[1], kv_len=key.shape[1],
                           **options)
  if config.dq_tiles is not None and (
      len(config.dq_tiles) != 2
      or not all(isinstance(n, int) for n in config.dq_tiles)):
    raise ValueError(f"dq_tiles must be (block_q, block_kv) of ints or None, "
                     f"got {config.dq_tiles!r}")
  return config


def gradients(query, key, value, d_out, stats, dq_config: _Static | None,
              dkdv_configs: list[_Static], *, dq_plan=None, dkdv_plan=None,
              segments=None):
  """(dq, dk, dv) by the dQ kernel and the dK/dV pass(es), or by the one
  fused kernel.

  Args:
    query, key, value, d_out: as `mosaic_backward`'s.
    stats: `row_statistics`, float32 [batch, num_heads, 2, rows].
    dq_config, dkdv_configs: from `statics` (dq_config None when the dK/dV
      kernel is fused with dQ).
    dq_plan, dkdv_plan: the ranged kernels' plan rows, int32
      [batch, num_tiles, PLAN_WIDTH] (see `masked.tile_plans`), or None.
    segments: the ranged kernels' (q ids [batch, q_len], kv ids
      [batch, kv_len]) when the spec has segment ids, else None.
  """
  if dq_config is None:
    (static,) = dkdv_configs
    dq_sum, dk, dv = launch_dkdv(query, key, value, d_out, stats, static)
    return (dq_sum * static.scale).astype(query.dtype), dk, dv
  dq = launch_dq(query, key, value, d_out, stats, dq_config, plan=dq_plan,
                 segments=segments)
  grads = {}
  for static in dkdv_configs:
    grads.update(zip(static.outputs,
                     launch_dkdv(query, key, value, d_out, stats, static,
                                 plan=dkdv_plan, segments=segments)))
  return dq, grads["dk"], grads["dv"]


def check_supported(query, key, value, out, lse, d_out, d_lse, *, block_q,
                    block_kv, max_concurrent_steps,
                    any_lengths: bool = False):
  """Validates shapes (ValueError/TypeError) and coverage (NotImplemented).

  `any_lengths`: the ranged kernels mask the tails of both sequences.
  """
  batch, q_len, num_heads, head_dim = query.shape
  kv_len, _ = check_layout(query, key, value)
  if out.shape != query.shape or d_out.shape != query.shape:
    raise ValueError(f"out and d_out must be {query.shape} like query; got "
                     f"{out.shape}, {d_out.shape}")
  if lse.shape != (batch, num_heads, q_len):
    raise ValueError(f"lse must be [batch, num_heads, q_len] = "
                     f"{(batch, num_heads, q_len)}; got {lse.shape}")
  dtype = jnp.dtype(query.dtype)
  if out.dtype != dtype or d_out.dtype != dtype:
    raise TypeError(f"out and d_out must be {dtype} like query; got "
                    f"{out.dtype}, {d_out.dtype}")
  if d_lse is not None and d_lse.shape != lse.shape:
    raise ValueError(f"d_lse must be {lse.shape} like lse; got {d_lse.shape}")
  if lse.dtype != jnp.float32:
    raise TypeError(f"lse must be float32, got {lse.dtype}")
  if dtype not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"mosaic_backward supports bfloat16 and float16, got {dtype}")
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise NotImplementedError(f"mosaic_backward supports head_dim in "
                              f"{SUPPORTED_HEAD_DIMS}, got {head_dim}")
  check_tiles_divide(q_len, kv_len, block_q=block_q, block_kv=block_kv,
                     max_concurrent_steps=max_concurrent_steps,
                     any_lengths=any_lengths)


def check_tiles_divide(q_len: int, kv_len: int, *, block_q: int,
                       block_kv: int, max_concurrent_steps: int,
                       any_lengths: bool = False):
  """The tiles are whole wgmma rows and (unless `any_lengths`) divide the
  lengths; NotImplementedError otherwise."""
  check_tiles(block_q, block_kv, max_concurrent_steps)
  if not any_lengths and q_len % block_q:
    raise NotImplementedError(f"q_len {q_len} must be a multiple of block_q "
                              f"{block_q} (tails are not masked yet)")
  if not any_lengths and kv_len % block_kv:
    raise NotImplementedError(f"kv_len {kv_len} must be a multiple of "
                              f"block_kv {block_kv} (tails are not masked yet)")


def row_statistics(out, lse, d_out, d_lse, *, interpret: bool | None = None):
  """float32 [batch, num_heads, 2, q_len]: (lse in base 2, delta) per row.

  delta = rowsum(dO ∘ O) - d_lse (FlashAttention-2 §3.2), the sum by
  `triton.delta.row_delta` (XLA fused it with the transpose and the stack
  into 0.32-0.39 ms at seq 1k, a quarter of the backward; the kernel takes
  0.06-0.07 ms); `interpret` is its interpret mode (None: when no GPU is
  present). An empty row (lse = -inf) gets +inf, so that P = exp2(s - lse)
  is 0 there, not inf. Stacked, so that a tile of both is one TMA.
  """
  if interpret is None:
    interpret = not versions.has_gpu()
  delta = row_delta(out, d_out, interpret=interpret)
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  lse_log2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
  return jnp.stack([lse_log2, delta], axis=2)


def _accumulator_registers(*shapes) -> int:
  """Registers per thread that f32 wgmma accumulators of `shapes` take."""
  return sum(m * n for m, n in shapes) // THREADS_PER_WARPGROUP


def _smem_bytes(*, num_consumers, num_stages, resident_rows, streamed_rows,
                head_dim, itemsize, resident_stats, streamed_stats) -> int:
  """Shared memory of either kernel.

  Each consumer keeps two [resident_rows, head_dim] tiles (K and V, or Q and
  dO); each ring slot holds two [streamed_rows, head_dim] tiles. The row
  statistics (lse, delta) are f32 pairs for the Q rows, resident or
  streamed.
  """
  tiles = (num_consumers * 2 * resident_rows
           + num_stages * 2 * streamed_rows) * head_dim * itemsize
  stats = (num_consumers * resident_stats + num_stages * streamed_stats) * 2 * 4
  return tiles + stats


def _ranged_smem_bytes(spec, *, num_consumers, num_stages, resident_rows,
                       streamed_rows) -> int:
  """The ranged kernels' extra shared memory (0 for the plain ones): a plan
  row per warpgroup and, with segment ids, the int32 ids of each consumer's
  rows and of each ring slot."""
  if spec is None:
    return 0
  plan = (num_consumers + 1) * PLAN_WIDTH * 4
  if not spec.has_segments:
    return plan
  return plan + (num_consumers * resident_rows
                 + num_stages * streamed_rows) * 4


def _tiled_length(length: int, block: int, spec) -> int:
  """The length the grid's CTA tiles must divide: the plain kernels need
  whole tiles; the ranged ones mask a tail, so any length counts as padded
  to whole tiles of `_MAX_CONSUMERS` consumers."""
  if spec is None:
    return length
  return pl.cdiv(length, _MAX_CONSUMERS * block) * _MAX_CONSUMERS * block


def _num_consumers(length, block, smem_of) -> int:
  """Two consumer warpgroups if the length splits and shared memory allows.

  Two consumers share every streamed tile, halving that traffic; at
  head_dim 256 their resident tiles leave no room for a ring.
  """
  for consumers in (_MAX_CONSUMERS, 1):
    if length % (consumers * block) == 0 and (
        smem_of(consumers) <= SMEM_LIMIT_BYTES):
      return consumers
  raise NotImplementedError(
      f"the backward tiles need {smem_of(1)} bytes of shared memory even "
      f"with one consumer; sm90 has {SMEM_LIMIT_BYTES}")


def statics(query, key, *, scale: float, is_causal: bool,
            config: BackwardConfig, spec=None):
  """(`dq_static`, `dkdv_statics`) of `config`'s kernels, or (None, [the
  fused pass]) with the fused dQ; `spec`: the ranged (masked) kernels' mask
  spec. Raises NotImplementedError for what the kernels lack."""
  tiles = dict(scale=scale, is_causal=is_causal, block_q=config.block_q,
               block_kv=config.block_kv,
               max_concurrent_steps=config.max_concurrent_steps, spec=spec)
  if spec is not None and (config.fused_dq or config.dq_tiles is not None):
    # The ranged kernels' plans classify blocks at the one pair of tiles.
    raise NotImplementedError(
        "the ranged backward has no fused dQ and no dq_tiles")
  if config.fused_dq:
    if config.persistent:
      raise NotImplementedError(
          "the fused dQ runs on the launch grid in its own order only: its "
          "K/V tiles wait for each other in order")
    if not config.overlap_softmax:
      raise NotImplementedError(
          "the fused dQ issues each step's dQ piece beside the next step's "
          "dV and dK: with overlap_softmax only")
    (fused,) = dkdv_statics(query, key, fused_dq=True, **tiles)
    return None, [dataclasses.replace(
        fused, overlap_softmax=True, prefetch_lse=bool(config.prefetch_lse))]
  if config.scores_ahead:
    _check_scores_ahead(config, is_causal=is_causal, spec=spec)
  options = dict(overlap_softmax=bool(config.overlap_softmax),
                 tile_fastest=True,
                 lean_producer=bool(config.lean_producer))
  dq_tiles_args = tiles if config.dq_tiles is None else dict(
      tiles, block_q=config.dq_tiles[0], block_kv=config.dq_tiles[1])
  dq_config = dataclasses.replace(dq_static(query, key, **dq_tiles_args),
                                  **options)
  dkdv_configs = [dataclasses.replace(
      static, **options, prefetch_lse=bool(config.prefetch_lse),
      scores_ahead=bool(config.scores_ahead))
                  for static in dkdv_statics(
                      query, key, shared_rows=config.shared_rows, **tiles)]
  for static in dkdv_configs if config.scores_ahead else ():
    if static.outputs != ("dk", "dv"):
      raise NotImplementedError(
          "scores_ahead: where dK and dV take one pass (not at head_dim "
          f"{static.head_dim} with block_q {static.block_q})")
  if config.persistent:
    batch, _, num_heads, _ = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    dq_config = _persistent(
        dq_config, config.num_ctas, num_heads=num_heads, batch=batch,
        tiles_per_head=pl.cdiv(query.shape[1], dq_config.q_rows_per_cta))
    dkdv_configs = [_persistent(
        static, config.num_ctas, num_heads=num_kv_heads, batch=batch,
        tiles_per_head=pl.cdiv(kv_len, static.kv_rows_per_cta))
                    for static in dkdv_configs]
  return dq_config, dkdv_configs


def _check_scores_ahead(config: BackwardConfig, *, is_causal: bool, spec):
  """NotImplementedError naming why the dK/dV kernel cannot issue Sᵀ a
  step ahead under `config`, if it cannot."""
  for refused, why in (
      (is_causal, "not under a causal mask (its masked steps)"),
      (config.shared_rows, "not with shared rows"),
      (spec is not None, "not in the ranged (masked) kernel"),
      (not config.overlap_softmax,
       "not without overlap_softmax (its walk always overlaps)"),
      (config.max_concurrent_steps < 2,
       "a ring of two stages or more (the next step's Q tile must arrive "
       "while this step's is held)")):
    if refused:
      raise NotImplementedError(f"scores_ahead: {why}")


def dq_static(query, key, *, scale, is_causal, block_q, block_kv,
              max_concurrent_steps, spec=None) -> _Static:
  """The dQ kernel's configuration (`spec`: the ranged form's mask spec)."""
  _, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  registers = _accumulator_registers((block_q, head_dim),
                                     (block_q, block_kv), (block_q, block_kv))
  if registers > _ACCUMULATOR_REGISTERS:
    raise NotImplementedError(
        f"dQ with block_q {block_q}, block_kv {block_kv} at head_dim "
        f"{head_dim} needs {registers} accumulator registers per thread; "
        f"at most {_ACCUMULATOR_REGISTERS} fit")
  num_kv_blocks = pl.cdiv(kv_len, block_kv)
  stages = min(max_concurrent_steps, num_kv_blocks)
  smem_of = lambda consumers: _smem_bytes(
      num_consumers=consumers, num_stages=stages, resident_rows=block_q,
      streamed_rows=block_kv, head_dim=head_dim,
      itemsize=jnp.dtype(query.dtype).itemsize, resident_stats=block_q,
      streamed_stats=0) + _ranged_smem_bytes(
          spec, num_consumers=consumers, num_stages=stages,
          resident_rows=block_q, streamed_rows=block_kv)
  return _Static(
      block_q=block_q, block_kv=block_kv,
      num_consumers=_num_consumers(_tiled_length(q_len, block_q, spec),
                                   block_q, smem_of),
      num_stages=stages, num_q_blocks=pl.cdiv(q_len, block_q),
      num_kv_blocks=num_kv_blocks, head_dim=head_dim,
      group=num_heads // num_kv_heads, scale=float(scale),
      scale_log2=float(scale) * LOG2E, is_causal=bool(is_causal),
      dtype=jnp.dtype(query.dtype), outputs=("dq",), spec=spec)


def dkdv_statics(query, key, *, scale, is_causal, block_q, block_kv,
                 max_concurrent_steps, spec=None, fused_dq: bool = False,
                 shared_rows: bool = False) -> list[_Static]:
  """One pass computing dK and dV, or one pass each if registers demand;
  `fused_dq`: the one pass that also sums dQ (raises where there is none),
  its resident rows opaque where the zero's cell fits; `shared_rows`: the
  one pass with shared K/V rows (likewise)."""
  if shared_rows:
    return [_shared_rows_static(
        query, key, scale=scale, is_causal=is_causal, block_q=block_q,
        block_kv=block_kv, max_concurrent_steps=max_concurrent_steps,
        spec=spec)]
  _, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  scores = (block_kv, block_q)
  per_output = (block_kv, head_dim)
  if _accumulator_registers(per_output, per_output, scores, scores) <= (
      _ACCUMULATOR_REGISTERS):
    passes = [("dk", "dv")]
  else:
    registers = _accumulator_registers(per_output, scores, scores)
    if registers > _ACCUMULATOR_REGISTERS:
      raise NotImplementedError(
          f"dK/dV with block_q {block_q}, block_kv {block_kv} at head_dim "
          f"{head_dim} needs {registers} accumulator registers per thread "
          f"even one output at a time; at most {_ACCUMULATOR_REGISTERS} fit")
    passes = [("dk",), ("dv",)]
  if fused_dq and len(passes) > 1:
    raise NotImplementedError(
        f"the fused dQ needs dK and dV in one pass; with block_q {block_q}, "
        f"block_kv {block_kv} at head_dim {head_dim} they take two")
  group = num_heads // num_kv_heads
  num_q_blocks = pl.cdiv(q_len, block_q)
  stages = min(max_concurrent_steps, group * num_q_blocks)
  smem_of = lambda consumers: _smem_bytes(
      num_consumers=consumers, num_stages=stages, resident_rows=block_kv,
      streamed_rows=block_q, head_dim=head_dim,
      itemsize=jnp.dtype(query.dtype).itemsize, resident_stats=0,
      streamed_stats=block_q) + _ranged_smem_bytes(
          spec, num_consumers=consumers, num_stages=stages,
          resident_rows=block_kv, streamed_rows=block_q) + (
              _fused_dq_smem_bytes(
                  num_consumers=consumers, block_q=block_q,
                  block_kv=block_kv, head_dim=head_dim,
                  itemsize=jnp.dtype(query.dtype).itemsize)
              if fused_dq else 0)
  consumers = _num_consumers(_tiled_length(kv_len, block_kv, spec), block_kv,
                             smem_of)
  if fused_dq and (_dq_pieces(block_q, head_dim) != consumers
                   or block_kv % _DQ_PIECE):
    raise NotImplementedError(
        f"the fused dQ gives each of its consumers one [{_DQ_PIECE}, "
        f"{_DQ_PIECE}] piece of the [{block_q}, {head_dim}] dQ tile and "
        f"needs block_kv a multiple of {_DQ_PIECE}; here {consumers} "
        f"consumers, block_kv {block_kv}")
  opaque = fused_dq and (
      smem_of(consumers) + _ZERO_CELL_BYTES <= SMEM_LIMIT_BYTES)
  return [
      _Static(block_q=block_q, block_kv=block_kv, num_consumers=consumers,
              num_stages=stages, num_q_blocks=num_q_blocks,
              num_kv_blocks=pl.cdiv(kv_len, block_kv), head_dim=head_dim,
              group=group, scale=float(scale),
              scale_log2=float(scale) * LOG2E, is_causal=bool(is_causal),
              dtype=jnp.dtype(query.dtype), outputs=outputs, spec=spec,
              fused_dq=bool(fused_dq), opaque_resident=opaque)
      for outputs in passes]


def _shared_rows_static(query, key, *, scale, is_causal, block_q, block_kv,
                        max_concurrent_steps, spec=None) -> _Static:
  """The dK/dV kernel with shared rows (`_Static.shared_rows`): two
  consumers on one resident copy of the CTA's K/V rows, in column parts,
  each with its column part of dK and dV and its part of the streamed Q
  rows' scores; the ring as usual; the parts of Pᵀ and dSᵀ exchanged."""
  _, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  consumers = _MAX_CONSUMERS
  itemsize = jnp.dtype(query.dtype).itemsize
  q_part, d_part = block_q // consumers, head_dim // consumers
  if spec is not None:
    raise NotImplementedError("the ranged backward has no shared K/V rows")
  if q_part * itemsize not in _EXCHANGE_SWIZZLES or d_part % 64:
    raise NotImplementedError(
        f"shared K/V rows split the {block_q} streamed rows and head_dim "
        f"{head_dim} between {consumers} consumers: each part of the "
        f"exchanged scores must be a swizzle row ({_EXCHANGE_SWIZZLES} "
        f"bytes) and each part of the columns whole 64-column tiles")
  if kv_len % block_kv:
    raise NotImplementedError(
        f"kv_len {kv_len} must be a multiple of block_kv {block_kv} "
        f"(shared K/V rows)")
  scores = (block_kv, q_part)
  registers = _accumulator_registers(
      (block_kv, d_part), (block_kv, d_part), scores, scores)
  if registers > _ACCUMULATOR_REGISTERS:
    raise NotImplementedError(
        f"shared K/V rows with block_q {block_q}, block_kv {block_kv} at "
        f"head_dim {head_dim} need {registers} accumulator registers per "
        f"thread; at most {_ACCUMULATOR_REGISTERS} fit")
  group = num_heads // num_kv_heads
  num_q_blocks = pl.cdiv(q_len, block_q)
  stages = min(max_concurrent_steps, group * num_q_blocks)
  smem = _smem_bytes(
      num_consumers=1, num_stages=stages, resident_rows=block_kv,
      streamed_rows=block_q, head_dim=head_dim, itemsize=itemsize,
      resident_stats=0, streamed_stats=block_q) + (
          2 * block_kv * block_q * itemsize)  # the exchange
  check_shared_memory(
      smem, SMEM_LIMIT_BYTES,
      f"shared K/V rows with block_q {block_q}, block_kv {block_kv} at "
      f"head_dim {head_dim}")
  return _Static(block_q=block_q, block_kv=block_kv, num_consumers=consumers,
                 num_stages=stages, num_q_blocks=num_q_blocks,
                 num_kv_blocks=pl.cdiv(kv_len, block_kv), head_dim=head_dim,
                 group=group, scale=float(scale),
                 scale_log2=float(scale) * LOG2E,
                 is_causal=bool(is_causal), dtype=jnp.dtype(query.dtype),
                 outputs=("dk", "dv"), shared_rows=True)


# Swizzles (bytes) that a part of the exchanged Pᵀ and dSᵀ, one swizzle row
# wide, can take: wgmma reads 32-, 64- and 128-byte swizzled operands.
_EXCHANGE_SWIZZLES = (32, 64, 128)


def _exchange_transforms(dtype, columns: int):
  """A [rows, columns] 16-bit tile exactly one swizzle row wide."""
  swizzle = columns * jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(swizzle))


def _fused_dq_smem_bytes(*, num_consumers, block_q, block_kv, head_dim,
                         itemsize) -> int:
  """The fused dQ's extra shared memory: every consumer's dSᵀ tile (16
  bits) and the CTA's f32 dQ tile, staged in pieces for the TMA reduce-add;
  twice each (this step's and the last)."""
  return 2 * (num_consumers * block_kv * block_q * itemsize
              + block_q * head_dim * 4)


# `_Static.opaque_resident`'s int32 zero: a scratch buffer of its own,
# padded to the alignment of the others (how much is Mosaic GPU's: at d=64's
# fused 128-row Q tiles the cell took the kernel 144 bytes over the limit);
# 1 KiB bounds it.
_ZERO_CELL_BYTES = 1024
# The fused dQ's consumers meet on this hardware barrier after their last
# pieces (`compat.named_barrier`: ids from 8 up are free).
_PIECES_DONE_BARRIER = 8


def _dq_pieces(block_q: int, head_dim: int) -> int:
  """[_DQ_PIECE, _DQ_PIECE] pieces of a [block_q, head_dim] dQ tile."""
  return pl.cdiv(block_q, _DQ_PIECE) * pl.cdiv(head_dim, _DQ_PIECE)


def _tile_transforms(dtype):
  """128-byte swizzle with 8-row tiles: what TMA writes and wgmma reads
  without bank conflicts."""
  swizzle_elems = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)),
          plgpu.SwizzleTransform(SWIZZLE_BYTES))


# ---------------------------------------------------------------------------
# dK/dV kernel.


def launch_dkdv(query, key, value, d_out, stats, static: _Static, *,
                plan=None, segments=None):
  """Launches the dK/dV kernel for `static.outputs`; returns them in order
  (fused dQ: the f32 [batch, q_len, num_heads, head_dim] sum of dS K, not
  yet scaled, first).

  Ranged: `plan` int32 [batch, num_kv_tiles, PLAN_WIDTH]; `segments` as
  `gradients` takes them.
  """
  batch, kv_len, num_kv_heads, head_dim = key.shape
  consumers, stages = static.num_consumers, static.num_stages
  transforms = _tile_transforms(static.dtype)
  resident_shape = (consumers, static.block_kv, head_dim)
  if static.shared_rows:
    # One copy of the rows, in column parts (a TMA box must be contiguous
    # in shared memory); every tile in the exchange's swizzle, since a
    # wgmma's operands share one.
    resident_shape = (consumers, static.block_kv, head_dim // consumers)
    transforms = _exchange_transforms(static.dtype,
                                      static.block_q // consumers)
  resident = plgpu.SMEM(resident_shape, static.dtype, transforms=transforms)
  streamed = plgpu.SMEM((stages, static.block_q, head_dim), static.dtype,
                        transforms=transforms)
  scratch = (
      resident,                                           # K, then dK
      resident,                                           # V, then dV
      streamed,                                           # Q ring
      streamed,                                           # dO ring
      plgpu.SMEM((stages, 2, static.block_q), jnp.float32),  # stats ring
      plgpu.Barrier(num_barriers=consumers),              # k_arrived
      plgpu.Barrier(num_barriers=consumers),              # v_arrived
      plgpu.Barrier(num_barriers=stages),                 # q_arrived
      plgpu.Barrier(num_barriers=stages),                 # do_arrived
      plgpu.Barrier(num_barriers=stages),                 # stats_arrived
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # consumed
  )
  inputs = (query, key, value, d_out, stats)
  if static.ranged:
    scratch += _ranged_scratch(static, resident_rows=static.block_kv,
                               streamed_rows=static.block_q)
    inputs += (plan, *(segments or ()))
  if static.shared_rows:
    scratch += _exchange_scratch(static, static.block_kv,
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
        plgpu.SMEM((2, _dq_pieces(static.block_q, head_dim), _DQ_PIECE,
                    _DQ_PIECE), jnp.float32,
                   transforms=_tile_transforms(jnp.float32)),  # dQ pieces
        plgpu.Barrier(num_arrivals=consumers, num_barriers=2),  # dq_staged
        plgpu.Barrier(num_barriers=2),                        # stage_free
        plgpu.Barrier(num_arrivals=consumers, num_barriers=2),  # ds_read
    )
    out_type = (versions.output_struct(query.shape, jnp.float32, *inputs),
                ) + out_type
  if static.opaque_resident:  # a zero (see `_Static.opaque_resident`)
    scratch += (plgpu.SMEM((1,), jnp.int32),)
  results = plgpu.kernel(
      functools.partial(_dkdv_kernel, static=static),
      out_type=out_type,
      scratch_types=scratch,
      # Pallas hands CUDA the grid reversed: batch is the fastest axis and
      # kv_tile the slowest, so CTAs launched together are the same K/V
      # tile of different heads. The fused dQ relies on this order: K/V tile
      # j of a head launches after tile j - 1 (see `_FusedDq`).
      **_grid(static, (pl.cdiv(kv_len, static.kv_rows_per_cta),
                       num_kv_heads, batch), ("kv_tile", "kv_head", "batch")),
      num_threads=consumers + 1 + static.fused_dq,  # + the dQ writer
      thread_name="wg",
      kernel_name=_kernel_name(
          static, "".join(("dq_",) * static.fused_dq + static.outputs)),
      compiler_params=compat.compiler_params(approx_math=True),
  )(*inputs)
  return tuple(compat.vary_like(results, *inputs))


def _dkdv_kernel(*refs, static: _Static):
  """Kernel body; refs: `launch_dkdv`'s inputs (q, k, v, dO, stats, then
  the ranged kernel's plan, q ids, kv ids), the outputs, its scratch list.

  Launch grid: one K/V tile per CTA. Persistent grid (`static.persistent`):
  each CTA computes its tiles of `persistent_schedule` in turn (causal:
  K/V tile j reads the Q tiles from j on, so tiles go in pairs), the ring
  of streamed steps running on across tiles (see `_produce`).
  """
  num_inputs = 5 + static.ranged + 2 * static.segmented
  names = ("dq_sum",) * static.fused_dq + static.outputs
  inputs = refs[:num_inputs]
  out_refs = dict(zip(names, refs[num_inputs:num_inputs + len(names)]))
  scratch = refs[num_inputs + len(names):]
  wg = lax.axis_index("wg")
  batch_size, kv_len, num_kv_heads, _ = inputs[1].shape
  tile = functools.partial(_dkdv_tile, inputs, out_refs, scratch,
                           static=static)
  _each_tile(
      tile, wg, static=static, tile_axes=("batch", "kv_head", "kv_tile"),
      num_tiles=pl.cdiv(kv_len, static.kv_rows_per_cta),
      num_heads=num_kv_heads, batch=batch_size)


def _each_tile(tile, wg, *, static: _Static, tile_axes, num_tiles, num_heads,
               batch):
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
      lean=static.lean_producer)  # (see `_Static`)
  pl.when(wg < static.num_consumers)(
      lambda: run(consumer_registers, "increase", True))
  if static.fused_dq:  # the producer, and the dQ writer after it
    pl.when(wg >= static.num_consumers)(
        lambda: run(_FUSED_PRODUCER_REGISTERS, "decrease", False))
  else:
    pl.when(wg == static.num_consumers)(
        lambda: run(producer_registers, "decrease", False))


def _dkdv_tile(inputs, out_refs, scratch, batch, kv_head, kv_tile, wg, base,
               consumer: bool, *, static: _Static):
  """Consumer `wg`'s or the producer's part of K/V tile `kv_tile`; returns
  the tile's streamed steps. `base`: steps streamed before it on a
  persistent grid, or None."""
  q_ref, k_ref, v_ref, do_ref, stats_ref = inputs[:5]
  (k_smem, v_smem, q_ring, do_ring, stats_ring, k_arrived, v_arrived,
   q_arrived, do_arrived, stats_arrived, consumed) = scratch[:11]
  tile_start = kv_tile * static.kv_rows_per_cta
  plan, ids = _ranged_refs(static, inputs[5:], scratch[11:], batch=batch,
                           tile=kv_tile, own_is_query=False)
  num_steps = None
  if plan is None:
    # The union of the consumers' Q tiles, per query head of the group:
    # [first, num_q_blocks), where first is consumer 0's (it sees the most).
    first = _first_q_block(tile_start, static)
    per_head = static.num_q_blocks - first
    num_steps = static.group * per_head
  arrived = (q_arrived, do_arrived, stats_arrived) + _ids_arrived(ids)
  fused = None
  if static.fused_dq:
    fused = _FusedDq(*scratch[11:16], k=k_smem, dq_sum=out_refs["dq_sum"],
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
    plgpu.copy_gmem_to_smem(k_ref.at[batch, kv_rows, kv_head], own_k,
                            k_arrived.at[wg])
    if "dk" in static.outputs:  # only dPᵀ = V dOᵀ reads V
      plgpu.copy_gmem_to_smem(v_ref.at[batch, kv_rows, kv_head], own_v,
                              v_arrived.at[wg])
      plgpu.barrier_wait(v_arrived.at[wg])
    plgpu.barrier_wait(k_arrived.at[wg])
    q_of = None
    if plan is None:
      if fused is None:
        walk = _Walk(first, per_head,
                     _dkdv_causal_runs(kv_start, first, static), None)
      else:  # position p of the walk is Q tile `q_of(p)`
        q_of = functools.partial(_fused_q_block, first=first, static=static)
        walk = _Walk(0, per_head, _fused_runs(kv_start, first, static), None)
      tile_mask = lambda i, slot: _causal_mask_t(kv_start, i, static)
    else:
      walk = _ranged_walk(plan, wg)
      own_ids = _own_ids(ids, kv_rows, wg)
      shape = (static.block_kv, static.block_q)
      tile_mask = lambda i, slot: _variant_mask_t(
          kv_start, i, static, _tile_values(walk.values, own_ids, ids, slot,
                                            shape, own_is_query=False))
    resident = None
    if static.opaque_resident:  # see `_Static.opaque_resident`
      zero_smem = scratch[-1]
      zero_smem[...] = jnp.zeros((1,), jnp.int32)

      def resident():
        zero = zero_smem[0]  # read each step: the compiler cannot fold it
        return k_smem.at[wg + zero], v_smem.at[wg + zero], zero
    if static.scores_ahead:
      # Every step unmasked: one walk a step ahead across the group's heads.
      grads = _dkdv_consume_ahead(own_k, own_v, q_ring, do_ring, stats_ring,
                                  arrived, consumed, num_steps=num_steps,
                                  slot_of=_ring_slot(static, base),
                                  static=static)
    else:
      grads = _dkdv_consume(own_k, own_v, q_ring, do_ring, stats_ring,
                            arrived, consumed, walk=walk,
                            tile_mask=tile_mask, static=static, base=base,
                            fused=fused, wg=wg, q_of=q_of, resident=resident)
    if fused is not None:
      # The other consumers' last dQ pieces read this one's K rows: every
      # consumer is past them before any overwrites its K with dK (a race
      # found by reading in session 11, never seen in a GPU test).
      compat.named_barrier("sync", _PIECES_DONE_BARRIER,
                           static.num_consumers * THREADS_PER_WARPGROUP)
    # K and V are dead: write the gradients through their buffers.
    staged = {"dk": own_k, "dv": own_v}
    for name, grad in zip(static.outputs, grads):
      staged[name][...] = grad.astype(static.dtype)
    plgpu.commit_smem()
    for name in static.outputs:
      plgpu.copy_smem_to_gmem(staged[name],
                              out_refs[name].at[batch, kv_rows, kv_head])
    # Persistent: the next tile's K and V may load once these have left.
    plgpu.wait_smem_to_gmem(0, wait_read_only=base is not None)

  def _shared_consumer(c: int):
    kv_rows = pl.ds(tile_start, static.block_kv)
    columns = _column_part(c, static)
    # On a persistent grid, once its own stores from them have left (see
    # the end).
    _load_column_parts(c, ((k_ref, k_smem, k_arrived),
                           (v_ref, v_smem, v_arrived)),
                       batch=batch, rows=kv_rows, head=kv_head, static=static)
    walk = _Walk(first, per_head,
                 _dkdv_causal_runs(tile_start, first, static), None)
    grads = _dkdv_consume_shared(
        c, k_smem, v_smem, q_ring, do_ring, stats_ring, arrived, consumed,
        scratch[11:], walk=walk, kv_start=tile_start, static=static,
        base=base)
    # Every consumer is past its last step (`_dkdv_consume_shared`), so K
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
      walk = _ranged_walk(plan, static.num_consumers, consumer=False)
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

    streams = [(tile(q_ref), q_ring, q_arrived),
               (tile(do_ref), do_ring, do_arrived),
               (stats_tile, stats_ring, stats_arrived)]
    if ids is not None:  # query ids travel with their Q tiles
      streams.append((lambda step: ids.streamed_gmem.at[q_rows_of(step)[1]],
                      ids.ring, ids.ring_arrived))
    _produce(streams, consumed, union_steps, static, base=base)

  def _writer():
    batch_size, _, num_heads, _ = q_ref.shape
    turns = pl.get_global(plgpu.SemaphoreType.REGULAR(
        (batch_size * num_heads * static.num_q_blocks,)))
    _write_dq(fused._replace(turns=turns), batch=batch, order=kv_tile,
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


def _fused_q_block(i, *, first, static: _Static):
  """The Q tile of position i of a fused dK/dV tile's walk over Q tiles
  [first, num_q_blocks): in order, or under causal masking from the last
  down. Each K/V tile adds to a Q tile's dQ after the one before it
  (`_FusedDq`); walking down, every K/V tile reaches a Q tile at the same
  step, so that each needs only to trail the one before it by a step, as
  without a mask. Walking up, tile j would start at Q tile 2j, two steps
  before tile j - 1 reaches it, and so wait: the more, the later j."""
  if static.is_causal:
    return static.num_q_blocks - 1 - i
  return first + i


def _fused_runs(kv_start, first, static: _Static):
  """The fused kernel's runs over walk positions [0, num_q_blocks - first)
  (`_fused_q_block`) for K/V rows from kv_start. A consumer computes every
  step, its rows' or not (the pieces of dQ it computes need both
  consumers' dSᵀ): under causal masking, first the Q tiles wholly below the
  diagonal for these rows, then those at or above it, masked (wholly: to a
  zero dS)."""
  if not static.is_causal:
    return ((0, static.num_q_blocks, _UNMASKED),)
  unmasked = static.num_q_blocks - _first_unmasked_q_block(kv_start, static)
  return ((0, unmasked, _UNMASKED),
          (unmasked, static.num_q_blocks - first, _MASKED))


def _dkdv_consume(k_smem, v_smem, q_ring, do_ring, stats_ring, arrived,
                  consumed, *, walk: _Walk, tile_mask, static: _Static,
                  base=None, fused: _FusedDq | None = None, wg=None,
                  q_of=None, resident=None):
  """Consumer: dK, dV (f32, unscaled dK) of its `block_kv` K/V rows.

  Walks the producer's steps: for each query head of the group, Q tiles
  [walk.first, walk.first + walk.num_blocks), treated as `walk.runs` say
  (skipped, masked by `tile_mask(q_block, slot)`, or unmasked). Persistent:
  the ring slots count on from `base`. Fused dQ (`fused`): each step also
  issues consumer `wg`'s piece of the CTA's dS K for the step before
  (`_issue_merged_piece`), and the walk's positions are Q tiles
  `q_of(position)`. `resident` (`_Static.opaque_resident`): called each
  step, returns that step's views of the K and V rows and the zero that
  offsets them.
  """
  slot_of = _ring_slot(static, base)
  zeros = plgpu.layout_cast(
      jnp.zeros((static.block_kv, static.head_dim), jnp.float32),
      plgpu.Layout.WGMMA)
  grads = tuple(zeros for _ in static.outputs)

  def step_body(i, grads, *, head_base, masked):
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
    column_stat = functools.partial(_column_stat, stats_ring, slot)
    lse_log2 = column_stat(0) if static.prefetch_lse else None

    def probabilities(s_t):
      """(Pᵀ, its slope)."""
      p_t, slope = _probabilities(
          s_t, column_stat(0) if lse_log2 is None else lse_log2, per_column,
          walk.values, static)
      if masked:
        p_t = jnp.where(tile_mask(q_block, slot), p_t, 0.0)
      return p_t, slope

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
      (p_t, slope), *dp_t = _wgmma_then(shape, products, probabilities)
      piece = None
      if fused is not None:
        piece = functools.partial(_issue_merged_piece, fused, wg, step=step,
                                  static=static, offset=offset)
      grads = _dkdv_accumulate_overlapped(
          grads, p_t, dp_t, slope, q_tile, do_tile, stats_ring.at[slot],
          static, store_ds=store_ds, piece=piece)
      plgpu.barrier_arrive(consumed.at[slot])
      if piece is not None:
        *grads, piece_value = grads
        _stage_merged_piece(fused, wg, piece_value, step=step)
      return tuple(grads)
    s_t, *dp_t = _wgmma_fresh(shape, products)
    p_t, slope = probabilities(s_t)
    updates = []
    for name in static.outputs:
      if name == "dv":
        updates.append((p_t.astype(static.dtype), do_tile))  # dV += Pᵀ dO
      else:
        ds_t = _score_gradient(p_t, dp_t[0],
                               per_column(column_stat(1), s_t.shape), slope)
        updates.append((ds_t.astype(static.dtype), q_tile))  # dK += dSᵀ Q
    grads = _wgmma_accumulate(grads, updates)
    plgpu.barrier_arrive(consumed.at[slot])
    return grads

  grads = _walk_group(walk, step_body, arrived, consumed, slot_of, static,
                      grads)
  if fused is not None:  # the last step's pieces
    last = static.group * walk.num_blocks - 1 - walk.first
    offset = 0 if resident is None else resident()[2]
    pl.when(last >= 0)(functools.partial(
        _stage_dq_pieces, fused, wg, step=last, static=static, offset=offset))
  return tuple(grad * static.scale if name == "dk" else grad
               for name, grad in zip(static.outputs, grads))


def _dkdv_consume_ahead(k_rows, v_rows, q_ring, do_ring, stats_ring,
                        arrived, consumed, *, num_steps, slot_of,
                        static: _Static):
  """Consumer: (dK scaled, dV), f32, of its `block_kv` K/V rows over
  `num_steps` unmasked steps (step i in ring slot `slot_of(i)`), each
  step's Sᵀ issued before the step before has seen its dK done
  (`_Static.scores_ahead`, `_walk_scores_ahead`).

  A step's products are Sᵀ = K Qᵀ and dPᵀ = V dOᵀ ([block_kv, block_q]),
  then dV += Pᵀ dO and dK += dSᵀ Q. The arithmetic is `_dkdv_consume`'s
  (overlapped) to the bit: lse is read once Sᵀ is done (before it, with
  `prefetch_lse`), delta once dV is issued.
  """
  column_stat = functools.partial(_column_stat, stats_ring)

  def with_accumulators(s_ref, dp_ref, dk_ref, dv_ref):
    def products(slot):
      return ((k_rows, q_ring.at[slot].transpose((1, 0))),
              (v_rows, do_ring.at[slot].transpose((1, 0))))

    def probabilities(slot, wait_scores):
      lse_log2 = column_stat(slot, 0) if static.prefetch_lse else None
      s_t = wait_scores()
      if lse_log2 is None:
        lse_log2 = column_stat(slot, 0)
      return _probabilities(s_t, lse_log2, per_column, None, static)[0]

    def gradients(slot, p_t, dp_t):
      plgpu.wgmma(dv_ref, p_t.astype(static.dtype), do_ring.at[slot])
      delta = column_stat(slot, 1)
      ds_t = _score_gradient(p_t, dp_t, per_column(delta, p_t.shape), None)
      plgpu.wgmma(dk_ref, ds_t.astype(static.dtype), q_ring.at[slot])

    _walk_scores_ahead(s_ref, dp_ref, num_steps=num_steps, arrived=arrived,
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


def _column_stat(stats_ring, slot, n):
  """Row statistic n (0: lse, 1: delta) of a dK/dV step's Q rows, from its
  ring slot, in the layout of an Sᵀ tile's columns."""
  return plgpu.layout_cast(stats_ring[slot, n], plgpu.Layout.WGMMA.reduce(0))


def _ring_slot(static: _Static, base=None):
  """step -> its ring slot; persistent: the ring counts on from `base`."""
  def slot_of(step):
    if base is None and isinstance(step, int):  # no arithmetic on constants
      return step % static.num_stages          # alone in the lowering
    return lax.rem(step if base is None else base + step, static.num_stages)
  return slot_of


def _walk_scores_ahead(s_ref, dp_ref, *, num_steps: int, arrived, consumed,
                       slot_of, products, probabilities, gradients):
  """A dK/dV consumer's `num_steps` unmasked steps, each step's scores
  issued before the step before has seen its gradients done
  (`_Static.scores_ahead`).

  A step issues Sᵀ (into `s_ref`) and dPᵀ (`dp_ref`), the two
  `products(slot)` ((a, b) pairs: Sᵀ = a b), computes
  Pᵀ = `probabilities(slot, wait_scores)` (`wait_scores()` waits for Sᵀ
  and returns it, while dPᵀ runs), reads dPᵀ, and issues its two gradient
  products, dV then dK (`gradients(slot, p, dp)`). Step t + 1's Sᵀ is
  issued right after those, once its tiles have arrived and dV_t is done
  (its 16-bit Pᵀ operand's registers: with them held, ptxas serialized
  every wgmma for registers, C7512, session 24), so the tensor cores run
  it as soon as dK_t is done, not after this warpgroup has seen that,
  released the slot and issued it. Then the warpgroup waits for dK_t
  (wgmmas complete in issue order: Sᵀ may still run), releases the slot
  and issues dPᵀ.

  The loop turns after dPᵀ is read, where no wgmma is in flight: with the
  gradients' or Sᵀ's accumulators in flight across the back edge, ptxas
  serialized every wgmma of the kernel (C7514, session 24). In flight
  together are at most dK_t, its 16-bit dSᵀ_t operand and Sᵀ_{t+1}.
  Returns once every wgmma is done and the last slot is released.
  """
  zeros = lambda: plgpu.layout_cast(jnp.zeros(s_ref.shape, jnp.float32),
                                    plgpu.Layout.WGMMA)

  def scores(step, *, fresh: bool, before_dp=None):
    """Step's (Pᵀ, dPᵀ); nothing in flight after. Not `fresh`: the
    accumulators hold the step before's, and its dV and dK may run."""
    slot = slot_of(step)
    for barrier in arrived:
      plgpu.barrier_wait(barrier.at[slot])
    (s_a, s_b), (dp_a, dp_b) = products(slot)
    if not fresh:
      plgpu.wgmma_wait(1)  # dV of the step before
      s_ref[...] = zeros()
    plgpu.wgmma(s_ref, s_a, s_b)
    if before_dp is not None:
      before_dp()
    if not fresh:
      dp_ref[...] = zeros()
    plgpu.wgmma(dp_ref, dp_a, dp_b)
    p = probabilities(
        slot, lambda: plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
    return p, plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)

  def release(step):
    plgpu.barrier_arrive(consumed.at[slot_of(step)])

  def step_body(t, carry):
    gradients(slot_of(t), *carry)

    def gradients_done():  # dK_t; Sᵀ of step t + 1 may still run
      plgpu.wgmma_wait(1)
      release(t)
    return scores(t + 1, fresh=False, before_dp=gradients_done)

  carry = lax.fori_loop(0, num_steps - 1, step_body, scores(0, fresh=True))
  gradients(slot_of(num_steps - 1), *carry)
  plgpu.wgmma_wait(0)
  release(num_steps - 1)


def _walk_group(walk: _Walk, step_body, arrived, consumed, slot_of,
                static: _Static, grads):
  """A dK/dV consumer's walk: for each query head of the group, the runs
  of `walk`, skipped steps released at once, the others
  `step_body(i, grads, head_base=, masked=)`; step of walk position i of
  query head g is head_base + i."""
  def skip_body(i, grads, *, head_base):
    _skip_step(arrived, consumed, slot_of(head_base + i))
    return grads

  def head_body(g, grads):
    head_base = g * walk.num_blocks - walk.first
    bodies = {
        _SKIP: functools.partial(skip_body, head_base=head_base),
        _MASKED: functools.partial(step_body, head_base=head_base,
                                   masked=True),
        _UNMASKED: functools.partial(step_body, head_base=head_base,
                                     masked=False)}
    return _walk_runs(walk.runs, bodies, grads)

  return lax.fori_loop(0, static.group, head_body, grads)


def _exchange_scratch(static: _Static, rows: int, part_columns: int, *,
                      kinds: int):
  """Shared rows' exchange (`_Exchange`): `kinds` score tiles, each in one
  16-bit [rows, part_columns] part per consumer (a ref each, so that wgmma
  operands need no constant indices, which `pl.run_state` cannot take),
  then the barriers `exchanged` and `free`."""
  consumers = static.num_consumers
  part = plgpu.SMEM((rows, part_columns), static.dtype,
                    transforms=_exchange_transforms(static.dtype,
                                                    part_columns))
  return tuple(part for _ in range(kinds * consumers)) + tuple(
      plgpu.Barrier(num_arrivals=consumers, num_barriers=1)
      for _ in range(2))


class _Exchange(NamedTuple):
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
  def of(cls, refs, *, kinds: int, consumers: int) -> "_Exchange":
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


def _load_column_parts(c: int, tensors, *, batch, rows, head,
                       static: _Static):
  """Shared rows: consumer c loads its column part of each resident tensor
  ((gmem ref, smem parts, arrival barriers) in `tensors`) by TMA, then
  waits for every consumer's parts."""
  columns = _column_part(c, static)
  for ref, smem, arrived in tensors:
    plgpu.copy_gmem_to_smem(ref.at[batch, rows, head, columns], smem.at[c],
                            arrived.at[c])
  for _, _, arrived in tensors:
    for other in range(static.num_consumers):
      plgpu.barrier_wait(arrived.at[other])


def _column_part(c: int, static: _Static):
  """Consumer c's head_dim columns under shared K/V rows."""
  part = static.head_dim // static.num_consumers
  return pl.ds(c * part, part)


def _dkdv_consume_shared(c: int, k_smem, v_smem, q_ring, do_ring, stats_ring,
                         arrived, consumed, exchange_refs, *, walk: _Walk,
                         kv_start, static: _Static, base=None):
  """Consumer c under shared K/V rows (`_Static.shared_rows`): its columns
  of dK (f32, scaled) and dV, [block_kv, head_dim / num_consumers] each.

  Per step, with Q rows r_c (its part of the step's Q tile) and columns
  d_c (its part of head_dim):
    Sᵀ_c = K Q[r_c]ᵀ, dPᵀ_c = V dO[r_c]ᵀ      [block_kv, block_q / n]
    Pᵀ_c, dSᵀ_c  into the exchange; wait for every consumer's
    dV[:, d_c] += Σ_k Pᵀ_k dO[r_k, d_c],  dK[:, d_c] += Σ_k dSᵀ_k Q[r_k, d_c]
  so each consumer sums the same products in the same order as the
  consumer that owns all the columns would. `exchange_refs`: the
  `_exchange_scratch` of Pᵀ's and dSᵀ's [block_kv, block_q / n] parts.
  """
  consumers = static.num_consumers
  exchange = _Exchange.of(exchange_refs, kinds=2, consumers=consumers)
  p_parts, ds_parts = exchange.parts
  q_part = static.block_q // consumers
  rows = lambda k: pl.ds(k * q_part, q_part)
  columns = _column_part(c, static)
  shape = (static.block_kv, q_part)
  slot_of = _ring_slot(static, base)
  zeros = plgpu.layout_cast(
      jnp.zeros((static.block_kv, static.head_dim // consumers), jnp.float32),
      plgpu.Layout.WGMMA)
  column_stats = lambda stats, n: plgpu.layout_cast(
      stats[n, rows(c)], plgpu.Layout.WGMMA.reduce(0))

  def step_body(i, grads, *, head_base, masked):
    slot = slot_of(head_base + i)
    for barrier in arrived:
      plgpu.barrier_wait(barrier.at[slot])
    q_tile, do_tile = q_ring.at[slot], do_ring.at[slot]
    stats = stats_ring.at[slot]
    lse_log2 = column_stats(stats, 0) if static.prefetch_lse else None

    def probabilities(s_t):
      lse = column_stats(stats, 0) if lse_log2 is None else lse_log2
      p_t, _ = _probabilities(s_t, lse, per_column, None, static)
      if masked:
        p_t = jnp.where(_causal_mask_t(kv_start, i, static,
                                       q_rows=(c * q_part, q_part)), p_t, 0.0)
      return p_t

    # K and V are in column parts p: Sᵀ_c = Σ_p K_p Q[r_c, d_p]ᵀ, and dPᵀ_c.
    products = [[(smem.at[p], tile.at[rows(c), _column_part(p, static)]
                  .transpose((1, 0))) for p in range(consumers)]
                for smem, tile in ((k_smem, q_tile), (v_smem, do_tile))]
    if static.overlap_softmax:
      p_t, dp_t = _wgmma_then(shape, products, probabilities)
    else:
      s_t, dp_t = _wgmma_fresh(shape, products)
      p_t = probabilities(s_t)
    delta = column_stats(stats, 1)
    ds_t = _score_gradient(p_t, dp_t, per_column(delta, shape), None)
    exchange.put(c, [p_t, ds_t], static.dtype)
    grads = _wgmma_accumulate_sums(grads, [
        [(ds_parts[k], q_tile.at[rows(k), columns])   # dK
         for k in range(consumers)],
        [(p_parts[k], do_tile.at[rows(k), columns])    # dV
         for k in range(consumers)]])
    plgpu.barrier_arrive(consumed.at[slot])
    exchange.release()
    return grads

  exchange.begin()
  grads = _walk_group(walk, step_body, arrived, consumed, slot_of, static,
                      (zeros, zeros))
  exchange.end()
  dk, dv = grads
  return dk * static.scale, dv


class _FusedDq(NamedTuple):
  """Shared memory, barriers and global refs of the fused dQ
  (`_Static.fused_dq`); `_stage_dq` and `_write_dq` say how they are used.

  Every Q tile's dQ is a sum over the K/V tiles (CTAs) that see it. Each
  CTA's share, dS K for the step's Q tile, is a sum over its consumers' K/V
  rows: so the consumers store their dSᵀ tiles and wait for each other,
  then each computes some [_DQ_PIECE, _DQ_PIECE] pieces of it and stages
  them; the CTA's dQ writer (a warpgroup of its own, so that the consumers
  never wait on global memory) adds them, f32, by TMA reduce-add into
  `dq_sum`, the first K/V tile storing instead. In a fixed order, so that
  the float sums are the same every run: K/V tile j is the j-th, and its
  writer waits on the Q tile's turn semaphore until the writer of tile
  j - 1 has handed it on, once its add reached memory. Every earlier K/V
  tile adds to the Q tile: under causal masking K/V tile j sees Q tiles
  from j's diagonal on, a superset of those of later tiles, and a consumer
  walks (masked) also the steps its rows do not need. The earlier tiles are
  launched first (see `launch_dkdv`'s grid), and between tiles j - 1 and j
  of a head come the other heads' tile j - 1: so a wait never waits for a
  CTA that is not running or done, and tile j - 1 is a few steps ahead by
  the time tile j starts.
  """
  ds: Any          # [2, consumers, block_kv, block_q] 16-bit: dSᵀ tiles
  ds_stored: Any   # barriers [2], an arrival per consumer (unused with
                   # `_Static.hw_ds_sync`, which meets on a hardware one)
  stage: Any       # f32 [2, pieces, _DQ_PIECE, _DQ_PIECE]: the CTA's dS K
  staged: Any      # barriers [2], an arrival per consumer: pieces staged
  stage_free: Any  # barriers [2]: the writer read the stage
  k: Any           # [consumers, block_kv, head_dim]: the CTA's K rows
  dq_sum: Any      # f32 [batch, q_len, num_heads, head_dim], global
  turns: Any       # int32 semaphores [batch * num_heads * num_q_blocks]
  ds_read: Any = None  # barriers [2], an arrival per consumer: its pieces
                       # read the dSᵀ tiles (`_Static.deferred_dq`)


def _piece_position(number, static: _Static):
  """(row, column) of dQ piece `number` (a Python or traced int) in the
  [block_q, head_dim] tile, row-major, counted in pieces."""
  return divmod(number, pl.cdiv(static.head_dim, _DQ_PIECE))


def _pieces(static: _Static):
  """The [_DQ_PIECE, _DQ_PIECE] pieces of the [block_q, head_dim] dQ tile,
  row-major: (number, row, column), row and column counted in pieces."""
  return [(n, *_piece_position(n, static))
          for n in range(_dq_pieces(static.block_q, static.head_dim))]


def _pieces_of(wg: int, static: _Static):
  """Consumer wg's pieces: numbers wg, wg + num_consumers, ..."""
  return _pieces(static)[wg::static.num_consumers]


def _stage_dq_pieces(fused: _FusedDq, wg, *, step, static: _Static,
                     offset=0):
  """Consumer wg's pieces of the CTA's dS K for `step` (the walk's last),
  once every consumer stored its dSᵀ of `step`: computed and staged for
  the writer."""
  parity = lax.rem(step, 2)
  plgpu.barrier_wait(fused.ds_stored.at[parity])
  # The writer has read this stage's pieces of step - 2.
  pl.when(step >= 2)(lambda: plgpu.barrier_wait(fused.stage_free.at[parity]))
  ds, stage = fused.ds.at[parity], fused.stage.at[parity]

  def compute(wg: int):
    # Static slices: a Python branch per consumer.
    for number, _, _ in _pieces_of(wg, static):
      stage[number] = _wgmma_sum((_DQ_PIECE, _DQ_PIECE), list(
          _piece_operands(fused, ds, number, static=static, offset=offset)))

  for c in range(static.num_consumers):
    pl.when(wg == c)(functools.partial(compute, c))
  plgpu.commit_smem()  # the pieces, read by the writer's TMA
  plgpu.barrier_arrive(fused.staged.at[parity])
  plgpu.barrier_arrive(fused.ds_read.at[parity])  # done with dSᵀ


def _piece_operands(fused: _FusedDq, ds, number, *, static: _Static,
                    offset=0):
  """Yields the wgmma operands whose products sum to dQ piece `number` (a
  Python or traced int) of the CTA's dS K: for each consumer k, the
  piece's rows of k's dSᵀ [block_kv / consumers, block_q] in `ds`,
  transposed, and the piece's columns of k's K rows (the k-th slice of
  the CTA's K/V rows is consumer k's). `offset`: see `_stage_dq`.

  A generator, so that an index computed for operand k is computed where
  the caller takes it: the merged path issues each wgmma as it goes, the
  staged path lists them before its accumulator's scope (the kernels'
  jaxprs as before this helper).
  """
  row, col = _piece_position(number, static)
  rows = pl.ds(row * _DQ_PIECE, _DQ_PIECE)
  cols = pl.ds(col * _DQ_PIECE, _DQ_PIECE)
  for k in range(static.num_consumers):
    yield (ds.at[k, :, rows].transpose((1, 0)),
           fused.k.at[k + offset, :, cols])


def _issue_merged_piece(fused: _FusedDq, wg, acc_ref, *, step,
                        static: _Static, offset=0):
  """Issues consumer wg's piece of the CTA's dS K for step - 1 into
  `acc_ref`, once every consumer stored its dSᵀ of step - 1 and the writer
  freed that stage (`_Static.merged_pieces`). At step 0 it computes from a
  dSᵀ buffer no one stored (nothing waited for, the result is staged
  where no one reads it, see `_stage_merged_piece`), so that the wgmma
  group has the same shape every step."""
  parity = lax.rem(step + 1, 2)  # step - 1's, for step >= 0
  pl.when(step >= 1)(functools.partial(plgpu.barrier_wait,
                                       fused.ds_stored.at[parity]))
  # The writer has read this stage's pieces of step - 3.
  pl.when(step >= 3)(functools.partial(plgpu.barrier_wait,
                                       fused.stage_free.at[parity]))
  # Consumer wg's one piece is number wg.
  for lhs, rhs in _piece_operands(fused, fused.ds.at[parity], wg,
                                  static=static, offset=offset):
    plgpu.wgmma(acc_ref, lhs, rhs)


def _stage_merged_piece(fused: _FusedDq, wg, value, *, step):
  """After the step's wgmmas (`_Static.merged_pieces`): stages consumer
  wg's piece of step - 1 for the writer and says that this consumer's dSᵀ
  of `step` is stored and its piece of step - 1 is staged and done with
  that step's dSᵀ. At step 0 the piece is garbage and lands in the stage of
  parity 1, which the writer reads only once step 1's pieces are staged
  there (at step 2, or after the walk when step 1 is the last)."""
  parity = lax.rem(step + 1, 2)
  fused.stage.at[parity][wg] = value
  plgpu.commit_smem()  # this dSᵀ for every consumer's wgmma, the piece for TMA
  plgpu.barrier_arrive(fused.ds_stored.at[lax.rem(step, 2)])

  @pl.when(step >= 1)
  def _():
    plgpu.barrier_arrive(fused.staged.at[parity])
    plgpu.barrier_arrive(fused.ds_read.at[parity])


def _write_dq(fused: _FusedDq, *, batch, order, num_steps, head_and_block,
              static: _Static):
  """The dQ writer of K/V tile `order`: for each step, once the consumers
  staged its pieces, waits for the Q tile's turn and adds them to `dq_sum`
  (stores them, as the first); then, once the previous step's adds are in
  memory, hands that Q tile on and frees its stage. `head_and_block(step)`
  is the step's (query head, Q tile)."""
  _, _, num_heads, _ = fused.dq_sum.shape
  first = order == 0
  pieces = _pieces(static)

  def hand_on(turn):
    plgpu.semaphore_signal(fused.turns.at[turn], 1, memory_scope="gpu")

  def write(step, handed):
    parity = lax.rem(step, 2)
    plgpu.barrier_wait(fused.staged.at[parity])
    head, q_block = head_and_block(step)
    turn = (batch * num_heads + head) * static.num_q_blocks + q_block
    plgpu.semaphore_wait(fused.turns.at[turn], order, decrement=False,
                         memory_scope="gpu")
    for number, row, col in pieces:
      src = fused.stage.at[parity, number]
      dst = fused.dq_sum.at[
          batch, pl.ds(q_block * static.block_q + row * _DQ_PIECE, _DQ_PIECE),
          head, pl.ds(col * _DQ_PIECE, _DQ_PIECE)]
      last = number == len(pieces) - 1  # one commit group per step
      pl.when(first)(functools.partial(plgpu.copy_smem_to_gmem, src, dst,
                                       commit_group=last))
      pl.when(jnp.logical_not(first))(functools.partial(
          plgpu.copy_smem_to_gmem, src, dst, commit_group=last,
          reduction_op="add"))
    # All groups but this step's are done: the previous step's adds are
    # in memory, and its stage has been read.
    plgpu.wait_smem_to_gmem(1, wait_read_only=False)

    @pl.when(step > 0)
    def _():
      hand_on(handed)
      plgpu.barrier_arrive(fused.stage_free.at[1 - parity])
    return turn

  last_turn = lax.fori_loop(0, num_steps, write, jnp.int32(0))
  plgpu.wait_smem_to_gmem(0, wait_read_only=False)
  pl.when(num_steps > 0)(lambda: hand_on(last_turn))


def _dkdv_accumulate_overlapped(grads, p_t, dp_t, slope, q_tile, do_tile,
                                stats, static: _Static, store_ds=None,
                                piece=None):
  """`grads` (in `static.outputs` order) plus this step's dV += Pᵀ dO and
  dK += dSᵀ Q, with dV's wgmma issued first, so that dS is computed while
  it runs. `dp_t` is [dPᵀ] when dK is an output, else []; `stats` is the
  step's [2, block_q] (lse, delta) slot, whose delta is read here;
  `store_ds` (fused dQ) takes dSᵀ while dK's wgmma runs. `piece(acc_ref)`
  (fused dQ) issues a [_DQ_PIECE, _DQ_PIECE] product after them, into a
  fresh accumulator returned after the gradients, all waited for at
  once."""
  accs = [plgpu.ACC.init(grad) for grad in grads]
  if piece is not None:
    accs.append(plgpu.ACC.init(plgpu.layout_cast(
        jnp.zeros((_DQ_PIECE, _DQ_PIECE), jnp.float32), plgpu.Layout.WGMMA)))

  def issue(acc_refs):
    grad_refs = acc_refs[:len(grads)]
    named = dict(zip(static.outputs, grad_refs))
    if "dv" in named:
      plgpu.wgmma(named["dv"], p_t.astype(static.dtype), do_tile)
    if "dk" in named:
      delta = plgpu.layout_cast(stats[1], plgpu.Layout.WGMMA.reduce(0))
      ds_t = _score_gradient(p_t, dp_t[0], per_column(delta, p_t.shape),
                             slope)
      ds_t = ds_t.astype(static.dtype)
      plgpu.wgmma(named["dk"], ds_t, q_tile)
      if store_ds is not None:
        store_ds(ds_t)
    if piece is not None:
      piece(acc_refs[-1])

  return pl.run_state(issue)(tuple(accs))


def _dkdv_causal_runs(kv_start, first, static: _Static):
  """The plain kernel's runs over Q tiles [first, num_q_blocks) for K/V rows
  from kv_start: causal, skip the tiles wholly above the diagonal for these
  rows and mask those that straddle it."""
  if not static.is_causal:
    return ((0, static.num_q_blocks, _UNMASKED),)
  own_first = _first_q_block(kv_start, static)
  own_unmasked = _first_unmasked_q_block(kv_start, static)
  return ((first, own_first, _SKIP), (own_first, own_unmasked, _MASKED),
          (own_unmasked, static.num_q_blocks, _UNMASKED))


def _first_q_block(kv_start, static: _Static):
  """First Q tile with a row that attends key kv_start (causal), clipped.

  Row r attends kv_start iff r >= kv_start, so tile i needs
  (i + 1) * block_q - 1 >= kv_start.
  """
  if not static.is_causal:
    return 0
  return jnp.minimum(kv_start // static.block_q, static.num_q_blocks)


def _first_unmasked_q_block(kv_start, static: _Static):
  """First Q tile whose every row attends all of keys [kv_start, +block_kv).

  Needs i * block_q >= kv_start + block_kv - 1.
  """
  if not static.is_causal:
    return 0
  return jnp.minimum(pl.cdiv(kv_start + static.block_kv - 1, static.block_q),
                     static.num_q_blocks)


def _tile_indices_t(kv_start, q_block, static: _Static, q_rows=None):
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


def _causal_mask_t(kv_start, q_block, static: _Static, q_rows=None):
  """[block_kv, block_q] (or the `q_rows` part's columns): True where key
  kv_start + r is seen by query q_block * block_q + c (the transposed
  layout of Sᵀ).

  Two whole index tiles, compared: at d=64 they spill 180 bytes, in the
  masked step only (SASS, session 25). A row against a column of indices
  spilled none but ran the backward 1.5% and 1.2% slower at 16k and 4k
  (8fbd8ee, results/h200_mosaic_mask_form.md), so this form stays."""
  queries, keys = _tile_indices_t(kv_start, q_block, static, q_rows)
  return queries >= keys


def _variant_mask_t(kv_start, q_block, static: _Static, values):
  """`masking.keep` on the Sᵀ tile of `_tile_indices_t`."""
  return masking.keep(static.spec, *_tile_indices_t(kv_start, q_block, static),
                      values)


# ---------------------------------------------------------------------------
# dQ kernel.


def launch_dq(query, key, value, d_out, stats, static: _Static, *, plan=None,
              segments=None):
  """Launches the dQ kernel; returns dq like query.

  Ranged: `plan` int32 [batch, num_q_tiles, PLAN_WIDTH]; `segments` as
  `gradients` takes them.
  """
  batch, q_len, num_heads, head_dim = query.shape
  consumers, stages = static.num_consumers, static.num_stages
  transforms = _tile_transforms(static.dtype)
  resident = plgpu.SMEM((consumers, static.block_q, head_dim), static.dtype,
                        transforms=transforms)
  streamed = plgpu.SMEM((stages, static.block_kv, head_dim), static.dtype,
                        transforms=transforms)
  scratch = (
      resident,                                           # Q, then dQ
      resident,                                           # dO
      plgpu.SMEM((consumers, 2, static.block_q), jnp.float32),  # stats
      streamed,                                           # K ring
      streamed,                                           # V ring
      plgpu.Barrier(num_barriers=consumers),              # q_arrived
      plgpu.Barrier(num_barriers=consumers),              # do_arrived
      plgpu.Barrier(num_barriers=consumers),              # stats_arrived
      plgpu.Barrier(num_barriers=stages),                 # k_arrived
      plgpu.Barrier(num_barriers=stages),                 # v_arrived
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # consumed
  )
  inputs = (query, key, value, d_out, stats)
  if static.ranged:
    scratch += _ranged_scratch(static, resident_rows=static.block_q,
                               streamed_rows=static.block_kv)
    inputs += (plan, *(segments or ()))
  return compat.vary_like(plgpu.kernel(
      functools.partial(_dq_kernel, static=static),
      out_type=versions.output_struct(query.shape, query.dtype, *inputs),
      scratch_types=scratch,
      **_grid(static, (pl.cdiv(q_len, static.q_rows_per_cta),
                       num_heads, batch), ("q_tile", "head", "batch")),
      num_threads=consumers + 1,
      thread_name="wg",
      kernel_name=_kernel_name(static, "dq"),
      compiler_params=compat.compiler_params(approx_math=True),
  )(*inputs), *inputs)


def _dq_kernel(*refs, static: _Static):
  """Kernel body; refs: `launch_dq`'s inputs (q, k, v, dO, stats, then the
  ranged kernel's plan, q ids, kv ids), dq, its scratch list. Launch or
  persistent grid as `_dkdv_kernel` (causal: query tile i reads i + 1 K/V
  tiles, so persistent tiles go in pairs)."""
  num_inputs = 5 + static.ranged + 2 * static.segmented
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

  _each_tile(tile, wg, static=static, tile_axes=("batch", "head", "q_tile"),
             num_tiles=num_tiles, num_heads=num_heads, batch=batch_size)


def _dq_tile(inputs, dq_ref, scratch, batch, head, q_tile, wg, base,
             consumer: bool, *, static: _Static):
  """Consumer `wg`'s or the producer's part of query tile `q_tile`; returns
  the tile's streamed steps (as `_dkdv_tile`)."""
  q_ref, k_ref, v_ref, do_ref, stats_ref = inputs[:5]
  (q_smem, do_smem, stats_smem, k_ring, v_ring, q_arrived, do_arrived,
   stats_arrived, k_arrived, v_arrived, consumed) = scratch[:11]
  tile_start = q_tile * static.q_rows_per_cta
  plan, ids = _ranged_refs(static, inputs[5:], scratch[11:], batch=batch,
                           tile=q_tile, own_is_query=True)
  num_steps = None
  if plan is None:
    # The last consumer's rows come last, so it sees the most K/V tiles.
    last_start = tile_start + (static.q_rows_per_cta - static.block_q)
    num_steps = _num_kv_blocks_seen(last_start, static)
  arrived = (k_arrived, v_arrived) + _ids_arrived(ids)

  def _consumer():
    q_start = tile_start + wg * static.block_q
    q_rows = pl.ds(q_start, static.block_q)
    own_q, own_do, own_stats = q_smem.at[wg], do_smem.at[wg], stats_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[batch, q_rows, head], own_q,
                            q_arrived.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[batch, q_rows, head], own_do,
                            do_arrived.at[wg])
    plgpu.copy_gmem_to_smem(stats_ref.at[batch, head, :, q_rows], own_stats,
                            stats_arrived.at[wg])
    for barrier in (q_arrived, do_arrived, stats_arrived):
      plgpu.barrier_wait(barrier.at[wg])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    lse_log2 = plgpu.layout_cast(own_stats[0], row_layout)
    delta = plgpu.layout_cast(own_stats[1], row_layout)
    if plan is None:
      walk = _Walk(0, num_steps, _dq_causal_runs(q_start, num_steps, static),
                   None)
      tile_mask = lambda step, slot: causal_mask(q_start, step, static)
    else:
      walk = _ranged_walk(plan, wg)
      own_ids = _own_ids(ids, q_rows, wg)
      shape = (static.block_q, static.block_kv)
      tile_mask = lambda step, slot: variant_mask(
          q_start, step, static, _tile_values(walk.values, own_ids, ids, slot,
                                              shape, own_is_query=True))
    dq = _dq_consume(own_q, own_do, lse_log2, delta, k_ring, v_ring, arrived,
                     consumed, walk=walk, tile_mask=tile_mask, static=static,
                     base=base)
    own_q[...] = dq.astype(static.dtype)  # Q is dead: dQ goes out through it
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(own_q, dq_ref.at[batch, q_rows, head])
    # Persistent: the next tile's Q may load once dQ has left.
    plgpu.wait_smem_to_gmem(0, wait_read_only=base is not None)

  def _producer():
    kv_head = head // static.group
    if plan is None:
      union_first, union_steps = None, num_steps
    else:
      walk = _ranged_walk(plan, static.num_consumers, consumer=False)
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
                      ids.ring, ids.ring_arrived))
    _produce(streams, consumed, union_steps, static, base=base)

  (_consumer if consumer else _producer)()
  return num_steps


def _dq_consume(q_smem, do_smem, lse_log2, delta, k_ring, v_ring, arrived,
                consumed, *, walk: _Walk, tile_mask, static: _Static,
                base=None):
  """Consumer: dQ (f32, scaled) of its `block_q` rows.

  `lse_log2` and `delta` are the rows' statistics. Walks the producer's
  steps, K/V tiles [walk.first, walk.first + walk.num_blocks), treated as
  `walk.runs` say (skipped, masked by `tile_mask(kv_block, slot)`, or
  unmasked).
  """
  dq = plgpu.layout_cast(
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
      p, slope = _probabilities(s, lse_log2, per_row, walk.values, static)
      if masked:
        p = jnp.where(tile_mask(step, slot), p, 0.0)
      return p, slope

    shape = (static.block_q, static.block_kv)
    if static.overlap_softmax:
      (p, slope), dp = _wgmma_then(shape, products, probabilities)
    else:
      s, dp = _wgmma_fresh(shape, products)
      p, slope = probabilities(s)
    ds = _score_gradient(p, dp, per_row(delta, p.shape), slope)
    (dq,) = _wgmma_accumulate((dq,), [(ds.astype(static.dtype), k_tile)])
    plgpu.barrier_arrive(consumed.at[slot])
    return dq

  def skip_body(step, dq):
    _skip_step(arrived, consumed, slot_of(step))
    return dq

  dq = _walk_runs(walk.runs, {
      _SKIP: skip_body, _UNMASKED: functools.partial(step_body, masked=False),
      _MASKED: functools.partial(step_body, masked=True)}, dq)
  return dq * static.scale


def _dq_causal_runs(q_start, num_steps, static: _Static):
  """The plain kernel's runs over K/V tiles [0, num_steps) for rows from
  q_start: causal, mask the tiles that straddle the diagonal and skip those
  that only the other consumer's (later) rows see."""
  own_steps = _num_kv_blocks_seen(q_start, static)
  own_unmasked = _num_unmasked_kv_blocks(q_start, own_steps, static)
  runs = ((0, own_unmasked, _UNMASKED),)
  if static.is_causal:
    runs += ((own_unmasked, own_steps, _MASKED), (own_steps, num_steps, _SKIP))
  return runs


def _num_kv_blocks_seen(q_start, static: _Static):
  """K/V tiles that rows [q_start, q_start + block_q) attend to."""
  if not static.is_causal:
    return static.num_kv_blocks
  return jnp.minimum(pl.cdiv(q_start + static.block_q, static.block_kv),
                     static.num_kv_blocks)


def _num_unmasked_kv_blocks(q_start, num_blocks, static: _Static):
  """Leading K/V tiles wholly at or below the diagonal: tile j's last key,
  (j + 1) * block_kv - 1, is at most the first row, q_start."""
  if not static.is_causal:
    return num_blocks
  return jnp.minimum((q_start + 1) // static.block_kv, num_blocks)


# ---------------------------------------------------------------------------
# Shared by both kernels.


class _Walk(NamedTuple):
  """A warpgroup's walk over the steps its CTA streams.

  The streamed blocks are [first, first + num_blocks) (per query head of
  the group in the dK/dV kernel); `runs` are (start, stop, kind) block
  ranges that cover them in order, kind one of _SKIP, _MASKED, _UNMASKED;
  `values` are the ranged kernels' `masking.MaskValues` (None in the plain
  ones).
  """
  first: Any
  num_blocks: Any
  runs: tuple
  values: Any


def _walk_runs(runs, bodies, carry):
  """Runs `bodies[kind]` over each (start, stop, kind) run, in order."""
  for start, stop, kind in runs:
    carry = lax.fori_loop(start, stop, bodies[kind], carry)
  return carry


def _ranged_walk(plan: PlanRow, slot, *, consumer: bool = True) -> _Walk:
  """Reads the CTA's plan row (see `masked.tile_plans`) into `slot`.

  A consumer (`slot` = its warpgroup) walks the union [first, total) in five
  runs: skips before its range [lo, hi), the masked edge up to the run of
  full tiles [unmasked_lo, unmasked_hi), that run, the other masked edge,
  skips after. All of them, in every consumer, so that every ring barrier
  goes through the same phases in every thread. The producer (`consumer`
  False) needs only the union.
  """
  read = read_plan(plan, slot)
  first, total = read(PLAN_UNION), read(PLAN_UNION + 1)
  if not consumer:
    return _Walk(first, total - first, (), None)
  lo, unmasked_lo, unmasked_hi, hi = (read(slot * 4 + i) for i in range(4))
  runs = ((first, lo, _SKIP), (lo, unmasked_lo, _MASKED),
          (unmasked_lo, unmasked_hi, _UNMASKED), (unmasked_hi, hi, _MASKED),
          (hi, total, _SKIP))
  values = masking.MaskValues(q_offset=read(PLAN_SCALARS),
                              q_lengths=read(PLAN_SCALARS + 1),
                              kv_lengths=read(PLAN_SCALARS + 2))
  return _Walk(first, total - first, runs, values)


class _SegmentIds(NamedTuple):
  """A ranged kernel's segment ids (`spec.has_segments`), by role. The dQ
  kernel owns query rows and streams K/V tiles; the dK/dV kernel owns K/V
  rows and streams Q tiles."""
  own_gmem: Any        # int32 [len] of this batch, along the resident axis
  streamed_gmem: Any   # int32 [len] of this batch, along the streamed axis
  own_smem: Any        # int32 [consumers, rows]
  own_arrived: Any     # barriers [consumers]
  ring: Any            # int32 [stages, rows]: filled with each ring slot
  ring_arrived: Any    # barriers [stages]


def _ranged_scratch(static: _Static, *, resident_rows, streamed_rows):
  """The ranged kernels' scratch after the common list: plan rows (one per
  warpgroup) and, with segment ids, `_SegmentIds`' shared memory."""
  consumers, stages = static.num_consumers, static.num_stages
  scratch = (plgpu.SMEM((consumers + 1, PLAN_WIDTH), jnp.int32),
             plgpu.Barrier(num_barriers=consumers + 1))   # plan_arrived
  if static.segmented:
    scratch += (plgpu.SMEM((consumers, resident_rows), jnp.int32),
                plgpu.Barrier(num_barriers=consumers),
                plgpu.SMEM((stages, streamed_rows), jnp.int32),
                plgpu.Barrier(num_barriers=stages))
  return scratch


def _ranged_refs(static: _Static, inputs, scratch, *, batch, tile,
                 own_is_query: bool):
  """(`_Plan`, `_SegmentIds` or None) of a ranged kernel, or (None, None).

  `inputs` are the kernel's inputs after the common five (plan, q ids,
  kv ids), `scratch` its scratch after the common list.
  """
  if not static.ranged:
    return None, None
  plan = PlanRow(inputs[0].at[batch, tile], *scratch[:2])
  if not static.segmented:
    return plan, None
  q_ids, kv_ids = inputs[1].at[batch], inputs[2].at[batch]
  own, streamed = (q_ids, kv_ids) if own_is_query else (kv_ids, q_ids)
  return plan, _SegmentIds(own, streamed, *scratch[2:6])


def _ids_arrived(ids: _SegmentIds | None):
  """The ids ring's barrier, awaited with the other streams' each step."""
  return () if ids is None else (ids.ring_arrived,)


def _own_ids(ids: _SegmentIds | None, rows, wg):
  """Segment ids of consumer `wg`'s own rows, [rows] in the layout of a
  tile's rows; None without segment ids."""
  if ids is None:
    return None
  own = ids.own_smem.at[wg]
  plgpu.copy_gmem_to_smem(ids.own_gmem.at[rows], own, ids.own_arrived.at[wg])
  plgpu.barrier_wait(ids.own_arrived.at[wg])
  return plgpu.layout_cast(own[...], plgpu.Layout.WGMMA.reduce(1))


def _tile_values(values, own_ids, ids: _SegmentIds | None, slot, shape, *,
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


def _probabilities(s, lse_log2, broadcast, values, static: _Static):
  """P = exp(final logit - lse) of a tile of raw q·k, and the slope of the
  final logit in scale·q·k (None without score changes).

  `broadcast` spreads the per-row `lse_log2` over `s`: `_rows` for S tiles,
  `_cols` for Sᵀ. Score changes (the soft cap) follow `modify_scores`, the
  one definition, and its derivative is that function's `jax.jvp`.
  """
  if not (static.ranged and static.spec.modifies_scores):
    return jnp.exp2(s * static.scale_log2 - broadcast(lse_log2, s.shape)), None
  modify = lambda x: masking.modify_scores(static.spec, x, None, None, values)
  logits, slope = jax.jvp(modify, (s * static.scale,), (jnp.ones_like(s),))
  return jnp.exp2(logits * LOG2E - broadcast(lse_log2, s.shape)), slope


def _score_gradient(p, dp, delta, slope):
  """dS = P ∘ (dP - delta), times the score changes' slope when there is
  one; dS is then dL / d(scale·q·k), scaled once at the end."""
  ds = p * (dp - delta)
  return ds if slope is None else ds * slope


def _grid(static: _Static, grid, names) -> dict:
  """`plgpu.kernel`'s grid arguments: the launch grid `grid` (tile axis
  first, so launched slowest; reversed with `static.tile_fastest`), or a
  persistent grid of `static.num_ctas` CTAs."""
  if static.persistent:
    return dict(grid=(static.num_ctas,), grid_names=("cta",))
  grid, names = launch_grid(grid, names, tile_fastest=static.tile_fastest)
  return dict(grid=grid, grid_names=names)


def _persistent(static: _Static, num_ctas, *, tiles_per_head: int,
                num_heads: int, batch: int) -> _Static:
  """`static` on a persistent grid (`persistent_num_ctas`)."""
  if static.ranged:
    raise NotImplementedError("the ranged backward has no persistent grid")
  return dataclasses.replace(static, persistent=True,
                             num_ctas=persistent_num_ctas(
                                 num_ctas, paired=static.is_causal,
                                 num_tiles=batch * num_heads * tiles_per_head))


def _kernel_name(static: _Static, outputs: str) -> str:
  return ("mosaic_flash_backward_" + ("masked_" if static.ranged else "")
          + outputs)


def _produce(streams, consumed, num_steps, static: _Static, base=None):
  """Producer warpgroup: TMA step t's tiles into ring slot t % num_stages.

  `streams` are (source, ring, arrived): `source(step)` is the GMEM view of
  that step's tile. A slot is refilled once every consumer released it.
  Persistent (`base` given): the ring runs on from the CTA's earlier tiles,
  step t going to slot (base + t) % num_stages, without a fill of its own.
  """
  stages = static.num_stages

  def load(step, slot):
    for source, ring, arrived in streams:
      plgpu.copy_gmem_to_smem(source(step), ring.at[slot], arrived.at[slot])

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


def _skip_step(arrived, consumed, slot):
  """Takes part in a step without computing: keeps this consumer's barrier
  phases in step with the ring, and releases the slot."""
  for barrier in arrived:
    plgpu.barrier_wait(barrier.at[slot])
  plgpu.barrier_arrive(consumed.at[slot])


def _terms(product):
  """A product (a, b) as a one-term sum; a list of (a, b) is a sum."""
  return product if isinstance(product, list) else [product]


def _wgmma_fresh(shape, products):
  """[a @ b for (a, b) in products] into fresh f32 accumulators of `shape`,
  issued together so that they share one wgmma wait (a product may be a
  list of (a, b): their sum, see `_terms`)."""
  def issue(*acc_refs):
    for acc_ref, product in zip(acc_refs, products):
      for a, b in _terms(product):
        plgpu.wgmma(acc_ref, a, b)
    return tuple(acc_ref[...] for acc_ref in acc_refs)

  return pl.run_scoped(issue, *[plgpu.ACC(shape, jnp.float32)
                                for _ in products])


def _wgmma_then(shape, products, first_fn):
  """(first_fn(a0 @ b0), a1 @ b1, ...) into fresh f32 accumulators: all
  issued together, and `first_fn` run on the first product as soon as it is
  done, while the others are still on the tensor cores (wgmmas complete in
  issue order). A product may be a list of (a, b), their sum (`_terms`).
  """
  def issue(first_ref, *acc_refs):
    for acc_ref, product in zip((first_ref, *acc_refs), products):
      for a, b in _terms(product):
        plgpu.wgmma(acc_ref, a, b)
    later = sum(len(_terms(product)) for product in products[1:])
    first = first_fn(plgpu.wgmma_accumulator_load(first_ref, wait_n=later))
    return (first, *(acc_ref[...] for acc_ref in acc_refs))

  return pl.run_scoped(issue, *[plgpu.ACC(shape, jnp.float32)
                                for _ in products])


def _wgmma_sum(shape, products):
  """sum(a @ b for (a, b) in products) into one fresh f32 accumulator."""
  def issue(acc_ref):
    for a, b in products:
      plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(issue, plgpu.ACC(shape, jnp.float32))


def _wgmma_accumulate_sums(accs, sums):
  """(acc + sum(a @ b for (a, b) in products) for acc, products in
  zip(accs, sums)), one wgmma wait."""
  def issue(acc_refs):
    for acc_ref, products in zip(acc_refs, sums):
      for a, b in products:
        plgpu.wgmma(acc_ref, a, b)

  return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs))


def _wgmma_accumulate(accs, products):
  """(acc + a @ b for acc, (a, b) in zip(accs, products)), one wgmma wait."""
  def issue(acc_refs):
    for acc_ref, (a, b) in zip(acc_refs, products):
      plgpu.wgmma(acc_ref, a, b)

  return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs))
