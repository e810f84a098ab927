"""The Mosaic GPU kernels' numerics on a CPU, under JAX's Mosaic GPU
interpreter (`tests/mosaic_interpret.py` teaches it what the kernels use).

The interpreter simulates the kernels' threads, shared memory, barriers, TMA
and wgmma, so these tests run the real kernel bodies (warp specialisation,
the K/V ring, online softmax, causal block skipping, the persistent walk;
the backward's dQ and dK/dV kernels, and the fused one with its dQ writer's
semaphores and reduce-adds; the masked forward's and backward's plan rows,
masks, ragged tiles, ALiBi and dropout) at small shapes, against the
reference with FlashAttention's tolerance rule, and dropout's kept weights
bit for bit against the Triton kernels'. What it cannot see (wgmma pipelining,
shared-memory limits, registers, speed) stays with `-m gpu` on an H200.

Kernels of more warpgroups than this process's CPU client can run
(`mosaic_interpret.MAX_WARPGROUPS`, set by its thread pool, which conftest
makes before this module can size it) skip here, and
`test_interpreted_wide_forms_in_a_larger_pool` runs them in a pytest child
whose client gets `mosaic_interpret.CPU_CLIENT_THREADS` threads.
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import masking, validation
from jax_flash.reference import naive_attention
from tests import mosaic_interpret
from tests.attention_checks import (Case, assert_forward_within_rule,
                                    assert_within_rule, forward_and_grads,
                                    blocks_and_stripes, position_score,
                                    random_inputs)

# `slow` (run by `pytest -m slow`, not by default): cases whose kernel form
# a faster default case already takes, kept for a kernel change's check
# before GPU time; the GPU suite runs them all at realistic sizes.
slow = lambda *values: pytest.param(*values, marks=pytest.mark.slow)

if mosaic_interpret.WHY_NOT is not None:
  pytest.skip(mosaic_interpret.WHY_NOT, allow_module_level=True)
try:
  from pallas_kernels.mosaic.forward import mosaic_forward
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

# (case, is_causal, mosaic_forward options). The default grid is the
# persistent one; a CPU has no SM count, so it gets two CTAs.
CASES = [
    slow(Case(1, 128, 128, 1, 1, 64), False, dict(persistent=False)),
    (Case(1, 128, 128, 1, 1, 64), True, dict(persistent=False)),
    slow(Case(1, 256, 256, 2, 2, 64), False, dict(num_ctas=2)),
    (Case(1, 256, 256, 2, 2, 64), True, dict(num_ctas=2)),
    # GQA 2:1, and kv_len != q_len both ways under causal masking (empty
    # and partly masked K/V blocks, rows that attend to nothing).
    (Case(1, 128, 256, 2, 1, 64), True, dict(persistent=False)),
    slow(Case(1, 256, 128, 1, 1, 64), True, dict(persistent=False)),
    # Three consumers (d=64's plan from q_len 1024) on a short tile; four
    # warpgroups (`_skip_if_too_wide`), their turns on hardware barriers.
    (Case(1, 192, 128, 1, 1, 64), False, dict(persistent=False,
                                              num_consumers=3)),
    # Short last tiles (256 = 192 + 64 rows: two spare consumers; 320 =
    # 192 + 128: one) whose spares walk the steps without math
    # (`skip_spare`). Three K/V blocks in two stages, so that the producer
    # waits on every spare release; on one CTA, two heads, so that a whole
    # tile follows a short one and the barriers' phases must have come out
    # even; on the launch grid too. (A spare that skipped a release, a K
    # wait or a step hangs here.)
    (Case(1, 256, 384, 2, 2, 64), False, dict(num_ctas=1, num_consumers=3)),
    (Case(1, 320, 384, 2, 2, 64), False, dict(num_ctas=1, num_consumers=3)),
    (Case(1, 256, 384, 1, 1, 64), False, dict(persistent=False,
                                              num_consumers=3)),
    # The consumer schedules: two consumers' turns at a rendezvous and on
    # hardware barriers, and P's row sum after P V.
    slow(Case(1, 128, 128, 1, 1, 64), True, dict(persistent=False,
                                                 hw_turns=False)),
    slow(Case(1, 128, 128, 1, 1, 64), True, dict(persistent=False,
                                                 hw_turns=True)),
    slow(Case(1, 128, 128, 2, 2, 64), False, dict(num_ctas=2,
                                                  sum_after_pv=True)),
    # O rescaled only at steps where a row's max moved (`lazy_rescale`): on
    # any growth (the persistent grid, causal), and beyond 8 (the default
    # threshold; d=128 without a mask has it by its plan, below).
    slow(Case(1, 256, 256, 2, 2, 64), True,
         dict(num_ctas=2, lazy_rescale=True, rescale_threshold=0.0)),
    slow(Case(1, 128, 256, 1, 1, 128), True, dict(persistent=False,
                                                 lazy_rescale=True)),
    # head_dim 128's 128-row K/V tiles; without a mask its plan takes the
    # row sum after P V and rescales O lazily.
    slow(Case(1, 128, 256, 1, 1, 128), True, dict(persistent=False)),
    (Case(1, 128, 256, 1, 1, 128), False, dict(num_ctas=2)),
    # Ragged lengths on the plain kernel (`common.ragged_lengths`): TMA
    # zero-fills the tiles' rows past q_len and kv_len and drops the
    # stores past q_len: the last tile's second consumer has 8 real rows
    # of its 64 at q_len 200 and none at 136 (its first has 8); the last
    # K/V block 72 and 8 real rows. Causal with q_len <= kv_len needs no
    # mask; without causal masking, or with q_len > kv_len, the last K/V
    # block is a masked step (`masks_key_tail`).
    slow(Case(1, 200, 200, 2, 1, 64), True, dict(persistent=False)),
    slow(Case(1, 136, 264, 1, 1, 128), True, dict(num_ctas=2)),
    (Case(1, 200, 200, 2, 1, 64), False, dict(persistent=False)),
    (Case(1, 264, 136, 1, 1, 128), True, dict(num_ctas=2)),
    # Three consumers on a short tile (256 = 192 + 64 rows) with the key
    # tail: the spares compute their rows again (no `skip_spare`).
    (Case(1, 256, 200, 1, 1, 64), False, dict(persistent=False,
                                              num_consumers=3)),
]


@pytest.mark.parametrize("q_len, kv_len, is_causal, head_dim, options", [
    (197, 197, False, 64, dict(persistent=False)),   # ViT-B/16's tokens
    slow(261, 133, True, 64, dict(num_ctas=2)),      # causal, q_len > kv_len
    # Two swizzle tiles a row: column tiles, two Q tiles, a K/V tail.
    (75, 70, False, 128, dict(persistent=False)),
    slow(261, 133, True, 256, dict(num_ctas=2)),
])
def test_interpreted_forward_reads_rows_in_place(q_len, kv_len, is_causal,
                                                 head_dim, options):
  """Lengths off the 8-row TMA tiling (`rows.rows_in_place`):
  `mosaic_forward` on the unpadded rows, TMA's zero fill past the ends
  and clipped stores the tail handling, the last K/V block masked past
  kv_len; out and lse as the reference's. Rows wider than a swizzle tile
  are column tiles (`rows.ColumnTiles`): a copy a tile, each an arrival
  on its barrier, and every product split at the tiles. (The interpreter
  sees one buffer where the GPU has two views: `mosaic_interpret`.)"""
  case = Case(1, q_len, kv_len, 2, 1, head_dim)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=head_dim**-0.5,
                                  is_causal=is_causal, **options)
  assert out.shape == q.shape
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal)


@pytest.mark.parametrize("q_len, kv_len, is_causal", [
    slow(197, 197, False),    # ViT-B/16's tokens
    slow(261, 133, True),     # causal, q_len > kv_len
])
def test_interpreted_forward_on_padded_rows(q_len, kv_len, is_causal):
  """`mosaic_forward(kv_len=)` on rows zero-padded to whole 8-row TMA tiles
  (`attention._plain_attention`'s call where rows are wider than a
  swizzle tile, d=128 here): the padded keys masked, out and lse of the
  real rows as the reference's on the unpadded inputs. Fails without
  `kv_len` (the padded keys' zero scores counted)."""
  from pallas_kernels.mosaic.masked import pad_rows
  case = Case(1, q_len, kv_len, 2, 1, 128)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  out, lse = mosaic_interpret.run(
      mosaic_forward, *(pad_rows(x) for x in (q, k, v)), scale=128**-0.5,
      is_causal=is_causal, kv_len=kv_len, persistent=False)
  assert_forward_within_rule(q, k, v, out[:, :q_len], lse[:, :, :q_len],
                             is_causal=is_causal)


def _skip_if_too_wide(warpgroups: int) -> None:
  """Skips a kernel of `warpgroups` warpgroups that could deadlock this
  process's interpreter (`test_interpreted_wide_forms_in_a_larger_pool`
  runs it)."""
  if warpgroups > mosaic_interpret.MAX_WARPGROUPS:
    pytest.skip(f"{warpgroups} warpgroups could deadlock the interpreter on "
                f"a CPU client of {mosaic_interpret.MAX_WARPGROUPS - 1} "
                f"threads; run in a child with more")


@pytest.mark.parametrize("case, is_causal, options", CASES, ids=str)
def test_interpreted_mosaic_forward_matches_reference(case, is_causal,
                                                      options):
  """out and lse against the float32 reference, within twice the plain
  bf16 computation's error (DESIGN's rule)."""
  _skip_if_too_wide(options.get("num_consumers", 2) + 1)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=7)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=case.head_dim**-0.5,
                                  is_causal=is_causal, **options)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal)


