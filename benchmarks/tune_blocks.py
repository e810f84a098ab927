"""Sweeps the Triton kernels' BlockSizes on this GPU; prints the best per head dim.

    python -m benchmarks.tune_blocks   # -> results/h200_block_sweep.json

At seq 4096, batch·seq = 16384, hidden 2048, bf16 (`--seq`, `--tokens`,
`--hidden`: a model's shape, e.g. ViT-L/14's 32 x 577 tokens of 16 heads),
for head_dim 64, 128, 256, one kernel at a time (`--phases`: some of them;
the three kernels are separate launches, so their times add up and each
can be tuned with the others fixed), starting from the defaults a call of
that length gets (`BlockSizes.get_default`):

1. "fwd": every (block_q, block_k, num_warps, num_stages) of `FWD_SPACE`,
   timing the forward.
2. "dkdv", then "dq", with the best forward fixed, timing forward+backward:
   every tile pair of `DKDV_TILES` / `DQ_TILES` x `BWD_WARPS` at the
   default's stage count, then the best of those with the other
   `BWD_STAGES`.

Each phase ranks candidates without a mask, re-times the best `--finalists`
with the causal mask and keeps the best geometric mean of the two TFLOP/s
(`--full-only`: the best without a mask, for shapes trained without one).
Candidates compile concurrently (`--compile-workers`) and are timed one at a
time. Those that fail (too much shared memory, say) are recorded with their
error. When its share of `--budget` runs out a phase keeps the best found so
far; candidates are ordered so the current default comes first. The output
ends with a `_GPU_DEFAULTS` literal for `pallas_kernels/config.py`.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import math
import sys
import textwrap
import time

from tqdm import tqdm

from benchmarks import common, peers
from pallas_kernels import compat
from pallas_kernels.config import BlockSizes

FWD_SPACE = dict(block_q=(64, 128), block_k=(32, 64, 128), num_warps=(4, 8),
                 num_stages=(2, 3, 4))
# (q tile, kv tile). The dK/dV kernel's grid runs over K/V tiles and loops
# over Q tiles, the dQ kernel the other way round: the grid axis gets the
# larger tile, as in FlashAttention-2's backward.
DKDV_TILES = ((32, 64), (64, 64), (32, 128), (64, 128), (128, 128))
DQ_TILES = ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128))
BWD_WARPS = (4, 8)
BWD_STAGES = (1, 2, 3)
STANDARD = dict(tokens=16384, hidden=2048, seq=4096, head_dims=[64, 128, 256],
                fwd_space=FWD_SPACE, dkdv_tiles=DKDV_TILES, dq_tiles=DQ_TILES,
                bwd_warps=BWD_WARPS, bwd_stages=BWD_STAGES)
# CPU interpret mode: warps and stages are ignored there; tiles still matter.
SMOKE = dict(tokens=256, hidden=64, seq=128, head_dims=[32],
             fwd_space=dict(block_q=(32, 64), block_k=(32,), num_warps=(4,),
                            num_stages=(2,)),
             dkdv_tiles=((16, 32),), dq_tiles=((32, 16),),
             bwd_warps=(4,), bwd_stages=(1, 2))
# Per backward phase: the BlockSizes fields of its kernel.
BWD_FIELDS = {
    "dkdv": ("block_q_dkv", "block_kv_dkv", "num_warps_dkdv",
             "num_stages_dkdv"),
    "dq": ("block_q_dq", "block_kv_dq", "num_warps_dq", "num_stages_dq"),
}
PHASES = ("fwd", "dkdv", "dq")
BUDGET_SHARE = {"fwd": 0.3, "dkdv": 0.35, "dq": 0.35}


@dataclasses.dataclass
class Sweep:
  """Runs and records trials; what every trial shares."""
  args: argparse.Namespace
  bar: tqdm
  pool: concurrent.futures.Executor
  trials: list = dataclasses.field(default_factory=list)
  seconds: list = dataclasses.field(default_factory=list)

  def seconds_per_trial(self) -> float:
    """Mean wall time of a trial so far (compile + time); 2 s before any."""
    return sum(self.seconds) / len(self.seconds) if self.seconds else 2.0

  def run(self, phase: str, head_dim: int, causal: bool,
          candidates: list[BlockSizes], deadline: float, reserve: int = 0
          ) -> dict[BlockSizes, float]:
    """TFLOP/s of each candidate that ran; stops at `deadline`.

    Candidates go in batches of `--compile-workers`: compiled concurrently,
    then timed one after another. `reserve` trials' worth of time is kept
    before the deadline (for the causal finalists).
    """
    cell = common.Cell.standard("fwd" if phase == "fwd" else "fwd_bwd",
                                self.args.seq, head_dim, causal,
                                tokens=self.args.tokens,
                                hidden=self.args.hidden)
    scores = {}
    workers = self.args.compile_workers
    for i in range(0, len(candidates), workers):
      batch = candidates[i:i + workers]
      if (time.monotonic() + (reserve + len(batch)) * self.seconds_per_trial()
          > deadline):
        break
      self.bar.set_postfix_str(
          f"{phase} d{head_dim}{' causal' if causal else ''}", refresh=False)
      start = time.monotonic()
      builds = [self.pool.submit(common.compile_benchmark, functools.partial(
          peers.jax_flash_triton, cell, interpret=self.args.interpret,
          block_sizes=blocks)) for blocks in batch]
      concurrent.futures.wait(builds)  # nothing compiles while timing
      for blocks, build in zip(batch, builds):
        entry = {"phase": phase, "head_dim": head_dim, "causal": causal,
                 "block_sizes": dataclasses.asdict(blocks)}
        try:
          m = common.measure(*build.result(), warmup=self.args.warmup,
                             reps=self.args.reps)
          entry.update(ms=m.ms, tflops=cell.flops / (m.ms * 1e-3) / 1e12)
          scores[blocks] = entry["tflops"]
        except Exception as e:  # a candidate that does not compile is a result
          entry["error"] = common.describe_error(e)
        self.trials.append(entry)
        self.bar.update()
      self.seconds += [(time.monotonic() - start) / len(batch)] * len(batch)
    return scores


def fwd_candidates(default: BlockSizes, space: dict) -> list[BlockSizes]:
  """Every forward setting of `space`, nearest to the default first.

  Near the current default is where a budget cut should leave the search.
  """
  combos = [dict(zip(space, values))
            for values in itertools.product(*space.values())]
  combos.sort(key=lambda c: sum(v != getattr(default, k) for k, v in c.items()))
  return [dataclasses.replace(default, **c) for c in combos]


def bwd_candidates(base: BlockSizes, phase: str, tiles, warps
                   ) -> list[BlockSizes]:
  """`phase`'s kernel tiles x warps at `base`'s stage count, `base` first."""
  block_q, block_kv, warps_field, _ = BWD_FIELDS[phase]
  candidates = [dataclasses.replace(base, **{block_q: q, block_kv: kv,
                                             warps_field: w})
                for (q, kv), w in itertools.product(tiles, warps)]
  candidates.sort(key=lambda b: b != base)
  return candidates


def tune(sweep: Sweep, head_dim: int, phase: str, base: BlockSizes,
         deadline: float) -> BlockSizes:
  """The best BlockSizes for one phase and head dim, starting from `base`."""
  args = sweep.args
  run = functools.partial(sweep.run, phase, head_dim, False,
                          deadline=deadline,
                          reserve=0 if args.full_only else args.finalists)
  if phase == "fwd":
    scores = run(fwd_candidates(base, args.fwd_space))
  else:
    tiles = args.dkdv_tiles if phase == "dkdv" else args.dq_tiles
    scores = run(bwd_candidates(base, phase, tiles, args.bwd_warps))
    if scores:
      # The stage count that fits shared memory depends on the tiles: vary it
      # only around the best tiles.
      stages_field = BWD_FIELDS[phase][3]
      best = max(scores, key=scores.get)
      scores.update(run([dataclasses.replace(best, **{stages_field: s})
                         for s in args.bwd_stages
                         if s != getattr(best, stages_field)]))
  if not scores:
    return base
  finalists = sorted(scores, key=scores.get, reverse=True)[:args.finalists]
  if args.full_only:
    return finalists[0]
  causal = sweep.run(phase, head_dim, True, finalists, deadline)
  if not causal:
    return finalists[0]
  return max(causal, key=lambda b: math.sqrt(scores[b] * causal[b]))


def defaults_literal(best: dict[int, BlockSizes]) -> str:
  """Python source for `_GPU_DEFAULTS` in pallas_kernels/config.py."""
  lines = ["_GPU_DEFAULTS = {"]
  for head_dim, blocks in sorted(best.items()):
    values = dataclasses.asdict(blocks)
    # Grouped by kernel: forward, dK/dV, dQ (then anything else).
    order = [*FWD_SPACE, *BWD_FIELDS["dkdv"], *BWD_FIELDS["dq"]]
    order += [k for k in values if k not in order]
    fields = ", ".join(f"{k}={values[k]}" for k in order)
    start = f"    {head_dim}: BlockSizes("
    lines.append(textwrap.fill(fields + "),", width=80, initial_indent=start,
                               subsequent_indent=" " * len(start)))
  return "\n".join(lines + ["}"])


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  parser.add_argument("--head-dims", nargs="+", type=int)
  parser.add_argument("--seq", type=int,
                      help="sequence length (default 4096; a model's, e.g. "
                      "ViT's 577, for a sweep at its shape)")
  parser.add_argument("--tokens", type=int,
                      help="batch * seq (default 16384)")
  parser.add_argument("--hidden", type=int,
                      help="heads * head_dim (default 2048)")
  parser.add_argument("--phases", nargs="+", choices=PHASES,
                      help="the kernels to tune (default all three, in "
                      "order); the others keep their defaults")
  parser.add_argument("--full-only", action="store_true",
                      help="no causal finalists: for shapes trained without "
                      "a causal mask (ViT)")
  parser.add_argument("--out",
                      default="benchmarks/results/h200_block_sweep.json")
  parser.add_argument("--budget", type=float, default=420.0,
                      help="seconds for the whole sweep")
  parser.add_argument("--finalists", type=int, default=3)
  parser.add_argument("--compile-workers", type=int, default=8)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes and spaces (interpret mode on a CPU)")
  args = parser.parse_args(argv)
  args.phases = args.phases or list(PHASES)
  for name, value in (SMOKE if args.smoke else STANDARD).items():
    if getattr(args, name, None) is None:
      setattr(args, name, value)
  args.interpret = not compat.has_gpu()
  return args


def main(argv=None) -> int:
  compat.filter_known_warnings()
  args = parse_args(argv)
  header = common.run_header("benchmarks.tune_blocks", argv)
  start = time.monotonic()
  per_head_dim = math.prod(map(len, args.fwd_space.values())) + sum(
      len(tiles) * len(args.bwd_warps) + len(args.bwd_stages) - 1
      for tiles in (args.dkdv_tiles, args.dq_tiles)) + 3 * args.finalists
  default = lambda d: BlockSizes.get_default(d, kv_len=args.seq)
  best = {d: default(d) for d in args.head_dims}
  chosen = {}  # (phase, head_dim) -> BlockSizes
  with common.progress(total=len(args.head_dims) * per_head_dim,
                       desc="sweep", unit="trial") as bar, \
      concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
    sweep = Sweep(args, bar, pool)
    phase_end = start
    shares = sum(BUDGET_SHARE[p] for p in args.phases)
    for phase in args.phases:
      phase_end += BUDGET_SHARE[phase] / shares * args.budget
      for i, head_dim in enumerate(args.head_dims):
        # Equal shares of what is left: a head dim that finishes early
        # gives its spare time to the next.
        left = phase_end - time.monotonic()
        deadline = time.monotonic() + left / (len(args.head_dims) - i)
        best[head_dim] = chosen[phase, head_dim] = tune(
            sweep, head_dim, phase, best[head_dim], deadline)
        common.write_json(args.out, {**header, "trials": sweep.trials})
  result = {**header, "seq_len": args.seq, "tokens": args.tokens,
            "hidden": args.hidden, "trials": sweep.trials,
            "best": {d: dataclasses.asdict(b) for d, b in best.items()}}
  common.write_json(args.out, result)

  def measured(phase, head_dim, blocks):
    return ", ".join(
        f"{'causal' if t['causal'] else 'full'} {t['tflops']:.4g}"
        for t in sweep.trials
        if t["phase"] == phase and t["head_dim"] == head_dim
        and t["block_sizes"] == dataclasses.asdict(blocks) and "tflops" in t)

  for (phase, head_dim), blocks in chosen.items():
    # The default is each phase's first candidate, timed beside the others.
    print(f"d{head_dim} {phase}: TFLOP/s "
          f"{measured(phase, head_dim, blocks) or 'not measured (default kept)'}"
          f" (the default: "
          f"{measured(phase, head_dim, default(head_dim)) or 'not measured'})")
  failed = sum("error" in t for t in sweep.trials)
  print(f"{len(sweep.trials)} trials ({failed} failed) in "
        f"{time.monotonic() - start:.0f} s; wrote {args.out}\n")
  print(defaults_literal(best))
  return 0


if __name__ == "__main__":
  sys.exit(main())
