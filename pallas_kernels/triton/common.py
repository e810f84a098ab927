"""Pieces shared by the forward, dK/dV and dQ Triton kernels."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import masking
from pallas_kernels.masking import MaskSpec
from pallas_kernels.config import MIN_BLOCK, next_power_of_two

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class KernelDims:
  """Static sizes a kernel body needs: true head dim and its padded tile width."""

  head_dim: int
  head_dim_padded: int

  @classmethod
  def for_head_dim(cls, head_dim: int) -> "KernelDims":
    # tl.arange and tl.dot need power-of-two tiles of at least 16.
    return cls(head_dim, max(MIN_BLOCK, next_power_of_two(head_dim)))

  @property
  def needs_column_mask(self) -> bool:
    return self.head_dim != self.head_dim_padded


def clamp_block(block: int, seq_len: int) -> int:
  """Shrinks a tile to the sequence (a tile of 128 for q_len 1 is waste)."""
  return min(block, max(MIN_BLOCK, next_power_of_two(seq_len)))


def load_tile(ref, rows, dims: KernelDims, seq_len: int | None, other=0.0,
              head=None):
  """Loads a [len(rows), head_dim_padded] tile of a [seq, head_dim] ref.

  Rows past `seq_len` (when given) and columns past `head_dim` read `other`;
  pass `seq_len=None` when every row of the slice is in bounds. With `head`,
  the ref is [seq, heads, head_dim] and the tile is taken from that head (one
  indexer, as Triton's lowering needs).
  """
  index = (rows, slice(None)) if head is None else (rows, head, slice(None))
  mask = None
  if seq_len is not None:
    row_idx = rows.start + jnp.arange(rows.size)
    mask = (row_idx < seq_len)[:, None]
  if dims.needs_column_mask:
    col_mask = (jnp.arange(dims.head_dim_padded) < dims.head_dim)[None, :]
    mask = col_mask if mask is None else jnp.logical_and(mask, col_mask)
  if mask is None:
    return ref[index]
  return plgpu.load(ref.at[index], mask=mask, other=other)


def store_tile(ref, rows, value, dims: KernelDims, seq_len: int):
  """Stores a [len(rows), head_dim_padded] tile, skipping padding rows/columns."""
  row_idx = rows.start + jnp.arange(rows.size)
  mask = (row_idx < seq_len)[:, None]
  if dims.needs_column_mask:
    mask = jnp.logical_and(
        mask, (jnp.arange(dims.head_dim_padded) < dims.head_dim)[None, :])
  plgpu.store(ref.at[rows, :], value.astype(ref.dtype), mask=mask)


def store_rows(ref, rows, value, seq_len):
  """Stores a vector slice `ref[rows]`, skipping rows past `seq_len`."""
  mask = rows.start + jnp.arange(rows.size) < seq_len
  plgpu.store(ref.at[rows], value.astype(ref.dtype), mask=mask)


def load_rows(ref, rows, seq_len: int | None, other, head=None):
  """Loads a vector slice `ref[rows]` (or `ref[head, rows]`), reading `other`
  past `seq_len`."""
  index = rows if head is None else (head, rows)
  if seq_len is None:
    return ref[index]
  mask = rows.start + jnp.arange(rows.size) < seq_len
  return plgpu.load(ref.at[index], mask=mask, other=other)


# `jax.default_matmul_precision` values that ask for IEEE float32 products.
_IEEE_FLOAT32_REQUESTS = ("highest", "float32", "F32_F32_F32")


def dot_precision(dtype, interpret: bool):
  """The `precision` of a kernel's dots on `dtype` tiles.

  Pallas Triton lowers a float32 dot at DEFAULT precision to one TF32 pass
  (10-bit mantissas), and at HIGHEST to Triton's IEEE dot, a loop of FMAs
  off the tensor cores: 3-7x slower and slow to compile
  (`benchmarks/results/h200_float32_probe.md`). Lowered through Triton,
  float32 therefore takes three TF32 passes (the split-mantissa product:
  float32-class error on tensor cores) unless the caller asked for IEEE
  float32 through `jax.default_matmul_precision`. Interpreted, the dots
  are XLA's, which the CPU lacks the TF32 algorithms for: IEEE float32.
  16-bit tiles: None (the default).
  """
  if jnp.dtype(dtype) != jnp.float32:
    return None
  if (not interpret and jax.config.jax_default_matmul_precision
      not in _IEEE_FLOAT32_REQUESTS):
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return lax.Precision.HIGHEST


def matmul(a, b, precision, *, transpose_b: bool = False):
  """a @ b (or a @ b.T) on tensor cores with float32 accumulation;
  `precision` from `dot_precision`."""
  contract_b = 1 if transpose_b else 0
  return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                         precision=precision,
                         preferred_element_type=jnp.float32)


def matmul_t(a, b, precision):
  """a.T @ b with float32 accumulation."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                         precision=precision,
                         preferred_element_type=jnp.float32)


