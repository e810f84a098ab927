"""Masks and score changes in the Triton kernels against the reference.

Every variant alone and in the combinations users need, forward, LSE and all
gradients (dbias and dsinks too), in interpret mode on awkward shapes.
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_flash
from jax_flash import BlockMask, BlockSizes
from tests.attention_checks import (Case, check_against_reference,
                                   forward_and_grads, random_inputs,
                                   triton_attention)

BLOCKS = BlockSizes(block_q=32, block_k=16, block_q_dkv=16, block_kv_dkv=32,
                    block_q_dq=32, block_kv_dq=16)
CASE = Case(2, 70, 90, 4, 2, 40)        # GQA 4:2, tails, padded head dim
SELF = Case(2, 83, 83, 4, 1, 32)        # self-attention, MQA


def _segments(lengths, total):
  """int32 [batch, total]: consecutive runs of the given lengths per row."""
  rows = []
  for row in lengths:
    ids = np.repeat(np.arange(len(row)), row)[:total]
    rows.append(np.pad(ids, (0, total - len(ids)), constant_values=len(row)))
  return jnp.asarray(np.stack(rows), jnp.int32)


def _triton(**variants):
  return triton_attention(BLOCKS, **variants)


def _check(case, dtype=jnp.float32, **variants):
  check_against_reference(_triton(**variants), case, dtype, seed=7,
                          **variants)


SEG_Q = _segments([[10, 25, 35], [70]], 70)
SEG_K = _segments([[12, 30, 48], [40, 50]], 90)
SEG_SELF = _segments([[20, 30, 33], [5, 40, 38]], 83)

VARIANTS = {
    "window": (CASE, dict(local_window_size=(9, 4))),
    "window-int": (SELF, dict(local_window_size=6)),
    "causal+window+segments": (SELF, dict(is_causal=True,
                                          local_window_size=(20, 0),
                                          segment_ids=SEG_SELF)),
    "bottom-right-causal": (CASE, dict(is_causal=True, q_offset=20)),
    "q_offset-per-batch": (CASE, dict(is_causal=True,
                                      q_offset=jnp.array([0, 33]))),
    "lengths+gqa": (CASE, dict(query_seq_lengths=jnp.array([70, 31]),
                               key_value_seq_lengths=jnp.array([17, 90]))),
    "zero-length-rows": (CASE, dict(key_value_seq_lengths=jnp.array([0, 50]))),
    "segments-cross": (CASE, dict(segment_ids=(SEG_Q, SEG_K))),
    "softcap+causal": (SELF, dict(is_causal=True, logits_soft_cap=1.5)),
    "alibi": (CASE, dict(alibi_slopes=jnp.array([0.5, 0.25, 0.125, 0.0625]))),
    "alibi-per-batch": (SELF, dict(is_causal=True,
                                   alibi_slopes=jnp.arange(8.0).reshape(2, 4)
                                   / 8)),
    "dense-mask": (CASE, dict(mask=jax.random.bernoulli(
        jax.random.key(1), 0.6, (2, 1, 70, 90)))),
    "float-mask": (SELF, dict(mask=jnp.tril(jnp.ones((1, 1, 83, 83))))),
    # Blocks of 32 positions, shifted per head: whole tiles kept or empty
    # (skipped and unmasked from the mask's own classification), differing
    # between the heads of a K/V group.
    "dense-mask-blocks": (CASE, dict(mask=jnp.stack([
        jnp.arange(70)[:, None] // 32 == (jnp.arange(90) + 16 * h) // 32
        for h in range(4)])[None])),
    "mask_fn+score_fn": (CASE, dict(
        mask_fn=lambda b, h, i, j: ((i // 16 + j // 16 + h) % 3) != 0,
        score_fn=lambda s, b, h, i, j: s * (1.0 + 0.25 * h) - 0.01 * (i - j))),
    "dropout": (CASE, dict(dropout_rate=0.3,
                           dropout_rng=jax.random.key(42))),
    "dropout+causal+gqa": (SELF, dict(is_causal=True, dropout_rate=0.1,
                                      dropout_rng=jax.random.key(3))),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_reference(name):
  case, variants = VARIANTS[name]
  _check(case, **variants)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
def test_half_precision_variants(dtype):
  _check(SELF, dtype, is_causal=True, local_window_size=(16, 0),
         segment_ids=SEG_SELF, logits_soft_cap=5.0)


# Full and per-key with `-m slow` (CI's ten minutes, ~10 s each): the
# broadcast bias's reductions by per-query, a [heads, q, k] bias and its
# gradient on Triton by `test_attention.py::test_unbatched_inputs_and_low_
# rank_bias_like_jax_nn`, every shape by the GPU tests.
@pytest.mark.parametrize("bias_shape", [
    pytest.param((2, 4, 70, 90), marks=pytest.mark.slow),
    pytest.param((1, 4, 1, 90), marks=pytest.mark.slow), (2, 1, 70, 1)],
                         ids=["full", "per-key", "per-query"])
def test_bias_and_its_gradient(bias_shape):
  q, k, v, d_out, _ = random_inputs(CASE, jnp.float32, 5)
  bias = jax.random.normal(jax.random.key(9), bias_shape)

  def loss(fn, q, k, v, bias, **kw):
    return jnp.sum(fn(q, k, v, bias, is_causal=True, **kw) * d_out)

  got = jax.grad(loss, (1, 2, 3, 4))(jax_flash.flash_attention, q, k, v,
                                     bias, implementation="triton",
                                     block_sizes=BLOCKS)
  want = jax.grad(loss, (1, 2, 3, 4))(jax_flash.attention_reference, q, k, v,
                                      bias)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, (q, k, v, bias))
  for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
    np.testing.assert_allclose(g, w, atol=2e-5 * max(1, np.abs(w).max()),
                               err_msg=name)


# Bool masks the same for every head that vary along one sequence axis
# (`validation._vector_mask_as_segments`); batch 0 of "per batch" keeps
# nothing, and "query rows" drops whole rows: zeros there.
VECTOR_MASKS = {
    "key padding [b, 1, 1, kv]": (2, 1, 1, 90),
    "keys, no batch axis [kv]": (90,),
    "query rows [b, 1, q, 1]": (2, 1, 70, 1),
    "per batch [b, 1, 1, 1]": (2, 1, 1, 1),
}


def _causal_triton_and_reference(inputs, kernel_kwargs, reference_kwargs):
  """`forward_and_grads` of the causal Triton kernels with `kernel_kwargs`
  and of the reference with `reference_kwargs` on `inputs` (q, k, v, d_out,
  d_lse), asserted equal to float32 rounding; returns both."""
  got = forward_and_grads(_triton(is_causal=True, **kernel_kwargs), *inputs)
  want = forward_and_grads(functools.partial(
      jax_flash.attention_reference, is_causal=True, return_residual=True,
      **reference_kwargs), *inputs)
  chex.assert_trees_all_close(got, want, atol=2e-5)
  return got, want


@pytest.mark.parametrize("name", [
    name if i % 2 == 0 else pytest.param(name, marks=pytest.mark.slow)
    for i, name in enumerate(VECTOR_MASKS)])  # half by default: CI's time
def test_vector_masks_run_as_segment_ids(name):
  """Such a mask becomes segment ids (no dense mask operand), and the
  output and gradients equal the reference's under the same mask given
  for every head (a dense mask, not converted), causal, random
  cotangent."""
  from jax_flash import validation
  shape = VECTOR_MASKS[name]
  mask = jax.random.bernoulli(jax.random.key(2), 0.6, shape)
  if name.startswith("per batch"):
    mask = mask.at[0].set(False).at[1].set(True)
  q, k, v, d_out, d_lse = random_inputs(CASE, jnp.float32, 10)
  call = validation.normalise_call(q, k, v, mask=mask)
  assert call.operands.dense_mask is None and call.spec.has_segments
  per_head = jnp.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + shape),
                              (2, 4, 70, 90))

  got, want = _causal_triton_and_reference(
      (q, k, v, d_out, d_lse), dict(mask=mask), dict(mask=per_head))
  if name.startswith("per batch"):
    assert float(jnp.abs(got["out"][0]).max()) == 0.0


def test_padding_bias_at_float32_lowest_empties_its_rows():
  """A bias of `finfo(float32).min` on every key of a batch (HF's and
  Flax's padding bias over a sequence of length 0): its rows give zeros
  and zero gradients in the kernels and in the reference alike
  (`masking.LOWEST_LOGIT`), the other batch's rows as without it."""
  q, k, v, d_out, d_lse = random_inputs(CASE, jnp.float32, 12)
  bias = jnp.where(jnp.arange(90) < jnp.array([[60], [0]]), 0.0,
                   jnp.finfo(jnp.float32).min)[:, None, None, :]
  got, want = _causal_triton_and_reference(
      (q, k, v, d_out, d_lse), dict(bias=bias), dict(bias=bias))
  assert float(jnp.abs(want["out"][1]).max()) == 0.0
  assert float(jnp.abs(want["dq"][1]).max()) == 0.0


@pytest.mark.parametrize("form", ["bias", "score_fn"])
def test_padding_at_minus_1e10_stays_finite(form):
  """Padding by a large finite logit, as many codebases write it: a bias of
  -1e10 on the padded keys and queries (rows of nothing but padding), or a
  `score_fn` setting them there. float32 keeps no part of q·k at that
  magnitude (an ulp is 1024), and P's exponent there needs the kernels' cap
  (`triton.common.weights`; without it such rows are NaN, and so is dK).
  Out, the LSE and the gradients (padded rows' cotangents zero, as a masked
  loss gives them) are the reference's, causal, GQA, tails."""
  q, k, v, d_out, d_lse = random_inputs(CASE, jnp.float32, 14)
  q_valid = jnp.arange(70) < jnp.array([[50], [70]])
  kv_valid = jnp.arange(90) < jnp.array([[60], [90]])
  pair = q_valid[:, :, None] & kv_valid[:, None, :]
  d_out = jnp.where(q_valid[:, :, None, None], d_out, 0.0)
  d_lse = jnp.where(q_valid[:, :, None], d_lse, 0.0)
  if form == "bias":
    kwargs = dict(bias=jnp.where(pair, 0.0, -1e10)[:, None])
  else:
    kwargs = dict(score_fn=lambda s, b, h, i, j: jnp.where(
        (i < jnp.where(b == 0, 50, 70)) & (j < jnp.where(b == 0, 60, 90)),
        s, -1e10))
  got, want = _causal_triton_and_reference(
      (q, k, v, d_out, d_lse), kwargs, kwargs)
  chex.assert_tree_all_finite(got)


def test_sinks_and_their_gradient():
  q, k, v, d_out, _ = random_inputs(CASE, jnp.float32, 6)
  sinks = jnp.array([0.5, -1.0, 2.0, 0.0])

  def loss(fn, q, sinks, **kw):
    return jnp.sum(fn(q, k, v, sinks=sinks, is_causal=True, **kw) * d_out)

  got = jax.grad(loss, (1, 2))(jax_flash.flash_attention, q, sinks,
                               implementation="triton", block_sizes=BLOCKS)
  want = jax.grad(loss, (1, 2))(jax_flash.attention_reference, q, sinks)
  chex.assert_trees_all_close(got, want, atol=2e-5)


def test_fully_masked_rows_are_zero_with_zero_gradients():
  q, k, v, d_out, _ = random_inputs(CASE, jnp.float32, 8)
  variants = dict(key_value_seq_lengths=jnp.array([0, 90]),
                  segment_ids=(SEG_Q, jnp.full((2, 90), 99, jnp.int32)))

  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, implementation="triton",
                                     block_sizes=BLOCKS, return_residual=True,
                                     **variants)

  (out, lse), vjp = jax.vjp(attention, q, k, v)
  grads = vjp((d_out, jnp.ones_like(lse)))
  assert not np.any(out) and np.all(lse == -np.inf)
  chex.assert_tree_all_finite(grads)
  chex.assert_trees_all_equal(grads, jax.tree.map(jnp.zeros_like, grads))


