"""`flax.nnx.MultiHeadAttention` on jax_flash: change one import."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from flax_layers import kv_cache
from flax_layers.attention_fn import attend, flash_attention_fn, resolve_inputs


class MultiHeadAttention(nnx.MultiHeadAttention):
  """Multi-head attention with FlashAttention, a drop-in for Flax's.

  The constructor takes exactly the arguments of `flax.nnx.MultiHeadAttention`
  (including `num_kv_heads` for GQA, `decode`, `dropout_rate`,
  `normalize_qk`), builds the same submodules and so the same state: a
  checkpoint of one loads into the other, and the same parameters give the
  same outputs. Only the default `attention_fn` differs
  (`flax_layers.flash_attention_fn`; pass `functools.partial(
  flash_attention_fn, implementation=...)` to pin a backend).

  What runs fused where Flax builds dense masks:
    - `is_causal=True`: the kernels skip the blocks above the diagonal; no
      [q_len, kv_len] mask exists.
    - `decode=True`: the new keys and values are written into the cache
      (`jax_flash.write_kv_cache`) and the new tokens attend to it with
      `jax_flash.decode_attention`, which reads only each sequence's filled
      part. A call may carry several tokens (chunked prefill); they attend
      causally.
    - `segment_ids` (an addition to Flax's call): packed sequences.

  The cache (see `flax_layers.kv_cache`): `init_cache` makes Flax's
  (`cached_key`, `cached_value` [batch..., max_len, num_kv_heads, head_dim],
  `cache_index` scalar), as does `set_view`; `init_cache(...,
  page_size=16)` makes a paged one (pages [num_pages, page_size,
  num_kv_heads, head_dim], `cache_index` [batch...], `block_tables`
  [batch..., pages_per_seq]). Ragged batches: `cache_index` may hold a
  length per sequence, and `input_lengths` right-pads a call (a batch of
  prompts of different lengths in one prefill call).

  Example::

    from flax import nnx
    from flax_layers.nnx import MultiHeadAttention  # was: nnx.Multi...

    layer = MultiHeadAttention(num_heads=8, num_kv_heads=2, in_features=512,
                               decode=False, rngs=nnx.Rngs(0))
    y = layer(x, is_causal=True)                     # x: [batch, len, 512]

    layer.init_cache((batch, max_len, 512), page_size=16)  # or dense: no size
    y = layer(prompts, decode=True, input_lengths=prompt_lengths)  # prefill
    y = layer(next_tokens, decode=True)              # [batch, 1, 512] a step
  """

  def __init__(self, *args, attention_fn=flash_attention_fn, **kwargs):
    super().__init__(*args, attention_fn=attention_fn, **kwargs)
    self.block_tables: nnx.Cache | None = nnx.data(None)

  def init_cache(self, input_shape, dtype=jnp.float32, *, page_size=None):
    """Flax's `init_cache`, or with `page_size` a paged cache.

    Args:
      input_shape: (batch..., max_length, in_features), as Flax's.
      dtype: the cache's dtype; decoding computes in it.
      page_size: rows per page; None: Flax's dense cache. Sequence b starts
        with pages b * pages_per_seq onwards of a pool that holds every
        sequence's max_length; the pool (`cached_key`, `cached_value`) and
        `block_tables` may be replaced to allocate pages differently.
    """
    self.block_tables = None
    if page_size is None:
      super().init_cache(input_shape, dtype)
      return
    cache = kv_cache.init_paged(tuple(input_shape[:-2]), input_shape[-2],
                                self.num_kv_heads, self.head_dim, page_size,
                                dtype)
    (self.cached_key, self.cached_value, self.cache_index,
     self.block_tables) = (nnx.Cache(x) for x in cache)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
               deterministic=None, rngs=None, sow_weights=False, decode=None,
               is_causal=False, segment_ids=None, input_lengths=None,
               out_sharding=None, qkv_sharding=None):
    """Applies multi-head attention; Flax's arguments plus `segment_ids` and
    `input_lengths`.

    Args:
      inputs_q: [batch..., q_len, in_features].
      inputs_k, inputs_v: [batch..., kv_len, in_kv_features]; default
        `inputs_q` and `inputs_k` (self-attention).
      mask: [batch..., num_heads | 1, q_len, kv_len], boolean or float 0/1;
        True attends.
      deterministic: no dropout when True; default the constructor's.
      rngs: `nnx.Rngs` or stream for dropout; default the constructor's.
      sow_weights: sow the attention weights into `nnx.Intermediate` (this
        runs Flax's attention, with a `FlashFallbackWarning`).
      decode: append to the KV cache (see `init_cache`) and attend to it;
        implies causal attention among the new tokens. Default the
        constructor's.
      is_causal: query i attends to keys j <= i.
      segment_ids: int32 [batch..., q_len] (self-attention) or a pair
        (q_ids, kv_ids); only equal ids attend.
      input_lengths: with `decode`, int [batch...]: the valid tokens of
        each sequence in this call, the rest right padding (their outputs
        are meaningless); `cache_index` advances by them and becomes
        [batch...]. Default: all q_len.
      out_sharding, qkv_sharding: as Flax's, for the projections.

    Returns:
      [batch..., q_len, out_features].
    """
    inputs_k, inputs_v = resolve_inputs(inputs_q, inputs_k, inputs_v)
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"inputs_q has {inputs_q.shape[-1]} features; the "
                       f"module expects in_features={self.in_features}")
    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)

    deterministic, dropout_rng = self._dropout(deterministic, rngs)
    flax_kwargs = dict(mask=mask, segment_ids=segment_ids,
                       module=self if sow_weights else None,
                       dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                       broadcast_dropout=self.broadcast_dropout,
                       deterministic=deterministic, dtype=self.dtype,
                       precision=self.precision)
    if self._decoding(decode):
      if self.cached_key is None or self.cache_index is None:
        raise ValueError("decode=True needs the cache: call init_cache first")
      x, keys, values, index = kv_cache.decode(
          self.attention_fn, query, key, value,
          cached_key=self.cached_key[...], cached_value=self.cached_value[...],
          cache_index=self.cache_index[...],
          block_tables=(None if self.block_tables is None
                        else self.block_tables[...]),
          input_lengths=input_lengths, **flax_kwargs)
      self.cached_key[...] = keys
      self.cached_value[...] = values
      self.cache_index.set_value(index)  # a scalar may become [batch...]
    elif input_lengths is not None:
      raise ValueError("input_lengths applies to decode=True calls")
    else:
      x = attend(self.attention_fn, query, key, value, is_causal=is_causal,
                 q_offset=None, **flax_kwargs)
    return self.out(x, out_sharding=out_sharding)

  def _decoding(self, decode) -> bool:
    decode = self.decode if decode is None else decode
    if decode is None:
      raise ValueError("MultiHeadAttention needs `decode`, either in the "
                       "constructor or in the call")
    return decode

  def _dropout(self, deterministic, rngs):
    """(deterministic, dropout_rng); the call's arguments before the module's."""
    if self.dropout_rate <= 0.0:
      return True, None
    deterministic = (self.deterministic if deterministic is None
                     else deterministic)
    if deterministic is None:
      raise ValueError("MultiHeadAttention with dropout needs `deterministic`, "
                       "either in the constructor or in the call")
    if deterministic:
      return True, None
    rngs = self.rngs if rngs is None else rngs
    if isinstance(rngs, nnx.Rngs):
      rngs = rngs.dropout
    if rngs is None:
      raise ValueError("dropout needs `rngs`, in the call or kept by the "
                       "constructor (keep_rngs=True)")
    return False, rngs()
