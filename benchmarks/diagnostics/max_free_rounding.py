"""The output's error of a softmax without a running max (the soft cap's
max-free forward, `plan.max_free_cap`), emulated in XLA on any machine.

    python -m benchmarks.diagnostics.max_free_rounding

Rows of `keys` capped logits (cap 5) over bf16 V [keys, 80]; P is rounded
to bf16 for the P·V product as the kernels round it, and the row sum l
kept in float32. Three forms, max |O - O_exact| over 20,000 rows each,
O rounded to bf16 as stored:
- max-subtracted: P = exp(s - max) (the row's largest weight is exactly 1,
  so rounding never touches it);
- max-free: P = exp(s), up to e^cap, rounded like every other weight, while
  l sums the unrounded P: O is off by the dominant weight's rounding;
- max-free, l of the rounded P: numerator and denominator from the same
  weights, so a row of one key gives V exactly again. The kernel's form
  (`KernelStatic.max_free`) normalises O so and keeps the exact sum for
  the LSE, which this emulation of O does not need.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ROWS, HEAD_DIM, CAP = 20_000, 80, 5.0


def _rounded(x):
  return x.astype(jnp.bfloat16).astype(jnp.float32)


def errors(keys: int, seed: int = 0) -> dict[str, float]:
  """max |O - O_exact| of the three forms for rows of `keys` keys."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  s = CAP * jnp.tanh(jax.random.normal(k1, (ROWS, keys)) * 2.0 / CAP)
  v = _rounded(jax.random.normal(k2, (ROWS, keys, HEAD_DIM)))
  exact = jnp.einsum("rk,rkd->rd", jax.nn.softmax(s, -1), v)

  def out(p, row_sum):
    return jnp.einsum("rk,rkd->rd", _rounded(p), v) / row_sum[:, None]
  shifted = jnp.exp(s - s.max(-1, keepdims=True))
  free = jnp.exp(s)
  forms = {"max-subtracted": out(shifted, shifted.sum(-1)),
           "max-free": out(free, free.sum(-1)),
           "max-free, l of rounded P": out(free, _rounded(free).sum(-1))}
  return {name: float(jnp.max(jnp.abs(_rounded(o) - exact)))
          for name, o in forms.items()}


def main() -> None:
  print("| keys a row | max-subtracted | max-free | max-free, l of rounded P |")
  print("|---|---|---|---|")
  for keys in (1, 2, 4, 16, 128):
    e = errors(keys)
    print(f"| {keys} | " + " | ".join(f"{x:.4f}" for x in e.values()) + " |")


if __name__ == "__main__":
  main()
