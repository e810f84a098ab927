"""`flash_attention_triton`: forward and backward kernels wired by `jax.custom_vjp`.

Residuals are (q, k, v, o, lse) plus the masks' small operands and the bias:
O(N) memory beyond what the caller passed, never an N x N array. dbias (the
one O(N^2) gradient) has a launch of its own, which XLA removes under jit
when the bias gradient is unused. (Not `symbolic_zeros`, which would say so
directly: JAX does not support it under shard_map.)
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels.masking import MaskSpec
from pallas_kernels import compat
from pallas_kernels.config import BlockSizes
from pallas_kernels.triton.backward import flash_backward
from pallas_kernels.triton.forward import flash_forward


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def flash_attention_triton(query, key, value, call_operands, bias,
                           scale: float, spec: MaskSpec,
                           block_sizes: BlockSizes, interpret: bool):
  """Exact attention; returns (out [B, Tq, N, D], lse float32 [B, N, Tq]).

  `call_operands` are `validation.Operands` (integer arrays: no gradient);
  `bias` is None or broadcastable to [B, N, Tq, Tk].
  """
  with compat.quiet_triton_deprecation():
    return flash_forward(query, key, value, call_operands, bias, scale=scale,
                         spec=spec, block_sizes=block_sizes,
                         interpret=interpret)


def _fwd(query, key, value, call_operands, bias, scale, spec, block_sizes,
         interpret):
  out, lse = flash_attention_triton(query, key, value, call_operands, bias,
                                    scale, spec, block_sizes, interpret)
  return (out, lse), (query, key, value, out, lse, call_operands, bias)


def _bwd(scale, spec, block_sizes, interpret, residuals, cotangents):
  query, key, value, out, lse, call_operands, bias = residuals
  d_out, d_lse = cotangents
  dq, dk, dv, dbias = triton_attention_backward(
      query, key, value, out, lse, d_out, d_lse, call_operands, bias,
      scale=scale, spec=spec, block_sizes=block_sizes, interpret=interpret)
  return dq, dk, dv, None, dbias


def triton_attention_backward(query, key, value, out, lse, d_out, d_lse,
                              call_operands, bias, *, scale: float,
                              spec: MaskSpec, block_sizes: BlockSizes,
                              interpret: bool):
  """`flash_attention_triton`'s gradients (dq, dk, dv, dbias) from given
  residuals: `out` [B, Tq, N, D] and `lse` float32 [B, N, Tq] need not come
  from this call's forward (see `jax_flash.residual_backward`)."""
  with compat.quiet_triton_deprecation():
    return flash_backward(
        query, key, value, out, lse, d_out, d_lse, call_operands, bias,
        scale=scale, spec=spec, block_sizes=block_sizes, interpret=interpret)


flash_attention_triton.defvjp(_fwd, _bwd)
