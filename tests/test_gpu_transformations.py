"""tests/test_transformations.py's matrix compiled on a GPU (`pytest -m gpu`).

Both kernel families, the Triton kernels (sm80+) and the Mosaic kernels
(sm90), in bfloat16 at small model sizes, under `jit` of `grad`, `vmap` and
`vmap` of `grad`, `lax.scan` over layers with `jax.checkpoint` policies,
grad of grad and Hessian-vector products, `eval_shape`, Flax's drop-in modules in `nn.scan` of `nn.remat` and
`nnx.scan`, `jax.shard_map` with `check_vma` True and False (data parallel;
`ring_attention` on a data x sequence mesh), `sequence_parallel_attention`
and `pmap`. Errors obey DESIGN's rule: at most twice those of the same
transformed computation done naively in bfloat16, both against it in
float32 (Flax's own modules for the Flax rows). Under `shard_map` the
results with `check_vma=True` equal those with `check_vma=False` bitwise.
Meshes take up to 2 GPUs; one is enough to type values as varying.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jax_flash.reference import naive_attention
from jax_flash.sharding import sequence_parallel_attention
from pallas_kernels import compat
from tests import test_transformations as matrix
from tests.attention_checks import Case, assert_within_rule

pytestmark = pytest.mark.gpu

DTYPE = jnp.bfloat16
CASES = [Case(2, 512, 512, 8, 2, 64), Case(2, 1024, 1024, 4, 4, 128)]
CASE = CASES[0]
FEATURES = 256  # the Flax layers' model width
ATTENTION_NAMES = ("out", "lse", "dq", "dk", "dv")


@pytest.fixture(params=["triton", "mosaic"])
def implementation(request):
  if request.param == "mosaic" and (
      compat.gpu_compute_capability() or (0, 0))[0] != 9:
    pytest.skip("the Mosaic kernels need an sm90 GPU")
  return request.param


def naive(compute_dtype):
  """Causal `(q, k, v) -> (out, lse)`, plain jnp in `compute_dtype`."""
  return functools.partial(naive_attention, is_causal=True,
                           compute_dtype=compute_dtype)


def upcast(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def assert_rule(ours, exact, lowp, names) -> None:
  """DESIGN's rule on every leaf; `names` name them ("lse" has its eps)."""
  ours, exact, lowp = map(jax.tree.leaves, (ours, exact, lowp))
  assert len(ours) == len(exact) == len(lowp) == len(names)
  for name, o, e, n in zip(names, ours, exact, lowp):
    assert_within_rule(name, o, e, n)


def assert_attention_rule(ours, inputs) -> None:
  """`forward_and_grad` results `ours` against the naive computations."""
  run = lambda attend, args: jax.jit(functools.partial(
      matrix.forward_and_grad, attend))(*args)
  assert_rule(ours, run(naive(jnp.float32), upcast(inputs)),
              run(naive(DTYPE), inputs), ATTENTION_NAMES)


def num_devices() -> int:
  return min(2, jax.device_count())


@pytest.mark.parametrize("case", CASES, ids=str)
def test_jit_of_grad_on_gpu(implementation, case):
  inputs = matrix.random_inputs(case, dtype=DTYPE)
  ours = jax.jit(functools.partial(matrix.forward_and_grad,
                                   matrix.attention(implementation)))(*inputs)
  assert_attention_rule(ours, inputs)


def test_vmap_and_vmap_of_grad_on_gpu(implementation):
  q, k, v, d_out, _ = matrix.random_inputs(CASE, 1, lead=(2,), dtype=DTYPE)
  run = lambda attend, *args: jax.jit(matrix.vmapped(attend))(*args)
  assert_rule(run(matrix.attention(implementation), q, k, v, d_out),
              run(naive(jnp.float32), *upcast((q, k, v, d_out))),
              run(naive(DTYPE), q, k, v, d_out), ATTENTION_NAMES)


@pytest.mark.parametrize("policy", list(matrix.POLICIES), ids=str)
def test_scan_over_layers_with_checkpoint_on_gpu(implementation, policy):
  h, _, _, d_h, _ = matrix.random_inputs(CASE, 2, dtype=DTYPE)
  _, ks, vs, _, d_lse = matrix.random_inputs(CASE, 3, lead=(matrix.LAYERS,),
                                             dtype=DTYPE)

  def run(attend, h, ks, vs, d_h):
    return jax.jit(matrix.scanned_layers(attend, policy, d_h, d_lse))(h, ks,
                                                                      vs)
  assert_rule(run(matrix.attention(implementation), h, ks, vs, d_h),
              run(naive(jnp.float32), *upcast((h, ks, vs, d_h))),
              run(naive(DTYPE), h, ks, vs, d_h),
              ("h", "lse", "dh", "dk", "dv"))


