"""How the forward's consumer warpgroups take turns on the tensor cores.

FlashAttention-3 §3.1: while one consumer's matmuls run, the others do
their softmax. Two ways here (`forward_kernel.KernelStatic.hw_turns`):

  rendezvous  two consumers meet at one two-arrival mbarrier, twice a step
              (`Rendezvous`)
  ring        each consumer waits at its own hardware barrier, issues its
              matmuls and passes the turn to the next (`RingTurns`; three
              consumers always, two at head_dim 64: `plan.FORWARD_PLAN`)

Both have one interface, which `forward_kernel.consume` calls at fixed
points of its step (`consumer_turns` builds the right one): `begin()`
before S_0, `after_scores(step)` once S_step is issued,
`before_values(step, wait)` before P_step V_step (`wait()` awaits V's tile
there), `end()` after the last P V. `turn_barriers` allocates the
mbarriers, `turns_of` hands `consume` what it takes turns with,
`seed_turns` starts a ring.
"""
from __future__ import annotations

import functools

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic import compat

THREADS_PER_WARPGROUP = 128
# `hw_turns`: consumer w's turn barrier is hardware barrier
# HW_TURN_BARRIER + w (Mosaic GPU uses 0 and 1 .. warpgroups).
HW_TURN_BARRIER = 8


def turn_barriers(static):
  """The rendezvous' mbarrier of two arrivals; with a ring of hardware
  barriers, one mbarrier of one arrival per consumer, which the ring does
  not use but the kernel still allocates and initialises: dropping them
  changes the kernel that was measured."""
  if not static.hw_turns:
    return plgpu.Barrier(num_arrivals=2, num_barriers=1)
  return plgpu.Barrier(num_arrivals=1, num_barriers=static.num_consumers)


def turns_of(barriers, static):
  """What `forward_kernel.consume` takes turns with: the rendezvous barrier of two
  consumers, or (unused) the ring's (`turn_barriers`)."""
  return barriers if static.hw_turns else barriers.at[0]


def seed_turns(turns, wg, static):
  """Gives warpgroup 0 the first turn of a ring (`RingTurns`): the last
  consumer arrives once at warpgroup 0's barrier, as if it had just passed
  the turn on. Consumers that meet at a rendezvous: nothing to do."""
  if static.hw_turns:
    last = static.num_consumers - 1
    pl.when(wg == last)(lambda: RingTurns.arrive(0))


