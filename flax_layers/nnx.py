"""`flax.nnx.MultiHeadAttention` on jax_flash: change one import."""
from __future__ import annotations

from flax import nnx

from flax_layers.attention_fn import (append_to_cache, attend,
                                      flash_attention_fn, resolve_inputs)


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
    - `decode=True`: the new tokens attend to the cache through `q_offset`
      (their position), so work stops at the filled part of the cache. A call
      may carry several tokens (chunked prefill); they attend causally.
    - `segment_ids` (an addition to Flax's call): packed sequences.

  `init_cache` and `set_view` are Flax's.

  Example::

    from flax import nnx
    from flax_layers.nnx import MultiHeadAttention  # was: nnx.Multi...

    layer = MultiHeadAttention(num_heads=8, num_kv_heads=2, in_features=512,
                               decode=False, rngs=nnx.Rngs(0))
    y = layer(x, is_causal=True)                     # x: [batch, len, 512]
  """

  def __init__(self, *args, attention_fn=flash_attention_fn, **kwargs):
    super().__init__(*args, attention_fn=attention_fn, **kwargs)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
               deterministic=None, rngs=None, sow_weights=False, decode=None,
               is_causal=False, segment_ids=None, out_sharding=None,
               qkv_sharding=None):
    """Applies multi-head attention; Flax's arguments plus `segment_ids`.

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

    q_offset = None
    if self._decoding(decode):
      if self.cached_key is None or self.cache_index is None:
        raise ValueError("decode=True needs the cache: call init_cache first")
      q_offset = self.cache_index[...]
      key, value = append_to_cache(self.cached_key[...],
                                   self.cached_value[...], q_offset, key,
                                   value)
      self.cached_key[...] = key
      self.cached_value[...] = value
      self.cache_index[...] = q_offset + query.shape[-3]
      is_causal = True

    deterministic, dropout_rng = self._dropout(deterministic, rngs)
    x = attend(self.attention_fn, query, key, value, mask=mask,
               is_causal=is_causal, q_offset=q_offset,
               segment_ids=segment_ids,
               module=self if sow_weights else None,
               dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
               broadcast_dropout=self.broadcast_dropout,
               deterministic=deterministic, dtype=self.dtype,
               precision=self.precision)
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
