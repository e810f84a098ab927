"""Block classification and loop ranges against brute force over every element.

The kernels trust these to skip tiles and to drop the element mask, so a wrong
state means silently wrong attention.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jax_flash import masking
from jax_flash.masking import (EMPTY, FULL, PARTIAL, BlockMask, MaskSpec,
                               MaskValues)


def _keep_matrix(spec: MaskSpec, q_pad: int, kv_pad: int, values):
  """[batch, q_pad, kv_pad] bools; rows past q_len count as attending nothing."""
  q = np.arange(q_pad)[None, :, None]
  kv = np.arange(kv_pad)[None, None, :]
  keep = np.asarray(masking.keep(spec, q, kv, values)) & (q < spec.q_len)
  return np.broadcast_to(keep, (2, q_pad, kv_pad))


@st.composite
def _calls(draw):
  q_len, kv_len = draw(st.integers(1, 200)), draw(st.integers(1, 200))
  flags = dict(is_causal=draw(st.booleans()),
               has_q_offset=draw(st.booleans()),
               has_kv_lengths=draw(st.booleans()),
               has_q_lengths=draw(st.booleans()),
               has_segments=draw(st.booleans()))
  if draw(st.booleans()):
    flags["window"] = (draw(st.one_of(st.none(), st.integers(0, 80))),
                       draw(st.one_of(st.none(), st.integers(0, 80))))
  spec = MaskSpec(q_len=q_len, kv_len=kv_len, **flags)
  ints = lambda lo, hi, n: jnp.asarray(draw(
      st.lists(st.integers(lo, hi), min_size=n, max_size=n)), jnp.int32)
  ops = dict(q_offset=ints(-20, 60, 2) if spec.has_q_offset else None,
             q_lengths=ints(0, q_len, 2) if spec.has_q_lengths else None,
             kv_lengths=ints(0, kv_len, 2) if spec.has_kv_lengths else None)
  if spec.has_segments:
    # Sorted ids (packed documents) in one row, arbitrary ids in the other.
    q_seg = jnp.stack([jnp.sort(ints(0, 4, q_len)), ints(0, 4, q_len)])
    kv_seg = jnp.stack([jnp.sort(ints(0, 4, kv_len)), ints(0, 4, kv_len)])
    ops.update(q_segments=q_seg, kv_segments=kv_seg)
  return spec, ops


def _values(ops):
  per_batch = lambda x: None if x is None else np.asarray(x)[:, None, None]
  return MaskValues(
      q_offset=0 if ops.get("q_offset") is None else per_batch(ops["q_offset"]),
      q_lengths=per_batch(ops.get("q_lengths")),
      kv_lengths=per_batch(ops.get("kv_lengths")),
      q_segments=None if "q_segments" not in ops
      else np.asarray(ops["q_segments"])[:, :, None],
      kv_segments=None if "kv_segments" not in ops
      else np.asarray(ops["kv_segments"])[:, None, :])


def _padded_values(spec, ops, q_pad, kv_pad):
  ops = dict(ops)
  if "q_segments" in ops:
    ops["q_segments"] = jnp.pad(ops["q_segments"],
                                ((0, 0), (0, q_pad - spec.q_len)))
    ops["kv_segments"] = jnp.pad(ops["kv_segments"],
                                 ((0, 0), (0, kv_pad - spec.kv_len)),
                                 constant_values=-1)
  return _values(ops)


@settings(max_examples=60, deadline=None)
@given(call=_calls(), block_q=st.sampled_from([16, 32, 64]),
       block_k=st.sampled_from([16, 32, 64]))
def test_block_states_are_sound(call, block_q, block_k):
  """EMPTY tiles hold no kept pair; FULL tiles keep every pair and lie wholly
  inside both sequences."""
  spec, ops = call
  # Jitted: one compile of the whole classification per example, where op
  # by op each of its small ops compiles for every new shape.
  classify = jax.jit(functools.partial(masking.classify_blocks, spec,
                                       block_q, block_k))
  states = np.asarray(classify(**ops))
  nq, nk = states.shape[-2:]
  keep = _keep_matrix(spec, nq * block_q, nk * block_k,
                      _padded_values(spec, ops, nq * block_q, nk * block_k))
  for b in range(2):
    state = states[min(b, states.shape[0] - 1), 0]
    for i in range(nq):
      for j in range(nk):
        tile = keep[b, i * block_q:(i + 1) * block_q,
                    j * block_k:(j + 1) * block_k]
        if state[i, j] == EMPTY:
          assert not tile.any(), (b, i, j)
        if state[i, j] == FULL:
          assert tile.all(), (b, i, j)
          assert (i + 1) * block_q <= spec.q_len
          assert (j + 1) * block_k <= spec.kv_len


# Jitted once: the examples' few shapes each compile once.
_block_ranges = jax.jit(masking.block_ranges)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([0, 1, 2]), min_size=1,
                              max_size=12), min_size=1, max_size=6).filter(
                                  lambda r: len({len(x) for x in r}) == 1))
def test_block_ranges_cover_every_nonempty_block(rows):
  states = jnp.asarray(rows, jnp.int32)
  ranges = np.asarray(_block_ranges(states))
  for row, (lo, ulo, uhi, hi) in zip(rows, ranges):
    assert 0 <= lo <= ulo <= uhi <= hi <= len(row)
    for j, state in enumerate(row):
      if state != EMPTY:
        assert lo <= j < hi
      if ulo <= j < uhi:
        assert state == FULL


@pytest.mark.parametrize("changes, plain", [
    ({}, True), (dict(is_causal=True), True),
    (dict(window=(16, 0)), False), (dict(has_kv_lengths=True), False),
    (dict(logits_soft_cap=30.0), False), (dict(has_bias=True), False),
    (dict(dropout_rate=0.1), False), (dict(score_fn=lambda s, *_: s), False)])
def test_is_plain_is_nothing_beyond_the_lengths_and_causal(changes, plain):
  """`MaskSpec.is_plain`: what the routing takes for the plain kernels."""
  assert MaskSpec(q_len=97, kv_len=130, **changes).is_plain == plain


def test_causal_skips_blocks_above_the_diagonal():
  spec = MaskSpec(q_len=256, kv_len=256, is_causal=True)
  ranges = np.asarray(masking.block_ranges(
      masking.classify_blocks(spec, 64, 64)))[0, 0]
  # Query block i visits key blocks 0..i; only the diagonal one is masked.
  np.testing.assert_array_equal(
      ranges, [(0, 0, 0, 1), (0, 0, 1, 2), (0, 0, 2, 3), (0, 0, 3, 4)])


def test_bottom_right_alignment_with_q_offset():
  spec = MaskSpec(q_len=2, kv_len=5, is_causal=True, has_q_offset=True)
  keep = masking.keep(spec, np.arange(2)[:, None], np.arange(5)[None, :],
                      MaskValues(q_offset=3))
  np.testing.assert_array_equal(keep, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


def test_block_mask_coarsening():
  mask_fn = lambda b, h, i, j: (i // 16) % 2 == (j // 16) % 2   # checkerboard
  fine = BlockMask.from_mask_fn(mask_fn, batch=1, num_heads=1, q_len=64,
                                kv_len=64, per_batch=False, per_head=False)
  np.testing.assert_array_equal(
      np.asarray(fine.states)[0, 0], 2 * (np.indices((4, 4)).sum(0) % 2 == 0))
  # 32 x 32 tiles mix kept and dropped 16 x 16 blocks: all partial.
  assert (np.asarray(fine.coarsen(32, 32)) == masking.PARTIAL).all()
  # 8-row tiles (a kernel's tiles shrunk to a short sequence) take their
  # 16 x 16 block's state; 16 x 64 strips mix them; cut to the counts.
  finer = np.asarray(fine.coarsen(8, 16, (7, 4)))[0, 0]
  np.testing.assert_array_equal(
      finer, np.repeat(np.asarray(fine.states)[0, 0], 2, axis=0)[:7])
  mixed = np.asarray(fine.coarsen(8, 64))[0, 0]
  assert mixed.shape == (8, 1) and (mixed == masking.PARTIAL).all()
  with pytest.raises(ValueError, match="multiples or divisors"):
    fine.coarsen(24, 16)


@pytest.mark.parametrize("mask_fn, used", [
    (lambda b, h, i, j: i >= j, (False, False)),
    (lambda b, h, i, j: i >= j + h, (False, True)),
    (lambda b, h, i, j: (i * 7 + j * 3 + b + h) % 5 != 0, (True, True)),
    (lambda b, h, i, j: jnp.where(b > 0, i >= j, True), (True, False)),
])
def test_block_mask_evaluates_what_mask_fn_reads(mask_fn, used,
                                                  monkeypatch):
  """The map is computed for every batch and head only where `mask_fn`
  reads `b` and `h`, and in strips of several tile rows (a ragged last
  strip here): each block's state equals the one found from every
  (query, key) pair at once."""
  from pallas_kernels import masking as kernel_masking
  assert kernel_masking.arguments_used(mask_fn) == used
  monkeypatch.setattr(kernel_masking, "_STRIP_EVALUATIONS", 1000)
  q_len, kv_len, tile = 100, 77, 16
  block_mask = BlockMask.from_mask_fn(mask_fn, batch=2, num_heads=3,
                                      q_len=q_len, kv_len=kv_len)
  nb, nh = 2 if used[0] else 1, 3 if used[1] else 1
  assert block_mask.states.shape == (nb, nh, 7, 5)
  b, h, i, j = np.ix_(range(nb), range(nh), range(7 * tile), range(5 * tile))
  kept = np.broadcast_to(np.asarray(mask_fn(b, h, i, j)),
                         (nb, nh, 7 * tile, 5 * tile))
  inside = np.broadcast_to((i < q_len) & (j < kv_len), kept.shape)
  blocks = lambda x: x.reshape(nb, nh, 7, tile, 5, tile)
  any_kept = blocks(kept & inside).any((3, 5))
  all_kept = blocks(kept | ~inside).all((3, 5))
  want = np.where(~any_kept, EMPTY, np.where(all_kept, FULL,
                                             masking.PARTIAL))
  np.testing.assert_array_equal(block_mask.states, want)


def test_block_mask_for_a_call_is_built_once_when_traced(monkeypatch):
  """`BlockMask.for_call` under jit: a mask_fn of its arguments alone is
  evaluated while tracing, its states a constant (int8) of the program
  (no loop over strips in it); one that reads a traced value, or states
  above the cap, are built inside the call; every form's states equal
  `from_mask_fn`'s."""
  from pallas_kernels import masking as kernel_masking
  shape = dict(batch=2, num_heads=3, q_len=100, kv_len=77)
  want = BlockMask.from_mask_fn(lambda b, h, i, j: i >= j + h, **shape)

  def states(offset):
    return BlockMask.for_call(lambda b, h, i, j: i >= j + h + offset,
                              **shape).states

  constant = jax.jit(states, static_argnums=0)
  program = constant.lower(0).as_text()
  assert "while" not in program and "xi8>" in program
  np.testing.assert_array_equal(constant(0), want.states)
  # A traced offset: evaluated in the call.
  assert "while" in jax.jit(states).lower(jnp.int32(0)).as_text()
  np.testing.assert_array_equal(jax.jit(states)(jnp.int32(0)), want.states)
  monkeypatch.setattr(kernel_masking, "CONSTANT_BLOCK_MASK_STATES", 104)
  # 3 heads x 7 x 5 states: above the cap.
  assert "while" in jax.jit(states, static_argnums=0).lower(1).as_text()