def run_block_loop(block_range, body, carry, block_state=None):
  """Runs `body(j, carry, masked)` over the visited blocks of a block range.

  `block_range` is `(lo, unmasked_lo, unmasked_hi, hi)` (see
  `pallas_kernels.masking.block_ranges`). Full blocks run the cheaper unmasked
  body; the edges run the masked one. With `block_state(j)` (block-sparse
  masks), empty blocks inside the edges are skipped too.
  """
  lo, unmasked_lo, unmasked_hi, hi = block_range

  def masked(j, c):
    if block_state is None:
      return body(j, c, True)
    return lax.cond(block_state(j) == masking.EMPTY, lambda: c,
                    lambda: body(j, c, True))

  unmasked = lambda j, c: body(j, c, False)
  carry = lax.fori_loop(lo, unmasked_lo, masked, carry)
  carry = lax.fori_loop(unmasked_lo, unmasked_hi, unmasked, carry)
  return lax.fori_loop(unmasked_hi, hi, masked, carry)


# Shared memory a CTA may use on sm90 (the H200 reports 232448 bytes; sm80
# has less, where Triton itself then lowers its pipelining).
SHARED_MEMORY_BYTES = 232448


def compiler_params(num_warps: int, num_stages: int):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def fit_stages(num_stages: int, *, resident_bytes: int, per_step_bytes: int,
               itemsize: int) -> int:
  """Pipeline depth that keeps Triton's shared-memory buffers within sm90's.

  Triton keeps `num_stages` copies of every tile loaded in the K/V (or Q)
  loop in shared memory. A streamed mask or bias tile adds to the tuned
  K/V tiles' footprint (a 128 x 128 float32 bias tile is 64 KiB), so a depth
  tuned without them can exceed the limit; fewer stages always compile.
  float32 inputs' dots (split TF32 products) take scratch of about one more
  resident set and step beside the pipelined tiles: Triton 3.5 compiled a
  float32 dK/dV kernel at d=128 with a streamed bias into 221,568 bytes
  where the tiles came to 147,456, and XLA's Triton asked 237,952 on an H100
  (`tests/test_gpu_sweep.py`, draw 186), so that is reserved.

  Args:
    num_stages: the tuned depth.
    resident_bytes: tiles held across the loop (the owned Q or K/V tile).
    per_step_bytes: tiles loaded in each loop step.
    itemsize: bytes of an input element.
  """
  scratch = resident_bytes + per_step_bytes if itemsize >= 4 else 0
  fitting = ((SHARED_MEMORY_BYTES - resident_bytes - scratch)
             // max(per_step_bytes, 1))
  return max(1, min(num_stages, fitting))


def streamed_tile_bytes(call_operands, bias, block_q: int,
                        block_k: int) -> int:
  """Bytes of the [block_q, block_k] mask and bias tiles of one loop step."""
  total = 0
  for array in (call_operands.dense_mask, bias):
    if array is not None:
      total += block_q * block_k * jnp.dtype(array.dtype).itemsize
  return total


def tile_indices(q_start, kv_start, block_q: int, block_k: int):
  """Global [block_q, 1] query and [1, block_k] key indices of a tile."""
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
  return q_idx, kv_idx


def logits_base2(spec: MaskSpec, qk, scale: float, q_idx, kv_idx, values,
                 masked: bool):
  """Final logits in base 2 (ready for exp2) from raw q·k, [block_q, block_k].

  Without score changes, log2(e) is folded into the scale: one multiply.
  """
  if spec.modifies_scores:
    s = masking.modify_scores(spec, qk * scale, q_idx, kv_idx,
                              values) * LOG2_E
  else:
    s = qk * (scale * LOG2_E)
  if masked:
    s = jnp.where(masking.keep(spec, q_idx, kv_idx, values), s, -jnp.inf)
  return s


def score_grad(spec: MaskSpec, qk, scale: float, q_idx, kv_idx, values, ds):
  """Maps dL/d(final logit) to dL/d(scale * q·k) through `modify_scores`.

  The modification is elementwise, so its derivative is one `jax.jvp` of the
  same function with a tangent of ones. Also the gradient of the bias, which
  is added first.
  """
  if not spec.modifies_scores:
    return ds
  modify = lambda s: masking.modify_scores(spec, s, q_idx, kv_idx, values)
  _, slope = jax.jvp(modify, (qk * scale,), (jnp.ones_like(qk),))
  return ds * slope


def softmax_init(rows: int, width: int):
  """The online softmax's state before the first K/V tile: the unnormalised
  output acc [rows, width], running max m and sum l [rows] (base 2)."""
  return (jnp.zeros((rows, width), jnp.float32),
          jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def softmax_step(m, l, s, masked: bool, unbounded: bool = False):
  """One K/V tile of the online softmax (FlashAttention-2 Alg. 1).

  Args:
    m, l: running max and sum [rows]; s: base-2 logits [rows, block_k].
    masked: the tile has masked (-inf) logits.
    unbounded: a bias or score_fn may take logits anywhere (say a padding
      bias of -1e10); see `weights`.

  Returns:
    (m_new, correction [rows] to scale acc by, p [rows, block_k] the
    tile's weights, l_new).
  """
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  if masked:
    # A row with every key masked so far keeps m = -inf; shift by 0 instead
    # so that exp2 gives 0, not NaN.
    m_new_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  else:
    m_new_safe = m_new
  correction = jnp.exp2(m - m_new_safe)
  p = weights(s, m_new_safe[:, None], unbounded)
  return m_new, correction, p, l * correction + jnp.sum(p, axis=1)


def weights(s, shift, unbounded: bool):
  """exp2(s - shift) of base-2 logits s against a shift that is at least
  their max (the running max, or the LSE in the backward). With
  `unbounded` the exponent is capped at 0, where it belongs: at |s| near
  1e10 an ulp of s is 1024, and a compiler that contracts the logit's
  last multiply into the subtraction (an FMA) but rounds it where the max
  or the LSE was taken leaves the exponent up to half of that off, so a
  row of padding-biased logits got P = 2^512 = inf (NaN out, NaN dK)."""
  if unbounded:
    return jnp.exp2(jnp.minimum(s - shift, 0.0))
  return jnp.exp2(s - shift)


def softmax_finish(acc, m, l):
  """(out [rows, width], natural-log lse [rows]) from the final state; rows
  with nothing to attend to give 0 and -inf."""
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  out = acc / l_safe[:, None]
  return out, jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN_2)


def dropout_keep(spec: MaskSpec, reader, q_idx, kv_idx, batch, head):
  """The dropout mask of a tile (None without dropout)."""
  if not spec.dropout_rate:
    return None
  return masking.dropout_keep(reader.dropout_seed(), batch, head, q_idx, kv_idx,
                              spec.dropout_rate)
