"""`python -m benchmarks.models` at smoke size on the CPU: every cell and
implementation is measured or skipped with a reason, the JSON, table and
plot are written; the cell table covers issue 38's kinds; the FLOP count
is checked by hand and against jax_flash's own masks."""
from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from benchmarks import common, models
from pallas_kernels import compat

# Its module-scoped fixture (the smoke run) is built once: every test of
# the file runs in one xdist worker (pyproject).
pytestmark = pytest.mark.xdist_group("test_benchmark_models")

# The grid's record fields (run_grid) and the suite's own.
RECORD_FIELDS = {"impl", "mode", "seq_len", "head_dim", "causal", "dtype",
                 "batch", "num_heads", "ms", "tflops", "peak_gib", "name",
                 "num_kv_heads", "window", "soft_cap", "documents", "padded",
                 "attended_pairs", "dense_tflops", "implementation",
                 "max_diff", "rel_diff"}
CPU_IMPLS = {"jax_flash", "jax_flash_triton", "xla", "matmul"}
# The end-to-end run's cells: the masks whose peers and skips differ (the
# other smoke cells' counts and peers are checked one by one below).
RUN_CELLS = ("window4k_causal_32k", "softcap_d256_window4k_8k",
             "packed_docs_causal_8k", "padded_lengths_causal_2k")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("models") / "models.json")
  assert models.main(["--smoke", "--cells", *RUN_CELLS, "--out", out]) == 0
  with open(out) as f:
    return out, json.load(f)


def test_every_cell_is_measured_or_skipped(smoke):
  _, result = smoke
  assert {"device", "jax_version", "command", "records", "skipped"} <= set(
      result)
  assert "benchmarks.models --smoke" in result["command"]
  key = lambda e: (e["name"], e["mode"], e["impl"])
  measured = [key(r) for r in result["records"]]
  skipped = [key(s) for s in result["skipped"]]
  assert len(set(measured + skipped)) == len(measured) + len(skipped)
  assert set(measured + skipped) == {
      (name, mode, impl) for name in RUN_CELLS
      for mode in ("fwd", "fwd_bwd") for impl in models.IMPLS}
  assert all(s["reason"] for s in result["skipped"])
  if not compat.has_gpu():
    assert {k[2] for k in measured} == CPU_IMPLS
    for s in result["skipped"]:  # a GPU-only peer, or no soft cap in jax.nn
      assert "GPU" in s["reason"] or (s["soft_cap"]
                                      and "logits_soft_cap" in s["reason"]), s


def test_records_follow_the_schema(smoke):
  _, result = smoke
  for r in result["records"]:
    assert RECORD_FIELDS <= set(r), RECORD_FIELDS - set(r)
    assert r["ms"] > 0 and r["tflops"] > 0
    assert r["tflops"] == pytest.approx(r["flops"] / r["ms"] / 1e9)
    if r["impl"] != models.CEILING:
      cell = models.smoke_cell(models.CELLS_BY_NAME[r["name"]])
      assert r["num_kv_heads"] == cell.num_kv_heads
      assert r["flops"] == models.work_flops(cell, r["attended_pairs"],
                                             r["mode"])
    if r["impl"] not in ("jax_flash", models.CEILING):
      # The same computation as jax_flash's, up to bf16 rounding.
      assert r["rel_diff"] < models.SUSPECT_DIFF, r
  if not compat.has_gpu():  # implementation=None runs XLA on a CPU
    assert {r["implementation"] for r in result["records"]
            if r["impl"] == "jax_flash"} == {"xla"}


def test_table_and_plot_are_written(smoke, tmp_path):
  out, result = smoke
  stem = out.removesuffix(".json")
  assert os.path.getsize(stem + ".png") > 0
  with open(stem + ".md") as f:
    text = f.read()
  for part in ("## fwd\n", "## fwd_bwd", "Geometric mean of ours / best peer",
               "ours / best", "largest rel_diff", "## Skipped",
               "packed_docs_causal_8k"):
    assert part in text, part
  headers, rows = models.mode_table(result, "fwd")
  assert len(rows) == len(RUN_CELLS)
  assert all(len(row) == len(headers) for row in rows)
  # --render alone writes them again from the JSON.
  os.remove(stem + ".md")
  assert models.main(["--render", out]) == 0
  assert os.path.exists(stem + ".md")


def test_time_budget_leaves_a_valid_file(tmp_path):
  out = str(tmp_path / "cut.json")
  assert models.main(["--smoke", "--out", out, "--time-budget", "0",
                      "--cells", "short_bert_512"]) == 0
  with open(out) as f:
    result = json.load(f)
  assert result["records"] == [] and result["unmeasured"] == [
      "short_bert_512"]
  with open(out.removesuffix(".json") + ".md") as f:
    assert "Not measured (time budget)" in f.read()


