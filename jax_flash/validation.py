"""Argument checks shared by `flash_attention` and `attention_reference`.

Every error names the argument and shows the shapes it saw.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import masking
from pallas_kernels.masking import Operands

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)



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


def add_batch_axis(query, key, value):
  """jax.nn's unbatched layout: a rank-3 `[seq, heads, head_dim]` input is a
  batch of one.

  Returns the rank-4 (query, key, value) and `restore(out, lse)`, which
  gives the results in the caller's layout: out shaped like `query` and lse
  `query.shape[:-1]` (`[q_len, num_heads]` for an unbatched query), as
  `jax.nn.dot_product_attention` returns them. Other ranks pass through to
  `check_qkv`, which names them.
  """
  given = tuple(jnp.asarray(x) for x in (query, key, value))
  query_shape = given[0].shape
  query, key, value = (x[None] if x.ndim == 3 else x for x in given)
  if any(x.ndim == 3 for x in given):
    try:  # errors name the shapes as given, not only as batched here
      check_qkv(query, key, value)
    except ValueError as e:
      raise ValueError(
          f"{e} (as given: query {given[0].shape}, key {given[1].shape}, "
          f"value {given[2].shape}; a rank-3 input is a batch of one)"
      ) from None

  def restore(out, lse):
    return (jnp.reshape(out, query_shape),
            jnp.reshape(lse, query_shape[:-1]))

  return query, key, value, restore


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
          f"{name} must have rank 4 [batch, seq_len, num_heads, head_dim] (or "
          f"3, unbatched), got shape {tuple(x.shape)} (rank {x.ndim}); "
          f"shapes: {shapes}")
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
  except (TypeError, ValueError) as e:  # not a number, or a string of none
    raise TypeError(f"scale must be a Python number, got {scale!r}") from e
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  return scale


def _concrete_values(x):
  """x as a numpy array, or None under a transformation (traced values)."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return None


