"""`mosaic_forward_fp8`: the Mosaic forward on float8_e4m3fn inputs.

The kernel is the forward's with `static.fp8` set (FP8 wgmma, V transposed,
P as wgmma's register operand, descale factors
read per block); this module lays out the inputs and descale rows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import masking
from pallas_kernels.mosaic import common, forward, forward_kernel, masked, plan


def mosaic_forward_fp8(query, key, value, *, q_descale, k_descale, v_descale,
                       scale: float, is_causal: bool,
                       spec: masking.MaskSpec | None = None, q_offset=None,
                       q_lengths=None, kv_lengths=None, q_segments=None,
                       kv_segments=None, alibi_slopes=None, block_mask=None,
                       dense_mask=None,
                       out_dtype=jnp.bfloat16, block_q: int = 64,
                       block_kv: int | None = None,
                       q_descale_rows: int | None = None,
                       k_descale_rows: int | None = None,
                       max_concurrent_steps: int = 2,
                       lazy_rescale: bool | None = None,
                       persistent: bool | None = None,
                       num_ctas: int | None = None):
  """FlashAttention-3 forward on float8_e4m3fn inputs (FA3 §3.3).

  Q·Kᵀ and P·V run as FP8 wgmma with float32 accumulation; P is rounded to
  e4m3 before P·V. True inputs are `query * q_descale` etc. (see
  `jax_flash.fp8.quantize_fp8`), so the kernel multiplies each S tile by its Q and K
  blocks' factors and the output by V's.

  Args:
    query: float8_e4m3fn [batch, q_len, num_heads, head_dim].
    key, value: float8_e4m3fn [batch, kv_len, num_kv_heads, head_dim].
    q_descale: float32 [batch, num_heads] (per tensor and head) or
      [batch, num_heads, cdiv(q_len, q_descale_rows)] (per block of rows).
    k_descale: float32 [batch, num_kv_heads] or
      [batch, num_kv_heads, cdiv(kv_len, k_descale_rows)].
    v_descale: float32 [batch, num_kv_heads]: per tensor and head only; a
      per-block V factor would rescale the accumulator at every step.
    scale, is_causal, block_q, block_kv, max_concurrent_steps: as
      `forward.mosaic_forward` (block_kv: None picks
      `plan.FP8_BLOCK_KV`'s, halved where it does not divide
      `k_descale_rows` or fit beside a mask's buffers).
    q_descale_rows, k_descale_rows: query / key rows per factor of a
      per-block descale, multiples of block_q / block_kv (factors repeat
      over the kernel's tiles); None: block_q / block_kv.
    spec: masks and score changes, as `masked.mosaic_forward_masked` takes
      them (is_causal must be the spec's), with their operands (q_offset,
      q_lengths, kv_lengths, q_segments, kv_segments, alibi_slopes,
      block_mask, dense_mask): the masked kernel's plan rows over the FP8
      kernel, any kv_len. Not a bias or dropout (NotImplementedError).
      None: causal or not only.
    out_dtype: dtype of the output (bfloat16 or float16).
    lazy_rescale: O rescaled only where a row's max moved by more than 8
      (log2 units, see `forward.KernelStatic`). P, rounded to e4m3 before
      P V, then stays below 2**8 = 256, within e4m3's 448, and keeps
      e4m3's relative precision. None: at
      `plan.FP8_LAZY_RESCALE_HEAD_DIMS`.
    persistent: the persistent grid (`forward_persistent`, `num_ctas` CTAs,
      None: one per SM) instead of a CTA a tile; without a spec only.
      None: where `plan.FP8_PERSISTENT_UP_TO` says.

  Any q_len: Q is padded with zero rows to the kernel's tile (block_q
  times the consumers) and their outputs dropped; causal masks are top-left
  aligned, so the real rows see the same keys. Any kv_len: without a spec
  the last K/V block is masked past kv_len where a query may see there
  (`common.masks_key_tail`), as in the 16-bit plain kernel; with one the
  plan rows mask it.

  Returns:
    out [batch, q_len, num_heads, head_dim] in `out_dtype`, lse float32
    [batch, num_heads, q_len], as `forward.mosaic_forward`.
  """
  common.check_layout(query, key, value)
  if spec is not None:
    masked.check_ranged_features(spec, "the FP8 kernel")
    spec = masked.kernel_spec(spec)
    if spec.is_causal != is_causal:
      raise ValueError(f"is_causal {is_causal} is not the spec's "
                       f"{spec.is_causal}")
    if (spec.q_len, spec.kv_len) != (query.shape[1], key.shape[1]):
      raise ValueError(f"spec is for q_len {spec.q_len}, kv_len "
                       f"{spec.kv_len}; got query {query.shape}, key "
                       f"{key.shape}")
    masked.check_score_array("dense_mask", spec.has_dense_mask, dense_mask,
                             query, spec.kv_len, dtype=jnp.bool_)
    masked.check_slopes(spec, alibi_slopes, query.shape)
  q_len = query.shape[1]
  q_descale_rows = q_descale_rows or block_q
  tile_rows = block_q * forward_kernel.NUM_CONSUMERS
  query = jnp.pad(query, ((0, 0), (0, -q_len % tile_rows), (0, 0), (0, 0)))
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in common.SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"out_dtype must be bfloat16 or float16, got {out_dtype}")
  # Any kv_len: K and V zero-padded to whole K/V blocks (a copy, only for
  # such lengths; V's transpose copies it anyway), keys past kv_len masked
  # (without a spec where a query may see there, `forward.check_supported`'s
  # kv_len; with one by the plan rows).
  kv_len = key.shape[1]

  def check(block_kv):
    if k_descale_rows and k_descale_rows % block_kv:
      raise NotImplementedError(f"k_descale_rows {k_descale_rows} is not "
                                f"whole tiles of {block_kv} keys")
    padded = jax.ShapeDtypeStruct(
        (key.shape[0], -(-kv_len // block_kv) * block_kv, *key.shape[2:]),
        key.dtype)
    return forward.check_supported(
        query, padded, padded, scale=scale, is_causal=is_causal,
        block_q=block_q, block_kv=block_kv,
        max_concurrent_steps=max_concurrent_steps, fp8_out_dtype=out_dtype,
        spec=spec, kv_len=None if spec else kv_len)
  if block_kv is None:
    block_kv = forward.fitting_block_kv(
        plan.FP8_BLOCK_KV.get(query.shape[-1], 64), check)
  static = check(block_kv)
  k_descale_rows = k_descale_rows or block_kv
  key, value = (masked.pad_rows(x, block_kv) for x in (key, value))
  if lazy_rescale is None:
    lazy_rescale = query.shape[-1] in plan.FP8_LAZY_RESCALE_HEAD_DIMS
  # (A head's tiles launch together, as in every forward, `forward.launch`:
  # launched the other way, the FP8 forward at 16k, d=128 read 1.11 GB from
  # DRAM against 0.10 GB, h100_ncu_fp8_d128_vs_cudnn.md.)
  split = (query.shape[-1], bool(is_causal)) in plan.FP8_SPLIT_HANDOVER
  static = dataclasses.replace(
      static, **forward.rescale_fields(lazy_rescale), split_handover=split)
  if persistent is None:
    persistent = spec is None and (
        key.shape[1] <= plan.FP8_PERSISTENT_UP_TO[bool(is_causal)])
  if persistent:
    if spec is not None:
      raise NotImplementedError("the masked FP8 forward has no persistent "
                                "grid")
    static = forward.persistent_static(static, query.shape, num_ctas)
  descale = descale_rows(
      query.shape, key.shape,
      per_tile(q_descale, q_descale_rows, q_len, block_q,
               static.num_q_blocks, "q_descale"),
      per_tile(k_descale, k_descale_rows, kv_len, block_kv,
               static.num_kv_blocks, "k_descale"),
      v_descale, static)
  # [batch, kv_heads, head_dim, kv_len]: an XLA transpose, one pass over V
  # in FP8 (FA3 transposes in the kernel instead).
  value_t = jnp.transpose(value, (0, 2, 3, 1))
  ranged = {}
  if spec is not None:
    ranged, plan_heads = _ranged_operands(
        static, query, key, q_offset=q_offset, q_lengths=q_lengths,
        kv_lengths=kv_lengths, q_segments=q_segments,
        kv_segments=kv_segments, alibi_slopes=alibi_slopes,
        block_mask=block_mask, dense_mask=dense_mask)
    static = dataclasses.replace(static, plan_heads=plan_heads)
  # In the order of P's columns as the kernel hands P V its register
  # operand (`common.fp8_operand`), fused with the transpose.
  value_t = common.interleave_fp8_keys(value_t)
  out, lse = forward.launch(static, query, key, value_t, descale, **ranged)
  return out[:, :q_len], lse[:, :, :q_len]


def _ranged_operands(static: forward.KernelStatic, query, key, *, q_offset,
                     q_lengths, kv_lengths, q_segments, kv_segments,
                     alibi_slopes, block_mask, dense_mask):
  """(`forward.launch`'s keyword operands of the masked kernel, plan
  heads) for the FP8 call `static` (its spec), on query and key padded to
  the kernel's tiles: the plan rows (`masked.plan_rows`), the segment ids
  padded like the rows, the ALiBi slope rows, the int8 dense mask."""
  spec = static.spec
  batch = query.shape[0]
  block_mask = masked.block_mask_of(spec, block_mask, query.shape)
  plans, plan_heads = masked.plan_rows(
      static, batch, q_offset=q_offset, q_lengths=q_lengths,
      kv_lengths=kv_lengths, q_segments=q_segments, kv_segments=kv_segments,
      block_mask=block_mask, dense_mask=dense_mask)
  operands = dict(plan=plans)
  if spec.has_segments:
    operands["segments"] = (
        masked.pad_ids(q_segments, query.shape[1]),
        masked.pad_ids(kv_segments, key.shape[1]))
  if spec.has_alibi:
    operands["slopes"] = common.slope_rows(alibi_slopes)
  if spec.has_dense_mask:
    operands["dense_mask"] = masked.pad_tiles(dense_mask.astype(jnp.int8),
                                              static.block_kv)
  return operands, plan_heads


def per_tile(descale, rows: int, length: int, tile: int, num_tiles: int,
             name: str):
  """A per-block descale [batch, heads, cdiv(length, rows)] as one factor
  per kernel tile of `tile` rows, [batch, heads, num_tiles] (tiles past
  `length`, Q's padding, take the last factor); [batch, heads] (per tensor
  and head) passes through, and other shapes to `descale_rows`, which
  names them."""
  descale = jnp.asarray(descale, jnp.float32)
  if descale.ndim != 3:
    return descale
  if rows % tile:
    raise NotImplementedError(f"{name}: {rows} rows per factor is not a "
                              f"multiple of the kernel's {tile}-row tiles")
  blocks = -(-length // rows)
  if descale.shape[2] != blocks:
    raise ValueError(f"{name} must have cdiv({length}, {rows}) = {blocks} "
                     f"blocks; got {descale.shape}")
  index = np.minimum(np.arange(num_tiles) * tile // rows, blocks - 1)
  return descale[:, :, index]


def descale_rows(q_shape, k_shape, q_descale, k_descale, v_descale,
                  static: forward.KernelStatic):
  """float32 [batch, num_heads, n / 32, 32]: [Q blocks | K/V blocks | V |
  padding], one row per query head (K/V factors gathered for its K/V head).

  Padded to a multiple of 32 floats (Mosaic copies multiples of 128 bytes,
  one per thread of the warpgroup) and folded into rows of 32, since a TMA
  copies at most 256 elements along a dimension (`forward_kernel._descale`).
  """
  batch, _, num_heads, _ = q_shape
  num_kv_heads = k_shape[2]

  def per_block(x, heads, blocks, name):
    x = jnp.asarray(x, jnp.float32)
    if x.shape == (batch, heads):
      x = x[:, :, None]
    if x.shape not in ((batch, heads, 1), (batch, heads, blocks)):
      raise ValueError(f"{name} must be [batch, heads] = {(batch, heads)} or "
                       f"[batch, heads, blocks] = {(batch, heads, blocks)}; "
                       f"got {x.shape}")
    return jnp.broadcast_to(x, (batch, heads, blocks))

  q = per_block(q_descale, num_heads, static.num_q_blocks, "q_descale")
  k = per_block(k_descale, num_kv_heads, static.num_kv_blocks, "k_descale")
  v = per_block(v_descale, num_kv_heads, 1, "v_descale")
  kv = jnp.repeat(jnp.concatenate([k, v], axis=2), static.group, axis=1)
  rows = jnp.concatenate([q, kv], axis=2)
  width = forward_kernel.DESCALE_WIDTH
  pad = -rows.shape[2] % width
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, pad)), constant_values=1.0)
  return rows.reshape(batch, num_heads, -1, width)
