"""The dropout hash (`masking.dropout_keep`): its split form, its mixing and
the statistics of the mask it draws.

Every kernel and the reference draw dropout's bits from these functions, so
the tests here hold for all of them; that each kernel reproduces them is
checked beside the kernels (`test_mosaic_interpret_masked.py`, `-m gpu`).
"""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import masking

U32 = st.integers(0, 2**32 - 1)
POSITION = st.integers(0, 2**31 - 1)


@hypothesis.given(seed=U32, start=POSITION, index=POSITION)
@hypothesis.settings(max_examples=50, deadline=None)
def test_split_halves_equal_the_whole_position(seed, start, index):
  """A kernel passes an iota and its tile's start apart; the bits are those
  of the position they sum to (modulo 2^32)."""
  stream = masking.dropout_stream(jnp.uint32(seed), 0, 0)
  position = jnp.uint32((start + index) % 2**32)
  assert (masking.dropout_query_hash(stream, jnp.uint32(index), start)
          == masking.dropout_query_hash(stream, position))
  assert (masking.dropout_key_hash(jnp.uint32(index), start)
          == masking.dropout_key_hash(position))


def _spread_then_mix(x):
  return masking.dropout_quad_hash(masking._spread(x), jnp.uint32(0))


def _without_spread(x):
  return masking.dropout_quad_hash(x, jnp.uint32(0))


def _without_last_shift(x):
  """The finaliser without its last xor-shift: the low bytes of a product
  depend only on the low bits of its factors."""
  x = masking._spread(x) * jnp.uint32(masking.DROPOUT_MIX_1)
  x = x ^ lax.shift_right_logical(x, jnp.uint32(13))
  return x * jnp.uint32(masking.DROPOUT_MIX_2)


def _avalanche_bias(mix, samples=20_000):
  """max over input bits i and output bits j (each byte is one weight's
  compare) of |P(bit j flips when bit i does) - 1/2|."""
  x = np.random.default_rng(0).integers(0, 2**32, samples, dtype=np.uint64)
  x = jnp.asarray(x.astype(np.uint32))
  y = np.asarray(mix(x))
  worst = 0.0
  for i in range(32):
    flips = y ^ np.asarray(mix(x ^ jnp.uint32(1 << i)))
    for j in range(32):
      worst = max(worst, abs(float(((flips >> j) & 1).mean()) - 0.5))
  return worst


# 20k samples: one frequency's standard deviation is 0.0035; the largest of
# 1024 lands near 0.012. A bias of 0.03 is 8.5 of them.
AVALANCHE_LIMIT = 0.03


def test_mixing_avalanches_into_every_byte():
  """Every bit of the two words' xor flips every bit of the quad's hash
  with probability 1/2: no structure of the positions survives into any
  weight's byte (the battery below looks for it directly)."""
  assert _avalanche_bias(_spread_then_mix) < AVALANCHE_LIMIT


@pytest.mark.parametrize("weakened", [_without_spread, _without_last_shift])
def test_avalanche_check_rejects_weaker_mixing(weakened):
  """The check above can fail: the high bits of the xor reach the low
  output bits only through `_spread`, and the low bytes need the last
  xor-shift."""
  assert _avalanche_bias(weakened) > 0.2


def _standardised_masks(n, rate, heads=2):
  q = jnp.arange(n)[:, None]
  k = jnp.arange(n)[None, :]
  p = 1 - masking.quantized_dropout_rate(rate)
  return [(np.asarray(masking.dropout_keep(jnp.int32(5), 1, h, q, k, rate),
                      np.float64) - p) / np.sqrt(p * (1 - p))
          for h in range(heads)]