@pytest.mark.parametrize("threshold", [slow(0.0), 8.0])
def test_interpreted_lazy_rescale_with_wide_scores(threshold):
  """Scores 8x the usual spread, so that rows' maxima keep moving by more
  than the threshold after the first K/V tile (at 8: rescales at later
  steps, and P up to 2**8 between them), against the reference. (The
  interpreter runs each thread's branch as the plain product:
  `mosaic_interpret`.)"""
  case = Case(1, 256, 256, 1, 1, 64)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=11)
  scale = 8 * case.head_dim**-0.5
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v, scale=scale,
                                  is_causal=True, num_ctas=2,
                                  lazy_rescale=True,
                                  rescale_threshold=threshold)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=True, scale=scale)


def _segment_ids(*run_lengths):
  """int32 [1, sum(run_lengths)]: ids 0, 1, ... in runs of these lengths."""
  ids = np.repeat(np.arange(len(run_lengths)), run_lengths)
  return jnp.asarray(ids[None], jnp.int32)


def _dense_mask_per_head():
  """bool [1, 2, 100, 200]: head 0 keeps keys 128-199 and a third of the
  rest, head 1 a random 60% with rows 0-9 seeing nothing. No query of the
  first 64 sees keys 64-127, so that a K/V tile's range of Q tiles starts
  past the first (dK/dV's walk from one head's last masked tile to the
  next's first)."""
  i, j = jnp.arange(100)[:, None], jnp.arange(200)
  banded = (j >= 128) | ((i + j) % 3 == 0)
  sparse = jax.random.bernoulli(jax.random.key(8), 0.6, (100, 200))
  sparse = sparse.at[:10].set(False)
  return jnp.stack([banded, sparse])[None].at[:, :, :64, 64:128].set(False)


# name: (case, `flash_attention` mask arguments) for `mosaic_forward_masked`,
# the masks as jax_flash passes them (`validation.normalise_call`); lengths
# that are not multiples of the 64-row tiles (TMA reads past the end fill
# zeros, writes past it are dropped: `mosaic_interpret`'s TMA patches).
MASKED_VARIANTS = {
    # Three 128-row tiles of the forward and dQ grids, whose plan rows
    # take them heaviest first (the last, with every key, first).
    "ragged causal": (Case(1, 260, 200, 1, 1, 64), dict(is_causal=True)),
    # q_offset = kv_len - q_len, GQA 2:1.
    "bottom-right causal": (Case(1, 100, 200, 2, 1, 64),
                            dict(is_causal=True, q_offset=jnp.array([100]))),
    # Blocks left of the window skipped, its edge masked.
    "causal window": (Case(1, 150, 150, 1, 1, 64),
                      dict(is_causal=True, local_window_size=(40, 0))),
    # Per batch: rows past q_length attend to nothing (lse -inf), keys past
    # kv_length are masked, both inside a tile.
    "lengths": (Case(2, 120, 130, 1, 1, 64),
                dict(query_seq_lengths=jnp.array([70, 120]),
                     key_value_seq_lengths=jnp.array([130, 50]))),
    # Not causal, so that it reads the ragged K/V tail.
    "soft cap": (Case(1, 97, 170, 1, 1, 64), dict(logits_soft_cap=5.0)),
    # Rows of two swizzle tiles off the 8-row tiling, read in place as
    # column tiles (`rows.ColumnTiles`), a window over GQA 2:1 heads.
    "window, column tiles": (Case(1, 75, 70, 2, 1, 128),
                             dict(is_causal=True, local_window_size=(20, 0))),
    # A query's and a key's ids, boundaries inside tiles.
    "segments": (Case(1, 100, 150, 1, 1, 64),
                 dict(segment_ids=(_segment_ids(30, 50, 20),
                                   _segment_ids(90, 20, 40)))),
    # ALiBi on every visited tile, a slope per (batch, query head): GQA
    # 2:1 (each head of a K/V tile's group its own in dK/dV),
    # bottom-right causal in one batch, top-left in the other.
    "alibi": (Case(2, 64, 100, 2, 1, 64),
              dict(is_causal=True, q_offset=jnp.array([36, 0]),
                   alibi_slopes=jnp.array([[0.5, 0.25], [0.125, 1.0]]))),
    # Slopes per head; before the soft cap, not causal.
    "alibi soft cap": (Case(1, 97, 170, 2, 1, 64),
                       dict(logits_soft_cap=5.0,
                            alibi_slopes=jnp.array([0.3, 0.05]))),
    # A score_fn of (b, h): GQA 2:1 (dK/dV passes each head of the group
    # its own h), bottom-right causal in one batch.
    "score_fn": (Case(2, 64, 100, 2, 1, 64),
                 dict(is_causal=True, q_offset=jnp.array([36, 0]),
                      score_fn=position_score)),
    # A mask_fn of (b, h): its BlockMask's empty tiles skipped, full ones
    # unmasked, the rest masked head by head (dK/dV: each head of the
    # group); rows past 128 attend to a ragged last block. (The score_fn
    # case checks the batch argument.)
    "mask_fn": (Case(1, 130, 256, 2, 1, 64),
                dict(mask_fn=blocks_and_stripes)),
    # A bias per (batch, head), its sequence axes padded to TMA's 8-row
    # tiling (100 and 150), streamed tile by tile; bottom-right causal.
    "bias": (Case(2, 100, 150, 2, 1, 64),
             dict(is_causal=True, q_offset=jnp.array([50, 0]),
                  bias=2.0 * jax.random.normal(jax.random.key(4),
                                               (2, 2, 100, 150),
                                               jnp.bfloat16))),
    # A bias per (batch, head) and no mask: every tile visited, dbias is
    # the dbias kernel's dS as it is, cut to the lengths.
    "bias, no mask": (Case(2, 100, 150, 2, 1, 64),
                      dict(bias=jax.random.normal(jax.random.key(5),
                                                  (2, 2, 100, 150),
                                                  jnp.bfloat16))),
    # A dense mask per batch beside a bias per head, under a soft cap (the
    # mask after it): both streamed. Batch 0's keeps keys 128-255 and a
    # third of the rest: the first query tile's three K/V tiles masked,
    # unmasked (its mask tile not read), masked; batch 1's is random, rows
    # 0-9 seeing nothing.
    "dense mask, bias": (Case(2, 100, 300, 2, 1, 64),
                         dict(logits_soft_cap=5.0,
                              mask=jnp.stack([
                                  ((jnp.arange(300) >= 128)
                                   & (jnp.arange(300) < 256))
                                  | ((jnp.arange(100)[:, None]
                                      + jnp.arange(300)) % 3 == 0),
                                  jax.random.bernoulli(
                                      jax.random.key(6), 0.6, (100, 300)
                                  ).at[:10].set(False)])[:, None],
                              bias=jax.random.normal(jax.random.key(7),
                                                     (1, 2, 100, 300),
                                                     jnp.bfloat16))),
    # A bias per key (BERT-style padding) broadcast over the heads and
    # queries: a tile's extent of rows, read from its start
    # (`common.repeat_broadcast_axes`); dbias summed over heads and queries.
    # Queries past a tile's extent (200): read from the repeated rows.
    "per-key bias": (Case(1, 200, 150, 2, 1, 64),
                     dict(is_causal=True, q_offset=100,
                          bias=jnp.where(
                              jnp.arange(150) < 90,
                              jax.random.normal(jax.random.key(8), (150,)),
                              -30.0)[None, None, None, :].astype(
                                  jnp.bfloat16))),
    # A bias per query and head, keys past a tile's extent: the dK/dV
    # kernel's streamed axis repeats.
    "per-query bias": (Case(1, 100, 300, 2, 1, 64),
                       dict(bias=jax.random.normal(jax.random.key(9),
                                                   (1, 2, 100, 1),
                                                   jnp.bfloat16))),
    # A dense mask per head, GQA 2:1 (`_dense_mask_per_head`): the
    # backward's dK/dV reads each query head's transposed tiles.
    "dense mask": (Case(1, 100, 200, 2, 1, 64),
                   dict(mask=_dense_mask_per_head())),
    # The reference drops the same weights (`masking.dropout_keep`).
    "dropout": (Case(2, 64, 100, 2, 1, 64),
                dict(is_causal=True, q_offset=jnp.array([36, 0]),
                     dropout_rate=0.3, dropout_rng=jax.random.key(3))),
}


