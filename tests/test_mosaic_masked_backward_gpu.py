"""The masked Mosaic backward on an sm90 GPU (`-m gpu`): dq, dk, dv of
every mask and score change against the reference, ALiBi's column terms,
the folded cap, determinism and empty rows, and dropout's bits against the
Triton kernels'. Its CPU checks (plans, the algorithm in jnp, lowering)
are in test_mosaic_masked_backward.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import masking, validation
from pallas_kernels import compat as versions
from tests.attention_checks import (ALIBI_SLOPES, TRITON_BACKWARD, Case,
                                    blocks_and_stripes,
                                    check_against_reference,
                                    masked_backward_kernels, position_score,
                                    random_inputs)

try:
  from pallas_kernels.mosaic import attention as mosaic_attention_module
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)


# ---------------------------------------------------------------------------
# On an sm90 GPU: gradients against the reference.


@pytest.fixture(autouse=True)
def _cap_on_the_masked_backward(monkeypatch):
  """This module tests the masked backward: a soft cap alone would take
  the plain backward kernels (`plan.PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS`;
  their GPU test is in test_mosaic_lowering.py)."""
  from pallas_kernels.mosaic import plan
  monkeypatch.setattr(plan, "PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS", ())


def _require_sm90():
  if (versions.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic backward needs sm90 (wgmma, TMA, setmaxnreg)")


def _document_ids(batch, length, document):
  return jnp.repeat(jnp.arange(-(-length // document), dtype=jnp.int32),
                    document)[None, :length].repeat(batch, 0)


_GPU_VARIANTS = {
    "causal window": (Case(2, 1000, 1000, 4, 2, 128),
                      dict(is_causal=True, local_window_size=(300, 0))),
    "bottom-right causal": (Case(2, 500, 2047, 8, 2, 64),
                            dict(is_causal=True,
                                 q_offset=jnp.array([1547, 100]))),
    "ragged lengths": (Case(2, 777, 1100, 4, 1, 256),
                       dict(query_seq_lengths=jnp.array([700, 0]),
                            key_value_seq_lengths=jnp.array([1100, 333]))),
    "segments": (Case(2, 1024, 1000, 4, 2, 128),
                 dict(segment_ids=(_document_ids(2, 1024, 300),
                                   _document_ids(2, 1000, 250)))),
    "soft cap, d=96": (Case(1, 777, 1100, 8, 2, 96),
                       dict(is_causal=True, logits_soft_cap=20.0)),
    "alibi": (Case(2, 500, 2047, 8, 2, 64),
              dict(is_causal=True, q_offset=jnp.array([1547, 100]),
                   alibi_slopes=ALIBI_SLOPES)),
    "alibi soft cap, d=96": (Case(1, 777, 1100, 8, 2, 96),
                             dict(logits_soft_cap=20.0,
                                  alibi_slopes=ALIBI_SLOPES[0])),
    # A score_fn of (b, h, q_idx, kv_idx), GQA 4:1, bottom-right causal.
    "score_fn": (Case(2, 500, 2047, 8, 2, 64),
                 dict(is_causal=True, q_offset=jnp.array([1547, 100]),
                      score_fn=position_score)),
    # A mask_fn of (b, h, q_idx, kv_idx) whose tiles differ per head,
    # GQA 4:1 (no K/V copies at this size), causal and ragged.
    "mask_fn": (Case(2, 1000, 1100, 8, 2, 128),
                dict(is_causal=True, mask_fn=blocks_and_stripes)),
    # A dense mask per batch: causal, and past the diagonal documents of
    # 300 queries (tiles full, empty and partial; dK/dV from its
    # transpose).
    "dense mask": (Case(2, 1000, 1000, 8, 2, 128),
                   dict(mask=(jnp.arange(1000)[:, None] >= jnp.arange(1000))
                        & ((jnp.arange(1000)[:, None] // 300
                            == jnp.arange(1000) // 300)
                           | (jnp.arange(2)[:, None, None] == 0))[:, None])),
    # The reference drops the same weights (`masking.dropout_keep`).
    "dropout": (Case(2, 1000, 1537, 8, 2, 128),
                dict(is_causal=True, dropout_rate=0.1,
                     dropout_rng=jax.random.key(5))),
    "dropout, segments, d=256": (Case(2, 777, 1024, 4, 2, 256),
                                 dict(segment_ids=(
                                     _document_ids(2, 777, 300),
                                     _document_ids(2, 1024, 400)),
                                      dropout_rate=0.25,
                                      dropout_rng=jax.random.key(6))),
    "combined": (Case(2, 1500, 1537, 4, 2, 128),
                 dict(is_causal=True, local_window_size=(512, 0),
                      q_offset=jnp.array([37, 0]),
                      key_value_seq_lengths=jnp.array([1537, 1000]),
                      segment_ids=(_document_ids(2, 1500, 700),
                                   _document_ids(2, 1537, 700)),
                      logits_soft_cap=30.0)),
}


def _masked_attention(**variants):
  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, return_residual=True,
                                     implementation="mosaic", **variants)
  return attention


def _assert_uses_masked_backward(attention, case: Case, dtype):
  shapes = [jax.ShapeDtypeStruct(s, dtype) for s in (
      (case.batch, case.q_len, case.num_heads, case.head_dim),
      (case.batch, case.kv_len, case.num_kv_heads, case.head_dim),
      (case.batch, case.kv_len, case.num_kv_heads, case.head_dim))]

  def vjp(q, k, v):
    (out, lse), pullback = jax.vjp(attention, q, k, v)
    return pullback((out, lse))

  text = jax.jit(vjp).lower(*shapes).as_text()
  assert masked_backward_kernels(text) and not TRITON_BACKWARD.search(text)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", list(_GPU_VARIANTS))
def test_masked_backward_matches_reference_on_gpu(name, dtype, monkeypatch):
  """dq, dk, dv by the masked Mosaic backward under random cotangents of
  out and lse, by FlashAttention's tolerance rule."""
  _require_sm90()
  monkeypatch.setattr(mosaic_attention_module, "MASKED_KERNEL_ENABLED", True)
  monkeypatch.setattr(mosaic_attention_module, "MASKED_BACKWARD_ENABLED",
                      True)
  case, variants = _GPU_VARIANTS[name]
  attention = _masked_attention(**variants)
  _assert_uses_masked_backward(attention, case, dtype)
  check_against_reference(attention, case, dtype, seed=7, **variants)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_alibi_columns_fwd_bwd_match_reference_on_gpu(head_dim, monkeypatch):
  """Causal ALiBi as a term per key and one per query in the masked
  forward and both backward kernels (`plan.MASKED_ALIBI_COLUMNS`): out,
  lse, dq, dk, dv, GQA 4:1, bottom-right causal."""
  _require_sm90()
  from pallas_kernels.mosaic import plan
  monkeypatch.setattr(plan, "MASKED_ALIBI_COLUMNS", True)
  case, variants = _GPU_VARIANTS["alibi"]
  case = Case(case.batch, case.q_len, case.kv_len, case.num_heads,
              case.num_kv_heads, head_dim)
  attention = _masked_attention(**variants)
  _assert_uses_masked_backward(attention, case, jnp.bfloat16)
  check_against_reference(attention, case, jnp.bfloat16, seed=9, **variants)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [Case(1, 777, 1100, 8, 2, 96),
                                  Case(2, 1024, 1024, 8, 4, 128),
                                  Case(1, 1000, 1000, 4, 2, 256)], ids=str)
