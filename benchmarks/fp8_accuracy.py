"""Error of the FP8 (e4m3) Mosaic forward against float32, next to bf16's.

    python -m benchmarks.fp8_accuracy   # -> benchmarks/results/h200_fp8_accuracy.{json,md}

Inputs: normal bf16 [2, seq, 8 heads, head_dim] with 2 K/V heads. The FP8
forward gets them quantised by `quantize_fp8` (Q, K and V per tensor and
head, or Q per block of 64 rows); "bf16" is the reference computed in bf16.
Both are compared with the reference in float32 on the bf16 inputs: max and
mean absolute error of the output, max absolute error of the LSE.

The yardstick for FP8 is FlashAttention's rule carried over: the naive
computation in the same precision ("fp8 naive": float32 attention on the
dequantised inputs with P rounded to e4m3 before P V, as the kernel does).
The kernel should stay within 2x its error; "rows over" counts output rows
whose error exceeds that, which points at a kernel bug rather than rounding.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp



from benchmarks import common, render
from jax_flash import attention_reference, masking
from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8, quantize_fp8


def quantized_forward(q, k, v, *, is_causal: bool, per_block: bool,
                      **options):
  """(out, lse [B, N, Tq]) of the FP8 forward on quantised q, k, v
  (`options`: more of `mosaic_forward_fp8`'s, e.g. lazy_rescale)."""
  q8, q_descale = quantize_fp8(q, block_rows=64 if per_block else None)
  k8, k_descale = quantize_fp8(k)
  v8, v_descale = quantize_fp8(v)
  return mosaic_forward_fp8(q8, k8, v8, q_descale=q_descale,
                            k_descale=k_descale, v_descale=v_descale,
                            scale=q.shape[-1]**-0.5, is_causal=is_causal,
                            **options)


def naive_fp8(q, k, v, *, is_causal: bool, per_block: bool):
  """(out float32 [B, T, H, D], lse float32 [B, T, H]): attention on the
  dequantised FP8 inputs, P in e4m3.

  P = exp(s - rowmax) is rounded to e4m3 before P V and the row sum taken
  before rounding, as in the kernel (which uses the running max instead).
  The LSE depends on the Q and K rounding only.
  """
  def dequantized(x, block_rows=None):
    x8, descale = quantize_fp8(x, block_rows=block_rows)
    if descale.ndim == 2:                           # [B, H] -> [B, 1, H, 1]
      factor = descale[:, None, :, None]
    else:                                           # [B, H, n] -> [B, T, H, 1]
      factor = jnp.repeat(jnp.moveaxis(descale, 2, 1), block_rows,
                          axis=1)[..., None]
    return x8.astype(jnp.float32) * factor

  q32 = dequantized(q, 64 if per_block else None)
  k32, v32 = dequantized(k), dequantized(v)
  group = q.shape[2] // k.shape[2]
  k32, v32 = (jnp.repeat(x, group, axis=2) for x in (k32, v32))
  s = jnp.einsum("bqhd,bkhd->bhqk", q32, k32) * q.shape[-1]**-0.5
  if is_causal:  # the mask from its one definition
    q_len, kv_len = s.shape[-2:]
    keep = masking.keep(
        masking.MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=True),
        jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :],
        masking.MaskValues())
    s = jnp.where(keep, s, -jnp.inf)
  row_max = s.max(axis=-1, keepdims=True)
  p = jnp.exp(s - row_max)
  p8 = p.astype(jnp.float8_e4m3fn).astype(jnp.float32)
  out = jnp.einsum("bhqk,bkhd->bqhd", p8, v32)
  row_sum = jnp.swapaxes(p.sum(axis=-1), 1, 2)                  # [B, T, H]
  lse = jnp.swapaxes(row_max[..., 0], 1, 2) + jnp.log(row_sum)
  return out / row_sum[..., None], lse


def errors(q, k, v, *, is_causal: bool, per_block: bool,
           **options) -> dict[str, float]:
  """FP8, naive-FP8 and bf16 errors against float32 (see module doc);
  `options` go to the FP8 kernel."""
  f32 = lambda x: x.astype(jnp.float32)
  out8, lse8 = quantized_forward(q, k, v, is_causal=is_causal,
                                 per_block=per_block, **options)
  want, want_lse = attention_reference(f32(q), f32(k), f32(v),
                                       is_causal=is_causal,
                                       return_residual=True)
  bf16 = attention_reference(q, k, v, is_causal=is_causal)
  naive, naive_lse = naive_fp8(q, k, v, is_causal=is_causal,
                              per_block=per_block)
  diff = lambda a: jnp.abs(f32(a) - want)
  naive_max = diff(naive).max()
  return {"fp8_max": float(diff(out8).max()),
          "fp8_mean": float(diff(out8).mean()),
          "naive_fp8_max": float(naive_max),
          "naive_fp8_mean": float(diff(naive).mean()),
          "rows_over": int((diff(out8).max(axis=-1) > 2 * naive_max).sum()),
          "bf16_max": float(diff(bf16).max()),
          "bf16_mean": float(diff(bf16).mean()),
          "fp8_lse_max": float(jnp.abs(jnp.swapaxes(lse8, 1, 2)
                                       - want_lse).max()),
          "naive_fp8_lse_max": float(jnp.abs(naive_lse - want_lse).max())}


def random_qkv(seq: int, head_dim: int, seed: int = 0):
  """bf16 q [2, seq, 8, D], k and v [2, seq, 2, D].

  Drawn in float32 (bf16 draws all share one amax, which would make the
  per-block scales equal to the per-tensor ones), and Q's blocks of 64
  rows scaled by 2^u, u uniform in [-2, 2], so that parts of the sequence
  differ in range as activations do and per-block scales have something to
  gain.
  """
  keys = jax.random.split(jax.random.key(seed), 4)
  shape_q, shape_kv = (2, seq, 8, head_dim), (2, seq, 2, head_dim)
  block_scale = 2.0 ** jax.random.uniform(keys[3], (-(-seq // 64),),
                                          minval=-2.0, maxval=2.0)
  row_scale = jnp.repeat(block_scale, 64)[:seq, None, None]
  q = jax.random.normal(keys[0], shape_q) * row_scale
  return (q.astype(jnp.bfloat16),
          jax.random.normal(keys[1], shape_kv).astype(jnp.bfloat16),
          jax.random.normal(keys[2], shape_kv).astype(jnp.bfloat16))


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
  headers = ["head_dim", "causal", "q scales", "fp8 max", "fp8 naive max",
             "bf16 max", "fp8 / bf16", "fp8 mean", "fp8 naive mean",
             "bf16 mean", "rows over", "fp8 lse max", "fp8 naive lse max"]
  table = [[r["head_dim"], r["causal"], r["q_scales"], f"{r['fp8_max']:.2e}",
            f"{r['naive_fp8_max']:.2e}", f"{r['bf16_max']:.2e}",
            f"{r['fp8_max'] / r['bf16_max']:.1f}", f"{r['fp8_mean']:.2e}",
            f"{r['naive_fp8_mean']:.2e}", f"{r['bf16_mean']:.2e}",
            r["rows_over"], f"{r['fp8_lse_max']:.2e}",
            f"{r['naive_fp8_lse_max']:.2e}"] for r in rows]
  print(render.write_results(args.out, result, headers, table))
  return 0


if __name__ == "__main__":
  sys.exit(main())
