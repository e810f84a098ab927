"""`flash_attention_triton`: forward and backward kernels wired by `jax.custom_vjp`.

Residuals are (q, k, v, o, lse): O(N) memory, never an N x N array.
"""
from __future__ import annotations

import functools

import jax

from jax_flash.masking import MaskSpec
from pallas_kernels import compat
from pallas_kernels.config import BlockSizes
from pallas_kernels.triton.backward import flash_backward
from pallas_kernels.triton.forward import flash_forward


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def flash_attention_triton(query, key, value, scale: float, spec: MaskSpec,
                           block_sizes: BlockSizes, interpret: bool):
  """Exact attention; returns (out [B, Tq, N, D], lse float32 [B, N, Tq])."""
  with compat.quiet_triton_deprecation():
    return flash_forward(query, key, value, scale=scale, spec=spec,
                         block_sizes=block_sizes, interpret=interpret)


def _fwd(query, key, value, scale, spec, block_sizes, interpret):
  out, lse = flash_attention_triton(query, key, value, scale, spec,
                                    block_sizes, interpret)
  return (out, lse), (query, key, value, out, lse)


def _bwd(scale, spec, block_sizes, interpret, residuals, cotangents):
  query, key, value, out, lse = residuals
  d_out, d_lse = cotangents
  with compat.quiet_triton_deprecation():
    return flash_backward(query, key, value, out, lse, d_out, d_lse,
                          scale=scale, spec=spec, block_sizes=block_sizes,
                          interpret=interpret)


flash_attention_triton.defvjp(_fwd, _bwd)
