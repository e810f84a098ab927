"""A user's `score_fn` with its divisions by a scalar done as products.

A float division in a Mosaic GPU kernel lowers to IEEE `div.rn.f32`: about
15 SASS instructions per element (FFMAs refining a reciprocal, an FCHK and
a branch to a slow path), where a multiplication is one. `score_fn`s divide
every score by a constant as a matter of course (a soft cap, `cap *
tanh(s / cap)`), and on the masked kernels that division cost more than the
tanh and the exponential together. `scalar_divisions_as_products(fn)`
evaluates fn's jaxpr with each `x / y` whose divisor is a scalar (a
constant, or a value such as one computed from the batch or head index)
done as `x * (1 / y)`: the reciprocal once, a multiply per element; within
an ulp of the division. Divisions inside nested jaxprs (`jax.jit`,
`custom_jvp`) are left as written.

The kernels call `score_fn` through this; the reference calls it as it is.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np


def scalar_divisions_as_products(fn):
  """`fn` (arrays -> one array), its divisions by a float scalar done as
  multiplications by the reciprocal (see the module)."""
  @functools.wraps(fn)
  def wrapped(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)
  return wrapped


def _evaluate(jaxpr, consts, args):
  env = {}

  def read(var):
    return var.val if isinstance(var, jex.Literal) else env[var]

  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for var, value in zip(jaxpr.invars, args):
    env[var] = value
  for eqn in jaxpr.eqns:
    values = [read(var) for var in eqn.invars]
    if _divides_by_a_scalar(eqn):
      outs = [values[0] * _reciprocal(values[1], eqn.invars[1])]
    else:
      outs = eqn.primitive.bind(
          *values, **eqn.primitive.get_bind_params(eqn.params))
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for var, value in zip(eqn.outvars, outs):
      env[var] = value
  return [read(var) for var in jaxpr.outvars]


def _divides_by_a_scalar(eqn) -> bool:
  divisor = eqn.invars[1] if eqn.primitive is lax.div_p else None
  return (divisor is not None and divisor.aval.shape == ()
          and jnp.issubdtype(divisor.aval.dtype, jnp.floating))


def _reciprocal(divisor, var):
  """1 / divisor in its dtype: folded now for a constant, else one scalar
  division where the kernel computes the divisor."""
  dtype = var.aval.dtype
  if isinstance(var, jex.Literal):
    return np.asarray(1, dtype) / np.asarray(divisor, dtype)
  return lax.div(jnp.asarray(1, dtype), divisor)
