"""The forward's warpgroups: what each computes, step by step.

A CTA of `num_consumers + 1` warpgroups computes `num_consumers * block_q`
query rows of one (batch, head) (`forward_kernel`), or, on the persistent
grid, such tiles one after another (`forward_persistent.py`):

  consumers   warpgroups 0, 1 (and 2): each loads its `block_q` rows of Q
              and walks the K/V blocks they see (`consume`): S = Q Kᵀ by
              wgmma, the online softmax (`softmax.py`; masked on the blocks
              that straddle the diagonal, or as the plan row says in the
              ranged form), O += P V by wgmma, taking turns on the tensor
              cores with the other consumers (`turns.py`); then O,
              normalised, and the LSE leave through shared memory by TMA.
  producer    the last warpgroup, at few registers: streams K and V tiles
              by TMA into the ring of `num_stages` slots (`_produce`),
              refilling a slot once every consumer that reads it released
              it. Its barriers per slot:

                k_arrived[s], v_arrived[s]   TMA completion (-> consumers)
                k_consumed[w * num_stages + s], v_consumed[...]
                                             consumer w is done (-> producer)

              Per consumer, so that under causal masking a consumer with
              fewer K/V blocks simply stops arriving and the producer stops
              waiting for it: no flush loop is needed.

On the persistent grid `consume` computes one tile of the walk (`Tile`),
its ring slots counting on from the tiles before.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import masking
from pallas_kernels.mosaic import turns
from pallas_kernels.mosaic.common import (
    LOG2E, PLAN_DROPOUT_SEED, PLAN_SCALARS, PLAN_TILE, PLAN_UNION, PlanRow,
    ScoreTiles, SlopeRows, alibi_column_terms, alibi_row_terms, causal_mask,
    chained_tiles, copy_slopes, dropout_key_hashes, dropout_kept,
    dropout_query_hashes, fp8_operand, masked_steps, per_column, per_row,
    read_plan, register_split, slope_reader, tile_index, tile_indices,
    variant_mask)
from pallas_kernels.mosaic.forward_static import (
    MMA_SUM_COLUMNS, NUM_CONSUMERS, KernelStatic)
from pallas_kernels.mosaic.rows import (
    RowViews, copy_rows_in, copy_rows_out, wgmma)
from pallas_kernels.mosaic.softmax import add_unfused, exponentiate, rescale

_LN2 = math.log(2.0)
# The FP8 descale row is copied as [n / 32, 32] floats: a TMA copies at most
# 256 elements along each dimension (1-D it would cap seq near 8k), and a
# row of 32 floats is 128 bytes, a whole number of the warpgroup's copies.
DESCALE_WIDTH = 32

# The FP8 kernel stages O in its output dtype through a buffer of its own
# (an FP8 Q buffer is half O's size), at most this many columns wide: a
# wider O leaves in column pieces, one after another through the buffer.
# At head_dim 256 that halves the buffer (64 KiB -> 32 KiB for two
# consumers), which 128-row K/V tiles need (FlashAttention-3's FP8 tile
# there); the wait for each piece's store to leave it costs once per tile.
FP8_O_COLUMNS = 128


def fp8_o_columns(head_dim: int) -> int:
  """Columns of the FP8 kernel's O buffer (`FP8_O_COLUMNS`)."""
  return min(head_dim, FP8_O_COLUMNS)


def consumer_rows(tile_start, wg, static: KernelStatic):
  """First query row of consumer `wg` in the tile that starts at `tile_start`.

  Two consumers: `tile_start + wg * block_q` (tiles are whole). More: the
  last tile of a (batch, head) may be short, and a consumer whose rows
  would start at or past q_len takes the last block_q rows instead. It
  stores nothing, and walks their K/V blocks without math
  (`KernelStatic.skip_spare`, the default without a causal mask) or
  computes them again, bitwise as their owner does (a row's sums do not
  depend on the consumer); later consumers never start before earlier
  ones, so the last still reads the most K/V blocks.
  """
  start = tile_start + wg * static.block_q
  if static.num_consumers == NUM_CONSUMERS:
    return start
  return jnp.minimum(start, static.q_len - static.block_q)


def num_kv_steps(q_start, static: KernelStatic):
  """K/V blocks that rows [q_start, q_start + block_q) attend to."""
  if not static.is_causal:
    return static.num_kv_blocks
  last_row = q_start + static.block_q
  return jnp.minimum(pl.cdiv(last_row, static.block_kv), static.num_kv_blocks)


