"""The Mosaic GPU (sm90) backward: cross-lowered for CUDA on CPU, checked on a GPU.

As in test_mosaic_lowering.py, lowering runs Pallas -> Mosaic GPU -> NVVM in
Python and so catches most kernel errors without a GPU; PTX generation and
the numerics need the `-m gpu` test.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat as versions
from pallas_kernels.config import BlockSizes
from tests.attention_checks import Case, check_against_reference, random_inputs

try:
  from pallas_kernels.mosaic.backward import mosaic_backward
  from pallas_kernels.mosaic.forward import mosaic_forward
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

_CUSTOM_CALL = "mosaic_gpu_v2"
_KERNEL_NAME = re.compile(
    r"mosaic_flash_backward_(dq_dkdv|dkdv|dk|dv|dq)(?![a-z])")



def _structs(*, batch=2, q_len=256, kv_len=384, num_heads=4, num_kv_heads=2,
             head_dim=64, dtype=jnp.bfloat16):
  """Abstract (q, k, v, out, lse, d_out) of a call."""
  q = jax.ShapeDtypeStruct((batch, q_len, num_heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, kv_len, num_kv_heads, head_dim), dtype)
  lse = jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)
  return q, kv, kv, q, lse, q


def _kernels(text):
  """Which backward kernels (dq, dkdv, dk, dv) a lowered module contains."""
  return set(_KERNEL_NAME.findall(text))


def _lower(head_dim, is_causal, **shape_and_blocks):
  blocks = {name: shape_and_blocks.pop(name)
            for name in ("block_q", "block_kv", "max_concurrent_steps",
                         "overlap_softmax", "fused_dq", "persistent",
                         "tile_fastest", "prefetch_stats", "opaque_resident",
                         "shared_rows", "shared_q_rows", "deferred_dq",
                         "prefetch_lse", "stage_free_on_read", "early_delta",
                         "lean_producer", "merged_pieces", "scores_ahead",
                         "num_ctas", "dq_tiles", "hw_ds_sync")
            if name in shape_and_blocks}
  args = _structs(head_dim=head_dim, **shape_and_blocks)

  def backward(*args):
    return mosaic_backward(*args, scale=head_dim**-0.5, is_causal=is_causal,
                           **blocks)

  lowered = jax.jit(backward).trace(*args).lower(lowering_platforms=("cuda",))
  for grad, primal in zip(lowered.out_info, args[:3]):
    assert grad.shape == primal.shape and grad.dtype == primal.dtype
  return lowered.as_text()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_lowers_for_cuda(head_dim, is_causal, lowering_semantics):
  # GQA 4:2 and q_len 256 != kv_len 384.
  text = _lower(head_dim, is_causal)
  assert _CUSTOM_CALL in text
  # At head_dim 256 two 64 x 256 f32 accumulators do not fit one
  # warpgroup's registers: dK and dV come from one pass each.
  expected = {"dq", "dk", "dv"} if head_dim == 256 else {"dq", "dkdv"}
  assert _kernels(text) == expected


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_overlapped_backward_lowers_and_changes_the_kernels(
    head_dim, is_causal, lowering_semantics):
  """`overlap_softmax` (P while dP runs, dS while dV runs) lowers in both
  semantics, with the same kernels (at 256 one pass per output, where only
  the dK pass has a dP), and changes them; it is the default."""
  text = _lower(head_dim, is_causal, overlap_softmax=True)
  expected = {"dq", "dk", "dv"} if head_dim == 256 else {"dq", "dkdv"}
  assert _kernels(text) == expected
  assert text != _lower(head_dim, is_causal, overlap_softmax=False)
  # (Not `text == _lower(...)` with the default: under JAX 0.11.2 the
  # serialized module carries call-site locations.)
  default = inspect.signature(mosaic_backward).parameters["overlap_softmax"]
  assert default.default is True


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [
    dict(q_len=512, kv_len=128),                    # causal: rows past kv_len
    dict(q_len=128, kv_len=512),                    # causal: keys never seen
    dict(q_len=192, kv_len=320, num_heads=4, num_kv_heads=1),  # MQA, 1 consumer
    dict(q_len=256, kv_len=256, block_q=128, max_concurrent_steps=3),
    dict(q_len=256, kv_len=256, dtype=jnp.float16),
], ids=str)
def test_backward_lowers_other_shapes(shape, is_causal, cuda_lowering):
  assert _kernels(_lower(64, is_causal, **shape)) == {"dq", "dkdv"}


def test_d_lse_lowers(cuda_lowering):
  q, k, v, out, lse, d_out = _structs()

  def backward(q, k, v, out, lse, d_out, d_lse):
    return mosaic_backward(q, k, v, out, lse, d_out, d_lse, scale=0.125,
                           is_causal=True)

  text = jax.jit(backward).trace(q, k, v, out, lse, d_out, lse).lower(
      lowering_platforms=("cuda",)).as_text()
  assert _kernels(text) == {"dq", "dkdv"}


@pytest.mark.parametrize("kwargs, match", [
    (dict(q_len=200), "q_len 200"),
    (dict(kv_len=200), "kv_len 200"),
    (dict(head_dim=96), "head_dim"),
    (dict(dtype=jnp.float32), "bfloat16 and float16"),
    (dict(block_q=96), "multiples of 64"),
    (dict(head_dim=256, block_kv=128), "registers"),
    (dict(head_dim=128, block_q=256), "registers"),
    (dict(head_dim=256, max_concurrent_steps=4), "shared memory"),
])
def test_unsupported_calls_raise_not_implemented(kwargs, match):
  """These make a dispatcher fall back to the Triton backward."""
  shape = {name: kwargs.pop(name) for name in ("q_len", "kv_len", "head_dim",
                                               "dtype") if name in kwargs}
  args = _structs(batch=1, **{"q_len": 256, "kv_len": 256, **shape})
  with pytest.raises(NotImplementedError, match=match):
    mosaic_backward(*args, scale=0.125, is_causal=False, **kwargs)


@pytest.mark.parametrize("change, error", [
    (dict(lse=jax.ShapeDtypeStruct((1, 256, 2), jnp.float32)), ValueError),
    (dict(out=jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float16)), TypeError),
    (dict(d_out=jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)),
     ValueError),
])
def test_bad_residuals_raise(change, error):
  q, k, v, out, lse, d_out = _structs(batch=1, q_len=256, kv_len=256,
                                      num_heads=2, num_kv_heads=1)
  args = {"out": out, "lse": lse, "d_out": d_out, **change}
  with pytest.raises(error):
    mosaic_backward(q, k, v, args["out"], args["lse"], args["d_out"],
                    scale=0.125, is_causal=False)


def mosaic_attention_with(**backward_kwargs):
  """(q, k, v, is_causal) -> (out, lse [B, Tq, N]): the Mosaic forward, with
  the Mosaic backward called with `backward_kwargs`."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def attention(q, k, v, is_causal):
    return forward(q, k, v, is_causal)[0]

  def forward(q, k, v, is_causal):
    out, lse = mosaic_forward(q, k, v, scale=q.shape[-1]**-0.5,
                              is_causal=is_causal)
    return (out, jnp.transpose(lse, (0, 2, 1))), (q, k, v, out, lse)

  def backward(is_causal, residuals, cotangents):
    q, k, v, out, lse = residuals
    d_out, d_lse = cotangents
    return mosaic_backward(q, k, v, out, lse, d_out,
                           jnp.transpose(d_lse, (0, 2, 1)),
                           scale=q.shape[-1]**-0.5, is_causal=is_causal,
                           **backward_kwargs)

  attention.defvjp(forward, backward)
  return attention


_mosaic_attention = mosaic_attention_with()


def _require_sm90():
  if (versions.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic backward needs sm90 (wgmma, TMA, setmaxnreg)")


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", [
    Case(2, 1024, 1024, 8, 8, 64),
    Case(2, 512, 1024, 8, 2, 128),    # GQA 4:1, kv_len > q_len
    Case(1, 1024, 512, 4, 1, 256),    # MQA, q_len > kv_len
    Case(1, 384, 640, 4, 2, 128),     # odd tile counts
    Case(1, 2048, 2048, 4, 4, 128),
], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mosaic_backward_matches_reference_on_gpu(case, is_causal, dtype):
  """Mosaic forward and backward against jax.vjp of the reference, with
  random cotangents of both the output and the LSE."""
  _require_sm90()
  attention = jax.jit(functools.partial(_mosaic_attention,
                                        is_causal=is_causal))
  check_against_reference(attention, case, dtype, is_causal=is_causal)


