"""`flash_attention_mosaic`: the Hopper forward wired by `jax.custom_vjp`.

Forward: `mosaic_forward` (wgmma, TMA, warp specialisation). Backward, by
`backward`: "triton", the recomputing FlashAttention-2 backward of the Triton
family (it needs only the forward's q, k, v, o, lse), or "mosaic",
`mosaic_backward` (falling back to "triton" for calls it does not cover).
`jax_flash` uses "triton" until the Mosaic backward has passed the GPU
tests (`tests/test_mosaic_backward.py -m gpu`); the benchmarks time both.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash.masking import MaskSpec
from jax_flash.validation import Operands
from pallas_kernels import compat
from pallas_kernels.config import BlockSizes
from pallas_kernels.mosaic.backward import mosaic_backward
from pallas_kernels.mosaic.forward import mosaic_forward
from pallas_kernels.triton.backward import flash_backward


BACKWARDS = ("triton", "mosaic")
# Head dims the kernels take natively; others are zero-padded up to one.
NATIVE_HEAD_DIMS = (64, 128, 256)


def mosaic_attention(query, key, value, *, scale: float, is_causal: bool,
                     backward_blocks: BlockSizes, backward: str = "triton"):
  """`flash_attention_mosaic` for any head dim up to 256.

  A head dim that is not native is zero-padded to the next native one
  (zero columns add nothing to q·k, and the padded output columns are
  dropped), as the Triton kernels pad inside theirs; the padding's
  gradient is the slice, by autodiff.

  Returns (out [B, Tq, N, D], lse float32 [B, N, Tq]).
  """
  head_dim = query.shape[-1]
  native = next((d for d in NATIVE_HEAD_DIMS if d >= head_dim), None)
  if native is None:
    raise NotImplementedError(
        f"the Mosaic kernels support head_dim up to 256, got {head_dim}")
  if native != head_dim:
    pad = [(0, 0)] * 3 + [(0, native - head_dim)]
    query, key, value = (jnp.pad(x, pad) for x in (query, key, value))
  out, lse = flash_attention_mosaic(query, key, value, scale, is_causal,
                                    backward_blocks, backward)
  return out[..., :head_dim], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def flash_attention_mosaic(query, key, value, scale: float, is_causal: bool,
                           backward_blocks: BlockSizes,
                           backward: str = "triton"):
  """Exact attention on sm90; returns (out [B, Tq, N, D], lse f32 [B, N, Tq]).

  `backward_blocks` are the Triton backward's tiles; `backward` is one of
  `BACKWARDS` (see the module docstring).
  """
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  return mosaic_forward(query, key, value, scale=scale, is_causal=is_causal)


def _fwd(query, key, value, scale, is_causal, backward_blocks, backward):
  out, lse = flash_attention_mosaic(query, key, value, scale, is_causal,
                                    backward_blocks, backward)
  return (out, lse), (query, key, value, out, lse)


def _bwd(scale, is_causal, backward_blocks, backward, residuals, cotangents):
  query, key, value, out, lse = residuals
  d_out, d_lse = cotangents
  if backward == "mosaic":
    try:
      return mosaic_backward(query, key, value, out, lse, d_out, d_lse,
                             scale=scale, is_causal=is_causal)
    except NotImplementedError:
      pass  # a call the Mosaic kernels do not cover: the Triton backward
  spec = MaskSpec(q_len=query.shape[1], kv_len=key.shape[1],
                  is_causal=is_causal)
  with compat.quiet_triton_deprecation():
    dq, dk, dv, _ = flash_backward(
        query, key, value, out, lse, d_out, d_lse, Operands(), None,
        scale=scale, spec=spec, block_sizes=backward_blocks, interpret=False)
  return dq, dk, dv


flash_attention_mosaic.defvjp(_fwd, _bwd)
