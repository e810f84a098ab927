"""Where a grid cell's fwd+bwd time goes: our pieces one by one, beside tokamax.

    python -m benchmarks.diagnostics.backward_breakdown --seq 1024 --head-dim 128
    python -m benchmarks.diagnostics.backward_breakdown --seq 1024 --head-dim 64 --causal

One cell of the standard grid (bf16, batch·seq 16384, hidden 2048), every
piece compiled and timed in one process, one after another:

  forward          `mosaic_forward` with its defaults
  row statistics   `backward.row_statistics` (delta by `triton.delta`, the
                   LSE in base 2)
  delta by XLA     the same sum computed by XLA alone (the yardstick for
                   `triton.delta.row_delta`)
  dQ kernel        `backward.launch_dq` (absent when dQ is fused)
  dK/dV pass       `backward.launch_dkdv`, each pass (two at head_dim 256)
  backward         `mosaic_backward` as `flash_attention` calls it
  fwd+bwd          the grid's `jax_flash_mosaic` fwd_bwd (`jax.vjp`)
  tokamax          tokamax's forward and fwd+bwd, where it imports

The backward's kernels are configured by `backward.configure`, the one
place that decides `mosaic_backward`'s defaults, with the tiles
`attention.backward_tiles` gives `flash_attention`. What the fwd+bwd takes
beyond forward + backward is the custom_vjp's glue; what the backward
takes beyond its kernels and statistics, launch gaps. TFLOP/s use the
grid's count (a piece's share of the backward counts as the backward).
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks import common, peers
from pallas_kernels import compat


def pieces(cell: common.Cell):
  """[(name, jitted fn, args)] of our forward and backward pieces."""
  from pallas_kernels.mosaic import attention, backward
  from pallas_kernels.mosaic.forward import mosaic_forward
  q, k, v, d_out = common.attention_inputs(cell.shape, cell.dtype)
  scale = cell.head_dim**-0.5
  forward = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=scale, is_causal=cell.causal))
  out, lse = forward(q, k, v)
  tiles = attention.backward_tiles(cell.head_dim, cell.seq_len)
  dq_config, dkdv_configs = backward.configure(
      q, k, scale=scale, is_causal=cell.causal, **tiles)
  statistics = jax.jit(lambda out, lse, d_out: backward.row_statistics(
      out, lse, d_out, None))
  stats = statistics(out, lse, d_out)
  # What XLA makes of delta alone: the yardstick for `row_delta`.
  xla_delta = jax.jit(lambda out, d_out: jnp.swapaxes(jnp.sum(
      out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1), 1, 2))
  found = [("forward", forward, (q, k, v)),
           ("row statistics", statistics, (out, lse, d_out)),
           ("delta by XLA", xla_delta, (out, d_out))]
  if dq_config is not None:
    found.append(("dQ kernel", jax.jit(
        lambda *a: backward.launch_dq(*a, dq_config)), (q, k, v, d_out,
                                                        stats)))
  for static in dkdv_configs:
    found.append((f"dK/dV pass {'+'.join(static.outputs)}", jax.jit(
        lambda *a, static=static: backward.launch_dkdv(*a, static)),
                  (q, k, v, d_out, stats)))
  found.append(("backward", jax.jit(lambda *a: backward.mosaic_backward(
      *a, scale=scale, is_causal=cell.causal, **tiles)),
                (q, k, v, out, lse, d_out)))
  return found


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--tokens", type=int, default=16384,
                      help="batch * seq_len")
  parser.add_argument("--hidden", type=int, default=2048,
                      help="num_heads * head_dim")
  args = parser.parse_args(argv)
  cell_of = lambda mode: common.Cell.standard(
      mode, args.seq, args.head_dim, args.causal, tokens=args.tokens,
      hidden=args.hidden)
  fwd_bwd = cell_of("fwd_bwd")
  forward_flops = cell_of("fwd").flops
  rows = [(name, fn, fn_args, forward_flops * (1.0 if name == "forward"
                                               else 2.5))
          for name, fn, fn_args in pieces(fwd_bwd)]
  for mode in ("fwd", "fwd_bwd"):
    cell = cell_of(mode)
    for name, build in (("jax_flash_mosaic", peers.jax_flash_mosaic),
                        ("tokamax_mosaic", peers.tokamax_mosaic)):
      try:
        bench = build(cell)
      except peers.Unavailable as e:
        print(f"{name} {mode}: {e}", file=sys.stderr)
        continue
      rows.append((f"{name} {mode}", bench.fn, bench.args, cell.flops))
  print(f"# {fwd_bwd.label()}, shape {fwd_bwd.shape}, "
        f"{jax.devices()[0].device_kind}")
  print("| piece | ms | TFLOP/s |")
  print("|---|---|---|")
  for name, fn, fn_args, flops in rows:
    ms = common.time_fn(fn, *fn_args, reps=args.reps)
    print(f"| {name} | {ms:.4f} | {flops / ms / 1e9:.0f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
