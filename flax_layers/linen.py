"""`flax.linen.MultiHeadDotProductAttention` on jax_flash: change one import."""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import linen

from flax_layers.attention_fn import (append_to_cache, attend,
                                      flash_attention_fn, resolve_inputs)


class MultiHeadDotProductAttention(linen.MultiHeadDotProductAttention):
  """Multi-head attention with FlashAttention, a drop-in for Flax's.

  The same fields as `flax.linen.MultiHeadDotProductAttention` (it is a
  subclass, with the same class name, so automatic names match too), the same
  parameter tree (`query`, `key`, `value`, `out`, and `query_ln`/`key_ln`
  with `normalize_qk`) and the same `cache` collection: existing checkpoints
  load, and the same parameters give the same outputs. Only the default
  `attention_fn` differs (`flax_layers.flash_attention_fn`).

  What runs fused where Flax builds dense masks:
    - `is_causal=True` (an addition to the call; Flax's linen module has no
      causal flag): no [q_len, kv_len] mask exists.
    - `decode=True`: the new tokens attend to the cache through `q_offset`;
      a call may carry several tokens (chunked prefill), attending causally.
    - `segment_ids` (an addition): packed sequences.

  Example::

    # was: from flax.linen import MultiHeadDotProductAttention
    from flax_layers.linen import MultiHeadDotProductAttention

    layer = MultiHeadDotProductAttention(num_heads=8, qkv_features=512)
    variables = layer.init(jax.random.key(0), x)
    y = layer.apply(variables, x, is_causal=True)  # x: [batch, len, d]
  """

  attention_fn: Callable[..., Any] = flash_attention_fn

  @linen.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *,
               inputs_kv=None, mask=None, deterministic=None,
               dropout_rng=None, sow_weights=False, is_causal=False,
               segment_ids=None):
    """Applies multi-head attention; Flax's arguments plus two.

    Args:
      inputs_q: [batch..., q_len, features].
      inputs_k, inputs_v: [batch..., kv_len, features]; default `inputs_q`
        and `inputs_k` (self-attention).
      inputs_kv: Flax's deprecated spelling of `inputs_k=inputs_v=...`.
      mask: [batch..., num_heads | 1, q_len, kv_len], boolean or float 0/1;
        True attends.
      deterministic: no dropout when True; merged with the field as Flax does.
      dropout_rng: key for dropout; default `self.make_rng('dropout')`.
      sow_weights: sow the attention weights into 'intermediates' (this runs
        Flax's attention, with a `FlashFallbackWarning`).
      is_causal: query i attends to keys j <= i.
      segment_ids: int32 [batch..., q_len] (self-attention) or a pair
        (q_ids, kv_ids); only equal ids attend.

    Returns:
      [batch..., q_len, out_features or features].
    """
    if inputs_kv is not None:
      if inputs_k is not None or inputs_v is not None:
        raise ValueError("pass either inputs_kv or inputs_k/inputs_v")
      warnings.warn("inputs_kv is deprecated (as in Flax); use inputs_k and "
                    "inputs_v", DeprecationWarning, stacklevel=2)
      inputs_k = inputs_kv
    inputs_k, inputs_v = resolve_inputs(inputs_q, inputs_k, inputs_v)

    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(f"qkv_features ({qkv_features}) must be divisible by "
                       f"num_heads ({self.num_heads})")
    head_dim = qkv_features // self.num_heads
    dense = functools.partial(
        linen.DenseGeneral, axis=-1, dtype=self.dtype,
        param_dtype=self.param_dtype, features=(self.num_heads, head_dim),
        kernel_init=self.kernel_init, bias_init=self.bias_init,
        use_bias=self.use_bias, precision=self.precision,
        dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls)
    query = dense(name="query")(inputs_q)
    key = dense(name="key")(inputs_k)
    value = dense(name="value")(inputs_v)
    if self.normalize_qk:
      norm = functools.partial(linen.LayerNorm, use_bias=False,
                               dtype=self.dtype, param_dtype=self.param_dtype)
      query = norm(name="query_ln")(query)
      key = norm(name="key_ln")(key)

    q_offset = None
    if self.decode:
      # As in Flax: `init` creates the cache from the full-length input and
      # attends without it; later calls append to it.
      initialised = self.has_variable("cache", "cached_key")
      cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape,
                                 key.dtype)
      cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                   value.shape, value.dtype)
      cache_index = self.variable("cache", "cache_index",
                                  lambda: jnp.array(0, dtype=jnp.int32))
      if initialised:
        q_offset = cache_index.value
        key, value = append_to_cache(cached_key.value, cached_value.value,
                                     q_offset, key, value)
        cached_key.value, cached_value.value = key, value
        cache_index.value = q_offset + query.shape[-3]
        is_causal = True

    if self.dropout_rate > 0.0:
      deterministic = linen.merge_param("deterministic", self.deterministic,
                                        deterministic)
      if not deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      deterministic = True

    x = attend(
        self.attention_fn, query, key, value, mask=mask, is_causal=is_causal,
        q_offset=q_offset, segment_ids=segment_ids,
        module=self if sow_weights else None, dropout_rng=dropout_rng,
        dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout,
        deterministic=deterministic, dtype=self.dtype,
        precision=self.precision,
        force_fp32_for_softmax=self.force_fp32_for_softmax,
        qk_attn_weights_einsum=_make(self.qk_attn_weights_einsum_cls),
        attn_weights_value_einsum=_make(self.attn_weights_value_einsum_cls))
    return linen.DenseGeneral(
        features=features, axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init,
        use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)


def _make(factory):
  """linen's einsum overrides are given as factories (AQT)."""
  return factory() if factory else None
