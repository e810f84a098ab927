"""Where a program's GPU time goes, kernel by kernel (JAX's profiler).

    python -m benchmarks.diagnostics.kernel_profile --generate auto xla
    python -m benchmarks.diagnostics.kernel_profile --generate triton --top 30

`--generate IMPL...`: the generation example (`examples/generate.py`, its
`gpu` preset, untrained weights): per implementation, the prompts' prefill
and `--chunks` compiled chunks of decoding steps, compiled and warmed up,
then timed and run again under `jax.profiler.trace`; prints, per
implementation, the GPU kernels by total time (count, total and mean µs)
and the sum over all kernels, so a slow loop is split into its attention,
cache writes, matmuls and launch gaps (the wall time beyond the kernels'
sum). `kernel_times` profiles any callable.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys
import tempfile
import time


def kernel_times(fn, *args, **kwargs):
  """Runs `fn(*args, **kwargs)` under the profiler.

  Returns:
    (result, wall seconds, {kernel name: [count, total µs]}) over the GPU
    streams of the trace (host events are left out).
  """
  import jax  # noqa: PLC0415  (the profiler only where it runs)
  with tempfile.TemporaryDirectory() as log_dir:
    start = time.perf_counter()
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      result = fn(*args, **kwargs)
      jax.block_until_ready(result)
    wall = time.perf_counter() - start
    traces = sorted(pathlib.Path(log_dir).rglob("perfetto_trace.json.gz"))
    if not traces:
      raise RuntimeError(f"the profiler wrote no perfetto trace in {log_dir}")
    with gzip.open(traces[-1]) as f:
      events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  gpu_pids = {e["pid"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"
              and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
  totals = collections.defaultdict(lambda: [0, 0.0])
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu_pids:
      totals[e["name"]][0] += 1
      totals[e["name"]][1] += float(e.get("dur", 0.0))
  return result, wall, dict(totals)


def print_table(title: str, wall: float, totals, top: int) -> None:
  """The kernels by total time, longest first."""
  rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
  total = sum(t for _, t in totals.values())
  print(f"\n== {title}: wall {wall * 1e3:.1f} ms, kernels {total / 1e3:.1f} ms "
        f"in {sum(c for c, _ in totals.values())} launches")
  for name, (count, us) in rows[:top]:
    print(f"{us / 1e3:9.2f} ms {count:7d}x {us / count:8.1f} us  {name[:90]}")


def _generate(implementations, top: int, preset: str, chunks: int) -> None:
  """Profiles the generation example's prefill and `chunks` compiled chunks
  of decoding steps per implementation (compiled and warmed up first)."""
  examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
  sys.path.insert(0, str(examples))
  import generate  # noqa: PLC0415  (the example, not a package)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import train_lm  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  preset = generate.PRESETS[preset]
  cfg = train_lm.PRESETS[preset.model]
  corpus = train_lm.CharCorpus()
  prompts, lengths = generate.make_prompts(corpus, preset, seed=0)
  chunk = generate.chunk_length(preset.new_tokens - 1)
  for impl in implementations:
    model = train_lm.LanguageModel(cfg, len(corpus.vocab), None,
                                   nnx.Rngs(0))
    prefill, decode_chunk, params, empty_cache = generate.compile_loop(
        model, cfg, preset, prompts, lengths,
        implementation=None if impl == "auto" else impl, seed=0)

    def decode(chunks):
      cache = jax.tree.map(jnp.copy, empty_cache)  # each call donates it
      token, cache = prefill(params, cache, prompts, lengths)
      starts = lengths
      for _ in range(chunks):
        tokens, cache = decode_chunk(params, cache, token, starts)
        token, starts = tokens[:, -1], starts + chunk
      return token, cache

    jax.block_until_ready(decode(chunks))
    start = time.perf_counter()
    jax.block_until_ready(decode(chunks))
    with_steps = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(decode(0))
    per_step = (with_steps - (time.perf_counter() - start)) / (chunks * chunk)
    _, wall, totals = kernel_times(decode, chunks)
    print_table(f"generate --implementation {impl} (prefill + {chunks} x "
                f"{chunk} steps;"
                f" untraced {per_step * 1e3:.3f} ms a step)", wall, totals,
                top)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--generate", nargs="+", metavar="IMPL",
                      default=["auto", "xla"],
                      help="implementations: auto, mosaic, triton, xla")
  parser.add_argument("--preset", default="gpu",
                      help="the generation example's preset")
  parser.add_argument("--chunks", type=int, default=2,
                      help="compiled chunks of decoding steps after the "
                      "prefill (generate.chunk_length steps each)")
  parser.add_argument("--top", type=int, default=20)
  args = parser.parse_args(argv)
  _generate(args.generate, args.top, args.preset, args.chunks)


if __name__ == "__main__":
  main()