def _masked_call(q, k, v, variants):
  """(scale, spec, keyword operands) of the masked Mosaic kernels for
  `flash_attention`'s mask arguments `variants`, as jax_flash makes them
  (and the bias, where there is one)."""
  from pallas_kernels.mosaic.attention import masked_operand_kwargs
  call = validation.normalise_call(q, k, v, **variants)
  operands = masked_operand_kwargs(call.operands)
  if call.bias is not None:
    operands["bias"] = call.bias
  return call.scale, call.spec, operands


# Masked forward variants whose masks a default one also takes (the
# bottom-right offset: "alibi", "bias"; the window: lazy rescale's; the
# soft cap: lazy rescale's and "dense mask, bias"'; ALiBi: "alibi"; the
# dense mask and the bias: "dense mask, bias"; "ragged causal": the lazy
# rescale's "soft cap" (97 x 300, causal); lengths: that case's tails and
# the sinks test's kv lengths; dropout: its bits test's forward and the
# backward's "dropout"; the GPU tests take every variant).
_SLOW_MASKED = ("bottom-right causal", "causal window", "soft cap",
                "dense mask", "bias", "bias, no mask", "alibi soft cap",
                "lengths", "dropout", "ragged causal", "window, column tiles",
                "per-query bias",
                # `test_broadcast_bias_on_gpu` and the lowering test
                "per-key bias",
                # CI's ten minutes: 12-16 s each interpreted; their GPU
                # twins (`test_masked_kernel_matches_reference_on_gpu`,
                # the lazy rescale's, ALiBi's columns') and lowering tests
                # run, and the Triton kernels take the same masks here
                "alibi", "score_fn", "mask_fn")


@pytest.mark.parametrize("name", [slow(n) if n in _SLOW_MASKED else n
                                  for n in MASKED_VARIANTS])
def test_interpreted_mosaic_forward_masked_matches_reference(name):
  """`mosaic_forward_masked`'s out and lse against the float32 reference
  for the same mask arguments, within twice the plain bf16 computation's
  error."""
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  case, variants = MASKED_VARIANTS[name]
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, **operands)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


@pytest.mark.parametrize("name", [slow("causal window"), "soft cap"])
def test_interpreted_lazy_rescale_masked_forward(name):
  """The ranged forward with O rescaled lazily (`lazy_rescale`), against
  the reference as above, with Q times 8 (exact in bf16) so that rows'
  maxima keep moving past the threshold (the soft cap bounds them)."""
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  case, variants = MASKED_VARIANTS[name]
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=13)
  q = q * 8
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, lazy_rescale=True,
                                  **operands)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


# (case, is_causal, mosaic_backward options): the two kernels (dQ, and
# dK/dV); the fused kernel's are FUSED_BACKWARD_CASES.
BACKWARD_CASES = [
    # d=64's 128-row Q tiles on the persistent grid (its default up to
    # kv_len 1024), GQA 2:1 (by default on ragged lengths, below).
    slow(Case(1, 256, 256, 2, 1, 64), True, dict(block_q=128, num_ctas=2)),
    slow(Case(1, 128, 128, 1, 1, 64), False, dict(persistent=False)),
    # d=128 on the launch grid, lse read early (its default without a mask)
    # and lean producers (bitwise scheduling, here the same numbers).
    (Case(1, 128, 256, 1, 1, 128), False, dict(persistent=False)),
    # The dQ kernel on tiles of its own (`dq_tiles`): 64 Q rows a consumer,
    # 128 K/V rows a step, beside dK/dV's 128-row Q steps; causal, so both
    # kernels' diagonals differ.
    (Case(1, 256, 256, 1, 1, 64), True,
     dict(block_q=128, persistent=False, dq_tiles=(64, 128))),
    # dK/dV on two copies of each K/V head of GQA 4:2, each walking one
    # query head (`kv_head_copies`), the copies summed after (copies in
    # another order would pair query heads with the wrong K/V head).
    slow(Case(1, 128, 256, 4, 2, 64), True,
         dict(persistent=False, kv_head_copies=2)),
    # Ragged lengths on the plain kernels (`common.ragged_lengths`: no
    # mask), as the forward's cases: d=64's plan (128-row Q tiles,
    # persistent), GQA 2:1; d=128's launch grid with kv_len > q_len and
    # < q_len; without causal masking; d=256's plan above 1k, dK/dV with
    # shared K/V rows.
    (Case(1, 200, 200, 2, 1, 64), True, dict(block_q=128, num_ctas=2)),
    slow(Case(1, 136, 264, 1, 1, 128), True, dict(persistent=False)),
    slow(Case(1, 264, 136, 1, 1, 128), True, dict(persistent=False)),
    slow(Case(1, 200, 136, 2, 1, 64), False, dict(persistent=False)),
    slow(Case(1, 136, 264, 1, 1, 256), True, dict(shared_rows=True)),
]


