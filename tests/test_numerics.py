"""jax_flash.numerics, and the numerics notebook executed end to end."""
from __future__ import annotations

import functools
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import numerics

REPO = pathlib.Path(__file__).resolve().parents[1]


def jnp_attention_and_grads(q, k, v, d_out, *, is_causal, mask):
  """jax.nn attention in float32 with exact dots, and its VJP."""
  def attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, mask=mask,
                                        is_causal=is_causal)
  with jax.default_matmul_precision("highest"):
    out, pullback = jax.vjp(attention, q, k, v)
    return out, pullback(d_out)


def test_float64_reference_matches_autodiff():
  """The hand-written float64 backward against JAX's autodiff (GQA, causal,
  mask, q_len != kv_len)."""
  case = numerics.Case(dtype="float32", q_len=7, kv_len=11, head_dim=16,
                       num_heads=4, num_kv_heads=2, batch=2, is_causal=True)
  q, k, v, d_out = case.inputs(seed=0)
  keep = jax.random.bernoulli(jax.random.key(1), 0.7, (2, 4, 7, 11))
  keep = keep | jnp.eye(7, 11, dtype=bool)  # no empty rows: jax.nn differs
  out, grads = jnp_attention_and_grads(q, k, v, d_out, is_causal=True,
                                       mask=keep)
  ref_out, ref_grads = numerics.attention_float64(
      q, k, v, d_out, is_causal=True, mask=np.asarray(keep))
  for actual, expected in zip((out, *grads), (ref_out, *ref_grads)):
    assert numerics.error_stats(actual, expected).max_abs < 2e-6


def test_error_stats():
  stats = numerics.error_stats(jnp.array([1.0, 2.5, -1.0]),
                               np.array([1.0, 2.0, -2.0]))
  assert stats.max_abs == 1.0
  assert stats.mean_abs == pytest.approx(0.5)
  assert stats.max_rel == pytest.approx(0.5)  # 1 / max|ref|
  assert stats.mean_rel == pytest.approx(0.5 / (5 / 3))
  assert math.isnan(numerics.error_stats(jnp.array([jnp.nan]),
                                         np.array([0.0])).max_abs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_naive_attention_is_plain_attention(dtype):
  case = numerics.Case(dtype=dtype, q_len=9, head_dim=16, num_heads=4,
                       num_kv_heads=1, is_causal=True)
  q, k, v, _ = case.inputs(seed=2)
  expected = numerics.attention_float64(q, k, v, is_causal=True)
  out = numerics.naive_attention(q, k, v, is_causal=True)
  assert out.dtype == jnp.dtype(dtype)
  tol = 1e-6 if dtype == "float32" else 3e-2
  assert numerics.error_stats(out, expected).max_abs < tol


def test_sweep_rows_and_the_two_x_rule():
  implementations = {"jax_flash": jax_flash.flash_attention}
  cases = [numerics.Case(dtype=d, q_len=33, head_dim=16, num_heads=2)
           for d in ("float16", "bfloat16")]
  rows = numerics.sweep(implementations, cases)
  assert len(rows) == len(cases) * 2 * len(numerics.TENSORS)
  for row in rows:
    assert row["error"] is None
    if row["implementation"] == "naive":
      assert row["ratio"] == pytest.approx(1.0)
    else:
      assert row["max_abs"] <= 2 * row["naive_max_abs"] + 1e-5, row
  table = numerics.format_table(rows, ["implementation", "dtype", "tensor",
                                       "max_abs", "ratio"])
  assert len(table.splitlines()) == len(rows) + 1


def test_sweep_records_unsupported_cases():
  def float32_only(q, k, v, *, is_causal=False):
    if q.dtype != jnp.float32:
      raise NotImplementedError("float32 only")
    return jax_flash.flash_attention(q, k, v, is_causal=is_causal)

  rows = numerics.sweep({"f32": float32_only},
                        [numerics.Case(dtype="bfloat16", q_len=8,
                                       head_dim=16)])
  refused = [r for r in rows if r["implementation"] == "f32"]
  assert refused and all(r["error"] == "float32 only" for r in refused)
  assert all(math.isnan(r["max_abs"]) for r in refused)


@pytest.mark.parametrize("implementation", [None, "triton"])
def test_fully_masked_rows_stay_finite_and_zero(implementation):
  attention = functools.partial(jax_flash.flash_attention,
                                implementation=implementation)
  result = numerics.fully_masked_rows(attention)
  assert result["all_finite"]
  assert result["empty_row_max_abs_out"] == 0.0
  assert result["empty_row_max_abs_dq"] == 0.0
  assert result["other_rows_max_abs_err"] < 1e-5


@pytest.mark.slow  # CI's ten minutes (33 s); the GPU round executes it
# at full size and commits its outputs (`h200_check.sh notebook`)
def test_notebook_executes(monkeypatch):
  """The notebook runs top to bottom at its `small` size on this machine."""
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  monkeypatch.setenv("JAX_FLASH_NOTEBOOK_SIZE", "small")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  notebook = nbformat.read(REPO / "notebooks" / "numerics.ipynb",
                           as_version=4)
  client = nbclient.NotebookClient(
      notebook, timeout=300, kernel_name="python3",
      resources={"metadata": {"path": str(REPO / "notebooks")}})
  client.execute()
  outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
  text = "".join(out.get("text", "") for out in outputs)
  assert "size 'small'" in text
  assert "all_finite': True" in text or "skipped" in text
  assert sum("image/png" in out.get("data", {}) for out in outputs) == 2
