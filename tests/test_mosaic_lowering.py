"""The Mosaic GPU (sm90) forward: cross-lowered for CUDA on CPU, checked on a GPU.

Lowering runs Pallas -> Mosaic GPU -> NVVM in Python (layout inference,
barrier and TMA lowering, the MLIR verifier) and so catches most kernel errors
without a GPU; PTX generation and the run itself need the `-m gpu` test.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from pallas_kernels import compat as versions
from tests.attention_checks import (Case, assert_forward_within_rule,
                                    check_against_reference, random_inputs)

try:
  from pallas_kernels.mosaic.forward import mosaic_forward
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

_CUSTOM_CALL = "mosaic_gpu_v2"
_KERNEL_NAME = "mosaic_flash_forward"



def _lower(head_dim, is_causal, *, q_len=256, kv_len=384, **blocks):
  q = jax.ShapeDtypeStruct((2, q_len, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), jnp.bfloat16)

  def forward(q, k, v):
    return mosaic_forward(q, k, v, scale=head_dim**-0.5, is_causal=is_causal,
                          **blocks)

  lowered = jax.jit(forward).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",))
  out, lse = lowered.out_info
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (2, 4, q_len) and lse.dtype == jnp.float32
  return lowered.as_text()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward_lowers_for_cuda(head_dim, is_causal, lowering_semantics):
  text = _lower(head_dim, is_causal)
  assert _CUSTOM_CALL in text
  assert _KERNEL_NAME in text


def test_causal_launch_order_changes_only_causal_kernels(cuda_lowering):
  """`heavy_first` reorders causal tiles of the launch grid
  (`forward.tile_index`); without a mask every tile costs the same, and the
  kernel is left as it was."""
  text = lambda causal, heavy_first: _lower(128, causal, persistent=False,
                                          heavy_first=heavy_first)
  assert text(True, True) != text(True, False)
  assert text(False, True) == text(False, False)


def test_tile_fastest_launch_order_lowers_and_changes_the_grid(cuda_lowering):
  """`tile_fastest` launches the launch grid in the other order (so it
  changes the kernel) and lowers; the persistent grid has its own order,
  which it leaves alone."""
  for causal in (False, True):
    text = lambda **kw: _lower(128, causal, persistent=False, **kw)
    assert text(tile_fastest=True) != text(tile_fastest=False)
  assert (_lower(64, True, persistent=True, num_ctas=3, tile_fastest=True)
          == _lower(64, True, persistent=True, num_ctas=3, tile_fastest=False))


def test_tile_fastest_default_is_the_causal_launch_grid(cuda_lowering):
  """By default a causal call on the launch grid launches tile-fastest (the
  session 13 A/B); a non-causal one keeps the launch grid's other order
  (the persistent grid is its default)."""
  from pallas_kernels.mosaic import forward
  assert forward.tile_fastest_by_default(is_causal=True, persistent=False)
  assert not forward.tile_fastest_by_default(is_causal=True, persistent=True)
  assert not forward.tile_fastest_by_default(is_causal=False,
                                             persistent=False)
  causal = lambda **kw: _lower(256, True, persistent=False, **kw)
  assert causal() == causal(tile_fastest=True) != causal(tile_fastest=False)
  full = lambda **kw: _lower(128, False, persistent=False, **kw)
  assert full() == full(tile_fastest=False)


# The forward's consumer schedules: the plain one (each consumer waits for V
# after the whole hand-over) and the variants, each spelled out in full, since
# `split_handover` is on by default (measured in session 5, NOTES.md).
PLAIN_SCHEDULE = dict(fence_softmax=False, split_handover=False)
SCHEDULE_VARIANTS = [dict(fence_softmax=True, split_handover=False),
                     dict(split_handover=True),
                     dict(fence_softmax=True, split_handover=True),
                     dict(overlap_scores=True)]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("variant", SCHEDULE_VARIANTS,
                         ids=["fence", "split", "both", "overlap"])
def test_schedule_variants_lower_and_change_the_kernel(variant, is_causal,
                                                       lowering_semantics):
  """The consumer schedule variants (`forward.KernelStatic`) lower in both
  semantics, and each changes the plain schedule's kernel (an option that
  did nothing could not be measured); `split_handover` is the default."""
  text = _lower(128, is_causal, **variant)
  assert _CUSTOM_CALL in text
  assert text != _lower(128, is_causal, **PLAIN_SCHEDULE)
  defaults = inspect.signature(mosaic_forward).parameters
  assert defaults["split_handover"].default is True
  assert not defaults["fence_softmax"].default
  assert not defaults["overlap_scores"].default


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("shape", [
    dict(q_len=128, kv_len=128),                  # one K/V block: no loop
    dict(q_len=128, kv_len=640),                  # causal: keys never seen
    dict(q_len=512, kv_len=256, block_kv=64),     # causal: rows past kv_len
], ids=str)
def test_overlapped_forward_lowers(shape, head_dim, is_causal,
                                   lowering_semantics):
  """`overlap_scores` at the other head dims and at the loop's edges (a
  single block, where only the prologue and epilogue run)."""
  assert _CUSTOM_CALL in _lower(head_dim, is_causal, overlap_scores=True,
                                **shape)


@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_lowers_deeper_pipeline(is_causal, cuda_lowering):
  # q_len > kv_len: under causal masking the last row tiles see every block.
  text = _lower(64, is_causal, q_len=512, kv_len=256, block_kv=64,
                max_concurrent_steps=3)
  assert _CUSTOM_CALL in text


def test_padded_head_dim_lowers_with_gradients(cuda_lowering):
  """Head dim 96 runs the 128 kernels on zero-padded inputs."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import mosaic_attention
  x = jax.ShapeDtypeStruct((1, 256, 2, 96), jnp.bfloat16)

  def loss(q, k, v):
    out, lse = mosaic_attention(q, k, v, scale=96**-0.5, is_causal=True,
                                backward_blocks=BlockSizes.get_default(
                                    96, "NVIDIA H200"))
    return out.astype(jnp.float32).sum() + lse.sum()

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
      lowering_platforms=("cuda",))
  assert [g.shape for g in lowered.out_info] == [x.shape] * 3
  assert _KERNEL_NAME in lowered.as_text()