def _assert_bitwise_either_way(option, head_dim, is_causal, seed, *,
                               runs: int = 1, **kwargs):
  """dq, dk, dv with `option` on equal those with it off, bit for bit, in
  each of `runs` runs with it on (a race shows in some runs only)."""
  _require_sm90()
  case = Case(2, 1024, 1536, 8, 2, head_dim)
  q, k, v, d_out, _ = random_inputs(case, jnp.bfloat16, seed)
  scale = head_dim**-0.5
  out, lse = mosaic_forward(q, k, v, scale=scale, is_causal=is_causal)
  run = lambda on: jax.jit(functools.partial(
      mosaic_backward, scale=scale, is_causal=is_causal, **{option: on},
      **kwargs))(q, k, v, out, lse, d_out)
  want = run(False)
  for attempt in range(runs):
    for a, b, name in zip(run(True), want, ("dq", "dk", "dv")):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=f"{name}, run {attempt}")


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_overlapped_backward_is_bitwise_the_default_on_gpu(head_dim,
                                                           is_causal):
  """`overlap_softmax` reorders when the matmuls are waited for, not what
  is computed: the gradients equal the default kernels' bit for bit (a
  register read before its wgmma finished would not)."""
  _assert_bitwise_either_way("overlap_softmax", head_dim, is_causal, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (64, {}), (128, {}), (256, {}), (128, dict(overlap_softmax=False)),
    (64, dict(fused_dq=True, block_q=128)), (256, dict(shared_rows=False)),
], ids=str)
def test_prefetched_stats_are_bitwise_the_default_on_gpu(head_dim, kwargs,
                                                         is_causal):
  """`prefetch_stats` moves the dK/dV kernel's reads of lse and delta
  ahead of its matmuls, not what is computed: dq, dk, dv equal the kernels
  without it bit for bit, in every dK/dV form it applies to (head_dim 256:
  shared rows by default at this kv_len, and the two passes)."""
  _assert_bitwise_either_way("prefetch_stats", head_dim, is_causal, 17,
                             **kwargs)


def test_prefetched_stats_change_only_the_dkdv_kernels(cuda_lowering):
  """The option reaches the dK/dV kernels (their code differs), not the dQ
  kernel; by default it is on where it was measured faster (head_dim 64
  with 64-row Q tiles: not the dispatch's 128-row ones) and off
  elsewhere."""
  from pallas_kernels.mosaic import backward
  q, kv = _structs(head_dim=128)[:2]
  dq, dkdv = backward.configure(q, kv, scale=0.1, is_causal=True,
                                prefetch_stats=True)
  assert all(config.prefetch_stats for config in dkdv)
  assert not dq.prefetch_stats
  dq, dkdv = backward.configure(q, kv, scale=0.1, is_causal=True)
  assert not any(config.prefetch_stats for config in dkdv)
  q64, kv64 = _structs(head_dim=64)[:2]
  for is_causal in (False, True):
    for block_q, on in ((64, True), (128, False)):
      _, dkdv = backward.configure(q64, kv64, scale=0.1, is_causal=is_causal,
                                   block_q=block_q)
      assert all(config.prefetch_stats == on for config in dkdv)
  assert _lower(128, True, prefetch_stats=True) != _lower(128, True)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (128, dict(fused_dq=True)), (128, {}), (64, {}),
    (128, dict(persistent=True)),
], ids=str)
def test_opaque_resident_is_bitwise_the_default_on_gpu(head_dim, kwargs,
                                                       is_causal):
  """`opaque_resident` changes where the resident tiles' descriptors are
  computed, not what is computed: dq, dk, dv equal the kernels without it
  bit for bit (an index off by the zero would not), fused dQ included."""
  _assert_bitwise_either_way("opaque_resident", head_dim, is_causal, 19,
                             **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (128, {}), (64, dict(block_q=128)),
], ids=str)
def test_deferred_dq_is_bitwise_the_fused_kernel_on_gpu(head_dim, kwargs,
                                                        is_causal):
  """`deferred_dq` computes each step's dQ pieces a step later, in the
  same order and with the same operands: dq, dk, dv equal the fused
  kernel's bit for bit (a piece read from a dSᵀ buffer already
  overwritten would not)."""
  _assert_bitwise_either_way("deferred_dq", head_dim, is_causal, 23,
                             fused_dq=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (64, dict(block_q=128)), (128, {}), (256, {}),
], ids=str)
def test_tile_fastest_is_bitwise_the_default_on_gpu(head_dim, kwargs,
                                                    is_causal):
  """`tile_fastest` changes only which CTAs run together: the two kernels'
  gradients equal the default order's bit for bit (at d=256 with the
  shared-rows dK/dV kernel)."""
  _assert_bitwise_either_way("tile_fastest", head_dim, is_causal, 29,
                             persistent=False, fused_dq=False, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (64, dict(block_q=128)), (128, dict(deferred_dq=False)),
], ids=str)
def test_hw_ds_sync_is_bitwise_the_fused_kernel_on_gpu(head_dim, kwargs,
                                                       is_causal):
  """`hw_ds_sync` moves the fused consumers' meeting each step onto a
  hardware barrier: dq, dk, dv equal the fused kernel's bit for bit, three
  runs in a row (a consumer reading the other's dSᵀ before it is stored
  would not)."""
  _assert_bitwise_either_way("hw_ds_sync", head_dim, is_causal, 59,
                             runs=3, fused_dq=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (128, {}), (128, dict(deferred_dq=False)), (64, dict(block_q=128)),
], ids=str)
def test_stage_free_on_read_is_bitwise_the_fused_kernel_on_gpu(
    head_dim, kwargs, is_causal):
  """`stage_free_on_read` frees each stage of dQ pieces once the writer's
  TMA has read it: dq, dk, dv equal the fused kernel's bit for bit, three
  runs in a row (pieces overwritten before they were read, or a turn
  handed on before its adds landed, would not)."""
  _assert_bitwise_either_way("stage_free_on_read", head_dim, is_causal, 53,
                             runs=3, fused_dq=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (128, dict(fused_dq=True)), (128, dict(fused_dq=False, persistent=False)),
    (128, dict(overlap_softmax=False, fused_dq=False)),
    (128, dict(persistent=True, num_ctas=5)),
    (64, dict(fused_dq=True, block_q=128)), (256, {}),
    (64, dict(fused_dq=False, block_q=128)),
    (64, dict(fused_dq=False, block_q=128, persistent=False)),
], ids=str)
def test_prefetched_lse_is_bitwise_the_default_on_gpu(head_dim, kwargs,
                                                      is_causal):
  """`prefetch_lse` moves the dK/dV kernel's read of lse ahead of its
  matmuls: the gradients equal the kernels' without it bit for bit, in
  the fused, plain and (d=256) shared-rows consumers."""
  _assert_bitwise_either_way("prefetch_lse", head_dim, is_causal, 59,
                             **kwargs)


@pytest.mark.parametrize("head_dim, kwargs", [
    (128, dict(fused_dq=True)), (128, dict(fused_dq=False)), (256, {}),
], ids=str)
def test_prefetched_lse_lowers_and_changes_the_dkdv_kernels(head_dim, kwargs,
                                                            cuda_lowering):
  assert (_lower(head_dim, True, prefetch_lse=True, **kwargs)
          != _lower(head_dim, True, prefetch_lse=False, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (128, dict(fused_dq=False, persistent=False)),
    (128, dict(persistent=True, num_ctas=5)),
    (128, dict(fused_dq=False, prefetch_lse=False)), (128, dict(fused_dq=True)),
    (64, dict(fused_dq=False, block_q=128)),
], ids=str)
def test_early_delta_is_bitwise_the_default_on_gpu(head_dim, kwargs,
                                                   is_causal):
  """`early_delta` moves the dK/dV kernel's read of delta before P's
  exponentials: the gradients equal the kernels' without it bit for bit,
  with and without lse read early, two kernels and fused."""
  _assert_bitwise_either_way("early_delta", head_dim, is_causal, 61,
                             **kwargs)


