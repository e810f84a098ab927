"""`reciprocals.scalar_divisions_as_products`: a score_fn's divisions by a
scalar as products, within an ulp, derivative included; other divisions
untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reciprocals import scalar_divisions_as_products


def score_fn(s, b, h, q_idx, kv_idx):
  """A soft cap (a constant divisor), a divisor of (b, h), one per score,
  and a nested jit (`jax.nn.softplus`)."""
  per_score = jnp.maximum(q_idx - kv_idx, 1).astype(jnp.float32)
  return (30.0 * jnp.tanh(s / 30.0) + s / (3.0 + b + h) + s / per_score
          + jax.nn.softplus(s))


def _args():
  s = 20 * jax.random.normal(jax.random.key(0), (64, 48))
  q_idx = jnp.arange(64)[:, None] + jnp.zeros((64, 48), jnp.int32)
  kv_idx = jnp.arange(48)[None, :] + jnp.zeros((64, 48), jnp.int32)
  return s, jnp.int32(1), jnp.int32(2), q_idx, kv_idx


def _divisions(fn, args):
  """The divisors' shapes of the top-level divisions in fn's jaxpr."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [eqn.invars[1].aval.shape for eqn in jaxpr.eqns
          if eqn.primitive is jax.lax.div_p]


def test_only_divisions_by_an_array_remain():
  args = _args()
  assert sorted(_divisions(score_fn, args)) == [(), (), (64, 48)]
  # The (b, h) divisor's reciprocal is one scalar division.
  assert sorted(_divisions(scalar_divisions_as_products(score_fn), args)) == [
      (), (64, 48)]


def test_values_and_derivative_within_an_ulp():
  s, *others = _args()
  tangent = jax.random.normal(jax.random.key(1), s.shape)
  want, want_t = jax.jvp(lambda x: score_fn(x, *others), (s,), (tangent,))
  got, got_t = jax.jvp(
      lambda x: scalar_divisions_as_products(score_fn)(x, *others), (s,),
      (tangent,))
  np.testing.assert_allclose(got, want, rtol=4e-7, atol=4e-6)
  np.testing.assert_allclose(got_t, want_t, rtol=4e-7, atol=4e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_keeps_dtypes_and_integer_divisions(dtype):
  fn = lambda x, n: (x / 7.0, n // 3, x / jnp.asarray(2.0, dtype))
  x = jnp.linspace(-3, 3, 10, dtype=dtype)
  n = jnp.arange(10)
  got = scalar_divisions_as_products(fn)(x, n)
  want = fn(x, n)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), rtol=1e-2)
