"""`flash_attention`: validate, normalise, dispatch."""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from jax_flash import (builtin_forms, higher_order, masking, reference,
                       validation)
from jax_flash.reference import (AlibiSlopes, Bias, KeyValue, Lengths, Lse,
                                 Mask, MaskFn, Out, QOffset, Query, ScoreFn,
                                 SegmentIds, Sinks, Window)
from jax_flash.validation import AttentionCall
from pallas_kernels import compat
from pallas_kernels import masking as kernel_masking
from pallas_kernels.config import BlockSizes
from pallas_kernels.triton import flash_attention_triton

Implementation = Literal["mosaic", "triton", "xla"]
IMPLEMENTATIONS: tuple[str, ...] = ("mosaic", "triton", "xla")


def flash_attention(
    query: Query, key: KeyValue, value: KeyValue, bias: Bias | None = None,
    mask: Mask | None = None, *, scale: float | None = None,
    is_causal: bool = False, query_seq_lengths: Lengths | None = None,
    key_value_seq_lengths: Lengths | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None, q_offset: QOffset | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: AlibiSlopes | None = None,
    mask_fn: MaskFn | masking.BlockMask | None = None,
    score_fn: ScoreFn | None = None, dropout_rate: float = 0.0,
    dropout_rng: PRNGKeyArray | None = None, sinks: Sinks | None = None,
    return_residual: bool = False,
    implementation: Implementation | None = None,
    block_sizes: BlockSizes | None = None, interpret: bool | None = None,
) -> Out | tuple[Out, Lse]:
  """Exact softmax attention, tiled so the N x N scores never reach HBM.

  A drop-in superset of `jax.nn.dot_product_attention` (same layout, same
  results; rows with nothing to attend to give 0, not the mean of V). Every
  mask and score change below is computed inside the kernels, forward and
  backward, and tiles that the masks empty are skipped.

  Args:
    query: [batch, q_len, num_heads, head_dim], float16, bfloat16 or float32;
      or [q_len, num_heads, head_dim], a batch of one (as jax.nn).
    key, value: [batch, kv_len, num_kv_heads, head_dim] (or without batch);
      num_heads must be a multiple of num_kv_heads (GQA/MQA without
      repeating K/V).
    bias: float, broadcastable to [batch, num_heads, q_len, kv_len] (a lower
      rank gains leading axes, as jax.nn); added to the logits.
      Differentiable (dbias only when asked for).
    mask: bool (or float 0/1), broadcastable like bias; True attends.
    scale: multiplies q·k; default 1/sqrt(head_dim).
    is_causal: query i attends to keys j <= i + q_offset. Top-left aligned
      by default, as jax.nn; `q_offset = kv_len - q_len` aligns bottom-right::

        q_len=2, kv_len=4:   k0 k1 k2 k3      with q_offset=2:  k0 k1 k2 k3
                         q0   1  0  0  0                    q0   1  1  1  0
                         q1   1  1  0  0                    q1   1  1  1  1

    query_seq_lengths, key_value_seq_lengths: int32 [batch]; rows / keys at
      or past the length are padding (right padding, as jax.nn). These, the
      segment ids and q_offset may drop the batch axis: the same for every
      batch element.
    local_window_size: int or (left, right): keys within
      [q_pos - left, q_pos + right] (sliding window; combine with is_causal).
    segment_ids: int32 [batch, q_len] (self-attention) or a pair
      (q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len]): tokens
      attend within their segment (packed documents).
    q_offset: int or int32 [batch]: position of query 0 on the key axis
      (chunked prefill, decoding against a cache).
    logits_soft_cap: logits = cap * tanh(logits / cap) (Gemma 2).
    alibi_slopes: float32 [num_heads] or [batch, num_heads]; adds
      -slope * |q_pos - kv_idx| to the logits. Not differentiated: their
      gradient is zero from every implementation.
    mask_fn: (b, h, q_idx, kv_idx) -> bool, jnp ops traced into the kernels.
      Its block sparsity is computed once, as the call is traced, and kept
      in the compiled program (for one batch or head where mask_fn ignores
      `b` or `h`; up to a 32k square; `BlockMask.for_call`), else on every
      call; pass a `BlockMask` (`BlockMask.from_mask_fn`) to share one
      between calls.
      Fully masked tiles are skipped (block-sparse attention). Without
      q_offset, a mask_fn that is a conjunction of comparisons of
      q_idx - kv_idx with numbers (`q_idx >= kv_idx`, `q_idx - kv_idx <
      window`, `abs(q_idx - kv_idx) <= w`) runs as `is_causal` and
      `local_window_size` (`builtin_forms`).
    score_fn: (score, b, h, q_idx, kv_idx) -> score, elementwise in score,
      traced into the kernels (its derivative by jax.jvp in the backward;
      in the Mosaic kernels its divisions by a scalar run as products by
      the reciprocal, within an ulp: a division costs ~15 instructions a
      score there). Under a causal mask, a score_fn that adds a linear
      function of the positions, s + a(b, h) q_idx + c(b, h) kv_idx +
      d(b, h) (ALiBi written as `slope * (kv_idx - q_idx)`, or without
      q_offset `-slope * abs(q_idx - kv_idx)`), runs as the built-in ALiBi
      with the remainder per row added to the LSE, and `cap * tanh(s /
      cap)` as the built-in soft cap (`builtin_forms`): the same results up
      to rounding, on the built-in's kernels.
    dropout_rate, dropout_rng: dropout of the attention weights, from a
      counter-based hash of (seed, b, h, q_idx, kv_idx) in the kernels.
      The rate is applied in steps of 1/256, rounded (0.1 drops 26/256 of
      the weights, and the kept ones are scaled by 256/230), as
      FlashAttention-2's: each weight compares one byte of a hash that four
      weights share. Rates that round to 0 or 1 are refused.
    sinks: float32 [num_heads]: a learnable logit per head that joins every
      row's softmax denominator (attention sinks, GPT-OSS). Differentiable.
    return_residual: also return the logsumexp of the logits, float32
      [batch, q_len, num_heads], natural log (-inf for empty rows).
    implementation: None picks the best available (mosaic -> triton -> xla on
      a GPU, triton first for short calls where its kernels are faster:
      masked calls at d=64, and lengths off Mosaic's 8-row tiling that the
      Mosaic path would pad, `triton_first`; xla on a CPU unless
      `interpret=True`); "mosaic", "triton" and "xla" force one (on a CPU
      "triton" runs in Pallas interpret mode). A backend that cannot do a
      call raises NotImplementedError, and None then tries the next one.
    block_sizes: kernel tiles (`pallas_kernels.config.BlockSizes`); default
      tuned per head dim and device.
    interpret: run Pallas kernels in interpret mode; default: when no GPU.

  Returns:
    out [batch, q_len, num_heads, head_dim] in query's dtype, or (out, lse)
    with `return_residual=True`; without a batch axis in query, neither has
    one.
  """
  query, key, value, restore = validation.add_batch_axis(query, key, value)
  call = validation.normalise_call(
      query, key, value, bias=bias, mask=mask, scale=scale,
      is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      q_offset=q_offset, logits_soft_cap=logits_soft_cap,
      alibi_slopes=alibi_slopes, mask_fn=mask_fn, score_fn=score_fn,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, sinks=sinks)
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a BlockSizes, got {block_sizes!r}")
  # The kernels take a score_fn or mask_fn of a built-in form as the
  # built-ins; XLA evaluates it as written.
  kernel_call, lse_shift = builtin_forms.as_builtin(call)

  def run(name, interpret_):
    if name == "xla":
      return _IMPLEMENTATIONS[name](call, query, key, value)
    return _on_kernels(_IMPLEMENTATIONS[name], kernel_call, lse_shift, query,
                       key, value, block_sizes=block_sizes,
                       interpret=interpret_)

  out, lse = dispatch(implementation, interpret, run,
                      triton_first=triton_first(kernel_call, query.dtype))
  out, lse = restore(out, lse)
  return (out, lse) if return_residual else out


