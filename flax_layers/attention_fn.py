"""jax_flash behind Flax's `attention_fn` hook, and what the modules share.

`flash_attention_fn` takes every keyword that
`flax.linen.MultiHeadDotProductAttention` and `flax.nnx.MultiHeadAttention`
pass to their `attention_fn`, and runs
`jax_flash.flash_attention`. A call it cannot run fused (sowing the weights,
batch/head-broadcast dropout, a dot algorithm, a dtype or variant that
jax_flash refuses with NotImplementedError) goes to Flax's own
`dot_product_attention` with a `FlashFallbackWarning`: slower, never different.

Position arguments that Flax expresses as dense masks (decoding against a KV
cache, packed sequences) have fused forms here: `q_offset` and `segment_ids`.
Where a backend refuses one, it becomes a dense mask (same result).
"""
from __future__ import annotations

import inspect
import math
import warnings

import jax.numpy as jnp
from flax import linen, nnx
from jax import lax

import jax_flash
from jax_flash import masking

_FUSED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


class FlashFallbackWarning(UserWarning):
  """A call that jax_flash cannot run fused was computed another way."""


def flash_attention_fn(
    query, key, value, bias=None, mask=None, *, broadcast_dropout=True,
    dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
    precision=None, module=None, is_causal=False,
    force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None, q_offset=None, segment_ids=None,
    implementation=None, block_sizes=None, interpret=None):
  """FlashAttention as a Flax `attention_fn`.

  Use it as `attention_fn=flash_attention_fn` in `flax.linen` or `flax.nnx`
  attention modules, or `functools.partial(flash_attention_fn,
  implementation="triton")` to pin a backend (linen reads the signature of a
  partial like that of a function).

  Args:
    query: [batch..., q_len, num_heads, head_dim].
    key, value: [batch..., kv_len, num_kv_heads, head_dim]; num_heads must be
      a multiple of num_kv_heads (GQA).
    bias: added to the logits; broadcastable to
      [batch..., num_heads, q_len, kv_len].
    mask: boolean, or float where nonzero means attend (as Flax's `jnp.where`
      reads it); broadcastable like `bias`. True attends.
    broadcast_dropout: Flax's flag: one dropout mask shared across batch and
      heads. The fused dropout draws per (batch, head), so True falls back.
    dropout_rng, dropout_rate, deterministic: dropout of the attention
      weights, applied when `not deterministic and dropout_rate > 0`.
    dtype: computation dtype; default: the promoted dtype of q, k, v.
    precision: `lax.Precision` (or its name, or a pair). The kernels multiply
      in the input dtype with float32 accumulation (IEEE float32 for float32
      inputs), which is at least what any `lax.Precision` asks; a
      `lax.DotAlgorithmPreset` falls back.
    module: a module to sow the attention weights into; fused attention never
      forms them, so this falls back.
    is_causal: query i attends to keys j <= i + q_offset (top-left aligned
      when q_offset is None, as Flax and `jax.nn`).
    force_fp32_for_softmax: linen's flag; the kernels always take the softmax
      in float32, so it is honoured as is.
    qk_attn_weights_einsum, attn_weights_value_einsum: linen's einsum
      overrides (quantisation); given, they fall back.
    q_offset: position of query 0 on the key axis, an int or int32 [batch...]:
      decoding step t has q_len 1 and q_offset t against the whole cache.
    segment_ids: int32 [batch..., q_len] for self-attention, or a pair
      (q_ids [batch..., q_len], kv_ids [batch..., kv_len]); only equal ids
      attend (packed sequences).
    implementation, block_sizes, interpret: passed to
      `jax_flash.flash_attention`.

  Returns:
    [batch..., q_len, num_heads, head_dim] in the computation dtype.

  A query row that nothing may attend to gives zeros on the fused path (Flax
  gives the mean of `value` there); see `jax_flash.flash_attention`.
  """
  dtype = jnp.dtype(jnp.result_type(query, key, value) if dtype is None
                    else dtype)
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  dropout = not deterministic and dropout_rate > 0.0
  unflatten, (query, key, value, bias, mask, q_offset,
              segment_ids) = _flatten_batch(query, key, value, bias, mask,
                                            q_offset, segment_ids)
  if mask is not None:
    mask = mask.astype(bool)

  reason = unfused_reason(dtype=dtype, precision=precision, module=module,
                           dropout=dropout,
                           broadcast_dropout=broadcast_dropout,
                           einsums=(qk_attn_weights_einsum,
                                    attn_weights_value_einsum))
  if reason is None:
    try:
      out, note = _fused(
          query, key, value, bias, mask, is_causal=is_causal,
          q_offset=q_offset, segment_ids=segment_ids,
          dropout_rate=dropout_rate if dropout else 0.0,
          dropout_rng=dropout_rng if dropout else None,
          implementation=implementation, block_sizes=block_sizes,
          interpret=interpret)
      if note:
        warnings.warn(f"flash_attention_fn: {note}", FlashFallbackWarning,
                      stacklevel=2)
      return unflatten(out)
    except NotImplementedError as e:
      reason = f"jax_flash cannot run this call fused ({e})"
  warnings.warn(f"flash_attention_fn: {reason}; using Flax's "
                "dot_product_attention", FlashFallbackWarning, stacklevel=2)
  mask = _and(mask, dense_mask(query.shape[1], key.shape[1],
                               is_causal=is_causal, q_offset=q_offset,
                               segment_ids=segment_ids))
  out = _flax_attention(
      query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
      dropout_rng=dropout_rng, dropout_rate=dropout_rate,
      deterministic=deterministic, dtype=dtype, precision=precision,
      module=module, force_fp32_for_softmax=force_fp32_for_softmax,
      qk_attn_weights_einsum=qk_attn_weights_einsum,
      attn_weights_value_einsum=attn_weights_value_einsum)
  return unflatten(out)