# (case, is_causal, mosaic_backward options) of `scores_ahead`, each also
# run without it (`test_interpreted_scores_ahead_is_bitwise_the_default`).
AHEAD_CASES = [
    # Each step's Sᵀ issued right behind the step before's dK: GQA 2:1 over
    # three Q tiles a head (six steps through two stages, across the
    # heads), on the launch grid; on one persistent CTA walking two K/V
    # tiles, its ring running on across them (two steps a tile in two
    # stages; three in two, so that the second tile starts in slot 1: a
    # walk that ignored the ring's `base` would read the wrong slot); a
    # walk of one step; and d=128's 64-row Q tiles with lse read early.
    slow(Case(1, 384, 256, 2, 1, 64), False,
         dict(block_q=128, persistent=False, scores_ahead=True)),
    slow(Case(1, 256, 256, 1, 1, 64), False,
         dict(block_q=128, num_ctas=1, scores_ahead=True)),
    slow(Case(1, 384, 256, 1, 1, 64), False,
         dict(block_q=128, num_ctas=1, scores_ahead=True)),
    (Case(1, 128, 128, 1, 1, 64), False,
     dict(block_q=128, persistent=False, scores_ahead=True)),
    slow(Case(1, 256, 128, 1, 1, 128), False,
         dict(persistent=False, scores_ahead=True, prefetch_lse=True)),
]

# (case, is_causal, mosaic_backward options) of the fused kernel
# (`fused_dq=True`: dK/dV and a dQ writer, four warpgroups). Two K/V tiles
# of two 64-row consumers, so that the second tile's writer waits for the
# first's turn on each Q tile and reduce-adds onto its stores; two Q tiles.
FUSED_BACKWARD_CASES = [
    # d=64's 128-row Q tiles (two dQ pieces, one a consumer), GQA 2:1,
    # causal (the walk down from the last Q tile, masked steps), each
    # step's piece issued beside the next step's dV and dK.
    (Case(1, 256, 256, 2, 1, 64), True, dict(persistent=False)),
    # d=128's 64-row Q tiles, with the opaque resident rows.
    (Case(1, 128, 256, 1, 1, 128), False, dict()),
]


def _references(q, k, v, d_out, d_lse, **variants):
  """(float32, bf16) `forward_and_grads` of the reference with
  `flash_attention`'s arguments `variants`, under cotangents d_out and
  d_lse ([batch, q_len, heads]); with a bias among them, also its
  gradient ("dbias")."""
  def reference(compute_dtype):
    cast = lambda x: x.astype(compute_dtype)
    if "bias" not in variants:
      return forward_and_grads(
          lambda q, k, v: naive_attention(
              q, k, v, compute_dtype=compute_dtype, **variants),
          cast(q), cast(k), cast(v), cast(d_out), d_lse)
    others = {n: x for n, x in variants.items() if n != "bias"}
    (out, lse), vjp = jax.vjp(
        lambda q, k, v, bias: naive_attention(
            q, k, v, bias=bias, compute_dtype=compute_dtype, **others),
        cast(q), cast(k), cast(v), cast(variants["bias"]))
    grads = vjp((cast(d_out), d_lse))
    return dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv", "dbias"),
                                             grads)))
  return reference(jnp.float32), reference(jnp.bfloat16)


def _backward_test(case, is_causal, options):
  """Asserts dq, dk, dv of `mosaic_backward`'s kernels for `options`
  (`backward.configure`'s) under a random cotangent of out and of lse
  against the float32 reference's, within twice the plain bf16
  computation's error; returns them (`_interpreted_gradients`)."""
  grads, exact, lowp = _interpreted_gradients(case, is_causal, options)
  for name, ours in zip(("dq", "dk", "dv"), grads):
    assert_within_rule(name, ours, exact[name], lowp[name])
  return grads


def _interpreted_gradients(case, is_causal, options):
  """(dq, dk, dv) of `mosaic_backward`'s kernels for `options` under the
  interpreter, and the float32 and bf16 references' `forward_and_grads`.
  delta (`row_statistics`, a Triton kernel the Mosaic GPU interpreter
  cannot take) is computed outside it."""
  from pallas_kernels.mosaic import backward
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=11)
  exact, lowp = _references(q, k, v, d_out, d_lse, is_causal=is_causal)
  out, lse = exact["out"], exact["lse"]
  lse_t = jnp.swapaxes(lse, 1, 2)  # [batch, heads, q_len], the kernels'
  dq_config, dkdv_configs = backward.configure(
      q, k, scale=case.head_dim**-0.5, is_causal=is_causal, **options)
  stats = backward.row_statistics(out.astype(q.dtype), lse_t, d_out,
                                  jnp.swapaxes(d_lse, 1, 2))
  grads = mosaic_interpret.run(backward.gradients, q, k, v, d_out, stats,
                               dq_config, dkdv_configs)
  return grads, exact, lowp


@pytest.mark.parametrize("case, is_causal, options", BACKWARD_CASES, ids=str)
def test_interpreted_mosaic_backward_matches_reference(case, is_causal,
                                                       options):
  """The two Mosaic backward kernels' dq, dk, dv (`_backward_test`)."""
  _backward_test(case, is_causal, options)


@pytest.mark.timeout(300)  # a release or wait too few hangs: fail sooner
                           # (by thread: pyproject's timeout_method)
@pytest.mark.parametrize("case, is_causal, options", AHEAD_CASES, ids=str)
def test_interpreted_scores_ahead_is_bitwise_the_default(case, is_causal,
                                                         options):
  """`scores_ahead` changes when the dK/dV consumers issue and wait, not
  what they sum: its dq, dk, dv obey the tolerance rule and equal the
  kernels' without it bit for bit (a step read from the wrong ring slot
  that only reorders the sums, which the rule cannot see, would not)."""
  ahead = _backward_test(case, is_causal, options)
  plain, _, _ = _interpreted_gradients(case, is_causal,
                                       dict(options, scores_ahead=False))
  for name, a, b in zip(("dq", "dk", "dv"), ahead, plain):
    np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("case, is_causal, options", FUSED_BACKWARD_CASES,
                         ids=str)
def test_interpreted_mosaic_fused_backward_matches_reference(case, is_causal,
                                                             options):
  """The fused kernel's dq, dk, dv (`_backward_test`): its dQ, a sum over
  K/V tiles by reduce-adds in the order of the turn semaphores."""
  _skip_if_too_wide(4)  # two consumers, the producer, the dQ writer
  _backward_test(case, is_causal, dict(options, fused_dq=True))


@pytest.mark.slow
def test_interpreted_wide_forms_in_a_larger_pool():
  """Runs the tests that skip here for want of CPU client threads
  (`_skip_if_too_wide`: the three-consumer forward, the fused backward) in
  a pytest child whose client has `mosaic_interpret.CPU_CLIENT_THREADS`;
  they must all pass there."""
  if mosaic_interpret.MAX_WARPGROUPS >= 4:
    pytest.skip("the wide forms run in this process")
  selected = "fused_backward or num_consumers"
  env = dict(os.environ,
             PJRT_NPROC=str(mosaic_interpret.CPU_CLIENT_THREADS))
  child = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
       "no:cacheprovider", "-k", selected, __file__],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      env=env, capture_output=True, text=True, timeout=300, check=False)
  summary = child.stdout.strip().splitlines()[-1] if child.stdout else ""
  expected = len(FUSED_BACKWARD_CASES) + sum(
      "num_consumers" in getattr(case, "values", case)[2] for case in CASES)
  assert child.returncode == 0 and summary.startswith(
      f"{expected} passed"), child.stdout[-4000:] + child.stderr[-2000:]


# Head dims between the plans' 64, 128 and 256, computed at their own width
# on the next one's plan (`plan.plan_head_dim`): 16-bit rows of 160, 192,
# 320 and 384 bytes in 32-, 64-, 64- and 128-byte swizzles (the
# interpreter checks the kernels' arithmetic at those widths; the swizzles
# themselves, `test_mosaic_head_dims`' lowering and `-m gpu`). Each: the
# forward on its plan (persistent, two CTAs), under causal masking for
# 80 and 160; the masked forward on ragged causal lengths. The backward on
# its plan up to kv_len 1024 (the two kernels at 80 and 96; above 128 dK
# and dV in a pass each, at 160) and with shared K/V rows (the plan above
# 128 and 1024, at 160 in 32-byte swizzle tiles, at 192 in 64).
OWN_WIDTH_CASES = [(80, True), (96, False), (160, True), (192, False)]
# 96 by default (its 64-byte swizzle), the others with `-m slow`.
_own_width = lambda d, *rest: (pytest.param(d, *rest) if d == 96
                               else slow(d, *rest))


