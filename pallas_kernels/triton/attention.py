"""`flash_attention_triton`: forward and backward kernels wired by `jax.custom_vjp`.

Residuals are (q, k, v, o, lse) plus the masks' small operands and the bias:
O(N) memory beyond what the caller passed, never an N x N array. dbias (the
one O(N^2) gradient) is computed only when the bias is differentiated.
"""
from __future__ import annotations

import functools

import jax

from jax_flash.masking import MaskSpec
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
  # symbolic_zeros: each primal comes wrapped with whether it is perturbed,
  # which tells us whether anyone wants dbias.
  unwrap = lambda x: jax.tree.map(lambda p: p.value, x,
                                  is_leaf=lambda p: hasattr(p, "perturbed"))
  bias_grad = bias is not None and bool(bias.perturbed)
  query, key, value, call_operands, bias = (
      unwrap(query), unwrap(key), unwrap(value), unwrap(call_operands),
      unwrap(bias))
  out, lse = flash_attention_triton(query, key, value, call_operands, bias,
                                    scale, spec, block_sizes, interpret)
  # The bias-gradient flag rides in the residuals' structure (static).
  flag = () if bias_grad else None
  return (out, lse), (query, key, value, out, lse, call_operands, bias, flag)


def _bwd(scale, spec, block_sizes, interpret, residuals, cotangents):
  query, key, value, out, lse, call_operands, bias, flag = residuals
  d_out, d_lse = cotangents
  if isinstance(d_lse, jax.custom_derivatives.SymbolicZero):
    d_lse = None
  if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
    d_out = jax.numpy.zeros(d_out.shape, d_out.dtype)
  with compat.quiet_triton_deprecation():
    dq, dk, dv, dbias = flash_backward(
        query, key, value, out, lse, d_out, d_lse, call_operands, bias,
        bias_grad=flag is not None, scale=scale, spec=spec,
        block_sizes=block_sizes, interpret=interpret)
  return dq, dk, dv, None, dbias


flash_attention_triton.defvjp(_fwd, _bwd, symbolic_zeros=True)
