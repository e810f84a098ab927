"""`flash_attention_backward`: the gradients of one call from given residuals.

A call's backward needs only q, k, v, the residuals (out, lse) and the
cotangents. Given the (out, lse) of attention over *more* keys than this call
holds, with this call's keys among them (K/V shards merged by log-sum-exp,
as `jax_flash.sharding` does), the same backward gives this call's share of
that attention's gradient. The weights of this call's keys in the merged
softmax are P = exp(s - lse), and delta = rowsum(dO * out) - d_lse is the
merged row's. So dS = P * (dO Vᵀ - delta) is exactly the merged attention's
gradient on these logits: dK and dV of these keys, and their part of dQ
(the parts of all calls sum to dQ).

The ring's backward uses this instead of running each pair's forward again
to rebuild the pair's own (out, lse): one forward kernel fewer per pair.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_flash import api, reference, validation
from jax_flash.validation import AttentionCall
from pallas_kernels.config import BlockSizes


def flash_attention_backward(
    query, key, value, out, lse, d_out, d_lse=None, *, scale=None,
    is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
    local_window_size=None, segment_ids=None, q_offset=None,
    logits_soft_cap=None, implementation=None, block_sizes=None,
    interpret=None):
  """(dq, dk, dv) of `flash_attention` with these arguments, at residuals
  (out, lse) and cotangents (d_out, d_lse).

  Args:
    query, key, value: as `flash_attention`.
    out: [batch, q_len, num_heads, head_dim], query's dtype: the output of
      this call, or of attention over a superset of its keys.
    lse: float32 [batch, q_len, num_heads], natural log, matching `out`
      (-inf for rows that attend to nothing).
    d_out: like out. d_lse: like lse, or None (zero).
    The rest: as `flash_attention` (the mask arguments that
    `sequence_parallel_attention` forwards); bias, masks given as arrays or
    functions, ALiBi, score functions, dropout and sinks are not supported.

  Returns:
    (dq, dk, dv), shaped and typed like (query, key, value).
  """
  call = validation.normalise_call(
      query, key, value, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      q_offset=q_offset, logits_soft_cap=logits_soft_cap)
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a BlockSizes, got {block_sizes!r}")
  shape = call.shape
  rows = (shape.batch, shape.q_len, shape.num_heads)
  for name, x, want_shape, dtype in (
      ("out", out, query.shape, query.dtype),
      ("d_out", d_out, query.shape, None),
      ("lse", lse, rows, jnp.float32),
      ("d_lse", d_lse, rows, None)):
    if x is None and name == "d_lse":
      continue
    if tuple(x.shape) != tuple(want_shape):
      raise ValueError(f"{name} must have shape {tuple(want_shape)}, got "
                       f"{tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
      raise TypeError(f"{name} must be {jnp.dtype(dtype).name}, got "
                      f"{x.dtype}")
  if d_lse is None:
    d_lse = jnp.zeros(rows, jnp.float32)
  d_lse = d_lse.astype(jnp.float32)
  run = lambda name, interpret_: _BACKWARDS[name](
      call, query, key, value, out, lse, d_out, d_lse,
      block_sizes=block_sizes, interpret=interpret_)
  return api.dispatch(implementation, interpret, run)


def _xla(call: AttentionCall, query, key, value, out, lse, d_out, d_lse, **_):
  return reference.reference_backward(call, query, key, value, out, lse,
                                      d_out, d_lse)


def _triton(call: AttentionCall, query, key, value, out, lse, d_out, d_lse,
            *, block_sizes, interpret):
  from pallas_kernels.triton.attention import triton_attention_backward
  block_sizes, operands = api.triton_setup(call, query.dtype, block_sizes,
                                           interpret)
  dq, dk, dv, _ = triton_attention_backward(
      query, key, value, out, _kernel_rows(lse), d_out, _kernel_rows(d_lse),
      operands, None, scale=call.scale, spec=call.spec,
      block_sizes=block_sizes, interpret=interpret)
  return dq, dk, dv


def _mosaic(call: AttentionCall, query, key, value, out, lse, d_out, d_lse,
            *, block_sizes, interpret):
  block_sizes, mosaic, operands = api.mosaic_setup(call, block_sizes,
                                                   interpret)
  return mosaic.mosaic_attention_backward(
      query, key, value, out, _kernel_rows(lse), d_out, _kernel_rows(d_lse),
      scale=call.scale, is_causal=call.spec.is_causal,
      backward_blocks=block_sizes, spec=call.spec, operands=operands)


def _kernel_rows(x):
  """[batch, q_len, heads] (the API's lse layout) -> [batch, heads, q_len]
  (the kernels')."""
  return jnp.swapaxes(x, 1, 2)


_BACKWARDS = {"xla": _xla, "triton": _triton, "mosaic": _mosaic}
