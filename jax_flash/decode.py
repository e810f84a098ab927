"""Inference: attention of a few new tokens against a dense or paged KV cache.

`decode_attention` is FlashDecoding: the cache of each sequence is split into
spans that separate programs read in parallel, each span's partial softmax
(out, lse) is merged by its log-sum-exp, and every query head of a K/V head's
group shares one tile, so each cache byte is read once. `write_kv_cache`
appends new keys and values in place.

Positions (DESIGN.md section 2b). Row `i` of sequence `b` sits at
`p = cache_lengths[b] - q_len + i` and attends to cache positions `j <= p`
(and `j >= p - left` with a window)::

    cache_lengths[b] = 6, q_len = 2:   j: 0 1 2 3 4 5 6 7   (max_len 8)
                               row 0 (p=4)  1 1 1 1 1 0 0 0
                               row 1 (p=5)  1 1 1 1 1 1 0 0

For a dense cache this is `flash_attention(query, key_cache, value_cache,
is_causal=True, q_offset=cache_lengths - q_len,
key_value_seq_lengths=cache_lengths)`, the oracle the tests compare with.
Cache entries at or past a sequence's length and pages no table names may
hold anything (NaN and Inf included): they never reach the result.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jax_flash import api, reference, validation
from pallas_kernels import masking

Implementation = Literal["mosaic", "triton", "xla"]


@dataclasses.dataclass(frozen=True)
class DecodeCall:
  """One validated decode call (static parts; traced arrays beside it).

  Attributes:
    batch, q_len, num_heads, num_kv_heads, head_dim: sizes.
    capacity: cache positions a sequence can hold (max_len, or
      pages_per_seq * page_size).
    page_size: rows per page; 0 for a dense cache.
    scale: logit scale.
    spec: the mask and score semantics (`pallas_kernels.masking.MaskSpec`):
      causal with a per-sequence q_offset and kv length, window, soft cap,
      ALiBi.
  """

  batch: int
  q_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  capacity: int
  page_size: int
  scale: float
  spec: masking.MaskSpec

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads


def decode_attention(
    query: Float[Array, "batch q_len heads dim"],
    key_cache: Float[Array, "batch_or_pages len_or_page kv_heads dim"],
    value_cache: Float[Array, "batch_or_pages len_or_page kv_heads dim"],
    cache_lengths: Int[Array, "batch"],
    *, block_tables: Int[Array, "batch pages_per_seq"] | None = None,
    scale: float | None = None, local_window_size=None,
    logits_soft_cap: float | None = None, alibi_slopes=None, sinks=None,
    return_residual: bool = False,
    implementation: Implementation | None = None,
    interpret: bool | None = None):
  """Attention of each sequence's newest `q_len` tokens against its KV cache.

  Args:
    query: [batch, q_len, num_heads, head_dim]: each sequence's newest q_len
      tokens (1 when decoding; a few for speculative decoding; hundreds for
      chunked prefill).
    key_cache, value_cache: dense [batch, max_len, num_kv_heads, head_dim],
      or paged [num_pages, page_size, num_kv_heads, head_dim]; the dtype of
      query. num_heads must be a multiple of num_kv_heads.
    cache_lengths: int [batch]: valid tokens per sequence, the new ones
      included (a scalar: the same for every sequence). Traced: one
      compilation serves every step of a generation loop.
    block_tables: int [batch, pages_per_seq] for a paged cache: token t of
      sequence b lives in page block_tables[b, t // page_size], row
      t % page_size. Entries past a sequence's length are never read.
      None: a dense cache.
    scale: multiplies q·k; default 1/sqrt(head_dim).
    local_window_size: int or (left, right): row p also needs j >= p - left
      (the right side is moot: decoding is causal).
    logits_soft_cap: logits = cap * tanh(logits / cap).
    alibi_slopes: float32 [num_heads] or [batch, num_heads].
    sinks: float32 [num_heads]: a logit per head that joins every row's
      softmax denominator (GPT-OSS).
    return_residual: also return the logsumexp, float32
      [batch, q_len, num_heads] (-inf for rows with nothing to attend to).
    implementation: None picks the fastest that takes the call (on a GPU:
      mosaic -> triton -> xla; on a CPU xla unless `interpret=True`);
      "triton" runs in Pallas interpret mode on a CPU.
    interpret: run the Pallas kernels in interpret mode.

  Returns:
    out [batch, q_len, num_heads, head_dim] in query's dtype, or (out, lse).
    Rows at a position below 0 (cache_lengths[b] < q_len) give 0.
  """
  call, operands = normalise_decode_call(
      query, key_cache, value_cache, cache_lengths, block_tables=block_tables,
      scale=scale, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks)
  lengths, tables, slopes, sinks = operands
  out, lse = api.dispatch(implementation, interpret, lambda name, interp: (
      _IMPLEMENTATIONS[name](call, query, key_cache, value_cache, lengths,
                             tables, slopes, interpret=interp)))
  if sinks is not None:
    out, lse = masking.apply_sinks(out, lse, sinks)
  return (out, lse) if return_residual else out


def write_kv_cache(key_cache, value_cache, new_key, new_value, positions, *,
                   block_tables=None):
  """Writes new keys and values into a dense or paged cache.

  Args:
    key_cache, value_cache: dense [batch, max_len, num_kv_heads, head_dim]
      or paged [num_pages, page_size, num_kv_heads, head_dim].
    new_key, new_value: [batch, t, num_kv_heads, head_dim], written at
      positions[b] .. positions[b] + t - 1 of sequence b.
    positions: int [batch] (or a scalar, the same for every sequence).
    block_tables: int [batch, pages_per_seq] for a paged cache.

  Returns:
    (key_cache, value_cache) with the new rows written and nothing else
    changed. A scatter: under `jit` with the caches donated it updates them
    in place. Positions past the capacity are dropped; a negative one is
    a ValueError where `positions` is concrete, and dropped where it is
    traced (never wrapped round to the cache's end).
  """
  key_cache, value_cache = jnp.asarray(key_cache), jnp.asarray(value_cache)
  new_key, new_value = jnp.asarray(new_key), jnp.asarray(new_value)
  for name, x in (("key_cache", key_cache), ("value_cache", value_cache),
                  ("new_key", new_key), ("new_value", new_value)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4, got shape {x.shape}")
  if key_cache.shape != value_cache.shape:
    raise ValueError("key_cache and value_cache must have the same shape, got "
                     f"{key_cache.shape} and {value_cache.shape}")
  if new_key.shape != new_value.shape:
    raise ValueError("new_key and new_value must have the same shape, got "
                     f"{new_key.shape} and {new_value.shape}")
  batch, t = new_key.shape[:2]
  if new_key.shape[2:] != key_cache.shape[2:]:
    raise ValueError(
        "new_key must be [batch, t, num_kv_heads, head_dim] with the cache's "
        f"heads and head_dim {key_cache.shape[2:]}, got {new_key.shape}")
  positions = validation._check_int_array("positions", positions, (batch,))
  values = validation._concrete_values(positions)
  if values is not None and values.min() < 0:
    raise ValueError(f"positions must be non-negative, got {values}")
  offsets = positions[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  if block_tables is None:
    if key_cache.shape[0] != batch:
      raise ValueError(f"new_key's batch ({batch}) must match the dense "
                       f"cache's ({key_cache.shape[0]})")
    # Positions past max_len are out of bounds: "drop" leaves the cache.
    # So are negative ones, which `.at[]` would count from the end.
    rows = (jnp.arange(batch, dtype=jnp.int32)[:, None],
            jnp.where(offsets < 0, key_cache.shape[1], offsets))
  else:
    tables = _block_tables(block_tables, batch)
    page_size = key_cache.shape[1]
    capacity = tables.shape[1] * page_size
    page = jnp.take_along_axis(
        tables, jnp.clip(offsets // page_size, 0, tables.shape[1] - 1), axis=1)
    # Past the capacity or before 0: an out-of-range page index, which
    # "drop" skips.
    page = jnp.where((offsets >= 0) & (offsets < capacity), page,
                     key_cache.shape[0])
    rows = (page, offsets % page_size)
  write = lambda cache, new: cache.at[rows].set(new.astype(cache.dtype),
                                                mode="drop")
  return write(key_cache, new_key), write(value_cache, new_value)


# --- validation -----------------------------------------------------------


def _block_tables(block_tables, batch: int):
  tables = jnp.asarray(block_tables)
  if not jnp.issubdtype(tables.dtype, jnp.integer):
    raise TypeError(f"block_tables must be an integer array, got "
                    f"{tables.dtype}")
  if tables.ndim != 2 or tables.shape[0] != batch:
    raise ValueError(f"block_tables must have shape [batch, pages_per_seq] "
                     f"with batch {batch}, got {tables.shape}")
  return tables.astype(jnp.int32)


def normalise_decode_call(query, key_cache, value_cache, cache_lengths, *,
                          block_tables=None, scale=None,
                          local_window_size=None, logits_soft_cap=None,
                          alibi_slopes=None, sinks=None):
  """Validates a decode call.

  Returns:
    (DecodeCall, (cache_lengths int32 [batch], block_tables int32
    [batch, pages_per_seq] or None, alibi slopes float32 [batch, num_heads]
    or None, sinks [num_heads] or None)).
  """
  query = jnp.asarray(query)
  shapes = (f"query {tuple(query.shape)}, key_cache "
            f"{tuple(jnp.shape(key_cache))}, value_cache "
            f"{tuple(jnp.shape(value_cache))}")
  for name, x in (("query", query), ("key_cache", key_cache),
                  ("value_cache", value_cache)):
    if jnp.ndim(x) != 4:
      raise ValueError(f"{name} must have rank 4, got shape "
                       f"{tuple(jnp.shape(x))}; shapes: {shapes}")
    if not any(jnp.dtype(x.dtype) == d for d in validation._FLOAT_DTYPES):
      raise TypeError(f"{name} must be float16, bfloat16 or float32, got "
                      f"{x.dtype}")
  if not query.dtype == key_cache.dtype == value_cache.dtype:
    raise TypeError("query, key_cache and value_cache must have the same "
                    f"dtype, got {query.dtype}, {key_cache.dtype}, "
                    f"{value_cache.dtype}")
  if key_cache.shape != value_cache.shape:
    raise ValueError(f"key_cache and value_cache must have the same shape; "
                     f"{shapes}")
  batch, q_len, num_heads, head_dim = query.shape
  _, rows, num_kv_heads, cache_dim = key_cache.shape
  if cache_dim != head_dim:
    raise ValueError(f"query and the caches must have the same head_dim; "
                     f"{shapes}")
  if 0 in query.shape or 0 in key_cache.shape:
    raise ValueError(f"sizes must be > 0; {shapes}")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads ({num_heads}) must be divisible by "
                     f"num_kv_heads ({num_kv_heads}); {shapes}")
  if block_tables is None:
    if key_cache.shape[0] != batch:
      raise ValueError(f"a dense cache must have query's batch size; {shapes}"
                       " (pass block_tables for a paged cache)")
    capacity, page_size, tables = rows, 0, None
  else:
    tables = _block_tables(block_tables, batch)
    page_size = rows
    capacity = tables.shape[1] * page_size
  lengths = validation._check_int_array("cache_lengths", cache_lengths,
                                         (batch,))
  concrete = validation._concrete_values(lengths)
  if concrete is not None and (concrete.min() < 0
                               or concrete.max() > capacity):
    raise ValueError(f"cache_lengths must lie in [0, {capacity}] (the "
                     f"cache's capacity), got {concrete}")
  if tables is not None:
    _check_pages(tables, concrete, page_size, key_cache.shape[0])
  scale = validation.check_scale(scale, head_dim)
  window = validation._check_window(local_window_size)
  if window is not None:
    window = (window[0], None)  # the right side is moot under causality
  if logits_soft_cap is not None:
    logits_soft_cap = float(logits_soft_cap)
    if not logits_soft_cap > 0:
      raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
  shape = validation.AttentionShape(batch, q_len, capacity, num_heads,
                                    num_kv_heads, head_dim)
  slopes = validation._check_alibi(alibi_slopes, shape)
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    if sinks.shape != (num_heads,):
      raise ValueError(f"sinks must have shape [num_heads] = ({num_heads},),"
                       f" got {sinks.shape}")
  spec = masking.MaskSpec(
      q_len=q_len, kv_len=capacity, is_causal=True,
      window=None if window is None or window[0] is None else window,
      has_q_offset=True, has_kv_lengths=True, logits_soft_cap=logits_soft_cap,
      has_alibi=slopes is not None)
  call = DecodeCall(batch, q_len, num_heads, num_kv_heads, head_dim, capacity,
                    page_size, scale, spec)
  return call, (lengths, tables, slopes, sinks)


def _check_pages(tables, lengths, page_size: int, num_pages: int):
  """Page indices that a sequence reads must name a page of the cache
  (checked where the tables and lengths are concrete)."""
  values = validation._concrete_values(tables)
  if values is None or lengths is None:
    return
  used = np.arange(values.shape[1])[None, :] * page_size < lengths[:, None]
  bad = used & ((values < 0) | (values >= num_pages))
  if bad.any():
    b, j = np.argwhere(bad)[0]
    raise ValueError(
        f"block_tables[{b}, {j}] = {values[b, j]} is not a page of the cache "
        f"(num_pages {num_pages}), and sequence {b} reads it (length "
        f"{lengths[b]})")


# --- implementations ---------------------------------------------------------


def dense_view(key_cache, value_cache, lengths, tables=None):
  """The cache as dense [batch, capacity, num_kv_heads, head_dim] arrays with
  every entry at or past a sequence's length set to 0 (so that garbage,
  NaN included, cannot reach a result through 0 * NaN).

  Args:
    key_cache, value_cache: dense or paged, as `decode_attention` takes them.
    lengths: int32 [batch]; tables: int32 [batch, pages_per_seq] or None.

  XLA's path, the Flax layers' unfused fallback and the tests' oracle; it
  reads and writes the whole cache.
  """
  if tables is not None:
    pages = jnp.clip(tables, 0, key_cache.shape[0] - 1)
    gather = lambda cache: cache[pages].reshape(
        (tables.shape[0], tables.shape[1] * cache.shape[1]) + cache.shape[2:])
    key_cache, value_cache = gather(key_cache), gather(value_cache)
  valid = jnp.arange(key_cache.shape[1])[None, :] < lengths[:, None]
  valid = valid[:, :, None, None]
  clean = lambda cache: jnp.where(valid, cache, jnp.zeros((), cache.dtype))
  return clean(key_cache), clean(value_cache)


def _run_xla(call: DecodeCall, query, key_cache, value_cache, lengths, tables,
             slopes, **_):
  key, value = dense_view(key_cache, value_cache, lengths, tables)
  attention_call = validation.AttentionCall(
      validation.AttentionShape(call.batch, call.q_len, call.capacity,
                                call.num_heads, call.num_kv_heads,
                                call.head_dim),
      call.scale, call.spec,
      masking.Operands(q_offset=lengths - call.q_len, kv_lengths=lengths,
                       alibi_slopes=slopes))
  return reference.reference_attention(attention_call, query, key, value)


def _run_triton(call: DecodeCall, query, key_cache, value_cache, lengths,
                tables, slopes, *, interpret: bool):
  api.check_triton_device(call.head_dim, interpret)
  from pallas_kernels.triton import decode  # noqa: PLC0415
  return decode.flash_decode(
      query, key_cache, value_cache, lengths, tables, slopes,
      scale=call.scale, spec=call.spec, page_size=call.page_size,
      interpret=interpret)


def _run_mosaic(call: DecodeCall, *_, interpret: bool, **__):
  raise NotImplementedError(
      "decode_attention has no Mosaic kernel; the Triton kernel serves "
      "Hopper (decoding is bound by HBM bandwidth, not by wgmma)")


_IMPLEMENTATIONS = {"mosaic": _run_mosaic, "triton": _run_triton,
                    "xla": _run_xla}
