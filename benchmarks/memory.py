"""Peak device memory of causal attention forward+backward against seq_len.

    python -m benchmarks.memory   # -> benchmarks/results/h200_memory.{json,md,png}

Batch 1, 16 heads, head_dim 128, bf16, seq_len 1k..256k, the loss-grad
callable of `peers` (inputs, cotangent, outputs and every temporary). Two
numbers per point:

- compiled: XLA's memory analysis of the compiled executable (arguments +
  outputs + temporaries); no device memory is needed to get it.
- measured: the allocator's `peak_bytes_in_use` after running it once, or
  "oom". The allocator's peak cannot be reset, so each implementation runs in
  its own process, sequence lengths in increasing order: the peak after a run
  is then that run's peak.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading

import jax
from tqdm import tqdm

from benchmarks import common, peers, render
from pallas_kernels import compat

IMPLS = ("jax_flash_triton", "xla", "cudnn")
SEQS = [1024 * 2 ** i for i in range(9)]  # 1k .. 256k
STANDARD = dict(batch=1, num_heads=16, head_dim=128, seqs=SEQS)
SMOKE = dict(batch=1, num_heads=2, head_dim=32, seqs=[64, 128])
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RESULT = "RESULT "  # prefix of the worker's stdout lines meant for the parent


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impls", nargs="+", choices=list(peers.PEERS),
                      default=list(IMPLS), metavar="IMPL",
                      help=f"default: {' '.join(IMPLS)}")
  parser.add_argument("--seqs", nargs="+", type=int)
  parser.add_argument("--out", default="benchmarks/results/h200_memory.json")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes (interpret mode on a CPU), for tests")
  parser.add_argument("--worker-timeout", type=float, default=150.0,
                      help="seconds one implementation's process may take")
  parser.add_argument("--worker", choices=list(peers.PEERS),
                      help=argparse.SUPPRESS)  # internal: measure one impl
  args = parser.parse_args(argv)
  preset = SMOKE if args.smoke else STANDARD
  args.seqs = sorted(args.seqs or preset["seqs"])
  args.shape = {k: preset[k] for k in ("batch", "num_heads", "head_dim")}
  return args


def _cell(seq_len: int, shape: dict) -> common.Cell:
  return common.Cell(mode="fwd_bwd", seq_len=seq_len, causal=True, **shape)


def worker(impl: str, seqs: list[int], shape: dict) -> None:
  """Measures `impl` at each seq_len; prints one RESULT line per point."""
  print(_RESULT + json.dumps(common.device_header()), flush=True)
  interpret = not compat.has_gpu()
  ran_out = False
  for seq in seqs:
    entry = {"impl": impl, "seq_len": seq, "compiled_gib": None,
             "measured_gib": None}
    bench = compiled = None
    try:
      bench = peers.PEERS[impl](_cell(seq, shape), interpret=interpret)
      compiled = bench.fn.lower(*bench.args).compile()
      entry["compiled_gib"] = common.compiled_peak_gib(compiled)
      if ran_out:  # a longer sequence needs more: do not try
        entry["status"] = "oom (not run: a shorter one ran out)"
      else:
        jax.block_until_ready(compiled(*bench.args))
        entry["measured_gib"] = common.device_peak_gib()
        entry["status"] = "ok"
    except Exception as e:  # record and go on to the next length
      oom = common.is_oom(e)
      ran_out = ran_out or oom
      entry["status"] = "oom" if oom else common.describe_error(e)
    del bench, compiled
    gc.collect()
    print(_RESULT + json.dumps(entry), flush=True)


def run_worker(impl: str, args, bar: tqdm) -> tuple[dict, list[dict]]:
  """Runs `worker` in a fresh process; returns (device header, entries)."""
  command = [sys.executable, "-m", "benchmarks.memory", "--worker", impl,
             "--seqs", *map(str, args.seqs)] + (["--smoke"] if args.smoke
                                                else [])
  # Let the allocator use the whole card, so that "oom" means the device's
  # memory ran out and not JAX's default 75% share of it.
  env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ}
  header, entries = {}, []
  with tempfile.TemporaryFile("w+") as stderr:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr,
                            text=True, env=env, cwd=_ROOT)
    timer = threading.Timer(args.worker_timeout, proc.kill)
    timer.start()
    try:
      for line in proc.stdout:
        if not line.startswith(_RESULT):
          continue
        data = json.loads(line[len(_RESULT):])
        if "impl" in data:
          entries.append(data)
          bar.update()
        else:
          header = data
      proc.wait()
    finally:
      timer.cancel()
    if proc.returncode != 0:
      stderr.seek(0)
      tail = stderr.read().strip().splitlines()[-3:]
      reason = (f"worker exited with {proc.returncode}: " + " / ".join(tail)
                )[:300]
      done = {e["seq_len"] for e in entries}
      for seq in args.seqs:
        if seq not in done:
          entries.append({"impl": impl, "seq_len": seq, "compiled_gib": None,
                          "measured_gib": None, "status": reason})
          bar.update()
  return header, entries


def _gib(value) -> str:
  return "—" if value is None else f"{value:.3g}"


def memory_table(result: dict) -> tuple[list[str], list[list]]:
  """Rows: seq_len; per impl the compiled and the measured peak in GiB."""
  by_key = {(e["impl"], e["seq_len"]): e for e in result["records"]}
  impls = [i for i in peers.PEERS if any(e["impl"] == i
                                         for e in result["records"])]
  headers = ["seq_len"] + [f"{i} {kind}" for i in impls
                           for kind in ("compiled", "measured")]
  rows = []
  for seq in sorted({e["seq_len"] for e in result["records"]}):
    row = [seq]
    for impl in impls:
      entry = by_key.get((impl, seq), {})
      row.append(_gib(entry.get("compiled_gib")))
      status = entry.get("status", "—")
      row.append(_gib(entry["measured_gib"]) if status == "ok" else status)
    rows.append(row)
  return headers, rows


def write_report(result: dict, path: str) -> tuple[str, str]:
  """`<stem>.md` and `<stem>.png` next to `path`, like `render.render`."""
  stem = os.path.splitext(path)[0]
  s = result["shape"]
  title = (f"causal fwd+bwd, batch {s['batch']}, {s['num_heads']} heads, "
           f"head_dim {s['head_dim']}, bf16")
  lines = render.header_lines(result, "Peak device memory (GiB)")
  lines += [f"{title}. compiled: XLA's memory analysis (arguments + outputs + "
            "temporaries); measured: the allocator's peak after one run.", "",
            render.markdown_table(*memory_table(result)), ""]
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines))
  series = {}
  for e in result["records"]:
    for kind in ("compiled", "measured"):
      value = e[f"{kind}_gib"]
      points = series.setdefault(f"{e['impl']} ({kind})", [])
      if value is not None and (kind == "compiled" or e["status"] == "ok"):
        points.append((e["seq_len"], value))
  render.plot_panels(stem + ".png", {title: series}, ylabel="GiB", ncols=1,
                     logy=True)
  return stem + ".md", stem + ".png"


def main(argv=None) -> int:
  compat.filter_known_warnings()
  args = parse_args(argv)
  if args.worker:
    worker(args.worker, args.seqs, args.shape)
    return 0
  # The parent never touches the device: each worker gets all its memory.
  result = {"command": common.command_line("benchmarks.memory", argv),
            "shape": args.shape,
            "mode": "fwd_bwd", "causal": True, "dtype": "bfloat16",
            "records": []}
  with common.progress(total=len(args.impls) * len(args.seqs), desc="memory",
                       unit="run") as bar:
    for impl in args.impls:
      bar.set_postfix_str(impl, refresh=False)
      header, entries = run_worker(impl, args, bar)
      result.update(header)
      result["records"] += entries
      common.write_json(args.out, result)
  result.setdefault("device", "unknown")
  result.setdefault("jax_version", "unknown")
  common.write_json(args.out, result)
  print(render.markdown_table(*memory_table(result)))
  print("wrote", args.out, *write_report(result, args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
