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
from pallas_kernels.mosaic.forward import (
    _PLAN_SCALARS, _PLAN_UNION, _SMEM_LIMIT_BYTES, _LOG2E, _SUPPORTED_DTYPES,
    _SUPPORTED_HEAD_DIMS, _SWIZZLE_BYTES, PLAN_WIDTH, _Plan, _causal_mask,
    _cols, check_layout, check_shared_memory, check_tiles, launch_grid,
    register_split, _read_plan, _rows, _variant_mask, persistent_num_ctas,
    persistent_schedule, tile_index)
from pallas_kernels.triton.delta import row_delta

_MAX_CONSUMERS = 2
# f32 registers per consumer thread that the wgmma accumulators (the
# [rows, head_dim] dK/dV or dQ sums and the [rows, cols] S and dP tiles) may
# take of `forward._CONSUMER_REGISTERS`; the rest holds P and dS in 16
# bits, the softmax statistics and addresses. A [m, n] f32 accumulator of
# one warpgroup is m * n / 128 registers per thread.
_ACCUMULATOR_REGISTERS = 192
_THREADS_PER_WARPGROUP = 128
# The fused dQ's fourth warpgroup (the dQ writer) takes its registers from
# the producer: 2 * 232 + 24 + 24 = 512 per thread slot (see
# `forward._CONSUMER_REGISTERS`). 24 is setmaxnreg's least; both only
# issue TMA.
_FUSED_PRODUCER_REGISTERS = 24
# The persistent grid (`mosaic_backward(persistent=None)`), by head dim: the
# longest kv_len at which it is the default. Session 6's A/B on the H200
# (results/h200_mosaic_persistent_backward.md, backward alone, 64 x 64
# tiles, non-causal / causal) at seq 1k, 4k, 16k: head_dim 128 +8/+11%,
# -3/-17%, -2/-5%; 256 +47/+17%, 0/+1%, 0/0%. Head_dim 64 ships 128-row Q
# tiles (`attention.backward_tiles`); with those (session 7,
# results/h200_mosaic_persistent_wide.md) +1/+6%, -4/+7%, -3/+3%: on up
# to kv_len 1024, and under causal masking up to the kv_len in
# `PERSISTENT_CAUSAL_MAX_KV_LEN`. At 16k the causal launch grid (tile-
# fastest since session 12) passed the persistent one: 375 / 379 against
# 374 / 367 TFLOP/s in session 19's two runs
# (results/h200_mosaic_fused_recheck_wide*.md); at 4k the persistent grid
# stayed ahead, 339 against 333 (session 20, three rounds, the launch
# grid's dQ kernel on 128 x 64). 8192 is between the two, not measured.
PERSISTENT_MAX_KV_LEN = {64: 1024, 128: 1024, 256: 1024}
PERSISTENT_CAUSAL_MAX_KV_LEN = {64: 8192}
# The fused dQ (`mosaic_backward(fused_dq=None)`), by head dim: the shortest
# kv_len at which it is the default. Measured on the H200, backward alone,
# full / causal, against the two kernels: head_dim 64 (128-row Q tiles)
# +6% / +10% at seq 16k (results/h200_mosaic_fused.md; +4% / +14% in
# results/h200_mosaic_writer.md), -18% / -13% at 4k and -14% / -18% at 1k
# (results/h200_mosaic_fused_short.md); head_dim 128 -11% / -24% at 16k,
# and with `opaque_resident` (session 11, results/h200_mosaic_opaque.md,
# two rounds in turn) 447 -> 470 / 476 -> 458 at 16k, 412 -> 418 / 414 ->
# 377 at 4k; with `deferred_dq` as well (session 12,
# results/h200_mosaic_deferred.md, two rounds in turn) 446 -> 468 / 459 ->
# 471 at 16k, 419 -> 403 / 405 -> 393 at 4k. Then the two kernels launched
# tile-fastest (`TILE_FASTEST_BY_DEFAULT`) caught up: 463 / 482 against
# the fused kernel's 460 / 460 at 16k (results/h200_mosaic_tile_order.md),
# and in three rounds 459 / 476 against 469 / 469
# (results/h200_mosaic_fused_order.md): d=128 fuses without a causal mask
# only. d=64's fused kernel stays ahead (415 / 372 against 406 / 355;
# under causal masking no longer, see below).
# Session 14: with lse read early (`PREFETCH_LSE_TILES`) the two kernels
# passed the fused one at d=128 without a mask too, 501 against 473 at 16k
# and 453 against 429 at 4k (three rounds, results/h200_mosaic_fused_stalls.md),
# so d=128 no longer fuses by default.
# Session 15: with each step's dQ piece issued beside the next step's dV
# and dK (`MERGED_PIECES_HEAD_DIMS`) the fused kernel passed them again at
# 16k, 504 and 508 against 498 and 498 (two A/Bs of three rounds,
# results/h200_mosaic_merged.md), but not at 4k (451 against 450, and the
# two kernels with `LEAN_PRODUCER_BY_DEFAULT` 475): d=128 fuses from 16k.
# Under causal masking only at FUSED_DQ_CAUSAL_HEAD_DIMS. Its GPU tests
# pass (sessions 8, 11 and 12). d=64 under causal masking fused until
# session 20: at 16k the two kernels on the launch grid ran 384 against the
# fused kernel's 371 TFLOP/s (settled, three rounds in alternating order,
# results/h200_mosaic_stages_wide.md; +2.8% and +1.7% in session 19's two
# unsettled runs). At d=64 the fused kernel's consumers spill (Nsight
# Compute, session 20: 2.3e8 local-memory sectors a backward at 16k; ptxas:
# 464 bytes at its 232 registers, still 220 at 256; the two kernels' dK/dV
# kernel 180 bytes at its 240).
# Session 24: without a mask, d=64's two kernels with the dK/dV kernel's Sᵀ
# issued a step ahead (`SCORES_AHEAD_LAUNCH_TILES`) passed the fused one
# at 16k, 420.5 against 410.7 TFLOP/s (backward alone, three rounds,
# results/h200_mosaic_ahead_s24.md): d=64 no longer fuses by default.
FUSED_DQ_MIN_KV_LEN: dict[int, int] = {128: 16384}
FUSED_DQ_CAUSAL_HEAD_DIMS: tuple[int, ...] = ()
# `mosaic_backward(opaque_resident=None)`: on with the fused dQ at these
# head dims. At d=128 it took the fused kernel from 397 / 351 to 470 / 458
# TFLOP/s at 16k and from 315 / 260 to 418 / 377 at 4k (full / causal); the
# two kernels gained nothing from it (447 / 476 -> 448 / 461 at 16k). At
# d=64 the fused dQ's 128-row Q tiles leave no shared memory for its zero;
# read from global memory instead it cost 25% (402 -> 300 at 16k full,
# results/h200_mosaic_opaque_wide.md), so that form was not kept.
OPAQUE_RESIDENT_FUSED_HEAD_DIMS: tuple[int, ...] = (128,)
# `mosaic_backward(deferred_dq=None)`: on with the fused dQ at these head
# dims. At d=128, 16k (fused with `opaque_resident`, against without):
# 469 -> 468 full, 444 -> 471 causal; at 4k 410 -> 403 and 400 -> 393
# (results/h200_mosaic_deferred.md). At d=64 (128-row Q tiles) it cost
# 16-33% (results/h200_mosaic_deferred_wide.md).
DEFERRED_DQ_FUSED_HEAD_DIMS: tuple[int, ...] = (128,)
# `mosaic_backward(tile_fastest=None)`: the two kernels' launch grids with a
# head's tiles launched together, so that the CTAs running at once stream
# the same head's Q and dO (dK/dV kernel) or K and V (dQ kernel) through
# L2, rather than the same tile of as many heads. Measured on the H200
# (session 12, backward alone, two rounds in turn, full / causal, TFLOP/s,
# results/h200_mosaic_tile_order.md): at 4k d=64 (128-row Q tiles) 360 / 305 ->
# 394 / 312, d=128 409 / 397 -> 443 / 419, d=256 323 / 298 -> 346 / 306;
# at 16k d=64 397 / 351 -> 406 / 355, d=128 452 / 460 -> 463 / 482, d=256
# 355 / 342 -> 361 / 348. Bitwise the other order (GPU test). Not on the
# persistent grid (its own walk) nor with the fused dQ (its own order).
TILE_FASTEST_BY_DEFAULT = True
# The fused dQ splits each Q tile's dQ into [_DQ_PIECE, _DQ_PIECE] pieces,
# shared out among the consumers: 64 rows, a wgmma's height, by 64 columns,
# one 128-byte swizzle row of 16-bit K, so that a piece's slice of the
# resident K (and of dSᵀ) is whole swizzle tiles.
_DQ_PIECE = 64


