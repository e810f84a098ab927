"""Error statistics of attention implementations against a float64 reference.

The reference is computed in NumPy float64 (forward and the analytic
backward), independent of JAX and of every implementation compared, from the
same rounded inputs the implementation sees: only the implementation's own
arithmetic counts as error.

The yardstick is FlashAttention's (Dao et al., tests/test_flash_attn.py): the
plain computation in the input dtype (`naive_attention`). An implementation
passes when its error is at most twice the yardstick's (plus a small eps).

An implementation is any callable `attention(query, key, value, *,
is_causal=False, mask=None) -> out` with query [batch, q_len, num_heads,
head_dim] and key/value [batch, kv_len, num_kv_heads, head_dim]:
`jax_flash.flash_attention` and `jax.nn.dot_product_attention` (with
`functools.partial` for their `implementation=`) both are.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

TENSORS = ("out", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class ErrorStats:
  """Absolute and norm-relative error of one tensor.

  Relative errors divide by the reference's max (resp. mean) magnitude, not
  elementwise, so that entries near zero do not dominate.
  """

  max_abs: float
  mean_abs: float
  max_rel: float
  mean_rel: float


def error_stats(actual, reference) -> ErrorStats:
  """Errors of `actual` against `reference` (any shapes that match)."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  reference = np.asarray(reference, np.float64)
  if actual.shape != reference.shape:
    raise ValueError(f"shapes differ: actual {actual.shape}, reference "
                     f"{reference.shape}")
  diff = np.abs(actual - reference)  # NaN where actual is not finite
  scale_max = max(float(np.max(np.abs(reference))), np.finfo(np.float64).tiny)
  scale_mean = max(float(np.mean(np.abs(reference))),
                   np.finfo(np.float64).tiny)
  max_abs = float(np.max(diff)) if diff.size else 0.0
  mean_abs = float(np.mean(diff)) if diff.size else 0.0
  return ErrorStats(max_abs, mean_abs, max_abs / scale_max,
                    mean_abs / scale_mean)


@dataclasses.dataclass(frozen=True)
class Case:
  """One shape and dtype to measure; inputs are standard normal."""

  dtype: str
  q_len: int
  head_dim: int
  kv_len: int | None = None  # default q_len
  batch: int = 1
  num_heads: int = 4
  num_kv_heads: int | None = None  # default num_heads
  is_causal: bool = False

  def inputs(self, seed: int):
    """(q, k, v, d_out) in `dtype`; d_out is the random cotangent."""
    kv_len = self.kv_len or self.q_len
    num_kv_heads = self.num_kv_heads or self.num_heads
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(self.batch, self.q_len, self.num_heads, self.head_dim),
              (self.batch, kv_len, num_kv_heads, self.head_dim),
              (self.batch, kv_len, num_kv_heads, self.head_dim),
              (self.batch, self.q_len, self.num_heads, self.head_dim)]
    return tuple(jax.random.normal(k, s, jnp.float32).astype(self.dtype)
                 for k, s in zip(keys, shapes))


