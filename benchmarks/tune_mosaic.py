"""Sweeps the Mosaic GPU kernels' tiles and pipeline depth; prints the best.

    python -m benchmarks.tune_mosaic   # -> results/h200_mosaic_sweep.json
    python -m benchmarks.tune_mosaic --render a.json   # -> a.md: its tables
    python -m benchmarks.tune_mosaic --render a.json b.json ab.json  # merged

At seq 4096 (`--seq`), batch·seq = 16384, hidden 2048, bf16, for head_dim
64, 128 and 256, causal and not: every (block_q, block_kv,
max_concurrent_steps) of `FORWARD_SPACE` for `mosaic_forward` (timing the
forward) and of `BACKWARD_SPACE` for `mosaic_backward` (timing the backward
alone, on residuals from one forward); `--kernels` picks other sweeps of
`KERNELS`, each an A/B of one choice of the plan
(`pallas_kernels/mosaic/plan.py`) against its alternatives, every other
choice as the plan makes it. A candidate the kernel refuses (too much
shared memory or too many registers: NotImplementedError) is recorded with
its reason. A cell's candidates are compiled first, then timed one at a
time, so nothing else runs on the GPU while one is timed; with `--rounds
N` they are timed N times in turn (A, B, B, A, ...), each keeping the
median of its rounds, since the GPU's clocks drift between candidates
timed one after another (single A/Bs of a few % flipped sign between
runs). The best per (kernel, head_dim) is the best geometric mean of its
causal and non-causal TFLOP/s.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import math
import os
import statistics
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp

from benchmarks import common, render
from pallas_kernels import compat

FORWARD_SPACE = dict(block_q=(64, 128), block_kv=(64, 128, 192),
                     max_concurrent_steps=(2, 3, 4))
BACKWARD_SPACE = dict(block_q=(64, 128), block_kv=(64, 128),
                      max_concurrent_steps=(2, 3))
# The forward's choices (`plan.ForwardConfig`), one at a time.
FORWARD_PERSISTENT_SPACE = dict(persistent=(False, True))
# Three consumer warpgroups against two, with both K/V tile heights, and
# three consumers' ring depth (they leave room for 4 stages at d=64).
CONSUMERS_SPACE = dict(num_consumers=(2, 3), block_kv=(64, 128))
CONSUMER_STAGES_SPACE = dict(num_consumers=(3,),
                             max_concurrent_steps=(2, 3, 4))
HW_TURNS_SPACE = dict(hw_turns=(False, True))
SUM_AFTER_PV_SPACE = dict(sum_after_pv=(False, True))
RESCALE_SPACE = dict(lazy_rescale=(False, True))
MMA_ROW_SUM_SPACE = dict(mma_row_sum=(False, True))
# The backward's (`plan.BackwardConfig`), one at a time; `block_q=128` is
# d=64's plan (`--head-dims 64`).
OVERLAP_SPACE = dict(overlap_softmax=(False, True))
BACKWARD_PERSISTENT_SPACE = dict(persistent=(False, True))
# The fused dQ against the two kernels, on the launch grid, with both Q
# tile heights (it takes 128 at d=64, 64 at d=128).
FUSED_SPACE = dict(fused_dq=(False, True), block_q=(64, 128),
                   persistent=(False,))
SHARED_SPACE = dict(shared_rows=(False, True), persistent=(False, True))
PREFETCH_LSE_SPACE = dict(prefetch_lse=(False, True), fused_dq=(False,))
LEAN_SPACE = dict(lean_producer=(False, True), fused_dq=(False,))
AHEAD_SPACE = dict(scores_ahead=(False, True), fused_dq=(False,),
                   persistent=(False,))
# The dQ kernel on tiles of its own, against the dK/dV kernel's (d=64's
# 128 x 64), on the launch grid and on the persistent one; first the
# plan's own row (at d=64 under causal masking up to 8k the persistent
# grid, whose 128 x 64 dQ tiles spill, h100_spill_survey.md).
DQ_TILES_CANDIDATES = [{}] + [
    dict(fused_dq=False, persistent=persistent, dq_tiles=tiles)
    for persistent in (False, True) for tiles in (None, (64, 128), (64, 64))]
BACKWARD_STAGES_SPACE = dict(max_concurrent_steps=(2, 3))
# dK/dV on K/V copies, MQA (one K/V head for the cell's 2048 / head_dim
# query heads: batch x K/V tiles CTAs, 128 at the standard grid's
# batch·seq 16k), on the launch grid's two kernels.
KV_COPIES_SPACE = dict(kv_head_copies=(1, 2, 4, 8, 16), persistent=(False,),
                       fused_dq=(False,))
# What the fused dQ's fixed order costs (`turn_cost_benchmark`): the fused
# kernel, the same without its turn waits (a diagnostic: its dQ is
# wrong), and the two kernels. If the unordered kernel gains much and the
# ordered one does not, determinism's order is the lever (e.g. fewer,
# coarser turns); if neither does, the kernel's steps are.
TURN_COST_CANDIDATES = [dict(fused_dq=True, persistent=False),
                        dict(fused_dq=True, persistent=False,
                             unordered_turns=True),
                        dict(fused_dq=False, persistent=False)]


def candidates(space: dict | list[dict]) -> list[dict]:
  """Every combination of a space's values, or a list of candidates as
  given."""
  if isinstance(space, list):
    return space
  return [dict(zip(space, values))
          for values in itertools.product(*space.values())]


def forward_benchmark(cell: common.Cell, blocks: dict):
  from pallas_kernels.mosaic.forward import mosaic_forward
  q, k, v, _ = common.attention_inputs(cell.shape, cell.dtype)
  fn = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=cell.head_dim**-0.5, is_causal=cell.causal, **blocks))
  return fn, (q, k, v)


def backward_benchmark(cell: common.Cell, blocks: dict,
                       num_kv_heads: int | None = None):
  """The backward alone; `num_kv_heads`: K and V of that many heads (the
  cell's first) for its query heads (GQA, MQA)."""
  from pallas_kernels.mosaic.backward import mosaic_backward
  from pallas_kernels.mosaic.forward import mosaic_forward
  q, k, v, d_out = common.attention_inputs(cell.shape, cell.dtype)
  if num_kv_heads is not None:
    k, v = k[:, :, :num_kv_heads], v[:, :, :num_kv_heads]
  scale = cell.head_dim**-0.5
  out, lse = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=scale, is_causal=cell.causal))(q, k, v)
  fn = jax.jit(lambda *a: mosaic_backward(
      *a, scale=scale, is_causal=cell.causal, **blocks))
  return fn, (q, k, v, out, lse, d_out)


