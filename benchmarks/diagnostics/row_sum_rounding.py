"""What O's and the LSE's row sum taken over the rounded P would cost in
accuracy, with a running max (benchmarks/NOTES.md Open, "The row sum by
MMA with a running max"), emulated in XLA on any machine.

    python -m benchmarks.diagnostics.row_sum_rounding

Causal attention, [batch 2, seq 512, heads 4, head_dim 64], q, k, v
N(0, 1) in bfloat16 (and with FlashAttention-3's outliers: N(0, 100) at
0.1% of entries), scale 1 / sqrt(d). The forward as the kernels compute
it with the row's max subtracted (the largest weight exactly 1): P =
exp(s - max) rounded to P V's dtype for P V (bfloat16, or e4m3 as the FP8
kernel rounds it), accumulated in float32, and normalised by
- "exact sum": l = the sum of the unrounded P (the kernels' form; the LSE
  is max + log l);
- "rounded sum": l = the sum of the rounded P, what P times a tile of ones
  gives (the LSE from it too).
The backward recomputes P from the LSE (FlashAttention-2's), in float32
with bfloat16 operands. Printed: max |x - x_float64| of O, the LSE, dQ,
dK and dV under a random cotangent, and their ratio to the plain
bfloat16 computation's (`jax.nn` attention in bfloat16: the tests' 2x
rule's yardstick; the FP8 rows' yardstick is the exact-sum form's own).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BATCH, SEQ, HEADS, DIM = 2, 512, 4, 64
E4M3 = jnp.float8_e4m3fn


def _inputs(seed: int, outliers: bool):
  keys = jax.random.split(jax.random.key(seed), 5)
  shape = (BATCH, SEQ, HEADS, DIM)
  q, k, v = (jax.random.normal(key, shape) for key in keys[:3])
  if outliers:  # FlashAttention-3's: N(0, 100) at 0.1% of entries
    big = jax.random.bernoulli(keys[3], 1e-3, shape)
    q, k = (jnp.where(big, 10.0 * x, x) for x in (q, k))
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  d_out = jax.random.normal(keys[4], shape)
  return q, k, v, d_out


def _scores(q, k, dtype):
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(dtype), k.astype(dtype),
                 precision="highest") * DIM**-0.5
  mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
  return jnp.where(mask, s, -jnp.inf)


def _forward(q, k, v, *, rounded_sum: bool, p_dtype):
  """(O, LSE) as the kernels compute them, l as `rounded_sum` says."""
  s = _scores(q, k, jnp.float32)
  m = s.max(-1, keepdims=True)
  p = jnp.exp(s - m)
  p_low = p.astype(p_dtype).astype(jnp.float32)
  o = jnp.einsum("bhqk,bkhd->bqhd", p_low, v.astype(jnp.float32),
                 precision="highest")
  l = (p_low if rounded_sum else p).sum(-1)
  lse = m[..., 0] + jnp.log(l)
  return o / jnp.swapaxes(l, 1, 2)[..., None], lse


def _backward(q, k, v, o, lse, d_out):
  """FlashAttention-2's backward from (O, LSE): P recomputed, bfloat16
  operands, float32 accumulation."""
  bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  s = _scores(q, k, jnp.float32)
  p = jnp.exp(s - lse[..., None])
  d_out = bf(d_out)
  delta = jnp.einsum("bqhd,bqhd->bhq", d_out, o)
  dv = jnp.einsum("bhqk,bqhd->bkhd", bf(p), d_out, precision="highest")
  dp = jnp.einsum("bqhd,bkhd->bhqk", d_out, bf(v), precision="highest")
  ds = p * (dp - delta[..., None])
  dq = jnp.einsum("bhqk,bkhd->bqhd", bf(ds), bf(k),
                  precision="highest") * DIM**-0.5
  dk = jnp.einsum("bhqk,bqhd->bkhd", bf(ds), bf(q),
                  precision="highest") * DIM**-0.5
  return dq, dk, dv


def _exact(q, k, v, d_out):
  """O, LSE, dQ, dK, dV in float64 (numpy), by autodiff in float64."""
  with jax.enable_x64():
    q, k, v, d_out = (jnp.asarray(np.asarray(x, np.float64))
                      for x in (q, k, v, d_out))
    s = _scores(q, k, jnp.float64)
    lse = jax.nn.logsumexp(s, -1)

    def attend(q, k, v):
      s = _scores(q, k, jnp.float64)
      return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    o, vjp = jax.vjp(attend, q, k, v)
    grads = vjp(d_out)
    return [np.asarray(x) for x in (o, lse, *grads)]


def _plain_bf16(q, k, v, d_out):
  """The tests' yardstick: attention computed in bfloat16."""
  def attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
  o, vjp = jax.vjp(attend, q, k, v)
  s = _scores(q, k, jnp.bfloat16).astype(jnp.float32)
  lse = jax.nn.logsumexp(s, -1)
  return [o, lse, *vjp(d_out.astype(jnp.bfloat16))]


def errors(seed: int = 0, *, outliers: bool = False, p_dtype=jnp.bfloat16
           ) -> dict[str, list[float]]:
  """max |x - x_float64| of (O, LSE, dQ, dK, dV) by form."""
  q, k, v, d_out = _inputs(seed, outliers)
  exact = _exact(q, k, v, d_out)
  worst = lambda xs: [float(np.max(np.abs(np.asarray(x, np.float64) - e)))
                      for x, e in zip(xs, exact)]
  result = {}
  if p_dtype == jnp.bfloat16:
    result["plain bf16"] = worst(_plain_bf16(q, k, v, d_out))
  for name, rounded_sum in (("exact sum", False), ("rounded sum", True)):
    o, lse = _forward(q, k, v, rounded_sum=rounded_sum, p_dtype=p_dtype)
    o_stored = o.astype(jnp.bfloat16).astype(jnp.float32)
    result[name] = worst([o_stored, lse,
                          *_backward(q, k, v, o_stored, lse, d_out)])
  return result


def main() -> None:
  names = ("O", "LSE", "dQ", "dK", "dV")
  for label, kwargs in (("bf16 P, N(0,1)", {}),
                        ("bf16 P, outliers", dict(outliers=True)),
                        ("e4m3 P, N(0,1)", dict(p_dtype=E4M3)),
                        ("e4m3 P, outliers", dict(p_dtype=E4M3,
                                                  outliers=True))):
    e = errors(**kwargs)
    yardstick = e.get("plain bf16", e["exact sum"])
    print(f"\n{label}: max error (x the "
          f"{'plain bf16' if 'plain bf16' in e else 'exact sum'} form's)")
    print("| form | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for form, row in e.items():
      cells = [f"{x:.2e} ({x / y:.2f}x)" for x, y in zip(row, yardstick)]
      print(f"| {form} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
