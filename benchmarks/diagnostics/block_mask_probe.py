"""What building a `mask_fn`'s BlockMask costs each call, beside the kernel.

    python -m benchmarks.diagnostics.block_mask_probe [--seqs 4096 16384]

`flash_attention(mask_fn=f)` builds `masking.BlockMask.from_mask_fn(f)`
inside the jitted call (`api.with_block_mask`): `f` evaluated on every
(query, key) pair, q_len x kv_len evaluations, on every call. This times
that build alone (jitted, median of `jax_flash.timing.time_fn`) for
`benchmarks.masks`' causal and 16-document masks at each length and
BlockMask tile, so that its share of a `mask_fn` row's time is known.
"""
from __future__ import annotations

import argparse
import sys

import jax

from jax_flash import masking, timing
from pallas_kernels import compat


def masks(seq: int) -> dict:
  document = seq // 16
  return {"causal": lambda b, h, q, k: q >= k,
          "16 documents": lambda b, h, q, k: q // document == k // document}


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 16384])
  parser.add_argument("--tiles", nargs="+", type=int, default=[16, 64])
  parser.add_argument("--heads", type=int, default=16)
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}", flush=True)
  for seq in args.seqs:
    for name, mask_fn in masks(seq).items():
      for tile in args.tiles:
        build = jax.jit(lambda: masking.BlockMask.from_mask_fn(
            mask_fn, batch=1, num_heads=args.heads, q_len=seq, kv_len=seq,
            tile=tile).states)
        ms = timing.time_fn(build)
        print(f"seq {seq:>6} {name:>12} tile {tile:>3}: {ms:.3f} ms",
              flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
