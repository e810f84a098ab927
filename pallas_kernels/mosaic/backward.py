"""FlashAttention-2 backward for Hopper (sm90) in Pallas Mosaic GPU.

Recomputing backward (FlashAttention-2, Dao 2023, §3.2): nothing N x N is
stored; each kernel recomputes P = exp(scale * Q Kᵀ - lse) from Q, K and the
forward's LSE. Two kernels, so that every output is written by exactly one
CTA, in a fixed order (deterministic, no atomics):

  dK/dV  grid (kv_tile, kv_head, batch). Each consumer warpgroup owns
         `block_kv` rows of K and V, resident in shared memory, and loops
         over the Q tiles of every query head of its GQA group, summing in
         order:  Sᵀ = K Qᵀ,  dPᵀ = V dOᵀ,  dV += Pᵀ dO,  dK += dSᵀ Q.
  dQ     grid (q_tile, head, batch). Each consumer owns `block_q` rows of Q
         and dO and loops over K/V tiles:  S = Q Kᵀ,  dP = dO Vᵀ,  dQ += dS K.

with dS = P ∘ (dP - delta) and delta = rowsum(dO ∘ O) (less the cotangent of
the LSE, when there is one), computed outside the kernels. Every matmul is
a `wgmma` (transposes are free: they are views of the swizzled shared-memory
tiles). The scale of dS is applied once, to the finished dK and dQ.

Warp specialisation as in the forward (FlashAttention-3, Shah et al. 2024,
§3.1): `num_consumers` (1 or 2) compute warpgroups, and one producer
warpgroup that streams the loop's tiles by TMA into a ring of `num_stages`
shared-memory slots. Barriers per ring slot:

  <tile>_arrived[s]   TMA completion, one per streamed tensor (producer ->
                      consumers)
  consumed[s]         every consumer is done with slot s (-> producer);
                      `num_consumers` arrivals

Every consumer walks every streamed step, also the steps its rows do not
need under causal masking (it waits for the tiles and releases them at
once): Mosaic tracks each barrier's phase per thread, so a consumer that
skipped a phase would wait on the wrong parity afterwards.

When the two f32 accumulators dK and dV of a consumer do not fit its
registers (head_dim 256: 2 * 64 x 256 f32 is 256 registers per thread), the
dK/dV kernel runs twice, once per output; the dV pass then skips dPᵀ.

Causal (top-left aligned, as `jax.nn.dot_product_attention`): query i
attends keys j <= i. Tiles wholly above the diagonal are left out of the
loop bounds; only tiles that straddle it are masked.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic import compat
from pallas_kernels.mosaic.forward import (
    _CONSUMER_REGISTERS, _PRODUCER_REGISTERS, _SMEM_LIMIT_BYTES,
    _LOG2E, _SUPPORTED_DTYPES, _SUPPORTED_HEAD_DIMS, _SWIZZLE_BYTES,
    _TILE_MULTIPLE, _causal_mask, _cols, _rows, tile_index)

_MAX_CONSUMERS = 2
# f32 registers per consumer thread that the wgmma accumulators (the
# [rows, head_dim] dK/dV or dQ sums and the [rows, cols] S and dP tiles) may
# take of `_CONSUMER_REGISTERS`; the rest holds P and dS in 16 bits, the
# softmax statistics and addresses. A [m, n] f32 accumulator of one
# warpgroup is m * n / 128 registers per thread.
_ACCUMULATOR_REGISTERS = 192
_THREADS_PER_WARPGROUP = 128


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything a kernel body needs that is known at trace time."""
  block_q: int
  block_kv: int
  num_consumers: int
  num_stages: int
  num_q_blocks: int
  num_kv_blocks: int
  head_dim: int
  group: int             # query heads per K/V head (GQA)
  scale: float
  scale_log2: float      # scale * log2(e): scores enter exp2 directly
  is_causal: bool
  dtype: jnp.dtype
  outputs: tuple[str, ...]  # dK/dV kernel: ("dk", "dv"), ("dk",) or ("dv",)
  # dQ kernel, causal: launch the tiles with the most K/V blocks first
  # (`forward.tile_index`). The dK/dV kernel's K/V tile j reads the Q blocks
  # from j on, so its grid order is heaviest first already.
  heavy_first: bool = True


