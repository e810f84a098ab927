"""The plan: which Mosaic kernel runs a call, and on what schedule.

Every schedule decision of the plain forward and backward is a field of
`ForwardConfig` or `BackwardConfig`. A call's plan is the row of `FORWARD_PLAN`
or `BACKWARD_PLAN` that covers its head dim, causal masking and lengths,
with the fields a caller names replacing the row's (`forward_config`,
`backward_config`). Each row carries the measurement that chose it: H200,
bf16, batch·seq 16k, hidden 2048 (the standard grid), TFLOP/s of the kernel
alone, A/Bs of a few candidates timed in turn in one process
(`benchmarks/tune_mosaic.py`; the tables under `benchmarks/results/`).
Options measured slower and dropped are in `benchmarks/NOTES.md`, "Mosaic
options tried and removed".

The masked and FP8 forms share the kernels; their few decisions are the
constants at the end.

Rows are keyed by the head dims measured, 64, 128 and 256. A head dim
between them (a multiple of 16, computed at its own width: 80, 96, 160,
192, ...) runs on the rows of the next measured one (`plan_head_dim`):
the same tiles, so the same wgmma shapes but N = head_dim and fewer K
steps, and shared memory and registers no more than that dim's (checked
at the actual width by the kernels). Where a row's choice needs the
measured width itself (the fused dQ's 64-column pieces, shared rows' column
halves of whole swizzle tiles), `backward_config` falls back as for other
calls it cannot take. Unmeasured at these dims: the rows are a start, not
a tuning.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from pallas_kernels.mosaic.common import ragged_lengths

# Lengths from lo to hi, both included; hi None: unbounded.
Range = tuple[int, int | None]
ANY: Range = (0, None)
# wgmma works on 64-row slabs: the least tile.
_MIN_TILE = 64


def below(n: int) -> Range:
  return (0, n - 1)


def up_to(n: int) -> Range:
  return (0, n)


def at_least(n: int) -> Range:
  return (n, None)


def above(n: int) -> Range:
  return (n + 1, None)


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """How `forward.mosaic_forward` runs a call.

  block_q: query rows per consumer warpgroup; a CTA computes
    `num_consumers * block_q`.
  block_kv: K/V rows per pipeline stage; None: `default_block_kv`.
  max_concurrent_steps: depth of the K/V ring (TMA stages in flight).
  num_consumers: consumer warpgroups, 2 or 3; three take their turns on
    hardware barriers.
  persistent: one CTA per SM walks the tiles (`num_ctas` of them; None:
    the GPU's SM count) instead of one CTA a tile. The launch grid
    launches a head's query tiles together, heaviest first under causal
    masking.
  hw_turns: two consumers pass the turn on the tensor cores round a ring
    of hardware barriers instead of meeting at an mbarrier rendezvous.
  sum_after_pv: P's row sum taken while P V runs (bitwise the same).
  lazy_rescale: O rescaled only where a row's running max grew by more
    than `rescale_threshold` (log2 units, 0 to 8; at 0 bitwise the eager
    rescale).
  mma_row_sum: O's and the LSE's row sum l over P as P V rounds it, by
    the tensor cores (`KernelStatic.mma_row_sum`; its accumulator rescaled
    with O) instead of the float32 P's adds and shuffles; not with a soft
    cap's max-free form (its own `mma_row_sum`). The same accuracy
    (benchmarks/diagnostics/row_sum_rounding); not yet timed
    (`tune_mosaic --kernels forward_mma_sum`).
  """
  block_q: int = 64
  block_kv: int | None = None
  max_concurrent_steps: int = 2
  num_consumers: int = 2
  persistent: bool = True
  num_ctas: int | None = None
  hw_turns: bool = False
  sum_after_pv: bool = False
  lazy_rescale: bool = False
  rescale_threshold: float = 8.0
  mma_row_sum: bool = False


# (head_dim, causal, q_len range, kv_len range, plan), one row per call.
FORWARD_PLAN: tuple[tuple[int, bool, Range, Range, ForwardConfig], ...] = (
    # d=64: three consumers from q_len 1024 (causal 2048), so that a
    # softmax, as long as the matmuls at d=64, runs under two others'
    # turns: 16k 423 -> 490 / 371 -> 431 (full / causal), 4k 383 -> 434 /
    # 320 -> 371, 1k 289 -> 318 / 243 -> 233 (h200_mosaic_consumers.md).
    # Their turns, and two consumers', on hardware barriers: three 386 ->
    # 390 at 1k, 457 -> 462 at 4k, 484 -> 490 at 16k; two (causal 1k) 288
    # -> 307 against the rendezvous (h200_mosaic_hw_turns.md). The
    # persistent grid at every length: causal +12% / +2% at 4k / 16k
    # (h200_mosaic_persistent.md).
    (64, False, below(1024), ANY, ForwardConfig(hw_turns=True)),
    (64, False, at_least(1024), ANY,
     ForwardConfig(num_consumers=3, hw_turns=True)),
    (64, True, below(2048), ANY, ForwardConfig(hw_turns=True)),
    (64, True, at_least(2048), ANY,
     ForwardConfig(num_consumers=3, hw_turns=True)),
    # d=128: without a mask the row sum after P V,
    # +1.7% / +1.9% / +2.7% at 1k / 4k / 16k (h200_mosaic_sum_after_pv_rest
    # .md), and O rescaled lazily, +3.6% / +4.2% / +3.1%
    # (h200_mosaic_rescale.md; causal -3.7% to -0.2%, off). Causal: the
    # persistent grid up to 8k (541 against 498 at 4k), the launch grid
    # from 16k (590 against 575, h200_mosaic_forward_order.md).
    (128, False, ANY, ANY,
     ForwardConfig(sum_after_pv=True, lazy_rescale=True)),
    (128, True, ANY, up_to(8192), ForwardConfig()),
    (128, True, ANY, above(8192), ForwardConfig(persistent=False)),
    # d=256: O rescaled lazily, +6.5% / +7.8% / +3.9% at 1k / 4k / 16k
    # without a mask, +4.1% / +2.2% / +4.3% causal. Causal: the persistent
    # grid up to 4k (537 against 523), the launch grid above (618 against
    # 604 at 16k).
    (256, False, ANY, ANY, ForwardConfig(lazy_rescale=True)),
    (256, True, ANY, up_to(4096), ForwardConfig(lazy_rescale=True)),
    (256, True, ANY, above(4096),
     ForwardConfig(persistent=False, lazy_rescale=True)),
)


def forward_config(*, head_dim: int, is_causal: bool, q_len: int, kv_len: int,
                 **options) -> ForwardConfig:
  """The configuration of a forward call: its row of `FORWARD_PLAN`,
  `options` (`ForwardConfig`'s fields) replacing the row's. Three
  consumers planned where q_len is not whole `block_q` rows fall back to
  two."""
  config = dataclasses.replace(
      _row(FORWARD_PLAN, head_dim, is_causal, q_len, kv_len), **options)
  if config.block_kv is None:
    config = dataclasses.replace(config, block_kv=default_block_kv(head_dim))
  if ("num_consumers" not in options and config.num_consumers == 3
      and q_len % config.block_q):
    config = dataclasses.replace(config, num_consumers=2)
  return config


def default_block_kv(head_dim: int) -> int:
  """K/V rows per stage of the 16-bit forwards (plain, masked; FP8's are
  `FP8_BLOCK_KV`): 128, the sweep's best at d=128 (64 x 128 in two
  stages: 495 / 469 TFLOP/s full / causal at 4k, h200_mosaic_sweep.md)
  and within 1% of it at d=64; 64 at head_dim 256, where Q (2 x 64 rows)
  and two stages of 128-row K and V tiles would need 320 KiB of shared
  memory (64-row ones: 192). Between 128 and 256, 128 up to 176, whose
  two stages still fit (220 KiB; on an H100 at 4k, geomean of causal and
  not, 437 -> 452, 529 -> 591, 435 -> 441 TFLOP/s at d=144, 160, 176,
  h100_mosaic_between_tiles.md); 64 from 192 (240 KiB). The masked forward
  halves it where a bias or dense mask tile leaves too little room
  (`forward.fitting_block_kv`)."""
  return 128 if head_dim <= 176 else 64


def plan_head_dim(head_dim: int) -> int:
  """The head dim whose plan rows a call of `head_dim` runs on: the least
  that the rows are keyed by at or above it (see the module's
  docstring)."""
  measured = sorted({row[0] for row in FORWARD_PLAN})
  for d in measured:
    if head_dim <= d:
      return d
  raise NotImplementedError(
      f"the Mosaic kernels run head_dim up to {measured[-1]}, got {head_dim}")


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """How `backward.mosaic_backward` runs a call.

  block_q, block_kv: Q and K/V rows of a tile: per consumer warpgroup of
    the kernel that keeps them resident, per streamed step of the other.
  max_concurrent_steps: depth of both kernels' TMA rings.
  fused_dq: one kernel, the dK/dV kernel also summing dQ in float32 in a
    fixed order (`fused_dq.py`), instead of a dK/dV and a dQ kernel; on
    the launch grid only, where dK and dV fit one pass and kv_len gives
    two consumers.
  persistent: both kernels on a grid of `num_ctas` CTAs (None: one per SM)
    that walk their tiles, the streamed ring running on across them;
    else one CTA a tile, a head's tiles launched together.
  shared_rows: the dK/dV kernel's two consumers share one copy of the
    K/V rows, each computing half of dK's and dV's columns: one pass where
    dK and dV do not fit one consumer's registers (head_dim above 128).
  lean_producer: the two kernels' consumers at 240 registers a thread and
    producers at 24 (not 232 and 40). The fused kernel's four warpgroups
    have none to spare.
  prefetch_lse: the dK/dV kernel reads each step's lse before its matmuls.
  scores_ahead: the dK/dV kernel issues each step's Sᵀ right behind the
    step before's dK (without a causal mask; not with shared rows, nor in
    the fused kernel: there it does nothing).
  dq_tiles: the dQ kernel's own (block_q, block_kv); None: the dK/dV
    kernel's.
  overlap_softmax: each consumer computes P while dP's wgmma runs and dS
    while dV's does (FlashAttention-3 §3.2 within a step): 2.6%, 3.4% and
    2.3% faster at head_dim 64, 128, 256 (16k, h200_mosaic_schedule.md).
  kv_head_copies: the dK/dV kernel runs on K and V repeated this many
    times along their heads, each copy's CTAs walking group / copies of
    its query heads; XLA then sums the copies' dK and dV in float32
    (deterministic). More CTAs where batch x K/V heads x K/V tiles is
    about a wave of SMs (MQA, few K/V heads): under causal masking one
    wave of tiles whose work runs from 1 to all Q tiles takes as long as
    its longest. None: `planned_kv_copies`' choice. Needs the two
    kernels on the launch grid.
  Every choice gives bitwise the same gradients, but for the fused dQ
  (another order of float32 sums, fixed: deterministic too) and
  kv_head_copies (dK and dV rounded to 16 bits per copy before the sum).
  """
  block_q: int = 64
  block_kv: int = 64
  max_concurrent_steps: int = 2
  fused_dq: bool = False
  persistent: bool = False
  num_ctas: int | None = None
  shared_rows: bool = False
  lean_producer: bool = True
  prefetch_lse: bool = False
  scores_ahead: bool = False
  dq_tiles: tuple[int, int] | None = None
  overlap_softmax: bool = True
  kv_head_copies: int | None = None


# (head_dim, causal, q_len range, kv_len range, config), one row per call.
# Every launch grid launches a head's tiles together: 2-9% over the same
# tile of many heads (h200_mosaic_tile_order.md). Lean producers wherever
# the two kernels run, but on the persistent grid at d=128 under causal
# masking: d=64 +1% to +6% (-1% at 4k and 16k without a mask), d=128 +1%
# to +3% without a mask, d=256 +2% to +5%; d=128 causal -1.0% / -0.5% /
# +0.2% at 1k / 4k / 16k, but with lse read early on the launch grid 413
# -> 419 at 4k, 477 -> 478 at 16k (h200_mosaic_lean.md,
# h200_mosaic_causal_128.md).
BACKWARD_PLAN: tuple[tuple[int, bool, Range, Range, BackwardConfig], ...] = (
    # d=64: 128-row Q tiles, 13% faster than 64 (337 / 266 against 297 /
    # 247 full / causal at 4k, h200_mosaic_sweep.md). The persistent grid
    # up to kv_len 1k (+1% / +6% at 1k), under causal masking up to 8k
    # (339 against the launch grid's 333 at 4k; at 16k the launch grid
    # 375 / 379 against 374 / 367, h200_mosaic_persistent_wide.md and
    # h200_mosaic_fused_recheck_wide*.md). On the launch grid without a
    # mask each step's Sᵀ behind the step before's dK: 387 -> 403 at 4k,
    # 400 -> 421 at 16k, where it passed the fused dQ's 411
    # (h200_mosaic_scores_ahead.md); under causal masking the dQ kernel on
    # 64 x 128 tiles, 381 -> 391 at 16k, 331 -> 337 at 4k
    # (h200_mosaic_dq_tiles.md), on either grid: against 128 x 64 (which
    # spill 516 bytes) 335-342 -> 342-347 on the persistent grid at 4k,
    # 359-361 -> 366-373 on the launch grid at 8k, where each grid beat
    # the other by 1-2% (an H100, h100_mosaic_dq_tiles_persistent.md).
    (64, False, ANY, up_to(1024), BackwardConfig(block_q=128,
                                                 persistent=True)),
    (64, False, ANY, above(1024), BackwardConfig(block_q=128,
                                                 scores_ahead=True)),
    (64, True, ANY, up_to(4096), BackwardConfig(block_q=128,
                                                persistent=True,
                                                dq_tiles=(64, 128))),
    (64, True, ANY, above(4096), BackwardConfig(block_q=128,
                                                dq_tiles=(64, 128))),
    # d=128: the persistent grid up to kv_len 1k (+8% / +11% at 1k, -3% /
    # -17% at 4k, h200_mosaic_persistent_backward.md). lse read before
    # the dK/dV matmuls, 378 -> 402 / 438 -> 457 / 459 -> 488 at 1k / 4k
    # / 16k without a mask (h200_mosaic_prefetch_lse.md); causal on the
    # launch grid 409 -> 413 at 4k, 471 -> 477 at 16k, on the persistent
    # grid 305 -> 299 (off). From kv_len 16k without a mask the fused dQ,
    # each step's dQ piece issued beside the next step's dV and dK and lse
    # read early: 523 and 512 against the two kernels' 492 and 494
    # (h200_mosaic_fused_lse.md); at 4k the two kernels lead, 475 against
    # 451 (h200_mosaic_merged.md), and under causal masking at 16k, 496
    # against 440 (h200_mosaic_fused_lse.md).
    (128, False, ANY, up_to(1024), BackwardConfig(persistent=True,
                                                  prefetch_lse=True)),
    (128, False, ANY, (1025, 16383), BackwardConfig(prefetch_lse=True)),
    (128, False, ANY, at_least(16384), BackwardConfig(fused_dq=True,
                                                      prefetch_lse=True)),
    (128, True, ANY, up_to(1024), BackwardConfig(persistent=True,
                                                 lean_producer=False)),
    (128, True, ANY, above(1024), BackwardConfig(prefetch_lse=True)),
    # d=256: the persistent grid up to kv_len 1k (+47% / +17% at 1k), dK
    # and dV in two passes there; above, one pass with shared rows, 310 /
    # 312 -> 352 / 346 at 16k, 288 / 258 -> 331 / 280 at 4k (on the
    # persistent grid at 1k 253 / 195 -> 256 / 191, h200_mosaic_shared_
    # dkdv.md).
    (256, False, ANY, up_to(1024), BackwardConfig(persistent=True)),
    (256, False, ANY, above(1024), BackwardConfig(shared_rows=True)),
    (256, True, ANY, up_to(1024), BackwardConfig(persistent=True)),
    (256, True, ANY, above(1024), BackwardConfig(shared_rows=True)),
)


def backward_config(*, head_dim: int, is_causal: bool, q_len: int,
                    kv_len: int, **options) -> BackwardConfig:
  """The configuration of a backward call: its row of `BACKWARD_PLAN`,
  `options` (`BackwardConfig`'s fields) replacing the row's.

  What the row plans but the kernels cannot take for this call falls back,
  unless named in `options`: Q tiles that do not divide q_len to 64 rows
  (but where no 64-row tile divides the lengths, `common.ragged_lengths`:
  then any tiles);
  the fused dQ where kv_len is not two consumers' K/V tiles or the dQ tile
  not one [64, 64] piece a consumer (head_dim 96's tile is not whole
  pieces) to the two kernels; shared rows where the halves of head_dim and
  block_q share no swizzle tile (at block_q 64: a head_dim not a multiple
  of 32, such as 176) to dK and dV apart; dQ tiles that do not divide
  the lengths (but ragged ones) to the dK/dV kernel's; Sᵀ ahead without a
  ring of two stages or `overlap_softmax` to off. A persistent grid or dQ tiles
  named in `options` ask for the two kernels, and the fused dQ for the
  launch grid; a persistent grid drops the plan's Sᵀ ahead.
  """
  config = dataclasses.replace(
      _row(BACKWARD_PLAN, head_dim, is_causal, q_len, kv_len), **options)
  planned = lambda name: name not in options
  # Lengths that no 64-row tile divides take any tiles, partial at the
  # end (`common.ragged_lengths`); others keep whole tiles.
  ragged = ragged_lengths(q_len, kv_len) and bool(
      q_len % _MIN_TILE or kv_len % _MIN_TILE)
  if planned("block_q") and q_len % config.block_q and not ragged:
    config = dataclasses.replace(config, block_q=_MIN_TILE)
  if config.dq_tiles is not None and tuple(config.dq_tiles) == (
      config.block_q, config.block_kv):
    config = dataclasses.replace(config, dq_tiles=None)  # the same tiles
  pieces = -(-config.block_q // _MIN_TILE) * -(-head_dim // _MIN_TILE)
  if planned("fused_dq") and config.fused_dq and (
      kv_len % (2 * config.block_kv) or pieces != 2 or head_dim % _MIN_TILE
      or options.get("persistent")
      or (not planned("dq_tiles") and config.dq_tiles is not None)):
    config = dataclasses.replace(config, fused_dq=False)
  # Two consumers' halves of head_dim and of block_q must be whole 16-bit
  # tiles of one swizzle, the narrowest 32 bytes: gcd(d / 2, block_q / 2)
  # a multiple of 16 (`shared_rows.shared_transforms`).
  if planned("shared_rows") and config.shared_rows and math.gcd(
      head_dim, config.block_q) % 32:
    config = dataclasses.replace(config, shared_rows=False)
  if planned("persistent") and options.get("fused_dq"):
    config = dataclasses.replace(config, persistent=False)
  if planned("dq_tiles") and config.dq_tiles and not ragged and (
      q_len % config.dq_tiles[0] or kv_len % config.dq_tiles[1]):
    config = dataclasses.replace(config, dq_tiles=None)
  if planned("scores_ahead") and config.scores_ahead and (
      config.persistent or config.max_concurrent_steps < 2
      or not config.overlap_softmax):
    config = dataclasses.replace(config, scores_ahead=False)
  return config


# dK/dV CTAs (batch x K/V heads x K/V tiles of two consumers' rows) that
# `planned_kv_copies` aims for: four waves of the H100's and H200's 132 SMs.
DKDV_MIN_CTAS = 4 * 132


def planned_kv_copies(config: BackwardConfig, *, batch: int,
                      num_kv_heads: int, group: int, kv_len: int) -> int:
  """`config.kv_head_copies`, or where None the fewest copies (a divisor of
  the GQA `group`) that give the dK/dV kernel `DKDV_MIN_CTAS` CTAs; 1
  where the kernels cannot take copies (the fused dQ, a persistent grid).

  Raises:
    ValueError: copies named that do not divide the group.
    NotImplementedError: copies named with the fused dQ or a persistent
      grid.
  """
  copies = config.kv_head_copies
  if copies is not None:
    if copies < 1 or group % copies:
      raise ValueError(f"kv_head_copies must divide the GQA group of "
                       f"{group} query heads per K/V head; got {copies}")
    if copies > 1 and (config.fused_dq or config.persistent):
      raise NotImplementedError(
          "kv_head_copies: the two backward kernels on the launch grid only "
          "(not the fused dQ, not a persistent grid)")
    return copies
  if config.fused_dq or config.persistent:
    return 1
  ctas = batch * num_kv_heads * -(-kv_len // (2 * config.block_kv))
  return next((c for c in range(1, group + 1)
               if group % c == 0 and ctas * c >= DKDV_MIN_CTAS), group)


def _row(rows, head_dim: int, is_causal: bool, q_len: int, kv_len: int):
  """The plan of the row that covers the call (of its `plan_head_dim`)."""
  key = (plan_head_dim(head_dim), bool(is_causal))
  for d, causal, q_range, kv_range, config in rows:
    if (d, causal) == key and _within(q_len, q_range) and _within(
        kv_len, kv_range):
      return config
  raise NotImplementedError(
      f"no plan row covers q_len {q_len}, kv_len {kv_len}")


def _within(length: int, bounds: Range) -> bool:
  lo, hi = bounds
  return lo <= length and (hi is None or length <= hi)


# The masked forward (`masked.mosaic_forward_masked`) rescales O lazily at
# d=256: on a causal 1k window +7.1% / +6.1% at 16k / 4k; d=128 -1.4% /
# -0.8%, d=64 -7.9% / -7.5% (h200_mosaic_rescale_masked.md). It launches
# tile-slowest: tile-fastest moved it -1.1% to +1.8% (h200_mosaic_masked_
# order.md).
MASKED_LAZY_RESCALE_HEAD_DIMS = (256,)
# The FP8 forward (`fp8.mosaic_forward_fp8`) likewise: d=256 +4.7% / +3.8%
# without a mask and +6.9% / +6.0% causal at 16k; d=128 -5.9% to -10.4%,
# d=64 -8.2% to -14.6% (h200_mosaic_fp8_rescale*.md).
FP8_LAZY_RESCALE_HEAD_DIMS = (256,)
# The FP8 forward's K/V tile by head dim, longer than the 16-bit kernel's
# (FP8's matmuls run at twice the rate, a step's other work does not): on
# an H100 at 16k, geomean of causal and not, two stages (three tie or do
# not fit), d=64 256 keys 504 TFLOP/s (128: 450), d=128 256 keys 780 (128:
# 752, 192: 673), d=256 128 keys 1,050 (64: 935)
# (h100_mosaic_fp8_tiles.md). A K factor of "block" scales
# (`jax_flash.fp8.K_BLOCK_ROWS` rows) covers whole tiles of every head dim.
FP8_BLOCK_KV = {64: 256, 128: 256, 256: 128}
# (head_dim, causal) where the FP8 forward's consumers split their
# rendezvous as the 16-bit forwards' do (`KernelStatic.split_handover`).
# On an H100 at 16k, with a head's tiles launched together, two rounds:
# causal d=64 469 -> 513 TFLOP/s; causal d=128 813 -> 802, d=256 1,131 ->
# 1,090; without a mask 570 -> 547, 929 -> 875, 1,202 -> 1,131
# (h100_mosaic_fp8_schedule.md).
FP8_SPLIT_HANDOVER = ((64, True),)
# The FP8 forward runs on the persistent grid (`forward_persistent`) up to
# this kv_len, by causal: it wins on short walks (a CTA's next tile is
# ready as the last one ends) and loses on long ones (the launch grid's
# CTAs stream a head's K and V through L2 together). On an H100, two
# rounds, batch x seq 16k, hidden 2048, launch -> persistent TFLOP/s at
# d=64 / 128 / 256 (h100_mosaic_fp8_persistent.md):
#   2k   full 465->488 722->749 907->929      causal 334->360 483->529 651->713
#   4k   full 514->530 812->828 1041->1053    causal 413->436 607->656 815->885
#   8k   full 546->554 871->841 1117->1110    causal 469->486 702->730 935->1001
#   16k  full 565->549 917->863 1199->1104    causal 506->513 794->772 1102->1033
FP8_PERSISTENT_UP_TO = {False: 4096, True: 8192}
# The masked kernels add causal ALiBi as a term per key and one per query
# (`common.alibi_columns`; `KernelStatic.alibi_columns` in the forward,
# `BackwardStatic.alibi_columns` in dQ and dK/dV) instead of a slope times
# an index tile: on an H100 at 16k, causal, the forward 467 -> 534 TFLOP/s
# at d=128 and 551 -> 585 at d=256, the backward 394 -> 429 and 172 -> 231
# (h100_mosaic_prepared.md).
MASKED_ALIBI_COLUMNS = True
# The plan head dims at which the masked forward runs without a running
# max where a soft cap bounds every logit (`KernelStatic.max_free`: O
# normalised by P's row sum as P V takes it, the LSE by the exact sum). On
# an H100 at 16k, causal, cap 30, against the running max: d=256 567 ->
# 597 TFLOP/s; d=128 484 -> 422 loses, as does the plain d=256 forward,
# 632 -> 587 (h100_mosaic_max_free_sums.md). One sum of the unrounded P
# (tokamax's form) had won at both, +5% / +11%, but rounds each row's
# dominant weight (benchmarks/NOTES.md, "Soft cap without a running max").
MASKED_MAX_FREE_HEAD_DIMS = (256,)
# Without a running max, the row sum P V takes (`l_pv`) computed by the
# tensor cores, P times a tile of ones beside P V (`KernelStatic.
# mma_row_sum`), instead of P's 16-bit copy widened back and added a score
# at a time (the second sum made the max-free forms lose, above). On an
# H100, causal, cap 30, two rounds, the masked d=256 forward 583 -> 596
# TFLOP/s at 16k and 472 -> 491 at 4k (with the running max: 575, 495);
# at d=128 494 / 427 against the running max's 503 / 420
# (h100_mosaic_max_free_mma_sum.md).
MAX_FREE_MMA_ROW_SUM = True
# Instead, every max-free forward (masked and plain) takes each row's max
# on its first computed step only and one sum of the unrounded P
# (`KernelStatic.first_step_max`): no second sum and no ones tiles, and a
# row whose keys all fall in one step keeps its largest weight at exactly
# 1. Untimed (`tune_mosaic --kernels max_free`'s "first_max" forms): one
# unrounded sum with m = 0 had won +5% / +11% at d=256 / 128 over the
# running max in the masked forward (h100_mosaic_max_free_sums.md).
MAX_FREE_FIRST_STEP_MAX = False
# The plain capped forward (`PLAIN_SOFTCAP_HEAD_DIMS`) without a running
# max at these plan head dims, always with the tensor cores' row sum (its
# two-sum form lost: 631 -> 576 at d=256, 16k, h100_mosaic_max_free_pairs.md).
# On an H100, causal, cap 30, two rounds, running max -> max-free: d=128
# 475 -> 504 TFLOP/s at 16k, 459 -> 466 at 4k; d=256 619 -> 606 and 548
# -> 543 (h100_mosaic_max_free_mma_sum.md).
PLAIN_MAX_FREE_HEAD_DIMS = (128,)
# The cap's multiplies by 1 / cap (before the tanh) and by cap (after it)
# folded into the score's scale and exp2's (`KernelStatic.fold_cap`,
# `masking.modify_scores_folded`): two FMULs fewer a score for a cap
# alone, as tokamax's sm90 forward computes it. On an H100 at 16k, causal,
# cap 30: 487 -> 515 TFLOP/s at d=128, 568 -> 614 at d=256
# (h100_mosaic_softcap_folded.md).
MASKED_SOFTCAP_FOLDED = True
# The masked backward's dQ and dK/dV kernels the same way where the cap is
# the only score change (`BackwardStatic.fold_cap`): P from t = tanh(q·k *
# scale / cap) as exp2(t * cap log2(e) - lse), and the cap's slope as
# 1 - t² (one FMA) instead of `modify_scores`' multiplies and its
# `jax.jvp`. The masked causal backward alone on an H100 at 16k, cap 30:
# d=128 348 -> 356 TFLOP/s, d=256 252 -> 270 (h100_mosaic_softcap_
# backward_folded.md); Gemma's 8k cells fwd+bwd 301 -> 317 (global) and
# 291 -> 312 (4k window; h100_models_softcap_backward_folded.md).
MASKED_BACKWARD_SOFTCAP_FOLDED = True
# The head dims at which a call whose only change beyond `is_causal` is a
# soft cap takes the plain forward (`KernelStatic.soft_cap`, the cap folded
# as above) instead of the masked one; its backward is as
# `PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS` (below) says. On an H100 at 16k,
# causal, cap 30, against the masked forward folded: d=256 640 against
# 614 TFLOP/s (the plain causal forward without a cap: 632), d=128 499
# against 515 (h100_mosaic_softcap_folded.md); between them unmeasured.
PLAIN_SOFTCAP_HEAD_DIMS = (256,)
# And under causal masking at these head dims too: at d=128 without a
# running max (`PLAIN_MAX_FREE_HEAD_DIMS`) 504 against the masked
# forward's 503 at 16k and 466 against 420 at 4k
# (h100_mosaic_max_free_mma_sum.md); without a mask (the row sum after P
# V) not timed.
PLAIN_SOFTCAP_CAUSAL_HEAD_DIMS = (128,)
# The head dims (of `plan_head_dim`) at which a call whose only change
# beyond a top-left `is_causal` is ALiBi takes the plain kernels, forward
# and backward, with ALiBi as column terms (`common.alibi_columns`; the
# launch grid, neither the fused dQ nor shared rows) instead of the masked
# ones (`attention._takes_plain_alibi`). On an H100, causal, fwd+bwd,
# masked -> plain TFLOP/s at 16k: 343 -> 370, 447 -> 468, 287 -> 351 at
# d=64, 128, 256; +3-17% at 2k and 4k (h100_mosaic_alibi_plain.md).
PLAIN_ALIBI_HEAD_DIMS = (64, 128, 256)
# The head dims (of `plan_head_dim`) at which a soft cap alone takes the
# plain dQ and dK/dV kernels (`BackwardStatic.soft_cap`: the folded cap,
# without the fused dQ, shared rows or `scores_ahead`) instead of the
# masked ones, whichever forward ran (`attention._plain_cap_backward`).
# On an H100, causal cap, fwd+bwd, masked -> plain TFLOP/s at 16k: 293 ->
# 268, 388 -> 414, 324 -> 334 at d=64, 128, 256; at 4k 265 -> 231,
# 327 -> 352, 290 -> 300 (h100_mosaic_softcap_plain_backward.md), before
# the slope ahead (`BackwardStatic.cap_slope_ahead`). With it, d=64's plain
# backward wins too: 314 -> 327 at 16k, 268 -> 271 at 4k; d=128 442 -> 453
# and 359 -> 376 (h100_mosaic_softcap_slope_ahead.md).
PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS = (64, 128, 256)
# The largest soft cap it takes, by P's dtype: e^cap below float16's
# largest (65504), and in bfloat16 a row sum of e^cap over 2^31 keys below
# float32's (3.4e38 = e^88.7).
MAX_FREE_SOFT_CAPS = {"bfloat16": 60.0, "float16": 10.0}


def first_step_max_floor(cap: float, dtype) -> float:
  """`KernelStatic.first_step_max`'s floor on a row's m (log2 units) under
  soft cap `cap` for P in `dtype`: with m >= (cap - bound) log2(e), P =
  2^(s log2 e - m) <= e^bound, the m = 0 form's bound at the largest cap
  it takes (`MAX_FREE_SOFT_CAPS`)."""
  bound = MAX_FREE_SOFT_CAPS[np.dtype(dtype).name]
  return (min(float(cap), bound) - bound) * float(np.log2(np.e))


def max_free_cap(cap: float | None, dtype, head_dim: int, *,
                 plain: bool = False) -> bool:
  """Whether the masked forward at `head_dim` (the plain one with `plain`)
  skips its running max (`KernelStatic.max_free`, at
  `MASKED_MAX_FREE_HEAD_DIMS`, `PLAIN_MAX_FREE_HEAD_DIMS`): a soft cap
  bounds every logit, so P = e^s, |s| <= cap, stays in range for caps up
  to `MAX_FREE_SOFT_CAPS` of P's dtype."""
  head_dims = PLAIN_MAX_FREE_HEAD_DIMS if plain else MASKED_MAX_FREE_HEAD_DIMS
  return (plan_head_dim(head_dim) in head_dims
          and cap is not None
          and cap <= MAX_FREE_SOFT_CAPS.get(np.dtype(dtype).name, 0.0))
