"""The masked Mosaic forward (window, q_offset, lengths, segment ids, soft
cap, ALiBi, dropout, any lengths): cross-lowered for CUDA on the CPU,
checked against the reference on a GPU. `implementation=None` routes calls
to it only once `MASKED_KERNEL_ENABLED` is set, after the GPU tests here
have passed.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import lower_mosaic
import jax_flash
from jax_flash import masking, validation
from jax_flash.reference import naive_attention
from jax_flash.validation import Operands
from pallas_kernels import compat as versions
from pallas_kernels.config import BlockSizes
from tests.attention_checks import (ALIBI_SLOPES, Case,
                                    assert_forward_within_rule,
                                    assert_within_rule,
                                    blocks_and_stripes,
                                    check_against_reference,
                                    one_head_dim_each, position_score,
                                    random_inputs)

try:
  from pallas_kernels.mosaic import attention as mosaic_attention_module
  from pallas_kernels.mosaic.attention import masked_operand_kwargs
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)


# name: (q_len, kv_len, MaskSpec fields, operands)
VARIANTS = {name: case for name, case in lower_mosaic.MASKED_CASES.items()
            if name != "grid window"}  # (too large to interpret)


def _operands(values: dict) -> Operands:
  return lower_mosaic.masked_operands(values)


# Mosaic GPU's other lowering semantics (the one-line switch in
# `pallas_kernels.mosaic.compat`) for these forms with `-m slow`.
_SEMANTICS = ["Warpgroup", pytest.param("Lane", marks=pytest.mark.slow)]


@pytest.mark.parametrize("lowering_semantics", _SEMANTICS, indirect=True)
@pytest.mark.parametrize("name, head_dim", one_head_dim_each(list(VARIANTS)))
def test_masked_forward_lowers_for_cuda(head_dim, name, lowering_semantics):
  q_len, kv_len, fields, values = VARIANTS[name]
  spec = masking.MaskSpec(q_len=q_len, kv_len=kv_len, **fields)
  q = jax.ShapeDtypeStruct((2, q_len, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), jnp.bfloat16)
  operands = masked_operand_kwargs(_operands(values))

  def forward(q, k, v):
    return mosaic_forward_masked(q, k, v, scale=head_dim**-0.5, spec=spec,
                                 **operands)

  lowered = jax.jit(forward).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",))
  out, lse = lowered.out_info
  assert out.shape == q.shape and lse.shape == (2, 4, q_len)
  assert "mosaic_flash_forward" in lowered.as_text()


def _masked_forward(name, head_dim, **options):
  """`forward(q, k, v)`: the masked forward for VARIANTS[name], and the
  shapes (b2, h4:2) it takes."""
  q_len, kv_len, fields, values = VARIANTS[name]
  spec = masking.MaskSpec(q_len=q_len, kv_len=kv_len, **fields)
  operands = masked_operand_kwargs(_operands(values))

  def forward(q, k, v):
    return mosaic_forward_masked(q, k, v, scale=head_dim**-0.5, spec=spec,
                                 **operands, **options)
  return forward, Case(2, q_len, kv_len, 4, 2, head_dim)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(64, 128), (64, 64), (128, 64)])
def test_quad_registers_draw_dropout_keeps_bits(shape, transposed):
  """`common.quad_dropout_in_threads`'s register walk, by the WGMMA
  layout's own element map (`mosaic_layouts`): each thread's quads hashed
  from the words at their first register's row and column, each member's
  byte shifted to the top and compared, give `masking.dropout_keep`'s bits
  on a tile whose queries and keys start at multiples of 16, every
  element once (queries down the rows, or across them: an Sᵀ tile). Fails
  if a register index or a shift is wrong."""
  from jax.experimental.mosaic.gpu import fragmented_array as mgpu_arrays
  from pallas_kernels import masking as kernel_masking
  from pallas_kernels.mosaic import common
  from tests.mosaic_layouts import element_coordinates
  rate, seed, batch, head, q0, k0 = 0.3, 17, 1, 2, 48, 160
  layout = mgpu_arrays.WGMMA_LAYOUT
  where = element_coordinates(layout, shape)
  quads = common.quad_registers(layout.registers_shape(shape),
                                transposed=transposed)
  firsts, members = [], []   # (row, col) of each quad's first, its members
  for warp, lane in {(w, l) for w, l, _, _ in where}:
    for first, quad in quads:
      for position in (0, 1):
        firsts.append(where[warp, lane, first, position])
        members.append([(*where[warp, lane, member, position], shift)
                        for member, shift in quad])
  firsts, members = np.array(firsts), np.array(members)
  if transposed:
    q_first, k_first = firsts[:, 1], firsts[:, 0]
  else:
    q_first, k_first = firsts[:, 0], firsts[:, 1]
  words = kernel_masking.dropout_quad_hash(
      kernel_masking.dropout_query_hash(
          kernel_masking.dropout_stream(seed, batch, head), q0 + q_first),
      kernel_masking.dropout_key_hash(k0 + k_first))
  bytes_on_top = np.left_shift(np.asarray(words)[:, None],
                               members[..., 2].astype(np.uint32))
  kept = np.zeros(shape, bool)
  seen = np.zeros(shape, int)
  np.add.at(seen, (members[..., 0], members[..., 1]), 1)
  kept[members[..., 0], members[..., 1]] = (
      bytes_on_top >= kernel_masking.dropout_threshold(rate))
  assert (seen == 1).all()
  rows, cols = np.arange(shape[0])[:, None], np.arange(shape[1])[None]
  q_idx, kv_idx = (cols, rows) if transposed else (rows, cols)
  np.testing.assert_array_equal(kept, masking.dropout_keep(
      seed, batch, head, q0 + q_idx, k0 + kv_idx, rate))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lazy_rescale_masked_forward_lowers(head_dim, cuda_lowering):
  """`lazy_rescale` in the ranged forward: another module; by default on
  at d=256 only (`plan.MASKED_LAZY_RESCALE_HEAD_DIMS`)."""
  def text(**options):
    forward, case = _masked_forward("causal window", head_dim, **options)
    q = jax.ShapeDtypeStruct((2, case.q_len, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, case.kv_len, 2, head_dim), jnp.bfloat16)
    return jax.jit(forward).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()
  lazy, plain = text(lazy_rescale=True), text(lazy_rescale=False)
  assert lazy != plain
  assert text() == (lazy if head_dim == 256 else plain)


def test_score_changes_add_no_division(cuda_lowering):
  """A division in a kernel is IEEE div.rn.f32, ~15 SASS instructions a
  score: the built-in soft cap and a score_fn that divides by a constant
  (`masked.kernel_spec`) lower, forward and backward, with no more
  divisions than the plain causal mask's (the forward's rows' 1 / l)."""
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)

  def divisions(backward=False, **fields):
    spec = masking.MaskSpec(q_len=256, kv_len=256, is_causal=True, **fields)
    if backward:
      fn, args = (lambda q, k, v, out, lse, d_out: mosaic_backward_masked(
          q, k, v, out, lse, d_out, scale=0.125, spec=spec)), (
              x, x, x, x, lse, x)
    else:
      fn, args = (lambda q, k, v: mosaic_forward_masked(
          q, k, v, scale=0.125, spec=spec)), (x, x, x)
    return lower_mosaic.canonical(fn, args).count("arith.divf")
  softcap_score = lambda s, *_: 30.0 * jnp.tanh(s / 30.0)
  for backward in (False, True):
    plain = divisions(backward)
    assert divisions(backward, logits_soft_cap=30.0) == plain
    assert divisions(backward, score_fn=softcap_score) == plain


