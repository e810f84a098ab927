"""Where a Mosaic GPU kernel spills: local-memory accesses per register budget.

    MOSAIC_GPU_DUMP_SASS=1 python3 -m benchmarks.tune_mosaic ... > dump.txt
    python3 -m benchmarks.sass_spills dump.txt [--kernel NAME]

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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("dump", help="a file holding the SASS dump ('-': stdin)")
  parser.add_argument("--kernel", help="only kernels whose name contains it")
  args = parser.parse_args(argv)
  text = sys.stdin.read() if args.dump == "-" else open(args.dump).read()
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
