"""The attention suites compiled on a GPU at realistic sizes (`pytest -m gpu`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from tests.attention_checks import Case, check_against_reference, random_inputs

pytestmark = pytest.mark.gpu

GPU_CASES = [
    (Case(2, 1024, 1024, 16, 16, 128), jnp.bfloat16),
    (Case(1, 4096, 4096, 8, 2, 64), jnp.bfloat16),
    (Case(1, 2048, 2048, 4, 4, 256), jnp.bfloat16),
    (Case(1, 16384, 16384, 2, 1, 128), jnp.bfloat16),
    (Case(1, 1000, 1537, 8, 2, 96), jnp.float16),
    (Case(2, 1, 4096, 8, 1, 128), jnp.bfloat16),
    (Case(1, 777, 300, 4, 2, 40), jnp.float32),
    (Case(1, 2048, 2048, 4, 4, 256), jnp.float16),
]


def _compiled(is_causal):
  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, is_causal=is_causal,
                                     return_residual=True,
                                     implementation="triton")
  return attention


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case, dtype", GPU_CASES,
                         ids=[f"{c}-{jnp.dtype(d).name}" for c, d in GPU_CASES])
def test_matches_reference_on_gpu(case, dtype, is_causal):
  check_against_reference(_compiled(is_causal), case, dtype,
                          is_causal=is_causal, seed=1, f32_tol=1e-4)


def test_deterministic_on_gpu():
  q, k, v, d_out, _ = random_inputs(Case(2, 2048, 2048, 8, 2, 128),
                                    jnp.bfloat16, 3)

  @jax.jit
  def run(q, k, v):
    out, vjp = jax.vjp(lambda *a: jax_flash.flash_attention(
        *a, is_causal=True, implementation="triton"), q, k, v)
    return out, vjp(d_out)

  first = jax.tree.leaves(run(q, k, v))
  for _ in range(3):
    for a, b in zip(first, jax.tree.leaves(run(q, k, v))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_implementation_none_uses_kernels_on_gpu():
  q, k, v, _, _ = random_inputs(Case(1, 512, 512, 4, 4, 64), jnp.bfloat16, 0)
  text = jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v)).lower(
      q, k, v).as_text()
  assert "flash_forward" in text