def test_max_free_where_planned():
  """The masked forward skips its running max at the planned head dims
  (those between 128 and 256 on 256's rows) and caps within P's range."""
  from pallas_kernels.mosaic import plan
  assert plan.MASKED_MAX_FREE_HEAD_DIMS == (256,)
  assert plan.max_free_cap(50.0, jnp.bfloat16, 256)
  assert plan.max_free_cap(50.0, jnp.bfloat16, 192)
  assert not plan.max_free_cap(50.0, jnp.bfloat16, 128)
  assert not plan.max_free_cap(61.0, jnp.bfloat16, 256)
  assert not plan.max_free_cap(30.0, jnp.float16, 256)
  assert not plan.max_free_cap(None, jnp.bfloat16, 256)


@pytest.mark.parametrize("dtype, cap", [(jnp.bfloat16, 30.0),
                                        (jnp.bfloat16, 60.0),
                                        (jnp.float16, 10.0),
                                        (jnp.float16, 4.0)])
def test_first_step_max_floor_keeps_p_in_range(dtype, cap):
  """`plan.first_step_max_floor`: a logit at the cap over a row max at the
  floor gives P = e^bound, the m = 0 form's largest (`MAX_FREE_SOFT_CAPS`),
  finite in P's dtype; the floor never asks more of a row than m = 0
  does (it is at most 0)."""
  from pallas_kernels.mosaic import plan
  floor = plan.first_step_max_floor(cap, dtype)
  bound = plan.MAX_FREE_SOFT_CAPS[np.dtype(dtype).name]
  largest_p = np.exp2(cap * np.log2(np.e) - floor)
  np.testing.assert_allclose(largest_p, np.exp(bound), rtol=1e-6)
  assert np.isfinite(np.asarray(largest_p, dtype))
  assert floor <= 0.0