def _z_scores(x, other_head):
  """z-scores (standard normal for an ideal mask) of the keep rate, the
  spread of row and column rates, and correlations at lags along rows,
  columns, both diagonals, over rectangles, and between two heads."""
  n = x.shape[0]
  z = {"rate": x.mean() * np.sqrt(x.size)}
  for axis, name in ((0, "columns"), (1, "rows")):
    means = x.mean(axis) * np.sqrt(n)
    z[f"spread of {name}"] = (np.sum(means**2) - n) / np.sqrt(2 * n)
  for d in (d for d in (1, 2, 3, 8, 16, 17, 64, 65, 128, 512) if d < n):
    for name, a, b in (("row", x[:, d:], x[:, :-d]),
                       ("column", x[d:], x[:-d]),
                       ("diagonal", x[d:, d:], x[:-d, :-d]),
                       ("antidiagonal", x[d:, :-d], x[:-d, d:])):
      product = a * b
      z[f"{name} lag {d}"] = product.mean() * np.sqrt(product.size)
  for dq, dk in ((1, 1), (3, 5), (64, 64)):
    product = (x[dq:, dk:] * x[:-dq, :-dk] * x[dq:, :-dk] * x[:-dq, dk:])
    z[f"rectangle {dq}x{dk}"] = product.mean() * np.sqrt(product.size)
  product = x * other_head
  z["between heads"] = product.mean() * np.sqrt(product.size)
  return z


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_mask_statistics(rate):
  """No detectable bias or correlation in a 2048 x 2048 mask (about 50
  statistics a rate; |z| > 6 has odds of 1e-9 each for an ideal mask)."""
  x, other = _standardised_masks(2048, rate)
  z = _z_scores(x, other)
  worst = max(z, key=lambda name: abs(z[name]))
  assert abs(z[worst]) < 6, (worst, z[worst])


def test_mask_statistics_catch_a_structured_mask():
  """The battery above can fail: the halves' xor without mixing (the
  positions' linear structure left in) is rejected."""
  q = jnp.arange(512)[:, None]
  k = jnp.arange(512)[None, :]
  halves = (masking.dropout_query_hash(masking.dropout_stream(5, 1, 0), q)
            ^ masking.dropout_key_hash(k))
  keep = np.asarray(halves >= jnp.uint32(masking.dropout_threshold(0.5)))
  x = keep * 2.0 - 1.0
  z = _z_scores(x, np.roll(x, 1, axis=0))
  assert max(abs(v) for v in z.values()) > 6


@pytest.mark.slow
def test_mask_statistics_at_8k():
  """The battery at 8192 x 8192 (4x the power of the default run's)."""
  x, other = _standardised_masks(8192, 0.1)
  z = _z_scores(x, other)
  worst = max(z, key=lambda name: abs(z[name]))
  assert abs(z[worst]) < 6, (worst, z[worst])


def test_threshold_is_exact_and_stays_in_range():
  assert masking.dropout_threshold(0.25) == 2**30
  assert masking.dropout_threshold(255 / 256) == 255 << 24
  assert masking.quantized_dropout_rate(0.1) == 26 / 256
  with pytest.raises(ValueError, match="rounds to 256/256"):
    masking.dropout_threshold(1 - 2**-10)


def test_each_weight_takes_its_byte_of_its_quad():
  """The four weights {q, q + 8} x {k, k + 8} (bit 3 of q and k clear)
  share one hash and take its four bytes, top first."""
  seed, q, k = jnp.int32(11), 33, 70      # q % 16 = 1, k % 16 = 6
  quad = masking.dropout_quad_hash(
      masking.dropout_query_hash(masking.dropout_stream(seed, 0, 2), q),
      masking.dropout_key_hash(k))
  quad = int(quad)
  for dq, dk, byte in ((0, 0, 3), (0, 8, 2), (8, 0, 1), (8, 8, 0)):
    value = (quad >> (8 * byte)) & 0xFF
    for levels in (value, value + 1):
      rate = levels / 256
      if levels < 256:
        kept = bool(masking.dropout_keep(seed, 0, 2, q + dq, k + dk, rate))
        assert kept == (value >= levels), (dq, dk, levels)
