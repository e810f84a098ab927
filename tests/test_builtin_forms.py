"""`score_fn` and `mask_fn` run as the built-ins (`jax_flash.builtin_forms`):
which functions are read as ALiBi, a soft cap, a causal mask or a window,
with which slopes, row shifts and bounds, and that the kernels then give
the reference's numbers for the function as written (out, LSE and
gradients)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_flash
from jax_flash import BlockSizes, builtin_forms, validation
from tests.attention_checks import (Case, check_against_reference,
                                   position_score, triton_attention)

BLOCKS = BlockSizes(block_q=32, block_k=16, block_q_dkv=16, block_kv_dkv=32,
                    block_q_dq=32, block_kv_dq=16)


def alibi_abs(s, b, h, q_idx, kv_idx):
  """ALiBi as `benchmarks.masks` writes it: -slope |q - kv|."""
  del b
  slope = jnp.exp2(-(h + 1).astype(jnp.float32))
  return s - slope * jnp.abs(q_idx - kv_idx).astype(jnp.float32)


def alibi_linear(s, b, h, q_idx, kv_idx):
  """FlexAttention's form: slope (kv - q), a slope chosen by `where`."""
  del b
  slope = jnp.where(h % 2 == 0, 0.25, 0.125) / (h + 1)
  return s + slope * (kv_idx - q_idx)


def shifted_rows(s, b, h, q_idx, kv_idx):
  """Linear in the positions with a per-row remainder: q's slope is not
  -kv's, and a constant per (b, h)."""
  return s + 0.03 * (h + 1) * kv_idx - 0.01 * q_idx + 0.5 * b - 0.2 * h


def _slopes(form):
  return np.asarray(form.slopes)


def test_alibi_as_abs_is_read_with_its_slopes():
  form = builtin_forms.score_form(alibi_abs, batch=2, num_heads=3,
                                abs_sign_known=True)
  np.testing.assert_array_equal(_slopes(form), [[0.5, 0.25, 0.125]] * 2)
  assert not form.shifts_rows


def test_linear_alibi_is_read_with_where_slopes():
  form = builtin_forms.score_form(alibi_linear, batch=1, num_heads=4,
                                abs_sign_known=False)
  np.testing.assert_allclose(_slopes(form),
                             [[0.25, 0.125 / 2, 0.25 / 3, 0.125 / 4]])
  assert not form.shifts_rows


def test_row_remainder_is_kept_as_a_shift():
  form = builtin_forms.score_form(shifted_rows, batch=2, num_heads=2,
                                abs_sign_known=False)
  np.testing.assert_allclose(_slopes(form), [[0.03, 0.06]] * 2, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(form.row_slope),
                             [[0.02, 0.05]] * 2, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(form.row_const),
                             [[0.0, -0.2], [0.5, 0.3]], rtol=1e-6)


