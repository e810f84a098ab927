"""The Mosaic GPU kernels' numerics on a CPU, under JAX's Mosaic GPU
interpreter (`tests/mosaic_interpret.py` teaches it what the kernels use).

The interpreter simulates the kernels' threads, shared memory, barriers, TMA
and wgmma, so these tests run the real kernel bodies (warp specialisation,
the K/V ring, online softmax, causal block skipping, the persistent walk;
the backward's dQ and dK/dV kernels, and the fused one with its dQ writer's
semaphores and reduce-adds; rows read in place, head dims at their own
width, sinks, the plain soft cap, the FP8 forward) at small shapes, against
the reference with FlashAttention's tolerance rule. The masked kernels are
`test_mosaic_interpret_masked.py`'s. What the interpreter cannot see
(wgmma pipelining, shared-memory limits, registers, speed) stays with
`-m gpu` on an H200.

Kernels of more warpgroups than this process's CPU client can run
(`mosaic_interpret.MAX_WARPGROUPS`, set by its thread pool, which conftest
makes before this module can size it) skip here, and
`test_interpreted_wide_forms_in_a_larger_pool` runs them in a pytest child
whose client gets `mosaic_interpret.CPU_CLIENT_THREADS` threads.
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import masking
from jax_flash.reference import naive_attention
from tests import mosaic_interpret
from tests.attention_checks import (Case, assert_forward_within_rule,
                                    assert_within_rule, forward_and_grads,
                                    random_inputs, reference_gradients)

# `slow` (run by `pytest -m slow`, not by default): cases whose kernel form
# a faster default case already takes, kept for a kernel change's check
# before GPU time; the GPU suite runs them all at realistic sizes.
slow = lambda *values: pytest.param(*values, marks=pytest.mark.slow)

if mosaic_interpret.WHY_NOT is not None:
  pytest.skip(mosaic_interpret.WHY_NOT, allow_module_level=True)
try:
  from pallas_kernels.mosaic.forward import mosaic_forward
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

# (case, is_causal, mosaic_forward options). The default grid is the
# persistent one; a CPU has no SM count, so it gets two CTAs.
CASES = [
    slow(Case(1, 128, 128, 1, 1, 64), False, dict(persistent=False)),
    # (CI's ten minutes: causal on the launch grid by the GQA case below,
    # on the persistent one by the d=128 ragged case)
    slow(Case(1, 128, 128, 1, 1, 64), True, dict(persistent=False)),
    slow(Case(1, 256, 256, 2, 2, 64), False, dict(num_ctas=2)),
    slow(Case(1, 256, 256, 2, 2, 64), True, dict(num_ctas=2)),
    # GQA 2:1, and kv_len != q_len both ways under causal masking (empty
    # and partly masked K/V blocks, rows that attend to nothing).
    (Case(1, 128, 256, 2, 1, 64), True, dict(persistent=False)),
    slow(Case(1, 256, 128, 1, 1, 64), True, dict(persistent=False)),
    # Three consumers (d=64's plan from q_len 1024) on a short tile; four
    # warpgroups (`_skip_if_too_wide`), their turns on hardware barriers.
    (Case(1, 192, 128, 1, 1, 64), False, dict(persistent=False,
                                              num_consumers=3)),
    # Short last tiles (256 = 192 + 64 rows: two spare consumers; 320 =
    # 192 + 128: one) whose spares walk the steps without math
    # (`skip_spare`). Three K/V blocks in two stages, so that the producer
    # waits on every spare release; on one CTA, two heads, so that a whole
    # tile follows a short one and the barriers' phases must have come out
    # even; on the launch grid too. (A spare that skipped a release, a K
    # wait or a step hangs here.)
    (Case(1, 256, 384, 2, 2, 64), False, dict(num_ctas=1, num_consumers=3)),
    (Case(1, 320, 384, 2, 2, 64), False, dict(num_ctas=1, num_consumers=3)),
    (Case(1, 256, 384, 1, 1, 64), False, dict(persistent=False,
                                              num_consumers=3)),
    # The consumer schedules: two consumers' turns at a rendezvous and on
    # hardware barriers, and P's row sum after P V.
    slow(Case(1, 128, 128, 1, 1, 64), True, dict(persistent=False,
                                                 hw_turns=False)),
    slow(Case(1, 128, 128, 1, 1, 64), True, dict(persistent=False,
                                                 hw_turns=True)),
    slow(Case(1, 128, 128, 2, 2, 64), False, dict(num_ctas=2,
                                                  sum_after_pv=True)),
    # O rescaled only at steps where a row's max moved (`lazy_rescale`): on
    # any growth (the persistent grid, causal), and beyond 8 (the default
    # threshold; d=128 without a mask has it by its plan, below).
    slow(Case(1, 256, 256, 2, 2, 64), True,
         dict(num_ctas=2, lazy_rescale=True, rescale_threshold=0.0)),
    slow(Case(1, 128, 256, 1, 1, 128), True, dict(persistent=False,
                                                 lazy_rescale=True)),
    # head_dim 128's 128-row K/V tiles; without a mask its plan takes the
    # row sum after P V and rescales O lazily.
    slow(Case(1, 128, 256, 1, 1, 128), True, dict(persistent=False)),
    (Case(1, 128, 256, 1, 1, 128), False, dict(num_ctas=2)),
    # Ragged lengths on the plain kernel (`common.ragged_lengths`): TMA
    # zero-fills the tiles' rows past q_len and kv_len and drops the
    # stores past q_len: the last tile's second consumer has 8 real rows
    # of its 64 at q_len 200 and none at 136 (its first has 8); the last
    # K/V block 72 and 8 real rows. Causal with q_len <= kv_len needs no
    # mask; without causal masking, or with q_len > kv_len, the last K/V
    # block is a masked step (`masks_key_tail`).
    slow(Case(1, 200, 200, 2, 1, 64), True, dict(persistent=False)),
    slow(Case(1, 136, 264, 1, 1, 128), True, dict(num_ctas=2)),
    (Case(1, 200, 200, 2, 1, 64), False, dict(persistent=False)),
    (Case(1, 264, 136, 1, 1, 128), True, dict(num_ctas=2)),
    # Three consumers on a short tile (256 = 192 + 64 rows) with the key
    # tail: the spares compute their rows again (no `skip_spare`).
    (Case(1, 256, 200, 1, 1, 64), False, dict(persistent=False,
                                              num_consumers=3)),
]


@pytest.mark.parametrize("q_len, kv_len, is_causal, head_dim, options", [
    # ViT-B/16's tokens (its GPU twin by default: CI's ten minutes)
    slow(197, 197, False, 64, dict(persistent=False)),
    slow(261, 133, True, 64, dict(num_ctas=2)),      # causal, q_len > kv_len
    # Two swizzle tiles a row: column tiles, two Q tiles, a K/V tail.
    (75, 70, False, 128, dict(persistent=False)),
    slow(261, 133, True, 256, dict(num_ctas=2)),
])
def test_interpreted_forward_reads_rows_in_place(q_len, kv_len, is_causal,
                                                 head_dim, options):
  """Lengths off the 8-row TMA tiling (`rows.rows_in_place`):
  `mosaic_forward` on the unpadded rows, TMA's zero fill past the ends
  and clipped stores the tail handling, the last K/V block masked past
  kv_len; out and lse as the reference's. Rows wider than a swizzle tile
  are column tiles (`rows.ColumnTiles`): a copy a tile, each an arrival
  on its barrier, and every product split at the tiles. (The interpreter
  sees one buffer where the GPU has two views: `mosaic_interpret`.)"""
  case = Case(1, q_len, kv_len, 2, 1, head_dim)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=head_dim**-0.5,
                                  is_causal=is_causal, **options)
  assert out.shape == q.shape
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal)


@pytest.mark.parametrize("q_len, kv_len, is_causal", [
    slow(197, 197, False),    # ViT-B/16's tokens
    slow(261, 133, True),     # causal, q_len > kv_len
])
def test_interpreted_forward_on_padded_rows(q_len, kv_len, is_causal):
  """`mosaic_forward(kv_len=)` on rows zero-padded to whole 8-row TMA tiles
  (`attention._plain_attention`'s call where rows are wider than a
  swizzle tile, d=128 here): the padded keys masked, out and lse of the
  real rows as the reference's on the unpadded inputs. Fails without
  `kv_len` (the padded keys' zero scores counted)."""
  from pallas_kernels.mosaic.masked import pad_rows
  case = Case(1, q_len, kv_len, 2, 1, 128)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  out, lse = mosaic_interpret.run(
      mosaic_forward, *(pad_rows(x) for x in (q, k, v)), scale=128**-0.5,
      is_causal=is_causal, kv_len=kv_len, persistent=False)
  assert_forward_within_rule(q, k, v, out[:, :q_len], lse[:, :, :q_len],
                             is_causal=is_causal)


def _skip_if_too_wide(warpgroups: int) -> None:
  """Skips a kernel of `warpgroups` warpgroups that could deadlock this
  process's interpreter (`test_interpreted_wide_forms_in_a_larger_pool`
  runs it)."""
  if warpgroups > mosaic_interpret.MAX_WARPGROUPS:
    pytest.skip(f"{warpgroups} warpgroups could deadlock the interpreter on "
                f"a CPU client of {mosaic_interpret.MAX_WARPGROUPS - 1} "
                f"threads; run in a child with more")


@pytest.mark.parametrize("case, is_causal, options", CASES, ids=str)
def test_interpreted_mosaic_forward_matches_reference(case, is_causal,
                                                      options):
  """out and lse against the float32 reference, within twice the plain
  bf16 computation's error (DESIGN's rule)."""
  _skip_if_too_wide(options.get("num_consumers", 2) + 1)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=7)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=case.head_dim**-0.5,
                                  is_causal=is_causal, **options)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal)