def test_cells_cover_the_kinds_of_issue_38():
  cells = models.CELLS
  assert len(cells) >= 12 and len(models.CELLS_BY_NAME) == len(cells)
  for kind in ("gqa", "window", "softcap", "packed", "dim", "ragged", "mqa",
               "short", "padded"):
    assert any(kind in c.name for c in cells), kind
  gqa = {(c.num_heads, c.num_kv_heads) for c in cells
         if c.head_dim == 128 and c.causal and c.num_kv_heads == 8}
  assert {(32, 8), (64, 8)} <= gqa
  assert {4096, 32768} <= {c.seq_len for c in cells if "gqa" in c.name}
  assert any(c.window == 4096 and c.seq_len == 32768 for c in cells)
  gemma = [c for c in cells if c.soft_cap and c.head_dim == 256]
  assert {c.window for c in gemma} == {None, 4096}  # local and global layers
  assert any(c.documents > 1 for c in cells)
  assert any(c.num_kv_heads == 1 for c in cells)
  assert {96, 160, 192} <= {c.head_dim for c in cells}
  assert {1000, 5000, 12000} <= {c.seq_len for c in cells
                                 if c.causal and c.seq_len % 128}
  # and off the 8-row TMA tiling (read in place as column tiles at d=128)
  assert any(c.causal and c.seq_len % 8 and c.head_dim == 128 for c in cells)
  assert any(c.batch >= 32 and c.seq_len <= 1024 for c in cells)
  for c in cells:  # a cell's fwd+bwd well under a second on an H200
    assert 16_000 <= c.batch * c.seq_len <= 64 * 1024, c.name
    assert c.num_heads % c.num_kv_heads == 0, c.name


def test_attended_pairs_by_hand():
  cell = models.ModelCell("t", "", batch=1, seq_len=4, num_heads=2,
                          num_kv_heads=1, head_dim=8)
  # A causal window of 2 keys: rows see 1, 2, 2, 2 keys.
  window = dataclasses.replace(cell, window=2)
  assert models.attended_pairs(window) == 7
  assert models.work_flops(window, 7, "fwd") == 4 * 7 * 2 * 8
  assert models.work_flops(window, 7, "fwd_bwd") == 3.5 * 4 * 7 * 2 * 8
  # Two causal documents of 2 tokens: 1 + 2 + 1 + 2.
  assert models.attended_pairs(cell, segment_ids=[[0, 0, 1, 1]]) == 6
  # Length 3, causal: 1 + 2 + 3, and the padded row sees nothing.
  assert models.attended_pairs(cell, lengths=[3]) == 6
  full = dataclasses.replace(cell, causal=False)
  assert models.attended_pairs(full) == 16
  assert models.attended_pairs(full, lengths=[3]) == 9
  # FlashAttention's count (DESIGN section 5) halves causal: T²/2, not
  # T(T+1)/2; the two agree without a mask.
  assert models.attended_pairs(cell) == 10
  assert models.work_flops(full, 16, "fwd") == common.attention_flops(
      1, 4, 4, 2, 8, False, "fwd")


@pytest.mark.parametrize("name", models.SMOKE_CELLS)
def test_attended_pairs_are_jax_flashs_masks(name):
  """With q = 0 every kept logit is 0, so a row's logsumexp is the log of
  the number of keys it attends to: the count from jax_flash's own masks."""
  cell = dataclasses.replace(models.smoke_cell(models.CELLS_BY_NAME[name]),
                             dtype="float32")
  inputs = models.make_inputs(cell, seed=3)
  _, lse = jax_flash.attention_reference(
      jnp.zeros_like(inputs.q), inputs.k, inputs.v, is_causal=cell.causal,
      local_window_size=cell.window_size, logits_soft_cap=cell.soft_cap,
      segment_ids=inputs.segment_ids, query_seq_lengths=inputs.lengths,
      key_value_seq_lengths=inputs.lengths, return_residual=True)
  counted = float(jnp.sum(jnp.exp(lse))) / cell.num_heads
  assert counted == pytest.approx(
      models.attended_pairs(cell, inputs.segment_ids, inputs.lengths),
      rel=1e-5)


@pytest.mark.parametrize("name", [n for n in models.SMOKE_CELLS
                                  if not models.CELLS_BY_NAME[n].soft_cap])
def test_xla_peer_attends_to_the_same_keys(name):
  """jax.nn's window is (left, right) with cuDNN's length left + 1: the
  peer's call on the cell matches jax_flash's in float32, rows past a
  padded length left out (there jax.nn gives the mean of V, jax_flash 0)."""
  cell = dataclasses.replace(models.smoke_cell(models.CELLS_BY_NAME[name]),
                             dtype="float32")
  inputs = models.make_inputs(cell, seed=4)
  args = (*inputs[:3], inputs.segment_ids, inputs.lengths)
  ours = models.IMPLS["jax_flash"](cell, "fwd", True)(*args)
  peer = models.IMPLS["xla"](cell, "fwd", True)(*args)
  rows = (np.ones(ours.shape[:2], bool) if inputs.lengths is None
          else np.asarray(models.valid_rows(inputs.lengths, cell.seq_len)))
  np.testing.assert_allclose(np.asarray(peer)[rows], np.asarray(ours)[rows],
                             atol=2e-5)