def test_grad_of_grad_and_hessian_vector_product_on_gpu(implementation):
  """`matrix.second_order` (grad of a loss of the gradients, and a
  Hessian-vector product) through the kernels, whose gradients' own
  derivatives are XLA's (`jax_flash.higher_order`)."""
  inputs = matrix.random_inputs(CASE, 4, dtype=DTYPE)
  weights = matrix.random_inputs(CASE, 5, dtype=DTYPE)[:3]
  tangents = matrix.random_inputs(CASE, 6, dtype=DTYPE)[:3]

  def run(attend, args):
    return jax.jit(lambda *a: matrix.second_order(attend, a[:5], a[5:8],
                                                  a[8:]))(*args)
  args = (*inputs, *weights, *tangents)
  assert_rule(run(matrix.attention(implementation), args),
              run(naive(jnp.float32), upcast(args)), run(naive(DTYPE), args),
              ("dq", "dk", "dv") * 2)


def test_eval_shape_on_gpu(implementation):
  shapes = lambda attend: jax.eval_shape(
      functools.partial(matrix.forward_and_grad, attend),
      *matrix.random_inputs(CASE, dtype=DTYPE))
  assert shapes(matrix.attention(implementation)) == shapes(
      matrix.attention("reference"))


@matrix.NO_FALLBACK
def test_linen_module_in_scan_of_remat_on_gpu(implementation):
  x, d_y = matrix.flax_inputs(CASE, FEATURES, 4)
  params = matrix.linen_stack(None, CASE).init(jax.random.key(0), x, None)
  run = lambda impl, dtype: jax.jit(matrix.linen_vjp(impl, CASE, d_y, dtype))(
      params, x)
  ours = run(implementation, DTYPE)
  assert_rule(ours, run(None, jnp.float32), run(None, DTYPE),
              ["flax"] * len(jax.tree.leaves(ours)))


@matrix.NO_FALLBACK
def test_nnx_module_in_scan_on_gpu(implementation):
  x, d_y = matrix.flax_inputs(CASE, FEATURES, 6)
  params = nnx.state(matrix.nnx_layers(None, CASE, FEATURES), nnx.Param)
  run = lambda impl, dtype: jax.jit(matrix.nnx_vjp(
      impl, CASE, FEATURES, d_y, dtype))(params, x)
  ours = run(implementation, DTYPE)
  assert_rule(ours, run(None, jnp.float32), run(None, DTYPE),
              ["flax"] * len(jax.tree.leaves(ours)))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_shard_map_data_parallel_on_gpu(implementation, case):
  inputs = matrix.random_inputs(case, dtype=DTYPE)
  run = lambda check_vma: matrix.data_parallel(
      matrix.attention(implementation), inputs,
      jax.devices()[:num_devices()], check_vma)
  checked = run(True)
  matrix.assert_bitwise(checked, run(False))
  assert_attention_rule(checked, inputs)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_shard_map_ring_on_gpu(implementation, case):
  inputs = matrix.random_inputs(case, dtype=DTYPE)
  devices = [jax.devices()[:num_devices()]]  # [dp 1, sp]
  run = lambda check_vma: matrix.ring(implementation, inputs, devices,
                                      check_vma)
  checked = run(True)
  matrix.assert_bitwise(checked, run(False))
  assert_attention_rule(checked, inputs)


def test_sequence_parallel_attention_on_gpu(implementation):
  inputs = matrix.random_inputs(CASE, dtype=DTYPE)
  mesh = Mesh(np.array(jax.devices()[:num_devices()]), ("sp",))
  attend = functools.partial(sequence_parallel_attention, mesh=mesh,
                             axis_name="sp", is_causal=True,
                             return_residual=True,
                             implementation=implementation)
  ours = jax.jit(functools.partial(matrix.forward_and_grad, attend))(*inputs)
  assert_attention_rule(ours, inputs)


def test_pmap_on_gpu(implementation):
  inputs = matrix.random_inputs(CASE, dtype=DTYPE)
  ours = matrix.pmapped(matrix.attention(implementation), inputs,
                        num_devices())
  assert_attention_rule(ours, inputs)