@pytest.mark.parametrize("head_dim, is_causal",
                         [_own_width(*c) for c in OWN_WIDTH_CASES])
def test_interpreted_own_width_forward_matches_reference(head_dim,
                                                         is_causal):
  case = Case(1, 128, 256, 2, 1, head_dim)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=3)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=head_dim**-0.5, is_causal=is_causal,
                                  num_ctas=2)
  assert out.shape == q.shape
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal)


# Under -m slow (CI's ten minutes): the masked forward at d=96 runs on the
# GPU ("soft cap, d=96" and its kin), ragged and causal, and here the
# lazy rescale's "soft cap" case is ragged and causal.
@pytest.mark.parametrize("head_dim", [slow(d) for d, _ in OWN_WIDTH_CASES])
def test_interpreted_own_width_masked_forward_matches_reference(head_dim):
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  case, variants = MASKED_VARIANTS["ragged causal"]
  case = Case(1, case.q_len, case.kv_len, 1, 1, head_dim)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, **operands)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


_MAX_FREE_CASES = {
    # Not causal, a ragged K/V tail; Q times 8 so that logits reach the cap.
    "cap 20": dict(logits_soft_cap=20.0),
    # Bottom-right causal with the largest cap it takes, ALiBi before the
    # cap, sinks, and rows that see no key (kv length 0).
    "cap 60 alibi sinks": dict(
        is_causal=True, q_offset=jnp.array([70, 0]), logits_soft_cap=60.0,
        alibi_slopes=jnp.array([0.5, 0.25]),
        key_value_seq_lengths=jnp.array([170, 0]),
        sinks=jnp.array([3.0, -1.0])),
}


@pytest.mark.parametrize("name, fold_cap", [
    # The cap alone folds both its multiplies, beside ALiBi only the one
    # after. (CI's ten minutes: by default the max-free form is the row of
    # one key's test, below, causal with the cap folded.)
    slow("cap 20", False), slow("cap 60 alibi sinks", False),
    slow("cap 20", True), slow("cap 60 alibi sinks", True)])
def test_interpreted_max_free_forward(monkeypatch, name, fold_cap):
  """The masked forward without a running max under a soft cap
  (`KernelStatic.max_free`): out and lse as the reference's; the online
  softmax's `exponentiate` is never called. With `fold_cap`
  (`plan.MASKED_SOFTCAP_FOLDED`) the cap's multiplies are folded into the
  scales (`masking.modify_scores_folded`, counted)."""
  from pallas_kernels import masking
  from pallas_kernels.mosaic import forward_kernel, plan
  from pallas_kernels.mosaic.masked import mosaic_forward_masked

  def no_running_max(*args, **kwargs):
    raise AssertionError("the max-free forward took a running max")
  folds, folded = [], masking.modify_scores_folded

  def counted(*args, **kwargs):
    folds.append(1)
    return folded(*args, **kwargs)
  monkeypatch.setattr(plan, "MASKED_MAX_FREE_HEAD_DIMS", (64,))
  monkeypatch.setattr(plan, "MASKED_SOFTCAP_FOLDED", fold_cap)
  monkeypatch.setattr(forward_kernel, "exponentiate", no_running_max)
  monkeypatch.setattr(masking, "modify_scores_folded", counted)
  case = Case(2, 97, 170, 2, 1, 64)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=8)
  q = q * 8
  variants = dict(_MAX_FREE_CASES[name])
  sinks = variants.pop("sinks", None)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, sinks=sinks,
                                  **operands)
  assert bool(folds) == fold_cap
  assert_forward_within_rule(q, k, v, out, lse, sinks=sinks, **variants)


def test_interpreted_max_free_row_of_one_key_is_its_value(monkeypatch):
  """Without a running max (`KernelStatic.max_free`) no weight is exactly 1,
  yet a causal row that sees one key gives exactly that key's value: O is
  normalised by the row sum of P as P V takes it, rounded
  (benchmarks/diagnostics/max_free_rounding: a sum of the unrounded P gave
  V (1 + δ), δ up to 2^-9); the LSE keeps the exact sum. (With a running
  max the row's one weight is exactly 1: `exponentiate` fails the test.)"""
  from pallas_kernels.mosaic import forward_kernel, plan
  from pallas_kernels.mosaic.masked import mosaic_forward_masked

  def no_running_max(*args, **kwargs):
    raise AssertionError("the max-free forward took a running max")
  monkeypatch.setattr(plan, "MASKED_MAX_FREE_HEAD_DIMS", (64,))
  monkeypatch.setattr(forward_kernel, "exponentiate", no_running_max)
  case = Case(1, 64, 64, 2, 1, 64)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=12)
  q = q * 8
  variants = dict(is_causal=True, logits_soft_cap=5.0)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, **operands)
  np.testing.assert_array_equal(out[:, 0], jnp.broadcast_to(v[:, 0],
                                                            out[:, 0].shape))
  assert_forward_within_rule(q, k, v, out, lse, **variants)


# Sinks in the forward's epilogue: strong enough to take about half of a
# row's weight (a row's LSE is near 5 here), a different one per head.
_SINKS = jnp.array([5.0, -2.0])


@pytest.mark.parametrize("case, options", [
    # The launch grid, GQA 2:1 (each query head its own sink).
    (Case(1, 128, 256, 2, 1, 64), dict(persistent=False)),
    # The persistent grid: two CTAs walk tiles of both heads.
    (Case(1, 256, 256, 2, 2, 64), dict(num_ctas=2)),
    # The row sum after P V, and a running max that lags (lazy rescale).
    slow(Case(1, 128, 256, 2, 1, 64), dict(
        persistent=False, sum_after_pv=True, lazy_rescale=True)),
], ids=str)
def test_interpreted_forward_sinks(case, options):
  """`mosaic_forward(sinks=...)`: out and lse as the reference's with the
  sinks (`masking.apply_sinks`), causal."""
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=3)
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=case.head_dim**-0.5, is_causal=True,
                                  sinks=_SINKS, **options)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=True, sinks=_SINKS)


@pytest.mark.parametrize("case, is_causal, cap, sinks", [
    # Causal, GQA 2:1, the persistent grid.
    (Case(1, 256, 256, 2, 1, 64), True, 20.0, None),
    # The running max at exp2's scale cap log2(e) past any bound on P;
    # not causal, a ragged key tail, sinks.
    slow(Case(1, 128, 200, 2, 2, 64), False, 100.0, _SINKS),
], ids=str)
def test_interpreted_plain_forward_soft_cap(case, is_causal, cap, sinks):
  """`mosaic_forward(soft_cap=...)` (`plan.PLAIN_SOFTCAP_HEAD_DIMS`'s forward): out
  and lse as the reference's with `logits_soft_cap`, Q times 8 so that
  logits reach the cap."""
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  q = q * 8
  out, lse = mosaic_interpret.run(mosaic_forward, q, k, v,
                                  scale=case.head_dim**-0.5,
                                  is_causal=is_causal, soft_cap=cap,
                                  sinks=sinks)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal,
                             logits_soft_cap=cap, sinks=sinks)


