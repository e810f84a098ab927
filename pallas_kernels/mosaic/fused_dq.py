"""The fused dQ: the dK/dV kernel also sums dQ, deterministically.

Every Q tile's dQ is a sum over the K/V tiles (CTAs) that see it. Each
CTA's share, dS K for the step's Q tile, is a sum over its consumers' K/V
rows: so the consumers store their dSᵀ tiles, and each consumer computes
one [DQ_PIECE, DQ_PIECE] piece of the share from both, issued beside the
next step's dV and dK (`issue_piece`: a step late, so that the consumers
do not wait for each other every step) and staged for the CTA's dQ writer
(`stage_piece`). The writer, a warpgroup of its own so that the consumers
never wait on global memory, adds the pieces, f32, by TMA reduce-add into
the dQ sum in global memory (`write_dq`), the first K/V tile storing
instead, in a fixed order: K/V tile j's writer waits on the Q tile's turn
semaphore until tile j - 1's has handed it on, once its add reached
memory. So the float sums are the same every run. 5 matmuls per tile pair
instead of the two kernels' 7 (the dQ kernel's recomputed S and dP go).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic.rows import wgmma
from pallas_kernels.mosaic.pipeline import BackwardStatic, wgmma_sum

# The fused dQ splits each Q tile's dQ into [DQ_PIECE, DQ_PIECE] pieces,
# one per consumer: 64 rows, a wgmma's height, by 64 columns, one 128-byte
# swizzle row of 16-bit K, so that a piece's slice of the resident K (and
# of dSᵀ) is whole swizzle tiles.
DQ_PIECE = 64


class FusedDq(NamedTuple):
  """Shared memory, barriers and global refs of the fused dQ
  (`BackwardStatic.fused_dq`); `issue_dq_piece`, `stage_dq_piece` and
  `write_dq` say how they are used.

  Every Q tile's dQ is a sum over the K/V tiles (CTAs) that see it. Each
  CTA's share, dS K for the step's Q tile, is a sum over its consumers' K/V
  rows: so the consumers store their dSᵀ tiles and wait for each other,
  then each computes some [DQ_PIECE, DQ_PIECE] pieces of it and stages
  them; the CTA's dQ writer (a warpgroup of its own, so that the consumers
  never wait on global memory) adds them, f32, by TMA reduce-add into
  `dq_sum`, the first K/V tile storing instead. In a fixed order, so that
  the float sums are the same every run: K/V tile j is the j-th, and its
  writer waits on the Q tile's turn semaphore until the writer of tile
  j - 1 has handed it on, once its add reached memory. Every earlier K/V
  tile adds to the Q tile: under causal masking K/V tile j sees Q tiles
  from j's diagonal on, a superset of those of later tiles, and a consumer
  walks (masked) also the steps its rows do not need. The earlier tiles are
  launched first (see `launch_dkdv`'s grid), and between tiles j - 1 and j
  of a head come the other heads' tile j - 1: so a wait never waits for a
  CTA that is not running or done, and tile j - 1 is a few steps ahead by
  the time tile j starts.
  """
  ds: Any          # [2, consumers, block_kv, block_q] 16-bit: dSᵀ tiles
  ds_stored: Any   # barriers [2], an arrival per consumer: dSᵀ stored
  stage: Any       # f32 [2, pieces, DQ_PIECE, DQ_PIECE]: the CTA's dS K
  staged: Any      # barriers [2], an arrival per consumer: pieces staged
  stage_free: Any  # barriers [2]: the writer read the stage
  k: Any           # [consumers, block_kv, head_dim]: the CTA's K rows
  dq_sum: Any      # f32 [batch, q_len, num_heads, head_dim], global
  turns: Any       # int32 semaphores [batch * num_heads * num_q_blocks]
  ds_read: Any     # barriers [2], an arrival per consumer: its piece read
                   # the dSᵀ tiles


def fused_smem_bytes(*, num_consumers, block_q, block_kv, head_dim,
                     itemsize) -> int:
  """The fused dQ's extra shared memory: every consumer's dSᵀ tile (16
  bits) and the CTA's f32 dQ tile, staged in pieces for the TMA reduce-add;
  twice each (this step's and the last)."""
  return 2 * (num_consumers * block_kv * block_q * itemsize
              + block_q * head_dim * 4)


# `BackwardStatic.opaque_resident`'s int32 zero: a scratch buffer of its own,
# padded to the alignment of the others (how much is Mosaic GPU's: at d=64's
# fused 128-row Q tiles the cell took the kernel 144 bytes over the limit);
# 1 KiB bounds it.
ZERO_CELL_BYTES = 1024
# The fused dQ's consumers meet on this hardware barrier after their last
# pieces (`compat.named_barrier`: ids from 8 up are free).
PIECES_DONE_BARRIER = 8


def num_dq_pieces(block_q: int, head_dim: int) -> int:
  """[DQ_PIECE, DQ_PIECE] pieces of a [block_q, head_dim] dQ tile."""
  return pl.cdiv(block_q, DQ_PIECE) * pl.cdiv(head_dim, DQ_PIECE)


def _piece_position(number, static: BackwardStatic):
  """(row, column) of dQ piece `number` (a Python or traced int) in the
  [block_q, head_dim] tile, row-major, counted in pieces."""
  return divmod(number, pl.cdiv(static.head_dim, DQ_PIECE))


def _pieces(static: BackwardStatic):
  """The [DQ_PIECE, DQ_PIECE] pieces of the [block_q, head_dim] dQ tile,
  row-major: (number, row, column), row and column counted in pieces."""
  return [(n, *_piece_position(n, static))
          for n in range(num_dq_pieces(static.block_q, static.head_dim))]


def _pieces_of(wg: int, static: BackwardStatic):
  """Consumer wg's pieces: numbers wg, wg + num_consumers, ..."""
  return _pieces(static)[wg::static.num_consumers]


def issue_dq_piece(fused: FusedDq, wg, acc_ref, *, step,
                   static: BackwardStatic, offset=0):
  """Issues consumer wg's piece of the CTA's dS K for step - 1 into
  `acc_ref`, once every consumer stored its dSᵀ of step - 1 and the writer
  freed that stage, beside the step's dV and dK. At step 0 it computes from a
  dSᵀ buffer no one stored (nothing waited for, the result is staged
  where no one reads it, see `stage_dq_piece`), so that the wgmma
  group has the same shape every step."""
  parity = lax.rem(step + 1, 2)  # step - 1's, for step >= 0
  pl.when(step >= 1)(functools.partial(plgpu.barrier_wait,
                                       fused.ds_stored.at[parity]))
  # The writer has read this stage's pieces of step - 3.
  pl.when(step >= 3)(functools.partial(plgpu.barrier_wait,
                                       fused.stage_free.at[parity]))
  # Consumer wg's one piece is number wg.
  for lhs, rhs in _piece_operands(fused, fused.ds.at[parity], wg,
                                  static=static, offset=offset):
    wgmma(acc_ref, lhs, rhs)


def stage_dq_piece(fused: FusedDq, wg, value, *, step):
  """After the step's wgmmas (`issue_dq_piece`'s group): stages consumer
  wg's piece of step - 1 for the writer and says that this consumer's dSᵀ
  of `step` is stored and its piece of step - 1 is staged and done with
  that step's dSᵀ. At step 0 the piece is garbage and lands in the stage of
  parity 1, which the writer reads only once step 1's pieces are staged
  there (at step 2, or after the walk when step 1 is the last)."""
  parity = lax.rem(step + 1, 2)
  fused.stage.at[parity][wg] = value
  plgpu.commit_smem()  # this dSᵀ for every consumer's wgmma, the piece for TMA
  plgpu.barrier_arrive(fused.ds_stored.at[lax.rem(step, 2)])

  @pl.when(step >= 1)
  def _():
    plgpu.barrier_arrive(fused.staged.at[parity])
    plgpu.barrier_arrive(fused.ds_read.at[parity])


def stage_dq_pieces(fused: FusedDq, wg, *, step, static: BackwardStatic,
                    offset=0):
  """Consumer wg's pieces of the CTA's dS K for `step` (the walk's last),
  once every consumer stored its dSᵀ of `step`: computed and staged for
  the writer."""
  parity = lax.rem(step, 2)
  plgpu.barrier_wait(fused.ds_stored.at[parity])
  # The writer has read this stage's pieces of step - 2.
  pl.when(step >= 2)(lambda: plgpu.barrier_wait(fused.stage_free.at[parity]))
  ds, stage = fused.ds.at[parity], fused.stage.at[parity]

  def compute(wg: int):
    # Static slices: a Python branch per consumer.
    for number, _, _ in _pieces_of(wg, static):
      stage[number] = wgmma_sum((DQ_PIECE, DQ_PIECE), list(
          _piece_operands(fused, ds, number, static=static, offset=offset)))

  for c in range(static.num_consumers):
    pl.when(wg == c)(functools.partial(compute, c))
  plgpu.commit_smem()  # the pieces, read by the writer's TMA
  plgpu.barrier_arrive(fused.staged.at[parity])
  plgpu.barrier_arrive(fused.ds_read.at[parity])  # done with dSᵀ


def _piece_operands(fused: FusedDq, ds, number, *, static: BackwardStatic,
                    offset=0):
  """Yields the wgmma operands whose products sum to dQ piece `number` (a
  Python or traced int) of the CTA's dS K: for each consumer k, the
  piece's rows of k's dSᵀ [block_kv / consumers, block_q] in `ds`,
  transposed, and the piece's columns of k's K rows (the k-th slice of
  the CTA's K/V rows is consumer k's). `offset`: the zero that indexes
  the K rows (`BackwardStatic.opaque_resident`).

  A generator, so that an index computed for operand k is computed where
  the caller takes it: the merged path issues each wgmma as it goes, the
  staged path lists them before its accumulator's scope (the kernels'
  jaxprs as before this helper).
  """
  row, col = _piece_position(number, static)
  rows = pl.ds(row * DQ_PIECE, DQ_PIECE)
  cols = pl.ds(col * DQ_PIECE, DQ_PIECE)
  for k in range(static.num_consumers):
    yield (ds.at[k, :, rows].transpose((1, 0)),
           fused.k.at[k + offset, :, cols])


def write_dq(fused: FusedDq, *, batch, order, num_steps, head_and_block,
             static: BackwardStatic):
  """The dQ writer of K/V tile `order`: for each step, once the consumers
  staged its pieces, waits for the Q tile's turn and adds them to `dq_sum`
  (stores them, as the first); then, once the previous step's adds are in
  memory, hands that Q tile on and frees its stage. `head_and_block(step)`
  is the step's (query head, Q tile)."""
  _, _, num_heads, _ = fused.dq_sum.shape
  first = order == 0
  pieces = _pieces(static)

  def hand_on(turn):
    plgpu.semaphore_signal(fused.turns.at[turn], 1, memory_scope="gpu")

  def write(step, handed):
    parity = lax.rem(step, 2)
    plgpu.barrier_wait(fused.staged.at[parity])
    head, q_block = head_and_block(step)
    turn = (batch * num_heads + head) * static.num_q_blocks + q_block
    plgpu.semaphore_wait(fused.turns.at[turn], order, decrement=False,
                         memory_scope="gpu")
    for number, row, col in pieces:
      src = fused.stage.at[parity, number]
      dst = fused.dq_sum.at[
          batch, pl.ds(q_block * static.block_q + row * DQ_PIECE, DQ_PIECE),
          head, pl.ds(col * DQ_PIECE, DQ_PIECE)]
      last = number == len(pieces) - 1  # one commit group per step
      pl.when(first)(functools.partial(plgpu.copy_smem_to_gmem, src, dst,
                                       commit_group=last))
      pl.when(jnp.logical_not(first))(functools.partial(
          plgpu.copy_smem_to_gmem, src, dst, commit_group=last,
          reduction_op="add"))
    # All groups but this step's are done: the previous step's adds are
    # in memory, and its stage has been read.
    plgpu.wait_smem_to_gmem(1, wait_read_only=False)

    @pl.when(step > 0)
    def _():
      hand_on(handed)
      plgpu.barrier_arrive(fused.stage_free.at[1 - parity])
    return turn

  last_turn = lax.fori_loop(0, num_steps, write, jnp.int32(0))
  plgpu.wait_smem_to_gmem(0, wait_read_only=False)
  pl.when(num_steps > 0)(lambda: hand_on(last_turn))