@pytest.mark.parametrize("head_dim", [64, 256])
def test_max_free_forward_lowers(head_dim, cuda_lowering, monkeypatch):
  """The soft cap without a running max (`plan.MASKED_MAX_FREE_HEAD_DIMS`):
  it lowers, and the choice reaches the kernel."""
  from pallas_kernels.mosaic import plan

  def text():
    forward, case = _masked_forward("soft cap", head_dim)
    q = jax.ShapeDtypeStruct((2, case.q_len, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, case.kv_len, 2, head_dim), jnp.bfloat16)
    return jax.jit(forward).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()
  monkeypatch.setattr(plan, "MASKED_MAX_FREE_HEAD_DIMS", ())
  with_max = text()
  monkeypatch.setattr(plan, "MASKED_MAX_FREE_HEAD_DIMS", (head_dim,))
  assert text() != with_max


def test_folded_cap_lowers_with_fewer_multiplies(cuda_lowering,
                                                  monkeypatch):
  """The cap's multiplies folded into the scales (`plan.
  MASKED_SOFTCAP_FOLDED`): the lowered capped forward multiplies fewer
  times per score tile, and keeps its tanh."""
  from pallas_kernels.mosaic import plan

  def count(op):
    forward, case = _masked_forward("soft cap", 64)
    q = jax.ShapeDtypeStruct((2, case.q_len, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, case.kv_len, 2, 64), jnp.bfloat16)
    return lower_mosaic.canonical(forward, (q, kv, kv)).count(op)
  monkeypatch.setattr(plan, "MASKED_SOFTCAP_FOLDED", False)
  unfolded = count("arith.mulf")
  monkeypatch.setattr(plan, "MASKED_SOFTCAP_FOLDED", True)
  assert count("arith.mulf") < unfolded and count("tanh.approx") > 0


