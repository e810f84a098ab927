"""FlashAttention's benchmark grid, every implementation side by side.

    python -m benchmarks.run_grid                      # full grid, all peers
    python -m benchmarks.run_grid --impls jax_flash_triton cudnn --seqs 16384
    python -m benchmarks.run_grid --smoke --out /tmp/smoke.json   # CPU, seconds
    # two GPUs of one host, half the grid each, then one file and its table:
    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.run_grid --causal full --out a.json &
    CUDA_VISIBLE_DEVICES=1 python -m benchmarks.run_grid --causal causal --out b.json
    python -m benchmarks.run_grid --include a.json b.json --time-budget 0

Grid (DESIGN.md section 5): bf16, batch·seq = 16384, hidden 2048 (heads =
2048 / head_dim), seq in {1k, 4k, 16k}, head_dim in {64, 128, 256}, causal
or not, modes fwd and fwd_bwd. Each (cell, implementation) is compiled once
(a cell's implementations concurrently), its memory read from XLA's
analysis, then timed alone (median of `--reps` samples after `--warmup`
calls). With `--rounds R` a cell's implementations are timed R times in
turn, every other round reversed (A B C, C B A, ...;
`common.round_order`), and each keeps the median of its rounds, so that a
drift of the GPU's clocks during the cell falls on every implementation
alike rather than on whichever was timed then. A failure is recorded under
"skipped" with its reason and the grid goes on. The JSON is rewritten after every cell, so a killed run keeps what
it measured, and `--resume` measures only what is missing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import gc
import itertools
import os
import statistics
import sys
import time

from tqdm import tqdm

from benchmarks import common, peers, render
from pallas_kernels import compat

STANDARD = dict(tokens=16384, hidden=2048, seqs=[1024, 4096, 16384],
                head_dims=[64, 128, 256], warmup=2, reps=7)
# Tiny sizes for CPU tests: Pallas interpret mode, a few seconds in all.
SMOKE = dict(tokens=128, hidden=64, seqs=[64], head_dims=[32], warmup=1,
             reps=2)
CAUSAL = {"full": False, "causal": True}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  parser.add_argument("--impls", nargs="+", choices=list(peers.PEERS),
                      default=list(peers.PEERS), metavar="IMPL",
                      help=f"default: all of {', '.join(peers.PEERS)}")
  parser.add_argument("--seqs", nargs="+", type=int)
  parser.add_argument("--head-dims", nargs="+", type=int)
  parser.add_argument("--causal", nargs="+", choices=list(CAUSAL),
                      default=list(CAUSAL))
  parser.add_argument("--modes", nargs="+", choices=common.MODES,
                      default=list(common.MODES))
  parser.add_argument("--tokens", type=int, help="batch * seq_len")
  parser.add_argument("--hidden", type=int, help="num_heads * head_dim")
  parser.add_argument("--warmup", type=int)
  parser.add_argument("--reps", type=int)
  parser.add_argument("--rounds", type=int, default=1,
                      help="time a cell's implementations this many times "
                      "in turn; each keeps the median of its rounds")
  parser.add_argument("--out", default="benchmarks/results/h200.json")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes (interpret mode on a CPU), for tests")
  parser.add_argument("--interpret", action=argparse.BooleanOptionalAction,
                      default=None, help="Pallas interpret mode "
                      "(default: when no GPU is present)")
  parser.add_argument("--resume", action="store_true",
                      help="keep the entries in --out; measure the rest")
  parser.add_argument("--include", nargs="+", default=[], metavar="JSON",
                      help="results of other runs (say, halves of the grid "
                      "measured on two GPUs at once) taken as measured")
  parser.add_argument("--time-budget", type=float, default=500.0,
                      help="seconds after which no new measurement starts "
                      "(the file stays valid; rerun with --resume)")
  parser.add_argument("--compile-workers", type=int, default=4,
                      help="threads compiling one cell's implementations "
                      "(1: one after another)")
  parser.add_argument("--no-render", action="store_true",
                      help="skip writing the .md and .png next to --out")
  args = parser.parse_args(argv)
  for name, value in (SMOKE if args.smoke else STANDARD).items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.interpret is None:
    args.interpret = not compat.has_gpu()
  if args.rounds < 1:
    parser.error(f"--rounds must be at least 1, got {args.rounds}")
  return args


def grid_cells(args) -> list[common.Cell]:
  """Cells in a fixed order: mode, causal, head_dim, seq_len."""
  return [common.Cell.standard(mode, seq, head_dim, CAUSAL[causal],
                               tokens=args.tokens, hidden=args.hidden)
          for mode, causal, head_dim, seq in itertools.product(
              args.modes, args.causal, args.head_dims, args.seqs)]


# Peers whose compilation runs XLA's autotuner (`common.compile_benchmark`).
AUTOTUNED = frozenset({"xla", "cudnn", "matmul"})


def run(args, header: dict) -> dict:
  """Measures every (cell, impl) not already in the results; returns them.

  A cell's implementations compile concurrently (compiling, not timing,
  is most of the grid's time); once all have compiled they are timed one
  after another with nothing else running.
  """
  result = {**header, "records": [], "skipped": []}
  earlier = list(args.include)
  if args.resume and os.path.exists(args.out):
    earlier.insert(0, args.out)
  for path in earlier:
    previous = render.load(path)
    if path in args.include:  # each part's own command, for the record
      result.setdefault("parts", []).append(previous["command"])
      # The parts' device and versions, not those of the merging machine.
      result.update({k: previous[k] for k in common.device_header()})
    result["records"] += previous["records"]
    # A peer that was unavailable then (a wheel missing) is tried again.
    result["skipped"] += [e for e in previous["skipped"]
                          if not e["reason"].startswith("Unavailable")]
  done = {common.entry_key(e) for e in result["records"] + result["skipped"]}
  todo = {cell: [i for i in args.impls if (i, *cell.key) not in done]
          for cell in grid_cells(args)}
  todo = {cell: impls for cell, impls in todo.items() if impls}
  total = sum(map(len, todo.values()))
  deadline = time.monotonic() + args.time_budget
  with common.progress(total=total, desc="grid", unit="run") as bar, \
      concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
    for cell, impls in todo.items():
      if time.monotonic() > deadline:
        tqdm.write(f"time budget of {args.time_budget:.0f} s spent: "
                   f"{total - bar.n} runs left; rerun with --resume")
        break
      bar.set_postfix_str(cell.label(), refresh=False)
      builds = {impl: pool.submit(
          common.compile_benchmark,
          functools.partial(peers.PEERS[impl], cell, interpret=args.interpret),
          autotuned=impl in AUTOTUNED) for impl in impls}
      # Every build of the cell finishes before any timing starts: XLA and
      # tokamax autotune on the GPU while they compile, and a kernel timed
      # beside that read 2-10x slow on the H200.
      concurrent.futures.wait(builds.values())
      result["records"] += [dataclasses.asdict(record) for record in
                            _time_in_rounds(cell, builds, args, result)]
      builds = None  # let gc free the executables and inputs with the cell
      bar.update(len(impls))
      gc.collect()  # frees this cell's inputs before the next allocates
      common.write_json(args.out, result)
  return result


def _time_in_rounds(cell, builds: dict, args, result: dict
                    ) -> list[common.Record]:
  """Times the cell's built implementations (`builds`: impl -> future of
  (executable, inputs)) `args.rounds` times in turn; returns a record per
  implementation with the median of its rounds. A failure (to build or to
  run) goes to `result["skipped"]`, and that implementation is not timed
  again."""
  runnable, rounds = {}, {}
  for impl, build in builds.items():
    try:
      runnable[impl] = build.result()
    except Exception as e:  # one peer's failure must not end the grid
      result["skipped"].append(
          common.skip_entry(impl, cell, common.describe_error(e)))
  for round_index in range(args.rounds):
    for impl, (compiled, inputs) in common.round_order(
        list(runnable.items()), round_index):
      try:
        rounds.setdefault(impl, []).append(common.measure(
            compiled, inputs, warmup=args.warmup, reps=args.reps))
      except Exception as e:
        result["skipped"].append(
            common.skip_entry(impl, cell, common.describe_error(e)))
        del runnable[impl]
        rounds.pop(impl, None)
  return [common.Record.measured(
      impl, cell, statistics.median(m.ms for m in rounds[impl]),
      rounds[impl][0].peak_gib) for impl in runnable]


def main(argv=None) -> int:
  compat.filter_known_warnings()
  args = parse_args(argv)
  result = run(args, common.run_header("benchmarks.run_grid", argv))
  common.write_json(args.out, result)
  print(render.markdown_table(*render.summary_table(result)))
  if result["skipped"]:
    print(f"\n{len(result['skipped'])} skipped:")
    print(render.markdown_table(*render.skipped_table(result)))
  if not args.no_render:
    print("wrote", args.out, *render.render(args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
