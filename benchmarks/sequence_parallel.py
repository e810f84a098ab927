"""Sequence-parallel attention over the GPUs of one host: correctness, scaling
and the longest sequence (issue 7's runs).

    python -m benchmarks.sequence_parallel             # every device there is
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python -m benchmarks.sequence_parallel --smoke   # CPU, tiny sizes

bf16, batch 1, 16 heads, head_dim 128, causal, forward+backward, through
`jax_flash.sequence_parallel_attention` on a mesh of the first P devices
(P = 1, 2, 4, ... up to all), inputs sharded on the sequence:

  correctness  both strategies, causal and not, at 2k tokens per device on
               all devices: output and dq, dk, dv against one-device
               `flash_attention`, max |error| relative to max |reference|.
  weak         `--seq-per-device` tokens per device (32k). Attention's work
               grows as seq², so efficiency is compared in FLOP/s: TFLOP/s
               per device at P over TFLOP/s at P = 1. Strategies: ring with
               load balance, ring without, all-gather.
  strong       `--total-seq` tokens (256k) over P devices; speed-up over P=1
               (where one device holds it).
  overlap      ring with load balance on all devices at the weak size,
               against the same program with its transfers removed
               (`lax.ppermute` traced as the identity: the same kernels on
               the same shapes, wrong numbers): ring time / kernels' time
               near 1 means the transfers hide behind the kernels.
  longest      causal fwd+bwd, ring with load balance, on all devices: the
               sequence doubles from `--longest-start` until a run fails
               or the next one (4x the last, attention being seq²) would
               not end within `--longest-budget` seconds.

Results: `benchmarks/results/<kind>x<N>_sequence_parallel.{json,md,png}`.
On several GPUs run with NCCL_NVLS_ENABLE=0 and
XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true (overlap of the
ring's transfers with the kernels; see `jax_flash/sharding.py`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from benchmarks import common, render
from pallas_kernels import compat

STRATEGIES = {"ring+balance": dict(strategy="ring", load_balance=True),
              "ring": dict(strategy="ring", load_balance=False),
              "all_gather": dict(strategy="all_gather", load_balance=False)}
STANDARD = dict(heads=16, head_dim=128, seq_per_device=32768,
                total_seq=262144, longest_start=262144, check_per_device=2048,
                reps=5, longest_budget=240.0)
SMOKE = dict(heads=2, head_dim=32, seq_per_device=64, total_seq=256,
             longest_start=256, check_per_device=32, reps=1,
             longest_budget=60.0)


def device_counts(available: int) -> list[int]:
  """1, 2, 4, ... up to `available` (which is always included)."""
  counts = [1]
  while counts[-1] * 2 <= available:
    counts.append(counts[-1] * 2)
  return counts if counts[-1] == available else counts + [available]


def _mesh(num_devices: int):
  return jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ("seq",))


def _inputs(seq: int, cfg: dict, mesh, seed: int = 0):
  """(q, k, v, d_out) bf16 [1, seq, heads, head_dim], sharded on seq."""
  sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, "seq"))
  shape = (1, seq, cfg["heads"], cfg["head_dim"])
  return tuple(jax.device_put(x, sharding) for x in
               common.attention_inputs(shape, jnp.bfloat16, seed))


def _fwd_bwd(attention):
  """jit of (q, k, v, d_out) -> (out, dq, dk, dv)."""
  def run(q, k, v, d_out):
    out, vjp = jax.vjp(attention, q, k, v)
    return (out, *vjp(d_out))
  return jax.jit(run)


def _parallel(mesh, causal: bool, **strategy):
  return lambda q, k, v: jax_flash.sequence_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=causal, **strategy)


def correctness(cfg: dict, num_devices: int) -> list[dict]:
  mesh = _mesh(num_devices)
  q, k, v, d_out = _inputs(cfg["check_per_device"] * num_devices, cfg, mesh)
  rows = []
  for causal in (False, True):
    single = _fwd_bwd(lambda q, k, v: jax_flash.flash_attention(
        q, k, v, is_causal=causal))
    want = [np.asarray(x, np.float32) for x in single(
        *(jax.device_put(x, jax.devices()[0]) for x in (q, k, v, d_out)))]
    for name, strategy in STRATEGIES.items():
      got = _fwd_bwd(_parallel(mesh, causal, **strategy))(q, k, v, d_out)
      errors = [float(np.max(np.abs(np.asarray(g, np.float32) - w))
                      / max(float(np.max(np.abs(w))), 1e-6))
                for g, w in zip(got, want)]
      rows.append(dict(experiment="correctness", strategy=name,
                       causal=causal, devices=num_devices,
                       relative_errors=dict(zip(("out", "dq", "dk", "dv"),
                                                errors)),
                       ok=max(errors) <= 2e-2))
  return rows


def _time(seq: int, num_devices: int, cfg: dict, strategy: dict) -> float:
  mesh = _mesh(num_devices)
  fn = _fwd_bwd(_parallel(mesh, True, **strategy))
  return common.time_fn(fn, *_inputs(seq, cfg, mesh), warmup=1,
                        reps=cfg["reps"])


def _untransferred(x, axis_name, perm):
  """`lax.ppermute` without the transfer: each device keeps what it has."""
  del axis_name, perm
  return x


def overlap(cfg: dict, num_devices: int) -> dict:
  """The ring against its kernels alone, at the weak-scaling size."""
  seq = cfg["seq_per_device"] * num_devices
  mesh = _mesh(num_devices)
  inputs = _inputs(seq, cfg, mesh)
  times = {}
  for name, transfers in (("ring", True), ("kernels", False)):
    fn = _fwd_bwd(_parallel(mesh, True, **STRATEGIES["ring+balance"]))
    # Traced here, with every ppermute an identity for "kernels": the same
    # kernels, causal skips and merges, and no collective at all.
    with mock.patch.object(jax.lax, "ppermute",
                           jax.lax.ppermute if transfers else _untransferred):
      compiled = fn.lower(*inputs).compile()
    permutes = compiled.as_text().count("collective-permute")
    if bool(permutes) != transfers:
      raise AssertionError(f"{name}: {permutes} collective-permutes")
    times[name] = common.time_fn(compiled, *inputs, warmup=1,
                                 reps=cfg["reps"])
  return dict(experiment="overlap", strategy="ring+balance",
              devices=num_devices, seq_len=seq, ms=times["ring"],
              kernels_ms=times["kernels"],
              ring_over_kernels=times["ring"] / times["kernels"])


def _tflops(seq: int, ms: float, cfg: dict) -> float:
  return common.attention_flops(1, seq, seq, cfg["heads"], cfg["head_dim"],
                                True, "fwd_bwd") / (ms * 1e-3) / 1e12


def scaling(cfg: dict, counts: list[int]) -> list[dict]:
  rows = []
  for name, strategy in STRATEGIES.items():
    base = None
    for p in counts:
      seq = cfg["seq_per_device"] * p
      ms = _time(seq, p, cfg, strategy)
      per_device = _tflops(seq, ms, cfg) / p
      base = base or per_device
      rows.append(dict(experiment="weak", strategy=name, devices=p,
                       seq_len=seq, ms=ms, tflops_per_device=per_device,
                       efficiency=per_device / base))
  base = None
  for p in counts:
    ms = _time(cfg["total_seq"], p, cfg, STRATEGIES["ring+balance"])
    base = base or ms
    rows.append(dict(experiment="strong", strategy="ring+balance", devices=p,
                     seq_len=cfg["total_seq"], ms=ms, speedup=base / ms))
  return rows


def longest(cfg: dict, num_devices: int, limit: int = 8) -> dict:
  """The longest causal fwd+bwd that runs on all devices (doubling), within
  `cfg["longest_budget"]` seconds in all."""
  seq, best, best_ms, error = cfg["longest_start"], None, None, None
  deadline = time.monotonic() + cfg["longest_budget"]
  for _ in range(limit):
    # The next run does 4x the last one's work; compilation is extra.
    if best_ms is not None and time.monotonic() + 4e-3 * best_ms > deadline:
      error = f"time budget: {seq} tokens would take ~{4e-3 * best_ms:.0f} s"
      break
    try:
      mesh = _mesh(num_devices)
      fn = _fwd_bwd(_parallel(mesh, True, **STRATEGIES["ring+balance"]))
      inputs = _inputs(seq, cfg, mesh)
      compiled = fn.lower(*inputs).compile()
      start = time.perf_counter()
      jax.block_until_ready(compiled(*inputs))
      best, best_ms = seq, (time.perf_counter() - start) * 1e3
      del compiled, inputs
    except Exception as e:  # out of memory, most likely: the answer
      error = common.describe_error(e)
      break
    seq *= 2
  return dict(experiment="longest", strategy="ring+balance",
              devices=num_devices, seq_len=best, ms=best_ms,
              stopped_by=error)


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true")
  experiments = ["correctness", "scaling", "overlap", "longest"]
  parser.add_argument("--experiments", nargs="+", default=experiments,
                      choices=experiments)
  parser.add_argument("--longest-budget", type=float,
                      help="seconds for the longest-sequence search")
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  cfg = dict(SMOKE if args.smoke else STANDARD)
  if args.longest_budget is not None:
    cfg["longest_budget"] = args.longest_budget
  n = len(jax.devices())
  kind = jax.devices()[0].device_kind.split()[-1].lower()
  out = args.out or f"benchmarks/results/{kind}x{n}_sequence_parallel.json"
  rows = []
  result = {**common.run_header("benchmarks.sequence_parallel", argv),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "devices": n, "config": cfg, "records": rows}
  runs = {"correctness": lambda: correctness(cfg, n),
          "scaling": lambda: scaling(cfg, device_counts(n)),
          "overlap": lambda: [overlap(cfg, n)] if n > 1 else [],
          "longest": lambda: [longest(cfg, n, limit=2 if args.smoke else 8)]}
  for name in experiments:
    if name in args.experiments:
      rows += runs[name]()
      common.write_json(out, result)  # a run cut short keeps what it has
  table = [[r["experiment"], r["strategy"], r.get("causal", True),
            r["devices"], r.get("seq_len", "—"),
            f"{r['ms']:.2f}" if r.get("ms") is not None else "—",
            f"{r['efficiency']:.2f}" if "efficiency" in r else
            f"{r['speedup']:.2f}x" if "speedup" in r else
            f"ring / kernels alone {r['ring_over_kernels']:.3f}"
            if "ring_over_kernels" in r else
            ("ok" if r["ok"] else "FAIL") if "ok" in r else
            (r["stopped_by"] or "")[:60]] for r in rows]
  print(render.write_results(out, result, [
      "experiment", "strategy", "causal", "devices", "seq", "ms",
      "efficiency / speed-up / check"], table))
  panels = {}
  for r in rows:
    if r["experiment"] in ("weak", "strong"):
      value = r["efficiency"] if r["experiment"] == "weak" else r["speedup"]
      title = ("weak scaling: efficiency" if r["experiment"] == "weak" else
               "strong scaling: speed-up")
      panels.setdefault(title, {}).setdefault(r["strategy"], []).append(
          (r["devices"], value))
  if panels:
    render.plot_panels(os.path.splitext(out)[0] + ".png", panels,
                       ylabel="ratio", xlabel="devices", ncols=2)
  return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
