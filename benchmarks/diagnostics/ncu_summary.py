"""Headline numbers of Nsight Compute exports, as markdown.

    python -m benchmarks.diagnostics.ncu_summary metrics ncu_fwd_bwd_16384_128_raw.csv
    python -m benchmarks.diagnostics.ncu_summary stalls ncu_fwd_bwd_16384_128_sass.csv
    python -m benchmarks.diagnostics.ncu_summary phases ncu_fwd_bwd_4096_64_sass.csv
    python -m benchmarks.diagnostics.ncu_summary opcodes ncu_fwd_bwd_4096_64_sass.csv

`metrics`: one row per profiled kernel of `ncu --page raw --csv` exports
(what `h200_check.sh ncu` brings back): duration, tensor-pipe and shared-
memory utilisation, L2 traffic, registers, local-memory (spill) traffic and
the average warp stall cycles per issued instruction by reason.

`stalls`: for each kernel of a `--page source --csv --print-source sass`
export (`NCU_SOURCE=1`), the share of warp-stall samples by reason and the
instructions that collect the most samples, with their top reasons. The
samples cover every warp, the producer's waits included.

`opcodes`: per kernel of the same export, the warp instructions executed
by SASS opcode (predicates and modifiers dropped), the most frequent
first: which pipe's work a kernel issues beyond another's.

`phases`: each kernel's SASS cut after every wgmma wait
(`WARPGROUP.DEPBAR`), in program order: per piece its samples (and the
wait's own), and what it issues (HGMMA, MUFU, TMA, barrier waits), so that
a consumer loop reads as "issue S, wait, softmax, issue dV, ..." with the
time of each part. Code that is not a consumer's (the producer's loop,
the prologue) falls in the pieces after the consumers' last wait.
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys

# column -> ncu metric of the raw page
METRICS = {
    "ms": "gpu__time_duration.sum",
    "tensor %":
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "smem read %": "l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed",
    "L2 %": "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
    "L2 hit %": "lts__t_sector_hit_rate.pct",
    "DRAM read": "dram__bytes_read.sum",  # with its unit
    "regs": "launch__registers_per_thread",
    "local sectors": "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum",
}
STALLS = ("long_scoreboard", "barrier", "short_scoreboard", "wait",
          "mio_throttle", "gmma", "dispatch_stall", "math_pipe_throttle")


def _stall_metric(reason: str) -> str:
  return (f"smsp__average_warps_issue_stalled_{reason}_per_issue_active"
          ".ratio")


def _to_ms(value: str, unit: str) -> str:
  scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "nsecond": 1e-6,
           "ms": 1.0, "msecond": 1.0}.get(unit, 1.0)
  return f"{float(value.replace(',', '')) * scale:.3f}"


def metrics_table(path: str) -> str:
  rows = list(csv.reader(open(path)))
  header, units, data = rows[0], rows[1], rows[2:]
  index = {name: i for i, name in enumerate(header)}
  columns = [(label, metric) for label, metric in METRICS.items()
             if metric in index]
  columns += [(f"stall {reason}", _stall_metric(reason)) for reason in STALLS
              if _stall_metric(reason) in index]
  lines = ["| kernel | " + " | ".join(label for label, _ in columns) + " |",
           "|---" * (len(columns) + 1) + "|"]
  for row in data:
    cells = []
    for label, metric in columns:
      value = row[index[metric]]
      try:
        unit = units[index[metric]]
        cells.append(_to_ms(value, unit) if label == "ms"
                     else f"{float(value.replace(',', '')):.3g}"
                     + (f" {unit}" if label == "DRAM read" else ""))
      except ValueError:
        cells.append(value)
    name = row[index["Kernel Name"]][:60]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


# XLA's own fusions, which a profiled call runs dozens of beside the
# attention kernels: left out of the SASS reports unless named.
_XLA_FUSION = re.compile(r"^(input_|loop_|sort_|wrapped_)")


def _kernels(path: str, kernel: str | None = None):
  """[(name, header, rows)] of a source-page export: the kernels whose
  name contains `kernel`, or (None) every one but XLA's fusions."""
  lines = open(path).read().splitlines()
  starts = [i for i, line in enumerate(lines)
            if line.startswith('"Kernel Name"')]
  for n, start in enumerate(starts):
    stop = starts[n + 1] if n + 1 < len(starts) else len(lines)
    name = next(csv.reader([lines[start]]))[1]
    if (kernel not in name) if kernel else _XLA_FUSION.match(name):
      continue
    table = list(csv.reader(lines[start + 1:stop]))
    yield name, table[0], table[1:]


def _columns(header):
  """(column index by name, row -> its warp-stall samples) of a kernel's
  source-page table."""
  index = {h: i for i, h in enumerate(header)}
  column = index["Warp Stall Sampling (All Samples)"]
  return index, lambda row: int(row[column] or 0)


