"""FlashAttention-2 backward for Hopper (sm90) in Pallas Mosaic GPU.

Recomputing backward (FlashAttention-2, Dao 2023, §3.2): nothing N x N is
stored; each kernel recomputes P = exp(scale * Q Kᵀ - lse) from Q, K and the
forward's LSE. Two kernels, so that every output is written by exactly one
CTA, in a fixed order (deterministic, no atomics):

  dK/dV  (`dkdv.py`) grid over K/V tiles. Each consumer warpgroup owns
         `block_kv` rows of K and V, resident in shared memory, and loops
         over the Q tiles of every query head of its GQA group, summing in
         order:  Sᵀ = K Qᵀ,  dPᵀ = V dOᵀ,  dV += Pᵀ dO,  dK += dSᵀ Q.
  dQ     (`dq.py`) grid over Q tiles. Each consumer owns `block_q` rows of Q
         and dO and loops over K/V tiles:  S = Q Kᵀ,  dP = dO Vᵀ,  dQ += dS K.

with dS = P ∘ (dP - delta) and delta = rowsum(dO ∘ O) (less the cotangent of
the LSE, when there is one), computed first by a kernel of its own
(`triton.delta.row_delta`, `row_statistics`). Every matmul is a `wgmma`
(transposes are free: they are views of the swizzled shared-memory tiles).
The scale of dS is applied once, to the finished dK and dQ.

Warp specialisation as in the forward (FlashAttention-3, Shah et al. 2024,
§3.1): one or two consumer warpgroups, and one producer warpgroup that
streams the loop's tiles by TMA into a ring of shared-memory slots
(`pipeline.produce`); every consumer walks every streamed step
(`pipeline.Walk`). Two more forms of the dK/dV kernel: with shared rows
(`shared_rows.py`: above head_dim 128 two consumers on one copy of the K/V
rows, each with half of dK's and dV's columns, where one consumer could not
hold both), and fused with dQ (`fused_dq.py`: a fourth warpgroup adds each
K/V tile's share of dQ to a float32 sum in a fixed order; one kernel
instead of two). Persistent grids (one CTA per SM walking its tiles, the
ring running on from tile to tile) for both kernels.

Causal (top-left aligned, as `jax.nn.dot_product_attention`): query i
attends keys j <= i. Tiles wholly above the diagonal are left out of the
loop bounds; only tiles that straddle it are masked.

Ranged form (`masked_backward.mosaic_backward_masked`: window, q_offset,
lengths, segment ids, soft cap, ALiBi, dropout, any lengths), chosen by
`BackwardStatic.spec` at trace time (the plain form's code is untouched by
it). Each CTA reads a plan row of loop ranges built in XLA from
`masking.classify_blocks` (see `masked.tile_plans`); masked steps apply
`masking.keep`, score changes (the soft cap, ALiBi: every visited step)
enter through `masking.modify_scores` and its derivative, and dropout's
kept weights are regenerated from `masking.dropout_keep`'s hash.

Which kernels and schedule a call runs is `plan.backward_config`'s choice;
this module turns it into the kernels' statics (`statics`) and runs them
(`gradients`).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat as versions
from pallas_kernels.mosaic.common import (
    HEAD_DIM_MULTIPLE, LOG2E, PLAN_WIDTH, SMEM_LIMIT_BYTES, SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS, SWIZZLES, THREADS_PER_WARPGROUP, TMA_ROW_TILE,
    check_layout, check_shared_memory, check_tiles, own_width_head_dim,
    check_slope_shape, persistent_num_ctas, ragged_lengths, slope_rows,
    slope_rows_bytes)
from pallas_kernels.mosaic.rows import rows_in_place
from pallas_kernels.mosaic.dkdv import launch_dkdv
from pallas_kernels.mosaic.dq import launch_dq
from pallas_kernels.mosaic.fused_dq import (DQ_PIECE, ZERO_CELL_BYTES,
                                            fused_smem_bytes, num_dq_pieces)
from pallas_kernels.mosaic.pipeline import BackwardStatic
from pallas_kernels.mosaic.plan import (BackwardConfig, backward_config,
                                       planned_kv_copies)
from pallas_kernels.triton.delta import row_delta

_MAX_CONSUMERS = 2
# f32 registers per consumer thread that the wgmma accumulators (the
# [rows, head_dim] dK/dV or dQ sums and the [rows, cols] S and dP tiles) may
# take of the consumers' 232; the rest holds P and dS in 16 bits, the
# softmax statistics and addresses. A [m, n] f32 accumulator of one
# warpgroup is m * n / 128 registers per thread.
_ACCUMULATOR_REGISTERS = 192


def mosaic_backward(query, key, value, out, lse, d_out, d_lse=None, *,
                    scale: float, is_causal: bool, alibi_slopes=None,
                    soft_cap: float | None = None, **options):
  """Gradients of `mosaic_forward`'s output with respect to q, k and v.

  Args:
    query: [batch, q_len, num_heads, head_dim], bfloat16 or float16;
      head_dim a multiple of 16 from 64 to 256.
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
    alibi_slopes: float32 [batch, num_heads] or None: the forward's causal
      ALiBi (`mosaic_forward(alibi_slopes=)`), as a term per key and one
      per query in both kernels (`common.alibi_columns`); on the launch
      grid, without the fused dQ or shared rows.
    soft_cap: None, or the forward's positive cap (`mosaic_forward(
      soft_cap=)`): P and the cap's slope from t = tanh(scale q·k / cap)
      in both kernels (`BackwardStatic.soft_cap`); on the launch grid,
      without the fused dQ, shared rows or `scores_ahead`.
    **options: fields of `plan.BackwardConfig` replacing the plan's choice
      for this call (`plan.backward_config`): tiles, pipeline depth, the
      fused dQ, grid, shared rows, registers, when lse and Sᵀ are read and
      issued, the dQ kernel's own tiles.

  Returns:
    (dq, dk, dv), shaped and typed like (query, key, value).

  Raises:
    NotImplementedError: for calls these kernels do not cover (dtype, head
      dim, lengths not multiples of 8, `common.ragged_lengths`; tiles that
      do not fit in shared memory or registers), so that a dispatcher falls
      back.
  """
  config = _config(query, key, is_causal, options, alibi_slopes, soft_cap)
  alibi = alibi_slopes is not None
  # Lengths the tiles do not divide, in whole TMA row tiles: rows past
  # either end load as zeros and add nothing (`common.ragged_lengths`);
  # at d=64 any lengths, the rows read and written in place.
  q_len, kv_len = query.shape[1], key.shape[1]
  in_place = rows_in_place(q_len, kv_len, query.shape[-1], query.dtype)
  if in_place and (config.fused_dq or config.shared_rows):
    raise NotImplementedError(
        f"lengths off the 8-row TMA tiling ({q_len}, {kv_len}) are read in "
        "place by the dQ and dK/dV kernels only, not the fused dQ or shared "
        "rows")
  any_lengths = ragged_lengths(q_len, kv_len) or in_place
  check_supported(query, key, value, out, lse, d_out, d_lse,
                  block_q=config.block_q, block_kv=config.block_kv,
                  max_concurrent_steps=config.max_concurrent_steps,
                  any_lengths=any_lengths)
  if config.dq_tiles is not None:
    check_tiles_divide(query.shape[1], key.shape[1],
                       block_q=config.dq_tiles[0],
                       block_kv=config.dq_tiles[1],
                       max_concurrent_steps=config.max_concurrent_steps,
                       any_lengths=any_lengths)
  # Configuring raises for tiles that do not fit, before any work is traced.
  dq_config, dkdv_configs = statics(query, key, scale=scale,
                                    is_causal=is_causal, config=config,
                                    alibi=alibi, soft_cap=soft_cap)
  stats = row_statistics(out, lse, d_out, d_lse)
  if in_place:
    dq_config, *dkdv_configs = (
        dataclasses.replace(static, rows_in_place=True)
        for static in (dq_config, *dkdv_configs))
    # Whole 8-row tiles: TMA needs 16-byte strides. The rows past q_len
    # hold zeros, read only beside zero Q and dO rows.
    stats = jnp.pad(stats, ((0, 0), (0, 0), (0, 0),
                            (0, -q_len % TMA_ROW_TILE)))
  return gradients(query, key, value, d_out, stats, dq_config, dkdv_configs,
                   slopes=slope_rows(alibi_slopes) if alibi else None)


def _score_change_config(config: BackwardConfig, options, q_shape, *,
                         is_causal: bool, alibi_slopes=None,
                         soft_cap: float | None = None) -> BackwardConfig:
  """`config` for the plain kernels' ALiBi or soft cap (`mosaic_backward`):
  on the launch grid, without the fused dQ, shared rows or `scores_ahead`
  (the planned ones give way; asked for, NotImplementedError). ValueError
  for slopes not [batch, num_heads] or a cap not positive. (The capped
  route on the persistent grid hung in the interpreter: benchmarks/
  NOTES.md, "The soft cap on the plain backward".)"""
  change = "ALiBi" if soft_cap is None else "a soft cap"
  if alibi_slopes is not None and soft_cap is not None:
    raise NotImplementedError("the plain backward takes ALiBi or a soft cap, "
                              "not both (the masked kernels take the mix)")
  if alibi_slopes is not None:
    check_slope_shape(alibi_slopes, q_shape)
    if not is_causal:
      raise NotImplementedError("the plain backward takes ALiBi under a "
                                "causal mask (the masked kernels take the "
                                "rest)")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"soft_cap must be positive, got {soft_cap}")
  refused = ("fused_dq", "shared_rows", "scores_ahead", "persistent")
  asked = [name for name in refused if options.get(name)]
  if asked:
    raise NotImplementedError(f"the plain backward takes {change} without "
                              f"{', '.join(asked)}")
  return dataclasses.replace(config, **dict.fromkeys(refused, False))


def configure(query, key, *, scale: float, is_causal: bool,
              alibi_slopes=None, soft_cap: float | None = None, **options):
  """`mosaic_backward`'s kernels for these arguments: (`dq_static` or None
  when fused, [`dkdv_statics`' passes]), as `gradients` takes them. Raises
  NotImplementedError for tiles that do not fit."""
  config = _config(query, key, is_causal, options, alibi_slopes, soft_cap)
  return statics(query, key, scale=scale, is_causal=is_causal, config=config,
                 alibi=alibi_slopes is not None, soft_cap=soft_cap)


def reads_rows_in_place(query, key, is_causal: bool) -> bool:
  """Whether `mosaic_backward` on its plan reads these rows in place
  (`rows.rows_in_place`): not with the fused dQ or shared rows, whose
  calls are padded instead (`attention._bwd`)."""
  config = _config(query, key, is_causal, {})
  return (rows_in_place(query.shape[1], key.shape[1], query.shape[-1],
                        query.dtype)
          and not (config.fused_dq or config.shared_rows))


def _config(query, key, is_causal: bool, options, alibi_slopes=None,
            soft_cap: float | None = None) -> BackwardConfig:
  """`plan.backward_config` of a call (with the plain kernels' ALiBi or
  soft cap, `_score_change_config`'s), its `dq_tiles` checked."""
  config = backward_config(head_dim=query.shape[-1], is_causal=is_causal,
                           q_len=query.shape[1], kv_len=key.shape[1],
                           **options)
  if alibi_slopes is not None or soft_cap is not None:
    config = _score_change_config(config, options, query.shape,
                                  is_causal=is_causal,
                                  alibi_slopes=alibi_slopes,
                                  soft_cap=soft_cap)
  batch, _, num_heads, _ = query.shape
  config = dataclasses.replace(config, kv_head_copies=planned_kv_copies(
      config, batch=batch, num_kv_heads=key.shape[2],
      group=num_heads // key.shape[2], kv_len=key.shape[1]))
  if config.dq_tiles is not None and (
      len(config.dq_tiles) != 2
      or not all(isinstance(n, int) for n in config.dq_tiles)):
    raise ValueError(f"dq_tiles must be (block_q, block_kv) of ints or None, "
                     f"got {config.dq_tiles!r}")
  return config


def gradients(query, key, value, d_out, stats,
              dq_config: BackwardStatic | None,
              dkdv_configs: list[BackwardStatic], *, dq_plan=None,
              dkdv_plan=None, segments=None, slopes=None, biases=None,
              dense_masks=None):
  """(dq, dk, dv) by the dQ kernel and the dK/dV pass(es), or by the one
  fused kernel.

  Args:
    query, key, value, d_out: as `mosaic_backward`'s.
    stats: `row_statistics`, float32 [batch, num_heads, 2, rows].
    dq_config, dkdv_configs: from `statics` (dq_config None when the dK/dV
      kernel is fused with dQ).
    dq_plan, dkdv_plan: the ranged kernels' plan rows, int32
      [batch, num_tiles, PLAN_WIDTH] (see `masked.tile_plans`), or None.
    segments: the ranged kernels' (q ids [batch, q_len], kv ids
      [batch, kv_len]) when the spec has segment ids, else None.
    slopes: the ALiBi slopes as `common.slope_rows` when the ranged
      kernels' spec has them or the plain ones take them (`alibi_columns`),
      else None.
    biases: the ranged kernels' bias, in query's dtype, [batch | 1,
      heads | 1, q_len, kv_len] for dQ and its transpose [..., kv_len,
      q_len] for dK/dV, padded to their tiles, or None.
    dense_masks: the ranged kernels' dense mask as int8, the same two
      forms, or None.
  """
  dq_bias, dkdv_bias = biases or (None, None)
  dq_mask, dkdv_mask = dense_masks or (None, None)
  if dq_config is None:
    (static,) = dkdv_configs
    dq_sum, dk, dv = launch_dkdv(query, key, value, d_out, stats, static)
    return (dq_sum * static.scale).astype(query.dtype), dk, dv
  dq = launch_dq(query, key, value, d_out, stats, dq_config, plan=dq_plan,
                 segments=segments, slopes=slopes, bias=dq_bias,
                 dense_mask=dq_mask)
  # K/V copies (`plan.BackwardConfig.kv_head_copies`): the dK/dV statics'
  # group is the call's over the copies.
  num_kv_heads = key.shape[2]
  copies = query.shape[2] // num_kv_heads // dkdv_configs[0].group
  if copies > 1:  # K/V head i's copies are heads i * copies + c
    key, value = (jnp.repeat(x, copies, axis=2) for x in (key, value))
  grads = {}
  for static in dkdv_configs:
    grads.update(zip(static.outputs,
                     launch_dkdv(query, key, value, d_out, stats, static,
                                 plan=dkdv_plan, segments=segments,
                                 slopes=slopes, bias=dkdv_bias,
                                 dense_mask=dkdv_mask)))
  if copies > 1:
    grads = {name: _sum_copies(grad, copies) for name, grad in grads.items()}
  return dq, grads["dk"], grads["dv"]


def _with_heads(key, num_heads: int):
  """`key`'s shape and dtype with `num_heads` K/V heads (statics read only
  these)."""
  batch, kv_len, _, head_dim = key.shape
  return jax.ShapeDtypeStruct((batch, kv_len, num_heads, head_dim),
                              key.dtype)


def _sum_copies(grad, copies: int):
  """[batch, kv_len, heads * copies, head_dim] -> [..., heads, ...]: each
  head's copies summed in float32, in order."""
  batch, kv_len, heads, head_dim = grad.shape
  parts = grad.reshape(batch, kv_len, heads // copies, copies, head_dim)
  return parts.astype(jnp.float32).sum(axis=3).astype(grad.dtype)


def check_supported(query, key, value, out, lse, d_out, d_lse, *, block_q,
                    block_kv, max_concurrent_steps,
                    any_lengths: bool = False):
  """Validates shapes (ValueError/TypeError) and coverage (NotImplemented).

  `any_lengths`: the kernels take lengths their tiles do not divide (the
  ranged kernels mask the tails; the plain ones need no mask there,
  `common.ragged_lengths`).
  """
  batch, q_len, num_heads, head_dim = query.shape
  kv_len, _ = check_layout(query, key, value)
  if out.shape != query.shape or d_out.shape != query.shape:
    raise ValueError(f"out and d_out must be {query.shape} like query; got "
                     f"{out.shape}, {d_out.shape}")
  if lse.shape != (batch, num_heads, q_len):
    raise ValueError(f"lse must be [batch, num_heads, q_len] = "
                     f"{(batch, num_heads, q_len)}; got {lse.shape}")
  dtype = jnp.dtype(query.dtype)
  if out.dtype != dtype or d_out.dtype != dtype:
    raise TypeError(f"out and d_out must be {dtype} like query; got "
                    f"{out.dtype}, {d_out.dtype}")
  if d_lse is not None and d_lse.shape != lse.shape:
    raise ValueError(f"d_lse must be {lse.shape} like lse; got {d_lse.shape}")
  if lse.dtype != jnp.float32:
    raise TypeError(f"lse must be float32, got {lse.dtype}")
  if dtype not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"mosaic_backward supports bfloat16 and float16, got {dtype}")
  if not own_width_head_dim(head_dim, dtype):
    raise NotImplementedError(
        f"mosaic_backward supports head_dim a multiple of "
        f"{HEAD_DIM_MULTIPLE} from {SUPPORTED_HEAD_DIMS[0]} to "
        f"{SUPPORTED_HEAD_DIMS[-1]}, got {head_dim}")
  check_tiles_divide(q_len, kv_len, block_q=block_q, block_kv=block_kv,
                     max_concurrent_steps=max_concurrent_steps,
                     any_lengths=any_lengths)


def check_tiles_divide(q_len: int, kv_len: int, *, block_q: int,
                       block_kv: int, max_concurrent_steps: int,
                       any_lengths: bool = False):
  """The tiles are whole wgmma rows and (unless `any_lengths`) divide the
  lengths; NotImplementedError otherwise."""
  check_tiles(block_q, block_kv, max_concurrent_steps)
  if not any_lengths and q_len % block_q:
    raise NotImplementedError(f"q_len {q_len} must be a multiple of block_q "
                              f"{block_q} (tails are not masked yet)")
  if not any_lengths and kv_len % block_kv:
    raise NotImplementedError(f"kv_len {kv_len} must be a multiple of "
                              f"block_kv {block_kv} (tails are not masked yet)")


def row_statistics(out, lse, d_out, d_lse, *, interpret: bool | None = None):
  """float32 [batch, num_heads, 2, q_len]: (lse in base 2, delta) per row.

  delta = rowsum(dO ∘ O) - d_lse (FlashAttention-2 §3.2), the sum by
  `triton.delta.row_delta` (XLA fused it with the transpose and the stack
  into 0.32-0.39 ms at seq 1k, a quarter of the backward; the kernel takes
  0.06-0.07 ms); `interpret` is its interpret mode (None: when no GPU is
  present). An empty row (lse = -inf) gets +inf, so that P = exp2(s - lse)
  is 0 there, not inf. Stacked, so that a tile of both is one TMA.
  """
  if interpret is None:
    interpret = not versions.has_gpu()
  delta = row_delta(out, d_out, interpret=interpret)
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  lse_log2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
  return jnp.stack([lse_log2, delta], axis=2)


def cap_slope_ahead(static: BackwardStatic, capped: bool) -> bool:
  """`BackwardStatic.cap_slope_ahead` for a dK/dV kernel whose scores a
  cap alone changes (`capped`): where its step computes Pᵀ while dPᵀ's
  wgmma runs (`overlap_softmax`; the walks of shared rows and
  `scores_ahead` take no slope). The dQ kernel takes its slope after dP's
  wait: ahead, it lost (benchmarks/NOTES.md, "The soft cap on the plain
  backward")."""
  return bool(capped and static.overlap_softmax
              and not (static.shared_rows or static.scores_ahead))


def statics(query, key, *, scale: float, is_causal: bool,
            config: BackwardConfig, spec=None, alibi: bool = False,
            soft_cap: float | None = None):
  """(`dq_static`, `dkdv_statics`) of `config`'s kernels, or (None, [the
  fused pass]) with the fused dQ; `spec`: the ranged (masked) kernels' mask
  spec; `alibi`, `soft_cap`: the plain kernels' ALiBi and cap
  (`BackwardStatic.alibi_columns`, `.soft_cap`). Raises
  NotImplementedError for what the kernels lack."""
  if soft_cap is not None:  # `_score_change_config` cleared what it refuses
    dq_config, dkdv_configs = statics(query, key, scale=scale,
                                      is_causal=is_causal, config=config,
                                      alibi=alibi)
    return (dataclasses.replace(dq_config, soft_cap=float(soft_cap)),
            [dataclasses.replace(static, soft_cap=float(soft_cap),
                                 cap_slope_ahead=cap_slope_ahead(static,
                                                                 True))
             for static in dkdv_configs])
  tiles = dict(scale=scale, is_causal=is_causal, block_q=config.block_q,
               block_kv=config.block_kv,
               max_concurrent_steps=config.max_concurrent_steps, spec=spec,
               alibi=alibi)
  if spec is not None and (config.fused_dq or config.dq_tiles is not None):
    # The ranged kernels' plans classify blocks at the one pair of tiles.
    raise NotImplementedError(
        "the ranged backward has no fused dQ and no dq_tiles")
  if config.fused_dq:
    if config.persistent:
      raise NotImplementedError(
          "the fused dQ runs on the launch grid in its own order only: its "
          "K/V tiles wait for each other in order")
    if not config.overlap_softmax:
      raise NotImplementedError(
          "the fused dQ issues each step's dQ piece beside the next step's "
          "dV and dK: with overlap_softmax only")
    (fused,) = dkdv_statics(query, key, fused_dq=True, **tiles)
    return None, [dataclasses.replace(
        fused, overlap_softmax=True, prefetch_lse=bool(config.prefetch_lse))]
  if config.scores_ahead:
    _check_scores_ahead(config, is_causal=is_causal, spec=spec)
  options = _kernel_options(config)
  dq_tiles_args = tiles if config.dq_tiles is None else dict(
      tiles, block_q=config.dq_tiles[0], block_kv=config.dq_tiles[1])
  dq_config = dataclasses.replace(dq_static(query, key, **dq_tiles_args),
                                  **options)
  # The dK/dV kernel sees the K/V heads `gradients` gives it: with copies,
  # each walks group / copies query heads.
  copies = config.kv_head_copies or 1
  if copies > 1 and config.persistent:
    raise NotImplementedError("kv_head_copies: not on a persistent grid")
  dkdv_configs = [dataclasses.replace(
      static, **options, prefetch_lse=bool(config.prefetch_lse),
      scores_ahead=bool(config.scores_ahead))
                  for static in dkdv_statics(
                      query, _with_heads(key, key.shape[2] * copies),
                      shared_rows=config.shared_rows, **tiles)]
  for static in dkdv_configs if config.scores_ahead else ():
    if static.outputs != ("dk", "dv"):
      raise NotImplementedError(
          "scores_ahead: where dK and dV take one pass (not at head_dim "
          f"{static.head_dim} with block_q {static.block_q})")
  if config.persistent:
    batch, _, num_heads, _ = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    dq_config = _persistent(
        dq_config, config.num_ctas, num_heads=num_heads, batch=batch,
        tiles_per_head=pl.cdiv(query.shape[1], dq_config.q_rows_per_cta))
    dkdv_configs = [_persistent(
        static, config.num_ctas, num_heads=num_kv_heads, batch=batch,
        tiles_per_head=pl.cdiv(kv_len, static.kv_rows_per_cta))
                    for static in dkdv_configs]
  return dq_config, dkdv_configs


def _check_scores_ahead(config: BackwardConfig, *, is_causal: bool, spec):
  """NotImplementedError naming why the dK/dV kernel cannot issue Sᵀ a
  step ahead under `config`, if it cannot."""
  for refused, why in (
      (is_causal, "not under a causal mask (its masked steps)"),
      (config.shared_rows, "not with shared rows"),
      (spec is not None, "not in the ranged (masked) kernel"),
      (not config.overlap_softmax,
       "not without overlap_softmax (its walk always overlaps)"),
      (config.max_concurrent_steps < 2,
       "a ring of two stages or more (the next step's Q tile must arrive "
       "while this step's is held)")):
    if refused:
      raise NotImplementedError(f"scores_ahead: {why}")


def dq_static(query, key, *, scale, is_causal, block_q, block_kv,
              max_concurrent_steps, spec=None, alibi: bool = False,
              dbias_dtype=None) -> BackwardStatic:
  """The dQ kernel's configuration (`spec`: the ranged form's mask spec;
  `alibi`: the plain form's ALiBi; `dbias_dtype`: its dbias form,
  `BackwardStatic.dbias_dtype`)."""
  _, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  registers = _accumulator_registers((block_q, head_dim),
                                     (block_q, block_kv), (block_q, block_kv))
  if registers > _ACCUMULATOR_REGISTERS:
    raise NotImplementedError(
        f"dQ with block_q {block_q}, block_kv {block_kv} at head_dim "
        f"{head_dim} needs {registers} accumulator registers per thread; "
        f"at most {_ACCUMULATOR_REGISTERS} fit")
  num_kv_blocks = pl.cdiv(kv_len, block_kv)
  stages = min(max_concurrent_steps, num_kv_blocks)
  smem_of = lambda consumers: _smem_bytes(
      num_consumers=consumers, num_stages=stages, resident_rows=block_q,
      streamed_rows=block_kv, head_dim=head_dim,
      itemsize=jnp.dtype(query.dtype).itemsize, resident_stats=block_q,
      streamed_stats=0) + _ranged_smem_bytes(
          spec, num_consumers=consumers, num_stages=stages,
          resident_rows=block_q, streamed_rows=block_kv,
          num_heads=num_heads, itemsize=jnp.dtype(query.dtype).itemsize,
          alibi=alibi) + (
              0 if dbias_dtype is None else  # each consumer's dS tile
              consumers * block_q * block_kv * jnp.dtype(dbias_dtype).itemsize)
  return BackwardStatic(
      block_q=block_q, block_kv=block_kv,
      num_consumers=_num_consumers(_tiled_length(q_len, block_q, spec),
                                   block_q, smem_of),
      num_stages=stages, num_q_blocks=pl.cdiv(q_len, block_q),
      num_kv_blocks=num_kv_blocks, head_dim=head_dim,
      group=num_heads // num_kv_heads, scale=float(scale),
      scale_log2=float(scale) * LOG2E, is_causal=bool(is_causal),
      dtype=jnp.dtype(query.dtype), outputs=("dq",), spec=spec,
      alibi_columns=alibi, dbias_dtype=None if dbias_dtype is None else jnp.dtype(dbias_dtype))


def dbias_static(query, key, *, scale: float, config: BackwardConfig, spec,
                 dbias_dtype) -> BackwardStatic:
  """The dQ kernel's dbias form for the ranged kernels of `config`: its
  tiles and options, and as many consumers as its shared memory (each
  consumer's dS tile besides) allows."""
  static = dq_static(query, key, scale=scale, is_causal=spec.is_causal,
                     block_q=config.block_q, block_kv=config.block_kv,
                     max_concurrent_steps=config.max_concurrent_steps,
                     spec=spec, dbias_dtype=dbias_dtype)
  return dataclasses.replace(static, **_kernel_options(config))


def dkdv_statics(query, key, *, scale, is_causal, block_q, block_kv,
                 max_concurrent_steps, spec=None, alibi: bool = False,
                 fused_dq: bool = False,
                 shared_rows: bool = False) -> list[BackwardStatic]:
  """One pass computing dK and dV, or one pass each if registers demand;
  `fused_dq`: the one pass that also sums dQ (raises where there is none),
  its resident rows opaque where the zero's cell fits; `shared_rows`: the
  one pass with shared K/V rows (likewise); `alibi`: the plain form's
  ALiBi (neither of those)."""
  if alibi and (fused_dq or shared_rows):
    raise NotImplementedError("the plain dK/dV kernel takes ALiBi without "
                              "the fused dQ or shared rows")
  if shared_rows:
    return [_shared_rows_static(
        query, key, scale=scale, is_causal=is_causal, block_q=block_q,
        block_kv=block_kv, max_concurrent_steps=max_concurrent_steps,
        spec=spec)]
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
  if fused_dq and len(passes) > 1:
    raise NotImplementedError(
        f"the fused dQ needs dK and dV in one pass; with block_q {block_q}, "
        f"block_kv {block_kv} at head_dim {head_dim} they take two")
  group = num_heads // num_kv_heads
  num_q_blocks = pl.cdiv(q_len, block_q)
  stages = min(max_concurrent_steps, group * num_q_blocks)
  smem_of = lambda consumers: _smem_bytes(
      num_consumers=consumers, num_stages=stages, resident_rows=block_kv,
      streamed_rows=block_q, head_dim=head_dim,
      itemsize=jnp.dtype(query.dtype).itemsize, resident_stats=0,
      streamed_stats=block_q) + _ranged_smem_bytes(
          spec, num_consumers=consumers, num_stages=stages,
          resident_rows=block_kv, streamed_rows=block_q,
          num_heads=num_heads, itemsize=jnp.dtype(query.dtype).itemsize,
          alibi=alibi) + (
              fused_smem_bytes(
                  num_consumers=consumers, block_q=block_q,
                  block_kv=block_kv, head_dim=head_dim,
                  itemsize=jnp.dtype(query.dtype).itemsize)
              if fused_dq else 0)
  consumers = _num_consumers(_tiled_length(kv_len, block_kv, spec), block_kv,
                             smem_of)
  if fused_dq and (num_dq_pieces(block_q, head_dim) != consumers
                   or block_kv % DQ_PIECE or head_dim % DQ_PIECE):
    raise NotImplementedError(
        f"the fused dQ gives each of its consumers one [{DQ_PIECE}, "
        f"{DQ_PIECE}] piece of the [{block_q}, {head_dim}] dQ tile and "
        f"needs block_kv and head_dim multiples of {DQ_PIECE}; here "
        f"{consumers} consumers, block_kv {block_kv}")
  opaque = fused_dq and (
      smem_of(consumers) + ZERO_CELL_BYTES <= SMEM_LIMIT_BYTES)
  return [
      BackwardStatic(
          block_q=block_q, block_kv=block_kv, num_consumers=consumers,
          num_stages=stages, num_q_blocks=num_q_blocks,
          num_kv_blocks=pl.cdiv(kv_len, block_kv), head_dim=head_dim,
          group=group, scale=float(scale), scale_log2=float(scale) * LOG2E,
          is_causal=bool(is_causal), dtype=jnp.dtype(query.dtype),
          outputs=outputs, spec=spec, fused_dq=bool(fused_dq),
          opaque_resident=opaque, alibi_columns=alibi)
      for outputs in passes]


def _shared_rows_static(query, key, *, scale, is_causal, block_q, block_kv,
                        max_concurrent_steps, spec=None) -> BackwardStatic:
  """The dK/dV kernel with shared rows (`BackwardStatic.shared_rows`): two
  consumers on one resident copy of the CTA's K/V rows, in column parts,
  each with its column part of dK and dV and its part of the streamed Q
  rows' scores; the ring as usual; the parts of Pᵀ and dSᵀ exchanged."""
  _, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  consumers = _MAX_CONSUMERS
  itemsize = jnp.dtype(query.dtype).itemsize
  q_part, d_part = block_q // consumers, head_dim // consumers
  if spec is not None:
    raise NotImplementedError("the ranged backward has no shared K/V rows")
  if math.gcd(q_part, d_part) * itemsize % SWIZZLES[-1]:
    raise NotImplementedError(
        f"shared K/V rows split the {block_q} streamed rows and head_dim "
        f"{head_dim} between {consumers} consumers: both parts must be "
        f"whole tiles of one swizzle (`shared_rows.shared_transforms`), "
        f"at least {SWIZZLES[-1]} bytes wide")
  if kv_len % block_kv and not ragged_lengths(q_len, kv_len):
    raise NotImplementedError(
        f"kv_len {kv_len} must be a multiple of block_kv {block_kv} "
        f"(shared K/V rows)")
  scores = (block_kv, q_part)
  registers = _accumulator_registers(
      (block_kv, d_part), (block_kv, d_part), scores, scores)
  if registers > _ACCUMULATOR_REGISTERS:
    raise NotImplementedError(
        f"shared K/V rows with block_q {block_q}, block_kv {block_kv} at "
        f"head_dim {head_dim} need {registers} accumulator registers per "
        f"thread; at most {_ACCUMULATOR_REGISTERS} fit")
  group = num_heads // num_kv_heads
  num_q_blocks = pl.cdiv(q_len, block_q)
  stages = min(max_concurrent_steps, group * num_q_blocks)
  smem = _smem_bytes(
      num_consumers=1, num_stages=stages, resident_rows=block_kv,
      streamed_rows=block_q, head_dim=head_dim, itemsize=itemsize,
      resident_stats=0, streamed_stats=block_q) + (
          2 * block_kv * block_q * itemsize)  # the exchange
  check_shared_memory(
      smem, SMEM_LIMIT_BYTES,
      f"shared K/V rows with block_q {block_q}, block_kv {block_kv} at "
      f"head_dim {head_dim}")
  return BackwardStatic(
      block_q=block_q, block_kv=block_kv, num_consumers=consumers,
      num_stages=stages, num_q_blocks=num_q_blocks,
      num_kv_blocks=pl.cdiv(kv_len, block_kv), head_dim=head_dim,
      group=group, scale=float(scale), scale_log2=float(scale) * LOG2E,
      is_causal=bool(is_causal), dtype=jnp.dtype(query.dtype),
      outputs=("dk", "dv"), shared_rows=True)


def _persistent(static: BackwardStatic, num_ctas, *, tiles_per_head: int,
                num_heads: int, batch: int) -> BackwardStatic:
  """`static` on a persistent grid (`persistent_num_ctas`)."""
  if static.ranged:
    raise NotImplementedError("the ranged backward has no persistent grid")
  return dataclasses.replace(static, persistent=True,
                             num_ctas=persistent_num_ctas(
                                 num_ctas, paired=static.is_causal,
                                 num_tiles=batch * num_heads * tiles_per_head))


def _accumulator_registers(*shapes) -> int:
  """Registers per thread that f32 wgmma accumulators of `shapes` take."""
  return sum(m * n for m, n in shapes) // THREADS_PER_WARPGROUP


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


def _kernel_options(config: BackwardConfig) -> dict:
  """The `BackwardStatic` options that `config` sets on both kernels."""
  return dict(overlap_softmax=bool(config.overlap_softmax),
              tile_fastest=True, lean_producer=bool(config.lean_producer))


def _ranged_smem_bytes(spec, *, num_consumers, num_stages, resident_rows,
                       streamed_rows, num_heads, itemsize,
                       alibi: bool = False) -> int:
  """The ranged kernels' extra shared memory (for the plain ones each
  consumer's slopes with `alibi`, else 0): a plan row per warpgroup, with
  segment ids the int32 ids of each consumer's rows and of each ring slot,
  with ALiBi each consumer's slopes, with a bias each consumer's tile in
  q's dtype (`itemsize` bytes), with a dense mask each consumer's int8
  tile."""
  if spec is None:
    return num_consumers * slope_rows_bytes(num_heads) if alibi else 0
  extra = (num_consumers + 1) * PLAN_WIDTH * 4
  if spec.has_segments:
    extra += (num_consumers * resident_rows + num_stages * streamed_rows) * 4
  if spec.has_alibi:
    extra += num_consumers * slope_rows_bytes(num_heads)
  if spec.has_bias:
    extra += num_consumers * resident_rows * streamed_rows * itemsize
  if spec.has_dense_mask:
    extra += num_consumers * resident_rows * streamed_rows
  return extra


def _tiled_length(length: int, block: int, spec) -> int:
  """The length the grid's CTA tiles must divide: a length of whole tiles
  in the plain kernels; else (the ranged kernels mask a tail, the plain
  ones need no mask there, `common.ragged_lengths`) the length padded to
  whole tiles of `_MAX_CONSUMERS` consumers."""
  if spec is None and length % block == 0:
    return length
  return pl.cdiv(length, _MAX_CONSUMERS * block) * _MAX_CONSUMERS * block


def _num_consumers(length, block, smem_of) -> int:
  """Two consumer warpgroups if the length splits and shared memory allows.

  Two consumers share every streamed tile, halving that traffic; at
  head_dim 256 their resident tiles leave no room for a ring.
  """
  for consumers in (_MAX_CONSUMERS, 1):
    if length % (consumers * block) == 0 and (
        smem_of(consumers) <= SMEM_LIMIT_BYTES):
      return consumers
  raise NotImplementedError(
      f"the backward tiles need {smem_of(1)} bytes of shared memory even "
      f"with one consumer; sm90 has {SMEM_LIMIT_BYTES}")