@pytest.mark.slow  # CI's ten minutes: the GPU sinks test's "masked" case
def test_interpreted_masked_forward_sinks():
  """`mosaic_forward_masked(sinks=...)` with dropout, and rows that see no
  key (a batch whose kv length is 0): those give out 0 and lse = the
  sink."""
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  case = Case(2, 100, 150, 2, 1, 64)
  variants = dict(is_causal=True, q_offset=jnp.array([50, 0]),
                  key_value_seq_lengths=jnp.array([0, 150]),
                  dropout_rate=0.2, dropout_rng=jax.random.key(1))
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=4)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, sinks=_SINKS,
                                  **operands)
  assert not np.any(out[0])
  np.testing.assert_array_equal(lse[0], np.broadcast_to(
      np.asarray(_SINKS)[:, None], lse[0].shape))
  assert_forward_within_rule(q, k, v, out, lse, sinks=_SINKS, **variants)


def test_sink_gradient_is_the_references():
  """`attention.sink_gradient` from the forward's out and lse (sinks in
  them) and random cotangents of both, against autodiff of the reference,
  with a row that sees no key."""
  from pallas_kernels.mosaic.attention import sink_gradient
  q, k, v, d_out, d_lse = random_inputs(Case(2, 40, 30, 2, 1, 16),
                                        jnp.float32, seed=6)
  variants = dict(is_causal=True, key_value_seq_lengths=jnp.array([0, 30]))

  def attention(sinks):
    return naive_attention(q, k, v, sinks=sinks, compute_dtype=jnp.float32,
                           **variants)
  (out, lse), vjp = jax.vjp(attention, _SINKS)
  want, = vjp((d_out, d_lse))
  got = sink_gradient(_SINKS, out, jnp.swapaxes(lse, 1, 2), d_out,
                      jnp.swapaxes(d_lse, 1, 2))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert sink_gradient(None, out, lse, d_out, d_lse) is None


@pytest.mark.slow  # the default masked cases with causal ALiBi take the form too
def test_interpreted_alibi_columns_match_reference(monkeypatch):
  """Causal ALiBi as a per-column term with the rows' left in the LSE
  (`common.alibi_columns`): out and lse as the reference's, GQA 2:1,
  bottom-right causal in one batch and top-left in the other."""
  from pallas_kernels.mosaic import plan
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  monkeypatch.setattr(plan, "MASKED_ALIBI_COLUMNS", True)
  case = Case(2, 200, 260, 2, 1, 64)   # two tiles: rows from 0 to 192
  variants = dict(is_causal=True, q_offset=jnp.array([60, 0]),
                  alibi_slopes=jnp.array([[0.5, 0.25], [0.125, 1.0]]))
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=5)
  scale, spec, operands = _masked_call(q, k, v, variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k, v,
                                  scale=scale, spec=spec, **operands)
  assert_forward_within_rule(q, k, v, out, lse, **variants)


@pytest.mark.parametrize("head_dim, is_causal, options", [
    *(_own_width(d, c, dict(num_ctas=2)) for d, c in OWN_WIDTH_CASES[:3]),
    slow(160, False, dict(shared_rows=True, persistent=False)),
    slow(192, True, dict(shared_rows=True, persistent=False)),
], ids=str)
def test_interpreted_own_width_backward_matches_reference(head_dim, is_causal,
                                                          options):
  """dq, dk, dv (`_backward_test`), GQA 2:1."""
  _backward_test(Case(1, 128, 128, 2, 1, head_dim), is_causal, options)


@pytest.mark.parametrize("name, copies", [
    # (Ragged causal rows: the GPU's "soft cap, d=96" and "causal window";
    # "window, column tiles" below is the default masked backward here.)
    slow("ragged causal", None), slow("lengths", None),
    # ALiBi's slopes, mask_fn's and score_fn's h per query head of a K/V
    # tile's group (no copies: with as many copies as the group, each copy
    # is one head).
    # (The dense mask's forward tiles: the forward's default "dense mask,
    # bias"; its transposed per-head tiles, and mask_fn's per-head plan
    # rows, here under -m slow, as are their forwards: CI's ten minutes;
    # their GPU tests and lowering tests run by default.)
    slow("alibi", 1), slow("score_fn", 1), slow("mask_fn", 1),
    slow("dense mask", 1),
    # mask_fn's tiles per head: with a K/V copy per query head the dK/dV
    # plan rows are per K/V head too (`masked.head_plans`).
    slow("mask_fn", 2),
    # Rows of two swizzle tiles read in place as column tiles by the masked
    # dQ and dK/dV kernels (its forward: the plain forward's in-place case).
    ("window, column tiles", None),
    # Dropout's hash and ALiBi's slopes are per query head: on K/V copies
    # (`kv_head_copies`) each copy's heads must still be the call's (under
    # -m slow: the GPU's masked backward tests take dropout on copies, and
    # its bits against Triton's).
    slow("dropout", 2),
    # A bias per (batch, head) in both kernels (dK/dV: each head's
    # transposed tiles) and dbias, dS in bf16 from the dbias kernel;
    # bottom-right causal, so that the tiles the plan skips are never
    # written (the interpreter's outputs start as NaN) and must be zeroed.
    slow("bias", 1),
    # A bias per head broadcast over the batch: dS in float32, summed.
    slow("dense mask, bias", 1),
    # No mask: no tile to zero, dS passed on as it is.
    slow("bias, no mask", 1),
    # Biases broadcast along a sequence axis: per key (both kernels' tiles
    # from a tile's extent of rows; dS in float32, summed over heads and
    # queries) and per query; under -m slow since their GPU test
    # (`test_broadcast_bias_on_gpu`) and lowering test run by default.
    slow("per-key bias", None), slow("per-query bias", None)])
def test_interpreted_mosaic_backward_masked_matches_reference(name, copies,
                                                              monkeypatch):
  """`mosaic_backward_masked`'s dq, dk, dv and dbias (its plan rows,
  padded statistics and ranged kernels) under a random cotangent of out
  and of lse, against the float32 reference's, within twice the plain
  bf16 computation's error. As above, `row_statistics` runs outside the
  interpreter, on the arguments that the masked backward passes it."""
  from pallas_kernels.mosaic import backward
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  case, variants = MASKED_VARIANTS[name]
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=11)
  exact, lowp = _references(q, k, v, d_out, d_lse, **variants)
  # The kernels' layouts: out like q, lse and d_lse [batch, heads, q_len].
  args = (exact["out"].astype(q.dtype), jnp.swapaxes(exact["lse"], 1, 2),
          d_out, jnp.swapaxes(d_lse, 1, 2))
  stats = backward.row_statistics(*args)

  def precomputed_statistics(*given):
    assert all(a is b for a, b in zip(given, args, strict=True))
    return stats

  monkeypatch.setattr(backward, "row_statistics", precomputed_statistics)
  scale, spec, operands = _masked_call(q, k, v, variants)
  grads = mosaic_interpret.run(mosaic_backward_masked, q, k, v, *args,
                               scale=scale, spec=spec, kv_head_copies=copies,
                               **operands)
  names = ("dq", "dk", "dv") + (("dbias",) if spec.has_bias else ())
  for grad, ours in zip(names, grads):
    assert_within_rule(grad, ours, exact[grad], lowp[grad])