@pytest.mark.parametrize("case, is_causal, options", [
    # GQA 2:1, causal, kv_len > q_len, the launch grid.
    (Case(1, 128, 256, 2, 1, 64), True, dict(persistent=False)),
    # The persistent grid, O and l rescaled on any growth of the max.
    slow(Case(1, 256, 256, 2, 2, 64), True,
         dict(num_ctas=2, lazy_rescale=True, rescale_threshold=0.0)),
    # d=128 without a mask: the plan's sum after P V and lazy rescale give
    # way to the tensor cores' sum.
    slow(Case(1, 128, 256, 1, 1, 128), False, dict(num_ctas=2)),
], ids=str)
def test_interpreted_forward_row_sum_by_mma(monkeypatch, case, is_causal,
                                            options):
  """`ForwardConfig.mma_row_sum`: O's and the LSE's row sum l is P (as P V
  rounds it) times a tile of ones, its accumulator rescaled by alpha with
  O (`forward_kernel._row_sum` patched to fail, so the float32 sum is not
  taken); out and lse within the 2x rule."""
  from pallas_kernels.mosaic import forward_kernel

  def no_float32_sum(*args, **kwargs):
    raise AssertionError("the forward summed P in float32")
  monkeypatch.setattr(forward_kernel, "_row_sum", no_float32_sum)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=17)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=case.head_dim**-0.5,
                                  is_causal=is_causal, mma_row_sum=True,
                                  **options)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal)


