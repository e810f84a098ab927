"""The masked Mosaic GPU kernels' numerics on a CPU, under JAX's Mosaic GPU
interpreter (`tests/mosaic_interpret.py`), as `test_mosaic_interpret.py` runs
the plain ones: the masked forward's and backward's plan rows, masks, ragged
tiles, score changes (soft cap, ALiBi, `score_fn`), the max-free forward,
sinks, bias and dbias, the FP8 forward with masks, and dropout's kept
weights bit for bit against the Triton kernels', against the reference
with FlashAttention's tolerance rule at small shapes. What the interpreter
cannot see stays with `-m gpu`.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import masking, validation
from jax_flash.reference import naive_attention
from tests import mosaic_interpret
from tests.attention_checks import (Case, assert_forward_within_rule,
                                    assert_within_rule, blocks_and_stripes,
                                    position_score, random_inputs,
                                    reference_gradients)

# `slow` (run by `pytest -m slow`, not by default): cases whose kernel form
# a faster default case already takes, kept for a kernel change's check
# before GPU time; the GPU suite runs them all at realistic sizes.
slow = lambda *values: pytest.param(*values, marks=pytest.mark.slow)

if mosaic_interpret.WHY_NOT is not None:
  pytest.skip(mosaic_interpret.WHY_NOT, allow_module_level=True)
try:
  importlib.import_module("pallas_kernels.mosaic.forward")
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)
# The plain kernels' cases that the masked ones share (head dims computed
# at their own width, a sink per head).
from tests.test_mosaic_interpret import OWN_WIDTH_CASES, SINKS  # noqa: E402


def _segment_ids(*run_lengths):
  """int32 [1, sum(run_lengths)]: ids 0, 1, ... in runs of these lengths."""
  ids = np.repeat(np.arange(len(run_lengths)), run_lengths)
  return jnp.asarray(ids[None], jnp.int32)


def _dense_mask_per_head():
  """bool [1, 2, 100, 200]: head 0 keeps keys 128-199 and a third of the
  rest, head 1 a random 60% with rows 0-9 seeing nothing. No query of the
  first 64 sees keys 64-127, so that a K/V tile's range of Q tiles starts
  past the first (dK/dV's walk from one head's last masked tile to the
  next's first)."""
  i, j = jnp.arange(100)[:, None], jnp.arange(200)
  banded = (j >= 128) | ((i + j) % 3 == 0)
  sparse = jax.random.bernoulli(jax.random.key(8), 0.6, (100, 200))
  sparse = sparse.at[:10].set(False)
  return jnp.stack([banded, sparse])[None].at[:, :, :64, 64:128].set(False)


# name: (case, `flash_attention` mask arguments) for `mosaic_forward_masked`,
# the masks as jax_flash passes them (`validation.normalise_call`); lengths
# that are not multiples of the 64-row tiles (TMA reads past the end fill
# zeros, writes past it are dropped: `mosaic_interpret`'s TMA patches).
MASKED_VARIANTS = {
    # Three 128-row tiles of the forward and dQ grids, whose plan rows
    # take them heaviest first (the last, with every key, first).
    "ragged causal": (Case(1, 260, 200, 1, 1, 64), dict(is_causal=True)),
    # q_offset = kv_len - q_len, GQA 2:1.
    "bottom-right causal": (Case(1, 100, 200, 2, 1, 64),
                            dict(is_causal=True, q_offset=jnp.array([100]))),
    # Blocks left of the window skipped, its edge masked.
    "causal window": (Case(1, 150, 150, 1, 1, 64),
                      dict(is_causal=True, local_window_size=(40, 0))),
    # Per batch: rows past q_length attend to nothing (lse -inf), keys past
    # kv_length are masked, both inside a tile.
    "lengths": (Case(2, 120, 130, 1, 1, 64),
                dict(query_seq_lengths=jnp.array([70, 120]),
                     key_value_seq_lengths=jnp.array([130, 50]))),
    # Not causal, so that it reads the ragged K/V tail.
    "soft cap": (Case(1, 97, 170, 1, 1, 64), dict(logits_soft_cap=5.0)),
    # Rows of two swizzle tiles off the 8-row tiling, read in place as
    # column tiles (`rows.ColumnTiles`), a window over GQA 2:1 heads.
    "window, column tiles": (Case(1, 75, 70, 2, 1, 128),
                             dict(is_causal=True, local_window_size=(20, 0))),
    # A query's and a key's ids, boundaries inside tiles.
    "segments": (Case(1, 100, 150, 1, 1, 64),
                 dict(segment_ids=(_segment_ids(30, 50, 20),
                                   _segment_ids(90, 20, 40)))),
    # ALiBi on every visited tile, a slope per (batch, query head): GQA
    # 2:1 (each head of a K/V tile's group its own in dK/dV),
    # bottom-right causal in one batch, top-left in the other.
    "alibi": (Case(2, 64, 100, 2, 1, 64),
              dict(is_causal=True, q_offset=jnp.array([36, 0]),
                   alibi_slopes=jnp.array([[0.5, 0.25], [0.125, 1.0]]))),
    # Slopes per head; before the soft cap, not causal.
    "alibi soft cap": (Case(1, 97, 170, 2, 1, 64),
                       dict(logits_soft_cap=5.0,
                            alibi_slopes=jnp.array([0.3, 0.05]))),
    # A score_fn of (b, h): GQA 2:1 (dK/dV passes each head of the group
    # its own h), bottom-right causal in one batch.
    "score_fn": (Case(2, 64, 100, 2, 1, 64),
                 dict(is_causal=True, q_offset=jnp.array([36, 0]),
                      score_fn=position_score)),
    # A mask_fn of (b, h): its BlockMask's empty tiles skipped, full ones
    # unmasked, the rest masked head by head (dK/dV: each head of the
    # group); rows past 128 attend to a ragged last block. (The score_fn
    # case checks the batch argument.)
    "mask_fn": (Case(1, 130, 256, 2, 1, 64),
                dict(mask_fn=blocks_and_stripes)),
    # A bias per (batch, head), its sequence axes padded to TMA's 8-row
    # tiling (100 and 150), streamed tile by tile; bottom-right causal.
    "bias": (Case(2, 100, 150, 2, 1, 64),
             dict(is_causal=True, q_offset=jnp.array([50, 0]),
                  bias=2.0 * jax.random.normal(jax.random.key(4),
                                               (2, 2, 100, 150),
                                               jnp.bfloat16))),
    # A bias per (batch, head) and no mask: every tile visited, dbias is
    # the dbias kernel's dS as it is, cut to the lengths.
    "bias, no mask": (Case(2, 100, 150, 2, 1, 64),
                      dict(bias=jax.random.normal(jax.random.key(5),
                                                  (2, 2, 100, 150),
                                                  jnp.bfloat16))),
    # A dense mask per batch beside a bias per head, under a soft cap (the
    # mask after it): both streamed. Batch 0's keeps keys 128-255 and a
    # third of the rest: the first query tile's three K/V tiles masked,
    # unmasked (its mask tile not read), masked; batch 1's is random, rows
    # 0-9 seeing nothing.
    "dense mask, bias": (Case(2, 100, 300, 2, 1, 64),
                         dict(logits_soft_cap=5.0,
                              mask=jnp.stack([
                                  ((jnp.arange(300) >= 128)
                                   & (jnp.arange(300) < 256))
                                  | ((jnp.arange(100)[:, None]
                                      + jnp.arange(300)) % 3 == 0),
                                  jax.random.bernoulli(
                                      jax.random.key(6), 0.6, (100, 300)
                                  ).at[:10].set(False)])[:, None],
                              bias=jax.random.normal(jax.random.key(7),
                                                     (1, 2, 100, 300),
                                                     jnp.bfloat16))),
    # A bias per key (BERT-style padding) broadcast over the heads and
    # queries: a tile's extent of rows, read from its start
    # (`common.repeat_broadcast_axes`); dbias summed over heads and queries.
    # Queries past a tile's extent (200): read from the repeated rows.
    "per-key bias": (Case(1, 200, 150, 2, 1, 64),
                     dict(is_causal=True, q_offset=100,
                          bias=jnp.where(
                              jnp.arange(150) < 90,
                              jax.random.normal(jax.random.key(8), (150,)),
                              -30.0)[None, None, None, :].astype(
                                  jnp.bfloat16))),
    # A bias per query and head, keys past a tile's extent: the dK/dV
    # kernel's streamed axis repeats.
    "per-query bias": (Case(1, 100, 300, 2, 1, 64),
                       dict(bias=jax.random.normal(jax.random.key(9),
                                                   (1, 2, 100, 1),
                                                   jnp.bfloat16))),
    # A dense mask per head, GQA 2:1 (`_dense_mask_per_head`): the
    # backward's dK/dV reads each query head's transposed tiles.
    "dense mask": (Case(1, 100, 200, 2, 1, 64),
                   dict(mask=_dense_mask_per_head())),
    # The reference drops the same weights (`masking.dropout_keep`).
    "dropout": (Case(2, 64, 100, 2, 1, 64),
                dict(is_causal=True, q_offset=jnp.array([36, 0]),
                     dropout_rate=0.3, dropout_rng=jax.random.key(3))),
    # dbias under dropout: the dbias kernel writes dS itself (the kept
    # weights' dP scaled by 1 / (1 - rate), the dropped ones' by 0), the
    # same dS as dQ's and dK's sums take.
    "dropout, bias": (Case(1, 64, 100, 2, 1, 64),
                      dict(dropout_rate=0.3, dropout_rng=jax.random.key(5),
                           bias=jax.random.normal(jax.random.key(6),
                                                  (1, 2, 64, 100),
                                                  jnp.bfloat16))),
}


def _masked_call(q, k, v, variants):
  """(scale, spec, keyword operands) of the masked Mosaic kernels for
  `flash_attention`'s mask arguments `variants`, as jax_flash makes them
  (and the bias, where there is one)."""
  from pallas_kernels.mosaic.attention import masked_operand_kwargs
  call = validation.normalise_call(q, k, v, **variants)
  operands = masked_operand_kwargs(call.operands)
  if call.bias is not None:
    operands["bias"] = call.bias
  return call.scale, call.spec, operands


# Masked forward variants whose masks a default one also takes (the
# bottom-right offset: "alibi", "bias"; the window: lazy rescale's; the
# soft cap: lazy rescale's and "dense mask, bias"'; ALiBi: "alibi"; the
# dense mask and the bias: "dense mask, bias"; "ragged causal": the lazy
# rescale's "soft cap" (97 x 300, causal); lengths: that case's tails and
# the sinks test's kv lengths; dropout: its bits test's forward and the
# backward's "dropout"; the GPU tests take every variant).
_SLOW_MASKED = ("bottom-right causal", "causal window", "soft cap",
                "dense mask", "bias", "bias, no mask", "alibi soft cap",
                "lengths", "dropout", "ragged causal", "window, column tiles",
                "per-query bias", "dropout, bias",
                # `test_broadcast_bias_on_gpu` and the lowering test
                "per-key bias",
                # CI's ten minutes: 12-16 s each interpreted; their GPU
                # twins (`test_masked_kernel_matches_reference_on_gpu`,
                # the lazy rescale's, ALiBi's columns') and lowering tests
                # run, and the Triton kernels take the same masks here
                "alibi", "score_fn", "mask_fn",
                # likewise (19 s): its GPU twin, and the lowering tests'
                # "dense mask" and "bias" forms
                "dense mask, bias")


@pytest.mark.parametrize("name", [slow(n) if n in _SLOW_MASKED else n
                                  for n in MASKED_VARIANTS])
def test_interpreted_mosaic_forward_masked_matches_reference(name):
  """`mosaic_forward_masked`'s out and lse against the float32 reference
  for the same mask arguments, within twice the plain bf16 computation's
  error."""
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  case, variants = MASKED_VARIANTS[name]
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, **operands)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


