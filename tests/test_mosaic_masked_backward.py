"""The masked Mosaic backward (window, q_offset, lengths, segment ids, soft
cap, ALiBi, dropout, any lengths).

On the CPU: the plan rows are checked against a brute-force `masking.keep`
per tile, the kernels' algorithm (plans, walks, padded statistics, step
math) is run in plain jnp against the reference's gradients, and the
kernels are cross-lowered for CUDA. On an sm90 GPU
(test_mosaic_masked_backward_gpu.py): gradients against the reference.
`attention.MASKED_BACKWARD_ENABLED` routes masked gradients to these
kernels.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import lower_mosaic
from jax_flash import masking
from jax_flash.reference import naive_attention
from jax_flash.validation import Operands
from pallas_kernels.config import BlockSizes
from tests.attention_checks import (TRITON_BACKWARD, Case,
                                    masked_backward_kernels,
                                    one_head_dim_each, random_inputs)

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels.mosaic import attention as mosaic_attention_module
  from pallas_kernels.mosaic import backward, common, compat, pipeline
  from pallas_kernels.mosaic.masked_backward import (
      mosaic_backward_masked, padded_statistics, plan_rows)
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

def _ids(lengths_and_ids, batch):
  """int32 [batch, sum of lengths]: runs of segment ids, the same per batch."""
  return np.repeat(np.concatenate([np.full(n, i) for n, i in lengths_and_ids]
                                  )[None], batch, 0).astype(np.int32)


# name: (q_len, kv_len, MaskSpec fields, operands); batch 2.
VARIANTS = {
    "causal window": (384, 384, dict(is_causal=True, window=(100, 0)), {}),
    "bottom-right causal": (256, 512, dict(is_causal=True, has_q_offset=True),
                            dict(q_offset=[256, 100])),
    "ragged lengths": (200, 333, dict(has_q_lengths=True,
                                      has_kv_lengths=True),
                       dict(q_lengths=[100, 200], kv_lengths=[333, 0])),
    "segments": (256, 200, dict(has_segments=True),
                 dict(q_segments=_ids([(100, 0), (156, 1)], 2),
                      kv_segments=_ids([(60, 0), (140, 1)], 2))),
    "soft cap": (97, 300, dict(is_causal=True, logits_soft_cap=20.0), {}),
    "combined": (300, 450, dict(is_causal=True, window=(128, None),
                                has_q_offset=True, has_kv_lengths=True,
                                has_segments=True, logits_soft_cap=30.0),
                 dict(q_offset=[150, 0], kv_lengths=[450, 201],
                      q_segments=_ids([(70, 3), (230, 4)], 2),
                      kv_segments=_ids([(200, 3), (250, 4)], 2))),
    # ALiBi's slopes per (batch, query head): each head of a K/V tile's
    # group reads its own.
    "alibi": (200, 333, dict(is_causal=True, has_q_offset=True,
                             has_alibi=True),
              dict(q_offset=[133, 0],
                   alibi_slopes=[[0.5, 0.25, 0.125, 0.0625],
                                 [1.0, 0.5, 0.25, 0.125]])),
    "alibi soft cap": (97, 300, dict(has_kv_lengths=True, has_alibi=True,
                                     logits_soft_cap=20.0),
                       dict(kv_lengths=[300, 150],
                            alibi_slopes=[[0.5, 0.25, 0.125, 0.0625]] * 2)),
    # score_fn's (b, h) per CTA (dK/dV: per query head of the group).
    "score_fn": (200, 333, dict(is_causal=True, has_q_offset=True,
                                score_fn=lower_mosaic.head_score),
                 dict(q_offset=[133, 0])),
    # mask_fn's (b, h) per CTA (dK/dV: per query head of the group).
    "mask_fn": (256, 200, dict(has_kv_lengths=True,
                               mask_fn=lower_mosaic.head_blocks),
                dict(kv_lengths=[200, 150])),
    # A dense mask per head (dK/dV: each query head's, transposed).
    "dense mask": lower_mosaic.MASKED_CASES["dense mask"],
    # Dropout's mask regenerated in both kernels (dK/dV: per query head).
    "dropout": (200, 333, dict(is_causal=True, has_q_offset=True,
                               dropout_rate=0.1),
                dict(q_offset=[133, 0], dropout_seed=1234)),
}


def _spec_and_operands(name):
  q_len, kv_len, fields, values = VARIANTS[name]
  spec = masking.MaskSpec(q_len=q_len, kv_len=kv_len, **fields)
  return spec, lower_mosaic.masked_operands(values)


def _operand_kwargs(operands: Operands) -> dict:
  """The masks' operands and the dropout seed, as `plan_rows` takes them."""
  return dict(q_offset=operands.q_offset, q_lengths=operands.q_lengths,
              kv_lengths=operands.kv_lengths, q_segments=operands.q_segments,
              kv_segments=operands.kv_segments,
              dense_mask=operands.dense_mask,
              dropout_seed=operands.dropout_seed)


