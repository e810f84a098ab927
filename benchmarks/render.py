"""Turns a results JSON of `run_grid.py` into a markdown table and a plot.

    python -m benchmarks.render benchmarks/results/h200.json

writes `h200.md` (rows: cells; columns: TFLOP/s per implementation, the best
peer and the ratio of ours to it) and `h200.png` (TFLOP/s against seq_len, one
line per implementation, one panel per (mode, causal, head_dim)).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
from typing import Callable, Iterable, Sequence

from benchmarks import common
from benchmarks.peers import CEILING, OTHER_PRECISION, OURS, PEERS

Points = list[tuple[float, float]]


def load(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def write_results(path: str, result: dict, headers: Sequence[str],
                  rows: Iterable[Sequence]) -> str:
  """Writes `result` to `path` (JSON) and a table of `rows` next to it (.md,
  headed by the command and device); returns the table."""
  common.write_json(path, result)
  text = markdown_table(headers, rows)
  with open(path.removesuffix(".json") + ".md", "w") as f:
    f.write(f"`{result['command']}` on {result['device']}\n\n{text}\n")
  return text


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
  """A GitHub markdown table; also readable as plain text in a terminal."""
  lines = ["| " + " | ".join(map(str, headers)) + " |",
           "|" + "|".join("---" for _ in headers) + "|"]
  lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
  return "\n".join(lines)


def _cell_order(entry: dict) -> tuple:
  return (entry["mode"], entry["causal"], entry["head_dim"], entry["seq_len"])


def _impls(result: dict) -> list[str]:
  """Implementations in the file, in `PEERS` order (unknown names last)."""
  seen = {e["impl"] for e in result["records"] + result.get("skipped", [])}
  return [n for n in PEERS if n in seen] + sorted(seen - set(PEERS))


def tflops_by_cell(result: dict) -> dict[tuple, dict[str, float]]:
  """{(mode, causal, head_dim, seq_len): {impl: TFLOP/s}}, cells in order."""
  cells = collections.defaultdict(dict)
  for rec in sorted(result["records"], key=_cell_order):
    cells[_cell_order(rec)][rec["impl"]] = rec["tflops"]
  return dict(cells)


def best_peer(tflops: dict[str, float]) -> tuple[str, float] | None:
  """The fastest implementation that is neither ours nor the matmul ceiling."""
  peers = {n: t for n, t in tflops.items()
           if n not in (*OURS, *OTHER_PRECISION, CEILING)}
  if not peers:
    return None
  name = max(peers, key=peers.get)
  return name, peers[name]


def _fmt(tflops: dict[str, float], name: str) -> str:
  if name not in tflops:
    return "—"
  value = tflops[name]
  return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def best_ours(tflops: dict[str, float]) -> tuple[str, float] | None:
  """The fastest of this project's implementations in the cell."""
  ours = {n: t for n, t in tflops.items() if n in OURS}
  if not ours:
    return None
  name = max(ours, key=ours.get)
  return name, ours[name]


def _ratio(tflops: dict[str, float]) -> str:
  best, ours = best_peer(tflops), best_ours(tflops)
  if best is None or ours is None:
    return "—"
  return f"{ours[1] / best[1]:.2f}"


def grid_table(result: dict) -> tuple[list[str], list[list]]:
  """Every implementation's TFLOP/s per cell, the best peer and our ratio."""
  impls = _impls(result)
  headers = ["cell", *impls, "best peer", "ours / best"]
  rows = []
  for cell, tflops in tflops_by_cell(result).items():
    best = best_peer(tflops)
    rows.append([common.cell_label(*cell),
                 *(_fmt(tflops, n) for n in impls),
                 best[0] if best else "—", _ratio(tflops)])
  return headers, rows


def summary_table(result: dict) -> tuple[list[str], list[list]]:
  """The compact version for a terminal: ours, the best peer, the ratio."""
  headers = ["cell", "ours", "TFLOP/s", "best peer", "TFLOP/s", "ratio",
             CEILING]
  rows = []
  for cell, tflops in tflops_by_cell(result).items():
    best, ours = best_peer(tflops), best_ours(tflops)
    best_name = best[0] if best else "—"
    ours_name = ours[0] if ours else "—"
    rows.append([common.cell_label(*cell), ours_name, _fmt(tflops, ours_name),
                 best_name,
                 _fmt(tflops, best_name), _ratio(tflops),
                 _fmt(tflops, CEILING)])
  return headers, rows


def write_suite_files(stem: str, lines: list[str], result: dict,
                      plot: Callable[[str, dict], None]) -> tuple[str, str]:
  """A suite's `stem`.md: `lines`, then the cells the time budget left
  unmeasured and the skipped runs with their reasons; and its `stem`.png
  drawn by `plot(path, result)`. Returns both paths."""
  if result.get("unmeasured"):
    lines = lines + ["## Not measured (time budget)", "",
                     ", ".join(result["unmeasured"]), ""]
  if result["skipped"]:
    lines = lines + ["## Skipped", "",
                     markdown_table(*skipped_table(result)), ""]
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines))
  plot(stem + ".png", result)
  return stem + ".md", stem + ".png"


