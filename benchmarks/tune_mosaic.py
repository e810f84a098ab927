"""Sweeps the Mosaic GPU kernels' tiles and pipeline depth; prints the best.

    python -m benchmarks.tune_mosaic   # -> results/h200_mosaic_sweep.json
    python -m benchmarks.tune_mosaic --render a.json   # -> a.md: its tables
    python -m benchmarks.tune_mosaic --render a.json b.json ab.json  # merged

At seq 4096 (`--seq`), batch·seq = 16384, hidden 2048, bf16, for head_dim
64, 128 and 256, causal and not: every (block_q, block_kv,
max_concurrent_steps) of `FORWARD_SPACE` for `mosaic_forward` (timing the
forward) and of `BACKWARD_SPACE` for `mosaic_backward` (timing the backward
alone, on residuals from one forward). A candidate the kernel refuses (too
much shared memory or too many registers: NotImplementedError) is recorded
with its reason. A cell's candidates are compiled first, then timed one
at a time, so nothing else runs on the GPU while one is timed; with
`--rounds N` they are timed N times in turn (A, B, B, A, ...), each keeping
the median of its rounds, since the GPU's clocks drift between candidates
timed one after another (single A/Bs of a few % flipped sign between
runs). The best per (kernel, head_dim) is the best geometric mean of its
causal and non-causal TFLOP/s.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import statistics
import sys
import time
from unittest import mock

import jax

from benchmarks import common, render
from pallas_kernels import compat

FORWARD_SPACE = dict(block_q=(64, 128), block_kv=(64, 128, 192),
                     max_concurrent_steps=(2, 3, 4))
BACKWARD_SPACE = dict(block_q=(64, 128), block_kv=(64, 128),
                      max_concurrent_steps=(2, 3))
# Causal launch order (`forward.tile_index`), default tiles: an A/B in one
# process, since the predicted gain (a few %) is run-to-run noise otherwise.
ORDER_SPACE = dict(heavy_first=(False, True))
# The forward's order is the launch grid's (the persistent one pairs tiles).
FORWARD_ORDER_SPACE = dict(heavy_first=(False, True), persistent=(False,))
# Consumer schedule variants of the forward (`forward.KernelStatic`), default
# tiles: an A/B of the same kind.
SCHEDULE_SPACE = dict(fence_softmax=(False, True), split_handover=(False, True))
# The forward's intra-warpgroup overlap (`forward.KernelStatic`).
# O rescaled every step on both sides: `overlap_scores` has no lazy form.
FORWARD_OVERLAP_SPACE = dict(overlap_scores=(False, True), lazy_rescale=(False,))
# The backward's overlap within a consumer (`backward._Static`).
OVERLAP_SPACE = dict(overlap_softmax=(False, True))
# The persistent grids (`forward.persistent_static`, `backward._persistent`).
PERSISTENT_SPACE = dict(persistent=(False, True))
# Launch grid order: tile slowest (the default) or fastest
# (`forward.KernelStatic.tile_fastest`, `backward._Static.tile_fastest`).
LAUNCH_SPACE = dict(tile_fastest=(False, True), persistent=(False,))
# The persistent backward with head_dim 64's 128-row Q tiles.
PERSISTENT_WIDE_SPACE = dict(persistent=(False, True), block_q=(128,))
# The fused dQ (`backward._Static.fused_dq`) against the two kernels, on the
# launch grid, with both Q tile heights (head_dim 64 ships 128 rows).
FUSED_SPACE = dict(fused_dq=(False, True), block_q=(64, 128),
                   persistent=(False,))
# Three consumer warpgroups against two (`forward.KernelStatic.num_consumers`),
# with both K/V tile heights, on the default grid (persistent where it is
# the default).
CONSUMERS_SPACE = dict(num_consumers=(2, 3), block_kv=(64, 128))
# How the consumers take turns (`forward.KernelStatic.ring_turns`,
# `hw_turns`), with the default consumers (three at d=64, always a ring).
TURNS_SPACE = dict(ring_turns=(False, True), hw_turns=(False, True))
# Shared K/V rows in the dK/dV kernel (`backward._Static.shared_rows`), on
# either grid; and shared Q rows in the dQ kernel with them.
SHARED_SPACE = dict(shared_rows=(False, True), persistent=(False, True))
SHARED_Q_SPACE = dict(shared_rows=(True,), shared_q_rows=(False, True),
                      persistent=(False,))
# The dK/dV kernel's row statistics read before its matmuls
# (`backward._Static.prefetch_stats`), default grid.
PREFETCH_SPACE = dict(prefetch_stats=(False, True))
# The backward's Q tile height (head_dim 64 ships 128 rows,
# `attention.backward_tiles`), each with its defaults (64 rows: prefetched
# row statistics; 128 rows at 16k: the fused dQ until session 24).
WIDE_Q_SPACE = dict(block_q=(64, 128))
# Resident tiles' descriptors recomputed each step
# (`backward._Static.opaque_resident`), in the two kernels and fused.
OPAQUE_SPACE = dict(fused_dq=(False, True), opaque_resident=(False, True),
                    persistent=(False,))
# The fused dQ's pieces a step later (`backward._Static.deferred_dq`),
# against the fused kernel and the two kernels.
DEFERRED_SPACE = dict(fused_dq=(False, True), deferred_dq=(False, True),
                      persistent=(False,), merged_pieces=(False,))
# The same at head_dim 64's 128-row Q tiles (the fused dQ's there), fused.
DEFERRED_WIDE_SPACE = dict(fused_dq=(True,), deferred_dq=(False, True),
                           block_q=(128,), persistent=(False,))
# Both backward kernels' launch order at seq 16k, where the default may be
# the fused dQ (which has its own order): the two kernels in either order,
# and the default (`backward.configure`).
TILE_ORDER_CANDIDATES = [dict(persistent=False, fused_dq=False,
                              tile_fastest=False),
                         dict(persistent=False, fused_dq=False,
                              tile_fastest=True),
                         dict()]
# The fused dQ against the two kernels launched tile-fastest.
FUSED_ORDER_CANDIDATES = [dict(persistent=False, fused_dq=False,
                               tile_fastest=True),
                          dict(persistent=False, fused_dq=True)]
# The forward's default grid against the launch grid launched tile-fastest
# (sessions 12 and 13; since then the second is the default for causal d=128
# from 16k and d=256 above 4k, so `{}` there runs it too).
FORWARD_TILE_ORDER_CANDIDATES = [dict(), dict(persistent=False,
                                              tile_fastest=True)]
# head_dim 256's forward with 128-row K/V tiles in one stage (K and V
# refilled apart, each as soon as both consumers are done with it) against
# its default 64-row tiles in two: S = Q Kᵀ at N=128 reads 96 KB of shared
# memory per 64x128x256 product where N=64 reads 64 KB per half as much work.
# Measured in session 13 (results/h200_mosaic_one_stage.md): 29-31% slower
# at 1k-16k; the one stage leaves each K and V load exposed. Session 15
# (results/h200_mosaic_forward_wide_kv.md, run as `forward_wide_kv` at
# 46ebeea) added the consumers at 240 registers, which the N=128 S needs,
# per cell: +1.9% at 4k without a mask, -9.6% to -22.6% in the other
# five; at d=128 one stage of 128-row tiles -0.3% to -8.6%, of 256-row
# tiles -9.5% to -26.2%.
FORWARD_ONE_STAGE_CANDIDATES = [dict(c, sum_after_pv=False, lazy_rescale=False)
                                for c in (
    dict(), dict(block_kv=128, max_concurrent_steps=1, lean_producer=False),
    dict(block_kv=128, max_concurrent_steps=1, lean_producer=True),
    dict(block_kv=256, max_concurrent_steps=1, lean_producer=True))]
# Session 14's two from the fused dQ's stall samples at d=128 4k: the
# writer freeing each stage of dQ pieces once read
# (`backward._Static.stage_free_on_read`), and lse read before the matmuls
# (`backward._Static.prefetch_lse`), fused, against the two kernels as
# they are (the default at 4k) and with lse read early too.
# (Pinned as they ran in session 14: no merged pieces, no lean producers.)
FUSED_STALLS_CANDIDATES = [
    dict(fused_dq=True, persistent=False, merged_pieces=False),
    dict(fused_dq=True, persistent=False, stage_free_on_read=True,
         merged_pieces=False),
    dict(fused_dq=True, persistent=False, stage_free_on_read=True,
         prefetch_lse=True, merged_pieces=False),
    dict(fused_dq=False, persistent=False, lean_producer=False),
    dict(fused_dq=False, persistent=False, prefetch_lse=True,
         lean_producer=False)]
# lse read early in the two kernels' dK/dV kernel (`backward._Static.
# prefetch_lse`), wherever the fused kernel is not the question.
PREFETCH_LSE_SPACE = dict(prefetch_lse=(False, True), fused_dq=(False,))
# delta read early as well (`backward._Static.early_delta`: before P's
# exponentials; `prefetch_stats`: before the matmuls, with lse), against
# the default two kernels at d=128 without a mask (lse early).
# With the consumers at 240 registers and the producer at 24
# (`lean_producer`), which gives delta (and lse) read early their room.
DELTA_CANDIDATES = [
    dict(fused_dq=False, lean_producer=False),
    dict(fused_dq=False, early_delta=True, lean_producer=False),
    dict(fused_dq=False, lean_producer=True),
    dict(fused_dq=False, lean_producer=True, early_delta=True),
    dict(fused_dq=False, prefetch_lse=False, prefetch_stats=True,
         lean_producer=False)]
# The fused dQ's piece issued with the next step's dV and dK
# (`backward._Static.merged_pieces`) against the fused kernel without it
# and the two kernels (the default at d=128); at d=64's 128-row Q tiles
# (`backward_merged_wide`) against the fused kernel as shipped there (not
# deferred) and deferred.
MERGED_CANDIDATES = [
    dict(fused_dq=True, persistent=False, merged_pieces=False),
    dict(fused_dq=True, persistent=False, merged_pieces=True),
    dict(fused_dq=True, persistent=False, merged_pieces=True,
         stage_free_on_read=True),
    dict(fused_dq=False, persistent=False)]
MERGED_WIDE_CANDIDATES = [
    dict(fused_dq=True, block_q=128),
    dict(fused_dq=True, block_q=128, deferred_dq=True),
    dict(fused_dq=True, block_q=128, deferred_dq=True, merged_pieces=True)]
# `lean_producer` alone, wherever the two kernels run (d=64's 128-row Q
# tiles: `backward_lean_wide`).
LEAN_SPACE = dict(lean_producer=(False, True), fused_dq=(False,))
LEAN_WIDE_SPACE = dict(LEAN_SPACE, block_q=(128,))
# The forward's consumers at 240 registers (`KernelStatic.lean_producer`),
# and with them the intra-warpgroup overlap (`overlap_scores`, launch grid),
# which holds the next step's S as well, against the default.
FORWARD_LEAN_CANDIDATES = [dict(c, lazy_rescale=False) for c in (
    dict(sum_after_pv=False), dict(lean_producer=True, sum_after_pv=False),
    dict(persistent=False, overlap_scores=True),
    dict(persistent=False, overlap_scores=True, lean_producer=True))]
# P's row sum after P V is issued (`forward.KernelStatic.sum_after_pv`,
# tokamax's order above head_dim 128), alone and with lean producers,
# against the default; the ncu of the d=256 forward at 4k
# (results/h200_ncu_fwd256_4k.md) shows our consumers polling barriers
# where cuDNN's wait on their wgmmas. Session 16, without a mask
# (results/h200_mosaic_sum_after_pv.md): d=128 +2.3% at 4k and +2.0% at
# 16k (the default there since), d=256 -2.7% and -1.2%; session 11's form
# (`late_row_sum`, results/h200_mosaic_late_sum_r3.md) read d=128 -1.6% at
# 16k and +2.6% at 4k. These three lists
# are pinned as they ran, with the row sum before P V and (since session
# 18's default) O rescaled every step.
FORWARD_SUM_AFTER_PV_CANDIDATES = [dict(c, lazy_rescale=False) for c in (
    dict(sum_after_pv=False), dict(sum_after_pv=True),
    dict(sum_after_pv=True, lean_producer=True))]
# O rescaled only at steps where some row's max moved
# (`forward.KernelStatic.rescale_threshold`): never skipped, skipped where
# no max grew (bitwise the same), and FlashAttention-4's lazy form (a row's
# max moves only by more than 8, log2 units). Session 15's ncu of the d=256
# forward at 4k: O's rescale is 128 FMUL a thread a 64-key step, 69 M of
# its 260 M warp instructions against cuDNN's 52 M of 185 M. Session 18
# (results/h200_mosaic_rescale.md) made the lazy form the default at d=256
# and at d=128 without a mask; the list is pinned as it ran.
FORWARD_RESCALE_CANDIDATES = [
    dict(lazy_rescale=False),
    dict(lazy_rescale=True, rescale_threshold=0.0, rescale_per_warp=False),
    dict(lazy_rescale=True, rescale_threshold=8.0, rescale_per_warp=False)]
# The lazy rescale's skip decided per warp (`rescale_per_warp`: a
# `vote.sync.any`, no divergence before P V's wgmma) against per thread
# (session 18's default). Session 19 (results/h200_mosaic_rescale_warp.md,
# three rounds): -2.5% to +1.4% cell by cell, +0.1% in the geometric mean;
# the default since. Pinned as it ran.
FORWARD_RESCALE_WARP_CANDIDATES = [
    dict(lazy_rescale=True, rescale_per_warp=False),
    dict(lazy_rescale=True, rescale_per_warp=True)]
# What the fused dQ's fixed order costs (`turn_cost_benchmark`): the fused
# kernel as shipped, the same without its turn waits (a diagnostic: its dQ
# is wrong), and the two kernels. cuDNN's backward, one kernel adding dQ in
# any order, took 2.27 ms at d=128 4k against our two kernels' 2.75 under
# ncu (results/h200_ncu_4k.md): if the unordered kernel gets near it and
# the shipped one does not, determinism's order is the lever (e.g. fewer,
# coarser turns); if neither does, the kernel's steps are.
TURN_COST_CANDIDATES = [dict(fused_dq=True, persistent=False),
                        dict(fused_dq=True, persistent=False,
                             unordered_turns=True),
                        dict(fused_dq=False, persistent=False)]
# head_dim 64's fused dQ (its default from 16k, causal or not) against the
# two kernels as they stand since (lean producers; persistent under causal
# masking, the launch grid tile-fastest without), on the dispatch's 128-row
# Q tiles: its last A/Bs against them predate both (sessions 8-12). Session
# 19 at 16k (results/h200_mosaic_fused_recheck_wide*.md, two runs of two
# and three rounds): causal, the launch grid +2.8% / +1.7% over the fused
# kernel, the persistent grid +2.7% / -1.5%; without a mask the two
# kernels' two entries (the same kernel there) read 1.6% apart in both
# runs, +1.1 / -0.5% and +1.4 / -0.2% against fused. Within the noise:
# the default stands.
# (Session 19's defaults resolve these: since session 20 d=64 causal at 16k
# runs the launch grid with `dq_tiles` unless told otherwise.)
FUSED_RECHECK_WIDE_CANDIDATES = [
    dict(block_q=128), dict(block_q=128, fused_dq=False),
    dict(block_q=128, fused_dq=False, persistent=False)]
# The TMA ring's depth of head_dim 64's backward (128-row Q tiles), fused
# (the 16k default) and as two kernels on the launch grid: session 5's
# sweep of depths predates every later change to these kernels, and the
# fused kernel was never swept (4 stages do not fit it). Pinned as they ran
# in session 20 (results/h200_mosaic_stages_wide.md: `block_q=128` alone
# was the fused kernel then, the launch grid's dQ kernel on 128 x 64).
STAGES_WIDE_CANDIDATES = [
    dict(block_q=128, fused_dq=True),
    dict(block_q=128, fused_dq=True, max_concurrent_steps=3)] + [
    dict(block_q=128, fused_dq=False, persistent=False, dq_tiles=(128, 64),
         max_concurrent_steps=n) for n in (2, 3, 4)]
# head_dim 128 under causal masking, where our backward ran 6% behind
# cuDNN's at 16k in session 20 (474 against 507 TFLOP/s) but only 2%
# without a mask: the options measured off there in earlier sessions, each
# alone and two together, against session 19's default (the two kernels,
# launch grid, both off: pinned, since session 20 made both the default).
CAUSAL_128_CANDIDATES = [
    dict(lean_producer=False, prefetch_lse=False), dict(persistent=True),
    dict(lean_producer=True, prefetch_lse=False),
    dict(lean_producer=False, prefetch_lse=True),
    dict(lean_producer=True, prefetch_lse=True)]
# The dQ kernel on tiles of its own (`mosaic_backward(dq_tiles=)`), the
# two kernels on the launch grid: 128 K/V rows a step (wgmma's N 128 for S
# and dP, half the steps) against the dK/dV kernel's tiles (pinned: session
# 20 made 64 x 128 the d=64 causal default).
DQ_TILES_64_CANDIDATES = [
    dict(block_q=128, fused_dq=False, persistent=False, dq_tiles=tiles)
    for tiles in ((128, 64), (64, 128), (64, 64))]
DQ_TILES_128_CANDIDATES = [
    dict(fused_dq=False, persistent=False, dq_tiles=tiles)
    for tiles in ((64, 64), (64, 128))]
# d=64 under causal masking at 4k and 8k (NOTES, session 20's list, item
# 4): the persistent grid (the default up to kv_len 8192) against the
# launch grid with the dQ kernel on 64 x 128 tiles (its default from 16k)
# and on 128 x 64, head to head.
CAUSAL_64_GRID_CANDIDATES = [
    dict(block_q=128, persistent=True),
    dict(block_q=128, persistent=False, fused_dq=False, dq_tiles=(64, 128)),
    dict(block_q=128, persistent=False, fused_dq=False, dq_tiles=(128, 64))]
# head_dim 64's forward (three consumers, whose turns always go round a
# ring) with those turns on hardware barriers (`hw_turns`) against the
# default's mbarrier ring: session 10's unsettled run read +3% at 16k and
# +1% at 4k (results/h200_mosaic_turns.md), where fwd d=64 1k is the
# forward's one grid cell below its best peer (0.990 in session 20).
# Pinned as they ran: session 21 made hw_turns d=64's default.
FORWARD_HW_TURNS_CANDIDATES = [dict(hw_turns=False), dict(hw_turns=True)]
# head_dim 64 without a mask at 4k, the two kernels on the launch grid
# (fwd+bwd 0.995 of cuDNN in session 20's grid): the default against a
# ring one stage deeper and the dQ kernel on 64 x 128 tiles (session 20:
# 385 -> 380, two rounds).
BACKWARD_FULL_64_CANDIDATES = [
    dict(block_q=128), dict(block_q=128, max_concurrent_steps=3),
    dict(block_q=128, dq_tiles=(64, 128))]
# head_dim 64's fused dQ (the default from kv_len 16k without a mask until
# session 24) with
# its consumers meeting each step on a hardware barrier (`hw_ds_sync`)
# against the mbarrier, and the two kernels on the launch grid beside them.
# Pinned as they ran (session 21 made hw_ds_sync d=64's default).
FUSED_HW_SYNC_CANDIDATES = [
    dict(block_q=128, fused_dq=True, hw_ds_sync=False),
    dict(block_q=128, fused_dq=True, hw_ds_sync=True),
    dict(block_q=128, fused_dq=False, persistent=False)]
# Where the fused dQ is not the default (d=64 under causal masking at 16k
# and without a mask at 4k; d=128 at 16k, whose fused dQ, the default
# without a mask, defers its pieces, and whose causal default is the two
# kernels), the default against the fused dQ with its consumers meeting
# each step on a hardware barrier (not deferred), as d=64 runs it at 16k.
HW_SYNC_RECHECK_64_CANDIDATES = [
    dict(block_q=128), dict(block_q=128, fused_dq=True, deferred_dq=False,
                            hw_ds_sync=True)]
HW_SYNC_RECHECK_128_CANDIDATES = [
    dict(), dict(fused_dq=True, deferred_dq=False, merged_pieces=False,
                 hw_ds_sync=True)]
# head_dim 128's fused dQ (the default from kv_len 16k without a mask)
# against itself with lse read early, delta read before P's exponentials,
# stages freed once read (each measured before merged pieces, session 14),
# and the two kernels.
# Pinned as they ran (lse early is the fused default since).
FUSED_RECHECK_128_CANDIDATES = [
    dict(fused_dq=True, prefetch_lse=False),
    dict(fused_dq=True, prefetch_lse=True),
    dict(fused_dq=True, prefetch_lse=False, early_delta=True),
    dict(fused_dq=True, prefetch_lse=False, stage_free_on_read=True),
    dict(fused_dq=False)]
# Session 22: lse read early made d=128's fused dQ 498 -> 523 at 16k; it
# with the other options again, and the two kernels and the fused dQ
# without it, wherever the fused dQ might run. (Session 22's run also had
# it with the deferred `hw_ds_sync` of ccc1e2d, a form since removed.)
FUSED_LSE_128_CANDIDATES = [
    dict(fused_dq=True, prefetch_lse=True),
    dict(fused_dq=True, prefetch_lse=True, stage_free_on_read=True),
    dict(fused_dq=True, prefetch_lse=True, early_delta=True),
    dict(fused_dq=True, prefetch_lse=False), dict(fused_dq=False)]
# The same at d=64's 128-row Q tiles (its fused default, 16k without a mask).
FUSED_LSE_64_CANDIDATES = [
    dict(block_q=128, fused_dq=True, prefetch_lse=False),
    dict(block_q=128, fused_dq=True, prefetch_lse=True)]
# The same with head_dim 64's 128-row Q tiles (the dispatch's there).
TILE_ORDER_WIDE_CANDIDATES = [dict(c, block_q=128)
                              for c in TILE_ORDER_CANDIDATES]
# The launch order alone with those tiles (seq 4k: nothing fused there).
LAUNCH_WIDE_SPACE = dict(LAUNCH_SPACE, block_q=(128,))
# Three consumers' K/V ring depth (they leave room for 4 stages at d=64).
CONSUMER_STAGES_SPACE = dict(num_consumers=(3,),
                             max_concurrent_steps=(2, 3, 4))

# Session 23: three consumers' short last tiles without math for a consumer
# that has no rows there (`forward.KernelStatic.skip_spare`). At d=64 only
# (`--head-dims 64`): elsewhere two consumers run and both are one kernel.
FORWARD_SKIP_SPARE_SPACE = dict(skip_spare=(False, True))

# Session 23: d=64's two kernels (128-row Q tiles) with lse read before the
# dK/dV kernel's matmuls, delta before P's exponentials, or both (measured
# at d=128 and 256 only before; the ncu of d=64's 4k backward put 5% of
# the dK/dV consumers' samples on P's first FFMAs waiting for lse).
STATS_EARLY_64_CANDIDATES = [
    dict(block_q=128, fused_dq=False),
    dict(block_q=128, fused_dq=False, prefetch_lse=True),
    dict(block_q=128, fused_dq=False, early_delta=True),
    dict(block_q=128, fused_dq=False, prefetch_lse=True, early_delta=True)]

# Session 24: the dK/dV kernel's Sᵀ issued right behind the step before's
# dV and dK (`backward._Static.scores_ahead`, the default on d=64's launch
# grid since; the ncu of d=64's 4k backward had 7% of the dK/dV kernel's
# samples on the wait for Sᵀ and 6.5% on dV and dK's, back to back).
# d=64's two kernels (128-row Q tiles) and its default (the fused dQ at
# 16k, the persistent grid at 1k); d=128's two kernels (64-row Q tiles,
# lse read early by default). The same in the dQ kernel, measured slower
# (results/h200_mosaic_ahead_s24.md), was removed.
AHEAD_64_CANDIDATES = [
    dict(block_q=128, fused_dq=False, scores_ahead=False),
    dict(block_q=128, fused_dq=False, scores_ahead=True),
    dict(block_q=128)]
AHEAD_128_CANDIDATES = [
    dict(fused_dq=False), dict(fused_dq=False, prefetch_lse=False),
    dict(fused_dq=False, prefetch_lse=False, scores_ahead=True)]
# d=64 from 16k: the fused dQ (the default until session 24) against the
# two kernels with `scores_ahead`.
AHEAD_FUSED_64_CANDIDATES = [dict(block_q=128, fused_dq=True),
                             dict(block_q=128, fused_dq=False)]
# Under causal masking (each query head's unmasked run ahead), d=64 with
# its defaults otherwise (the persistent grid up to kv_len 8192, else the
# launch grid with the dQ kernel on 64 x 128 tiles).
AHEAD_CAUSAL_64_CANDIDATES = [dict(block_q=128, scores_ahead=False),
                              dict(block_q=128, scores_ahead=True)]


def candidates(space: dict | list[dict]) -> list[dict]:
  """Every combination of a space's values, or a list of candidates as
  given."""
  if isinstance(space, list):
    return space
  return [dict(zip(space, values))
          for values in itertools.product(*space.values())]


def forward_benchmark(cell: common.Cell, blocks: dict):
  from pallas_kernels.mosaic.forward import mosaic_forward
  q, k, v, _ = common.attention_inputs(cell.shape, cell.dtype)
  fn = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=cell.head_dim**-0.5, is_causal=cell.causal, **blocks))
  return fn, (q, k, v)


def backward_benchmark(cell: common.Cell, blocks: dict):
  from pallas_kernels.mosaic.backward import mosaic_backward
  from pallas_kernels.mosaic.forward import mosaic_forward
  q, k, v, d_out = common.attention_inputs(cell.shape, cell.dtype)
  scale = cell.head_dim**-0.5
  out, lse = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=scale, is_causal=cell.causal))(q, k, v)
  fn = jax.jit(lambda *a: mosaic_backward(
      *a, scale=scale, is_causal=cell.causal, **blocks))
  return fn, (q, k, v, out, lse, d_out)


def fp8_forward_benchmark(cell: common.Cell, blocks: dict):
  """The FP8 forward as the grid times it (`peers.jax_flash_mosaic_fp8`),
  with the candidate's options."""
  from benchmarks import peers
  bench = peers.jax_flash_mosaic_fp8(cell, **blocks)
  return bench.fn, bench.args