# Short sequences go to the Triton kernels first in two cases.
# (1) Lengths off Mosaic GPU's 8-row TMA tiling (`pallas_kernels.mosaic.
# common.TMA_ROW_TILE`, not importable without Mosaic GPU) where the Mosaic
# path pads Q, K and V to whole 8-row tiles and cuts O back (four copies):
# rows of no whole number of 128-byte swizzle tiles (d=80, 96, ...).
# Triton against padded Mosaic on an H100, d=64, forward / fwd+bwd
# TFLOP/s: ViT-B/16's 197 tokens 121 / 94 against 74 / 76, ViT-L/14's 577
# 182 / 177 against 171 / 172 (benchmarks/results/h100_models_softcap_vit.md);
# above 577 unmeasured, so the bound is 640, not the next power of two.
# 16-bit rows of whole swizzle tiles (d=64, 128, 256) Mosaic reads in
# place (`rows.rows_in_place`), no copies, and plain calls stay with
# Mosaic: d=64 163 / 131 against Triton's 131 / 96 at 197 tokens, 303 /
# 242 against 221 / 175 at 577 (h100_models_vit_in_place.md); d=128 causal
# at 577, 32:8 heads, 282 / 237 against 155 / 126
# (h100_models_column_tiles_schedule.md). So do masked calls of wider rows:
# at 577 tokens with padded lengths Mosaic against Triton 144 / 143 against
# 99 / 77 at d=128, 150 / 105 against 110 / 59 at d=256; a 256-key window
# and packed documents at d=128 163 / 163 against 121 / 98 and 68 / 75
# against 54 / 39 (h100_short_masked_route.md).
# (2) Masked calls of rows of one swizzle tile or less (d=64 in 16 bits), at
# any length up to the bound: Triton's forward wins and its fwd+bwd ties,
# padded lengths, Mosaic against Triton, 577 tokens causal 88 / 91 against
# 115 / 88, 512 (BERT large's batch) 146 / 144 against 178 / 145, 384
# causal 63 / 65 against 86 / 70 (h100_short_masked_route_d64.md).
TRITON_FIRST_UP_TO = 640
_MOSAIC_ROW_TILE = 8
_SWIZZLE_BYTES = 128