@pytest.mark.parametrize("threshold", [slow(0.0), 8.0])
def test_interpreted_lazy_rescale_with_wide_scores(threshold):
  """Scores 8x the usual spread, so that rows' maxima keep moving by more
  than the threshold after the first K/V tile (at 8: rescales at later
  steps, and P up to 2**8 between them), against the reference. (The
  interpreter runs each thread's branch as the plain product:
  `mosaic_interpret`.)"""
  case = Case(1, 256, 256, 1, 1, 64)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=11)
  scale = 8 * case.head_dim**-0.5
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v, scale=scale,
                                  is_causal=True, num_ctas=2,
                                  lazy_rescale=True,
                                  rescale_threshold=threshold)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=True, scale=scale)


# (case, is_causal, mosaic_backward options): the two kernels (dQ, and
# dK/dV); the fused kernel's are FUSED_BACKWARD_CASES.
BACKWARD_CASES = [
    # d=64's 128-row Q tiles on the persistent grid (its default up to
    # kv_len 1024), GQA 2:1 (by default on ragged lengths, below).
    slow(Case(1, 256, 256, 2, 1, 64), True, dict(block_q=128, num_ctas=2)),
    slow(Case(1, 128, 128, 1, 1, 64), False, dict(persistent=False)),
    # d=128 on the launch grid, lse read early (its default without a mask)
    # and lean producers (bitwise scheduling, here the same numbers).
    (Case(1, 128, 256, 1, 1, 128), False, dict(persistent=False)),
    # The dQ kernel on tiles of its own (`dq_tiles`): 64 Q rows a consumer,
    # 128 K/V rows a step, beside dK/dV's 128-row Q steps; causal, so both
    # kernels' diagonals differ.
    (Case(1, 256, 256, 1, 1, 64), True,
     dict(block_q=128, persistent=False, dq_tiles=(64, 128))),
    # The same on the persistent grid (both named: a planned persistent
    # grid drops the plan's dQ tiles), GQA 2:1, two CTAs for the dQ
    # kernel's eight tiles.
    (Case(1, 256, 256, 2, 1, 64), True,
     dict(block_q=128, persistent=True, num_ctas=3, dq_tiles=(64, 128))),
    # dK/dV on two copies of each K/V head of GQA 4:2, each walking one
    # query head (`kv_head_copies`), the copies summed after (copies in
    # another order would pair query heads with the wrong K/V head).
    slow(Case(1, 128, 256, 4, 2, 64), True,
         dict(persistent=False, kv_head_copies=2)),
    # Ragged lengths on the plain kernels (`common.ragged_lengths`: no
    # mask), as the forward's cases: d=64's plan (128-row Q tiles,
    # persistent), GQA 2:1; d=128's launch grid with kv_len > q_len and
    # < q_len; without causal masking; d=256's plan above 1k, dK/dV with
    # shared K/V rows.
    (Case(1, 200, 200, 2, 1, 64), True, dict(block_q=128, num_ctas=2)),
    slow(Case(1, 136, 264, 1, 1, 128), True, dict(persistent=False)),
    slow(Case(1, 264, 136, 1, 1, 128), True, dict(persistent=False)),
    slow(Case(1, 200, 136, 2, 1, 64), False, dict(persistent=False)),
    slow(Case(1, 136, 264, 1, 1, 256), True, dict(shared_rows=True)),
]


# (case, is_causal, mosaic_backward options) of `scores_ahead`, each also
# run without it (`test_interpreted_scores_ahead_is_bitwise_the_default`).
AHEAD_CASES = [
    # Each step's Sᵀ issued right behind the step before's dK: GQA 2:1 over
    # three Q tiles a head (six steps through two stages, across the
    # heads), on the launch grid; on one persistent CTA walking two K/V
    # tiles, its ring running on across them (two steps a tile in two
    # stages; three in two, so that the second tile starts in slot 1: a
    # walk that ignored the ring's `base` would read the wrong slot); a
    # walk of one step; and d=128's 64-row Q tiles with lse read early.
    slow(Case(1, 384, 256, 2, 1, 64), False,
         dict(block_q=128, persistent=False, scores_ahead=True)),
    slow(Case(1, 256, 256, 1, 1, 64), False,
         dict(block_q=128, num_ctas=1, scores_ahead=True)),
    slow(Case(1, 384, 256, 1, 1, 64), False,
         dict(block_q=128, num_ctas=1, scores_ahead=True)),
    (Case(1, 128, 128, 1, 1, 64), False,
     dict(block_q=128, persistent=False, scores_ahead=True)),
    slow(Case(1, 256, 128, 1, 1, 128), False,
         dict(persistent=False, scores_ahead=True, prefetch_lse=True)),
]

# (case, is_causal, mosaic_backward options) of the fused kernel
# (`fused_dq=True`: dK/dV and a dQ writer, four warpgroups). Two K/V tiles
# of two 64-row consumers, so that the second tile's writer waits for the
# first's turn on each Q tile and reduce-adds onto its stores; two Q tiles.
FUSED_BACKWARD_CASES = [
    # d=64's 128-row Q tiles (two dQ pieces, one a consumer), GQA 2:1,
    # causal (the walk down from the last Q tile, masked steps), each
    # step's piece issued beside the next step's dV and dK.
    (Case(1, 256, 256, 2, 1, 64), True, dict(persistent=False)),
    # d=128's 64-row Q tiles, with the opaque resident rows.
    (Case(1, 128, 256, 1, 1, 128), False, dict()),
]


