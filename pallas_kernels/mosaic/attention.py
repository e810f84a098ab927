"""`flash_attention_mosaic`: the Hopper forward wired by `jax.custom_vjp`.

Forward: `mosaic_forward` (wgmma, TMA, warp specialisation). Backward: the
recomputing FlashAttention-2 backward of the Triton family, which needs only
the forward's (q, k, v, o, lse), so both families share one definition of the
gradient. A Mosaic backward replaces it when it exists.
"""
from __future__ import annotations

import functools

import jax

from jax_flash.masking import MaskSpec
from jax_flash.validation import Operands
from pallas_kernels import compat
from pallas_kernels.config import BlockSizes
from pallas_kernels.mosaic.forward import mosaic_forward
from pallas_kernels.triton.backward import flash_backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def flash_attention_mosaic(query, key, value, scale: float, is_causal: bool,
                           backward_blocks: BlockSizes):
  """Exact attention on sm90; returns (out [B, Tq, N, D], lse f32 [B, N, Tq]).

  `backward_blocks` are the Triton backward's tiles.
  """
  return mosaic_forward(query, key, value, scale=scale, is_causal=is_causal)


def _fwd(query, key, value, scale, is_causal, backward_blocks):
  out, lse = flash_attention_mosaic(query, key, value, scale, is_causal,
                                    backward_blocks)
  return (out, lse), (query, key, value, out, lse)


def _bwd(scale, is_causal, backward_blocks, residuals, cotangents):
  query, key, value, out, lse = residuals
  d_out, d_lse = cotangents
  spec = MaskSpec(q_len=query.shape[1], kv_len=key.shape[1],
                  is_causal=is_causal)
  with compat.quiet_triton_deprecation():
    dq, dk, dv, _ = flash_backward(
        query, key, value, out, lse, d_out, d_lse, Operands(), None,
        scale=scale, spec=spec, block_sizes=backward_blocks, interpret=False)
  return dq, dk, dv


flash_attention_mosaic.defvjp(_fwd, _bwd)
