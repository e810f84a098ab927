"""Backward kernels: recompute P from Q, K and the LSE (FlashAttention-2 §3.2).

`delta = rowsum(dO * O)` is a cheap reduction left to XLA. Then two kernels,
neither with atomics, so gradients are bitwise deterministic:

- dK/dV: grid (K/V block, batch, K/V head); loops over the query heads of its
  group and over the query blocks that `MaskSpec.q_block_range` visits, so GQA's
  sum over the group happens in a fixed order inside the kernel.
- dQ: grid (Q block, batch, head); loops over K/V blocks like the forward.

With `p = exp(s - lse)`: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - delta),
dK = scale · dSᵀ Q, dQ = scale · dS K.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_flash.masking import MaskSpec
from pallas_kernels.config import BlockSizes
from pallas_kernels.triton import common


def _probabilities(q, k, lse2, *, qk_scale, spec, q_start, kv_start, block_q,
                   block_k, masked):
  """Recomputes the [block_q, block_k] probabilities from the base-2 LSE."""
  s = common.matmul(q, k, transpose_b=True) * qk_scale
  p = jnp.exp2(s - lse2[:, None])
  if masked:
    keep = common.element_keep(spec, q_start, kv_start, block_q, block_k)
    p = jnp.where(keep, p, 0.0)
  return p


def _lse_for_backward(lse):
  """Base-2 LSE with empty rows (-inf) mapped to +inf, so their P is 0, not NaN."""
  return jnp.where(lse == -jnp.inf, jnp.inf, lse * common.LOG2_E)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref,
                 dv_ref, *, scale: float, spec: MaskSpec,
                 dims: common.KernelDims, group: int, block_q: int,
                 block_k: int):
  """q_ref, do_ref [q_len, group, Dp]; k_ref, v_ref, dk_ref, dv_ref [block_k, Dp];
  lse_ref, delta_ref [group, q_len]."""
  kv_start = pl.program_id(0) * block_k
  tile = pl.ds(0, block_k)
  kv_rows_left = spec.kv_len - kv_start if spec.kv_len % block_k else None
  k = common.load_tile(k_ref, tile, dims, kv_rows_left)
  v = common.load_tile(v_ref, tile, dims, kv_rows_left)
  qk_scale = scale * common.LOG2_E
  block_range = spec.q_block_range(kv_start, block_q, block_k)

  def head_body(g, carry):
    def body(i, carry, masked: bool):
      dk, dv = carry
      q_start = i * block_q
      rows = pl.ds(q_start, block_q)
      tail = spec.q_len if masked else None
      q = common.load_tile(q_ref, rows, dims, tail, head=g)
      do = common.load_tile(do_ref, rows, dims, tail, head=g)
      lse2 = _lse_for_backward(
          common.load_rows(lse_ref, rows, tail, jnp.inf, head=g))
      delta = common.load_rows(delta_ref, rows, tail, 0.0, head=g)
      p = _probabilities(q, k, lse2, qk_scale=qk_scale, spec=spec,
                         q_start=q_start, kv_start=kv_start, block_q=block_q,
                         block_k=block_k, masked=masked)
      dv = dv + common.matmul_t(p.astype(do.dtype), do)
      dp = common.matmul(do, v, transpose_b=True)
      ds = p * (dp - delta[:, None])
      dk = dk + common.matmul_t(ds.astype(q.dtype), q)
      return dk, dv
    return common.run_block_loop(block_range, body, carry)

  zeros = jnp.zeros((block_k, dims.head_dim_padded), jnp.float32)
  dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
  rows_left = spec.kv_len - kv_start
  common.store_tile(dk_ref, tile, dk * scale, dims, rows_left)
  common.store_tile(dv_ref, tile, dv, dims, rows_left)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               scale: float, spec: MaskSpec, dims: common.KernelDims,
               block_q: int, block_k: int):
  """q_ref, do_ref, dq_ref [block_q, Dp]; k_ref, v_ref [kv_len, Dp];
  lse_ref, delta_ref [block_q]."""
  q_start = pl.program_id(0) * block_q
  tile = pl.ds(0, block_q)
  q_rows_left = spec.q_len - q_start if spec.q_len % block_q else None
  q = common.load_tile(q_ref, tile, dims, q_rows_left)
  do = common.load_tile(do_ref, tile, dims, q_rows_left)
  lse2 = _lse_for_backward(common.load_rows(lse_ref, tile, q_rows_left, jnp.inf))
  delta = common.load_rows(delta_ref, tile, q_rows_left, 0.0)
  qk_scale = scale * common.LOG2_E

  def body(j, dq, masked: bool):
    kv_start = j * block_k
    rows = pl.ds(kv_start, block_k)
    tail = spec.kv_len if masked else None
    k = common.load_tile(k_ref, rows, dims, tail)
    v = common.load_tile(v_ref, rows, dims, tail)
    p = _probabilities(q, k, lse2, qk_scale=qk_scale, spec=spec,
                       q_start=q_start, kv_start=kv_start, block_q=block_q,
                       block_k=block_k, masked=masked)
    dp = common.matmul(do, v, transpose_b=True)
    ds = p * (dp - delta[:, None])
    return dq + common.matmul(ds.astype(k.dtype), k)

  dq = jnp.zeros((block_q, dims.head_dim_padded), jnp.float32)
  dq = common.run_block_loop(spec.kv_block_range(q_start, block_q, block_k),
                             body, dq)
  common.store_tile(dq_ref, tile, dq * scale, dims, spec.q_len - q_start)


def flash_backward(query, key, value, out, lse, d_out, d_lse, *, scale: float,
                   spec: MaskSpec, block_sizes: BlockSizes, interpret: bool):
  """Gradients of attention with respect to query, key and value.

  Args:
    query: [batch, q_len, num_heads, head_dim]; key, value: [batch, kv_len,
      num_kv_heads, head_dim]; out, d_out: like query.
    lse: float32 [batch, num_heads, q_len] from the forward.
    d_lse: cotangent of lse (same shape) or None.

  Returns:
    (dq, dk, dv) shaped like (query, key, value).
  """
  # delta = rowsum(dO * O); an LSE cotangent enters the same way, because
  # d lse / d s = P, so dS = P * (dP - (delta - d_lse)).
  delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32),
                     out.astype(jnp.float32))
  if d_lse is not None:
    delta = delta - d_lse
  args = (query, key, value, d_out, lse, delta)
  options = dict(scale=scale, spec=spec, block_sizes=block_sizes,
                 interpret=interpret)
  dk, dv = backward_dkdv(*args, **options)
  dq = backward_dq(*args, **options)
  return dq, dk, dv


def backward_dkdv(query, key, value, d_out, lse, delta, *, scale: float,
                  spec: MaskSpec, block_sizes: BlockSizes, interpret: bool):
  """dK, dV [batch, kv_len, num_kv_heads, head_dim]; lse, delta [B, N, Tq]."""
  batch, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  group = num_heads // num_kv_heads
  dims = common.KernelDims.for_head_dim(head_dim)
  dp = dims.head_dim_padded
  block_q = common.clamp_block(block_sizes.block_q_dkv, q_len)
  block_k = common.clamp_block(block_sizes.block_kv_dkv, kv_len)
  q_padded = pl.cdiv(q_len, block_q) * block_q
  group_q_spec = pl.BlockSpec((None, q_padded, group, dp),
                              lambda j, b, h: (b, 0, h, 0))
  group_row_spec = pl.BlockSpec((None, group, q_padded),
                                lambda j, b, h: (b, h, 0))
  kv_tile_spec = pl.BlockSpec((None, block_k, None, dp),
                              lambda j, b, h: (b, j, h, 0))
  return pl.pallas_call(
      functools.partial(_dkdv_kernel, scale=scale, spec=spec, dims=dims,
                        group=group, block_q=block_q, block_k=block_k),
      grid=(pl.cdiv(kv_len, block_k), batch, num_kv_heads),
      in_specs=[group_q_spec, kv_tile_spec, kv_tile_spec, group_q_spec,
                group_row_spec, group_row_spec],
      out_specs=[kv_tile_spec, kv_tile_spec],
      out_shape=[jax.ShapeDtypeStruct(key.shape, key.dtype),
                 jax.ShapeDtypeStruct(value.shape, value.dtype)],
      compiler_params=common.compiler_params(block_sizes.num_warps_dkdv,
                                             block_sizes.num_stages_dkdv),
      interpret=interpret,
      name="flash_backward_dkdv",
  )(query, key, value, d_out, lse, delta)


def backward_dq(query, key, value, d_out, lse, delta, *, scale: float,
                spec: MaskSpec, block_sizes: BlockSizes, interpret: bool):
  """dQ [batch, q_len, num_heads, head_dim]; lse, delta [B, N, Tq]."""
  batch, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  group = num_heads // num_kv_heads
  dims = common.KernelDims.for_head_dim(head_dim)
  dp = dims.head_dim_padded
  block_q = common.clamp_block(block_sizes.block_q_dq, q_len)
  block_k = common.clamp_block(block_sizes.block_kv_dq, kv_len)
  kv_padded = pl.cdiv(kv_len, block_k) * block_k
  q_tile_spec = pl.BlockSpec((None, block_q, None, dp),
                             lambda i, b, h: (b, i, h, 0))
  kv_spec = pl.BlockSpec((None, kv_padded, None, dp),
                         lambda i, b, h: (b, 0, h // group, 0))
  row_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
  return pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, spec=spec, dims=dims,
                        block_q=block_q, block_k=block_k),
      grid=(pl.cdiv(q_len, block_q), batch, num_heads),
      in_specs=[q_tile_spec, kv_spec, kv_spec, q_tile_spec, row_spec,
                row_spec],
      out_specs=q_tile_spec,
      out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
      compiler_params=common.compiler_params(block_sizes.num_warps_dq,
                                             block_sizes.num_stages_dq),
      interpret=interpret,
      name="flash_backward_dq",
  )(query, key, value, d_out, lse, delta)
