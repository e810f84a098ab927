"""Sequence-parallel attention over a mesh axis: ring and all-gather.

When one sequence no longer fits one device, shard it on the sequence axis over
a mesh axis of P devices. Two strategies, both on JAX's own machinery
(`jax.sharding.Mesh`, `shard_map`, `lax.ppermute`, `lax.all_gather`; several
hosts work through `jax.distributed` like any other collective):

* ring (`ring_attention`; the default of `sequence_parallel_attention`): each
  device keeps its query shard and passes its K/V shard round the ring with
  `lax.ppermute`. At every step it runs `flash_attention(...,
  return_residual=True)` on the (query shard, K/V shard) pair it holds and
  merges the partial output into a running one by the log-sum-exp (`_merge`).
  The transfer of the next K/V shard is issued before the kernels of the
  current one, so the two overlap. Memory per device: its own shards, the K/V
  shard in hand and the next one in flight, a float32 output accumulator;
  never the whole K/V, never an N x N array. The backward (`jax.custom_vjp`)
  is a ring too: each pair's share of the gradient is the attention backward
  of the pair at the saved merged (out, lse) (`flash_attention_backward`:
  the backward kernels alone, no forward again), and float32 dK/dV sums go
  round the ring with K/V, so that each shard's sum reaches its owner. On
  one device the one pair's merged residuals are its own, so the ring costs
  what `flash_attention` costs, plus a few elementwise passes. (Running
  each other pair's forward again to get its own (out, lse) cost 14% of the
  kernels' time on 2 H200s, see benchmarks/NOTES.md.)
* all_gather: K/V gathered once per call (`lax.all_gather`) and the kernel
  run against the local query shard; the backward gathers again and
  reduce-scatters float32 dK/dV. Fewer, larger transfers: better on short
  rings and with few K/V heads (GQA), but every device holds the whole K/V.

Causal attention with contiguous shards: a K/V shard after the query shard is
skipped (`lax.cond`), the device's own shard is plain `is_causal=True` (equal
shard lengths) and earlier shards are full attention. Device P-1 then does
2P-1 times the work of device 0 and every ring step waits for it;
`load_balance=True` lays the sequence out zig-zag (device i holds chunks i and
2P-1-i of 2P), so that every device does half a pair's work at every step
(see `sequence_parallel_attention`).

Overlap on GPU. XLA overlaps the `ppermute`s with the kernels only when its
latency hiding scheduler is on::

    XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"

Collective-permutes are asynchronous by default; do not list
`collectivepermute` in `--xla_gpu_disable_async_collectives`. Profile-guided
latency estimation (`JAX_ENABLE_PGLE=yes`) gives the scheduler measured
costs. See JAX's "GPU performance tips" and NVIDIA JAX-Toolbox's GPU
performance page; flag names move between XLA versions (check
`xla/debug_options_flags.cc` of the jaxlib in use).

Variant arguments across shards: `segment_ids` (the K/V side travels with
K/V), `query_seq_lengths` and `key_value_seq_lengths` (global lengths, turned
into the valid prefix of each shard), `local_window_size` (positions passed as
`q_offset` per pair) and `logits_soft_cap` are forwarded to `flash_attention`;
`bias`, `mask`, `alibi_slopes`, `mask_fn`, `score_fn`, dropout and a user
`q_offset` are refused (they would need global positions inside the kernel).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jax_flash import higher_order, validation
from jax_flash.api import flash_attention
from jax_flash.residual_backward import flash_attention_backward

STRATEGIES = ("ring", "all_gather")

# Forwarded to every pair, unchanged.
_STATIC_KWARGS = ("local_window_size", "logits_soft_cap")
# Arrays that depend on which shard a pair covers; adjusted per pair.
_ARRAY_KWARGS = ("segment_ids", "query_seq_lengths", "key_value_seq_lengths")
# What `sequence_parallel_attention` checks on the global arrays.
_GLOBAL_CHECKS = _ARRAY_KWARGS + ("scale", "local_window_size",
                                  "logits_soft_cap")
# Need global positions inside the kernel (or are positions themselves).
_REFUSED_KWARGS = ("bias", "mask", "q_offset", "alibi_slopes", "mask_fn",
                   "score_fn", "dropout_rng")

# How the K/V shard of a pair sits relative to the query shard.
_FULL = "full"      # not causal: every pair is full attention
_DIAG = "diag"      # the device's own K/V shard (causal)
_BEFORE = "before"  # a K/V shard held by an earlier device (causal)
_AFTER = "after"    # a K/V shard held by a later device (causal)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static description of one sharded attention call (hashable)."""

  axis_name: Any
  num_shards: int
  strategy: str
  zigzag: bool          # shards hold chunks (i, 2P-1-i) of 2P, not chunk i of P
  is_causal: bool
  scale: float | None
  implementation: str | None
  block_sizes: Any
  interpret: bool | None
  local_window_size: Any = None
  logits_soft_cap: float | None = None

  @property
  def chunks_per_shard(self) -> int:
    return 2 if self.zigzag else 1

  @property
  def positional(self) -> bool:
    """Whether the kernel needs each pair's relative position (`q_offset`)."""
    return self.local_window_size is not None

  def chunk_starts(self, device, shard_len: int):
    """Global positions of the first token of each local chunk of `device`."""
    if not self.zigzag:
      return (device * shard_len,)
    chunk = shard_len // 2
    return (device * chunk, (2 * self.num_shards - 1 - device) * chunk)


