"""Sweeps the Triton kernels' BlockSizes on this GPU; prints the best per head dim.

    python -m benchmarks.tune_blocks   # -> results/h200_block_sweep.json

At seq 4096, batch·seq = 16384, hidden 2048, bf16, for head_dim 64, 128, 256.
Pruned to fit a time budget (compiling dominates, not timing):

1. forward: every (block_q, block_k, num_warps, num_stages) of `FWD_SPACE`
   without mask, then the best `--finalists` again with the causal mask;
   the winner has the best geometric mean of the two TFLOP/s.
2. backward, with that forward fixed, timing forward+backward: every tile pair
   of `BWD_TILES` x `BWD_WARPS` at the default's stage count, then the best
   of those with the other `BWD_STAGES`, then finalists causal as above.

Candidates that fail (too much shared memory, say) are recorded with their
error. When the budget runs out a phase keeps the best found so far
(candidates are ordered so the current default comes first). The result ends
with a `_GPU_DEFAULTS` literal for `pallas_kernels/config.py`.
"""
from __future__ import annotations

import argparse
import dataclasses
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
# The dK/dV kernel's grid runs over K/V tiles and loops over Q tiles; the dQ
# kernel the other way round. One (major, minor) pair serves both: major is
# the grid axis (block_kv_dkv, block_q_dq), minor the loop (block_q_dkv,
# block_kv_dq), as in FlashAttention-2's backward.
BWD_TILES = ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128))
BWD_WARPS = (4, 8)
BWD_STAGES = (1, 2, 3)
STANDARD = dict(tokens=16384, hidden=2048, seq=4096, head_dims=[64, 128, 256],
                fwd_space=FWD_SPACE, bwd_tiles=BWD_TILES, bwd_warps=BWD_WARPS,
                bwd_stages=BWD_STAGES)
# CPU interpret mode: warps and stages are ignored there; tiles still matter.
SMOKE = dict(tokens=256, hidden=64, seq=128, head_dims=[32],
             fwd_space=dict(block_q=(32, 64), block_k=(32,), num_warps=(4,),
                            num_stages=(2,)),
             bwd_tiles=((32, 16), (64, 32)), bwd_warps=(4,),
             bwd_stages=(1, 2))


@dataclasses.dataclass
class Sweep:
  """The trials so far and what they share."""
  args: argparse.Namespace
  bar: tqdm
  trials: list = dataclasses.field(default_factory=list)
  seconds: list = dataclasses.field(default_factory=list)

  def seconds_per_trial(self) -> float:
    """Mean duration of a trial so far (compile + time); 2 s before any."""
    return sum(self.seconds) / len(self.seconds) if self.seconds else 2.0

  def cell(self, mode: str, head_dim: int, causal: bool) -> common.Cell:
    return common.Cell.standard(mode, self.args.seq, head_dim, causal,
                                tokens=self.args.tokens,
                                hidden=self.args.hidden)

  def trial(self, phase: str, head_dim: int, causal: bool,
            blocks: BlockSizes) -> float | None:
    """TFLOP/s of jax_flash_triton with `blocks`, or None if it failed."""
    mode = "fwd" if phase == "fwd" else "fwd_bwd"
    cell = self.cell(mode, head_dim, causal)
    entry = {"phase": phase, "head_dim": head_dim, "causal": causal,
             "block_sizes": dataclasses.asdict(blocks)}
    self.bar.set_postfix_str(
        f"{phase} d{head_dim}{' causal' if causal else ''}", refresh=False)
    start = time.monotonic()
    try:
      bench = peers.jax_flash_triton(cell, interpret=self.args.interpret,
                                     block_sizes=blocks)
      m = common.measure(bench.fn, bench.args, warmup=self.args.warmup,
                         reps=self.args.reps)
      entry.update(ms=m.ms, tflops=cell.flops / (m.ms * 1e-3) / 1e12)
    except Exception as e:  # a candidate that does not compile is a result
      entry["error"] = common.describe_error(e)
    self.trials.append(entry)
    self.seconds.append(time.monotonic() - start)
    self.bar.update()
    return entry.get("tflops")


def fwd_candidates(default: BlockSizes, space: dict) -> list[BlockSizes]:
  """Every forward setting of `space`, nearest to the default first.

  Near the current default is where a budget cut should leave the search.
  """
  combos = [dict(zip(space, values))
            for values in itertools.product(*space.values())]
  combos.sort(key=lambda c: sum(v != getattr(default, k) for k, v in c.items()))
  return [dataclasses.replace(default, **c) for c in combos]


def bwd_blocks(base: BlockSizes, major: int, minor: int, warps: int,
               stages: int) -> BlockSizes:
  return dataclasses.replace(
      base, block_q_dkv=minor, block_kv_dkv=major, block_q_dq=major,
      block_kv_dq=minor, num_warps_bwd=warps, num_stages_bwd=stages)


def pick(sweep: Sweep, phase: str, head_dim: int,
         scores: dict[BlockSizes, float], finalists: int,
         deadline: float) -> BlockSizes:
  """Re-times the best `finalists` causal; returns the best geometric mean."""
  ranked = sorted(scores, key=scores.get, reverse=True)[:finalists]
  final = {}
  for blocks in ranked:
    if time.monotonic() > deadline:
      break
    causal = sweep.trial(phase, head_dim, True, blocks)
    if causal is not None:
      final[blocks] = math.sqrt(scores[blocks] * causal)
  return max(final, key=final.get) if final else ranked[0]


