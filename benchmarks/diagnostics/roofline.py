"""FLOPs, bytes and the matmul-bound time of every cell of the standard grid.

    python -m benchmarks.diagnostics.roofline        # a markdown table on stdout

bf16, batch·seq = 16384, hidden 2048 (DESIGN.md section 5). FLOPs by
FlashAttention's count (`common.attention_flops`). Bytes are the HBM traffic
of an ideal kernel: the forward reads Q, K, V once and writes O (bf16) and
the LSE (float32); forward+backward adds reading Q, K, V, O, dO, the LSE and
delta and writing dQ, dK, dV. Each bound is that amount over the H200's
dense bf16 matmul rate and its copy bandwidth as measured on the lent
machines (~790 TFLOP/s and ~4.3 TB/s; the device library's KINDS.md); the
larger one is the cell's floor.
"""
from __future__ import annotations

import itertools
import sys

from benchmarks import common, render

MATMUL_TFLOPS = 790.0
HBM_TB_PER_S = 4.3
TOKENS, HIDDEN = 16384, 2048


def cell_bytes(batch: int, seq: int, heads: int, head_dim: int,
               mode: str) -> float:
  """HBM bytes of an ideal kernel (see the module docstring)."""
  tensor = batch * seq * heads * head_dim * 2        # one bf16 [B, T, N, D]
  rows = batch * seq * heads * 4                     # one float32 [B, N, T]
  forward = 4 * tensor + rows                        # Q, K, V in; O out; LSE
  if mode == "fwd":
    return forward
  return forward + 5 * tensor + 2 * rows + 3 * tensor


def rows():
  for mode, causal, head_dim, seq in itertools.product(
      common.MODES, (False, True), (64, 128, 256), (1024, 4096, 16384)):
    batch, heads = TOKENS // seq, HIDDEN // head_dim
    flops = common.attention_flops(batch, seq, seq, heads, head_dim, causal,
                                   mode)
    nbytes = cell_bytes(batch, seq, heads, head_dim, mode)
    compute_ms = flops / (MATMUL_TFLOPS * 1e12) * 1e3
    memory_ms = nbytes / (HBM_TB_PER_S * 1e12) * 1e3
    yield [common.cell_label(mode, causal, head_dim, seq), f"{flops:.2e}",
           f"{nbytes / 2**20:.0f}", f"{flops / nbytes:.0f}",
           f"{compute_ms:.3f}", f"{memory_ms:.3f}"]


def main() -> int:
  headers = ["cell", "FLOPs", "MiB moved", "FLOP/byte",
             "matmul-bound ms", "HBM-bound ms"]
  print(render.markdown_table(headers, list(rows())))
  return 0


if __name__ == "__main__":
  sys.exit(main())