def test_masked_gradients_lower_with_padded_head_dim(cuda_lowering,
                                                     monkeypatch):
  """Head dim 96 (at its own width), ragged lengths, window and lengths,
  through `jax.grad`."""
  monkeypatch.setattr(mosaic_attention_module, "MASKED_KERNEL_ENABLED", True)
  spec = masking.MaskSpec(q_len=200, kv_len=333, is_causal=True,
                          window=(50, None), has_kv_lengths=True)
  q = jax.ShapeDtypeStruct((2, 200, 4, 96), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 333, 2, 96), jnp.bfloat16)

  def loss(q, k, v):
    out, lse = mosaic_attention_module.mosaic_attention(
        q, k, v, scale=0.1, is_causal=True, spec=spec,
        operands=_operands(dict(kv_lengths=[333, 100])),
        backward_blocks=BlockSizes.get_default(96, "NVIDIA H200"))
    return out.astype(jnp.float32).sum() + lse.sum()

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",))
  assert [g.shape for g in lowered.out_info] == [q.shape, kv.shape, kv.shape]
  assert "mosaic_flash_forward" in lowered.as_text()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_masked_forward_with_bias_lowers_for_cuda(head_dim, cuda_lowering):
  """A bias per head (batch broadcast), ragged lengths (its axes padded to
  8), causal: each consumer's bias tile fits beside the K/V ring."""
  spec = masking.MaskSpec(q_len=200, kv_len=333, is_causal=True,
                          has_bias=True)
  q = jax.ShapeDtypeStruct((2, 200, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 333, 2, head_dim), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 4, 200, 333), jnp.bfloat16)
  lowered = jax.jit(lambda q, k, v, b: mosaic_forward_masked(
      q, k, v, scale=head_dim**-0.5, spec=spec, bias=b)).trace(
          q, kv, kv, bias).lower(lowering_platforms=("cuda",))
  assert "mosaic_flash_forward" in lowered.as_text()


@pytest.mark.parametrize("head_dim", [64, 256])
def test_masked_forward_with_dense_mask_lowers_for_cuda(head_dim,
                                                        cuda_lowering):
  """A dense mask per batch (int8 tiles: 128- and 64-byte rows) beside a
  bias per head, ragged lengths."""
  spec = masking.MaskSpec(q_len=200, kv_len=333, has_dense_mask=True,
                          has_bias=True, logits_soft_cap=20.0)
  q = jax.ShapeDtypeStruct((2, 200, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 333, 2, head_dim), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 4, 200, 333), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((2, 1, 200, 333), jnp.bool_)
  lowered = jax.jit(lambda q, k, v, b, m: mosaic_forward_masked(
      q, k, v, scale=head_dim**-0.5, spec=spec, bias=b, dense_mask=m)).trace(
          q, kv, kv, bias, mask).lower(lowering_platforms=("cuda",))
  assert "mosaic_flash_forward" in lowered.as_text()


def test_key_padding_mask_runs_on_the_mosaic_kernels(cuda_lowering,
                                                     monkeypatch):
  """A bool key-padding mask [batch, 1, 1, kv_len] (as jax.nn and BERT-style
  encoders pass it) runs on the Mosaic kernels as segment ids, forward and
  backward, off the 8-row tiling, cross-lowered for an H200; the masked
  kernels stream no mask tiles of that shape."""
  from pallas_kernels import compat
  monkeypatch.setattr(compat, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(compat, "has_gpu", lambda: True)
  q = jax.ShapeDtypeStruct((2, 577, 4, 128), jnp.bfloat16)
  mask = jnp.arange(577)[None, None, None, :] < jnp.array([577, 300])[
      :, None, None, None]

  def loss(q, k, v):
    return jax_flash.flash_attention(q, k, v, mask=mask,
                                     implementation="mosaic").astype(
                                         jnp.float32).sum()

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
      lowering_platforms=("cuda",)).as_text()
  kernels = set(re.findall(r"mosaic_flash_backward_masked_([a-z]+)", text))
  assert "mosaic_flash_forward" in text and kernels == {"dq", "dkdv"}


@pytest.mark.parametrize("bias_shape", [
    (2, 1, 1, 333),
    pytest.param((1, 4, 200, 1), marks=pytest.mark.slow)],  # CI's ten minutes
                         ids=["per key", "per query"])