def test_dropout_is_deterministic_and_keeps_the_expected_fraction():
  kept = jax_flash.masking.dropout_keep(
      jnp.int32(123), jnp.arange(2)[:, None, None, None],
      jnp.arange(3)[None, :, None, None], jnp.arange(64)[None, None, :, None],
      jnp.arange(64)[None, None, None, :], 0.25)
  assert abs(float(kept.mean()) - 0.75) < 0.01
  q, k, v, _, _ = random_inputs(CASE, jnp.float32, 2)
  run = lambda key: jax_flash.flash_attention(
      q, k, v, dropout_rate=0.5, dropout_rng=key, implementation="triton",
      block_sizes=BLOCKS)
  a, b, c = run(jax.random.key(1)), run(jax.random.key(1)), run(
      jax.random.key(2))
  chex.assert_trees_all_equal(a, b)
  assert not np.allclose(a, c)


def test_dropout_rate_is_applied_in_steps_of_1_256():
  """0.1 drops the weights 26/256 drops, and scales the kept ones by
  256/230, as the reference does; the fraction dropped is 26/256's."""
  q, k, v, _, _ = random_inputs(CASE, jnp.float32, 3)
  run = lambda fn, rate: fn(q, k, v, dropout_rate=rate,
                            dropout_rng=jax.random.key(4), is_causal=True)
  triton = functools.partial(jax_flash.flash_attention,
                             implementation="triton", block_sizes=BLOCKS)
  chex.assert_trees_all_equal(run(triton, 0.1), run(triton, 26 / 256))
  chex.assert_trees_all_equal(run(jax_flash.attention_reference, 0.1),
                              run(jax_flash.attention_reference, 26 / 256))
  kept = jax_flash.masking.dropout_keep(
      jnp.int32(9), 0, 0, jnp.arange(512)[:, None], jnp.arange(512)[None],
      0.1)
  assert abs(float(1 - kept.mean()) - 26 / 256) < 0.004  # 3 sigma