# --------------------------------------------------------------------------
# Merging partial results.


def _rescale(lse_part, lse_total):
  """exp(lse_part - lse_total), 0 where either is -inf (never NaN)."""
  finite_total = jnp.where(jnp.isneginf(lse_total), 0.0, lse_total)
  return jnp.exp(lse_part - finite_total)


def _merge(out_a, lse_a, out_b, lse_b):
  """Merges two partial attention results over disjoint key sets.

  Args:
    out_a, out_b: float32 [batch, rows, heads, head_dim], each normalised over
      its own keys (0 for rows with none).
    lse_a, lse_b: float32 [batch, rows, heads], -inf for rows with no keys.

  Returns:
    (out, lse) over the union of the keys; rows empty in both give 0 and -inf.
  """
  lse = jnp.logaddexp(lse_a, lse_b)
  out = (_rescale(lse_a, lse)[..., None] * out_a
         + _rescale(lse_b, lse)[..., None] * out_b)
  return out, lse


def _set_rows(array, rows: slice, values):
  """`array.at[:, rows].set(values)` for a static slice of axis 1, without a
  scatter: XLA 0.11.2's SPMD partitioner crashes (segfault, CPU and GPU) on
  the scatters that `.at[]` makes inside this module's shard_map."""
  if rows == slice(None):
    return values
  return lax.dynamic_update_slice_in_dim(array, values, rows.start, axis=1)


def _add_rows(array, rows: slice, values):
  """`array.at[:, rows].add(values)` for a static slice of axis 1 (see
  `_set_rows`)."""
  if rows == slice(None):
    return array + values
  return _add_rows_at(array, rows.start, values)


def _add_rows_at(array, start, values):
  """Adds `values` to the rows of axis 1 from `start` (static or traced)."""
  rows = lax.dynamic_slice_in_dim(array, start, values.shape[1], axis=1)
  return lax.dynamic_update_slice_in_dim(array, rows + values, start, axis=1)


def _accumulate(acc, rows: slice, out, lse, num_rows: int):
  """Merges a kernel result for query rows `rows` into `acc`.

  `acc` is None before the first call; when that call covers every row it
  becomes the accumulator as is (no merge: one kernel call on one device
  costs what `flash_attention` costs).
  """
  out = out.astype(jnp.float32)
  if acc is None and rows == slice(None):
    return out, lse
  if acc is None:
    shape = out.shape[:1] + (num_rows,) + out.shape[2:]
    acc = (jnp.zeros(shape, jnp.float32),
           jnp.full(shape[:-1], -jnp.inf, jnp.float32))
  acc_out, acc_lse = acc
  if rows == slice(None):
    return _merge(acc_out, acc_lse, out, lse)
  merged_out, merged_lse = _merge(acc_out[:, rows], acc_lse[:, rows], out, lse)
  return (_set_rows(acc_out, rows, merged_out),
          _set_rows(acc_lse, rows, merged_lse))


# --------------------------------------------------------------------------
# The kernel calls of one (query shard, K/V shard) pair.