def test_broadcast_bias_runs_on_the_mosaic_kernels(bias_shape, cuda_lowering,
                                                   monkeypatch):
  """A bias broadcast along a sequence axis, through `flash_attention`
  cross-lowered for an H200: the Mosaic forward, dQ, dK/dV and dbias
  kernels; the bias operands hold a tile's extent of the broadcast axis,
  not q_len x kv_len."""
  from pallas_kernels import compat
  monkeypatch.setattr(compat, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(compat, "has_gpu", lambda: True)
  q = jax.ShapeDtypeStruct((2, 200, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 333, 2, 128), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct(bias_shape, jnp.bfloat16)

  def loss(q, k, v, b):
    return jax_flash.flash_attention(q, k, v, b, is_causal=True,
                                     implementation="mosaic").astype(
                                         jnp.float32).sum()

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(
      q, kv, kv, bias).lower(lowering_platforms=("cuda",))
  assert lowered.out_info[3].shape == bias_shape
  text = lowered.as_text()
  kernels = set(re.findall(r"mosaic_flash_backward_masked_([a-z]+)", text))
  assert "mosaic_flash_forward" in text and kernels == {"dq", "dkdv",
                                                        "dbias"}
  assert not re.search(r"tensor<\d+x\d+x(200|208)x(333|336)xbf16>", text)


def test_bias_gradients_come_from_the_mosaic_backward(cuda_lowering):
  """With a bias, the masked Mosaic forward and backward: dQ, dK/dV and
  the dbias launch (dS in float32, summed over the broadcast batch axis),
  no Triton kernel."""
  spec = masking.MaskSpec(q_len=256, kv_len=256, is_causal=True,
                          has_bias=True)
  q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.bfloat16)

  def loss(q, k, v, b):
    out, lse = mosaic_attention_module.mosaic_attention(
        q, k, v, scale=0.1, is_causal=True, spec=spec, bias=b,
        backward_blocks=BlockSizes.get_default(128, "NVIDIA H200"))
    return out.astype(jnp.float32).sum() + lse.sum()

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(
      q, q, q, bias).lower(lowering_platforms=("cuda",))
  assert [g.shape for g in lowered.out_info] == [q.shape] * 3 + [bias.shape]
  text = lowered.as_text()
  kernels = set(re.findall(r"mosaic_flash_backward_masked_([a-z]+)", text))
  assert "mosaic_flash_forward" in text and kernels == {"dq", "dkdv",
                                                        "dbias"}
  assert "triton" not in text


@pytest.mark.parametrize("name, x, match", [
    ("bias", None, "bias must be"),                                 # missing
    ("bias", jnp.zeros((2, 1, 128, 128), jnp.bfloat16), "bias must be"),
    # neither q_len nor broadcast (1) along the queries
    ("bias", jnp.zeros((1, 2, 64, 128), jnp.bfloat16), "q_len, kv_len"),
    ("bias", jnp.zeros((1, 2, 128, 128), jnp.float32),
     "take bias in bfloat16"),
    ("dense_mask", jnp.ones((1, 2, 128, 1), bool), "q_len, kv_len"),
    ("dense_mask", jnp.ones((1, 2, 128, 128), jnp.int8), "in bool"),
    ("dense_mask", jnp.ones((1, 3, 128, 128), bool), "dense_mask must be"),
])
def test_masked_forward_checks_the_score_arrays(name, x, match):
  """A bias or dense mask the kernel cannot stream is NotImplementedError
  (the Triton kernels take it); a wrong one is ValueError."""
  spec = masking.MaskSpec(q_len=128, kv_len=128,
                          **{"bias": dict(has_bias=True),
                             "dense_mask": dict(has_dense_mask=True)}[name])
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  error = ValueError if "must be" in match else NotImplementedError
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda q: mosaic_forward_masked(
        q, q, q, scale=0.125, spec=spec, **{name: x}), q)


