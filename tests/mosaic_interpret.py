"""JAX 0.10.2's private Mosaic GPU interpreter, taught what our kernels use.

JAX ships an interpreter for Pallas Mosaic GPU kernels
(`jax._src.pallas.mosaic_gpu.interpret`: private) that runs a kernel on the
CPU, simulating shared memory, warpgroup threads, mbarriers, TMA and wgmma.
Under it `pallas_kernels.mosaic.forward` stops at what it lacks; `install()`
monkeypatches these into it (tests/test_mosaic_interpret*.py use them to
check the Mosaic kernels' numerics in CI, without a GPU):

* `JaxprInterpreter.interpret`, wrapped: three primitives that the stock
  loop would send to `_interpret_arithmetic_primitive` (which gets no
  ordering token, so that its callbacks could run before the kernel's
  inputs are copied into shared memory: a wgmma then read NaN) are handled
  with the kernel's token:
    - `run_state_p` (`pl.run_state`, our wgmma accumulators): each value
      operand becomes a thread-private REGS buffer holding it, as
      `run_scoped` does for a `plgpu.ACC`; the body is interpreted; the
      outputs are the buffers' final contents (the interpreter's wgmma is
      synchronous, so nothing is in flight by then);
    - `layout_cast_p` (`plgpu.layout_cast`): a layout hint, the value;
    - `wgmma_accumulator_store_p` (`acc_ref[...] = value`): a swap into the
      accumulator's buffer (the stock interpreter only loads).
  Every other equation goes to the stock loop, unchanged.
* `JaxprInterpreter._interpret_wgmma_ref_p`: also takes an LHS held in
  registers (`wgmma(o_ref, p, v_smem.at[slot])`) and a trailing
  `.transpose(...)` on an operand (`k_smem.at[slot].transpose((1, 0))`).
  The product is the stock one's: acc += a @ b in acc's dtype.
* `shared_memory.Barrier.deallocate`: the stock one raises when a thread
  that waited on a barrier did not wait on every phase. Hardware has no
  such rule and our K/V ring breaks it by design: the producer waits on a
  slot's "consumed" barrier only before refilling that slot, so the last
  `num_stages` consumptions are never awaited. These trailing phases are
  counted in `UNOBSERVED_TRAILING_PHASES` instead. A wait that skips a
  phase, or a phase completed twice between waits, still raises.
* TMA at the ends of the global arrays. The masked kernels
  (`masked.mosaic_forward_masked`, `masked_backward`) pad rows only to the
  TMA row tiling (8) and read and write whole 64-row tiles, relying on
  TMA: a load fills what lies past the end of the global array with zeros,
  a store drops it. The stock interpreter raises on such a load (in one
  warpgroup's thread: the others then wait on their barriers forever, the
  test hangs), or with `out_of_bounds_reads="uninitialized"` fills every
  out-of-bounds read, of any kind, with `uninitialized_memory`; and it
  drops the whole store, in-bounds rows too, without a word
  (`Buffer.__setitem__` refuses a range partly out of bounds,
  `copy_smem_to_gmem` ignores the refusal: the masked forward's ragged
  last tile came out as its output buffer's initial contents). So:
    - `gpu_callbacks._handle_out_of_bounds_read`, while a TMA load runs
      on this host thread (`DeviceLocalMemoryTransfer.execute`, wrapped
      to say so): the in-bounds part, zeros past it. Any other
      out-of-bounds read still raises, and unwritten shared memory still
      reads NaN;
    - `gpu_callbacks.copy_smem_to_gmem`: the stock store, but a range
      partly past the end writes its in-bounds part; and with
      `reduction_op="add"` (the fused backward's dQ writer, which the
      stock one refuses) an atomic read-add-write of that part.
* The fused backward's cross-CTA order (`fused_dq.write_dq`): in the
  wrapped `interpret`, with the kernel's token, as above,
    - `get_global` of a semaphore array (`plgpu.SemaphoreType.REGULAR`,
      which the stock interpreter cannot allocate: its callbacks fail to
      lower with "SemaphoreEffect"): an id given when the kernel is
      traced, so that every grid point and thread sees one int32 array,
      zero at first use and dropped when the launch ends
      (`gc._clean_up_shared_memory`, wrapped), as Mosaic GPU zeroes a
      launch's semaphores;
    - `semaphore_signal` (an atomic add that wakes the waiters) and
      `semaphore_wait` (blocks the warpgroup's host thread until the value
      is reached, then subtracts it if `decrement`). Grid points run one
      after another (the interpreter's `fori_loop`), in the order CUDA
      launches them (the last grid axis fastest), so a CTA waits only for
      itself or for earlier CTAs: the fused kernel's turns (K/V tile j
      after tile j - 1) are always already handed on, and a wait on a
      later CTA would never return (the test then times out);
    - `compat.named_barrier`'s inline PTX (`bar.sync` / `bar.arrive`: the
      fused consumers' meeting before K becomes dK, and the forward's
      `hw_turns`), recognised by its code object: a barrier of the CTA's
      host threads, 128 threads a warpgroup. Made a no-op, the fused dQ's
      dq goes wrong: the race it guards against happens here too.
    - `common.fp8_operand` (FP8 P regrouped into wgmma's 8-bit register
      operand): P with its columns permuted as V's keys are
      (`_fp8_operand_value`);
    - `softmax.multiply_rows_in_threads` (the lazy rescale's branch in
      each thread, Mosaic GPU code): its product, `acc * alpha[:, None]`,
      which the branch equals since it skips only multiplies by exactly
      1; whether it skips the right threads shows only on a GPU.
    - `common.quad_dropout_in_threads` (dropout's kept weights, one hash
      per quad of a thread's registers): `common.quad_dropout_value`, the
      same bits from the words at each quad's first row and column;
    - `softmax.add_rounded_in_threads` (the LSE's add, unfused by PTX's
      `add.rn`): `a + b` behind an optimization barrier, so that XLA's
      algebraic simplifier folds it with nothing, as no compiler may fold
      PTX's.

Each simulated warpgroup is a host thread whose kernel blocks inside XLA
callbacks (barrier waits), and XLA's CPU client runs about one more of
them at once than its thread pool has threads: more warpgroups than
`MAX_WARPGROUPS` can deadlock (measured on 2 cores with the default pool,
one thread a core: 3 warpgroups ran 8 of 8 times, 4 hung 4 runs of 6; on
1 core 3 hung at once). The pool's size is the environment's `PJRT_NPROC`
when the client is made; importing this module before any JAX computation
sets it to `CPU_CLIENT_THREADS` (4 warpgroups then ran 5 of 5 times on 2
cores, and the fused backward's three forms with them 5 of 5), and
`MAX_WARPGROUPS` follows the pool the client has (conftest makes the
client first: tests/test_mosaic_interpret.py runs the wide forms in a
child process).

What the interpreter cannot check: wgmma runs synchronously there, so
`wait_n` and the overlap of wgmma groups are not exercised; TMA stores are
synchronous too, so `wait_smem_to_gmem` orders nothing; sequential grid
points cannot race, so the fused dQ's turns are never contended (a writer
that did not wait would pass); inline PTX other than `named_barrier`
cannot run, and `multiply_rows_in_threads` runs as its plain product.

Written against JAX 0.10.2's private modules: `WHY_NOT` says why the patch
is unavailable elsewhere, and the tests skip with it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np

PATCHED_JAX_VERSION = "0.10.2"
# Threads of the CPU client's pool asked for (`PJRT_NPROC`, read when the
# client is made), enough for the fused backward's four warpgroups.
CPU_CLIENT_THREADS = 8


def _cpu_client_threads() -> int:
  """The CPU client's thread pool size: `CPU_CLIENT_THREADS` if the client
  is not made yet (this sets `PJRT_NPROC` for it), else the one it got
  (`PJRT_NPROC` or `NPROC` as set then, else the cores)."""
  from jax._src import xla_bridge
  if not xla_bridge.backends_are_initialized():
    os.environ.setdefault("PJRT_NPROC", str(CPU_CLIENT_THREADS))
  for name in ("PJRT_NPROC", "NPROC"):
    if os.environ.get(name, "").isdigit():
      return int(os.environ[name])
  return len(os.sched_getaffinity(0))


# Warpgroups (consumers, the producer, the fused dQ writer) that run
# without deadlock here.
MAX_WARPGROUPS = _cpu_client_threads() + 1
WHY_NOT: str | None = None
if jax.__version__ != PATCHED_JAX_VERSION:
  WHY_NOT = (f"the Mosaic GPU interpreter patch is written against JAX "
             f"{PATCHED_JAX_VERSION}'s private modules; this is JAX "
             f"{jax.__version__}")
else:
  try:
    from jax._src import callback
    from jax._src import core as jax_core
    from jax._src import source_info_util
    from jax._src.pallas import core as pallas_core
    from jax._src.pallas import primitives as pallas_primitives
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu import core as mgpu_core
    from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
    from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as ji
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory as gpu_memory
    from jax._src.pallas.mosaic_gpu.interpret.params import (
        InterpretGPUParams, force_gpu_interpret_mode)
    from jax._src.state import discharge as state_discharge
    from jax._src.state import types as state_types
  except ImportError as e:  # a jaxlib without Mosaic GPU, or moved modules
    WHY_NOT = f"the Mosaic GPU interpreter is not importable: {e}"


if WHY_NOT is None:
  from pallas_kernels.mosaic import common as mosaic_common
  from pallas_kernels.mosaic import compat as mosaic_compat
  from pallas_kernels.mosaic import softmax as mosaic_softmax
  _inner_code = lambda fn, name: next(
      c for c in fn.__code__.co_consts
      if isinstance(c, types.CodeType) and c.co_name == name)
  _NAMED_BARRIER_EMIT = _inner_code(mosaic_compat.named_barrier, "emit")
  _FP8_REGROUP = _inner_code(mosaic_common.fp8_operand, "regroup")
  _SEMAPHORE_PRIMITIVES = (
      pallas_primitives.get_global_p, gpu_primitives.semaphore_signal_p,
      gpu_primitives.semaphore_wait_p, pallas_primitives.semaphore_signal_p,
      pallas_primitives.semaphore_wait_p)


# --------------------------------------------------------------------------
# Host-side helpers of the callbacks below

def _range_of(transforms):
  """The numpy index of a buffer's `.at[...]` transforms (traced ints as
  Python ones)."""
  return interpret_utils.to_range(
      jax.tree.map(int, gc._remove_noop_transforms(transforms)))


def _host_context(device_id, grid_point_coords, thread_id, source_info):
  """(shared memory, global thread id, logging info) of a callback's
  simulated thread."""
  device_id, thread_id = int(device_id), int(thread_id)
  sm = gc._get_shared_memory()
  info = interpret_utils.GPULoggingInfo(
      device_id=device_id,
      grid_point_coords=tuple(int(x) for x in grid_point_coords),
      thread_id=thread_id, source_info=source_info)
  return sm, sm.get_global_thread_id(device_id, thread_id), info


def _clear_launch_state():
  """Drops the semaphores and named barriers of the launch that ended."""
  _SEMAPHORES.clear()
  _NAMED_BARRIERS.clear()


# --------------------------------------------------------------------------
# REGS buffers (thread-private; own id sequence, see gc._allocate_buffer)

def _alloc_regs(self, token, value, source_info):
  """(token, key) of a new REGS buffer of thread `self.thread_id` holding
  `value` (`self`: the `JaxprInterpreter`)."""
  token, request = gc.call_make_allocation_request_array(
      token=token, device_id=jnp.int32(self.device_info.device_id),
      memory_space_id=gc.get_memory_space_idx(mgpu_core.MemorySpace.REGS),
      thread_id=jnp.int32(self.thread_id), initial_ref_count=1)
  return gc.call_allocate_buffer(
      token=token, device_id=jnp.int32(self.device_info.device_id),
      grid_point_coords=self.grid_point_coords, thread_id=self.thread_id,
      allocation_request_as_array=request, value=value,
      source_info=source_info)


def _free_regs(self, token, key, source_info):
  return gc.call_deallocate_buffer(
      token=token, device_id=jnp.int32(self.device_info.device_id),
      grid_point_coords=self.grid_point_coords, thread_id=self.thread_id,
      allocation_key_as_array=key, source_info=source_info)


# --------------------------------------------------------------------------
# run_state

def _interpret_run_state_p(self, eqn, token, invals):
  """(token, outputs) of a `run_state` equation: value operands become
  REGS buffers for the body, then the buffers' final contents."""
  if not all(eqn.params["is_initialized"]):
    raise NotImplementedError("run_state with uninitialized refs")
  args, owned = [], []
  for var, val in zip(eqn.invars, invals):
    if isinstance(var.aval, state_types.AbstractRef):  # an outer ref: its key
      args.append(val)
      owned.append(False)
    else:
      token, key = _alloc_regs(self, token, val, eqn.source_info)
      args.append(key)
      owned.append(True)
  token, _ = self.interpret(eqn.params["jaxpr"], token, *args)
  outs = []
  for var, key, own in zip(eqn.invars, args, owned):
    if not own:
      outs.append(key)
      continue
    token, value = gc.call_get(
        token=token, result_shape_and_dtype=var.aval,
        device_id=jnp.int32(self.device_info.device_id),
        grid_point_coords=self.grid_point_coords, thread_id=self.thread_id,
        allocation_key_as_array=key, transforms=(),
        source_info=eqn.source_info)
    token = _free_regs(self, token, key, eqn.source_info)
    outs.append(value)
  return token, outs


