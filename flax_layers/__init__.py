"""Flax modules and `attention_fn` hooks for jax-flash.

Two ways in, each a one-line change:

- `attention_fn=flax_layers.flash_attention_fn` in Flax's own
  `linen.MultiHeadDotProductAttention` or `nnx.MultiHeadAttention`;
- `flax_layers.linen.MultiHeadDotProductAttention` or
  `flax_layers.nnx.MultiHeadAttention` in place of Flax's class: the same
  arguments and parameters, plus fused causal masking, packed sequences and
  KV-cache decoding through `jax_flash.decode_attention`: Flax's dense cache
  or a paged one, ragged batches (`flax_layers.kv_cache`).

Anything the kernels cannot do goes to Flax's attention with a
`FlashFallbackWarning`; nothing is silently different.
"""
from flax_layers import kv_cache, linen, nnx
from flax_layers.attention_fn import FlashFallbackWarning, flash_attention_fn

__all__ = ["FlashFallbackWarning", "flash_attention_fn", "kv_cache", "linen",
           "nnx"]
