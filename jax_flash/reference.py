"""`attention_reference`: plain jnp attention, the oracle every kernel is tested against."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash import masking, validation
from jax_flash.validation import AttentionCall


def reference_attention(call: AttentionCall, query, key, value, bias=None,
                        sinks=None, *, compute_dtype=jnp.float32):
  """Materialised softmax attention under the semantics of `jax_flash.masking`.

  Args:
    call: the normalised call (`validation.normalise_call`).
    query: [batch, q_len, num_heads, head_dim].
    key, value: [batch, kv_len, num_kv_heads, head_dim].
    bias: broadcastable to [batch, num_heads, q_len, kv_len], or None.
    sinks: float32 [num_heads] or None.
    compute_dtype: float32 for the oracle; the input dtype for the "naive
      low-precision" yardstick of the tolerance rule (matmuls in that dtype,
      softmax in float32 then rounded to it, as FlashAttention's tests do).

  Returns:
    out [batch, q_len, num_heads, head_dim] in query.dtype and
    lse float32 [batch, q_len, num_heads] (natural log; -inf for empty rows).
  """
  spec, ops = call.spec, call.operands
  b, tq, n, d = query.shape
  group = n // key.shape[2]
  precision = jax.lax.Precision.HIGHEST
  q = query.astype(compute_dtype)
  k = jnp.repeat(key.astype(compute_dtype), group, axis=2)
  v = jnp.repeat(value.astype(compute_dtype), group, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision)
  logits = logits.astype(jnp.float32) * call.scale

  q_idx = jnp.arange(tq)[None, None, :, None]
  kv_idx = jnp.arange(spec.kv_len)[None, None, None, :]
  per_batch = lambda x: None if x is None else x[:, None, None, None]
  values = masking.MaskValues(
      batch=jnp.arange(b)[:, None, None, None],
      head=jnp.arange(n)[None, :, None, None],
      q_offset=0 if ops.q_offset is None else per_batch(ops.q_offset),
      q_lengths=per_batch(ops.q_lengths),
      kv_lengths=per_batch(ops.kv_lengths),
      q_segments=None if ops.q_segments is None
      else ops.q_segments[:, None, :, None],
      kv_segments=None if ops.kv_segments is None
      else ops.kv_segments[:, None, None, :],
      dense_mask=ops.dense_mask,
      alibi_slope=None if ops.alibi_slopes is None
      else ops.alibi_slopes[:, :, None, None],
      bias=None if bias is None else bias.astype(jnp.float32))
  logits = masking.modify_scores(spec, logits, q_idx, kv_idx, values)
  keep = masking.keep(spec, q_idx, kv_idx, values)
  logits = jnp.where(keep, logits, -jnp.inf)

  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnormalised = jnp.exp(logits - row_max)
  row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
  empty = row_sum == 0.0
  # Rows with nothing to attend to give 0 (not NaN) and zero gradients.
  probs = unnormalised / jnp.where(empty, 1.0, row_sum)
  if spec.dropout_rate:
    kept = masking.dropout_keep(ops.dropout_seed, values.batch, values.head,
                                q_idx, kv_idx, spec.dropout_rate)
    probs = jnp.where(kept, probs / (1.0 - spec.dropout_rate), 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(compute_dtype), v,
                   precision=precision).astype(query.dtype)
  lse = jnp.where(empty, -jnp.inf,
                  jnp.log(jnp.where(empty, 1.0, row_sum)) + row_max)
  lse = jnp.swapaxes(lse[..., 0], 1, 2)
  if sinks is not None:
    out, lse = masking.apply_sinks(out, lse, sinks)
  return out, lse


def attention_reference(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
    segment_ids=None, q_offset=None, logits_soft_cap=None, alibi_slopes=None,
    mask_fn=None, score_fn=None, dropout_rate=0.0, dropout_rng=None,
    sinks=None, return_residual=False, implementation=None, block_sizes=None,
    interpret=None):
  """Pure-jnp attention with `flash_attention`'s signature, float32 accumulate.

  Materialises the [batch, heads, q_len, kv_len] logits: use it as an oracle,
  not in a model. `implementation`, `block_sizes` and `interpret` are accepted
  for signature compatibility and ignored.
  """
  del implementation, block_sizes, interpret
  out, lse = naive_attention(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      q_offset=q_offset, logits_soft_cap=logits_soft_cap,
      alibi_slopes=alibi_slopes, mask_fn=mask_fn, score_fn=score_fn,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, sinks=sinks)
  return (out, lse) if return_residual else out


def naive_attention(query, key, value, bias=None, mask=None, *,
                    compute_dtype=jnp.float32, **variants):
  """`attention_reference`'s (out, lse) with the arithmetic in `compute_dtype`.

  With the input dtype, this is the "naive low-precision" yardstick of the
  FlashAttention tolerance rule. `variants` are `flash_attention`'s mask and
  score keyword arguments.
  """
  call = validation.normalise_call(query, key, value, bias=bias, mask=mask,
                                   **variants)
  return reference_attention(call, query, key, value, call.bias, call.sinks,
                             compute_dtype=compute_dtype)
