"""The dK/dV kernel with shared rows (`pipeline.BackwardStatic.shared_rows`).

Both consumers take the CTA's K/V rows; each computes Sᵀ and dPᵀ for half
of the step's Q rows and dK and dV for half of the head_dim columns, the
halves of Pᵀ and dSᵀ meeting in shared memory. At head_dim 256 that is one
dK/dV pass with two consumers, where two passes (dK, dV) with one would
run. Cross-lowered for CUDA on CPU; checked against the reference, the
launch grid and the two-pass kernels on a GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.attention_checks import Case, check_against_reference, random_inputs

try:
  from pallas_kernels.mosaic import backward
  from pallas_kernels.mosaic.forward import mosaic_forward
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

from tests.test_mosaic_backward import (_api_layout, _kernels, _require_sm90,
                                        _structs, backward_kernels,
                                        mosaic_attention_with)


def _lowered(head_dim, is_causal, **kwargs):
  args = _structs(head_dim=head_dim, q_len=512, kv_len=768)
  return jax.jit(lambda *a: backward.mosaic_backward(
      *a, scale=0.1, is_causal=is_causal, **kwargs)).trace(*args).lower(
          lowering_platforms=("cuda",))


@pytest.mark.parametrize("head_dim, is_causal, persistent", [
    (256, False, False), (256, True, True), (128, False, True)])
def test_shared_rows_lower_as_one_dkdv_pass(head_dim, is_causal, persistent,
                                            cuda_lowering):
  """One dK/dV kernel (at head_dim 256 instead of a dK and a dV pass), with
  two consumers on K/V tiles of block_kv rows, on either grid."""
  lowered = _lowered(head_dim, is_causal, shared_rows=True,
                     persistent=persistent)
  assert _kernels(lowered.as_text()) == {"dq", "dkdv"}
  assert [g.shape for g in lowered.out_info] == [
      s.shape for s in _structs(head_dim=head_dim, q_len=512,
                                kv_len=768)[:3]]
  if head_dim == 256:
    assert _kernels(_lowered(head_dim, is_causal,
                             shared_rows=False).as_text()) == {
                                 "dq", "dk", "dv"}
  q, kv = _structs(head_dim=head_dim)[:2]
  (static,) = backward.dkdv_statics(
      q, kv, scale=0.1, is_causal=is_causal, block_q=64, block_kv=64,
      max_concurrent_steps=2, shared_rows=True)
  assert static.num_consumers == 2 and static.kv_rows_per_cta == 64
  assert static.outputs == ("dk", "dv")


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=176), "swizzle"),          # 88 columns a consumer
    (dict(block_q=128), "shared memory"),     # 2 x 2 x 128 x 256 ring
    (dict(kv_len=804), "multiple of block_kv"),   # off the 8-row tiling
    (dict(spec=object()), "ranged"),
])
def test_shared_rows_refuse_what_they_do_not_cover(kwargs, match):
  """NotImplementedError, so that a dispatcher can fall back."""
  shape = dict(head_dim=256, q_len=512, kv_len=768)
  shape.update((name, kwargs.pop(name)) for name in list(kwargs)
               if name in shape)
  q, kv = _structs(**shape)[:2]
  tiles = dict(block_q=64, block_kv=64, max_concurrent_steps=2)
  tiles.update(kwargs)
  with pytest.raises(NotImplementedError, match=match):
    backward.dkdv_statics(q, kv, scale=0.1, is_causal=False,
                          shared_rows=True, **tiles)


def test_shared_rows_are_planned_at_d256_on_the_launch_grid():
  """The plan shares the rows at head_dim 256 where the launch grid runs
  (kv_len above 1024); up to 1024 the persistent grid keeps the two-pass
  kernels; other head dims never share."""
  def kernels(head_dim, seq):
    q, kv = _structs(head_dim=head_dim, q_len=seq, kv_len=seq)[:2]
    _, dkdv = backward.configure(q, kv, scale=0.1, is_causal=False)
    return [config.outputs for config in dkdv], [
        config.shared_rows for config in dkdv]
  assert kernels(256, 2048) == ([("dk", "dv")], [True])
  assert kernels(256, 1024) == ([("dk",), ("dv",)], [False, False])
  assert kernels(128, 2048) == ([("dk", "dv")], [False])


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", [
    Case(2, 1024, 1024, 8, 8, 256),
    Case(1, 512, 1024, 8, 2, 256),    # GQA 4:1, kv_len > q_len
    Case(1, 1024, 448, 4, 1, 256),    # MQA, q_len > kv_len, 7 K/V tiles
    Case(2, 512, 768, 8, 2, 128),
], ids=str)
def test_shared_rows_match_reference_on_gpu(case, is_causal):
  """Forward and shared-rows backward against jax.vjp of the reference,
  with random cotangents of the output and the LSE, in both dtypes, on the
  launch grid (the persistent grid equals it bit for bit: below)."""
  _require_sm90()
  attention = jax.jit(functools.partial(
      mosaic_attention_with(shared_rows=True, persistent=False),
      is_causal=is_causal))
  for dtype in (jnp.bfloat16, jnp.float16):
    check_against_reference(attention, case, dtype, is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_shared_rows_are_deterministic_and_the_grid_on_gpu(is_causal):
  """Bitwise repeatable, and a persistent grid of 3 CTAs (each walking
  many tiles) equals the launch grid bit for bit: a barrier phase or ring
  slot off by one across tiles would not."""
  _require_sm90()
  case = Case(2, 1024, 1536, 8, 2, 256)
  q, k, v, d_out, _ = random_inputs(case, jnp.bfloat16, 21)
  scale = case.head_dim**-0.5
  out, lse = mosaic_forward(q, k, v, scale=scale, is_causal=is_causal)
  run = lambda **kwargs: jax.jit(functools.partial(
      backward.mosaic_backward, scale=scale, is_causal=is_causal,
      shared_rows=True, kv_head_copies=1, **kwargs))(q, k, v, out, lse,
                                                      d_out)
  want = run(persistent=False)   # one K/V copy: copies round dK, dV apart
  for got in (run(persistent=False), run(persistent=True, num_ctas=3)):
    for a, b, name in zip(got, want, ("dq", "dk", "dv")):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=name)


@pytest.mark.gpu
def test_shared_rows_agree_with_the_default_kernels_on_gpu():
  """The same sums in the same order as the two-pass kernels (each
  consumer adds the parts in order): dk and dv within about one bf16
  rounding of theirs (the products are split into more wgmmas, whose f32
  accumulation may round differently)."""
  _require_sm90()
  case = Case(1, 2048, 2048, 8, 8, 256)
  q, k, v, d_out, _ = random_inputs(case, jnp.bfloat16, 4)
  scale = case.head_dim**-0.5
  out, lse = mosaic_forward(q, k, v, scale=scale, is_causal=True)
  run = lambda shared: jax.jit(functools.partial(
      backward.mosaic_backward, scale=scale, is_causal=True,
      shared_rows=shared, persistent=False))(
          q, k, v, out, lse, d_out)
  for a, b, name in zip(run(True), run(False), ("dq", "dk", "dv")):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-3 * np.abs(b).max(),
                               err_msg=name)


def _public_attention(is_causal):
  """`flash_attention` on its Mosaic path."""
  import jax_flash
  return jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=is_causal, return_residual=True,
      implementation="mosaic"))


def test_the_mosaic_route_takes_shared_rows_at_d256(cuda_lowering):
  """The plan through the route `flash_attention` takes
  (`mosaic.attention.mosaic_attention`): at head_dim 256
  and kv_len 2048 the backward lowers to one dK/dV kernel (and the dQ
  kernel); at kv_len 1024 (persistent) to the two passes."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention as mosaic_attention
  route = jax.jit(lambda q, k, v: _api_layout(*mosaic_attention.
      mosaic_attention(q, k, v, scale=0.0625, is_causal=False,
                       backward_blocks=BlockSizes.get_default(256))))
  assert backward_kernels(route, Case(1, 2048, 2048, 4, 2, 256)) == {
      "dq", "dkdv"}
  assert backward_kernels(route, Case(1, 1024, 1024, 4, 2, 256)) == {
      "dq", "dk", "dv"}


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_attention_default_at_d256_on_gpu(is_causal):
  """`flash_attention` at head_dim 256, kv_len 2048 (shared rows by its
  plan), GQA 2:1, q_len not the kv_len: output, LSE and gradients obey
  the tolerance rule."""
  _require_sm90()
  check_against_reference(_public_attention(is_causal),
                          Case(1, 1536, 2048, 4, 2, 256), jnp.bfloat16,
                          is_causal=is_causal)