def test_masks_fall_back_while_the_masked_kernel_is_disabled(monkeypatch):
  monkeypatch.setattr(mosaic_attention_module, "MASKED_KERNEL_ENABLED", False)
  spec = masking.MaskSpec(q_len=128, kv_len=128, window=(8, 8))
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="not enabled"):
    jax.eval_shape(lambda q: mosaic_attention_module.mosaic_attention(
        q, q, q, scale=0.125, is_causal=False, spec=spec,
        backward_blocks=BlockSizes()), q)


_GPU_VARIANTS = {
    "ragged causal": (Case(2, 1000, 1537, 8, 2, 128), dict(is_causal=True)),
    "bottom-right causal": (Case(2, 512, 2048, 8, 2, 128),
                            dict(is_causal=True,
                                 q_offset=jnp.array([1536, 100]))),
    "causal window": (Case(1, 2048, 2048, 4, 4, 64),
                      dict(is_causal=True, local_window_size=(300, 0))),
    "lengths": (Case(2, 1024, 1024, 4, 1, 256),
                dict(query_seq_lengths=jnp.array([1000, 0]),
                     key_value_seq_lengths=jnp.array([700, 1024]))),
    "soft cap, d=96": (Case(1, 777, 1100, 8, 2, 96),
                       dict(is_causal=True, logits_soft_cap=20.0)),
    "packed documents": (Case(2, 2048, 2048, 4, 2, 128),
                         dict(is_causal=True, segment_ids=jnp.repeat(
                             jnp.arange(8, dtype=jnp.int32), 256)[None]
                             .repeat(2, 0))),
    # A slope per (batch, head), GQA 4:1, bottom-right causal and ragged.
    "alibi": (Case(2, 1000, 1537, 8, 2, 128),
              dict(is_causal=True, q_offset=jnp.array([537, 0]),
                   alibi_slopes=ALIBI_SLOPES)),
    "alibi soft cap, d=96": (Case(1, 777, 1100, 8, 2, 96),
                             dict(logits_soft_cap=20.0,
                                  alibi_slopes=ALIBI_SLOPES[0])),
    # A score_fn of (b, h, q_idx, kv_idx), GQA 4:1, ragged.
    "score_fn, d=96": (Case(2, 777, 1100, 8, 2, 96),
                       dict(is_causal=True, score_fn=position_score)),
    # A mask_fn whose tiles differ per head, GQA 4:1, causal, ragged.
    "mask_fn": (Case(2, 1000, 1537, 8, 2, 128),
                dict(is_causal=True, mask_fn=blocks_and_stripes)),
    # A dense mask per batch, int8 tiles streamed beside K/V; causal.
    "dense mask": (Case(2, 1000, 1537, 8, 2, 128),
                   dict(is_causal=True, mask=jax.random.bernoulli(
                       jax.random.key(9), 0.7, (2, 1, 1000, 1537)))),
    # The reference drops the same weights (`masking.dropout_keep`).
    "dropout, causal window": (Case(2, 1000, 1537, 8, 2, 128),
                               dict(is_causal=True,
                                    local_window_size=(500, 0),
                                    dropout_rate=0.1,
                                    dropout_rng=jax.random.key(5))),
}