# Shared K/V rows in the dK/dV kernel (`mosaic_backward(shared_rows=None)`),
# by head dim, on the launch grid (the persistent grid, the default up to
# kv_len 1024, keeps the two passes). Measured on the H200
# (results/h200_mosaic_shared_dkdv.md, backward alone, full / causal):
# head_dim 256 at 16k 310 / 312 -> 352 / 346 TFLOP/s, at 4k 288 / 258 ->
# 331 / 280; at 1k, on the persistent grid, 253 / 195 -> 256 / 191. Shared
# Q rows in the dQ kernel as well (`shared_q_rows`) were slower than its one
# consumer: 340 / 343 at 16k, 318 / 279 at 4k
# (results/h200_mosaic_shared_both.md).
SHARED_ROWS_HEAD_DIMS: tuple[int, ...] = (256,)
# The dK/dV kernel's row statistics read before its matmuls
# (`mosaic_backward(prefetch_stats=None)`), by (head_dim, block_q): what
# it holds while the matmuls run grows with block_q. Measured on the H200
# (results/h200_mosaic_prefetch.md, backward alone, full / causal, TFLOP/s,
# off -> on), 64-row Q tiles: head_dim 64 at 16k 372 / 358 -> 381 / 372,
# at 4k 314 / 280 -> 324 / 305, at 1k 276 / 222 -> 314 / 229; head_dim 128
# at 16k 463 / 462 -> 441 / 474, at 4k 410 / 408 -> 381 / 380; head_dim
# 256 2-10% slower. With head_dim 64's 128-row Q tiles (the dispatch's,
# `attention.backward_tiles`) the whole fwd+bwd fell to half speed.
PREFETCH_STATS_TILES: tuple[tuple[int, int], ...] = ((64, 64),)
# lse alone read early (`mosaic_backward(prefetch_lse=None)`), by (head_dim,
# block_q), in the two kernels' dK/dV kernel without a causal mask (the fused
# one's: `FUSED_PREFETCH_LSE_TILES`). Measured on the H200 (session 14, backward
# alone, TFLOP/s, off -> on): d=128 without a mask, three rounds in turn
# (results/h200_mosaic_fused_stalls.md), 424 -> 453 at 4k and 463 -> 501 at 16k;
# two rounds (results/h200_mosaic_prefetch_lse.md) 378 -> 402 at 1k (persistent
# grid), 438 -> 457 at 4k, 459 -> 488 at 16k. Under causal masking 305 -> 299,
# 423 -> 417, 475 -> 482, and at d=256 -3% to +1%: off there. Session 20, d=128
# under causal masking on the launch grid (settled, three rounds in alternating
# order, backward alone, results/h200_mosaic_causal_128.md): 409 -> 413 at 4k
# and 471 -> 477 at 16k alone, and 419 / 478 with `lean_producer` as well: both
# on there (`CAUSAL_LAUNCH_LEAN_HEAD_DIMS`); the persistent grid (kv_len up to
# 1024) keeps them off, unmeasured since.
PREFETCH_LSE_TILES: tuple[tuple[int, int], ...] = ((128, 64),)
# The same in the fused dQ's consumers, by (head_dim, block_q). Session 14
# (before merged pieces) it cost the fused kernel 7-9%; session 22 (d=128
# without a mask at 16k, its default there: deferred, merged pieces,
# backward alone, settled, three rounds in alternating order,
# results/h200_mosaic_fused_lse.md) 498 -> 523 and 497 -> 512 TFLOP/s in
# two A/Bs (the two kernels 492 and 494); under causal masking 434 -> 440
# and at 4k 438 -> 437, where the two kernels (496, 474) stay the default.
# At d=64's 128-row Q tiles (lse of 128 columns held) 417 -> 184.
FUSED_PREFETCH_LSE_TILES: tuple[tuple[int, int], ...] = ((128, 64),)
CAUSAL_LAUNCH_LEAN_HEAD_DIMS: tuple[int, ...] = (128,)
# `mosaic_backward(lean_producer=None)`: the two kernels' consumers at 240
# registers and producers at 24 (the fused dQ has none to spare). Measured
# on the H200 (session 15, backward alone, geomean of full and causal,
# two rounds, off -> on, TFLOP/s, results/h200_mosaic_lean.md): d=64
# (128-row Q tiles) 391 -> 392 at 16k, 367 -> 372 at 4k, 283 -> 293 at
# 1k; d=128 492 -> 494, 441 -> 446, 354 -> 358; d=256 357 -> 363, 328 ->
# 341, 241 -> 249. At d=128 without a mask, three rounds, twice
# (results/h200_mosaic_early_delta.md): 499 -> 496 at 16k, 462 -> 475 and
# 465 -> 473 at 4k, 400 -> 404 at 1k. Cell by cell it is +2% to +5% at
# d=256, +1% to +3% at d=128 without a mask, +1% to +4% at d=64 under
# causal masking, -1% to +6% at d=64 without one, and at d=128 under
# causal masking -1.0%, -0.5%, +0.2% at 1k, 4k, 16k: off there, but on
# with `prefetch_lse` on the launch grid since session 20 (see
# `CAUSAL_LAUNCH_LEAN_HEAD_DIMS`). Not yet in the ranged kernels.
LEAN_PRODUCER_BY_DEFAULT = True
LEAN_PRODUCER_CAUSAL_HEAD_DIMS: tuple[int, ...] = (64, 256)
# `mosaic_backward(merged_pieces=None)`: on with the fused (deferred) dQ at
# these head dims where each consumer has one dQ piece. At d=128 without a
# mask (session 15, three rounds, twice, results/h200_mosaic_merged.md):
# the fused kernel 482 -> 504 and 478 -> 508 at 16k, 439 -> 451 at 4k. At
# d=64's 128-row Q tiles it needs `deferred_dq`, which costs more there
# (402 not deferred, 327 deferred, 345 deferred and merged, at 16k).
MERGED_PIECES_HEAD_DIMS: tuple[int, ...] = (128,)
# `mosaic_backward(dq_tiles=None)`: the dQ kernel's own (block_q, block_kv)
# by the call's (head_dim, block_q), under causal masking on the launch grid
# (where kv_len is a multiple of their block_kv; elsewhere the dK/dV
# kernel's tiles). Session 20 (results/h200_mosaic_dq_tiles.md, backward
# alone, settled, rounds in alternating order), d=64 with 128-row Q tiles,
# its dQ kernel on 64 x 128 tiles instead of 128 x 64: causal 381 -> 391
# TFLOP/s at 16k (three rounds) and 331 -> 337 at 4k (two, launch grid; 4k
# runs the persistent grid); without a mask 397 -> 398 at 16k (the fused
# kernel ran there until session 24) and 385 -> 380 at 4k. At d=128,
# 64 x 128 against 64 x 64: -0.9% to +0.4% but -2.8% at 4k without a mask:
# not there.
DQ_TILES_CAUSAL_LAUNCH: dict[tuple[int, int], tuple[int, int]] = {
    (64, 128): (64, 128)}
# `mosaic_backward(hw_ds_sync=None)`: the fused dQ's consumers meet each
# step on a hardware barrier at these head dims (where the pieces are not
# deferred). Session 21 (backward alone, settled, three rounds in
# alternating order, results/h200_mosaic_fused_hw_sync.md): d=64 without a
# mask at 16k 405 -> 420 TFLOP/s (the two kernels 402). Where the pieces
# are deferred (d=128) the consumers' waits on hardware barriers of their
# own (two per consumer, by step parity; built in ccc1e2d) measured a tie in
# session 22 (494.7 -> 493.9 at 16k, 432 -> 432 at 4k,
# results/h200_mosaic_deferred_hw_sync.md: the other's arrival is a step
# old by then), so that form was removed and `hw_ds_sync` still refuses
# `deferred_dq`.
HW_DS_SYNC_HEAD_DIMS: tuple[int, ...] = (64,)
# `mosaic_backward(scores_ahead=None)`: on by (head_dim, block_q) on the
# launch grid without a causal mask (where the two kernels run: not the
# fused dQ). Under causal masking (each head's unmasked run ahead; built at
# the end of session 24, its GPU tests and A/B not yet run) off. Session
# 24 (backward alone, three rounds, TFLOP/s, off -> on,
# results/h200_mosaic_ahead_s24.md): d=64 with 128-row Q tiles 387 -> 403
# at 4k and 400 -> 421 at 16k (the two kernels, which run there since:
# `FUSED_DQ_MIN_KV_LEN`), but on the persistent grid at 1k 342 -> 337;
# d=128 (64-row Q tiles, lse read early) 470 -> 456 at 4k.
SCORES_AHEAD_LAUNCH_TILES: tuple[tuple[int, int], ...] = ((64, 128),)


def shared_rows_by_default(*, head_dim: int, persistent: bool) -> bool:
  """Whether `mosaic_backward(shared_rows=None)` shares the dK/dV kernel's
  K/V rows between its consumers (on the launch grid; which grid runs is
  decided first, by `persistent_by_default`)."""
  return head_dim in SHARED_ROWS_HEAD_DIMS and not persistent


def prefetch_stats_by_default(*, head_dim: int, block_q: int) -> bool:
  """Whether `mosaic_backward(prefetch_stats=None)` reads the dK/dV
  kernel's row statistics before its matmuls."""
  return (head_dim, block_q) in PREFETCH_STATS_TILES


def _causal_launch_lean(*, head_dim: int, persistent: bool) -> bool:
  """Whether a causal call runs lean producers with lse read early
  (`CAUSAL_LAUNCH_LEAN_HEAD_DIMS`: on the launch grid at those head dims)."""
  return not persistent and head_dim in CAUSAL_LAUNCH_LEAN_HEAD_DIMS


def prefetch_lse_by_default(*, head_dim: int, block_q: int, fused_dq: bool,
                            is_causal: bool, persistent: bool = False) -> bool:
  """Whether `mosaic_backward(prefetch_lse=None)` reads the dK/dV kernel's
  lse before its matmuls: in the fused dQ where `FUSED_PREFETCH_LSE_TILES`
  says; in the two kernels where `PREFETCH_LSE_TILES` says, on either grid
  without a causal mask, under one on the launch grid at
  `CAUSAL_LAUNCH_LEAN_HEAD_DIMS` only."""
  if fused_dq:
    return (head_dim, block_q) in FUSED_PREFETCH_LSE_TILES
  if is_causal and not _causal_launch_lean(head_dim=head_dim,
                                           persistent=persistent):
    return False
  return (head_dim, block_q) in PREFETCH_LSE_TILES


def lean_producer_by_default(*, head_dim: int, fused_dq: bool,
                             is_causal: bool, persistent: bool = False
                             ) -> bool:
  """Whether `mosaic_backward(lean_producer=None)` moves registers from
  the producers to the consumers (the two kernels only; under causal
  masking at `LEAN_PRODUCER_CAUSAL_HEAD_DIMS`, and on the launch grid at
  `CAUSAL_LAUNCH_LEAN_HEAD_DIMS`)."""
  if is_causal and head_dim not in LEAN_PRODUCER_CAUSAL_HEAD_DIMS and not (
      _causal_launch_lean(head_dim=head_dim, persistent=persistent)):
    return False
  return LEAN_PRODUCER_BY_DEFAULT and not fused_dq


def merged_pieces_by_default(*, head_dim: int, deferred_dq: bool,
                             overlap_softmax: bool,
                             one_piece_each: bool) -> bool:
  """Whether the fused dQ with `mosaic_backward(merged_pieces=None)`
  merges its pieces: deferred, at `MERGED_PIECES_HEAD_DIMS`, where each
  consumer has one dQ piece (decided in `statics`, which knows the
  consumers)."""
  return (deferred_dq and overlap_softmax and one_piece_each
          and head_dim in MERGED_PIECES_HEAD_DIMS)


