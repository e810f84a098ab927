"""Which LSE rows the plain Mosaic forward gets wrong at ragged lengths.

    python -m benchmarks.diagnostics.ragged_lse_rows [--grads]

For lengths that no Q tile divides (1000 rows in 128-row tiles; ViT's 197
tokens padded to 200; a causal call with q_len > kv_len; head dim 176 at
its own width), runs `mosaic_forward` twice and prints, against the
float32 reference, the largest LSE error and where the wrong rows are:
(batch, head) pairs and row indices [batch, heads, q_len]. A TMA store
that spills a partial tile's rows past q_len onto the next head shows as
rows 0..k of heads >= 1 (the fault `forward.launch`'s padded LSE fixed:
benchmarks/NOTES.md, "Ragged lengths on the plain kernels"). `--grads`
also checks `flash_attention(implementation="mosaic")`'s gradients.
Needs an sm90 GPU.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash.reference import naive_attention
from pallas_kernels.mosaic.forward import mosaic_forward

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "tests"))
from attention_checks import Case, forward_and_grads, random_inputs  # noqa: E402

CASES = (
    (Case(1, 1000, 1000, 4, 2, 128), False),
    (Case(1, 1000, 1000, 4, 2, 128), True),
    (Case(2, 264, 136, 4, 2, 128), True),     # q_len > kv_len
    (Case(1, 1000, 1000, 4, 2, 256), False),
    (Case(8, 200, 200, 12, 12, 64), False),   # ViT-B/16, rows padded
    (Case(1, 776, 304, 4, 4, 176), False),    # at its own width
)


def wrong_rows(lse, ref_lse, tolerance: float = 0.01) -> str:
  """The largest error of lse [batch, heads, q_len] and where it exceeds
  `tolerance`."""
  err = np.abs(np.asarray(lse) - ref_lse)
  bad = np.argwhere(err > tolerance)
  pairs = sorted({(int(b), int(h)) for b, h, _ in bad})
  rows = sorted({int(r) for _, _, r in bad})
  where = f" in (batch, head) {pairs[:6]} rows {rows[:4]}..{rows[-4:]}"
  return f"LSE error {err.max():.4f}, {len(bad)} wrong" + (where if rows
                                                             else "")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--grads", action="store_true")
  args = parser.parse_args()
  up = lambda x: x.astype(jnp.float32)
  for case, causal in CASES:
    q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, 0)
    reference = lambda q, k, v: naive_attention(q, k, v, is_causal=causal)
    _, ref_lse = jax.jit(reference)(up(q), up(k), up(v))
    ref_lse = np.asarray(jnp.swapaxes(ref_lse, 1, 2))
    forward = jax.jit(lambda q, k, v: mosaic_forward(
        q, k, v, scale=case.head_dim ** -0.5, is_causal=causal))
    for run in range(2):
      print(f"{case} causal={causal} run {run}: "
            f"{wrong_rows(forward(q, k, v)[1], ref_lse)}", flush=True)
    if args.grads:
      exact = forward_and_grads(reference, up(q), up(k), up(v), up(d_out),
                                d_lse)
      ours = forward_and_grads(jax.jit(
          lambda q, k, v: jax_flash.flash_attention(
              q, k, v, is_causal=causal, return_residual=True,
              implementation="mosaic")), q, k, v, d_out, d_lse)
      print("  max error:", {name: round(float(jnp.max(jnp.abs(
          up(ours[name]) - exact[name]))), 4) for name in ours}, flush=True)


if __name__ == "__main__":
  main()