def _backward_test(case, is_causal, options):
  """Asserts dq, dk, dv of `mosaic_backward`'s kernels for `options`
  (`backward.configure`'s) under a random cotangent of out and of lse
  against the float32 reference's, within twice the plain bf16
  computation's error; returns them (`_interpreted_gradients`)."""
  grads, exact, lowp = _interpreted_gradients(case, is_causal, options)
  for name, ours in zip(("dq", "dk", "dv"), grads):
    assert_within_rule(name, ours, exact[name], lowp[name])
  return grads


def _interpreted_gradients(case, is_causal, options, alibi_slopes=None,
                           soft_cap=None):
  """(dq, dk, dv) of `mosaic_backward`'s kernels for `options` (and the
  plain kernels' ALiBi or soft cap; with a cap, Q times 4, so that logits
  reach it) under the interpreter, and the float32 and bf16 references'
  `forward_and_grads`. delta (`row_statistics`, a Triton kernel the
  Mosaic GPU interpreter cannot take) is computed outside it."""
  from pallas_kernels.mosaic import backward
  from pallas_kernels.mosaic.common import slope_rows
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=11)
  if soft_cap is not None:
    q = q * 4
  exact, lowp = reference_gradients(q, k, v, d_out, d_lse, is_causal=is_causal,
                                    alibi_slopes=alibi_slopes,
                                    logits_soft_cap=soft_cap)
  out, lse = exact["out"], exact["lse"]
  lse_t = jnp.swapaxes(lse, 1, 2)  # [batch, heads, q_len], the kernels'
  dq_config, dkdv_configs = backward.configure(
      q, k, scale=case.head_dim**-0.5, is_causal=is_causal,
      alibi_slopes=alibi_slopes, soft_cap=soft_cap, **options)
  stats = backward.row_statistics(out.astype(q.dtype), lse_t, d_out,
                                  jnp.swapaxes(d_lse, 1, 2))
  grads = mosaic_interpret.run(
      backward.gradients, q, k, v, d_out, stats, dq_config, dkdv_configs,
      slopes=None if alibi_slopes is None else slope_rows(alibi_slopes))
  return grads, exact, lowp


@pytest.mark.parametrize("case, is_causal, options", BACKWARD_CASES, ids=str)
def test_interpreted_mosaic_backward_matches_reference(case, is_causal,
                                                       options):
  """The two Mosaic backward kernels' dq, dk, dv (`_backward_test`)."""
  _backward_test(case, is_causal, options)


@pytest.mark.timeout(300)  # a release or wait too few hangs: fail sooner
                           # (by thread: pyproject's timeout_method)
@pytest.mark.parametrize("case, is_causal, options", AHEAD_CASES, ids=str)
def test_interpreted_scores_ahead_is_bitwise_the_default(case, is_causal,
                                                         options):
  """`scores_ahead` changes when the dK/dV consumers issue and wait, not
  what they sum: its dq, dk, dv obey the tolerance rule and equal the
  kernels' without it bit for bit (a step read from the wrong ring slot
  that only reorders the sums, which the rule cannot see, would not)."""
  ahead = _backward_test(case, is_causal, options)
  plain, _, _ = _interpreted_gradients(case, is_causal,
                                       dict(options, scores_ahead=False))
  for name, a, b in zip(("dq", "dk", "dv"), ahead, plain):
    np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("case, is_causal, options", FUSED_BACKWARD_CASES,
                         ids=str)
def test_interpreted_mosaic_fused_backward_matches_reference(case, is_causal,
                                                             options):
  """The fused kernel's dq, dk, dv (`_backward_test`): its dQ, a sum over
  K/V tiles by reduce-adds in the order of the turn semaphores."""
  _skip_if_too_wide(4)  # two consumers, the producer, the dQ writer
  _backward_test(case, is_causal, dict(options, fused_dq=True))


@pytest.mark.slow
def test_interpreted_wide_forms_in_a_larger_pool():
  """Runs the tests that skip here for want of CPU client threads
  (`_skip_if_too_wide`: the three-consumer forward, the fused backward,
  the capped routes) in
  a pytest child whose client has `mosaic_interpret.CPU_CLIENT_THREADS`;
  they must all pass there."""
  if mosaic_interpret.MAX_WARPGROUPS >= 4:
    pytest.skip("the wide forms run in this process")
  selected = "fused_backward or num_consumers or soft_cap_route"
  env = dict(os.environ,
             PJRT_NPROC=str(mosaic_interpret.CPU_CLIENT_THREADS))
  child = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
       "no:cacheprovider", "-k", selected, __file__],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      env=env, capture_output=True, text=True, timeout=300, check=False)
  summary = child.stdout.strip().splitlines()[-1] if child.stdout else ""
  # The fused backward's cases, the three-consumer forwards, and the
  # capped routes.
  expected = len(FUSED_BACKWARD_CASES) + sum(
      "num_consumers" in getattr(case, "values", case)[2]
      for case in CASES) + 2
  assert child.returncode == 0 and summary.startswith(
      f"{expected} passed"), child.stdout[-4000:] + child.stderr[-2000:]