@pytest.mark.parametrize("name", [slow("causal window"), "soft cap"])
def test_interpreted_lazy_rescale_masked_forward(name):
  """The ranged forward with O rescaled lazily (`lazy_rescale`), against
  the reference as above, with Q times 8 (exact in bf16) so that rows'
  maxima keep moving past the threshold (the soft cap bounds them)."""
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  case, variants = MASKED_VARIANTS[name]
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=13)
  q = q * 8
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, lazy_rescale=True,
                                  **operands)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


# Under -m slow (CI's ten minutes): the masked forward at d=96 runs on the
# GPU ("soft cap, d=96" and its kin), ragged and causal, and here the
# lazy rescale's "soft cap" case is ragged and causal.
@pytest.mark.parametrize("head_dim", [slow(d) for d, _ in OWN_WIDTH_CASES])
def test_interpreted_own_width_masked_forward_matches_reference(head_dim):
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  case, variants = MASKED_VARIANTS["ragged causal"]
  case = Case(1, case.q_len, case.kv_len, 1, 1, head_dim)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, **operands)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


_MAX_FREE_CASES = {
    # Not causal, a ragged K/V tail; Q times 8 so that logits reach the cap.
    "cap 20": dict(logits_soft_cap=20.0),
    # Bottom-right causal with the largest cap it takes, ALiBi before the
    # cap, sinks, and rows that see no key (kv length 0).
    "cap 60 alibi sinks": dict(
        is_causal=True, q_offset=jnp.array([70, 0]), logits_soft_cap=60.0,
        alibi_slopes=jnp.array([0.5, 0.25]),
        key_value_seq_lengths=jnp.array([170, 0]),
        sinks=jnp.array([3.0, -1.0])),
}


