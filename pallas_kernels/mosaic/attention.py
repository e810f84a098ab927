"""The Mosaic kernels wired by `jax.custom_vjp`, as `jax_flash` calls them.

`flash_attention_mosaic`: `mosaic_forward` (wgmma, TMA, warp
specialisation) and `mosaic_backward`, falling back to the Triton family's
recomputing backward (it needs only the forward's q, k, v, o, lse) for
calls the Mosaic backward does not cover. With the Mosaic backward fwd+bwd
at seq 16k runs 1.07-1.26x faster than with the Triton one
(`benchmarks/results/h200_mosaic.md`), which is why the Triton backward is
no longer an option here.

`flash_attention_mosaic_masked`: the masked forward (`mosaic_forward_masked`:
window, q_offset, lengths, segment ids, soft cap, ALiBi, dropout, mask_fn,
score_fn, a bias, a dense mask, any lengths) with the masked Mosaic
backward (`mosaic_backward_masked`, dbias too, falling back to Triton's for
calls it does not cover): at seq 16k, d=128, fwd+bwd
of a causal 1k window 1.85 ms against 2.04 ms with the Triton backward,
soft cap 19.6 ms against 28.8 ms (`benchmarks/results/h200_masks_mosaic.md`).
`MASKED_KERNEL_ENABLED` and `MASKED_BACKWARD_ENABLED` route masks back to
the Triton kernels if either ever regresses.

`mosaic_attention` pads head dims the kernels do not take to the next they
do and picks the plain pair (any lengths, `_plain_attention`) or, for
masks, the masked one; `mosaic_attention_backward` gives its gradients
from given residuals.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.masking import MaskSpec
from pallas_kernels.masking import Operands
from pallas_kernels import compat
from pallas_kernels.config import BlockSizes
from pallas_kernels.mosaic.backward import (mosaic_backward,
                                           reads_rows_in_place,
                                           row_statistics)
from pallas_kernels.mosaic.common import (
    HEAD_DIM_MULTIPLE, SUPPORTED_HEAD_DIMS, TMA_ROW_TILE, ragged_lengths)
from pallas_kernels.mosaic.rows import rows_in_place
from pallas_kernels.mosaic.forward import mosaic_forward
from pallas_kernels.mosaic import plan
from pallas_kernels.mosaic.plan import backward_config, default_block_kv
from pallas_kernels.mosaic.masked import mosaic_forward_masked, pad_rows
from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
from pallas_kernels.triton.backward import flash_backward


# Masks on the masked Mosaic forward and backward (else the Triton kernels).
MASKED_KERNEL_ENABLED = True
MASKED_BACKWARD_ENABLED = True


def backward_tiles(head_dim: int, q_len: int) -> dict:
  """`mosaic_backward`'s tiles for a plain call of `head_dim` and `q_len`
  (its plan's: `plan.BACKWARD_PLAN`), as keyword arguments."""
  config = backward_config(head_dim=head_dim, is_causal=False, q_len=q_len,
                           kv_len=q_len)
  return dict(block_q=config.block_q, block_kv=config.block_kv)


def mosaic_attention(query, key, value, *, scale: float, is_causal: bool,
                     backward_blocks: BlockSizes,
                     spec: MaskSpec | None = None,
                     operands: Operands | None = None, bias=None,
                     sinks=None):
  """`flash_attention_mosaic` (or, for masks, the masked kernel) for any
  head dim up to 256 and any lengths (`_plain_attention`).

  `spec` and `operands` (`validation.Operands`) describe masks beyond
  `is_causal`, `bias` (None, or [B | 1, N | 1, Tq, Tk]) the spec's bias;
  without `MASKED_KERNEL_ENABLED` they raise NotImplementedError (the
  caller falls back to the Triton kernels). `sinks` (float32 [N] or None,
  differentiable) join every row's softmax denominator in the forward's
  epilogue (`masking.apply_sinks` after the fact, the same numbers).

  The kernels compute head dims that are multiples of 16 from 64 to 256
  at their own width; another is zero-padded to the next such (72 to 80,
  40 to 64: zero columns add nothing to q·k, and the padded output columns
  are dropped), as the Triton kernels pad inside theirs; the padding's
  gradient is the slice, by autodiff.

  Returns (out [B, Tq, N, D], lse float32 [B, N, Tq]).
  """
  head_dim = query.shape[-1]
  query, key, value = _pad_head_dim(query, key, value)
  operands = operands or Operands()
  if _masked(query, key, is_causal, spec, sinks):
    out, lse = flash_attention_mosaic_masked(query, key, value, bias,
                                             operands, scale, spec,
                                             backward_blocks, sinks)
  else:
    out, lse = _plain_attention(
        query, key, value, scale, is_causal, backward_blocks, sinks,
        _plain_soft_cap(spec, query.shape[-1]),
        _plain_alibi(spec, operands, is_causal, query.shape[-1], sinks))
  return out[..., :head_dim], lse


def _plain_attention(query, key, value, scale, is_causal, backward_blocks,
                     sinks, soft_cap=None, alibi_slopes=None):
  """`flash_attention_mosaic`, on rows zero-padded to whole 8-row TMA tiles
  where the lengths are not (`common.ragged_lengths`; a copy, as the
  masked kernels make): the forward masks the padded keys wherever a query
  may see them (`mosaic_forward(kv_len=)`), the backward needs no mask
  (zero K and V add nothing to dQ; the padded rows' gradients and outputs
  are sliced off, the padding's gradient by autodiff). Rows the kernels
  read in place (`rows.rows_in_place`: 16-bit rows of whole swizzle
  tiles) are not padded in either direction."""
  q_len, kv_len = query.shape[1], key.shape[1]
  if ragged_lengths(q_len, kv_len) or rows_in_place(
      q_len, kv_len, query.shape[-1], query.dtype):
    return flash_attention_mosaic(query, key, value, scale, is_causal,
                                  backward_blocks, sinks, None, soft_cap,
                                  alibi_slopes)
  query, key, value = (pad_rows(x) for x in (query, key, value))
  out, lse = flash_attention_mosaic(query, key, value, scale, is_causal,
                                    backward_blocks, sinks, kv_len, soft_cap,
                                    alibi_slopes)
  return out[:, :q_len], lse[:, :, :q_len]


def mosaic_attention_backward(query, key, value, out, lse, d_out, d_lse, *,
                              scale: float, is_causal: bool,
                              backward_blocks: BlockSizes,
                              spec: MaskSpec | None = None,
                              operands: Operands | None = None):
  """The gradients `mosaic_attention` gives, from given residuals.

  `out` [B, Tq, N, D] and `lse` float32 [B, N, Tq] need not come from this
  call's forward: from attention over more keys (merged K/V shards) the
  result is this call's share of that attention's gradient (see
  `jax_flash.residual_backward`). Same routing (plain or masked kernels)
  and head-dim padding as `mosaic_attention`; `d_lse` like `lse`.

  Returns (dq, dk, dv), shaped like (query, key, value).
  """
  head_dim = query.shape[-1]
  query, key, value, out, d_out = _pad_head_dim(query, key, value, out,
                                                d_out)
  residuals, cotangents = (query, key, value, out, lse), (d_out, d_lse)
  operands = operands or Operands()
  if _masked(query, key, is_causal, spec):
    dq, dk, dv, _, _, _ = _masked_bwd(
        scale, spec, backward_blocks, (*residuals, None, operands, None),
        cotangents)
  else:
    soft_cap = _plain_soft_cap(spec, query.shape[-1])
    alibi = _plain_alibi(spec, operands, is_causal, query.shape[-1])
    dq, dk, dv = _bwd(scale, is_causal, backward_blocks, None, soft_cap,
                      (*residuals, None, alibi), cotangents)[:3]
  return tuple(x[..., :head_dim] for x in (dq, dk, dv))


def _pad_head_dim(*arrays):
  """Zero-pads the last axis to the next head dim the kernels compute at
  its own width (`common.own_width_head_dim`: a multiple of 16, at least
  64). Zero columns add nothing to q·k, and padded output columns are
  dropped; the Triton kernels pad inside theirs."""
  head_dim = arrays[0].shape[-1]
  least, most = SUPPORTED_HEAD_DIMS[0], SUPPORTED_HEAD_DIMS[-1]
  if head_dim > most:
    raise NotImplementedError(
        f"the Mosaic kernels support head_dim up to {most}, got {head_dim}")
  width = max(least, -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE)
  if width == head_dim:
    return arrays
  pad = [(0, 0)] * 3 + [(0, width - head_dim)]
  return tuple(jnp.pad(x, pad) for x in arrays)


def _masked(query, key, is_causal: bool, spec: MaskSpec | None,
            sinks=None) -> bool:
  """Whether a call goes to the masked kernels: masks beyond `is_causal`.
  Plain calls of any lengths take the plain forward (the last K/V block
  masked past kv_len where a query may see there, `_plain_attention`):
  at ViT's 197 tokens, d=64, 55 TFLOP/s against the masked kernel's 43;
  at 1000, d=64/128/256, 327 / 436 / 439 against 253 / 360 / 408 (an
  H100, geomean of causal and not, h100_mosaic_ragged_forward_*.md).
  Their backward is the plain kernels' too (`_bwd`, benchmarks/NOTES.md,
  "Ragged lengths on the plain kernels")."""
  head_dim = query.shape[-1]
  if (spec is None or (spec.is_plain and spec.is_causal == is_causal)
      or _plain_soft_cap(spec, head_dim) is not None
      or _takes_plain_alibi(spec, is_causal, head_dim, sinks)):
    return False
  if not MASKED_KERNEL_ENABLED:
    raise NotImplementedError(
        "the masked Mosaic kernel is not enabled (MASKED_KERNEL_ENABLED); "
        f"masks run on the Triton kernels (got {spec})")
  return True


def _plain_soft_cap(spec: MaskSpec | None, head_dim: int) -> float | None:
  """The soft cap of a call the plain forward takes with it
  (`plan.PLAIN_SOFTCAP_HEAD_DIMS`, and `PLAIN_SOFTCAP_CAUSAL_HEAD_DIMS`
  under causal masking): one whose only change beyond `is_causal` and its
  lengths is the cap, at those (padded) head dims; else None."""
  if spec is None or spec.logits_soft_cap is None:
    return None
  if head_dim not in plan.PLAIN_SOFTCAP_HEAD_DIMS and not (
      spec.is_causal and head_dim in plan.PLAIN_SOFTCAP_CAUSAL_HEAD_DIMS):
    return None
  uncapped = dataclasses.replace(spec, logits_soft_cap=None)
  return spec.logits_soft_cap if uncapped.is_plain else None


def _plain_alibi(spec: MaskSpec | None, operands: Operands, is_causal: bool,
                 head_dim: int, sinks=None):
  """The ALiBi slopes (float32 [batch, num_heads]) of a call the plain
  kernels take with them (`_takes_plain_alibi`), else None."""
  if not _takes_plain_alibi(spec, is_causal, head_dim, sinks):
    return None
  return operands.alibi_slopes


def _takes_plain_alibi(spec: MaskSpec | None, is_causal: bool, head_dim: int,
                       sinks=None) -> bool:
  """Whether the plain kernels take the call's ALiBi as column terms
  (`plan.PLAIN_ALIBI_HEAD_DIMS`): its only change beyond a top-left
  `is_causal` and its lengths, without sinks."""
  if (spec is None or not spec.has_alibi or not is_causal
      or sinks is not None
      or plan.plan_head_dim(head_dim) not in plan.PLAIN_ALIBI_HEAD_DIMS):
    return False
  return dataclasses.replace(spec, has_alibi=False) == MaskSpec(
      q_len=spec.q_len, kv_len=spec.kv_len, is_causal=True)


def _plain_cap_backward(head_dim: int) -> bool:
  """Whether a soft cap alone takes the plain backward kernels
  (`plan.PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS`), whichever forward ran."""
  return plan.plan_head_dim(head_dim) in plan.PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS


def _divides(query, key) -> bool:
  """Whether the plain kernels' tiles divide the lengths."""
  return (query.shape[1] % (2 * 64) == 0
          and key.shape[1] % default_block_kv(query.shape[-1]) == 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 7, 8))