def fp8_forward_benchmark(cell: common.Cell, blocks: dict):
  """The FP8 forward as the grid times it (`peers.jax_flash_mosaic_fp8`),
  with the candidate's options."""
  from benchmarks import peers
  bench = peers.jax_flash_mosaic_fp8(cell, **blocks)
  return bench.fn, bench.args


# The FP8 forward's lazy O rescale (`mosaic_forward_fp8(lazy_rescale=)`),
# as the bf16 kernel's but with P rounded to e4m3 after it.
FP8_RESCALE_SPACE = dict(lazy_rescale=(False, True))
# The K/V tile at head dims between 128 and 256 (`plan.default_block_kv`
# gives them d=256's 64 keys; at 144-176 Q and two stages of 128-key K/V
# tiles fit shared memory): d=160's forward was 0.93x tokamax's
# (h200_models.md). `--head-dims 144 160 176 --seq 4096`.
BETWEEN_TILES_SPACE = dict(block_kv=(64, 128))
# The FP8 forward's K/V tile and ring depth (`plan.FP8_BLOCK_KV`): at
# FP8's double matmul rate a step's fixed work (the row max's shuffles,
# O's rescale, the barriers) weighs twice as much against its matmuls, and
# FlashAttention-3 takes longer steps in FP8 (kBlockN 160, 224, 128 at
# d=64, 128, 256; 128, 128, 80 in 16 bits). 192 keys lost to 128 and 256
# at d=64 and 128 (benchmarks/NOTES.md, FP8 forward) and left the space. A
# candidate that does not fit shared memory is recorded as refused.
FP8_TILES_SPACE = dict(block_kv=(64, 128, 256),
                       max_concurrent_steps=(2, 3))


# The masked kernels on a causal sliding window of MASKED_WINDOW keys
# (`masked.mosaic_forward_masked`, `masked_backward.mosaic_backward_masked`).
# Their TFLOP/s use the causal count, of which a window does a fraction:
# compare candidates only. The masked backward's `overlap_softmax` has not
# been timed there (the plain kernels' is on).
MASKED_WINDOW = 1024
MASKED_RESCALE_SPACE = dict(lazy_rescale=(False, True))
MASKED_OVERLAP_SPACE = dict(overlap_softmax=(False, True))


def _window_spec(cell: common.Cell):
  from jax_flash import masking
  return masking.MaskSpec(q_len=cell.seq_len, kv_len=cell.seq_len,
                          is_causal=True, window=(MASKED_WINDOW, 0))