@pytest.mark.parametrize("name, fold_cap", [
    # The cap alone folds both its multiplies, beside ALiBi only the one
    # after. (CI's ten minutes: by default the max-free form is the row of
    # one key's test, below, causal with the cap folded.)
    slow("cap 20", False), slow("cap 60 alibi sinks", False),
    slow("cap 20", True), slow("cap 60 alibi sinks", True)])
def test_interpreted_max_free_forward(monkeypatch, name, fold_cap):
  """The masked forward without a running max under a soft cap
  (`KernelStatic.max_free`): out and lse as the reference's; the online
  softmax's `exponentiate` is never called. With `fold_cap`
  (`plan.MASKED_SOFTCAP_FOLDED`) the cap's multiplies are folded into the
  scales (`masking.modify_scores_folded`, counted)."""
  from pallas_kernels import masking
  from pallas_kernels.mosaic import forward_kernel, plan
  from pallas_kernels.mosaic.masked import mosaic_forward_masked

  def no_running_max(*args, **kwargs):
    raise AssertionError("the max-free forward took a running max")
  folds, folded = [], masking.modify_scores_folded

  def counted(*args, **kwargs):
    folds.append(1)
    return folded(*args, **kwargs)
  monkeypatch.setattr(plan, "MASKED_MAX_FREE_HEAD_DIMS", (64,))
  monkeypatch.setattr(plan, "MASKED_SOFTCAP_FOLDED", fold_cap)
  monkeypatch.setattr(forward_kernel, "exponentiate", no_running_max)
  monkeypatch.setattr(masking, "modify_scores_folded", counted)
  case = Case(2, 97, 170, 2, 1, 64)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=8)
  q = q * 8
  variants = dict(_MAX_FREE_CASES[name])
  sinks = variants.pop("sinks", None)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, sinks=sinks,
                                  **operands)
  assert bool(folds) == fold_cap
  assert_forward_within_rule(q, k, v, out, lse, sinks=sinks, **variants)


