"""Timing, FLOP and memory helpers shared by every benchmark and `python -m jax_flash`.

Protocol (DESIGN.md section 5): FlashAttention's FLOP count, random inputs
(never zeros), warm-up calls, then the median of several timed samples.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
import threading
from typing import Any, Callable

import jax
from tqdm import tqdm

from jax_flash.timing import (  # noqa: F401  (re-exported: the benchmarks' helpers)
    GIB, SETTLE_MS, compiled_peak_gib, random_array, time_fn, time_samples)

MODES = ("fwd", "fwd_bwd")
# FlashAttention's convention: the backward does 5 matmuls to the forward's 2
# (2.5x); the recomputation of P inside the backward is not counted.
_MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def attention_flops(batch: int, seq_q: int, seq_k: int, heads: int,
                    head_dim: int, causal: bool, mode: str) -> float:
  """FLOPs of attention by FlashAttention's count.

  4·B·Tq·Tk·N·D for the forward's two matmuls (QK^T and PV), halved when
  causal (half of the score matrix is skipped), x2.5 for "bwd" and x3.5 for
  "fwd_bwd".
  """
  flops = 4.0 * batch * seq_q * seq_k * heads * head_dim * _MODE_FACTOR[mode]
  return flops / 2 if causal else flops


@dataclasses.dataclass(frozen=True)
class Cell:
  """One point of a benchmark grid.

  The attention inputs q, k, v (and the cotangent of the output) all have
  shape [batch, seq_len, num_heads, head_dim].
  """
  mode: str
  seq_len: int
  head_dim: int
  causal: bool
  batch: int
  num_heads: int
  dtype: str = "bfloat16"

  @classmethod
  def standard(cls, mode: str, seq_len: int, head_dim: int, causal: bool, *,
               tokens: int = 16384, hidden: int = 2048) -> "Cell":
    """FlashAttention's grid: batch·seq = tokens, heads·head_dim = hidden."""
    if tokens % seq_len or hidden % head_dim:
      raise ValueError(f"seq_len {seq_len} must divide tokens {tokens} and "
                       f"head_dim {head_dim} must divide hidden {hidden}")
    return cls(mode=mode, seq_len=seq_len, head_dim=head_dim, causal=causal,
               batch=tokens // seq_len, num_heads=hidden // head_dim)

  @property
  def shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seq_len, self.num_heads, self.head_dim)

  @property
  def flops(self) -> float:
    return attention_flops(self.batch, self.seq_len, self.seq_len,
                           self.num_heads, self.head_dim, self.causal,
                           self.mode)

  @property
  def key(self) -> tuple:
    """Identifies the cell in a results file (with the implementation name)."""
    return (self.mode, self.seq_len, self.head_dim, self.causal)

  def label(self) -> str:
    return cell_label(self.mode, self.causal, self.head_dim, self.seq_len)


def cell_label(mode: str, causal: bool, head_dim: int, seq_len: int) -> str:
  """"fwd causal d128 s4096": how tables and progress bars name a cell."""
  return f"{mode} {'causal' if causal else 'full'} d{head_dim} s{seq_len}"


@dataclasses.dataclass
class Record:
  """One measured (implementation, cell): a row of a results JSON."""
  impl: str
  mode: str
  seq_len: int
  head_dim: int
  causal: bool
  dtype: str
  batch: int
  num_heads: int
  ms: float
  tflops: float
  peak_gib: float | None

  @classmethod
  def measured(cls, impl: str, cell: Cell, ms: float,
               peak_gib: float | None) -> "Record":
    return cls(impl=impl, mode=cell.mode, seq_len=cell.seq_len,
               head_dim=cell.head_dim, causal=cell.causal, dtype=cell.dtype,
               batch=cell.batch, num_heads=cell.num_heads, ms=ms,
               tflops=cell.flops / (ms * 1e-3) / 1e12, peak_gib=peak_gib)


def skip_entry(impl: str, cell: Cell, reason: str) -> dict:
  """A row of a results file's "skipped" list."""
  return {"impl": impl, "mode": cell.mode, "seq_len": cell.seq_len,
          "head_dim": cell.head_dim, "causal": cell.causal, "reason": reason}


def entry_key(entry: dict) -> tuple:
  """(impl, mode, seq_len, head_dim, causal) of a record or skip entry."""
  return (entry["impl"], entry["mode"], entry["seq_len"], entry["head_dim"],
          entry["causal"])


# ---------------------------------------------------------------- inputs


def attention_inputs(shape, dtype, seed: int = 0):
  """(q, k, v, d_out), random, each [batch, seq, heads, head_dim]."""
  keys = jax.random.split(jax.random.key(seed), 4)
  return tuple(random_array(k, shape, dtype) for k in keys)


