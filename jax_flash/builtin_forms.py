"""A `score_fn` or `mask_fn` that is a built-in, run as that built-in.

`score_fn(s, b, h, q_idx, kv_idx)` is opaque to the kernels: they call it
on whole [block_q, block_kv] tiles of scores and positions, forward and
backward. A relative-position bias written that way, FlexAttention-style
(`s + slope(h) * (kv_idx - q_idx)`, or under a causal mask `s - slope(h) *
abs(q_idx - kv_idx)`), then costs a tile of positions, a conversion and a
multiply-add per score, where the built-in causal ALiBi enters as one
term per key and one per query (`pallas_kernels.mosaic.common.
alibi_columns`): on an H100 at 16k, d=128, fwd+bwd, ALiBi as a `score_fn`
ran 0.79x plain causal against the built-in's 0.88x. A soft cap written
as `score_fn` misses the plain kernels' capped forward (d=256) and the
folded cap (`masking.modify_scores_folded`).

`score_form` reads the function's jaxpr (traced on scalars) with its
score and positions as symbols and everything else, (b, h) and constants,
as values, under `vmap` over every (b, h). Where the result is, on every
entry a causal mask keeps,

    A = s + alpha(b, h) * q_idx + beta(b, h) * kv_idx + gamma(b, h)

the call runs as built-in ALiBi with slopes beta (the built-in adds
-slope * |q_pos - kv_idx| = slope * (kv_idx - q_pos) there, q_pos = q_idx
+ q_offset), and what is left, a constant per row,

    shift(b, h, q_idx) = (alpha + beta) * q_idx + beta * q_offset + gamma,

leaves the softmax alone and is added to the returned logsumexp. Without
position terms (alpha = beta = 0) no mask is needed. `cap * tanh(A / cap)`
(or `A * (1 / cap)`), cap a Python number, runs as the built-in soft cap
after A's ALiBi, which must then leave no shift: a cap is not
shift-invariant, nor are sinks. `abs` is read where the mask fixes its
sign: of +-c (q_idx - kv_idx) under a causal mask without q_offset (kept
keys sit at or before their query). Anything else (a product of
positions, a `where` on them, a score not added) leaves the call as it
is. The rewritten scores differ from the function's by rounding only
(slope times a position, summed, against slope times the difference).

`mask_fn(b, h, q_idx, kv_idx)` likewise: a conjunction (`&`) of
comparisons of q_idx - kv_idx (times a number) with numbers bounds q_idx -
kv_idx from below and above, which is `is_causal` (a lower bound of 0) and
a `local_window_size` (other bounds; `abs(q_idx - kv_idx) <= w` is the
band -w..w), without q_offset (the function sees q_idx, the built-ins
q_idx + q_offset). The causal mask written as `mask_fn` then runs on the
plain kernels (it ran 0.93-0.94x of `is_causal` on the masked ones, H100,
16k, d=128, fwd+bwd), a window on the masked kernels without the
function's tiles or its block map.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jax_flash.validation import AttentionCall


class _NotAForm(Exception):
  """The function is not s + a linear function of the positions."""


@dataclasses.dataclass(frozen=True)
class _Coefficient:
  """const + sum(weight * atom): a coefficient of the form, kept symbolic
  in its atoms (traced scalars of b and h) so that terms cancel."""

  const: float = 0.0
  terms: tuple = ()  # ((atom, weight), ...), atoms distinct by identity

  def plus(self, other: "_Coefficient", sign: float = 1.0):
    terms = list(self.terms)
    for atom, weight in other.terms:
      for i, (mine, w) in enumerate(terms):
        if mine is atom:
          terms[i] = (mine, w + sign * weight)
          break
      else:
        terms.append((atom, sign * weight))
    return _Coefficient(self.const + sign * other.const,
                        tuple((a, w) for a, w in terms if w != 0))

  def scaled(self, factor: float):
    return _Coefficient(self.const * factor,
                        tuple((a, w * factor) for a, w in self.terms
                              if w * factor != 0))

  @property
  def is_const(self) -> bool:
    return not self.terms

  @property
  def is_zero(self) -> bool:
    return self.is_const and self.const == 0

  def value(self, dtype=jnp.float32):
    """The coefficient as a JAX scalar of `dtype`."""
    if len(self.terms) == 1 and self.const == 0 and self.terms[0][1] == 1:
      return jnp.asarray(self.terms[0][0]).astype(dtype)
    total = jnp.asarray(self.const, dtype)
    for atom, weight in self.terms:
      total = total + jnp.asarray(atom).astype(dtype) * weight
    return total

  def times(self, other: "_Coefficient"):
    if other.is_const:
      return self.scaled(other.const)
    if self.is_const:
      return other.scaled(self.const)
    return _atom(self.value() * other.value())


def _atom(value) -> _Coefficient:
  return _Coefficient(0.0, ((value, 1.0),))


_ZERO = _Coefficient()
_ONE = _Coefficient(1.0)


@dataclasses.dataclass(frozen=True)
class _Form:
  """s * score + q * q_idx + k * kv_idx + one, of a dtype."""

  score: _Coefficient
  q: _Coefficient
  k: _Coefficient
  one: _Coefficient
  dtype: object

  @property
  def parts(self):
    return (self.score, self.q, self.k, self.one)

  @property
  def is_scalar(self) -> bool:
    """Whether it depends on b, h and constants only."""
    return self.score.is_zero and self.q.is_zero and self.k.is_zero

  def map(self, fn, dtype=None):
    return _Form(*map(fn, self.parts), dtype or self.dtype)

  def plus(self, other: "_Form", sign: float = 1.0):
    return _Form(*(a.plus(b, sign) for a, b in zip(self.parts, other.parts)),
                 self.dtype)

  def scalar_value(self):
    return self.one.value(self.dtype)


def _scalar(value, dtype) -> _Form:
  """A value of b, h and constants: a number where it is known (a cap must
  be), else an atom."""
  known = not isinstance(value, jax.core.Tracer) and np.ndim(value) == 0
  coefficient = _Coefficient(float(value)) if known else _atom(value)
  return _Form(_ZERO, _ZERO, _ZERO, coefficient, dtype)


_SHAPE_ONLY = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
               "copy", "copy_p"}
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _evaluate(jaxpr, consts, args, *, abs_sign_known: bool):
  """The outputs of `jaxpr` on `args` (`_Form`s), symbolic where they
  depend on the score or the positions."""
  env = {}

  def read(var):
    if isinstance(var, jex.Literal):
      value = var.val
      if getattr(value, "shape", ()) != ():
        raise _NotAForm("a non-scalar literal")
      return _scalar(value.item() if hasattr(value, "item") else value,
                     var.aval.dtype)
    return env[var]

  for var, value in zip(jaxpr.constvars, consts):
    env[var] = _scalar(value, getattr(value, "dtype", jnp.float32))
  for var, value in zip(jaxpr.invars, args):
    env[var] = value
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    outs = _apply(eqn, ins, abs_sign_known=abs_sign_known)
    for var, value in zip(eqn.outvars, outs):
      env[var] = value
  return [read(v) for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True)
class _Tanh:
  """tanh(form), and after a multiply by a constant `factor`: factor *
  tanh(form)."""

  form: _Form
  factor: float | None = None
  is_scalar = False
  dtype = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Bounds:
  """A `mask_fn`'s keep condition as bounds on q_idx - kv_idx: lower <= q -
  kv <= upper (None: unbounded)."""

  lower: int | None = None
  upper: int | None = None
  is_scalar = False
  dtype = jnp.bool_

  def both(self, other: "_Bounds") -> "_Bounds":
    pick = lambda f, a, b: a if b is None else b if a is None else f(a, b)
    return _Bounds(pick(max, self.lower, other.lower),
                   pick(min, self.upper, other.upper))


# Comparisons of a and b as c (q - kv) + c0 against 0, c0 = ±(a - b)'s
# constant: the sign that makes it a - b or b - a, and whether strict.
_COMPARISONS = {"ge": (1.0, False), "gt": (1.0, True), "le": (-1.0, False),
                "lt": (-1.0, True)}


def _bounds(form: _Form, strict: bool) -> _Bounds:
  """The bounds on d = q - kv of `form` >= 0 (> 0 where `strict`), `form`
  being c d + c0 with c and c0 numbers: positions are integers."""
  q, k, c0 = form.q, form.k, form.one
  if not (form.score.is_zero and q.is_const and k.is_const and c0.is_const
          and q.const == -k.const != 0):
    raise _NotAForm("a comparison that is not of q_idx - kv_idx with a "
                    "number")
  c, t = q.const, -c0.const / q.const  # c d >= -c0: d >= t (c > 0)
  if c > 0:
    return _Bounds(lower=math.floor(t) + 1 if strict else math.ceil(t))
  return _Bounds(upper=math.ceil(t) - 1 if strict else math.floor(t))


def _apply(eqn, ins, *, abs_sign_known: bool):
  name = eqn.primitive.name
  dtype = eqn.outvars[0].aval.dtype
  if all(x.is_scalar for x in ins):
    values = [x.scalar_value() for x in ins]
    outs = eqn.primitive.bind(*values, **eqn.params)
    outs = outs if eqn.primitive.multiple_results else [outs]
    return [_scalar(o, v.aval.dtype) for o, v in zip(outs, eqn.outvars)]
  if any(v.aval.shape != () for v in eqn.outvars):
    raise _NotAForm(f"{name} of a non-scalar shape")
  if name in _SHAPE_ONLY or (name == "convert_element_type"
                             and ins[0].dtype == dtype):
    return [ins[0]]
  for param in _CALLS:
    if param in eqn.params:
      closed = eqn.params[param]
      inner = getattr(closed, "jaxpr", closed)
      return _evaluate(inner, getattr(closed, "consts", ()), ins,
                       abs_sign_known=abs_sign_known)
  if any(isinstance(x, _Distance) for x in ins):
    return [_distance_op(name, ins, dtype)]
  if name in _COMPARISONS:
    sign, strict = _COMPARISONS[name]
    return [_bounds(ins[0].plus(ins[1], -1.0).map(
        lambda c: c.scaled(sign)), strict)]
  if any(isinstance(x, _Bounds) for x in ins):
    bounds = [x if isinstance(x, _Bounds) else _always(x) for x in ins]
    if name != "and" or None in bounds:
      raise _NotAForm(f"{name} of a mask's bounds")
    return [bounds[0].both(bounds[1])]
  if any(isinstance(x, _Tanh) for x in ins):
    return [_scaled_tanh(name, ins)]
  if name == "tanh":
    return [_Tanh(ins[0])]
  if name == "add":
    return [ins[0].plus(ins[1])]
  if name == "sub":
    return [ins[0].plus(ins[1], -1.0)]
  if name == "neg":
    return [ins[0].map(lambda c: c.scaled(-1.0))]
  if name == "mul":
    form, factor = ins if ins[1].is_scalar else ins[::-1]
    if not factor.is_scalar:
      raise _NotAForm("a product of two position or score terms")
    return [form.map(lambda c: c.times(factor.one))]
  if (name == "div" and ins[1].is_scalar
      and jnp.issubdtype(dtype, jnp.floating)):  # not an integer division
    den = ins[1].one
    inverse = (_Coefficient(1.0 / den.const) if den.is_const
               else _atom(1.0 / den.value()))
    return [ins[0].map(lambda c: c.times(inverse))]
  if name == "convert_element_type":
    # Exact ones only (positions below 2^24): to float32 or wider, or
    # between integers; a rounding to 16 bits would be lost.
    if jnp.dtype(dtype).itemsize >= 4 and (
        jnp.issubdtype(dtype, jnp.floating) or
        jnp.issubdtype(ins[0].dtype, jnp.integer)):
      return [ins[0].map(lambda c: c, dtype)]
    raise _NotAForm("a conversion that rounds, or to an integer")
  if name == "abs":
    return [_abs_of_difference(ins[0], abs_sign_known)]
  raise _NotAForm(f"{name} of a position or score term")


def _always(form: _Form) -> _Bounds | None:
  """No bounds where `form` is the constant True, else None."""
  true = form.is_scalar and form.one.is_const and form.one.const == 1
  return _Bounds() if true else None


def _scaled_tanh(name: str, ins) -> _Tanh:
  """factor * tanh(form), the factor a constant (a Python number, so that
  it can be the built-in cap)."""
  tanh, factor = ins if isinstance(ins[0], _Tanh) else ins[::-1]
  if not (name == "mul" and tanh.factor is None and factor.is_scalar
          and factor.one.is_const):
    raise _NotAForm(f"{name} of a tanh")
  return _Tanh(tanh.form, factor.one.const)


@dataclasses.dataclass(frozen=True)
class _Distance:
  """scale * |q_idx - kv_idx| where its sign is not known: only a mask's
  comparison with a number takes it (a band about the diagonal)."""

  scale: float
  is_scalar = False
  dtype = jnp.int32


def _abs_of_difference(form: _Form, sign_known: bool) -> _Form | _Distance:
  """|c (q_idx - kv_idx)| = |c| (q_idx - kv_idx) where every kept key sits
  at or before its query (causal, no q_offset); else a `_Distance`."""
  q, k = form.q, form.k
  if not (form.score.is_zero and form.one.is_zero and q.is_const
          and k.is_const and q.const == -k.const != 0):
    raise _NotAForm("abs of anything but c * (q_idx - kv_idx)")
  c = abs(q.const)
  if not sign_known:
    return _Distance(c)
  return dataclasses.replace(form, q=_Coefficient(c), k=_Coefficient(-c))


def _distance_op(name: str, ins, dtype):
  """A `_Distance` converted to float, times a positive number, or
  compared with a number (`_band`)."""
  if name in _COMPARISONS:
    return _band(name, ins)
  if name == "convert_element_type" and jnp.dtype(dtype).itemsize >= 4:
    return ins[0]
  distance, factor = ins if isinstance(ins[0], _Distance) else ins[::-1]
  if (name == "mul" and isinstance(factor, _Form) and factor.is_scalar
      and factor.one.is_const and factor.one.const > 0):
    return _Distance(distance.scale * factor.one.const)
  raise _NotAForm(f"{name} of a distance")


def _band(name: str, ins) -> _Bounds:
  """|d| <= t (or < t), d = q_idx - kv_idx: -t' <= d <= t'."""
  distance, limit = ins
  name = {"ge": "le", "gt": "lt"}.get(name, name) if isinstance(
      ins[1], _Distance) else name
  if isinstance(ins[1], _Distance):
    distance, limit = ins[1], ins[0]
  if not (name in ("le", "lt") and isinstance(limit, _Form)
          and limit.is_scalar and limit.one.is_const):
    raise _NotAForm(f"{name} of a distance")
  t = limit.one.const / distance.scale
  reach = math.ceil(t) - 1 if name == "lt" else math.floor(t)
  if reach < 0:
    raise _NotAForm("a band that keeps nothing")
  return _Bounds(-reach, reach)


@dataclasses.dataclass(frozen=True)
class ScoreForm:
  """`score_fn` as built-ins (module docstring): ALiBi `slopes` float32
  [batch, num_heads] (None without position terms), the row shift's parts
  (None where symbolically zero: `row_slope` [batch, num_heads] times
  q_idx, plus `row_const` [batch, num_heads]) and a soft `cap`."""

  slopes: jax.Array | None
  row_slope: jax.Array | None
  row_const: jax.Array | None
  cap: float | None = None

  @property
  def shifts_rows(self) -> bool:
    return self.row_slope is not None or self.row_const is not None


def _uncapped(out) -> tuple[_Form, float | None]:
  """(A, cap) of `out` = A or cap * tanh(A / cap)."""
  if not isinstance(out, _Tanh):
    return out, None
  cap, inner = out.factor, out.form
  if cap is None or not cap > 0 or not inner.score.is_const:
    raise _NotAForm("a tanh that is not a soft cap")
  if abs(inner.score.const * cap - 1.0) > 1e-6:
    raise _NotAForm("a tanh whose scale is not 1 / its factor")
  scores = inner.map(lambda c: c.scaled(cap))
  return dataclasses.replace(scores, score=_ONE), cap


def score_form(score_fn, *, batch: int, num_heads: int,
               abs_sign_known: bool) -> ScoreForm | None:
  """`score_fn`'s built-in form (module docstring), or None where it has
  none. `abs_sign_known`: every kept key sits at or before its query
  (causal without q_offset), so that abs(q_idx - kv_idx) is q_idx -
  kv_idx."""
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
  try:
    closed = jax.make_jaxpr(score_fn)(
        scalar(jnp.float32), *(scalar(jnp.int32) for _ in range(4)))
  except Exception:  # pylint: disable=broad-except
    return None  # a function that takes tiles only: opaque it stays
  if len(closed.jaxpr.outvars) != 1 or any(
      isinstance(c, jax.core.Tracer) for c in closed.consts):
    # A value of the caller's trace among its constants: built-in slopes
    # or caps would take no gradient where the function's terms do.
    return None
  found = {}

  def coefficients(b, h):
    score = _Form(_ONE, _ZERO, _ZERO, _ZERO, jnp.float32)
    q = _Form(_ZERO, _ONE, _ZERO, _ZERO, jnp.int32)
    k = _Form(_ZERO, _ZERO, _ONE, _ZERO, jnp.int32)
    (out,) = _evaluate(closed.jaxpr, closed.consts,
                       [score, _scalar(b, jnp.int32), _scalar(h, jnp.int32),
                        q, k], abs_sign_known=abs_sign_known)
    out, cap = _uncapped(out)
    if not (out.score.is_const and out.score.const == 1.0
            and jnp.issubdtype(out.dtype, jnp.floating)):
      raise _NotAForm("the score is not added")
    row = out.q.plus(out.k)
    found.update(positions=not (out.q.is_zero and out.k.is_zero),
                 row_slope=not row.is_zero, row_const=not out.one.is_zero,
                 cap=cap)
    return out.k.value(), row.value(), out.one.value()

  b = jnp.arange(batch, dtype=jnp.int32)[:, None]
  h = jnp.arange(num_heads, dtype=jnp.int32)[None, :]
  grid = jax.vmap(jax.vmap(coefficients))
  try:
    slopes, row_slope, row_const = grid(*jnp.broadcast_arrays(b, h))
  except _NotAForm:
    return None
  return ScoreForm(slopes.astype(jnp.float32) if found["positions"] else None,
                   row_slope if found["row_slope"] else None,
                   row_const if found["row_const"] else None, found["cap"])


def mask_form(mask_fn) -> _Bounds | None:
  """`mask_fn`'s keep condition as bounds on q_idx - kv_idx (`_Bounds`;
  no bounds for the constant True), or None where it is anything else: a
  conjunction of comparisons of q_idx - kv_idx with numbers is a causal
  mask and a window."""
  int32 = jax.ShapeDtypeStruct((), jnp.int32)
  try:
    closed = jax.make_jaxpr(mask_fn)(int32, int32, int32, int32)
  except Exception:  # pylint: disable=broad-except
    return None
  if len(closed.jaxpr.outvars) != 1 or any(
      isinstance(c, jax.core.Tracer) for c in closed.consts):
    return None
  found = []

  def bounds(b, h):  # b and h traced: bounds that depend on them are not
    q = _Form(_ZERO, _ONE, _ZERO, _ZERO, jnp.int32)  # numbers
    k = _Form(_ZERO, _ZERO, _ONE, _ZERO, jnp.int32)
    (out,) = _evaluate(closed.jaxpr, closed.consts,
                       [_scalar(b, jnp.int32), _scalar(h, jnp.int32), q, k],
                       abs_sign_known=False)
    found.append(out if isinstance(out, _Bounds) else _always(out))
    return b

  try:
    jax.make_jaxpr(bounds)(int32, int32)
  except _NotAForm:
    return None
  return found[0]


def _with_mask_form(spec, operands):
  """(spec, operands) with a `mask_fn` that is a causal mask and a window
  replaced by `is_causal` and `window`, or None where it is not. The
  function sees q_idx, the built-ins q_idx + q_offset: without q_offset
  only."""
  bounds = mask_form(spec.mask_fn)
  if bounds is None or spec.has_q_offset:
    return None
  lower, upper = bounds.lower, bounds.upper
  if (lower is not None and lower > 0) or (upper is not None and upper < 0):
    return None  # keys strictly before the diagonal only, or after it
  causal = spec.is_causal or lower == 0
  left, right = spec.window or (None, None)
  pick = lambda a, b: a if b is None else b if a is None else min(a, b)
  left = pick(left, upper)
  right = pick(right, None if lower is None or lower == 0 else -lower)
  window = None if left is None and right is None else (left, right)
  spec = dataclasses.replace(spec, mask_fn=None, is_causal=causal,
                             window=window)
  return spec, operands._replace(block_mask=None)


def as_builtin(call: AttentionCall):
  """(call, lse_shift): `call` with a `score_fn` that has a built-in form
  replaced by the built-ins, and the float32 [batch, num_heads, q_len] to
  add to the kernels' logsumexp (None where nothing is); else (call,
  None)."""
  spec, operands = call.spec, call.operands
  if spec.mask_fn is not None:
    masks = _with_mask_form(spec, operands)
    if masks is not None:
      spec, operands = masks
      call = dataclasses.replace(call, spec=spec, operands=operands)
  if spec.score_fn is None:
    return call, None
  shape = call.shape
  form = score_form(spec.score_fn, batch=shape.batch,
                    num_heads=shape.num_heads,
                    abs_sign_known=spec.is_causal and not spec.has_q_offset)
  if form is None:
    return call, None
  positions = form.slopes is not None
  if positions and (not spec.is_causal or spec.has_alibi):
    return call, None  # not ALiBi's form, or ALiBi already
  if form.cap is not None and spec.logits_soft_cap is not None:
    return call, None  # a cap inside a cap
  shift_sensitive = (form.cap is not None or spec.logits_soft_cap is not None
                     or call.sinks is not None)
  if shift_sensitive and (form.shifts_rows
                          or (positions and spec.has_q_offset)):
    return call, None
  builtin = dataclasses.replace(
      call, spec=dataclasses.replace(
          spec, score_fn=None, has_alibi=spec.has_alibi or positions,
          logits_soft_cap=(form.cap if form.cap is not None
                           else spec.logits_soft_cap)),
      operands=(operands._replace(alibi_slopes=form.slopes) if positions
                else operands))
  return builtin, _row_shift(form, operands.q_offset, shape)


def _row_shift(form: ScoreForm, q_offset, shape):
  """shift [batch, num_heads, q_len] (module docstring), or None."""
  shift = None
  if form.row_slope is not None:
    q_idx = jnp.arange(shape.q_len, dtype=jnp.float32)
    shift = form.row_slope[:, :, None] * q_idx
  if q_offset is not None and form.slopes is not None:
    offset = jnp.asarray(q_offset, jnp.float32).reshape(-1)[:, None, None]
    term = form.slopes[:, :, None] * offset
    shift = term if shift is None else shift + term
  if form.row_const is not None:
    term = form.row_const[:, :, None]
    shift = term if shift is None else shift + term
  if shift is None:
    return None
  return jnp.broadcast_to(shift, (shape.batch, shape.num_heads, shape.q_len))
