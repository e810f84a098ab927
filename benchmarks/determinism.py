"""Whether an implementation's fwd+bwd gives the same bits every run.

    python -m benchmarks.determinism --impls jax_flash_mosaic cudnn \
        --seq 16384 --head-dim 128 --runs 5 --out results/determinism.json

For each implementation, the grid cell's fwd+bwd (`peers.PEERS`: the
gradients of sum(out * d_out) for one random cotangent) runs `--runs` times
on the same inputs; the record says how many distinct (dq, dk, dv) bit
patterns came out and the largest difference from the first run. jax-flash
promises one pattern (DESIGN.md section 2: no atomics); a peer that sums dQ
with atomic adds gives more. Run it once as is and once under
`XLA_FLAGS=--xla_gpu_deterministic_ops=true` to see what XLA's switch does
to the peers (the flag is recorded with the results).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import jax
import numpy as np

from benchmarks import common, peers


def _digest(arrays) -> str:
  """One hash of the arrays' bytes."""
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.asarray(a).tobytes())
  return h.hexdigest()[:16]


def check(impl: str, cell: common.Cell, runs: int) -> dict:
  """The record of `runs` fwd+bwd runs of `impl` on `cell`'s inputs."""
  bench = peers.PEERS[impl](cell)
  first, digests, largest = None, [], 0.0
  for _ in range(runs):
    grads = [np.asarray(g, np.float32)
             for g in jax.block_until_ready(bench.fn(*bench.args))]
    digests.append(_digest(grads))
    if first is None:
      first = grads
    largest = max(largest, *(float(np.max(np.abs(g - f)))
                             for g, f in zip(grads, first)))
  return dict(impl=impl, seq=cell.seq_len, head_dim=cell.head_dim,
              causal=cell.causal, runs=runs,
              distinct_results=len(set(digests)),
              largest_difference=largest)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impls", nargs="+", default=["jax_flash_mosaic",
                                                     "cudnn"],
                      choices=list(peers.PEERS))
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--tokens", type=int, default=16384,
                      help="batch * seq_len (the grid's 16384)")
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  cell = common.Cell.standard("fwd_bwd", args.seq, args.head_dim,
                              args.causal, tokens=args.tokens)
  records = []
  for impl in args.impls:
    try:
      records.append(check(impl, cell, args.runs))
    except (peers.Unavailable, peers.TooLarge) as e:
      records.append(dict(impl=impl, unavailable=f"{type(e).__name__}: {e}"))
    print(json.dumps(records[-1]), flush=True)
  with open(args.out, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind,
                   jax_version=jax.__version__,
                   xla_flags=os.environ.get("XLA_FLAGS", ""),
                   command=" ".join(["python -m benchmarks.determinism",
                                     *sys.argv[1:]]),
                   records=records), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