# CI's ten minutes: the first-step form is off (`plan.MAX_FREE_FIRST_STEP_MAX`).
@pytest.mark.parametrize("row_sums", ["rounded", "mma", slow("first step max")])
def test_interpreted_max_free_row_of_one_key_is_its_value(monkeypatch,
                                                          row_sums):
  """Without a running max (`KernelStatic.max_free`) no weight is exactly 1,
  yet a causal row that sees one key gives exactly that key's value: O is
  normalised by the row sum of P as P V takes it, rounded
  (benchmarks/diagnostics/max_free_rounding: a sum of the unrounded P gave
  V (1 + δ), δ up to 2^-9); the LSE keeps the exact sum. (With a running
  max the row's one weight is exactly 1: `exponentiate` fails the test.)
  Also with that sum taken by the tensor cores (`plan.MAX_FREE_MMA_ROW_SUM`:
  P times a tile of ones), and with each row's max taken on its first step
  and one unrounded sum (`plan.MAX_FREE_FIRST_STEP_MAX`: the row's one
  weight is exactly 1 again; with m = 0 instead the row fails)."""
  from pallas_kernels.mosaic import forward, forward_kernel, plan
  from pallas_kernels.mosaic.masked import mosaic_forward_masked

  def no_running_max(*args, **kwargs):
    raise AssertionError("the max-free forward took a running max")
  monkeypatch.setattr(plan, "MASKED_MAX_FREE_HEAD_DIMS", (64,))
  monkeypatch.setattr(plan, "MAX_FREE_MMA_ROW_SUM", row_sums == "mma")
  monkeypatch.setattr(plan, "MAX_FREE_FIRST_STEP_MAX",
                      row_sums == "first step max")
  monkeypatch.setattr(forward_kernel, "exponentiate", no_running_max)
  statics = []
  launch = forward.launch
  monkeypatch.setattr(forward, "launch", lambda static, *args, **kwargs: (
      statics.append(static), launch(static, *args, **kwargs))[1])
  case = Case(1, 64, 64, 2, 1, 64)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=12)
  q = q * 8
  variants = dict(is_causal=True, logits_soft_cap=5.0)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, **operands)
  np.testing.assert_array_equal(out[:, 0], jnp.broadcast_to(v[:, 0],
                                                            out[:, 0].shape))
  assert_forward_within_rule(q, k, v, out, lse, **variants)
  assert [(s.max_free, s.mma_row_sum, s.first_step_max is not None)
          for s in statics] == [(True, row_sums == "mma",
                                 row_sums == "first step max")]


# CI's ten minutes: the form is off (`plan.MAX_FREE_FIRST_STEP_MAX`) and
# its row of one key's test runs by default.
@pytest.mark.parametrize("floor", [slow(True), slow(False)])
def test_interpreted_first_step_max_needs_its_floor(monkeypatch, floor):
  """Each row's max from its first computed step (`plan.
  MAX_FREE_FIRST_STEP_MAX`) under a causal window of 11 keys and the
  largest cap it takes: the consumers' ranges start at their top rows'
  first block, so rows past key 138 keep no key in their first step (m
  = -inf there) and the early rows' first steps hold logits down to -60.
  With `plan.first_step_max_floor` out and lse are the reference's; with
  no floor (slow, the check that the case needs one) they are not.
  Sinks join the epilogue's denominator."""
  from pallas_kernels.mosaic import plan
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  monkeypatch.setattr(plan, "MASKED_MAX_FREE_HEAD_DIMS", (64,))
  monkeypatch.setattr(plan, "MAX_FREE_FIRST_STEP_MAX", True)
  if not floor:
    monkeypatch.setattr(plan, "first_step_max_floor",
                        lambda cap, dtype: -float("inf"))
  case = Case(1, 256, 256, 2, 1, 64)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=13)
  q = q * 8
  variants = dict(is_causal=True, local_window_size=(10, 0),
                  logits_soft_cap=60.0)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, sinks=SINKS,
                                  **operands)
  if floor:
    assert_forward_within_rule(q, k, v, out, lse, sinks=SINKS, **variants)
  else:
    assert not np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.slow  # CI's ten minutes: the GPU sinks test's "masked" case
