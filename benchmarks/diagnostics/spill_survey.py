"""Which Mosaic kernels spill registers, for every row of `benchmarks.masks`.

    python3 -m benchmarks.diagnostics.spill_survey --seq 4096 \
        --head-dims 64 128 256 --out spills.json      # on an sm90 GPU

The capped backward's dK/dV step gained 8-22% fwd+bwd when P ∘ slope was
taken before dPᵀ's wait (16 float32 registers a thread fewer live there,
`BackwardStatic.cap_slope_ahead`): where a consumer spills, its registers, not its
arithmetic, can be the cost. ptxas says how much each kernel spills
(`MOSAIC_GPU_DUMP_PTXAS=1`); this compiles each row's forward and
gradients (`benchmarks.masks.build`, 16 heads, on the Mosaic kernels) in
a process of its own with that dump on, several processes at once
(compiling is CPU work; nothing is timed), and tabulates each kernel's
registers and spill bytes. Rows whose kernels spill are where a
register-level change (as the slope ahead) can pay; `sass_spills --loops`
on a SASS dump of one row then says whether the spills sit in a loop.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys

# ptxas's report of a kernel: its name, then its spills and registers.
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                     r"(\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
DEFAULT_ROWS = (
    "full", "causal", "sliding window 1k (causal)",
    "16 documents (segment ids)", "causal as mask_fn",
    "causal + softcap 30", "causal + alibi", "causal + dropout 0.1",
    "causal + sinks", "dense bias + dbias")


def parse_ptxas(text: str) -> list[dict]:
  """[{kernel, registers, stack, spill_stores, spill_loads}] in the order
  ptxas compiled them, from its `info` lines."""
  kernels, current = [], None
  for line in text.splitlines():
    if match := _ENTRY.search(line):
      current = dict(kernel=match.group(1))
      kernels.append(current)
    elif current is not None and (match := _SPILLS.search(line)):
      current.update(stack=int(match.group(1)),
                     spill_stores=int(match.group(2)),
                     spill_loads=int(match.group(3)))
    elif current is not None and (match := _REGISTERS.search(line)):
      current["registers"] = int(match.group(1))
  return [k for k in kernels if "spill_stores" in k]


def compile_row(row: str, seq: int, head_dim: int, mode: str) -> None:
  """Compiles one row's call (in this process, whose ptxas output the
  parent reads)."""
  from benchmarks import masks  # noqa: PLC0415
  from pallas_kernels import compat  # noqa: PLC0415
  compat.filter_known_warnings()
  fn, inputs = masks.build(mode, (1, seq, 16, head_dim),
                           masks.variants(seq, 16)[row], interpret=False,
                           implementation="mosaic")
  fn.lower(*inputs).compile()


def survey_one(row: str, seq: int, head_dim: int, mode: str,
               timeout: int) -> dict:
  """One row in a child process with ptxas's report on: its kernels'
  records, or the error that stopped it."""
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
  command = [sys.executable, "-m", "benchmarks.diagnostics.spill_survey",
             "--one", row, "--seq", str(seq), "--head-dims", str(head_dim),
             "--mode", mode]
  try:
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return dict(row=row, head_dim=head_dim, error=f"over {timeout} s")
  record = dict(row=row, head_dim=head_dim,
                kernels=parse_ptxas(done.stdout + done.stderr))
  if done.returncode:  # the exception's own line, not JAX's notes after it
    errors = [line for line in done.stderr.splitlines()
              if re.match(r"\w+(Error|Exception)\b", line)] or ["?"]
    record["error"] = errors[-1][:200]
  return record


def table(records: list[dict]) -> str:
  """Markdown: one line per kernel of each row and head dim."""
  lines = ["| row | d | kernel | registers | spill stores | spill loads |",
           "|---|---|---|---|---|---|"]
  for record in records:
    if "error" in record and not record.get("kernels"):
      lines.append(f"| {record['row']} | {record['head_dim']} | "
                   f"{record['error']} | | | |")
    for k in record.get("kernels", ()):
      if k["kernel"].startswith("mosaic"):  # XLA's own fusions aside
        lines.append(
            f"| {record['row']} | {record['head_dim']} | {k['kernel']} | "
            f"{k.get('registers', '')} | {k['spill_stores']} | "
            f"{k['spill_loads']} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--head-dims", type=int, nargs="+",
                      default=[64, 128, 256])
  parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS),
                      metavar="ROW", help="rows of benchmarks.masks")
  parser.add_argument("--mode", choices=("fwd", "fwd_bwd"),
                      default="fwd_bwd")
  parser.add_argument("--workers", type=int, default=8,
                      help="rows compiled at once, each its own process")
  parser.add_argument("--timeout", type=int, default=240,
                      help="seconds a row's process may take")
  parser.add_argument("--out", help="the records as JSON; a .md beside it")
  parser.add_argument("--one", metavar="ROW", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    compile_row(args.one, args.seq, args.head_dims[0], args.mode)
    return 0
  jobs = [(row, d) for d in args.head_dims for row in args.rows]
  with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
    records = list(pool.map(
        lambda job: survey_one(job[0], args.seq, job[1], args.mode,
                               args.timeout), jobs))
  text = table(records)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(seq=args.seq, mode=args.mode, records=records), f,
                indent=1)
    command = " ".join(argv or sys.argv[1:])
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
      f.write(f"# Register spills by kernel (ptxas), seq {args.seq}, "
              f"{args.mode}, 16 heads, bf16\n\nCommand: `python3 -m "
              f"benchmarks.diagnostics.spill_survey {command}`\n\n"
              f"{text}\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
