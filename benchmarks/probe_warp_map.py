"""Probes `plgpu.warp_map` with the fused dQ's writer path, on a toy kernel.

    python -m benchmarks.probe_warp_map            # on an H100/H200
    python -m benchmarks.probe_warp_map --lower    # any machine: lowers only

Session 8 built the fused dQ backward with its writer as a warp of the
producer warpgroup (FlashAttention-3's layout, `NOTES.md`): it lowered, and
hung on the H200. This toy has the same shape: a ring of `steps` bf16
[64, 64] tiles streamed by TMA, a consumer warpgroup that doubles each tile
into an f32 stage, and a writer that, in step order, stores (the first) or
TMA-reduce-adds the stage to an f32 [64, 64] output, waits for the copy,
signals a turn semaphore and frees the stage. Expected: 2 x the sum of the
tiles. Four layouts, each run in a subprocess with a time limit so that a
hang is reported rather than waited for:

  separate       producer and writer in warpgroups of their own (what ships)
  warp_producer  the producer as warp 0 of its warpgroup (`warp_map`), the
                 writer a warpgroup
  warp_writer    the producer a warpgroup, the writer as warp 1 of its own
  warp_both      both in one warpgroup, warp 0 streaming and warp 1 writing
                 (the layout that hung)

Prints one line per layout: ok, wrong (max error), error or hang.
"""
from __future__ import annotations

import argparse
import functools
import subprocess
import sys

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic import compat

LAYOUTS = ("separate", "warp_producer", "warp_writer", "warp_both")
_TILE = 64
_STAGES = 2


def _transforms(dtype):
  elems = 128 // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128))


def toy(x, layout: str):
  """x: bf16 [steps * 64, 64] -> f32 [64, 64], 2 x the sum of its tiles."""
  steps = x.shape[0] // _TILE

  def body(x_ref, out_ref, ring, stage, arrived, consumed, staged,
           stage_free):
    wg = lax.axis_index("wg")

    def produce():
      @pl.loop(0, steps)
      def _(step):
        slot = lax.rem(step, _STAGES)
        pl.when(step >= _STAGES)(
            lambda: plgpu.barrier_wait(consumed.at[slot]))
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(step * _TILE, _TILE)],
                                ring.at[slot], arrived.at[slot])

    def write(turn):
      def step_fn(step, carry):
        parity = lax.rem(step, 2)
        plgpu.barrier_wait(staged.at[parity])
        plgpu.semaphore_signal(turn.at[0], 1, memory_scope="gpu")
        plgpu.semaphore_wait(turn.at[0], step + 1, decrement=False,
                             memory_scope="gpu")
        pl.when(step == 0)(functools.partial(
            plgpu.copy_smem_to_gmem, stage.at[parity], out_ref,
            commit_group=True))
        pl.when(step > 0)(functools.partial(
            plgpu.copy_smem_to_gmem, stage.at[parity], out_ref,
            commit_group=True, reduction_op="add"))
        # Each add lands before the next starts: the sum's order is fixed.
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        plgpu.barrier_arrive(stage_free.at[parity])
        return carry
      lax.fori_loop(0, steps, step_fn, 0)

    def consume():
      def step_fn(step, carry):
        slot, parity = lax.rem(step, _STAGES), lax.rem(step, 2)
        plgpu.barrier_wait(arrived.at[slot])
        doubled = ring[slot].astype(jnp.float32) * 2.0
        plgpu.barrier_arrive(consumed.at[slot])
        pl.when(step >= 2)(
            lambda: plgpu.barrier_wait(stage_free.at[parity]))
        stage[parity] = doubled
        plgpu.commit_smem()
        plgpu.barrier_arrive(staged.at[parity])
        return carry
      lax.fori_loop(0, steps, step_fn, 0)

    def writer():
      # (A warp may close over refs and scalars only: the semaphore is
      # allocated outside `warp_map`.)
      return functools.partial(write, pl.get_global(
          plgpu.SemaphoreType.REGULAR((1,))))

    def in_warp(number, fn):
      @plgpu.warp_map
      def _(warp):
        pl.when(warp == number)(fn)

    pl.when(wg == 0)(consume)
    if layout == "warp_both":
      @pl.when(wg == 1)
      def _():
        write_fn = writer()

        @plgpu.warp_map
        def _(warp):
          pl.when(warp == 0)(produce)
          pl.when(warp == 1)(write_fn)
      return
    pl.when(wg == 1)(
        (lambda: in_warp(0, produce)) if layout == "warp_producer"
        else produce)
    pl.when(wg == 2)(
        (lambda: in_warp(1, writer())) if layout == "warp_writer"
        else lambda: writer()())

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((_TILE, _TILE), jnp.float32),
      scratch_types=(
          plgpu.SMEM((_STAGES, _TILE, _TILE), jnp.bfloat16,
                     transforms=_transforms(jnp.bfloat16)),
          plgpu.SMEM((2, _TILE, _TILE), jnp.float32,
                     transforms=_transforms(jnp.float32)),
          plgpu.Barrier(num_barriers=_STAGES),                 # arrived
          plgpu.Barrier(num_barriers=_STAGES),                 # consumed
          plgpu.Barrier(num_barriers=2),                       # staged
          plgpu.Barrier(num_barriers=2),                       # stage_free
      ),
      num_threads=2 if layout == "warp_both" else 3, thread_name="wg",
      kernel_name=f"probe_warp_map_{layout}",
      compiler_params=compat.compiler_params(),
  )(x)


def _inputs(steps: int = 16):
  return jax.random.normal(jax.random.key(0), (steps * _TILE, _TILE),
                           jnp.float32).astype(jnp.bfloat16)


def run_one(layout: str) -> str:
  x = _inputs()
  out = jax.block_until_ready(jax.jit(functools.partial(toy, layout=layout))(x))
  expected = 2.0 * x.astype(jnp.float32).reshape(-1, _TILE, _TILE).sum(0)
  error = float(jnp.max(jnp.abs(out - expected)))
  return "ok" if error <= 1e-3 * float(jnp.max(jnp.abs(expected))) else (
      f"wrong (max error {error:.3g})")


def lower_one(layout: str) -> str:
  x = jax.ShapeDtypeStruct((16 * _TILE, _TILE), jnp.bfloat16)
  jax.jit(functools.partial(toy, layout=layout)).trace(x).lower(
      lowering_platforms=("cuda",))
  return "lowers"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lower", action="store_true",
                      help="only lower for CUDA (any machine)")
  parser.add_argument("--layouts", nargs="+", choices=LAYOUTS,
                      default=list(LAYOUTS))
  parser.add_argument("--timeout", type=float, default=60.0)
  parser.add_argument("--one", choices=LAYOUTS, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:  # the subprocess
    print((lower_one if args.lower else run_one)(args.one))
    return 0
  failed = 0
  for layout in args.layouts:
    command = [sys.executable, "-m", "benchmarks.probe_warp_map",
               "--one", layout] + (["--lower"] if args.lower else [])
    try:
      done = subprocess.run(command, capture_output=True, text=True,
                            timeout=args.timeout)
      lines = done.stdout.strip().splitlines()
      verdict = lines[-1] if done.returncode == 0 and lines else (
          "error: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300])
    except subprocess.TimeoutExpired:
      verdict = f"hang (no result in {args.timeout:.0f} s)"
    failed += verdict not in ("ok", "lowers")
    print(f"{layout:14s} {verdict}", flush=True)
  return int(failed > 0)


if __name__ == "__main__":
  sys.exit(main())
