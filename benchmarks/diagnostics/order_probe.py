"""Does what ran just before a kernel move its timing?

    python -m benchmarks.diagnostics.order_probe --cells fwd:4096:128 fwd:1024:64 \
        --impls jax_flash_mosaic cudnn tokamax_mosaic --out probe.json

`run_grid` times a cell's implementations in turn, in the same order every
round, so each always follows the same neighbour: the first (ours) follows
the dense matmul that closes every round, the heaviest power draw of all. If
a predecessor's power draw or heat (or an idle GPU's lowered clocks) carries
over into the next few hundred milliseconds, the grid's ratios carry it
too. Here each implementation is timed after each of three conditions: the
cell's dense matmul (the grid's ceiling, run for `--heat-ms`), an idle
pause (`--idle-s`), and itself (timed once before and discarded);
conditions and implementations interleave over `--rounds`. Every sample is
kept, so a ramp within a timing shows as its first samples against its
median. `--settle-ms` gives each timing `common.time_fn`'s settle first:
with it, the three conditions should read alike.
"""
from __future__ import annotations

import statistics
import sys
import time

from benchmarks import common, render
from benchmarks.diagnostics.timing_probe import build, parse_cell, probe_parser
from pallas_kernels import compat

CONDITIONS = ("matmul", "idle", "self")


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = probe_parser(__doc__, cells=["fwd:4096:128"],
                        impls=["jax_flash_mosaic", "cudnn", "tokamax_mosaic"])
  parser.add_argument("--heat-ms", type=float, default=300.0,
                      help="how long the matmul runs before a timing")
  parser.add_argument("--idle-s", type=float, default=2.0)
  parser.add_argument("--settle-ms", type=float, default=0.0,
                      help="each timing's untimed run of the implementation "
                      "itself first (`common.time_fn`'s settle_ms; 0: none, "
                      "to see the predecessor's effect)")
  parser.add_argument("--out", default="order_probe.json")
  args = parser.parse_args(argv)

  result = dict(common.run_header("benchmarks.diagnostics.order_probe", argv),
                rows=[])
  for spec in args.cells:
    cell = parse_cell(spec)
    built = build(cell, args.impls)
    heater = build(cell, ["matmul"]).get("matmul")
    if heater is None:
      raise SystemExit(f"{cell.label()}: the dense matmul does not run here "
                       "(see above), and it is the probe's heater")
    heater, heater_args = heater
    for round_ in range(args.rounds):
      for condition in CONDITIONS:
        for name, (compiled, inputs) in built.items():
          if condition == "matmul":
            common.time_samples(heater, *heater_args, settle_ms=0.0,
                                reps=max(1, round(args.heat_ms / 20)))
          elif condition == "idle":
            time.sleep(args.idle_s)
          else:
            common.time_samples(compiled, *inputs, settle_ms=0.0)
          samples = common.time_samples(compiled, *inputs,
                                        settle_ms=args.settle_ms)
          result["rows"].append(dict(
              cell=cell.label(), impl=name, condition=condition,
              round=round_, samples=samples, flops=cell.flops,
              end=time.time()))
          print(f"{cell.label():24s} {name:18s} after {condition:6s}: "
                f"{cell.flops / statistics.median(samples) / 1e9:6.1f} "
                f"TFLOP/s (first sample {samples[0]:.4f} ms, median "
                f"{statistics.median(samples):.4f})", flush=True)
    common.write_json(args.out, result)
  text = table(result)
  with open(args.out.removesuffix(".json") + ".md", "w") as f:
    f.write(text)
  print(text)
  return 0


def table(result: dict) -> str:
  """Markdown: per cell and implementation, the median over rounds of each
  condition's median TFLOP/s, its ratio to the best other implementation
  under the same condition, and the first samples' lag behind the median."""
  by_key = {}
  for row in result["rows"]:
    by_key.setdefault((row["cell"], row["condition"], row["impl"]), []).append(
        row)
  tflops = {key: statistics.median(
      r["flops"] / statistics.median(r["samples"]) / 1e9 for r in rows)
      for key, rows in by_key.items()}
  lines = [f"# Order probe ({result['device']}, JAX {result['jax_version']})",
           "", f"Command: `{result['command']}`", "",
           "TFLOP/s of each implementation timed right after the cell's "
           "dense matmul, an idle pause, or itself (median over rounds); "
           "in brackets the ratio to the best other implementation under "
           "the same condition; `first`: the first sample's time over the "
           "median's (above 1: a ramp).", ""]
  rows = []
  for (cell, condition, impl), value in tflops.items():
    others = [v for (c, k, i), v in tflops.items()
              if c == cell and k == condition and i != impl]
    ratio = f" ({value / max(others):.3f})" if others else ""
    first = statistics.median(r["samples"][0] / statistics.median(r["samples"])
                              for r in by_key[(cell, condition, impl)])
    rows.append([cell, impl, condition, f"{value:.0f}{ratio}",
                 f"{first:.3f}"])
  rows.sort(key=lambda r: (r[0], r[1], CONDITIONS.index(r[2])))
  lines += [render.markdown_table(
      ["cell", "impl", "after", "TFLOP/s", "first"], rows), ""]
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
