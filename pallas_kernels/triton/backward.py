"""Backward kernels: recompute P from Q, K and the LSE (FlashAttention-2 §3.2).

`delta = rowsum(dO * O)` first (`delta.row_delta`, a kernel of its own). Then
two kernels, neither with atomics, so gradients are bitwise deterministic:

- dK/dV: grid (K/V block, batch, K/V head); loops over the query heads of its
  group and over the query blocks that `MaskSpec.q_block_range` visits, so GQA's
  sum over the group happens in a fixed order inside the kernel.
- dQ: grid (Q block, batch, head); loops over K/V blocks like the forward.

With `p = exp(s - lse)`: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - delta),
dK = scale · dSᵀ Q, dQ = scale · dS K. Score changes (bias, ALiBi, soft cap,
`score_fn`) multiply dS by their elementwise derivative; dropout's mask
(regenerated from the same hash) scales P in dV and dP in dS. dbias, when
asked for, is dS itself, written tile by tile by the dQ kernel.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.masking import MaskSpec
from pallas_kernels import compat
from pallas_kernels.config import BlockSizes
from pallas_kernels.triton import common, operands
from pallas_kernels.triton.delta import row_delta
from pallas_kernels.triton.operands import Tiling


def _tile_gradients(q, k, v, do, lse2, delta, *, spec, scale, reader,
                    q_start, kv_start, tiling, batch, head, group_index,
                    masked):
  """Recomputes one [block_q, block_k] tile and returns (p_out, ds).

  p_out: the weights that multiplied V (after dropout), for dV.
  ds: dL/d(scale * q·k), for dQ and dK (also dbias).
  """
  q_idx, kv_idx = common.tile_indices(q_start, kv_start, tiling.block_q,
                                      tiling.block_k)
  values = reader.values(q_start, kv_start, group_index)
  qk = common.matmul(q, k, tiling.precision, transpose_b=True)
  s = common.logits_base2(spec, qk, scale, q_idx, kv_idx, values, masked)
  p = common.weights(s, lse2[:, None], spec.unbounded_scores)
  dp = common.matmul(do, v, tiling.precision, transpose_b=True)
  kept = common.dropout_keep(spec, reader, q_idx, kv_idx, batch, head)
  p_out = p
  if kept is not None:
    keep_scale = 1.0 / (1.0 - spec.dropout_rate)
    p_out = jnp.where(kept, p * keep_scale, 0.0)
    dp = jnp.where(kept, dp * keep_scale, 0.0)
  ds = p * (dp - delta[:, None])
  ds = common.score_grad(spec, qk, scale, q_idx, kv_idx, values, ds)
  return p_out, ds


def _lse_for_backward(lse):
  """Base-2 LSE with empty rows (-inf) mapped to +inf, so their P is 0, not NaN."""
  return jnp.where(lse == -jnp.inf, jnp.inf, lse * common.LOG2_E)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
                 scale: float, spec: MaskSpec, dims: common.KernelDims,
                 tiling: Tiling, layouts):
  """q_ref, do_ref [q_len, group, Dp]; k_ref, v_ref [block_k, Dp];
  lse_ref, delta_ref [group, q_len]; optional inputs; dk_ref, dv_ref
  [block_k, Dp]."""
  *inputs, dk_ref, dv_ref = refs
  block_q, block_k = tiling.block_q, tiling.block_k
  batch, kv_head = pl.program_id(1), pl.program_id(2)
  reader = operands.TileReader(inputs, layouts, spec, tiling, batch, kv_head)
  kv_start = pl.program_id(0) * block_k
  tile = pl.ds(0, block_k)
  kv_rows_left = spec.kv_len - kv_start if spec.kv_len % block_k else None
  k = common.load_tile(k_ref, tile, dims, kv_rows_left)
  v = common.load_tile(v_ref, tile, dims, kv_rows_left)

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
      p_out, ds = _tile_gradients(
          q, k, v, do, lse2, delta, spec=spec, scale=scale, reader=reader,
          q_start=q_start, kv_start=kv_start, tiling=tiling, batch=batch,
          head=kv_head * tiling.group + g, group_index=g, masked=masked)
      dv = dv + common.matmul_t(p_out.astype(do.dtype), do, tiling.precision)
      dk = dk + common.matmul_t(ds.astype(q.dtype), q, tiling.precision)
      return dk, dv

    block_state = None
    if spec.needs_block_map:
      block_state = lambda i: reader.block_state(i, g)
    return common.run_block_loop(reader.ranges(g), body, carry, block_state)

  zeros = jnp.zeros((block_k, dims.head_dim_padded), jnp.float32)
  dk, dv = lax.fori_loop(0, tiling.group, head_body, (zeros, zeros))
  rows_left = spec.kv_len - kv_start
  common.store_tile(dk_ref, tile, dk * scale, dims, rows_left)
  common.store_tile(dv_ref, tile, dv, dims, rows_left)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
               scale: float, spec: MaskSpec, dims: common.KernelDims,
               tiling: Tiling, layouts, bias_grad: bool):
  """q_ref, do_ref [block_q, Dp]; k_ref, v_ref [kv_len, Dp]; lse_ref,
  delta_ref [block_q]; optional inputs; (zeroed dbias input, aliased);
  dq_ref [block_q, Dp]; with bias_grad, dbias_ref [block_q, kv_len]."""
  if bias_grad:
    *inputs, _, dq_ref, dbias_ref = refs
  else:
    *inputs, dq_ref = refs
  block_q, block_k = tiling.block_q, tiling.block_k
  batch, head = pl.program_id(1), pl.program_id(2)
  reader = operands.TileReader(inputs, layouts, spec, tiling, batch, head)
  q_start = pl.program_id(0) * block_q
  tile = pl.ds(0, block_q)
  q_rows_left = spec.q_len - q_start if spec.q_len % block_q else None
  q = common.load_tile(q_ref, tile, dims, q_rows_left)
  do = common.load_tile(do_ref, tile, dims, q_rows_left)
  lse2 = _lse_for_backward(common.load_rows(lse_ref, tile, q_rows_left, jnp.inf))
  delta = common.load_rows(delta_ref, tile, q_rows_left, 0.0)

  def body(j, dq, masked: bool):
    kv_start = j * block_k
    rows = pl.ds(kv_start, block_k)
    tail = spec.kv_len if masked else None
    k = common.load_tile(k_ref, rows, dims, tail)
    v = common.load_tile(v_ref, rows, dims, tail)
    _, ds = _tile_gradients(
        q, k, v, do, lse2, delta, spec=spec, scale=scale, reader=reader,
        q_start=q_start, kv_start=kv_start, tiling=tiling, batch=batch,
        head=head, group_index=None, masked=masked)
    if bias_grad:
      valid = ((q_start + jnp.arange(block_q) < spec.q_len)[:, None]
               & (kv_start + jnp.arange(block_k) < spec.kv_len)[None, :])
      plgpu.store(dbias_ref.at[tile, rows], ds.astype(dbias_ref.dtype),
                  mask=valid)
    return dq + common.matmul(ds.astype(k.dtype), k, tiling.precision)

  dq = jnp.zeros((block_q, dims.head_dim_padded), jnp.float32)
  block_state = reader.block_state if spec.needs_block_map else None
  dq = common.run_block_loop(reader.ranges(), body, dq, block_state)
  common.store_tile(dq_ref, tile, dq * scale, dims, spec.q_len - q_start)


def flash_backward(query, key, value, out, lse, d_out, d_lse, call_operands,
                   bias, *, scale: float, spec: MaskSpec,
                   block_sizes: BlockSizes, interpret: bool):
  """Gradients of attention with respect to query, key, value (and bias).

  Args:
    query: [batch, q_len, num_heads, head_dim]; key, value: [batch, kv_len,
      num_kv_heads, head_dim]; out, d_out: like query.
    lse: float32 [batch, num_heads, q_len] from the forward.
    d_lse: cotangent of lse (same shape) or None.
    call_operands: `validation.Operands`; bias: as in `flash_forward`.

  Returns:
    (dq, dk, dv, dbias) shaped like (query, key, value, bias); dbias is None
    without a bias. dbias (the one O(N^2) output) comes from a launch of its
    own, so that under jit XLA drops it when nothing uses the bias gradient.
  """
  # delta = rowsum(dO * O); an LSE cotangent enters the same way, because
  # d lse / d s = P, so dS = P * (dP - (delta - d_lse)).
  delta = row_delta(out, d_out, interpret=interpret)
  if d_lse is not None:
    delta = delta - d_lse
  args = (query, key, value, d_out, lse, delta, call_operands, bias)
  options = dict(scale=scale, spec=spec, block_sizes=block_sizes,
                 interpret=interpret)
  dk, dv = backward_dkdv(*args, **options)
  dq, _ = backward_dq(*args, **options)
  dbias = None
  if bias is not None:
    # The dQ kernel again, writing dS tiles (its dQ is discarded): paid only
    # when dbias is used. Then sum over the axes bias was broadcast along.
    _, dbias_full = backward_dq(*args, bias_grad=True, **options)
    axes = tuple(i for i, n in enumerate(bias.shape) if n == 1)
    dbias = dbias_full.sum(axes, keepdims=True).astype(bias.dtype)
  return dq, dk, dv, dbias


def backward_dkdv(query, key, value, d_out, lse, delta, call_operands, bias,
                  *, scale: float, spec: MaskSpec, block_sizes: BlockSizes,
                  interpret: bool):
  """dK, dV [batch, kv_len, num_kv_heads, head_dim]; lse, delta [B, N, Tq]."""
  batch, q_len, _, _ = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  dims, tiling, extra, extra_specs, layouts = operands.setup_launch(
      query, key, spec, call_operands, bias, kv_tiled=True,
      block_q=block_sizes.block_q_dkv, block_k=block_sizes.block_kv_dkv,
      interpret=interpret)
  group, dp = tiling.group, dims.head_dim_padded
  q_padded = pl.cdiv(q_len, tiling.block_q) * tiling.block_q
  group_q_spec = pl.BlockSpec((None, q_padded, group, dp),
                              lambda j, b, h: (b, 0, h, 0))
  group_row_spec = pl.BlockSpec((None, group, q_padded),
                                lambda j, b, h: (b, h, 0))
  kv_tile_spec = pl.BlockSpec((None, tiling.block_k, None, dp),
                              lambda j, b, h: (b, j, h, 0))
  itemsize = jnp.dtype(query.dtype).itemsize
  # Resident: the K and V tiles (the dK, dV accumulators live in registers).
  # Per step: a Q and a dO tile, and the streamed mask / bias tiles.
  stages = common.fit_stages(
      block_sizes.num_stages_dkdv,
      resident_bytes=2 * tiling.block_k * dp * itemsize,
      per_step_bytes=2 * tiling.block_q * dp * itemsize
      + common.streamed_tile_bytes(call_operands, bias, tiling.block_q,
                                   tiling.block_k),
      itemsize=itemsize)
  inputs = (query, key, value, d_out, lse, delta, *extra)
  return compat.pallas_call(
      functools.partial(_dkdv_kernel, scale=scale, spec=spec, dims=dims,
                        tiling=tiling, layouts=layouts),
      grid=(pl.cdiv(kv_len, tiling.block_k), batch, num_kv_heads),
      in_specs=[group_q_spec, kv_tile_spec, kv_tile_spec, group_q_spec,
                group_row_spec, group_row_spec, *extra_specs],
      out_specs=[kv_tile_spec, kv_tile_spec],
      out_shape=[compat.output_struct(key.shape, key.dtype, *inputs),
                 compat.output_struct(value.shape, value.dtype, *inputs)],
      compiler_params=common.compiler_params(block_sizes.num_warps_dkdv,
                                             stages),
      interpret=interpret,
      name="flash_backward_dkdv",
  )(*inputs)


def backward_dq(query, key, value, d_out, lse, delta, call_operands, bias, *,
                bias_grad: bool = False, scale: float, spec: MaskSpec,
                block_sizes: BlockSizes, interpret: bool):
  """dQ [batch, q_len, num_heads, head_dim] and, with `bias_grad`, the
  unreduced float32 dbias [batch, num_heads, q_len, kv_len] (else None)."""
  batch, q_len, num_heads, _ = query.shape
  kv_len = key.shape[1]
  dims, tiling, extra, extra_specs, layouts = operands.setup_launch(
      query, key, spec, call_operands, bias, kv_tiled=False,
      block_q=block_sizes.block_q_dq, block_k=block_sizes.block_kv_dq,
      interpret=interpret)
  group, dp = tiling.group, dims.head_dim_padded
  kv_padded = pl.cdiv(kv_len, tiling.block_k) * tiling.block_k
  q_tile_spec = pl.BlockSpec((None, tiling.block_q, None, dp),
                             lambda i, b, h: (b, i, h, 0))
  kv_spec = pl.BlockSpec((None, kv_padded, None, dp),
                         lambda i, b, h: (b, 0, h // group, 0))
  row_spec = pl.BlockSpec((None, None, tiling.block_q),
                          lambda i, b, h: (b, h, i))
  in_specs = [q_tile_spec, kv_spec, kv_spec, q_tile_spec, row_spec, row_spec,
              *extra_specs]
  itemsize = jnp.dtype(query.dtype).itemsize
  # Resident: the Q and dO tiles; per step: a K and a V tile, the streamed
  # mask / bias tiles and, with `bias_grad`, the dbias tile written out.
  stages = common.fit_stages(
      block_sizes.num_stages_dq,
      resident_bytes=2 * tiling.block_q * dp * itemsize,
      per_step_bytes=2 * tiling.block_k * dp * itemsize
      + common.streamed_tile_bytes(call_operands, bias, tiling.block_q,
                                   tiling.block_k)
      + (tiling.block_q * tiling.block_k * 4 if bias_grad else 0),
      itemsize=itemsize)
  inputs = [query, key, value, d_out, lse, delta, *extra]
  out_specs = [q_tile_spec]
  out_shape = [compat.output_struct(query.shape, query.dtype, *inputs)]
  aliases = {}
  if bias_grad:
    # Skipped tiles are never written, so dbias starts as zeros (aliased).
    dbias_shape = (batch, num_heads, q_len, kv_len)
    dbias_spec = pl.BlockSpec((None, None, tiling.block_q, kv_padded),
                              lambda i, b, h: (b, h, i, 0))
    aliases = {len(inputs): 1}
    inputs.append(jnp.zeros(dbias_shape, jnp.float32))
    in_specs.append(dbias_spec)
    out_specs.append(dbias_spec)
    out_shape.append(compat.output_struct(dbias_shape, jnp.float32, *inputs))
  results = compat.pallas_call(
      functools.partial(_dq_kernel, scale=scale, spec=spec, dims=dims,
                        tiling=tiling, layouts=layouts, bias_grad=bias_grad),
      grid=(pl.cdiv(q_len, tiling.block_q), batch, num_heads),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=common.compiler_params(block_sizes.num_warps_dq,
                                             stages),
      interpret=interpret,
      name="flash_backward_dq",
  )(*inputs)
  return results[0], (results[1] if bias_grad else None)
