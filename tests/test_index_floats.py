"""Position tiles to float32 by the mantissa (`pallas_kernels.index_floats`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.index_floats import (EXACT_BOUND, exact_float,
                                         fast_index_floats)


def test_exact_float_is_the_conversion_below_the_bound():
  edges = np.array([0, 1, -1, 7, -7, EXACT_BOUND - 1, -(EXACT_BOUND - 1),
                    EXACT_BOUND // 3, -(EXACT_BOUND // 3)], np.int32)
  x = jnp.concatenate([jnp.asarray(edges), jax.random.randint(
      jax.random.key(0), (4096,), -(EXACT_BOUND - 1), EXACT_BOUND)])
  want = x.astype(jnp.float32)
  # Eager and compiled (where XLA's simplifier could rewrite it).
  for got in (exact_float(x, EXACT_BOUND),
              jax.jit(lambda x: exact_float(x, EXACT_BOUND))(x)):
    np.testing.assert_array_equal(np.asarray(got).view(np.int32),
                                  np.asarray(want).view(np.int32))  # +0.0
  assert "bitcast_convert_type" in str(jax.make_jaxpr(
      lambda x: exact_float(x, EXACT_BOUND))(x))


@pytest.mark.parametrize("x, bound", [
    (jnp.arange(8), EXACT_BOUND + 1),        # no proof of |x| < 2^22
    (jnp.int32(5), 10),                      # a scalar: one conversion
    (jnp.arange(8, dtype=jnp.int16), 10),    # not int32
])
def test_exact_float_converts_otherwise(x, bound):
  text = str(jax.make_jaxpr(lambda x: exact_float(x, bound))(x))
  assert "bitcast_convert_type" not in text
  np.testing.assert_array_equal(exact_float(x, bound),
                                jnp.asarray(x).astype(jnp.float32))


def _tiles(q_len, kv_len, q_start=0):
  q = jnp.broadcast_to(jnp.arange(q_start, q_start + 64)[:, None], (64, 128))
  kv = jnp.broadcast_to(jnp.arange(kv_len - 128, kv_len)[None, :], (64, 128))
  score = jax.random.normal(jax.random.key(1), (64, 128))
  return score, jnp.int32(1), jnp.int32(3), q.astype(jnp.int32), kv.astype(
      jnp.int32)


def _alibi(score, b, h, q_idx, kv_idx):
  slope = jnp.exp2(-(h + 1).astype(jnp.float32))
  return score - slope * jnp.abs(q_idx - kv_idx).astype(jnp.float32)


def _clipped(score, b, h, q_idx, kv_idx):
  # jnp.clip is a nested jit; where's int cases are a select.
  near = jnp.clip(q_idx - kv_idx, -8, 8) * 3
  return score + near.astype(jnp.float32) + jnp.where(
      q_idx > kv_idx, 2, -1).astype(jnp.float32)


def _head_tile(score, b, h, q_idx, kv_idx):
  # b and h are not bounded: a tile of them converts as written.
  return score + (q_idx * 0 + b * 1000 + h).astype(jnp.float32)


def _products(score, b, h, q_idx, kv_idx):
  # q * kv * kv reaches 2^22 at these lengths: converts as written.
  return score + (q_idx * kv_idx * kv_idx).astype(jnp.float32) * 1e-9


@pytest.mark.parametrize("fn, rewrites", [
    (_alibi, 1), (_clipped, 2), (_head_tile, 0), (_products, 0)])
def test_fast_index_floats_rewrites_bounded_tiles_only(fn, rewrites):
  """The same values as the score_fn as written, with a mantissa form
  for each conversion an interval proves below 2^22, none for others."""
  args = _tiles(1000, 1000, q_start=900)
  fast = fast_index_floats(fn, 1000, 1000)
  np.testing.assert_array_equal(fast(*args), fn(*args))
  text = str(jax.make_jaxpr(fast)(*args))
  assert text.count("bitcast_convert_type") == rewrites


def test_fast_index_floats_needs_the_lengths_below_the_bound():
  args = _tiles(1000, 1000)
  fast = fast_index_floats(_alibi, EXACT_BOUND, 1000)
  assert "bitcast_convert_type" not in str(jax.make_jaxpr(fast)(*args))


def test_fast_index_floats_keeps_derivatives():
  """The kernels' backward takes score_fn's jvp."""
  args = _tiles(1000, 1000)
  fast = fast_index_floats(_alibi, 1000, 1000)
  tangent = jax.random.normal(jax.random.key(2), args[0].shape)
  want = jax.jvp(lambda s: _alibi(s, *args[1:]), (args[0],), (tangent,))
  got = jax.jvp(lambda s: fast(s, *args[1:]), (args[0],), (tangent,))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
