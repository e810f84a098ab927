"""The one place that knows about differences between JAX versions.

CPU machines run JAX 0.10.2 and the H200 runs JAX 0.11.2. Keep every version
check here so the kernels read the same on both.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import jax
from jax.experimental import pallas as pl


# JAX 0.11 deprecates the Pallas Triton backend (it still works). Only this
# exact warning is filtered; anything else stays visible.
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def quiet_triton_deprecation():
  """Silences JAX 0.11's deprecation warning for the Pallas Triton backend."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION)
    yield


def filter_known_warnings() -> None:
  """Installs process-wide filters for the known, harmless deprecations."""
  warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION)


def has_gpu() -> bool:
  """True when the default JAX backend is a CUDA GPU."""
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def gpu_compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the first GPU, or None without one."""
  if not has_gpu():
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None:
    return None
  major, _, minor = str(cc).partition(".")
  return int(major), int(minor or 0)


def output_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """`ShapeDtypeStruct` of a kernel output that varies like its inputs.

  Inside `shard_map(check_vma=True)` Pallas needs each output's manual-axis
  type: an attention output varies along every mesh axis any input varies
  along. (JAX 0.10.2 and 0.11.2 both call it `manual_axis_type`, read from an
  aval's `.mat`.)
  """
  types = [jax.typeof(x).mat for x in inputs]
  varying = frozenset().union(*(t.varying for t in types))
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=types[0].update(varying=varying))


def pallas_call(kernel, *, interpret: bool = False, **kwargs):
  """`pl.pallas_call` that also runs interpreted inside `shard_map(check_vma=True)`.

  Compiled (`interpret=False`) it is `pl.pallas_call` itself. Interpreted,
  JAX's Pallas interpreter (0.10.2, unchanged upstream) evaluates the kernel's
  jaxpr, traced without manual-axis types, on blocks of the inputs; where
  those vary along a mesh axis, a primitive that meets them with one of the
  kernel's constants refuses the mix (the `pad` of a masked load, an `eq`,
  a scan's carry). Such calls go through `_interpreted_call_p()`, which has
  the kernel's types outside and lowers the interpreter on the same values
  typed invariant, as under `check_vma=False` (the results are bitwise
  those, tests/test_transformations.py).
  """
  call = pl.pallas_call(kernel, interpret=interpret, **kwargs)
  if not interpret:
    return call
  return functools.partial(_interpret, call)


def _varying(arrays) -> frozenset:
  return frozenset().union(*(jax.typeof(x).mat.varying for x in arrays))


def _invariant_structs(arrays):
  return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]


def _with_varying(avals, varying: frozenset):
  return [a.update_manual_axis_type(a.mat.update(varying=varying))
          for a in avals]


def _interpret(call, *inputs):
  """`call(*inputs)`, through `_interpreted_call_p()` where an input varies."""
  leaves, in_tree = jax.tree.flatten(inputs)
  varying = _varying(leaves)
  if not varying:
    return call(*inputs)
  jaxpr, out_shape = jax.make_jaxpr(
      lambda *xs: call(*in_tree.unflatten(xs)),
      return_shape=True)(*_invariant_structs(leaves))
  outs = _interpreted_call_p().bind(*leaves, jaxpr=jaxpr, varying=varying)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


@functools.cache
def _interpreted_call_p():
  """One interpreted pallas_call as an opaque primitive.

  Its `jaxpr` is the call traced on invariant inputs; its outputs vary along
  `varying`, the inputs' axes (as `output_struct` declares). Made on first
  use, so that compiled kernels never touch these JAX internals.
  """
  from jax.extend import core as jex_core
  from jax.interpreters import batching, mlir

  primitive = jex_core.Primitive("pallas_call_interpreted")
  primitive.multiple_results = True
  primitive.def_abstract_eval(
      lambda *_, jaxpr, varying: _with_varying(jaxpr.out_avals, varying))

  def lowering(ctx, *args, jaxpr, varying):
    del varying
    invariant = lambda avals: _with_varying(avals, frozenset())
    ctx = ctx.replace(avals_in=invariant(ctx.avals_in),
                      avals_out=invariant(ctx.avals_out))
    return mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr),
                          multiple_results=True)(ctx, *args)

  def batched(args, dims, *, jaxpr, varying):
    vmapped = jax.vmap(jex_core.jaxpr_as_fun(jaxpr), in_axes=dims)
    outs = primitive.bind(
        *args, jaxpr=jax.make_jaxpr(vmapped)(*_invariant_structs(args)),
        varying=varying)
    return outs, [0] * len(outs)

  mlir.register_lowering(primitive, lowering)
  batching.primitive_batchers[primitive] = batched
  return primitive


# SMs of an H100/H200 SXM: what a persistent kernel is sized for when no
# GPU is present to ask (cross-lowering on a CPU).
_DEFAULT_NUM_SMS = 132


def num_sms() -> int:
  """Streaming multiprocessors of the first GPU (`core_count` in both JAX
  versions); 132 without a GPU."""
  if not has_gpu():
    return _DEFAULT_NUM_SMS
  return int(getattr(jax.devices()[0], "core_count", 0) or _DEFAULT_NUM_SMS)