def flash_attention_mosaic(query, key, value, scale: float, is_causal: bool,
                           backward_blocks: BlockSizes, sinks=None,
                           kv_len: int | None = None,
                           soft_cap: float | None = None, alibi_slopes=None):
  """Exact attention on sm90; returns (out [B, Tq, N, D], lse f32 [B, N, Tq]).

  `backward_blocks` are the Triton backward's tiles, for the calls the
  Mosaic backward does not cover. `sinks`: float32 [N] or None, in the
  forward's epilogue; `kv_len`: key's rows past it are zero padding
  (`mosaic_forward`'s); `soft_cap`: None or the logits' cap
  (`plan.PLAIN_SOFTCAP_HEAD_DIMS`), whose gradients the masked backward
  gives; `alibi_slopes`: None or float32 [B, N], causal ALiBi in the plain
  kernels both ways (`_takes_plain_alibi`; not differentiated).
  """
  return mosaic_forward(query, key, value, scale=scale, is_causal=is_causal,
                        sinks=sinks, kv_len=kv_len, soft_cap=soft_cap,
                        alibi_slopes=alibi_slopes)


def _fwd(query, key, value, scale, is_causal, backward_blocks, sinks, kv_len,
         soft_cap, alibi_slopes):
  out, lse = flash_attention_mosaic(query, key, value, scale, is_causal,
                                    backward_blocks, sinks, kv_len, soft_cap,
                                    alibi_slopes)
  return (out, lse), (query, key, value, out, lse, sinks, alibi_slopes)


