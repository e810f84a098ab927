"""Shared test helpers: random inputs, the tolerance rule, GPU gating."""
from __future__ import annotations

import jax
import pytest

from pallas_kernels import compat

compat.filter_known_warnings()

ON_GPU = compat.has_gpu()


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.default_backend() "
                          f"is {jax.default_backend()!r})")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope="module")
def cuda_lowering():
  """Skips, with JAX's own message, where Mosaic GPU cannot lower for CUDA
  (or is absent from this jaxlib); the Mosaic tests' cross-lowering needs it.
  """
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from pallas_kernels.mosaic import compat as mosaic_compat
  except ImportError as e:
    pytest.skip(f"Mosaic GPU is not importable: {e}")
  x = jax.ShapeDtypeStruct((128,), jax.numpy.float32)

  def copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  probe = plgpu.kernel(copy, out_type=x,
                       compiler_params=mosaic_compat.compiler_params())
  try:
    jax.jit(probe).trace(x).lower(lowering_platforms=("cuda",))
  except NotImplementedError as e:  # no "cuda" lowering rule registered
    pytest.skip(f"this JAX cannot lower Mosaic GPU for CUDA here: {e}")


@pytest.fixture(params=["Warpgroup", "Lane"])
def lowering_semantics(request, cuda_lowering, monkeypatch):
  """Runs a Mosaic cross-lowering test in each of Mosaic GPU's lowering
  semantics, so that the one-line switch in `pallas_kernels.mosaic.compat`
  stays available if the chosen one miscompiles on the GPU."""
  del cuda_lowering  # requested for its skip
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels.mosaic import compat as mosaic_compat
  monkeypatch.setattr(mosaic_compat, "LOWERING_SEMANTICS",
                      getattr(plgpu.LoweringSemantics, request.param))
  return request.param