def test_dense_mask_tiles_are_classified():
  """A dense mask's tiles: EMPTY exactly where it keeps nothing inside the
  sequences, FULL exactly where it keeps every pair of a whole tile, per
  (batch, head); axes it broadcasts along stay of size 1."""
  rng = np.random.default_rng(0)
  q_len, kv_len, block_q, block_k = 100, 150, 32, 64
  nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
  # Per tile: nothing kept, a random half, or everything.
  kinds = rng.integers(0, 3, size=(2, 3, nq, nk))
  noise = rng.random((2, 3, nq * block_q, nk * block_k)) < 0.5
  kind = kinds.repeat(block_q, 2).repeat(block_k, 3)
  mask = np.where(kind == 2, True, np.where(kind == 1, noise, False))
  mask = mask[:, :, :q_len, :kv_len]
  spec = masking.MaskSpec(q_len=q_len, kv_len=kv_len, has_dense_mask=True)
  states = np.asarray(masking.classify_blocks(spec, block_q, block_k,
                                              dense_mask=jnp.asarray(mask)))
  assert states.shape == (2, 3, nq, nk)
  for b, h, i, j in np.ndindex(states.shape):
    tile = mask[b, h, i * block_q:(i + 1) * block_q,
                j * block_k:(j + 1) * block_k]
    whole = (i + 1) * block_q <= q_len and (j + 1) * block_k <= kv_len
    want = EMPTY if not tile.any() else (
        FULL if tile.all() and whole else PARTIAL)
    assert states[b, h, i, j] == want, (b, h, i, j)
  # A key-padding mask broadcast along batch, heads and queries.
  keys = jnp.arange(kv_len)[None, None, None, :] < 70
  assert masking.dense_block_states(keys, block_q, block_k).shape == (
      1, 1, 1, nk)