@pytest.mark.parametrize("kwargs, match", [
    (dict(q_len=200), "q_len 200"),
    (dict(kv_len=200), "kv_len 200"),
    (dict(head_dim=96), "head_dim"),
    (dict(dtype=jnp.float32), "bfloat16 and float16"),
    (dict(scale=-1.0), "positive"),
    (dict(head_dim=256, block_kv=128), "shared memory"),
])
def test_unsupported_calls_raise_not_implemented(kwargs, match):
  """These make a dispatcher fall back to the Triton kernels."""
  head_dim = kwargs.pop("head_dim", 64)
  dtype = kwargs.pop("dtype", jnp.bfloat16)
  q = jax.ShapeDtypeStruct((1, kwargs.pop("q_len", 256), 2, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((1, kwargs.pop("kv_len", 256), 1, head_dim),
                            dtype)
  scale = kwargs.pop("scale", 0.125)
  with pytest.raises(NotImplementedError, match=match):
    mosaic_forward(q, kv, kv, scale=scale, is_causal=False, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", [
    Case(2, 1024, 1024, 8, 8, 64),
    Case(2, 512, 1024, 8, 2, 128),    # GQA 4:1, kv_len > q_len
    Case(1, 1024, 512, 4, 1, 256),    # MQA, q_len > kv_len
    Case(1, 4096, 4096, 4, 4, 128),
    Case(1, 1024, 768, 4, 2, 96),     # padded to 128 outside the kernel
], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mosaic_matches_reference_on_gpu(case, is_causal, dtype):
  """Forward and gradients by the Mosaic kernels, through `flash_attention`
  (the Mosaic backward is the Mosaic path's default since 2026-11-29)."""
  _check_mosaic_against_reference(case, dtype, is_causal)


def _require_sm90():
  if (versions.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic forward needs sm90 (wgmma, TMA, setmaxnreg)")


def _check_mosaic_against_reference(case, dtype, is_causal):
  """`flash_attention(implementation="mosaic")`'s output, LSE and gradients
  against the reference (FlashAttention's tolerance rule)."""
  _require_sm90()

  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, is_causal=is_causal,
                                     return_residual=True,
                                     implementation="mosaic")

  check_against_reference(attention, case, dtype, is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_schedule_variants_are_bitwise_the_default_on_gpu(head_dim,
                                                          is_causal):
  """The consumer schedule variants change when things run, not what is
  computed: out and lse equal the default kernel's bit for bit (a race on
  a reordered barrier would not)."""
  _require_sm90()
  q, k, v, _, _ = random_inputs(Case(2, 2048, 2048, 8, 2, head_dim),
                                jnp.bfloat16, 3)
  # O rescaled every step throughout: `overlap_scores` has no lazy form.
  run = lambda **variant: jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=head_dim**-0.5, is_causal=is_causal, lazy_rescale=False,
      **variant))(q, k, v)
  want = run(**PLAIN_SCHEDULE)
  for variant in (dict(), *SCHEDULE_VARIANTS):
    for a, b in zip(run(**variant), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=str(variant))


# Persistent grids that make CTAs walk several tiles, with the ring's slots
# and barrier phases running on across tiles: one CTA, a count that divides
# neither the tiles nor the stages, and the SM count.
PERSISTENT_CTAS = [1, 3, None]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("num_ctas", PERSISTENT_CTAS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_persistent_forward_lowers(head_dim, num_ctas, is_causal,
                                   lowering_semantics):
  """`persistent=True` lowers in both semantics (O staged apart at head_dim
  <= 128, through Q's buffer at 256) and is a different kernel; with
  `overlap_scores` it is NotImplementedError; the default where measured
  faster (results/h200_mosaic_persistent.md)."""
  from pallas_kernels.mosaic import forward
  text = _lower(head_dim, is_causal, persistent=True, num_ctas=num_ctas)
  assert _KERNEL_NAME in text
  assert text != _lower(head_dim, is_causal, persistent=False)
  static = forward.persistent_static(
      forward.check_supported(
          jnp.zeros((2, 256, 4, head_dim), jnp.bfloat16),
          *[jnp.zeros((2, 384, 2, head_dim), jnp.bfloat16)] * 2, scale=1.0,
          is_causal=False, block_q=64,
          block_kv=forward.default_block_kv(head_dim),
          max_concurrent_steps=2), (2, 256, 4, head_dim), num_ctas)
  assert static.stage_o_apart == (head_dim <= 128)
  assert static.num_ctas == min(num_ctas or 132, 2 * 4 * 2)
  with pytest.raises(NotImplementedError, match="overlap_scores"):
    _lower(head_dim, is_causal, persistent=True, overlap_scores=True)
  if num_ctas is None:
    persistent_default = forward.persistent_by_default(
        is_causal=is_causal, head_dim=head_dim, kv_len=384)
    assert (_lower(head_dim, is_causal) == text) == persistent_default


def _forward_runner(head_dim, is_causal, *, seed):
  """`run(**options) -> (out, lse)`: `mosaic_forward` with `options` on one
  set of random GQA 4:1 inputs (b2, q1024, k1536, h8:2), for comparing
  options bit for bit. Skips without sm90."""
  _require_sm90()
  q, k, v, _, _ = random_inputs(Case(2, 1024, 1536, 8, 2, head_dim),
                                jnp.bfloat16, seed)
  return lambda **kwargs: jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=head_dim**-0.5, is_causal=is_causal, **kwargs))(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_persistent_forward_is_bitwise_the_grid_on_gpu(head_dim, is_causal):
  """The persistent grid computes each tile as the launch grid does, so
  out and lse equal it bit for bit, for CTAs walking 1 to 32 tiles (a
  barrier phase or ring slot off by one across tiles would not); and the
  reference agrees, through `flash_attention`, in both dtypes."""
  run = _forward_runner(head_dim, is_causal, seed=4)
  want = run(persistent=False)
  for num_ctas in (*PERSISTENT_CTAS, 7):
    for a, b in zip(run(persistent=True, num_ctas=num_ctas), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=f"num_ctas {num_ctas}")


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tile_fastest_forward_is_bitwise_the_default_order_on_gpu(
    head_dim, is_causal):
  """The launch grid launched tile-fastest runs the same tiles in another
  order: out and lse equal the default order's bit for bit."""
  run = _forward_runner(head_dim, is_causal, seed=31)
  want = run(persistent=False, tile_fastest=False)
  for a, b in zip(run(persistent=False, tile_fastest=True), want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_lean_producer_lowers_and_changes_the_forward(head_dim,
                                                      cuda_lowering):
  """`lean_producer` (consumers at 240 registers, the producer at 24)
  lowers on either grid and is another kernel; three consumers refuse it
  (their budget is 3 * 160 + 32)."""
  for persistent in (False, True):
    text = lambda **kw: _lower(head_dim, False, persistent=persistent, **kw)
    assert text(lean_producer=True) != text()
  with pytest.raises(NotImplementedError, match="lean_producer"):
    _lower(64, False, num_consumers=3, lean_producer=True)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_sum_after_pv_lowers_and_changes_the_forward(head_dim,
                                                     lowering_semantics):
  """`sum_after_pv` (P's row sum after P V is issued) lowers on either
  grid, with lean producers too, and is another kernel; `overlap_scores`,
  which orders its steps its own way, refuses it."""
  for kwargs in (dict(persistent=False), dict(persistent=True),
                 dict(lean_producer=True)):
    text = lambda **kw: _lower(head_dim, True, **kwargs, **kw)
    assert text(sum_after_pv=True) != text(sum_after_pv=False)
  with pytest.raises(NotImplementedError, match="sum_after_pv"):
    _lower(head_dim, False, persistent=False, overlap_scores=True,
           sum_after_pv=True)


def test_sum_after_pv_default_is_d128_without_a_mask(cuda_lowering):
  """By default the row sum follows P V at head_dim 128 without a causal
  mask only (session 16's A/B), and never under `overlap_scores` (which
  refuses it: the default must not ask for it there)."""
  from pallas_kernels.mosaic import forward
  default = lambda d, causal, **kw: forward.sum_after_pv_by_default(
      head_dim=d, is_causal=causal, **kw)
  assert default(128, False)
  assert not default(128, True)
  assert not default(64, False) and not default(256, False)
  assert not default(128, False, overlap_scores=True)
  for causal in (False, True):
    text = lambda **kw: _lower(128, causal, **kw)
    assert text() == text(sum_after_pv=not causal)
  _lower(128, False, persistent=False, overlap_scores=True)  # no raise


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lazy_rescale_lowers_and_changes_the_forward(head_dim,
                                                     lowering_semantics):
  """`lazy_rescale` (O rescaled only where a row's max moved) lowers on
  either grid and with `sum_after_pv`, at thresholds 0 and 8, and is
  another kernel; a threshold out of range is a ValueError naming it, and
  `overlap_scores` (its own step) refuses it."""
  for kwargs in (dict(persistent=False), dict(persistent=True),
                 dict(sum_after_pv=True)):
    text = lambda **kw: _lower(head_dim, True, **kwargs, **kw)
    plain = text(lazy_rescale=False)
    lazy = {t: text(lazy_rescale=True, rescale_threshold=t) for t in (0.0, 8.0)}
    assert plain not in lazy.values() and lazy[0.0] != lazy[8.0]
  for threshold in (-1.0, 9.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="rescale_threshold"):
      _lower(head_dim, False, lazy_rescale=True, rescale_threshold=threshold)
  with pytest.raises(NotImplementedError, match="lazy_rescale"):
    _lower(head_dim, False, persistent=False, overlap_scores=True,
           lazy_rescale=True)


def test_rescale_per_warp_lowers_and_changes_the_forward(cuda_lowering):
  """The lazy rescale's skip decided per warp (a `vote.sync`) lowers, is
  another kernel than per thread, and is the default with the lazy
  rescale; without `lazy_rescale` it is a ValueError naming it."""
  for head_dim, causal in ((128, False), (256, True)):
    text = lambda **kw: _lower(head_dim, causal, lazy_rescale=True, **kw)
    assert text(rescale_per_warp=False) != text()
    assert text(rescale_per_warp=True) == text()  # the default
  with pytest.raises(ValueError, match="rescale_per_warp"):
    _lower(256, False, lazy_rescale=False, rescale_per_warp=True)


def test_lazy_rescale_default_follows_the_measured_table(cuda_lowering):
  """By default O is rescaled lazily at d=256 and at d=128 without a mask
  (session 18's A/B), at threshold 8, and never under `overlap_scores`
  (which refuses it: the default must not ask for it there)."""
  from pallas_kernels.mosaic import forward
  default = lambda d, causal, **kw: forward.lazy_rescale_by_default(
      head_dim=d, is_causal=causal, **kw)
  assert default(256, False) and default(256, True) and default(128, False)
  assert not default(128, True)
  assert not default(64, False) and not default(64, True)
  assert not default(256, False, overlap_scores=True)
  for head_dim in (64, 128, 256):
    for causal in (False, True):
      want = default(head_dim, causal)
      text = lambda **kw: _lower(head_dim, causal, **kw)
      assert text() == text(lazy_rescale=want, rescale_threshold=8.0)
      assert text() != text(lazy_rescale=not want)
  _lower(256, False, persistent=False, overlap_scores=True)  # no raise


def test_skip_spare_lowers_where_a_tile_is_short(cuda_lowering):
  """`skip_spare` makes another kernel where three consumers meet a short
  last tile without a causal mask (on either grid), the default there, and
  changes nothing where tiles are whole or the mask is causal."""
  for kwargs in (dict(persistent=True), dict(persistent=False)):
    text = lambda **kw: _lower(64, False, q_len=1024, kv_len=1024,
                               num_consumers=3, **kwargs, **kw)
    assert text(skip_spare=True) == text() != text(skip_spare=False)
  whole = lambda **kw: _lower(64, False, q_len=1152, kv_len=1024,
                              num_consumers=3, **kw)
  causal = lambda **kw: _lower(64, True, q_len=1024, kv_len=1024,
                               num_consumers=3, **kw)
  for text in (whole, causal):
    assert text(skip_spare=True) == text(skip_spare=False)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [
    dict(persistent=True), dict(persistent=True, num_ctas=7),
    dict(persistent=True, num_ctas=1), dict(persistent=False),
    dict(persistent=False, hw_turns=False),
    # mbarrier turns whose phases carry from a CTA's short tile to its
    # next (session 23's review)
    dict(persistent=True, num_ctas=7, hw_turns=False)], ids=str)
@pytest.mark.parametrize("q_len", [1024, 1088])
def test_skip_spare_is_bitwise_on_gpu(q_len, kwargs):
  """Spare consumers that skip their math (the default) change nothing
  that is computed: out and lse equal theirs computing, bit for bit, three
  runs in a row, with two spare consumers (q_len 1024 = 5 * 192 + 64) or
  one (1088 = 5 * 192 + 128) in each head's last tile, GQA 4:1, on either
  grid (a spare consumer that released a slot or passed a turn too often
  or not at all would hang; the interpreter's cases catch those on a CPU).
  lse bitwise since its add is unfused (`forward._add_unfused`)."""
  _require_sm90()
  q, k, v, _, _ = random_inputs(Case(2, q_len, 1536, 8, 2, 64),
                                jnp.bfloat16, seed=97)
  run = lambda **kw: jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=64**-0.5, is_causal=False, num_consumers=3,
      **kwargs, **kw))(q, k, v)
  want = run(skip_spare=False)
  for attempt in range(3):
    for a, b in zip(run(skip_spare=True), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=f"run {attempt}")


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lazy_rescale_at_zero_is_bitwise_on_gpu(head_dim, is_causal,
                                                persistent):
  """Threshold 0: the max moves on any growth, as without the option, and
  only multiplies by alphas of exactly 1 are skipped: out and lse equal
  the default's bit for bit (a thread that skipped its multiply where one
  of its rows' max moved, or a branch that returned the wrong registers,
  would not)."""
  run = _forward_runner(head_dim, is_causal, seed=73)
  want = run(persistent=persistent, lazy_rescale=False)
  for a, b in zip(run(persistent=persistent, lazy_rescale=True,
                      rescale_threshold=0.0), want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_rescale_per_warp_is_bitwise_per_thread_on_gpu(head_dim, is_causal):
  """Deciding the lazy rescale's skip per warp only adds multiplies by
  exactly 1: out and lse equal the per-thread decision's bit for bit, at
  scores 8x the usual spread so that maxima keep moving (a warp vote that
  skipped where a thread needed its multiply would not)."""
  _require_sm90()
  q, k, v, _, _ = random_inputs(Case(2, 1024, 1536, 8, 2, head_dim),
                                jnp.bfloat16, seed=83)
  run = lambda **kw: jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=8 * head_dim**-0.5, is_causal=is_causal,
      lazy_rescale=True, **kw))(q, k, v)
  for a, b in zip(run(rescale_per_warp=True), run(rescale_per_warp=False)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("spread", [1, 8])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lazy_rescale_forward_matches_reference_on_gpu(head_dim, is_causal,
                                                       spread):
  """Threshold 8 (P up to 2**8 between rescales) against the float32
  reference, within DESIGN's rule; at `spread` 8 the scores are 8x the
  usual, so that rows' maxima keep moving by more than 8 after the first
  K/V tile (GQA 4:1, kv_len > q_len)."""
  _require_sm90()
  q, k, v, _, _ = random_inputs(Case(2, 1024, 1536, 8, 2, head_dim),
                                jnp.bfloat16, seed=79)
  scale = spread * head_dim**-0.5
  out, lse = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=scale, is_causal=is_causal, lazy_rescale=True,
      rescale_threshold=8.0))(q, k, v)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal,
                             scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [
    dict(persistent=False), dict(persistent=True),
    dict(lean_producer=True), dict(lean_producer=True, persistent=False),
], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sum_after_pv_forward_is_bitwise_on_gpu(head_dim, is_causal, kwargs):
  """P's row sum taken while P V runs is the same sum: out and lse equal
  the default order's bit for bit (a sum read from the wrong registers, or
  l carried wrongly through the wgmma's scope, would not)."""
  if kwargs.get("lean_producer") and head_dim == 64:
    pytest.skip("d=64 runs three consumers; lean_producer takes two")
  run = _forward_runner(head_dim, is_causal, seed=67)
  want = run(sum_after_pv=False, **kwargs)
  for a, b in zip(run(sum_after_pv=True, **kwargs), want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_lean_producer_forward_is_bitwise_on_gpu(head_dim, is_causal,
                                                 persistent):
  """With the consumers at 240 registers out and lse equal the default's
  bit for bit (a register budget that did not add up would hang)."""
  run = _forward_runner(head_dim, is_causal, seed=59)
  want = run(persistent=persistent)
  for a, b in zip(run(persistent=persistent, lean_producer=True), want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kv_len", [(128, 16384), (256, 8192)])
def test_causal_forward_default_at_long_kv_on_gpu(head_dim, kv_len):
  """The shipped causal default at long kv_len, no switch turned (session
  13: the launch grid, tile-fastest): `flash_attention`'s output, LSE and
  gradients obey the tolerance rule (GQA 2:1), and its forward is bitwise
  `mosaic_forward(persistent=False, tile_fastest=True)`."""
  _require_sm90()
  from pallas_kernels.mosaic import forward
  assert not forward.persistent_by_default(is_causal=True, head_dim=head_dim,
                                           kv_len=kv_len)
  case = Case(1, kv_len, kv_len, 4, 2, head_dim)
  attention = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=True, return_residual=True, implementation="mosaic"))
  check_against_reference(attention, case, jnp.bfloat16, is_causal=True)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, 43)
  out, lse = attention(q, k, v)
  want_out, want_lse = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=head_dim**-0.5, is_causal=True, persistent=False,
      tile_fastest=True))(q, k, v)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
  np.testing.assert_array_equal(np.asarray(lse),
                                np.asarray(jnp.swapaxes(want_lse, 1, 2)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    Case(2, 512, 1024, 8, 2, 128),    # GQA 4:1, kv_len > q_len
    Case(1, 1024, 512, 4, 1, 256),    # MQA, q_len > kv_len
    Case(3, 384, 640, 5, 5, 64),      # odd tile counts
], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_persistent_forward_matches_reference_on_gpu(case, dtype, is_causal,
                                                     monkeypatch):
  from pallas_kernels.mosaic import forward
  monkeypatch.setattr(forward, "PERSISTENT_BY_DEFAULT", True)
  monkeypatch.setattr(forward, "PERSISTENT_CAUSAL_MAX_KV_LEN",
                      {64: None, 128: None, 256: None})
  _check_mosaic_against_reference(case, dtype, is_causal)


def test_dispatch_on_hopper_lowers_the_expected_kernels(cuda_lowering,
                                                         monkeypatch):
  """`implementation=None` as on an H200, cross-lowered: Mosaic for aligned
  and ragged 16-bit calls (ragged through the masked forward), Triton for
  float32 and for ALiBi (the same expectations as the GPU's
  `test_implementation_none_uses_kernels_on_gpu`)."""
  monkeypatch.setattr(versions, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(versions, "has_gpu", lambda: True)

  def lowered(dtype, q_len, **kwargs):
    q = jax.ShapeDtypeStruct((1, q_len, 4, 64), dtype)
    return jax.jit(lambda q, k, v: jax_flash.flash_attention(
        q, k, v, interpret=False, **kwargs)).trace(q, q, q).lower(
            lowering_platforms=("cuda",)).as_text()

  for text in (lowered(jnp.bfloat16, 512), lowered(jnp.bfloat16, 500)):
    assert _KERNEL_NAME in text
  for text in (lowered(jnp.float32, 512),
               lowered(jnp.bfloat16, 512, alibi_slopes=jnp.ones(4))):
    assert _KERNEL_NAME not in text and "flash_forward" in text


def test_persistent_default_follows_the_measured_table():
  """Non-causal always; causal where the A/B found it faster (the table);
  never with overlap_scores."""
  from pallas_kernels.mosaic import forward
  default = lambda causal, d, n, **kw: forward.persistent_by_default(
      is_causal=causal, head_dim=d, kv_len=n, **kw)
  assert all(default(False, d, n) for d in (64, 128, 256)
             for n in (128, 1024, 16384))
  assert default(True, 64, 1024) and default(True, 64, 16384)
  assert default(True, 128, 8192) and not default(True, 128, 16384)
  assert default(True, 256, 4096) and not default(True, 256, 16384)
  assert not default(False, 128, 1024, overlap_scores=True)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape, head_dim, num_ctas", [
    ((2, 1024, 4), 128, 5),    # 8 tiles per head
    ((1, 768, 3), 64, 4),      # 6 tiles per head, 18 in all
    ((3, 384, 1), 256, 2),     # 3 per head: odd, pairs cross heads
    ((1, 128, 1), 128, 1),     # one tile
])
def test_persistent_tiles_cover_every_tile_once(shape, head_dim, num_ctas,
                                               is_causal):
  """The persistent CTAs' tiles are every (batch, head, q tile) once; under
  causal masking, heaviest paired with lightest, the CTAs' K/V block counts
  differ by at most one pair's (the launch grid's tail is up to a whole
  head's heaviest tiles)."""
  from pallas_kernels.mosaic import forward
  batch, q_len, heads = shape
  q = jnp.zeros((batch, q_len, heads, head_dim), jnp.bfloat16)
  kv = jnp.zeros((batch, q_len, heads, head_dim), jnp.bfloat16)
  static = forward.persistent_static(forward.check_supported(
      q, kv, kv, scale=1.0, is_causal=is_causal, block_q=64,
      block_kv=forward.default_block_kv(head_dim), max_concurrent_steps=2),
                                     q.shape, num_ctas)
  seen, loads = [], []
  for cta in range(static.num_ctas):
    tiles = forward.persistent_tiles(q.shape, static, cta)
    mine = [tuple(int(x) for x in tiles.tile_of(n))
            for n in range(int(tiles.count))]
    seen += mine
    loads.append(sum(int(tiles.blocks(start)) for _, _, start in mine))
  want = [(b, h, t * 128) for b in range(batch) for h in range(heads)
          for t in range(q_len // 128)]
  assert sorted(seen) == sorted(want)
  # One unit of work more or less: a tile, or a pair (all pairs cost the
  # same, the heaviest tile's blocks and the lightest's).
  unit = tiles.blocks(q_len - 128) + (tiles.blocks(0) if is_causal else 0)
  assert max(loads) - min(loads) <= int(unit)


# Three consumer warpgroups (`mosaic_forward(num_consumers=3)`). q_len 320
# ends every (batch, head) on a short tile: 192 rows, then 128, whose third
# consumer recomputes the last 64 rows and stores nothing.
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, block_kv", [(64, 128), (128, 64)])
def test_three_consumers_lower(head_dim, block_kv, is_causal, persistent,
                               lowering_semantics):
  text = _lower(head_dim, is_causal, q_len=320, num_consumers=3,
                block_kv=block_kv, persistent=persistent)
  assert _KERNEL_NAME in text
  two, three = (_lower(head_dim, is_causal, block_kv=block_kv,
                       persistent=persistent, num_consumers=n)
                for n in (2, 3))
  assert two != three


def test_three_consumers_refuse_what_they_lack():
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  run = lambda q=q, **kwargs: mosaic_forward(q, q, q, scale=0.125,
                                             is_causal=False, **kwargs)
  with pytest.raises(ValueError, match="num_consumers"):
    run(num_consumers=4)
  with pytest.raises(NotImplementedError, match="overlap_scores"):
    run(num_consumers=3, overlap_scores=True)
  # Whole 64-row blocks only; the two-consumer kernel wants 128-row tiles.
  ragged = jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="q_len 200"):
    run(ragged, num_consumers=3)
  short = jax.ShapeDtypeStruct((1, 320, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="q_len 320"):
    run(short, num_consumers=2)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("q_len, num_ctas", [(320, 3), (1024, 5), (64, 1),
                                             (576, 2)])
def test_three_consumers_cover_every_row_once(q_len, num_ctas, is_causal):
  """The persistent CTAs' three-consumer tiles store every 64-row block of
  every (batch, head) once (`consumer_rows`: a short tile's spare consumers
  recompute the last block and store nothing), and the producer streams as
  many K/V blocks as the tile's last consumer reads."""
  from pallas_kernels.mosaic import forward
  batch, heads, head_dim = 2, 3, 64
  q = jnp.zeros((batch, q_len, heads, head_dim), jnp.bfloat16)
  kv = jnp.zeros((batch, 640, heads, head_dim), jnp.bfloat16)
  static = forward.persistent_static(forward.check_supported(
      q, kv, kv, scale=1.0, is_causal=is_causal, block_q=64, block_kv=128,
      max_concurrent_steps=2, num_consumers=3), q.shape, num_ctas)
  stored = []
  for cta in range(static.num_ctas):
    tiles = forward.persistent_tiles(q.shape, static, cta)
    for n in range(int(tiles.count)):
      b, h, start = (int(x) for x in tiles.tile_of(n))
      rows = [int(forward.consumer_rows(start, w, static)) for w in range(3)]
      assert rows == sorted(rows) and rows[-1] <= q_len - 64
      stored += [(b, h, r) for w, r in enumerate(rows)
                 if start + 64 * w < q_len]
      assert int(tiles.blocks(start)) == int(
          forward._num_kv_steps(rows[-1], static))
  want = [(b, h, r) for b in range(batch) for h in range(heads)
          for r in range(0, q_len, 64)]
  assert sorted(stored) == want


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, block_kv", [(64, 128), (64, 64),
                                                (128, 64)])
