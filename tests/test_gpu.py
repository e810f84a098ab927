"""The attention suites compiled on a GPU at realistic sizes (`pytest -m gpu`)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.reference import naive_attention
from tests.attention_checks import (DISPATCHED_TO_MOSAIC, DISPATCHED_TO_TRITON,
                                    Case, assert_within_rule,
                                    check_against_reference, random_inputs)

pytestmark = pytest.mark.gpu

GPU_CASES = [
    (Case(2, 1024, 1024, 16, 16, 128), jnp.bfloat16),
    (Case(1, 4096, 4096, 8, 2, 64), jnp.bfloat16),
    (Case(1, 2048, 2048, 4, 4, 256), jnp.bfloat16),
    (Case(1, 16384, 16384, 2, 1, 128), jnp.bfloat16),
    (Case(1, 1000, 1537, 8, 2, 96), jnp.float16),
    (Case(2, 1, 4096, 8, 1, 128), jnp.bfloat16),
    (Case(1, 777, 300, 4, 2, 40), jnp.float32),
    # float32 tiles at their largest head dim (32x32, one stage; TF32x3).
    (Case(1, 1000, 1000, 4, 2, 256), jnp.float32),
    (Case(1, 2048, 2048, 4, 4, 256), jnp.float16),
    # Keys short enough for the short-key forward tiles
    # (`config._GPU_SHORT_FORWARD`): ViT-B's 197 tokens; GQA on 257 keys.
    (Case(4, 197, 197, 12, 12, 64), jnp.bfloat16),
    (Case(2, 300, 257, 4, 2, 64), jnp.float16),
]


def _compiled(is_causal):
  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, is_causal=is_causal,
                                     return_residual=True,
                                     implementation="triton")
  return attention


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case, dtype", GPU_CASES,
                         ids=[f"{c}-{jnp.dtype(d).name}" for c, d in GPU_CASES])
def test_matches_reference_on_gpu(case, dtype, is_causal):
  check_against_reference(_compiled(is_causal), case, dtype,
                          is_causal=is_causal, seed=1, f32_tol=1e-4)


def test_deterministic_on_gpu():
  q, k, v, d_out, _ = random_inputs(Case(2, 2048, 2048, 8, 2, 128),
                                    jnp.bfloat16, 3)

  @jax.jit
  def run(q, k, v):
    out, vjp = jax.vjp(lambda *a: jax_flash.flash_attention(
        *a, is_causal=True, implementation="triton"), q, k, v)
    return out, vjp(d_out)

  first = jax.tree.leaves(run(q, k, v))
  for _ in range(3):
    for a, b in zip(first, jax.tree.leaves(run(q, k, v))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_implementation_none_uses_kernels_on_gpu():
  """Mosaic on sm90 where it covers the call, else the Triton kernels."""
  from pallas_kernels import compat
  on_hopper = (compat.gpu_compute_capability() or (0, 0))[0] == 9

  def lowered(dtype, q_len, **kwargs):
    q, k, v, _, _ = random_inputs(Case(1, q_len, q_len, 4, 4, 64), dtype, 0)
    return jax.jit(lambda q, k, v: jax_flash.flash_attention(
        q, k, v, **kwargs)).lower(q, k, v).as_text()

  for dtype, q_len, kwargs in DISPATCHED_TO_MOSAIC:
    text = lowered(dtype, q_len, **kwargs)
    assert ("mosaic_flash_forward" in text) == on_hopper
    assert "flash_forward" in text
  for dtype, q_len, kwargs in DISPATCHED_TO_TRITON:
    text = lowered(dtype, q_len, **kwargs)
    assert "mosaic_flash_forward" not in text
    assert "flash_forward" in text


_DOCS = jnp.repeat(jnp.arange(8, dtype=jnp.int32), 256)[None].repeat(2, 0)
GPU_VARIANTS = {
    "causal+window": dict(is_causal=True, local_window_size=(300, 0)),
    "segments": dict(segment_ids=_DOCS),
    "lengths+bottom-right": dict(is_causal=True, q_offset=jnp.array([0, 500]),
                                 key_value_seq_lengths=jnp.array([2048,
                                                                  1700])),
    "softcap+alibi": dict(logits_soft_cap=20.0,
                          alibi_slopes=jnp.linspace(0.01, 0.5, 8)),
    "dropout": dict(dropout_rate=0.2, dropout_rng=jax.random.key(0)),
    "mask_fn+score_fn": dict(mask_fn=lambda b, h, i, j: (i // 128) % 2 ==
                             (j // 128) % 2,
                             score_fn=lambda s, b, h, i, j: s * 0.9),
    "sinks+mask": dict(sinks=jnp.linspace(-1, 1, 8),
                       mask=jnp.ones((2, 1, 2048, 2048), bool).at[
                           :, :, :, 1000:1100].set(False)),
}


@pytest.mark.parametrize("name", list(GPU_VARIANTS))
def test_variants_on_gpu(name):
  variants = GPU_VARIANTS[name]

  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, return_residual=True,
                                     implementation="triton", **variants)
  check_against_reference(attention, Case(2, 2048, 2048, 8, 2, 128),
                          jnp.bfloat16, seed=2, **variants)


# Short masked calls (`api.triton_first`): at d=128 and 256
# `implementation=None` takes the Mosaic masked kernels, which read rows off
# the 8-row tiling in place; at d=64 the Triton kernels, on the tiling or off.
SHORT_MASKED_CASES = {
    "d128 lengths": (Case(2, 577, 577, 8, 2, 128), True,
                     dict(is_causal=True,
                          key_value_seq_lengths=jnp.array([577, 300]))),
    "d256 window": (Case(2, 333, 333, 4, 2, 256), True,
                    dict(is_causal=True, local_window_size=(100, 0))),
    "d128 segments": (Case(2, 197, 197, 4, 4, 128), True,
                      dict(segment_ids=jnp.repeat(
                          jnp.arange(4, dtype=jnp.int32), 50)[None, :197]
                           .repeat(2, 0))),
    "d64 window": (Case(2, 197, 197, 4, 4, 64), False,
                   dict(local_window_size=(30, 30))),
    # A bool key-padding mask, run as segment ids (`validation.
    # _vector_mask_as_segments`).
    "d128 key padding mask": (Case(2, 577, 577, 8, 2, 128), True,
                              dict(mask=(jnp.arange(577) < jnp.array(
                                  [[577], [250]]))[:, None, None, :])),
    # d=64 on the 8-row tiling (BERT's 512 tokens): Triton's forward wins.
    "d64 key padding mask, 512": (Case(2, 512, 512, 4, 4, 64), False,
                                  dict(mask=(jnp.arange(512) < jnp.array(
                                      [[512], [130]]))[:, None, None, :])),
}


@pytest.mark.parametrize("name", list(SHORT_MASKED_CASES))
def test_short_masked_calls_take_their_kernels_on_gpu(name):
  """`implementation=None` on short masked calls off the tiling: the
  kernels `api.triton_first` names, and the reference's numbers."""
  from pallas_kernels import compat
  case, mosaic, variants = SHORT_MASKED_CASES[name]
  on_hopper = (compat.gpu_compute_capability() or (0, 0))[0] == 9

  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, return_residual=True,
                                     **variants)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, 0)
  text = attention.lower(q, k, v).as_text()
  assert ("mosaic_flash_forward" in text) == (mosaic and on_hopper)
  check_against_reference(attention, case, jnp.bfloat16, seed=4, **variants)