def _num_unmasked_steps(q_start, num_steps, static: KernelStatic):
  """Leading K/V blocks that need no mask: that lie wholly at or below the
  diagonal, and are not the partial last block of a key tail
  (`static.key_tail`).

  Block j needs no causal mask when its last key, (j + 1) * block_kv - 1, is
  at most the first query row, q_start.
  """
  unmasked = num_steps
  if static.is_causal:
    unmasked = jnp.minimum((q_start + 1) // static.block_kv, num_steps)
  if static.key_tail:
    unmasked = jnp.minimum(unmasked, static.num_kv_blocks - 1)
  return unmasked


def _plain_mask(q_start, step, static: KernelStatic):
  """[block_q, block_kv] of a masked step of the plain form: True where
  query q_start + r may attend key step * block_kv + c (causal masking, and
  keys before kv_len where `static.key_tail`)."""
  mask = causal_mask(q_start, step, static) if static.is_causal else None
  if static.key_tail:
    cols = plgpu.broadcasted_iota(jnp.int32, (static.block_q,
                                              static.block_kv), 1,
                                  layout=plgpu.Layout.WGMMA)
    kept = cols < static.kv_len - step * static.block_kv
    mask = kept if mask is None else mask & kept
  return mask


class Fp8Refs(NamedTuple):
  """One consumer's extra refs in the FP8 kernel."""
  descale_gmem: Any    # float32 [n / 32, 32]: this (batch, head)'s factors
  descale_smem: Any    # float32 [n / 32, 32]
  descale_arrived: Any
  o_smem: Any          # [block_q, fp8_o_columns(head_dim)] in the output
                       # dtype


class SegmentRefs(NamedTuple):
  """The ranged kernel's segment ids (`spec.has_segments`)."""
  q_gmem: Any        # int32 [q_len] of this batch
  kv_gmem: Any       # int32 [kv_len] of this batch
  q_smem: Any        # int32 [consumers, block_q]
  q_arrived: Any     # barriers [consumers]
  kv_smem: Any       # int32 [stages, block_kv]: streamed with K
  kv_arrived: Any    # barriers [stages]


class Tile(NamedTuple):
  """A persistent CTA's current tile, as `consume` needs it."""
  base: Any         # global index of the tile's first K/V block: the ring
                    # slot and barrier phase go on from the previous tile
  load_next_q: Any  # () -> None: issues the next tile's Q load, if any
  o_smem: Any       # [block_q, head_dim]: where O is staged (Q's buffer
                    # unless `static.stage_o_apart`)


class KernelRefs(NamedTuple):
  """`forward.launch`'s refs by name (None where the kernel's form has
  none): inputs, outputs, then scratch, in `launch`'s order."""
  q: Any
  k: Any
  v: Any
  descale: Any      # FP8
  plan: Any         # ranged: int32 [batch * plan_heads, tiles, PLAN_WIDTH]
  q_ids: Any        # segments: int32 [batch, q_len]
  kv_ids: Any       #           int32 [batch, kv_len]
  slopes: Any       # ALiBi: `common.slope_rows`
  bias: Any
  dense_mask: Any
  sinks: Any        # `forward.sink_rows`
  out: Any
  lse: Any
  common: tuple     # the 10 scratch refs every form has
  fp8: tuple | None         # O, descale rows, their barriers
  plan_rows: tuple | None   # ranged: plan rows' SMEM, their barriers
  o_apart: tuple | None     # `stage_o_apart`: O's and the LSE's buffers
  segments: tuple | None    # query ids, barriers, key ids, barriers
  slope_rows: tuple | None  # ALiBi: SMEM, barriers
  bias_tiles: tuple | None
  dense_tiles: tuple | None
  sink_rows: tuple | None
  ones: Any = None          # `mma_row_sum`: [consumers, block_kv, 16]


def kernel_refs(refs, static: KernelStatic) -> KernelRefs:
  """Names `refs`: q, k, v, [descale (FP8)], [plan (ranged)], [q ids, kv
  ids (segments)], [slopes (ALiBi)], [bias], [dense mask], [sinks], out,
  lse, the 10 common scratch refs, [FP8's 3], [ranged's 2], [O and LSE
  staged apart, 2], [segments' 4], [ALiBi's 2], [bias' 2], [dense mask's
  2], [the ones tiles (`mma_row_sum`)], [sinks' 2]."""
  ranged = static.ranged
  segmented = ranged and static.spec.has_segments
  has = dict(alibi=static.takes_slopes,
             bias=ranged and static.spec.has_bias,
             dense=ranged and static.spec.has_dense_mask)
  refs = iter(refs)

  def take(n, present=True):
    if not present:
      return None
    taken = tuple(next(refs) for _ in range(n))
    return taken[0] if n == 1 else taken

  q, k, v = take(3)
  descale, plan = take(1, static.fp8), take(1, ranged)
  q_ids, kv_ids = take(2, segmented) or (None, None)
  slopes, bias, dense_mask = (take(1, has[x]) for x in ("alibi", "bias",
                                                         "dense"))
  sinks = take(1, static.sinks)
  out, lse = take(2)
  named = KernelRefs(
      q, k, v, descale, plan, q_ids, kv_ids, slopes, bias, dense_mask, sinks,
      out, lse, common=take(10), fp8=take(3, static.fp8),
      plan_rows=take(2, ranged), o_apart=take(2, static.stage_o_apart),
      segments=take(4, segmented), slope_rows=take(2, has["alibi"]),
      bias_tiles=take(2, has["bias"]), dense_tiles=take(2, has["dense"]),
      ones=take(1, static.mma_row_sum), sink_rows=take(2, static.sinks))
  if next(refs, None) is not None:
    raise ValueError("more refs than the kernel's form takes")
  return named


def segment_refs_of(refs: KernelRefs, batch) -> SegmentRefs | None:
  """The ranged kernel's segment ids of `batch`, where it has them."""
  if refs.segments is None:
    return None
  return SegmentRefs(refs.q_ids.at[batch], refs.kv_ids.at[batch],
                     *refs.segments)


def mask_operands(refs: KernelRefs, static: KernelStatic, batch) -> dict:
  """`consume`'s mask operands for a tile of `batch`: its segment ids,
  ALiBi slopes (ranged, or the plain form's `alibi_columns`), bias and
  dense-mask tiles (None where it has none)."""
  operands = dict(segments=segment_refs_of(refs, batch), slopes=None,
                  bias=None, dense_mask=None)
  if refs.slopes is not None:
    operands["slopes"] = SlopeRows(refs.slopes.at[batch], *refs.slope_rows)
  if refs.bias is not None:
    operands["bias"] = ScoreTiles.of(refs.bias, refs.bias_tiles, batch,
                                     static.bias_repeats)
  if refs.dense_mask is not None:
    operands["dense_mask"] = ScoreTiles.of(refs.dense_mask,
                                           refs.dense_tiles, batch)
  return operands


def forward_kernel(*refs, static: KernelStatic):
  """Kernel body on the launch grid: one CTA a tile; refs as `kernel_refs`
  names them."""
  refs = kernel_refs(refs, static)
  q_ref, k_ref, v_ref = refs.q, refs.k, refs.v
  out_ref, lse_ref = refs.out, refs.lse
  sinks = None
  if static.sinks:
    sinks = SlopeRows(refs.sinks, *refs.sink_rows)
  (q_smem, k_smem, v_smem, lse_smem, q_arrived, k_arrived, v_arrived,
   k_consumed, v_consumed, pingpong) = refs.common
  q_smem, k_smem, v_smem = (RowViews.of(x, static)
                            for x in (q_smem, k_smem, v_smem))
  if static.fp8:
    descale_ref = refs.descale
    o_smem, descale_smem, descale_arrived = refs.fp8
  batch = lax.axis_index("batch")
  head = lax.axis_index("head")
  wg = lax.axis_index("wg")
  num_q_tiles = pl.cdiv(q_ref.shape[1], static.tile_rows)
  # The ranged kernel's CTA reads its tile from its plan row (heaviest
  # first, `masked.tile_plans`).
  q_tile = tile_index("q_tile", num_q_tiles, reverse=(
      static.is_causal and not static.ranged))
  tile_start = None if static.ranged else q_tile * static.tile_rows
  plan = None
  if static.ranged:
    plan_row = batch if static.plan_heads == 1 else (
        batch * static.plan_heads + head)
    plan = PlanRow(refs.plan.at[plan_row, q_tile], *refs.plan_rows)
  masks = mask_operands(refs, static, batch)
  slopes = masks["slopes"]

  consumer_registers, producer_registers = register_split(
      lean=False, num_consumers=static.num_consumers)

  @pl.when(wg < static.num_consumers)
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    turns.seed_turns(pingpong, wg, static)
    if static.fp8:
      fp8 = Fp8Refs(descale_ref.at[batch, head], descale_smem.at[wg],
                     descale_arrived.at[wg], o_smem.at[wg])
    else:
      fp8 = None
    sink_of = None
    if sinks is not None:  # in flight until the epilogue waits for it
      copy_slopes(sinks, wg)
      sink_of = lambda head: slope_reader(sinks, wg)(head)
    read = None
    if slopes is not None:  # in flight while the plan row (or Q) loads
      copy_slopes(slopes, wg)
    if plan is not None:
      read = read_plan(plan, wg)
    consume(q_ref, out_ref, lse_ref, q_smem.at[wg], k_smem, v_smem,
            lse_smem.at[wg], q_arrived.at[wg], k_arrived, v_arrived,
            k_consumed, v_consumed, turns.turns_of(pingpong, static),
            batch=batch, head=head, wg=wg, tile_start=tile_start,
            static=static, fp8=fp8, plan=read, sink_of=sink_of,
            ones=None if refs.ones is None else refs.ones.at[wg], **masks)

  @pl.when(wg == static.producer)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")
    _produce(k_ref, v_ref, k_smem, v_smem, k_arrived, v_arrived, k_consumed,
             v_consumed, batch=batch, kv_head=head // static.group,
             tile_start=tile_start, static=static, plan=plan,
             segments=masks["segments"])


def load_kv_block(rows, slot, ref, smem, arrived, *, k_ref, batch, kv_head,
                  static: KernelStatic, segments: SegmentRefs | None):
  """The producer's TMA of K or V (`ref`) rows `rows` (a block,
  `_kv_rows`) into ring slot `slot`; with K, its key ids (`segments`)."""
  if static.fp8 and ref is not k_ref:  # V transposed: [B, Hkv, D, T]
    block = ref.at[batch, kv_head, :, rows]
  else:
    block = ref.at[batch, rows, kv_head]
  copy_rows_in(block, smem.at[slot], arrived.at[slot])
  if segments is not None and ref is k_ref:  # key ids travel with K
    plgpu.copy_gmem_to_smem(segments.kv_gmem.at[rows],
                            segments.kv_smem.at[slot],
                            segments.kv_arrived.at[slot])


def _produce(k_ref, v_ref, k_smem, v_smem, k_arrived, v_arrived, k_consumed,
             v_consumed, *, batch, kv_head, tile_start, static: KernelStatic,
             plan: PlanRow | None, segments: SegmentRefs | None):
  """Producer warpgroup: TMA K/V block j into ring slot j % num_stages.

  Ranged kernel: blocks [first, total) of the plan's union, block j into
  slot (j - first) % num_stages; every consumer walks all of them.
  """
  stages = static.num_stages
  # Consumer w reads blocks [0, steps[w]); a later consumer's rows come
  # later, so it reads at least as many blocks as an earlier one.
  first = 0
  if plan is None:
    steps = [num_kv_steps(consumer_rows(tile_start, w, static), static)
             for w in range(static.num_consumers)]
    total = steps[-1]
  else:
    read = read_plan(plan, static.producer)
    first, total = read(PLAN_UNION), read(PLAN_UNION + 1)

  def load(step, slot, ref, smem, arrived):
    load_kv_block(_kv_rows(step, static), slot, ref, smem, arrived,
                  k_ref=k_ref, batch=batch, kv_head=kv_head, static=static,
                  segments=segments)

  def wait_consumed(consumed, step, slot):
    # The slot held block step - stages; wait for every consumer that read it.
    for w in range(static.num_consumers):
      if static.is_causal and plan is None:
        pl.when(step - stages < steps[w])(
            functools.partial(plgpu.barrier_wait,
                              consumed.at[w * stages + slot]))
      else:
        plgpu.barrier_wait(consumed.at[w * stages + slot])

  # Fill the ring. Under causal masking an early tile may need fewer blocks
  # than there are stages.
  for i in range(stages):
    def fill(i=i):
      load(first + i, i, k_ref, k_smem, k_arrived)
      load(first + i, i, v_ref, v_smem, v_arrived)
    if static.is_causal or plan is not None:
      pl.when(first + i < total)(fill)
    else:
      fill()

  @pl.loop(first + stages, total)
  def _refill(step):
    slot = lax.rem(step if plan is None else step - first, stages)
    # K before V: consumers need K_j first (S = Q K_jᵀ) and release it first.
    wait_consumed(k_consumed, step, slot)
    load(step, slot, k_ref, k_smem, k_arrived)
    wait_consumed(v_consumed, step, slot)
    load(step, slot, v_ref, v_smem, v_arrived)


def _kv_rows(step, static: KernelStatic):
  """K/V rows of block `step`. With a ragged tail (`static.ragged_tail`) a
  static start whose block reaches past K's rows is made a traced value
  (plus a traced zero): Pallas refuses a static slice past the array's
  end, where TMA reads zeros, and `pl.multiple_of` alone does not make one
  (under warpgroup lowering it fails on a constant). (The FP8 kernel's K
  and V come in whole blocks: under warpgroup lowering Mosaic GPU's FP8
  copies do not take such a start.)"""
  start = step * static.block_kv
  if (static.ragged_tail and isinstance(start, int)
      and start + static.block_kv > static.key_rows):
    start = pl.multiple_of(lax.axis_index("wg") * 0 + start,
                           static.block_kv)
  return pl.ds(start, static.block_kv)


def consume(q_ref, out_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem,
            q_arrived, k_arrived, v_arrived, k_consumed, v_consumed,
            pingpong, *, batch, head, wg, tile_start, static: KernelStatic,
            fp8: Fp8Refs | None, plan,
            segments: SegmentRefs | None = None, tile: Tile | None = None,
            slopes: SlopeRows | None = None, bias: ScoreTiles | None = None,
            dense_mask: ScoreTiles | None = None, sink_of=None, ones=None):
  """Consumer warpgroup `wg`: rows [q_start, q_start + block_q) of the tile.

  `sink_of` (`static.sinks`): head -> its sink logit, read in the epilogue.
  `ones` (`static.mma_row_sum`): this consumer's [block_kv, 16] tile of
  ones in shared memory, which P V's P is multiplied by for l_pv.
  `plan` (ranged kernel): index -> that entry of the tile's plan row, read
  from shared memory (`read_plan`; the ALiBi slopes' copy already issued).

  Persistent grid (`tile` given; the plain form): Q was loaded by the
  previous tile (or the kernel's prologue), ring slots count on from
  `tile.base`, and O's store is left in flight for the next tile to
  overlap.

  Ranged kernel: the tile is the plan row's (`tile_start` None), and both
  consumers walk every block of the plan's union (a block outside its own
  range is a skip: its barriers, no math), so that each barrier's phase
  advances alike in every thread, and take turns at every step.
  """
  block_q, block_kv = static.block_q, static.block_kv
  if plan is not None:
    read = plan
    tile_start = read(PLAN_TILE) * static.tile_rows
  q_start = consumer_rows(tile_start, wg, static)
  q_rows = pl.ds(q_start, block_q)
  alibi_slope = None  # `static.alibi_columns`: this head's
  if plan is None:
    first = first_computed = 0
    num_steps = num_kv_steps(q_start, static)
    num_unmasked = _num_unmasked_steps(q_start, num_steps, static)
    # Steps in which every consumer runs and so takes turns: all of
    # warpgroup 0's (it never has more blocks than a later one).
    num_shared = num_kv_steps(tile_start, static)
    if tile is None:
      slot_of = lambda step: lax.rem(step, static.num_stages)
    else:
      slot_of = lambda step: lax.rem(tile.base + step, static.num_stages)
  else:
    lo, unmasked_lo, unmasked_hi, hi = (read(wg * 4 + i) for i in range(4))
    first, num_steps = read(PLAN_UNION), read(PLAN_UNION + 1)
    first_computed = lo  # this consumer's range is [lo, hi) of the union
    values = masking.MaskValues(q_offset=read(PLAN_SCALARS),
                                q_lengths=read(PLAN_SCALARS + 1),
                                kv_lengths=read(PLAN_SCALARS + 2))
    if static.spec.reads_batch_and_head:  # mask_fn's, score_fn's b and h
      values = values._replace(batch=batch, head=head)
    if slopes is not None:  # this head's, for every tile it visits
      alibi_slope = slope_reader(slopes, wg)(head)
      values = values._replace(alibi_slope=alibi_slope)
    if static.spec.dropout_rate:  # the rows' half of the hash, once
      query_hashes = dropout_query_hashes(
          read(PLAN_DROPOUT_SEED), batch, head, q_start, block_q,
          plgpu.Layout.WGMMA.reduce(1))
    slot_of = lambda step: lax.rem(step - first, static.num_stages)
    if segments is not None:
      q_ids_smem = segments.q_smem.at[wg]
      plgpu.copy_gmem_to_smem(segments.q_gmem.at[q_rows], q_ids_smem,
                              segments.q_arrived.at[wg])
      plgpu.barrier_wait(segments.q_arrived.at[wg])
      q_ids = plgpu.layout_cast(q_ids_smem[...],
                                plgpu.Layout.WGMMA.reduce(1))
  consumed_base = wg * static.num_stages
  def reader(tiles: ScoreTiles, first, next_of, end):
    """Consumer `wg`'s tiles of its rows, K/V block `step` each."""
    return chained_tiles(
        tiles.smem.at[wg], tiles.arrived.at[wg],
        lambda step: tiles.source(head, q_rows, step * block_kv, block_kv),
        first=first, next_of=next_of, end=end)

  bias_tile = mask_tile = None
  if bias is not None:  # every step of the range: [lo, hi)
    bias_tile = reader(bias, lo, lambda step: step + 1, hi)
  if dense_mask is not None:  # the masked steps (the unmasked run's tiles
    # it keeps whole)
    mask_tile = reader(dense_mask,
                       *masked_steps(lo, unmasked_lo, unmasked_hi, hi))

  def wait_key_ids(slot):
    """Every step waits for its key ids (each barrier phase, every thread)."""
    if segments is not None:
      plgpu.barrier_wait(segments.kv_arrived.at[slot])

  def with_key_ids(values, slot, shape):
    """`values` with this step's [block_q, block_kv] segment id tiles."""
    if segments is None:
      return values
    kv_ids = plgpu.layout_cast(segments.kv_smem[slot],
                               plgpu.Layout.WGMMA.reduce(0))
    return values._replace(q_segments=per_row(q_ids, shape),
                           kv_segments=per_column(kv_ids, shape))

  if fp8 is not None:
    plgpu.copy_gmem_to_smem(fp8.descale_gmem, fp8.descale_smem,
                            fp8.descale_arrived)
  if tile is None:
    copy_rows_in(q_ref.at[batch, q_rows, head], q_smem, q_arrived)
  if fp8 is not None:
    plgpu.barrier_wait(fp8.descale_arrived)
    q_factor = _descale(fp8, q_start // block_q)
    v_factor = _descale(fp8, static.num_q_blocks + static.num_kv_blocks)
  plgpu.barrier_wait(q_arrived)
  if plan is None and slopes is not None:  # copied beside Q
    alibi_slope = slope_reader(slopes, wg)(head)

  turn = turns.consumer_turns(
      pingpong, wg=wg, num_steps=num_steps,
      num_shared=num_shared if plan is None else None, static=static,
      ranged=plan is not None)

  row_layout = plgpu.Layout.WGMMA.reduce(1)
  m = plgpu.layout_cast(jnp.full((block_q,), 0.0 if static.max_free
                                 else -jnp.inf, jnp.float32), row_layout)
  l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
  acc = plgpu.layout_cast(jnp.zeros((block_q, static.head_dim), jnp.float32),
                          plgpu.Layout.WGMMA)
  # `KernelStatic.max_free`: O's sum as P V takes P, but where the row's
  # max comes from its first step (`first_step_max`).
  l_pv = l if static.max_free and static.first_step_max is None else None
  # With a running max and `mma_row_sum`, l is the tensor cores' (`l_pv`).
  sum_by_mma = static.mma_row_sum and not static.max_free
  if static.mma_row_sum:
    # Every column of P [1] is l_pv; written once a tile, fenced for the
    # wgmmas that read it.
    ones[...] = plgpu.layout_cast(
        jnp.ones((block_kv, MMA_SUM_COLUMNS), static.dtype),
        plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    l_pv = plgpu.layout_cast(
        jnp.zeros((block_q, MMA_SUM_COLUMNS), jnp.float32), plgpu.Layout.WGMMA)

  # Every row tile sees block 0 (top-left causal), so num_steps >= 1. Later
  # K tiles are awaited under the previous P V (see `accumulate`).
  if plan is None:
    plgpu.barrier_wait(k_arrived.at[0 if tile is None else slot_of(0)])
  else:  # an empty union loads nothing
    pl.when(first < num_steps)(functools.partial(
        plgpu.barrier_wait, k_arrived.at[0]))

  def wait_next_k(step):
    next_step = step + 1
    @pl.when(next_step < num_steps)
    def _():
      plgpu.barrier_wait(k_arrived.at[slot_of(next_step)])

  turn.begin()

  def step_body(step, carry, *, masked: bool):
    acc, m, l, l_pv = carry
    slot = slot_of(step)
    if plan is not None:
      wait_key_ids(slot)

    def scores(s_ref):
      wgmma(s_ref, q_smem.mma, k_smem.mma.at[slot].transpose((1, 0)))
      turn.after_scores(step)
      return s_ref[...]

    s = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32))
    if masked and plan is not None:
      # Read before the slot is released: the key ids share it with K.
      step_values = with_key_ids(values, slot, s.shape)
    if masked and mask_tile is not None:
      step_values = step_values._replace(dense_mask=mask_tile(step) != 0)
    plgpu.barrier_arrive(k_consumed.at[consumed_base + slot])
    scale_log2 = static.scale_log2
    if plan is None and static.soft_cap is not None:
      cap_only = masking.MaskSpec(q_len=static.q_len, kv_len=static.kv_len,
                                  logits_soft_cap=static.soft_cap)
      s, factor = masking.modify_scores_folded(cap_only, s, static.scale,
                                               None, None, None)
      scale_log2 = factor * LOG2E
    if plan is None and static.alibi_columns:  # top-left causal: no offset
      s = s * static.scale + per_column(alibi_column_terms(
          alibi_slope, step * block_kv, q_start, 0, block_kv), s.shape)
      scale_log2 = LOG2E
    modified = plan is not None and static.spec.modifies_scores
    if modified:
      # Scores change before the masks (DESIGN's order), on every visited
      # tile: scale first (FP8: the true scores, times the Q and K
      # factors), then exp2 takes log2(e) (times the cap, folded).
      score_scale = static.scale
      if fp8 is not None:
        score_scale = score_scale * (
            q_factor * _descale(fp8, static.num_q_blocks + step))
      if static.alibi_columns:  # `common.alibi_columns`
        s = s * score_scale + per_column(alibi_column_terms(
            values.alibi_slope, step * block_kv, q_start, values.q_offset,
            block_kv), s.shape)
        if bias_tile is not None:
          s = s + bias_tile(step).astype(jnp.float32)
        scale_log2 = LOG2E
      else:
        positions = (tile_indices(q_start, step, static)
                     if static.spec.scores_read_positions else (None, None))
        tile_values = values if bias_tile is None else values._replace(
            bias=bias_tile(step).astype(jnp.float32))
        if static.fold_cap:
          s, factor = masking.modify_scores_folded(
              static.spec, s, score_scale, *positions, tile_values)
          scale_log2 = factor * LOG2E
        else:
          s = masking.modify_scores(static.spec, s * score_scale,
                                    *positions, tile_values)
          scale_log2 = LOG2E
    if masked and plan is None:
      s = jnp.where(_plain_mask(q_start, step, static), s, -jnp.inf)
    elif masked:
      s = jnp.where(variant_mask(q_start, step, static, step_values), s,
                    -jnp.inf)
    if fp8 is not None and not modified:  # the true scores: S times the Q
      # and K factors, folded into exp2's scale
      k_factor = _descale(fp8, static.num_q_blocks + step)
      scale_log2 = scale_log2 * (q_factor * k_factor)
    if static.max_free and static.first_step_max is not None:
      # The row's max from the first step it computes, then kept.
      m_new = lax.cond(step == first_computed,
                       functools.partial(_first_step_max, scale_log2,
                                         static.first_step_max),
                       lambda s: m, s)
      alpha, p = None, jnp.exp2(s * scale_log2 - per_row(m_new, s.shape))
    elif static.max_free:  # |s| <= the cap: no max to subtract
      m_new, alpha, p = m, None, jnp.exp2(s * scale_log2)
    else:
      m_new, alpha, p = exponentiate(
          s, m, scale_log2, threshold=static.rescale_threshold,
          unbounded=plan is not None and static.spec.unbounded_scores)
      acc = rescale(acc, alpha,
                    skip_ones=static.rescale_threshold is not None)
      if sum_by_mma:
        l_pv = rescale(l_pv, alpha,
                       skip_ones=static.rescale_threshold is not None)
    p_f32 = p
    if l_pv is not None and not static.mma_row_sum:
      # `max_free`: P's row sum as P V takes it, rounded
      l_pv = _row_sum(l_pv, None, p.astype(static.dtype).astype(jnp.float32))
    if not static.sum_after_pv and not sum_by_mma:
      l = _row_sum(l, alpha, p)
    if plan is not None and static.spec.dropout_rate:
      # The row sum (so the LSE) takes every weight; only P V sees dropout,
      # its 1 / (1 - rate) applied to O at the end.
      p = jnp.where(dropout_kept(
          query_hashes, dropout_key_hashes(step * block_kv, block_kv,
                                           plgpu.Layout.WGMMA.reduce(0)),
          p.shape, static.spec.dropout_rate), p, 0.0)
    p = p.astype(static.dtype)
    if fp8 is not None:
      # P V's 8-bit operand in registers, its columns permuted within each
      # 16 as V's keys are (`common.fp8_operand`, `interleave_fp8_keys`).
      p = fp8_operand(p)
    turn.before_values(step, functools.partial(plgpu.barrier_wait,
                                               v_arrived.at[slot]))

    def accumulate(o_ref, l_ref=None, l_pv_ref=None):
      v_tile = v_smem.mma.at[slot]
      if fp8 is not None:  # stored [head_dim, block_kv]: K-major for wgmma
        v_tile = v_tile.transpose((1, 0))
      wgmma(o_ref, p, v_tile)
      if l_pv_ref is not None:  # `mma_row_sum`: P [1], the same P
        wgmma(l_pv_ref, p, ones)
      if l_ref is not None:  # `sum_after_pv`: while P V_j runs
        l_ref[...] = _row_sum(l_ref[...], alpha, p_f32)
      # Wait for K_{j+1} while P V_j runs on the tensor cores.
      wait_next_k(step)

    # None for a sum the form does not take there.
    acc, l_after_pv, l_pv_mma = pl.run_state(
        lambda refs: accumulate(*refs))(
            (plgpu.ACC.init(acc), l if static.sum_after_pv else None,
             plgpu.ACC.init(l_pv) if static.mma_row_sum else None))
    if static.sum_after_pv:
      l = l_after_pv
    if static.mma_row_sum:
      l_pv = l_pv_mma
    plgpu.barrier_arrive(v_consumed.at[consumed_base + slot])
    return acc, m_new, l, l_pv

  def skip_body(step, carry):
    """A block of the union outside this consumer's range: barriers only."""
    slot = slot_of(step)
    wait_key_ids(slot)
    plgpu.barrier_arrive(k_consumed.at[consumed_base + slot])
    turn.after_scores(step)  # the rendezvous' two turns of a step
    turn.after_scores(step)
    plgpu.barrier_wait(v_arrived.at[slot])
    wait_next_k(step)
    plgpu.barrier_arrive(v_consumed.at[consumed_base + slot])
    return carry

  def spare_body(step, carry):
    """A step without math (`KernelStatic.skip_spare`): K and V awaited
    and released, the turn passed on at once, where `step_body` takes it."""
    slot = slot_of(step)
    turn.after_scores(step)
    plgpu.barrier_arrive(k_consumed.at[consumed_base + slot])
    turn.before_values(step, functools.partial(plgpu.barrier_wait,
                                               v_arrived.at[slot]))
    wait_next_k(step)
    plgpu.barrier_arrive(v_consumed.at[consumed_base + slot])
    return carry

  def finish(acc, m, l, l_pv):
    """Ends the turns, normalises, writes O and the LSE."""
    turn.end()
    if static.mma_row_sum:  # its columns are equal: any one is l_pv
      l_pv = l_pv.max(axis=1)
    if sum_by_mma:
      l, l_pv = l_pv, None

    # Epilogue: normalise, and write O through the Q buffer (Q is dead now;
    # in FP8 through a buffer of its own, in the output dtype). O's
    # normaliser is l_pv where there is one (`KernelStatic.max_free`).
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    l_o = l_safe if l_pv is None else jnp.where(empty, 1.0, l_pv)
    # O's columns per store: all of them, but for FP8 (`FP8_O_COLUMNS`).
    head_dim = static.head_dim
    columns = fp8_o_columns(head_dim) if fp8 is not None else head_dim
    num_pieces = head_dim // columns

    def o_piece(acc, piece):
      return acc if num_pieces == 1 else acc[:, piece * columns:
                                              (piece + 1) * columns]

    def out_rows(piece):
      rows = out_ref.at[batch, q_rows, head]
      return rows if num_pieces == 1 else rows.at[:, pl.ds(piece * columns,
                                                            columns)]
    o_smem, out_dtype = q_smem, static.dtype
    if tile is not None:
      o_smem = tile.o_smem
      if static.stage_o_apart:
        # Q is dead: the next tile's loads under this one's epilogue; O and
        # the LSE wait only for the previous tile's stores to leave them.
        tile.load_next_q()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if sink_of is not None:  # neither FP8 nor ALiBi's columns
      row_scale, lse = _with_sink(m, l, sink_of(head), l_pv)
      if plan is not None and static.spec.dropout_rate:
        row_scale = row_scale * (1.0 / (1.0 - static.spec.dropout_rate))
      o_smem.mma[...] = (acc * per_row(row_scale, acc.shape)).astype(
          out_dtype)
      lse_smem[...] = lse
    else:
      if fp8 is None and plan is not None and static.spec.dropout_rate:
        acc = acc * per_row(
            (1.0 / (1.0 - static.spec.dropout_rate)) / l_o, acc.shape)
      elif fp8 is None:
        acc = acc * per_row(1.0 / l_o, acc.shape)
      else:
        acc = acc * per_row(v_factor / l_safe, acc.shape)
        o_smem = RowViews.plain(fp8.o_smem)
        out_dtype = static.out_dtype
      o_smem.mma[...] = o_piece(acc, 0).astype(out_dtype)
      lse = add_unfused(m * _LN2, jnp.log(l_safe))
      if static.alibi_columns:  # the rows' terms the columns' left in it
        lse = lse - alibi_row_terms(alibi_slope, block_q)
      lse_smem[...] = jnp.where(empty, -jnp.inf, lse)
    plgpu.commit_smem()

    def store():
      copy_rows_out(o_smem, out_rows(0))
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, q_rows])
      for piece in range(1, num_pieces):  # FP8 at head_dim 256
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_smem.mma[...] = o_piece(acc, piece).astype(out_dtype)
        plgpu.commit_smem()
        copy_rows_out(o_smem, out_rows(piece))

    if static.num_consumers == NUM_CONSUMERS:
      store()
    else:  # a short last tile's spare consumers store nothing
      pl.when(tile_start + wg * block_q < static.q_len)(store)
    if tile is None:
      plgpu.wait_smem_to_gmem(0)
    elif not static.stage_o_apart:  # Q's buffer is free once O has left it
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      tile.load_next_q()

  carry = (acc, m, l, l_pv)
  masked_body = functools.partial(step_body, masked=True)
  if plan is None and static.skip_spare:
    # A consumer with no rows in this tile (`KernelStatic.skip_spare`)
    # walks every step without math; its O stays 0 and is not stored.
    spare = tile_start + wg * block_q >= static.q_len
    computed = jnp.where(spare, 0, num_steps)
    carry = lax.fori_loop(0, computed,
                          functools.partial(step_body, masked=False), carry)
    lax.fori_loop(computed, num_steps, spare_body, None)
  elif plan is None:
    carry = lax.fori_loop(0, num_unmasked,
                          functools.partial(step_body, masked=False), carry)
    if static.is_causal or static.key_tail:
      carry = lax.fori_loop(num_unmasked, num_steps, masked_body, carry)
  else:
    for start, stop, body in (
        (first, lo, skip_body), (lo, unmasked_lo, masked_body),
        (unmasked_lo, unmasked_hi, functools.partial(step_body,
                                                     masked=False)),
        (unmasked_hi, hi, masked_body), (hi, num_steps, skip_body)):
      carry = lax.fori_loop(start, stop, body, carry)
  finish(*carry)
  if tile is not None and static.is_causal and plan is None:
    # Persistent: the blocks only the other consumer reads pass through this
    # one too (barriers, no math, no turns), so that every consumer waits
    # for each barrier phase and the next tile finds them in step.
    last = num_kv_steps(
        consumer_rows(tile_start, static.num_consumers - 1, static), static)

    @pl.loop(num_steps, last)
    def _pass_through(step):
      slot = slot_of(step)
      plgpu.barrier_wait(k_arrived.at[slot])
      plgpu.barrier_arrive(k_consumed.at[consumed_base + slot])
      plgpu.barrier_wait(v_arrived.at[slot])
      plgpu.barrier_arrive(v_consumed.at[consumed_base + slot])


