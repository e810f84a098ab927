"""KV-cache decoding for the drop-in modules: Flax's cache, or a paged one.

A module with `decode=True` keeps its cache in Flax's variables
(`cached_key`, `cached_value`, `cache_index`), so checkpoints, `init_cache`
and the linen `cache` collection stay Flax's. Each call appends the new
keys and values with `jax_flash.write_kv_cache` and attends with
`jax_flash.decode_attention`, which reads only the filled part of each
sequence's cache. Two extensions, both opt-in:

- Ragged batches: `cache_index` may be int32 [batch...] (a length per
  sequence) instead of Flax's scalar, and a call may carry right-padded
  inputs with `input_lengths` (prompts of different lengths in one prefill
  call); the index then advances by each sequence's own length, so the next
  call overwrites the padding.
- Paged: `cached_key`/`cached_value` are a pool of pages
  [num_pages, page_size, num_kv_heads, head_dim], and a fourth variable,
  `block_tables` int32 [batch..., pages_per_seq], says which page holds
  token t of a sequence (page `block_tables[b, t // page_size]`, row
  `t % page_size`; DESIGN.md section 2b). All four are ordinary cache
  variables: a serving engine that allocates pages itself replaces the pool
  and writes the tables (and `cache_index`) between calls; the layer only
  appends and reads.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp

import jax_flash
from jax_flash.decode import dense_view
from flax_layers.attention_fn import attend, flash_attention_fn, unfused_reason


def init_paged(batch_shape: tuple[int, ...], max_length: int,
               num_kv_heads: int, head_dim: int, page_size: int, dtype):
  """A paged cache in which sequence b owns pages b * pages_per_seq onwards.

  Args:
    batch_shape: the inputs' batch dims.
    max_length: positions each sequence can hold (rounded up to pages).
    num_kv_heads, head_dim: the key/value projections' shape.
    page_size: rows per page.
    dtype: the pages' dtype.

  Returns:
    (cached_key, cached_value, cache_index, block_tables): pages
    [batch * pages_per_seq, page_size, num_kv_heads, head_dim] each, zeros
    int32 [batch...], int32 [batch..., pages_per_seq].
  """
  if not isinstance(page_size, int) or page_size < 1:
    raise ValueError(f"page_size must be a positive int, got {page_size!r}")
  pages_per_seq = -(-max_length // page_size)
  num_pages = math.prod(batch_shape) * pages_per_seq
  pages = jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype)
  tables = jnp.arange(num_pages, dtype=jnp.int32).reshape(
      batch_shape + (pages_per_seq,))
  return pages, pages, jnp.zeros(batch_shape, jnp.int32), tables


def decode(attention_fn, query, key, value, *, cached_key, cached_value,
           cache_index, block_tables=None, input_lengths=None, mask=None,
           segment_ids=None, module=None, **flax_kwargs):
  """Appends `key`/`value` to the cache and attends `query` to it.

  Row i of sequence b sits at position `cache_index[b] + i` and attends to
  the cache up to it (causal among the new tokens).

  Args:
    attention_fn: the module's. `flash_attention_fn`, or a
      `functools.partial` of it binding `implementation`, `interpret` or
      `block_sizes`, decodes through `jax_flash.decode_attention`; any other
      function (or a call with a mask, segment ids, sowing or dropout) gets
      the cache as dense keys and values (zero past the lengths) with the
      positions as `q_offset`, as `attend` passes them.
    query: [batch..., q_len, num_heads, head_dim].
    key, value: [batch..., q_len, num_kv_heads, head_dim], the new entries.
    cached_key, cached_value: dense [batch..., max_len, num_kv_heads,
      head_dim] (Flax's), or pages [num_pages, page_size, num_kv_heads,
      head_dim] with `block_tables`.
    cache_index: int32 scalar (Flax's) or [batch...]: tokens already cached.
    block_tables: int32 [batch..., pages_per_seq] for a paged cache.
    input_lengths: int [batch...] (or a scalar): valid tokens of this call,
      the rest right padding; default q_len. The padding is written past
      the new length, where nothing reads it and the next call overwrites it.
    mask, segment_ids, module, **flax_kwargs: as `attend` takes them.

  Returns:
    (out [batch..., q_len, num_heads, head_dim], cached_key, cached_value,
    cache_index): the index advanced by `input_lengths` (or q_len); int32
    [batch...] when either was, else a scalar as Flax keeps it.
    Positions past the capacity are not written: callers stop there.
  """
  batch_shape, q_len = query.shape[:-3], query.shape[-3]
  batch = math.prod(batch_shape)
  _check_cache(key, cached_key, cached_value, block_tables, batch_shape)
  index = jnp.asarray(cache_index, jnp.int32)
  if index.shape not in ((), batch_shape):
    raise ValueError(f"cache_index must be a scalar or [batch...] = "
                     f"{batch_shape}, got shape {index.shape}")
  advance = q_len
  if input_lengths is not None:
    advance = jnp.asarray(input_lengths, jnp.int32)
    if advance.shape not in ((), batch_shape):
      raise ValueError(f"input_lengths must be a scalar or [batch...] = "
                       f"{batch_shape}, got shape {advance.shape}")

  def flat(x):  # jax_flash takes one batch dim; the reshapes are free
    return jnp.reshape(x, (batch,) + x.shape[len(batch_shape):])

  positions = flat(jnp.broadcast_to(index, batch_shape))
  if block_tables is None:
    tables, keys, values = None, flat(cached_key), flat(cached_value)
  else:
    tables, keys, values = flat(block_tables), cached_key, cached_value
  keys, values = jax_flash.write_kv_cache(keys, values, flat(key),
                                          flat(value), positions,
                                          block_tables=tables)
  lengths = positions + q_len

  dtype = flax_kwargs.get("dtype")
  dtype = jnp.result_type(query, keys) if dtype is None else dtype
  options = _decode_options(attention_fn)
  fused = options is not None and mask is None and segment_ids is None and (
      unfused_reason(dtype=keys.dtype, precision=flax_kwargs.get("precision"),
                     module=module,
                     dropout=(not flax_kwargs.get("deterministic", True)
                              and flax_kwargs.get("dropout_rate", 0.0) > 0),
                     broadcast_dropout=flax_kwargs.get("broadcast_dropout"),
                     einsums=(flax_kwargs.get("qk_attn_weights_einsum"),
                              flax_kwargs.get("attn_weights_value_einsum")))
      is None)
  if fused:
    # In the cache's dtype: the cache is what decoding reads, once.
    out = jax_flash.decode_attention(
        flat(query).astype(keys.dtype), keys, values, lengths,
        block_tables=tables, **options)
    out = jnp.reshape(out, query.shape).astype(dtype)
  else:
    dense_keys, dense_values = dense_view(keys, values, lengths, tables)
    unflat = lambda x: jnp.reshape(x, batch_shape + x.shape[1:])
    out = attend(attention_fn, query, unflat(dense_keys),
                 unflat(dense_values), mask=mask, is_causal=True,
                 q_offset=jnp.reshape(positions, batch_shape),
                 segment_ids=segment_ids, module=module, **flax_kwargs)
  if tables is None:
    keys, values = (jnp.reshape(x, cached_key.shape) for x in (keys, values))
  return out, keys, values, index + advance


def _check_cache(key, cached_key, cached_value, block_tables, batch_shape):
  entry = key.shape[-2:]
  if cached_value.shape != cached_key.shape or cached_key.shape[-2:] != entry:
    raise ValueError(
        f"decoding: new keys {key.shape} do not fit the cache "
        f"{cached_key.shape} / {cached_value.shape} (the same "
        "[..., num_kv_heads, head_dim] for keys, values and cache)")
  if block_tables is None:
    if (cached_key.shape[:-3] != batch_shape
        or key.shape[-3] > cached_key.shape[-3]):
      raise ValueError(
          f"decoding: new keys {key.shape} do not fit the cache "
          f"{cached_key.shape} ([batch..., max_len, kv_heads, head_dim])")
  elif cached_key.ndim != 4 or block_tables.shape[:-1] != batch_shape:
    raise ValueError(
        f"decoding: a paged cache is [num_pages, page_size, kv_heads, "
        f"head_dim] with block_tables [batch..., pages_per_seq]; got "
        f"{cached_key.shape} and {block_tables.shape} for batch dims "
        f"{batch_shape}")


def _decode_options(attention_fn) -> dict | None:
  """`decode_attention`'s options when `attention_fn` is
  `flash_attention_fn` with at most backend keywords bound, else None."""
  bound = {}
  while isinstance(attention_fn, functools.partial):
    if attention_fn.args:
      return None
    bound = {**attention_fn.keywords, **bound}
    attention_fn = attention_fn.func
  if attention_fn is not flash_attention_fn or not set(bound) <= {
      "implementation", "interpret", "block_sizes"}:
    return None
  # Block sizes are the training kernels'; decode_attention picks its own.
  return {k: v for k, v in bound.items() if k != "block_sizes"}
