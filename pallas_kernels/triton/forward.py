"""Forward kernel: tiled attention with online softmax (FlashAttention-2 Alg. 1).

Grid (q block, batch, head). Each program keeps its Q tile resident, walks the
K/V blocks that the call's block ranges say are non-empty, and keeps the
output unnormalised (with running max `m` and sum `l`, in base 2) until the
end. It stores O and the natural-log LSE; nothing of size N x N is written.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.masking import MaskSpec
from pallas_kernels import compat
from pallas_kernels.config import BlockSizes
from pallas_kernels.triton import common, operands
from pallas_kernels.triton.operands import Tiling


def _forward_kernel(q_ref, k_ref, v_ref, *refs, scale: float, spec: MaskSpec,
                    dims: common.KernelDims, tiling: Tiling, layouts):
  """q_ref [block_q, Dp]; k_ref, v_ref [kv_len, Dp]; then the optional inputs
  of `layouts`; outputs o_ref [block_q, Dp] and lse_ref [block_q]."""
  *inputs, o_ref, lse_ref = refs
  block_q, block_k = tiling.block_q, tiling.block_k
  batch, head = pl.program_id(1), pl.program_id(2)
  reader = operands.TileReader(inputs, layouts, spec, tiling, batch, head)
  q_start = pl.program_id(0) * block_q
  tile = pl.ds(0, block_q)
  # Rows of this tile that exist; None when every tile is full (no row mask).
  q_rows_left = spec.q_len - q_start if spec.q_len % block_q else None
  q = common.load_tile(q_ref, tile, dims, q_rows_left)

  # A bias or score_fn can take a whole row of an unmasked tile to -inf
  # (a padding bias at float32's lowest: `masking.LOWEST_LOGIT`): such
  # tiles keep the guard against exp2(-inf - -inf) too.
  rows_may_empty = spec.has_bias or spec.score_fn is not None

  def body(j, carry, masked: bool):
    acc, m, l = carry
    kv_start = j * block_k
    kv_rows = pl.ds(kv_start, block_k)
    tail = spec.kv_len if masked else None
    k = common.load_tile(k_ref, kv_rows, dims, tail)
    q_idx, kv_idx = common.tile_indices(q_start, kv_start, block_q, block_k)
    values = reader.values(q_start, kv_start)
    qk = common.matmul(q, k, tiling.precision, transpose_b=True)
    s = common.logits_base2(spec, qk, scale, q_idx, kv_idx, values, masked)
    m_new, correction, p, l = common.softmax_step(
        m, l, s, masked or rows_may_empty, spec.unbounded_scores)
    kept = common.dropout_keep(spec, reader, q_idx, kv_idx, batch, head)
    if kept is not None:
      # The softmax sum uses every weight; only the output sees dropout.
      p = jnp.where(kept, p * (1.0 / (1.0 - spec.dropout_rate)), 0.0)
    v = common.load_tile(v_ref, kv_rows, dims, tail)
    pv = common.matmul(p.astype(v.dtype), v, tiling.precision)
    acc = acc * correction[:, None] + pv
    return acc, m_new, l

  carry = common.softmax_init(block_q, dims.head_dim_padded)
  block_state = reader.block_state if spec.needs_block_map else None
  acc, m, l = common.run_block_loop(reader.ranges(), body, carry, block_state)

  out, lse = common.softmax_finish(acc, m, l)
  common.store_tile(o_ref, tile, out, dims, spec.q_len - q_start)
  common.store_rows(lse_ref, tile, lse, spec.q_len - q_start)


def flash_forward(query, key, value, call_operands, bias, *, scale: float,
                  spec: MaskSpec, block_sizes: BlockSizes, interpret: bool):
  """Attention forward.

  Args:
    query: [batch, q_len, num_heads, head_dim].
    key, value: [batch, kv_len, num_kv_heads, head_dim].
    call_operands: `validation.Operands` (the masks' traced inputs).
    bias: broadcastable [batch|1, heads|1, q_len|1, kv_len|1] or None.

  Returns:
    out [batch, q_len, num_heads, head_dim] (query.dtype) and
    lse float32 [batch, num_heads, q_len] (natural log, -inf for empty rows).
  """
  batch, q_len, num_heads, _ = query.shape
  group = num_heads // key.shape[2]
  dims, tiling, extra, extra_specs, layouts = operands.setup_launch(
      query, key, spec, call_operands, bias, kv_tiled=False,
      block_q=block_sizes.block_q, block_k=block_sizes.block_k,
      interpret=interpret)
  kv_padded = pl.cdiv(spec.kv_len, tiling.block_k) * tiling.block_k
  dp = dims.head_dim_padded

  itemsize = jnp.dtype(query.dtype).itemsize
  stages = common.fit_stages(
      block_sizes.num_stages,
      resident_bytes=tiling.block_q * dp * itemsize,
      per_step_bytes=2 * tiling.block_k * dp * itemsize
      + common.streamed_tile_bytes(call_operands, bias, tiling.block_q,
                                   tiling.block_k),
      itemsize=itemsize)
  inputs = (query, key, value, *extra)
  kernel = functools.partial(_forward_kernel, scale=scale, spec=spec,
                             dims=dims, tiling=tiling, layouts=layouts)
  grid = (pl.cdiv(q_len, tiling.block_q), batch, num_heads)
  q_spec = pl.BlockSpec((None, tiling.block_q, None, dp),
                        lambda i, b, h: (b, i, h, 0))
  kv_spec = pl.BlockSpec((None, kv_padded, None, dp),
                         lambda i, b, h: (b, 0, h // group, 0))
  lse_spec = pl.BlockSpec((None, None, tiling.block_q),
                          lambda i, b, h: (b, h, i))
  return compat.pallas_call(
      kernel,
      grid=grid,
      in_specs=[q_spec, kv_spec, kv_spec, *extra_specs],
      out_specs=[q_spec, lse_spec],
      out_shape=[compat.output_struct(query.shape, query.dtype, *inputs),
                 compat.output_struct((batch, num_heads, q_len), jnp.float32,
                                      *inputs)],
      compiler_params=common.compiler_params(block_sizes.num_warps, stages),
      interpret=interpret,
      name="flash_forward",
  )(*inputs)