MOSAIC_SINK_CASES = {
    # The plan's persistent grid at 4k, its launch grid at 16k (d=128
    # causal), and d=256 without a mask.
    "persistent 4k": (Case(1, 4096, 4096, 8, 2, 128), dict(is_causal=True)),
    "launch grid 16k": (Case(1, 16384, 16384, 2, 2, 128),
                        dict(is_causal=True)),
    "d256 full": (Case(2, 2048, 2048, 4, 4, 256), {}),
    # d=128 without a mask: the row sum after P V, O rescaled lazily (a
    # running max that lags the true one); d=64 at 4k: three consumers on
    # hardware turns.
    "d128 full": (Case(1, 2048, 2048, 8, 2, 128), {}),
    "d64 full, three consumers": (Case(1, 4096, 4096, 8, 2, 64), {}),
    # The masked kernel: rows that see no key (a kv length of 0), dropout.
    "masked": (Case(2, 1000, 1200, 4, 2, 64),
               dict(is_causal=True, key_value_seq_lengths=jnp.array([0, 1100]),
                    dropout_rate=0.1, dropout_rng=jax.random.key(5))),
}


@pytest.mark.parametrize("name", list(MOSAIC_SINK_CASES))
def test_sinks_in_the_mosaic_epilogue_on_gpu(name):
  """Sinks in the Mosaic forward's epilogue: out, lse, dq, dk, dv and
  dsinks (`attention.sink_gradient`) against the reference."""
  case, variants = MOSAIC_SINK_CASES[name]
  variants = dict(variants, sinks=jnp.linspace(-2.0, 6.0, case.num_heads))

  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, return_residual=True,
                                     implementation="mosaic", **variants)
  check_against_reference(attention, case, jnp.bfloat16, seed=3, **variants)

  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, 3)
  others = {n: x for n, x in variants.items() if n != "sinks"}

  def sink_gradient(attend, dtype):
    # The inputs are arguments, not closed-over constants: XLA would fold
    # the naive reference's [b, h, q, k] products over constants at compile
    # time (a minute each at d=256, 2k tokens).
    def loss(sinks, q, k, v):
      out, lse = attend(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                        sinks=sinks, **others)
      return (jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
              + jnp.sum(lse * d_lse))
    return jax.jit(jax.grad(loss))(variants["sinks"], q, k, v)

  ours = sink_gradient(functools.partial(
      jax_flash.flash_attention, return_residual=True,
      implementation="mosaic"), jnp.bfloat16)
  exact, naive = (sink_gradient(functools.partial(
      naive_attention, compute_dtype=dtype), dtype)
                  for dtype in (jnp.float32, jnp.bfloat16))
  assert_within_rule("dsinks", ours, exact, naive)


