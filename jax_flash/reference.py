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
  _, tq, n, _ = query.shape
  precision = jax.lax.Precision.HIGHEST
  logits, values = masked_logits(call, query, key, bias,
                                 compute_dtype=compute_dtype)
  spec, ops = call.spec, call.operands
  q_idx = jnp.arange(tq)[None, None, :, None]
  kv_idx = jnp.arange(spec.kv_len)[None, None, None, :]
  v = _repeat_heads(value.astype(compute_dtype), n)

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


def _repeat_heads(x, num_heads: int):
  """[b, t, num_kv_heads, d] -> [b, t, num_heads, d] (GQA: head h reads K/V
  head h // group)."""
  return jnp.repeat(x, num_heads // x.shape[2], axis=2)


def masked_logits(call: AttentionCall, query, key, bias=None, *,
                  compute_dtype=jnp.float32):
  """Scaled, score-modified logits [batch, heads, q_len, kv_len], float32,
  -inf where the mask drops a key; and the `masking.MaskValues` used."""
  spec, ops = call.spec, call.operands
  b, tq, n, _ = query.shape
  q = query.astype(compute_dtype)
  k = _repeat_heads(key.astype(compute_dtype), n)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k,
                      precision=jax.lax.Precision.HIGHEST)
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
  return jnp.where(keep, logits, -jnp.inf), values


def reference_backward(call: AttentionCall, query, key, value, out, lse,
                       d_out, d_lse):
  """(dq, dk, dv) from given residuals, by the softmax gradient's formula.

  `out` [batch, q_len, heads, dim] and `lse` float32 [batch, q_len, heads]
  may come from attention over more keys than `key` holds (merged K/V
  shards): P = exp(logits - lse) are then the weights of these keys in that
  softmax, and dS = P * (dO V^T - (rowsum(dO * out) - d_lse)) is its
  gradient, so the result is this call's share of that attention's
  gradient (see `jax_flash.residual_backward`). Masks and score changes
  enter through the VJP of `masked_logits`; dropout and sinks are not
  supported.
  """
  f32 = lambda x: x.astype(jnp.float32)
  precision = jax.lax.Precision.HIGHEST
  n = query.shape[2]
  logits, logits_vjp = jax.vjp(
      lambda q, k: masked_logits(call, q, k)[0], query, key)
  v, v_vjp = jax.vjp(lambda v: _repeat_heads(f32(v), n), value)
  row_lse = jnp.swapaxes(lse, 1, 2)[..., None]           # [b, h, q, 1]
  finite = jnp.isfinite(row_lse)
  probs = jnp.where(finite, jnp.exp(logits - jnp.where(finite, row_lse, 0.0)),
                    0.0)
  dv, = v_vjp(jnp.einsum("bhqk,bqhd->bkhd", probs, f32(d_out),
                         precision=precision))
  d_probs = jnp.einsum("bqhd,bkhd->bhqk", f32(d_out), v, precision=precision)
  delta = jnp.sum(f32(d_out) * f32(out), axis=-1) - d_lse  # [b, q, h]
  d_logits = probs * (d_probs - jnp.swapaxes(delta, 1, 2)[..., None])
  dq, dk = logits_vjp(d_logits)
  return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)


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
  query, key, value, restore = validation.add_batch_axis(query, key, value)
  out, lse = naive_attention(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      q_offset=q_offset, logits_soft_cap=logits_soft_cap,
      alibi_slopes=alibi_slopes, mask_fn=mask_fn, score_fn=score_fn,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, sinks=sinks)
  out, lse = restore(out, lse)
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
