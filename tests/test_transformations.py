"""Attention under the transformations users write, against the reference.

Forward and gradients of causal `flash_attention`, the Triton kernels in
interpret mode and XLA, under `jit` of `grad`, `vmap` and `vmap` of `grad`,
`lax.scan` over layers with `vjp`, `jax.checkpoint` with two policies,
second order (grad of a loss of the gradients, and Hessian-vector products,
with masks, a bias and sinks) and `eval_shape`; and Flax's drop-in modules inside `nn.scan` of `nn.remat` and
`nnx.scan`. Inputs and cotangents are random; the oracle is
`jax_flash.attention_reference` (Flax's own modules for the Flax rows).

The rows that need several devices are `CHECKS`, run by
`tests/sharding_worker.py` in a child process with 8 CPU devices (as
tests/test_sharding.py's): `jax.shard_map` with `check_vma` True and False,
the gradient taken inside (data parallel over the batch; `ring_attention` on
a data x sequence mesh, and its second order), and `pmap`. Under `shard_map` the results with
`check_vma=True` must equal those with `check_vma=False` bitwise.
`sequence_parallel_attention`, whose own `shard_map` checks types, is
differentiated with the Triton kernels in tests/sharding_worker.py
(`ring-p4-causal-zigzag-triton`, `all_gather-p4-full-triton`).

The shapes are awkward on purpose: 28 tokens (not a multiple of a tile;
zig-zag chunks of 7 on 2 devices), head dim 24 (padded to 32 in the
kernels), 4 query heads on 2 K/V heads. The helpers take the sizes, so that
tests/test_gpu_transformations.py runs the same rows compiled.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec

import flax_layers.linen
import flax_layers.nnx
import jax_flash
from flax_layers import flash_attention_fn
from jax_flash.sharding import ring_attention, zigzag_indices
from tests import sharding_worker
from tests.attention_checks import Case

# Its module-scoped fixtures (a child process, a trained model) are built
# once: every test of the file runs in one xdist worker (pyproject).
pytestmark = pytest.mark.xdist_group("test_transformations")

IMPLEMENTATIONS = ("triton", "xla")
CASE = Case(batch=2, q_len=28, kv_len=28, num_heads=4, num_kv_heads=2,
            head_dim=24)
FEATURES = 32  # the Flax layers' model width
LAYERS = 2
TOL = 2e-5  # float32, relative to the reference's largest magnitude
NUM_WORKERS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def random_inputs(case: Case, seed: int = 0, lead=(), dtype=jnp.float32):
  """(q, k, v, d_out, d_lse) with leading axes `lead` (vmap, layers);
  d_lse float32."""
  keys = jax.random.split(jax.random.key(seed), 5)
  rows = (*lead, case.batch, case.q_len)
  kv_rows = (*lead, case.batch, case.kv_len)
  q = jax.random.normal(keys[0], (*rows, case.num_heads, case.head_dim),
                        dtype)
  k = jax.random.normal(keys[1], (*kv_rows, case.num_kv_heads,
                                  case.head_dim), dtype)
  v = jax.random.normal(keys[2], k.shape, dtype)
  d_out = jax.random.normal(keys[3], q.shape, dtype)
  d_lse = jax.random.normal(keys[4], (*rows, case.num_heads), jnp.float32)
  return q, k, v, d_out, d_lse


def attention(implementation: str):
  """Causal `(q, k, v) -> (out, lse)`; "reference" is the oracle."""
  if implementation == "reference":
    return functools.partial(jax_flash.attention_reference, is_causal=True,
                             return_residual=True)
  return functools.partial(jax_flash.flash_attention, is_causal=True,
                           return_residual=True,
                           implementation=implementation)


def forward_and_grad(attend, q, k, v, d_out, d_lse):
  """(out, lse, dq, dk, dv): `attend`'s results and, by `jax.grad`, the
  gradients at cotangents (d_out, d_lse)."""
  def loss(q, k, v):
    out, lse = attend(q, k, v)
    return jnp.sum(out * d_out) + jnp.sum(lse * d_lse), (out, lse)

  grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k,
                                                                      v)
  return (out, lse, *grads)


def grad_of_output(attend):
  """dq, dk, dv of <out, d_out> by `jax.grad` (a zero lse cotangent)."""
  def loss(q, k, v, d_out):
    return jnp.sum(attend(q, k, v)[0] * d_out)
  return jax.grad(loss, argnums=(0, 1, 2))


def vmapped(attend):
  """(q, k, v, d_out) -> vmap of the forward and vmap of `grad_of_output`
  over a leading axis."""
  def run(q, k, v, d_out):
    forward = jax.vmap(attend)(q, k, v)
    return forward, jax.vmap(grad_of_output(attend))(q, k, v, d_out)
  return run


POLICIES = {
    None: None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "save_attention_out": jax.checkpoint_policies.save_only_these_names(
        "attention_out"),
}


def scanned_layers(attend, policy, d_h, d_lse):
  """`lax.scan` of residual attention layers, each (optionally) under
  `jax.checkpoint(policy=POLICIES[policy])`, and its `vjp`:
  (h, ks, vs) -> ((h, per-layer lse), (dh, dks, dvs))."""
  def layer(h, kv):
    out, lse = attend(h, *kv)
    return h + checkpoint_name(out, "attention_out"), lse

  if policy is not None:
    layer = jax.checkpoint(layer, policy=POLICIES[policy])

  def run(h, ks, vs):
    outs, vjp = jax.vjp(lambda *a: lax.scan(layer, a[0], a[1:]), h, ks, vs)
    return outs, vjp((d_h, d_lse))
  return run


def assert_close(got, want) -> dict:
  """Every leaf of `got` within TOL of `want`'s; returns the errors."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want)
  errors = {}
  for i, (g, w) in enumerate(zip(got, want)):
    g, w = np.asarray(g), np.asarray(w)
    assert (g.shape, g.dtype) == (w.shape, w.dtype), (i, g.shape, w.shape)
    errors[i] = float(np.max(np.abs(g - w)))
    assert errors[i] <= TOL * max(1.0, float(np.max(np.abs(w)))), (
        i, errors[i])
  return errors