def attention_float64(query, key, value, d_out=None, *, is_causal=False,
                      mask=None, scale=None):
  """Softmax attention and its gradients in NumPy float64.

  Args:
    query: [batch, q_len, num_heads, head_dim].
    key, value: [batch, kv_len, num_kv_heads, head_dim].
    d_out: cotangent of the output, [batch, q_len, num_heads, head_dim]; when
      None only the output is computed.
    is_causal: query i attends to keys j <= i (top-left, as jax.nn).
    mask: bool, broadcastable to [batch, num_heads, q_len, kv_len].
    scale: default 1/sqrt(head_dim).

  Returns:
    out, or (out, (dq, dk, dv)) with d_out; float64, in the input layouts.
    Rows with nothing to attend to give 0 and zero gradients.
  """
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
             for x in (query, key, value))
  b, tq, n, d = q.shape
  _, tk, nk, _ = k.shape
  g = n // nk
  scale = d ** -0.5 if scale is None else scale
  # Heads as [kv_head, group] so that K/V broadcast over the group (GQA).
  q = q.reshape(b, tq, nk, g, d).transpose(0, 2, 3, 1, 4)  # [b, nk, g, tq, d]
  k = k.transpose(0, 2, 1, 3)[:, :, None]  # [b, nk, 1, tk, d]
  v = v.transpose(0, 2, 1, 3)[:, :, None]
  keep = np.ones((tq, tk), bool)
  if is_causal:
    keep = np.tril(keep)
  if mask is not None:
    mask = np.broadcast_to(np.asarray(mask, bool), (b, n, tq, tk))
    keep = keep & mask.reshape(b, nk, g, tq, tk)
  logits = np.where(keep, scale * (q @ k.swapaxes(-1, -2)), -np.inf)
  row_max = np.max(logits, axis=-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  p = np.exp(logits - row_max)
  row_sum = np.sum(p, axis=-1, keepdims=True)
  p = p / np.where(row_sum == 0.0, 1.0, row_sum)
  out = p @ v  # [b, nk, g, tq, d]

  def to_query_layout(x):
    return x.transpose(0, 3, 1, 2, 4).reshape(b, tq, n, d)

  if d_out is None:
    return to_query_layout(out)
  do = np.asarray(jnp.asarray(d_out, jnp.float32), np.float64)
  do = do.reshape(b, tq, nk, g, d).transpose(0, 2, 3, 1, 4)
  dv = np.sum(p.swapaxes(-1, -2) @ do, axis=2)  # sum over the group
  dp = do @ v.swapaxes(-1, -2)
  ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
  dq = scale * (ds @ k)
  dk = scale * np.sum(ds.swapaxes(-1, -2) @ q, axis=2)
  return to_query_layout(out), (to_query_layout(dq), dk.transpose(0, 2, 1, 3),
                                dv.transpose(0, 2, 1, 3))


def naive_attention(query, key, value, *, is_causal=False, mask=None,
                    scale=None):
  """Attention with every step in the input dtype: the 2x yardstick.

  Logits, softmax and the weighted sum are rounded to the input dtype, as
  in FlashAttention's `attention_ref(upcast=False)`. Dots multiply exactly
  (`Precision.HIGHEST`, so float32 is not TF32), so float32 gets a float32
  yardstick. Same arguments and layouts as `jax.nn.dot_product_attention`.
  """
  dtype = query.dtype
  group = query.shape[2] // key.shape[2]
  key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  highest = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, precision=highest)
  logits = logits * jnp.asarray(scale, dtype)
  keep = jnp.ones(logits.shape[-2:], bool)
  if is_causal:
    keep = jnp.tril(keep)
  if mask is not None:
    keep = keep & mask
  logits = jnp.where(keep, logits, -jnp.inf)
  weights = jax.nn.softmax(logits, axis=-1)
  weights = jnp.where(jnp.any(keep, axis=-1, keepdims=True), weights, 0)
  return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(dtype), value,
                    precision=highest)


def measure(attention: Callable, case: Case, *, seed: int = 0,
            reference=None) -> dict[str, ErrorStats]:
  """Errors of `attention`'s output and gradients on `case`.

  Args:
    attention: `(q, k, v, *, is_causal) -> out`.
    case: shape, dtype and causality.
    seed: inputs and cotangent.
    reference: `attention_float64`'s result for these inputs, to share it
      among implementations; computed when None.

  Returns:
    {"out", "dq", "dk", "dv"} -> ErrorStats.
  """
  q, k, v, d_out = case.inputs(seed)
  if reference is None:
    reference = attention_float64(q, k, v, d_out, is_causal=case.is_causal)
  out, grads = _forward_and_vjp(attention, case.is_causal, q, k, v, d_out)
  ref_out, ref_grads = reference
  return {name: error_stats(actual, expected) for name, actual, expected in
          zip(TENSORS, (out, *grads), (ref_out, *ref_grads))}


def _forward_and_vjp(attention, is_causal, q, k, v, d_out):
  def forward_and_vjp(q, k, v, d_out):
    out, pullback = jax.vjp(
        lambda q, k, v: attention(q, k, v, is_causal=is_causal), q, k, v)
    return out, pullback(d_out)

  # Jitted on a GPU, where op-by-op dispatch compiles every small op of
  # the wrappers separately; not on the CPU, where JAX 0.10 cannot compile
  # jax.nn's float16 attention (an F16_F16_F32 dot) but runs it op by op.
  if jax.default_backend() == "gpu":
    forward_and_vjp = jax.jit(forward_and_vjp)
  return forward_and_vjp(q, k, v, d_out)