def test_folded_cap_backward_matches_reference_on_gpu(case, monkeypatch):
  """The cap's multiplies folded into the scales in both backward kernels
  (`plan.MASKED_BACKWARD_SOFTCAP_FOLDED`; dK/dV's slope taken ahead of
  dPᵀ's wait): out, lse, dq, dk, dv, causal, GQA, logits past the cap
  (the scale 4 / sqrt(d))."""
  _require_sm90()
  from pallas_kernels.mosaic import plan
  monkeypatch.setattr(plan, "MASKED_BACKWARD_SOFTCAP_FOLDED", True)
  variants = dict(is_causal=True, logits_soft_cap=20.0,
                  scale=4 * case.head_dim**-0.5)
  attention = _masked_attention(**variants)
  _assert_uses_masked_backward(attention, case, jnp.bfloat16)
  check_against_reference(attention, case, jnp.bfloat16, seed=10, **variants)


@pytest.mark.gpu
def test_masked_backward_deterministic_and_empty_rows_on_gpu(monkeypatch):
  """Bitwise repeatable; rows and a batch with nothing to attend to get
  zero gradients, and nothing is NaN."""
  _require_sm90()
  monkeypatch.setattr(mosaic_attention_module, "MASKED_KERNEL_ENABLED", True)
  monkeypatch.setattr(mosaic_attention_module, "MASKED_BACKWARD_ENABLED",
                      True)
  case = Case(2, 333, 517, 8, 2, 128)
  # Batch 0: rows from 300 on are padding; batch 1: no keys at all.
  variants = dict(is_causal=True, q_offset=jnp.array([184, 184]),
                  query_seq_lengths=jnp.array([300, 333]),
                  key_value_seq_lengths=jnp.array([517, 0]))
  attention = _masked_attention(**variants)
  _assert_uses_masked_backward(attention, case, jnp.bfloat16)
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, 11)
  grads = jax.jit(lambda *a: jax.vjp(attention, *a[:3])[1](a[3:]))

  first = grads(q, k, v, d_out, d_lse)
  for grad in first:
    assert np.isfinite(np.asarray(grad, np.float32)).all()
  dq, dk, dv = (np.asarray(g, np.float32) for g in first)
  np.testing.assert_array_equal(dq[0, 300:], 0.0)
  np.testing.assert_array_equal(dq[1], 0.0)
  np.testing.assert_array_equal(dk[1], 0.0)
  np.testing.assert_array_equal(dv[1], 0.0)
  for _ in range(2):
    for a, b in zip(first, grads(q, k, v, d_out, d_lse)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_dropout_bits_match_triton_on_gpu(monkeypatch):
  """The masked Mosaic kernels drop the weights the Triton kernels drop
  (and `masking.dropout_keep` says), bit for bit, at GPU sizes: with Q = 0
  every weight is 1 / kv_len and with V the identity over the keys O[i, j]
  is nonzero exactly where weight (i, j) is kept; with dO the identity over
  the queries, dV is its transpose (the dK/dV kernel's Sᵀ tiles)."""
  _require_sm90()
  monkeypatch.setattr(mosaic_attention_module, "MASKED_KERNEL_ENABLED", True)
  monkeypatch.setattr(mosaic_attention_module, "MASKED_BACKWARD_ENABLED",
                      True)
  batch, length, heads, dim, rate = 2, 256, 4, 256, 0.2
  q = jnp.zeros((batch, length, heads, dim), jnp.bfloat16)
  k = jax.random.normal(jax.random.key(1), q.shape, jnp.bfloat16)
  identity = jnp.broadcast_to(jnp.eye(length, dim, dtype=jnp.bfloat16)[
      None, :, None], q.shape)
  expected = np.asarray(masking.dropout_keep(
      _dropout_seed(jax.random.key(9)), np.arange(batch)[:, None, None,
                                                         None],
      np.arange(heads)[None, None, :, None],
      np.arange(length)[None, :, None, None],
      np.arange(length)[None, None, None, :], rate))   # [b, q, h, kv]

  def bits(implementation):
    def attention(q, k, v):
      return jax_flash.flash_attention(
          q, k, v, dropout_rate=rate, dropout_rng=jax.random.key(9),
          implementation=implementation)
    out, pullback = jax.jit(lambda q, k, v: jax.vjp(attention, q, k, v))(
        q, k, identity)
    _, _, dv = jax.jit(pullback)(identity)
    return (np.asarray(out, np.float32) != 0,
            np.asarray(dv, np.float32).transpose(0, 3, 2, 1) != 0)

  for implementation in ("mosaic", "triton"):
    out_bits, dv_bits = bits(implementation)
    np.testing.assert_array_equal(out_bits, expected, err_msg=implementation)
    np.testing.assert_array_equal(dv_bits, expected, err_msg=implementation)


def _dropout_seed(rng):
  """The int32 dropout seed `flash_attention` derives from `rng`."""
  return validation.normalise_call(
      *(jnp.zeros((1, 1, 1, 16)),) * 3, dropout_rate=0.5,
      dropout_rng=rng).operands.dropout_seed