def masked_forward_benchmark(cell: common.Cell, blocks: dict):
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  q, k, v, _ = common.attention_inputs(cell.shape, cell.dtype)
  spec = _window_spec(cell)
  fn = jax.jit(lambda q, k, v: mosaic_forward_masked(
      q, k, v, scale=cell.head_dim**-0.5, spec=spec, **blocks))
  return fn, (q, k, v)


def ragged_forward_benchmark(cell: common.Cell, blocks: dict):
  """The forward at a length its tiles do not divide (`--seq 1000`, 197,
  ...) as `blocks["form"]` computes it: the plain kernel on rows padded to
  whole 8-row tiles with the key tail masked (what
  `attention._plain_attention` runs), or the masked kernel on the plain
  mask. Its A/B chose the plain kernel for every plain call
  (`attention._masked`)."""
  from jax_flash import masking
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  q, k, v, _ = common.attention_inputs(cell.shape, cell.dtype)
  scale, length = cell.head_dim**-0.5, cell.seq_len
  if blocks["form"] == "plain":
    unused = BlockSizes.get_default(cell.head_dim, "NVIDIA H200")  # bwd's
    return jax.jit(lambda q, k, v: attention._plain_attention(
        q, k, v, scale, cell.causal, unused, None)[0]), (q, k, v)
  spec = masking.MaskSpec(q_len=length, kv_len=length, is_causal=cell.causal)
  return jax.jit(lambda q, k, v: mosaic_forward_masked(
      q, k, v, scale=scale, spec=spec)[0]), (q, k, v)


def masked_term_forward_benchmark(cell: common.Cell, blocks: dict):
  """The masked forward on a causal mask with `blocks["term"]`
  (`causal_spec`), the other entries its options."""
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  blocks = dict(blocks)
  spec, operands = causal_spec(cell, blocks.pop("term"))
  q, k, v, _ = common.attention_inputs(cell.shape, cell.dtype)
  fn = jax.jit(lambda q, k, v, operands: mosaic_forward_masked(
      q, k, v, scale=cell.head_dim**-0.5, spec=spec, **operands,
      **blocks)[0])
  return functools.partial(fn, operands=operands), (q, k, v)


def masked_backward_benchmark(cell: common.Cell, blocks: dict):
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  q, k, v, d_out = common.attention_inputs(cell.shape, cell.dtype)
  scale, spec = cell.head_dim**-0.5, _window_spec(cell)
  out, lse = jax.jit(lambda q, k, v: mosaic_forward_masked(
      q, k, v, scale=scale, spec=spec))(q, k, v)
  fn = jax.jit(lambda *a: mosaic_backward_masked(
      *a, scale=scale, spec=spec, **blocks))
  return fn, (q, k, v, out, lse, d_out)


def masked_causal_backward_benchmark(cell: common.Cell, blocks: dict):
  """The masked backward alone on a causal mask with `blocks["term"]`
  (`causal_spec`: none, ALiBi, dropout 0.1, a soft cap of 30): its dQ
  grid's plan rows heaviest first or in tile order (`blocks["form"]`,
  `masked_schedule`), the other entries its options."""
  blocks = dict(blocks)
  form = blocks.pop("form", "masked")
  spec, operands = causal_spec(cell, blocks.pop("term", "none"))
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
  q, k, v, d_out = common.attention_inputs(cell.shape, cell.dtype)
  scale = cell.head_dim**-0.5
  out, lse = jax.jit(lambda q, k, v, operands: mosaic_forward_masked(
      q, k, v, scale=scale, spec=spec, **operands))(q, k, v, operands)
  fn = jax.jit(lambda *a, operands: mosaic_backward_masked(
      *a, scale=scale, spec=spec, **operands, **blocks))
  args = (q, k, v, out, lse, d_out)
  with masked_schedule(form):
    return functools.partial(fn.lower(*args, operands=operands).compile(),
                             operands=operands), args


MASKED_ORDER_SPACE = dict(form=("masked", "masked_in_order"))
# The plain causal backward's choices (the masked backward's defaults),
# against the masked backward without them, with each score change.
MASKED_BACKWARD_CANDIDATES = [
    dict(term=term, **options)
    for term in ("none", "alibi", "dropout", "softcap")
    for options in ({}, dict(overlap_softmax=False, prefetch_lse=False,
                             lean_producer=False))]


# The documents of `causal_spec`'s "documents": where each of 8 packed
# documents of unequal lengths starts, as a fraction of the sequence.
DOCUMENT_STARTS = (0.0, 0.05, 0.15, 0.3, 0.5, 0.6, 0.8, 0.9)