def _check_masked_backward_without_scores(monkeypatch, case, variants, *,
                                          seed, flag, why, q_factor=1.0):
  """`mosaic_backward_masked` under `variants` with `plan.<flag>` on and
  `masking.modify_scores` patched to fail inside the kernels (raising
  `why`), so that the form under test is the one taken: dq, dk, dv (and
  dbias with a bias) against the reference under random cotangents, on
  the reference's out and lse."""
  from pallas_kernels import masking as kernel_masking
  from pallas_kernels.mosaic import backward, plan
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=seed)
  q = q * q_factor
  exact, lowp = _references(q, k, v, d_out, d_lse, **variants)
  args = (exact["out"].astype(q.dtype), jnp.swapaxes(exact["lse"], 1, 2),
          d_out, jnp.swapaxes(d_lse, 1, 2))
  scale, spec, operands = _masked_call(q, k, v, variants)

  def refuse(*args, **kwargs):
    raise AssertionError(why)
  monkeypatch.setattr(plan, flag, True)
  monkeypatch.setattr(kernel_masking, "modify_scores", refuse)
  stats = backward.row_statistics(*args)
  monkeypatch.setattr(backward, "row_statistics", lambda *given: stats)
  grads = mosaic_interpret.run(mosaic_backward_masked, q, k, v, *args,
                               scale=scale, spec=spec, **operands)
  names = ("dq", "dk", "dv") + (("dbias",) if "bias" in variants else ())
  for grad, ours in zip(names, grads):
    assert_within_rule(grad, ours, exact[grad], lowp[grad])


@pytest.mark.slow  # the default masked cases with causal ALiBi take the form too
@pytest.mark.parametrize("with_bias", [False, True])
def test_interpreted_alibi_columns_backward(monkeypatch, with_bias):
  """The masked backward with causal ALiBi as a term per key and one per
  query (`BackwardStatic.alibi_columns`): dq, dk, dv (and dbias) as the
  reference's, GQA 2:1, bottom-right causal in one batch, two 128-row
  tiles; no index tile taken."""
  variants = dict(is_causal=True, q_offset=jnp.array([60, 0]),
                  alibi_slopes=jnp.array([[0.5, 0.25], [0.125, 1.0]]))
  if with_bias:
    variants["bias"] = jax.random.normal(jax.random.key(2),
                                         (2, 2, 200, 260), jnp.bfloat16)
  _check_masked_backward_without_scores(
      monkeypatch, Case(2, 200, 260, 2, 1, 64), variants, seed=12,
      flag="MASKED_ALIBI_COLUMNS",
      why="the column form took ALiBi per score")


@pytest.mark.slow  # CI's ten minutes: lowered by default
# (`test_folded_cap_backward_lowers_with_fewer_multiplies`), run on the GPU
def test_interpreted_folded_cap_backward(monkeypatch):
  """The masked backward with the cap's multiplies folded into the scales
  (`BackwardStatic.fold_cap`): dq, dk, dv as the reference's, GQA 2:1,
  causal with query and key tails (two Q tiles, three K/V tiles), logits
  well past the cap (q scaled by 4); the unfolded form not taken."""
  _check_masked_backward_without_scores(
      monkeypatch, Case(1, 72, 130, 2, 1, 64),
      dict(is_causal=True, logits_soft_cap=5.0), seed=15,
      flag="MASKED_BACKWARD_SOFTCAP_FOLDED",
      why="the backward took the unfolded cap", q_factor=4.0)


@pytest.mark.parametrize("q_len, kv_len, is_causal, head_dim", [
    # The whole route (forward, backward and their padding) of parts the
    # default suite checks apart: `-m slow` (CI's ten minutes).
    slow(99, 99, False, 64),      # rows read in place, not causal
    slow(197, 197, False, 64),    # ViT's tokens
    slow(136, 100, True, 64),     # causal, q_len > kv_len: whole 8-row tiles
    # Rows of two swizzle tiles, in place a column tile at a time in both
    # directions.
    slow(75, 70, False, 128),
])
def test_interpreted_ragged_route(monkeypatch, q_len, kv_len, is_causal,
                                  head_dim):
  """`mosaic_attention` at lengths no tile divides where real queries see
  past kv_len (`attention._masked`: the plain forward with its key tail
  masked, the masked forward patched to fail; the masked backward on the
  padded rows, whose zero keys add nothing): out, lse and the gradients
  under random cotangents against the reference (`_check_plain_route`)."""
  from pallas_kernels.mosaic import attention

  def refuse(*_, **__):
    raise AssertionError("a plain call reached the masked forward")
  monkeypatch.setattr(attention, "mosaic_forward_masked", refuse)
  case = Case(1, q_len, kv_len, 2, 1, head_dim)
  _check_plain_route(monkeypatch, *random_inputs(case, jnp.bfloat16,
                                                 seed=13),
                     is_causal=is_causal)


