"""Shared test helpers: random inputs, the tolerance rule, GPU gating."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os


def _default_xla_flag(name: str, value: str) -> None:
  """Adds `--name=value` to XLA_FLAGS unless the caller set `name` there."""
  if name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        filter(None, [os.environ.get("XLA_FLAGS"), f"--{name}={value}"]))


def _gpu_plugin_installed() -> bool:
  """Whether JAX will find a PJRT plugin (jax[cuda12] and jax[cuda13]
  install one; the H200 host's is `xla_cuda13`), asked without starting a
  backend."""
  return (importlib.util.find_spec("jax_plugins") is not None
          or bool(importlib.metadata.entry_points(group="jax_plugins")))


# XLA's GPU autotuner compiles and times candidate kernels for every new
# matmul shape, in every process; with pytest-xdist's workers sharing a GPU
# it was most of the GPU suite's time (on the H200: three heavy tests 105 s
# -> 43 s in one process, and the whole suite, which had taken three
# 10-minute calls of a two-GPU host, ran in 3 min 9 s). Tests need
# right numbers, not the fastest matmul, and level 0 also gives every
# process the same reference kernels. Set before any backend starts; a
# level the caller set in XLA_FLAGS stays.
_default_xla_flag("xla_gpu_autotune_level", "0")

# The CPU suite is bound by XLA:CPU compiling the interpret-mode kernels
# and the references (`--compile-times`: XLA's compile 60% of the tests'
# calls, 88% with tracing and lowering), not by
# running them at their small shapes. Without LLVM's optimisations (JAX's
# `jax_disable_most_optimizations`) and with XLA:CPU's element emitters in
# place of its slower-compiling MLIR fusion emitters, the same HLO (no
# fast math either way) compiles in about a quarter of the time, and the
# default run took 5 min 45 s to 6 min instead of 11 min 5 s on 2 cores.
# Results move by float32 rounding only (errors against the reference of
# 1.4e-6 became 1.7e-6 in one case, under a bound of 2e-5), and a
# perturbed kernel fails the same tests either way. Only where no GPU
# plugin is installed (CI's CPU-only jaxlib 0.10.2, where the flag was
# checked): a GPU host compiles as before. The emitter flag only on
# jaxlib 0.10, where it was checked: XLA aborts a process whose XLA_FLAGS
# names a flag it does not know. Exported, so that the tests' child
# processes (the sharding worker, the notebook, ...) get them too; a value
# the caller set stays (JAX_DISABLE_MOST_OPTIMIZATIONS=0 and
# XLA_FLAGS=--xla_cpu_use_fusion_emitters=true restore XLA's defaults;
# `xla_default_env` gives a child them, as the test of `python -m
# jax_flash` does).
CPU_ONLY = not _gpu_plugin_installed()
_FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"


def xla_default_env() -> dict[str, str]:
  """This process's environment for a child that compiles with XLA's
  default settings (not the faster-compiling ones above)."""
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="0")
  env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                              if flag != _FAST_COMPILE_FLAG)
  return env


if CPU_ONLY:
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  if importlib.metadata.version("jaxlib").startswith("0.10."):
    name, value = _FAST_COMPILE_FLAG.removeprefix("--").split("=")
    _default_xla_flag(name, value)

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

from pallas_kernels import compat  # noqa: E402

compat.filter_known_warnings()
if CPU_ONLY:  # in case a plugin imported jax before the variable was set
  jax.config.update("jax_disable_most_optimizations",
                    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower()
                    in ("1", "true", "t", "yes", "y", "on"))

# `--compile-times N`: tracing, lowering and compile seconds per test.
pytest_plugins = ["tests.compile_times"]

ON_GPU = compat.has_gpu()


def pytest_addoption(parser):
  parser.addoption(
      "--shard", default=None, metavar="I/N",
      help="run only part I of N (0-based) of the selected tests: every N-th "
           "by node id, from the I-th; the N parts partition the selection "
           "(benchmarks/h200_check.sh tests_shards: one half of the GPU "
           "suite on each GPU of a two-GPU host)")


def pytest_report_header(config):
  """Which compile settings this run took (the CPU ones apply only where
  no GPU plugin is installed)."""
  del config
  return (f"jax-flash tests: CPU_ONLY={CPU_ONLY}, JAX_DISABLE_MOST_"
          f"OPTIMIZATIONS={os.environ.get('JAX_DISABLE_MOST_OPTIMIZATIONS')}"
          f", XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")


def shard_of(nodeids, shard: str) -> set[str]:
  """The node ids of part `shard` ("I/N") of `nodeids`: every N-th by
  sorted node id, from the I-th, so that a test's many parametrizations
  spread over the parts."""
  try:
    index, count = (int(n) for n in shard.split("/"))
  except ValueError:
    raise pytest.UsageError(f"--shard wants I/N, got {shard!r}") from None
  if not 0 <= index < count:
    raise pytest.UsageError(f"--shard {shard!r}: I must be in [0, N)")
  return set(sorted(nodeids)[index::count])


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
  if shard := config.getoption("--shard"):
    keep = shard_of([item.nodeid for item in items], shard)
    config.hook.pytest_deselected(
        items=[item for item in items if item.nodeid not in keep])
    items[:] = [item for item in items if item.nodeid in keep]
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


# Both semantics in the default run (`lowering_semantics`'s parameters).
BOTH_SEMANTICS = pytest.mark.parametrize("lowering_semantics",
                                         ["Warpgroup", "Lane"], indirect=True)


@pytest.fixture(params=["Warpgroup",
                        pytest.param("Lane", marks=pytest.mark.slow)])
def lowering_semantics(request, cuda_lowering, monkeypatch):
  """Runs a Mosaic cross-lowering test in each of Mosaic GPU's lowering
  semantics, so that the one-line switch in `pallas_kernels.mosaic.compat`
  stays available if the chosen one miscompiles on the GPU. "Lane" with
  `-m slow` (CI's ten minutes), but for the plain forward's and
  backward's lowering tests (`BOTH_SEMANTICS`)."""
  del cuda_lowering  # requested for its skip
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels.mosaic import compat as mosaic_compat
  monkeypatch.setattr(mosaic_compat, "LOWERING_SEMANTICS",
                      getattr(plgpu.LoweringSemantics, request.param))
  return request.param