# Head dims between the plans' 64, 128 and 256, computed at their own width
# on the next one's plan (`plan.plan_head_dim`): 16-bit rows of 160, 192,
# 320 and 384 bytes in 32-, 64-, 64- and 128-byte swizzles (the
# interpreter checks the kernels' arithmetic at those widths; the swizzles
# themselves, `test_mosaic_head_dims`' lowering and `-m gpu`). Each: the
# forward on its plan (persistent, two CTAs), under causal masking for
# 80 and 160; the masked forward on ragged causal lengths. The backward on
# its plan up to kv_len 1024 (the two kernels at 80 and 96; above 128 dK
# and dV in a pass each, at 160) and with shared K/V rows (the plan above
# 128 and 1024, at 160 in 32-byte swizzle tiles, at 192 in 64).
OWN_WIDTH_CASES = [(80, True), (96, False), (160, True), (192, False)]
# 96 by default (its 64-byte swizzle), the others with `-m slow`.
_own_width = lambda d, *rest: (pytest.param(d, *rest) if d == 96
                               else slow(d, *rest))


@pytest.mark.parametrize("head_dim, is_causal",
                         [_own_width(*c) for c in OWN_WIDTH_CASES])
def test_interpreted_own_width_forward_matches_reference(head_dim,
                                                         is_causal):
  case = Case(1, 128, 256, 2, 1, head_dim)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=3)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=head_dim**-0.5, is_causal=is_causal,
                                  num_ctas=2)
  assert out.shape == q.shape
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal)


# Sinks in the forward's epilogue: strong enough to take about half of a
# row's weight (a row's LSE is near 5 here), a different one per head.
SINKS = jnp.array([5.0, -2.0])


@pytest.mark.parametrize("case, options", [
    # The launch grid, GQA 2:1 (each query head its own sink).
    (Case(1, 128, 256, 2, 1, 64), dict(persistent=False)),
    # The persistent grid: two CTAs walk tiles of both heads (CI's ten
    # minutes: its GPU twin by default).
    slow(Case(1, 256, 256, 2, 2, 64), dict(num_ctas=2)),
    # The row sum after P V, and a running max that lags (lazy rescale).
    slow(Case(1, 128, 256, 2, 1, 64), dict(
        persistent=False, sum_after_pv=True, lazy_rescale=True)),
], ids=str)
def test_interpreted_forward_sinks(case, options):
  """`mosaic_forward(sinks=...)`: out and lse as the reference's with the
  sinks (`masking.apply_sinks`), causal."""
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=3)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=case.head_dim**-0.5, is_causal=True,
                                  sinks=SINKS, **options)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=True, sinks=SINKS)


@pytest.mark.parametrize("case, is_causal, cap, sinks, max_free, options", [
    # Causal, GQA 2:1, the persistent grid.
    (Case(1, 256, 256, 2, 1, 64), True, 20.0, None, None, {}),
    # Without a running max, the row sum P V takes by the tensor cores.
    (Case(1, 256, 256, 2, 1, 64), True, 20.0, None, "mma sum", {}),
    # Each row's max from its first step (`plan.MAX_FREE_FIRST_STEP_MAX`),
    # one unrounded sum; GQA 2:1's two heads in a persistent CTA's walk
    # (CI's ten minutes: the masked row of one key's test takes the form).
    slow(Case(1, 256, 256, 2, 1, 64), True, 40.0, None, "first step max",
         {}),
    # The running max at exp2's scale cap log2(e) past any bound on P;
    # not causal, a ragged key tail, sinks.
    slow(Case(1, 128, 200, 2, 2, 64), False, 100.0, SINKS, None, {}),
    # Max-free: a ragged key tail, sinks, the exact sum taken while P V
    # runs (d=128's plan without a mask).
    slow(Case(1, 128, 200, 2, 2, 64), False, 50.0, SINKS, "mma sum",
         dict(sum_after_pv=True, persistent=False)),
    slow(Case(1, 128, 200, 2, 2, 64), False, 50.0, SINKS, "first step max",
         dict(sum_after_pv=True, persistent=False)),
], ids=str)
def test_interpreted_plain_forward_soft_cap(monkeypatch, case, is_causal, cap,
                                            sinks, max_free, options):
  """`mosaic_forward(soft_cap=...)` (`plan.PLAIN_SOFTCAP_HEAD_DIMS`'s forward): out
  and lse as the reference's with `logits_soft_cap`, Q times 8 so that
  logits reach the cap. With `max_free`, without a running max
  (`plan.PLAIN_MAX_FREE_HEAD_DIMS`, `exponentiate` patched to fail), O's
  row sum P times a tile of ones or each row's max from its first step:
  a causal row of one key is exactly its value."""
  from pallas_kernels.mosaic import forward_kernel, plan
  if max_free:
    def no_running_max(*args, **kwargs):
      raise AssertionError("the max-free forward took a running max")
    monkeypatch.setattr(plan, "PLAIN_MAX_FREE_HEAD_DIMS", (64,))
    monkeypatch.setattr(plan, "MAX_FREE_FIRST_STEP_MAX",
                        max_free == "first step max")
    monkeypatch.setattr(forward_kernel, "exponentiate", no_running_max)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  q = q * 8
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=case.head_dim**-0.5,
                                  is_causal=is_causal, soft_cap=cap,
                                  sinks=sinks, **options)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal,
                             logits_soft_cap=cap, sinks=sinks)
  if max_free and is_causal and sinks is None:
    np.testing.assert_array_equal(
        out[:, 0], jnp.broadcast_to(v[:, 0], out[:, 0].shape))