def _bwd(scale, is_causal, backward_blocks, kv_len, soft_cap, residuals,
         cotangents):
  """The plain backward kernels; under a soft cap, or on a call they do
  not cover, the masked ones, else Triton's. `kv_len` goes
  unused: padded keys are zero, so where a real query sees one (not
  causal, or q_len > kv_len) its dS times K adds nothing to dQ, and dV and
  dK of those rows are sliced off; padded query rows carry zero dO and
  d_lse, so their dS is zero. The real rows' gradients are those of the
  unpadded call, given the forward's lse (which masked the padding)."""
  del kv_len
  query, key, value, out, lse, sinks, alibi_slopes = residuals
  d_out, d_lse = cotangents
  q_len, kv_rows = query.shape[1], key.shape[1]
  if not (ragged_lengths(q_len, kv_rows)
          or reads_rows_in_place(query, key, is_causal)):
    # Lengths off the 8-row TMA tiling whose rows the backward kernels do
    # not read in place: a forward's in place on the fused dQ's or shared
    # rows' plan, or `mosaic_attention_backward`'s residuals. Padded rows
    # carry zero dO and d_lse, so nothing of theirs reaches a real row's
    # gradient (above), and their LSE of 0 keeps P finite.
    pad_lse = lambda x: jnp.pad(x, ((0, 0), (0, 0),
                                    (0, -q_len % TMA_ROW_TILE)))
    dq, dk, dv, d_sinks, _ = _bwd(
        scale, is_causal, backward_blocks, None, soft_cap,
        (*map(pad_rows, (query, key, value, out)), pad_lse(lse), sinks,
         alibi_slopes),
        (pad_rows(d_out), pad_lse(d_lse)))
    return dq[:, :q_len], dk[:, :kv_rows], dv[:, :kv_rows], d_sinks, None
  d_sinks = sink_gradient(sinks, out, lse, d_out, d_lse)
  if soft_cap is None or _plain_cap_backward(query.shape[-1]):
    try:
      return (*mosaic_backward(query, key, value, out, lse, d_out, d_lse,
                               scale=scale, is_causal=is_causal,
                               alibi_slopes=alibi_slopes, soft_cap=soft_cap),
              d_sinks, None)
    except NotImplementedError:
      pass  # a call the plain kernels do not cover: the masked ones'
  spec = MaskSpec(q_len=query.shape[1], kv_len=key.shape[1],
                  is_causal=is_causal, logits_soft_cap=soft_cap,
                  has_alibi=alibi_slopes is not None)
  if MASKED_BACKWARD_ENABLED and (soft_cap is not None
                                  or alibi_slopes is not None
                                  or not _divides(query, key)):
    try:  # a soft cap, ALiBi, or tiles the plain kernels do not cover
      return (*mosaic_backward_masked(query, key, value, out, lse, d_out,
                                      d_lse, scale=scale, spec=spec,
                                      alibi_slopes=alibi_slopes)[:3],
              d_sinks, None)
    except NotImplementedError:
      pass
  with compat.quiet_triton_deprecation():
    dq, dk, dv, _ = flash_backward(
        query, key, value, out, lse, d_out, d_lse,
        Operands(alibi_slopes=alibi_slopes), None, scale=scale, spec=spec,
        block_sizes=backward_blocks, interpret=False)
  return dq, dk, dv, d_sinks, None


