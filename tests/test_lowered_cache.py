"""The disk cache of lowered Mosaic kernels (`pallas_kernels.mosaic.
lowered_cache`): cross-lowered for CUDA on any machine, run on a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.config import BlockSizes

pytest.importorskip("flatbuffers", reason="jax.export's serialisation")


def _fwd_bwd(head_dim: int, **options):
  """Causal fwd + VJP through `mosaic_attention`: (out, (dq, dk, dv))."""
  from pallas_kernels.mosaic import mosaic_attention

  def call(q, k, v, d_out):
    out, vjp = jax.vjp(lambda q, k, v: mosaic_attention(
        q, k, v, scale=head_dim**-0.5, is_causal=True,
        backward_blocks=BlockSizes.get_default(head_dim, "NVIDIA H200"),
        **options)[0], q, k, v)
    return out, vjp(d_out)

  return call


@pytest.fixture
def cache(cuda_lowering, tmp_path, monkeypatch):
  """The cache on, in a fresh directory, as on a GPU; its counters reset."""
  del cuda_lowering  # requested for its skip
  from pallas_kernels.mosaic import lowered_cache
  monkeypatch.setattr(lowered_cache, "_on_gpu", lambda: True)
  monkeypatch.setenv("JAX_FLASH_KERNEL_CACHE", "1")
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  monkeypatch.setattr(lowered_cache, "stats", {"hits": 0, "misses": 0})
  yield lowered_cache
  jax.config.update("jax_compilation_cache_dir", None)


def _lower(fn, shape=(1, 256, 2, 64)):
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  return jax.jit(fn).trace(x, x, x, x).lower(
      lowering_platforms=("cuda",)).as_text()


def test_second_lowering_reads_the_kernels_and_lowers_the_same(cache):
  """The first lowering exports the three kernels (forward, dK/dV, dQ),
  which are the plain lowering's kernels; a second lowering reads them and
  lowers to the same text as the first (so JAX's compilation cache finds
  its compiled form) without lowering a kernel."""
  from benchmarks.lower_mosaic import kernels_lowered
  with kernels_lowered() as exported:
    first = _lower(_fwd_bwd(64))
  assert cache.stats == {"hits": 0, "misses": 3}
  assert len(list(cache.cache_directory().glob("*.bin"))) == 3
  jax.clear_caches()
  with kernels_lowered() as lowered_again:
    second = _lower(_fwd_bwd(64))
  assert cache.stats == {"hits": 3, "misses": 3}
  assert second == first and not lowered_again
  jax.config.update("jax_compilation_cache_dir", None)
  jax.clear_caches()
  with kernels_lowered() as plain:
    _lower(_fwd_bwd(64))
  assert cache.stats["hits"] == 3
  assert len(plain) == 3 and sorted(exported) == sorted(plain)


def test_a_changed_shape_or_option_is_another_kernel(cache):
  _lower(_fwd_bwd(64))
  jax.clear_caches()
  _lower(_fwd_bwd(64), shape=(1, 384, 2, 64))
  assert cache.stats == {"hits": 0, "misses": 6}
  jax.clear_caches()
  _lower(_fwd_bwd(64))
  assert cache.stats == {"hits": 3, "misses": 6}


def test_damaged_file_is_exported_anew(cache):
  _lower(_fwd_bwd(64))
  for path in cache.cache_directory().glob("*.bin"):
    path.write_bytes(b"not a module")
  jax.clear_caches()
  _lower(_fwd_bwd(64))
  assert cache.stats == {"hits": 0, "misses": 6}


def test_off_without_a_cache_dir_or_when_turned_off(cache, monkeypatch):
  monkeypatch.setenv("JAX_FLASH_KERNEL_CACHE", "0")
  _lower(_fwd_bwd(64))
  monkeypatch.setenv("JAX_FLASH_KERNEL_CACHE", "1")
  jax.config.update("jax_compilation_cache_dir", None)
  jax.clear_caches()
  _lower(_fwd_bwd(64))
  assert cache.stats == {"hits": 0, "misses": 0}


def test_launches_keyed_by_address_or_under_vmap_are_not_cached(cache):
  """A `score_fn` in the static arguments (its repr names an address), and
  a launch traced under `vmap`, run the plain launch."""
  from pallas_kernels.mosaic import mosaic_forward_masked
  from pallas_kernels import masking
  spec = masking.MaskSpec(q_len=256, kv_len=256, is_causal=True,
                          score_fn=lambda s, b, h, q, k: s * 0.5)
  x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  jax.jit(lambda q, k, v: mosaic_forward_masked(
      q, k, v, scale=0.125, spec=spec)).trace(x, x, x).lower(
          lowering_platforms=("cuda",))
  from pallas_kernels.mosaic import mosaic_forward
  batched = jax.ShapeDtypeStruct((3, 1, 256, 2, 64), jnp.bfloat16)
  jax.jit(jax.vmap(lambda q, k, v: mosaic_forward(
      q, k, v, scale=0.125, is_causal=True)[0])).trace(
          batched, batched, batched).lower(lowering_platforms=("cuda",))
  assert cache.stats == {"hits": 0, "misses": 0}


@pytest.mark.gpu
def test_cached_kernels_give_the_same_bits_on_gpu(tmp_path, monkeypatch):
  """On a GPU: outputs and gradients of the plain launch, of the launch
  that exports the kernels and of the one that reads them, bitwise equal."""
  from pallas_kernels.mosaic import lowered_cache
  monkeypatch.setattr(lowered_cache, "stats", {"hits": 0, "misses": 0})
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, d_out = (jax.random.normal(key, (2, 1024, 4, 128), jnp.bfloat16)
                    for key in keys)
  results = []
  # The directory given directly: JAX's own compilation cache stays as the
  # test process set it.
  for directory in (None, tmp_path, tmp_path):
    monkeypatch.setattr(lowered_cache, "cache_directory",
                        lambda directory=directory: directory)
    jax.clear_caches()
    results.append(jax.jit(_fwd_bwd(128))(q, k, v, d_out))
  assert lowered_cache.stats == {"hits": 3, "misses": 3}
  for got in results[1:]:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(results[0])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