def test_interpreted_masked_forward_sinks():
  """`mosaic_forward_masked(sinks=...)` with dropout, and rows that see no
  key (a batch whose kv length is 0): those give out 0 and lse = the
  sink."""
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  case = Case(2, 100, 150, 2, 1, 64)
  variants = dict(is_causal=True, q_offset=jnp.array([50, 0]),
                  key_value_seq_lengths=jnp.array([0, 150]),
                  dropout_rate=0.2, dropout_rng=jax.random.key(1))
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=4)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, sinks=SINKS,
                                  **operands)
  assert not np.any(out[0])
  np.testing.assert_array_equal(lse[0], np.broadcast_to(
      np.asarray(SINKS)[:, None], lse[0].shape))
  assert_forward_within_rule(q, k, v, out, lse, sinks=SINKS, **variants)


@pytest.mark.slow  # the default masked cases with causal ALiBi take the form too
def test_interpreted_alibi_columns_match_reference(monkeypatch):
  """Causal ALiBi as a per-column term with the rows' left in the LSE
  (`common.alibi_columns`): out and lse as the reference's, GQA 2:1,
  bottom-right causal in one batch and top-left in the other."""
  from pallas_kernels.mosaic import plan
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  monkeypatch.setattr(plan, "MASKED_ALIBI_COLUMNS", True)
  case = Case(2, 200, 260, 2, 1, 64)   # two tiles: rows from 0 to 192
  variants = dict(is_causal=True, q_offset=jnp.array([60, 0]),
                  alibi_slopes=jnp.array([[0.5, 0.25], [0.125, 1.0]]))
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, **operands)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


@pytest.mark.parametrize("name, copies", [
    # (Ragged causal rows: the GPU's "soft cap, d=96" and "causal window";
    # "window, column tiles" below is the default masked backward here.)
    slow("ragged causal", None), slow("lengths", None),
    # ALiBi's slopes, mask_fn's and score_fn's h per query head of a K/V
    # tile's group (no copies: with as many copies as the group, each copy
    # is one head).
    # (The dense mask's forward tiles: the forward's default "dense mask,
    # bias"; its transposed per-head tiles, and mask_fn's per-head plan
    # rows, here under -m slow, as are their forwards: CI's ten minutes;
    # their GPU tests and lowering tests run by default.)
    slow("alibi", 1), slow("score_fn", 1), slow("mask_fn", 1),
    slow("dense mask", 1),
    # mask_fn's tiles per head: with a K/V copy per query head the dK/dV
    # plan rows are per K/V head too (`masked.head_plans`).
    slow("mask_fn", 2),
    # Rows of two swizzle tiles read in place as column tiles by the masked
    # dQ and dK/dV kernels (its forward: the plain forward's in-place case).
    ("window, column tiles", None),
    # Dropout's hash and ALiBi's slopes are per query head: on K/V copies
    # (`kv_head_copies`) each copy's heads must still be the call's (under
    # -m slow: the GPU's masked backward tests take dropout on copies, and
    # its bits against Triton's).
    slow("dropout", 2),
    slow("dropout, bias", 1),
    # A bias per (batch, head) in both kernels (dK/dV: each head's
    # transposed tiles) and dbias, dS in bf16 from the dbias kernel;
    # bottom-right causal, so that the tiles the plan skips are never
    # written (the interpreter's outputs start as NaN) and must be zeroed.
    slow("bias", 1),
    # A bias per head broadcast over the batch: dS in float32, summed.
    slow("dense mask, bias", 1),
    # No mask: no tile to zero, dS passed on as it is.
    slow("bias, no mask", 1),
    # Biases broadcast along a sequence axis: per key (both kernels' tiles
    # from a tile's extent of rows; dS in float32, summed over heads and
    # queries) and per query; under -m slow since their GPU test
    # (`test_broadcast_bias_on_gpu`) and lowering test run by default.
    slow("per-key bias", None), slow("per-query bias", None)])