# The FP8 forward's lazy O rescale (`mosaic_forward_fp8(lazy_rescale=)`),
# as the bf16 kernel's (session 18) but with P rounded to e4m3 after it.
# Session 19: the default at d=256 since (`fp8.FP8_LAZY_RESCALE_HEAD_DIMS`).
FP8_RESCALE_SPACE = dict(lazy_rescale=(False, True))


# The ranged (masked) kernels' launch order, on a causal sliding window of
# MASKED_WINDOW keys (`masked.mosaic_forward_masked`,
# `masked_backward.mosaic_backward_masked`). Their TFLOP/s use the causal
# count, of which a window does a fraction: compare candidates only.
MASKED_WINDOW = 1024
MASKED_ORDER_SPACE = dict(tile_fastest=(False, True))
# The ranged forward's O rescaled lazily (`lazy_rescale`, session 18),
# pinned as it ran: the skip per thread (per warp by default since session
# 19, a form this A/B has not timed in the ranged kernel).
MASKED_RESCALE_SPACE = [dict(lazy_rescale=False),
                        dict(lazy_rescale=True, rescale_per_warp=False)]


def _window_spec(cell: common.Cell):
  from jax_flash import masking
  return masking.MaskSpec(q_len=cell.seq_len, kv_len=cell.seq_len,
                          is_causal=True, window=(MASKED_WINDOW, 0))