def triton_first(call: AttentionCall, dtype) -> bool:
  """Whether `implementation=None` tries the Triton kernels before the
  Mosaic ones for this call of inputs of `dtype` (`TRITON_FIRST_UP_TO`)."""
  shape = call.shape
  if max(shape.q_len, shape.kv_len) > TRITON_FIRST_UP_TO:
    return False
  row_bytes = shape.head_dim * jnp.dtype(dtype).itemsize
  # The masked kernels' calls (a soft cap alone runs on the plain ones).
  masked = not dataclasses.replace(call.spec, logits_soft_cap=None).is_plain
  if masked and row_bytes <= _SWIZZLE_BYTES:
    return True
  if not (shape.q_len % _MOSAIC_ROW_TILE or shape.kv_len % _MOSAIC_ROW_TILE):
    return False
  in_place = (row_bytes % _SWIZZLE_BYTES == 0
              and jnp.dtype(dtype).itemsize == 2 and call.sinks is None
              and (call.spec.is_plain or row_bytes > _SWIZZLE_BYTES))
  return not in_place


def dispatch(implementation, interpret, run, *, triton_first: bool = False):
  """`run(name, interpret)` for the first implementation that takes the call.

  Without a GPU the kernels can only be interpreted (slow): None picks them
  only when interpret=True was asked for; otherwise XLA. A forced
  implementation's NotImplementedError propagates; with None the next one is
  tried, and if none takes the call the error lists why. `triton_first`:
  None tries the Triton kernels before the Mosaic ones.
  """
  on_gpu = compat.has_gpu()
  candidates = _candidates(implementation, on_gpu=on_gpu,
                           interpret=interpret is True,
                           triton_first=triton_first)
  if interpret is None:
    interpret = not on_gpu
  errors = []
  for name in candidates:
    try:
      return run(name, interpret)
    except NotImplementedError as e:
      if implementation is not None:
        raise
      errors.append(f"{name}: {e}")
  raise NotImplementedError("no implementation supports this call: "
                            + "; ".join(errors))


def _candidates(implementation, *, on_gpu: bool, interpret: bool,
                triton_first: bool = False):
  if implementation is not None:
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or "
                       f"None, got {implementation!r}")
    return (implementation,)
  if on_gpu or interpret:
    return ("triton", "mosaic", "xla") if triton_first else IMPLEMENTATIONS
  return ("xla",)


def _on_kernels(run_kernels, call: AttentionCall, lse_shift, query, key,
                value, **kernel_options):
  """`run_kernels(call, ...)` ((out, lse) as the API returns them), its
  gradients the kernels' and theirs XLA's (`higher_order`)."""
  def kernels(diff, other):
    (query, key, value, bias, sinks), (operands, lse_shift) = diff, other
    return run_kernels(_with_arrays(call, operands, bias, sinks), query, key,
                       value, lse_shift=lse_shift, **kernel_options)

  def xla(diff, other):
    (query, key, value, bias, sinks), (operands, lse_shift) = diff, other
    out, lse = _run_xla(_with_arrays(call, operands, bias, sinks), query,
                        key, value)
    if lse_shift is not None:
      lse = lse + jnp.swapaxes(lse_shift, 1, 2)
    return out, lse

  return higher_order.with_reference_derivatives(
      kernels, xla, (query, key, value, call.bias, call.sinks),
      (call.operands, lse_shift))


def _with_arrays(call: AttentionCall, operands, bias, sinks) -> AttentionCall:
  return dataclasses.replace(call, operands=operands, bias=bias, sinks=sinks)


def _run_xla(call: AttentionCall, query, key, value, **_):
  return reference.reference_attention(call, query, key, value, call.bias,
                                       call.sinks)


