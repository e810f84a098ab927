"""Cross-lowering the kernels for CUDA on a CPU-only machine.

Triton lowering errors (unsupported indexing, shapes) surface here without a GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jax._src.pallas.triton import lowering as triton_lowering

from jax_flash.masking import MaskSpec
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


@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("q_len, kv_len", [(300, 200), (256, 512)])
def test_triton_kernels_lower_for_cuda(head_dim, is_causal, q_len, kv_len,
                                       verified_triton_modules):
  q = jax.ShapeDtypeStruct((2, q_len, 8, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), jnp.bfloat16)
  spec = MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=is_causal)
  blocks = BlockSizes.get_default(head_dim, device_kind="NVIDIA H200")

  def loss(q, k, v):
    out, lse = flash_attention_triton(q, k, v, 0.1, spec, blocks, False)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

  lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",))
  text = lowered.as_text()
  for name in ("flash_forward", "flash_backward_dkdv", "flash_backward_dq"):
    assert name in text, name
  assert len(verified_triton_modules) == 3