def test_interpreted_mosaic_backward_masked_matches_reference(name, copies,
                                                              monkeypatch):
  """`mosaic_backward_masked`'s dq, dk, dv and dbias (its plan rows,
  padded statistics and ranged kernels) under a random cotangent of out
  and of lse, against the float32 reference's, within twice the plain
  bf16 computation's error. As above, `row_statistics` runs outside the
  interpreter, on the arguments that the masked backward passes it."""
  from pallas_kernels.mosaic import backward
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  case, variants = MASKED_VARIANTS[name]
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=11)
  exact, lowp = reference_gradients(q, k, v, d_out, d_lse, **variants)
  # The kernels' layouts: out like q, lse and d_lse [batch, heads, q_len].
  args = (exact["out"].astype(q.dtype), jnp.swapaxes(exact["lse"], 1, 2),
          d_out, jnp.swapaxes(d_lse, 1, 2))
  stats = backward.row_statistics(*args)

  def precomputed_statistics(*given):
    assert all(a is b for a, b in zip(given, args, strict=True))
    return stats

  monkeypatch.setattr(backward, "row_statistics", precomputed_statistics)
  scale, spec, operands = _masked_call(q, k, v, variants)
  grads = mosaic_interpret.run(mosaic_backward_masked, q, k, v, *args,
                               scale=scale, spec=spec, kv_head_copies=copies,
                               **operands)
  names = ("dq", "dk", "dv") + (("dbias",) if spec.has_bias else ())
  for grad, ours in zip(names, grads):
    assert_within_rule(grad, ours, exact[grad], lowp[grad])


def test_interpreted_padding_bias_at_minus_1e10(monkeypatch):
  """A padding bias of -1e10 (finite, as many codebases write it) on the
  padded keys and on the padded queries' every key: the masked forward
  and backward stay finite and within the rule against the reference
  (the padded queries' cotangents zero, as a masked loss gives them). At
  that magnitude float32's ulp is 1024 and the exponent of P, one FMA,
  can overshoot the row max taken of rounded products: without its cap
  (`softmax.capped_exp2`) 56 rows of O here are NaN."""
  from pallas_kernels.mosaic import backward
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  case = Case(2, 128, 128, 2, 1, 64)
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=3)
  q_valid = jnp.arange(128) < jnp.array([[100], [128]])
  kv_valid = jnp.arange(128) < jnp.array([[90], [128]])
  bias = jnp.where(q_valid[:, :, None] & kv_valid[:, None, :], 0.0,
                   -1e10)[:, None].astype(jnp.bfloat16)
  d_out = jnp.where(q_valid[:, :, None, None], d_out, 0).astype(d_out.dtype)
  d_lse = jnp.where(q_valid[:, :, None], d_lse, 0.0)
  variants = dict(bias=bias, is_causal=True)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, **operands)
  assert bool(jnp.isfinite(out).all())
  assert_forward_within_rule(q, k, v, out, lse, **variants)
  exact, lowp = reference_gradients(q, k, v, d_out, d_lse, **variants)
  args = (exact["out"].astype(q.dtype), jnp.swapaxes(exact["lse"], 1, 2),
          d_out, jnp.swapaxes(d_lse, 1, 2))
  stats = backward.row_statistics(*args)
  monkeypatch.setattr(backward, "row_statistics", lambda *given: stats)
  grads = mosaic_interpret.run(mosaic_backward_masked, q, k, v, *args,
                               scale=scale, spec=spec, **operands)
  for grad, ours in zip(("dq", "dk", "dv", "dbias"), grads):
    assert bool(jnp.isfinite(ours).all()), grad
    assert_within_rule(grad, ours, exact[grad], lowp[grad])


def _check_masked_backward_without_scores(monkeypatch, case, variants, *,
                                          seed, why, flag=None,
                                          q_factor=1.0):
  """`mosaic_backward_masked` under `variants` with `plan.<flag>` (if
  given) on and `masking.modify_scores` patched to fail inside the
  kernels (raising `why`), so that the form under test is the one taken:
  dq, dk, dv (and dbias with a bias) against the reference under random
  cotangents, on the reference's out and lse."""
  from pallas_kernels import masking as kernel_masking
  from pallas_kernels.mosaic import backward, plan
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=seed)
  q = q * q_factor
  exact, lowp = reference_gradients(q, k, v, d_out, d_lse, **variants)
  args = (exact["out"].astype(q.dtype), jnp.swapaxes(exact["lse"], 1, 2),
          d_out, jnp.swapaxes(d_lse, 1, 2))
  scale, spec, operands = _masked_call(q, k, v, variants)

  def refuse(*args, **kwargs):
    raise AssertionError(why)
  if flag is not None:
    monkeypatch.setattr(plan, flag, True)
  monkeypatch.setattr(kernel_masking, "modify_scores", refuse)
  stats = backward.row_statistics(*args)
  monkeypatch.setattr(backward, "row_statistics", lambda *given: stats)
  grads = mosaic_interpret.run(mosaic_backward_masked, q, k, v, *args,
                               scale=scale, spec=spec, **operands)
  names = ("dq", "dk", "dv") + (("dbias",) if "bias" in variants else ())
  for grad, ours in zip(names, grads):
    assert_within_rule(grad, ours, exact[grad], lowp[grad])