def _run_triton(call: AttentionCall, query, key, value, *, block_sizes,
                interpret, lse_shift=None):
  block_sizes, operands = triton_setup(call, query.dtype, block_sizes,
                                       interpret)
  out, lse = flash_attention_triton(query, key, value, operands, call.bias,
                                    call.scale, call.spec, block_sizes,
                                    interpret)
  return _kernel_result(call, out, lse, lse_shift=lse_shift)


def triton_setup(call: AttentionCall, dtype, block_sizes, interpret):
  """(tiles, operands) of a Triton kernel call; NotImplementedError where
  the kernels cannot run it."""
  head_dim = call.shape.head_dim
  check_triton_device(head_dim, interpret)
  kernel_masking.check_no_captured_arrays(call.spec)
  if block_sizes is None:
    block_sizes = BlockSizes.get_default(head_dim, dtype=dtype,
                                         kv_len=call.shape.kv_len)
  return block_sizes, with_block_mask(call)


def with_block_mask(call: AttentionCall):
  """`call.operands`, with `mask_fn`'s `masking.BlockMask` built where the
  caller passed the function alone (the kernels skip and unmask tiles by
  it; forward and backward share it), once as the call is traced where it
  can be (`BlockMask.for_call`)."""
  operands = call.operands
  if call.spec.mask_fn is not None and operands.block_mask is None:
    shape = call.shape
    operands = operands._replace(block_mask=masking.BlockMask.for_call(
        call.spec.mask_fn, batch=shape.batch, num_heads=shape.num_heads,
        q_len=shape.q_len, kv_len=shape.kv_len))
  return operands


def check_triton_device(head_dim: int, interpret: bool):
  """NotImplementedError where the Triton kernels cannot run: head dims
  above 256, or no sm80+ GPU outside interpret mode."""
  if head_dim > 256:
    raise NotImplementedError(
        f"the Triton kernels support head_dim up to 256, got {head_dim}")
  if not interpret:
    cc = compat.gpu_compute_capability()
    if cc is None or cc < (8, 0):
      raise NotImplementedError(
          f"the Triton kernels need an sm80+ GPU or interpret=True (got {cc})")


def _kernel_result(call: AttentionCall, out, lse, *,
                   sinks_applied: bool = False, lse_shift=None):
  """A kernel's (out, lse [B, N, Tq]) as the API returns them: lse
  [B, Tq, N], `lse_shift` [B, N, Tq] (`builtin_forms.as_builtin`'s) added,
  and the sinks folded in unless the kernel did."""
  if lse_shift is not None:
    lse = lse + lse_shift
  lse = jnp.swapaxes(lse, 1, 2)
  if call.sinks is not None and not sinks_applied:
    out, lse = masking.apply_sinks(out, lse, call.sinks)
  return out, lse


def _run_mosaic(call: AttentionCall, query, key, value, *, block_sizes,
                interpret, lse_shift=None):
  """The sm90 kernels (sinks in the forward's epilogue); masks beyond
  `is_causal` raise NotImplementedError unless the masked kernel is
  enabled."""
  block_sizes, mosaic, operands = mosaic_setup(call, block_sizes, interpret)
  out, lse = mosaic.mosaic_attention(
      query, key, value, scale=call.scale, is_causal=call.spec.is_causal,
      backward_blocks=block_sizes, spec=call.spec, operands=operands,
      bias=call.bias, sinks=call.sinks)
  return _kernel_result(call, out, lse, sinks_applied=True,
                        lse_shift=lse_shift)


def mosaic_setup(call: AttentionCall, block_sizes, interpret):
  """(Triton backward tiles, the `pallas_kernels.mosaic` module, operands
  `with_block_mask`) of a Mosaic call; NotImplementedError where the
  kernels cannot run it."""
  if interpret:
    raise NotImplementedError("the Mosaic GPU kernels have no interpret mode")
  cc = compat.gpu_compute_capability()
  if cc is None or cc[0] != 9:
    raise NotImplementedError(
        f"the Mosaic GPU kernels need an sm90 GPU (got {cc})")
  if block_sizes is None:
    block_sizes = BlockSizes.get_default(call.shape.head_dim)
  try:  # Imported here: Mosaic GPU is absent from some jaxlib builds.
    from pallas_kernels import mosaic
  except ImportError as e:
    raise NotImplementedError(f"Mosaic GPU is not importable: {e}") from e
  kernel_masking.check_no_captured_arrays(call.spec)
  return block_sizes, mosaic, with_block_mask(call)


_IMPLEMENTATIONS = {"mosaic": _run_mosaic, "triton": _run_triton,
                    "xla": _run_xla}