def _patched_interpret(self, jaxpr, token, *args):
  """The stock loop, but with the equations it cannot take (run_state,
  layout_cast, the accumulator store, semaphores, `named_barrier`'s
  inline PTX) handled here, in the kernel's token chain."""
  special = (state_discharge.run_state_p, mgpu_core.layout_cast_p,
             gpu_primitives.wgmma_accumulator_store_p, *_SEMAPHORE_PRIMITIVES)
  is_special = lambda e: (e.primitive in special
                          or (e.primitive is gpu_primitives.inline_mgpu_p
                              and (_named_barrier_of(e) is not None
                                   or _is_row_multiply(e)
                                   or _is_rounded_add(e)
                                   or _is_fp8_operand(e)
                                   or _is_quad_dropout(e))))
  if not any(is_special(e) for e in jaxpr.eqns):
    return _STOCK_INTERPRET(self, jaxpr, token, *args)
  # Interpret the equations in runs: maximal runs of ordinary equations go
  # to the stock loop (as a sub-jaxpr over the live variables), the special
  # ones are handled here, the token threaded through all of them.
  env = {}
  def read(v):
    return v.val if isinstance(v, jax_core.Literal) else env[v]
  for v, a in zip(jaxpr.constvars + jaxpr.invars, args):
    env[v] = a
  eqns = list(jaxpr.eqns)
  i = 0
  while i < len(eqns):
    eqn = eqns[i]
    if is_special(eqn):
      invals = [read(v) for v in eqn.invars]
      with source_info_util.user_context(
          eqn.source_info.traceback, name_stack=eqn.source_info.name_stack):
        if eqn.primitive is mgpu_core.layout_cast_p:
          outs = [invals[0]]
        elif eqn.primitive is gpu_primitives.wgmma_accumulator_store_p:
          token, old = gc.call_swap(
              token=token, result_shape_and_dtype=eqn.outvars[0].aval,
              device_id=jnp.int32(self.device_info.device_id),
              grid_point_coords=self.grid_point_coords,
              thread_id=self.thread_id, allocation_key_as_array=invals[0],
              transforms=(), val=invals[1], mask=None,
              source_info=eqn.source_info)
          outs = [old]
        elif _is_row_multiply(eqn):
          acc, alpha = invals
          outs = [acc * alpha[:, None]]
        elif _is_rounded_add(eqn):  # opaque to XLA's simplifier, as PTX
          outs = [jax.lax.optimization_barrier(invals[0] + invals[1])]
        elif _is_fp8_operand(eqn):
          outs = [_fp8_operand_value(invals[0])]
        elif _is_quad_dropout(eqn):
          outs = [mosaic_common.quad_dropout_value(
              *invals, **eqn.params["mgpu_fn"].keywords)]
        elif eqn.primitive is gpu_primitives.inline_mgpu_p:
          token, outs = _interpret_named_barrier(self, eqn, token,
                                                 _named_barrier_of(eqn))
        elif eqn.primitive in _SEMAPHORE_PRIMITIVES:
          token, outs = _interpret_semaphore_primitive(self, eqn, token,
                                                       invals)
        else:
          token, outs = _interpret_run_state_p(self, eqn, token, invals)
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
      i += 1
      continue
    j = i
    while j < len(eqns) and not is_special(eqns[j]):
      j += 1
    run = eqns[i:j]
    defined = set()
    free = []
    for e in run:
      for v in e.invars:
        if (isinstance(v, jax_core.Var) and v not in defined
            and v not in free):
          free.append(v)
      defined.update(e.outvars)
    # Outputs of the run: everything it defines that is used later.
    later = set()
    for e in eqns[j:]:
      later.update(v for v in e.invars if isinstance(v, jax_core.Var))
    later.update(v for v in jaxpr.outvars if isinstance(v, jax_core.Var))
    outs = [v for e in run for v in e.outvars
            if v in later and not isinstance(v, jax_core.DropVar)]
    sub = jax_core.Jaxpr([], free, outs, run)
    token, vals = _STOCK_INTERPRET(self, sub, token, *[env[v] for v in free])
    for v, val in zip(outs, vals):
      env[v] = val
    i = j
  return token, [read(v) for v in jaxpr.outvars]