def assert_bitwise(a, b) -> None:
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@functools.cache
def reference_results():
  return jax.jit(functools.partial(forward_and_grad, attention("reference")))(
      *random_inputs(CASE))


def first_order_loss(attend, d_out, d_lse, weights):
  """(q, k, v, extras) -> the first-order gradients' inner product with
  `weights` (a gradient penalty; MAML's inner step differentiated again):
  `attend(q, k, v, extras)` -> (out, lse) at cotangents (d_out, d_lse)."""
  def loss(*args):  # its cotangents depend on the output: a real Hessian
    out, lse = attend(*args)
    return (jnp.sum(out * d_out) + jnp.sum(lse * d_lse)
            + 0.5 * jnp.sum(jnp.square(out.astype(jnp.float32))))

  def penalty(*args):
    grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    return sum(jnp.sum(g * w) for g, w in zip(jax.tree.leaves(grads),
                                              jax.tree.leaves(weights)))
  return loss, penalty


SEGMENTS = jnp.asarray(np.repeat([[0, 1, 2]], CASE.batch, 0).repeat(
    [9, 12, 7], axis=1), jnp.int32)


def masked_attention(implementation: str):
  """`(q, k, v, (bias, sinks)) -> (out, lse)` under packed documents, a
  window and a soft cap, with a differentiable bias and sinks."""
  attend = (jax_flash.attention_reference if implementation == "reference"
            else functools.partial(jax_flash.flash_attention,
                                   implementation=implementation))

  def run(q, k, v, extras):
    bias, sinks = extras
    return attend(q, k, v, bias, is_causal=True, segment_ids=SEGMENTS,
                  local_window_size=(9, 0), logits_soft_cap=5.0, sinks=sinks,
                  return_residual=True)
  return run


def second_order_inputs(seed: int):
  """(args, d_out, d_lse, weights, tangents) of `first_order_loss` for
  `masked_attention`: args (q, k, v, (bias, sinks)); weights and tangents
  random, shaped as args."""
  q, k, v, d_out, d_lse = random_inputs(CASE, seed)
  keys = jax.random.split(jax.random.key(seed + 100), 4)
  bias = jax.random.normal(keys[0], (1, CASE.num_heads, CASE.q_len,
                                     CASE.kv_len))
  sinks = jax.random.normal(keys[1], (CASE.num_heads,))
  args = (q, k, v, (bias, sinks))
  leaves, tree = jax.tree.flatten(args)
  random_like = lambda key: jax.tree.unflatten(tree, [
      jax.random.normal(sub, x.shape, x.dtype)
      for sub, x in zip(jax.random.split(key, len(leaves)), leaves)])
  return args, d_out, d_lse, random_like(keys[2]), random_like(keys[3])