def stalls_report(path: str, top: int = 12, kernel: str | None = None) -> str:
  out = []
  for name, header, rows in _kernels(path, kernel):
    index, samples = _columns(header)
    reasons = [h for h in header
               if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(samples(row) for row in rows) or 1
    by_reason = collections.Counter()
    for row in rows:
      for reason in reasons:
        by_reason[reason] += int(row[index[reason]] or 0)
    out += [f"### {name}", "",
            f"{len(rows)} SASS instructions, {total} samples. By reason: "
            + ", ".join(f"{r[6:]} {100 * n / total:.1f}%"
                        for r, n in by_reason.most_common(6)), "",
            "| share | instruction | top reasons |", "|---|---|---|"]
    for row in sorted(rows, key=samples, reverse=True)[:top]:
      worst = sorted(((int(row[index[r]] or 0), r[6:]) for r in reasons),
                     reverse=True)[:2]
      source = row[index["Source"]].strip().replace("|", "/")[:60]
      out.append(f"| {100 * samples(row) / total:.1f}% | `{source}` | "
                 + ", ".join(f"{r} {n}" for n, r in worst) + " |")
    out.append("")
  return "\n".join(out)


# SASS opcodes `phases` counts in each piece.
_COUNTED = {"HGMMA": "HGMMA", "MUFU": "MUFU", "UTMALDG": "TMA load",
            "SYNCS.PHASECHK": "mbarrier wait", "BAR.SYNC": "bar.sync"}
# A SASS instruction's predicate ("@P1 ", "@!UP2 ", "@PT ").
_PREDICATE = re.compile(r"^@!?U?P(?:T|\d)\s+")


def phases_report(path: str, kernel: str | None = None) -> str:
  """Per kernel (those whose name contains `kernel`, if given), the SASS
  in pieces ending at each wgmma wait, with each piece's share of the
  samples."""
  out = []
  for name, header, rows in _kernels(path, kernel):
    index, samples = _columns(header)
    source = lambda row: row[index["Source"]].strip()
    total = sum(samples(row) for row in rows) or 1
    out += [f"### {name}", "", f"{total} samples; pieces end at a wgmma wait.",
            "", "| piece | instructions | share | at its wait | issues |",
            "|---|---|---|---|---|"]
    start = 0
    for n, row in enumerate(rows):
      is_wait = source(row).startswith("WARPGROUP.DEPBAR")
      if not is_wait and n != len(rows) - 1:
        continue
      piece = rows[start:n + 1]
      counts = collections.Counter()
      for r in piece:
        op = _PREDICATE.sub("", source(r))
        for prefix, label in _COUNTED.items():
          if op.startswith(prefix):
            counts[label] += 1
      share = sum(samples(r) for r in piece)
      wait = f"{100 * samples(row) / total:.1f}%" if is_wait else "-"
      first = rows[start][index["Address"]]
      out.append(f"| {first}.. | {len(piece)} | {100 * share / total:.1f}% | "
                 f"{wait} | " + ", ".join(f"{k} {v}" for k, v in
                                          counts.items()) + " |")
      start = n + 1
    out.append("")
  return "\n".join(out)


def opcodes_report(path: str, top: int = 12, kernel: str | None = None) -> str:
  """Per kernel, warp instructions executed by SASS opcode."""
  out = []
  for name, header, rows in _kernels(path, kernel):
    index = {h: i for i, h in enumerate(header)}
    column = index.get("Instructions Executed")
    if column is None:
      return f"no 'Instructions Executed' column in {path}: {header}"
    by_opcode = collections.Counter()
    for row in rows:
      op = _PREDICATE.sub("", row[index["Source"]].strip()).split(" ")[0]
      by_opcode[op.split(".")[0]] += int(float(row[column] or 0))
    total = sum(by_opcode.values()) or 1
    out += [f"### {name}", "", f"{total:,} warp instructions.", "",
            "| opcode | warp instructions | share |", "|---|---|---|"]
    out += [f"| {op} | {n:,} | {100 * n / total:.1f}% |"
            for op, n in by_opcode.most_common(top)]
    out.append("")
  return "\n".join(out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("what",
                      choices=("metrics", "stalls", "phases", "opcodes"))
  parser.add_argument("paths", nargs="+")
  parser.add_argument("--top", type=int, default=12)
  parser.add_argument("--kernel", help="stalls, phases, opcodes: kernels "
                      "whose name has this (default: all but XLA's fusions)")
  args = parser.parse_args(argv)
  for path in args.paths:
    if args.what == "metrics":
      print(metrics_table(path))
    elif args.what == "stalls":
      print(stalls_report(path, args.top, args.kernel))
    elif args.what == "opcodes":
      print(opcodes_report(path, args.top, args.kernel))
    else:
      print(phases_report(path, args.kernel))
    print()
  return 0


if __name__ == "__main__":
  sys.exit(main())
