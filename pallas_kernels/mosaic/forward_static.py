"""`KernelStatic`: what the forward kernel body knows at trace time.

One frozen dataclass per launch of `forward_kernel.forward_kernel` or
`persistent_kernel`, built by `forward.py` (the plain form), `masked.py`
(the ranged form) and `fp8.py`; each field's comment says which form takes
it and why (with the A/B behind a choice, where one was measured).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# Consumer warpgroups of the masked and FP8 forms, and of the plain one but
# where its plan takes three.
NUM_CONSUMERS = 2
# Columns of the ones tile `KernelStatic.mma_row_sum` multiplies P by: a
# wgmma's N is a multiple of 8, and a 16-bit operand in N-major order is
# swizzled in rows of 32 bytes at least (Mosaic GPU has no 16-byte
# swizzle), so 16 is the narrowest.
MMA_SUM_COLUMNS = 16


@dataclasses.dataclass(frozen=True)
class KernelStatic:
  """Everything the kernel body needs that is known at trace time."""
  block_q: int
  block_kv: int
  num_stages: int
  num_kv_blocks: int
  head_dim: int
  group: int             # query heads per K/V head (GQA)
  scale_log2: float      # scale * log2(e): scores enter exp2 directly
  is_causal: bool
  dtype: jnp.dtype
  # FP8 (e4m3) inputs (`mosaic_forward_fp8`): V arrives transposed, since
  # wgmma reads 8-bit B operands only K-major ([head_dim, block_kv] tiles);
  # per-block descale factors come in one float32 row per (batch, head):
  # [Q blocks | K/V blocks | V | padding], see `fp8.descale_rows`.
  fp8: bool = False
  out_dtype: jnp.dtype | None = None
  num_q_blocks: int = 0
  # Masked ("ranged") kernel (`mosaic_forward_masked`): the static mask spec,
  # the softmax scale, and loop ranges read per tile from a plan row (see
  # `masked.plan_rows`) instead of computed from causal geometry.
  spec: Any = None
  scale: float = 0.0
  # Ranged: plan rows per batch (1) or per batch and query head (the head
  # count), where a mask differs by head (`masked.head_plans`).
  plan_heads: int = 1
  # The rendezvous of two consumers (`turns.Rendezvous`) split: a consumer
  # arrives at the hand-over barrier, then waits for V, then for the
  # other, instead of waiting for V after the whole rendezvous; 1.3%,
  # 2.0% and 7.0% faster at head_dim 64, 128, 256 (16k,
  # h200_mosaic_schedule.md). The plain and masked forms'; the FP8 form's
  # where `plan.FP8_SPLIT_HANDOVER` says.
  split_handover: bool = False
  # Persistent grid (`persistent_kernel`): `num_ctas` CTAs (one per SM) walk
  # the tiles in turn, so that a tile's prologue (Q and the first K/V
  # loads) and epilogue (the O store) overlap its neighbours' work instead of
  # costing a CTA launch each. The plain form only (`forward_persistent`;
  # not FP8, not ALiBi). `stage_o_apart`: O and the
  # LSE go out through a buffer of their own where it fits, so the next
  # tile's Q loads while this one's O is written.
  persistent: bool = False
  num_ctas: int = 0
  stage_o_apart: bool = False
  # Shared memory of every buffer but O's staged apart (`check_supported`).
  smem_bytes: int = 0
  # Consumer warpgroups (plain form; 2 elsewhere). With three the last tile
  # of a (batch, head) may be short: a consumer whose rows start past q_len
  # takes the last 64 rows and stores nothing (`consumer_rows`), so q_len
  # need only be a multiple of block_q.
  num_consumers: int = NUM_CONSUMERS
  q_len: int = 0
  # The consumers pass the turn round a ring of the CTA's hardware barriers
  # (`turns.RingTurns`: `bar.arrive` / `bar.sync`, no polling, no
  # shared-memory traffic) instead of meeting at an mbarrier rendezvous.
  # Scheduling only: bitwise the same.
  hw_turns: bool = False
  # P's row sum taken after P V is issued, while the wgmma runs (tokamax's
  # sm90 forward orders it so above head_dim 128): the same expression,
  # `l * alpha + rowsum(P)`, moved, so bitwise the same.
  sum_after_pv: bool = False
  # O's lazy rescale: a row keeps its running max until a tile's max
  # exceeds it by more than `rescale_threshold` (log2 units; P's entries
  # then stay below 2**threshold), and each warp multiplies its part of O
  # only at steps where the max of one of its rows moved
  # (`multiply_rows_in_threads`). 0.0: the max moves whenever it grows, so
  # only multiplies by exactly 1 are skipped: bitwise the eager rescale.
  # None: rescale every step.
  rescale_threshold: float | None = None
  # Three consumers, short last tile (q_len not a multiple of 3 * block_q):
  # a consumer with no rows of its own (`consumer_rows`) walks the tile's
  # steps without math instead of computing the last rows again: it waits
  # for each K and V tile and releases it, and passes each turn on as soon
  # as it has it, so that the others' matmuls take its turns (386 -> 396
  # TFLOP/s at d=64 1k without a mask, h200_mosaic_skip_spare.md). Plain
  # form without a causal mask (where three consumers run from q_len
  # 1024). What is stored is computed as without it: bitwise the same.
  skip_spare: bool = False
  # Causal ALiBi without score_fn or soft cap: the term enters as a
  # per-column vector and the LSE loses a per-row one (`common.
  # alibi_columns`) instead of |q_pos - kv| per element from two index
  # tiles. Ranged: `plan.MASKED_ALIBI_COLUMNS`. Plain form (top-left
  # causal, `mosaic_forward(alibi_slopes=)`): the slopes come as the
  # ranged form's (`takes_slopes`), on the launch grid.
  alibi_columns: bool = False
  # Attention sinks (GPT-OSS): a logit per head that joins every row's
  # softmax denominator, in the epilogue (`_with_sink`), read from the
  # kernel's last input (`common.slope_rows` of the sinks [heads]) instead
  # of an XLA pass over O after the kernel. Not with `alibi_columns` (its
  # rows' logits are shifted until the LSE) nor FP8.
  sinks: bool = False
  # A soft cap that bounds every logit (`plan.max_free_cap`): P =
  # 2^(s log2 e) cannot overflow, so there is no running max (m stays 0)
  # and nothing to rescale: no row max per step, no alpha, O and l only
  # accumulate. `plan.MASKED_MAX_FREE_HEAD_DIMS` (ranged),
  # `plan.PLAIN_MAX_FREE_HEAD_DIMS` (plain, with `mma_row_sum`). No weight
  # is then exactly 1, so the row's dominant one is rounded for P V too: O
  # is normalised by the row sum of P as P V takes it (in P's dtype,
  # `l_pv`), which keeps a row of one key at exactly V, and the LSE by the
  # exact sum (benchmarks/diagnostics/max_free_rounding).
  max_free: bool = False
  # With `max_free`, each row's m taken on the first step the consumer
  # computes and kept (no max on later steps, no alpha, nothing rescaled),
  # but never below this floor (log2 units, `plan.first_step_max_floor`:
  # e^cap over e^floor stays within `MAX_FREE_SOFT_CAPS`' bound on P, and
  # a row with no key kept in its first step has a finite m); None: m
  # stays 0. A row's largest weight in its first step is then exactly 1,
  # as under a running max, so one sum of the unrounded P serves O and the
  # LSE (no `l_pv`, no `mma_row_sum`): a row whose keys all fall in one
  # step, the rows of few keys that the rounded sum kept exact, stays
  # exact; a later key above the first step's max has its weight above 1,
  # rounded for P V (relative 2^-9 in bfloat16, tokamax's m = 0 form's
  # error). `plan.MAX_FREE_FIRST_STEP_MAX`.
  first_step_max: float | None = None
  # With `max_free`, l_pv taken by the tensor cores: P times a tile of ones
  # [block_kv, MMA_SUM_COLUMNS] in shared memory, a wgmma beside P V's on
  # the same 16-bit P, so every one of its columns is the row sum P V
  # took; instead of widening the rounded P back and adding it, two ops a
  # score beside the exact sum's add. Not with dropout (P V's P is then
  # not the one the sum takes). `plan.MAX_FREE_MMA_ROW_SUM`. With a
  # running max (plain form, `ForwardConfig.mma_row_sum`), that sum is l
  # itself, for O and the LSE: its accumulator rescaled by alpha as O is,
  # no float32 adds (the row's largest weight is exactly 1, so the LSE
  # stays within the 2x rule, benchmarks/diagnostics/row_sum_rounding).
  mma_row_sum: bool = False
  # Ranged, a soft cap: its multiplies by 1 / cap and by cap folded into
  # the score's scale and exp2's (`masking.modify_scores_folded`), two
  # fewer a score where the cap is the only change. `plan.
  # MASKED_SOFTCAP_FOLDED`.
  fold_cap: bool = False
  # Plain form, a soft cap (`plan.PLAIN_SOFTCAP_HEAD_DIMS`): each score
  # enters exp2 as tanh(s * scale / cap) at cap log2(e) (`masking.
  # modify_scores_folded`), without the ranged kernel's plan rows.
  soft_cap: float | None = None
  # Plain form, lengths its tiles do not divide (`common.ragged_lengths`):
  # the last tiles reach past q_len and kv_len, where TMA reads zeros and
  # drops stores; the ring's static block starts change (`_kv_rows`), and
  # where a real query may see past kv_len (`key_tail`,
  # `common.masks_key_tail`) the last K/V block is a masked step.
  ragged_tail: bool = False
  # ... and rows off the 8-row TMA tiling, read and written in place
  # through untiled views of the Q, K, V and O buffers
  # (`rows.rows_in_place`, `rows.RowViews`).
  rows_in_place: bool = False
  kv_len: int = 0
  key_tail: bool = False
  key_rows: int = 0  # K's rows: kv_len, or more where padded
  # Ranged, a bias broadcast along the queries or the keys (per key, per
  # query): (own rows, streamed) repeated to a tile's extent and read from
  # its start (`common.repeat_broadcast_axes`, `ScoreTiles.repeats`).
  bias_repeats: tuple[bool, bool] = (False, False)

  @property
  def ranged(self) -> bool:
    return self.spec is not None

  @property
  def takes_slopes(self) -> bool:
    """Whether the kernel reads ALiBi slopes (`common.slope_rows`)."""
    return (self.spec.has_alibi if self.ranged else self.alibi_columns)

  @property
  def tile_rows(self) -> int:
    """Query rows per CTA tile."""
    return self.num_consumers * self.block_q

  @property
  def producer(self) -> int:
    """Warpgroup index of the TMA producer (after the consumers)."""
    return self.num_consumers