def mosaic_backward(query, key, value, out, lse, d_out, d_lse=None, *,
                    scale: float, is_causal: bool, block_q: int = 64,
                    block_kv: int = 64, max_concurrent_steps: int = 2,
                    heavy_first: bool = True):
  """Gradients of `mosaic_forward`'s output with respect to q, k and v.

  Args:
    query: [batch, q_len, num_heads, head_dim], bfloat16 or float16.
    key, value: [batch, kv_len, num_kv_heads, head_dim], same dtype;
      num_heads % num_kv_heads == 0 (query head h reads K/V head
      h // (num_heads // num_kv_heads)).
    out: the forward's output, like query.
    lse: float32 [batch, num_heads, q_len], the forward's natural-log
      logsumexp; -inf marks a row that attends to nothing (its gradients
      are zero).
    d_out: the cotangent of out, like query.
    d_lse: the cotangent of lse, like lse, or None (zero). Since
      d lse / d s = P, it only shifts delta: dS = P ∘ (dP - delta + d_lse).
    scale: multiplies q·k in the forward.
    is_causal: top-left aligned, query i attends keys j <= i (as
      `forward.mosaic_forward`, whose docstring draws it).

    block_q: Q rows per tile: per consumer warpgroup in the dQ kernel, per
      streamed step in the dK/dV kernel.
    block_kv: K/V rows per tile: per consumer warpgroup in the dK/dV kernel,
      per streamed step in the dQ kernel.
    max_concurrent_steps: depth of the TMA ring of both kernels.
    heavy_first: under causal masking, launch the dQ kernel's query tiles
      with the most K/V blocks first; False launches them in order.

  Returns:
    (dq, dk, dv), shaped and typed like (query, key, value).

  Raises:
    NotImplementedError: for calls these kernels do not cover (dtype, head
      dim, lengths not multiples of the tiles, tiles that do not fit in
      shared memory or registers), so that a dispatcher falls back.
  """
  _check_supported(query, key, value, out, lse, d_out, d_lse,
                   block_q=block_q, block_kv=block_kv,
                   max_concurrent_steps=max_concurrent_steps)
  tiles = dict(scale=scale, is_causal=is_causal, block_q=block_q,
               block_kv=block_kv, max_concurrent_steps=max_concurrent_steps)
  # Planning raises for tiles that do not fit, before any work is traced.
  dq_plan = dataclasses.replace(_plan_dq(query, key, **tiles),
                                heavy_first=bool(heavy_first))
  dkdv_plans = _plan_dkdv(query, key, **tiles)
  stats = _row_statistics(out, lse, d_out, d_lse)
  dq = _dq_call(query, key, value, d_out, stats, dq_plan)
  grads = {}
  for static in dkdv_plans:
    grads.update(zip(static.outputs,
                     _dkdv_call(query, key, value, d_out, stats, static)))
  return dq, grads["dk"], grads["dv"]


def _check_supported(query, key, value, out, lse, d_out, d_lse, *, block_q,
                     block_kv, max_concurrent_steps):
  """Validates shapes (ValueError/TypeError) and coverage (NotImplemented)."""
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError("query, key and value must be [batch, len, heads, dim]; "
                     f"got {query.shape}, {key.shape}, {value.shape}")
  batch, q_len, num_heads, head_dim = query.shape
  kv_shape = (batch, key.shape[1], key.shape[2], head_dim)
  if key.shape != kv_shape or value.shape != kv_shape:
    raise ValueError(f"key and value must both be {kv_shape} for query "
                     f"{query.shape}; got {key.shape}, {value.shape}")
  if out.shape != query.shape or d_out.shape != query.shape:
    raise ValueError(f"out and d_out must be {query.shape} like query; got "
                     f"{out.shape}, {d_out.shape}")
  if lse.shape != (batch, num_heads, q_len):
    raise ValueError(f"lse must be [batch, num_heads, q_len] = "
                     f"{(batch, num_heads, q_len)}; got {lse.shape}")
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads {num_heads} is not a multiple of "
                     f"num_kv_heads {num_kv_heads}")
  dtype = jnp.dtype(query.dtype)
  if any(x.dtype != dtype for x in (key, value, out, d_out)):
    raise TypeError("query, key, value, out and d_out must share a dtype; "
                    f"got {query.dtype}, {key.dtype}, {value.dtype}, "
                    f"{out.dtype}, {d_out.dtype}")
  if d_lse is not None and d_lse.shape != lse.shape:
    raise ValueError(f"d_lse must be {lse.shape} like lse; got {d_lse.shape}")
  if lse.dtype != jnp.float32:
    raise TypeError(f"lse must be float32, got {lse.dtype}")
  if dtype not in _SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"mosaic_backward supports bfloat16 and float16, got {dtype}")
  if head_dim not in _SUPPORTED_HEAD_DIMS:
    raise NotImplementedError(f"mosaic_backward supports head_dim in "
                              f"{_SUPPORTED_HEAD_DIMS}, got {head_dim}")
  if block_q % _TILE_MULTIPLE or block_kv % _TILE_MULTIPLE:
    raise NotImplementedError(f"block_q {block_q} and block_kv {block_kv} "
                              f"must be multiples of {_TILE_MULTIPLE}")
  if q_len % block_q:
    raise NotImplementedError(f"q_len {q_len} must be a multiple of block_q "
                              f"{block_q} (tails are not masked yet)")
  if kv_len % block_kv:
    raise NotImplementedError(f"kv_len {kv_len} must be a multiple of "
                              f"block_kv {block_kv} (tails are not masked yet)")
  if max_concurrent_steps < 1:
    raise ValueError(
        f"max_concurrent_steps must be >= 1, got {max_concurrent_steps}")