@pytest.mark.parametrize("case, options", [
    # GQA 2:1, q_len < kv_len: tiles past every query's keys, rows whose
    # keys end mid-block.
    (Case(2, 128, 256, 2, 1, 64), dict()),
    # Three consumers on hardware turns; q_len > kv_len.
    slow(Case(1, 384, 256, 1, 1, 64), dict(num_consumers=3)),
], ids=str)
def test_interpreted_plain_forward_alibi(case, options):
  """`mosaic_forward(alibi_slopes=...)` (causal ALiBi as column terms on
  the plain form): out and lse as the reference's with slopes that differ
  by batch and head, large enough that a dropped row term or a wrong key
  position moves every row."""
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=9)
  slopes = jnp.linspace(0.05, 0.6, case.batch * case.num_heads,
                        dtype=jnp.float32).reshape(case.batch, case.num_heads)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=case.head_dim**-0.5, is_causal=True,
                                  alibi_slopes=slopes, **options)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=True,
                             alibi_slopes=slopes)


@pytest.mark.parametrize("case, options", [
    # GQA 2:1 (the dK/dV kernel's walk over the group's heads, each its
    # slope), q_len < kv_len.
    (Case(2, 128, 256, 2, 1, 64), dict()),
    # The dQ kernel on tiles of its own; K/V head copies in dK/dV.
    slow(Case(1, 256, 256, 4, 1, 64), dict(dq_tiles=(64, 128),
                                           kv_head_copies=2)),
    slow(Case(1, 128, 128, 2, 2, 128), dict()),
], ids=str)
def test_interpreted_plain_backward_alibi(case, options):
  """`mosaic_backward(alibi_slopes=...)`'s kernels (causal ALiBi as column
  terms on the plain dQ and dK/dV kernels): dq, dk, dv against the
  reference's under random cotangents, with slopes by batch and head."""
  slopes = jnp.linspace(0.05, 0.6, case.batch * case.num_heads,
                        dtype=jnp.float32).reshape(case.batch, case.num_heads)
  grads, exact, lowp = _interpreted_gradients(case, True, options,
                                              alibi_slopes=slopes)
  for name, ours in zip(("dq", "dk", "dv"), grads):
    assert_within_rule(name, ours, exact[name], lowp[name])


@pytest.mark.parametrize("case, is_causal, options", [
    # GQA 2:1 under causal masking, q_len < kv_len.
    (Case(2, 128, 256, 2, 1, 64), True, dict(persistent=False)),
    # Without a mask: d=64's planned `scores_ahead` and persistent grid
    # give way.
    slow(Case(1, 256, 128, 2, 2, 64), False, dict()),
    # d=256: the planned shared rows give way.
    slow(Case(1, 128, 128, 2, 1, 256), True, dict(persistent=False)),
], ids=str)
def test_interpreted_plain_backward_soft_cap(case, is_causal, options):
  """`mosaic_backward(soft_cap=...)`'s kernels (the cap on the plain dQ
  and dK/dV kernels, `BackwardStatic.soft_cap`): dq, dk, dv against the
  reference's under random cotangents, logits past a cap of 10."""
  grads, exact, lowp = _interpreted_gradients(case, is_causal, options,
                                              soft_cap=10.0)
  for name, ours in zip(("dq", "dk", "dv"), grads):
    assert_within_rule(name, ours, exact[name], lowp[name])


def test_cap_slope_ahead_in_dkdv_only():
  """The plain capped backward (`test_interpreted_plain_backward_soft_cap`'s
  first case runs it): the dK/dV kernel takes dV's 16-bit P and P ∘ slope
  before dPᵀ's wait (`BackwardStatic.cap_slope_ahead`), the dQ kernel its
  slope after dP's (ahead, it lost on the GPU)."""
  from pallas_kernels.mosaic import backward
  q = jnp.zeros((2, 128, 2, 64), jnp.bfloat16)
  k = jnp.zeros((2, 256, 1, 64), jnp.bfloat16)
  dq, dkdv = backward.configure(q, k, scale=0.125, is_causal=True,
                                soft_cap=10.0, persistent=False)
  assert all(static.cap_slope_ahead for static in dkdv)
  assert not dq.cap_slope_ahead
  plain_dq, plain_dkdv = backward.configure(q, k, scale=0.125,
                                            is_causal=True, persistent=False)
  assert not any(static.cap_slope_ahead for static in (plain_dq,
                                                       *plain_dkdv))


def test_plain_forward_alibi_refuses_what_the_masked_kernel_takes():
  """ValueError for slopes of the wrong shape; NotImplementedError without
  a causal mask, with sinks or a soft cap, or on the persistent grid."""
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  slopes = jnp.ones((1, 2), jnp.float32)
  with pytest.raises(ValueError, match="alibi_slopes"):
    mosaic_forward(q, q, q, scale=1.0, is_causal=True,
                   alibi_slopes=jnp.ones((2,), jnp.float32))
  for kwargs in (dict(is_causal=False), dict(is_causal=True, sinks=SINKS),
                 dict(is_causal=True, soft_cap=20.0),
                 dict(is_causal=True, persistent=True)):
    with pytest.raises(NotImplementedError):
      mosaic_forward(q, q, q, scale=1.0, alibi_slopes=slopes, **kwargs)