# --------------------------------------------------------------------------
# wgmma

def _split_transpose(transforms):
  """(leading transforms, permutation or None) for a trailing transpose."""
  transforms = tuple(transforms)
  perm = None
  while transforms and isinstance(transforms[-1],
                                  state_types.TransposeTransform):
    p = transforms[-1].permutation
    perm = p if perm is None else tuple(p[i] for i in perm)
    transforms = transforms[:-1]
  if any(isinstance(t, state_types.TransposeTransform) for t in transforms):
    raise NotImplementedError(f"transpose before indexing: {transforms}")
  return transforms, perm


def _wgmma_callback(*, token, device_id, grid_point_coords, thread_id,
                    acc_allocation_key_as_array, acc_transforms, acc_dtype,
                    a_allocation_key_as_array, a_transforms, a_value,
                    b_allocation_key_as_array, b_transforms,
                    a_perm, b_perm, source_info=None):
  sm, gtid, info = _host_context(device_id, grid_point_coords, thread_id,
                                 source_info)

  def read(key_arr, transforms, perm):
    key = gc.HostAllocationKey.from_array(key_arr)
    val, _, _ = sm.get_buffer_content(
        key, _range_of(transforms), gtid, logging_info=info)
    assert val is not None
    return val if perm is None else np.transpose(val, perm)

  if a_value is not None:
    a = np.asarray(a_value)
  else:
    a = read(a_allocation_key_as_array, a_transforms, a_perm)
  b = read(b_allocation_key_as_array, b_transforms, b_perm)
  acc_key = gc.HostAllocationKey.from_array(acc_allocation_key_as_array)
  acc_range = _range_of(acc_transforms)
  acc, _, _ = sm.get_buffer_content(acc_key, acc_range, gtid,
                                    logging_info=info)
  res = acc + np.matmul(a, b, dtype=acc_dtype)
  sm.store_buffer_content(acc_key, acc_range, res, gtid, logging_info=info)
  return token