def _gpu_variant(name: str, head_dim: int, seed: int):
  """(q, k, v, variants, forward) of `_GPU_VARIANTS[name]` at `head_dim`:
  `forward(**options)` runs `mosaic_forward_masked` on its masks, jitted,
  with `options`, and returns (out, lse). Skips below sm90."""
  if (versions.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic forward needs sm90")
  case, variants = _GPU_VARIANTS[name]
  case = dataclasses.replace(case, head_dim=head_dim)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed)
  call = validation.normalise_call(q, k, v, **variants)
  operands = masked_operand_kwargs(call.operands)

  def forward(**options):
    return jax.jit(lambda q, k, v: mosaic_forward_masked(
        q, k, v, scale=call.scale, spec=call.spec, **operands,
        **options))(q, k, v)
  return q, k, v, variants, forward


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_GPU_VARIANTS))
@pytest.mark.parametrize("head_dim", [128, 256])
def test_lazy_rescale_masked_forward_matches_reference_on_gpu(name,
                                                              head_dim):
  """The ranged forward with O rescaled lazily, on each mask variant (at
  this head dim), against the float32 reference within DESIGN's rule."""
  q, k, v, variants, forward = _gpu_variant(name, head_dim, 43)
  out, lse = forward(lazy_rescale=True)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_alibi_columns_match_reference_on_gpu(head_dim, monkeypatch):
  """Causal ALiBi as a per-column term (`plan.MASKED_ALIBI_COLUMNS`), GQA
  4:1, bottom-right causal in one batch, ragged lengths."""
  if (versions.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic forward needs sm90")
  from pallas_kernels.mosaic import plan
  monkeypatch.setattr(plan, "MASKED_ALIBI_COLUMNS", True)
  case, variants = _GPU_VARIANTS["alibi"]
  case = dataclasses.replace(case, head_dim=head_dim)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, 43)
  call = validation.normalise_call(q, k, v, **variants)
  operands = masked_operand_kwargs(call.operands)
  out, lse = jax.jit(lambda q, k, v: mosaic_forward_masked(
      q, k, v, scale=call.scale, spec=call.spec, **operands))(q, k, v)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


@pytest.mark.gpu
@pytest.mark.parametrize("fold_cap, row_sums", [(False, "rounded"),
                                               (True, "rounded"),
                                               (True, "mma"),
                                               (True, "first step max")])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype, cap", [(jnp.bfloat16, 50.0),
                                        (jnp.float16, 10.0)])
