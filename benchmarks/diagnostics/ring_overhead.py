"""The ring's cost over plain `flash_attention` on a one-device mesh.

    python -m benchmarks.diagnostics.ring_overhead   # -> benchmarks/results/h200_ring_overhead.json

bf16, batch 1, 16 heads, head_dim 128, seq 16k (`--seq`), causal and not,
forward and forward+backward: `sequence_parallel_attention` (ring and
all-gather) on a mesh of one device against `flash_attention`. The issue's
bar: at most 5% over plain.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from benchmarks import common, render
from pallas_kernels import compat


def _callables(mesh, causal: bool):
  plain = lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=causal)
  ring = lambda strategy: (lambda q, k, v: jax_flash.sequence_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", strategy=strategy,
      is_causal=causal))
  return {"flash_attention": plain, "ring": ring("ring"),
          "all_gather": ring("all_gather")}


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--out",
                      default="benchmarks/results/h200_ring_overhead.json")
  args = parser.parse_args(argv)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
  q, k, v, d_out = common.attention_inputs((1, args.seq, 16, 128),
                                           jnp.bfloat16)
  rows = []
  for causal in (False, True):
    for mode in ("fwd", "fwd_bwd"):
      base = None
      for name, attention in _callables(mesh, causal).items():
        if mode == "fwd":
          fn, inputs = jax.jit(attention), (q, k, v)
        else:
          loss = lambda q, k, v, d, a=attention: jnp.sum(
              a(q, k, v).astype(jnp.float32) * d.astype(jnp.float32))
          fn, inputs = jax.jit(jax.grad(loss, (0, 1, 2))), (q, k, v, d_out)
        ms = common.time_fn(fn, *inputs, warmup=2, reps=args.reps)
        base = base or ms
        rows.append(dict(impl=name, mode=mode, causal=causal,
                         seq_len=args.seq, ms=ms, overhead=ms / base - 1))
  result = {
      **common.run_header("benchmarks.diagnostics.ring_overhead", argv),
      "records": rows}
  text = render.write_results(
      args.out, result, ["impl", "mode", "causal", "ms", "overhead"],
      [[r["impl"], r["mode"], r["causal"], f"{r['ms']:.3f}",
        f"{100 * r['overhead']:+.1f}%"] for r in rows])
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
