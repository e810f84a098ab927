"""`attention_reference`: plain jnp attention, the oracle every kernel is tested against."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash import masking, validation


def reference_attention(query, key, value, *, scale: float,
                        spec: masking.MaskSpec, compute_dtype=jnp.float32):
  """Materialised softmax attention.

  Args:
    query: [batch, q_len, num_heads, head_dim].
    key, value: [batch, kv_len, num_kv_heads, head_dim].
    scale: multiplies q·k.
    spec: which pairs attend (`masking.MaskSpec`).
    compute_dtype: float32 for the oracle; the input dtype for the "naive
      low-precision" yardstick of the tolerance rule (matmuls in that dtype,
      softmax in float32 then rounded to it, as FlashAttention's tests do).

  Returns:
    out [batch, q_len, num_heads, head_dim] in query.dtype and
    lse float32 [batch, q_len, num_heads] (natural log; -inf for empty rows).
  """
  b, tq, n, d = query.shape
  _, tk, nk, _ = key.shape
  group = n // nk
  precision = jax.lax.Precision.HIGHEST
  q = query.astype(compute_dtype).reshape(b, tq, nk, group, d)
  k = key.astype(compute_dtype)
  v = value.astype(compute_dtype)
  logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k, precision=precision)
  logits = logits.astype(jnp.float32) * scale

  keep = spec.keep(jnp.arange(tq)[:, None], jnp.arange(tk)[None, :])
  logits = jnp.where(keep, logits, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnormalised = jnp.exp(logits - row_max)
  row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
  empty = row_sum == 0.0
  # Rows with nothing to attend to give 0 (not NaN) and zero gradients.
  probs = unnormalised / jnp.where(empty, 1.0, row_sum)
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(compute_dtype), v,
                   precision=precision)
  out = out.reshape(b, tq, n, d).astype(query.dtype)
  lse = jnp.where(empty, -jnp.inf,
                  jnp.log(jnp.where(empty, 1.0, row_sum)) + row_max)
  lse = lse[..., 0].reshape(b, n, tq).transpose(0, 2, 1)
  return out, lse


def attention_reference(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
    segment_ids=None, q_offset=None, logits_soft_cap=None, alibi_slopes=None,
    mask_fn=None, score_fn=None, dropout_rate=0.0, dropout_rng=None,
    return_residual=False, implementation=None, block_sizes=None,
    interpret=None):
  """Pure-jnp attention with `flash_attention`'s signature, float32 accumulate.

  Materialises the [batch, heads, q_len, kv_len] logits: use it as an oracle,
  not in a model. `implementation`, `block_sizes` and `interpret` are accepted
  for signature compatibility and ignored.
  """
  del implementation, block_sizes, interpret
  _, scale, spec = validation.normalise_call(
      query, key, value, scale=scale, is_causal=is_causal,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, bias=bias, mask=mask,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      q_offset=q_offset, logits_soft_cap=logits_soft_cap,
      alibi_slopes=alibi_slopes, mask_fn=mask_fn, score_fn=score_fn)
  out, lse = reference_attention(query, key, value, scale=scale, spec=spec)
  return (out, lse) if return_residual else out