@pytest.mark.parametrize("kwargs", [dict(fused_dq=False), dict(fused_dq=True)],
                         ids=str)
def test_early_delta_lowers_and_changes_the_dkdv_kernel(kwargs,
                                                        cuda_lowering):
  assert (_lower(128, False, early_delta=True, **kwargs)
          != _lower(128, False, early_delta=False, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, is_causal, kwargs", [
    (64, False, dict(block_q=128, fused_dq=False, persistent=False)),
    (64, False, dict(block_q=128, persistent=True, num_ctas=5)),
    # 32 steps a tile in three stages: the CTAs' later tiles start in
    # other slots than 0 (the ring's `base`)
    (64, False, dict(block_q=128, persistent=True, num_ctas=5,
                     max_concurrent_steps=3)),
    (64, False, dict(block_q=128, fused_dq=False, prefetch_lse=True)),
    (64, False, dict(block_q=128, fused_dq=False, max_concurrent_steps=3)),
    (128, False, dict(fused_dq=False, persistent=False)),
    (128, False, dict(fused_dq=False, persistent=False, prefetch_lse=False)),
    # Causal: each head's unmasked run a step ahead, the masked steps and
    # the skipped ones as without the option (session 24; not yet run on
    # a GPU when written).
    (64, True, dict(block_q=128, persistent=False)),
    (64, True, dict(block_q=128, persistent=True, num_ctas=5)),
    (128, True, dict(persistent=False)),
], ids=str)
def test_scores_ahead_is_bitwise_the_default_on_gpu(head_dim, is_causal,
                                                    kwargs):
  """`scores_ahead` issues each step's Sᵀ right behind the step before's dV
  and dK, before waiting for those: the gradients equal the kernels'
  without it bit for bit, three runs (an accumulator read before its
  wgmma finished, a slot released before dK read it, or a Q tile
  overwritten under the Sᵀ issued ahead would not), across the GQA
  group's heads, on both grids."""
  _assert_bitwise_either_way("scores_ahead", head_dim, is_causal, 73, runs=3,
                             **kwargs)


def test_scores_ahead_lowers_where_it_applies(lowering_semantics):
  """The option changes the plain dK/dV kernel with or without a causal
  mask (64- and 128-row Q tiles, either grid), is the default on d=64's
  launch grid without a mask only, and the rest is refused by name."""
  for head_dim, kwargs in ((64, dict(block_q=128, persistent=False)),
                           (64, dict(block_q=128, persistent=True)),
                           (128, dict(fused_dq=False))):
    for is_causal in (False, True):
      assert (_lower(head_dim, is_causal, scores_ahead=True, **kwargs)
              != _lower(head_dim, is_causal, scores_ahead=False, **kwargs))
  causal = dict(block_q=128, persistent=False)
  assert (_lower(64, True, **causal)
          == _lower(64, True, scores_ahead=False, **causal))
  launch = dict(block_q=128, persistent=False, fused_dq=False)
  assert (_lower(64, False, **launch)
          == _lower(64, False, scores_ahead=True, **launch))
  # Not by default where its walk cannot serve the call's other options
  # (one stage; no overlap): those calls run as before it.
  for kwargs in (dict(max_concurrent_steps=1), dict(overlap_softmax=False)):
    assert (_lower(64, False, **launch, **kwargs)
            == _lower(64, False, scores_ahead=False, **launch, **kwargs))
  persistent = dict(block_q=128, persistent=True)
  assert (_lower(64, False, **persistent)
          == _lower(64, False, scores_ahead=False, **persistent))
  for head_dim, is_causal, kwargs, match in (
      (128, False, dict(fused_dq=True), "fused dQ"),
      (256, False, dict(shared_rows=True), "shared rows"),
      (256, False, dict(shared_rows=False), "one pass"),
      (64, False, dict(block_q=128, early_delta=True), "early_delta"),
      (64, False, dict(block_q=128, prefetch_stats=True), "prefetch_stats"),
      (128, False, dict(fused_dq=False, opaque_resident=True),
       "opaque_resident"),
      (64, False, dict(block_q=128, max_concurrent_steps=1), "two stages"),
      (64, False, dict(block_q=128, overlap_softmax=False),
       "overlap_softmax")):
    with pytest.raises(NotImplementedError, match=match):
      _lower(head_dim, is_causal, scores_ahead=True, **kwargs)


class _FakePipeline:
  """A stand-in for `plgpu` in `_walk_scores_ahead`: wgmma groups complete
  in issue order when waited for, and every ordering rule the walk relies
  on is asserted as it runs (what the interpreter, whose wgmmas are
  synchronous, and a GPU test, where a race may not show, cannot see)."""

  class Layout:
    WGMMA = None

  class Ref:
    """An accumulator, a ring slot's tile or a barrier array."""

    def __init__(self, pipeline, name, shape=(2, 2)):
      self.pipeline, self.name, self.shape = pipeline, name, shape

    @property
    def at(self):  # barrier.at[slot] -> (name, slot)
      return {slot: (self.name, slot) for slot in range(8)}

    def __setitem__(self, index, value):  # zeroing an accumulator
      self.pipeline.assert_settled(self.name, "written")

  def __init__(self):
    self.pending = []  # [(accumulator, tiles read)], oldest first
    self.most_in_flight = 0
    self.waited = {}   # barrier -> slots waited on, in order
    self.released = []

  def assert_settled(self, accumulator, what):
    assert all(acc != accumulator for acc, _ in self.pending), (
        f"{accumulator} {what} while a wgmma into it is in flight")

  # The `plgpu` calls the walk makes.
  def layout_cast(self, x, layout):
    return x

  def barrier_wait(self, barrier):
    name, slot = barrier
    self.waited.setdefault(name, []).append(slot)

  def barrier_arrive(self, barrier):
    name, slot = barrier
    assert name == "consumed"
    for _, tiles in self.pending:
      assert all(tile[1] != slot for tile in tiles), (
          f"slot {slot} released while a wgmma reads {tiles}")
    self.released.append(slot)

  def wgmma(self, acc, a, b):
    tiles = [x for x in (a, b) if isinstance(x, tuple)]
    self.pending.append((acc.name, tiles))
    self.most_in_flight = max(self.most_in_flight, len(self.pending))

  def wgmma_wait(self, n):
    del self.pending[:max(len(self.pending) - n, 0)]

  def wgmma_accumulator_load(self, acc, *, wait_n):
    self.wgmma_wait(wait_n)
    self.assert_settled(acc.name, "read")
    return acc.name


@pytest.mark.parametrize("num_steps, stages", [(1, 2), (2, 2), (5, 2),
                                               (7, 3)])
