"""The one place that knows about differences between JAX versions.

CPU machines run JAX 0.10.2 and the H200 runs JAX 0.11.2. Keep every version
check here so the kernels read the same on both.
"""
from __future__ import annotations

import contextlib
import warnings

import jax


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


# SMs of an H100/H200 SXM: what a persistent kernel is sized for when no
# GPU is present to ask (cross-lowering on a CPU).
_DEFAULT_NUM_SMS = 132


def num_sms() -> int:
  """Streaming multiprocessors of the first GPU (`core_count` in both JAX
  versions); 132 without a GPU."""
  if not has_gpu():
    return _DEFAULT_NUM_SMS
  return int(getattr(jax.devices()[0], "core_count", 0) or _DEFAULT_NUM_SMS)