@pytest.mark.slow  # the default masked cases with causal ALiBi take the form too
@pytest.mark.parametrize("with_bias", [False, True])
def test_interpreted_alibi_columns_backward(monkeypatch, with_bias):
  """The masked backward with causal ALiBi as a term per key and one per
  query (`BackwardStatic.alibi_columns`): dq, dk, dv (and dbias) as the
  reference's, GQA 2:1, bottom-right causal in one batch, two 128-row
  tiles; no index tile taken."""
  variants = dict(is_causal=True, q_offset=jnp.array([60, 0]),
                  alibi_slopes=jnp.array([[0.5, 0.25], [0.125, 1.0]]))
  if with_bias:
    variants["bias"] = jax.random.normal(jax.random.key(2),
                                         (2, 2, 200, 260), jnp.bfloat16)
  _check_masked_backward_without_scores(
      monkeypatch, Case(2, 200, 260, 2, 1, 64), variants, seed=12,
      flag="MASKED_ALIBI_COLUMNS",
      why="the column form took ALiBi per score")


@pytest.mark.slow  # CI's ten minutes: lowered by default
# (`test_folded_cap_backward_lowers_with_fewer_multiplies`), run on the GPU
def test_interpreted_folded_cap_backward(monkeypatch):
  """The masked backward with the cap's multiplies folded into the scales
  (`BackwardStatic.fold_cap`): dq, dk, dv as the reference's, GQA 2:1,
  causal with query and key tails (two Q tiles, three K/V tiles), logits
  well past the cap (q scaled by 4); the unfolded form not taken."""
  _check_masked_backward_without_scores(
      monkeypatch, Case(1, 72, 130, 2, 1, 64),
      dict(is_causal=True, logits_soft_cap=5.0), seed=15,
      flag="MASKED_BACKWARD_SOFTCAP_FOLDED",
      why="the backward took the unfolded cap", q_factor=4.0)


def test_interpreted_folded_cap_backward_with_dropout(monkeypatch):
  """The masked dK/dV and dQ kernels with the folded cap and dropout, dK/dV
  taking Pᵀ ∘ slope and dV's 16-bit Pᵀ before dPᵀ's wait
  (`BackwardStatic.cap_slope_ahead`; dropout's sign code rides on P ∘
  slope, the slope >= 0), both hashing the kept weights after S is read:
  dq, dk, dv against the reference's, GQA 2:1, causal with tails."""
  _check_masked_backward_without_scores(
      monkeypatch, Case(1, 72, 130, 2, 1, 64),
      dict(is_causal=True, logits_soft_cap=5.0, dropout_rate=0.2,
           dropout_rng=jax.random.key(4)), seed=16,
      flag="MASKED_BACKWARD_SOFTCAP_FOLDED",
      why="the backward took the unfolded cap", q_factor=4.0)


def test_interpreted_dropout_backward(monkeypatch):
  """Both masked backward kernels with dropout alone, the kept weights
  hashed after S (Sᵀ) is read: dq, dk, dv against the reference's (the
  same bits), GQA 2:1, causal with tails; no score change taken."""
  _check_masked_backward_without_scores(
      monkeypatch, Case(1, 72, 130, 2, 1, 64),
      dict(is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(7)),
      seed=17, why="dropout took the score path")


# name: flash_attention mask arguments of the FP8 kernel
# with masks (the masked kernel's plan rows): [2, 100, 2, 64] queries on
# [2, 200, 1, 64] keys (GQA 2:1, kv_len no multiple of the 64-key tiles).
_FP8_MASKED_VARIANTS = {
    # Bottom-right causal with a window, per batch; keys past a length.
    "window lengths": (dict(is_causal=True, q_offset=jnp.array([100, 30]),
                            local_window_size=(70, 0),
                            key_value_seq_lengths=jnp.array([200, 90]))),
    # Score changes on the true (descaled) scores, segment ids.
    "soft cap alibi segments": (dict(
        logits_soft_cap=5.0, alibi_slopes=jnp.array([0.3, 0.05]),
        segment_ids=(jnp.repeat(jnp.array([0, 1]), 50),
                     jnp.repeat(jnp.array([0, 1]), 100)))),
    # A dense mask per batch, a mask_fn and a score_fn of (b, h).
    "dense mask_fn score_fn": (dict(
        mask=jax.random.bernoulli(jax.random.key(9), 0.7, (2, 1, 100, 200)),
        mask_fn=blocks_and_stripes, score_fn=position_score)),
}


