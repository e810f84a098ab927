"""delta = rowsum(dO ∘ O): the backward's one preprocessing step, as a kernel.

FlashAttention-2's backward (§3.2) needs, per query row, the dot product of
the output's row and its cotangent's. In the API's layout that is a
reduction over head_dim of two [batch, q_len, heads, head_dim] arrays into a
[batch, heads, q_len] row the backward kernels stream. Left to XLA inside
the Mosaic backward's row statistics (the sum, a transpose, and a stack
with the LSE), XLA fused it all and took 0.32-0.39 ms at the grid's seq-1k
cells on the H200, a quarter of the backward; reading O and dO (2 x 64 MiB)
takes ~30 us. With the sum in this kernel the statistics take 0.06-0.07
ms, about what XLA's sum alone takes (0.055 ms;
`benchmarks/diagnostics/backward_breakdown.py`): the kernel fixes the sum's
cost whatever XLA fuses around it, and both backwards share it. One
program reads a [block, head_dim] tile of each (contiguous head_dim rows,
strided by the heads) and writes its block of the row.

Pallas with the Triton lowering: any sm80+ GPU, and interpret mode on a CPU.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.triton import common

# Elements of one operand's tile per program: 8192 keep 64 float32 values a
# thread in 4 warps, with no spills (128 rows at head_dim 64, 32 at 256).
_TILE_ELEMENTS = 8192
_NUM_WARPS = 4


def row_delta(out, d_out, *, interpret: bool = False):
  """rowsum(d_out ∘ out) in float32, products and sum in float32.

  Args:
    out, d_out: [batch, q_len, num_heads, head_dim], the same shape; any
      float dtype (each converted to float32 before the product).
    interpret: Pallas interpret mode (a CPU).

  Returns:
    float32 [batch, num_heads, q_len].
  """
  if out.shape != d_out.shape or out.ndim != 4:
    raise ValueError("out and d_out must both be [batch, q_len, heads, "
                     f"head_dim]; got {out.shape}, {d_out.shape}")
  batch, q_len, num_heads, head_dim = out.shape
  dims = common.KernelDims.for_head_dim(head_dim)
  block = common.clamp_block(
      max(_TILE_ELEMENTS // dims.head_dim_padded, 16), q_len)
  tile_spec = pl.BlockSpec((None, block, None, dims.head_dim_padded),
                           lambda i, b, h: (b, i, h, 0))
  return compat.pallas_call(
      functools.partial(_delta_kernel, q_len=q_len, block=block, dims=dims),
      grid=(pl.cdiv(q_len, block), batch, num_heads),
      in_specs=[tile_spec, tile_spec],
      out_specs=pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i)),
      out_shape=compat.output_struct((batch, num_heads, q_len), jnp.float32,
                                     out, d_out),
      compiler_params=common.compiler_params(_NUM_WARPS, 1),
      interpret=interpret,
      name="flash_backward_delta",
  )(out, d_out)


def _delta_kernel(out_ref, d_out_ref, delta_ref, *, q_len: int, block: int,
                  dims: common.KernelDims):
  """out_ref, d_out_ref: [block, head_dim_padded] rows of one (batch, head),
  rows past q_len and columns past head_dim read as 0; delta_ref: [block]."""
  rows_left = q_len - pl.program_id(0) * block
  tile = pl.ds(0, block)
  seq_len = None if q_len % block == 0 else rows_left
  product = (common.load_tile(out_ref, tile, dims, seq_len)
             .astype(jnp.float32)
             * common.load_tile(d_out_ref, tile, dims, seq_len)
             .astype(jnp.float32))
  common.store_rows(delta_ref, tile, jnp.sum(product, axis=1), rows_left)