def _patched_wgmma_ref_p(self, eqn, token, get_invals):
  assert eqn.primitive is gpu_primitives.wgmma_ref_p
  acc, a, b, *leaves = get_invals()
  empty = jax.tree.structure([])
  acc_t, a_t, b_t = jax.tree.unflatten(
      jax.tree_util.treedef_tuple((
          eqn.params["acc_transforms_tree"] or empty,
          eqn.params["a_transforms_tree"] or empty,
          eqn.params["b_transforms_tree"] or empty)), leaves)
  a_t, a_perm = _split_transpose(a_t)
  b_t, b_perm = _split_transpose(b_t)
  a_is_value = not isinstance(eqn.invars[1].aval, state_types.AbstractRef)
  if a_is_value and (a_t or a_perm):
    raise NotImplementedError("transforms on a register-held wgmma LHS")
  return callback.io_callback(
      functools.partial(_wgmma_callback, acc_dtype=eqn.invars[0].aval.dtype,
                        a_perm=a_perm, b_perm=b_perm,
                        source_info=eqn.source_info),
      gc.TOKEN_SHAPE_DTYPE,
      token=token, device_id=self.device_info.device_id,
      grid_point_coords=self.grid_point_coords, thread_id=self.thread_id,
      acc_allocation_key_as_array=acc, acc_transforms=acc_t,
      a_allocation_key_as_array=None if a_is_value else a,
      a_transforms=a_t, a_value=a if a_is_value else None,
      b_allocation_key_as_array=b, b_transforms=b_t,
      ordered=True), []


