"""How evenly each grid of the masked forward loads the SMs, on a CPU.

    python -m benchmarks.diagnostics.persistent_balance
    python -m benchmarks.diagnostics.persistent_balance --seqs 8192 \
        --head-dims 256 --terms window gemma_local --sms 132

For `tune_mosaic`'s masked persistent A/B cells (batch·seq 16k, hidden
2048, causal with `tune_mosaic.causal_spec`'s term), each tile's cost is
taken as its plan row's K/V blocks (`masked.plan_rows`) plus half a block
for its prologue and epilogue. Three schedules are compared by their
busiest SM's load against the ideal (the total over the SMs), a CTA per
SM at a time:

  launch   the launch grid: tiles in launch order (each head's heaviest
           first, head by head), each to the SM that frees first
  paired   the plain causal forward's persistent pairs over each head's
           plan rows (heaviest with lightest), round-robin
  dealt    every tile sorted by cost, dealt forwards then backwards
           (`masked.persistent_plan`, `forward_persistent._PlanRows`)

A model of balance only: it leaves out the per-tile latencies a schedule
hides or not, and memory traffic. It explains the paired schedule's
losses on an H100 (`results/h100_mosaic_masked_persistent_paired.md`: a
4k window at 8k, d=256, 1.23x the ideal against the launch grid's 1.07x).
"""
from __future__ import annotations

import argparse
import heapq
import types

import numpy as np

from benchmarks import common, tune_mosaic

# The tile's own work beside its K/V blocks (prologue, epilogue), in blocks.
TILE_OVERHEAD_BLOCKS = 0.5


def tile_costs(seq: int, head_dim: int, term: str) -> np.ndarray:
  """[batch, heads, tiles]: each tile's cost in K/V blocks, each head's
  tiles heaviest first (the plan rows' order)."""
  from pallas_kernels.mosaic import common as mosaic_common
  from pallas_kernels.mosaic import masked, plan
  cell = common.Cell.standard("fwd", seq, head_dim, True)
  spec, operands = tune_mosaic.causal_spec(cell, term)
  block_kv = plan.default_block_kv(head_dim)
  static = types.SimpleNamespace(spec=spec, block_q=64, block_kv=block_kv,
                                 num_kv_blocks=-(-seq // block_kv))
  rows, plan_heads = masked.plan_rows(
      static, cell.batch, q_offset=None, q_lengths=None, kv_lengths=None,
      q_segments=operands.get("q_segments"),
      kv_segments=operands.get("kv_segments"))
  rows = np.asarray(rows)
  union = mosaic_common.PLAN_UNION
  blocks = (rows[..., union + 1] - rows[..., union]).astype(float)
  blocks = blocks.reshape(cell.batch, plan_heads, -1)
  return np.broadcast_to(blocks + TILE_OVERHEAD_BLOCKS,
                         (cell.batch, cell.num_heads, blocks.shape[-1]))


def launch_makespan(costs: np.ndarray, sms: int) -> float:
  """Tiles in launch order, each to the SM that frees first."""
  free = [0.0] * sms
  for cost in costs.reshape(-1):
    heapq.heappush(free, heapq.heappop(free) + cost)
  return max(free)


def paired_makespan(costs: np.ndarray, sms: int) -> float:
  """Each head's first-with-last pairs, then its middle tile paired with
  the next head's, round-robin (`common.persistent_schedule`)."""
  heads = costs.reshape(-1, costs.shape[-1])
  n = heads.shape[-1]
  pairs = [float(h[j] + h[n - 1 - j]) for h in heads for j in range(n // 2)]
  middles = [float(h[n // 2]) for h in heads] if n % 2 else []
  pairs += [sum(middles[i:i + 2]) for i in range(0, len(middles), 2)]
  ctas = min(sms, len(pairs))
  loads = np.zeros(ctas)
  for i, pair in enumerate(pairs):
    loads[i % ctas] += pair
  return loads.max()


def dealt_makespan(costs: np.ndarray, sms: int) -> float:
  """Every tile by descending cost, dealt forwards then backwards."""
  ordered = np.sort(costs.reshape(-1))[::-1]
  ctas = min(sms, ordered.size)
  loads = np.zeros(ctas)
  for i, cost in enumerate(ordered):
    round_, place = divmod(i, ctas)
    loads[place if round_ % 2 == 0 else ctas - 1 - place] += cost
  return loads.max()


def balance(seq: int, head_dim: int, term: str, sms: int) -> dict:
  """Each schedule's busiest SM against the ideal load (1.0: even)."""
  costs = tile_costs(seq, head_dim, term)
  ideal = costs.sum() / sms
  return dict(seq=seq, head_dim=head_dim, term=term, tiles=costs.size,
              **{name: float(makespan(costs, sms) / ideal)
                 for name, makespan in (("launch", launch_makespan),
                                        ("paired", paired_makespan),
                                        ("dealt", dealt_makespan))})


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqs", nargs="+", type=int, default=[2048, 8192])
  parser.add_argument("--head-dims", nargs="+", type=int, default=[128, 256])
  parser.add_argument("--terms", nargs="+",
                      default=["none", "window", "documents"])
  parser.add_argument("--sms", type=int, default=132)
  args = parser.parse_args(argv)
  print("seq   d    term         tiles  launch paired dealt  (busiest SM "
        "/ ideal)")
  for seq in args.seqs:
    for head_dim in args.head_dims:
      for term in args.terms:
        row = balance(seq, head_dim, term, args.sms)
        print(f"{seq:<5d} {head_dim:<4d} {term:12s} {row['tiles']:5d}  "
              f"{row['launch']:.3f}  {row['paired']:.3f}  "
              f"{row['dealt']:.3f}")


if __name__ == "__main__":
  main()
