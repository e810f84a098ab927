"""Where a Mosaic GPU kernel spills: local-memory accesses per register budget.

    MOSAIC_GPU_DUMP_SASS=1 python3 -m benchmarks.tune_mosaic ... > dump.txt
    python3 -m benchmarks.diagnostics.sass_spills dump.txt [--kernel NAME]

ptxas reports a kernel's spills in total (`MOSAIC_GPU_DUMP_PTXAS=1`), not
which warpgroup's code they are in. Warp-specialised kernels set each
warpgroup's register budget with `setmaxnreg`, which SASS shows as a
`USETMAXREG` instruction at the start of that warpgroup's branch. This
script walks each kernel's SASS in program order and counts the local
stores and loads (`STL`, `LDL`: spills and their reloads) after each
`USETMAXREG`, keyed by the budget it set: the consumers' (say 232) apart
from the producer's and the dQ writer's (24). Code before the first one
(the kernel's prologue) counts under "launch".

A heuristic, not a control-flow analysis: code is attributed to the last
`USETMAXREG` above it in the listing, which holds for the kernels here (each
warpgroup's branch follows its own `setmaxnreg`).

    python3 -m benchmarks.diagnostics.sass_spills dump.txt --loops

says which loops spill instead: for each loop (a branch back to a label
above it, spanning at least `--min-loop` bytes of code, so not a barrier's
spin), its local stores and loads and its wgmmas (`HGMMA`). It showed
that ptxas permuted the causal `scores_ahead` loop's carried registers
through local memory at each turn (a loop's spills cost every step; the same
count in code run once per tile costs little).
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

# A kernel's SASS starts with a line naming it, as cuobjdump and nvdisasm
# print it ("Function : name" or ".text.name:").
_FUNCTION = re.compile(r"(?:Function\s*:\s*|\.text\.)([A-Za-z_][\w$.]*)")
_SETMAXNREG = re.compile(r"\bUSETMAXREG\b[^;]*?(0x[0-9a-fA-F]+|\b\d+\b)\s*;")
_LOCAL = re.compile(r"\b(STL|LDL)(?:\.[\w.]+)?\b")


def spills_by_budget(sass: str) -> dict[str, dict[str, collections.Counter]]:
  """{kernel: {budget: Counter(STL=..., LDL=...)}}; budget is the register
  count of the last USETMAXREG above (as a string), or "launch"."""
  result: dict[str, dict[str, collections.Counter]] = {}
  kernel, budget = None, "launch"
  for line in sass.splitlines():
    if (match := _FUNCTION.search(line)) and "USETMAXREG" not in line:
      kernel, budget = match.group(1), "launch"
      result.setdefault(kernel, {})
      continue
    if kernel is None:
      continue
    if match := _SETMAXNREG.search(line):
      budget = str(int(match.group(1), 0))
    for op in _LOCAL.findall(line):
      result[kernel].setdefault(budget, collections.Counter())[op] += 1
  return result


_ADDRESS = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(.*)")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
_LOOP_OPS = ("STL", "LDL", "HGMMA")


def spills_by_loop(sass: str, min_bytes: int = 0x200
                   ) -> dict[str, list[tuple[int, int, collections.Counter]]]:
  """{kernel: [(first, last address, Counter(STL=, LDL=, HGMMA=)), ...]}
  for each loop of at least `min_bytes` of code, in listing order; an outer
  loop counts what its inner loops hold too."""
  result: dict[str, list] = {}
  kernel, labels, pending, code = None, {}, [], []

  def close():
    if kernel is None:
      return
    loops = []
    for address, text in code:
      branch = _BRANCH.search(text)
      start = labels.get(branch.group(1)) if branch else None
      if start is not None and start < address and (
          address - start >= min_bytes):
        counts = collections.Counter()
        for inside, body in code:
          if start <= inside <= address:
            for op in _LOOP_OPS:
              counts[op] += len(re.findall(rf"\b{op}\b", body))
        loops.append((start, address, counts))
    result[kernel] = loops

  for line in sass.splitlines():
    if (match := _FUNCTION.search(line)) and "USETMAXREG" not in line:
      close()
      kernel, labels, pending, code = match.group(1), {}, [], []
    elif match := _LABEL.match(line):
      pending.append(match.group(1))
    elif match := _ADDRESS.match(line):
      address = int(match.group(1), 16)
      labels.update((label, address) for label in pending)
      pending = []
      code.append((address, match.group(2)))
  close()
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("dump", help="a file holding the SASS dump ('-': stdin)")
  parser.add_argument("--kernel", help="only kernels whose name contains it")
  parser.add_argument("--loops", action="store_true",
                      help="per loop instead of per register budget")
  parser.add_argument("--min-loop", type=lambda x: int(x, 0), default=0x200,
                      help="bytes of code a loop spans at least (0x200)")
  args = parser.parse_args(argv)
  text = sys.stdin.read() if args.dump == "-" else open(args.dump).read()
  if args.loops:
    for kernel, loops in spills_by_loop(text, args.min_loop).items():
      if args.kernel and args.kernel not in kernel:
        continue
      print(f"{kernel}:" + ("" if loops else " no loops"))
      for first, last, c in loops:
        print(f"  loop {first:#x}-{last:#x}: {c['STL']} STL / {c['LDL']} LDL,"
              f" {c['HGMMA']} HGMMA")
    return 0
  found = spills_by_budget(text)
  for kernel, budgets in found.items():
    if args.kernel and args.kernel not in kernel:
      continue
    counts = ", ".join(f"{budget}: {c['STL']} STL / {c['LDL']} LDL"
                       for budget, c in budgets.items()) or "no spills"
    print(f"{kernel}: {counts}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