def causal_spec(cell: common.Cell, term: str):
  """(a `MaskSpec` with `term`, causal where the cell is (the sweeps that
  call it are causal only, but for `max_free`), the masked kernels'
  operands of it): "none", "alibi" (slopes 2^-1 .. 2^-heads), "dropout" (0.1),
  "softcap" (30), "window" (4,096 keys, Mistral's), "gemma_local" (that
  window and a cap of 50, Gemma's local layers) or "documents" (8 packed,
  `DOCUMENT_STARTS`)."""
  from jax_flash import masking
  positions = jnp.arange(cell.seq_len)
  ids = jnp.searchsorted(jnp.asarray(DOCUMENT_STARTS) * cell.seq_len,
                         positions, side="right").astype(jnp.int32) - 1
  ids = jnp.broadcast_to(ids, (cell.batch, cell.seq_len))
  changes, operands = {
      "none": ({}, {}),
      "window": (dict(window=(4096, 0)), {}),
      "gemma_local": (dict(window=(4096, 0), logits_soft_cap=50.0), {}),
      "documents": (dict(has_segments=True),
                    dict(q_segments=ids, kv_segments=ids)),
      "alibi": (dict(has_alibi=True), dict(alibi_slopes=jnp.broadcast_to(
          2.0 ** -jnp.arange(1.0, cell.num_heads + 1),
          (cell.batch, cell.num_heads)))),
      "dropout": (dict(dropout_rate=0.1), dict(dropout_seed=jnp.int32(7))),
      "softcap": (dict(logits_soft_cap=30.0), {}),
  }[term]
  return masking.MaskSpec(q_len=cell.seq_len, kv_len=cell.seq_len,
                          is_causal=cell.causal, **changes), operands


@contextlib.contextmanager
def masked_schedule(form: str):
  """While a masked kernel is traced: its plan rows in tile order, not
  heaviest first, for `form` "masked_in_order" (`masked.heaviest_first_order`
  the identity); causal ALiBi by index tiles, not as column terms, for
  "alibi_tiles" (`plan.MASKED_ALIBI_COLUMNS` off); the soft cap with a
  running max for "softcap_with_max" (`plan.MASKED_MAX_FREE_HEAD_DIMS`
  empty), its multiplies not folded into the scales for "softcap_unfolded"
  (`plan.MASKED_SOFTCAP_FOLDED` off), and in the backward for
  "softcap_backward_folded" (`plan.MASKED_BACKWARD_SOFTCAP_FOLDED` on);
  max-free with the row sum by the tensor cores at every head dim for
  "softcap_mma_sum" (`plan.MAX_FREE_MMA_ROW_SUM`) and in the plain capped
  forward for "softcap_plain_mma_sum" (`plan.PLAIN_MAX_FREE_HEAD_DIMS`);
  max-free with each row's max from its first step for
  "softcap_first_max" and "softcap_plain_first_max" (`plan.
  MAX_FREE_FIRST_STEP_MAX`); the plain capped forward with its running
  max at every head dim for "softcap_plain_with_max"; as planned for any
  other."""
  from pallas_kernels.mosaic import masked, plan
  every_dim = (64, 128, 256)
  choices = {"alibi_tiles": [("MASKED_ALIBI_COLUMNS", False)],
             "softcap_with_max": [("MASKED_MAX_FREE_HEAD_DIMS", ())],
             "softcap_mma_sum": [("MASKED_MAX_FREE_HEAD_DIMS", every_dim),
                                 ("MAX_FREE_MMA_ROW_SUM", True),
                                 ("MAX_FREE_FIRST_STEP_MAX", False)],
             "softcap_first_max": [("MASKED_MAX_FREE_HEAD_DIMS", every_dim),
                                   ("MAX_FREE_FIRST_STEP_MAX", True)],
             "softcap_plain_with_max": [("PLAIN_MAX_FREE_HEAD_DIMS", ())],
             "softcap_plain_mma_sum": [("PLAIN_MAX_FREE_HEAD_DIMS",
                                        every_dim),
                                       ("MAX_FREE_FIRST_STEP_MAX", False)],
             "softcap_plain_first_max": [("PLAIN_MAX_FREE_HEAD_DIMS",
                                          every_dim),
                                         ("MAX_FREE_FIRST_STEP_MAX", True)],
             "softcap_unfolded": [("MASKED_SOFTCAP_FOLDED", False)],
             "softcap_backward_folded": [("MASKED_BACKWARD_SOFTCAP_FOLDED",
                                          True)]}
  if form in choices:
    with contextlib.ExitStack() as patches:
      for name, value in choices[form]:
        patches.enter_context(mock.patch.object(plan, name, value))
      yield
    return
  if form != "masked_in_order":
    yield
    return
  in_order = lambda steps: jnp.broadcast_to(
      jnp.arange(steps.shape[-1], dtype=jnp.int32), steps.shape)
  with mock.patch.object(masked, "heaviest_first_order", in_order):
    yield