# Biases broadcast along a sequence axis on the masked Mosaic kernels
# (`common.repeat_broadcast_axes`): per key (BERT-style, per batch) and per
# query (per head), lengths past a tile's extent and off the 8-row tiling.
BROADCAST_BIASES = {"per key": (2, 1, 1, 1537), "per query": (1, 8, 1000, 1)}


@pytest.mark.parametrize("name", list(BROADCAST_BIASES))
def test_broadcast_bias_on_gpu(name):
  """out, lse, dq, dk, dv against the reference, and dbias (the reference's
  dS summed over the broadcast axes) within 1e-3 of the largest sum of
  |dS| over those axes: a sum's rounding scales with its terms, and a
  per-query dbias is a sum that cancels to zero (softmax ignores a shift
  of a whole row), so its error is all rounding, mostly of delta from the
  stored 16-bit output."""
  case = Case(2, 1000, 1537, 8, 2, 128)
  shape = BROADCAST_BIASES[name]
  bias = jax.random.normal(jax.random.key(3), shape, jnp.bfloat16)

  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, bias, return_residual=True,
                                     implementation="mosaic")
  check_against_reference(attention, case, jnp.bfloat16, seed=5, bias=bias)
  q, k, v, d_out, _ = random_inputs(case, jnp.bfloat16, 5)

  def loss(attend, bias, q, k, v):
    return jnp.sum(attend(q, k, v, bias).astype(jnp.float32)
                   * d_out.astype(jnp.float32))
  got = jax.jit(jax.grad(functools.partial(loss, functools.partial(
      jax_flash.flash_attention, implementation="mosaic"))))(bias, q, k, v)
  # The reference's dS: its gradient for a full zero bias added to this one.
  full = jnp.zeros((case.batch, case.num_heads, case.q_len, case.kv_len))
  ds = jax.jit(jax.grad(functools.partial(
      loss, lambda q, k, v, b: jax_flash.attention_reference(
          q, k, v, bias=b + bias.astype(jnp.float32)))))(
              full, *(x.astype(jnp.float32) for x in (q, k, v)))
  axes = tuple(i for i in range(4) if shape[i] == 1)
  np.testing.assert_allclose(
      np.asarray(got, np.float32), ds.sum(axes, keepdims=True),
      atol=1e-3 * float(jnp.abs(ds).sum(axes).max()))


