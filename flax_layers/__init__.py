"""Flax modules and `attention_fn` hooks for jax-flash.

Two ways in, each a one-line change:

- `attention_fn=flax_layers.flash_attention_fn` in Flax's own
  `linen.MultiHeadDotProductAttention` or `nnx.MultiHeadAttention`;
- `flax_layers.linen.MultiHeadDotProductAttention` or
  `flax_layers.nnx.MultiHeadAttention` in place of Flax's class: the same
  arguments and parameters, plus fused causal masking, KV-cache decoding and
  packed sequences.

Anything the kernels cannot do goes to Flax's attention with a
`FlashFallbackWarning`; nothing is silently different.
"""
from flax_layers import linen, nnx
from flax_layers.attention_fn import FlashFallbackWarning, flash_attention_fn

__all__ = ["FlashFallbackWarning", "flash_attention_fn", "linen", "nnx"]