def skipped_table(result: dict) -> tuple[list[str], list[list]]:
  """Why cells are missing: one row per (impl, reason), with a count."""
  counts = collections.Counter((s["impl"], s["reason"])
                               for s in result.get("skipped", []))
  return ["impl", "cells", "reason"], [
      [impl, n, reason.replace("|", "/")]
      for (impl, reason), n in sorted(counts.items())]


def plot_panels(path: str, panels: dict[str, dict[str, Points]], *,
                ylabel: str, xlabel: str = "seq_len", ncols: int = 3,
                logy: bool = False) -> None:
  """One subplot per panel, one line per series, log2 x axis; saves a PNG."""
  import matplotlib
  matplotlib.use("Agg")  # no display on the benchmark machines
  import matplotlib.pyplot as plt

  # One colour per series across all panels, so a line is the same
  # implementation everywhere.
  labels = list(dict.fromkeys(l for series in panels.values() for l in series))
  palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  colours = {l: palette[i % len(palette)] for i, l in enumerate(labels)}
  nrows = max(1, -(-len(panels) // ncols))
  fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows),
                           squeeze=False)
  for ax in axes.flat[len(panels):]:
    ax.set_visible(False)
  for ax, (title, series) in zip(axes.flat, panels.items()):
    ticks = set()
    for label, points in series.items():
      if not points:
        continue
      xs, ys = zip(*sorted(points))
      ticks.update(xs)
      style = (dict(color="grey", linestyle="--") if label == CEILING
               else dict(color=colours[label]))
      ax.plot(xs, ys, marker="o", label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [_short(x) for x in sorted(ticks)])
    if logy:
      ax.set_yscale("log")
    else:
      ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
  handles = {}
  for ax in axes.flat:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      handles.setdefault(label, handle)
  handles = {l: handles[l] for l in labels if l in handles}
  fig.legend(handles.values(), handles.keys(), loc="lower center",
             ncol=min(len(handles), 5), fontsize=9)
  fig.tight_layout(rect=(0, 0.06, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _short(n: float) -> str:
  """1024 -> "1k", 262144 -> "256k": tick labels for sequence lengths."""
  return f"{n / 1024:g}k" if n >= 1024 else f"{n:g}"


def grid_panels(result: dict) -> dict[str, dict[str, Points]]:
  """{title: {impl: [(seq_len, TFLOP/s)]}}, a panel per (mode, causal, d)."""
  panels = collections.defaultdict(lambda: collections.defaultdict(list))
  for (mode, causal, head_dim, seq), tflops in tflops_by_cell(result).items():
    title = f"{mode}, {'causal' if causal else 'full'}, head_dim {head_dim}"
    for impl, value in tflops.items():
      panels[title][impl].append((seq, value))
  return panels


def header_lines(result: dict, title: str) -> list[str]:
  """Title, device, command and, where the run has one, its caveat."""
  lines = [f"# {title}", "",
           f"Device: {result['device']}; JAX {result['jax_version']}.", "",
           f"Command: `{result['command']}`", ""]
  if result.get("parts"):  # e.g. the grid's halves, one process each
    lines += ["Parts, each measured in one process of its own:", "",
              *(f"- `{command}`" for command in result["parts"]), ""]
  if result.get("note"):
    lines += [f"**Note:** {result['note']}", ""]
  return lines


def render(path: str) -> tuple[str, str]:
  """Writes `<stem>.md` and `<stem>.png` next to `path`; returns their paths."""
  result = load(path)
  stem = os.path.splitext(path)[0]
  lines = header_lines(result, "Attention throughput (TFLOP/s)")
  lines += ["FLOPs: 4·B·T²·N·D, halved for causal, x3.5 for fwd_bwd; "
            "median of timed samples after warm-up. "
            f"Ratio: the faster of ours ({', '.join(OURS)}) over the fastest "
            f"peer ({CEILING} excluded: it is "
            "the ceiling, a dense bf16 matmul of the same FLOPs).", "",
            markdown_table(*grid_table(result)), ""]
  if result.get("skipped"):
    lines += ["## Skipped", "", markdown_table(*skipped_table(result)), ""]
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines))
  head_dims = {rec["head_dim"] for rec in result["records"]}
  plot_panels(stem + ".png", grid_panels(result), ylabel="TFLOP/s",
              ncols=max(1, len(head_dims)))
  return stem + ".md", stem + ".png"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results", nargs="+", help="results JSON of run_grid.py")
  for path in parser.parse_args(argv).results:
    print(*render(path))


if __name__ == "__main__":
  main()