def _first_step_max(scale_log2, floor, s):
  """`KernelStatic.first_step_max`'s m [block_q] (log2 units) from the
  scores s [block_q, block_kv] (-inf where masked): each row's max, at
  least `floor`."""
  return jnp.maximum(s.max(axis=1) * scale_log2, floor)


def _row_sum(l, alpha, p):
  """The running row sum l [block_q] after tile p: rescaled by alpha, or
  without a running max (alpha None) only added to."""
  return (l if alpha is None else l * alpha) + p.sum(axis=1)


def _with_sink(m, l, sink, l_pv=None):
  """(O's row factor, the LSE) of rows whose running max (exp2's units) and
  sum are m and l [block_q], with `sink` (natural-log units) in each row's
  denominator, as `masking.apply_sinks` computes after the fact:
  m' = max(m, sink), l' = l 2^(m - m') + 2^(sink - m'), O scaled by
  2^(m - m') / l' (O's l' from l_pv, the sum as P V took it, where given).
  A row that saw no key (m = -inf, l = 0) gets O = 0 and the LSE `sink`,
  with no case of its own."""
  sink = sink * LOG2E
  m_total = jnp.maximum(m, sink)
  alpha = jnp.exp2(m - m_total)
  with_sink = lambda row_sum: row_sum * alpha + jnp.exp2(sink - m_total)
  l_total = with_sink(l)
  l_o = l_total if l_pv is None else with_sink(l_pv)
  return alpha / l_o, add_unfused(m_total * _LN2, jnp.log(l_total))


def _descale(fp8: Fp8Refs, i):
  """Factor i of the FP8 descale row, stored [n / 32, 32] (see
  `fp8.descale_rows`)."""
  return fp8.descale_smem[i // DESCALE_WIDTH, i % DESCALE_WIDTH]