def _row_statistics(out, lse, d_out, d_lse):
  """float32 [batch, num_heads, 2, q_len]: (lse in base 2, delta) per row.

  delta = rowsum(dO ∘ O) - d_lse (FlashAttention-2 §3.2), the product and
  sum elementwise: an einsum would become a TF32 matmul on the GPU. An
  empty row (lse = -inf) gets +inf, so that P = exp2(s - lse) is 0 there,
  not inf. Stacked, so that a tile of both is one TMA.
  """
  delta = jnp.transpose(
      jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1),
      (0, 2, 1))
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  lse_log2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * _LOG2E)
  return jnp.stack([lse_log2, delta], axis=2)


def _accumulator_registers(*shapes) -> int:
  """Registers per thread that f32 wgmma accumulators of `shapes` take."""
  return sum(m * n for m, n in shapes) // _THREADS_PER_WARPGROUP


def _smem_bytes(*, num_consumers, num_stages, resident_rows, streamed_rows,
                head_dim, itemsize, resident_stats, streamed_stats) -> int:
  """Shared memory of either kernel.

  Each consumer keeps two [resident_rows, head_dim] tiles (K and V, or Q and
  dO); each ring slot holds two [streamed_rows, head_dim] tiles. The row
  statistics (lse, delta) are f32 pairs for the Q rows, resident or
  streamed.
  """
  tiles = (num_consumers * 2 * resident_rows
           + num_stages * 2 * streamed_rows) * head_dim * itemsize
  stats = (num_consumers * resident_stats + num_stages * streamed_stats) * 2 * 4
  return tiles + stats


def _num_consumers(length, block, smem_of) -> int:
  """Two consumer warpgroups if the length splits and shared memory allows.

  Two consumers share every streamed tile, halving that traffic; at
  head_dim 256 their resident tiles leave no room for a ring.
  """
  for consumers in (_MAX_CONSUMERS, 1):
    if length % (consumers * block) == 0 and (
        smem_of(consumers) <= _SMEM_LIMIT_BYTES):
      return consumers
  raise NotImplementedError(
      f"the backward tiles need {smem_of(1)} bytes of shared memory even "
      f"with one consumer; sm90 has {_SMEM_LIMIT_BYTES}")


def _plan_dq(query, key, *, scale, is_causal, block_q, block_kv,
             max_concurrent_steps) -> _Static:
  _, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  registers = _accumulator_registers((block_q, head_dim),
                                     (block_q, block_kv), (block_q, block_kv))
  if registers > _ACCUMULATOR_REGISTERS:
    raise NotImplementedError(
        f"dQ with block_q {block_q}, block_kv {block_kv} at head_dim "
        f"{head_dim} needs {registers} accumulator registers per thread; "
        f"at most {_ACCUMULATOR_REGISTERS} fit")
  num_kv_blocks = kv_len // block_kv
  stages = min(max_concurrent_steps, num_kv_blocks)
  smem_of = lambda consumers: _smem_bytes(
      num_consumers=consumers, num_stages=stages, resident_rows=block_q,
      streamed_rows=block_kv, head_dim=head_dim,
      itemsize=jnp.dtype(query.dtype).itemsize, resident_stats=block_q,
      streamed_stats=0)
  return _Static(
      block_q=block_q, block_kv=block_kv,
      num_consumers=_num_consumers(q_len, block_q, smem_of),
      num_stages=stages, num_q_blocks=q_len // block_q,
      num_kv_blocks=num_kv_blocks, head_dim=head_dim,
      group=num_heads // num_kv_heads, scale=float(scale),
      scale_log2=float(scale) * _LOG2E, is_causal=bool(is_causal),
      dtype=jnp.dtype(query.dtype), outputs=("dq",))