# --------------------------------------------------------------------------
# Global semaphores (`pl.get_global(plgpu.SemaphoreType.REGULAR(shape))`)

class _Semaphores:
  """The int32 values of the launch's global semaphore arrays, by the id
  that their `get_global` equation got when the kernel was traced (every
  grid point and thread runs that one trace, so all see one array), made
  zero on first use and dropped when the launch ends, as Mosaic GPU zeroes
  a launch's semaphores."""

  def __init__(self):
    self.cv = threading.Condition()
    self.values: dict[int, np.ndarray] = {}

  def array(self, sem_id: int, shape) -> np.ndarray:
    """The array `sem_id` (call with `self.cv` held)."""
    if sem_id not in self.values:
      self.values[sem_id] = np.zeros(shape, np.int32)
    return self.values[sem_id]

  def clear(self):
    with self.cv:
      self.values.clear()


_SEMAPHORES = _Semaphores()
_NEXT_SEMAPHORE_ID = iter(range(1 << 30))


def _semaphore_signal_callback(token, sem_id, transforms, inc, *, shape):
  with _SEMAPHORES.cv:
    _SEMAPHORES.array(int(sem_id), shape)[_range_of(transforms)] += (
        int(inc))
    _SEMAPHORES.cv.notify_all()
  return token


def _semaphore_wait_callback(token, sem_id, transforms, value, *, shape,
                             decrement):
  """Blocks this warpgroup's host thread until the semaphore reaches
  `value`. The grid points run one after another (the interpreter's
  `fori_loop` over them), so only a thread of the same CTA, or an earlier
  CTA, can have raised it: a wait on a later CTA never returns."""
  index, value = _range_of(transforms), int(value)
  with _SEMAPHORES.cv:
    sems = _SEMAPHORES.array(int(sem_id), shape)
    _SEMAPHORES.cv.wait_for(lambda: sems[index] >= value)
    if decrement:
      sems[index] -= value
  return token