def test_block_mask_is_reusable_and_skips_empty_tiles():
  mask_fn = lambda b, h, i, j: (i // 32) == (j // 32)   # block diagonal
  block_mask = BlockMask.from_mask_fn(mask_fn, batch=1, num_heads=1,
                                      q_len=128, kv_len=128, per_batch=False,
                                      per_head=False)
  states = np.asarray(block_mask.coarsen(32, 32))[0, 0]
  np.testing.assert_array_equal(states, 2 * np.eye(4, dtype=int))
  q, k, v, _, _ = random_inputs(Case(1, 128, 128, 2, 2, 16), jnp.float32, 3)
  got = jax_flash.flash_attention(q, k, v, mask_fn=block_mask,
                                  implementation="triton", block_sizes=BLOCKS)
  want = jax_flash.attention_reference(q, k, v, mask_fn=mask_fn)
  np.testing.assert_allclose(got, want, atol=2e-6)


def test_block_mask_of_larger_tiles_than_a_short_call_takes():
  """A BlockMask kept at 64 x 64 over a call of 20 x 30 tokens, whose
  kernel tiles shrink below it: each kernel tile takes its BlockMask
  tile's state (`BlockMask.coarsen`'s finer tiles)."""
  mask_fn = lambda b, h, i, j: (i + j) % 3 != 0
  block_mask = BlockMask.from_mask_fn(mask_fn, batch=1, num_heads=1,
                                      q_len=20, kv_len=30, tile=64)
  q, k, v, _, _ = random_inputs(Case(1, 20, 30, 2, 1, 16), jnp.float32, 5)
  got = jax_flash.flash_attention(q, k, v, mask_fn=block_mask,
                                  implementation="triton", interpret=True)
  want = jax_flash.attention_reference(q, k, v, mask_fn=mask_fn)
  np.testing.assert_allclose(got, want, atol=2e-6)


def test_variants_under_jit_and_vmap():
  q, k, v, _, _ = random_inputs(SELF, jnp.float32, 4)
  variants = dict(is_causal=True, segment_ids=SEG_SELF,
                  query_seq_lengths=jnp.array([83, 40]))
  run = jax.jit(lambda q, k, v, seg: jax_flash.flash_attention(
      q, k, v, implementation="triton", block_sizes=BLOCKS, is_causal=True,
      segment_ids=seg))
  np.testing.assert_allclose(
      run(q, k, v, SEG_SELF),
      jax_flash.attention_reference(q, k, v, is_causal=True,
                                    segment_ids=SEG_SELF), atol=2e-6)
  stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
  got = jax.vmap(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, implementation="triton", block_sizes=BLOCKS, **variants))(
          *stacked)
  want = jax.vmap(lambda q, k, v: jax_flash.attention_reference(
      q, k, v, **variants))(*stacked)
  np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(local_window_size=-1), ValueError, "local_window_size must be >= 0"),
    (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
    (dict(alibi_slopes=jnp.ones(3)), ValueError, r"alibi_slopes must have"),
    (dict(segment_ids=jnp.zeros((2, 7), jnp.int32)), ValueError,
     r"q_len == kv_len"),
    (dict(segment_ids=(jnp.zeros((2, 9), jnp.int32),
                       jnp.zeros((2, 12), jnp.int32))), ValueError,
     r"segment_ids \(query\) must have shape \(2, 8\)"),
    (dict(segment_ids=(jnp.zeros((2, 8)), jnp.zeros((2, 12)))), TypeError,
     "integer"),
    (dict(dropout_rate=0.1), ValueError, "needs a dropout_rng"),
    (dict(dropout_rate=-0.1), ValueError, r"dropout_rate must be"),
    (dict(query_seq_lengths=jnp.array([9, 1])), ValueError,
     r"query_seq_lengths must lie in \[0, 8\]"),
    (dict(key_value_seq_lengths=jnp.array([1])), ValueError,
     r"key_value_seq_lengths must have shape \(2,\)"),
    (dict(q_offset=jnp.array([1.0, 2.0])), TypeError, "q_offset"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be > 0"),
    (dict(bias=jnp.ones((2, 3, 8, 12))), ValueError,
     r"bias must be broadcastable to .* \(2, 4, 8, 12\)"),
    (dict(mask=jnp.ones((3, 8, 12), bool)), ValueError,
     r"mask must be broadcastable.*got \(3, 8, 12\)"),
    (dict(mask=jnp.ones((1, 2, 4, 8, 12), bool)), ValueError,
     r"mask must be broadcastable.*rank at most 4"),
    (dict(query_seq_lengths=jnp.array([[1, 2]])), ValueError,
     r"query_seq_lengths must have shape \(2,\) \(or \(\)"),
    (dict(mask_fn=3), TypeError, "mask_fn must be callable"),
    # A BlockMask built for other lengths would skip the wrong tiles.
    (dict(mask_fn=BlockMask.from_mask_fn(lambda b, h, i, j: i >= j, batch=2,
                                         num_heads=4, q_len=8, kv_len=8)),
     ValueError, r"BlockMask has states \(1, 1, 1, 1\).*kv_len 12"),
    (dict(mask_fn=BlockMask.from_mask_fn(lambda b, h, i, j: i + b >= j,
                                         batch=3, num_heads=4, q_len=8,
                                         kv_len=12)),
     ValueError, r"BlockMask has states \(3, 1, 1, 1\)"),
    (dict(sinks=jnp.ones(3)), ValueError, r"sinks must have shape"),
])
def test_bad_variant_arguments(kwargs, error, match):
  q = jnp.ones((2, 8, 4, 16))
  kv = jnp.ones((2, 12, 2, 16))
  for fn in (jax_flash.flash_attention, jax_flash.attention_reference):
    with pytest.raises(error, match=match):
      fn(q, kv, kv, **kwargs)


