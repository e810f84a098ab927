"""Argument checks shared by `flash_attention` and `attention_reference`.

Every error names the argument and shows the shapes it saw.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)

# Arguments of the public signature that later issues fill in; until then a
# value other than the default is refused by name rather than ignored.
RESERVED_ARGUMENTS = (
    "bias", "mask", "query_seq_lengths", "key_value_seq_lengths",
    "local_window_size", "segment_ids", "q_offset", "logits_soft_cap",
    "alibi_slopes", "mask_fn", "score_fn", "dropout_rng",
)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """Sizes of one attention call, read off validated inputs."""

  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int

  @property
  def group(self) -> int:
    """Query heads per key/value head (1 = MHA, num_heads = MQA)."""
    return self.num_heads // self.num_kv_heads


def check_qkv(query, key, value) -> AttentionShape:
  """Validates `query [B, Tq, N, D]`, `key/value [B, Tk, K, D]`.

  Raises:
    ValueError: wrong ranks, mismatched batch, lengths, heads or head dims.
    TypeError: non-float dtypes or dtypes that differ between the three.
  """
  shapes = (f"query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"value {tuple(value.shape)}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have rank 4 [batch, seq_len, num_heads, head_dim], got "
          f"shape {tuple(x.shape)} (rank {x.ndim}); shapes: {shapes}")
    if not any(x.dtype == d for d in _FLOAT_DTYPES):
      raise TypeError(
          f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
  if not query.dtype == key.dtype == value.dtype:
    raise TypeError(
        "query, key and value must have the same dtype, got "
        f"{query.dtype}, {key.dtype}, {value.dtype}")
  b, tq, n, d = query.shape
  bk, tk, nk, dk = key.shape
  if key.shape != value.shape:
    raise ValueError(f"key and value must have the same shape; {shapes}")
  if bk != b:
    raise ValueError(f"query and key must have the same batch size; {shapes}")
  if dk != d:
    raise ValueError(f"query and key must have the same head_dim; {shapes}")
  if tq == 0 or tk == 0 or d == 0 or n == 0 or nk == 0:
    raise ValueError(f"sequence lengths, heads and head_dim must be > 0; {shapes}")
  if n % nk:
    raise ValueError(
        f"num_heads ({n}) must be divisible by num_kv_heads ({nk}); {shapes}")
  return AttentionShape(b, tq, tk, n, nk, d)


def check_scale(scale, head_dim: int) -> float:
  """Returns the logit scale, `1/sqrt(head_dim)` by default."""
  if scale is None:
    return float(head_dim) ** -0.5
  try:
    scale = float(scale)
  except TypeError as e:
    raise TypeError(f"scale must be a Python number, got {scale!r}") from e
  if not jnp.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  return scale


def check_reserved(**values) -> None:
  """Refuses variant arguments that this version does not implement yet."""
  for name, value in values.items():
    if value is not None:
      raise NotImplementedError(
          f"{name} is not implemented yet in jax_flash (got {type(value).__name__})")


def check_dropout(dropout_rate, dropout_rng) -> None:
  if not 0.0 <= float(dropout_rate) < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  if dropout_rate and dropout_rng is None:
    raise ValueError("dropout_rate > 0 needs a dropout_rng key")
  if dropout_rate:
    raise NotImplementedError("dropout is not implemented yet in jax_flash")


def normalise_call(query, key, value, *, scale, is_causal, dropout_rate=0.0,
                   dropout_rng=None, **variants):
  """Validates one call and returns `(shape, scale, mask_spec)`.

  `variants` are the mask/score arguments of the public signature; those that
  this version does not implement must be None.
  """
  from jax_flash.masking import MaskSpec  # masking has no dependencies back

  shape = check_qkv(query, key, value)
  scale = check_scale(scale, shape.head_dim)
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  check_dropout(dropout_rate, dropout_rng)
  check_reserved(**variants)
  spec = MaskSpec(q_len=shape.q_len, kv_len=shape.kv_len, is_causal=is_causal)
  return shape, scale, spec