def _interpret_semaphore_primitive(self, eqn, token, invals):
  """(token, outputs) of `get_global` (of a semaphore array: its id) and
  of `plgpu.semaphore_signal` / `semaphore_wait` (or Pallas's): an atomic
  add that wakes the waiters, and a wait for the value, minus it after
  if `decrement`. `memory_scope` has nothing to order here: every load
  and store, TMA ones included, is done by the time its callback returns.
  """
  if eqn.primitive is pallas_primitives.get_global_p:
    what = eqn.params["what"]
    if not jnp.issubdtype(what.dtype, pallas_core.semaphore):
      raise NotImplementedError(f"get_global of {what}")
    return token, [jnp.int32(next(_NEXT_SEMAPHORE_ID))]
  args = jax.tree.unflatten(eqn.params["args_tree"], invals)
  shape = jax.tree.unflatten(eqn.params["args_tree"],
                             [v.aval for v in eqn.invars])[0].shape
  if eqn.primitive in (gpu_primitives.semaphore_signal_p,
                       pallas_primitives.semaphore_signal_p):
    sem, transforms, inc, device_id, core_index = args
    if device_id is not None or core_index is not None:
      raise NotImplementedError("a remote or per-core semaphore signal")
    callback_fn = functools.partial(_semaphore_signal_callback, shape=shape)
  else:
    sem, transforms, value, decrement = args
    callback_fn = functools.partial(_semaphore_wait_callback, shape=shape,
                                    decrement=bool(decrement))
    inc = value
  token = callback.io_callback(callback_fn, gc.TOKEN_SHAPE_DTYPE, token, sem,
                               transforms, inc, ordered=True)
  return token, []


def _patched_clean_up_shared_memory(token):
  _clear_launch_state()
  return _STOCK_CLEAN_UP_SHARED_MEMORY(token)


# --------------------------------------------------------------------------
# Named hardware barriers (`compat.named_barrier`: inline PTX `bar.sync` /
# `bar.arrive`)

_THREADS_PER_WARPGROUP = 128


def _named_barrier_of(eqn):
  """(operation, barrier id, thread count) if `eqn` is the `inline_mgpu`
  of `compat.named_barrier` (its `emit`, by code object), else None."""
  fn = eqn.params.get("mgpu_fn")
  if getattr(fn, "__code__", None) is not _NAMED_BARRIER_EMIT:
    return None
  cells = inspect.getclosurevars(fn).nonlocals
  return cells["operation"], cells["barrier_id"], cells["num_threads"]


def _is_row_multiply(eqn) -> bool:
  """Whether `eqn` is the forward's `multiply_rows_in_threads` (the lazy
  rescale's in-thread branch): `acc * alpha[:, None]`, which is what the
  branch computes, since it skips only multiplies by exactly 1."""
  fn = eqn.params.get("mgpu_fn")
  return (eqn.primitive is gpu_primitives.inline_mgpu_p
          and getattr(fn, "func", fn)  # through functools.partial
          is mosaic_softmax.multiply_rows_in_threads)


def _is_rounded_add(eqn) -> bool:
  """Whether `eqn` is the forward's `add_rounded_in_threads` (`a + b`)."""
  return (eqn.primitive is gpu_primitives.inline_mgpu_p
          and eqn.params.get("mgpu_fn")
          is mosaic_softmax.add_rounded_in_threads)


def _is_quad_dropout(eqn) -> bool:
  """Whether `eqn` is `common.quad_dropout_in_threads` (dropout's kept
  weights, a hash per quad of a thread's registers)."""
  fn = eqn.params.get("mgpu_fn")
  return (eqn.primitive is gpu_primitives.inline_mgpu_p
          and getattr(fn, "func", None) is mosaic_common.quad_dropout_in_threads)


def _is_fp8_operand(eqn) -> bool:
  """Whether `eqn` is `common.fp8_operand`'s register regrouping (its
  `regroup`, by code object)."""
  fn = eqn.params.get("mgpu_fn")
  return (eqn.primitive is gpu_primitives.inline_mgpu_p
          and getattr(fn, "__code__", None) is _FP8_REGROUP)


def _fp8_operand_value(p):
  """What `common.fp8_operand` hands wgmma, as a value: P with its columns
  in the order of V's keys after `common.interleave_fp8_keys` (column c
  of the result is P's column keys[c]). That the hardware regrouping is
  this permutation is checked apart, from Mosaic GPU's layouts
  (tests/test_mosaic_fp8.py); here it is what lets the kernel around it
  run."""
  keys = mosaic_common.interleave_fp8_keys(
      jnp.arange(p.shape[-1])[None, None, None])[0, 0, 0]
  return p[:, keys]


