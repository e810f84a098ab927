"""The causal forward on the persistent grid and on the launch grid, at
lengths around tile-count boundaries: where a schedule loads CTAs unevenly.

    python -m benchmarks.diagnostics.schedule_lengths
    python -m benchmarks.diagnostics.schedule_lengths --lengths 4096 4224 \
        --head-dim 128 --out benchmarks/results/h100_persistent_schedule_lengths.json

`mosaic_forward` at [batch, T, heads, head_dim] (kv heads `--kv-heads`),
causal, once with its plan's persistent grid and once with
`persistent=False`, for each T; TFLOP/s count the attended pairs,
T (T + 1) / 2 a head. The tile count per head is ceil(T / 128) (two
64-row consumers). With an odd count the persistent grid pairs each
head's middle tile with the next head's (`common.persistent_schedule`);
a pairing that loads CTAs unevenly shows as one length far below its
neighbours (benchmarks/NOTES.md, "Persistent schedule: odd tile counts").
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks import common

DEFAULT_LENGTHS = (1280, 1408, 3968, 4096, 4097, 4224, 4352, 4480, 8192, 8320)


def measure_length(seq: int, *, batch: int, heads: int, kv_heads: int,
                   head_dim: int) -> dict:
  """TFLOP/s of the causal forward at `seq` on both grids."""
  from pallas_kernels.mosaic.forward import mosaic_forward
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim),
                            jnp.bfloat16) for key in keys[1:])
  flops = 4 * batch * heads * head_dim * seq * (seq + 1) / 2
  row = {"seq": seq, "tiles": -(-seq // 128)}
  for grid, options in (("persistent", {}),
                        ("launch_grid", dict(persistent=False))):
    fn = jax.jit(lambda q, k, v, options=options: mosaic_forward(
        q, k, v, scale=head_dim**-0.5, is_causal=True, **options)[0])
    compiled = fn.lower(q, k, v).compile()
    ms = common.measure(compiled, (q, k, v), reps=20).ms
    row[grid] = round(flops / (ms / 1e3) / 1e12, 1)
  return row


def render(result: dict) -> str:
  lines = ["# Causal forward by length, persistent against launch grid",
           "", f"`{result['command']}`", "",
           f"{result['device']}; batch {result['batch']}, heads "
           f"{result['heads']}:{result['kv_heads']}, d={result['head_dim']}, "
           "bf16; TFLOP/s of the attended pairs.", "",
           "| tokens | tiles a head | persistent | launch grid |",
           "|---|---|---|---|"]
  lines += [f"| {r['seq']} | {r['tiles']} | {r['persistent']:.0f} | "
            f"{r['launch_grid']:.0f} |" for r in result["rows"]]
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+",
                      default=list(DEFAULT_LENGTHS))
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--out", help="JSON path; the table beside it (.md)")
  args = parser.parse_args(argv)
  rows = []
  for seq in common.progress(args.lengths, desc="lengths"):
    rows.append(measure_length(seq, batch=args.batch, heads=args.heads,
                               kv_heads=args.kv_heads,
                               head_dim=args.head_dim))
  result = {**common.run_header(
      "benchmarks.diagnostics.schedule_lengths", argv),
            "batch": args.batch,
            "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "rows": rows}
  table = render(result)
  print(table)
  if args.out:
    common.write_json(args.out, result)
    with open(args.out.removesuffix(".json") + ".md", "w") as f:
      f.write(table)


if __name__ == "__main__":
  main()
