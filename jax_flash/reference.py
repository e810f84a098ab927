"""`attention_reference`: plain jnp attention, the oracle every kernel is tested against."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jax_flash import masking, validation
from jax_flash.validation import AttentionCall

# The public signatures' shapes (jaxtyping). Documentation only: nothing
# checks them at run time (no `jaxtyped` decorator, no import hook), so
# tracing and dispatch are as without them. "*batch" is one axis, or none
# in jax.nn's unbatched form; "#" marks an axis that may be 1 (broadcast),
# and "*#leading" the leading axes a bias or mask of lower rank gains.
Query = Float[Array, "*batch q_len heads dim"]
KeyValue = Float[Array, "*batch kv_len kv_heads dim"]
Bias = Float[Array, "*#leading #q_len #kv_len"]
Mask = Bool[Array, "*#leading #q_len #kv_len"] | Bias
Lengths = Int[Array, "*batch"]
SegmentIds = (Int[Array, "*batch seq"]
              | tuple[Int[Array, "*batch q_len"], Int[Array, "*batch kv_len"]])
QOffset = int | Int[Array, "*batch"]
Window = int | tuple[int | None, int | None]
AlibiSlopes = Float[Array, "*batch heads"]
Sinks = Float[Array, " heads"]
MaskFn = Callable[[Array, Array, Array, Array], Bool[Array, "..."]]
ScoreFn = Callable[[Array, Array, Array, Array, Array], Float[Array, "..."]]
Out = Float[Array, "*batch q_len heads dim"]
Lse = Float[Array, "*batch q_len heads"]


def reference_attention(
    call: AttentionCall, query: Float[Array, "batch q_len heads dim"],
    key: Float[Array, "batch kv_len kv_heads dim"],
    value: Float[Array, "batch kv_len kv_heads dim"],
    bias: Float[Array, "#batch #heads #q_len #kv_len"] | None = None,
    sinks: Sinks | None = None, *, compute_dtype=jnp.float32,
) -> tuple[Float[Array, "batch q_len heads dim"],
           Float[Array, "batch q_len heads"]]:
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
  keep = (masking.keep(spec, q_idx, kv_idx, values)
          & (logits > masking.LOWEST_LOGIT))
  return jnp.where(keep, logits, -jnp.inf), values


def reference_backward(
    call: AttentionCall, query: Float[Array, "batch q_len heads dim"],
    key: Float[Array, "batch kv_len kv_heads dim"],
    value: Float[Array, "batch kv_len kv_heads dim"],
    out: Float[Array, "batch q_len heads dim"],
    lse: Float[Array, "batch q_len heads"],
    d_out: Float[Array, "batch q_len heads dim"],
    d_lse: Float[Array, "batch q_len heads"],
) -> tuple[Float[Array, "batch q_len heads dim"],
           Float[Array, "batch kv_len kv_heads dim"],
           Float[Array, "batch kv_len kv_heads dim"]]:
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
    return_residual: bool = False, implementation: str | None = None,
    block_sizes=None, interpret: bool | None = None,
) -> Out | tuple[Out, Lse]:
  """Pure-jnp attention with `flash_attention`'s signature, float32 accumulate.

  Materialises the [batch, heads, q_len, kv_len] logits: use it as an oracle,
  not in a model. `implementation`, `block_sizes` and `interpret` are accepted
  for signature compatibility and ignored. Returns out [batch, q_len,
  num_heads, head_dim] in query's dtype, or (out, lse float32 [batch, q_len,
  num_heads]) with `return_residual=True`; without a batch axis in query,
  neither has one.
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


def naive_attention(
    query: Float[Array, "batch q_len heads dim"],
    key: Float[Array, "batch kv_len kv_heads dim"],
    value: Float[Array, "batch kv_len kv_heads dim"],
    bias: Bias | None = None, mask: Mask | None = None, *,
    compute_dtype=jnp.float32, **variants,
) -> tuple[Float[Array, "batch q_len heads dim"],
           Float[Array, "batch q_len heads"]]:
  """`attention_reference`'s (out, lse) with the arithmetic in `compute_dtype`.

  With the input dtype, this is the "naive low-precision" yardstick of the
  FlashAttention tolerance rule. `variants` are `flash_attention`'s mask and
  score keyword arguments.
  """
  call = validation.normalise_call(query, key, value, bias=bias, mask=mask,
                                   **variants)
  return reference_attention(call, query, key, value, call.bias, call.sinks,
                             compute_dtype=compute_dtype)