class _NamedBarriers:
  """A CTA's hardware barriers by (device, grid point, id): each warpgroup
  counts 128 threads; `sync` waits for the count to reach the barrier's,
  `arrive` only counts; a full count starts the next phase."""

  def __init__(self):
    self.cv = threading.Condition()
    self.state: dict[tuple, list[int]] = {}  # key: [count, phase]

  def __call__(self, token, device_id, grid_point_coords, *, operation,
               barrier_id, num_threads):
    key = (int(device_id), tuple(int(x) for x in grid_point_coords),
           barrier_id)
    with self.cv:
      state = self.state.setdefault(key, [0, 0])
      phase = state[1]
      state[0] += _THREADS_PER_WARPGROUP
      if state[0] > num_threads:
        raise RuntimeError(f"named barrier {barrier_id}: more than "
                           f"{num_threads} threads arrived in a phase")
      if state[0] == num_threads:
        state[0], state[1] = 0, phase + 1
        self.cv.notify_all()
      elif operation == "sync":
        self.cv.wait_for(lambda: state[1] != phase)
    return token

  def clear(self):
    with self.cv:
      self.state.clear()


_NAMED_BARRIERS = _NamedBarriers()


def _interpret_named_barrier(self, eqn, token, barrier):
  operation, barrier_id, num_threads = barrier
  token = callback.io_callback(
      functools.partial(_NAMED_BARRIERS, operation=operation,
                        barrier_id=barrier_id, num_threads=num_threads),
      gc.TOKEN_SHAPE_DTYPE, token, self.device_info.device_id,
      self.grid_point_coords, ordered=True)
  return token, []


# --------------------------------------------------------------------------
# Barrier deallocation

UNOBSERVED_TRAILING_PHASES = 0


def _patched_barrier_deallocate(self):
  global UNOBSERVED_TRAILING_PHASES
  with self.cv:
    self.ref_count -= 1
    if self.ref_count > 0:
      return
    for next_phase in self.next_awaited_phase_by_thread:
      observed = next_phase - 1
      if 0 < observed < self.phase:
        UNOBSERVED_TRAILING_PHASES += self.phase - observed


# --------------------------------------------------------------------------
# TMA at the ends of the global arrays

# Set on a simulated thread's host thread while its TMA load runs: the
# stock transfer reads its source through `gc._get`, which is also every
# plain load's, so only this says that an out-of-bounds read is a TMA one.
_IN_TMA_LOAD = threading.local()


def _patched_transfer_execute(self, token):
  _IN_TMA_LOAD.active = True
  try:
    return _STOCK_TRANSFER_EXECUTE(self, token)
  finally:
    _IN_TMA_LOAD.active = False


def _patched_handle_out_of_bounds_read(ret, full_read_shape, shape, dtype,
                                       allocation_key, read_range, *args,
                                       **kwargs):
  """A TMA load's read: `ret`, its in-bounds part (None where none is),
  padded with zeros to `full_read_shape`. Its coordinates must not be
  negative (our kernels' never are), so the in-bounds part is the leading
  corner. Any other read: the stock handling."""
  if not getattr(_IN_TMA_LOAD, "active", False):
    return _STOCK_HANDLE_OUT_OF_BOUNDS_READ(
        ret, full_read_shape, shape, dtype, allocation_key, read_range,
        *args, **kwargs)
  starts = [r.start if isinstance(r, slice) else r for r in read_range]
  if any(start is not None and start < 0 for start in starts):
    raise IndexError(f"TMA load at negative coordinates {read_range} of "
                     f"{allocation_key}: the zero fill assumes none")
  value = np.zeros(full_read_shape, dtype)
  if ret is not None:
    value[tuple(slice(n) for n in ret.shape)] = ret
  return value


def _clipped_copy_smem_to_gmem(*, token, device_id, grid_point_coords,
                               thread_id, src_allocation_key_as_array,
                               src_transforms, dst_allocation_key_as_array,
                               dst_transforms, predicate, source_info,
                               commit_group, reduction_op):
  """`gc.copy_smem_to_gmem` (synchronous, no race detection, as the stock
  one), but a store partly past the end of `dst` writes its in-bounds
  part, as TMA does."""
  del commit_group
  if predicate is not None or reduction_op not in (None, "add"):
    raise NotImplementedError(
        f"TMA store with a predicate or a {reduction_op} reduction")
  sm, gtid, info = _host_context(device_id, grid_point_coords, thread_id,
                                 source_info)
  val, _, _ = sm.get_buffer_content(
      gc.HostAllocationKey.from_array(src_allocation_key_as_array),
      _range_of(src_transforms), gtid, logging_info=info)
  assert val is not None
  dst_key = gc.HostAllocationKey.from_array(dst_allocation_key_as_array)
  dst_range = _range_of(dst_transforms)
  if reduction_op == "add":
    # The read and the write under the memory's lock, so that the add is
    # atomic, as TMA's is; in dst's dtype; only the in-bounds part (the
    # buffer's read returns that part, at the range's leading corner).
    with sm.lock:
      buffer = sm.mem[dst_key]
      old = buffer[dst_range]
      added = old + val[tuple(slice(n) for n in old.shape)].astype(old.dtype)
      buffer.set_in_bounds_portion(dst_range, added)
    return token
  in_bounds, _, _ = sm.store_buffer_content(dst_key, dst_range, val, gtid,
                                            logging_info=info)
  if not in_bounds:  # nothing was written: write what lies in bounds
    with sm.lock:
      sm.mem[dst_key].set_in_bounds_portion(dst_range, val)
  return token


