"""Does the grid's timing see the kernels, or the host between them?

    python -m benchmarks.diagnostics.timing_probe --cells fwd:1024:64 fwd:1024:128 \
        --impls jax_flash_mosaic tokamax_mosaic cudnn --out probe.json

For short cells (a 0.3 ms forward at seq 1k) a timed sample of a few calls
carries the host's launch and synchronisation latency, which need not be
the same for every implementation. Each implementation of a cell is
compiled as `run_grid` compiles it, then timed in turn (rounds) with
samples of at least `--sample-ms` milliseconds each, once per value given
(the grid's 2 ms first): if the ratios between implementations move with
the sample length, the short samples measured the host, not the kernels.
Each timing now also settles first (`common.SETTLE_MS`);
`results/h200_timing_probe.md` was measured without the settle.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks import common, peers, render
from pallas_kernels import compat


def parse_cell(spec: str) -> common.Cell:
  """mode:seq:head_dim[:causal] -> the grid's cell."""
  mode, seq, head_dim, *causal = spec.split(":")
  return common.Cell.standard(mode, int(seq), int(head_dim), bool(causal))


def probe_parser(doc: str, *, cells: list[str], impls: list[str]
                 ) -> argparse.ArgumentParser:
  """A probe's command line: `--cells` (mode:seq:head_dim[:causal]),
  `--impls` and `--rounds`, with `doc` as its help."""
  parser = argparse.ArgumentParser(
      description=doc.splitlines()[0], epilog=doc,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--cells", nargs="+", default=cells,
                      help="mode:seq:head_dim[:causal]")
  parser.add_argument("--impls", nargs="+", choices=list(peers.PEERS),
                      default=impls)
  parser.add_argument("--rounds", type=int, default=3)
  return parser


def build(cell: common.Cell, names: list[str]) -> dict:
  """name -> (executable, inputs) of each implementation that runs at
  `cell`, compiled as `run_grid` compiles it; the others are named on
  stderr and left out."""
  built = {}
  for name in names:
    try:
      bench = getattr(peers, name)(cell)
      built[name] = common.compile_benchmark(
          lambda bench=bench: (bench.fn, bench.args))
    except (peers.Unavailable, NotImplementedError) as e:
      print(f"{cell.label()} {name}: {e}", file=sys.stderr)
  return built


def main(argv=None) -> int:
  """Times each cell's implementations at each sample length."""
  compat.filter_known_warnings()
  parser = probe_parser(__doc__, cells=["fwd:1024:64"],
                        impls=["jax_flash_mosaic", "tokamax_mosaic", "cudnn"])
  parser.add_argument("--sample-ms", nargs="+", type=float,
                      default=[2.0, 50.0])
  parser.add_argument("--out", default="timing_probe.json")
  args = parser.parse_args(argv)

  rows = []
  for spec in args.cells:
    cell = parse_cell(spec)
    built = build(cell, args.impls)
    for sample_ms in args.sample_ms:
      times = {name: [] for name in built}
      for round_index in range(args.rounds):  # in turn: drift is shared
        for name, (compiled, inputs) in common.round_order(
            list(built.items()), round_index):
          times[name].append(common.time_fn(
              compiled, *inputs, min_sample_ms=sample_ms, max_inner=10_000))
      for name, ms in times.items():
        ms = statistics.median(ms)
        rows.append(dict(cell=cell.label(), impl=name, sample_ms=sample_ms,
                         ms=ms, tflops=cell.flops / ms / 1e9))
        print(f"{cell.label():28s} {name:18s} sample {sample_ms:5.0f} ms: "
              f"{ms:.4f} ms {cell.flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    result = dict(
        common.run_header("benchmarks.diagnostics.timing_probe", argv),
        rows=rows)
    common.write_json(args.out, result)
    with open(args.out.removesuffix(".json") + ".md", "w") as f:
      f.write(table(result))
  return 0


def table(result: dict) -> str:
  """Markdown: one row per (cell, sample length), TFLOP/s per
  implementation and each one's ratio to the fastest of the others."""
  impls = list(dict.fromkeys(row["impl"] for row in result["rows"]))
  by_key = {}
  for row in result["rows"]:
    by_key.setdefault((row["cell"], row["sample_ms"]), {})[row["impl"]] = (
        row["tflops"])

  def entry(got, name):
    if name not in got:
      return "—"
    others = [v for k, v in got.items() if k != name]
    ratio = f" ({got[name] / max(others):.2f})" if others else ""
    return f"{got[name]:.0f}{ratio}"

  rows = [[cell, f"{sample_ms:g}", *(entry(got, name) for name in impls)]
          for (cell, sample_ms), got in by_key.items()]
  return "\n".join([
      f"# Timing probe ({result['device']}, JAX {result['jax_version']})", "",
      f"Command: `{result['command']}`", "",
      "TFLOP/s by the minimum length of a timed sample (0: one call and its "
      "synchronisation); in brackets, the ratio to the fastest other "
      "implementation.", "",
      render.markdown_table(["cell", "sample ms", *impls], rows), ""])

if __name__ == "__main__":
  sys.exit(main())