def test_scores_ahead_walk_keeps_the_pipeline_rules(monkeypatch, num_steps,
                                                    stages):
  """`_walk_scores_ahead`'s order of issues, waits and releases, on a
  stand-in for `plgpu`: no slot released while a wgmma reads its tiles, no
  accumulator read or zeroed while a wgmma into it runs, nothing in flight
  where the loop turns (ptxas C7514), at most two wgmmas in flight
  (dK_t and Sᵀ_{t+1}: with dV_t too, C7512), and each step's tiles awaited
  and released once, in order."""
  from types import SimpleNamespace

  from pallas_kernels.mosaic import backward
  fake = _FakePipeline()

  def fori_loop(lower, upper, body, carry):
    for i in range(lower, upper):
      carry = body(i, carry)
      assert not fake.pending, "a wgmma in flight across the back edge"
    return carry

  monkeypatch.setattr(backward, "plgpu", fake)
  monkeypatch.setattr(backward, "lax", SimpleNamespace(fori_loop=fori_loop))
  ref = functools.partial(_FakePipeline.Ref, fake)
  s_ref, dp_ref, dk_ref, dv_ref = (ref(n) for n in ("S", "dP", "dK", "dV"))
  slot_of = lambda step: step % stages
  reads = []

  def products(slot):
    return (("K", ("Q", slot)), ("V", ("dO", slot)))

  def probabilities(slot, wait_scores):
    assert wait_scores() == "S"
    reads.append(slot)
    return "P"

  def gradients(slot, p, dp):
    assert (p, dp) == ("P", "dP") and slot == reads[-1]
    fake.wgmma(dv_ref, p, ("dO", slot))
    fake.wgmma(dk_ref, "dS", ("Q", slot))

  backward._walk_scores_ahead(
      s_ref, dp_ref, num_steps=num_steps, arrived=[ref("q_arrived"),
                                                   ref("do_arrived")],
      consumed=ref("consumed"), slot_of=slot_of, products=products,
      probabilities=probabilities, gradients=gradients)
  slots = [slot_of(step) for step in range(num_steps)]
  assert not fake.pending and fake.most_in_flight <= 2
  assert reads == slots and fake.released == slots
  assert fake.waited == {"q_arrived": slots, "do_arrived": slots}


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (128, {}), (64, dict(block_q=128)), (128, dict(stage_free_on_read=True)),
], ids=str)
def test_merged_pieces_are_bitwise_the_deferred_kernel_on_gpu(
    head_dim, kwargs, is_causal):
  """`merged_pieces` issues each step's dQ piece with the next step's dV
  and dK, from a column slice chosen by the consumer's index: dq, dk, dv
  equal the deferred fused kernel's bit for bit, three runs (a piece from
  the wrong slice, a dSᵀ read before it was stored, or a stage
  overwritten before the writer read it would not)."""
  _assert_bitwise_either_way("merged_pieces", head_dim, is_causal, 71,
                             runs=3, fused_dq=True, deferred_dq=True,
                             **kwargs)


def test_merged_pieces_lower_where_each_consumer_has_one_piece(
    lowering_semantics):
  """The option changes the deferred fused kernel at d=128 and at d=64's
  128-row Q tiles (one dQ piece a consumer), in both lowering semantics,
  and refuses the rest."""
  for head_dim, block_q in ((128, 64), (64, 128)):
    fused = dict(fused_dq=True, deferred_dq=True, block_q=block_q)
    assert (_lower(head_dim, True, merged_pieces=True, **fused)
            != _lower(head_dim, True, merged_pieces=False, **fused))
  for kwargs, match in ((dict(fused_dq=True, deferred_dq=False), "deferred"),
                        (dict(fused_dq=True, overlap_softmax=False),
                         "overlap_softmax"),
                        # kv_len 192: three K/V tiles, one consumer, two
                        # pieces for it
                        (dict(fused_dq=True, kv_len=192), "one dQ piece"),
                        (dict(fused_dq=False), "fused dQ only")):
    with pytest.raises(NotImplementedError, match=match):
      _lower(128, False, merged_pieces=True, **kwargs)
  with pytest.raises(NotImplementedError, match="shared rows"):
    _lower(256, False, early_delta=True, shared_rows=True)


