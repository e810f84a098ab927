"""`row_delta`: the backward's delta = rowsum(dO ∘ O), as a Pallas kernel.

Against the plain float32 product and sum, interpreted on a CPU (awkward
lengths and head dims, every dtype; inside `shard_map` with either
`check_vma`), cross-lowered for CUDA with the MLIR verifier, and compiled on
a GPU (`-m gpu`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import jax_flash  # noqa: F401  (imports pallas_kernels in the right order)
from pallas_kernels import compat
from pallas_kernels.triton.delta import row_delta
from tests.test_lowering import verified_triton_modules  # noqa: F401


def _operands(shape, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed))
  return tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype)
               for k in keys)


def _want(out, d_out):
  return np.swapaxes(np.sum(np.asarray(out, np.float32)
                            * np.asarray(d_out, np.float32), axis=-1), 1, 2)


# Lengths under, at and past a block (128 rows at head_dim 64, 32 at 256),
# head dims padded in the kernel (40, 96), one row.
SHAPES = [(2, 97, 3, 40), (1, 1, 2, 64), (2, 257, 4, 256), (1, 300, 2, 96),
          (3, 128, 1, 64)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_row_delta_is_the_float32_row_sum(shape, dtype):
  out, d_out = _operands(shape, dtype)
  got = row_delta(out, d_out, interpret=True)
  assert got.shape == (shape[0], shape[2], shape[1])
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), _want(out, d_out), rtol=1e-6,
                             atol=1e-5)


def test_row_delta_inside_shard_map():
  """Its output declares how it varies (check_vma=True), at a length and
  head dim that leave partial tiles; the same bits as unchecked."""
  out, d_out = _operands(SHAPES[0], jnp.float32)
  mesh = Mesh(np.array(jax.devices()[:1]), ("b",))
  spec = PartitionSpec("b")
  run = lambda check_vma: jax.jit(jax.shard_map(
      functools.partial(row_delta, interpret=True), mesh=mesh,
      in_specs=(spec, spec), out_specs=spec, check_vma=check_vma))(out,
                                                                   d_out)
  checked = run(True)
  np.testing.assert_array_equal(checked, run(False))
  np.testing.assert_allclose(np.asarray(checked), _want(out, d_out),
                             rtol=1e-6, atol=1e-5)


def test_row_delta_names_mismatched_shapes():
  with pytest.raises(ValueError, match="out and d_out"):
    row_delta(jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 8, 2, 32)),
              interpret=True)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_row_delta_lowers_for_cuda(shape, verified_triton_modules):
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  text = jax.jit(lambda o, do: row_delta(o, do)).trace(x, x).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "flash_backward_delta" in text
  assert verified_triton_modules


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(16, 1024, 16, 128)], ids=str)
def test_row_delta_matches_on_gpu(shape):
  if not compat.has_gpu():
    pytest.skip("needs a GPU")
  out, d_out = _operands(shape, jnp.bfloat16, seed=1)
  np.testing.assert_allclose(np.asarray(jax.jit(row_delta)(out, d_out)),
                             _want(out, d_out), rtol=1e-5, atol=1e-4)