@pytest.mark.parametrize("implementation, bias_shape, dtype", [
    ("mosaic", (2, 4, 1000, 1000), jnp.bfloat16),   # the masked kernels
    ("triton", (2, 1, 1, 1000), jnp.float32),       # a per-key f32 bias
], ids=["mosaic full bf16", "triton per-key f32"])
def test_padding_bias_at_the_lowest_float_on_gpu(implementation, bias_shape,
                                                 dtype):
  """A padding bias at its dtype's lowest on every key of batch 1 (an empty
  sequence, as HF's and Flax's padding biases give it): zeros there, no
  NaN, and batch 0 as the reference (`masking.LOWEST_LOGIT`)."""
  q, k, v, _, _ = random_inputs(Case(2, 1000, 1000, 4, 2, 128),
                                jnp.bfloat16, 6)
  keep = jnp.arange(1000) < jnp.array([[700], [0]])
  bias = jnp.broadcast_to(jnp.where(keep, 0.0, jnp.finfo(dtype).min)[
      :, None, None, :], bias_shape).astype(dtype)

  @jax.jit
  def run(q, k, v):
    return jax.vjp(lambda *a: jax_flash.flash_attention(
        *a, bias=bias, is_causal=True, implementation=implementation),
                   q, k, v)[1](jnp.ones_like(q))
  grads = run(q, k, v)
  out = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, bias=bias, is_causal=True,
      implementation=implementation))(q, k, v)
  assert all(bool(jnp.isfinite(x).all()) for x in (out, *grads))
  assert float(jnp.abs(out[1]).max()) == 0.0
  want = jax_flash.attention_reference(q, k, v, bias=bias, is_causal=True)
  np.testing.assert_allclose(np.asarray(out[0], np.float32),
                             np.asarray(want[0], np.float32), atol=0.02)


@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_padding_bias_at_minus_1e10_on_gpu(implementation):
  """A finite padding bias of -1e10 on padded keys and on every key of the
  padded queries (batch 0: 700 queries and 600 keys of 1000 valid):
  out and gradients finite (the padded queries' cotangents zero, as a
  masked loss gives them), the valid rows as the reference's. At that
  magnitude an ulp of a logit is 1024, and P's exponent could overshoot
  the row max by half of it (`MaskSpec.unbounded_scores`)."""
  q, k, v, d_out, _ = random_inputs(Case(2, 1000, 1000, 4, 2, 128),
                                    jnp.bfloat16, 7)
  q_valid = jnp.arange(1000) < jnp.array([[700], [1000]])
  kv_valid = jnp.arange(1000) < jnp.array([[600], [1000]])
  bias = jnp.where(q_valid[:, :, None] & kv_valid[:, None, :], 0.0,
                   -1e10)[:, None].astype(jnp.bfloat16)
  d_out = jnp.where(q_valid[:, :, None, None], d_out, 0).astype(d_out.dtype)

  def attend(fn, q, k, v, **kw):
    return fn(q, k, v, bias=bias, is_causal=True, **kw)

  @jax.jit
  def run(q, k, v):
    out, vjp = jax.vjp(lambda *a: attend(
        jax_flash.flash_attention, *a, implementation=implementation),
                       q, k, v)
    return out, vjp(d_out)
  out, grads = run(q, k, v)
  assert all(bool(jnp.isfinite(x).all()) for x in (out, *grads))
  want, want_grads = jax.vjp(lambda *a: attend(
      jax_flash.attention_reference, *a), q, k, v)
  want_grads = want_grads(d_out)
  rows = np.asarray(q_valid)
  np.testing.assert_allclose(np.asarray(out, np.float32)[rows],
                             np.asarray(want, np.float32)[rows], atol=0.02)
  for ours, theirs in zip(grads, want_grads):
    theirs = np.asarray(theirs, np.float32)
    np.testing.assert_allclose(np.asarray(ours, np.float32), theirs,
                               atol=0.02 * float(np.abs(theirs).max()))


def test_bias_gradient_on_gpu():
  q, k, v, d_out, _ = random_inputs(Case(1, 1024, 1536, 8, 8, 64),
                                    jnp.bfloat16, 4)
  bias = jax.random.normal(jax.random.key(1), (1, 8, 1024, 1536))

  def loss(fn, bias, q, k, v, **kw):
    out = fn(q, k, v, bias, is_causal=True, **kw)
    return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

  got = jax.jit(jax.grad(lambda *a: loss(jax_flash.flash_attention, *a,
                                         implementation="triton")))(
                                             bias, q, k, v)
  want = jax.grad(lambda *a: loss(jax_flash.attention_reference, *a))(
      bias, q, k, v)
  np.testing.assert_allclose(got, want, atol=0.02 * float(jnp.abs(want).max()))