def _pair_calls(plan: _Plan, kind: str):
  """Kernel calls for a pair: a list of (q chunks, kv chunks, is_causal).

  Chunks are local chunk indices. With the zig-zag layout a shard is chunks
  (lo, hi) = (i, 2P-1-i); since positions grow along each shard, the causal
  mask of the device's own pair is plain top-left causal on the whole shard,
  an earlier device's pair is all queries against its `lo` chunk, and a later
  device's pair is the `hi` queries against its whole shard. Each is half the
  work of a full pair, on every device.

  With a window (positional) every call must cover one chunk on each side so
  that a single `q_offset` places it; causal masking then comes from the
  offset, so every call keeps the user's `is_causal`.
  """
  every = tuple(range(plan.chunks_per_shard))
  if kind == _FULL:
    calls = [(every, every, False)]
  elif kind == _DIAG:
    calls = [(every, every, True)]
  elif kind == _BEFORE:
    calls = [(every, (0,), False)]
  else:  # _AFTER
    calls = [((1,), every, False)] if plan.zigzag else []
  if not plan.positional:
    return calls
  return [((qc,), (kc,), plan.is_causal)
          for qs, ks, _ in calls for qc in qs for kc in ks
          # Within a shard chunk order is position order: a later chunk of
          # the device's own shard is entirely in the future.
          if not (kind == _DIAG and kc > qc)]


def _rows(chunks, chunk_len: int, num_chunks: int) -> slice:
  if len(chunks) == num_chunks:
    return slice(None)
  return slice(chunks[0] * chunk_len, (chunks[-1] + 1) * chunk_len)


def _valid_prefix(global_lengths, starts, chunk_len: int):
  """Valid (non-padding) tokens among chunks starting at `starts`.

  Right padding stays a prefix of every shard since positions grow along it.
  """
  return sum(jnp.clip(global_lengths - s, 0, chunk_len) for s in starts
             ).astype(jnp.int32)


def _call_kwargs(plan: _Plan, extras, *, q_starts, q_chunk_len, q_rows,
                 kv_starts, kv_chunk_len, kv_rows, kv_segment_ids, batch):
  """Keyword arguments of `flash_attention` for one call of a pair."""
  kwargs = {name: getattr(plan, name) for name in _STATIC_KWARGS
            if getattr(plan, name) is not None}
  if "q_segment_ids" in extras:
    kwargs["segment_ids"] = (extras["q_segment_ids"][:, q_rows],
                             kv_segment_ids[:, kv_rows])
  if "query_seq_lengths" in extras:
    kwargs["query_seq_lengths"] = _valid_prefix(
        extras["query_seq_lengths"], q_starts, q_chunk_len)
  if "key_value_seq_lengths" in extras:
    kwargs["key_value_seq_lengths"] = _valid_prefix(
        extras["key_value_seq_lengths"], kv_starts, kv_chunk_len)
  if plan.positional:
    kwargs["q_offset"] = jnp.full((batch,), q_starts[0] - kv_starts[0],
                                  jnp.int32)
  return kwargs


def _attend(plan: _Plan, is_causal: bool, kwargs, query, key, value):
  return flash_attention(
      query, key, value, scale=plan.scale, is_causal=is_causal,
      return_residual=True, implementation=plan.implementation,
      block_sizes=plan.block_sizes, interpret=plan.interpret, **kwargs)


def _attend_backward(plan: _Plan, is_causal: bool, kwargs, *args):
  return flash_attention_backward(
      *args, scale=plan.scale, is_causal=is_causal,
      implementation=plan.implementation, block_sizes=plan.block_sizes,
      interpret=plan.interpret, **kwargs)


