"""`flax.linen.MultiHeadDotProductAttention` on jax_flash: change one import."""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import linen

from flax_layers import kv_cache
from flax_layers.attention_fn import attend, flash_attention_fn, resolve_inputs


class MultiHeadDotProductAttention(linen.MultiHeadDotProductAttention):
  """Multi-head attention with FlashAttention, a drop-in for Flax's.

  The same fields as `flax.linen.MultiHeadDotProductAttention` (it is a
  subclass, with the same class name, so automatic names match too), the same
  parameter tree (`query`, `key`, `value`, `out`, and `query_ln`/`key_ln`
  with `normalize_qk`) and the same `cache` collection: existing checkpoints
  load, and the same parameters give the same outputs. Only the default
  `attention_fn` differs (`flax_layers.flash_attention_fn`), and one field
  is added, `page_size`.

  What runs fused where Flax builds dense masks:
    - `is_causal=True` (an addition to the call; Flax's linen module has no
      causal flag): no [q_len, kv_len] mask exists.
    - `decode=True`: the new keys and values are written into the cache
      (`jax_flash.write_kv_cache`) and the new tokens attend to it with
      `jax_flash.decode_attention`, which reads only each sequence's filled
      part. A call may carry several tokens (chunked prefill), attending
      causally.
    - `segment_ids` (an addition): packed sequences.

  The cache (see `flax_layers.kv_cache`), made by `init` with
  `decode=True` from an input of the full length, as Flax's: `cached_key`,
  `cached_value` [batch..., max_len, num_heads, head_dim] and a scalar
  `cache_index`. With `page_size` set it is paged instead: pages
  [num_pages, page_size, num_heads, head_dim], `cache_index` [batch...] and
  `block_tables` [batch..., pages_per_seq], sequence b starting with pages
  b * pages_per_seq onwards; any of them may be replaced between calls (a
  serving engine's own pool and tables). Ragged batches: `cache_index` may
  hold a length per sequence, and `input_lengths` right-pads a call.

  Example::

    # was: from flax.linen import MultiHeadDotProductAttention
    from flax_layers.linen import MultiHeadDotProductAttention

    layer = MultiHeadDotProductAttention(num_heads=8, qkv_features=512)
    variables = layer.init(jax.random.key(0), x)
    y = layer.apply(variables, x, is_causal=True)  # x: [batch, len, d]
  """

  attention_fn: Callable[..., Any] = flash_attention_fn
  page_size: int | None = None  # decode=True: rows per page of a paged cache

  @linen.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *,
               inputs_kv=None, mask=None, deterministic=None,
               dropout_rng=None, sow_weights=False, is_causal=False,
               segment_ids=None, input_lengths=None):
    """Applies multi-head attention; Flax's arguments plus three.

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
      input_lengths: with `decode`, int [batch...]: the valid tokens of
        each sequence in this call, the rest right padding (their outputs
        are meaningless); `cache_index` advances by them and becomes
        [batch...]. Default: all q_len.

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

    if self.dropout_rate > 0.0:
      deterministic = linen.merge_param("deterministic", self.deterministic,
                                        deterministic)
      if not deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      deterministic = True
    flax_kwargs = dict(
        mask=mask, segment_ids=segment_ids,
        module=self if sow_weights else None, dropout_rng=dropout_rng,
        dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout,
        deterministic=deterministic, dtype=self.dtype,
        precision=self.precision,
        force_fp32_for_softmax=self.force_fp32_for_softmax,
        qk_attn_weights_einsum=_make(self.qk_attn_weights_einsum_cls),
        attn_weights_value_einsum=_make(self.attn_weights_value_einsum_cls))

    cache = self._cache(key) if self.decode else None
    if cache is not None:
      cached_key, cached_value, cache_index, tables = cache
      x, cached_key.value, cached_value.value, cache_index.value = (
          kv_cache.decode(
              self.attention_fn, query, key, value,
              cached_key=cached_key.value, cached_value=cached_value.value,
              cache_index=cache_index.value,
              block_tables=None if tables is None else tables.value,
              input_lengths=input_lengths, **flax_kwargs))
    elif input_lengths is not None:
      raise ValueError("input_lengths applies to decoding with a cache")
    else:
      x = attend(self.attention_fn, query, key, value, is_causal=is_causal,
                 q_offset=None, **flax_kwargs)
    return linen.DenseGeneral(
        features=features, axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init,
        use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)

  def _cache(self, key):
    """The cache variables (key, value, index, block tables or None), or
    None while `init` creates them: as in Flax, that call attends without
    the cache."""
    initialised = self.has_variable("cache", "cached_key")
    if self.page_size is None:
      tables = None
      cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape,
                                 key.dtype)
      cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                   key.shape, key.dtype)
      cache_index = self.variable("cache", "cache_index",
                                  lambda: jnp.array(0, dtype=jnp.int32))
    else:
      def paged(part):
        return kv_cache.init_paged(key.shape[:-3], key.shape[-3],
                                   *key.shape[-2:], self.page_size,
                                   key.dtype)[part]
      cached_key, cached_value, cache_index, tables = (
          self.variable("cache", name, paged, part) for part, name in
          enumerate(("cached_key", "cached_value", "cache_index",
                     "block_tables")))
    if not initialised:
      return None
    return cached_key, cached_value, cache_index, tables


def _make(factory):
  """linen's einsum overrides are given as factories (AQT)."""
  return factory() if factory else None