def sink_gradient(sinks, out, lse, d_out, d_lse):
  """d loss / d sinks [N] (None without sinks), from the forward's out
  [B, Tq, N, D] and lse [B, N, Tq] with the sinks in them.

  A sink is a logit in every row's denominator with nothing in the
  numerator: its weight p = exp(sink - lse) scales O down (dO/dsink = -p O)
  and raises the LSE (dlse/dsink = p), so dsink = sum over rows of
  p (d_lse - rowsum(d_out * out)). The kernels' gradients of q, k and v
  need nothing more: out and lse already hold the sinks (P = exp(s - lse)
  is the sink-normalised weight, and rowsum(d_out * out) its delta).
  rowsum(d_out * out) - d_lse is the backward's own row statistic
  (`backward.row_statistics`, the same call on the same operands as the
  backward kernels').
  """
  if sinks is None:
    return None
  delta = row_statistics(out, lse, d_out, d_lse)[:, :, 1]  # minus d_lse
  weight = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
  return -jnp.sum(weight * delta, axis=(0, 2)).astype(sinks.dtype)


flash_attention_mosaic.defvjp(_fwd, _bwd)


def masked_operand_kwargs(operands: Operands) -> dict:
  """The masked Mosaic kernels' keyword operands (q_offset, q_lengths,
  kv_lengths: int32 [batch] or None; the segment ids; the ALiBi slopes,
  float32 [batch, num_heads]; the dropout seed, int32 []; mask_fn's
  `masking.BlockMask`; the dense mask, bool [B | 1, N | 1, Tq, Tk]) from
  `operands`."""
  return dict(q_offset=operands.q_offset, q_lengths=operands.q_lengths,
              kv_lengths=operands.kv_lengths,
              q_segments=operands.q_segments,
              kv_segments=operands.kv_segments,
              alibi_slopes=operands.alibi_slopes,
              dropout_seed=operands.dropout_seed,
              block_mask=operands.block_mask,
              dense_mask=operands.dense_mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def flash_attention_mosaic_masked(query, key, value, bias, operands: Operands,
                                  scale: float, spec: MaskSpec,
                                  backward_blocks: BlockSizes, sinks=None):
  """`mosaic_forward_masked`; gradients, dbias among them, by
  `mosaic_backward_masked` while `MASKED_BACKWARD_ENABLED`, else (or where
  it raises NotImplementedError) by the Triton backward for the same
  `spec`.

  `bias` is None or [B | 1, N | 1, Tq, Tk] (differentiable); `operands`
  carries q_offset, q_lengths, kv_lengths (int32 [batch]), the segment
  ids, the ALiBi slopes (float32 [batch, num_heads]), the dropout seed
  (int32 []), mask_fn's BlockMask and the dense mask (the forward's);
  `sinks` as `flash_attention_mosaic`'s; returns (out [B, Tq, N, D], lse
  float32 [B, N, Tq]).
  """
  return mosaic_forward_masked(query, key, value, scale=scale, spec=spec,
                               bias=bias, sinks=sinks,
                               **masked_operand_kwargs(operands))


def _masked_fwd(query, key, value, bias, operands, scale, spec,
                backward_blocks, sinks):
  out, lse = flash_attention_mosaic_masked(query, key, value, bias, operands,
                                           scale, spec, backward_blocks,
                                           sinks)
  return (out, lse), (query, key, value, out, lse, bias, operands, sinks)


def _masked_bwd(scale, spec, backward_blocks, residuals, cotangents):
  query, key, value, out, lse, bias, operands, sinks = residuals
  d_out, d_lse = cotangents
  cap = spec.logits_soft_cap
  if (cap is not None and _plain_cap_backward(query.shape[-1])
      and dataclasses.replace(spec, logits_soft_cap=None).is_plain):
    # A cap alone: the plain kernels' backward on the masked forward's
    # residuals (`plan.PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS`).
    dq, dk, dv, d_sinks, _ = _bwd(
        scale, spec.is_causal, backward_blocks, None, cap,
        (query, key, value, out, lse, sinks, None), cotangents)
    return dq, dk, dv, None, None, d_sinks
  d_sinks = sink_gradient(sinks, out, lse, d_out, d_lse)
  if MASKED_BACKWARD_ENABLED:
    try:
      dq, dk, dv, dbias = mosaic_backward_masked(
          query, key, value, out, lse, d_out, d_lse, scale=scale, spec=spec,
          bias=bias, **masked_operand_kwargs(operands))
      return dq, dk, dv, dbias, None, d_sinks
    except NotImplementedError:
      pass  # a call the masked Mosaic backward does not cover: Triton's
  with compat.quiet_triton_deprecation():
    dq, dk, dv, dbias = flash_backward(
        query, key, value, out, lse, d_out, d_lse, operands, bias,
        scale=scale, spec=spec, block_sizes=backward_blocks, interpret=False)
  return dq, dk, dv, dbias, None, d_sinks


flash_attention_mosaic_masked.defvjp(_masked_fwd, _masked_bwd)