# ---------------------------------------------------------------------------
# One device.


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jit_of_grad(implementation):
  run = jax.jit(functools.partial(forward_and_grad,
                                  attention(implementation)))
  assert_close(run(*random_inputs(CASE)), reference_results())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_and_vmap_of_grad(implementation):
  q, k, v, d_out, _ = random_inputs(CASE, 1, lead=(2,))
  got = jax.jit(vmapped(attention(implementation)))(q, k, v, d_out)
  want = jax.jit(vmapped(attention("reference")))(q, k, v, d_out)
  assert_close(got, want)


@pytest.mark.parametrize("policy", list(POLICIES), ids=str)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_scan_over_layers_with_checkpoint(implementation, policy):
  h, _, _, d_h, _ = random_inputs(CASE, 2)
  _, ks, vs, _, d_lse = random_inputs(CASE, 3, lead=(LAYERS,))
  run = lambda impl: jax.jit(scanned_layers(attention(impl), policy, d_h,
                                            d_lse))(h, ks, vs)
  assert_close(run(implementation), run("reference"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_grad_of_grad_and_hessian_vector_product(implementation):
  """Second-order derivatives through the kernels (`jax_flash.
  higher_order`: the kernels' gradients, their own derivatives XLA's) of
  every differentiable input, masks on: `jax.grad` of a loss of the
  gradients, and a Hessian-vector product (`jax.jvp` of `jax.grad`)."""
  args, d_out, d_lse, weights, tangents = second_order_inputs(4)

  def run(impl):
    loss, penalty = first_order_loss(masked_attention(impl), d_out, d_lse,
                                     weights)
    grad_loss = jax.grad(loss, argnums=(0, 1, 2, 3))
    hvp = jax.jvp(lambda *a: grad_loss(*a), args, tangents)[1]
    return jax.grad(penalty, argnums=(0, 1, 2, 3))(*args), hvp

  assert_close(jax.jit(lambda: run(implementation))(),
               jax.jit(lambda: run("reference"))())


def test_forward_mode_of_the_kernels_names_the_way_out():
  """`jax.jvp` of the attention itself cannot run the kernels (a custom VJP
  is reverse mode only): the error says so and names XLA, which runs it."""
  q, k, v, _, _ = random_inputs(CASE)
  jvp = lambda impl: jax.jvp(lambda q: attention(impl)(q, k, v)[0], (q,),
                             (v[:, :, :1].repeat(CASE.num_heads, 2),))
  with pytest.raises(TypeError, match="implementation='xla'"):
    jvp("triton")
  assert jvp("xla")[1].shape == q.shape


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_eval_shape(implementation):
  shapes = lambda impl: jax.eval_shape(
      functools.partial(forward_and_grad, attention(impl)),
      *random_inputs(CASE))
  assert shapes(implementation) == shapes("reference")


# ---------------------------------------------------------------------------
# Flax: the drop-in modules against Flax's own, with the same parameters.
# A call that fell back to Flax's attention would warn; here it fails.

NO_FALLBACK = pytest.mark.filterwarnings(
    "error::flax_layers.FlashFallbackWarning")


def flash_fn(implementation):
  return functools.partial(flash_attention_fn, implementation=implementation)


class LinenLayer(linen.Module):
  """A residual causal attention layer: Flax's module when `implementation`
  is None, else the drop-in on that implementation."""

  implementation: str | None
  num_heads: int
  head_dim: int
  dtype: jnp.dtype = jnp.float32

  @linen.compact
  def __call__(self, x, _):
    kwargs = dict(num_heads=self.num_heads,
                  qkv_features=self.num_heads * self.head_dim,
                  dtype=self.dtype, deterministic=True)
    if self.implementation is None:
      y = linen.MultiHeadDotProductAttention(**kwargs)(
          x, mask=linen.make_causal_mask(x[..., 0]))
    else:
      y = flax_layers.linen.MultiHeadDotProductAttention(
          attention_fn=flash_fn(self.implementation), **kwargs)(
              x, is_causal=True)
    return x + y.astype(x.dtype), None


def linen_stack(implementation, case: Case, dtype=jnp.float32):
  """`nn.scan` over LAYERS `nn.remat`-ed `LinenLayer`s."""
  return linen.scan(linen.remat(LinenLayer), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=LAYERS)(
                        implementation, case.num_heads, case.head_dim, dtype)


def linen_vjp(implementation, case: Case, d_y, dtype=jnp.float32):
  """(params, x) -> (y, (dparams, dx)) of `linen_stack`."""
  def run(params, x):
    apply = lambda p, x: linen_stack(implementation, case, dtype).apply(
        p, x, None)[0]
    y, vjp = jax.vjp(apply, params, x)
    return y, vjp(d_y)
  return run


def nnx_layers(implementation, case: Case, features: int,
               dtype=jnp.float32):
  """LAYERS stacked (nnx.vmap) attention modules with GQA: Flax's when
  `implementation` is None, else the drop-in on that implementation."""
  @nnx.split_rngs(splits=LAYERS)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    kwargs = dict(num_heads=case.num_heads, in_features=features,
                  qkv_features=case.num_heads * case.head_dim,
                  num_kv_heads=case.num_kv_heads, dtype=dtype, decode=False,
                  rngs=rngs)
    if implementation is None:
      return nnx.MultiHeadAttention(**kwargs)
    return flax_layers.nnx.MultiHeadAttention(
        attention_fn=flash_fn(implementation), **kwargs)
  return create(nnx.Rngs(5))


def nnx_vjp(implementation, case: Case, features: int, d_y,
            dtype=jnp.float32):
  """(params, x) -> (y, (dparams, dx)) of `nnx.scan` of residual layers
  over `nnx_layers`."""
  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def forward(layer, x):
    if implementation is None:
      y = layer(x, mask=nnx.make_causal_mask(x[..., 0]))
    else:
      y = layer(x, is_causal=True)
    return x + y.astype(x.dtype)

  def run(params, x):
    graph, _, rest = nnx.split(
        nnx_layers(implementation, case, features, dtype), nnx.Param, ...)
    apply = lambda params, x: forward(nnx.merge(graph, params, rest), x)
    y, vjp = jax.vjp(apply, params, x)
    return y, vjp(d_y)
  return run


def flax_inputs(case: Case, features: int, seed: int):
  """x and a random cotangent d_y, [batch, q_len, features] float32."""
  keys = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(keys[0], (case.batch, case.q_len, features))
  return x, jax.random.normal(keys[1], x.shape)


@NO_FALLBACK
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linen_module_in_scan_of_remat(implementation):
  x, d_y = flax_inputs(CASE, FEATURES, 4)
  params = linen_stack(None, CASE).init(jax.random.key(0), x, None)
  run = lambda impl: jax.jit(linen_vjp(impl, CASE, d_y))(params, x)
  assert_close(run(implementation), run(None))


@NO_FALLBACK
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nnx_module_in_scan(implementation):
  x, d_y = flax_inputs(CASE, FEATURES, 6)
  params = nnx.state(nnx_layers(None, CASE, FEATURES), nnx.Param)
  run = lambda impl: jax.jit(nnx_vjp(impl, CASE, FEATURES, d_y))(params, x)
  assert_close(run(implementation), run(None))


# ---------------------------------------------------------------------------
# Several devices: data parallel and sequence parallel under shard_map, and
# pmap. The runners take the devices, for the GPU file too.


def data_parallel(attend, inputs, devices, check_vma: bool):
  """`forward_and_grad` inside `shard_map` over the batch."""
  mesh = Mesh(np.array(devices), ("dp",))
  batch = PartitionSpec("dp")
  body = functools.partial(forward_and_grad, attend)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(batch,) * 5,
                               out_specs=(batch,) * 5,
                               check_vma=check_vma))(*inputs)