def score_change_benchmark(cell: common.Cell, blocks: dict):
  """The forward (causal, or as the cell is for `max_free`) as
  `blocks["form"]` computes it: the plain kernel,
  the masked kernel on the same causal mask (its plan rows, two
  consumers, tiles heaviest first; or in tile order: `masked_schedule`),
  and the masked kernel with ALiBi,
  dropout 0.1 or a soft cap of 30 (`SCORE_CHANGE_SPACE`), so that a score
  change's cost splits into the masked kernel's and the term's own;
  "softcap_plain": the plain kernel with that cap
  (`plan.PLAIN_SOFTCAP_HEAD_DIMS`), "softcap_plain_with_max",
  "softcap_plain_mma_sum" and "softcap_plain_first_max" with or without
  its running max (`masked_schedule`)."""
  from pallas_kernels.mosaic.forward import mosaic_forward
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  q, k, v, _ = common.attention_inputs(cell.shape, cell.dtype)
  scale, form = cell.head_dim**-0.5, blocks["form"]
  if form == "plain" or form.startswith("softcap_plain"):
    cap = causal_spec(cell, "softcap")[0].logits_soft_cap
    fn = jax.jit(lambda q, k, v: mosaic_forward(
        q, k, v, scale=scale, is_causal=cell.causal,
        soft_cap=None if form == "plain" else cap))
    with masked_schedule(form):
      return fn.lower(q, k, v).compile(), (q, k, v)
  spec, operands = causal_spec(cell, "none" if form in MASKED_FORMS
                               else form.split("_")[0])
  fn = jax.jit(lambda q, k, v, operands: mosaic_forward_masked(
      q, k, v, scale=scale, spec=spec, **operands))
  with masked_schedule(form):
    return fn.lower(q, k, v, operands).compile(), (q, k, v, operands)


def route_benchmark(cell: common.Cell, blocks: dict):
  """Causal attention through `jax_flash.flash_attention` on the Mosaic
  kernels, forward (`blocks["mode"]` "fwd") or forward and backward
  ("fwd_bwd"), with `blocks["change"]` ("alibi", `causal_spec`'s slopes;
  "softcap", its cap of 30) as `blocks["form"]` routes it: "causal"
  without the change, "masked" on the masked kernels, "plain" on the
  plain ones (`plan.PLAIN_ALIBI_HEAD_DIMS`; the cap's backward,
  `plan.PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS`: empty, or every head dim)."""
  import jax_flash
  from pallas_kernels.mosaic import plan
  form, mode, change = blocks["form"], blocks["mode"], blocks["change"]
  q, k, v, d_out = common.attention_inputs(cell.shape, cell.dtype)
  spec, operands = causal_spec(cell, change)
  kwargs = {} if form == "causal" else (
      dict(alibi_slopes=operands["alibi_slopes"]) if change == "alibi"
      else dict(logits_soft_cap=spec.logits_soft_cap))

  def attend(q, k, v):
    return jax_flash.flash_attention(q, k, v, is_causal=True,
                                     implementation="mosaic", **kwargs)
  if mode == "fwd":
    fn = jax.jit(attend)
  else:
    fn = jax.jit(lambda q, k, v, d_out: jax.vjp(attend, q, k, v)[1](d_out))
  args = (q, k, v) if mode == "fwd" else (q, k, v, d_out)
  switch = {"alibi": "PLAIN_ALIBI_HEAD_DIMS",
            "softcap": "PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS"}[change]
  head_dims = () if form == "masked" else (64, 128, 256)
  with mock.patch.object(plan, switch, head_dims):
    return fn.lower(*args).compile(), args


# The forms `score_change_benchmark` times: where issue 39's ALiBi (0.62x
# plain causal's forward on the H100) and dropout (0.52x) lose their time.
MASKED_FORMS = ("masked", "masked_in_order")
SCORE_CHANGE_SPACE = dict(form=("plain", *MASKED_FORMS, "alibi",
                                "alibi_tiles", "dropout", "softcap"))


