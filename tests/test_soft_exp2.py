"""The software exp2 (`pallas_kernels.mosaic.soft_exp2`) in jnp: its error
bound, its edge values and the columns it takes. The kernels' Mosaic GPU
code of it is checked against the reference attention on a GPU
(tests/test_mosaic_lowering.py) and run as this jnp twin by the CPU
interpreter (tests/test_mosaic_interpret.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from pallas_kernels.mosaic import soft_exp2


def test_relative_error_is_within_its_bound_over_the_whole_range():
  """A fine grid over [-125, 8] (P's range: at most 2**8 under the lazy
  rescale; below -125 the results are subnormal or nearly, and far below
  anything that adds to a row's sum), against float64's 2**x; and the
  bound is tight (the fit's own error is 7.48e-5, so a wrong coefficient
  shows)."""
  x = np.concatenate([np.linspace(-125.0, 8.0, 2_000_003),
                      np.arange(-125, 9, dtype=np.float64)]).astype(np.float32)
  got = np.asarray(jax.jit(soft_exp2.reference)(jnp.asarray(x)), np.float64)
  # Compiled (XLA) as run op by op, but for FMA contraction's last bit.
  np.testing.assert_allclose(
      got, np.asarray(soft_exp2.reference(jnp.asarray(x)), np.float64),
      rtol=3e-7)
  relative = np.abs(got / np.exp2(x.astype(np.float64)) - 1.0)
  assert relative.max() <= soft_exp2.MAX_RELATIVE_ERROR
  assert relative.max() > 0.5 * soft_exp2.MAX_RELATIVE_ERROR


@settings(max_examples=50, deadline=None)
@given(st.floats(-125.0, 8.0, width=32))
def test_any_float_in_range(x):
  got = float(soft_exp2.reference(jnp.float32(x)))
  assert abs(got / 2.0**x - 1.0) <= soft_exp2.MAX_RELATIVE_ERROR


def test_edges_are_finite_and_nan_stays_nan():
  """From -126 down (and at -inf) the clamp gives 2**-126 to 2e-4, never a
  wrapped exponent (negative, huge or NaN); NaN propagates."""
  x = jnp.array([-126.0, -126.5, -127.0, -1e4, -jnp.inf], jnp.float32)
  got = np.asarray(soft_exp2.reference(x))
  np.testing.assert_allclose(got, 2.0**-126, rtol=2e-4)
  assert np.isnan(np.asarray(soft_exp2.reference(jnp.float32(jnp.nan))))


def test_soft_columns_are_the_last_groups_of_each_cycle():
  """Of each cycle of 8 groups of 8 columns, the last `soft_groups`; and
  `mixed_reference` takes the software exp2 exactly there."""
  cols = soft_exp2.soft_columns(128, 2)
  assert cols.sum() == 32
  assert not cols[:48].any() and cols[48:64].all() and cols[112:].all()
  assert not soft_exp2.soft_columns(128, 0).any()
  assert soft_exp2.soft_columns(128, 8).all()
  x = jnp.linspace(-20.0, 0.0, 4 * 128, dtype=jnp.float32).reshape(4, 128)
  mixed = np.asarray(soft_exp2.mixed_reference(x, 2))
  np.testing.assert_array_equal(mixed[:, cols],
                                np.asarray(soft_exp2.reference(x))[:, cols])
  np.testing.assert_array_equal(mixed[:, ~cols],
                                np.asarray(jnp.exp2(x))[:, ~cols])
