"""Integer positions to float32 without the conversion pipe.

On sm90 an int32 -> float32 conversion (I2F) issues at 16 a clock per SM,
on the pipe that also runs the exponential (MUFU ex2, 16 a clock), which
the softmax needs once per score. A score change that converts a position
tile once per score, ALiBi's |q - kv| written as a `score_fn` or built in
without a causal mask, so doubles the work of the softmax's slowest pipe:
on an H100 at 16k, d=128, causal, ALiBi as `score_fn` ran 0.78x of plain
causal fwd+bwd and the soft cap, whose tanh is the same kind of second
op, 0.77x (`benchmarks/results/h100_masks_mosaic.md`).

For |x| < 2^22, float32(x) is exactly bitcast_f32(x + 0x4B400000) -
1.5 * 2^23: the add puts x in the mantissa of a float in [2^23, 2^24),
whose step is 1, and the subtraction takes the offset off exactly. An
integer add and a float subtract, on pipes 4-8x wider; the same bits as
the conversion.

`exact_float(x, bound)` is that form where |x| < bound is known;
`fast_index_floats(fn, q_len, kv_len)` evaluates a `score_fn`'s jaxpr with
it wherever an interval bound on the converted tile, computed from q_idx
in [0, q_len) and kv_idx in [0, kv_len) through adds, subtractions,
negations, absolute values, minima, maxima, products, clamps and selects
(also inside nested `jit`s), proves |x| < 2^22. Other conversions (of
scalars, of unbounded values) stay as written.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

# |x| below this converts exactly through the float mantissa.
EXACT_BOUND = 2**22
# How far the kernels' index tiles reach past q_len and kv_len (padding to
# whole tiles: less than a tile), allowed for in the bounds.
POSITION_SLACK = 512
_MAGIC_BITS = 0x4B400000       # float32 1.5 * 2^23
_MAGIC = 12582912.0            # 1.5 * 2^23
_INT32 = (-(2**31), 2**31 - 1)


def exact_float(x, bound: int):
  """float32 of int32 `x`, given |x| < `bound`: by the mantissa where
  bound <= 2^22 and x is an array (a scalar's conversion costs once),
  else by a conversion."""
  x = jnp.asarray(x)
  if (x.dtype != jnp.int32 or x.ndim == 0 or bound > EXACT_BOUND):
    return x.astype(jnp.float32)
  return _by_mantissa(x)


def _by_mantissa(x):
  shifted = lax.bitcast_convert_type(x + jnp.int32(_MAGIC_BITS), jnp.float32)
  return shifted - jnp.float32(_MAGIC)


def fast_index_floats(fn, q_len: int, kv_len: int):
  """`fn(score, batch, head, q_idx, kv_idx)` (a `score_fn`), its
  conversions to float32 of position tiles with |x| < 2^22 provable done
  by `exact_float`'s mantissa form (see the module), q_idx and kv_idx
  bounded by the lengths plus `POSITION_SLACK`."""
  bounds = (None, None, None, (0, q_len + POSITION_SLACK),
            (0, kv_len + POSITION_SLACK))

  @functools.wraps(fn)
  def wrapped(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out, _ = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args),
                       bounds[:len(args)])
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)
  return wrapped


def _evaluate(jaxpr, consts, args, arg_bounds):
  """jaxpr's outputs and their int32 intervals (None: unknown)."""
  env, bounds = {}, {}

  def read(var):
    return var.val if isinstance(var, jex.Literal) else env[var]

  def bound(var):
    if isinstance(var, jex.Literal):
      if var.aval.dtype == jnp.int32 and np.ndim(var.val) == 0:
        return int(var.val), int(var.val)
      return None
    return bounds.get(var)

  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for var, value, b in zip(jaxpr.invars, args, arg_bounds):
    env[var] = value
    bounds[var] = b if var.aval.dtype == jnp.int32 else None
  for eqn in jaxpr.eqns:
    values = [read(var) for var in eqn.invars]
    in_bounds = [bound(var) for var in eqn.invars]
    inner = eqn.params.get("jaxpr")
    if eqn.primitive.name in ("pjit", "jit") and inner is not None:
      outs, out_bounds = _evaluate(inner.jaxpr, inner.consts, values,
                                   in_bounds)
    elif _converts_bounded_tile(eqn, in_bounds[0]):
      outs, out_bounds = [_by_mantissa(values[0])], [None]
    else:
      outs = eqn.primitive.bind(
          *values, **eqn.primitive.get_bind_params(eqn.params))
      if not eqn.primitive.multiple_results:
        outs = [outs]
      out_bounds = [_interval(eqn, in_bounds)] * len(outs)
    for var, value, b in zip(eqn.outvars, outs, out_bounds):
      env[var] = value
      bounds[var] = b
  return [read(var) for var in jaxpr.outvars], [
      bound(var) for var in jaxpr.outvars]


def _converts_bounded_tile(eqn, interval) -> bool:
  """An int32 array's conversion to float32 whose interval is within
  (-2^22, 2^22)."""
  if eqn.primitive is not lax.convert_element_type_p or interval is None:
    return False
  source, target = eqn.invars[0].aval, eqn.outvars[0].aval
  return (source.dtype == jnp.int32 and target.dtype == jnp.float32
          and source.ndim > 0
          and max(abs(interval[0]), abs(interval[1])) < EXACT_BOUND)


def _interval(eqn, bounds):
  """The int32 interval of eqn's output from its inputs', or None."""
  out = eqn.outvars[0].aval
  if getattr(out, "dtype", None) != jnp.int32:
    return None
  name = eqn.primitive.name
  if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims",
              "copy", "copy_p", "transpose"):
    return bounds[0]
  if name == "convert_element_type":
    return bounds[0] if eqn.invars[0].aval.dtype == jnp.int32 else None
  if name == "select_n":  # the cases' union; the predicate is no int
    bounds = bounds[1:]
  if any(b is None for b in bounds):
    return None
  if name == "select_n":
    lo, hi = min(b[0] for b in bounds), max(b[1] for b in bounds)
  elif name == "clamp":
    low, x, high = bounds
    lo, hi = max(low[0], min(x[0], high[1])), min(high[1], max(x[1],
                                                               low[0]))
  elif name == "add":
    lo, hi = bounds[0][0] + bounds[1][0], bounds[0][1] + bounds[1][1]
  elif name == "sub":
    lo, hi = bounds[0][0] - bounds[1][1], bounds[0][1] - bounds[1][0]
  elif name == "neg":
    lo, hi = -bounds[0][1], -bounds[0][0]
  elif name == "abs":
    lo, hi = bounds[0]
    lo, hi = ((lo, hi) if lo >= 0 else (-hi, -lo) if hi <= 0
              else (0, max(-lo, hi)))
  elif name in ("max", "min"):
    pick = max if name == "max" else min
    lo, hi = pick(bounds[0][0], bounds[1][0]), pick(bounds[0][1],
                                                     bounds[1][1])
  elif name == "mul":
    products = [a * b for a in bounds[0] for b in bounds[1]]
    lo, hi = min(products), max(products)
  else:
    return None
  return (lo, hi) if _INT32[0] <= lo and hi <= _INT32[1] else None