def dq_tiles_by_default(*, head_dim: int, block_q: int, q_len: int,
                        kv_len: int, is_causal: bool, persistent: bool,
                        fused_dq: bool) -> tuple[int, int] | None:
  """`mosaic_backward(dq_tiles=None)`'s tiles (`DQ_TILES_CAUSAL_LAUNCH`,
  where they divide the lengths), or None for the dK/dV kernel's."""
  tiles = DQ_TILES_CAUSAL_LAUNCH.get((head_dim, block_q))
  if (tiles is None or not is_causal or persistent or fused_dq
      or q_len % tiles[0] or kv_len % tiles[1]):
    return None
  return tiles


def hw_ds_sync_by_default(*, head_dim: int, fused_dq: bool,
                          deferred_dq: bool) -> bool:
  """Whether `mosaic_backward(hw_ds_sync=None)` has the fused dQ's
  consumers meet on a hardware barrier (`HW_DS_SYNC_HEAD_DIMS`, where they
  meet each step: not deferred)."""
  return fused_dq and not deferred_dq and head_dim in HW_DS_SYNC_HEAD_DIMS


def scores_ahead_by_default(*, head_dim: int, block_q: int, fused_dq: bool,
                            is_causal: bool, persistent: bool) -> bool:
  """Whether `mosaic_backward(scores_ahead=None)` issues the dK/dV
  kernel's Sᵀ a step ahead (`SCORES_AHEAD_LAUNCH_TILES`)."""
  return ((head_dim, block_q) in SCORES_AHEAD_LAUNCH_TILES
          and not (fused_dq or is_causal or persistent))


def persistent_by_default(*, head_dim: int, kv_len: int,
                          is_causal: bool = False) -> bool:
  """Whether `mosaic_backward(persistent=None)` runs the persistent grid."""
  if is_causal and kv_len <= PERSISTENT_CAUSAL_MAX_KV_LEN.get(head_dim, 0):
    return True
  return kv_len <= PERSISTENT_MAX_KV_LEN.get(head_dim, 0)


def fused_dq_by_default(*, head_dim: int, kv_len: int, block_q: int,
                        block_kv: int = 64, is_causal: bool = False) -> bool:
  """Whether `mosaic_backward(fused_dq=None)` fuses dQ into dK/dV: where
  the tables say, where its dQ pieces share out between two consumers
  (else it would refuse the call, and the Triton backward would run), and
  where kv_len gives it two consumers (with one it was never measured
  against the two kernels)."""
  least = FUSED_DQ_MIN_KV_LEN.get(head_dim)
  if is_causal and head_dim not in FUSED_DQ_CAUSAL_HEAD_DIMS:
    return False
  return (least is not None and kv_len >= least
          and kv_len % (_MAX_CONSUMERS * block_kv) == 0
          and _dq_pieces(block_q, head_dim) % _MAX_CONSUMERS == 0)


def opaque_resident_by_default(*, head_dim: int, fused_dq: bool) -> bool:
  """Whether `mosaic_backward(opaque_resident=None)` recomputes the dK/dV
  kernel's resident descriptors each step."""
  return fused_dq and head_dim in OPAQUE_RESIDENT_FUSED_HEAD_DIMS


def tile_fastest_by_default(*, persistent: bool, fused_dq: bool) -> bool:
  """Whether `mosaic_backward(tile_fastest=None)` launches the two
  kernels' launch grids tile-fastest."""
  return TILE_FASTEST_BY_DEFAULT and not (persistent or fused_dq)


def deferred_dq_by_default(*, head_dim: int, fused_dq: bool) -> bool:
  """Whether `mosaic_backward(deferred_dq=None)` computes the fused dQ's
  pieces of a step during the next."""
  return fused_dq and head_dim in DEFERRED_DQ_FUSED_HEAD_DIMS


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
  # dQ kernel, causal: launch the tiles with the most K/V blocks first
  # (`forward.tile_index`). The dK/dV kernel's K/V tile j reads the Q blocks
  # from j on, so its grid order is heaviest first already.
  heavy_first: bool = True
  # Overlap within a consumer (`tune_mosaic --kernels backward_overlap`; on
  # in `mosaic_backward`, 2-3% faster on the H200, off in the ranged
  # kernels until they are run with it on a GPU): P's exponentials run while the dP wgmma is on the
  # tensor cores (both kernels), and in the dK/dV kernel dS while the
  # dV += Pᵀ dO wgmma is (FlashAttention-3's intra-warpgroup overlap, §3.2,
  # within one step).
  overlap_softmax: bool = False
  # dK/dV kernel: read the step's row statistics (lse, delta) from shared
  # memory before the step's wgmmas are issued, not when P and dS need
  # them, so that the load's latency hides behind the matmuls (Nsight
  # Compute at d=128 16k: 12% of the consumers' stall samples were P's
  # first FFMAs waiting on the lse load). Costs their registers (16 each
  # at block_q 64) while the matmuls run.
  prefetch_stats: bool = False
  # dK/dV kernel: read lse alone before the step's wgmmas (delta when dS
  # needs it), so that the load P's first FFMAs wait on hides behind the
  # matmuls at half `prefetch_stats`' registers (Nsight Compute, fused dQ
  # at d=128 4k, session 14: 10% of the consumers' stall samples were P's
  # FFMAs waiting on that load; at 16k with merged pieces, session 22,
  # 12%: results/h200_ncu_fused_16k_s22.md).
  prefetch_lse: bool = False
  # dK/dV kernel (plain and fused consumers): read delta as soon as Sᵀ is
  # ready, before P's exponentials, not after dV's wgmma is issued, so
  # that its load hides behind them (the fused dQ's stall samples, session
  # 14: 2% of the consumers' on dS's FADDs waiting for it). Costs its 16
  # registers (block_q 64) through P. Bitwise the default (GPU tests,
  # session 15); measured 1-5% slower at d=128 (results/h200_mosaic_
  # early_delta.md): off.
  early_delta: bool = False
  # dK/dV kernel, plain consumers (under causal masking, each query head's
  # run of unmasked steps; without a mask, every step of the walk, across
  # the group's heads): step t + 1's Sᵀ = K Qᵀ is issued once step t's dV
  # is done but before its dK is, so that the tensor cores run it right
  # behind dK rather than after the warpgroup has seen dK done, released
  # the slot and issued it (`_walk_scores_ahead`). Nsight Compute of
  # d=64's 4k backward (session 23, results/h200_ncu_d64_4k_s23.md): 7% of
  # the dK/dV kernel's samples waited for Sᵀ and 6.5% for dV and dK, back
  # to back. Scheduling only:
  # bitwise the default (GPU tests). The same in the dQ kernel (S behind
  # the step before's dQ product) measured slower, 405 -> 399 TFLOP/s at
  # d=64 4k and 471 -> 456 at d=128 (session 24, results/h200_mosaic_
  # ahead_s24.md), and was removed.
  scores_ahead: bool = False
  # Both kernels (not the fused dQ, whose four warpgroups have 512 registers
  # a thread slot shared 232/232/24/24): the producer at 24 registers (it
  # only issues TMA; it may spill) and the consumers at 240, instead of 40
  # and 232 (`forward._LEAN_REGISTERS`: 2 * 240 + 24 = 504, a 384-thread
  # CTA's launch budget of 168 a thread, as 2 * 232 + 40), so that lse and
  # delta read early (`prefetch_lse`, `early_delta`) have room. Bitwise the
  # default (GPU tests, session 15); the default where measured faster
  # (`LEAN_PRODUCER_BY_DEFAULT`).
  lean_producer: bool = False
  # dK/dV kernel, plain form: the consumers index their resident K and V
  # rows each step with a zero read from shared memory (the last scratch
  # buffer; shared memory, which the kernel's barriers and copies may write
  # for all the compiler knows), so that it cannot hoist those tiles' wgmma
  # descriptors out of the step loop. Hoisted, they are loop invariants
  # that hold registers across every matmul: in the fused dQ at d=128
  # (Nsight Compute, session 11) ptxas spilled them and reloaded them each
  # step from L2, ~190 bytes per thread per step, and the wgmma issues
  # stalled on the reloads. Recomputed, a descriptor costs a few integer
  # operations per matmul.
  opaque_resident: bool = False
  # Fused dQ: a consumer computes its dQ pieces of step s during step s + 1
  # (after that step's dK and dV), not at the end of step s. At step s the
  # pieces need both consumers' dSᵀ of s, so each consumer waits there for
  # the other every step, and their softmaxes stop alternating with each
  # other's matmuls (Nsight Compute, session 11: the fused kernel at 55%
  # of the tensor pipe). A step later the other's dSᵀ is long stored; what
  # a consumer then waits for is the other having read the dSᵀ buffer it
  # is about to overwrite (`_FusedDq.ds_read`), a step of slack.
  deferred_dq: bool = False
  # Fused dQ: the writer frees a stage of dQ pieces as soon as its TMA has
  # read it, not once the adds have reached global memory (which the turn
  # hand-on still waits for). A consumer reuses a stage two steps on; with
  # the stage held until the adds land, consumers stalled on it (Nsight
  # Compute at d=128 4k, session 14: 9% of their stall samples). Bitwise
  # the fused kernel (6 GPU tests, three runs each); measured -5% at 4k
  # and +3% at 16k (results/h200_mosaic_fused_stalls.md): off.
  stage_free_on_read: bool = False
  # Fused dQ, deferred, one dQ piece a consumer: step s - 1's piece is
  # issued in the same wgmma group as step s's dV and dK, one wait for all
  # three, instead of issued and waited for on its own after them (the
  # fused kernel's stall samples, session 14: 6% of the consumers' on that
  # wait, 6% more on dV/dK's); the tensor cores then have 768 clocks queued
  # a consumer step. Bitwise the deferred kernel (GPU tests, three runs,
  # session 15); the default at `MERGED_PIECES_HEAD_DIMS`.
  merged_pieces: bool = False
  # Fused dQ, not deferred: the consumers' meeting each step (every dSᵀ of
  # the step stored before any consumer reads them for its dQ pieces) is
  # one `bar.sync` on a hardware barrier (`_DS_STORED_BARRIER`) instead of
  # an arrival on and a polling wait for the `ds_stored` mbarrier. Safe on
  # a barrier without phases: each consumer arrives and waits in one
  # instruction, so none can arrive for the next step before all have
  # arrived for this one. Scheduling only: bitwise the same (GPU tests).
  # The default at `HW_DS_SYNC_HEAD_DIMS`.
  hw_ds_sync: bool = False
  # Persistent grid: `num_ctas` CTAs (one per SM) walk the tiles in turn
  # (`forward.persistent_schedule`), so that a tile's start (its resident
  # loads, the ring's fill) overlaps the previous tile's end. Plain form.
  persistent: bool = False
  num_ctas: int = 0
  # Fused dQ (`mosaic_backward(fused_dq=True)`; dK/dV kernel only): each
  # step also computes the CTA's dS K for the Q tile, the consumers sharing
  # out its pieces, and a fourth warpgroup adds it, in f32, to a dQ sum in
  # global memory by TMA reduce-add, in a fixed order (see `_FusedDq`). 5
  # matmuls per tile pair instead of 7 (the dQ kernel's recomputed S and dP
  # go). Launch grid, plain form.
  fused_dq: bool = False
  # Launch grid order, as the forward's `KernelStatic.tile_fastest`: a
  # head's tiles launched together rather than the same tile of many heads.
  tile_fastest: bool = False
  # Shared K/V rows (`mosaic_backward(shared_rows=True)`; dK/dV kernel, plain
  # form): the consumers share the CTA's `block_kv` K/V rows instead of
  # owning `block_kv` rows each. Consumer c computes Sᵀ and dPᵀ for its
  # part of the step's Q rows, and dK and dV for its part of the head_dim
  # columns; the parts of Pᵀ and dSᵀ meet in shared memory
  # (`_dkdv_consume_shared`). So dK and dV fit one pass where a consumer
  # could not hold both whole (head_dim 256), with two consumers. In the dQ
  # kernel (`mosaic_backward(shared_q_rows=True)`) likewise: the consumers
  # share block_q Q rows, each computing S and dP for part of the step's
  # K/V rows and dQ for part of the columns, dS exchanged
  # (`_dq_consume_shared`).
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
    return self.block_q * (1 if self.shared_rows else self.num_consumers)

  @property
  def segmented(self) -> bool:
    return self.ranged and self.spec.has_segments