def masked_forward_benchmark(cell: common.Cell, blocks: dict):
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  q, k, v, _ = common.attention_inputs(cell.shape, cell.dtype)
  spec = _window_spec(cell)
  fn = jax.jit(lambda q, k, v: mosaic_forward_masked(
      q, k, v, scale=cell.head_dim**-0.5, spec=spec, **blocks))
  return fn, (q, k, v)


def masked_backward_benchmark(cell: common.Cell, blocks: dict):
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  q, k, v, d_out = common.attention_inputs(cell.shape, cell.dtype)
  scale, spec = cell.head_dim**-0.5, _window_spec(cell)
  out, lse = jax.jit(lambda q, k, v: mosaic_forward_masked(
      q, k, v, scale=scale, spec=spec))(q, k, v)
  fn = jax.jit(lambda *a: mosaic_backward_masked(
      *a, scale=scale, spec=spec, **blocks))
  return fn, (q, k, v, out, lse, d_out)


@contextlib.contextmanager
def turns_removed():
  """While a fused backward is traced: its writers' turn waits do nothing,
  so every writer adds as soon as its pieces are staged (dQ WRONG: the
  first K/V tile stores where it should add first, and adds race)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  with mock.patch.object(plgpu, "semaphore_wait",
                         lambda *args, **kwargs: None):
    yield


def turn_cost_benchmark(cell: common.Cell, blocks: dict):
  """`backward_benchmark`; with `unordered_turns`, compiled (so traced)
  under `turns_removed`."""
  blocks = dict(blocks)
  if not blocks.pop("unordered_turns", False):
    return backward_benchmark(cell, blocks)
  fn, args = backward_benchmark(cell, blocks)
  with turns_removed():
    return fn.lower(*args).compile(), args


def _forward(space, causal=(False, True)):
  return forward_benchmark, space, 1.0, causal


def _backward(space, causal=(False, True)):
  # FlashAttention's count: the backward is 2.5x the forward.
  return backward_benchmark, space, 2.5, causal


# kernel -> (build, space, FLOPs relative to the forward, causal values).
KERNELS = {"forward": _forward(FORWARD_SPACE),
           "backward": _backward(BACKWARD_SPACE),
           "forward_order": _forward(FORWARD_ORDER_SPACE, causal=(True,)),
           "backward_order": _backward(ORDER_SPACE, causal=(True,)),
           "forward_schedule": _forward(SCHEDULE_SPACE),
           "forward_overlap": _forward(FORWARD_OVERLAP_SPACE),
           "backward_overlap": _backward(OVERLAP_SPACE),
           "forward_persistent": _forward(PERSISTENT_SPACE),
           "backward_persistent": _backward(PERSISTENT_SPACE),
           "backward_persistent_wide": _backward(PERSISTENT_WIDE_SPACE),
           "backward_fused": _backward(FUSED_SPACE),
           "forward_launch": _forward(LAUNCH_SPACE),
           "forward_consumers": _forward(CONSUMERS_SPACE),
           "forward_consumer_stages": _forward(CONSUMER_STAGES_SPACE),
           "forward_turns": _forward(TURNS_SPACE),
           "backward_launch": _backward(LAUNCH_SPACE),
           "backward_shared": _backward(SHARED_SPACE),
           "backward_shared_q": _backward(SHARED_Q_SPACE),
           "backward_prefetch": _backward(PREFETCH_SPACE),
           "backward_wide_q": _backward(WIDE_Q_SPACE),
           "backward_opaque": _backward(OPAQUE_SPACE),
           "backward_deferred": _backward(DEFERRED_SPACE),
           "backward_deferred_wide": _backward(DEFERRED_WIDE_SPACE),
           "backward_tile_order": _backward(TILE_ORDER_CANDIDATES),
           "backward_tile_order_wide": _backward(TILE_ORDER_WIDE_CANDIDATES),
           "backward_launch_wide": _backward(LAUNCH_WIDE_SPACE),
           "backward_fused_order": _backward(FUSED_ORDER_CANDIDATES),
           "backward_fused_recheck_wide": _backward(
               FUSED_RECHECK_WIDE_CANDIDATES),
           "backward_stages_wide": _backward(STAGES_WIDE_CANDIDATES),
           "backward_dq_tiles_64": _backward(DQ_TILES_64_CANDIDATES),
           "backward_dq_tiles_128": _backward(DQ_TILES_128_CANDIDATES),
           "backward_causal_64_grid": _backward(CAUSAL_64_GRID_CANDIDATES,
                                                causal=(True,)),
           "forward_hw_turns": _forward(FORWARD_HW_TURNS_CANDIDATES),
           "backward_full_64": _backward(BACKWARD_FULL_64_CANDIDATES,
                                         causal=(False,)),
           "backward_fused_hw_sync": _backward(FUSED_HW_SYNC_CANDIDATES),
           "backward_hw_sync_64": _backward(HW_SYNC_RECHECK_64_CANDIDATES),
           "backward_hw_sync_128": _backward(HW_SYNC_RECHECK_128_CANDIDATES),
           "backward_fused_recheck_128": _backward(
               FUSED_RECHECK_128_CANDIDATES, causal=(False,)),
           "backward_fused_lse_128": _backward(FUSED_LSE_128_CANDIDATES),
           "backward_fused_lse_64": _backward(FUSED_LSE_64_CANDIDATES,
                                              causal=(False,)),
           "backward_causal_128": _backward(CAUSAL_128_CANDIDATES,
                                            causal=(True,)),
           "forward_tile_order": _forward(FORWARD_TILE_ORDER_CANDIDATES),
           "forward_one_stage": _forward(FORWARD_ONE_STAGE_CANDIDATES),
           "backward_fused_stalls": _backward(FUSED_STALLS_CANDIDATES),
           "backward_prefetch_lse": _backward(PREFETCH_LSE_SPACE),
           "backward_early_delta": _backward(DELTA_CANDIDATES),
           "backward_lean": _backward(LEAN_SPACE),
           "forward_lean": _forward(FORWARD_LEAN_CANDIDATES),
           "forward_sum_after_pv": _forward(FORWARD_SUM_AFTER_PV_CANDIDATES),
           "forward_rescale": _forward(FORWARD_RESCALE_CANDIDATES),
           "forward_rescale_warp": _forward(FORWARD_RESCALE_WARP_CANDIDATES),
           "backward_stats_early_64": _backward(STATS_EARLY_64_CANDIDATES),
           "backward_ahead_64": _backward(AHEAD_64_CANDIDATES,
                                          causal=(False,)),
           "backward_ahead_128": _backward(AHEAD_128_CANDIDATES,
                                           causal=(False,)),
           "backward_ahead_fused_64": _backward(AHEAD_FUSED_64_CANDIDATES,
                                                causal=(False,)),
           "backward_ahead_causal_64": _backward(AHEAD_CAUSAL_64_CANDIDATES,
                                                 causal=(True,)),
           "forward_skip_spare": _forward(FORWARD_SKIP_SPARE_SPACE,
                                          causal=(False,)),
           "backward_merged": _backward(MERGED_CANDIDATES),
           "backward_merged_wide": _backward(MERGED_WIDE_CANDIDATES),
           "backward_lean_wide": _backward(LEAN_WIDE_SPACE),
           "backward_turn_cost": (turn_cost_benchmark,
                                  TURN_COST_CANDIDATES, 2.5, (False, True)),
           "forward_fp8_rescale": (fp8_forward_benchmark,
                                   FP8_RESCALE_SPACE, 1.0, (False, True)),
           "masked_forward_order": (masked_forward_benchmark,
                                    MASKED_ORDER_SPACE, 1.0, (True,)),
           "masked_forward_rescale": (masked_forward_benchmark,
                                      MASKED_RESCALE_SPACE, 1.0, (True,)),
           "masked_backward_order": (masked_backward_benchmark,
                                     MASKED_ORDER_SPACE, 2.5, (True,))}


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--head-dims", nargs="+", type=int,
                      default=[64, 128, 256])
  parser.add_argument("--kernels", nargs="+", choices=list(KERNELS),
                      default=["forward", "backward"])
  parser.add_argument("--budget", type=float, default=400.0,
                      help="seconds; the JSON keeps what was measured")
  parser.add_argument("--rounds", type=int, default=1,
                      help="time each cell's candidates this many times in "
                      "turn; each keeps the median of its rounds")
  parser.add_argument("--causal", nargs="+", choices=("full", "causal"),
                      help="only these of each kernel's causal values")
  parser.add_argument("--out", help="the sweep's JSON (default "
                      "benchmarks/results/h200_mosaic_sweep.json)")
  parser.add_argument("--render", nargs="+", metavar="JSON",
                      help="measure nothing: write the sweeps in these files "
                      "(say, one per GPU) as one JSON and table at the last")
  args = parser.parse_args(argv)
  if args.render:
    if args.out:  # the merged file is --render's last path, not --out
      parser.error("--render writes its last JSON path; drop --out")
    print(write_tables(args.render[:-1] or args.render, args.render[-1]))
    return 0
  args.out = args.out or "benchmarks/results/h200_mosaic_sweep.json"
  result = {**common.run_header("benchmarks.tune_mosaic", argv),
            "seq_len": args.seq, "trials": []}
  deadline = time.monotonic() + args.budget
  wanted = {"full": False, "causal": True}
  cells = [(kernel, head_dim, causal)
           for kernel in args.kernels for head_dim in args.head_dims
           for causal in KERNELS[kernel][3]
           if not args.causal or causal in {wanted[c] for c in args.causal}]
  for kernel, head_dim, causal in common.progress(cells, desc="sweep"):
    if time.monotonic() > deadline:
      break
    result["trials"] += sweep_cell(kernel, args.seq, head_dim, causal,
                                   rounds=max(1, args.rounds))
    common.write_json(args.out, result)
  for line in best_lines(result["trials"]):
    print(line)
  return 0


def sweep_cell(kernel: str, seq: int, head_dim: int, causal: bool, *,
               rounds: int = 1) -> list[dict]:
  """One cell's trials: every candidate of `kernel`'s space built (a
  refusal or failure recorded as its "error"), then all timed `rounds`
  times in turn, each trial keeping the median of its rounds."""
  build, space, flops_factor, _ = KERNELS[kernel]
  cell = common.Cell.standard("fwd", seq, head_dim, causal)
  runs = []
  for blocks in candidates(space):
    trial = {"kernel": kernel, "head_dim": head_dim, "causal": causal,
             "seq": seq, **blocks}
    try:
      runs.append((trial, *build(cell, blocks), []))
    except Exception as e:  # refused: recorded, the sweep goes on
      trial["error"] = common.describe_error(e)
      runs.append((trial, None, None, None))
  for round_index in range(rounds):
    for trial, fn, inputs, samples in common.round_order(runs, round_index):
      if fn is None or "error" in trial:
        continue
      try:
        samples.append(common.time_fn(fn, *inputs))
      except Exception as e:  # failed to compile or run
        trial["error"] = common.describe_error(e)
  for trial, _, _, samples in runs:
    if samples and "error" not in trial:
      ms = statistics.median(samples)
      trial.update(ms=ms, tflops=flops_factor * cell.flops / (ms * 1e-3)
                   / 1e12, **({"rounds": rounds} if rounds > 1 else {}))
  return [run[0] for run in runs]


# A trial's fields that are not the candidate's options.
_TRIAL_FIELDS = frozenset({"kernel", "head_dim", "causal", "ms", "tflops",
                           "error", "seq", "rounds"})


def write_tables(parts: list[str], out: str) -> str:
  """Merges sweep files into `out` (their trials in order, their commands
  listed) and writes `out`'s .md: the best per (kernel, head_dim), then
  every trial. Returns the markdown."""
  if not out.endswith(".json"):  # twice a slip here overwrote a part file
    raise ValueError(f"the merged file must be a .json path, got {out!r}")
  if out not in parts and os.path.exists(out) and "parts" not in (
      render.load(out)):
    # A sweep's own file, not an earlier merge: `--render a.json b.json`
    # meant "render both", and lost b's trials (session 20, three times).
    raise ValueError(f"{out} holds a sweep of its own: merging into it would "
                     f"overwrite it; name a new .json as the last path")
  results = [render.load(p) for p in parts]
  merged = {**results[0], "trials": [t for r in results for t in r["trials"]]}
  if out not in parts:  # a merge, which says so (and may be redone)
    merged["parts"] = [r["command"] for r in results]
  common.write_json(out, merged)
  option_names = sorted({n for t in merged["trials"] for n in t}
                        - _TRIAL_FIELDS)
  rows = [[t["kernel"], t.get("seq", merged["seq_len"]), t["head_dim"],
           t["causal"],
           ", ".join(f"{n}={t[n]}" for n in option_names if n in t),
           f"{t['ms']:.3f}" if "ms" in t else "—",
           f"{t['tflops']:.0f}" if "tflops" in t else t["error"][:90]]
          for t in merged["trials"]]
  lines = render.header_lines(merged, "Mosaic kernel sweep (TFLOP/s)")
  seqs = sorted({r["seq_len"] for r in results})
  lines += [f"Seq {', '.join(map(str, seqs))}, batch·seq 16384, hidden 2048, "
            "bf16; TFLOP/s as the grid counts them (the backward alone: "
            "2.5x the forward's FLOPs).", "", "## Best per kernel and head "
            "dim (geometric mean over causal and not)", ""]
  lines += [f"- {line}" for line in best_lines(merged["trials"])]
  lines += ["", "## Every trial", "", render.markdown_table(
      ["kernel", "seq", "head_dim", "causal", "options", "ms",
       "TFLOP/s or why not"],
      rows), ""]
  text = "\n".join(lines)
  with open(out.removesuffix(".json") + ".md", "w") as f:
    f.write(text)
  return text


def option_names(space: dict | list[dict]) -> list[str]:
  """The options a space (or list of candidates) sets, in order."""
  return list(dict.fromkeys(name for blocks in candidates(space)
                            for name in blocks))


def best_lines(trials: list[dict]) -> list[str]:
  """The best candidate per (kernel, head_dim): geometric mean over the
  causal values measured (candidates measured for all of them only)."""
  lines = []
  groups, measured = {}, {}
  for t in trials:
    if "tflops" in t:
      key = (t["kernel"], t.get("seq", 0), t["head_dim"])
      # Option values as JSON gives them back (a tuple as a list) hashed.
      names = (option_names(KERNELS[t["kernel"]][1])
               if t["kernel"] in KERNELS else sorted(set(t) - _TRIAL_FIELDS))
      blocks = tuple((n, tuple(t[n]) if isinstance(t[n], list) else t[n])
                     for n in names if n in t)
      groups.setdefault(key, {}).setdefault(blocks, []).append(t["tflops"])
      measured.setdefault(key, set()).add(t["causal"])
  for (kernel, seq, head_dim), by_blocks in sorted(groups.items()):
    causal_values = sorted(measured[(kernel, seq, head_dim)])
    scored = {b: math.prod(v) ** (1 / len(v)) for b, v in by_blocks.items()
              if len(v) == len(causal_values)}
    if scored:
      best = max(scored, key=scored.get)
      others = ", ".join(f"{dict(b)} {v:.0f}" for b, v in scored.items()
                         if b != best)
      at = f" seq {seq}" if seq else ""
      lines.append(f"{kernel}{at} d{head_dim}: {dict(best)} "
                   f"{scored[best]:.0f} TFLOP/s (geomean over causal "
                   f"{list(causal_values)}; others: {others})")
  return lines


if __name__ == "__main__":
  sys.exit(main())