def test_sink_gradient_is_thereference_gradients():
  """`attention.sink_gradient` from the forward's out and lse (sinks in
  them) and random cotangents of both, against autodiff of the reference,
  with a row that sees no key."""
  from pallas_kernels.mosaic.attention import sink_gradient
  q, k, v, d_out, d_lse = random_inputs(Case(2, 40, 30, 2, 1, 16),
                                        jnp.float32, seed=6)
  variants = dict(is_causal=True, key_value_seq_lengths=jnp.array([0, 30]))

  def attention(sinks):
    return naive_attention(q, k, v, sinks=sinks, compute_dtype=jnp.float32,
                           **variants)
  (out, lse), vjp = jax.vjp(attention, SINKS)
  want, = vjp((d_out, d_lse))
  got = sink_gradient(SINKS, out, jnp.swapaxes(lse, 1, 2), d_out,
                      jnp.swapaxes(d_lse, 1, 2))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert sink_gradient(None, out, lse, d_out, d_lse) is None


@pytest.mark.parametrize("head_dim, is_causal, options", [
    *(_own_width(d, c, dict(num_ctas=2)) for d, c in OWN_WIDTH_CASES[:3]),
    slow(160, False, dict(shared_rows=True, persistent=False)),
    slow(192, True, dict(shared_rows=True, persistent=False)),
], ids=str)
def test_interpreted_own_width_backward_matches_reference(head_dim, is_causal,
                                                          options):
  """dq, dk, dv (`_backward_test`), GQA 2:1."""
  _backward_test(Case(1, 128, 128, 2, 1, head_dim), is_causal, options)


@pytest.mark.parametrize("q_len, kv_len, is_causal, head_dim", [
    # The whole route (forward, backward and their padding) of parts the
    # default suite checks apart: `-m slow` (CI's ten minutes).
    slow(99, 99, False, 64),      # rows read in place, not causal
    slow(197, 197, False, 64),    # ViT's tokens
    slow(136, 100, True, 64),     # causal, q_len > kv_len: whole 8-row tiles
    # Rows of two swizzle tiles, in place a column tile at a time in both
    # directions.
    slow(75, 70, False, 128),
])
def test_interpreted_ragged_route(monkeypatch, q_len, kv_len, is_causal,
                                  head_dim):
  """`mosaic_attention` at lengths no tile divides where real queries see
  past kv_len (`attention._masked`: the plain forward with its key tail
  masked, the masked forward patched to fail; the masked backward on the
  padded rows, whose zero keys add nothing): out, lse and the gradients
  under random cotangents against the reference (`_check_plain_route`)."""
  from pallas_kernels.mosaic import attention

  def refuse(*_, **__):
    raise AssertionError("a plain call reached the masked forward")
  monkeypatch.setattr(attention, "mosaic_forward_masked", refuse)
  case = Case(1, q_len, kv_len, 2, 1, head_dim)
  _check_plain_route(monkeypatch, *random_inputs(case, jnp.bfloat16,
                                                 seed=13),
                     is_causal=is_causal)


