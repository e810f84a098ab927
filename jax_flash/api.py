"""`flash_attention`: validate, normalise, dispatch."""
from __future__ import annotations

from typing import Literal


import jax.numpy as jnp

from jax_flash import reference, validation
from jax_flash.masking import MaskSpec
from pallas_kernels import compat
from pallas_kernels.config import BlockSizes
from pallas_kernels.triton import flash_attention_triton

Implementation = Literal["mosaic", "triton", "xla"]
IMPLEMENTATIONS: tuple[str, ...] = ("mosaic", "triton", "xla")


def flash_attention(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
    segment_ids=None, q_offset=None, logits_soft_cap=None, alibi_slopes=None,
    mask_fn=None, score_fn=None, dropout_rate=0.0, dropout_rng=None,
    return_residual=False, implementation: Implementation | None = None,
    block_sizes: BlockSizes | None = None, interpret: bool | None = None):
  """Exact softmax attention, tiled so the N x N scores never reach HBM.

  A drop-in superset of `jax.nn.dot_product_attention` (same layout, same
  results; rows with nothing to attend to give 0, not the mean of V).

  Args:
    query: [batch, q_len, num_heads, head_dim], float16, bfloat16 or float32.
    key, value: [batch, kv_len, num_kv_heads, head_dim]; num_heads must be a
      multiple of num_kv_heads (GQA/MQA without repeating K/V).
    scale: multiplies q·k; default 1/sqrt(head_dim).
    is_causal: query i attends to keys j <= i (top-left aligned, as jax.nn)::

        q_len=2, kv_len=4:   k0 k1 k2 k3
                         q0   1  0  0  0
                         q1   1  1  0  0

    return_residual: also return the logsumexp of the logits, float32
      [batch, q_len, num_heads], natural log (-inf for empty rows).
    implementation: None picks the best available (mosaic -> triton -> xla on
      a GPU; xla on a CPU unless `interpret=True`); "triton" and "xla" force
      one (on a CPU "triton" runs in Pallas interpret mode). A backend that
      cannot do a call raises NotImplementedError, and None then tries the
      next one.
    block_sizes: kernel tiles (`pallas_kernels.config.BlockSizes`); default
      tuned per head dim and device.
    interpret: run Pallas kernels in interpret mode; default: when no GPU.
    bias, mask, query_seq_lengths, key_value_seq_lengths, local_window_size,
    segment_ids, q_offset, logits_soft_cap, alibi_slopes, mask_fn, score_fn,
    dropout_rate, dropout_rng: reserved for the masks and score
      modifications (not implemented yet: a non-default value raises
      NotImplementedError).

  Returns:
    out [batch, q_len, num_heads, head_dim] in query's dtype, or (out, lse)
    with `return_residual=True`.
  """
  shape, scale, spec = validation.normalise_call(
      query, key, value, scale=scale, is_causal=is_causal,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, bias=bias, mask=mask,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      q_offset=q_offset, logits_soft_cap=logits_soft_cap,
      alibi_slopes=alibi_slopes, mask_fn=mask_fn, score_fn=score_fn)
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a BlockSizes, got {block_sizes!r}")
  on_gpu = compat.has_gpu()
  if interpret is None:
    interpret = not on_gpu
  candidates = _candidates(implementation, on_gpu=on_gpu, interpret=interpret)

  errors = []
  for name in candidates:
    try:
      out, lse = _IMPLEMENTATIONS[name](
          query, key, value, scale=scale, spec=spec, head_dim=shape.head_dim,
          block_sizes=block_sizes, interpret=interpret)
    except NotImplementedError as e:
      if implementation is not None:
        raise
      errors.append(f"{name}: {e}")
      continue
    return (out, lse) if return_residual else out
  raise NotImplementedError("no implementation supports this call: "
                            + "; ".join(errors))


def _candidates(implementation, *, on_gpu: bool, interpret: bool):
  if implementation is not None:
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or "
                       f"None, got {implementation!r}")
    return (implementation,)
  if on_gpu or interpret:
    return IMPLEMENTATIONS
  return ("xla",)


def _run_xla(query, key, value, *, scale, spec: MaskSpec, **_):
  return reference.reference_attention(query, key, value, scale=scale,
                                       spec=spec)


def _run_triton(query, key, value, *, scale, spec: MaskSpec, head_dim,
                block_sizes, interpret):
  if head_dim > 256:
    raise NotImplementedError(
        f"the Triton kernels support head_dim up to 256, got {head_dim}")
  if not interpret:
    cc = compat.gpu_compute_capability()
    if cc is None or cc < (8, 0):
      raise NotImplementedError(
          f"the Triton kernels need an sm80+ GPU or interpret=True (got {cc})")
  if block_sizes is None:
    block_sizes = BlockSizes.get_default(head_dim)
  out, lse = flash_attention_triton(query, key, value, scale, spec,
                                    block_sizes, interpret)
  return out, jnp.swapaxes(lse, 1, 2)


def _run_mosaic(*args, **kwargs):
  raise NotImplementedError("the Mosaic GPU kernels are not built yet")


_IMPLEMENTATIONS = {"mosaic": _run_mosaic, "triton": _run_triton,
                    "xla": _run_xla}