_STOCK_INTERPRET = None
_STOCK_TRANSFER_EXECUTE = None
_STOCK_HANDLE_OUT_OF_BOUNDS_READ = None
_STOCK_CLEAN_UP_SHARED_MEMORY = None


def install() -> None:
  """Applies the patches (once); raises RuntimeError with `WHY_NOT` where
  they cannot apply."""
  global _STOCK_INTERPRET, _STOCK_TRANSFER_EXECUTE
  global _STOCK_HANDLE_OUT_OF_BOUNDS_READ, _STOCK_CLEAN_UP_SHARED_MEMORY
  if WHY_NOT is not None:
    raise RuntimeError(WHY_NOT)
  if _STOCK_INTERPRET is not None:
    return
  _STOCK_INTERPRET = ji.JaxprInterpreter.interpret
  _STOCK_TRANSFER_EXECUTE = gc.DeviceLocalMemoryTransfer.execute
  _STOCK_HANDLE_OUT_OF_BOUNDS_READ = gc._handle_out_of_bounds_read
  _STOCK_CLEAN_UP_SHARED_MEMORY = gc._clean_up_shared_memory
  gpu_memory.Barrier.deallocate = _patched_barrier_deallocate
  ji.JaxprInterpreter.interpret = _patched_interpret
  ji.JaxprInterpreter._interpret_wgmma_ref_p = _patched_wgmma_ref_p
  gc.DeviceLocalMemoryTransfer.execute = _patched_transfer_execute
  gc._handle_out_of_bounds_read = _patched_handle_out_of_bounds_read
  gc.copy_smem_to_gmem = _clipped_copy_smem_to_gmem
  gc._clean_up_shared_memory = _patched_clean_up_shared_memory


@contextlib.contextmanager
def interpreted():
  """A context in which Mosaic GPU kernels run under the interpreter."""
  install()
  with force_gpu_interpret_mode(InterpretGPUParams()), _rows_in_one_buffer():
    yield


@contextlib.contextmanager
def _rows_in_one_buffer():
  """Rows read in place (`rows.rows_in_place`) through one tiled buffer
  instead of `rows.row_buffer`'s `plgpu.RefUnion`: the interpreter has
  no aliased views (`ExtractAliasedRef`), and tiling is a no-op to it, so
  the in-place rows' semantics (TMA reads past the ends as zeros, stores
  there dropped, the kernels' masks and the backward's padding) are what
  a test sees; that the two views lay out the same bytes is the GPU's to
  check. Only while interpreting: lowering keeps the union."""
  from pallas_kernels.mosaic import dkdv, dq, forward, rows
  users = (forward, dq, dkdv)  # of `row_buffer`, imported by name
  stock_of = vars(rows.RowViews)["of"]

  def one_buffer_of(shape, dtype, in_place):
    # Split rows keep their column tiles ([..., tiles, rows, width]): the
    # products split at them as on the GPU.
    if in_place and rows.split_rows(shape[-1], dtype):
      shape = rows.column_tiles_shape(shape, dtype)
    return rows.row_buffer(shape, dtype, in_place=False)

  def one_buffer(cls, scratch, static):
    if static.rows_in_place and rows.split_rows(static.head_dim,
                                                  static.dtype):
      return cls(scratch, rows.ColumnTiles(scratch), split=True)
    return cls.plain(scratch)

  for module in users:
    module.row_buffer = one_buffer_of
  rows.RowViews.of = classmethod(one_buffer)
  try:
    yield
  finally:
    for module in users:
      module.row_buffer = rows.row_buffer
    rows.RowViews.of = stock_of


def reset() -> None:
  """Clears the interpreter's state after a failed kernel (else the next
  run reports the last one's leftovers)."""
  gc.reset_gpu_interpret_mode_state()
  _clear_launch_state()


def run(fn, *args, **kwargs) -> list[np.ndarray]:
  """`fn(*args, **kwargs)` (kernels and the code around them) under the
  interpreter, its outputs as float32 numpy arrays, in order; the
  interpreter's state is reset after, failed or not."""
  try:
    with interpreted():
      outputs = fn(*args, **kwargs)
      return [np.asarray(x, np.float32) for x in outputs]
  finally:
    reset()