def _each_call(plan: _Plan, kind: str, q, extras, kv, me, source):
  """Yields, per kernel call of the pair, (q rows, kv rows, fn, backward,
  q, k, v): `fn(q, k, v) -> (out, lse)` is `flash_attention` with the call's
  mask arguments, applied to the call's slices of the shards, and
  `backward(q, k, v, out, lse, d_out, d_lse) -> (dq, dk, dv)` its
  `flash_attention_backward`."""
  q_len, kv_len = q.shape[1], kv["key"].shape[1]
  n = plan.chunks_per_shard
  q_all, kv_all = plan.chunk_starts(me, q_len), plan.chunk_starts(source,
                                                                  kv_len)
  for q_chunks, kv_chunks, is_causal in _pair_calls(plan, kind):
    q_rows = _rows(q_chunks, q_len // n, n)
    kv_rows = _rows(kv_chunks, kv_len // n, n)
    kwargs = _call_kwargs(
        plan, extras, q_starts=[q_all[c] for c in q_chunks],
        q_chunk_len=q_len // n, q_rows=q_rows,
        kv_starts=[kv_all[c] for c in kv_chunks], kv_chunk_len=kv_len // n,
        kv_rows=kv_rows, kv_segment_ids=kv.get("kv_segment_ids"),
        batch=q.shape[0])
    fn = functools.partial(_attend, plan, is_causal, kwargs)
    backward = functools.partial(_attend_backward, plan, is_causal, kwargs)
    yield (q_rows, kv_rows, fn, backward, q[:, q_rows],
           kv["key"][:, kv_rows], kv["value"][:, kv_rows])


def _by_kind(plan: _Plan, s, me, source, run):
  """Runs `run(kind)` for the pair at ring step `s` (s = 0: the local shard).

  For causal attention at s > 0 whether the shard is before or after the
  query shard depends on the device, so it is a `lax.cond`.
  """
  if not plan.is_causal:
    return run(_FULL)
  if isinstance(s, int) and s == 0:
    return run(_DIAG)
  return lax.cond(source < me, lambda: run(_BEFORE), lambda: run(_AFTER))


# --------------------------------------------------------------------------
# Visiting every K/V shard: ring or gathered.


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _sweep(plan: _Plan, me, kv_local, carry, step):
  """Visits every K/V shard once: the local one (s = 0), then backwards round
  the ring, shard `source = (me - s) mod P` at step s.

  Args:
    kv_local: this device's K/V bundle {"key", "value", ["kv_segment_ids"]},
      each [batch, kv_len, ...].
    carry: state of this device (output accumulator, dQ).
    step: `(s, source, kv, carry) -> (carry, back)`; `back` (a pytree or
      None) is this device's contribution to arrays owned by `source` (dK,
      dV).

  Returns:
    (carry, the sum of every device's `back` for this device's shard).
  """
  p = plan.num_shards
  source_at = lambda s: lax.rem(me - s + p, p)
  if plan.strategy == "all_gather":
    return _gathered_sweep(plan, me, kv_local, carry, step, source_at)

  pairs = [(j, (j + 1) % p) for j in range(p)]
  send = lambda x: lax.ppermute(x, plan.axis_name, pairs)
  # Issued before step 0's kernels so that the transfer overlaps them.
  kv_next = send(kv_local) if p > 1 else None
  carry, back = step(0, me, kv_local, carry)
  if p == 1:
    return carry, back

  def ring_step(s, state, *, last=False):
    kv, carry, back = state
    # Both transfers are independent of this step's kernels and overlap them:
    # the next K/V shard, and the partial dK/dV sums of the shard held now
    # (accumulated by the previous devices of the ring).
    kv_next = None if last else send(kv)
    if back is not None:
      back = send(back)
    carry, contribution = step(s, source_at(s), kv, carry)
    if back is not None:
      back = _tree_add(back, contribution)
    return kv_next, carry, back

  state = lax.fori_loop(1, p - 1, ring_step, (kv_next, carry, back))
  _, carry, back = ring_step(p - 1, state, last=True)
  if back is not None:
    back = send(back)  # the complete sums, to the shard's owner
  return carry, back


def _gathered_sweep(plan: _Plan, me, kv_local, carry, step, source_at):
  """`_sweep` over K/V gathered once; `back` sums go through a gathered
  buffer, reduce-scattered to the owners at the end (the gather's
  transpose)."""
  p = plan.num_shards
  gathered = jax.tree.map(
      lambda x: lax.all_gather(x, plan.axis_name, axis=1, tiled=True),
      kv_local)
  shard_of = lambda src: jax.tree.map(
      lambda x: lax.dynamic_slice_in_dim(x, src * (x.shape[1] // p),
                                         x.shape[1] // p, axis=1), gathered)

  def add_at(buffers, src, parts):
    return jax.tree.map(
        lambda buffer, part: _add_rows_at(buffer, src * part.shape[1], part),
        buffers, parts)

  carry, back = step(0, me, kv_local, carry)
  if back is not None:
    back = add_at(jax.tree.map(lambda x: jnp.zeros(
        x.shape[:1] + (x.shape[1] * p,) + x.shape[2:], x.dtype), back),
                  me, back)

  def gathered_step(s, state):
    carry, back = state
    src = source_at(s)
    carry, contribution = step(s, src, shard_of(src), carry)
    if back is not None:
      back = add_at(back, src, contribution)
    return carry, back

  carry, back = lax.fori_loop(1, p, gathered_step, (carry, back))
  if back is not None:
    back = jax.tree.map(lambda x: lax.psum_scatter(
        x, plan.axis_name, scatter_dimension=1, tiled=True), back)
  return carry, back


# --------------------------------------------------------------------------
# Forward and backward sweeps, wired by custom_vjp.


def _kv_bundle(key, value, extras):
  kv = {"key": key, "value": value}
  if "kv_segment_ids" in extras:
    kv["kv_segment_ids"] = extras["kv_segment_ids"]
  return kv


def _forward(plan: _Plan, query, key, value, extras):
  """Output [batch, q_len, heads, dim] (query dtype), lse [batch, q_len, heads]."""
  me = lax.axis_index(plan.axis_name)

  def step(s, source, kv, acc):
    def run(kind):
      out = acc
      for q_rows, _, fn, _, q, k, v in _each_call(plan, kind, query, extras,
                                                  kv, me, source):
        out = _accumulate(out, q_rows, *fn(q, k, v), query.shape[1])
      return out

    return _by_kind(plan, s, me, source, run), None

  (out, lse), _ = _sweep(plan, me, _kv_bundle(key, value, extras), None, step)
  return out.astype(query.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sharded_attention(plan: _Plan, query, key, value, extras):
  return _forward(plan, query, key, value, extras)


def _sharded_attention_fwd(plan, query, key, value, extras):
  out, lse = _forward(plan, query, key, value, extras)
  return (out, lse), (query, key, value, extras, out, lse)


def _sharded_attention_bwd(plan, residuals, cotangents):
  """Per pair, the attention backward with the pair's share of the gradient.

  Pair j gave (o_j, lse_j); the result is O = sum_j exp(lse_j - L) o_j with
  L = logsumexp_j lse_j. The pair's logits s_j enter the merged softmax with
  weights P_j = exp(s_j - L), so its share of the gradient is the attention
  backward of the pair at the merged residuals (O, L) and cotangents
  (dO, dL) (`flash_attention_backward`): the backward kernels alone, no
  forward again. On one device the one pair's merged residuals are its own,
  so this is `flash_attention`'s own backward.
  """
  query, key, value, extras, out, lse = residuals
  d_out, d_lse = cotangents
  me = lax.axis_index(plan.axis_name)
  f32 = lambda x: x.astype(jnp.float32)

  def step(s, source, kv, d_query):
    def run(kind):
      dq = d_query
      dk, dv = jnp.zeros_like(kv["key"], jnp.float32), jnp.zeros_like(
          kv["value"], jnp.float32)
      for q_rows, kv_rows, _, backward, q, k, v in _each_call(
          plan, kind, query, extras, kv, me, source):
        dq_j, dk_j, dv_j = backward(q, k, v, out[:, q_rows], lse[:, q_rows],
                                    d_out[:, q_rows], d_lse[:, q_rows])
        dq = _add_rows(dq, q_rows, f32(dq_j))
        dk = _add_rows(dk, kv_rows, f32(dk_j))
        dv = _add_rows(dv, kv_rows, f32(dv_j))
      return dq, (dk, dv)

    return _by_kind(plan, s, me, source, run)

  dq, (dk, dv) = _sweep(plan, me, _kv_bundle(key, value, extras),
                        jnp.zeros_like(query, jnp.float32), step)
  no_grad = jax.tree.map(lambda _: None, extras)
  return (dq.astype(query.dtype), dk.astype(key.dtype),
          dv.astype(value.dtype), no_grad)


_sharded_attention.defvjp(_sharded_attention_fwd, _sharded_attention_bwd)


# --------------------------------------------------------------------------
# Public entry points.


def _split_kwargs(attention_kwargs):
  """(return_residual, static kwargs, array kwargs) of the variant arguments."""
  kwargs = dict(attention_kwargs)
  return_residual = kwargs.pop("return_residual", False)
  dropout_rate = kwargs.pop("dropout_rate", 0.0)
  if dropout_rate:
    raise NotImplementedError(
        "dropout is not supported by sequence-parallel attention (the mask "
        "hash needs global positions)")
  for name in _REFUSED_KWARGS:
    if kwargs.pop(name, None) is not None:
      raise NotImplementedError(
          f"{name} is not supported by sequence-parallel attention; supported "
          f"variant arguments: {_STATIC_KWARGS + _ARRAY_KWARGS}")
  statics = {n: kwargs.pop(n) for n in _STATIC_KWARGS if n in kwargs}
  arrays = {n: kwargs.pop(n) for n in _ARRAY_KWARGS
            if kwargs.get(n) is not None}
  for n in _ARRAY_KWARGS:
    kwargs.pop(n, None)
  if kwargs:
    raise TypeError(f"unexpected keyword arguments: {sorted(kwargs)}")
  return return_residual, statics, arrays


def _extras(arrays):
  """Array kwargs in the internal form: segment ids split into q and kv."""
  extras = {k: v for k, v in arrays.items() if k != "segment_ids"}
  if "segment_ids" in arrays:
    ids = arrays["segment_ids"]
    q_ids, kv_ids = ids if isinstance(ids, (tuple, list)) else (ids, ids)
    extras["q_segment_ids"] = q_ids
    extras["kv_segment_ids"] = kv_ids
  return extras


def _local_attention(query, key, value, *, axis_name, strategy: str,
                     zigzag: bool, is_causal: bool, scale, implementation,
                     block_sizes, interpret, attention_kwargs):
  """Attention of local shards inside a `shard_map` over `axis_name`."""
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
  return_residual, statics, arrays = _split_kwargs(attention_kwargs)
  if query.ndim != 4 or key.ndim != 4:
    raise ValueError(
        "query and key must be [batch, seq_len, num_heads, head_dim] shards, "
        f"got query {tuple(query.shape)}, key {tuple(key.shape)}")
  q_len, kv_len = query.shape[1], key.shape[1]
  if is_causal and q_len != kv_len:
    raise ValueError(
        "causal sequence-parallel attention needs query and key shards of "
        f"the same length, got query {tuple(query.shape)}, key "
        f"{tuple(key.shape)}")
  if zigzag and (q_len % 2 or kv_len % 2):
    raise ValueError(
        "the zig-zag layout (load_balance=True) needs shards of even length "
        f"(two chunks each), got query {tuple(query.shape)}, key "
        f"{tuple(key.shape)}")
  plan = _Plan(axis_name=axis_name, num_shards=lax.axis_size(axis_name),
               strategy=strategy, zigzag=zigzag, is_causal=is_causal,
               scale=scale, implementation=implementation,
               block_sizes=block_sizes, interpret=interpret, **statics)
  extras = _extras(arrays)
  if strategy == "all_gather" and not is_causal and not zigzag:
    out, lse = _gathered_full_attention(plan, query, key, value, extras)
  else:
    # Second-order derivatives by autodiff of the same sweeps on XLA (the
    # kernels' backward cannot be differentiated again; `higher_order`).
    on_xla = dataclasses.replace(plan, implementation="xla")
    out, lse = higher_order.with_reference_derivatives(
        lambda qkv, extras: _sharded_attention(plan, *qkv, extras),
        lambda qkv, extras: _forward(on_xla, *qkv, extras),
        (query, key, value), extras)
  return (out, lse) if return_residual else out


def _gathered_full_attention(plan: _Plan, query, key, value, extras):
  """Non-causal all-gather: one kernel call against the whole K/V.

  Plain autodiff: the transpose of the gather is a reduce-scatter of dK/dV.
  """
  gather = lambda x: lax.all_gather(x, plan.axis_name, axis=1, tiled=True)
  me = lax.axis_index(plan.axis_name)
  k, v = gather(key), gather(value)
  kwargs = _call_kwargs(
      plan, extras, q_starts=plan.chunk_starts(me, query.shape[1]),
      q_chunk_len=query.shape[1], q_rows=slice(None), kv_starts=(0,),
      kv_chunk_len=k.shape[1], kv_rows=slice(None),
      kv_segment_ids=(gather(extras["kv_segment_ids"])
                      if "kv_segment_ids" in extras else None),
      batch=query.shape[0])
  return _attend(plan, False, kwargs, query, k, v)


def ring_attention(query, key, value, *, axis_name, is_causal=False,
                   scale=None, implementation=None, block_sizes=None,
                   interpret=None, load_balance=False, **attention_kwargs):
  """Ring attention of local sequence shards, inside a `shard_map`.

  Call it inside your own `shard_map` (or `pmap`) over the mesh axis
  `axis_name` of P devices, on the local shards of a sequence split on that
  axis. Device i holds tokens [i * S, (i + 1) * S) (contiguous layout) or, with
  `load_balance=True`, chunks i and 2P-1-i of 2P chunks of S/2 tokens
  (zig-zag; lay out your tokens that way once, at the input, with
  `zigzag_indices`, and attention needs no reordering at all).

  Args:
    query: local shard [batch, S, num_heads, head_dim].
    key, value: local shards [batch, S_kv, num_kv_heads, head_dim]; GQA as in
      `flash_attention`. Causal attention needs S_kv == S.
    axis_name: the mesh axis the sequence is split over.
    is_causal: causal on the global sequence (top-left aligned).
    scale, implementation, block_sizes, interpret: as `flash_attention`, for
      every pair.
    load_balance: the shards are in the zig-zag layout (see above).
    **attention_kwargs: `return_residual` and the variant arguments that make
      sense across shards, with global meaning: `segment_ids` (local shards,
      [batch, S] or a (q_ids, kv_ids) pair), `query_seq_lengths` and
      `key_value_seq_lengths` (global lengths, int32 [batch]),
      `local_window_size`, `logits_soft_cap`.

  Returns:
    The local output shard [batch, S, num_heads, head_dim] in query's dtype,
    or (out, lse) with `return_residual=True` (lse float32 [batch, S,
    num_heads], -inf for rows with nothing to attend): exactly the rows of
    `flash_attention` on the global sequence.
  """
  return _local_attention(
      query, key, value, axis_name=axis_name, strategy="ring",
      zigzag=load_balance, is_causal=is_causal, scale=scale,
      implementation=implementation, block_sizes=block_sizes,
      interpret=interpret, attention_kwargs=attention_kwargs)


def zigzag_indices(seq_len: int, num_shards: int):
  """Token order of the zig-zag layout: `x[:, zigzag_indices(T, P)]` split
  into P contiguous shards gives device i chunks i and 2P-1-i of 2P."""
  if seq_len % (2 * num_shards):
    raise ValueError(f"the zig-zag layout needs seq_len ({seq_len}) divisible"
                     f" by 2 * num_shards ({2 * num_shards})")
  chunk = seq_len // (2 * num_shards)
  order = []
  for i in range(num_shards):
    for c in (i, 2 * num_shards - 1 - i):
      order.extend(range(c * chunk, (c + 1) * chunk))
  return jnp.asarray(order, jnp.int32)


def _zigzag_moves(num_shards: int):
  """ppermute pairs that move the even and the odd chunk of every device.

  Contiguous (2P chunks): device e holds chunks 2e, 2e+1. Zig-zag: device d
  holds d, 2P-1-d. Every device sends its even chunk with one permutation and
  its odd chunk with another; each is a bijection (even chunks < P go to even
  devices, even chunks >= P to odd ones, and vice versa).
  """
  p = num_shards
  owner = lambda c: c if c < p else 2 * p - 1 - c
  return ([(e, owner(2 * e)) for e in range(p)],
          [(e, owner(2 * e + 1)) for e in range(p)])


def _to_zigzag(x, axis_name, num_shards: int):
  """Contiguous shard [batch, 2C, ...] -> zig-zag shard, inside shard_map."""
  even, odd = _zigzag_moves(num_shards)
  c = x.shape[1] // 2
  got_even = lax.ppermute(x[:, :c], axis_name, even)
  got_odd = lax.ppermute(x[:, c:], axis_name, odd)
  # Device d's first chunk is d: the even one when d is even.
  d_even = lax.axis_index(axis_name) % 2 == 0
  return jnp.concatenate([jnp.where(d_even, got_even, got_odd),
                          jnp.where(d_even, got_odd, got_even)], axis=1)


def _from_zigzag(x, axis_name, num_shards: int):
  """Inverse of `_to_zigzag`."""
  even, odd = _zigzag_moves(num_shards)
  c = x.shape[1] // 2
  d_even = lax.axis_index(axis_name) % 2 == 0
  lo, hi = x[:, :c], x[:, c:]
  back_even = lax.ppermute(jnp.where(d_even, lo, hi), axis_name,
                           [(b, a) for a, b in even])
  back_odd = lax.ppermute(jnp.where(d_even, hi, lo), axis_name,
                          [(b, a) for a, b in odd])
  return jnp.concatenate([back_even, back_odd], axis=1)


def _place(x, mesh, spec):
  """Reshards `x` to `spec` where the mesh axes are Explicit.

  shard_map takes inputs of an Auto mesh as they come, but insists that an
  Explicit mesh's inputs already carry `in_specs`.
  """
  axes = [a for a in spec if a is not None]
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if axes and all(types[a] == jax.sharding.AxisType.Explicit for a in axes):
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
  return x


def sequence_parallel_attention(query, key, value, *, mesh, axis_name,
                                strategy="ring", load_balance=True,
                                **attention_kwargs):
  """`flash_attention` on global arrays, computed sequence-parallel.

  Splits the sequence axis over the mesh axis `axis_name` (P devices) with
  `shard_map` and runs the ring (default) or the all-gather strategy. Inputs
  and outputs are global arrays in natural order, sharded or not; the
  result equals single-device `flash_attention` (up to float rounding of the
  merge). Other mesh axes replicate this call; to shard the batch as well,
  call `ring_attention` inside your own `shard_map`.

  Load balance (causal only). With `load_balance=True` the sequence is laid
  out zig-zag: device i holds chunks i and 2P-1-i of 2P, so every device does
  the same work at every ring step (contiguous shards leave device 0 idle for
  most of the ring: about 2x speed-up for large P). The reordering happens
  here, inside the `shard_map`: query, key, value (and segment ids) go from
  contiguous to zig-zag shards by two `lax.ppermute`s each, and the output
  (and lse) back by two more; every device sends and receives one shard of
  each array, about 1/P of the ring's K/V traffic, with no gather of the
  global array. A model that lays its tokens out zig-zag once at the input
  (`zigzag_indices`) avoids this cost with `ring_attention(...,
  load_balance=True)`. Non-causal calls keep the contiguous layout.

  Args:
    query: [batch, seq_len, num_heads, head_dim].
    key, value: [batch, kv_len, num_kv_heads, head_dim]; kv_len == seq_len
      when causal. Both lengths divisible by P (by 2P with the zig-zag
      layout).
    mesh: a `jax.sharding.Mesh` with axis `axis_name`.
    axis_name: the mesh axis to split the sequence over.
    strategy: "ring" (K/V shards passed round the ring; memory per device
      falls as 1/P) or "all_gather" (K/V gathered once per call; fewer,
      larger transfers; better on short rings and with few K/V heads).
    load_balance: zig-zag layout for causal attention (see above).
    **attention_kwargs: as `ring_attention` (`is_causal`, `scale`,
      `implementation`, `block_sizes`, `interpret`, `return_residual`,
      `segment_ids` as global [batch, seq_len] arrays or a pair,
      `query_seq_lengths`, `key_value_seq_lengths`, `local_window_size`,
      `logits_soft_cap`).

  Returns:
    out [batch, seq_len, num_heads, head_dim], or (out, lse) with
    `return_residual=True`.
  """
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh "
                     f"(its axes: {tuple(mesh.shape)})")
  num_shards = mesh.shape[axis_name]
  is_causal = attention_kwargs.pop("is_causal", False)
  # The global call's checks, before shard_map: inside it the lengths are
  # traced (no range check) and the shapes are the shards'.
  validation.normalise_call(query, key, value, is_causal=is_causal, **{
      name: attention_kwargs[name] for name in _GLOBAL_CHECKS
      if attention_kwargs.get(name) is not None})
  zigzag = bool(load_balance and is_causal and num_shards > 1)
  parts = 2 * num_shards if zigzag else num_shards
  for name, x in (("query", query), ("key", key)):
    if x.ndim != 4 or x.shape[1] % parts:
      raise ValueError(
          f"{name} must be [batch, seq_len, heads, head_dim] with seq_len "
          f"divisible by {parts} ({num_shards} devices on axis {axis_name!r}"
          f"{', zig-zag chunks' if zigzag else ''}), got {tuple(x.shape)}")
  kernel_kwargs = {k: attention_kwargs.pop(k, None) for k in
                   ("scale", "implementation", "block_sizes", "interpret")}
  return_residual = attention_kwargs.get("return_residual", False)
  arrays = {n: attention_kwargs.pop(n) for n in _ARRAY_KWARGS
            if attention_kwargs.get(n) is not None}

  seq = PartitionSpec(None, axis_name)
  heads = PartitionSpec(None, axis_name, None, None)
  rows = PartitionSpec(None, axis_name, None)
  specs = {"query": heads, "key": heads, "value": heads}
  inputs = {"query": query, "key": key, "value": value}
  for name, x in arrays.items():
    if name == "segment_ids":
      specs[name] = jax.tree.map(lambda _: seq, x)
    else:  # global lengths: the same on every device
      specs[name] = PartitionSpec()
    inputs[name] = x
  inputs = jax.tree.map(lambda x, s: _place(x, mesh, s), inputs, specs)

  def local(inputs):
    inputs = dict(inputs)
    if zigzag:
      to_zz = lambda x: _to_zigzag(x, axis_name, num_shards)
      for name in ("query", "key", "value", "segment_ids"):
        if name in inputs:
          inputs[name] = jax.tree.map(to_zz, inputs[name])
    q, k, v = inputs.pop("query"), inputs.pop("key"), inputs.pop("value")
    result = _local_attention(
        q, k, v, axis_name=axis_name, strategy=strategy, zigzag=zigzag,
        is_causal=is_causal, attention_kwargs={**attention_kwargs, **inputs},
        **kernel_kwargs)
    if zigzag:
      result = jax.tree.map(lambda x: _from_zigzag(x, axis_name, num_shards),
                            result)
    return result

  out_specs = (heads, rows) if return_residual else heads
  return jax.shard_map(local, mesh=mesh, in_specs=(specs,),
                       out_specs=out_specs)(inputs)
