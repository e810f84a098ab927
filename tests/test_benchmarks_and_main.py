"""The benchmark scripts at smoke size and `python -m jax_flash`, on the CPU."""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
from unittest import mock

import jax
import pytest

from benchmarks import common, memory, render, run_grid, tune_blocks
from pallas_kernels import compat

# Its module-scoped fixtures (a child process, a trained model) are built
# once: every test of the file runs in one xdist worker (pyproject).
pytestmark = pytest.mark.xdist_group("test_benchmarks_and_main")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD_FIELDS = {"impl", "mode", "seq_len", "head_dim", "causal", "dtype",
                 "batch", "num_heads", "ms", "tflops", "peak_gib"}
GRID_IMPLS = ["jax_flash_triton", "xla", "cudnn", "matmul"]
# What `pip install .` installs (pyproject.toml's packages.find).
INSTALLED_PACKAGES = ("jax_flash", "pallas_kernels", "flax_layers")


def test_attention_flops_is_flash_attentions_count():
  # 4 * B * T * T * N * D = 4 * 2 * 1024 * 1024 * 16 * 64 = 2**33.
  assert common.attention_flops(2, 1024, 1024, 16, 64, False, "fwd") == 2 ** 33
  assert common.attention_flops(2, 1024, 1024, 16, 64, True, "fwd") == 2 ** 32
  assert common.attention_flops(2, 1024, 1024, 16, 64, True, "bwd") == (
      2.5 * 2 ** 32)
  assert common.attention_flops(2, 1024, 1024, 16, 64, False, "fwd_bwd") == (
      3.5 * 2 ** 33)
  # The standard grid: batch * seq = 16384, heads * head_dim = 2048.
  cell = common.Cell.standard("fwd", 4096, 128, False)
  assert (cell.batch, cell.num_heads) == (4, 16)
  assert cell.flops == 4 * 16384 * 4096 * 2048


@pytest.mark.slow  # tooling of the GPU runs
def test_compile_times_lists_the_tests_that_compile_longest(tmp_path):
  """`pytest --compile-times N` (tests/compile_times.py) sums JAX's compile
  events per test and lists the longest, in one process as under xdist."""
  (tmp_path / "test_compiles.py").write_text(
      "import jax, jax.numpy as jnp\n"
      "def test_sin():\n"
      "  jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3))\n"
      "def test_cos():\n"
      "  jax.jit(lambda x: jnp.cos(x) + 1)(jnp.ones((2, 5)))\n")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
  for workers in ("0", "2"):
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", workers,
         "-p", "no:cacheprovider", "-p", "tests.compile_times",
         "--compile-times", "2", "test_compiles.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:]
    summary = run.stdout.split("compile time, ")[-1]
    assert summary.startswith("2 tests"), run.stdout[-2000:]
    listed = [line for line in summary.splitlines()
              if "test_compiles.py::test_" in line]
    assert len(listed) == 2, summary
    assert float(listed[0].split()[0]) > 0


@pytest.fixture(scope="module")
def grid_json(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("grid") / "smoke.json")
  argv = ["--smoke", "--out", out, "--impls", *GRID_IMPLS, "--no-render"]
  assert run_grid.main(argv) == 0
  return out


def test_run_grid_smoke_writes_every_cell(grid_json):
  with open(grid_json) as f:
    result = json.load(f)
  assert {"device", "jax_version", "command", "records", "skipped"} <= set(
      result)
  assert "benchmarks.run_grid --smoke" in result["command"]
  cells = {(m, c) for m in common.MODES for c in (False, True)}
  measured = {common.entry_key(e) for e in result["records"]}
  skipped = {common.entry_key(e) for e in result["skipped"]}
  assert not measured & skipped
  assert len(measured | skipped) == len(cells) * len(GRID_IMPLS)
  for record in result["records"]:
    assert set(record) == RECORD_FIELDS
    assert record["ms"] > 0 and record["tflops"] > 0
  for impl in ("jax_flash_triton", "xla", "matmul"):
    assert {(r["mode"], r["causal"]) for r in result["records"]
            if r["impl"] == impl} == cells, impl
  if not compat.has_gpu():
    assert all(s["impl"] == "cudnn" and "GPU" in s["reason"]
               for s in result["skipped"])


def test_render_writes_table_and_plot(grid_json):
  md, png = render.render(grid_json)
  assert os.path.getsize(png) > 0
  with open(md) as f:
    text = f.read()
  for impl in ("jax_flash_triton", "xla", "matmul", "best peer"):
    assert impl in text
  headers, rows = render.grid_table(render.load(grid_json))
  assert len(rows) == 4 and len(rows[0]) == len(headers)
  # The best peer is never ours nor the matmul ceiling.
  assert {row[headers.index("best peer")] for row in rows} == {"xla"}


@pytest.mark.slow  # benchmark scripts, run for real on the GPU
def test_memory_and_tune_blocks_smoke(tmp_path):
  mem_out = str(tmp_path / "memory.json")
  assert memory.main(["--smoke", "--impls", "jax_flash_triton",
                      "--out", mem_out]) == 0
  with open(mem_out) as f:
    entries = json.load(f)["records"]
  assert [(e["seq_len"], e["status"]) for e in entries] == [(64, "ok"),
                                                            (128, "ok")]
  assert entries[0]["compiled_gib"] < entries[1]["compiled_gib"]
  assert os.path.exists(str(tmp_path / "memory.png"))

  sweep_out = str(tmp_path / "sweep.json")
  assert tune_blocks.main(["--smoke", "--finalists", "1",
                           "--out", sweep_out]) == 0
  with open(sweep_out) as f:
    sweep = json.load(f)
  assert {t["phase"] for t in sweep["trials"]} == {"fwd", "dkdv", "dq"}
  assert all("tflops" in t for t in sweep["trials"])

  # At a model's shape: the forward alone, without causal finalists.
  assert tune_blocks.main(["--smoke", "--phases", "fwd", "--full-only",
                           "--seq", "96", "--tokens", "192",
                           "--out", sweep_out]) == 0
  with open(sweep_out) as f:
    sweep = json.load(f)
  assert sweep["seq_len"] == 96
  assert {(t["phase"], t["causal"]) for t in sweep["trials"]} == {
      ("fwd", False)}