def sweep(implementations: Mapping[str, Callable], cases: Iterable[Case], *,
          seed: int = 0, progress: Callable | None = None) -> list[dict]:
  """Measures every implementation, and the yardstick, on every case.

  Args:
    implementations: name -> `attention` (see the module docstring). One that
      raises NotImplementedError for a case (cuDNN for float32, say) gets a
      row with `error` set and NaN statistics.
    cases: what to measure.
    seed: inputs.
    progress: optional wrapper for the case iterator (e.g. `tqdm.tqdm`).

  Returns:
    One dict per (case, implementation, tensor): the fields of `Case` and of
    `ErrorStats`, `implementation`, `tensor`, `naive_max_abs` (the
    yardstick's max_abs for the same tensor), `ratio` (max_abs /
    naive_max_abs: FlashAttention's rule asks for <= 2) and `error`.
    The yardstick itself appears as implementation "naive".
  """
  cases = list(cases)
  rows = []
  for case in (progress(cases) if progress else cases):
    q, k, v, d_out = case.inputs(seed)
    reference = attention_float64(q, k, v, d_out, is_causal=case.is_causal)
    naive = measure(naive_attention, case, seed=seed, reference=reference)
    for name, attention in {"naive": None, **implementations}.items():
      error = None
      try:
        stats = naive if attention is None else measure(
            attention, case, seed=seed, reference=reference)
      except NotImplementedError as e:
        error = str(e) or type(e).__name__
        nan = ErrorStats(math.nan, math.nan, math.nan, math.nan)
        stats = dict.fromkeys(TENSORS, nan)
      for tensor in TENSORS:
        rows.append({
            **dataclasses.asdict(case), "implementation": name,
            "tensor": tensor, **dataclasses.asdict(stats[tensor]),
            "naive_max_abs": naive[tensor].max_abs,
            "ratio": stats[tensor].max_abs / max(naive[tensor].max_abs,
                                                 np.finfo(np.float64).tiny),
            "error": error})
  return rows


def format_table(rows: Iterable[dict], columns: Iterable[str]) -> str:
  """Plain-text table of `rows` (dicts) with the given columns."""
  rows, columns = list(rows), list(columns)

  def cell(value):
    if isinstance(value, float):
      return f"{value:.2e}" if math.isfinite(value) else str(value)
    return str(value)

  cells = [[cell(row[c]) for c in columns] for row in rows]
  widths = [max([len(c)] + [len(r[i]) for r in cells])
            for i, c in enumerate(columns)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
  lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
  return "\n".join(lines)


def fully_masked_rows(attention: Callable, *, dtype="float32", seed=0):
  """Runs `attention` with a mask that leaves some query rows empty.

  The contract (DESIGN.md): such rows give output 0 and zero gradients, and
  nothing anywhere is NaN. `jax.nn`'s XLA path gives the mean of V instead.

  Args:
    attention: `(q, k, v, *, mask) -> out`.
    dtype: input dtype.
    seed: inputs.

  Returns:
    A dict: `all_finite` (output and gradients), `empty_rows` (their
    indices), `empty_row_max_abs_out` and `empty_row_max_abs_dq` (0 when
    the contract holds) and `other_rows_max_abs_err` (against float64).
  """
  case = Case(dtype=dtype, q_len=8, head_dim=16, num_heads=2, batch=1)
  q, k, v, d_out = case.inputs(seed)
  keep = np.array(jax.random.bernoulli(jax.random.key(seed + 1), 0.6,
                                       (1, 1, 8, 8)))
  keep |= np.eye(8, dtype=bool)
  empty_rows = [2, 5]
  keep[..., empty_rows, :] = False
  mask = jnp.asarray(keep)
  out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, mask=mask),
                          q, k, v)
  grads = pullback(d_out)
  ref_out, ref_grads = attention_float64(q, k, v, d_out, mask=keep)
  others = [i for i in range(8) if i not in empty_rows]
  values = [np.asarray(jnp.asarray(x, jnp.float32)) for x in (out, *grads)]
  errors = [error_stats(a[:, others], r[:, others]).max_abs
            for a, r in ((values[0], ref_out), (values[1], ref_grads[0]))]
  return {
      "all_finite": all(bool(np.all(np.isfinite(x))) for x in values),
      "empty_rows": empty_rows,
      "empty_row_max_abs_out": float(np.max(np.abs(values[0][:, empty_rows]))),
      "empty_row_max_abs_dq": float(np.max(np.abs(values[1][:, empty_rows]))),
      "other_rows_max_abs_err": max(errors),
  }