LEAN_FORMS = [
    (128, dict(fused_dq=False, persistent=False)),
    (128, dict(persistent=True, num_ctas=5)),
    (128, dict(fused_dq=False, early_delta=True)),
    (128, dict(fused_dq=False, persistent=False, prefetch_lse=False)),
    (64, dict(block_q=128, fused_dq=False)), (256, {}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", LEAN_FORMS, ids=str)
def test_lean_producer_is_bitwise_the_default_on_gpu(head_dim, kwargs,
                                                     is_causal):
  """`lean_producer` moves registers from the producers to the consumers
  (setmaxnreg): the gradients equal the default's bit for bit, two runs
  (a register budget that did not add up would hang or corrupt)."""
  _assert_bitwise_either_way("lean_producer", head_dim, is_causal, 67,
                             runs=2, **kwargs)


@pytest.mark.parametrize("head_dim, kwargs", LEAN_FORMS, ids=str)
def test_lean_producer_lowers_and_changes_both_kernels(head_dim, kwargs,
                                                       cuda_lowering):
  """The option changes both kernels (their register budgets)."""
  assert (_lower(head_dim, True, lean_producer=True, **kwargs)
          != _lower(head_dim, True, lean_producer=False, **kwargs))


def test_lean_producer_and_merged_pieces_defaults(cuda_lowering):
  """`lean_producer=None` is on with the two kernels (either grid; shared
  rows at d=256 from kv_len 2048; under causal masking at d=128 on the
  launch grid only, with lse read early) and
  off in the fused kernel; `merged_pieces=None` is on in
  the deferred fused kernel at d=128 where each consumer has one dQ piece,
  and off (not refused) where kv_len leaves one consumer two pieces; and
  `fused_dq=None` does not fuse where kv_len gives one consumer."""
  from pallas_kernels.mosaic import backward

  def configs(head_dim, kv_len, is_causal=False, **kwargs):
    q, kv = _structs(head_dim=head_dim, q_len=256, kv_len=kv_len)[:2]
    dq, dkdv = backward.configure(q, kv, scale=0.1, is_causal=is_causal,
                                  **kwargs)
    return [dq] + dkdv if dq is not None else dkdv

  # Under causal masking at d=64 and 256 (`LEAN_PRODUCER_CAUSAL_HEAD_DIMS`).
  for head_dim, lean in ((64, True), (128, False), (256, True)):
    assert all(c.lean_producer == lean
               for c in configs(head_dim, 512, is_causal=True,
                                fused_dq=False))
  # d=128 on the causal launch grid (`CAUSAL_LAUNCH_LEAN_HEAD_DIMS`).
  dq, dkdv = configs(128, 2048, is_causal=True)
  assert not (dq.persistent or dkdv.persistent or dkdv.fused_dq)
  assert dq.lean_producer and dkdv.lean_producer and dkdv.prefetch_lse

  for head_dim, kv_len, kwargs in ((128, 512, dict(persistent=False)),
                                   (128, 512, dict(persistent=True)),
                                   (256, 512, {}), (256, 2048, {}),
                                   (64, 512, dict(block_q=128,
                                                  fused_dq=False))):
    assert all(c.lean_producer and not c.merged_pieces
               for c in configs(head_dim, kv_len, **kwargs))
  assert all(c.shared_rows for c in configs(256, 2048)[1:])
  [fused] = configs(128, 512, fused_dq=True)
  assert fused.merged_pieces and fused.deferred_dq and not fused.lean_producer
  [fused] = configs(128, 192, fused_dq=True)   # one consumer, two pieces
  assert fused.num_consumers == 1 and not fused.merged_pieces
  [fused] = configs(64, 512, fused_dq=True, block_q=128)  # not deferred
  assert not (fused.merged_pieces or fused.deferred_dq)
  [fused] = configs(128, 512, fused_dq=True, deferred_dq=False)
  assert not fused.merged_pieces  # it needs the deferred pieces
  assert not any(c.lean_producer for c in configs(128, 512, fused_dq=True,
                                                  lean_producer=False))
  default = lambda n: backward.fused_dq_by_default(
      head_dim=128, kv_len=n, block_q=64, block_kv=64)
  assert default(16384) and not default(16384 + 64) and not default(8192)


def test_lean_producer_refuses_the_fused_dq(cuda_lowering):
  """The fused dQ's four warpgroups have no registers to spare; the lean
  split spends the same budget as the default one."""
  from pallas_kernels.mosaic import forward
  consumer, producer = forward.register_split(lean=True)
  default_consumer, default_producer = forward.register_split(lean=False)
  assert (consumer, producer) != (default_consumer, default_producer)
  assert 2 * consumer + producer == 2 * default_consumer + default_producer
  with pytest.raises(NotImplementedError, match="two kernels only"):
    _lower(128, False, fused_dq=True, lean_producer=True)


def test_prefetched_lse_default_follows_its_table(cuda_lowering):
  """`prefetch_lse=None` reads lse early at head_dim 128 with 64-row Q
  tiles: in the fused kernel (`FUSED_PREFETCH_LSE_TILES`), and in the two
  kernels' dK/dV kernel (`PREFETCH_LSE_TILES`) on either grid without a
  causal mask and on the launch grid with one; nowhere else (not at d=64's
  fused 128-row Q tiles); never in the dQ kernel."""
  from pallas_kernels.mosaic import backward
  q, kv = _structs(head_dim=128)[:2]
  for is_causal in (False, True):
    for persistent in (False, True):
      dq, dkdv = backward.configure(q, kv, scale=0.1, is_causal=is_causal,
                                    persistent=persistent)
      want = not (is_causal and persistent)
      assert dkdv and all(config.prefetch_lse == want for config in dkdv)
      assert not dq.prefetch_lse
    _, [fused] = backward.configure(q, kv, scale=0.1, is_causal=is_causal,
                                    fused_dq=True)
    assert fused.prefetch_lse
    for fused_dq in (False, True):
      assert not backward.prefetch_lse_by_default(
          head_dim=128, block_q=128, fused_dq=fused_dq, is_causal=is_causal)
    q64, kv64 = _structs(head_dim=64)[:2]
    _, [fused] = backward.configure(q64, kv64, scale=0.1, block_q=128,
                                    is_causal=is_causal, fused_dq=True)
    assert not fused.prefetch_lse
  for head_dim in (64, 256):
    q, kv = _structs(head_dim=head_dim)[:2]
    _, dkdv = backward.configure(q, kv, scale=0.1, is_causal=False)
    assert not any(config.prefetch_lse for config in dkdv)


@pytest.mark.parametrize("is_causal", [False, True])
def test_dq_tiles_lower_and_change_the_dq_kernel_only(is_causal,
                                                      cuda_lowering):
  """`dq_tiles` gives the dQ kernel tiles of its own: its lowered kernel
  changes, the dK/dV kernel's does not; the default
  (`DQ_TILES_CAUSAL_LAUNCH`) takes 64 x 128 at d=64's 128-row Q tiles
  under causal masking on the launch grid only; the fused kernel (no dQ
  kernel) refuses other tiles than its own, and tiles the lengths do not
  divide are refused."""
  from pallas_kernels.mosaic import backward
  q, kv = _structs(head_dim=64, q_len=512, kv_len=512)[:2]
  configs = lambda **kw: backward.configure(
      q, kv, scale=0.1, is_causal=is_causal, block_q=128, fused_dq=False,
      **kw)
  (dq, [dkdv]), (own_dq, [own_dkdv]) = (
      configs(dq_tiles=(128, 64), persistent=False),
      configs(dq_tiles=(64, 128), persistent=False))
  assert (dq.block_q, dq.block_kv) == (128, 64)
  assert (own_dq.block_q, own_dq.block_kv) == (64, 128) and own_dkdv == dkdv
  default_dq, _ = configs(persistent=False)
  assert default_dq == (own_dq if is_causal else dq)
  persistent_dq, _ = configs(persistent=True)
  assert (persistent_dq.block_q, persistent_dq.block_kv) == (128, 64)
  assert backward.dq_tiles_by_default(
      head_dim=64, block_q=128, q_len=16384, kv_len=16384 + 64,
      is_causal=True, persistent=False, fused_dq=False) is None  # 128 ∤ it
  # Tiles of the dQ kernel's own ask for it: the fused default gives way
  # (d=64 without a mask fuses from kv_len 16k), and a ranged call or a
  # malformed pair is refused.
  q16, kv16 = _structs(head_dim=64, q_len=16384, kv_len=16384)[:2]
  own, [plain] = backward.configure(q16, kv16, scale=0.1, is_causal=False,
                                    block_q=128, dq_tiles=(64, 128))
  assert (own.block_q, own.block_kv) == (64, 128) and not plain.fused_dq
  with pytest.raises(NotImplementedError, match="ranged"):
    backward.statics(q, kv, scale=0.1, is_causal=is_causal, block_q=128,
                     block_kv=64, max_concurrent_steps=2,
                     spec=object(), dq_tiles=(64, 128))
  with pytest.raises(ValueError, match="dq_tiles"):
    _lower(64, is_causal, block_q=128, fused_dq=False, dq_tiles=(64,))
  text = lambda **kw: _lower(64, is_causal, q_len=512, kv_len=512,
                             block_q=128, persistent=False, fused_dq=False,
                             **kw)
  assert text(dq_tiles=(64, 128)) != text(dq_tiles=(128, 64))
  with pytest.raises(NotImplementedError, match="two kernels only"):
    _lower(64, is_causal, block_q=128, fused_dq=True, dq_tiles=(64, 128))
  _lower(64, is_causal, block_q=128, fused_dq=True, dq_tiles=(128, 64))
  with pytest.raises(NotImplementedError, match="multiple of block_kv 256"):
    _lower(64, is_causal, kv_len=384, block_q=128, fused_dq=False,
           dq_tiles=(64, 256))


def test_stage_free_on_read_lowers_with_the_fused_dq_only(cuda_lowering):
  """The option changes the fused kernel (either piece schedule) and
  refuses the two kernels."""
  for kwargs in (dict(), dict(deferred_dq=False)):
    assert (_lower(128, False, fused_dq=True, stage_free_on_read=True,
                   **kwargs)
            != _lower(128, False, fused_dq=True, **kwargs))
  with pytest.raises(NotImplementedError, match="fused dQ only"):
    _lower(128, False, fused_dq=False, stage_free_on_read=True)


def test_hw_ds_sync_lowers_with_the_fused_dq_only(cuda_lowering):
  """The consumers' meeting on a hardware barrier changes the fused kernel
  (a `bar.sync` of both consumers' 256 threads) and refuses the two
  kernels and the deferred pieces (measured a tie there and removed)."""
  for head_dim, kwargs in ((64, dict(block_q=128)),
                           (128, dict(deferred_dq=False))):
    text = _lower(head_dim, False, fused_dq=True, hw_ds_sync=True, **kwargs)
    assert "bar.sync 9, 256" in text
    assert text != _lower(head_dim, False, fused_dq=True, hw_ds_sync=False,
                          **kwargs)
  with pytest.raises(NotImplementedError, match="fused dQ only"):
    _lower(64, False, block_q=128, fused_dq=False, hw_ds_sync=True)
  with pytest.raises(NotImplementedError, match="without deferred_dq"):
    _lower(128, False, fused_dq=True, deferred_dq=True, hw_ds_sync=True)


def test_deferred_dq_lowers_with_the_fused_dq_only(cuda_lowering):
  """The option changes the fused kernel and refuses the two kernels."""
  for head_dim, block_q in ((128, 64), (64, 128)):
    # merged_pieces off: at d=128 it follows deferred_dq by default.
    assert (_lower(head_dim, True, fused_dq=True, block_q=block_q,
                   deferred_dq=True, merged_pieces=False)
            != _lower(head_dim, True, fused_dq=True, block_q=block_q,
                      deferred_dq=False))
  with pytest.raises(NotImplementedError, match="fused dQ only"):
    _lower(128, False, fused_dq=False, deferred_dq=True)


def test_opaque_resident_lowers_where_it_fits(cuda_lowering):
  """The option changes the dK/dV kernel of the plain and fused forms, and
  refuses what it does not cover: shared rows, and the fused dQ at d=64's
  128-row Q tiles, whose shared memory has no room for the zero's cell."""
  for kwargs in (dict(fused_dq=True), {}):
    assert (_lower(128, True, opaque_resident=True, **kwargs)
            != _lower(128, True, opaque_resident=False, **kwargs))
  with pytest.raises(NotImplementedError, match="shared rows"):
    _lower(256, False, opaque_resident=True, shared_rows=True)
  with pytest.raises(NotImplementedError, match="zero's cell"):
    _lower(64, False, opaque_resident=True, fused_dq=True, block_q=128)


@pytest.mark.gpu
def test_mosaic_backward_deterministic_and_empty_rows_on_gpu():
  """Bitwise repeatable, and a row with lse = -inf gets zero gradients."""
  _require_sm90()
  case = Case(1, 512, 512, 8, 2, 128)
  q, k, v, d_out, _ = random_inputs(case, jnp.bfloat16, 5)
  out, lse = mosaic_forward(q, k, v, scale=0.125, is_causal=True)
  # Row 0 of every head treated as empty: out 0 and lse -inf, as the
  # forward reports a row that attends to nothing.
  out = out.at[:, 0].set(0)
  lse = lse.at[:, :, 0].set(-jnp.inf)
  run = jax.jit(functools.partial(mosaic_backward, scale=0.125,
                                  is_causal=True))
  first = run(q, k, v, out, lse, d_out)
  for grad in first:
    assert np.isfinite(np.asarray(grad, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(first[0][:, 0], np.float32), 0.0)
  for _ in range(2):
    for a, b in zip(first, run(q, k, v, out, lse, d_out)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shape, kwargs, masked", [
    (dict(q_len=256, kv_len=384, head_dim=64), dict(is_causal=True), False),
    (dict(q_len=256, kv_len=256, head_dim=96), {}, False),   # padded to 128
    (dict(q_len=200, kv_len=330, head_dim=64),               # ragged: masked
     dict(is_causal=True, q_offset=130), True),
    (dict(q_len=256, kv_len=256, head_dim=128),
     dict(local_window_size=(64, 0), logits_soft_cap=20.0), True),
], ids=["causal", "padded-head-dim", "ragged-q_offset", "window-softcap"])
def test_residual_backward_lowers_backward_kernels_only(
    shape, kwargs, masked, cuda_lowering, monkeypatch):
  """`flash_attention_backward` on an H200, cross-lowered: the Mosaic
  backward kernels (the masked ones for masks and ragged lengths) and no
  forward kernel (the ring's backward relies on it)."""
  from pallas_kernels import compat as versions
  from jax_flash.residual_backward import flash_attention_backward
  monkeypatch.setattr(versions, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(versions, "has_gpu", lambda: True)
  q = jax.ShapeDtypeStruct((1, shape["q_len"], 4, shape["head_dim"]),
                           jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, shape["kv_len"], 2, shape["head_dim"]),
                            jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, shape["q_len"], 4), jnp.float32)
  lowered = jax.jit(lambda q, k, v, o, l, do, dl: flash_attention_backward(
      q, k, v, o, l, do, dl, implementation="mosaic", interpret=False,
      **kwargs)).trace(q, kv, kv, q, lse, q, lse).lower(
          lowering_platforms=("cuda",))
  for grad, primal in zip(lowered.out_info, (q, kv, kv)):
    assert grad.shape == primal.shape and grad.dtype == primal.dtype
  text = lowered.as_text()
  assert "mosaic_flash_forward" not in text
  assert ("mosaic_flash_backward_masked_dq" in text) == masked
  assert bool(_kernels(text)) == (not masked)


@pytest.mark.parametrize("q_len, kwargs", [
    (256, dict(is_causal=True)),                          # the plain kernels
    (200, dict(is_causal=True, local_window_size=(64, 0))),   # the masked ones
], ids=["plain", "masked"])
def test_gradients_lower_inside_shard_map_with_check_vma(q_len, kwargs,
                                                         cuda_lowering,
                                                         monkeypatch):
  """Gradients through the Mosaic kernels inside `jax.shard_map` with its
  default `check_vma=True` (issue 35): each kernel's outputs vary along the
  mesh axes its inputs vary along (`mosaic.compat.vary_like`), so the
  custom VJP's types match; cross-lowered as on an H200."""
  import jax_flash
  from jax.sharding import NamedSharding, PartitionSpec as P
  monkeypatch.setattr(versions, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(versions, "has_gpu", lambda: True)
  mesh = jax.make_mesh((1,), ("data",))
  x = jax.ShapeDtypeStruct((2, q_len, 4, 64), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("data")))

  def loss(q, k, v, d_out):
    out = jax_flash.flash_attention(q, k, v, implementation="mosaic",
                                    interpret=False, **kwargs)
    return jnp.vdot(out.astype(jnp.float32), d_out.astype(jnp.float32))

  grads = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                        in_specs=(P("data"),) * 4,
                        out_specs=(P("data"),) * 3)
  lowered = jax.jit(grads).trace(x, x, x, x).lower(
      lowering_platforms=("cuda",))
  assert "mosaic_flash_backward" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", [
    Case(2, 1024, 1024, 8, 8, 64),
    Case(1, 256, 640, 4, 1, 64),      # MQA, one Q tile pair, kv_len > q_len
    Case(1, 1152, 384, 4, 2, 64),     # odd Q tile count, q_len > kv_len
], ids=str)
def test_wide_q_backward_at_d64_on_gpu(case, is_causal, monkeypatch):
  """The backward with block_q 128 at head_dim 64 (`attention.
  WIDE_Q_BACKWARD_AT_D64`, on since this passed), through the dispatch, in
  both dtypes, against the reference; and its tiles did reach the kernel."""
  _require_sm90()
  from pallas_kernels.mosaic import attention as mosaic_attention
  monkeypatch.setattr(mosaic_attention, "WIDE_Q_BACKWARD_AT_D64", True)
  assert mosaic_attention.backward_tiles(64, case.q_len)["block_q"] == 128
  for dtype in (jnp.bfloat16, jnp.float16):
    attention = jax.jit(lambda q, k, v: mosaic_attention.mosaic_attention(
        q, k, v, scale=q.shape[-1]**-0.5, is_causal=is_causal,
        backward_blocks=BlockSizes.get_default(64)))
    check_against_reference(
        lambda q, k, v: _api_layout(*attention(q, k, v)), case, dtype,
        is_causal=is_causal)