def _plans(spec, batch, operands: Operands, **tiles):
  """`plan_rows` under jit (op by op, its many small ops compile one by
  one), as numpy arrays."""
  plans = jax.jit(lambda operands: plan_rows(spec, batch, **tiles,
                                             **operands))(
      _operand_kwargs(operands))
  return tuple(np.asarray(plan) for plan in plans)


# ---------------------------------------------------------------------------
# Plan rows against a brute-force evaluation of the masks.


def _kept_tiles(spec, operands: Operands, batch, block_q, block_kv):
  """(any, all) kept pairs per [block_q, block_kv] tile, bool [batch, nq, nk],
  by `masking.keep` on every pair of the padded tiles.

  Keys past kv_len are never kept (`keep` says so). Query rows past q_len
  count as rows for `any`, as in `classify_blocks` (the kernels give them
  P = 0), and make a tile not `all` kept (its rows need the masked path).
  """
  nq, nk = -(-spec.q_len // block_q), -(-spec.kv_len // block_kv)
  q_idx = np.arange(nq * block_q)[None, :, None]
  kv_idx = np.arange(nk * block_kv)[None, None, :]
  per_batch = lambda x: None if x is None else np.asarray(x)[:, None, None]
  padded = lambda ids, n: None if ids is None else np.pad(
      np.asarray(ids), ((0, 0), (0, n - ids.shape[1])))
  values = masking.MaskValues(
      q_offset=0 if operands.q_offset is None else per_batch(
          operands.q_offset),
      q_lengths=per_batch(operands.q_lengths),
      kv_lengths=per_batch(operands.kv_lengths),
      q_segments=None if operands.q_segments is None
      else padded(operands.q_segments, nq * block_q)[:, :, None],
      kv_segments=None if operands.kv_segments is None
      else padded(operands.kv_segments, nk * block_kv)[:, None, :])
  kept = np.broadcast_to(np.asarray(masking.keep(spec, q_idx, kv_idx, values)),
                         (batch, nq * block_q, nk * block_kv))
  tiles = lambda x: x.reshape(batch, nq, block_q, nk, block_kv)
  return (tiles(kept).any((2, 4)),
          tiles(kept & (q_idx < spec.q_len)).all((2, 4)))


def _check_plan(plan, kept_any, kept_all, *, consumers, scalars, exact,
                heaviest_first):
  """What the kernels rely on, for every CTA row of `plan`.

  plan: int32 [batch, tiles, PLAN_WIDTH] over the blocks of the grid's axis
  (the rows of kept_any / kept_all [batch, rows, cols]); each batch's rows
  name every tile once (`PLAN_TILE`), by descending union where
  `heaviest_first`, else in tile order.
  """
  plan = np.asarray(plan)
  batch, num_rows, num_cols = kept_any.shape
  num_tiles = -(-num_rows // consumers)
  assert plan.shape == (batch, num_tiles, common.PLAN_WIDTH)
  union = common.PLAN_UNION
  for b in range(batch):
    tiles = plan[b, :, common.PLAN_TILE]
    steps = plan[b, :, union + 1] - plan[b, :, union]
    if heaviest_first:
      np.testing.assert_array_equal(np.sort(tiles), np.arange(num_tiles))
      assert (np.diff(steps) <= 0).all(), steps
      for i in range(num_tiles - 1):  # ties keep tile order
        assert steps[i] > steps[i + 1] or tiles[i] < tiles[i + 1], plan[b]
    else:
      np.testing.assert_array_equal(tiles, np.arange(num_tiles))
    for t in tiles:
      row = plan[b][tiles == t][0]
      first, total = row[union], row[union + 1]
      assert 0 <= first <= total <= num_cols, row
      np.testing.assert_array_equal(row[common.PLAN_SCALARS:][:3],
                                    scalars[b])
      nonempty = []
      for c in range(consumers):
        lo, unmasked_lo, unmasked_hi, hi = row[4 * c:4 * c + 4]
        # The five runs tile the union in order: every consumer walks each
        # of the producer's steps exactly once (the barrier phases).
        assert first <= lo <= unmasked_lo <= unmasked_hi <= hi <= total, row
        block = t * consumers + c
        if hi > lo:
          nonempty.append((lo, hi))
        if block >= num_rows:
          assert lo == hi, row  # a padding block visits nothing
          continue
        visited = np.zeros(num_cols, bool)
        visited[lo:hi] = True
        # Sound: no kept pair lies in a skipped tile, and the unmasked run
        # needs no mask.
        assert not (kept_any[b, block] & ~visited).any(), (b, block, row)
        assert kept_all[b, block, unmasked_lo:unmasked_hi].all(), (b, row)
        if exact:  # interval masks: the range is exactly the kept tiles
          cols = np.flatnonzero(kept_any[b, block])
          expected = (cols[0], cols[-1] + 1) if cols.size else (first, first)
          assert (lo, hi) == expected, (b, block, row)
      # The second slot of a one-consumer plan is zeros.
      assert not row[4 * consumers:union].any(), row
      if nonempty:
        assert (first, total) == (min(nonempty)[0],
                                  max(hi for _, hi in nonempty)), row
      else:
        assert first == total == 0, row


_PLAN_CASES = {
    # name: (spec fields, operands, block_q, block_kv, exact)
    "causal q > kv": (dict(q_len=300, kv_len=200, is_causal=True), {},
                      64, 64, True),
    "bottom-right causal": (dict(q_len=150, kv_len=400, is_causal=True,
                                 has_q_offset=True),
                            dict(q_offset=[250, 37]), 64, 64, True),
    "window": (dict(q_len=250, kv_len=260, window=(64, 30)), {}, 64, 128,
               True),
    "lengths": (dict(q_len=250, kv_len=250, has_q_lengths=True,
                     has_kv_lengths=True),
                dict(q_lengths=[0, 130], kv_lengths=[77, 250]), 64, 64, True),
    "segments": (dict(q_len=256, kv_len=200, has_segments=True),
                 dict(q_segments=_ids([(100, 0), (90, 1), (66, 2)], 2),
                      kv_segments=_ids([(60, 0), (10, 1), (130, 2)], 2)),
                 64, 64, True),
    "combined": (dict(q_len=300, kv_len=450, is_causal=True,
                      window=(128, None), has_q_offset=True,
                      has_kv_lengths=True, has_segments=True),
                 dict(q_offset=[150, 0], kv_lengths=[450, 201],
                      q_segments=_ids([(70, 3), (230, 4)], 2),
                      kv_segments=_ids([(200, 3), (250, 4)], 2)),
                 64, 128, False),
}


@pytest.mark.parametrize("consumers", [(2, 2), (1, 2), (2, 1)], ids=str)
@pytest.mark.parametrize("name", list(_PLAN_CASES))
def test_plans_cover_exactly_the_kept_tiles(name, consumers):
  """dQ plans (over K/V blocks) and dK/dV plans (over Q blocks, the
  transpose) against `masking.keep` evaluated on every pair."""
  fields, values, block_q, block_kv, exact = _PLAN_CASES[name]
  spec = masking.MaskSpec(**fields)
  operands = Operands(**{k: jnp.asarray(v, jnp.int32)
                         for k, v in values.items()})
  batch = 2
  dq_consumers, dkdv_consumers = consumers
  dq_plan, dkdv_plan = _plans(spec, batch, operands, block_q=block_q,
                              block_kv=block_kv, dq_consumers=dq_consumers,
                              dkdv_consumers=dkdv_consumers)
  kept_any, kept_all = _kept_tiles(spec, operands, batch, block_q, block_kv)
  per_batch = lambda x, default: np.broadcast_to(
      default if x is None else np.asarray(x), (batch,))
  scalars = np.stack([per_batch(operands.q_offset, 0),
                      per_batch(operands.q_lengths, spec.q_len),
                      per_batch(operands.kv_lengths, spec.kv_len)], -1)
  _check_plan(dq_plan, kept_any, kept_all, consumers=dq_consumers,
              scalars=scalars, exact=exact, heaviest_first=True)
  _check_plan(dkdv_plan, kept_any.transpose(0, 2, 1),
              kept_all.transpose(0, 2, 1), consumers=dkdv_consumers,
              scalars=scalars, exact=exact, heaviest_first=False)


def test_padded_statistics_make_padding_rows_empty():
  out = jnp.ones((1, 5, 2, 8), jnp.bfloat16)
  lse = jnp.zeros((1, 2, 5), jnp.float32).at[0, 1, 2].set(-jnp.inf)
  stats = np.asarray(padded_statistics(out, lse, out, None, rows=128))
  assert stats.shape == (1, 2, 2, 128)
  assert (stats[:, :, 0, 5:] == np.inf).all() and stats[0, 1, 0, 2] == np.inf
  np.testing.assert_array_equal(stats[:, :, 1, 5:], 0.0)
  np.testing.assert_array_equal(stats[:, :, 1, :5], 8.0)


# ---------------------------------------------------------------------------
# The kernels' algorithm in plain jnp, against the reference's gradients.


def _runs(row, consumer):
  """A consumer's (start, stop, kind) runs over its CTA's union, in the
  order `pipeline.ranged_walk` walks them."""
  lo, unmasked_lo, unmasked_hi, hi = row[4 * consumer:4 * consumer + 4]
  first, total = row[common.PLAN_UNION:common.PLAN_UNION + 2]
  return ((first, lo, "skip"), (lo, unmasked_lo, "masked"),
          (unmasked_lo, unmasked_hi, "unmasked"), (unmasked_hi, hi, "masked"),
          (hi, total, "skip"))


def _computed_steps(plan, consumers: int):
  """int32 [steps, 7]: (batch, own block, streamed block, masked, q_offset,
  q_length, kv_length) of every step a consumer computes, walking the plan
  rows as the kernels do.

  Asserts the barrier invariant: each consumer walks every step of its
  CTA's union exactly once.
  """
  steps = []
  scalars = slice(common.PLAN_SCALARS, common.PLAN_SCALARS + 3)
  for b, rows in enumerate(np.asarray(plan)):
    for row in rows:
      t = row[common.PLAN_TILE]
      first, total = row[common.PLAN_UNION:common.PLAN_UNION + 2]
      for c in range(consumers):
        walked = 0
        for start, stop, kind in _runs(row, c):
          walked += max(0, stop - start)
          steps += [(b, t * consumers + c, j, kind == "masked", *row[scalars])
                    for j in range(start, stop) if kind != "skip"]
        assert walked == total - first, row
  return np.array(steps, np.int32).reshape(-1, 7)


def _step_gradients(step, head, tensors, *, spec, config, transposed: bool):
  """The kernels' step math on one tile (`pipeline.tile_probabilities`,
  `pipeline.score_gradient`, `masking.keep` on masked steps only).

  step: a `_computed_steps` row (own block: Q in dQ, K/V in dK/dV).
  Returns dS K (dQ's update) or, transposed, (dSᵀ Q, Pᵀ dO).
  """
  q, k, v, d_out, stats, q_ids, kv_ids, slopes = tensors
  b, own, streamed, masked = step[0], step[1], step[2], step[3] > 0
  q_block, kv_block = (streamed, own) if transposed else (own, streamed)
  block_q, block_kv, group = config.block_q, config.block_kv, config.group
  qs, ks = q_block * block_q, kv_block * block_kv

  def rows(x, start, n, h):
    return jax.lax.dynamic_slice(x[b], (start, h, 0), (n, 1, x.shape[-1]))[:, 0]

  q_t, do_t = rows(q, qs, block_q, head), rows(d_out, qs, block_q, head)
  k_t, v_t = (rows(x, ks, block_kv, head // group) for x in (k, v))
  lse_log2, delta = jax.lax.dynamic_slice(stats[b, head], (0, qs),
                                          (2, block_q))
  # Query vectors run down S's rows (across Sᵀ's columns), keys the other way.
  as_q, as_kv = (lambda x: x[:, None]), (lambda x: x[None, :])
  if transposed:
    as_q, as_kv = as_kv, as_q
  values = masking.MaskValues(q_offset=step[4], q_lengths=step[5],
                              kv_lengths=step[6])
  if slopes is not None:
    values = values._replace(alibi_slope=slopes[b, head])
  if q_ids is not None:
    values = values._replace(
        q_segments=as_q(jax.lax.dynamic_slice(q_ids[b], (qs,), (block_q,))),
        kv_segments=as_kv(jax.lax.dynamic_slice(kv_ids[b], (ks,),
                                                (block_kv,))))
  if transposed:
    s, dp, broadcast = k_t @ q_t.T, v_t @ do_t.T, common.per_column
  else:
    s, dp, broadcast = q_t @ k_t.T, do_t @ v_t.T, common.per_row
  positions = (as_q(qs + jnp.arange(block_q)),
               as_kv(ks + jnp.arange(block_kv)))
  p, slope = pipeline.tile_probabilities(s, lse_log2, broadcast, values, config,
                                         positions=lambda: positions)
  kept = masking.keep(spec, *positions, values)
  p = jnp.where(kept | ~masked, p, 0.0)
  ds = pipeline.score_gradient(p, dp, broadcast(delta, s.shape), slope)
  return (ds @ q_t, p @ do_t) if transposed else ds @ k_t


def _emulated_backward(q, k, v, out, lse, d_out, d_lse, *, scale, spec,
                       operands: Operands, block_q=64, block_kv=64):
  """(dq, dk, dv) float32 by the masked kernels' algorithm: their plan
  rows, walks (skipped, masked and unmasked steps), padded statistics,
  zero-filled tails and step math; only TMA, the rings and wgmma are left
  out (and the order of the sums).
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  shapes = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (q, k)]
  tiles = dict(scale=scale, is_causal=spec.is_causal, block_q=block_q,
               block_kv=block_kv, max_concurrent_steps=2, spec=spec)
  dq_config = backward.dq_static(*shapes, **tiles)
  dkdv_config = backward.dkdv_statics(*shapes, **tiles)[0]
  dq_plan, dkdv_plan = _plans(spec, batch, operands, block_q=block_q,
                              block_kv=block_kv,
                              dq_consumers=dq_config.num_consumers,
                              dkdv_consumers=dkdv_config.num_consumers)
  q_rows = dq_plan.shape[1] * dq_config.num_consumers * block_q
  kv_rows = dkdv_plan.shape[1] * dkdv_config.num_consumers * block_kv
  pad = lambda x, n: None if x is None else jnp.pad(
      x, ((0, 0), (0, n - x.shape[1])) + ((0, 0),) * (x.ndim - 2))
  # Zero-filled tails, as TMA reads them.
  stats = jax.jit(functools.partial(padded_statistics, rows=q_rows))(
      out, lse, d_out, d_lse)
  tensors = (pad(q, q_rows), pad(k, kv_rows), pad(v, kv_rows),
             pad(d_out, q_rows), stats, pad(operands.q_segments, q_rows),
             pad(operands.kv_segments, kv_rows), operands.alibi_slopes)

  def gradients(config, plan, *, transposed):
    steps = _computed_steps(plan, config.num_consumers)
    heads = np.arange(num_heads)
    step_of = np.repeat(steps, num_heads, 0)          # every query head
    head_of = np.tile(heads, len(steps))
    step_fn = functools.partial(_step_gradients, spec=spec, config=config,
                                transposed=transposed)
    updates = jax.jit(jax.vmap(step_fn, in_axes=(0, 0, None)))(
        step_of, head_of, tensors)
    return step_of, head_of, updates

  step_of, head_of, dq_updates = gradients(dq_config, dq_plan,
                                           transposed=False)
  rows = step_of[:, 1:2] * block_q + np.arange(block_q)
  dq = jnp.zeros((batch, q_rows, num_heads, head_dim)).at[
      step_of[:, :1], rows, head_of[:, None]].add(dq_updates)
  step_of, head_of, (dk_updates, dv_updates) = gradients(
      dkdv_config, dkdv_plan, transposed=True)
  rows = step_of[:, 1:2] * block_kv + np.arange(block_kv)
  kv_heads = head_of[:, None] // (num_heads // num_kv_heads)
  zeros = jnp.zeros((batch, kv_rows, num_kv_heads, head_dim))
  dk = zeros.at[step_of[:, :1], rows, kv_heads].add(dk_updates)
  dv = zeros.at[step_of[:, :1], rows, kv_heads].add(dv_updates)
  return dq[:, :q_len] * scale, dk[:, :kv_len] * scale, dv[:, :kv_len]


def _api_variants(spec, operands: Operands) -> dict:
  """`flash_attention` keyword arguments for a spec and its operands."""
  variants = dict(is_causal=spec.is_causal)
  if spec.window is not None:
    variants["local_window_size"] = spec.window
  if spec.logits_soft_cap is not None:
    variants["logits_soft_cap"] = spec.logits_soft_cap
  for name, arg in (("q_offset", "q_offset"), ("q_lengths",
                                                "query_seq_lengths"),
                    ("kv_lengths", "key_value_seq_lengths")):
    if getattr(operands, name) is not None:
      variants[arg] = getattr(operands, name)
  if operands.q_segments is not None:
    variants["segment_ids"] = (operands.q_segments, operands.kv_segments)
  if operands.alibi_slopes is not None:
    variants["alibi_slopes"] = operands.alibi_slopes
  return variants


_EMULATED = {
    # name: (q_len, kv_len, heads, kv heads, head_dim, spec fields, operands)
    "combined, GQA 2:1": (
        150, 220, 2, 1, 64,
        dict(is_causal=True, window=(90, None), has_q_offset=True,
             has_kv_lengths=True, has_segments=True, logits_soft_cap=5.0),
        dict(q_offset=[70, 0], kv_lengths=[220, 100],
             q_segments=_ids([(40, 1), (110, 2)], 2),
             kv_segments=_ids([(100, 1), (120, 2)], 2))),
    "lengths with empty rows, d=256": (
        100, 130, 2, 2, 256, dict(has_q_lengths=True, has_kv_lengths=True),
        dict(q_lengths=[70, 100], kv_lengths=[130, 0])),
    # ALiBi's term and the soft cap's slope on every computed step, a
    # slope per (batch, query head).
    "alibi, soft cap, GQA 4:1": (
        130, 200, 4, 1, 64,
        dict(is_causal=True, has_q_offset=True, has_alibi=True,
             logits_soft_cap=5.0),
        dict(q_offset=[70, 0], alibi_slopes=[[0.5, 0.25, 0.125, 0.0625],
                                             [1.0, 0.3, 0.01, 0.2]])),
}


@pytest.mark.parametrize("name", list(_EMULATED))
def test_kernel_algorithm_matches_reference_gradients(name):
  """Plans, walks, tails and step math in plain jnp (f32) against jax.vjp
  of the reference, with random cotangents of out and lse."""
  q_len, kv_len, heads, kv_heads, head_dim, fields, values = _EMULATED[name]
  spec = masking.MaskSpec(q_len=q_len, kv_len=kv_len, **fields)
  operands = lower_mosaic.masked_operands(values)
  case = Case(2, q_len, kv_len, heads, kv_heads, head_dim)
  q, k, v, d_out, d_lse = random_inputs(case, jnp.float32, seed=1)
  scale = head_dim ** -0.5
  reference = functools.partial(naive_attention, scale=scale,
                                **_api_variants(spec, operands))

  @jax.jit
  def forward_and_vjp(q, k, v, d_out, d_lse):
    (out, lse), vjp = jax.vjp(reference, q, k, v)
    return out, lse, vjp((d_out, d_lse))

  out, lse, expected = forward_and_vjp(q, k, v, d_out, d_lse)
  got = _emulated_backward(q, k, v, out, jnp.swapaxes(lse, 1, 2), d_out,
                           jnp.swapaxes(d_lse, 1, 2), scale=scale, spec=spec,
                           operands=operands)
  for name_, ours, ref in zip(("dq", "dk", "dv"), got, expected):
    assert np.isfinite(np.asarray(ours)).all(), name_
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=2e-4,
                               rtol=2e-4, err_msg=name_)


# ---------------------------------------------------------------------------
# Cross-lowering for CUDA.


def _lower(name, head_dim, *, with_d_lse=True, num_heads=4, num_kv_heads=2,
           **blocks):
  spec, operands = _spec_and_operands(name)
  q = jax.ShapeDtypeStruct((2, spec.q_len, num_heads, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, spec.kv_len, num_kv_heads, head_dim),
                            jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((2, num_heads, spec.q_len), jnp.float32)
  args = (q, kv, kv, q, lse, q) + ((lse,) if with_d_lse else ())

  def backward_fn(*args):
    return mosaic_backward_masked(*args, scale=head_dim**-0.5, spec=spec,
                                  **_operand_kwargs(operands),
                                  alibi_slopes=operands.alibi_slopes,
                                  **blocks)

  lowered = jax.jit(backward_fn).trace(*args).lower(
      lowering_platforms=("cuda",))
  for grad, primal in zip(lowered.out_info, args[:3]):
    assert grad.shape == primal.shape and grad.dtype == primal.dtype
  return lowered.as_text()


def _expected_kernels(head_dim):
  # At head_dim 256 dK and dV come from one pass each (registers).
  return {"dq", "dk", "dv"} if head_dim == 256 else {"dq", "dkdv"}


# By default each variant at d=64 or d=256 in turn (the two kernel shapes:
# dK/dV together, or a pass each) and "combined" at every head dim (d=128:
# d=64's kernels at other tiles); every pair with `-m slow`.
@pytest.mark.parametrize("name, head_dim", one_head_dim_each(
    [name for name in VARIANTS if name != "alibi soft cap"],  # (overlapped)
    in_turn=(64, 256),
    always=(("combined", 64), ("combined", 128), ("combined", 256))))
def test_masked_backward_lowers_for_cuda(head_dim, name, cuda_lowering,
                                         monkeypatch):
  monkeypatch.setattr(compat, "LOWERING_SEMANTICS",
                      plgpu.LoweringSemantics.Warpgroup)
  assert (masked_backward_kernels(_lower(name, head_dim))
          == _expected_kernels(head_dim))


@pytest.mark.parametrize("name, head_dim", [("combined", 64),
                                            ("segments", 128),
                                            ("soft cap", 256)])
def test_masked_backward_lowers_in_lane_semantics(name, head_dim,
                                                  cuda_lowering, monkeypatch):
  """The one-line switch in compat stays available for the masked form."""
  monkeypatch.setattr(compat, "LOWERING_SEMANTICS",
                      plgpu.LoweringSemantics.Lane)
  assert (masked_backward_kernels(_lower(name, head_dim))
          == _expected_kernels(head_dim))


@pytest.mark.parametrize("name, kwargs", [
    ("ragged lengths", dict(with_d_lse=False)),
    ("combined", dict(num_heads=4, num_kv_heads=1, block_q=128,
                      max_concurrent_steps=3)),   # MQA, deeper ring
    # dK/dV tiles of 128 keys: dK and dV one pass each (registers).
    ("soft cap", dict(block_kv=128)),
], ids=str)
def test_masked_backward_lowers_other_calls(name, kwargs, cuda_lowering):
  expected = {"dq", "dk", "dv"} if "block_kv" in kwargs else {"dq", "dkdv"}
  assert masked_backward_kernels(_lower(name, 64, **kwargs)) == expected


# Mosaic GPU's other lowering semantics (the one-line switch in
# `pallas_kernels.mosaic.compat`) for these forms with `-m slow`.
_SEMANTICS = ["Warpgroup", pytest.param("Lane", marks=pytest.mark.slow)]


@pytest.mark.parametrize("lowering_semantics", _SEMANTICS, indirect=True)
@pytest.mark.parametrize("name, head_dim", [("combined", 64),
                                            pytest.param(  # CI's ten minutes
                                                "soft cap", 128,
                                                marks=pytest.mark.slow),
                                            pytest.param(
                                                "segments", 256,
                                                marks=pytest.mark.slow),
                                            ("alibi soft cap", 64),
                                            ("dropout", 128),
                                            pytest.param(
                                                "score_fn", 256,
                                                marks=pytest.mark.slow),
                                            ("mask_fn", 64)])
def test_overlapped_masked_backward_lowers(name, head_dim,
                                           lowering_semantics):
  """`overlap_softmax` in the ranged kernels (their default): the soft
  cap's slope, ALiBi, dropout and the masks enter the overlapped step as
  they do the plain one."""
  text = _lower(name, head_dim)
  assert masked_backward_kernels(text) == _expected_kernels(head_dim)
  assert text != _lower(name, head_dim, overlap_softmax=False)


@pytest.mark.parametrize("head_dim", [
    64, pytest.param(256, marks=pytest.mark.slow)])  # CI's ten minutes
def test_alibi_columns_backward_lowers(head_dim, cuda_lowering, monkeypatch):
  """Causal ALiBi as a term per key and one per query
  (`plan.MASKED_ALIBI_COLUMNS`) in both backward kernels:
  they lower, and the flag reaches them."""
  from pallas_kernels.mosaic import plan
  monkeypatch.setattr(plan, "MASKED_ALIBI_COLUMNS", False)
  tiles = _lower("alibi", head_dim)
  monkeypatch.setattr(plan, "MASKED_ALIBI_COLUMNS", True)
  columns = _lower("alibi", head_dim)
  assert masked_backward_kernels(columns) == _expected_kernels(head_dim)
  assert columns != tiles


def test_folded_cap_backward_lowers_with_fewer_multiplies(cuda_lowering,
                                                           monkeypatch):
  """The cap's multiplies folded into the scales in the backward
  (`plan.MASKED_BACKWARD_SOFTCAP_FOLDED`): both kernels lower, with fewer
  multiplies and their tanh; beside ALiBi the flag changes nothing (the
  cap is not the only score change)."""
  from pallas_kernels.mosaic import plan

  def text(name):
    spec, operands = _spec_and_operands(name)
    q = jax.ShapeDtypeStruct((2, spec.q_len, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, spec.kv_len, 2, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((2, 4, spec.q_len), jnp.float32)
    return lower_mosaic.canonical(
        lambda *a: mosaic_backward_masked(
            *a, scale=0.125, spec=spec, **_operand_kwargs(operands),
            alibi_slopes=operands.alibi_slopes), (q, kv, kv, q, lse, q))
  monkeypatch.setattr(plan, "MASKED_BACKWARD_SOFTCAP_FOLDED", False)
  unfolded, alibi = text("soft cap"), text("alibi soft cap")
  monkeypatch.setattr(plan, "MASKED_BACKWARD_SOFTCAP_FOLDED", True)
  folded = text("soft cap")
  assert masked_backward_kernels(folded) == _expected_kernels(64)
  assert folded.count("arith.mulf") < unfolded.count("arith.mulf")
  assert folded.count("tanh.approx") > 0
  assert text("alibi soft cap") == alibi


# sm90's dynamic shared memory per block (227 KiB): a kernel that asks for
# more fails to launch, where the kernels' own count (`check_shared_memory`)
# should have sent the call to the Triton kernels instead.
SM90_SHARED_MEMORY_BYTES = 227 * 1024


@pytest.mark.parametrize("head_dim", [
    pytest.param(d, marks=pytest.mark.slow) for d in (64, 96, 128, 160, 256)])
def test_every_streamed_operand_at_once_fits_shared_memory(head_dim,
                                                           cuda_lowering):
  """fwd+bwd with everything each masked kernel streams or copies beside
  its rings at once (a bias per head, with dbias; a dense mask per batch
  and head; segment ids; ALiBi slopes; dropout; lengths; ragged, causal)
  stays on the Mosaic kernels, and every kernel's launch asks for at most
  sm90's shared memory (read from the lowered kernels, Mosaic GPU's own
  allocation with its alignment, not our count of it)."""
  q_len, kv_len = 200, 333
  spec = masking.MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=True,
                          has_bias=True, has_dense_mask=True,
                          has_segments=True, has_alibi=True,
                          dropout_rate=0.1, has_kv_lengths=True)
  operands = Operands(
      q_segments=jnp.zeros((2, q_len), jnp.int32),
      kv_segments=jnp.zeros((2, kv_len), jnp.int32),
      alibi_slopes=jnp.ones((2, 4), jnp.float32),
      dropout_seed=jnp.int32(3), kv_lengths=jnp.array([kv_len, 100]),
      dense_mask=jnp.ones((2, 4, q_len, kv_len), bool))

  def loss(q, k, v, bias):
    out, _ = mosaic_attention_module.mosaic_attention(
        q, k, v, scale=0.1, is_causal=True, spec=spec, operands=operands,
        bias=bias, backward_blocks=BlockSizes.get_default(head_dim,
                                                          "NVIDIA H200"))
    return out.astype(jnp.float32).sum()

  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  text = lower_mosaic.canonical(
      jax.grad(loss, argnums=(0, 1, 2, 3)),
      (shape(2, q_len, 4, head_dim), shape(2, kv_len, 2, head_dim),
       shape(2, kv_len, 2, head_dim), shape(1, 4, q_len, kv_len)))
  assert "triton" not in text
  backward_kernels = masked_backward_kernels(text)
  assert backward_kernels >= {"dq", "dbias"}
  requests = [int(n) for n in re.findall(
      r"dynamic_shared_memory_size %c(\d+)_i32", text)]
  assert len(requests) == 1 + len(backward_kernels)  # and the forward
  assert max(requests) <= SM90_SHARED_MEMORY_BYTES, requests


def test_masked_backward_lowers_for_length_one(cuda_lowering):
  spec = masking.MaskSpec(q_len=1, kv_len=7, is_causal=True,
                          has_q_offset=True)
  q = jax.ShapeDtypeStruct((1, 1, 2, 128), jnp.float16)
  kv = jax.ShapeDtypeStruct((1, 7, 1, 128), jnp.float16)
  lse = jax.ShapeDtypeStruct((1, 2, 1), jnp.float32)
  text = jax.jit(lambda *a: mosaic_backward_masked(
      *a, scale=0.1, spec=spec, q_offset=jnp.array([6], jnp.int32))).trace(
          q, kv, kv, q, lse, q).lower(lowering_platforms=("cuda",)).as_text()
  assert masked_backward_kernels(text) == {"dq", "dkdv"}


@pytest.mark.parametrize("enabled", [False, True])
def test_masked_gradients_route_by_the_flag(enabled, cuda_lowering,
                                            monkeypatch):
  """Through `jax.grad` of `mosaic_attention` (head dim 96, padded): the
  masked Mosaic backward when enabled, else the Triton one."""
  monkeypatch.setattr(mosaic_attention_module, "MASKED_BACKWARD_ENABLED",
                      enabled)
  text = _lower_masked_gradients()
  assert bool(masked_backward_kernels(text)) == enabled
  assert bool(TRITON_BACKWARD.search(text)) == (not enabled)


def test_masked_gradients_fall_back_to_triton(cuda_lowering, monkeypatch):
  def refuse(*args, **kwargs):
    raise NotImplementedError("not covered")

  monkeypatch.setattr(mosaic_attention_module, "MASKED_BACKWARD_ENABLED",
                      True)
  monkeypatch.setattr(mosaic_attention_module, "mosaic_backward_masked",
                      refuse)
  text = _lower_masked_gradients()
  assert not masked_backward_kernels(text) and TRITON_BACKWARD.search(text)


def _lower_masked_gradients():
  spec, operands = _spec_and_operands("combined")
  q = jax.ShapeDtypeStruct((2, spec.q_len, 4, 96), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, spec.kv_len, 2, 96), jnp.bfloat16)

  def loss(q, k, v):
    out, lse = mosaic_attention_module.mosaic_attention(
        q, k, v, scale=0.1, is_causal=spec.is_causal, spec=spec,
        operands=operands,
        backward_blocks=BlockSizes.get_default(96, "NVIDIA H200"))
    return out.astype(jnp.float32).sum() + lse.sum()

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",))
  assert [g.shape for g in lowered.out_info] == [q.shape, kv.shape, kv.shape]
  return lowered.as_text()


# ---------------------------------------------------------------------------
# Refusals: the caller falls back to the Triton backward.


@pytest.mark.parametrize("bias, error, match", [
    (jnp.zeros((1, 2, 128, 128), jnp.float32), NotImplementedError,
     "take bias in bfloat16"),                    # the Triton backward's
    (jnp.zeros((1, 2, 64, 128), jnp.bfloat16), NotImplementedError,
     "q_len, kv_len"),                            # neither q_len nor 1
    (None, ValueError, "bias must be"),           # the spec has one
])
def test_masked_backward_refuses_a_bias_it_does_not_stream(bias, error,
                                                          match):
  spec = masking.MaskSpec(q_len=128, kv_len=128, has_bias=True)
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 2, 128), jnp.float32)
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda q, lse: mosaic_backward_masked(
        q, q, q, q, lse, q, scale=0.125, spec=spec, bias=bias), q, lse)


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=72), "head_dim"),    # not a multiple of 16
    (dict(dtype=jnp.float32), "bfloat16 and float16"),
    (dict(block_q=96), "multiples of 64"),
    (dict(head_dim=256, block_kv=128), "registers"),
    (dict(head_dim=256, max_concurrent_steps=4), "shared memory"),
])
def test_masked_backward_refuses_what_the_kernels_lack(kwargs, match):
  head_dim = kwargs.pop("head_dim", 64)
  dtype = kwargs.pop("dtype", jnp.bfloat16)
  spec = masking.MaskSpec(q_len=200, kv_len=100, is_causal=True)
  q = jax.ShapeDtypeStruct((1, 200, 2, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((1, 100, 1, head_dim), dtype)
  lse = jax.ShapeDtypeStruct((1, 2, 200), jnp.float32)
  with pytest.raises(NotImplementedError, match=match):
    mosaic_backward_masked(q, kv, kv, q, lse, q, scale=0.125, spec=spec,
                           **kwargs)


def test_masked_backward_checks_the_spec_lengths():
  spec = masking.MaskSpec(q_len=128, kv_len=100)
  q = jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 100, 1, 64), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 2, 200), jnp.float32)
  with pytest.raises(ValueError, match="q_len 128"):
    mosaic_backward_masked(q, kv, kv, q, lse, q, scale=0.125, spec=spec)
