"""What the fused dQ's fixed order costs (a diagnostic; its dQ is wrong).

    python -m benchmarks.fused_turn_cost --seqs 4096 16384 --head-dim 128

The fused backward (`mosaic_backward(fused_dq=True)`) adds each K/V tile's
share of a Q tile's dQ in K/V-tile order: a CTA's dQ writer waits on the Q
tile's turn semaphore until the previous K/V tile's add is in memory. That
order makes the gradients bitwise repeatable (DESIGN: deterministic); cuDNN
adds in any order (its backward is one kernel with dQ summed in f32, 2.27
ms at d=128 4k against our two kernels' 2.75 under ncu:
results/h200_ncu_4k.md). This times, in one process and in turn, the
backward alone:

- `fused`: the fused kernel as shipped;
- `fused_unordered`: the same kernel traced with the turn waits removed
  (`plgpu.semaphore_wait` made a no-op while it is traced), so that every
  writer adds as soon as its pieces are staged. Its dQ is WRONG (the first
  K/V tile stores where it should add first; adds race): the number says
  only what waiting for turns costs;
- `two_kernels`: the dK/dV and dQ kernels (the default at these lengths
  under causal masking, and without a mask below 16k at d=128).

If `fused_unordered` is near cuDNN's backward and `fused` is not, the
order is the lever (e.g. fewer, coarser turns); if both are slow, the
kernel's steps are.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
from unittest import mock

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import common, render
from pallas_kernels import compat

VARIANTS = ("fused", "fused_unordered", "two_kernels")


@contextlib.contextmanager
def turns_removed():
  """While a fused kernel is traced: its turn waits do nothing."""
  with mock.patch.object(plgpu, "semaphore_wait",
                         lambda *args, **kwargs: None):
    yield


def build(cell: common.Cell, variant: str):
  """(compiled backward, its arguments) of `variant` for `cell`."""
  from pallas_kernels.mosaic.backward import mosaic_backward
  from pallas_kernels.mosaic.forward import mosaic_forward
  q, k, v, d_out = common.attention_inputs(cell.shape, cell.dtype)
  scale = cell.head_dim**-0.5
  out, lse = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=scale, is_causal=cell.causal))(q, k, v)
  fused = variant != "two_kernels"
  options = dict(fused_dq=fused, persistent=False)
  if cell.head_dim == 64:
    options["block_q"] = 128  # the fused dQ's tiles at d=64
  fn = jax.jit(lambda *a: mosaic_backward(*a, scale=scale,
                                          is_causal=cell.causal, **options))
  args = (q, k, v, out, lse, d_out)
  patch = turns_removed() if variant == "fused_unordered" else (
      contextlib.nullcontext())
  with patch:  # the kernel is traced (and compiled) here
    return fn.lower(*args).compile(), args


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 16384])
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default="fused_turn_cost.json")
  args = parser.parse_args(argv)
  result = {**common.run_header("benchmarks.fused_turn_cost", argv),
            "trials": []}
  for seq in args.seqs:
    cell = common.Cell.standard("fwd", seq, args.head_dim, args.causal)
    built = {name: build(cell, name) for name in VARIANTS}
    times = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):  # in turn, so that clock drift is shared
      for name, (compiled, inputs) in built.items():
        times[name].append(common.time_fn(compiled, *inputs))
    for name in VARIANTS:
      ms = statistics.median(times[name])
      result["trials"].append(dict(
          seq=seq, head_dim=args.head_dim, causal=args.causal, variant=name,
          ms=ms, tflops=2.5 * cell.flops / (ms * 1e-3) / 1e12))
      print(f"seq {seq} d{args.head_dim} {name}: {ms:.3f} ms, "
            f"{result['trials'][-1]['tflops']:.0f} TFLOP/s", flush=True)
  common.write_json(args.out, result)
  print(render.markdown_table(
      ["seq", "variant", "ms", "TFLOP/s (backward, 2.5x)"],
      [[t["seq"], t["variant"], f"{t['ms']:.3f}", f"{t['tflops']:.0f}"]
       for t in result["trials"]]))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