@pytest.mark.parametrize("name", [slow(n) for n in _FP8_MASKED_VARIANTS])
def test_interpreted_fp8_forward_with_masks(name):
  """The FP8 forward on the masked kernel's plan rows against float32
  attention on the dequantised inputs with the same masks, within twice
  the emulated FP8 arithmetic's error (`emulated_fp8_attention` with the
  masks). The soft cap fails it when applied to S before the Q and K
  factors (error 1.07 against 0.021)."""
  from benchmarks.fp8_accuracy import emulated_fp8_attention
  from jax_flash import fp8 as public_fp8
  from pallas_kernels.mosaic.attention import masked_operand_kwargs
  from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8
  variants = _FP8_MASKED_VARIANTS[name]
  variants = {n: jnp.broadcast_to(x, (2, *x.shape[1:]))
              if n == "alibi_slopes" else x for n, x in variants.items()}
  keys = jax.random.split(jax.random.key(5), 3)
  q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key, shape in
             zip(keys, ((2, 100, 2, 64), (2, 200, 1, 64), (2, 200, 1, 64))))
  q8, k8, v8 = (public_fp8.quantize_fp8(x) for x in (q, k, v))
  call = validation.normalise_call(q, k, v, scale=0.125, **variants)
  operands = {n: x for n, x in masked_operand_kwargs(call.operands).items()
              if x is not None}
  out, _ = mosaic_interpret.run(
      mosaic_forward_fp8, q8.data, k8.data, v8.data, q_descale=q8.descale,
      k_descale=k8.descale, v_descale=v8.descale, scale=0.125,
      is_causal=call.spec.is_causal, spec=call.spec, block_kv=64,
      **operands)
  dequantised = [x.dequantize() for x in (q8, k8, v8)]
  exact = naive_attention(*dequantised, scale=0.125, **variants)[0]
  emulated = emulated_fp8_attention(q8, k8, v8, scale=0.125, **variants)[0]
  yardstick = np.abs(np.asarray(emulated) - exact).max()
  assert np.abs(out - exact).max() <= 2 * yardstick + 1e-3


@pytest.mark.slow  # CI's ten minutes: `test_dropout_bits_match_triton_on_gpu`
def test_interpreted_dropout_drops_the_triton_kernels_bits(monkeypatch):
  """The masked Mosaic kernels drop exactly the weights the Triton kernels
  drop (and `masking.dropout_keep` says), recovered bit for bit from their
  results: with Q = 0 every kept weight is 1 / kv_len, and with V the
  identity over the keys, O[i, j] is weight (i, j) times 1 / (1 - rate),
  nonzero exactly where kept; with dO the identity over the queries, dV of
  the dK/dV kernel (its Sᵀ tiles) is the transpose. Two heads (two
  streams; the batch's part of the stream is checked against the
  reference by the "dropout" variant), two 64-key tiles. Also: the LSE is
  log(kv_len), dropout's excluded, as in the reference."""
  from pallas_kernels.mosaic import backward
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  batch, q_len, kv_len, heads, dim, rate = 1, 64, 128, 2, 128, 0.3
  q = jnp.zeros((batch, q_len, heads, dim), jnp.bfloat16)
  k = jax.random.normal(jax.random.key(1), (batch, kv_len, heads, dim),
                        jnp.bfloat16)
  identity = lambda n: jnp.broadcast_to(
      jnp.eye(n, dim, dtype=jnp.bfloat16)[None, :, None],
      (batch, n, heads, dim))
  variants = dict(dropout_rate=rate, dropout_rng=jax.random.key(42))
  scale, spec, operands = _masked_call(q, k, identity(kv_len), variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k,
                                  identity(kv_len), scale=scale, spec=spec,
                                  block_kv=64, **operands)
  triton_out = jax_flash.flash_attention(q, k, identity(kv_len),
                                         implementation="triton",
                                         interpret=True, **variants)
  expected = np.asarray(masking.dropout_keep(
      operands["dropout_seed"], np.arange(batch)[:, None, None, None],
      np.arange(heads)[None, None, :, None],
      np.arange(q_len)[None, :, None, None],
      np.arange(kv_len)[None, None, None, :], rate))   # [b, q, h, kv]
  np.testing.assert_array_equal(out[..., :kv_len] != 0, expected)
  np.testing.assert_array_equal(np.asarray(triton_out, np.float32) != 0,
                                expected)
  kept_weight = np.float32(jnp.bfloat16(1 / (kv_len * (1 - rate))))
  np.testing.assert_array_equal(out[..., :kv_len][expected], kept_weight)
  np.testing.assert_allclose(lse, np.log(kv_len), rtol=1e-6)

  d_out = identity(q_len)
  args = (jnp.asarray(out, jnp.bfloat16), jnp.asarray(lse), d_out,
          jnp.zeros_like(lse))
  stats = backward.row_statistics(*args)
  monkeypatch.setattr(backward, "row_statistics", lambda *given: stats)
  _, _, dv, _ = mosaic_interpret.run(mosaic_backward_masked, q, k,
                                  identity(kv_len), *args, scale=scale,
                                  spec=spec, **operands)
  # dv [b, kv, h, i] = kept (i, kv) weight of head h.
  np.testing.assert_array_equal(dv[..., :q_len] != 0,
                                expected.transpose(0, 3, 2, 1))