def _api_layout(out, lse):
  return out, jnp.transpose(lse, (0, 2, 1))


def test_wide_q_backward_at_d64_lowers(cuda_lowering, monkeypatch):
  """With the switch on (the default), the plain route's backward at
  head_dim 64 takes 128-row Q tiles (off, its lowered kernels differ) and
  lowers; other head dims and Q lengths not divisible by 128 keep the
  defaults."""
  from pallas_kernels.mosaic import attention as mosaic_attention
  q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)

  def lowered():
    grad = jax.grad(lambda q, k, v: jnp.sum(mosaic_attention.mosaic_attention(
        q, k, v, scale=0.125, is_causal=True,
        backward_blocks=BlockSizes.get_default(64))[0].astype(jnp.float32)),
                    (0, 1, 2))
    return jax.jit(grad).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()

  assert mosaic_attention.WIDE_Q_BACKWARD_AT_D64  # on by default
  wide = lowered()
  monkeypatch.setattr(mosaic_attention, "WIDE_Q_BACKWARD_AT_D64", False)
  assert _kernels(wide) == {"dq", "dkdv"} and wide != lowered()
  monkeypatch.setattr(mosaic_attention, "WIDE_Q_BACKWARD_AT_D64", True)
  assert mosaic_attention.backward_tiles(128, 512) == {}
  assert mosaic_attention.backward_tiles(64, 320) == {}


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_persistent_backward_lowers(head_dim, is_causal, cuda_lowering):
  """`persistent=True` puts both kernels on a grid of `num_ctas` CTAs (a
  different module) and lowers; the ranged backward has no such grid."""
  from pallas_kernels.mosaic import backward
  q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 768, 2, head_dim), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((2, 4, 512), jnp.float32)

  def lowered(**kwargs):
    return jax.jit(lambda q, k, v, o, l, do: mosaic_backward(
        q, k, v, o, l, do, scale=0.1, is_causal=is_causal, **kwargs)).trace(
            q, kv, kv, q, lse, q).lower(lowering_platforms=("cuda",))

  persistent = lowered(persistent=True, num_ctas=3)
  assert [g.shape for g in persistent.out_info] == [q.shape, kv.shape,
                                                    kv.shape]
  assert _kernels(persistent.as_text()) == _kernels(lowered().as_text())
  assert persistent.as_text() != lowered(persistent=False).as_text()
  dq, dkdv = backward.statics(q, kv, scale=0.1, is_causal=is_causal,
                              block_q=64, block_kv=64,
                              max_concurrent_steps=2, persistent=True)
  # At most one CTA per tile (per pair of tiles under causal masking).
  tiles = 2 * 4 * 512 // (64 * dq.num_consumers)
  assert dq.num_ctas == min(132, tiles // 2 if is_causal else tiles)
  assert all(c.persistent for c in dkdv) and dq.persistent
  with pytest.raises(NotImplementedError, match="ranged"):
    backward._persistent(dataclasses.replace(dq, spec=object()), None,
                         tiles_per_head=1, num_heads=1, batch=1)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [{}, dict(block_q=128, block_kv=64)],
                         ids=["default-tiles", "wide-q"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_persistent_backward_is_bitwise_the_grid_on_gpu(head_dim, is_causal,
                                                        tiles):
  """On a persistent grid both kernels compute each tile as the launch grid
  does (in the same order), so dq, dk, dv equal it bit for bit, for CTAs
  walking one tile to dozens (a ring slot or barrier phase off by one
  across tiles would not)."""
  _require_sm90()
  if tiles and head_dim != 64:
    pytest.skip("128-row Q tiles are the d=64 backward's")
  case = Case(2, 1024, 1536, 8, 2, head_dim)   # GQA 4:1
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, 13)
  scale = head_dim**-0.5
  out, lse = mosaic_forward(q, k, v, scale=scale, is_causal=is_causal)
  d_lse = jnp.transpose(d_lse, (0, 2, 1))
  run = lambda **kwargs: jax.jit(functools.partial(
      mosaic_backward, scale=scale, is_causal=is_causal, **tiles,
      **kwargs))(q, k, v, out, lse, d_out, d_lse)
  want = run(persistent=False)
  for num_ctas in (3, None):
    for a, b, name in zip(run(persistent=True, num_ctas=num_ctas), want,
                          ("dq", "dk", "dv")):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=f"{name}, num_ctas {num_ctas}")


