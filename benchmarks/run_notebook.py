"""Executes a notebook's code cells in this process and stores their outputs.

    python -m benchmarks.run_notebook notebooks/numerics.ipynb OUT.ipynb

For machines without Jupyter (the GPU machine has no nbclient or ipykernel):
the cells run in order in one namespace, like a kernel would; stdout and
stderr become stream outputs and every open matplotlib figure a PNG after its
cell. The tests execute the notebook with nbclient instead.
"""
from __future__ import annotations

import base64
import contextlib
import io
import json
import sys
import time
import traceback

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def _figures_as_outputs() -> list[dict]:
  outputs = []
  for number in plt.get_fignums():
    buffer = io.BytesIO()
    plt.figure(number).savefig(buffer, format="png", bbox_inches="tight")
    outputs.append({"output_type": "display_data", "metadata": {},
                    "data": {"image/png":
                             base64.b64encode(buffer.getvalue()).decode(),
                             "text/plain": ["<Figure>"]}})
  plt.close("all")
  return outputs


class _Tee(io.StringIO):
  """Captures a cell's stream and echoes it live, so that a run cut off by
  a timeout still shows how far it got (progress bars go to stderr)."""

  def __init__(self, echo):
    super().__init__()
    self._echo = echo

  def write(self, text):
    self._echo.write(text)
    self._echo.flush()
    return super().write(text)


def execute(notebook: dict, after_cell=None) -> bool:
  """Runs every code cell, replacing its outputs; False if one raised.

  `after_cell(notebook)`, if given, runs after each cell (to save progress
  where the run may be cut off).
  """
  namespace: dict = {"__name__": "__main__"}
  plt.show = lambda *args, **kwargs: None  # figures are collected per cell
  count = 0
  start = time.perf_counter()
  for cell in notebook["cells"]:
    if cell["cell_type"] != "code":
      continue
    count += 1
    source = "".join(cell["source"])
    stdout, stderr = io.StringIO(), _Tee(sys.stderr)
    outputs, failed = [], False
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
      try:
        exec(compile(source, f"<cell {count}>", "exec"), namespace)
      except Exception:  # recorded in the notebook, as a kernel would
        failed = True
        traceback.print_exc()
    for name, stream in (("stdout", stdout), ("stderr", stderr)):
      if stream.getvalue():
        outputs.append({"output_type": "stream", "name": name,
                        "text": stream.getvalue().splitlines(keepends=True)})
    outputs.extend(_figures_as_outputs())
    cell["outputs"], cell["execution_count"] = outputs, count
    print(f"cell {count}: {'FAILED' if failed else 'ok'} after "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    if after_cell:
      after_cell(notebook)
    if failed:
      print(stderr.getvalue()[-2000:], file=sys.stderr)
      return False
  return True


def main(argv=None) -> int:
  source, target = (argv or sys.argv[1:])[:2]
  with open(source) as f:
    notebook = json.load(f)

  def save(notebook):
    with open(target, "w") as f:
      json.dump(notebook, f, indent=1)
      f.write("\n")

  ok = execute(notebook, after_cell=save)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