@contextlib.contextmanager
def turns_removed():
  """While a fused backward is traced: its writers' turn waits do nothing,
  so every writer adds as soon as its pieces are staged (dQ WRONG: the
  first K/V tile stores where it should add first, and adds race)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  with mock.patch.object(plgpu, "semaphore_wait",
                         lambda *args, **kwargs: None):
    yield


def turn_cost_benchmark(cell: common.Cell, blocks: dict):
  """`backward_benchmark`; with `unordered_turns`, compiled (so traced)
  under `turns_removed`."""
  blocks = dict(blocks)
  if not blocks.pop("unordered_turns", False):
    return backward_benchmark(cell, blocks)
  fn, args = backward_benchmark(cell, blocks)
  with turns_removed():
    return fn.lower(*args).compile(), args


def _forward(space, causal=(False, True)):
  return forward_benchmark, space, 1.0, causal


def _backward(space, causal=(False, True)):
  # FlashAttention's count: the backward is 2.5x the forward.
  return backward_benchmark, space, 2.5, causal


# kernel -> (build, space, FLOPs relative to the forward, causal values).
KERNELS = {"forward": _forward(FORWARD_SPACE),
           "backward": _backward(BACKWARD_SPACE),
           "forward_persistent": _forward(FORWARD_PERSISTENT_SPACE),
           "forward_consumers": _forward(CONSUMERS_SPACE),
           "forward_consumer_stages": _forward(CONSUMER_STAGES_SPACE),
           "forward_hw_turns": _forward(HW_TURNS_SPACE),
           "forward_sum_after_pv": _forward(SUM_AFTER_PV_SPACE),
           "forward_rescale": _forward(RESCALE_SPACE),
           "forward_mma_sum": _forward(MMA_ROW_SUM_SPACE),
           "backward_overlap": _backward(OVERLAP_SPACE),
           "backward_persistent": _backward(BACKWARD_PERSISTENT_SPACE),
           "backward_fused": _backward(FUSED_SPACE),
           "backward_shared": _backward(SHARED_SPACE),
           "backward_prefetch_lse": _backward(PREFETCH_LSE_SPACE),
           "backward_lean": _backward(LEAN_SPACE),
           "backward_ahead": _backward(AHEAD_SPACE, causal=(False,)),
           "backward_dq_tiles": _backward(DQ_TILES_CANDIDATES),
           "backward_stages": _backward(BACKWARD_STAGES_SPACE),
           "backward_kv_copies": (functools.partial(backward_benchmark,
                                                    num_kv_heads=1),
                                  KV_COPIES_SPACE, 2.5, (False, True)),
           "backward_turn_cost": (turn_cost_benchmark,
                                  TURN_COST_CANDIDATES, 2.5, (False, True)),
           "forward_between_tiles": _forward(BETWEEN_TILES_SPACE),
           "ragged_forward": (ragged_forward_benchmark,
                              dict(form=("plain", "masked")), 1.0,
                              (False, True)),
           "forward_fp8_rescale": (fp8_forward_benchmark,
                                   FP8_RESCALE_SPACE, 1.0, (False, True)),
           "forward_fp8_tiles": (fp8_forward_benchmark, FP8_TILES_SPACE, 1.0,
                                 (False, True)),
           "forward_fp8_persistent": (fp8_forward_benchmark,
                                      dict(persistent=(False, True)), 1.0,
                                      (False, True)),
           "score_changes": (score_change_benchmark, SCORE_CHANGE_SPACE,
                             1.0, (True,)),
           "alibi_columns": (score_change_benchmark,
                             dict(form=("plain", "alibi_tiles", "alibi")),
                             1.0, (True,)),
           "alibi_columns_backward": (
               masked_causal_backward_benchmark,
               dict(term=("alibi",), form=("alibi_tiles", "masked")),
               2.5, (True,)),
           "alibi_route": (route_benchmark,
                           dict(form=("causal", "masked", "plain"),
                                mode=("fwd",), change=("alibi",)),
                           1.0, (True,)),
           "alibi_route_fwd_bwd": (route_benchmark,
                                   dict(form=("causal", "masked", "plain"),
                                        mode=("fwd_bwd",),
                                        change=("alibi",)), 3.5, (True,)),
           "softcap_route_fwd_bwd": (route_benchmark,
                                     dict(form=("causal", "masked", "plain"),
                                          mode=("fwd_bwd",),
                                          change=("softcap",)), 3.5, (True,)),
           "max_free": (score_change_benchmark,
                        dict(form=("plain", "softcap_with_max",
                                   "softcap_mma_sum", "softcap_first_max",
                                   "softcap_plain_with_max",
                                   "softcap_plain_mma_sum",
                                   "softcap_plain_first_max")),
                        1.0, (True, False)),
           "softcap_folded": (score_change_benchmark,
                              dict(form=("plain", "softcap_unfolded",
                                         "softcap", "softcap_plain")),
                              1.0, (True,)),
           "softcap_backward_folded": (
               masked_causal_backward_benchmark,
               [dict(term="none"), dict(term="softcap"),
                dict(term="softcap", form="softcap_backward_folded")],
               2.5, (True,)),
           "masked_forward_terms": (
               masked_term_forward_benchmark,
               dict(term=("none", "window", "gemma_local", "documents",
                          "softcap")), 1.0, (True,)),
           "masked_forward_rescale": (masked_forward_benchmark,
                                      MASKED_RESCALE_SPACE, 1.0, (True,)),
           "masked_backward_order": (masked_causal_backward_benchmark,
                                     MASKED_ORDER_SPACE, 2.5, (True,)),
           "masked_backward_schedule": (masked_causal_backward_benchmark,
                                        MASKED_BACKWARD_CANDIDATES, 2.5,
                                        (True,)),
           "masked_backward_overlap": (masked_backward_benchmark,
                                       MASKED_OVERLAP_SPACE, 2.5, (True,))}


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--head-dims", nargs="+", type=int,
                      default=[64, 128, 256])
  parser.add_argument("--kernels", nargs="+", choices=list(KERNELS),
                      default=["forward", "backward"])
  parser.add_argument("--budget", type=float, default=400.0,
                      help="seconds; the JSON keeps what was measured")
  parser.add_argument("--rounds", type=int, default=1,
                      help="time each cell's candidates this many times in "
                      "turn; each keeps the median of its rounds")
  parser.add_argument("--causal", nargs="+", choices=("full", "causal"),
                      help="only these of each kernel's causal values")
  parser.add_argument("--out", help="the sweep's JSON (default "
                      "benchmarks/results/h200_mosaic_sweep.json)")
  parser.add_argument("--render", nargs="+", metavar="JSON",
                      help="measure nothing: write the sweeps in these files "
                      "(say, one per GPU) as one JSON and table at the last")
  args = parser.parse_args(argv)
  if args.render:
    if args.out:  # the merged file is --render's last path, not --out
      parser.error("--render writes its last JSON path; drop --out")
    print(write_tables(args.render[:-1] or args.render, args.render[-1]))
    return 0
  args.out = args.out or "benchmarks/results/h200_mosaic_sweep.json"
  result = {**common.run_header("benchmarks.tune_mosaic", argv),
            "seq_len": args.seq, "trials": []}
  deadline = time.monotonic() + args.budget
  wanted = {"full": False, "causal": True}
  cells = [(kernel, head_dim, causal)
           for kernel in args.kernels for head_dim in args.head_dims
           for causal in KERNELS[kernel][3]
           if not args.causal or causal in {wanted[c] for c in args.causal}]
  for kernel, head_dim, causal in common.progress(cells, desc="sweep"):
    if time.monotonic() > deadline:
      break
    result["trials"] += sweep_cell(kernel, args.seq, head_dim, causal,
                                   rounds=max(1, args.rounds))
    common.write_json(args.out, result)
  for line in best_lines(result["trials"]):
    print(line)
  return 0


def sweep_cell(kernel: str, seq: int, head_dim: int, causal: bool, *,
               rounds: int = 1) -> list[dict]:
  """One cell's trials: every candidate of `kernel`'s space built (a
  refusal or failure recorded as its "error"), then all timed `rounds`
  times in turn, each trial keeping the median of its rounds."""
  build, space, flops_factor, _ = KERNELS[kernel]
  # A head dim that does not divide the grid's hidden 2048 (160, 176, ...)
  # takes the most whole heads below it; a seq that does not divide the
  # grid's 16k tokens (1000, ViT's 197) the most whole sequences (at least
  # one).
  cell = common.Cell.standard("fwd", seq, head_dim, causal,
                              tokens=seq * max(1, 16384 // seq),
                              hidden=head_dim * (2048 // head_dim))
  runs = []
  for blocks in candidates(space):
    trial = {"kernel": kernel, "head_dim": head_dim, "causal": causal,
             "seq": seq, **blocks}
    try:
      runs.append((trial, *build(cell, blocks), []))
    except Exception as e:  # refused: recorded, the sweep goes on
      trial["error"] = common.describe_error(e)
      runs.append((trial, None, None, None))
  for round_index in range(rounds):
    for trial, fn, inputs, samples in common.round_order(runs, round_index):
      if fn is None or "error" in trial:
        continue
      try:
        samples.append(common.time_fn(fn, *inputs))
      except Exception as e:  # failed to compile or run
        trial["error"] = common.describe_error(e)
  for trial, _, _, samples in runs:
    if samples and "error" not in trial:
      ms = statistics.median(samples)
      trial.update(ms=ms, tflops=flops_factor * cell.flops / (ms * 1e-3)
                   / 1e12, **({"rounds": rounds} if rounds > 1 else {}))
  return [run[0] for run in runs]


# A trial's fields that are not the candidate's options.
_TRIAL_FIELDS = frozenset({"kernel", "head_dim", "causal", "ms", "tflops",
                           "error", "seq", "rounds"})


def write_tables(parts: list[str], out: str) -> str:
  """Merges sweep files into `out` (their trials in order, their commands
  listed) and writes `out`'s .md: the best per (kernel, head_dim), then
  every trial. Returns the markdown."""
  if not out.endswith(".json"):  # twice a slip here overwrote a part file
    raise ValueError(f"the merged file must be a .json path, got {out!r}")
  if out not in parts and os.path.exists(out) and "parts" not in (
      render.load(out)):
    # A sweep's own file, not an earlier merge: `--render a.json b.json`
    # meant "render both", and lost b's trials, three times.
    raise ValueError(f"{out} holds a sweep of its own: merging into it would "
                     f"overwrite it; name a new .json as the last path")
  results = [render.load(p) for p in parts]
  merged = {**results[0], "trials": [t for r in results for t in r["trials"]]}
  if out not in parts:  # a merge, which says so (and may be redone)
    merged["parts"] = [r["command"] for r in results]
  common.write_json(out, merged)
  option_names = sorted({n for t in merged["trials"] for n in t}
                        - _TRIAL_FIELDS)
  rows = [[t["kernel"], t.get("seq", merged["seq_len"]), t["head_dim"],
           t["causal"],
           ", ".join(f"{n}={t[n]}" for n in option_names if n in t),
           f"{t['ms']:.3f}" if "ms" in t else "—",
           f"{t['tflops']:.0f}" if "tflops" in t else t["error"][:90]]
          for t in merged["trials"]]
  lines = render.header_lines(merged, "Mosaic kernel sweep (TFLOP/s)")
  seqs = sorted({r["seq_len"] for r in results})
  lines += [f"Seq {', '.join(map(str, seqs))}, batch·seq 16384, hidden 2048, "
            "bf16; TFLOP/s as the grid counts them (the backward alone: "
            "2.5x the forward's FLOPs).", "", "## Best per kernel and head "
            "dim (geometric mean over causal and not)", ""]
  lines += [f"- {line}" for line in best_lines(merged["trials"])]
  lines += ["", "## Every trial", "", render.markdown_table(
      ["kernel", "seq", "head_dim", "causal", "options", "ms",
       "TFLOP/s or why not"],
      rows), ""]
  text = "\n".join(lines)
  with open(out.removesuffix(".json") + ".md", "w") as f:
    f.write(text)
  return text


def option_names(space: dict | list[dict]) -> list[str]:
  """The options a space (or list of candidates) sets, in order."""
  return list(dict.fromkeys(name for blocks in candidates(space)
                            for name in blocks))


def best_lines(trials: list[dict]) -> list[str]:
  """The best candidate per (kernel, head_dim): geometric mean over the
  causal values measured (candidates measured for all of them only)."""
  lines = []
  groups, measured = {}, {}
  for t in trials:
    if "tflops" in t:
      key = (t["kernel"], t.get("seq", 0), t["head_dim"])
      # Option values as JSON gives them back (a tuple as a list) hashed.
      names = (option_names(KERNELS[t["kernel"]][1])
               if t["kernel"] in KERNELS else sorted(set(t) - _TRIAL_FIELDS))
      blocks = tuple((n, tuple(t[n]) if isinstance(t[n], list) else t[n])
                     for n in names if n in t)
      groups.setdefault(key, {}).setdefault(blocks, []).append(t["tflops"])
      measured.setdefault(key, set()).add(t["causal"])
  for (kernel, seq, head_dim), by_blocks in sorted(groups.items()):
    causal_values = sorted(measured[(kernel, seq, head_dim)])
    scored = {b: math.prod(v) ** (1 / len(v)) for b, v in by_blocks.items()
              if len(v) == len(causal_values)}
    if scored:
      best = max(scored, key=scored.get)
      others = ", ".join(f"{dict(b)} {v:.0f}" for b, v in scored.items()
                         if b != best)
      at = f" seq {seq}" if seq else ""
      lines.append(f"{kernel}{at} d{head_dim}: {dict(best)} "
                   f"{scored[best]:.0f} TFLOP/s (geomean over causal "
                   f"{list(causal_values)}; others: {others})")
  return lines


if __name__ == "__main__":
  sys.exit(main())