def _check_int_array(name: str, x, shape: tuple[int, ...]):
  """x as int32 of `shape` [batch, ...]; without its batch axis, x is the
  same for every batch element."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {x.dtype}")
  if x.shape == shape[1:]:
    x = jnp.broadcast_to(x, shape)
  if x.shape != shape:
    raise ValueError(f"{name} must have shape {shape} (or {shape[1:]}, the "
                     f"same for every batch element), got {x.shape}")
  return x.astype(jnp.int32)


def _check_lengths(name: str, lengths, batch: int, limit: int):
  if lengths is None:
    return None
  lengths = _check_int_array(name, lengths, (batch,))
  values = _concrete_values(lengths)
  if values is not None:
    if values.min() < 0 or values.max() > limit:
      raise ValueError(f"{name} must lie in [0, {limit}], got {values}")
  return lengths


def _check_window(local_window_size):
  if local_window_size is None:
    return None
  bad = TypeError("local_window_size must be an int or a (left, right) "
                  f"pair of ints or None, got {local_window_size!r}")
  if isinstance(local_window_size, (int, np.integer)):
    window = (int(local_window_size), int(local_window_size))
  else:
    try:
      left, right = local_window_size
      window = tuple(None if w is None else operator.index(w)
                     for w in (left, right))
    except (TypeError, ValueError) as e:
      raise bad from e
  if any(w is not None and w < 0 for w in window):
    raise ValueError(f"local_window_size must be >= 0, got {local_window_size}")
  # A side of 2^30 or more bounds nothing a sequence reaches, and q_pos +
  # right would overflow int32 in the masks: unbounded.
  return tuple(None if w is not None and w >= _UNBOUNDED_WINDOW else w
               for w in window)


_UNBOUNDED_WINDOW = 1 << 30


def _broadcastable(name: str, x, shape: AttentionShape):
  """x with leading axes added up to rank 4 (as jax.nn does), checked to
  broadcast to [batch, num_heads, q_len, kv_len]."""
  full = (shape.batch, shape.num_heads, shape.q_len, shape.kv_len)
  padded = (1,) * (4 - x.ndim) + x.shape
  if x.ndim > 4 or any(d not in (1, f) for d, f in zip(padded, full)):
    raise ValueError(f"{name} must be broadcastable to [batch, num_heads, "
                     f"q_len, kv_len] = {full} (rank at most 4), got "
                     f"{x.shape}")
  return jnp.reshape(x, padded)


def _vector_mask_as_segments(mask, shape: AttentionShape):
  """(segment_ids, None) for a bool mask that varies along one sequence axis
  at most, the same for every head: [batch | 1, 1, 1, kv_len] (key
  padding, as jax.nn and BERT-style encoders pass it) or [batch | 1, 1,
  q_len, 1]; else (None, mask).

  Kept positions get segment 0 and dropped ones segment 1 on their own
  side, the other side all 0: a query attends a key exactly where the mask
  is True, and a query that keeps no key gets zeros, as under the mask.
  As segments the call runs on every kernel (the Mosaic ones stream no
  mask tiles of such shapes) and its empty tiles are skipped.
  """
  batch, heads, q_len, kv_len = mask.shape
  if heads != 1 or (q_len != 1 and kv_len != 1):
    return None, mask
  if kv_len == 1:
    q_ids = jnp.where(mask[:, 0, :, 0], 0, 1)
    kv_ids = jnp.zeros((1, shape.kv_len), jnp.int32)
  else:
    q_ids = jnp.zeros((1, shape.q_len), jnp.int32)
    kv_ids = jnp.where(mask[:, 0, 0, :], 0, 1)
  full = lambda ids, length: jnp.broadcast_to(
      ids.astype(jnp.int32), (shape.batch, length))
  return (full(q_ids, shape.q_len), full(kv_ids, shape.kv_len)), None


def _check_block_mask(block_mask, shape: AttentionShape):
  """A `BlockMask` passed as mask_fn, checked to be one of this call's
  shape: its tiles decide which the kernels skip, so one built for other
  lengths would silently drop or keep the wrong blocks."""
  tile = block_mask.tile
  want = (-(-shape.q_len // tile), -(-shape.kv_len // tile))
  nb, nh, nq, nk = block_mask.states.shape
  lengths = block_mask.lengths
  if (nq, nk) != want or nb not in (1, shape.batch) or (
      nh not in (1, shape.num_heads)) or (
          lengths is not None and lengths != (shape.q_len, shape.kv_len)):
    raise ValueError(
        f"mask_fn's BlockMask has states {block_mask.states.shape} (tile "
        f"{tile}, lengths {lengths}); this call needs [batch | 1, "
        f"num_heads | 1, {want[0]}, "
        f"{want[1]}] for batch {shape.batch}, {shape.num_heads} heads, "
        f"q_len {shape.q_len}, kv_len {shape.kv_len}: build it with "
        "BlockMask.from_mask_fn for these shapes")
  return block_mask


def _check_segments(segment_ids, shape: AttentionShape):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be an array or a (q_ids, kv_ids) "
                       f"pair, got {len(segment_ids)} items")
    q_ids, kv_ids = segment_ids
  else:
    if shape.q_len != shape.kv_len:
      raise ValueError(
          "a single segment_ids array needs q_len == kv_len (self-attention);"
          f" got q_len {shape.q_len}, kv_len {shape.kv_len}: pass "
          "(q_segment_ids, kv_segment_ids)")
    q_ids = kv_ids = segment_ids
  return (_check_int_array("segment_ids (query)", q_ids,
                           (shape.batch, shape.q_len)),
          _check_int_array("segment_ids (key/value)", kv_ids,
                           (shape.batch, shape.kv_len)))


def _check_per_batch_offset(q_offset, batch: int):
  if q_offset is None:
    return None
  if isinstance(q_offset, (int, np.integer)):
    return jnp.full((batch,), int(q_offset), jnp.int32)
  return _check_int_array("q_offset", q_offset, (batch,))


def _check_alibi(alibi_slopes, shape: AttentionShape):
  if alibi_slopes is None:
    return None
  slopes = jnp.asarray(alibi_slopes)
  if not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise TypeError(f"alibi_slopes must be float, got {slopes.dtype}")
  if slopes.shape == (shape.num_heads,):
    slopes = jnp.broadcast_to(slopes, (shape.batch, shape.num_heads))
  if slopes.shape != (shape.batch, shape.num_heads):
    raise ValueError(
        f"alibi_slopes must have shape [num_heads] = ({shape.num_heads},) or"
        f" [batch, num_heads] = ({shape.batch}, {shape.num_heads}), got "
        f"{slopes.shape}")
  # Not differentiated (the kernels take no gradient for them): the same
  # zero gradient from every implementation and the reference.
  return jax.lax.stop_gradient(slopes.astype(jnp.float32))


def _dropout_seed(dropout_rate, dropout_rng):
  try:  # Python, NumPy or concrete JAX scalars; static in the kernels
    dropout_rate = float(dropout_rate)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"dropout_rate must be a number in [0, 1) known when "
                     f"the call is traced, got {dropout_rate!r}") from e
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate must be a number in [0, 1), got "
                     f"{dropout_rate!r}")
  if not dropout_rate:
    return None
  levels = masking.dropout_levels(dropout_rate)
  if not 0 < levels < masking.DROPOUT_LEVELS:
    raise ValueError(
        f"dropout_rate is applied in steps of 1/256 (each weight compares "
        f"a byte); {dropout_rate!r} rounds to {levels}/256: give 0 or a "
        f"rate in [1/512, 511/512)")
  if dropout_rng is None:
    raise ValueError("dropout_rate > 0 needs a dropout_rng key")
  if not jnp.issubdtype(jnp.asarray(dropout_rng).dtype, jax.dtypes.prng_key):
    dropout_rng = jax.random.wrap_key_data(jnp.asarray(dropout_rng, jnp.uint32))
  bits = jax.random.bits(dropout_rng, (), jnp.uint32)
  return jax.lax.bitcast_convert_type(bits, jnp.int32)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
  """One validated call: static spec, scale, traced mask operands, and the
  differentiable extras (bias, sinks)."""

  shape: AttentionShape
  scale: float
  spec: masking.MaskSpec
  operands: Operands
  bias: Any = None
  sinks: Any = None


def normalise_call(query, key, value, *, bias=None, mask=None, scale=None,
                   is_causal=False, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None,
                   segment_ids=None, q_offset=None, logits_soft_cap=None,
                   alibi_slopes=None, mask_fn=None, score_fn=None,
                   dropout_rate=0.0, dropout_rng=None, sinks=None
                   ) -> AttentionCall:
  """Validates every argument of one call and puts it in canonical form."""
  shape = check_qkv(query, key, value)
  scale = check_scale(scale, shape.head_dim)
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  if bias is not None:
    bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"bias must be a float array, got {bias.dtype}")
    bias = _broadcastable("bias", bias, shape)
  if mask is not None:
    mask = jnp.asarray(mask)
    mask = _broadcastable("mask", mask, shape)
    # Flax's make_causal_mask gives float 0/1 masks: nonzero attends.
    mask = mask if mask.dtype == jnp.bool_ else mask != 0
    if segment_ids is None:
      segment_ids, mask = _vector_mask_as_segments(mask, shape)
  if logits_soft_cap is not None:
    try:
      logits_soft_cap = float(logits_soft_cap)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
      raise TypeError(f"logits_soft_cap must be a number known when the "
                      f"call is traced, got {logits_soft_cap!r}") from e
    if not logits_soft_cap > 0:
      raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
  for name, fn in (("mask_fn", mask_fn), ("score_fn", score_fn)):
    if fn is not None and not callable(fn):
      raise TypeError(f"{name} must be callable, got {fn!r}")
  block_mask = None
  if isinstance(mask_fn, masking.BlockMask):
    block_mask, mask_fn = _check_block_mask(mask_fn, shape), mask_fn.mask_fn
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    if sinks.shape != (shape.num_heads,):
      raise ValueError(f"sinks must have shape [num_heads] = "
                       f"({shape.num_heads},), got {sinks.shape}")
  q_segments, kv_segments = _check_segments(segment_ids, shape)
  operands = Operands(
      q_offset=_check_per_batch_offset(q_offset, shape.batch),
      q_lengths=_check_lengths("query_seq_lengths", query_seq_lengths,
                               shape.batch, shape.q_len),
      kv_lengths=_check_lengths("key_value_seq_lengths", key_value_seq_lengths,
                                shape.batch, shape.kv_len),
      q_segments=q_segments, kv_segments=kv_segments, dense_mask=mask,
      alibi_slopes=_check_alibi(alibi_slopes, shape),
      dropout_seed=_dropout_seed(dropout_rate, dropout_rng),
      block_mask=block_mask)
  spec = masking.MaskSpec(
      q_len=shape.q_len, kv_len=shape.kv_len, is_causal=bool(is_causal),
      window=_check_window(local_window_size),
      has_q_offset=operands.q_offset is not None,
      has_q_lengths=operands.q_lengths is not None,
      has_kv_lengths=operands.kv_lengths is not None,
      has_segments=q_segments is not None, has_dense_mask=mask is not None,
      mask_fn=mask_fn, score_fn=score_fn, logits_soft_cap=logits_soft_cap,
      has_alibi=operands.alibi_slopes is not None, has_bias=bias is not None,
      dropout_rate=masking.quantized_dropout_rate(dropout_rate))
  return AttentionCall(shape, scale, spec, operands, bias, sinks)
