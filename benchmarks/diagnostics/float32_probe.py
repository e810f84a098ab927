"""Compile time, run time and error of the Triton path in float32, by tiles
and dot precision.

    python -m benchmarks.diagnostics.float32_probe TILES PRECISION

TILES is `16bit` (the bfloat16 defaults) or `float32` (the float32 defaults);
PRECISION is `highest` (Triton's IEEE dot: FMAs) or `tf32x3` (three TF32
tensor-core passes). Written because the numerics notebook's float32 cases
did not compile within a minute on the H200 with 16-bit tiles at IEEE
precision. Prints per shape: compile time of the jitted forward and
forward+VJP, run time, and the max error of output and gradients against the
float32 reference at HIGHEST precision (random cotangent).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jax_flash
from pallas_kernels import compat, config
from pallas_kernels.triton import common

SHAPES = ((128, 128), (1024, 128), (1024, 256))  # (seq, head_dim), 2 heads
PRECISIONS = {"highest": jax.lax.Precision.HIGHEST,
              "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


def main(argv=None):
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("tiles", choices=("16bit", "float32"))
  parser.add_argument("precision", choices=tuple(PRECISIONS))
  args = parser.parse_args(argv)
  precision = PRECISIONS[args.precision]
  common.dot_precision = lambda dtype, interpret: (
      precision if jnp.dtype(dtype) == jnp.float32 else None)
  tiles_dtype = jnp.bfloat16 if args.tiles == "16bit" else jnp.float32
  for seq, head_dim in SHAPES:
    blocks = config.BlockSizes.get_default(head_dim, dtype=tiles_dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (1, seq, 2, head_dim), jnp.float32)
                      for key in keys)

    def with_vjp(attention):
      def run(q, k, v, d_out):
        out, pullback = jax.vjp(attention, q, k, v)
        return (out, *pullback(d_out))
      return run

    attention = lambda q, k, v: jax_flash.flash_attention(
        q, k, v, implementation="triton", block_sizes=blocks)
    with jax.default_matmul_precision("highest"):
      want = jax.jit(with_vjp(jax_flash.attention_reference))(q, k, v, d_out)
    for name, fn, inputs in (("fwd", attention, (q, k, v)),
                             ("fwd+vjp", with_vjp(attention), (q, k, v, d_out))):
      start = time.perf_counter()
      compiled = jax.jit(fn).lower(*inputs).compile()
      compile_s = time.perf_counter() - start
      got = jax.tree.leaves(jax.block_until_ready(compiled(*inputs)))
      start = time.perf_counter()
      for _ in range(5):
        jax.block_until_ready(compiled(*inputs))
      run_ms = (time.perf_counter() - start) / 5 * 1e3
      errors = " ".join(f"{float(jnp.max(jnp.abs(a - b))):.1e}"
                        for a, b in zip(got, want))
      print(f"{args.tiles}/{args.precision} seq {seq} d {head_dim} {name}: "
            f"compile {compile_s:.1f} s, run {run_ms:.2f} ms, "
            f"max error (out, dq, dk, dv) {errors}", flush=True)


if __name__ == "__main__":
  main()