@pytest.mark.parametrize("score_fn, sign_known", [
    (alibi_abs, False),  # abs without a causal mask's sign
    (lambda s, b, h, q, k: s + 0.1 * jnp.abs(q - 2 * k), True),
    (lambda s, b, h, q, k: s + 0.01 * (q * k), True),   # a product
    (lambda s, b, h, q, k: 2.0 * s + 0.1 * (k - q), True),  # s not added
    (lambda s, b, h, q, k: s + jnp.where(q > k, 0.0, 1.0), True),
    (lambda s, b, h, q, k: 5.0 * jnp.tanh(s / 4.0), True),  # not a cap
    (lambda s, b, h, q, k: 5.0 * jnp.tanh(s / 5.0) + 0.1, True),
    (position_score, True),  # a cap that depends on b and h
    (lambda s, b, h, q, k: s + jnp.sqrt((k - q).astype(jnp.float32)), True),
    (lambda s, b, h, q, k: s + ((q - k) // 3).astype(jnp.float32), True),
    (lambda s, b, h, q, k: s + lax.div(q - k, 3).astype(jnp.float32), True),
    (lambda s, b, h, q, k: (s.astype(jnp.bfloat16) + 0.5).astype(
        jnp.float32), True),  # a rounding of the score
    (lambda s, b, h, q, k: s + (k - q).astype(jnp.bfloat16).astype(
        jnp.float32), True),
])
def test_other_functions_stay_opaque(score_fn, sign_known):
  assert builtin_forms.score_form(score_fn, batch=1, num_heads=2,
                                abs_sign_known=sign_known) is None


def capped_alibi(s, b, h, q_idx, kv_idx):
  """Gemma's cap over FlexAttention's ALiBi."""
  return 5.0 * jnp.tanh(alibi_linear(s, b, h, q_idx, kv_idx) * (1 / 5.0))


def test_traced_constants_keep_the_function_opaque():
  """A slope closed over from the caller's trace (a parameter under
  jax.grad) stays in the function, whose terms it differentiates."""
  def forms(slope):
    score_fn = lambda s, b, h, q, k: s + slope * (k - q)
    form = builtin_forms.score_form(score_fn, batch=1, num_heads=2,
                                  abs_sign_known=True)
    assert form is None
    return slope
  jax.jit(forms)(jnp.float32(0.5))


def test_a_cap_is_read_as_the_builtin_cap():
  form = builtin_forms.score_form(lambda s, *_: 30.0 * jnp.tanh(s / 30.0),
                                batch=1, num_heads=2, abs_sign_known=False)
  assert form.cap == 30.0 and form.slopes is None and not form.shifts_rows
  cap = jnp.asarray(30.0)  # a concrete array closed over: a constant
  form = builtin_forms.score_form(lambda s, *_: cap * jnp.tanh(s / cap),
                                batch=1, num_heads=2, abs_sign_known=False)
  assert form.cap == 30.0
  form = builtin_forms.score_form(capped_alibi, batch=1, num_heads=2,
                                abs_sign_known=False)
  assert form.cap == 5.0 and not form.shifts_rows
  np.testing.assert_allclose(_slopes(form), [[0.25, 0.0625]], rtol=1e-6)


def _call(score_fn, case, **variants):
  q = jnp.zeros((case.batch, case.q_len, case.num_heads, case.head_dim))
  k = jnp.zeros((case.batch, case.kv_len, case.num_kv_heads, case.head_dim))
  return validation.normalise_call(q, k, k, score_fn=score_fn, **variants)


CASE = Case(2, 70, 90, 4, 2, 40)


def test_causal_alibi_runs_as_builtin_without_a_shift():
  call, shift = builtin_forms.as_builtin(_call(alibi_abs, CASE,
                                             is_causal=True))
  assert call.spec.score_fn is None and call.spec.has_alibi
  assert call.operands.alibi_slopes.shape == (2, 4) and shift is None


@pytest.mark.parametrize("variants", [
    dict(is_causal=False),  # no mask that fixes the sign or makes it ALiBi
    dict(is_causal=True, sinks=jnp.zeros(4)),  # a shift under sinks
    dict(is_causal=True, logits_soft_cap=5.0),  # a shift under a cap
    dict(is_causal=True, alibi_slopes=jnp.ones(4)),  # ALiBi already
    dict(is_causal=True, logits_soft_cap=5.0, score_fn=capped_alibi),
    dict(is_causal=True, q_offset=3, score_fn=capped_alibi),  # a shift
])
def test_rewrite_is_declined_where_it_would_change_the_result(variants):
  score_fn = variants.pop("score_fn", (
      shifted_rows if "alibi_slopes" not in variants else alibi_abs))
  call = _call(score_fn, CASE, **variants)
  rewritten, shift = builtin_forms.as_builtin(call)
  assert rewritten is call and shift is None


def test_sinks_and_cap_keep_the_rewrite_without_a_shift():
  call, _ = builtin_forms.as_builtin(_call(
      alibi_linear, CASE, is_causal=True, logits_soft_cap=5.0,
      sinks=jnp.zeros(4)))
  assert call.spec.has_alibi and call.spec.score_fn is None


def _triton(**variants):
  return triton_attention(BLOCKS, **variants)


@pytest.mark.parametrize("name, case, variants", [
    ("abs", Case(2, 83, 83, 4, 1, 32), dict(score_fn=alibi_abs)),
    ("linear-q_offset", CASE, dict(score_fn=alibi_linear, q_offset=20)),
    ("shifted-lengths", CASE, dict(
        score_fn=shifted_rows, q_offset=jnp.array([20, 5], jnp.int32),
        key_value_seq_lengths=jnp.array([90, 61], jnp.int32))),
    ("linear-cap-sinks", Case(1, 64, 64, 2, 2, 64), dict(
        score_fn=alibi_linear, logits_soft_cap=4.0,
        sinks=jnp.array([0.5, -1.0]))),
    ("capped-alibi", CASE, dict(score_fn=capped_alibi)),
    ("cap-not-causal", Case(2, 83, 83, 4, 1, 32), dict(
        score_fn=lambda s, *_: 4.0 * jnp.tanh(s / 4.0), is_causal=False,
        local_window_size=(9, 4))),
])
def test_rewritten_calls_match_the_function_as_written(name, case, variants):
  """Against the reference, which evaluates `score_fn` itself: out, the
  LSE (the row shift) and dq, dk, dv under random cotangents."""
  del name
  variants = {"is_causal": True, **variants}
  call, _ = builtin_forms.as_builtin(_call(**{"case": case, **variants}))
  assert call.spec.score_fn is None  # the rewrite is what runs
  check_against_reference(_triton(**variants), case, jnp.float32, seed=3,
                          **variants)


@pytest.mark.gpu
@pytest.mark.parametrize("score_fn", [alibi_abs, shifted_rows])
def test_rewritten_calls_on_the_mosaic_kernels_on_gpu(score_fn):
  """The same on the masked Mosaic kernels (causal ALiBi as column terms),
  bfloat16, GQA 4:2, ragged lengths."""
  from pallas_kernels import compat
  if (compat.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic kernels need sm90")
  case = Case(2, 1000, 1000, 4, 2, 128)
  variants = dict(score_fn=score_fn, is_causal=True)

  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, return_residual=True,
                                     implementation="mosaic", **variants)
  check_against_reference(attention, case, jnp.bfloat16, seed=5, **variants)


def _linear_terms(draw):
  """A random score_fn of FlexAttention's linear kind, built as nested
  jnp expressions: position terms scaled by constants or by functions of
  (b, h), integer or float arithmetic, an abs of +-(q - kv)."""
  def coefficient():
    kind = draw(st.sampled_from(["const", "head", "batch", "where"]))
    c = draw(st.floats(-2.0, 2.0, allow_nan=False, width=32))
    return {"const": lambda b, h: c,
            "head": lambda b, h: c / (h + 1).astype(jnp.float32),
            "batch": lambda b, h: c * jnp.exp2(-b.astype(jnp.float32)),
            "where": lambda b, h: jnp.where(h % 2 == 0, c, -c / 4)}[kind]

  def term():
    kind = draw(st.sampled_from(["q", "kv", "diff", "abs", "int_diff"]))
    a = coefficient()
    return {
        "q": lambda b, h, q, k: a(b, h) * q.astype(jnp.float32),
        "kv": lambda b, h, q, k: a(b, h) * k,
        "diff": lambda b, h, q, k: a(b, h) * (k - q),
        "abs": lambda b, h, q, k: a(b, h) * jnp.abs(k - q).astype(
            jnp.float32),
        "int_diff": lambda b, h, q, k: (3 * (q - k) - 2 * q).astype(
            jnp.float32) / (h + 2),
    }[kind]

  terms = [term() for _ in range(draw(st.integers(1, 3)))]
  offset = coefficient()

  def score_fn(s, b, h, q, k):
    total = s + offset(b, h)
    for t in terms:
      total = total + t(b, h, q, k)
    return total
  return score_fn


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_forms_reproduce_random_linear_functions(data):
  """For random linear score functions, the form's slopes and row terms
  give the function's value at random kept (causal) positions."""
  score_fn = _linear_terms(data.draw)
  batch, heads = 2, 3
  form = builtin_forms.score_form(score_fn, batch=batch, num_heads=heads,
                                abs_sign_known=True)
  assert form is not None
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
  q = rng.integers(0, 5000, 64).astype(np.int32)
  k = (q - rng.integers(0, 5000, 64)).clip(0).astype(np.int32)  # kept
  b = rng.integers(0, batch, 64).astype(np.int32)
  h = rng.integers(0, heads, 64).astype(np.int32)
  s = rng.normal(size=64).astype(np.float32)
  want = jax.vmap(score_fn)(s, b, h, q, k)
  zero = np.zeros((batch, heads), np.float32)
  slopes = np.asarray(form.slopes if form.slopes is not None else zero)
  row_slope = np.asarray(form.row_slope if form.row_slope is not None
                         else zero)
  row_const = np.asarray(form.row_const if form.row_const is not None
                         else zero)
  got = (s - slopes[b, h] * (q - k) + row_slope[b, h] * q
         + row_const[b, h])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-3)


# mask_fn read as the built-in causal mask and window.


@pytest.mark.parametrize("mask_fn, bounds", [
    (lambda b, h, q, k: q >= k, (0, None)),
    (lambda b, h, q, k: (q >= k) & (q - k < 256), (0, 255)),
    (lambda b, h, q, k: jnp.logical_and(k <= q, k > q - 100), (0, 99)),
    (lambda b, h, q, k: (k - q <= 5) & (q - k <= 7), (-5, 7)),
    (lambda b, h, q, k: 2 * q >= 2 * k - 3, (-1, None)),
    (lambda b, h, q, k: True, (None, None)),
    (lambda b, h, q, k: jnp.abs(q - k) <= 5, (-5, 5)),
    (lambda b, h, q, k: 8 > 2 * jnp.abs(k - q), (-3, 3)),
    (lambda b, h, q, k: (jnp.abs(q - k).astype(jnp.float32) < 2.5)
     & (q >= k), (0, 2)),
])
def test_masks_read_as_bounds(mask_fn, bounds):
  form = builtin_forms.mask_form(mask_fn)
  assert (form.lower, form.upper) == bounds


@pytest.mark.parametrize("mask_fn", [
    lambda b, h, q, k: q - k < 10 * (h + 1),   # a bound of h
    lambda b, h, q, k: (q // 128) == (k // 128),
    lambda b, h, q, k: (q >= k) | (k < 4),
    lambda b, h, q, k: q >= 2 * k,
    lambda b, h, q, k: (q >= k) & (b == 0),
    lambda b, h, q, k: jnp.abs(q - k) >= 5,   # two bands
    lambda b, h, q, k: jnp.abs(q - k) + 1 <= 5,
])
def test_other_masks_stay_opaque(mask_fn):
  assert builtin_forms.mask_form(mask_fn) is None


def _mask_call(mask_fn, **variants):
  return _call(None, CASE, mask_fn=mask_fn, **variants)


def test_causal_mask_fn_runs_as_is_causal():
  call, _ = builtin_forms.as_builtin(_mask_call(lambda b, h, q, k: q >= k))
  assert call.spec.is_plain and call.spec.is_causal
  assert call.spec.mask_fn is None and call.operands.block_mask is None


def test_window_mask_fn_meets_the_call_window():
  call, _ = builtin_forms.as_builtin(_mask_call(
      lambda b, h, q, k: (q >= k) & (q - k < 64), local_window_size=(99, 9)))
  assert call.spec.is_causal and call.spec.window == (63, 9)
  assert call.spec.mask_fn is None


@pytest.mark.parametrize("mask_fn, variants", [
    (lambda b, h, q, k: q >= k, dict(q_offset=4)),  # q_pos is q + q_offset
    (lambda b, h, q, k: q > k, {}),  # strictly below the diagonal
])
def test_mask_rewrite_is_declined(mask_fn, variants):
  call = _mask_call(mask_fn, **variants)
  assert builtin_forms.as_builtin(call)[0] is call


@pytest.mark.parametrize("name, case, variants", [
    ("causal", CASE, dict(mask_fn=lambda b, h, q, k: q >= k)),
    ("window", Case(2, 83, 83, 4, 1, 32), dict(
        mask_fn=lambda b, h, q, k: (k - q <= 5) & (q - k <= 7))),
    ("band", CASE, dict(mask_fn=lambda b, h, q, k: jnp.abs(q - k) < 9)),
    ("causal window, segments, alibi score_fn", Case(2, 83, 83, 4, 1, 32),
     dict(mask_fn=lambda b, h, q, k: (k <= q) & (k > q - 20),
          segment_ids=jnp.repeat(jnp.arange(3), 28)[None, :83].repeat(2, 0),
          score_fn=alibi_abs)),
])
def test_rewritten_masks_match_the_function_as_written(name, case, variants):
  del name
  call, _ = builtin_forms.as_builtin(_call(**{"score_fn": None, "case": case,
                                            **variants}))
  assert call.spec.mask_fn is None
  check_against_reference(_triton(**variants), case, jnp.float32, seed=4,
                          **variants)


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_bounds_reproduce_random_masks(data):
  """Random conjunctions of comparisons of the positions with numbers,
  against their bounds on every (q, kv) of a 64 x 64 grid."""
  def comparison():
    if data.draw(st.booleans()):  # a band: |q - kv| against a number
      reach = data.draw(st.integers(0, 40))
      strict = data.draw(st.booleans())
      return lambda q, k: (jnp.abs(q - k) < reach + 1 if strict
                           else jnp.abs(k - q) <= reach)
    a = data.draw(st.integers(-40, 40))
    c = data.draw(st.sampled_from([1, 2, -3]))
    op = data.draw(st.sampled_from(["ge", "gt", "le", "lt"]))
    side = data.draw(st.booleans())

    def keep(q, k):
      x, y = (c * q, c * k + a) if side else (c * k - a, c * q)
      return {"ge": x >= y, "gt": x > y, "le": x <= y, "lt": x < y}[op]
    return keep

  parts = [comparison() for _ in range(data.draw(st.integers(1, 3)))]

  def mask_fn(b, h, q, k):
    del b, h
    kept = parts[0](q, k)
    for part in parts[1:]:
      kept = kept & part(q, k)
    return kept
  form = builtin_forms.mask_form(mask_fn)
  q, k = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
  want = np.asarray(jax.vmap(jax.vmap(
      lambda q, k: mask_fn(0, 0, q, k)))(jnp.asarray(q), jnp.asarray(k)))
  got = np.ones_like(want)
  if form.lower is not None:
    got &= q - k >= form.lower
  if form.upper is not None:
    got &= q - k <= form.upper
  np.testing.assert_array_equal(got, want)
