"""Compile and run time of `flash_attention`'s forward and gradients, by shape.

    python -m benchmarks.diagnostics.compile_probe [--hang-after 90]

For the shapes of the numerics notebook's sweep (batch 1, 2 heads, head dim
128, float16/bfloat16/float32) and a few of the test suite's, prints per
shape: the compile time of the jitted forward, of the jitted forward+VJP,
and the run time of each after compilation, first and second (were a
kernel compiled at its first run, the difference would be that compile; on
the H200 with JAX 0.11.2 there is none: both runs under 5 ms, so Mosaic GPU
compiles inside XLA's compile). It tells a slow compile from a hang, and
first-call latency from steady-state time. With `--hang-after S`, a step
that takes longer than S seconds dumps every thread's Python traceback and
exits (faulthandler), so a hang names its place.

`--split IMPL...` times the stages of issue 38's first call instead (trace,
lower, compile, first run), and `--kernels` each Mosaic kernel of that
call lowered and compiled alone, in a program of its own: what of XLA's
compile is the kernels' (Mosaic GPU's LLVM passes and ptxas) and what is
the rest of the program's.
"""
from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import jax
import jax.numpy as jnp

import jax_flash
from pallas_kernels import compat

# (q_len, kv_len, heads, kv_heads, head_dim): the notebook's sweep, then
# shapes that only the GPU test suite reaches.
SHAPES = [(128, 128, 2, 2, 128), (256, 256, 2, 2, 128), (1024, 1024, 2, 2, 128),
          (4096, 4096, 2, 2, 128), (1024, 1024, 2, 2, 64),
          (1024, 1024, 2, 2, 256), (97, 97, 2, 2, 128), (512, 1024, 8, 2, 128)]
DTYPES = ("float16", "bfloat16", "float32")
# `--split`'s: issue 38's causal fwd+bwd at 4k, 16 heads.
SPLIT_SHAPE = (4096, 4096, 16, 16, 128)


def _inputs(shape, dtype):
  """Random (q, k, v, d_out) of batch 1 for `shape` as SHAPES'."""
  q_len, kv_len, heads, kv_heads, head_dim = shape
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (1, q_len, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (1, kv_len, kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (1, kv_len, kv_heads, head_dim), dtype)
  return q, k, v, jax.random.normal(keys[3], q.shape, dtype)


def _with_vjp(attention):
  """(q, k, v, d_out) -> (out, (dq, dk, dv)) of `attention`."""
  def forward_and_vjp(q, k, v, d_out):
    out, pullback = jax.vjp(attention, q, k, v)
    return out, pullback(d_out)
  return forward_and_vjp


def probe(shape, dtype: str, *, is_causal: bool, hang_after: float) -> dict:
  """Seconds to compile and to run the forward and the forward+VJP."""
  q, k, v, d_out = _inputs(shape, dtype)
  attention = lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=is_causal)
  forward_and_vjp = _with_vjp(attention)
  result = {}
  for name, fn, args in (("fwd", attention, (q, k, v)),
                         ("fwd+vjp", forward_and_vjp, (q, k, v, d_out))):
    faulthandler.dump_traceback_later(hang_after, exit=True,
                                      file=sys.__stderr__)
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    result[f"{name} compile s"] = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    result[f"{name} first run s"] = time.perf_counter() - start
    # Anything compiled at the first run rather than in XLA's compile above
    # shows as the first run less the second.
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    result[f"{name} second run s"] = time.perf_counter() - start
    faulthandler.cancel_dump_traceback_later()
  return result