def _check_plain_route(monkeypatch, q, k, v, d_out, d_lse, *, is_causal,
                       spec=None, **variants):
  """`mosaic_attention`'s out, lse and gradients (scale 0.125) under the
  cotangents d_out and d_lse against the reference with `variants`.
  delta's Triton kernel (`backward.row_delta`), which the Mosaic
  interpreter cannot take, is computed by XLA."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention, backward
  monkeypatch.setattr(backward, "row_delta", lambda out, d_out, **_: (
      jnp.swapaxes(jnp.sum(out.astype(jnp.float32)
                           * d_out.astype(jnp.float32), -1), 1, 2)))

  def attend(q, k, v):
    out, lse = attention.mosaic_attention(
        q, k, v, scale=0.125, is_causal=is_causal, spec=spec,
        backward_blocks=BlockSizes.get_default(q.shape[-1], "NVIDIA H200"))
    return out, jnp.swapaxes(lse, 1, 2)
  names = ("out", "lse", "dq", "dk", "dv")
  ours = mosaic_interpret.run(
      lambda: [forward_and_grads(attend, q, k, v, d_out, d_lse)[n]
               for n in names])
  exact, lowp = _references(q, k, v, d_out, d_lse, is_causal=is_causal,
                            scale=0.125, **variants)
  for name, got in zip(names, ours):
    assert_within_rule(name, got, exact[name], lowp[name])


@pytest.mark.slow  # the whole route, of parts the default suite checks apart
def test_interpreted_soft_cap_route(monkeypatch):
  """`mosaic_attention` of a causal call whose only change is a soft cap,
  with `plan.PLAIN_SOFTCAP_HEAD_DIMS`: the plain forward (the masked one patched to
  fail), the masked backward on its residuals; out, lse and gradients
  under random cotangents against the reference."""
  from pallas_kernels.mosaic import attention, plan

  def refuse(*_, **__):
    raise AssertionError("a capped plain call reached the masked forward")
  monkeypatch.setattr(plan, "PLAIN_SOFTCAP_HEAD_DIMS", (64, 128, 256))
  monkeypatch.setattr(attention, "mosaic_forward_masked", refuse)
  case, cap = Case(1, 200, 200, 2, 1, 64), 10.0
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=14)
  spec = masking.MaskSpec(q_len=200, kv_len=200, is_causal=True,
                          logits_soft_cap=cap)
  _check_plain_route(monkeypatch, q * 4, k, v, d_out, d_lse, is_causal=True,
                     spec=spec, logits_soft_cap=cap)


@pytest.mark.parametrize("head_dim, block_kv, kv_len", [
    (64, 64, 128), (256, 128, 128), (128, 256, 512), (64, 64, 197),
    (128, 256, 200)])
@pytest.mark.parametrize("is_causal", [slow(False), slow(True)])
def test_interpreted_fp8_forward_matches_reference(is_causal, head_dim,
                                                   block_kv, kv_len):
  """The FP8 forward (P as wgmma's register operand, V's keys permuted in
  its transpose, `mosaic_interpret` giving `fp8_operand`'s permutation of
  P) against float32 attention within twice the emulated FP8
  arithmetic's error (tests/test_mosaic_fp8.py's rule). GQA 2:1, 128
  keys: two 64-key tiles at d=64; one 128-key tile at d=256, whose O
  leaves in two column pieces (`forward_kernel.FP8_O_COLUMNS`); at d=128
  two of its planned 256-key tiles; key tails, the last block masked past
  kv_len without a causal mask (kv_len 197: K/V rows padded to 200; 200
  on a 256-key tile). Fails if
  V's keys are left in order (error 0.64 against 0.014), if the second
  piece holds the first's columns (3.4-4.7 against 0.2), or if it is
  stored over the first (NaN: the columns never written)."""
  from benchmarks.fp8_accuracy import emulated_fp8_attention
  from jax_flash import fp8 as public_fp8
  from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8
  keys = jax.random.split(jax.random.key(21), 3)
  q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key, shape in
             zip(keys, ((1, 128, 2, head_dim), (1, kv_len, 1, head_dim),
                        (1, kv_len, 1, head_dim))))
  q8, k8, v8 = (public_fp8.quantize_fp8(x) for x in (q, k, v))
  out, _ = mosaic_interpret.run(
      mosaic_forward_fp8, q8.data, k8.data, v8.data, q_descale=q8.descale,
      k_descale=k8.descale, v_descale=v8.descale, scale=0.125,
      is_causal=is_causal, block_kv=block_kv)
  exact = naive_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                          is_causal=is_causal, scale=0.125)[0]
  emulated = emulated_fp8_attention(q8, k8, v8, is_causal=is_causal,
                                    scale=0.125)[0]
  yardstick = np.abs(np.asarray(emulated) - exact).max()
  assert np.abs(out - exact).max() <= 2 * yardstick + 1e-3


# name: flash_attention mask arguments of the FP8 kernel
# with masks (the masked kernel's plan rows): [2, 100, 2, 64] queries on
# [2, 200, 1, 64] keys (GQA 2:1, kv_len no multiple of the 64-key tiles).
_FP8_MASKED_VARIANTS = {
    # Bottom-right causal with a window, per batch; keys past a length.
    "window lengths": (dict(is_causal=True, q_offset=jnp.array([100, 30]),
                            local_window_size=(70, 0),
                            key_value_seq_lengths=jnp.array([200, 90]))),
    # Score changes on the true (descaled) scores, segment ids.
    "soft cap alibi segments": (dict(
        logits_soft_cap=5.0, alibi_slopes=jnp.array([0.3, 0.05]),
        segment_ids=(jnp.repeat(jnp.array([0, 1]), 50),
                     jnp.repeat(jnp.array([0, 1]), 100)))),
    # A dense mask per batch, a mask_fn and a score_fn of (b, h).
    "dense mask_fn score_fn": (dict(
        mask=jax.random.bernoulli(jax.random.key(9), 0.7, (2, 1, 100, 200)),
        mask_fn=blocks_and_stripes, score_fn=position_score)),
}


@pytest.mark.parametrize("name", [slow(n) for n in _FP8_MASKED_VARIANTS])
def test_interpreted_fp8_forward_with_masks(name):
  """The FP8 forward on the masked kernel's plan rows against float32
  attention on the dequantised inputs with the same masks, within twice
  the emulated FP8 arithmetic's error (`emulated_fp8_attention` with the
  masks). The soft cap fails it when applied to S before the Q and K
  factors (error 1.07 against 0.021)."""
  from benchmarks.fp8_accuracy import emulated_fp8_attention
  from jax_flash import fp8 as public_fp8
  from pallas_kernels.mosaic.attention import masked_operand_kwargs
  from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8
  variants = _FP8_MASKED_VARIANTS[name]
  variants = {n: jnp.broadcast_to(x, (2, *x.shape[1:]))
              if n == "alibi_slopes" else x for n, x in variants.items()}
  keys = jax.random.split(jax.random.key(5), 3)
  q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key, shape in
             zip(keys, ((2, 100, 2, 64), (2, 200, 1, 64), (2, 200, 1, 64))))
  q8, k8, v8 = (public_fp8.quantize_fp8(x) for x in (q, k, v))
  call = validation.normalise_call(q, k, v, scale=0.125, **variants)
  operands = {n: x for n, x in masked_operand_kwargs(call.operands).items()
              if x is not None}
  out, _ = mosaic_interpret.run(
      mosaic_forward_fp8, q8.data, k8.data, v8.data, q_descale=q8.descale,
      k_descale=k8.descale, v_descale=v8.descale, scale=0.125,
      is_causal=call.spec.is_causal, spec=call.spec, block_kv=64,
      **operands)
  dequantised = [x.dequantize() for x in (q8, k8, v8)]
  exact = naive_attention(*dequantised, scale=0.125, **variants)[0]
  emulated = emulated_fp8_attention(q8, k8, v8, scale=0.125, **variants)[0]
  yardstick = np.abs(np.asarray(emulated) - exact).max()
  assert np.abs(out - exact).max() <= 2 * yardstick + 1e-3


@pytest.mark.slow  # CI's ten minutes: `test_dropout_bits_match_triton_on_gpu`
def test_interpreted_dropout_drops_the_triton_kernels_bits(monkeypatch):
  """The masked Mosaic kernels drop exactly the weights the Triton kernels
  drop (and `masking.dropout_keep` says), recovered bit for bit from their
  results: with Q = 0 every kept weight is 1 / kv_len, and with V the
  identity over the keys, O[i, j] is weight (i, j) times 1 / (1 - rate),
  nonzero exactly where kept; with dO the identity over the queries, dV of
  the dK/dV kernel (its Sᵀ tiles) is the transpose. Two heads (two
  streams; the batch's part of the stream is checked against the
  reference by the "dropout" variant), two 64-key tiles. Also: the LSE is
  log(kv_len), dropout's excluded, as in the reference."""
  from pallas_kernels.mosaic import backward
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  batch, q_len, kv_len, heads, dim, rate = 1, 64, 128, 2, 128, 0.3
  q = jnp.zeros((batch, q_len, heads, dim), jnp.bfloat16)
  k = jax.random.normal(jax.random.key(1), (batch, kv_len, heads, dim),
                        jnp.bfloat16)
  identity = lambda n: jnp.broadcast_to(
      jnp.eye(n, dim, dtype=jnp.bfloat16)[None, :, None],
      (batch, n, heads, dim))
  variants = dict(dropout_rate=rate, dropout_rng=jax.random.key(42))
  scale, spec, operands = _masked_call(q, k, identity(kv_len), variants)
  out, lse = mosaic_interpret.run(mosaic_forward_masked, q, k,
                                  identity(kv_len), scale=scale, spec=spec,
                                  block_kv=64, **operands)
  triton_out = jax_flash.flash_attention(q, k, identity(kv_len),
                                         implementation="triton",
                                         interpret=True, **variants)
  expected = np.asarray(masking.dropout_keep(
      operands["dropout_seed"], np.arange(batch)[:, None, None, None],
      np.arange(heads)[None, None, :, None],
      np.arange(q_len)[None, :, None, None],
      np.arange(kv_len)[None, None, None, :], rate))   # [b, q, h, kv]
  np.testing.assert_array_equal(out[..., :kv_len] != 0, expected)
  np.testing.assert_array_equal(np.asarray(triton_out, np.float32) != 0,
                                expected)
  kept_weight = np.float32(jnp.bfloat16(1 / (kv_len * (1 - rate))))
  np.testing.assert_array_equal(out[..., :kv_len][expected], kept_weight)
  np.testing.assert_allclose(lse, np.log(kv_len), rtol=1e-6)

  d_out = identity(q_len)
  args = (jnp.asarray(out, jnp.bfloat16), jnp.asarray(lse), d_out,
          jnp.zeros_like(lse))
  stats = backward.row_statistics(*args)
  monkeypatch.setattr(backward, "row_statistics", lambda *given: stats)
  _, _, dv, _ = mosaic_interpret.run(mosaic_backward_masked, q, k,
                                  identity(kv_len), *args, scale=scale,
                                  spec=spec, **operands)
  # dv [b, kv, h, i] = kept (i, kv) weight of head h.
  np.testing.assert_array_equal(dv[..., :q_len] != 0,
                                expected.transpose(0, 3, 2, 1))