def test_python_m_jax_flash_passes_from_another_directory(tmp_path):
  """The main job as an installed package runs it: from another directory,
  with only the three packages importable (links to them, as a plain
  `pip install .` would copy them; the editable install maps the same
  three), so that nothing under benchmarks/, tests/ or examples/ can creep
  in. Compiled with XLA's default settings (the rest of the CPU suite
  compiles faster without most optimisations, tests/conftest.py), so that
  a miscompile under the defaults users run would show here."""
  from tests.conftest import xla_default_env
  site = tmp_path / "site"
  site.mkdir()
  for package in INSTALLED_PACKAGES:
    (site / package).symlink_to(pathlib.Path(ROOT) / package)
  env = xla_default_env()
  env["PYTHONPATH"] = str(site)
  proc = subprocess.run([sys.executable, "-m", "jax_flash"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=240, env=env)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for text in ("triton", "xla", "err/bound", "PASS"):
    assert text in proc.stdout


def _imported_packages(path: pathlib.Path) -> set[str]:
  """Top-level names of every absolute import in a source file, those
  inside functions included."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      found.add(node.module.split(".")[0])
  return found


def test_installed_packages_import_one_way():
  """DESIGN.md section 1: flax_layers -> jax_flash -> pallas_kernels, and
  nothing installed imports benchmarks, tests or examples (absent after
  `pip install .`)."""
  below = {"pallas_kernels": {"jax_flash", "flax_layers"},
           "jax_flash": {"flax_layers"}, "flax_layers": set()}
  uninstalled = {"benchmarks", "tests", "examples"}
  for package in INSTALLED_PACKAGES:
    files = sorted((pathlib.Path(ROOT) / package).rglob("*.py"))
    assert files, package
    for path in files:
      wrong = _imported_packages(path) & (below[package] | uninstalled)
      assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def test_mosaic_sweep_picks_the_best_geometric_mean():
  from benchmarks.tune_mosaic import best_lines
  trial = lambda causal, tflops, block_kv: dict(
      kernel="forward", head_dim=128, causal=causal, block_q=64,
      block_kv=block_kv, max_concurrent_steps=2, tflops=tflops)
  # 128 is faster without the mask, 64 with it; 64 wins on the geomean;
  # a candidate measured only once (the sweep was cut) is not ranked.
  trials = [trial(False, 600, 128), trial(True, 300, 128),
            trial(False, 550, 64), trial(True, 450, 64),
            trial(False, 900, 192)]
  [line] = best_lines(trials)
  assert line.startswith("forward d128: {'block_q': 64, 'block_kv': 64,")
  # The causal-only launch-order A/B ranks on its one causal value.
  order = lambda heavy_first, tflops: dict(
      kernel="forward_order", head_dim=64, causal=True,
      heavy_first=heavy_first, tflops=tflops)
  [line] = best_lines([order(False, 400), order(True, 430)])
  assert line.startswith("forward_order d64: {'heavy_first': True} 430")
  assert "{'heavy_first': False} 400" in line
  # Trials at several sequence lengths rank apart.
  persistent = lambda seq, on, tflops: [dict(
      kernel="forward_persistent", seq=seq, head_dim=128, causal=causal,
      persistent=on, tflops=tflops) for causal in (False, True)]
  lines = best_lines([*persistent(1024, False, 380),
                      *persistent(1024, True, 450),
                      *persistent(16384, False, 580),
                      *persistent(16384, True, 570)])
  assert lines[0].startswith("forward_persistent seq 1024 d128: "
                             "{'persistent': True} 450")
  assert lines[1].startswith("forward_persistent seq 16384 d128: "
                             "{'persistent': False} 580")
  # A tuple option read back from JSON (a list) ranks like any other.
  tiles = lambda causal, value, tflops: dict(
      kernel="backward_dq_tiles_64", seq=16384, head_dim=64, causal=causal,
      block_q=128, dq_tiles=value, tflops=tflops)
  [line] = best_lines([tiles(c, None, 380) for c in (False, True)]
                      + [tiles(c, [64, 128], 390) for c in (False, True)])
  assert "'dq_tiles': (64, 128)} 390" in line


def test_mosaic_sweep_times_candidates_in_turn(monkeypatch):
  """With rounds, a cell's candidates are timed A, B, B, A, A, B, ... and
  each keeps the median of its rounds; a refused candidate keeps its
  reason."""
  from benchmarks import common, tune_mosaic
  order, times = [], {1: iter([5.0, 1.0, 2.0]), 2: iter([4.0, 4.0, 9.0])}

  def build(cell, blocks):
    if blocks["block_q"] == 3:
      raise NotImplementedError("too many registers")
    return (lambda: None), (blocks["block_q"],)

  def time_fn(fn, block_q):
    order.append(block_q)
    return next(times[block_q])

  monkeypatch.setitem(tune_mosaic.KERNELS, "toy",
                      (build, dict(block_q=(1, 2, 3)), 1.0, (False,)))
  monkeypatch.setattr(common, "time_fn", time_fn)
  trials = tune_mosaic.sweep_cell("toy", 1024, 64, False, rounds=3)
  assert order == [1, 2, 2, 1, 1, 2]
  assert [t.get("ms") for t in trials] == [2.0, 4.0, None]
  assert "too many registers" in trials[2]["error"]
  assert trials[0]["rounds"] == 3
  [line] = tune_mosaic.best_lines(trials)
  assert line.startswith("toy seq 1024 d64: {'block_q': 1}")


def test_mosaic_sweep_render_refuses_to_overwrite_a_part(tmp_path):
  """`--render A B` merges A into B (the last path, a JSON) and B's table;
  with `--out` (a slip made twice) or a non-JSON last path it refuses,
  leaving the parts as they were."""
  from benchmarks import tune_mosaic
  part = tmp_path / "part.json"
  trial = dict(kernel="forward", head_dim=64, causal=False, block_q=64,
               ms=1.0, tflops=500.0)
  part.write_text(json.dumps(dict(device="d", jax_version="v", command="c",
                                  seq_len=1024, trials=[trial])))
  before = part.read_text()
  with pytest.raises(SystemExit):
    tune_mosaic.main(["--render", str(part), str(tmp_path / "m.json"),
                      "--out", str(tmp_path / "other.json")])
  with pytest.raises(ValueError, match="json"):
    tune_mosaic.write_tables([str(part)], str(tmp_path / "m.md"))
  assert part.read_text() == before
  assert tune_mosaic.main(["--render", str(part), str(tmp_path / "m.json")]) == 0
  assert "500" in (tmp_path / "m.md").read_text()
  assert part.read_text() == before
  # Two sweeps and no merged path: the second is not overwritten.
  other = tmp_path / "other.json"
  other.write_text(before)
  with pytest.raises(ValueError, match="sweep of its own"):
    tune_mosaic.main(["--render", str(part), str(other)])
  assert other.read_text() == before
  # An earlier merge may be written again, and one file renders in place.
  assert tune_mosaic.main(["--render", str(part), str(other),
                           str(tmp_path / "m.json")]) == 0
  assert tune_mosaic.main(["--render", str(part), str(other),
                           str(tmp_path / "m.json")]) == 0
  assert tune_mosaic.main(["--render", str(part)]) == 0  # its own table
  # Trials of a kernel no longer in KERNELS rank on their own fields.
  gone = dict(trial, kernel="backward_removed", dq_tiles=[64, 128])
  [line] = tune_mosaic.best_lines([gone, dict(gone, causal=True)])
  assert line.startswith("backward_removed d64:") and "(64, 128)" in line


def _collected(*args) -> list[str]:
  """Node ids `pytest --collect-only` selects from tests/test_gpu.py with
  `args` (one file: collecting the whole suite imports every test module,
  which is most of a minute; `--shard` works on any selection)."""
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "--collect-only", "-q",
       "-p", "no:cacheprovider", "-p", "no:randomly", *args,
       "tests/test_gpu.py"],
      cwd=ROOT, capture_output=True, text=True, check=True)
  return [line for line in run.stdout.splitlines() if "::" in line]


@pytest.mark.slow  # tooling of the GPU runs
def test_gpu_test_shards_partition_the_gpu_suite():
  """`pytest --shard I/N` (tests/conftest.py) splits a selection into N
  disjoint parts that together are all of it, and `h200_check.sh
  tests_shards`' default shards (one a GPU) are all of the GPU suite."""
  import re
  from tests.conftest import shard_of
  gpu = _collected("-m", "gpu")
  assert len(gpu) > 20
  parts = [shard_of(gpu, f"{i}/4") for i in range(4)]
  assert sum(map(len, parts)) == len(gpu) and set().union(*parts) == set(gpu)
  assert max(map(len, parts)) - min(map(len, parts)) <= 1
  assert set(_collected("-m", "gpu", "--shard", "1/4")) == parts[1]
  script = (pathlib.Path(ROOT) / "benchmarks" / "h200_check.sh").read_text()
  block = script[script.index("\n    tests_shards)"):]
  block = block[:block.index(";;")]
  default = re.search(r"TEST_SHARDS:-([^}]*)\}", block).group(1).split()
  assert len(default) == 2  # one a GPU of a two-GPU host
  count = int(default[0].split("/")[1])
  assert sorted(default) == [f"{i}/{count}" for i in range(count)]


def test_roofline_counts_each_tensor_once():
  from benchmarks.diagnostics.roofline import cell_bytes
  tensor = 2 * 1024 * 16 * 128 * 2  # one bf16 [2, 1024, 16, 128]
  rows = 2 * 1024 * 16 * 4
  assert cell_bytes(2, 1024, 16, 128, "fwd") == 4 * tensor + rows
  # fwd+bwd: the forward, then Q K V O dO + LSE, delta in, dQ dK dV out.
  assert cell_bytes(2, 1024, 16, 128, "fwd_bwd") == 12 * tensor + 3 * rows


def test_grid_halves_measured_apart_merge_into_one_file(tmp_path):
  """Two GPUs of one host each measure half the grid; `--include` makes one
  results file (and table) of the halves without measuring anything again."""
  parts = []
  for causal in ("full", "causal"):
    part = str(tmp_path / f"{causal}.json")
    assert run_grid.main(["--smoke", "--impls", "xla", "--causal", causal,
                          "--out", part, "--no-render"]) == 0
    parts.append(part)
    # As if measured elsewhere: the merged file names the parts' device.
    common.write_json(part, {**render.load(part), "device": "GPU of parts"})
  merged = str(tmp_path / "grid.json")
  assert run_grid.main(["--smoke", "--impls", "xla", "--out", merged,
                        "--include", *parts, "--time-budget", "0"]) == 0
  result = render.load(merged)
  halves = [render.load(p)["records"] for p in parts]
  assert result["records"] == halves[0] + halves[1]
  assert {r["causal"] for r in result["records"]} == {False, True}
  assert len(result["parts"]) == 2 and "--causal causal" in result["parts"][1]
  assert result["device"] == "GPU of parts"
  with open(str(tmp_path / "grid.md")) as f:
    assert "Parts, each measured" in f.read()


@pytest.mark.slow  # a benchmark script (test_sharding checks the sharding)
def test_sequence_parallel_smoke_on_four_host_devices(tmp_path):
  """Issue 7's script end to end on CPU host devices (tiny sizes)."""
  out = tmp_path / "sp.json"
  env = {**os.environ,  # conftest's XLA_FLAGS stay
         "XLA_FLAGS": " ".join(filter(None, [
             os.environ.get("XLA_FLAGS"),
             "--xla_force_host_platform_device_count=4"]))}
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.sequence_parallel", "--smoke",
       "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  records = json.loads(out.read_text())["records"]
  checks = [r for r in records if r["experiment"] == "correctness"]
  assert len(checks) == 6 and all(r["ok"] for r in checks)
  weak = [r for r in records if r["experiment"] == "weak"]
  assert {r["devices"] for r in weak} == {1, 2, 4}
  assert all(r["efficiency"] > 0 for r in weak)
  [overlap] = [r for r in records if r["experiment"] == "overlap"]
  assert overlap["devices"] == 4 and overlap["ring_over_kernels"] > 0
  [longest] = [r for r in records if r["experiment"] == "longest"]
  assert longest["seq_len"] >= 256
  assert (tmp_path / "sp.png").exists() and (tmp_path / "sp.md").exists()


def test_device_counts_double_up_to_all():
  from benchmarks.sequence_parallel import device_counts
  assert device_counts(1) == [1]
  assert device_counts(8) == [1, 2, 4, 8]
  assert device_counts(6) == [1, 2, 4, 6]


def test_run_notebook_records_outputs_and_stops_at_a_failure(tmp_path, capsys):
  """The Jupyter-less runner used on the GPU machine: streams, figures,
  saving after each cell, and the first failing cell ends the run."""
  from benchmarks import run_notebook
  code = lambda source: {"cell_type": "code", "source": source,
                         "outputs": [], "metadata": {}}
  notebook = {"cells": [
      code("x = 2\nprint('x is', x)"),
      {"cell_type": "markdown", "source": "text", "metadata": {}},
      code("import sys, matplotlib.pyplot as plt\n"
           "print('progress', file=sys.stderr)\nplt.plot([x, 3])"),
      code("raise RuntimeError('stop here')"),
      code("print('never')")]}
  saved = []
  assert not run_notebook.execute(notebook, after_cell=lambda nb: saved.append(
      [len(c.get("outputs", [])) for c in nb["cells"]]))
  first, _, second, third, fourth = notebook["cells"]
  assert first["outputs"][0]["text"] == ["x is 2\n"]
  kinds = [o["output_type"] for o in second["outputs"]]
  assert kinds == ["stream", "display_data"]
  assert "image/png" in second["outputs"][1]["data"]
  assert "stop here" in "".join(third["outputs"][0]["text"])
  assert fourth["outputs"] == [] and "execution_count" not in fourth
  assert len(saved) == 3          # after each code cell that ran
  assert "progress" in capsys.readouterr().err   # echoed live


def test_compile_probe_reports_both_steps(capsys):
  from benchmarks.diagnostics import compile_probe
  assert compile_probe.main(["--shapes", "1", "--dtypes", "float32"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 3    # the device, then causal False and True
  for line in lines[1:]:
    assert "fwd compile s" in line and "fwd+vjp first run s" in line, line


def test_compile_probe_splits_a_first_call(capsys):
  from benchmarks.diagnostics import compile_probe
  with mock.patch.object(compile_probe, "SPLIT_SHAPE", (64, 64, 2, 1, 64)):
    assert compile_probe.main(["--split", "triton"]) == 0
  line = capsys.readouterr().out.splitlines()[-1]
  assert "triton:" in line and all(
      f"{stage} " in line for stage in ("trace", "lower", "compile",
                                        "first run")), line


def test_compile_probe_times_each_mosaic_kernel_alone(cuda_lowering,
                                                      monkeypatch):
  """`--kernels` records the three Mosaic launches of a causal fwd+VJP and
  lowers each alone (cross-lowered for CUDA here, its compile skipped)."""
  del cuda_lowering  # requested for its skip
  import jax_flash
  from benchmarks.diagnostics import compile_probe
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import mosaic_attention
  monkeypatch.setattr(jax_flash, "flash_attention", lambda q, k, v, **kw: (
      mosaic_attention(q, k, v, scale=q.shape[-1]**-0.5, **kw,
                       backward_blocks=BlockSizes.get_default(
                           q.shape[-1], "NVIDIA H200"))[0]))
  lower = jax.stages.Traced.lower
  monkeypatch.setattr(jax.stages.Traced, "lower", lambda self: lower(
      self, lowering_platforms=("cuda",)))
  monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self: None)
  stages = compile_probe.kernel_stages((256, 256, 2, 2, 64))
  assert [name for name, *_ in stages] == [
      "mosaic_flash_forward", "mosaic_flash_backward_dq",
      "mosaic_flash_backward_dkdv"]
  assert all(lower_s > 0 for _, lower_s, _ in stages)


def test_block_mask_probe_times_each_mask(capsys):
  from benchmarks.diagnostics import block_mask_probe
  assert block_mask_probe.main(["--seqs", "256", "--tiles", "16"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 3 and all(" ms" in line for line in lines[1:]), lines


def test_masks_benchmark_skips_what_a_backend_lacks(tmp_path):
  """On the CPU the Mosaic kernels refuse every call (no interpret mode):
  each row is skipped and recorded as absent, not a crash or a timing."""
  from benchmarks import masks
  out = tmp_path / "masks.json"
  assert masks.main(["--implementation", "mosaic", "--seq", "32", "--heads",
                     "2", "--head-dim", "32", "--reps", "1",
                     "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["implementation"] == "mosaic"
  if not compat.has_gpu():
    assert result["records"] == []


def test_masks_benchmark_judges_each_row_by_its_yardstick(tmp_path):
  """`--variants` measures a row with its yardstick (the built-in form of
  the same mask or score change) and records their ratio."""
  from benchmarks import masks
  out = tmp_path / "masks.json"
  assert masks.main(["--seq", "32", "--heads", "2", "--head-dim", "32",
                     "--reps", "1", "--variants", "16 documents as mask_fn",
                     "causal + ALiBi as score_fn", "--out", str(out)]) == 0
  records = {(r["variant"], r["mode"]): r
             for r in json.loads(out.read_text())["records"]}
  assert set(records) == {(v, m) for m in ("fwd", "fwd_bwd") for v in (
      "16 documents (segment ids)", "16 documents as mask_fn",
      "causal + alibi", "causal + ALiBi as score_fn")}
  for mode in ("fwd", "fwd_bwd"):
    row = records["16 documents as mask_fn", mode]
    assert row["against"] == "16 documents (segment ids)"
    assert row["vs_against"] == pytest.approx(
        records["16 documents (segment ids)", mode]["ms"] / row["ms"])


def test_masks_benchmark_keeps_rows_when_cut_short(tmp_path, monkeypatch):
  """Every row is written as it is measured: a run killed by its time
  limit (here: the third timing raises) leaves the rows before it."""
  from benchmarks import common, masks
  out, timed = tmp_path / "masks.json", []

  def time_fn(*_, **__):
    timed.append(1)
    if len(timed) == 3:
      raise KeyboardInterrupt  # what a timeout's signal leaves behind
    return 1.0
  monkeypatch.setattr(common, "time_fn", time_fn)
  with pytest.raises(KeyboardInterrupt):
    masks.main(["--seq", "32", "--heads", "2", "--head-dim", "32",
                "--reps", "1", "--out", str(out)])
  assert len(json.loads(out.read_text())["records"]) == 2
  assert (tmp_path / "masks.md").read_text().count("| fwd |") == 2


def test_masks_benchmark_passes_arrays_as_arguments():
  """A row's arrays (the dense bias and mask, segment ids, slopes) are
  arguments of its jitted program, not constants in it: at 16k x 16 heads
  the bias is 8.6 GB, which lowering would copy into the program."""
  from benchmarks import masks
  table = masks.variants(64, 2)
  for name in ("dense bias", "causal as a dense mask",
               "16 documents (segment ids)", "alibi"):
    fn, inputs = masks.build("fwd", (1, 64, 2, 32), table[name],
                             interpret=True)
    arrays = inputs[-1]
    assert set(arrays) == {n for n, x in table[name].kwargs.items()
                           if isinstance(x, jax.Array)} != set()
    assert "dense<" not in fn.lower(*inputs).as_text().split("func.func")[0]


def test_grid_rounds_interleave_and_keep_the_median(monkeypatch):
  """`--rounds`: a cell's implementations are timed in turn, round after
  round, every other round in reverse; each keeps the median of its rounds; one that fails to build or
  to run is skipped and not timed again."""
  import argparse
  import concurrent.futures
  cell = common.Cell.standard("fwd", 64, 32, False, tokens=128, hidden=64)
  times = {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0], "c": [1.0]}
  calls = []

  def fake_measure(compiled, inputs, *, warmup, reps):
    calls.append(compiled)
    if compiled == "c" and len(times["c"]) == 0:
      raise RuntimeError("c failed in its second round")
    return common.Measurement(times[compiled].pop(0), 1.5)

  def built(value=None, error=None):
    future = concurrent.futures.Future()
    if error is None:
      future.set_result((value, ()))
    else:
      future.set_exception(error)
    return future

  monkeypatch.setattr(common, "measure", fake_measure)
  builds = {"a": built("a"), "b": built("b"), "c": built("c"),
            "d": built(error=ValueError("d did not build"))}
  result = {"skipped": []}
  records = run_grid._time_in_rounds(
      cell, builds, argparse.Namespace(rounds=3, warmup=1, reps=1), result)
  # In turn, every other round reversed (`common.round_order`).
  assert calls == ["a", "b", "c", "c", "b", "a", "a", "b"]
  assert {r.impl: r.ms for r in records} == {"a": 2.0, "b": 5.0}
  assert all(r.peak_gib == 1.5 for r in records)
  assert [(s["impl"], s["reason"].split(":")[0]) for s in result["skipped"]
          ] == [("d", "ValueError"), ("c", "RuntimeError")]


def test_sass_spills_counts_local_accesses_per_register_budget():
  """`benchmarks.diagnostics.sass_spills` attributes each STL/LDL to the
  register budget of the last USETMAXREG above it, per kernel."""
  from benchmarks.diagnostics import sass_spills
  sass = """
        Function : mosaic_flash_backward_dq_dkdv_mosaic_gpu_kernel
        /*0010*/                   STL [R1+0x4], R2 ;
        /*0020*/                   USETMAXREG.TRYALLOC.CTAPOOL R3, 0xe8 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0040*/                   STL.64 [R1+0x8], R4 ;
        /*0050*/                   LDL.64 R4, [R1+0x8] ;
        /*0060*/                   USETMAXREG.DEALLOC.CTAPOOL 24 ;
        /*0070*/                   LDL R6, [R1+0x4] ;
        Function : other_kernel
        /*0010*/                   IADD3 R1, R1, 0x1, RZ ;
  """
  found = sass_spills.spills_by_budget(sass)
  budgets = found["mosaic_flash_backward_dq_dkdv_mosaic_gpu_kernel"]
  assert {b: dict(c) for b, c in budgets.items()} == {
      "launch": {"STL": 1}, "232": {"STL": 1, "LDL": 1}, "24": {"LDL": 1}}
  assert found["other_kernel"] == {}


def test_sass_spills_counts_local_accesses_per_loop(capsys):
  """`--loops`: each branch back to a label above it, long enough, is a
  loop; its STL/LDL/HGMMA counted, nested loops inside outer ones; a short
  backward branch (a barrier's spin) and a forward branch are not loops."""
  from benchmarks.diagnostics import sass_spills
  sass = """
        Function : mosaic_flash_backward_dkdv_mosaic_gpu_kernel
        /*0000*/                   STL [R1+0x4], R2 ;
.L_x_0:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;
        /*0020*/              @!P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
.L_x_2:
        /*0040*/                   LDL R4, [R1+0x4] ;
        /*0050*/                   STL [R1+0x8], R4 ;
        /*0060*/               @P0 BRA `(.L_x_2) ;
        /*0070*/               @P2 BRA `(.L_x_3) ;
        /*0080*/                   LDL R5, [R1+0x8] ;
.L_x_3:
        /*0090*/               @P1 BRA `(.L_x_1) ;
        Function : other_kernel
        /*0000*/                   EXIT ;
  """
  loops = sass_spills.spills_by_loop(sass, min_bytes=0x20)
  got = [(a, b, dict(c)) for a, b, c in
         loops["mosaic_flash_backward_dkdv_mosaic_gpu_kernel"]]
  assert got == [(0x40, 0x60, {"STL": 1, "LDL": 1, "HGMMA": 0}),
                 (0x30, 0x90, {"STL": 1, "LDL": 2, "HGMMA": 1})]
  assert loops["other_kernel"] == []
  with_spin = sass_spills.spills_by_loop(sass, min_bytes=0)
  assert len(with_spin["mosaic_flash_backward_dkdv_mosaic_gpu_kernel"]) == 3


def test_spill_survey_reads_ptxas_reports_per_kernel(monkeypatch):
  """Each kernel ptxas compiled, with its registers and spill bytes, in
  order (a kernel without a properties line left out); a row whose child
  process failed keeps the exception's line, not JAX's note after it."""
  from benchmarks.diagnostics import spill_survey
  report = """
ptxas info    : Compiling entry function 'mosaic_flash_forward_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mosaic_flash_forward_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas warning : Registers are spilled to local memory in function 'k2', 388 bytes spill stores, 456 bytes spill loads
ptxas info    : Compiling entry function 'mosaic_flash_backward_dkdv_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mosaic_flash_backward_dkdv_mosaic_gpu_kernel
    232 bytes stack frame, 388 bytes spill stores, 456 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 232 bytes cumulative stack size
ptxas info    : Compiling entry function 'half_reported' for 'sm_90a'
"""
  got = spill_survey.parse_ptxas(report)
  assert got == [
      dict(kernel="mosaic_flash_forward_mosaic_gpu_kernel", stack=0,
           spill_stores=0, spill_loads=0, registers=168),
      dict(kernel="mosaic_flash_backward_dkdv_mosaic_gpu_kernel", stack=232,
           spill_stores=388, spill_loads=456, registers=168)]
  text = spill_survey.table([dict(row="causal", head_dim=128, kernels=got)])
  assert "| causal | 128 | mosaic_flash_backward_dkdv_mosaic_gpu_kernel | "\
         "168 | 388 | 456 |" in text

  class Done:
    returncode, stdout = 1, ""
    stderr = ("Traceback...\nValueError: no GPU here\n-----\n"
              "For simplicity, JAX has removed its internal frames\n")
  monkeypatch.setattr(spill_survey.subprocess, "run", lambda *a, **k: Done)
  record = spill_survey.survey_one("causal", 4096, 64, "fwd", timeout=5)
  assert record == dict(row="causal", head_dim=64, kernels=[],
                        error="ValueError: no GPU here")


@pytest.mark.parametrize("head_dim, want", [
    (128, ["dQ kernel", "dK/dV pass dk+dv"]),
    (256, ["dQ kernel", "dK/dV pass dk", "dK/dV pass dv"]),
])
def test_backward_breakdown_times_every_piece(head_dim, want, monkeypatch,
                                              capsys):
  """Every piece `flash_attention`'s Mosaic backward runs, as
  `backward.configure` decides them (one dK/dV pass, or two at head_dim
  256), then the peers that import; the kernels are stand-ins here (Mosaic
  needs the GPU)."""
  import jax.numpy as jnp
  from benchmarks import peers
  from benchmarks.diagnostics import backward_breakdown
  from pallas_kernels.mosaic import backward, forward
  monkeypatch.setattr(forward, "mosaic_forward", lambda q, k, v, **kw: (
      q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)))
  monkeypatch.setattr(backward, "launch_dq", lambda q, *a: q)
  monkeypatch.setattr(backward, "launch_dkdv", lambda q, k, v, do, stats,
                      static: [k, v][:len(static.outputs)])
  monkeypatch.setattr(backward, "mosaic_backward",
                      lambda q, k, v, *a, **kw: (q, k, v))

  def unavailable(cell):
    raise peers.Unavailable("not on this machine")

  monkeypatch.setattr(peers, "jax_flash_mosaic", lambda cell: peers.Benchmark(
      lambda q: q, (jnp.zeros(cell.shape),)))
  monkeypatch.setattr(peers, "tokamax_mosaic", unavailable)
  assert backward_breakdown.main(["--seq", "256", "--head-dim",
                                  str(head_dim), "--tokens", "512",
                                  "--hidden", "256", "--reps", "1"]) == 0
  names = [line.split("|")[1].strip() for line in
           capsys.readouterr().out.splitlines()[3:]]
  assert names == ["forward", "row statistics", "delta by XLA", *want,
                   "backward",
                   "jax_flash_mosaic fwd", "jax_flash_mosaic fwd_bwd"]


def test_ncu_summary_reads_both_exports(tmp_path):
  """Nsight Compute's raw page (one row per kernel, a units row) and its
  SASS source page (a block per kernel) become tables: duration in ms
  whatever the unit, stall shares of the samples, the worst instructions
  first."""
  from benchmarks.diagnostics import ncu_summary
  raw = tmp_path / "raw.csv"
  raw.write_text(
      '"ID","Kernel Name","gpu__time_duration.sum",'
      '"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",'
      '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"\n'
      '"","","usecond","%","inst"\n'
      '"0","dkdv_kernel","6,510.5","70.1","2.16"\n'
      '"1","dq_kernel","4190","88.0","2.31"\n')
  table = ncu_summary.metrics_table(str(raw)).splitlines()
  assert table[0] == "| kernel | ms | tensor % | stall barrier |"
  assert table[2] == "| dkdv_kernel | 6.511 | 70.1 | 2.16 |"
  assert table[3] == "| dq_kernel | 4.190 | 88 | 2.31 |"
  sass = tmp_path / "sass.csv"
  columns = ('"Address","Source","Warp Stall Sampling (All Samples)",'
             '"stall_barrier","stall_short_sb","stall_barrier (Not Issued)"\n')
  sass.write_text(
      '"Kernel Name","ours",\n' + columns
      + '"0x1","BRA 0x2","10","10","0","3"\n'
      + '"0x2","FFMA R7, R1, -R10","30","0","30","0"\n'
      + '"Kernel Name","theirs",\n' + columns
      + '"0x1","HGMMA","4","4","0","0"\n')
  report = ncu_summary.stalls_report(str(sass), top=1)
  assert "### ours" in report and "### theirs" in report
  assert "40 samples. By reason: short_sb 75.0%, barrier 25.0%" in report
  assert "| 75.0% | `FFMA R7, R1, -R10` | short_sb 30, barrier 0 |" in report
  assert "BRA" not in report.split("### theirs")[0]  # top=1: only the worst


def test_ncu_summary_phases_cut_at_wgmma_waits(tmp_path):
  """`phases` cuts a kernel's SASS after each wgmma wait: each piece's
  share of the samples, its wait's own share, and what it issues; the
  last piece (no wait) runs to the end; `kernel` picks kernels by name."""
  from benchmarks.diagnostics import ncu_summary
  sass = tmp_path / "sass.csv"
  columns = '"Address","Source","Warp Stall Sampling (All Samples)"\n'
  sass.write_text(
      '"Kernel Name","dkdv",\n' + columns
      + '"0x1","HGMMA.64x128x16.F32.BF16 R88, gdesc[UR4], RZ","5"\n'
      + '"0x2","WARPGROUP.DEPBAR.LE gsb0, 0x1","20"\n'
      + '"0x3","MUFU.EX2 R8, R8","40"\n'
      + '"0x4","@!P1  MUFU.EX2 R9, R9","10"\n'
      + '"0x5","WARPGROUP.DEPBAR.LE gsb0, 0x0","5"\n'
      + '"0x6","@!P1  SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6], R4","10"\n'
      + '"0x7","@UP1  UTMALDG.5D [UR16], [UR6]","10"\n'
      + '"Kernel Name","dq",\n' + columns + '"0x1","EXIT","1"\n')
  report = ncu_summary.phases_report(str(sass), kernel="dkdv")
  assert "### dq" not in report
  lines = [l for l in report.splitlines() if l.startswith("| 0x")]
  assert lines == [
      "| 0x1.. | 2 | 25.0% | 20.0% | HGMMA 1 |",
      "| 0x3.. | 3 | 55.0% | 5.0% | MUFU 2 |",
      "| 0x6.. | 2 | 20.0% | - | mbarrier wait 1, TMA load 1 |"]


def test_ncu_summary_opcodes_count_each_kernels_instructions(tmp_path):
  """`opcodes` sums each kernel's executed warp instructions by opcode
  (predicate and modifiers dropped), the most frequent first, and leaves
  XLA's fusions out unless a kernel is named."""
  from benchmarks.diagnostics import ncu_summary
  sass = tmp_path / "sass.csv"
  columns = '"Address","Source","Instructions Executed"\n'
  sass.write_text(
      '"Kernel Name","attention_kernel",\n' + columns
      + '"0x1","LOP3.LUT R4, R4, R5, RZ, 0x3c, !PT","300"\n'
      + '"0x2","@!P1  MUFU.EX2 R9, R9","100"\n'
      + '"0x3","LOP3.LUT P0, RZ, R4, 0x1, RZ, 0xc0, !PT","300"\n'
      + '"0x4","IMAD R4, R4, -0x7a143595, RZ","",\n'
      + '"Kernel Name","loop_add_fusion",\n' + columns
      + '"0x1","IADD3 R1, R1, 0x1, RZ","7"\n')
  report = ncu_summary.opcodes_report(str(sass), top=2)
  assert "loop_add_fusion" not in report
  lines = [l for l in report.splitlines() if l.startswith("| ") and "%" in l]
  assert lines == ["| LOP3 | 600 | 85.7% |", "| MUFU | 100 | 14.3% |"]
  assert "| IADD3 | 7 | 100.0% |" in ncu_summary.opcodes_report(
      str(sass), kernel="fusion")


def test_timing_probe_times_each_sample_length_in_turn(tmp_path, monkeypatch):
  """`benchmarks.diagnostics.timing_probe` times every implementation of a
  cell at each sample length, in rounds (A B, B A, A B, ...), keeps the median per
  implementation, and its table gives each one's ratio to the fastest of
  the others; an implementation that cannot run is left out."""
  import types
  from benchmarks import peers
  from benchmarks.diagnostics import timing_probe
  built = lambda name: (lambda cell: types.SimpleNamespace(fn=name, args=()))
  monkeypatch.setattr(peers, "cudnn", built("cudnn"))
  monkeypatch.setattr(peers, "xla", built("xla"))

  def unavailable(cell):
    raise peers.Unavailable("not here")
  monkeypatch.setattr(peers, "tokamax_mosaic", unavailable)
  monkeypatch.setattr(common, "compile_benchmark",
                      lambda build: (build()[0], ()))
  # (name, sample_ms) -> the ms each of three rounds reads, in order.
  reads = {("cudnn", 2.0): [2.0, 9.0, 4.0], ("xla", 2.0): [1.0, 1.0, 1.0],
           ("cudnn", 50.0): [1.0, 1.0, 1.0], ("xla", 50.0): [3.0, 2.0, 2.0]}
  calls = []

  def fake_time_fn(name, *inputs, min_sample_ms, max_inner):
    calls.append((name, min_sample_ms))
    return reads[(name, min_sample_ms)].pop(0)
  monkeypatch.setattr(common, "time_fn", fake_time_fn)
  out = str(tmp_path / "probe.json")
  assert timing_probe.main(["--cells", "fwd:1024:64", "--impls", "cudnn",
                            "xla", "tokamax_mosaic", "--out", out]) == 0
  in_turn = lambda ms: [("cudnn", ms), ("xla", ms), ("xla", ms),
                        ("cudnn", ms), ("cudnn", ms), ("xla", ms)]
  assert calls == in_turn(2.0) + in_turn(50.0)
  rows = json.load(open(out))["rows"]
  assert {(r["impl"], r["sample_ms"]): r["ms"] for r in rows} == {
      ("cudnn", 2.0): 4.0, ("xla", 2.0): 1.0, ("cudnn", 50.0): 1.0,
      ("xla", 50.0): 2.0}
  text = open(out.removesuffix(".json") + ".md").read()
  assert "| fwd full d64 s1024 | 2 |" in text and "(0.25)" in text
  assert "(4.00)" in text and "| cell | sample ms | cudnn | xla |" in text


def test_order_probe_times_each_implementation_after_each_condition(
    tmp_path, monkeypatch):
  """`benchmarks.diagnostics.order_probe` times each implementation right
  after the cell's matmul, an idle pause and itself, conditions and implementations
  interleaved over the rounds; its table gives each condition's median,
  the ratio to the best other implementation under the same condition,
  and the first sample's lag."""
  import types
  from benchmarks import peers
  from benchmarks.diagnostics import order_probe
  built = lambda name: (lambda cell: types.SimpleNamespace(fn=name, args=()))
  for name in ("cudnn", "xla", "matmul"):
    monkeypatch.setattr(peers, name, built(name))
  monkeypatch.setattr(common, "compile_benchmark",
                      lambda build: (build()[0], ()))
  events = []
  monkeypatch.setattr(order_probe.time, "sleep",
                      lambda s: events.append(("sleep", s)))
  # Each implementation reads 1 ms a call, cudnn 2 ms right after the
  # matmul, and xla's first sample is twice its others.
  last = {"name": None}

  def fake_samples(name, *inputs, reps=10, **kwargs):
    events.append((name, reps))
    slow = name == "cudnn" and last["name"] == "matmul"
    last["name"] = name
    first = 2.0 if name == "xla" else 1.0
    return [first * (2.0 if slow else 1.0)] + [2.0 if slow else 1.0] * 9
  monkeypatch.setattr(common, "time_samples", fake_samples)
  out = str(tmp_path / "probe.json")
  assert order_probe.main(["--cells", "fwd:1024:64", "--impls", "cudnn",
                           "xla", "--rounds", "2", "--heat-ms", "100",
                           "--idle-s", "0.5", "--out", out]) == 0
  one_round = [("matmul", 5), ("cudnn", 10), ("matmul", 5), ("xla", 10),
               ("sleep", 0.5), ("cudnn", 10), ("sleep", 0.5), ("xla", 10),
               ("cudnn", 10), ("cudnn", 10), ("xla", 10), ("xla", 10)]
  assert events == one_round * 2
  rows = json.load(open(out))["rows"]
  assert len(rows) == 12 and {r["round"] for r in rows} == {0, 1}
  text = open(out.removesuffix(".json") + ".md").read()
  flops = common.Cell.standard("fwd", 1024, 64, False).flops
  fast, slow = f"{flops / 1e9:.0f}", f"{flops / 2e9:.0f}"
  assert f"| fwd full d64 s1024 | cudnn | matmul | {slow} (0.500) | 1.000 |" \
      in text
  assert f"| fwd full d64 s1024 | cudnn | idle | {fast} (1.000) | 1.000 |" \
      in text
  assert f"| fwd full d64 s1024 | xla | matmul | {fast} (2.000) | 2.000 |" \
      in text


def test_time_samples_settles_before_sampling(monkeypatch):
  """Before its samples, `timing.time_samples` (the one timer, re-exported
  by `benchmarks.common`) runs the function untimed for `settle_ms` (whole
  samples, so that the clocks follow its own power draw); by default only
  on a GPU. A fake clock: each call takes 1 ms."""
  from jax_flash import timing
  assert common.time_samples is timing.time_samples
  clock = {"s": 0.0, "calls": 0}
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["s"])

  def fn():
    clock["s"] += 1e-3
    clock["calls"] += 1
    return 0.0  # block_until_ready passes it through
  timed = lambda **kw: timing.time_samples(fn, warmup=2, reps=3,
                                           min_sample_ms=4.0, **kw)
  # 2 warm-up calls, 1 single call (1 ms, so samples of 4 calls), then
  # three 4-ms samples to settle 10 ms, then the three timed samples.
  assert timed(settle_ms=10.0) == pytest.approx([1.0, 1.0, 1.0])
  assert clock["calls"] == 2 + 1 + 3 * 4 + 3 * 4
  clock["calls"] = 0
  assert timed(settle_ms=0.0) == pytest.approx([1.0, 1.0, 1.0])
  assert clock["calls"] == 2 + 1 + 3 * 4
  # By default: no settling off a GPU, SETTLE_MS on one.
  for backend, settle_samples in (("cpu", 0), ("gpu", 63)):
    monkeypatch.setattr(timing.jax, "default_backend", lambda: backend)
    clock["calls"] = 0
    timed()
    assert timing.SETTLE_MS == 250.0
    assert clock["calls"] == 2 + 1 + settle_samples * 4 + 3 * 4, backend


def test_determinism_counts_distinct_results(tmp_path, monkeypatch):
  """`benchmarks.determinism` counts one bit pattern for a deterministic
  implementation (XLA's attention on the CPU) and one per run for a fake
  peer whose dq drifts by 2^-20 each run, with the largest difference."""
  from benchmarks import determinism, peers
  import jax.numpy as jnp
  import numpy as np
  calls = []

  def drifting(cell, *, interpret=False):
    def fn(q):
      calls.append(None)
      return (q + np.float32(2.0**-20) * len(calls), q, q)
    return peers.Benchmark(fn, (jnp.ones((2, 2), jnp.float32),))

  monkeypatch.setitem(peers.PEERS, "drifting", drifting)
  out = tmp_path / "determinism.json"
  assert determinism.main(["--impls", "xla", "drifting", "--seq", "256",
                           "--head-dim", "64", "--tokens", "512",
                           "--runs", "3", "--out", str(out)]) == 0
  records = json.loads(out.read_text())["records"]
  assert [r["distinct_results"] for r in records] == [1, 3]
  assert records[1]["largest_difference"] == pytest.approx(2 * 2.0**-20)


def test_row_sum_rounding_emulates_the_kernels_within_the_rule():
  """`diagnostics.row_sum_rounding`: its emulated forward and FlashAttention-2
  backward (bf16 P, the exact row sum and the rounded one) are within the
  tests' 2x rule of float64 against the plain bf16 computation, so its
  table measures the sums and not a wrong emulation (a backward without
  the scale, or P recomputed from the wrong LSE, is far outside)."""
  from benchmarks.diagnostics import row_sum_rounding
  errors = row_sum_rounding.errors(seed=1)
  yardstick = errors.pop("plain bf16")
  for form, row in errors.items():
    for name, ours, bound in zip(("O", "LSE", "dQ", "dK", "dV"), row,
                                 yardstick):
      assert ours <= 2 * bound + 1e-3, (form, name, ours, bound)