@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_random_variant_combinations(data):
  """Hypothesis picks a shape and a set of variants; kernel == reference."""
  q_len = data.draw(st.integers(1, 60), "q_len")
  kv_len = data.draw(st.integers(1, 60), "kv_len")
  case = Case(2, q_len, kv_len, 2, data.draw(st.sampled_from([1, 2])), 16)
  variants = {}
  if data.draw(st.booleans(), "causal"):
    variants["is_causal"] = True
  if data.draw(st.booleans(), "window"):
    variants["local_window_size"] = (data.draw(st.integers(0, 20)),
                                     data.draw(st.integers(0, 20)))
  if data.draw(st.booleans(), "offset"):
    variants["q_offset"] = jnp.asarray(
        data.draw(st.lists(st.integers(-5, 30), min_size=2, max_size=2)))
  if data.draw(st.booleans(), "lengths"):
    variants["key_value_seq_lengths"] = jnp.asarray(data.draw(
        st.lists(st.integers(0, kv_len), min_size=2, max_size=2)))
  if data.draw(st.booleans(), "softcap"):
    variants["logits_soft_cap"] = data.draw(st.floats(0.5, 10.0))
  _check(case, **variants)


def test_alibi_slopes_take_no_gradient_anywhere():
  """`alibi_slopes` are not differentiated: every implementation and the
  reference give them a zero gradient (the kernels take none, so XLA and
  the reference stop it too), and q's gradients agree."""
  q, k, v, d_out, _ = random_inputs(CASE, jnp.float32, 15)
  slopes = jnp.array([0.3, 0.1, 0.05, 0.2])

  def loss(fn, q, slopes, **kw):
    return jnp.sum(fn(q, k, v, alibi_slopes=slopes, is_causal=True, **kw)
                   * d_out)
  runs = [(jax_flash.attention_reference, {}),
          (jax_flash.flash_attention, dict(implementation="xla")),
          (jax_flash.flash_attention, dict(implementation="triton",
                                           block_sizes=BLOCKS))]
  grads = [jax.grad(loss, (1, 2))(fn, q, slopes, **kw) for fn, kw in runs]
  for dq, d_slopes in grads:
    np.testing.assert_array_equal(d_slopes, 0.0)
    np.testing.assert_allclose(dq, grads[0][0], atol=2e-5)
