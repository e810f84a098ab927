"""`python -m benchmarks.decode` at smoke size on the CPU: XLA's paths are
timed, the GPU-only implementations skip with a reason, and the JSON, table
and plot are written."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import decode, peers
from pallas_kernels import compat

# Its module-scoped fixtures (a child process, a trained model) are built
# once: every test of the file runs in one xdist worker (pyproject).
pytestmark = pytest.mark.xdist_group("test_benchmark_decode")

# DESIGN.md section 5's fields of a decode record.
RECORD_FIELDS = {"impl", "batch", "q_len", "kv_len", "num_heads",
                 "num_kv_heads", "head_dim", "page_size", "us", "gbps"}
GPU_ONLY = {"cudnn", "cudnn_paged", "pallas_decode", "pallas_paged",
            "jax_flash_triton", "jax_flash_mosaic", "jax_flash_paged_triton",
            "jax_flash_paged_mosaic"}


def _cell(entry: dict) -> tuple:
  return (entry["impl"], entry["batch"], entry["kv_len"], entry["q_len"],
          entry["page_size"], entry["lengths"])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("decode") / "decode")
  assert decode.main(["--smoke", "--out", out]) == 0
  with open(out + ".json") as f:
    return out, json.load(f)


def test_every_cell_is_measured_or_skipped(smoke):
  _, result = smoke
  assert {"device", "jax_version", "command", "records", "skipped"} <= set(
      result)
  assert "benchmarks.decode --smoke" in result["command"]
  measured = {_cell(r) for r in result["records"]}
  skipped = {_cell(s) for s in result["skipped"]}
  assert not measured & skipped
  cells = [decode.parse_cell(c) for c in decode.SMOKE_CELLS]
  expected = {
      (impl, batch, kv_len, q_len, page, "ragged" if ragged else "full")
      for batch, kv_len, ragged in cells for q_len in decode.SMOKE["q_lens"]
      for page in decode.SMOKE["page_sizes"]
      for impl in decode.implementations(page > 0)}
  assert measured | skipped == expected
  if not compat.has_gpu():
    assert {c[0] for c in measured} == {"jax_flash", "jax_flash_paged", "xla"}
    assert all(s["impl"] in GPU_ONLY and "GPU" in s["reason"]
               for s in result["skipped"])


def test_records_follow_the_schema(smoke):
  _, result = smoke
  for record in result["records"]:
    assert RECORD_FIELDS <= set(record)
    assert record["us"] > 0
    # GB/s counts the K and V bytes of the valid positions only.
    if record["lengths"] == "full":
      nbytes = (2 * record["batch"] * record["kv_len"] * record["num_kv_heads"]
                * record["head_dim"] * 2)
      assert record["gbps"] == pytest.approx(nbytes / record["us"] / 1e3)
    assert record["max_diff"] < decode.SUSPECT_DIFF, record
    if record["impl"] in decode.OURS.values():
      assert record["implementation"] == ("triton" if compat.has_gpu()
                                          else "xla")


def test_table_and_plot_are_written(smoke):
  out, result = smoke
  assert os.path.getsize(out + ".png") > 0
  with open(out + ".md") as f:
    text = f.read()
  for part in ("## q_len 1", "## q_len 4", "jax_flash[_paged] µs (GB/s)",
               "xla µs (GB/s)", "ours / best peer", "paged / dense (ours)",
               "## Skipped", "implementation=None ran"):
    assert part in text, part
  headers, rows = decode.decode_table(result, 1)
  # A dense and a paged row per cell.
  assert len(rows) == 2 * len(decode.SMOKE_CELLS)
  assert all(len(row) == len(headers) for row in rows)


def test_time_budget_leaves_a_valid_file(tmp_path):
  out = str(tmp_path / "cut")
  assert decode.main(["--smoke", "--out", out, "--time-budget", "0",
                      "--cells", "2x64"]) == 0
  with open(out + ".json") as f:
    result = json.load(f)
  assert result["records"] == [] and result["unmeasured"]
  with open(out + ".md") as f:
    assert "Not measured (time budget)" in f.read()


def test_paged_cache_holds_the_dense_rows():
  cell = decode.DecodeCell(batch=3, kv_len=64, q_len=1, page_size=16,
                           ragged=False, num_heads=4, num_kv_heads=2,
                           head_dim=8, dtype="float32")
  seqs = decode.make_sequences(cell, seed=1)
  paged = decode.cache_inputs(cell, seqs, seed=1)
  tables = np.asarray(paged.tables)
  assert sorted(tables.ravel()) == list(range(3 * 4))  # a permutation
  assert not np.array_equal(tables.ravel(), np.arange(12))  # shuffled
  for b in range(3):
    for i in range(4):
      np.testing.assert_array_equal(
          paged.key[tables[b, i]], seqs.key[b, 16 * i:16 * (i + 1)])
      np.testing.assert_array_equal(
          paged.value[tables[b, i]], seqs.value[b, 16 * i:16 * (i + 1)])


def test_folded_rows_stay_with_their_kv_head():
  """The Pallas peers see q_len rows as more query heads: each KV head's
  rows together, and unfolding restores the layout."""
  b, t, h, d, kv_heads = 2, 4, 8, 3, 2
  query = jnp.arange(b * t * h * d, dtype=jnp.float32).reshape(b, t, h, d)
  folded = decode._fold_rows(query, kv_heads)
  assert folded.shape == (b, kv_heads * t * (h // kv_heads), d)
  grouped = folded.reshape(b, kv_heads, t * (h // kv_heads), d)
  for kv in range(kv_heads):
    heads = range(kv * (h // kv_heads), (kv + 1) * (h // kv_heads))
    want = {tuple(np.asarray(query[0, i, j])) for i in range(t) for j in heads}
    assert {tuple(np.asarray(row)) for row in grouped[0, kv]} == want
  np.testing.assert_array_equal(
      decode._unfold_rows(folded, query.shape, kv_heads), query)


def test_cells_and_implementations_are_read_as_documented():
  assert decode.parse_cell("8x32k") == (8, 32768, False)
  assert decode.parse_cell("16x1000:ragged") == (16, 1000, True)
  with pytest.raises(Exception):
    decode.parse_cell("8by32k")
  assert decode.forced_implementation("jax_flash_paged_triton") == "triton"
  assert decode.forced_implementation("jax_flash_mosaic") == "mosaic"
  assert decode.forced_implementation("jax_flash_paged") is None
  assert peers.implementation_run(
      'stablehlo.custom_call @mosaic_gpu_v2(%0)') == "mosaic"
  assert peers.implementation_run(
      'stablehlo.custom_call @__gpu$xla.gpu.triton(%0)') == "triton"
  # A path in the text is not a kernel.
  assert peers.implementation_run(
      'loc("jax/_src/pallas/mosaic_gpu/x.py") stablehlo.dot') == "xla"


@pytest.mark.parametrize("q_len,page_size,ragged", [
    (1, 0, False), (4, 0, True), (1, 16, True), (4, 64, False)])
def test_pallas_peers_compute_the_decode_step(q_len, page_size, ragged):
  """JAX's Pallas kernels as the benchmark calls them (interpret mode):
  the last query row equals the oracle's (the earlier rows of a q_len 4
  step are non-causal there, by design)."""
  cell = decode.DecodeCell(batch=2, kv_len=512, q_len=q_len,
                           page_size=page_size, ragged=ragged, num_heads=8,
                           num_kv_heads=2, head_dim=64, dtype="float32")
  seqs = decode.make_sequences(cell, seed=2)
  peer = decode.pallas_paged if cell.paged else decode.pallas_decode
  fn, args = peer(cell, decode.cache_inputs(cell, seqs, seed=2),
                  interpret=True)
  out = fn(*args)
  assert out.shape == seqs.query.shape
  want = decode.oracle_last_row(seqs)
  np.testing.assert_allclose(out[:, -1], want, atol=1e-5)