def test_persistent_backward_default_follows_the_measured_table(
    cuda_lowering):
  """On where the A/B measured it faster (every head dim up to kv_len
  1024; head_dim 64 under causal masking up to 8192), off elsewhere."""
  from pallas_kernels.mosaic import backward
  default = lambda d, n, c=False: backward.persistent_by_default(
      head_dim=d, kv_len=n, is_causal=c)
  assert default(128, 1024) and default(256, 512) and default(64, 1024)
  assert not default(128, 4096) and not default(256, 2048)
  assert not default(64, 4096) and default(64, 8192, True)
  assert not default(64, 16384, True)
  assert not default(128, 4096, True)
  q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 4, 512), jnp.float32)
  text = lambda **kw: jax.jit(lambda q, k, v, o, l, do: mosaic_backward(
      q, k, v, o, l, do, scale=0.1, is_causal=True, **kw)).trace(
          q, q, q, q, lse, q).lower(lowering_platforms=("cuda",)).as_text()
  assert text() == text(persistent=True) != text(persistent=False)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, block_q", [(64, 128), (128, 64)])
def test_fused_dq_lowers_as_one_kernel(head_dim, block_q, is_causal,
                                       cuda_lowering):
  """`fused_dq=True`: one kernel computes dq, dk and dv (GQA 2:1, kv_len >
  q_len), with and without the overlap within a consumer, at the tiles each
  head dim ships."""
  texts = [_lower(head_dim, is_causal, block_q=block_q, fused_dq=True,
                  overlap_softmax=overlap)
           for overlap in (True, False)]
  for text in texts:
    assert _kernels(text) == {"dq_dkdv"}
    assert "mosaic_flash_backward_dq\"" not in text
  assert len(set(texts)) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=256), "one pass"),
    (dict(head_dim=128, persistent=True), "launch grid"),
    (dict(head_dim=64, block_q=64), "share out evenly"),  # one piece
])
def test_fused_dq_refuses_what_it_does_not_cover(kwargs, match,
                                                 cuda_lowering):
  with pytest.raises(NotImplementedError, match=match):
    _lower(kwargs.pop("head_dim"), False, **{"fused_dq": True, **kwargs})


def test_fused_dq_default_follows_its_table(cuda_lowering, monkeypatch):
  """`fused_dq=None` fuses where `FUSED_DQ_MIN_KV_LEN` says (under causal
  masking only at `FUSED_DQ_CAUSAL_HEAD_DIMS`), and never on a persistent
  grid or at head_dim 256; `opaque_resident=None` and `deferred_dq=None`
  go with it at d=128."""
  from pallas_kernels.mosaic import backward
  monkeypatch.setattr(backward, "FUSED_DQ_MIN_KV_LEN", {128: 512, 64: 512})
  monkeypatch.setattr(backward, "FUSED_DQ_CAUSAL_HEAD_DIMS", (64, 128))
  default = lambda d, n, block_q=64, **kw: backward.fused_dq_by_default(
      head_dim=d, kv_len=n, block_q=block_q, **kw)
  assert default(128, 512) and not default(128, 256)
  assert default(128, 512, is_causal=True)
  assert default(64, 512, block_q=128, is_causal=True)
  q, kv = _structs(head_dim=128, q_len=512, kv_len=512)[:2]
  for is_causal in (False, True):
    _, [fused] = backward.configure(q, kv, scale=0.1, is_causal=is_causal)
    assert fused.fused_dq and fused.opaque_resident and fused.deferred_dq
    assert not fused.tile_fastest  # the fused dQ keeps its own order
  q, kv = _structs(head_dim=128, q_len=2048, kv_len=256)[:2]
  dq, [plain] = backward.configure(q, kv, scale=0.1, is_causal=True,
                                   persistent=False)
  assert not (plain.fused_dq or plain.opaque_resident or plain.deferred_dq)
  assert plain.tile_fastest and dq.tile_fastest  # two kernels, launch grid
  monkeypatch.setattr(backward, "FUSED_DQ_CAUSAL_HEAD_DIMS", ())
  assert not default(128, 512, is_causal=True)
  assert not default(64, 512, block_q=128, is_causal=True)
  monkeypatch.setattr(backward, "FUSED_DQ_CAUSAL_HEAD_DIMS", (64, 128))
  assert not default(256, 4096)
  # head_dim 64 with 64-row Q tiles is one dQ piece: two consumers cannot
  # share it, so the default keeps the two kernels rather than refusing.
  assert default(64, 512, block_q=128) and not default(64, 512)
  assert _kernels(_lower(64, True, q_len=512, kv_len=512)) == {"dq", "dkdv"}
  assert _kernels(_lower(128, True, q_len=512, kv_len=512)) == {"dq_dkdv"}
  assert _kernels(_lower(128, True, q_len=256, kv_len=256)) == {"dq", "dkdv"}
  assert _kernels(_lower(128, True, q_len=512, kv_len=512,
                         persistent=True)) == {"dq", "dkdv"}


def test_tile_fastest_backward_lowers_and_changes_the_grids(cuda_lowering):
  """`tile_fastest` launches both kernels' launch grids in the other order
  (so it changes them) and lowers, also at head_dim 256's two dK/dV
  passes; the fused dQ, whose K/V tiles wait for each other, refuses it."""
  for head_dim in (128, 256):
    text = lambda **kw: _lower(head_dim, True, persistent=False, **kw)
    assert text(tile_fastest=True) != text(tile_fastest=False)
  with pytest.raises(NotImplementedError, match="own order"):
    _lower(128, False, fused_dq=True, tile_fastest=True)


def _fused_everywhere(monkeypatch):
  from pallas_kernels.mosaic import backward
  monkeypatch.setattr(backward, "FUSED_DQ_MIN_KV_LEN", {64: 0, 128: 0})
  monkeypatch.setattr(backward, "FUSED_DQ_CAUSAL_HEAD_DIMS", (64, 128))


def _assert_backward_is_fused(attention, case: Case):
  """The gradient of `attention` (q, k, v -> (out, lse)) at `case`'s shapes
  lowers to the one fused backward kernel, and no other."""
  assert backward_kernels(attention, case) == {"dq_dkdv"}