def unfused_reason(*, dtype, precision, module, dropout, broadcast_dropout,
                    einsums) -> str | None:
  """Why a call cannot go to jax_flash as it stands, or None."""
  if module is not None:
    return "sowing attention weights needs them materialised"
  if any(e is not None for e in einsums):
    return "custom attention einsums (e.g. quantised) are not fused"
  if not any(dtype == d for d in _FUSED_DTYPES):
    return f"dtype {dtype} is not one of float16, bfloat16, float32"
  if not _is_plain_precision(precision):
    return f"precision {precision!r} names a dot algorithm"
  if dropout and broadcast_dropout:
    return ("broadcast_dropout=True shares one dropout mask across batch and "
            "heads; set broadcast_dropout=False for the fused dropout")
  return None


def _is_plain_precision(precision) -> bool:
  if precision is None or isinstance(precision, (str, lax.Precision)):
    return True
  if isinstance(precision, (tuple, list)):
    return all(_is_plain_precision(p) for p in precision)
  return False


def _fused(query, key, value, bias, mask, *, is_causal, q_offset, segment_ids,
           **options):
  """jax_flash with the fused position arguments, else with them as a mask.

  Returns (out, note), where note says what was densified (or is empty).
  Raises NotImplementedError when even the dense form is not supported.
  """
  variants = {k: v for k, v in (("q_offset", q_offset),
                                ("segment_ids", segment_ids)) if v is not None}
  try:
    return jax_flash.flash_attention(query, key, value, bias, mask,
                                     is_causal=is_causal, **variants,
                                     **options), ""
  except NotImplementedError as e:
    if not variants:
      raise
    note = f"{e}; passing {', '.join(variants)} as a dense mask"
  # Causal attention stays fused when its offset is the default 0.
  causal_fused = is_causal and q_offset is None
  mask = _and(mask, dense_mask(query.shape[1], key.shape[1],
                               is_causal=is_causal and not causal_fused,
                               q_offset=q_offset, segment_ids=segment_ids))
  return jax_flash.flash_attention(query, key, value, bias, mask,
                                   is_causal=causal_fused, **options), note


def _flax_attention(query, key, value, bias, mask, *, module, **kwargs):
  """Flax's own attention on [batch, len, heads, dim] with heads repeated."""
  group = query.shape[2] // key.shape[2]
  key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))
  if isinstance(module, nnx.Module):
    # nnx sows into nnx.Intermediate and knows no linen-only keywords.
    for name in ("force_fp32_for_softmax", "qk_attn_weights_einsum",
                 "attn_weights_value_einsum"):
      kwargs.pop(name)
    return nnx.dot_product_attention(query, key, value, bias, mask,
                                     module=module, **kwargs)
  # linen's function honours `precision` in both einsums; nnx's may hand a
  # call without dropout to jax.nn, which does not take one.
  return linen.dot_product_attention(query, key, value, bias, mask,
                                     module=module, **kwargs)


def dense_mask(q_len: int, kv_len: int, *, is_causal=False, q_offset=None,
               segment_ids=None):
  """The position arguments as a boolean mask, or None when there are none.

  Args:
    q_len, kv_len: lengths of queries and keys.
    is_causal: keep key j for query i when j <= i + q_offset.
    q_offset: int or int [batch]; 0 when None.
    segment_ids: [batch, q_len] or ([batch, q_len], [batch, kv_len]).

  Returns:
    bool [batch or 1, 1, q_len, kv_len], or None.
  """
  if not is_causal and segment_ids is None:
    return None
  # The semantics are jax_flash.masking's: this only lays the inputs out.
  q_ids = kv_ids = None
  if segment_ids is not None:
    q_ids, kv_ids = (segment_ids if isinstance(segment_ids, (tuple, list))
                     else (segment_ids, segment_ids))
    q_ids, kv_ids = q_ids[:, None, :, None], kv_ids[:, None, None, :]
  spec = masking.MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=is_causal,
                          has_q_offset=q_offset is not None,
                          has_segments=segment_ids is not None)
  offset = jnp.asarray(0 if q_offset is None else q_offset, jnp.int32)
  values = masking.MaskValues(q_offset=jnp.reshape(offset, (-1, 1, 1, 1)),
                              q_segments=q_ids, kv_segments=kv_ids)
  return masking.keep(spec, jnp.arange(q_len)[None, None, :, None],
                      jnp.arange(kv_len)[None, None, None, :], values)


