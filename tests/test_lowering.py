"""Cross-lowering the kernels for CUDA on a CPU-only machine.

Triton lowering errors (unsupported indexing, shapes) surface here without a GPU.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jax._src.pallas.triton import lowering as triton_lowering

from jax_flash import masking, validation
from pallas_kernels.config import BlockSizes
from pallas_kernels.triton import flash_attention_triton


@pytest.fixture
def verified_triton_modules(monkeypatch):
  """Runs the MLIR verifier on every Triton module the lowering emits.

  Without a GPU nothing parses the module, so ill-typed IR (seen once: an
  i1 constant fed to arith.maxsi) would only fail at compile time on a GPU.
  """
  lower = triton_lowering.lower_jaxpr_to_triton_module
  verified = []

  def lower_and_verify(*args, **kwargs):
    result = lower(*args, **kwargs)
    result.module.operation.verify()
    verified.append(result)
    return result

  monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module",
                      lower_and_verify)
  return verified


def _lower_grad(q_len, kv_len, head_dim, verified, bias_shape=None,
                dtype=jnp.bfloat16, **variants):
  """Lowers forward + backward of the Triton path for CUDA; returns HLO text."""
  q = jax.ShapeDtypeStruct((2, q_len, 8, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), dtype)
  bias = None if bias_shape is None else jax.ShapeDtypeStruct(bias_shape,
                                                               jnp.float32)
  blocks = BlockSizes.get_default(head_dim, device_kind="NVIDIA H200",
                                  dtype=dtype, kv_len=kv_len)

  def loss(q, k, v, bias):
    call = validation.normalise_call(q, k, v, bias=bias, **variants)
    operands = call.operands
    if call.spec.mask_fn is not None:
      operands = operands._replace(block_mask=masking.BlockMask.from_mask_fn(
          call.spec.mask_fn, batch=2, num_heads=8, q_len=q_len,
          kv_len=kv_len))
    out, lse = flash_attention_triton(q, k, v, operands, call.bias,
                                      call.scale, call.spec, blocks, False)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  lowered = jax.jit(jax.grad(loss, argnums)).trace(q, kv, kv, bias).lower(
      lowering_platforms=("cuda",))
  text = lowered.as_text()
  for name in ("flash_forward", "flash_backward_delta", "flash_backward_dkdv",
               "flash_backward_dq"):
    assert name in text, name
  # With a bias, dbias is a launch of its own (dropped by XLA when unused).
  assert len(verified) == (4 if bias is None else 5)
  return text


@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("q_len, kv_len", [(300, 200), (256, 512)])
def test_triton_kernels_lower_for_cuda(head_dim, is_causal, q_len, kv_len,
                                       verified_triton_modules):
  _lower_grad(q_len, kv_len, head_dim, verified_triton_modules,
              is_causal=is_causal)


_SEGMENTS = jnp.repeat(jnp.arange(4), 75)[None].repeat(2, 0)

VARIANTS = {
    "window+lengths+offset": dict(
        is_causal=True, local_window_size=(64, 0), q_offset=jnp.array([0, 7]),
        query_seq_lengths=jnp.array([300, 100]),
        key_value_seq_lengths=jnp.array([300, 250])),
    "segments": dict(segment_ids=_SEGMENTS),
    "bias-grad": dict(bias_shape=(2, 8, 300, 300)),
    "bias-broadcast": dict(bias_shape=(1, 8, 1, 300)),
    "dense-mask": dict(mask=jnp.ones((2, 1, 300, 300), bool)),
    "mask_fn": dict(mask_fn=lambda b, h, i, j: (i - j) % 3 != 1),
    "scores": dict(logits_soft_cap=30.0, alibi_slopes=jnp.ones((8,)),
                   score_fn=lambda s, b, h, i, j: s + 0.1 * h),
    "dropout": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    "float32": dict(dtype=jnp.float32, is_causal=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_lower_for_cuda(name, verified_triton_modules):
  _lower_grad(300, 300, 96, verified_triton_modules, **VARIANTS[name])


def _input_precision(dot_line: str) -> str | None:
  match = re.search(r"inputPrecision = (\w+)", dot_line)
  return match[1] if match else None


@pytest.mark.parametrize("head_dim", [128, 256])
def test_float32_through_triton_multiplies_in_three_tf32_passes(
    head_dim, verified_triton_modules):
  """Lowered through Triton, float32 dots ask for TF32x3 (IEEE dots took
  over a minute to compile on the H200) unless the caller asks for IEEE
  float32; with the float32 tiles at every head dim."""
  # IEEE is tt.dot's default input precision, printed as no attribute.
  for requested, precision in ((None, "tf32x3"), ("highest", None)):
    verified_triton_modules.clear()
    with jax.default_matmul_precision(requested):
      _lower_grad(256, 256, head_dim, verified_triton_modules,
                  dtype=jnp.float32, is_causal=True)
    dots = [line for result in verified_triton_modules
            for line in str(result.module).splitlines() if "tt.dot " in line]
    attributes = {_input_precision(line) for line in dots}
    assert dots and attributes == {precision}, (requested, attributes)


def test_float32_pipeline_depth_leaves_room_for_triton_scratch():
  """`common.fit_stages`: the float32 dK/dV kernel at d=128 with a streamed
  float32 bias (64-key K/V tiles resident, 32-query Q, dO and bias tiles a
  step) takes one stage; two asked 237,952 bytes of an H100's 232,448 (XLA's
  Triton; the tiles alone come to 147,456). 16-bit tiles of the same bytes,
  and float32 without a streamed tile, keep the tuned two."""
  from pallas_kernels.triton import common
  resident, step, bias = 2 * 64 * 128 * 4, 2 * 32 * 128 * 4, 32 * 64 * 4
  assert common.fit_stages(2, resident_bytes=resident,
                           per_step_bytes=step + bias, itemsize=4) == 1
  assert common.fit_stages(2, resident_bytes=resident,
                           per_step_bytes=step, itemsize=4) == 2
  assert common.fit_stages(2, resident_bytes=resident,
                           per_step_bytes=step + bias, itemsize=2) == 2


def test_interpreted_float32_dots_are_ieee():
  """Interpreted (XLA's dots; the CPU has no TF32 algorithms): float32 at
  HIGHEST whatever is requested; 16-bit tiles at the default."""
  from pallas_kernels.triton import common
  for requested in (None, "highest", "bfloat16"):
    with jax.default_matmul_precision(requested):
      assert (common.dot_precision(jnp.float32, interpret=True)
              == jax.lax.Precision.HIGHEST)
  assert common.dot_precision(jnp.bfloat16, interpret=False) is None