# ---------------------------------------------------------------- timing


def round_order(items: list, round_index: int) -> list:
  """The order in which round `round_index` times `items` (a cell's
  implementations, a sweep's candidates): as given in even rounds,
  reversed in odd ones (A B C, C B A, ...), so that over the rounds each
  is timed early and late in its cell alike and none always follows the
  same neighbour (the clocks follow the power draw of the last few hundred
  milliseconds, see `SETTLE_MS`)."""
  return list(items) if round_index % 2 == 0 else list(items)[::-1]


# ---------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class Measurement:
  """Median milliseconds per call and the compiled peak memory in GiB."""
  ms: float
  peak_gib: float | None


# XLA's autotuner times candidate kernels on the GPU while it compiles: two
# such compilations at once would disturb each other's choice.
autotune_lock = threading.Lock()


def compile_benchmark(build: Callable[[], tuple[Callable, tuple]], *,
                      autotuned: bool = False):
  """(AOT-compiled executable, its inputs) of `build() -> (jitted_fn, args)`.

  Safe to call from several threads: compiling is most of a benchmark's time
  and parallelises, while timing must run alone (`measure`).
  `autotuned`: the computation has XLA ops that XLA autotunes (dots, cuDNN
  fusions), so it compiles under a lock, one at a time.
  """
  fn, args = build()
  lowered = fn.lower(*args)
  with autotune_lock if autotuned else contextlib.nullcontext():
    return lowered.compile(), args


def measure(compiled, args, *, warmup: int = 2, reps: int = 10
            ) -> Measurement:
  """Times an AOT-compiled executable and reads its memory analysis.

  (Timing the executable, not the jitted function, avoids compiling twice.)
  """
  return Measurement(time_fn(compiled, *args, warmup=warmup, reps=reps),
                     compiled_peak_gib(compiled))


def device_peak_gib() -> float | None:
  """Peak bytes the allocator has handed out in this process (GPU only)."""
  stats = jax.devices()[0].memory_stats()
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return stats["peak_bytes_in_use"] / GIB


# ---------------------------------------------------------------- output


def progress(iterable=None, **kwargs) -> tqdm:
  """A tqdm bar; in a log (stderr not a terminal) redrawn every 10 s only."""
  interactive = sys.stderr.isatty()
  return tqdm(iterable, dynamic_ncols=interactive,
              mininterval=0.1 if interactive else 10.0, **kwargs)


# ---------------------------------------------------------------- errors


def is_oom(error: BaseException) -> bool:
  """Device memory ran out (not a kernel's shared memory, also "exhausted")."""
  text = str(error).lower()
  if "shared memory" in text:
    return False
  return "resource_exhausted" in text or "out of memory" in text


def describe_error(error: BaseException, limit: int = 300) -> str:
  """One line for a results file: the type and the first line of the message."""
  first = next((line for line in str(error).splitlines() if line.strip()), "")
  return f"{type(error).__name__}: {first}"[:limit]


# ---------------------------------------------------------------- results


def command_line(module: str | None = None, argv=None) -> str:
  """The exact command line of this run, interpreter included.

  With `argv` (a script's `main(argv)` called in-process, as the tests do),
  the equivalent `python -m module argv...` instead of the host process's.
  """
  if argv is not None:
    return shlex.join([sys.executable, "-m", module, *argv])
  return shlex.join(getattr(sys, "orig_argv", None)
                    or [sys.executable, *sys.argv])


def device_header() -> dict[str, str]:
  """The device and JAX version (initialises the JAX backend)."""
  return {"device": jax.devices()[0].device_kind,
          "jax_version": jax.__version__}


def run_header(module: str | None = None, argv=None) -> dict[str, Any]:
  """The device, JAX version and exact command line, for a results file."""
  return {**device_header(), "command": command_line(module, argv)}


def suite_result(module: str, argv, args) -> dict[str, Any]:
  """An empty results file of a benchmark suite: the run header, its
  timing settings (`args.warmup`, `reps`, `rounds`, `seed`), no records."""
  return {**run_header(module, argv),
          "settings": {name: getattr(args, name)
                       for name in ("warmup", "reps", "rounds", "seed")},
          "records": [], "skipped": []}


def run_suite(run: Callable, args, result: dict, path: str,
              render_file: Callable) -> list[str]:
  """`run(args, result)`, then `result` written to `path` and rendered by
  `render_file(path)` (returning the paths written) even when the run is
  cut short, so that what was measured is kept."""
  try:
    run(args, result)
  finally:
    write_json(path, result)
    paths = render_file(path)
  return paths


def write_json(path: str, data: dict) -> None:
  """Writes atomically, so a run killed mid-write leaves the last good file."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1)
  os.replace(tmp, path)