def test_max_free_forward_matches_reference_on_gpu(head_dim, dtype, cap,
                                                   fold_cap, row_sums,
                                                   monkeypatch):
  """The masked forward without a running max (`plan.
  MASKED_MAX_FREE_HEAD_DIMS`, here at every head dim) under Gemma's soft
  cap (bfloat16) and float16's largest it takes, a causal window over
  ragged lengths, Q times 4 so that logits reach the cap; with the cap's
  multiplies folded (`plan.MASKED_SOFTCAP_FOLDED`), and the row sum P V
  takes by the tensor cores (`plan.MAX_FREE_MMA_ROW_SUM`) or each row's
  max from its first step and one sum (`plan.MAX_FREE_FIRST_STEP_MAX`)."""
  if (versions.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic forward needs sm90")
  from pallas_kernels.mosaic import plan
  monkeypatch.setattr(plan, "MASKED_MAX_FREE_HEAD_DIMS", (head_dim,))
  monkeypatch.setattr(plan, "MASKED_SOFTCAP_FOLDED", fold_cap)
  monkeypatch.setattr(plan, "MAX_FREE_MMA_ROW_SUM", row_sums == "mma")
  monkeypatch.setattr(plan, "MAX_FREE_FIRST_STEP_MAX",
                      row_sums == "first step max")
  case = Case(2, 1500, 1500, 8, 4, head_dim)
  variants = dict(is_causal=True, local_window_size=(700, 0),
                  logits_soft_cap=cap,
                  key_value_seq_lengths=jnp.array([1500, 900]))
  q, k, v, _, _ = random_inputs(case, dtype, 44)
  q = q * 4
  call = validation.normalise_call(q, k, v, **variants)
  operands = masked_operand_kwargs(call.operands)
  out, lse = jax.jit(lambda q, k, v: mosaic_forward_masked(
      q, k, v, scale=call.scale, spec=call.spec, **operands))(q, k, v)
  assert_forward_within_rule(q, k, v, out, lse, **variants)
  # A causal row of one key is exactly its value (O normalised by the sum
  # P V took; from the first step, where its logit is at least the floor
  # on m, `plan.first_step_max_floor`, in natural-log units).
  value = jnp.repeat(v[:, 0], case.num_heads // case.num_kv_heads, axis=1)
  exact = np.ones(value.shape[:2], bool)
  if row_sums == "first step max":
    key = jnp.repeat(k[:, 0], case.num_heads // case.num_kv_heads, axis=1)
    logit = cap * jnp.tanh(call.scale * jnp.einsum(
        "bhd,bhd->bh", q[:, 0].astype(jnp.float32),
        key.astype(jnp.float32)) / cap)
    floor = plan.first_step_max_floor(cap, dtype) / np.log2(np.e)
    exact = np.asarray(logit > floor + 1e-3)
  np.testing.assert_array_equal(np.asarray(out[:, 0])[exact],
                                np.asarray(value)[exact])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", list(_GPU_VARIANTS))
def test_masked_kernel_matches_reference_on_gpu(name, dtype, monkeypatch):
  """Forward by the masked Mosaic kernel, gradients by the masked Mosaic
  backward (or the Triton one, for what it refuses)."""
  if (versions.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic forward needs sm90")
  monkeypatch.setattr(mosaic_attention_module, "MASKED_KERNEL_ENABLED", True)
  case, variants = _GPU_VARIANTS[name]

  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, return_residual=True,
                                     implementation="mosaic", **variants)

  assert "mosaic_flash_forward" in attention.lower(
      *(jax.ShapeDtypeStruct(s, dtype) for s in (
          (case.batch, case.q_len, case.num_heads, case.head_dim),
          (case.batch, case.kv_len, case.num_kv_heads, case.head_dim),
          (case.batch, case.kv_len, case.num_kv_heads, case.head_dim)))
  ).as_text()
  check_against_reference(attention, case, dtype, seed=3, **variants)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bias_batch", [1, 2])
def test_bias_on_the_masked_kernels_on_gpu(bias_batch, head_dim, dtype):
  """A bias per head streamed by the masked Mosaic forward and backward
  (ragged lengths, bottom-right causal in one batch, GQA 4:1): out, lse,
  dq, dk, dv and dbias against the reference by DESIGN's rule: a bias
  per head broadcast over the batch (the dbias kernel's dS in float32,
  summed) or per batch and head (its dS in the bias's dtype)."""
  if (versions.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic forward needs sm90")
  case = Case(2, 1000, 1537, 8, 2, head_dim)
  bias = (2.0 * jax.random.normal(jax.random.key(8),
                                  (bias_batch, 8, 1000, 1537))).astype(dtype)
  variants = dict(is_causal=True, q_offset=jnp.array([537, 0]))

  def attention(q, k, v, bias):
    return jax_flash.flash_attention(q, k, v, bias=bias, return_residual=True,
                                     implementation="mosaic", **variants)

  q, k, v, d_out, _ = random_inputs(case, dtype, 3)
  assert "mosaic_flash_forward" in jax.jit(attention).lower(
      q, k, v, bias).as_text()
  gradients = jax.jit(jax.grad(
      lambda *args: attention(*args)[0].astype(jnp.float32).sum(),
      argnums=(0, 1, 2, 3))).lower(q, k, v, bias).as_text()
  assert "mosaic_flash_backward_masked_dbias" in gradients
  check_against_reference(functools.partial(attention, bias=bias), case,
                          dtype, seed=3, bias=bias, **variants)

  def dbias(attend, compute_dtype):
    """d<out, d_out>/d bias of `attend(q, k, v, bias)` on inputs in
    `compute_dtype`."""
    up = lambda x: x.astype(compute_dtype)
    loss = lambda b: jnp.sum(attend(up(q), up(k), up(v), b)[0].astype(
        jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.grad(loss))(up(bias))

  reference = lambda dt: dbias(lambda q, k, v, b: naive_attention(
      q, k, v, bias=b, compute_dtype=dt, **variants), dt)
  assert_within_rule("dbias", dbias(attention, dtype),
                     reference(jnp.float32), reference(dtype))