def tune(sweep: Sweep, head_dim: int, phase: str, base: BlockSizes,
         deadline: float) -> BlockSizes:
  """The best BlockSizes for one phase and head dim, starting from `base`."""
  args = sweep.args

  def run_all(candidates) -> dict[BlockSizes, float]:
    scores = {}
    for blocks in candidates:
      # Keep time for the causal finalists.
      reserve = args.finalists * sweep.seconds_per_trial()
      if time.monotonic() + reserve > deadline:
        break
      tflops = sweep.trial(phase, head_dim, False, blocks)
      if tflops is not None:
        scores[blocks] = tflops
    return scores

  if phase == "fwd":
    scores = run_all(fwd_candidates(base, args.fwd_space))
  else:
    # Tiles and warps at the default's stage count (one that fits in shared
    # memory for this head dim), then the other stage counts for the best.
    stages = base.num_stages_bwd
    candidates = [bwd_blocks(base, major, minor, warps, stages)
                  for (major, minor), warps in itertools.product(
                      args.bwd_tiles, args.bwd_warps)]
    candidates.sort(key=lambda b: b != base)
    scores = run_all(candidates)
    if scores:
      best = max(scores, key=scores.get)
      scores.update(run_all(dataclasses.replace(best, num_stages_bwd=s)
                            for s in args.bwd_stages if s != stages))
  if not scores:
    return base
  return pick(sweep, phase, head_dim, scores, args.finalists, deadline)


def defaults_literal(best: dict[int, BlockSizes]) -> str:
  """Python source for `_GPU_DEFAULTS` in pallas_kernels/config.py."""
  lines = ["_GPU_DEFAULTS = {"]
  for head_dim, blocks in sorted(best.items()):
    fields = ", ".join(f"{k}={v}" for k, v in
                       dataclasses.asdict(blocks).items())
    start = f"    {head_dim}: BlockSizes("
    lines.append(textwrap.fill(fields + "),", width=80, initial_indent=start,
                               subsequent_indent=" " * len(start)))
  return "\n".join(lines + ["}"])


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  parser.add_argument("--head-dims", nargs="+", type=int)
  parser.add_argument("--out",
                      default="benchmarks/results/h200_block_sweep.json")
  parser.add_argument("--budget", type=float, default=420.0,
                      help="seconds for the whole sweep (forward gets 40%%)")
  parser.add_argument("--finalists", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes and spaces (interpret mode on a CPU)")
  args = parser.parse_args(argv)
  preset = SMOKE if args.smoke else STANDARD
  for name, value in preset.items():
    if getattr(args, name, None) is None:
      setattr(args, name, value)
  args.interpret = not compat.has_gpu()
  return args


def main(argv=None) -> int:
  compat.filter_known_warnings()
  args = parse_args(argv)
  header = common.run_header("benchmarks.tune_blocks", argv)
  start = time.monotonic()
  phase_end = {"fwd": start + 0.4 * args.budget, "bwd": start + args.budget}
  per_head_dim = (math.prod(len(v) for v in args.fwd_space.values())
                  + len(args.bwd_tiles) * len(args.bwd_warps)
                  + len(args.bwd_stages) + 2 * args.finalists)
  best = {d: BlockSizes.get_default(d) for d in args.head_dims}
  chosen = {}  # (phase, head_dim) -> BlockSizes
  with common.progress(total=len(args.head_dims) * per_head_dim,
                       desc="sweep", unit="trial") as bar:
    sweep = Sweep(args, bar)
    for phase in ("fwd", "bwd"):
      for i, head_dim in enumerate(args.head_dims):
        # Equal shares of what is left: a head dim that finishes early
        # gives its spare time to the next.
        left = phase_end[phase] - time.monotonic()
        deadline = time.monotonic() + left / (len(args.head_dims) - i)
        best[head_dim] = chosen[phase, head_dim] = tune(
            sweep, head_dim, phase, best[head_dim], deadline)
        common.write_json(args.out, {**header, "trials": sweep.trials})
  result = {**header, "seq_len": args.seq, "tokens": args.tokens,
            "hidden": args.hidden, "trials": sweep.trials,
            "best": {d: dataclasses.asdict(b) for d, b in best.items()}}
  common.write_json(args.out, result)
  for (phase, head_dim), blocks in chosen.items():
    measured = [f"{'causal' if t['causal'] else 'full'} {t['tflops']:.4g}"
                for t in sweep.trials
                if t["phase"] == phase and t["head_dim"] == head_dim
                and t["block_sizes"] == dataclasses.asdict(blocks)
                and "tflops" in t]
    print(f"d{head_dim} {phase}: TFLOP/s "
          f"{', '.join(measured) or 'not measured (default kept)'}")
  failed = sum("error" in t for t in sweep.trials)
  print(f"{len(sweep.trials)} trials ({failed} failed) in "
        f"{time.monotonic() - start:.0f} s; wrote {args.out}\n")
  print(defaults_literal(best))
  return 0


if __name__ == "__main__":
  sys.exit(main())