def _plan_dkdv(query, key, *, scale, is_causal, block_q, block_kv,
               max_concurrent_steps) -> list[_Static]:
  """One pass computing dK and dV, or one pass each if registers demand."""
  _, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  scores = (block_kv, block_q)
  per_output = (block_kv, head_dim)
  if _accumulator_registers(per_output, per_output, scores, scores) <= (
      _ACCUMULATOR_REGISTERS):
    passes = [("dk", "dv")]
  else:
    registers = _accumulator_registers(per_output, scores, scores)
    if registers > _ACCUMULATOR_REGISTERS:
      raise NotImplementedError(
          f"dK/dV with block_q {block_q}, block_kv {block_kv} at head_dim "
          f"{head_dim} needs {registers} accumulator registers per thread "
          f"even one output at a time; at most {_ACCUMULATOR_REGISTERS} fit")
    passes = [("dk",), ("dv",)]
  group = num_heads // num_kv_heads
  num_q_blocks = q_len // block_q
  stages = min(max_concurrent_steps, group * num_q_blocks)
  smem_of = lambda consumers: _smem_bytes(
      num_consumers=consumers, num_stages=stages, resident_rows=block_kv,
      streamed_rows=block_q, head_dim=head_dim,
      itemsize=jnp.dtype(query.dtype).itemsize, resident_stats=0,
      streamed_stats=block_q)
  consumers = _num_consumers(kv_len, block_kv, smem_of)
  return [
      _Static(block_q=block_q, block_kv=block_kv, num_consumers=consumers,
              num_stages=stages, num_q_blocks=num_q_blocks,
              num_kv_blocks=kv_len // block_kv, head_dim=head_dim,
              group=group, scale=float(scale),
              scale_log2=float(scale) * _LOG2E, is_causal=bool(is_causal),
              dtype=jnp.dtype(query.dtype), outputs=outputs)
      for outputs in passes]


def _tile_transforms(dtype):
  """128-byte swizzle with 8-row tiles: what TMA writes and wgmma reads
  without bank conflicts."""
  swizzle_elems = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)),
          plgpu.SwizzleTransform(_SWIZZLE_BYTES))


# ---------------------------------------------------------------------------
# dK/dV kernel.