def mosaic_backward(query, key, value, out, lse, d_out, d_lse=None, *,
                    scale: float, is_causal: bool, block_q: int = 64,
                    block_kv: int = 64, max_concurrent_steps: int = 2,
                    heavy_first: bool = True, overlap_softmax: bool = True,
                    persistent: bool | None = None,
                    num_ctas: int | None = None,
                    fused_dq: bool | None = None,
                    tile_fastest: bool | None = None,
                    shared_rows: bool | None = None,
                    shared_q_rows: bool = False,
                    prefetch_stats: bool | None = None,
                    opaque_resident: bool | None = None,
                    deferred_dq: bool | None = None,
                    prefetch_lse: bool | None = None,
                    early_delta: bool = False,
                    scores_ahead: bool | None = None,
                    lean_producer: bool | None = None,
                    stage_free_on_read: bool = False,
                    merged_pieces: bool | None = None,
                    dq_tiles: tuple[int, int] | None = None,
                    hw_ds_sync: bool | None = None):
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

    block_q: Q rows per tile: per consumer warpgroup in the dQ kernel, per
      streamed step in the dK/dV kernel.
    block_kv: K/V rows per tile: per consumer warpgroup in the dK/dV kernel,
      per streamed step in the dQ kernel.
    max_concurrent_steps: depth of the TMA ring of both kernels.
    heavy_first: under causal masking, launch the dQ kernel's query tiles
      with the most K/V blocks first; False launches them in order.
    overlap_softmax: overlap the elementwise work with the matmuls within
      each consumer (see `_Static`); the results are the same either way.
      On by default: 2.6%, 3.4% and 2.3% faster at head_dim 64, 128, 256
      (H200, seq 16k).
    persistent: both kernels on a persistent grid of `num_ctas` CTAs (None:
      one per SM), each walking its tiles with the streamed ring running on
      across them; bitwise the launch grid's results. None: where measured
      faster (`persistent_by_default`).
    num_ctas: CTAs of the persistent grid; None: the GPU's SM count.
    fused_dq: one kernel: the dK/dV kernel also sums dQ, in float32 in
      global memory, each K/V tile adding its part in a fixed order (see
      `_FusedDq`), so the results are deterministic; 5 matmuls per
      (Q tile, K/V tile) pair instead of 7 (the dQ kernel recomputes S, dP).
      Launch grid only, and only where dK and dV fit one pass (head_dim up
      to 128). None: where measured faster (`fused_dq_by_default`: from
      kv_len 16384 at head_dim 128, without a causal mask), and not
      where `dq_tiles` asks for the dQ kernel.
    tile_fastest: both kernels' launch grids in tile-fastest order (see
      `_Static`); the results are the same either way. Not with `fused_dq`,
      whose K/V tiles of a head must launch apart. None: on the launch grid
      without the fused dQ (`tile_fastest_by_default`).
    shared_rows: the dK/dV kernel's two consumers share `block_kv` K/V
      rows, each computing half of dK's and dV's columns (see `_Static`):
      one pass where dK and dV do not fit one consumer (head_dim 256).
      Not with `fused_dq`. None: where measured faster
      (`shared_rows_by_default`).
    shared_q_rows: the dQ kernel's consumers likewise share `block_q` Q
      rows (two consumers at head_dim 256 instead of one); measured slower,
      so off by default.
    prefetch_stats: the dK/dV kernel reads each step's lse and delta before
      its matmuls are issued (see `_Static`); the same results either way.
      None: where measured faster (`prefetch_stats_by_default`).
    opaque_resident: the dK/dV kernel recomputes its resident tiles' wgmma
      descriptors each step instead of holding them (see `_Static`); the
      same results either way. Not with shared rows. None: where measured
      faster (`opaque_resident_by_default`: the fused dQ at head_dim 128).
    deferred_dq: the fused dQ's pieces of a step computed during the next
      (see `_Static`); the same results either way. Fused dQ only. None:
      where measured faster (`deferred_dq_by_default`: the fused dQ at
      head_dim 128).
    prefetch_lse: as `prefetch_stats` for lse alone (see `_Static`). None:
      where measured faster (`prefetch_lse_by_default`: head_dim 128 with
      64-row Q tiles, in the fused dQ, and in the two kernels on either
      grid without a causal mask and on the launch grid under one).
    early_delta: the dK/dV kernel reads delta before P's exponentials
      (see `_Static`); the same results either way.
    scores_ahead: the dK/dV kernel issues each step's Sᵀ right behind the
      step before's dK, before waiting for it (see `_Static`); the same
      results either way. The plain consumers (not fused, not shared
      rows, not the ranged kernel, not with `prefetch_stats`,
      `early_delta` or `opaque_resident`), with a ring of two stages or
      more; under causal masking each query head's unmasked steps. None: where measured
      faster (`scores_ahead_by_default`: d=64's launch grid without a
      mask) and these allow it.
    lean_producer: both kernels' producers at 24 registers and consumers
      at 240 (see `_Static`); the same results either way. Not with
      `fused_dq`. None: with the two kernels, but not on the persistent
      grid at head_dim 128 under causal masking (`lean_producer_by_default`).
    stage_free_on_read: the fused dQ's writer frees each stage of pieces
      once read rather than once added (see `_Static`); the same results
      either way. Fused dQ only.
    merged_pieces: the fused dQ issues each step's dQ piece with the next
      step's dV and dK (see `_Static`); the same results either way. With
      `deferred_dq` and one piece a consumer only. None: with the deferred
      fused dQ at head_dim 128 where each consumer has one piece
      (`merged_pieces_by_default`).
    dq_tiles: (block_q, block_kv) of the dQ kernel alone, where they differ
      from the dK/dV kernel's (block_q, block_kv). Two kernels only; pass
      (block_q, block_kv) for the same tiles. None: where measured faster
      (`dq_tiles_by_default`: 64 x 128 at head_dim 64 with 128-row Q tiles
      under causal masking on the launch grid), else the same tiles.
    hw_ds_sync: the fused dQ's consumers meet each step on a hardware
      barrier instead of an mbarrier (see `_Static`); the same results
      either way. Fused dQ without `deferred_dq` only. None: where
      measured faster (`hw_ds_sync_by_default`: the fused dQ at head_dim
      64).

  Returns:
    (dq, dk, dv), shaped and typed like (query, key, value).

  Raises:
    NotImplementedError: for calls these kernels do not cover (dtype, head
      dim, lengths not multiples of the tiles, tiles that do not fit in
      shared memory or registers), so that a dispatcher falls back.
  """
  if dq_tiles is not None and (
      len(dq_tiles) != 2 or not all(isinstance(n, int) for n in dq_tiles)):
    raise ValueError(f"dq_tiles must be (block_q, block_kv) of ints or None, "
                     f"got {dq_tiles!r}")
  check_supported(query, key, value, out, lse, d_out, d_lse,
                  block_q=block_q, block_kv=block_kv,
                  max_concurrent_steps=max_concurrent_steps)
  if dq_tiles is not None:
    check_tiles_divide(query.shape[1], key.shape[1], block_q=dq_tiles[0],
                       block_kv=dq_tiles[1],
                       max_concurrent_steps=max_concurrent_steps)
  # Configuring raises for tiles that do not fit, before any work is traced.
  dq_config, dkdv_configs = configure(
      query, key, scale=scale, is_causal=is_causal, block_q=block_q,
      block_kv=block_kv, max_concurrent_steps=max_concurrent_steps,
      heavy_first=heavy_first, overlap_softmax=overlap_softmax,
      persistent=persistent, num_ctas=num_ctas, fused_dq=fused_dq,
      tile_fastest=tile_fastest, shared_rows=shared_rows,
      shared_q_rows=shared_q_rows, prefetch_stats=prefetch_stats,
      opaque_resident=opaque_resident, deferred_dq=deferred_dq,
      prefetch_lse=prefetch_lse, early_delta=early_delta,
      scores_ahead=scores_ahead,
      lean_producer=lean_producer, stage_free_on_read=stage_free_on_read,
      merged_pieces=merged_pieces, dq_tiles=dq_tiles, hw_ds_sync=hw_ds_sync)
  stats = row_statistics(out, lse, d_out, d_lse)
  return gradients(query, key, value, d_out, stats, dq_config, dkdv_configs)


def configure(query, key, *, scale: float, is_causal: bool, block_q: int = 64,
              block_kv: int = 64, max_concurrent_steps: int = 2,
              heavy_first: bool = True, overlap_softmax: bool = True,
              persistent: bool | None = None, num_ctas: int | None = None,
              fused_dq: bool | None = None,
              tile_fastest: bool | None = None,
              shared_rows: bool | None = None, shared_q_rows: bool = False,
              prefetch_stats: bool | None = None,
              opaque_resident: bool | None = None,
              deferred_dq: bool | None = None,
              prefetch_lse: bool | None = None, early_delta: bool = False,
              scores_ahead: bool | None = None,
              lean_producer: bool | None = None,
              stage_free_on_read: bool = False,
              merged_pieces: bool | None = None,
              dq_tiles: tuple[int, int] | None = None,
              hw_ds_sync: bool | None = None):
  """`mosaic_backward`'s kernels for these arguments (its defaults decided):
  (`dq_static` or None when fused, [`dkdv_statics`' passes]), as
  `gradients` takes them. Raises NotImplementedError for tiles that do not
  fit."""
  tiles = dict(scale=scale, is_causal=is_causal, block_q=block_q,
               block_kv=block_kv, max_concurrent_steps=max_concurrent_steps)
  head_dim, kv_len = query.shape[-1], key.shape[1]
  same_tiles = dq_tiles is not None and tuple(dq_tiles) == (block_q,
                                                            block_kv)
  if fused_dq is None:  # tiles of the dQ kernel's own ask for that kernel
    own_tiles = dq_tiles is not None and not same_tiles
    fused_dq = not (persistent or own_tiles) and fused_dq_by_default(
        head_dim=head_dim, kv_len=kv_len, block_q=block_q,
        block_kv=block_kv, is_causal=is_causal)
  if persistent is None:
    persistent = not fused_dq and persistent_by_default(
        head_dim=head_dim, kv_len=kv_len, is_causal=is_causal)
  if shared_rows is None:
    shared_rows = not fused_dq and shared_rows_by_default(
        head_dim=head_dim, persistent=persistent)
  if prefetch_stats is None:
    prefetch_stats = prefetch_stats_by_default(head_dim=head_dim,
                                               block_q=block_q)
  if prefetch_lse is None:
    prefetch_lse = prefetch_lse_by_default(head_dim=head_dim, block_q=block_q,
                                           fused_dq=fused_dq,
                                           is_causal=is_causal,
                                           persistent=persistent)
  if opaque_resident is None:
    opaque_resident = opaque_resident_by_default(head_dim=head_dim,
                                                 fused_dq=fused_dq)
  if deferred_dq is None:
    deferred_dq = deferred_dq_by_default(head_dim=head_dim, fused_dq=fused_dq)
  if tile_fastest is None:
    tile_fastest = tile_fastest_by_default(persistent=persistent,
                                           fused_dq=fused_dq)
  if hw_ds_sync is None:
    hw_ds_sync = hw_ds_sync_by_default(head_dim=head_dim, fused_dq=fused_dq,
                                       deferred_dq=deferred_dq)
  if lean_producer is None:
    lean_producer = lean_producer_by_default(
        head_dim=head_dim, fused_dq=fused_dq, is_causal=is_causal,
        persistent=persistent)
  if scores_ahead is None:  # where measured faster and the options allow
    scores_ahead = scores_ahead_by_default(
        head_dim=head_dim, block_q=block_q, fused_dq=fused_dq,
        is_causal=is_causal, persistent=persistent) and not _why_not_ahead(
            fused_dq=fused_dq, shared_rows=shared_rows, spec=None,
            prefetch_stats=prefetch_stats, early_delta=early_delta,
            opaque_resident=opaque_resident,
            overlap_softmax=overlap_softmax,
            max_concurrent_steps=max_concurrent_steps)
  if same_tiles:
    dq_tiles = None  # the dK/dV kernel's, as asked
  elif dq_tiles is None:
    dq_tiles = dq_tiles_by_default(
        head_dim=head_dim, block_q=block_q, q_len=query.shape[1],
        kv_len=kv_len, is_causal=is_causal, persistent=persistent,
        fused_dq=fused_dq)
  # merged_pieces=None goes on: `statics` decides it with the consumers.
  return statics(query, key, heavy_first=heavy_first,
                 overlap_softmax=overlap_softmax, persistent=persistent,
                 num_ctas=num_ctas, fused_dq=fused_dq,
                 tile_fastest=tile_fastest, shared_rows=shared_rows,
                 shared_q_rows=shared_q_rows, prefetch_stats=prefetch_stats,
                 opaque_resident=opaque_resident, deferred_dq=deferred_dq,
                 prefetch_lse=prefetch_lse, early_delta=early_delta,
                 scores_ahead=scores_ahead, lean_producer=lean_producer,
                 stage_free_on_read=stage_free_on_read,
                 merged_pieces=merged_pieces, dq_tiles=dq_tiles,
                 hw_ds_sync=hw_ds_sync, **tiles)


def gradients(query, key, value, d_out, stats, dq_config: _Static | None,
              dkdv_configs: list[_Static], *, dq_plan=None, dkdv_plan=None,
              segments=None):
  """(dq, dk, dv) by the dQ kernel and the dK/dV pass(es), or by the one
  fused kernel.

  Args:
    query, key, value, d_out: as `mosaic_backward`'s.
    stats: `row_statistics`, float32 [batch, num_heads, 2, rows].
    dq_config, dkdv_configs: from `dq_static` and `dkdv_statics` (`statics`:
      dq_config None when the dK/dV kernel is fused with dQ).
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
  if dtype not in _SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"mosaic_backward supports bfloat16 and float16, got {dtype}")
  if head_dim not in _SUPPORTED_HEAD_DIMS:
    raise NotImplementedError(f"mosaic_backward supports head_dim in "
                              f"{_SUPPORTED_HEAD_DIMS}, got {head_dim}")
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
  into 0.32-0.39 ms at seq 1k, a quarter of the backward; now 0.06-0.07
  ms); `interpret` is its interpret mode (None: when no GPU is present). An
  empty row (lse = -inf) gets +inf, so that P = exp2(s - lse) is 0 there,
  not inf. Stacked, so that a tile of both is one TMA.
  """
  if interpret is None:
    interpret = not versions.has_gpu()
  delta = row_delta(out, d_out, interpret=interpret)
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  lse_log2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * _LOG2E)
  return jnp.stack([lse_log2, delta], axis=2)


def _accumulator_registers(*shapes) -> int:
  """Registers per thread that f32 wgmma accumulators of `shapes` take."""
  return sum(m * n for m, n in shapes) // _THREADS_PER_WARPGROUP


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
        smem_of(consumers) <= _SMEM_LIMIT_BYTES):
      return consumers
  raise NotImplementedError(
      f"the backward tiles need {smem_of(1)} bytes of shared memory even "
      f"with one consumer; sm90 has {_SMEM_LIMIT_BYTES}")


def statics(query, key, *, heavy_first: bool = True,
            overlap_softmax: bool = False, persistent: bool = False,
            num_ctas: int | None = None, fused_dq: bool = False,
            tile_fastest: bool = False, shared_rows: bool = False,
            shared_q_rows: bool = False, prefetch_stats: bool = False,
            opaque_resident: bool = False, deferred_dq: bool = False,
            prefetch_lse: bool = False, early_delta: bool = False,
            scores_ahead: bool = False,
            lean_producer: bool = False, stage_free_on_read: bool = False,
            merged_pieces: bool | None = False,
            dq_tiles: tuple[int, int] | None = None,
            hw_ds_sync: bool = False, **tiles):
  """(`dq_static`, `dkdv_statics`) with the schedule options set; `tiles`
  are their keyword arguments (`dq_tiles`: the dQ kernel's block_q and
  block_kv instead of theirs; `configure` turns tiles equal to theirs into
  None). Fused dQ: (None, [the one fused pass]);
  `merged_pieces=None` there: on where each consumer has one dQ piece."""
  options = dict(overlap_softmax=bool(overlap_softmax),
                 tile_fastest=bool(tile_fastest),
                 lean_producer=bool(lean_producer))
  dkdv_options = dict(options, prefetch_stats=bool(prefetch_stats),
                      prefetch_lse=bool(prefetch_lse),
                      early_delta=bool(early_delta),
                      opaque_resident=bool(opaque_resident))
  if scores_ahead:
    why = _why_not_ahead(fused_dq=fused_dq, shared_rows=shared_rows,
                         spec=tiles.get("spec"),
                         prefetch_stats=prefetch_stats,
                         early_delta=early_delta,
                         opaque_resident=opaque_resident,
                         overlap_softmax=overlap_softmax,
                         max_concurrent_steps=tiles["max_concurrent_steps"])
    if why:
      raise NotImplementedError(f"scores_ahead: {why}")
  if dq_tiles is not None and tiles.get("spec") is not None:
    # The ranged kernels' plans classify blocks at the one pair of tiles.
    raise NotImplementedError("dq_tiles: not in the ranged backward")
  if fused_dq:
    if dq_tiles is not None:
      raise NotImplementedError("dq_tiles: the two kernels only")
    if shared_rows or shared_q_rows:
      raise NotImplementedError("the fused dQ has no shared rows")
    if lean_producer:
      raise NotImplementedError(
          "lean_producer: the two kernels only (the fused dQ's four "
          "warpgroups share their registers otherwise)")
    if persistent or tile_fastest:
      raise NotImplementedError(
          "the fused dQ runs on the launch grid in its own order only: its "
          "K/V tiles wait for each other in order")
    if tiles.get("spec") is not None:
      raise NotImplementedError("the ranged backward has no fused dQ")
    if merged_pieces and not (deferred_dq and overlap_softmax):
      raise NotImplementedError(
          "merged_pieces: with deferred_dq and overlap_softmax only")
    if hw_ds_sync and deferred_dq:
      raise NotImplementedError(
          "hw_ds_sync: the fused dQ without deferred_dq only (deferred, it "
          "measured a tie and was removed: see HW_DS_SYNC_HEAD_DIMS)")
    fused_configs = dkdv_statics(query, key, fused_dq=True,
                                 opaque_resident=opaque_resident,
                                 deferred_dq=deferred_dq, **tiles)
    # One piece a consumer, counted with the consumers the kernel gets
    # (one, where kv_len is not a multiple of two K/V tiles).
    one_piece_each = all(
        _dq_pieces(config.block_q, config.head_dim) == config.num_consumers
        for config in fused_configs)
    if merged_pieces is None:
      merged_pieces = merged_pieces_by_default(
          head_dim=fused_configs[0].head_dim, deferred_dq=deferred_dq,
          overlap_softmax=overlap_softmax, one_piece_each=one_piece_each)
    elif merged_pieces and not one_piece_each:
      raise NotImplementedError(
          "merged_pieces: one dQ piece a consumer only")
    return None, [dataclasses.replace(
        config, **dkdv_options, deferred_dq=bool(deferred_dq),
        stage_free_on_read=bool(stage_free_on_read),
        merged_pieces=bool(merged_pieces), hw_ds_sync=bool(hw_ds_sync))
        for config in fused_configs]
  if deferred_dq or stage_free_on_read or merged_pieces or hw_ds_sync:
    raise NotImplementedError(
        "deferred_dq, stage_free_on_read, merged_pieces and hw_ds_sync: the "
        "fused dQ only")
  if early_delta and shared_rows:
    raise NotImplementedError(
        "early_delta: the plain and fused dK/dV consumers only (not shared "
        "rows)")
  if opaque_resident and (shared_rows or tiles.get("spec") is not None):
    raise NotImplementedError(
        "opaque_resident: the plain dK/dV consumers only (not shared rows, "
        "not the ranged kernel)")
  dq_tiles_args = tiles if dq_tiles is None else dict(
      tiles, block_q=dq_tiles[0], block_kv=dq_tiles[1])
  dq_config = dataclasses.replace(
      dq_static(query, key, shared_rows=shared_q_rows, **dq_tiles_args),
      heavy_first=bool(heavy_first), **options)
  dkdv_configs = [dataclasses.replace(config, **dkdv_options,
                                      scores_ahead=bool(scores_ahead))
                  for config in dkdv_statics(
                      query, key, shared_rows=shared_rows,
                      opaque_resident=opaque_resident, **tiles)]
  for config in dkdv_configs if scores_ahead else ():
    if config.outputs != ("dk", "dv"):
      raise NotImplementedError(
          "scores_ahead: where dK and dV take one pass (not at head_dim "
          f"{config.head_dim} with block_q {config.block_q})")
  if persistent:
    batch, _, num_heads, _ = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    dq_config = _persistent(
        dq_config, num_ctas, num_heads=num_heads, batch=batch,
        tiles_per_head=pl.cdiv(query.shape[1], dq_config.q_rows_per_cta))
    dkdv_configs = [_persistent(
        config, num_ctas, num_heads=num_kv_heads, batch=batch,
        tiles_per_head=pl.cdiv(kv_len, config.kv_rows_per_cta))
                    for config in dkdv_configs]
  return dq_config, dkdv_configs


def _why_not_ahead(*, fused_dq, shared_rows, spec, prefetch_stats,
                   early_delta, opaque_resident, overlap_softmax,
                   max_concurrent_steps) -> str:
  """Why `scores_ahead` cannot serve these options, or "" (the one list:
  an explicit request raises with it, the default stays off)."""
  for refused, why in (
      (fused_dq, "not with the fused dQ"),
      (shared_rows, "not with shared rows"),
      (spec is not None, "not in the ranged (masked) kernel"),
      (prefetch_stats or early_delta,
       "not with prefetch_stats or early_delta (it reads lse and delta "
       "where its own schedule puts them)"),
      (opaque_resident, "not with opaque_resident"),
      (not overlap_softmax,
       "not without overlap_softmax (its walk always overlaps)"),
      (max_concurrent_steps < 2,
       "a ring of two stages or more (the next step's Q tile must arrive "
       "while this step's is held)")):
    if refused:
      return why
  return ""


def dq_static(query, key, *, scale, is_causal, block_q, block_kv,
              max_concurrent_steps, spec=None,
              shared_rows: bool = False) -> _Static:
  """The dQ kernel's configuration (`spec`: the ranged form's mask spec;
  `shared_rows`: `_Static.shared_rows`)."""
  if shared_rows:
    return _shared_rows_static(
        query, key, scale=scale, is_causal=is_causal, block_q=block_q,
        block_kv=block_kv, max_concurrent_steps=max_concurrent_steps,
        spec=spec, kernel="dq")
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
      scale_log2=float(scale) * _LOG2E, is_causal=bool(is_causal),
      dtype=jnp.dtype(query.dtype), outputs=("dq",), spec=spec)


def dkdv_statics(query, key, *, scale, is_causal, block_q, block_kv,
                 max_concurrent_steps, spec=None,
                 fused_dq: bool = False,
                 shared_rows: bool = False,
                 opaque_resident: bool = False,
                 deferred_dq: bool = False) -> list[_Static]:
  """One pass computing dK and dV, or one pass each if registers demand;
  `fused_dq`: the one pass that also sums dQ (raises where there is none);
  `shared_rows`: the one pass with shared K/V rows (likewise);
  `opaque_resident`: with the shared memory of its zero's cell (raises
  where it would cost a consumer); `deferred_dq`: with its two barriers
  (16 bytes, which every fused form has room for).
  """
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
  if opaque_resident and smem_of(consumers) + _ZERO_CELL_BYTES > (
      _SMEM_LIMIT_BYTES):
    raise NotImplementedError(
        f"opaque_resident: no shared memory left for its zero's cell with "
        f"block_q {block_q}, block_kv {block_kv} at head_dim {head_dim}")
  if fused_dq and (_dq_pieces(block_q, head_dim) % consumers
                   or block_kv % _DQ_PIECE):
    raise NotImplementedError(
        f"the fused dQ shares the [{block_q}, {head_dim}] dQ tile among "
        f"{consumers} consumers in [{_DQ_PIECE}, {_DQ_PIECE}] pieces and "
        f"needs block_kv a multiple of {_DQ_PIECE} (got {block_kv}): "
        f"the pieces must share out evenly")
  return [
      _Static(block_q=block_q, block_kv=block_kv, num_consumers=consumers,
              num_stages=stages, num_q_blocks=num_q_blocks,
              num_kv_blocks=pl.cdiv(kv_len, block_kv), head_dim=head_dim,
              group=group, scale=float(scale),
              scale_log2=float(scale) * _LOG2E, is_causal=bool(is_causal),
              dtype=jnp.dtype(query.dtype), outputs=outputs, spec=spec,
              fused_dq=bool(fused_dq))
      for outputs in passes]


def _shared_rows_static(query, key, *, scale, is_causal, block_q, block_kv,
                        max_concurrent_steps, spec=None,
                        kernel: str = "dkdv") -> _Static:
  """A kernel with shared rows (`_Static.shared_rows`), `kernel` "dkdv" or
  "dq": two consumers on one resident copy of the CTA's rows (K/V or Q/dO,
  in column parts), each with its column part of the outputs and its part
  of the streamed rows' scores; the ring as usual; the score parts
  exchanged (Pᵀ and dSᵀ, or dS)."""
  _, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  consumers = _MAX_CONSUMERS
  itemsize = jnp.dtype(query.dtype).itemsize
  dkdv = kernel == "dkdv"
  resident, streamed = (block_kv, block_q) if dkdv else (block_q, block_kv)
  resident_len = kv_len if dkdv else q_len
  streamed_part, d_part = streamed // consumers, head_dim // consumers
  what = f"shared {'K/V' if dkdv else 'Q'} rows"
  if spec is not None:
    raise NotImplementedError(f"the ranged backward has no {what}")
  if streamed_part * itemsize not in _EXCHANGE_SWIZZLES or d_part % 64:
    raise NotImplementedError(
        f"{what} split the {streamed} streamed rows and head_dim {head_dim} "
        f"between {consumers} consumers: each part of the exchanged scores "
        f"must be a swizzle row ({_EXCHANGE_SWIZZLES} bytes) and each part "
        f"of the columns whole 64-column tiles")
  if resident_len % resident:
    raise NotImplementedError(
        f"{'kv_len' if dkdv else 'q_len'} {resident_len} must be a multiple "
        f"of {'block_kv' if dkdv else 'block_q'} {resident} ({what})")
  outputs = ("dk", "dv") if dkdv else ("dq",)
  scores = (resident, streamed_part)
  registers = _accumulator_registers(
      *[(resident, d_part)] * len(outputs), scores, scores)
  if registers > _ACCUMULATOR_REGISTERS:
    raise NotImplementedError(
        f"{what} with block_q {block_q}, block_kv {block_kv} at head_dim "
        f"{head_dim} need {registers} accumulator registers per thread; at "
        f"most {_ACCUMULATOR_REGISTERS} fit")
  group = num_heads // num_kv_heads
  num_q_blocks = pl.cdiv(q_len, block_q)
  num_kv_blocks = pl.cdiv(kv_len, block_kv)
  steps = group * num_q_blocks if dkdv else num_kv_blocks
  stages = min(max_concurrent_steps, steps)
  smem = _smem_bytes(
      num_consumers=1, num_stages=stages, resident_rows=resident,
      streamed_rows=streamed, head_dim=head_dim, itemsize=itemsize,
      resident_stats=0 if dkdv else consumers * block_q,  # a copy each
      streamed_stats=block_q if dkdv else 0) + (
          len(outputs) * resident * streamed * itemsize)  # the exchange
  check_shared_memory(
      smem, _SMEM_LIMIT_BYTES,
      f"{what} with block_q {block_q}, block_kv {block_kv} at head_dim "
      f"{head_dim}")
  return _Static(block_q=block_q, block_kv=block_kv, num_consumers=consumers,
                 num_stages=stages, num_q_blocks=num_q_blocks,
                 num_kv_blocks=num_kv_blocks, head_dim=head_dim, group=group,
                 scale=float(scale), scale_log2=float(scale) * _LOG2E,
                 is_causal=bool(is_causal), dtype=jnp.dtype(query.dtype),
                 outputs=outputs, shared_rows=True)


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
# The hardware barrier of `_Static.hw_ds_sync`.
_DS_STORED_BARRIER = 9


def _dq_pieces(block_q: int, head_dim: int) -> int:
  """[_DQ_PIECE, _DQ_PIECE] pieces of a [block_q, head_dim] dQ tile."""
  return pl.cdiv(block_q, _DQ_PIECE) * pl.cdiv(head_dim, _DQ_PIECE)


def _tile_transforms(dtype):
  """128-byte swizzle with 8-row tiles: what TMA writes and wgmma reads
  without bank conflicts."""
  swizzle_elems = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)),
          plgpu.SwizzleTransform(_SWIZZLE_BYTES))


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
    )
    if static.deferred_dq:
      scratch += (plgpu.Barrier(num_arrivals=consumers, num_barriers=2),)  # ds_read
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
                     ds_read=scratch[16] if static.deferred_dq else None)

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
    if static.scores_ahead and not static.is_causal:
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
                           static.num_consumers * _THREADS_PER_WARPGROUP)
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
  stages consumer `wg`'s pieces of the CTA's dS K for the Q tile
  (`_stage_dq`), and the walk's positions are Q tiles `q_of(position)`.
  `resident` (`_Static.opaque_resident`): called each step, returns that
  step's views of the K and V rows and the zero that offsets them.
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
    # the ring when the step needs it, or up front (`prefetch_stats`: then
    # `prefetched` holds them, delta only when dK is an output).
    column_stat = functools.partial(_column_stat, stats_ring, slot)
    prefetched = {}
    if static.prefetch_stats:  # see `_Static.prefetch_stats`
      prefetched = {n: column_stat(n)
                    for n in range(1 + ("dk" in static.outputs))}
    elif static.prefetch_lse:
      prefetched = {0: column_stat(0)}

    read_delta_early = (static.early_delta and "dk" in static.outputs
                        and 1 not in prefetched)

    def probabilities(s_t):
      """(Pᵀ, its slope, delta if `early_delta` reads it here, or None)."""
      lse_log2 = prefetched[0] if 0 in prefetched else column_stat(0)
      delta = column_stat(1) if read_delta_early else None  # for dS, after P
      p_t, slope = _probabilities(s_t, lse_log2, _cols, walk.values, static)
      if masked:
        p_t = jnp.where(tile_mask(q_block, slot), p_t, 0.0)
      return p_t, slope, delta

    store_ds = None
    if fused is not None:  # this step's dSᵀ, for every consumer to read
      ds_smem = fused.ds.at[lax.rem(step, 2), wg]

      def store_ds(ds_t):
        if static.deferred_dq:  # every consumer's pieces of step - 2 read it
          pl.when(step >= 2)(functools.partial(
              plgpu.barrier_wait, fused.ds_read.at[lax.rem(step, 2)]))
        ds_smem[...] = ds_t
    shape = (static.block_kv, static.block_q)
    if static.overlap_softmax:
      (p_t, slope, delta), *dp_t = _wgmma_then(shape, products,
                                               probabilities)
      piece = None
      if fused is not None and static.merged_pieces:
        piece = functools.partial(_issue_merged_piece, fused, wg, step=step,
                                  static=static, offset=offset)
      grads = _dkdv_accumulate_overlapped(
          grads, p_t, dp_t, slope, q_tile, do_tile, stats_ring.at[slot],
          static, store_ds=store_ds,
          delta=prefetched.get(1, delta), piece=piece)
      plgpu.barrier_arrive(consumed.at[slot])
      if piece is not None:
        *grads, piece_value = grads
        _stage_merged_piece(fused, wg, piece_value, step=step)
        return tuple(grads)
      return finish(grads, step, offset)
    s_t, *dp_t = _wgmma_fresh(shape, products)
    p_t, slope, delta = probabilities(s_t)
    updates = []
    for name in static.outputs:
      if name == "dv":
        updates.append((p_t.astype(static.dtype), do_tile))  # dV += Pᵀ dO
      else:
        if delta is None:
          delta = prefetched[1] if 1 in prefetched else column_stat(1)
        ds_t = _score_gradient(p_t, dp_t[0], _cols(delta, s_t.shape), slope)
        ds_t = ds_t.astype(static.dtype)
        updates.append((ds_t, q_tile))  # dK += dSᵀ Q
        if store_ds is not None:
          store_ds(ds_t)
    grads = _wgmma_accumulate(grads, updates)
    plgpu.barrier_arrive(consumed.at[slot])
    return finish(grads, step, offset)

  def finish(grads, step, offset):
    if fused is not None:
      _stage_dq(fused, wg, step=step, static=static, offset=offset)
    return grads

  unmasked_run = None
  if static.scores_ahead:  # causal: each unmasked run a step ahead
    def unmasked_run(start, stop, grads, *, head_base):
      ahead = functools.partial(
          _dkdv_consume_ahead, k_smem, v_smem, q_ring, do_ring, stats_ring,
          arrived, consumed, num_steps=stop - start, static=static,
          slot_of=lambda i: slot_of(head_base + start + i), scaled=False)
      # A K/V tile's last rows may see no unmasked Q tile.
      return lax.cond(stop > start, lambda grads: ahead(grads=grads),
                      lambda grads: grads, grads)
  grads = _walk_group(walk, step_body, arrived, consumed, slot_of, static,
                      grads, unmasked_run=unmasked_run)
  if fused is not None and static.deferred_dq:  # the last step's pieces
    last = static.group * walk.num_blocks - 1 - walk.first
    offset = 0 if resident is None else resident()[2]
    pl.when(last >= 0)(functools.partial(
        _stage_dq_pieces, fused, wg, step=last, static=static, offset=offset))
  return tuple(grad * static.scale if name == "dk" else grad
               for name, grad in zip(static.outputs, grads))


def _dkdv_consume_ahead(k_rows, v_rows, q_ring, do_ring, stats_ring,
                        arrived, consumed, *, num_steps, slot_of,
                        static: _Static, grads=None, scaled: bool = True):
  """Consumer: (dK, dV), f32, of its `block_kv` K/V rows over `num_steps`
  unmasked steps (step i in ring slot `slot_of(i)`), each step's Sᵀ issued
  before the step before has seen its dK done (`_Static.scores_ahead`,
  `_walk_scores_ahead`), added to `grads` ((dK, dV) so far; None: zeros).
  dK is scaled (`scaled`) or, for a part of a walk, not.

  A step's products are Sᵀ = K Qᵀ and dPᵀ = V dOᵀ ([block_kv, block_q]),
  then dV += Pᵀ dO and dK += dSᵀ Q. The arithmetic is `_dkdv_consume`'s
  (overlapped) to the bit: lse is read once Sᵀ is done (before it, with
  `prefetch_lse`), delta once dV is issued.
  """
  column_stat = functools.partial(_column_stat, stats_ring)

  def with_accumulators(s_ref, dp_ref, dk_ref, dv_ref):
    if grads is not None:  # the walk's sums so far (the refs start at zero)
      dk_ref[...], dv_ref[...] = grads

    def products(slot):
      return ((k_rows, q_ring.at[slot].transpose((1, 0))),
              (v_rows, do_ring.at[slot].transpose((1, 0))))

    def probabilities(slot, wait_scores):
      lse_log2 = column_stat(slot, 0) if static.prefetch_lse else None
      s_t = wait_scores()
      if lse_log2 is None:
        lse_log2 = column_stat(slot, 0)
      return _probabilities(s_t, lse_log2, _cols, None, static)[0]

    def gradients(slot, p_t, dp_t):
      plgpu.wgmma(dv_ref, p_t.astype(static.dtype), do_ring.at[slot])
      delta = column_stat(slot, 1)
      ds_t = _score_gradient(p_t, dp_t, _cols(delta, p_t.shape), None)
      plgpu.wgmma(dk_ref, ds_t.astype(static.dtype), q_ring.at[slot])

    _walk_scores_ahead(s_ref, dp_ref, num_steps=num_steps, arrived=arrived,
                       consumed=consumed, slot_of=slot_of, products=products,
                       probabilities=probabilities, gradients=gradients)
    dk = plgpu.wgmma_accumulator_load(dk_ref, wait_n=0)
    return (dk * static.scale if scaled else dk,
            plgpu.wgmma_accumulator_load(dv_ref, wait_n=0))

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
                static: _Static, grads, unmasked_run=None):
  """A dK/dV consumer's walk: for each query head of the group, the runs
  of `walk`, skipped steps released at once, the others
  `step_body(i, grads, head_base=, masked=)`; step of walk position i of
  query head g is head_base + i. `unmasked_run(start, stop, grads,
  head_base=)`, if given, takes each unmasked run whole instead."""
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
    if unmasked_run is None:
      return _walk_runs(walk.runs, bodies, grads)
    whole = {_UNMASKED: functools.partial(unmasked_run, head_base=head_base)}
    return _walk_runs(walk.runs, bodies, grads, whole=whole)

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
    lse_log2 = delta = None
    if static.prefetch_stats:  # see `_Static.prefetch_stats`
      lse_log2, delta = column_stats(stats, 0), column_stats(stats, 1)
    elif static.prefetch_lse:
      lse_log2 = column_stats(stats, 0)

    def probabilities(s_t):
      lse = column_stats(stats, 0) if lse_log2 is None else lse_log2
      p_t, _ = _probabilities(s_t, lse, _cols, None, static)
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
    if delta is None:
      delta = column_stats(stats, 1)
    ds_t = _score_gradient(p_t, dp_t, _cols(delta, shape), None)
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


def _stage_dq(fused: _FusedDq, wg, *, step, static: _Static, offset=0):
  """Consumer wg, after storing its dSᵀ of `step` in `fused.ds`: says so,
  then computes its pieces of the CTA's dS K for `step` (deferred: for the
  step before, and the last step's after the walk, `_stage_dq_pieces`).
  `offset`: a zero the K rows are indexed by (`_Static.opaque_resident`)."""
  parity = lax.rem(step, 2)
  plgpu.commit_smem()  # this consumer's dSᵀ, read by every consumer's wgmma
  if static.hw_ds_sync:  # every consumer's dSᵀ of `step` is stored after it
    compat.named_barrier("sync", _DS_STORED_BARRIER,
                         static.num_consumers * _THREADS_PER_WARPGROUP)
  else:
    plgpu.barrier_arrive(fused.ds_stored.at[parity])
  if not static.deferred_dq:
    _stage_dq_pieces(fused, wg, step=step, static=static, offset=offset,
                     parity=parity, stored=static.hw_ds_sync)
    return
  pl.when(step >= 1)(functools.partial(
      _stage_dq_pieces, fused, wg, step=step - 1, static=static,
      offset=offset))


def _stage_dq_pieces(fused: _FusedDq, wg, *, step, static: _Static,
                     offset=0, parity=None, stored: bool = False):
  """Consumer wg's pieces of the CTA's dS K for `step` (`parity`: step's,
  if computed), once every consumer stored its dSᵀ of `step` (waited for
  here unless `stored`): computed and staged for the writer."""
  if parity is None:
    parity = lax.rem(step, 2)
  if not stored:
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
  if fused.ds_read is not None:  # the pieces' wgmmas are done with dSᵀ
    plgpu.barrier_arrive(fused.ds_read.at[parity])


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
    if static.stage_free_on_read:
      # This step's stage has been read: free it (but for the last step's,
      # which no consumer waits for: as many arrivals as the default
      # path's, the last of them unwaited for too). Then,
      # once the previous step's adds are in memory, hand its Q tile on.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      pl.when(step < num_steps - 1)(functools.partial(
          plgpu.barrier_arrive, fused.stage_free.at[parity]))
      plgpu.wait_smem_to_gmem(1, wait_read_only=False)
      pl.when(step > 0)(functools.partial(hand_on, handed))
      return turn
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
                                delta=None, piece=None):
  """`grads` (in `static.outputs` order) plus this step's dV += Pᵀ dO and
  dK += dSᵀ Q, with dV's wgmma issued first, so that dS is computed while
  it runs. `dp_t` is [dPᵀ] when dK is an output, else []; `stats` is the
  step's [2, block_q] (lse, delta) slot, whose delta is read here unless
  given (`delta`, prefetched); `store_ds` (fused dQ) takes dSᵀ while
  dK's wgmma runs. `piece(acc_ref)` (`_Static.merged_pieces`) issues a
  [_DQ_PIECE, _DQ_PIECE] product after them, into a fresh accumulator
  returned after the gradients, all waited for at once."""
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
      step_delta = delta
      if step_delta is None:
        step_delta = plgpu.layout_cast(stats[1], plgpu.Layout.WGMMA.reduce(0))
      ds_t = _score_gradient(p_t, dp_t[0], _cols(step_delta, p_t.shape), slope)
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
  (8fbd8ee, results/h200_mosaic_mask_form_s25.md), so this form stays."""
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
  resident_shape = (consumers, static.block_q, head_dim)
  if static.shared_rows:  # as in `launch_dkdv`
    resident_shape = (consumers, static.block_q, head_dim // consumers)
    transforms = _exchange_transforms(static.dtype,
                                      static.block_kv // consumers)
  resident = plgpu.SMEM(resident_shape, static.dtype, transforms=transforms)
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
  if static.shared_rows:
    scratch += _exchange_scratch(static, static.block_q,
                                 static.block_kv // consumers, kinds=1)
  return compat.vary_like(plgpu.kernel(
      functools.partial(_dq_kernel, static=static),
      out_type=versions.output_struct(query.shape, query.dtype, *inputs),
      scratch_types=scratch,
      # Launched batch fastest, q_tile slowest (Pallas reverses the grid).
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
          static.heavy_first and static.is_causal and not static.ranged))
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

  def _shared_consumer(c: int):
    q_rows = pl.ds(tile_start, static.block_q)
    columns = _column_part(c, static)
    # Its own copy of the rows' statistics; Q and dO in parts (persistent:
    # once its own dQ part has left through Q's).
    plgpu.copy_gmem_to_smem(stats_ref.at[batch, head, :, q_rows],
                            stats_smem.at[c], stats_arrived.at[c])
    _load_column_parts(c, ((q_ref, q_smem, q_arrived),
                           (do_ref, do_smem, do_arrived)),
                       batch=batch, rows=q_rows, head=head, static=static)
    plgpu.barrier_wait(stats_arrived.at[c])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    lse_log2 = plgpu.layout_cast(stats_smem[c, 0], row_layout)
    delta = plgpu.layout_cast(stats_smem[c, 1], row_layout)
    walk = _Walk(0, num_steps, _dq_causal_runs(tile_start, num_steps, static),
                 None)
    dq = _dq_consume_shared(c, q_smem, do_smem, lse_log2, delta, k_ring,
                            v_ring, arrived, consumed, scratch[11:],
                            walk=walk, q_start=tile_start, static=static,
                            base=base)
    # Every consumer is past its last step: Q is dead, and each part of dQ
    # goes out through its part of Q.
    q_smem[c] = dq.astype(static.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem.at[c], dq_ref.at[batch, q_rows, head,
                                                    columns])
    plgpu.wait_smem_to_gmem(0, wait_read_only=base is not None)

  def _consumer():
    if static.shared_rows:  # static consumer numbers: static column slices
      for c in range(static.num_consumers):
        pl.when(wg == c)(functools.partial(_shared_consumer, c))
      return
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
      tile_mask = lambda step, slot: _causal_mask(q_start, step, static)
    else:
      walk = _ranged_walk(plan, wg)
      own_ids = _own_ids(ids, q_rows, wg)
      shape = (static.block_q, static.block_kv)
      tile_mask = lambda step, slot: _variant_mask(
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
      p, slope = _probabilities(s, lse_log2, _rows, walk.values, static)
      if masked:
        p = jnp.where(tile_mask(step, slot), p, 0.0)
      return p, slope

    shape = (static.block_q, static.block_kv)
    if static.overlap_softmax:
      (p, slope), dp = _wgmma_then(shape, products, probabilities)
    else:
      s, dp = _wgmma_fresh(shape, products)
      p, slope = probabilities(s)
    ds = _score_gradient(p, dp, _rows(delta, p.shape), slope)
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


def _dq_consume_shared(c: int, q_smem, do_smem, lse_log2, delta, k_ring,
                       v_ring, arrived, consumed, exchange_refs, *,
                       walk: _Walk, q_start, static: _Static, base=None):
  """Consumer c of a dQ tile with shared Q rows (`_Static.shared_rows`):
  its columns d_c of dQ (f32, scaled), [block_q, head_dim / n].

  Q and dO are resident in column parts p; per step, with K/V rows r_c
  (its part of the step's K/V tile):
    S_c = Σ_p Q_p K[r_c, d_p]ᵀ, dP_c = Σ_p dO_p V[r_c, d_p]ᵀ
    dS_c into the exchange; wait for every consumer's
    dQ[:, d_c] += Σ_k dS_k K[r_k, d_c]
  `exchange_refs`: the `_exchange_scratch` of dS's [block_q, block_kv / n]
  parts.
  """
  consumers = static.num_consumers
  exchange = _Exchange.of(exchange_refs, kinds=1, consumers=consumers)
  (ds_parts,) = exchange.parts
  kv_part = static.block_kv // consumers
  rows = lambda k: pl.ds(k * kv_part, kv_part)
  columns = _column_part(c, static)
  shape = (static.block_q, kv_part)
  dq = plgpu.layout_cast(
      jnp.zeros((static.block_q, static.head_dim // consumers), jnp.float32),
      plgpu.Layout.WGMMA)
  slot_of = _ring_slot(static, base)

  def step_body(step, dq, *, masked):
    slot = slot_of(step)
    for barrier in arrived:
      plgpu.barrier_wait(barrier.at[slot])
    k_tile, v_tile = k_ring.at[slot], v_ring.at[slot]
    products = [[(smem.at[p], tile.at[rows(c), _column_part(p, static)]
                  .transpose((1, 0))) for p in range(consumers)]
                for smem, tile in ((q_smem, k_tile), (do_smem, v_tile))]

    def probabilities(s):
      p, _ = _probabilities(s, lse_log2, _rows, None, static)
      if masked:
        p = jnp.where(_causal_mask(q_start, step, static,
                                   kv_offset=c * kv_part, shape=shape),
                      p, 0.0)
      return p

    if static.overlap_softmax:
      p, dp = _wgmma_then(shape, products, probabilities)
    else:
      s, dp = _wgmma_fresh(shape, products)
      p = probabilities(s)
    ds = _score_gradient(p, dp, _rows(delta, shape), None)
    exchange.put(c, [ds], static.dtype)
    (dq,) = _wgmma_accumulate_sums((dq,), [
        [(ds_parts[k], k_tile.at[rows(k), columns]) for k in range(consumers)]])
    plgpu.barrier_arrive(consumed.at[slot])
    exchange.release()
    return dq

  def skip_body(step, dq):
    _skip_step(arrived, consumed, slot_of(step))
    return dq

  exchange.begin()
  dq = _walk_runs(walk.runs, {
      _SKIP: skip_body, _UNMASKED: functools.partial(step_body, masked=False),
      _MASKED: functools.partial(step_body, masked=True)}, dq)
  exchange.end()
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


def _walk_runs(runs, bodies, carry, whole=None):
  """Runs `bodies[kind]` over each (start, stop, kind) run, in order; a
  kind in `whole` takes its run at once, `whole[kind](start, stop,
  carry)`."""
  for start, stop, kind in runs:
    if whole and kind in whole:
      carry = whole[kind](start, stop, carry)
    else:
      carry = lax.fori_loop(start, stop, bodies[kind], carry)
  return carry


def _ranged_walk(plan: _Plan, slot, *, consumer: bool = True) -> _Walk:
  """Reads the CTA's plan row (see `masked.tile_plans`) into `slot`.

  A consumer (`slot` = its warpgroup) walks the union [first, total) in five
  runs: skips before its range [lo, hi), the masked edge up to the run of
  full tiles [unmasked_lo, unmasked_hi), that run, the other masked edge,
  skips after. All of them, in every consumer, so that every ring barrier
  goes through the same phases in every thread. The producer (`consumer`
  False) needs only the union.
  """
  read = _read_plan(plan, slot)
  first, total = read(_PLAN_UNION), read(_PLAN_UNION + 1)
  if not consumer:
    return _Walk(first, total - first, (), None)
  lo, unmasked_lo, unmasked_hi, hi = (read(slot * 4 + i) for i in range(4))
  runs = ((first, lo, _SKIP), (lo, unmasked_lo, _MASKED),
          (unmasked_lo, unmasked_hi, _UNMASKED), (unmasked_hi, hi, _MASKED),
          (hi, total, _SKIP))
  values = masking.MaskValues(q_offset=read(_PLAN_SCALARS),
                              q_lengths=read(_PLAN_SCALARS + 1),
                              kv_lengths=read(_PLAN_SCALARS + 2))
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
  plan = _Plan(inputs[0].at[batch, tile], *scratch[:2])
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
  rows, cols = _rows(own_ids, shape), _cols(streamed, shape)
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
  return jnp.exp2(logits * _LOG2E - broadcast(lse_log2, s.shape)), slope


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