def _check_plain_route(monkeypatch, q, k, v, d_out, d_lse, *, is_causal,
                       spec=None, operands=None, **variants):
  """`mosaic_attention`'s out, lse and gradients (scale 0.125) under the
  cotangents d_out and d_lse against the reference with `variants`.
  delta's Triton kernel (`backward.row_delta`), which the Mosaic
  interpreter cannot take, is computed by XLA."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention, backward
  monkeypatch.setattr(backward, "row_delta", lambda out, d_out, **_: (
      jnp.swapaxes(jnp.sum(out.astype(jnp.float32)
                           * d_out.astype(jnp.float32), -1), 1, 2)))

  def attend(q, k, v):
    out, lse = attention.mosaic_attention(
        q, k, v, scale=0.125, is_causal=is_causal, spec=spec,
        operands=operands, backward_blocks=BlockSizes.get_default(q.shape[-1], "NVIDIA H200"))
    return out, jnp.swapaxes(lse, 1, 2)
  names = ("out", "lse", "dq", "dk", "dv")
  ours = mosaic_interpret.run(
      lambda: [forward_and_grads(attend, q, k, v, d_out, d_lse)[n]
               for n in names])
  exact, lowp = reference_gradients(q, k, v, d_out, d_lse, is_causal=is_causal,
                            scale=0.125, **variants)
  for name, got in zip(names, ours):
    assert_within_rule(name, got, exact[name], lowp[name])


@pytest.mark.parametrize("route", ["forward_plain", "backward_plain"])
def test_interpreted_soft_cap_route(monkeypatch, route):
  """`mosaic_attention` of a causal call whose only change is a soft cap:
  "forward_plain" with `plan.PLAIN_SOFTCAP_HEAD_DIMS`, the plain forward
  (the masked one patched to fail) and the masked backward on its
  residuals; "backward_plain" with `plan.PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS`,
  the masked forward and the plain backward (the masked one patched to
  fail). out, lse and gradients under random cotangents against the
  reference. The enclosing program's callback holds a CPU client thread
  beside a kernel's three warpgroups: it runs in the larger pool
  (`test_interpreted_wide_forms_in_a_larger_pool`; on two threads it
  hangs)."""
  from pallas_kernels.mosaic import attention, plan
  _skip_if_too_wide(4)
  plain_forward = route == "forward_plain"

  def refuse(*_, **__):
    raise AssertionError(f"a capped call left the {route} route")
  every = (64, 128, 256)
  monkeypatch.setattr(plan, "PLAIN_SOFTCAP_HEAD_DIMS",
                      every if plain_forward else ())
  monkeypatch.setattr(plan, "PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS",
                      () if plain_forward else every)
  monkeypatch.setattr(attention, "mosaic_forward_masked" if plain_forward
                      else "mosaic_backward_masked", refuse)
  case, cap = Case(1, 200, 200, 2, 1, 64), 10.0
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=14)
  spec = masking.MaskSpec(q_len=200, kv_len=200, is_causal=True,
                          logits_soft_cap=cap)
  _check_plain_route(monkeypatch, q * 4, k, v, d_out, d_lse, is_causal=True,
                     spec=spec, logits_soft_cap=cap)


@pytest.mark.slow  # the whole route (~80 s here); lowered by default
def test_interpreted_alibi_route(monkeypatch):
  """`mosaic_attention` of a causal call whose only change is ALiBi, at a
  length no tile divides: the plain forward and backward with ALiBi's
  column terms (`plan.PLAIN_ALIBI_HEAD_DIMS`; the masked kernels patched
  to fail); out, lse and gradients under random cotangents against the
  reference."""
  from pallas_kernels.mosaic import attention, plan

  def refuse(*_, **__):
    raise AssertionError("a plain ALiBi call reached the masked kernels")
  monkeypatch.setattr(plan, "PLAIN_ALIBI_HEAD_DIMS", (64, 128, 256))
  monkeypatch.setattr(attention, "mosaic_forward_masked", refuse)
  monkeypatch.setattr(attention, "mosaic_backward_masked", refuse)
  case = Case(2, 200, 200, 2, 1, 64)
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=15)
  slopes = jnp.array([[0.5, 0.05], [0.25, 0.125]], jnp.float32)
  spec = masking.MaskSpec(q_len=200, kv_len=200, is_causal=True,
                          has_alibi=True)
  _check_plain_route(monkeypatch, q, k, v, d_out, d_lse, is_causal=True,
                     spec=spec, operands=masking.Operands(alibi_slopes=slopes),
                     alibi_slopes=slopes)


_FP8_LAUNCH = dict(persistent=False)
_FP8_PERSISTENT = dict(persistent=True, num_ctas=3)


@pytest.mark.parametrize("head_dim, block_kv, kv_len, options", [
    (64, 64, 128, _FP8_LAUNCH), (256, 128, 128, _FP8_LAUNCH),
    (128, 256, 512, _FP8_LAUNCH), (64, 64, 197, _FP8_LAUNCH),
    (128, 256, 200, _FP8_LAUNCH), (64, 64, 256, _FP8_LAUNCH),
    (64, 64, 256, _FP8_PERSISTENT), (256, 128, 256, _FP8_PERSISTENT),
    (64, 64, 197, _FP8_PERSISTENT)])
@pytest.mark.parametrize("is_causal", [slow(False), slow(True)])
def test_interpreted_fp8_forward_matches_reference(is_causal, head_dim,
                                                   block_kv, kv_len, options):
  """The FP8 forward (P as wgmma's register operand, V's keys permuted in
  its transpose, `mosaic_interpret` giving `fp8_operand`'s permutation of
  P) against float32 attention within twice the emulated FP8
  arithmetic's error (tests/test_mosaic_fp8.py's rule). GQA 2:1, 128
  keys: two 64-key tiles at d=64; one 128-key tile at d=256, whose O
  leaves in two column pieces (`forward_kernel.FP8_O_COLUMNS`); at d=128
  two of its planned 256-key tiles; key tails, the last block masked past
  kv_len without a causal mask (kv_len 197: K/V rows padded to 200; 200
  on a 256-key tile). Fails if
  V's keys are left in order (error 0.64 against 0.014), if the second
  piece holds the first's columns (3.4-4.7 against 0.2), or if it is
  stored over the first (NaN: the columns never written). Four 64-key
  tiles of two heads' query tiles, launched a head's tiles together; and
  on the persistent grid (`options`): 512 queries, three CTAs walking
  the eight tiles of two heads, each tile's descale row copied in turn
  (head 1's queries 4x head 0's, so a factor read for the wrong head is
  4x off), O (two column pieces at d=256) through the FP8 O buffer, and
  a key tail there (the plan's grid at these lengths,
  `plan.FP8_PERSISTENT_UP_TO`)."""
  from benchmarks.fp8_accuracy import emulated_fp8_attention
  from jax_flash import fp8 as public_fp8
  from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8
  keys = jax.random.split(jax.random.key(21), 3)
  q_len = 512 if options["persistent"] else 128
  q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key, shape in
             zip(keys, ((1, q_len, 2, head_dim), (1, kv_len, 1, head_dim),
                        (1, kv_len, 1, head_dim))))
  if options["persistent"]:
    q = q * jnp.array([1.0, 4.0], jnp.bfloat16)[:, None]
  q8, k8, v8 = (public_fp8.quantize_fp8(x) for x in (q, k, v))
  out, _ = mosaic_interpret.run(
      mosaic_forward_fp8, q8.data, k8.data, v8.data, q_descale=q8.descale,
      k_descale=k8.descale, v_descale=v8.descale, scale=0.125,
      is_causal=is_causal, block_kv=block_kv, **options)
  exact = naive_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                          is_causal=is_causal, scale=0.125)[0]
  emulated = emulated_fp8_attention(q8, k8, v8, is_causal=is_causal,
                                    scale=0.125)[0]
  yardstick = np.abs(np.asarray(emulated) - exact).max()
  assert np.abs(out - exact).max() <= 2 * yardstick + 1e-3