def test_a_causal_dense_mask_skips_the_tiles_is_causal_skips():
  spec = masking.MaskSpec(q_len=256, kv_len=256, has_dense_mask=True)
  causal = jnp.tril(jnp.ones((256, 256), bool))[None, None]
  dense = masking.classify_blocks(spec, 64, 64, dense_mask=causal)
  built_in = masking.classify_blocks(
      masking.MaskSpec(q_len=256, kv_len=256, is_causal=True), 64, 64)
  np.testing.assert_array_equal(dense, built_in)


@pytest.mark.parametrize("fields, scale_traced", [
    (dict(logits_soft_cap=20.0), False),     # both multiplies folded
    (dict(logits_soft_cap=20.0), True),      # FP8's traced scale
    (dict(logits_soft_cap=50.0, has_alibi=True, has_bias=True), False),
    (dict(has_alibi=True), False),           # no cap: factor 1
])
def test_folded_scores_are_the_scores(fields, scale_traced):
  """`modify_scores_folded`'s factor * t is `modify_scores` of the scaled
  scores to a few float32 ulps (the folds change rounding only), on
  scores that reach far past the cap."""
  from pallas_kernels.masking import modify_scores_folded
  spec = MaskSpec(q_len=64, kv_len=96, **fields)
  keys = jax.random.split(jax.random.key(0), 2)
  qk = 40.0 * jax.random.normal(keys[0], (64, 96), jnp.float32)
  values = MaskValues(q_offset=jnp.int32(3), alibi_slope=jnp.float32(0.25),
                      bias=jax.random.normal(keys[1], (64, 96)))
  q_idx, kv_idx = np.arange(64)[:, None], np.arange(96)[None, :]
  scale = jnp.float32(0.125) if scale_traced else 0.125
  want = masking.modify_scores(spec, qk * scale, q_idx, kv_idx, values)
  t, factor = modify_scores_folded(spec, qk, scale, q_idx, kv_idx, values)
  np.testing.assert_allclose(factor * t, want, rtol=1e-6, atol=1e-5)
  if "logits_soft_cap" in fields:
    assert factor == fields["logits_soft_cap"]
    assert float(jnp.max(jnp.abs(t))) <= 1.0