def backward_kernels(attention, case: Case):
  """The backward kernels (`_kernels`) that the gradient of `attention`
  (q, k, v -> (out, lse)) lowers to at `case`'s shapes, for CUDA."""
  q = jax.ShapeDtypeStruct(
      (case.batch, case.q_len, case.num_heads, case.head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct(
      (case.batch, case.kv_len, case.num_kv_heads, case.head_dim),
      jnp.bfloat16)
  grad = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)[0].astype(
      jnp.float32)), (0, 1, 2))
  return _kernels(jax.jit(grad).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text())


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", [
    Case(2, 1024, 1024, 8, 8, 64),    # d=64 ships 128-row Q tiles
    Case(1, 256, 640, 4, 1, 64),      # MQA, kv_len > q_len
    Case(2, 512, 1024, 8, 2, 128),    # GQA 4:1
    Case(1, 1024, 384, 4, 2, 128),    # q_len > kv_len, odd K/V tile count
], ids=str)
def test_fused_dq_matches_reference_on_gpu(case, is_causal, monkeypatch):
  """The fused backward through the dispatch, in both dtypes, against the
  reference; and the fused kernel is what ran."""
  _require_sm90()
  from pallas_kernels.mosaic import attention as mosaic_attention
  _fused_everywhere(monkeypatch)
  attention = jax.jit(lambda q, k, v: _api_layout(*mosaic_attention.
      mosaic_attention(q, k, v, scale=q.shape[-1]**-0.5, is_causal=is_causal,
                       backward_blocks=BlockSizes.get_default(case.head_dim))))
  _assert_backward_is_fused(attention, case)
  for dtype in (jnp.bfloat16, jnp.float16):
    check_against_reference(attention, case, dtype, is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (64, dict(block_q=128, dq_tiles=(64, 128))),
    (128, dict(dq_tiles=(64, 128))),
], ids=str)
def test_dq_tiles_match_reference_on_gpu(head_dim, kwargs, is_causal):
  """The dQ kernel on tiles of its own (`dq_tiles`: 128 K/V rows a step)
  beside the dK/dV kernel's: forward, LSE and gradients against the
  reference (GQA 4:1, kv_len > q_len, launch grid)."""
  _require_sm90()
  attention = jax.jit(functools.partial(
      mosaic_attention_with(fused_dq=False, persistent=False, **kwargs),
      is_causal=is_causal))
  check_against_reference(attention, Case(1, 1024, 1536, 8, 2, head_dim),
                          jnp.bfloat16, is_causal=is_causal)


def test_backward_defaults_at_long_kv():
  """What `configure` picks at `test_backward_default_at_long_kv_on_gpu`'s
  shapes (q_len 15360, kv_len 16384, GQA 2:1): without a mask at d=128 the
  fused dQ (deferred, merged, opaque descriptors, lse read early), at d=64
  the two kernels on the launch grid with the dK/dV kernel's Sᵀ issued a
  step ahead (`SCORES_AHEAD_LAUNCH_TILES`; since session 24); under causal
  masking the two kernels on the launch grid, tile-fastest, lean
  producers, at d=64 the dQ kernel on 64 x 128 tiles
  (`DQ_TILES_CAUSAL_LAUNCH`), at d=128 lse read early
  (`CAUSAL_LAUNCH_LEAN_HEAD_DIMS`)."""
  from pallas_kernels.mosaic import attention as mosaic_attention
  from pallas_kernels.mosaic import backward
  for head_dim in (64, 128):
    q, kv = _structs(batch=1, q_len=15360, kv_len=16384, head_dim=head_dim)[:2]
    tiles = mosaic_attention.backward_tiles(head_dim, 15360)
    configs = lambda is_causal: backward.configure(
        q, kv, scale=0.1, is_causal=is_causal, **tiles)
    dq, dkdvs = configs(False)
    if head_dim == 128:
      [fused] = dkdvs
      assert dq is None and fused.fused_dq and not fused.persistent
      assert (fused.deferred_dq and fused.merged_pieces
              and fused.opaque_resident and fused.prefetch_lse)
      assert not (fused.scores_ahead or fused.hw_ds_sync)
    else:
      [dkdv] = dkdvs
      assert not (dkdv.fused_dq or dkdv.persistent or dq.persistent)
      assert dkdv.scores_ahead and not dq.scores_ahead
      assert dkdv.block_q == 128 and dkdv.tile_fastest
    dq, [dkdv] = configs(True)
    assert not dkdv.scores_ahead
    assert not (dkdv.fused_dq or dkdv.persistent or dq.persistent)
    assert dq.tile_fastest and dkdv.tile_fastest
    assert dq.lean_producer and dkdv.lean_producer
    want_tiles = (64, 128) if head_dim == 64 else (64, 64)
    assert (dq.block_q, dq.block_kv) == want_tiles
    assert dkdv.prefetch_lse == (head_dim == 128)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, is_causal, kernels", [
    (64, False, {"dq", "dkdv"}), (64, True, {"dq", "dkdv"}),
    (128, False, {"dq_dkdv"}), (128, True, {"dq", "dkdv"}),
])
def test_backward_default_at_long_kv_on_gpu(head_dim, is_causal, kernels):
  """The shipped defaults, no switch turned: `flash_attention` at kv_len
  16384 runs the fused backward at d=128 without a mask, else the two
  kernels
  (which options they take, `test_backward_defaults_at_long_kv` pins on
  the CPU), and its
  output, LSE and gradients obey the tolerance rule (GQA 2:1, q_len not
  the kv_len)."""
  _require_sm90()
  import jax_flash
  case = Case(1, 15360, 16384, 4, 2, head_dim)
  attention = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=is_causal, return_residual=True,
      implementation="mosaic"))
  assert backward_kernels(attention, case) == kernels
  check_against_reference(attention, case, jnp.bfloat16, is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_dq_is_deterministic_on_gpu(head_dim, is_causal):
  """Many K/V tiles add to each dQ tile; their fixed order makes the f32
  sums, so the gradients, bitwise the same run after run (an add out of
  turn would round differently). Without a mask dk and dv are the unfused
  kernel's bit for bit (the same steps in the same order); under causal
  masking the fused kernel walks the Q tiles downwards, and dq always sums
  in another order: those differ from the unfused kernel only by
  rounding."""
  _require_sm90()
  case = Case(2, 2048, 2048, 8, 2, head_dim)   # 16 K/V tiles per Q tile
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, 21)
  scale = head_dim**-0.5
  out, lse = mosaic_forward(q, k, v, scale=scale, is_causal=is_causal)
  d_lse = jnp.transpose(d_lse, (0, 2, 1))
  tiles = dict(block_q=128) if head_dim == 64 else {}
  run = lambda fused: jax.jit(functools.partial(
      mosaic_backward, scale=scale, is_causal=is_causal, fused_dq=fused,
      persistent=False, **tiles))(q, k, v, out, lse, d_out, d_lse)
  first = run(True)
  for _ in range(3):
    for a, b, name in zip(run(True), first, ("dq", "dk", "dv")):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=name)
  unfused = run(False)
  for a, b, name in zip(first, unfused, ("dq", "dk", "dv")):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if name == "dq" or is_causal:
      np.testing.assert_allclose(a, b, rtol=0.02, atol=0.02 * np.abs(b).max(),
                                 err_msg=name)
    else:
      np.testing.assert_array_equal(a, b, err_msg=name)


def test_warp_map_probe_lowers_in_every_layout(cuda_lowering):
  """`benchmarks.probe_warp_map` (the check of the writer-as-a-warp layout
  to run first on a GPU, NOTES) lowers for CUDA in each of its layouts,
  so that it is ready when device time is."""
  from benchmarks import probe_warp_map
  for layout in probe_warp_map.LAYOUTS:
    assert probe_warp_map.lower_one(layout) == "lowers"


@pytest.mark.gpu
def test_warp_map_probe_ships_layout_on_gpu():
  """The layout the fused dQ ships (producer and writer warpgroups of their
  own) gives the right sum on the GPU: the probe's control."""
  _require_sm90()
  from benchmarks import probe_warp_map
  assert probe_warp_map.run_one("separate") == "ok"


def test_turn_cost_diagnostic_removes_only_the_turn_waits(
    cuda_lowering):
  """`tune_mosaic --kernels backward_turn_cost`'s unordered candidate is
  the fused kernel without its turn waits: traced under its patch the
  module changes (the patch reaches the kernel), and the two-kernel
  backward does not (it has no turns)."""
  from benchmarks.tune_mosaic import turns_removed
  fused = lambda: _lower(128, False, fused_dq=True, persistent=False)
  two = lambda: _lower(128, False, fused_dq=False, persistent=False)
  shipped, plain = fused(), two()
  with turns_removed():
    assert fused() != shipped
    assert two() == plain
  assert fused() == shipped
