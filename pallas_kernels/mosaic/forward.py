"""FlashAttention-3 forward for Hopper (sm90) in Pallas Mosaic GPU.

One CTA computes a tile of `num_consumers * block_q` query rows of one
(batch, head) with `num_consumers + 1` warpgroups (FlashAttention-3, Shah et
al. 2024, §3.1):

  consumers   warpgroups 0, 1 (and 2): each owns `block_q` query rows, Q in
              shared memory; S = Q Kᵀ and O += P V by `wgmma`, the online
              softmax in registers (`softmax.py`). They take turns on the
              tensor cores, so that one's softmax runs under the others'
              matmuls (`turns.py`).
  producer    the last warpgroup: streams K and V tiles by TMA into a ring
              of `max_concurrent_steps` shared-memory slots.

(`forward_kernel.py` is the warpgroups' code.) The output O stays
unnormalised until the end; the natural-log LSE is
`(m + log2 l) * ln 2 = m ln 2 + ln l` of the base-2 running max m and sum l.

Causal (top-left aligned, as `jax.nn.dot_product_attention`): query i attends
keys j <= i. The K/V loop stops at the last block a row tile can see, and the
blocks that straddle the diagonal run in a second loop that applies the mask,
so the blocks before the diagonal pay nothing for it.

Persistent grid: one CTA per SM walks the tiles, the K/V ring and its
barrier phases running on from tile to tile, so that each tile's Q load and
O store overlap the neighbouring tiles' work instead of costing a launch.
Causal tiles go to the CTAs in pairs of equal cost
(`common.persistent_schedule`).

Two more forms of the same kernel, chosen by `KernelStatic` at trace time
(the plain form's code is untouched by them):

  ranged  (`masked.mosaic_forward_masked`) loop ranges per 64-row block from
          a plan row; both consumers walk the union of their ranges (a block
          outside one's own range is a skip: barriers, no math), so every
          barrier phase advances alike in every thread; masks by
          `pallas_kernels.masking.keep`, segment ids streamed with K; score
          changes (soft cap, ALiBi: a slope per head, from shared memory)
          by `masking.modify_scores` on every visited tile; dropout by
          `masking.dropout_keep`'s hash (the seed in the plan row) on P
          after the row sum.
  fp8     (`fp8.mosaic_forward_fp8`) e4m3 operands, V transposed, P through
          shared memory, per-block descale factors.

Which schedule a call runs is `plan.forward_config`'s choice; this module
checks the call, builds the kernel's statics and launches it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import compat as versions
from pallas_kernels.mosaic import compat, lowered_cache, plan, turns
from pallas_kernels.mosaic.common import (
    HEAD_DIM_MULTIPLE, LOG2E, PLAN_WIDTH, SMEM_LIMIT_BYTES, SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS, check_layout, check_slope_shape, check_shared_memory,
    check_tiles, launch_grid, masks_key_tail, own_width_head_dim,
    persistent_num_ctas, ragged_lengths, slope_rows, slope_rows_bytes,
    swizzled)
from pallas_kernels.mosaic.rows import row_buffer, row_copies, rows_in_place
from pallas_kernels.mosaic.forward_kernel import (
    NUM_CONSUMERS, KernelStatic, forward_kernel, fp8_o_columns)
from pallas_kernels.mosaic.forward_static import MMA_SUM_COLUMNS
from pallas_kernels.mosaic.forward_persistent import persistent_kernel
from pallas_kernels.mosaic.plan import ForwardConfig, forward_config

# The forward's shared memory also leaves the 2 KiB that Mosaic GPU reserves
# for cross-warp reductions (`CompilerParams.reduction_scratch_bytes`'
# default) and the padding of its small buffers to the swizzled ones'
# alignment: three consumers at head_dim 128 with O staged apart came to 512
# bytes under `SMEM_LIMIT_BYTES` and failed to compile on the H200.
_FORWARD_SMEM_LIMIT_BYTES = SMEM_LIMIT_BYTES - 2048
FP8 = jnp.dtype(jnp.float8_e4m3fn)
# `rescale_threshold`'s bound: P's entries stay below 2**threshold, and
# float16's largest is ~2**16 (bfloat16's ~2**128).
_MAX_RESCALE_THRESHOLD = 8.0


def mosaic_forward(query, key, value, *, scale: float, is_causal: bool,
                   sinks=None, kv_len: int | None = None,
                   soft_cap: float | None = None, alibi_slopes=None,
                   **options):
  """FlashAttention-3 forward on sm90.

  Args:
    query: [batch, q_len, num_heads, head_dim], bfloat16 or float16;
      head_dim a multiple of 16 from 64 to 256, computed at its own width
      (`common.own_width_head_dim`).
    key, value: [batch, kv_len, num_kv_heads, head_dim], same dtype;
      num_heads % num_kv_heads == 0 (query head h reads K/V head
      h // (num_heads // num_kv_heads)).
    scale: multiplies q·k; must be positive (it is folded into exp2).
    is_causal: top-left aligned, query i attends keys j <= i::

        q_len 4, kv_len 6        q_len 6, kv_len 4
        1 0 0 0 0 0              1 0 0 0
        1 1 0 0 0 0              1 1 0 0
        1 1 1 0 0 0              1 1 1 0
        1 1 1 1 0 0              1 1 1 1
                                 1 1 1 1
                                 1 1 1 1

    sinks: float32 [num_heads] or None: a logit per head that joins every
      row's softmax denominator (as `masking.apply_sinks`), in the kernel's
      epilogue.
    kv_len: the keys, of key's rows (None: all); the rows past it are
      padding (a caller's copy to whole 8-row TMA tiles), masked wherever
      a query may see them (`common.masks_key_tail`) and never loaded past
      the K/V block that holds key kv_len - 1.
    soft_cap: None, or a positive cap: logits become cap * tanh(logit /
      cap) (`masking.modify_scores`), computed as tanh(scale q·k / cap)
      into exp2 at cap log2(e).
    alibi_slopes: float32 [batch, num_heads] or None: with `is_causal`,
      each score loses slope * (q_idx - kv_idx) (`masking.modify_scores`'
      ALiBi), taken as a term per key and one per query
      (`common.alibi_columns`); on the launch grid, without sinks or a
      soft cap (the masked kernel takes those mixes).
    **options: fields of `plan.ForwardConfig` replacing the plan's choice
      for this call (`plan.forward_config`): tiles, pipeline depth,
      consumers, grid, turns, the row sum's place, the lazy rescale. Every
      choice gives bitwise the same result, but for the lazy rescale's
      threshold (above 0 it changes rounding).

  Returns:
    out: [batch, q_len, num_heads, head_dim], the dtype of query.
    lse: float32 [batch, num_heads, q_len], natural-log logsumexp of the
      scaled scores (and the sink); -inf (and out 0) for a row that attends
      to nothing (with sinks: the sink, and out 0).

  Raises:
    NotImplementedError: for calls this kernel does not cover yet (dtype,
      head dim, lengths not multiples of 8, `common.ragged_lengths`;
      non-positive scale, tiles that do not fit in shared memory), so that
      a dispatcher falls back.
  """
  config = forward_config(head_dim=query.shape[-1], is_causal=is_causal,
                          q_len=query.shape[1], kv_len=kv_len or key.shape[1],
                          **options)
  if config.num_consumers not in (2, 3):
    raise ValueError(f"num_consumers must be 2 or 3, got "
                     f"{config.num_consumers}")
  alibi = alibi_slopes is not None
  if alibi:
    _check_plain_alibi(alibi_slopes, query.shape, is_causal=is_causal,
                       sinks=sinks, soft_cap=soft_cap,
                       persistent=options.get("persistent"))
    config = dataclasses.replace(config, persistent=False)
  static = check_supported(query, key, value, scale=scale,
                           is_causal=is_causal, block_q=config.block_q,
                           block_kv=config.block_kv,
                           max_concurrent_steps=config.max_concurrent_steps,
                           num_consumers=config.num_consumers,
                           sinks=sinks is not None, kv_len=kv_len,
                           slopes=alibi)
  static = dataclasses.replace(
      static, split_handover=True, alibi_columns=alibi,
      # Three consumers always take hardware turns (`turns.RingTurns`).
      hw_turns=config.hw_turns or config.num_consumers != NUM_CONSUMERS,
      sum_after_pv=config.sum_after_pv,
      **rescale_fields(config.lazy_rescale,
                       threshold=config.rescale_threshold))
  static = dataclasses.replace(static, skip_spare=_skips_spare(static))
  if soft_cap is not None:
    if not soft_cap > 0:
      raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    static = dataclasses.replace(static, soft_cap=float(soft_cap))
    if plan.max_free_cap(soft_cap, query.dtype, query.shape[-1], plain=True):
      # No running max where the cap bounds P (`plan.
      # PLAIN_MAX_FREE_HEAD_DIMS`): each row's max from its first step, or
      # O's row sum by the tensor cores (with the running max where the
      # ones tiles do not fit).
      if plan.MAX_FREE_FIRST_STEP_MAX:
        static = dataclasses.replace(
            static, max_free=True, first_step_max=plan.first_step_max_floor(
                soft_cap, query.dtype))
      else:
        static = with_mma_row_sum(
            dataclasses.replace(static, max_free=True)) or static
  if config.mma_row_sum and not static.max_free:
    # l itself by the tensor cores (`ForwardConfig.mma_row_sum`).
    static = with_mma_row_sum(
        dataclasses.replace(static, sum_after_pv=False)) or static
  if config.persistent:
    static = persistent_static(static, query.shape, config.num_ctas)
  return launch(static, query, key, value,
                slopes=slope_rows(alibi_slopes) if alibi else None,
                sinks=None if sinks is None else sink_rows(sinks))


def _check_plain_alibi(alibi_slopes, q_shape, *, is_causal, sinks, soft_cap,
                       persistent):
  """`mosaic_forward`'s ALiBi: ValueError for slopes not [batch,
  num_heads]; NotImplementedError for what the plain form leaves to the
  masked kernel."""
  check_slope_shape(alibi_slopes, q_shape)
  if not is_causal or sinks is not None or soft_cap is not None:
    raise NotImplementedError(
        "the plain forward takes ALiBi under a causal mask, without sinks "
        "or a soft cap (the masked kernel takes the rest)")
  if persistent:
    raise NotImplementedError("the plain forward takes ALiBi on the launch "
                              "grid only")


def sink_rows(sinks):
  """float32 [ceil(heads / 32), 32] of sinks [heads] (`common.slope_rows`'
  layout: one TMA copy of whole 128-byte rows, head h at [h // 32, h %
  32])."""
  return slope_rows(jnp.asarray(sinks, jnp.float32)[None])[0]


def rescale_fields(lazy_rescale: bool, *,
                   threshold: float = ForwardConfig.rescale_threshold
                   ) -> dict:
  """`KernelStatic.rescale_threshold` for a forward's `lazy_rescale` and
  threshold (log2 units, 0 to 8; read only when lazy). The plain, masked
  and FP8 forwards share it."""
  if lazy_rescale and not (math.isfinite(threshold)
                           and 0 <= threshold <= _MAX_RESCALE_THRESHOLD):
    raise ValueError(
        f"rescale_threshold must be from 0 to {_MAX_RESCALE_THRESHOLD} "
        f"(log2 units), got {threshold}")
  return dict(rescale_threshold=float(threshold) if lazy_rescale else None)


def persistent_static(static: KernelStatic, q_shape, num_ctas: int | None
                      ) -> KernelStatic:
  """`static` for the persistent grid over query tiles of `q_shape`
  (`forward_persistent`)."""
  if static.ranged:
    raise NotImplementedError("the masked forward has no persistent grid")
  batch, q_len, num_heads, head_dim = q_shape
  num_ctas = persistent_num_ctas(
      num_ctas, paired=static.is_causal,
      num_tiles=batch * num_heads * pl.cdiv(q_len, static.tile_rows))
  o_bytes = static.tile_rows * (head_dim * static.dtype.itemsize + 4)
  # FP8's O has a buffer of its own already (never Q's).
  return dataclasses.replace(
      static, persistent=True, num_ctas=num_ctas,
      stage_o_apart=not static.fp8 and (
          static.smem_bytes + o_bytes <= _FORWARD_SMEM_LIMIT_BYTES))


def with_mma_row_sum(static: KernelStatic) -> KernelStatic | None:
  """`static` taking its row sum by the tensor cores (`KernelStatic.
  mma_row_sum`: l_pv where `max_free`, else l), its consumers' ones tiles
  counted in shared memory; None where they do not fit."""
  smem_bytes = static.smem_bytes + (static.num_consumers * static.block_kv
                                    * MMA_SUM_COLUMNS * static.dtype.itemsize)
  if smem_bytes > _FORWARD_SMEM_LIMIT_BYTES:
    return None
  return dataclasses.replace(static, mma_row_sum=True, smem_bytes=smem_bytes)


def launch(static: KernelStatic, query, key, value, descale=None, plan=None,
           segments=None, slopes=None, bias=None, dense_mask=None,
           sinks=None):
  """Builds and calls the kernel; `value` is [B, Hkv, D, T] in FP8; the
  ranged kernel's `slopes` are `common.slope_rows` (`spec.has_alibi`), its
  `bias` [batch | 1, heads | 1, q_len, kv_len] in query's dtype
  (`spec.has_bias`) and `dense_mask` the same in int8, nonzero where a
  query sees a key (`spec.has_dense_mask`); `sinks` are `sink_rows`
  (`static.sinks`).

  The LSE is written padded to whole tiles (its rows are TMA'd whole, and
  TMA needs 16-byte strides): the ranged kernel returns it so, for the
  caller to slice, the plain one cut to q_len.
  """
  batch, q_len, num_heads, head_dim = query.shape
  block_q, block_kv = static.block_q, static.block_kv
  consumers = static.num_consumers
  if static.hw_turns and (static.fp8 or static.ranged):
    raise NotImplementedError(
        f"the FP8 and masked kernels run {NUM_CONSUMERS} consumers, meeting "
        "at a rendezvous")
  num_q_tiles = pl.cdiv(q_len, static.tile_rows)
  stages = static.num_stages
  v_tile = (head_dim, block_kv) if static.fp8 else (block_kv, head_dim)
  in_place = static.rows_in_place
  arrivals = row_copies(head_dim, static.dtype, in_place=in_place)
  scratch = (
      # Q, then (bfloat16 / float16) O on the way out.
      row_buffer((consumers, block_q, head_dim), static.dtype,
                 in_place=in_place),
      row_buffer((stages, block_kv, head_dim), static.dtype,
                 in_place=in_place),
      # (FP8's V transposed, [head_dim, block_kv]: never in place.)
      row_buffer((stages, *v_tile), static.dtype, in_place=in_place),
      plgpu.SMEM((consumers, block_q), jnp.float32),  # LSE
      # q_arrived, k_arrived, v_arrived: one arrival a TMA copy
      plgpu.Barrier(num_barriers=consumers, num_arrivals=arrivals),
      *[plgpu.Barrier(num_barriers=stages, num_arrivals=arrivals)] * 2,
      # k_consumed and v_consumed: [consumer * stages + slot]; flat, since
      # the GPU interpreter allocates only 1-D barrier arrays.
      plgpu.Barrier(num_barriers=consumers * stages),
      plgpu.Barrier(num_barriers=consumers * stages),
      turns.turn_barriers(static),
  )
  inputs = (query, key, value)
  out_dtype = query.dtype
  if static.fp8:
    out_dtype = static.out_dtype
    scratch += (
        # O: an FP8 Q buffer is too small for it (`fp8_o_columns`).
        plgpu.SMEM((consumers, block_q, fp8_o_columns(head_dim)), out_dtype,
                   transforms=swizzled(fp8_o_columns(head_dim), out_dtype)),
        plgpu.SMEM((consumers, *descale.shape[-2:]), jnp.float32),
        plgpu.Barrier(num_barriers=consumers),        # descale_arrived
    )
    inputs += (descale,)
  # Padded to whole tiles: into an LSE of exactly q_len rows, the 1-D TMA
  # store of a partial tile's rows past q_len landed on the next head's
  # first rows on the GPU (benchmarks/NOTES.md, "Ragged lengths on the
  # plain kernels").
  lse_len = num_q_tiles * static.tile_rows
  if static.ranged:  # one plan row per consumer, one for the producer
    scratch += (
        plgpu.SMEM((consumers + 1, PLAN_WIDTH), jnp.int32),
        plgpu.Barrier(num_barriers=consumers + 1),    # plan_arrived
    )
    inputs += (plan,)
  if static.stage_o_apart:
    scratch += (row_buffer((consumers, block_q, head_dim), static.dtype,
                           in_place=in_place),             # O
                plgpu.SMEM((consumers, block_q), jnp.float32))  # LSE
  if segments is not None:
    scratch += (
        plgpu.SMEM((consumers, block_q), jnp.int32),  # query ids
        plgpu.Barrier(num_barriers=consumers),
        # Key ids stream with K, one ring slot per stage.
        plgpu.SMEM((stages, block_kv), jnp.int32),
        plgpu.Barrier(num_barriers=stages),
    )
    inputs += segments
  if slopes is not None:
    scratch += (plgpu.SMEM((consumers, *slopes.shape[1:]), jnp.float32),
                plgpu.Barrier(num_barriers=consumers))  # slopes_arrived
    inputs += (slopes,)
  for tiles in (bias, dense_mask):  # each consumer's tile of its step
    if tiles is not None:
      scratch += (plgpu.SMEM((consumers, block_q, block_kv), tiles.dtype,
                             transforms=swizzled(block_kv, tiles.dtype)),
                  plgpu.Barrier(num_barriers=consumers))
      inputs += (tiles,)
  if static.mma_row_sum:  # each consumer's ones tile
    scratch += (plgpu.SMEM((consumers, block_kv, MMA_SUM_COLUMNS),
                           static.dtype,
                           transforms=swizzled(MMA_SUM_COLUMNS,
                                               static.dtype)),)
  if static.sinks:  # last, for every form (the kernels count from the end)
    scratch += (plgpu.SMEM((consumers, *sinks.shape), jnp.float32),
                plgpu.Barrier(num_barriers=consumers))  # sinks_arrived
    inputs += (sinks,)
  out_type = (
      versions.output_struct(query.shape, out_dtype, *inputs),
      # Sequence minor, so that each consumer stores its LSE rows with one
      # contiguous 1-D TMA.
      versions.output_struct((batch, num_heads, lse_len), jnp.float32,
                             *inputs),
  )
  if static.persistent:
    body = persistent_kernel
    grid, grid_names = (static.num_ctas,), ("cta",)
  else:
    # Every form launches a head's query tiles together, so that the CTAs
    # at work at once stream the same K/V through L2, rather than the same
    # tile of many heads: the plain form +2.3% at d=256 and +2.6% at d=128
    # causal at 16k (h200_mosaic_forward_tile_order.md), FP8 +3.8-4.1% at
    # 16k (h100_mosaic_fp8_schedule.md).
    body = forward_kernel
    grid, grid_names = launch_grid((num_q_tiles, num_heads, batch),
                                   ("q_tile", "head", "batch"),
                                   tile_fastest=True)
  out, lse = compat.vary_like(lowered_cache.kernel(
      functools.partial(body, static=static),
      out_type=out_type,
      scratch_types=scratch,
      grid=grid,
      grid_names=grid_names,
      num_threads=consumers + 1,
      thread_name="wg",
      kernel_name="mosaic_flash_forward",
      compiler_params=compat.compiler_params(approx_math=True),
  )(*inputs), *inputs)
  return out, (lse if static.ranged else lse[:, :, :q_len])


def check_supported(query, key, value, *, scale, is_causal, block_q,
                    block_kv, max_concurrent_steps,
                    fp8_out_dtype=None, spec=None,
                    num_consumers: int = NUM_CONSUMERS,
                    sinks: bool = False, slopes: bool = False,
                    kv_len: int | None = None) -> KernelStatic:
  """Validates the call; anything this kernel lacks is NotImplementedError.

  `fp8_out_dtype` is given for the FP8 kernel (inputs float8_e4m3fn), `spec`
  for the ranged (masked) one, which takes any lengths; `sinks` where the
  epilogue takes them (`KernelStatic.sinks`), `slopes` where the plain form
  takes ALiBi's (`KernelStatic.alibi_columns`); `kv_len` where key's rows
  past it are padding (`mosaic_forward`'s).
  """
  _, q_len, num_heads, head_dim = query.shape
  rows, num_kv_heads = check_layout(query, key, value)
  if kv_len is None:
    kv_len = rows
  elif spec is not None or not 0 < kv_len <= rows:
    raise ValueError(f"kv_len {kv_len} must be from 1 to key's {rows} rows, "
                     "and only in the plain kernels")
  dtype = jnp.dtype(query.dtype)
  fp8 = fp8_out_dtype is not None
  if fp8 and dtype != FP8:
    raise TypeError(f"mosaic_forward_fp8 takes float8_e4m3fn inputs (see "
                    f"jax_flash.fp8.quantize_fp8), got {dtype}")
  if not fp8 and dtype not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"mosaic_forward supports bfloat16 and float16, got {dtype}")
  if not own_width_head_dim(head_dim, dtype):
    raise NotImplementedError(
        f"mosaic_forward supports head_dim in {SUPPORTED_HEAD_DIMS}"
        + ("" if fp8 else f" and the multiples of {HEAD_DIM_MULTIPLE} "
           "between") + f", got {head_dim}")
  check_tiles(block_q, block_kv, max_concurrent_steps)
  if spec is not None and fp8_out_dtype is not None and (
      spec.has_bias or spec.dropout_rate):
    raise NotImplementedError(
        "the FP8 kernel takes masks and score changes, not a bias or dropout")
  # Two consumers take whole tiles; more may end a (batch, head) on a short
  # tile (see `consumer_rows`).
  q_multiple = block_q * (num_consumers if num_consumers == NUM_CONSUMERS
                          else 1)
  # Lengths the tiles do not divide (`ragged_lengths`, of the arrays' rows:
  # TMA's 8-row tiling; the FP8 kernel's K and V come padded to whole
  # blocks, `fp8.mosaic_forward_fp8`).
  in_place = not fp8 and rows_in_place(q_len, rows, head_dim, dtype)
  ragged = spec is None and (ragged_lengths(q_len, rows) or in_place)
  if spec is None and q_len % q_multiple and not ragged:
    raise NotImplementedError(
        f"q_len {q_len} must be a multiple of {q_multiple} "
        f"({num_consumers} consumers x block_q {block_q}; the masked "
        "kernel takes other lengths)")
  if spec is None and kv_len % block_kv and not ragged:
    raise NotImplementedError(f"kv_len {kv_len} must be a multiple of "
                              f"block_kv {block_kv} (the masked kernel takes "
                              "other lengths)")
  if not scale > 0:
    raise NotImplementedError(
        f"scale must be positive (it is folded into exp2), got {scale}")
  num_kv_blocks = pl.cdiv(kv_len, block_kv)
  num_stages = min(max_concurrent_steps, num_kv_blocks)
  smem_bytes = _smem_bytes(block_q, block_kv, num_stages, head_dim,
                           dtype.itemsize, num_consumers)
  num_q_blocks = q_len // block_q
  if slopes or (spec is not None and spec.has_alibi):
    smem_bytes += num_consumers * slope_rows_bytes(num_heads)
  if sinks:
    if fp8:
      raise NotImplementedError("the FP8 kernel takes no sinks")
    smem_bytes += num_consumers * slope_rows_bytes(num_heads)
  if spec is not None and spec.has_bias:
    smem_bytes += num_consumers * block_q * block_kv * dtype.itemsize
  if spec is not None and spec.has_dense_mask:  # int8
    smem_bytes += num_consumers * block_q * block_kv
  if fp8:  # the O buffer, and the descale rows
    smem_bytes += num_consumers * (
        block_q * fp8_o_columns(head_dim) * fp8_out_dtype.itemsize
        + 4 * (num_q_blocks + num_kv_blocks + 32))
  check_shared_memory(
      smem_bytes, _FORWARD_SMEM_LIMIT_BYTES,
      f"block_q {block_q}, block_kv {block_kv}, {num_stages} stages at "
      f"head_dim {head_dim}")
  return KernelStatic(
      block_q=block_q, block_kv=block_kv, num_stages=num_stages,
      num_kv_blocks=num_kv_blocks, head_dim=head_dim,
      group=num_heads // num_kv_heads, scale_log2=float(scale) * LOG2E,
      is_causal=bool(is_causal), dtype=dtype, fp8=fp8,
      out_dtype=fp8_out_dtype, num_q_blocks=num_q_blocks if fp8 else 0,
      spec=spec, scale=float(scale), num_consumers=num_consumers,
      q_len=q_len, sinks=bool(sinks), smem_bytes=smem_bytes,
      ragged_tail=ragged and bool(q_len % q_multiple or kv_len % block_kv),
      rows_in_place=in_place, kv_len=kv_len, key_rows=rows,
      key_tail=ragged and masks_key_tail(q_len, kv_len, block_kv, is_causal))


def fitting_block_kv(block_kv: int, check) -> int:
  """`block_kv`, halved down to 64 keys while `check(block_kv)`
  (`check_supported` of the call on that tile) refuses it: a planned long
  tile gives way where a mask's buffers (a bias or dense mask tile per
  consumer) or a factor's rows leave it no room. 64 itself is not
  checked here: the call's own check then says why it cannot run."""
  while block_kv > 64:
    try:
      check(block_kv)
      return block_kv
    except NotImplementedError:
      block_kv //= 2
  return 64


def _smem_bytes(block_q, block_kv, num_stages, head_dim, itemsize,
                num_consumers=NUM_CONSUMERS) -> int:
  """Shared memory of the common buffers: Q, the K/V ring, the LSE rows."""
  return ((num_consumers * block_q + 2 * num_stages * block_kv) * head_dim
          * itemsize + num_consumers * block_q * 4)


def _skips_spare(static: KernelStatic) -> bool:
  """Whether a tile may have a consumer without rows that skips its math
  (`KernelStatic.skip_spare`, given the shape)."""
  return (static.num_consumers != NUM_CONSUMERS
          and not static.is_causal and not static.ranged and not static.fp8
          and not static.key_tail and static.q_len % static.tile_rows != 0)
