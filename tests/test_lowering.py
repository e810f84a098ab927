"""Cross-lowering the kernels for CUDA on a CPU-only machine.

Triton lowering errors (unsupported indexing, shapes) surface here without a GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jax_flash.masking import MaskSpec
from pallas_kernels.config import BlockSizes
from pallas_kernels.triton import flash_attention_triton


@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_triton_kernels_lower_for_cuda(head_dim, is_causal):
  q = jax.ShapeDtypeStruct((2, 300, 8, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 200, 2, head_dim), jnp.bfloat16)
  spec = MaskSpec(q_len=300, kv_len=200, is_causal=is_causal)
  blocks = BlockSizes.get_default(head_dim, device_kind="NVIDIA H200")

  def loss(q, k, v):
    out, lse = flash_attention_triton(q, k, v, 0.1, spec, blocks, False)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

  lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",))
  text = lowered.as_text()
  for name in ("flash_forward", "flash_backward_dkdv", "flash_backward_dq"):
    assert name in text, name
