"""Timing and memory measurement, for `python -m jax_flash` and the benchmarks.

Protocol (DESIGN.md section 5): random inputs (never zeros), warm-up calls,
then the median of several timed samples, each long enough that host
dispatch does not dominate it.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

GIB = 1024 ** 3


def random_array(key, shape, dtype) -> jax.Array:
  """Standard normal values (timings on zeros flatter the hardware)."""
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


# How long each timing first runs its function back to back, untimed. The
# H200 runs every kernel here at its power cap (700 W), and the clocks
# follow the last few hundred milliseconds' draw: right after the dense
# matmul, every attention kernel read 2-12% slower than after an idle
# pause, its first sample 8-17% slower than its median
# (results/h200_order_probe.md). In a fixed order of implementations the
# one timed after the matmul always paid it.
SETTLE_MS = 250.0


def time_fn(fn: Callable, *args, warmup: int = 2, reps: int = 10,
            min_sample_ms: float = 20.0, max_inner: int = 512,
            settle_ms: float | None = None) -> float:
  """Median wall time of `fn(*args)` in milliseconds.

  `fn` should be jitted (or an AOT-compiled executable); the first warm-up
  call compiles it. Each sample launches `inner` calls back to back and
  waits for the last one, with `inner` chosen so that a sample lasts at least
  `min_sample_ms`: a single short kernel would otherwise be dominated by the
  host's dispatch and synchronisation latency. 20 ms: on the H200 a 2 ms
  sample (5-6 calls of a 0.35 ms forward) still read every implementation
  5-10% slower than a 50 ms one, and moved the ratios between them by up
  to 4% (results/h200_timing_probe.md). Before the samples, `fn` runs
  untimed for `settle_ms`, so that the GPU's clocks follow `fn`'s own power
  draw rather than whatever ran before it (None: `SETTLE_MS` on a GPU, 0
  elsewhere, where interpret-mode calls are slow and nothing is capped).
  """
  return statistics.median(time_samples(
      fn, *args, warmup=warmup, reps=reps, min_sample_ms=min_sample_ms,
      max_inner=max_inner, settle_ms=settle_ms))


def time_samples(fn: Callable, *args, warmup: int = 2, reps: int = 10,
                 min_sample_ms: float = 20.0, max_inner: int = 512,
                 settle_ms: float | None = None) -> list[float]:
  """`time_fn`'s samples in the order taken: milliseconds per call."""
  if settle_ms is None:
    settle_ms = SETTLE_MS if jax.default_backend() == "gpu" else 0.0
  for _ in range(max(1, warmup)):
    jax.block_until_ready(fn(*args))
  single = _sample_ms(fn, args, 1)
  inner = int(min(max_inner, max(1, math.ceil(min_sample_ms / max(single,
                                                                   1e-3)))))
  settled = 0.0
  while settled < settle_ms:
    settled += _sample_ms(fn, args, inner)
  return [_sample_ms(fn, args, inner) / inner for _ in range(max(1, reps))]


def _sample_ms(fn, args, inner: int) -> float:
  start = time.perf_counter()
  for _ in range(inner):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) * 1e3


def compiled_peak_gib(compiled) -> float | None:
  """Peak device memory of an AOT-compiled executable, from XLA's analysis.

  Arguments + outputs + temporaries, less buffers aliased between arguments
  and outputs; None where the backend gives no analysis. Memory inside a
  kernel (shared memory, registers) is not device memory and not counted.
  """
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  return total / GIB