def ring(implementation, inputs, devices, check_vma: bool):
  """`forward_and_grad` of load-balanced causal `ring_attention` inside
  `shard_map` over a (data, sequence) mesh `devices` [dp, sp], the zig-zag
  layout laid out by the caller; results in natural order."""
  mesh = Mesh(np.array(devices), ("dp", "sp"))
  spec = PartitionSpec("dp", "sp")
  order = zigzag_indices(inputs[0].shape[1], mesh.shape["sp"])
  attend = functools.partial(ring_attention, axis_name="sp", is_causal=True,
                             load_balance=True, return_residual=True,
                             implementation=implementation)
  sharded = jax.jit(jax.shard_map(
      functools.partial(forward_and_grad, attend), mesh=mesh,
      in_specs=(spec,) * 5, out_specs=(spec,) * 5, check_vma=check_vma))
  results = sharded(*(x[:, order] for x in inputs))
  inverse = jnp.argsort(order)
  return tuple(x[:, inverse] for x in results)


def pmapped(attend, inputs, num_devices: int):
  """`forward_and_grad` under `jax.pmap`, the batch split over devices."""
  split = lambda x: x.reshape(num_devices, -1, *x.shape[1:])
  merge = lambda x: x.reshape(-1, *x.shape[2:])
  run = jax.pmap(functools.partial(forward_and_grad, attend),
                 devices=jax.devices()[:num_devices])
  return tuple(map(merge, run(*map(split, inputs))))


