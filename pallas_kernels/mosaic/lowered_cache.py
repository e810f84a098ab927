"""Lowered Mosaic kernels kept on disk between processes (first-call time).

A process's first call of the Mosaic attention traces each kernel's body in
Python and runs Mosaic GPU's passes over it (layout inference, dialect
lowering) before JAX can even look the program up in its persistent
compilation cache: ~1.5 s of a causal fwd+bwd's ~2.2 s first call at 4k in
a process that finds that cache filled. JAX's persistent cache keys on the
lowered program, so it cannot skip the lowering itself.

This cache does: where JAX's persistent compilation cache is on
(`jax_compilation_cache_dir`, the user's opt-in to files on disk), each
kernel launch is exported with `jax.export` (the kernel's lowered module,
Mosaic GPU's custom call in it, which `jax.export` lists as stable) into
`<that dir>/jax_flash_kernels/<key>.bin`, and a later process calls the
deserialised module instead of tracing and lowering the kernel again. The
program then lowers to the same text in every process, so JAX's own cache
finds its compiled form too.

The key is a SHA-256 of everything the lowered kernel depends on: the body
function's name and static arguments, `plgpu.kernel`'s arguments (output
and scratch types, grid, threads, compiler parameters), the operands'
shapes and dtypes, the JAX and jaxlib versions, the GPU's compute
capability, the `MOSAIC_GPU_*` environment, and a digest of this package's
source files (a changed kernel gets a new key). A launch whose key would
not be the same in another process (a static argument holding a function
or an array: `mask_fn`, `score_fn`; their reprs carry addresses) is not
cached, nor one traced under `vmap` or inside `jax.shard_map` (an
exported module takes neither), nor anything without a GPU (the CPU's
interpret mode). Any failure to read, export or write falls back to the
plain launch.

`JAX_FLASH_KERNEL_CACHE=0` turns it off (say, to dump a kernel's MLIR).
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import tempfile
import warnings
from typing import Any, Callable

import jax
import jaxlib
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat as versions

# Bumped when the key's contents or the file's format change.
_SCHEMA = 1
# Launches served from disk and exported to it in this process (tests).
stats = {"hits": 0, "misses": 0}


def kernel(body: Callable, **kernel_args) -> Callable:
  """`plgpu.kernel(body, **kernel_args)`, served from the disk cache where
  it is on. `body` is a `functools.partial` of a module-level kernel
  function with its static arguments as keywords."""
  launch = lambda *inputs: plgpu.kernel(body, **kernel_args)(*inputs)

  def call(*inputs):
    directory = cache_directory()
    key = None if directory is None else _key(body, kernel_args, inputs)
    if key is None:
      return launch(*inputs)
    exported = _load_or_export(directory / f"{key}.bin", launch, inputs)
    if exported is not None:
      try:
        return exported.call(*inputs)
      except Exception as e:  # noqa: BLE001 - the plain launch always works
        warnings.warn(f"jax_flash's kernel cache skipped {key}: {e!r}",
                      stacklevel=2)
    return launch(*inputs)

  return call


def cache_directory() -> pathlib.Path | None:
  """Where lowered kernels are kept, or None where the cache is off."""
  if os.environ.get("JAX_FLASH_KERNEL_CACHE", "1") == "0":
    return None
  root = jax.config.jax_compilation_cache_dir
  if not root or not _on_gpu():
    return None
  return pathlib.Path(root) / "jax_flash_kernels"


def _on_gpu() -> bool:
  return versions.has_gpu()


def _key(body, kernel_args: dict, inputs) -> str | None:
  """The launch's cache key, or None where it cannot be keyed."""
  if not isinstance(body, functools.partial) or body.args:
    return None
  for x in inputs:
    if isinstance(x, jax.core.Tracer) and not _plain_trace(x):
      return None
  text = repr((
      _SCHEMA, body.func.__module__, body.func.__qualname__,
      sorted(body.keywords.items()), sorted(kernel_args.items()),
      [(tuple(x.shape), str(x.dtype)) for x in inputs],
      jax.__version__, jaxlib.__version__, jax.config.jax_enable_x64,
      versions.gpu_compute_capability(),
      sorted((k, v) for k, v in os.environ.items()
             if k.startswith("MOSAIC_GPU")),
      _source_digest()))
  if " at 0x" in text:  # a function or object keyed by its address
    return None
  return hashlib.sha256(text.encode()).hexdigest()


def _plain_trace(x) -> bool:
  """Whether tracer `x` belongs to a plain `jit` trace: not batched (vmap)
  and varying along no manual mesh axis (shard_map)."""
  if type(x).__name__ != "DynamicJaxprTracer":
    return False
  aval = jax.typeof(x)
  return not getattr(getattr(aval, "mat", None), "varying", ()) and \
      not getattr(aval, "vma", ())


@functools.cache
def _source_digest() -> str:
  """SHA-256 of every Python source file of `pallas_kernels`."""
  digest = hashlib.sha256()
  package = pathlib.Path(__file__).resolve().parents[1]
  for path in sorted(package.rglob("*.py")):
    digest.update(str(path.relative_to(package)).encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()


def _load_or_export(path: pathlib.Path, launch: Callable, inputs) -> Any:
  """The exported launch from `path`, else exported now and written there;
  None where either fails (with a warning)."""
  from jax import export
  try:
    if path.exists():
      try:
        exported = export.deserialize(bytearray(path.read_bytes()))
      except Exception:  # noqa: BLE001 - a damaged file: exported anew
        path.unlink(missing_ok=True)
      else:
        stats["hits"] += 1
        return exported
    exported = export.export(jax.jit(launch), platforms=("cuda",))(
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs))
    data = exported.serialize()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole, then renamed: a process reading it sees all or none.
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
      f.write(data)
    os.replace(f.name, path)
    stats["misses"] += 1
    return exported
  except Exception as e:  # noqa: BLE001 - the plain launch always works
    warnings.warn(f"jax_flash's kernel cache skipped {path.name}: {e!r}",
                  stacklevel=3)
    return None