def _dkdv_call(query, key, value, d_out, stats, static: _Static):
  """Launches the dK/dV kernel for `static.outputs`; returns them in order."""
  batch, kv_len, num_kv_heads, head_dim = key.shape
  consumers, stages = static.num_consumers, static.num_stages
  transforms = _tile_transforms(static.dtype)
  resident = plgpu.SMEM((consumers, static.block_kv, head_dim), static.dtype,
                        transforms=transforms)
  streamed = plgpu.SMEM((stages, static.block_q, head_dim), static.dtype,
                        transforms=transforms)
  scratch = (
      resident,                                           # K, then dK
      resident,                                           # V, then dV
      streamed,                                           # Q ring
      streamed,                                           # dO ring
      plgpu.SMEM((stages, 2, static.block_q), jnp.float32),  # stats ring
      plgpu.Barrier(num_barriers=consumers),              # k_arrived
      plgpu.Barrier(num_barriers=consumers),              # v_arrived
      plgpu.Barrier(num_barriers=stages),                 # q_arrived
      plgpu.Barrier(num_barriers=stages),                 # do_arrived
      plgpu.Barrier(num_barriers=stages),                 # stats_arrived
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # consumed
  )
  out_type = tuple(jax.ShapeDtypeStruct(key.shape, key.dtype)
                   for _ in static.outputs)
  results = plgpu.kernel(
      functools.partial(_dkdv_kernel, static=static),
      out_type=out_type,
      scratch_types=scratch,
      # kv_tile fastest: neighbouring CTAs stream the same Q tiles from L2.
      grid=(kv_len // (consumers * static.block_kv), num_kv_heads, batch),
      grid_names=("kv_tile", "kv_head", "batch"),
      num_threads=consumers + 1,
      thread_name="wg",
      kernel_name="mosaic_flash_backward_" + "".join(static.outputs),
      compiler_params=compat.compiler_params(approx_math=True),
  )(query, key, value, d_out, stats)
  return tuple(results)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, *refs,
                 static: _Static):
  """Kernel body; `refs` are the outputs then `_dkdv_call`'s scratch list."""
  num_out = len(static.outputs)
  out_refs = dict(zip(static.outputs, refs[:num_out]))
  (k_smem, v_smem, q_ring, do_ring, stats_ring, k_arrived, v_arrived,
   q_arrived, do_arrived, stats_arrived, consumed) = refs[num_out:]
  batch = lax.axis_index("batch")
  kv_head = lax.axis_index("kv_head")
  wg = lax.axis_index("wg")
  tile_start = lax.axis_index("kv_tile") * (
      static.num_consumers * static.block_kv)
  # The union of the consumers' Q tiles, per query head of the group:
  # [first, num_q_blocks), where first is consumer 0's (it sees the most).
  first = _first_q_block(tile_start, static)
  per_head = static.num_q_blocks - first
  num_steps = static.group * per_head
  arrived = (q_arrived, do_arrived, stats_arrived)

  @pl.when(wg < static.num_consumers)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    kv_start = tile_start + wg * static.block_kv
    kv_rows = pl.ds(kv_start, static.block_kv)
    own_k, own_v = k_smem.at[wg], v_smem.at[wg]
    plgpu.copy_gmem_to_smem(k_ref.at[batch, kv_rows, kv_head], own_k,
                            k_arrived.at[wg])
    if "dk" in static.outputs:  # only dPᵀ = V dOᵀ reads V
      plgpu.copy_gmem_to_smem(v_ref.at[batch, kv_rows, kv_head], own_v,
                              v_arrived.at[wg])
      plgpu.barrier_wait(v_arrived.at[wg])
    plgpu.barrier_wait(k_arrived.at[wg])
    grads = _dkdv_consume(own_k, own_v, q_ring, do_ring, stats_ring, arrived,
                          consumed, kv_start=kv_start, first=first,
                          per_head=per_head, static=static)
    # K and V are dead: write the gradients through their buffers.
    staged = {"dk": own_k, "dv": own_v}
    for name, grad in zip(static.outputs, grads):
      staged[name][...] = grad.astype(static.dtype)
    plgpu.commit_smem()
    for name in static.outputs:
      plgpu.copy_smem_to_gmem(staged[name],
                              out_refs[name].at[batch, kv_rows, kv_head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == static.num_consumers)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

    def q_rows_of(step):
      # Step -> (query head of the group, Q tile); per_head > 0 whenever
      # there is a step.
      divisor = jnp.maximum(per_head, 1)
      g, i = lax.div(step, divisor), lax.rem(step, divisor)
      return kv_head * static.group + g, pl.ds((first + i) * static.block_q,
                                                static.block_q)

    def tile(ref):
      def source(step):
        head, rows = q_rows_of(step)
        return ref.at[batch, rows, head]
      return source

    def stats_tile(step):
      head, rows = q_rows_of(step)
      return stats_ref.at[batch, head, :, rows]

    _produce([(tile(q_ref), q_ring, q_arrived),
              (tile(do_ref), do_ring, do_arrived),
              (stats_tile, stats_ring, stats_arrived)],
             consumed, num_steps, static)


def _dkdv_consume(k_smem, v_smem, q_ring, do_ring, stats_ring, arrived,
                  consumed, *, kv_start, first, per_head, static: _Static):
  """Consumer: dK, dV (f32, unscaled dK) of K/V rows [kv_start, +block_kv).

  Walks the producer's steps: for each query head of the group, Q tiles
  [first, num_q_blocks); of these it skips those wholly above the diagonal
  for its rows, masks those that straddle it.
  """
  own_first = _first_q_block(kv_start, static)
  own_unmasked = _first_unmasked_q_block(kv_start, static)
  zeros = plgpu.layout_cast(
      jnp.zeros((static.block_kv, static.head_dim), jnp.float32),
      plgpu.Layout.WGMMA)
  grads = tuple(zeros for _ in static.outputs)

  def step_body(i, grads, *, head_base, masked):
    step = head_base + i
    slot = lax.rem(step, static.num_stages)
    for barrier in arrived:
      plgpu.barrier_wait(barrier.at[slot])
    q_tile, do_tile = q_ring.at[slot], do_ring.at[slot]
    products = [(k_smem, q_tile.transpose((1, 0)))]          # Sᵀ = K Qᵀ
    if "dk" in static.outputs:
      products.append((v_smem, do_tile.transpose((1, 0))))   # dPᵀ = V dOᵀ
    s_t, *dp_t = _wgmma_fresh((static.block_kv, static.block_q), products)
    lse_log2 = plgpu.layout_cast(stats_ring[slot, 0],
                                 plgpu.Layout.WGMMA.reduce(0))
    p_t = jnp.exp2(s_t * static.scale_log2 - _cols(lse_log2, s_t.shape))
    if masked:
      p_t = jnp.where(_causal_mask_t(kv_start, i, static), p_t, 0.0)
    updates = []
    for name in static.outputs:
      if name == "dv":
        updates.append((p_t.astype(static.dtype), do_tile))  # dV += Pᵀ dO
      else:
        delta = plgpu.layout_cast(stats_ring[slot, 1],
                                  plgpu.Layout.WGMMA.reduce(0))
        ds_t = p_t * (dp_t[0] - _cols(delta, s_t.shape))
        updates.append((ds_t.astype(static.dtype), q_tile))  # dK += dSᵀ Q
    grads = _wgmma_accumulate(grads, updates)
    plgpu.barrier_arrive(consumed.at[slot])
    return grads

  def skip_body(i, grads, *, head_base):
    _skip_step(arrived, consumed, lax.rem(head_base + i, static.num_stages))
    return grads

  def head_body(g, grads):
    # Step of Q tile i of query head g is head_base + i.
    head_base = g * per_head - first
    body = functools.partial(step_body, head_base=head_base)
    if static.is_causal:
      grads = lax.fori_loop(first, own_first,
                            functools.partial(skip_body, head_base=head_base),
                            grads)
      grads = lax.fori_loop(own_first, own_unmasked,
                            functools.partial(body, masked=True), grads)
      start = own_unmasked
    else:
      start = 0
    return lax.fori_loop(start, static.num_q_blocks,
                         functools.partial(body, masked=False), grads)

  grads = lax.fori_loop(0, static.group, head_body, grads)
  return tuple(grad * static.scale if name == "dk" else grad
               for name, grad in zip(static.outputs, grads))


def _first_q_block(kv_start, static: _Static):
  """First Q tile with a row that attends key kv_start (causal), clipped.

  Row r attends kv_start iff r >= kv_start, so tile i needs
  (i + 1) * block_q - 1 >= kv_start.
  """
  if not static.is_causal:
    return 0
  return jnp.minimum(kv_start // static.block_q, static.num_q_blocks)


def _first_unmasked_q_block(kv_start, static: _Static):
  """First Q tile whose every row attends all of keys [kv_start, +block_kv).

  Needs i * block_q >= kv_start + block_kv - 1.
  """
  if not static.is_causal:
    return 0
  return jnp.minimum(pl.cdiv(kv_start + static.block_kv - 1, static.block_q),
                     static.num_q_blocks)


def _causal_mask_t(kv_start, q_block, static: _Static):
  """[block_kv, block_q]: True where key kv_start + r is seen by query
  q_block * block_q + c (the transposed layout of Sᵀ)."""
  shape = (static.block_kv, static.block_q)
  keys = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  queries = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                   layout=plgpu.Layout.WGMMA)
  return queries + q_block * static.block_q >= keys + kv_start


# ---------------------------------------------------------------------------
# dQ kernel.


def _dq_call(query, key, value, d_out, stats, static: _Static):
  """Launches the dQ kernel; returns dq like query."""
  batch, q_len, num_heads, head_dim = query.shape
  consumers, stages = static.num_consumers, static.num_stages
  transforms = _tile_transforms(static.dtype)
  resident = plgpu.SMEM((consumers, static.block_q, head_dim), static.dtype,
                        transforms=transforms)
  streamed = plgpu.SMEM((stages, static.block_kv, head_dim), static.dtype,
                        transforms=transforms)
  scratch = (
      resident,                                           # Q, then dQ
      resident,                                           # dO
      plgpu.SMEM((consumers, 2, static.block_q), jnp.float32),  # stats
      streamed,                                           # K ring
      streamed,                                           # V ring
      plgpu.Barrier(num_barriers=consumers),              # q_arrived
      plgpu.Barrier(num_barriers=consumers),              # do_arrived
      plgpu.Barrier(num_barriers=consumers),              # stats_arrived
      plgpu.Barrier(num_barriers=stages),                 # k_arrived
      plgpu.Barrier(num_barriers=stages),                 # v_arrived
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # consumed
  )
  return plgpu.kernel(
      functools.partial(_dq_kernel, static=static),
      out_type=jax.ShapeDtypeStruct(query.shape, query.dtype),
      scratch_types=scratch,
      # q_tile fastest: neighbouring CTAs stream the same K/V from L2.
      grid=(q_len // (consumers * static.block_q), num_heads, batch),
      grid_names=("q_tile", "head", "batch"),
      num_threads=consumers + 1,
      thread_name="wg",
      kernel_name="mosaic_flash_backward_dq",
      compiler_params=compat.compiler_params(approx_math=True),
  )(query, key, value, d_out, stats)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, dq_ref,
               q_smem, do_smem, stats_smem, k_ring, v_ring,
               q_arrived, do_arrived, stats_arrived, k_arrived, v_arrived,
               consumed, *, static: _Static):
  """Kernel body; refs as laid out in `_dq_call`'s scratch list."""
  batch = lax.axis_index("batch")
  head = lax.axis_index("head")
  wg = lax.axis_index("wg")
  rows_per_tile = static.num_consumers * static.block_q
  q_tile = tile_index(
      "q_tile", static.num_q_blocks * static.block_q // rows_per_tile,
      reverse=static.heavy_first and static.is_causal)
  tile_start = q_tile * rows_per_tile
  # The last consumer's rows come last, so it sees the most K/V tiles.
  last_start = tile_start + (static.num_consumers - 1) * static.block_q
  num_steps = _num_kv_blocks_seen(last_start, static)
  arrived = (k_arrived, v_arrived)

  @pl.when(wg < static.num_consumers)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    q_start = tile_start + wg * static.block_q
    q_rows = pl.ds(q_start, static.block_q)
    own_q, own_do, own_stats = q_smem.at[wg], do_smem.at[wg], stats_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[batch, q_rows, head], own_q,
                            q_arrived.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[batch, q_rows, head], own_do,
                            do_arrived.at[wg])
    plgpu.copy_gmem_to_smem(stats_ref.at[batch, head, :, q_rows], own_stats,
                            stats_arrived.at[wg])
    for barrier in (q_arrived, do_arrived, stats_arrived):
      plgpu.barrier_wait(barrier.at[wg])
    dq = _dq_consume(own_q, own_do, own_stats, k_ring, v_ring, arrived,
                     consumed, q_start=q_start, num_steps=num_steps,
                     static=static)
    own_q[...] = dq.astype(static.dtype)  # Q is dead: dQ goes out through it
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(own_q, dq_ref.at[batch, q_rows, head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == static.num_consumers)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
    kv_head = head // static.group

    def tile(ref):
      def source(step):
        return ref.at[batch, pl.ds(step * static.block_kv, static.block_kv),
                      kv_head]
      return source

    _produce([(tile(k_ref), k_ring, k_arrived),
              (tile(v_ref), v_ring, v_arrived)],
             consumed, num_steps, static)


def _dq_consume(q_smem, do_smem, stats_smem, k_ring, v_ring, arrived,
                consumed, *, q_start, num_steps, static: _Static):
  """Consumer: dQ (f32, scaled) of rows [q_start, q_start + block_q)."""
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  lse_log2 = plgpu.layout_cast(stats_smem[0], row_layout)
  delta = plgpu.layout_cast(stats_smem[1], row_layout)
  own_steps = _num_kv_blocks_seen(q_start, static)
  own_unmasked = _num_unmasked_kv_blocks(q_start, own_steps, static)
  dq = plgpu.layout_cast(
      jnp.zeros((static.block_q, static.head_dim), jnp.float32),
      plgpu.Layout.WGMMA)

  def step_body(step, dq, *, masked):
    slot = lax.rem(step, static.num_stages)
    for barrier in arrived:
      plgpu.barrier_wait(barrier.at[slot])
    k_tile, v_tile = k_ring.at[slot], v_ring.at[slot]
    s, dp = _wgmma_fresh((static.block_q, static.block_kv), [
        (q_smem, k_tile.transpose((1, 0))),     # S = Q Kᵀ
        (do_smem, v_tile.transpose((1, 0))),    # dP = dO Vᵀ
    ])
    p = jnp.exp2(s * static.scale_log2 - _rows(lse_log2, s.shape))
    if masked:
      p = jnp.where(_causal_mask(q_start, step, static), p, 0.0)
    ds = p * (dp - _rows(delta, s.shape))
    (dq,) = _wgmma_accumulate((dq,), [(ds.astype(static.dtype), k_tile)])
    plgpu.barrier_arrive(consumed.at[slot])
    return dq

  def skip_body(step, dq):
    _skip_step(arrived, consumed, lax.rem(step, static.num_stages))
    return dq

  dq = lax.fori_loop(0, own_unmasked,
                     functools.partial(step_body, masked=False), dq)
  if static.is_causal:
    dq = lax.fori_loop(own_unmasked, own_steps,
                       functools.partial(step_body, masked=True), dq)
    # Tiles that only the other consumer's (later) rows see.
    dq = lax.fori_loop(own_steps, num_steps, skip_body, dq)
  return dq * static.scale


def _num_kv_blocks_seen(q_start, static: _Static):
  """K/V tiles that rows [q_start, q_start + block_q) attend to."""
  if not static.is_causal:
    return static.num_kv_blocks
  return jnp.minimum(pl.cdiv(q_start + static.block_q, static.block_kv),
                     static.num_kv_blocks)


def _num_unmasked_kv_blocks(q_start, num_blocks, static: _Static):
  """Leading K/V tiles wholly at or below the diagonal: tile j's last key,
  (j + 1) * block_kv - 1, is at most the first row, q_start."""
  if not static.is_causal:
    return num_blocks
  return jnp.minimum((q_start + 1) // static.block_kv, num_blocks)


def _produce(streams, consumed, num_steps, static: _Static):
  """Producer warpgroup: TMA step t's tiles into ring slot t % num_stages.

  `streams` are (source, ring, arrived): `source(step)` is the GMEM view of
  that step's tile. A slot is refilled once every consumer released it.
  """
  stages = static.num_stages

  def load(step, slot):
    for source, ring, arrived in streams:
      plgpu.copy_gmem_to_smem(source(step), ring.at[slot], arrived.at[slot])

  # Fill the ring. Under causal masking a tile may have fewer steps than
  # there are stages (or none).
  for step in range(stages):
    fill = functools.partial(load, step, step)
    if static.is_causal:
      pl.when(step < num_steps)(fill)
    else:
      fill()

  @pl.loop(stages, num_steps)
  def _refill(step):
    slot = lax.rem(step, stages)
    plgpu.barrier_wait(consumed.at[slot])
    load(step, slot)


def _skip_step(arrived, consumed, slot):
  """Takes part in a step without computing: keeps this consumer's barrier
  phases in step with the ring, and releases the slot."""
  for barrier in arrived:
    plgpu.barrier_wait(barrier.at[slot])
  plgpu.barrier_arrive(consumed.at[slot])


def _wgmma_fresh(shape, products):
  """[a @ b for (a, b) in products] into fresh f32 accumulators of `shape`,
  issued together so that they share one wgmma wait."""
  def issue(*acc_refs):
    for acc_ref, (a, b) in zip(acc_refs, products):
      plgpu.wgmma(acc_ref, a, b)
    return tuple(acc_ref[...] for acc_ref in acc_refs)

  return pl.run_scoped(issue, *[plgpu.ACC(shape, jnp.float32)
                                for _ in products])


def _wgmma_accumulate(accs, products):
  """(acc + a @ b for acc, (a, b) in zip(accs, products)), one wgmma wait."""
  def issue(acc_refs):
    for acc_ref, (a, b) in zip(acc_refs, products):
      plgpu.wgmma(acc_ref, a, b)

  return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs))