def _data_parallel_check(implementation):
  run = lambda check_vma: data_parallel(
      attention(implementation), random_inputs(CASE), jax.devices()[:2],
      check_vma)
  checked = run(True)
  assert_bitwise(checked, run(False))
  return assert_close(checked, reference_results())


def _ring_check(implementation):
  devices = np.array(jax.devices()[:4]).reshape(2, 2)
  run = lambda check_vma: ring(implementation, random_inputs(CASE), devices,
                               check_vma)
  checked = run(True)
  assert_bitwise(checked, run(False))
  return assert_close(checked, reference_results())


def second_order(attend, inputs, weights, tangents):
  """(grad of `first_order_loss`'s penalty, a Hessian-vector product) of
  `attend(q, k, v) -> (out, lse)`: inputs (q, k, v, d_out, d_lse), weights
  and tangents shaped as (q, k, v)."""
  q, k, v, d_out, d_lse = inputs
  loss, penalty = first_order_loss(attend, d_out, d_lse, weights)
  grad_loss = jax.grad(loss, argnums=(0, 1, 2))
  hvp = jax.jvp(grad_loss, (q, k, v), tangents)[1]
  return (*jax.grad(penalty, argnums=(0, 1, 2))(q, k, v), *hvp)


def _ring_second_order_check(implementation):
  """`second_order` of load-balanced causal `ring_attention` inside
  `shard_map` on a (data, sequence) mesh of 2 x 2 against the reference's
  on one device (the kernels' gradients, their derivatives by the ring's
  sweeps on XLA)."""
  inputs = random_inputs(CASE, 7)
  _, _, _, weights, tangents = second_order_inputs(8)
  weights, tangents = weights[:3], tangents[:3]
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "sp"))
  spec = PartitionSpec("dp", "sp")
  order = zigzag_indices(CASE.q_len, mesh.shape["sp"])
  attend = functools.partial(ring_attention, axis_name="sp", is_causal=True,
                             load_balance=True, return_residual=True,
                             implementation=implementation)

  def body(q, k, v, d_out, d_lse, w_q, w_k, w_v, t_q, t_k, t_v):
    return second_order(attend, (q, k, v, d_out, d_lse), (w_q, w_k, w_v),
                        (t_q, t_k, t_v))

  sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 11,
                                  out_specs=(spec,) * 6))
  got = sharded(*(x[:, order] for x in (*inputs, *weights, *tangents)))
  got = tuple(x[:, jnp.argsort(order)] for x in got)
  want = jax.jit(lambda: second_order(attention("reference"), inputs,
                                      weights, tangents))()
  return assert_close(got, want)


def _builtin_forms_check(implementation):
  """A causal window as `mask_fn` and ALiBi as `score_fn`, which the
  kernels run as the built-ins (`jax_flash.builtin_forms`: slopes and the
  LSE's row terms computed inside the body), data parallel under
  `shard_map` with `check_vma` True and False."""
  def alibi(s, b, h, q, k):
    del b
    return s - jnp.exp2(-(h + 1.0)) * jnp.abs(q - k).astype(jnp.float32)
  variants = dict(score_fn=alibi, mask_fn=lambda b, h, q, k: q - k < 9)
  run = lambda check_vma: data_parallel(
      functools.partial(attention(implementation), **variants),
      random_inputs(CASE), jax.devices()[:2], check_vma)
  checked = run(True)
  assert_bitwise(checked, run(False))
  want = jax.jit(functools.partial(forward_and_grad, functools.partial(
      attention("reference"), **variants)))(*random_inputs(CASE))
  return assert_close(checked, want)


def _pmap_check(implementation):
  got = pmapped(attention(implementation), random_inputs(CASE), 2)
  return assert_close(got, reference_results())


CHECKS = {
    f"{name}-{implementation}": functools.partial(check, implementation)
    for implementation in IMPLEMENTATIONS
    for name, check in (("shard_map-data_parallel", _data_parallel_check),
                        ("shard_map-ring", _ring_check),
                        ("shard_map-ring-second_order",
                         _ring_second_order_check),
                        ("shard_map-builtin_forms", _builtin_forms_check),
                        ("pmap", _pmap_check))}


@pytest.fixture(scope="module")
def multi_device_results():
  return sharding_worker.run_in_subprocesses(
      list(CHECKS), module=__name__, num_workers=NUM_WORKERS)


@pytest.mark.parametrize("name", list(CHECKS))
def test_multi_device(name, multi_device_results):
  results, worker_errors = multi_device_results
  if name not in results:
    pytest.fail(f"the worker did not report {name!r}:\n{worker_errors}")
  assert results[name]["status"] == "ok", results[name]["detail"]
