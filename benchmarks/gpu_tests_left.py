"""The GPU tests that logs of `pytest -m gpu -v` runs did not pass or skip.

    python -m benchmarks.gpu_tests_left LOG... [--out FILE]   # LOG.gz too

A device call cut off by its limit leaves part of the GPU suite unrun
(session 16 needed three calls; since session 17 it fits one, README,
"Tests"). This collects the suite's
GPU tests here (collection needs no GPU), reads the outcome lines of the
logs (`PASSED` or `SKIPPED` then a node id, as `-v` prints them, with or
without pytest-xdist's worker prefix), and writes the rest, one node id a
line, for the next call to run as `pytest -m gpu @FILE`
(`GPU_TESTS=@FILE bash benchmarks/h200_check.sh tests_shards`). A test
that failed, timed out or never started counts as not passed. Prints the
counts and the rest by file.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import re
import subprocess
import sys

# `[gw3] [ 41%] PASSED tests/a.py::t[x]` (pytest-xdist) or
# `tests/a.py::t[x] PASSED  [ 41%]` (one process); ids may hold spaces.
_XDIST_OUTCOME = re.compile(r"\b(PASSED|SKIPPED) (tests/\S+?\.py::\S.*?)\s*$")
_PLAIN_OUTCOME = re.compile(
    r"^(tests/\S+?\.py::\S.*?) (PASSED|SKIPPED)\b.*\[\s*\d+%\]\s*$")


def gpu_test_ids() -> list[str]:
  """Node ids of every `-m gpu` test, in collection order."""
  listing = subprocess.run(
      [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q",
       "-n", "0", "-p", "no:cacheprovider"],
      check=True, capture_output=True, text=True).stdout
  return list(dict.fromkeys(line for line in listing.splitlines()
                            if line.startswith("tests/") and "::" in line))


def outcomes(log_text: str) -> dict[str, str]:
  """{node id: "PASSED" or "SKIPPED"} from one `pytest -v` log."""
  found = {}
  for line in log_text.splitlines():
    if match := _XDIST_OUTCOME.search(line):
      found[match.group(2)] = match.group(1)
    elif match := _PLAIN_OUTCOME.match(line):
      found[match.group(1)] = match.group(2)
  return found


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("logs", nargs="+", help="`pytest -m gpu -v` logs")
  parser.add_argument("--out", help="write the node ids left here")
  args = parser.parse_args(argv)
  done = {}
  for path in args.logs:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as log:
      found = outcomes(log.read())
    if not found:  # not a `pytest -v` log: say so rather than count none
      parser.error(f"{path}: no PASSED or SKIPPED lines of `pytest -v`")
    done.update(found)
  every = gpu_test_ids()
  unknown = sorted(set(done) - set(every))
  if unknown:  # a renamed or removed test: say so rather than miscount
    print(f"{len(unknown)} outcomes name no current GPU test, e.g. "
          f"{unknown[0]}", file=sys.stderr)
  left = [test for test in every if test not in done]
  counts = collections.Counter(done[t] for t in every if t in done)
  print(f"{len(every)} GPU tests: {counts['PASSED']} passed, "
        f"{counts['SKIPPED']} skipped, {len(left)} left")
  for path, n in collections.Counter(t.split("::")[0] for t in left).items():
    print(f"  {path}: {n}")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as out:
      out.writelines(test + "\n" for test in left)
  return 0


if __name__ == "__main__":
  sys.exit(main())