class RingTurns:
  """Consumers take turns on the tensor cores round a ring of hardware
  barriers (`KernelStatic.hw_turns`).

  Consumer w waits at its own barrier (`HW_TURN_BARRIER + w`), issues its
  matmuls, and arrives at consumer w + 1's, so the turn goes 0, 1, 2,
  0, ... and a consumer's softmax may run under the others' matmuls for as
  long as all of theirs take (FlashAttention-3 §3.1 with three
  warpgroups). A consumer's turns bracket its matmul phases: phase 0 issues
  S_0; phase j in 1 .. n-1 issues P_{j-1} V_{j-1} and S_j; phase n issues
  P_{n-1} V_{n-1}. Under causal masking consumers read different numbers
  of blocks, and only phases 0 .. s take turns, s being warpgroup 0's
  block count (`num_shared`), the fewest: every consumer then waits s + 1
  times and passes s + 1 times in a tile, so that each barrier's phase runs
  on alike into the next tile (persistent grid), and one turn is always in
  flight (`seed_turns`).
  """

  def __init__(self, *, wg, num_steps, num_shared, static):
    self._wg, self._static = wg, static
    self._num_steps, self._num_shared = num_steps, num_shared

  # Consumer w waits at barrier HW_TURN_BARRIER + w, which counts its own
  # 128 threads (bar.sync) and the 128 of the consumer that passes it the
  # turn (bar.arrive). A ring is safe on such barriers, which have no
  # phases: consumer w - 1 passes to w again only after w has waited (the
  # turn goes round first); a rendezvous (both arrive, then both wait) is
  # not, so two consumers take hardware turns round a ring too.
  @staticmethod
  def arrive(w: int):
    """Passes the turn to consumer `w` (a Python int)."""
    compat.named_barrier("arrive", HW_TURN_BARRIER + w,
                         2 * THREADS_PER_WARPGROUP)

  def _per_consumer(self, fn):
    """fn(w) for this consumer, w as a Python int (a hardware barrier's id
    is an immediate)."""
    for w in range(self._static.num_consumers):
      pl.when(self._wg == w)(functools.partial(fn, w))

  def _pass_on(self):
    n = self._static.num_consumers
    self._per_consumer(lambda w: self.arrive((w + 1) % n))

  def _wait(self):
    self._per_consumer(lambda w: compat.named_barrier(
        "sync", HW_TURN_BARRIER + w, 2 * THREADS_PER_WARPGROUP))

  def _when(self, condition, fn):
    if self._static.is_causal:  # else every phase takes turns
      pl.when(condition())(fn)
    else:
      fn()

  def begin(self):
    """Before S_0: phase 0's turn."""
    self._wait()

  def after_scores(self, step):
    """After S_step is issued: the end of phase `step`."""
    self._when(lambda: step <= self._num_shared, self._pass_on)

  def before_values(self, step, wait_for_values):
    """Before P_step V_step: `wait_for_values()`, then the start of phase
    `step + 1`."""
    wait_for_values()
    self._when(lambda: step < self._num_shared, self._wait)

  def end(self):
    """After the last P V: the end of phase `num_steps`."""
    self._when(lambda: self._num_steps <= self._num_shared, self._pass_on)


class Rendezvous:
  """Two consumers meet at one mbarrier of two arrivals at each turn point
  (§3.1 ping-pong): once S is issued, and before P V. Warpgroup 1 starts
  one turn behind, so that its first S = Q Kᵀ runs while warpgroup 0 does
  its first softmax; warpgroup 0 ends with the turn that pairs with it, so
  that both make the same number. Under causal masking (plain kernel) only
  the steps both consumers run meet; the ranged kernel's consumers walk
  the same steps and meet at every one. With `split_handover` a consumer
  arrives before V's tile is awaited and waits after it.
  """

  def __init__(self, barrier, *, wg, num_shared, static, ranged: bool):
    self._barrier, self._wg, self._static = barrier, wg, static
    self._num_shared, self._ranged = num_shared, ranged

    def meet():
      plgpu.barrier_arrive(barrier)
      plgpu.barrier_wait(barrier)

    # One function object for every meeting, so that the kernel's jaxpr
    # traces it once (a bound method would be a new object each time).
    self._meet = meet

  def _when_shared(self, step, fn):
    if self._static.is_causal and not self._ranged:
      pl.when(step < self._num_shared)(fn)
    else:
      fn()

  def begin(self):
    pl.when(self._wg == 1)(self._meet)

  def end(self):
    pl.when(self._wg == 0)(self._meet)

  def after_scores(self, step):
    self._when_shared(step, self._meet)

  def before_values(self, step, wait_for_values):
    if self._static.split_handover:
      self._when_shared(step, lambda: plgpu.barrier_arrive(self._barrier))
      wait_for_values()
      self._when_shared(step, lambda: plgpu.barrier_wait(self._barrier))
    else:
      self.after_scores(step)
      wait_for_values()


def consumer_turns(barriers, *, wg, num_steps, num_shared, static,
                   ranged: bool):
  """The turn-taking of consumer `wg` (`barriers`: from `turns_of`):
  `RingTurns` where `static.hw_turns`, else `Rendezvous`. `num_steps`: its
  K/V blocks; `num_shared`: warpgroup 0's (None in the ranged kernel)."""
  if static.hw_turns:
    return RingTurns(wg=wg, num_steps=num_steps, num_shared=num_shared,
                     static=static)
  return Rendezvous(barriers, wg=wg, num_shared=num_shared, static=static,
                    ranged=ranged)
