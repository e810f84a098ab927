"""One grid cell's kernels, once each, for Nsight Compute to profile.

    ncu --profile-from-start off --clock-control none --set full -o REPORT \
        python3 -m benchmarks.diagnostics.ncu_kernels --mode fwd_bwd --seq 16384 \
        --head-dim 128 --impls jax_flash_mosaic cudnn

Each implementation (a name in `benchmarks.peers`) is built, run until
warm (compiled, autotuned), and then run once more between
`cuProfilerStart` and `cuProfilerStop`: with `--profile-from-start off`,
ncu profiles only the kernels of those runs, not compilation, autotuning
or input generation. Without ncu the profiler calls do nothing, so the
script also runs alone (a dry run of the builds).

`--masks NAME...` adds rows of `benchmarks.masks` (its variants at the
cell's length, 16 heads, on the Mosaic kernels): "causal as mask_fn"
profiles the masked kernels on the very mask the plain ones take with
`is_causal`, so that the two sets of kernels can be read side by side.

`--model-cell NAME` profiles a cell of `benchmarks.models` instead
(GQA, windows, soft caps: its shapes and options, its implementations'
names), e.g. `--model-cell gqa32x8_causal_32k --impls jax_flash cudnn`.

`h200_check.sh ncu` runs it under ncu and prints each kernel's headline
numbers (`benchmarks.diagnostics.ncu_summary`).
"""
from __future__ import annotations

import argparse
import ctypes
import sys

import jax

from benchmarks import common, peers
from pallas_kernels import compat


def _profiler():
  """(start, stop) of the CUDA driver's profiler range, or no-ops."""
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return (lambda: None), (lambda: None)
  return cuda.cuProfilerStart, cuda.cuProfilerStop


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mode", choices=common.MODES, default="fwd_bwd")
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--tokens", type=int, default=16384,
                      help="batch * seq_len")
  parser.add_argument("--impls", nargs="+",
                      default=["jax_flash_mosaic", "cudnn", "tokamax_mosaic"])
  parser.add_argument("--fused-dq", action="store_true",
                      help="our Mosaic backward fuses dQ into the dK/dV "
                      "kernel at this head dim (mosaic_backward(fused_dq))")
  parser.add_argument("--masks", nargs="+", default=[], metavar="NAME",
                      help="rows of benchmarks.masks to profile too, on the "
                      "Mosaic kernels (e.g. 'causal as mask_fn')")
  parser.add_argument("--model-cell", metavar="NAME",
                      help="a cell of benchmarks.models instead of the "
                      "grid's (--seq, --head-dim, --causal, --tokens unused)")
  parser.add_argument("--two-consumers", action="store_true",
                      help="our Mosaic forward with two consumer "
                      "warpgroups at every head dim (not three at d=64)")
  args = parser.parse_args(argv)
  if args.two_consumers or args.fused_dq:
    _replan(args.head_dim, two_consumers=args.two_consumers,
            fused_dq=args.fused_dq)
  start, stop = _profiler()
  if args.model_cell:
    cell, runs = _model_cell_runs(args.model_cell, args.mode, args.impls)
  else:
    cell = common.Cell.standard(args.mode, args.seq, args.head_dim,
                                args.causal, tokens=args.tokens)
    runs = []
    for name in args.impls:
      try:
        bench = getattr(peers, name)(cell)
      except peers.Unavailable as e:
        print(f"{name}: {e}", file=sys.stderr)
        continue
      runs.append((name, bench.fn, bench.args))
  if args.masks:
    from benchmarks import masks  # noqa: PLC0415
    table = masks.variants(args.seq, 16)
    for name in args.masks:
      fn, inputs = masks.build(args.mode, (1, args.seq, 16, args.head_dim),
                               table[name], interpret=False,
                               implementation="mosaic")
      runs.append((name, fn, inputs))
  for name, fn, inputs in runs:
    try:
      for _ in range(3):  # compile, autotune, warm
        jax.block_until_ready(fn(*inputs))
    except (peers.Unavailable, NotImplementedError) as e:  # no sm90 here
      print(f"{name}: {e}", file=sys.stderr)
      continue
    start()
    jax.block_until_ready(fn(*inputs))
    stop()
    print(f"{name} {getattr(cell, 'name', None) or cell.label()}: "
          "profiled", flush=True)
  return 0


def _model_cell_runs(name: str, mode: str, impls):
  """(the `benchmarks.models` cell `name`, [(impl, fn, args)] of `impls`
  built as that suite builds them)."""
  from benchmarks import models  # noqa: PLC0415
  cell = models.CELLS_BY_NAME[name]
  inputs = models.make_inputs(cell, seed=0)
  pairs = models.attended_pairs(cell, inputs.segment_ids, inputs.lengths)
  runs = []
  for impl in impls:
    try:
      built = models.build(impl, cell, mode, inputs, pairs, interpret=False)
    except (peers.Unavailable, NotImplementedError) as e:
      print(f"{impl}: {e}", file=sys.stderr)
      continue
    runs.append((impl, built.compiled, built.args))
  return cell, runs


def _replan(head_dim: int, *, two_consumers: bool, fused_dq: bool):
  """Rewrites the Mosaic plan's rows at `head_dim`, so that the public call
  (which the peers' benchmarks make) takes the asked-for schedule."""
  import dataclasses  # noqa: PLC0415
  from pallas_kernels.mosaic import plan  # noqa: PLC0415

  def rows(table, **change):
    return tuple((d, *key, dataclasses.replace(config, **change)
                  if d == head_dim else config)
                 for d, *key, config in table)

  if two_consumers:
    plan.FORWARD_PLAN = rows(plan.FORWARD_PLAN, num_consumers=2)
  if fused_dq:
    plan.BACKWARD_PLAN = rows(plan.BACKWARD_PLAN, fused_dq=True,
                              persistent=False)


if __name__ == "__main__":
  sys.exit(main())