def split(shape, *, implementation: str | None) -> dict:
  """Seconds of each stage of a causal bf16 fwd+VJP's first call at
  [1, q_len, heads, head_dim] (`shape` as SHAPES'): tracing, lowering
  (our Python and Mosaic GPU's MLIR passes), XLA's compile (which
  compiles the Mosaic kernels to cubins, ptxas included) and the first
  run; `implementation` "cudnn" times `jax.nn.dot_product_attention`'s
  instead."""
  q, k, v, d_out = _inputs(shape, jnp.bfloat16)
  if implementation == "cudnn":
    attention = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")
  else:
    attention = lambda q, k, v: jax_flash.flash_attention(
        q, k, v, is_causal=True, implementation=implementation)

  times, start = {}, time.perf_counter()
  traced = jax.jit(_with_vjp(attention)).trace(q, k, v, d_out)
  times["trace"], start = time.perf_counter() - start, time.perf_counter()
  lowered = traced.lower()
  times["lower"], start = time.perf_counter() - start, time.perf_counter()
  compiled = lowered.compile()
  times["compile"], start = time.perf_counter() - start, time.perf_counter()
  jax.block_until_ready(compiled(q, k, v, d_out))
  times["first run"] = time.perf_counter() - start
  return times


def kernel_stages(shape) -> list[tuple[str, float, float]]:
  """(kernel name, lower s, compile s) of each Mosaic kernel launched by
  the causal bf16 fwd+VJP of `split`, each in a `jit` of its own: the
  launches are recorded while the whole call is traced (`plgpu.kernel`
  wrapped), then lowered and compiled one by one."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  q, k, v, d_out = _inputs(shape, jnp.bfloat16)
  attention = lambda q, k, v: jax_flash.flash_attention(q, k, v,
                                                        is_causal=True)
  launches, kernel = [], plgpu.kernel

  def recorded(body, **kernel_args):
    def call(*inputs):
      launches.append((body, kernel_args, [
          jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]))
      return kernel(body, **kernel_args)(*inputs)
    return call

  plgpu.kernel = recorded
  try:
    jax.jit(_with_vjp(attention)).trace(q, k, v, d_out)
  finally:
    plgpu.kernel = kernel
  stages = []
  for body, kernel_args, avals in launches:
    alone = lambda *args, body=body, kw=kernel_args: kernel(body, **kw)(*args)
    start = time.perf_counter()
    lowered = jax.jit(alone).trace(*avals).lower()
    lower_s, start = time.perf_counter() - start, time.perf_counter()
    lowered.compile()
    stages.append((kernel_args.get("kernel_name", "kernel"), lower_s,
                   time.perf_counter() - start))
  return stages


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hang-after", type=float, default=90.0)
  parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
  parser.add_argument("--shapes", type=int, default=len(SHAPES),
                      help="probe the first N shapes only")
  parser.add_argument("--split", nargs="+", metavar="IMPL",
                      help="instead: the stages of a causal fwd+VJP's first "
                      "call (`split`) for these implementations in turn "
                      "(mosaic, triton, cudnn), the first as a new process "
                      "meets it, at SPLIT_SHAPE")
  parser.add_argument("--kernels", action="store_true",
                      help="instead: each Mosaic kernel of the call that "
                      "--split times, lowered and compiled alone")
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}", flush=True)
  if args.kernels:
    for name, lower_s, compile_s in kernel_stages(SPLIT_SHAPE):
      print(f"{SPLIT_SHAPE} {name}: lower {lower_s:.2f} s  compile "
            f"{compile_s:.2f} s", flush=True)
    return 0
  if args.split:
    for impl in args.split:
      times = split(SPLIT_SHAPE, implementation=impl)
      print(f"{SPLIT_SHAPE} causal fwd+vjp {impl}: " + "  ".join(
          f"{k} {v:.2f} s" for k, v in times.items()), flush=True)
    return 0
  for shape in SHAPES[:args.shapes]:
    for dtype in args.dtypes:
      for is_causal in (False, True):
        label = f"{shape} {dtype} causal={is_causal}"
        print(f"{label} ...", end=" ", flush=True)
        try:
          times = probe(shape, jnp.dtype(dtype), is_causal=is_causal,
                        hang_after=args.hang_after)
        except Exception as e:  # recorded, the probe goes on
          print(f"error: {type(e).__name__}: {str(e)[:200]}", flush=True)
          continue
        print("  ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