def test_three_consumers_are_bitwise_two_on_gpu(head_dim, block_kv,
                                                is_causal):
  """A row's sums do not depend on which consumer computes it, so three
  consumers give the two-consumer kernel's out and lse bit for bit, on the
  launch grid and on persistent grids of 1, 7 and every SM's CTAs; q_len
  1024 ends each head on a short tile (5 x 192 + 64 rows). A turn barrier
  off by a phase would hang or race, a wrong spare consumer would store
  stale rows."""
  run = functools.partial(_forward_runner(head_dim, is_causal, seed=5),
                          block_kv=block_kv)
  want = run(num_consumers=2, persistent=False)
  for kwargs in (dict(persistent=False), dict(persistent=True, num_ctas=1),
                 dict(persistent=True, num_ctas=7), dict(persistent=True)):
    for a, b in zip(run(num_consumers=3, **kwargs), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=str(kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    Case(2, 1024, 1024, 8, 2, 64),    # GQA 4:1, a short last tile
    Case(1, 128, 640, 4, 1, 64),      # MQA, one short tile per head
    Case(3, 384, 640, 5, 5, 64),      # two whole tiles
], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_three_consumers_match_reference_on_gpu(case, dtype, is_causal,
                                               monkeypatch):
  from pallas_kernels.mosaic import forward
  monkeypatch.setattr(forward, "THREE_CONSUMER_MIN_Q_LEN",
                      {False: 0, True: 0})
  _check_mosaic_against_reference(case, dtype, is_causal)


def test_three_consumers_stage_o_apart_only_where_it_fits():
  """O staged apart at head_dim 64; at 128 with 128-row K/V tiles it would
  leave too little shared memory (it failed to compile on the H200), so O
  goes out through Q's buffer."""
  from pallas_kernels.mosaic import forward
  for head_dim, apart in ((64, True), (128, False)):
    q = jnp.zeros((1, 1024, 4, head_dim), jnp.bfloat16)
    static = forward.persistent_static(forward.check_supported(
        q, q, q, scale=1.0, is_causal=False, block_q=64, block_kv=128,
        max_concurrent_steps=2, num_consumers=3), q.shape, None)
    assert static.stage_o_apart == apart


def test_three_consumers_default_follows_the_measured_table(cuda_lowering):
  """Three consumers at head_dim 64 from q_len 1024 (causal from 2048),
  two elsewhere, and wherever the three-consumer kernel cannot take the
  call (`overlap_scores`); the dispatch lowers the default."""
  from pallas_kernels.mosaic import forward
  default = lambda d, n, causal=False, **kw: forward.consumers_by_default(
      head_dim=d, q_len=n, is_causal=causal, **kw)
  assert default(64, 1024) == default(64, 16384) == 3
  assert default(64, 768) == default(64, 256) == 2
  assert default(64, 1024, True) == 2 and default(64, 2048, True) == 3
  assert default(128, 16384) == default(256, 16384) == 2
  assert default(64, 16384, overlap_scores=True) == 2
  assert default(64, 1088, block_q=128) == 2
  assert _lower(64, False, q_len=1024) == _lower(64, False, q_len=1024,
                                                  num_consumers=3)
  assert _lower(64, False, q_len=384) == _lower(64, False, q_len=384,
                                                 num_consumers=2)
  assert _lower(64, True, q_len=1024) == _lower(64, True, q_len=1024,
                                                 num_consumers=2)
  assert _lower(64, False, overlap_scores=True, persistent=False)


# How the consumers take turns (`KernelStatic.ring_turns`, `hw_turns`).
# hw_turns explicit: it is d=64's default (`forward.HW_TURNS_HEAD_DIMS`).
TURN_VARIANTS = [dict(num_consumers=2, ring_turns=True, hw_turns=False),
                 dict(num_consumers=2, hw_turns=True),
                 dict(num_consumers=3, hw_turns=True)]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("variant", TURN_VARIANTS, ids=str)
def test_turn_variants_lower(variant, is_causal, persistent,
                             lowering_semantics):
  """Ring turns of two consumers, and ring turns on hardware barriers
  (`bar.arrive` / `bar.sync` on barriers 8, 9, ...), lower in both
  semantics and change the kernel; `overlap_scores` refuses them."""
  text = _lower(64, is_causal, persistent=persistent, **variant)
  assert _KERNEL_NAME in text
  plain = dict(num_consumers=variant["num_consumers"], hw_turns=False)
  assert text != _lower(64, is_causal, persistent=persistent, **plain)
  if variant.get("hw_turns"):
    assert "bar.sync 8, 256" in text and "bar.arrive 9, 256" in text
  with pytest.raises(NotImplementedError, match="its own turns"):
    _lower(64, is_causal, persistent=False, overlap_scores=True,
           num_consumers=2, **{k: v for k, v in variant.items()
                               if k != "num_consumers"})


def test_hw_turns_default_is_d64(cuda_lowering):
  """By default the consumers take turns on hardware barriers at head_dim
  64 only (session 21's A/B), two consumers or three, and never under
  `overlap_scores` (which takes its own turns and refuses them)."""
  from pallas_kernels.mosaic import forward
  assert forward.hw_turns_by_default(head_dim=64)
  assert not forward.hw_turns_by_default(head_dim=64, overlap_scores=True)
  assert not any(forward.hw_turns_by_default(head_dim=d) for d in (128, 256))
  # `forward.consumers_by_default`: three from q_len 1024, two causal.
  for causal, q_len, consumers in ((False, 1024, 3), (True, 1024, 2)):
    text = lambda **kw: _lower(64, causal, q_len=q_len, **kw)
    assert text() == text(hw_turns=True, num_consumers=consumers)
    assert "bar.sync 8, " in text()
  assert "bar.sync 8, " not in _lower(128, False)
  _lower(64, False, persistent=False, overlap_scores=True)  # no raise


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_turn_variants_are_bitwise_the_default_on_gpu(head_dim, is_causal):
  """Turns change when a consumer's matmuls run, not what they compute: out
  and lse equal the default's bit for bit, on the launch grid and a
  persistent grid of 7 CTAs (a ring barrier off by a turn would hang or,
  on hardware barriers, let a consumer run ahead out of turn)."""
  run = _forward_runner(head_dim, is_causal, seed=6)
  want = run(persistent=False, hw_turns=False)
  for variant in TURN_VARIANTS:
    if variant["num_consumers"] == 3 and head_dim != 64:
      continue
    for grid in (dict(persistent=False), dict(persistent=True, num_ctas=7)):
      for a, b in zip(run(**variant, **grid), want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=f"{variant} {grid}")
