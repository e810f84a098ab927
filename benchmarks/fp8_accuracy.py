"""Error of the FP8 (e4m3) Mosaic forward against float32, next to bf16's.

    python -m benchmarks.fp8_accuracy   # -> benchmarks/results/h200_fp8_accuracy.{json,md}

Inputs: normal bf16 [2, seq, 8 heads, head_dim] with 2 K/V heads. The FP8
forward gets them quantised by `quantize_fp8` (Q, K and V per tensor and
head, or Q per block of 64 rows); "bf16" is the reference computed in bf16.
Both are compared with the reference in float32 on the bf16 inputs: max and
mean absolute error of the output, max absolute error of the LSE.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp

from benchmarks import common, render
from jax_flash import attention_reference
from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8, quantize_fp8


def quantized_forward(q, k, v, *, is_causal: bool, per_block: bool):
  """(out, lse [B, N, Tq]) of the FP8 forward on quantised q, k, v."""
  q8, q_descale = quantize_fp8(q, block_rows=64 if per_block else None)
  k8, k_descale = quantize_fp8(k)
  v8, v_descale = quantize_fp8(v)
  return mosaic_forward_fp8(q8, k8, v8, q_descale=q_descale,
                            k_descale=k_descale, v_descale=v_descale,
                            scale=q.shape[-1]**-0.5, is_causal=is_causal)


def errors(q, k, v, *, is_causal: bool, per_block: bool) -> dict[str, float]:
  """FP8 and bf16 errors against the float32 reference (see module doc)."""
  f32 = lambda x: x.astype(jnp.float32)
  out8, lse8 = quantized_forward(q, k, v, is_causal=is_causal,
                                 per_block=per_block)
  want, want_lse = attention_reference(f32(q), f32(k), f32(v),
                                       is_causal=is_causal,
                                       return_residual=True)
  bf16 = attention_reference(q, k, v, is_causal=is_causal)
  diff = lambda a: jnp.abs(f32(a) - want)
  return {"fp8_max": float(diff(out8).max()),
          "fp8_mean": float(diff(out8).mean()),
          "bf16_max": float(diff(bf16).max()),
          "bf16_mean": float(diff(bf16).mean()),
          "fp8_lse_max": float(jnp.abs(jnp.swapaxes(lse8, 1, 2)
                                       - want_lse).max())}


def random_qkv(seq: int, head_dim: int, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 3)
  shape_q, shape_kv = (2, seq, 8, head_dim), (2, seq, 2, head_dim)
  return (jax.random.normal(keys[0], shape_q, jnp.bfloat16),
          jax.random.normal(keys[1], shape_kv, jnp.bfloat16),
          jax.random.normal(keys[2], shape_kv, jnp.bfloat16))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--out",
                      default="benchmarks/results/h200_fp8_accuracy.json")
  args = parser.parse_args(argv)
  rows = []
  for head_dim, is_causal, per_block in itertools.product(
      (64, 128, 256), (False, True), (False, True)):
    q, k, v = random_qkv(args.seq, head_dim)
    rows.append({"head_dim": head_dim, "causal": is_causal,
                 "q_scales": "per block" if per_block else "per tensor",
                 **errors(q, k, v, is_causal=is_causal, per_block=per_block)})
  result = {**common.run_header("benchmarks.fp8_accuracy", argv),
            "seq_len": args.seq, "rows": rows}
  headers = ["head_dim", "causal", "q scales", "fp8 max", "bf16 max",
             "ratio", "fp8 mean", "bf16 mean", "fp8 lse max"]
  table = [[r["head_dim"], r["causal"], r["q_scales"], f"{r['fp8_max']:.2e}",
            f"{r['bf16_max']:.2e}", f"{r['fp8_max'] / r['bf16_max']:.1f}",
            f"{r['fp8_mean']:.2e}", f"{r['bf16_mean']:.2e}",
            f"{r['fp8_lse_max']:.2e}"] for r in rows]
  print(render.write_results(args.out, result, headers, table))
  return 0


if __name__ == "__main__":
  sys.exit(main())