def _and(a, b):
  if a is None or b is None:
    return b if a is None else a
  return jnp.logical_and(a, b)


def _flatten_batch(query, key, value, bias, mask, q_offset, segment_ids):
  """Folds Flax's `batch...` dims into the single batch dim jax_flash takes.

  Returns (unflatten, flattened arguments); unflatten restores the output.
  """
  batch_shape = query.shape[:-3]
  batch = math.prod(batch_shape)

  def logits_shaped(x):  # broadcastable to [batch..., heads, q_len, kv_len]
    if x is None:
      return None
    x = jnp.reshape(x, (1,) * (len(batch_shape) + 3 - x.ndim) + x.shape)
    if all(d == 1 for d in x.shape[:-3]):
      # Keep the batch broadcast rather than materialising it.
      return jnp.reshape(x, (1,) + x.shape[-3:])
    x = jnp.broadcast_to(x, batch_shape + x.shape[-3:])
    return jnp.reshape(x, (batch,) + x.shape[-3:])

  def per_batch(x):  # int or [batch...]
    if x is None or isinstance(x, int):
      return x
    return jnp.reshape(jnp.broadcast_to(jnp.asarray(x, jnp.int32),
                                        batch_shape), (batch,))

  def per_position(ids):  # [batch..., len]
    return jnp.reshape(jnp.asarray(ids, jnp.int32), (batch, ids.shape[-1]))

  if isinstance(segment_ids, (tuple, list)):
    segment_ids = tuple(per_position(ids) for ids in segment_ids)
  elif segment_ids is not None:
    segment_ids = per_position(segment_ids)
  query, key, value = (jnp.reshape(x, (batch,) + x.shape[-3:])
                       for x in (query, key, value))

  def unflatten(out):
    return jnp.reshape(out, batch_shape + out.shape[1:])

  return unflatten, (query, key, value, logits_shaped(bias),
                     logits_shaped(mask), per_batch(q_offset), segment_ids)


# What the drop-in modules share.


def attend(attention_fn, query, key, value, *, mask, is_causal, q_offset,
           segment_ids, module, **flax_kwargs):
  """Calls a module's `attention_fn` with the fused position arguments.

  An `attention_fn` that does not take `q_offset` and `segment_ids` (Flax's
  own `dot_product_attention`, say) gets them as a dense mask and keywords
  filtered by its signature, as linen does; `module` is passed whenever
  given, so a function that cannot sow fails loudly.

  Args:
    query: [batch..., q_len, num_heads, head_dim].
    key, value: [batch..., kv_len, num_kv_heads, head_dim].
    mask: the caller's mask, broadcastable to
      [batch..., num_heads, q_len, kv_len], or None.
    is_causal, q_offset, segment_ids: as in `flash_attention_fn`.
    module: the module to sow weights into, or None.
    **flax_kwargs: the remaining keywords Flax passes (dropout, dtype, ...).
  """
  params = inspect.signature(attention_fn).parameters
  if "q_offset" in params and "segment_ids" in params:
    return attention_fn(query, key, value, mask=mask, is_causal=is_causal,
                        q_offset=q_offset, segment_ids=segment_ids,
                        module=module, **flax_kwargs)

  def flat(ids):  # dense_mask takes one batch dim
    return jnp.reshape(ids, (-1, ids.shape[-1]))

  if isinstance(segment_ids, (tuple, list)):
    segment_ids = tuple(flat(ids) for ids in segment_ids)
  elif segment_ids is not None:
    segment_ids = flat(segment_ids)
  structure = dense_mask(query.shape[-3], key.shape[-3], is_causal=is_causal,
                         q_offset=q_offset, segment_ids=segment_ids)
  if structure is not None:
    batch_shape = query.shape[:-3]
    lead = batch_shape if structure.shape[0] > 1 else (1,) * len(batch_shape)
    mask = _and(mask, jnp.reshape(structure, lead + structure.shape[1:]))
  kwargs = dict(flax_kwargs, mask=mask, is_causal=False)
  if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
    kwargs = {k: v for k, v in kwargs.items() if k in params}
  if module is not None:
    kwargs["module"] = module
  return attention_fn(query, key, value, **kwargs)


def resolve_inputs(inputs_q, inputs_k, inputs_v):
  """Flax's defaults: keys from the queries, values from the keys."""
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError(
          "`inputs_k` cannot be None if `inputs_v` is not None; to use one "
          "array for both, pass it as `inputs_k` and leave `inputs_v` None.")
    inputs_k = inputs_q
  return inputs_k, inputs_k if inputs_v is None else inputs_v
