"""Where FP8 attention's error comes from, term by term (any machine).

    python -m benchmarks.diagnostics.fp8_error_terms [--seq 1024 4096]
        [--head-dims 64 128 256] [--out benchmarks/results/fp8_error_terms.json]

`benchmarks.fp8_accuracy`'s inputs and float64 reference (FA3's outlier
distribution), with each rounding of the FP8 kernel applied alone, in
float32 attention at HIGHEST precision (exact but for the rounding under
study):

  P              P = exp(s - rowmax) rounded to e4m3 before P·V
  V              V per (batch, head) in e4m3
  QK             Q and K per (batch, head) in e4m3
  QK rotated     the same after the random Hadamard rotation
  all            Q, K, V and P (FP8 per tensor, the baseline)
  all rotated    Q and K rotated (incoherent processing)
  all, V rotated as "all rotated" with V rotated too and the output rotated
                 back (exact in real arithmetic: P (V H) Hᵀ = P V)

The terms add about in quadrature. The ratio all / all rotated is the one
issue 40 asks to reach 2x; its bound with exact V and P is all / QK rotated.
Scales per block instead of per tensor change little: e4m3's relative step
does not depend on the scale (`fp8_accuracy`'s "block" rows).
"""
from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp

from benchmarks import common, render
from benchmarks.fp8_accuracy import outlier_qkv, reference_float64, rmse
from jax_flash.fp8 import hadamard_rotation, quantize_fp8

TERMS = ("P", "V", "QK", "QK rotated", "all", "all rotated",
         "all, V rotated")


def e4m3(x):
  """x [batch, seq, heads, dim] through `quantize_fp8` per (batch, head)
  and back, float32."""
  return quantize_fp8(x).dequantize()


@jax.jit
def attention(q, k, v, round_p):
  """Non-causal attention [batch, seq, heads, dim] in float32 at HIGHEST,
  P rounded to e4m3 before P·V where `round_p`; the row sum unrounded, as
  in the kernel."""
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest")
  s = s * q.shape[-1] ** -0.5
  p = jnp.exp(s - s.max(axis=-1, keepdims=True))
  p_used = jnp.where(round_p, p.astype(jnp.float8_e4m3fn).astype(jnp.float32),
                     p)
  out = jnp.einsum("bhqk,bkhd->bqhd", p_used, v, precision="highest")
  return out / jnp.swapaxes(p.sum(axis=-1), 1, 2)[..., None]


def term_outputs(q, k, v, rotation):
  """{term: float32 output} for the TERMS on float32 q, k, v."""
  qr, kr, vr = (x @ rotation for x in (q, k, v))
  return {
      "P": attention(q, k, v, True),
      "V": attention(q, k, e4m3(v), False),
      "QK": attention(e4m3(q), e4m3(k), v, False),
      "QK rotated": attention(e4m3(qr), e4m3(kr), v, False),
      "all": attention(e4m3(q), e4m3(k), e4m3(v), True),
      "all rotated": attention(e4m3(qr), e4m3(kr), e4m3(v), True),
      "all, V rotated": attention(e4m3(qr), e4m3(kr), e4m3(vr), True)
                        @ rotation.T,
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--head-dims", type=int, nargs="+",
                      default=[64, 128, 256])
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out",
                      default="benchmarks/results/fp8_error_terms.json")
  args = parser.parse_args(argv)
  records = []
  for seq, head_dim in itertools.product(args.seq, args.head_dims):
    q, k, v = outlier_qkv(args.seed, batch=1, seq=seq, heads=args.heads,
                          head_dim=head_dim)
    want = reference_float64(q, k, v)
    rotation = hadamard_rotation(head_dim, args.seed)
    for term, out in term_outputs(q, k, v, rotation).items():
      records.append({"term": term, "seq_len": seq, "head_dim": head_dim,
                      "heads": args.heads, "rmse": rmse(out, want)})
    print(records[-len(TERMS):], flush=True)
  rmses = {(r["seq_len"], r["head_dim"], r["term"]): r["rmse"]
           for r in records}
  cells = sorted({(r["seq_len"], r["head_dim"]) for r in records})
  headers = ["seq_len", "head_dim", *TERMS, "all / all rotated",
             "bound: all / QK rotated"]
  rows = [[seq, dim, *(f"{rmses[seq, dim, t]:.2e}" for t in TERMS),
           f"{rmses[seq, dim, 'all'] / rmses[seq, dim, 'all rotated']:.2f}",
           f"{rmses[seq, dim, 'all'] / rmses[seq, dim, 'QK rotated']:.2f}"]
          for seq, dim in cells]
  result = {**common.run_header("benchmarks.diagnostics.fp8_error_terms",
                                argv),
            "reference": "float64", "records": records}
  print(render.write_results(args.out, result, headers, rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
