"""The Mosaic GPU (sm90) forward: cross-lowered for CUDA on CPU, checked on a GPU.

Lowering runs Pallas -> Mosaic GPU -> NVVM in Python (layout inference,
barrier and TMA lowering, the MLIR verifier) and so catches most kernel errors
without a GPU; PTX generation and the run itself need the `-m gpu` test.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from pallas_kernels import compat as versions
from pallas_kernels.masking import MaskSpec, Operands
from tests.attention_checks import (DISPATCHED_TO_MOSAIC, DISPATCHED_TO_TRITON,
                                    Case, assert_forward_within_rule,
                                    check_against_reference, random_inputs)
from tests.conftest import BOTH_SEMANTICS

try:
  from pallas_kernels.mosaic import plan
  from pallas_kernels.mosaic.forward import mosaic_forward
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

# Cases whose kernel forms a default case already takes (`pytest -m slow`).
_slow = lambda *values: pytest.param(*values, marks=pytest.mark.slow)
_CUSTOM_CALL = "mosaic_gpu_v2"
_KERNEL_NAME = "mosaic_flash_forward"


def _lower(head_dim, is_causal, *, q_len=256, kv_len=384, **options):
  q = jax.ShapeDtypeStruct((2, q_len, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), jnp.bfloat16)

  def forward(q, k, v):
    return mosaic_forward(q, k, v, scale=head_dim**-0.5, is_causal=is_causal,
                          **options)

  lowered = jax.jit(forward).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",))
  out, lse = lowered.out_info
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (2, 4, q_len) and lse.dtype == jnp.float32
  return lowered.as_text()


def _static(q_len, kv_len, head_dim, *, is_causal=False, num_consumers=2,
            num_ctas=None, batch=2, heads=4):
  """The persistent `forward.KernelStatic` of a call's shapes."""
  from pallas_kernels.mosaic import forward
  q = jnp.zeros((batch, q_len, heads, head_dim), jnp.bfloat16)
  kv = jnp.zeros((batch, kv_len, heads, head_dim), jnp.bfloat16)
  static = forward.check_supported(
      q, kv, kv, scale=1.0, is_causal=is_causal, block_q=64,
      block_kv=plan.default_block_kv(head_dim), max_concurrent_steps=2,
      num_consumers=num_consumers)
  return forward.persistent_static(static, q.shape, num_ctas)


@BOTH_SEMANTICS
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward_lowers_for_cuda(head_dim, is_causal, lowering_semantics):
  text = _lower(head_dim, is_causal)
  assert _CUSTOM_CALL in text
  assert _KERNEL_NAME in text


def test_forward_plan_follows_its_rows():
  """`plan.forward_config` gives each row of `FORWARD_PLAN` at lengths in
  its ranges, lets options replace its fields, and falls back to two
  consumers where q_len is not whole 64-row blocks."""
  config = lambda d, causal, q_len, kv_len=None, **kw: plan.forward_config(
      head_dim=d, is_causal=causal, q_len=q_len, kv_len=kv_len or q_len, **kw)
  within = lambda lo, hi: hi // 128 * 128 if hi is not None else max(lo,
                                                                      16384)
  for d, causal, q_range, kv_range, row in plan.FORWARD_PLAN:
    got = config(d, causal, within(*q_range), within(*kv_range))
    assert got == dataclasses.replace(row, block_kv=plan.default_block_kv(d))
  assert config(64, False, 1024).num_consumers == 3
  assert config(64, False, 768).num_consumers == 2
  assert config(64, True, 1024).num_consumers == 2
  assert config(64, True, 2048).num_consumers == 3
  assert config(64, False, 1088, block_q=128).num_consumers == 2
  assert config(64, False, 1024, num_consumers=2).num_consumers == 2
  assert config(128, False, 1024).sum_after_pv
  assert not config(128, True, 1024).lazy_rescale
  assert config(128, True, 8192).persistent
  assert not config(128, True, 16384).persistent
  assert config(256, True, 4096).persistent
  assert not config(256, True, 8192).persistent
  assert config(256, True, 8192, persistent=True).persistent
  assert config(256, False, 4096).block_kv == 64
  # Head dims between the rows' run on the next one's rows.
  assert config(96, False, 1024) == config(128, False, 1024)
  assert config(192, True, 8192) == config(256, True, 8192)
  with pytest.raises(NotImplementedError, match="head_dim"):
    config(320, False, 1024)
  with pytest.raises(TypeError, match="overlap_scores"):
    config(128, False, 1024, overlap_scores=True)


def test_forward_default_is_its_plan(cuda_lowering):
  """With no options the kernel is the one its plan row spells out."""
  for head_dim, causal in ((64, False), (128, False)):
    row = plan.forward_config(head_dim=head_dim, is_causal=causal, q_len=256,
                              kv_len=384)
    assert _lower(head_dim, causal) == _lower(
        head_dim, causal, **dataclasses.asdict(row))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_options_lower_and_change_the_forward(head_dim, lowering_semantics):
  """Each schedule choice of `plan.ForwardConfig` lowers in both semantics
  and is another kernel than its alternative (an option that did nothing
  could not be measured): the launch grid and the persistent one, turns on
  hardware barriers (`bar.sync` / `bar.arrive` on barriers 8, 9) or at a
  rendezvous, the row sum after P V, O rescaled lazily at thresholds 0 and
  8."""
  base = dict(persistent=False, hw_turns=False, sum_after_pv=False,
              lazy_rescale=False)
  text = lambda **kw: _lower(head_dim, True, **dict(base, **kw))
  plain = text()
  variants = [text(persistent=True, num_ctas=3), text(hw_turns=True),
              text(sum_after_pv=True), text(lazy_rescale=True),
              text(lazy_rescale=True, rescale_threshold=0.0)]
  assert len({plain, *variants}) == 1 + len(variants)
  assert "bar.sync 8, 256" in variants[1] and "bar.arrive 9, 256" in variants[1]
  assert "bar.sync 8, " not in plain


def test_out_of_range_rescale_threshold_raises():
  q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  for threshold in (-1.0, 9.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="rescale_threshold"):
      mosaic_forward(q, q, q, scale=0.1, is_causal=False, lazy_rescale=True,
                     rescale_threshold=threshold)


@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_lowers_deeper_pipeline(is_causal, cuda_lowering):
  # q_len > kv_len: under causal masking the last row tiles see every block.
  text = _lower(64, is_causal, q_len=512, kv_len=256, block_kv=64,
                max_concurrent_steps=3)
  assert _CUSTOM_CALL in text


def test_padded_head_dim_lowers_with_gradients(cuda_lowering):
  """Head dim 72 runs the kernels at 80 on zero-padded inputs."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import mosaic_attention
  x = jax.ShapeDtypeStruct((1, 256, 2, 72), jnp.bfloat16)

  def loss(q, k, v):
    out, lse = mosaic_attention(q, k, v, scale=72**-0.5, is_causal=True,
                                backward_blocks=BlockSizes.get_default(
                                    72, "NVIDIA H200"))
    return out.astype(jnp.float32).sum() + lse.sum()

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
      lowering_platforms=("cuda",))
  assert [g.shape for g in lowered.out_info] == [x.shape] * 3
  assert _KERNEL_NAME in lowered.as_text()


@pytest.mark.parametrize("kwargs, match", [
    # Off the 8-row TMA tiling, rows of no whole number of swizzle tiles
    # (rows of whole ones are read in place: `rows.rows_in_place`).
    (dict(q_len=204, head_dim=96), "q_len 204"),
    (dict(kv_len=204, head_dim=96), "kv_len 204"),
    (dict(head_dim=72), "head_dim"),    # not a multiple of 16
    (dict(head_dim=48), "head_dim"),    # below 64: padded by the caller
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
    Case(1, 1024, 768, 4, 2, 96),     # at its own width (64-byte swizzle)
], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mosaic_matches_reference_on_gpu(case, is_causal, dtype):
  """Forward and gradients by the Mosaic kernels, through `flash_attention`."""
  _check_mosaic_against_reference(case, dtype, is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("case, is_causal", [
    (Case(2, 1000, 1000, 8, 2, 64), True),    # d=64's 128-row Q tiles
    (Case(1, 5000, 5000, 8, 2, 128), True),   # the model suite's cell
    (Case(2, 136, 264, 4, 4, 128), True),     # a consumer past q_len
    (Case(1, 1000, 1000, 4, 2, 256), True),   # shared K/V rows in dK/dV
    (Case(1, 1000, 1000, 4, 2, 160), True),   # at its own width
    # Off the 8-row TMA tiling at d=128 and 256: rows read in place a box
    # at a time (the backward's shared rows at d=256 pad them).
    (Case(1, 1001, 1001, 8, 2, 128), True),
    (Case(2, 577, 577, 4, 4, 256), False),
    # d=64 off the 8-row tiling: rows read and written in place by both
    # directions' kernels (`rows.rows_in_place`).
    (Case(8, 197, 197, 12, 12, 64), False),   # ViT-B/16
    (Case(2, 577, 577, 16, 4, 64), True),     # ViT-L/14 at 336 px, GQA
    (Case(2, 261, 133, 4, 2, 64), True),      # q_len > kv_len
    (Case(2, 3, 5, 4, 2, 64), False),         # fewer rows than a tile
    (Case(1, 1, 200, 4, 1, 64), True),        # one query
    # Real queries past kv_len: the last K/V block masked past it.
    (Case(1, 1000, 1000, 4, 2, 128), False),
    (Case(1, 1000, 1000, 4, 2, 256), False),
    (Case(2, 264, 136, 4, 2, 128), True),     # q_len > kv_len
], ids=str)
def test_ragged_lengths_on_the_plain_kernels_on_gpu(case, is_causal,
                                                    monkeypatch):
  """Lengths that no tile divides (`attention._masked`): forward and
  gradients by the plain kernels (the masked ones and Triton's backward
  patched to fail) against the reference; TMA's zero fill and clipped
  stores are the tail handling (and where the lengths are not whole 8-row
  tiles, a padded copy, or at d=64 the forward's rows in place and the
  backward's padded), with the forward's last K/V block masked past
  kv_len where a real query sees there."""
  from pallas_kernels.mosaic import attention

  def refuse(*_, **__):
    raise AssertionError("a ragged call reached the masked kernels")
  for name in ("mosaic_forward_masked", "mosaic_backward_masked",
               "flash_backward"):
    monkeypatch.setattr(attention, name, refuse)
  _check_mosaic_against_reference(case, jnp.bfloat16, is_causal)


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


def _replan(monkeypatch, **fields):
  """Every row of `plan.FORWARD_PLAN` with `fields` replaced, for the
  calls `flash_attention` makes while the test runs."""
  monkeypatch.setattr(plan, "FORWARD_PLAN", tuple(
      (*key, dataclasses.replace(row, **fields))
      for *key, row in plan.FORWARD_PLAN))


def _forward_runner(head_dim, is_causal, *, seed, q_len=1024,
                    input_q_len=None):
  """`run(**options) -> (out, lse)`: `mosaic_forward` with `options` on one
  set of random GQA 4:1 inputs (b2, q_len, k1536, h8:2), for comparing
  options bit for bit. With `input_q_len` > q_len the inputs have that many
  query rows and `run(..., rows=q_len)` computes on the first q_len only
  (rows do not depend on each other: causal masks are top-left aligned), so
  a kernel that takes only whole tiles can give another's expected rows.
  Skips without sm90."""
  _require_sm90()
  q, k, v, _, _ = random_inputs(
      Case(2, input_q_len or q_len, 1536, 8, 2, head_dim), jnp.bfloat16, seed)

  def run(rows=q_len, **kwargs):
    out, lse = jax.jit(lambda q, k, v: mosaic_forward(
        q, k, v, scale=head_dim**-0.5, is_causal=is_causal, **kwargs))(
            q[:, :rows], k, v)
    return out[:, :q_len], lse[:, :, :q_len]
  return run


# Persistent grids that make CTAs walk several tiles, with the ring's slots
# and barrier phases running on across tiles: one CTA, a count that divides
# neither the tiles nor the stages, and the SM count.
PERSISTENT_CTAS = [1, 7, None]


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_schedule_choices_are_bitwise_on_gpu(head_dim, is_causal):
  """The schedule's choices change when things run, not what is computed:
  out and lse equal the launch grid's with a rendezvous, the row sum
  before P V and O rescaled every step, bit for bit, on persistent grids
  of 1 to 32 tiles a CTA (a barrier phase or ring slot off by one across
  tiles would not), with turns on hardware barriers (a turn off by one
  would hang or let a consumer run ahead), the row sum after P V, and the
  lazy rescale at threshold 0 (a warp that skipped its multiply where a
  row's max moved would not)."""
  run = _forward_runner(head_dim, is_causal, seed=4)
  base = dict(persistent=False, hw_turns=False, sum_after_pv=False,
              lazy_rescale=False, num_consumers=2)
  want = run(**base)
  variants = [dict(persistent=True, num_ctas=n) for n in PERSISTENT_CTAS]
  variants += [dict(hw_turns=True), dict(hw_turns=True, persistent=True,
                                         num_ctas=7),
               dict(sum_after_pv=True), dict(sum_after_pv=True,
                                             persistent=True),
               dict(lazy_rescale=True, rescale_threshold=0.0),
               dict(lazy_rescale=True, rescale_threshold=0.0,
                    persistent=True)]
  for variant in variants:
    for a, b in zip(run(**dict(base, **variant)), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=str(variant))


@pytest.mark.gpu
@pytest.mark.parametrize("mma_row_sum", [False, True])
@pytest.mark.parametrize("spread", [1, 8])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lazy_rescale_forward_matches_reference_on_gpu(head_dim, is_causal,
                                                       spread, mma_row_sum):
  """Threshold 8 (P up to 2**8 between rescales) against the float32
  reference, within DESIGN's rule; at `spread` 8 the scores are 8x the
  usual, so that rows' maxima keep moving by more than 8 after the first
  K/V tile (GQA 4:1, kv_len > q_len). Also with l by the tensor cores
  (`ForwardConfig.mma_row_sum`, its accumulator rescaled with O)."""
  _require_sm90()
  q, k, v, _, _ = random_inputs(Case(2, 1024, 1536, 8, 2, head_dim),
                                jnp.bfloat16, seed=79)
  scale = spread * head_dim**-0.5
  out, lse = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=scale, is_causal=is_causal, lazy_rescale=True,
      rescale_threshold=8.0, mma_row_sum=mma_row_sum))(q, k, v)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal,
                             scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_row_sum_by_mma_matches_reference_on_gpu(head_dim, is_causal):
  """`ForwardConfig.mma_row_sum` on the plan's grid with O rescaled at
  every step (no lazy rescale): l by the tensor cores, its accumulator
  rescaled with O, against the float32 reference within DESIGN's rule
  (GQA 4:1, kv_len > q_len, a ragged q_len)."""
  _require_sm90()
  q, k, v, _, _ = random_inputs(Case(2, 1000, 1536, 8, 2, head_dim),
                                jnp.bfloat16, seed=83)
  out, lse = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=head_dim**-0.5, is_causal=is_causal,
      lazy_rescale=False, mma_row_sum=True))(q, k, v)
  assert_forward_within_rule(q, k, v, out, lse, is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kv_len", [(128, 16384), (256, 8192)])
def test_causal_forward_default_at_long_kv_on_gpu(head_dim, kv_len):
  """The causal plan at long kv_len (the launch grid): `flash_attention`'s
  output, LSE and gradients obey the tolerance rule (GQA 2:1), and its
  forward is bitwise `mosaic_forward(persistent=False)`."""
  _require_sm90()
  assert not plan.forward_config(head_dim=head_dim, is_causal=True,
                                 q_len=kv_len, kv_len=kv_len).persistent
  case = Case(1, kv_len, kv_len, 4, 2, head_dim)
  attention = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=True, return_residual=True, implementation="mosaic"))
  check_against_reference(attention, case, jnp.bfloat16, is_causal=True)
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, 43)
  out, lse = attention(q, k, v)
  want_out, want_lse = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=head_dim**-0.5, is_causal=True, persistent=False))(
          q, k, v)
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
  _replan(monkeypatch, persistent=True)
  _check_mosaic_against_reference(case, dtype, is_causal)


def test_dispatch_on_hopper_lowers_the_expected_kernels(cuda_lowering,
                                                         monkeypatch):
  """`implementation=None` as on an H200, cross-lowered: the calls of
  `DISPATCHED_TO_MOSAIC` on Mosaic, those of `DISPATCHED_TO_TRITON` on
  Triton (as the GPU's `test_implementation_none_uses_kernels_on_gpu`)."""
  monkeypatch.setattr(versions, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(versions, "has_gpu", lambda: True)

  def lowered(dtype, q_len, **kwargs):
    q = jax.ShapeDtypeStruct((1, q_len, 4, 64), dtype)
    return jax.jit(lambda q, k, v: jax_flash.flash_attention(
        q, k, v, interpret=False, **kwargs)).trace(q, q, q).lower(
            lowering_platforms=("cuda",)).as_text()

  for dtype, q_len, kwargs in DISPATCHED_TO_MOSAIC:
    assert _KERNEL_NAME in lowered(dtype, q_len, **kwargs)
  for dtype, q_len, kwargs in DISPATCHED_TO_TRITON:
    text = lowered(dtype, q_len, **kwargs)
    assert _KERNEL_NAME not in text and "flash_forward" in text


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape, head_dim, num_ctas", [
    ((2, 1024, 4), 128, 5),    # 8 tiles per head
    ((1, 768, 3), 64, 4),      # 6 tiles per head, 18 in all
    ((3, 384, 1), 256, 2),     # 3 per head: odd, middles paired
    # 5 per head and 10 CTAs: pairs of a head's last and the next head's
    # first tile fell to 2 CTAs (`common.persistent_schedule`).
    ((1, 640, 16), 128, 10),
    ((1, 128, 1), 128, 1),     # one tile
])
def test_persistent_tiles_cover_every_tile_once(shape, head_dim, num_ctas,
                                               is_causal):
  """The persistent CTAs' tiles are every (batch, head, q tile) once; under
  causal masking, heaviest paired with lightest, the CTAs' K/V block counts
  differ by at most one pair's (the launch grid's tail is up to a whole
  head's heaviest tiles)."""
  from pallas_kernels.mosaic import forward_persistent
  batch, q_len, heads = shape
  static = _static(q_len, q_len, head_dim, is_causal=is_causal,
                   num_ctas=num_ctas, batch=batch, heads=heads)
  seen, loads = [], []
  for cta in range(static.num_ctas):
    tiles = forward_persistent.persistent_tiles(
        (batch, q_len, heads, head_dim), static, cta)
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


# Three consumer warpgroups. q_len 320 ends every (batch, head) on a short
# tile: 192 rows, then 128, whose third consumer takes the last 64 rows
# again and stores nothing.
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, block_kv, persistent",
                         [(64, 128, True), (128, 64, False)])
def test_three_consumers_lower(head_dim, block_kv, persistent, is_causal,
                               lowering_semantics):
  lower = functools.partial(_lower, head_dim, is_causal, block_kv=block_kv,
                            persistent=persistent, hw_turns=True)
  text = lower(q_len=320, num_consumers=3)
  assert _KERNEL_NAME in text and "bar.sync 10, 256" in text
  assert lower(num_consumers=3) != lower(num_consumers=2)


def test_three_consumers_refuse_what_they_lack():
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  run = lambda q=q, **kwargs: mosaic_forward(q, q, q, scale=0.125,
                                             is_causal=False, **kwargs)
  with pytest.raises(ValueError, match="num_consumers"):
    run(num_consumers=4)
  # Lengths of whole 8-row TMA tiles (`common.ragged_lengths`) only, where
  # a row is no whole number of swizzle tiles (`rows.rows_in_place`).
  ragged = jax.ShapeDtypeStruct((1, 204, 2, 96), jnp.bfloat16)
  for consumers in (2, 3):
    with pytest.raises(NotImplementedError, match="q_len 204"):
      run(ragged, num_consumers=consumers)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("q_len, num_ctas", [(320, 3), (1024, 5), (64, 1),
                                             (576, 2)])
def test_three_consumers_cover_every_row_once(q_len, num_ctas, is_causal):
  """The persistent CTAs' three-consumer tiles store every 64-row block of
  every (batch, head) once (`consumer_rows`: a short tile's spare consumers
  take the last block again and store nothing), and the producer streams
  as many K/V blocks as the tile's last consumer reads. The spares skip
  their math where the tile is short and unmasked (`skip_spare`)."""
  from pallas_kernels.mosaic import forward, forward_kernel, forward_persistent
  batch, heads, head_dim = 2, 3, 64
  static = _static(q_len, 640, head_dim, is_causal=is_causal,
                   num_consumers=3, num_ctas=num_ctas, batch=batch,
                   heads=heads)
  assert forward._skips_spare(static) == (not is_causal and q_len % 192 != 0)
  stored = []
  for cta in range(static.num_ctas):
    tiles = forward_persistent.persistent_tiles(
        (batch, q_len, heads, head_dim), static, cta)
    for n in range(int(tiles.count)):
      b, h, start = (int(x) for x in tiles.tile_of(n))
      rows = [int(forward_kernel.consumer_rows(start, w, static))
              for w in range(3)]
      assert rows == sorted(rows) and rows[-1] <= q_len - 64
      stored += [(b, h, r) for w, r in enumerate(rows)
                 if start + 64 * w < q_len]
      assert int(tiles.blocks(start)) == int(
          forward_kernel.num_kv_steps(rows[-1], static))
  want = [(b, h, r) for b in range(batch) for h in range(heads)
          for r in range(0, q_len, 64)]
  assert sorted(stored) == want


def test_three_consumers_stage_o_apart_only_where_it_fits():
  """O staged apart at head_dim 64; at 128 with 128-row K/V tiles it would
  leave too little shared memory (it failed to compile on the H200), so O
  goes out through Q's buffer."""
  for head_dim, apart in ((64, True), (128, False)):
    static = _static(1024, 1024, head_dim, num_consumers=3, batch=1)
    assert static.stage_o_apart == apart


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1024, 1088])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, block_kv", [(64, 128), (64, 64),
                                                (128, 64)])
def test_three_consumers_are_bitwise_two_on_gpu(head_dim, block_kv,
                                                is_causal, q_len):
  """A row's sums do not depend on which consumer computes it, so three
  consumers give the two-consumer kernel's out and lse bit for bit, three
  runs in a row, on the launch grid and on persistent grids of 1, 7 and
  every SM's CTAs; each head ends on a short tile with two spare consumers
  (q_len 1024 = 5 * 192 + 64) or one (1088 = 5 * 192 + 128), which skip
  their math without a mask. A turn barrier off by a phase would hang or
  race, a wrong spare consumer would store stale rows, a spare that
  released a slot or passed a turn too often or not at all would hang. lse
  bitwise since its add is unfused (`softmax.add_unfused`)."""
  # Two consumers take whole 128-row tiles only: 1088's expected rows come
  # from 1152 rows of input.
  run = functools.partial(
      _forward_runner(head_dim, is_causal, seed=5, q_len=q_len,
                      input_q_len=-(-q_len // 128) * 128),
      block_kv=block_kv)
  want = run(rows=-(-q_len // 128) * 128, num_consumers=2, persistent=False,
             hw_turns=False)
  for kwargs in (dict(persistent=False), dict(persistent=True, num_ctas=1),
                 dict(persistent=True, num_ctas=7), dict(persistent=True)):
    for attempt in range(3):
      for a, b in zip(run(num_consumers=3, **kwargs), want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=f"{kwargs} run {attempt}")


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
  _replan(monkeypatch, num_consumers=3, hw_turns=True)
  _check_mosaic_against_reference(case, dtype, is_causal)


@pytest.mark.parametrize("head_dim, q_len, kv_len, is_causal", [
    (64, 1000, 1000, True),     # d=64's plan: 128-row Q tiles, persistent
    _slow(128, 5000, 5000, True),   # d=128's: the launch grid, lse early
    (128, 136, 264, True),      # q_len < kv_len, a tile past q_len
    (256, 1000, 1000, True),    # d=256's: dK and dV on shared K/V rows
    _slow(160, 1000, 1000, True),   # at its own width, on d=256's rows
    _slow(176, 1000, 1000, True),   # no shared rows (176 / 2: no swizzle)
    (128, 1001, 1001, True),    # padded to 1008
    (64, 197, 197, False),      # in place; the backward's rows padded
    _slow(128, 264, 136, True),     # q_len > kv_len: the key tail
])
def test_ragged_lengths_lower_on_the_plain_kernels(head_dim, q_len, kv_len,
                                                   is_causal, cuda_lowering,
                                                   monkeypatch):
  """Lengths that no tile divides, whole 8-row TMA tiles
  (`common.ragged_lengths`): `mosaic_attention`'s forward and backward
  lower on the plain kernels, with the masked ones patched to fail."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention

  def refuse(*_, **__):
    raise AssertionError("a ragged call reached the masked kernels")
  monkeypatch.setattr(attention, "mosaic_forward_masked", refuse)
  monkeypatch.setattr(attention, "mosaic_backward_masked", refuse)
  monkeypatch.setattr(attention, "flash_backward", refuse)
  q = jax.ShapeDtypeStruct((1, q_len, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, kv_len, 2, head_dim), jnp.bfloat16)

  def loss(q, k, v):
    out, lse = attention.mosaic_attention(
        q, k, v, scale=head_dim**-0.5, is_causal=is_causal,
        backward_blocks=BlockSizes.get_default(head_dim, "NVIDIA H200"))
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
      q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert _KERNEL_NAME in text


@pytest.mark.parametrize("is_causal", [False, True])
def test_short_ragged_tail_lowers_on_the_launch_grid(is_causal,
                                                     cuda_lowering):
  """200 keys in two 128-key blocks on the launch grid: the producer's
  ring fill reaches the last block with a static start past K's rows
  (`forward_kernel._kv_rows` makes it traced; `pl.multiple_of` on a
  constant does not lower under warpgroup semantics)."""
  x = jax.ShapeDtypeStruct((2, 200, 4, 64), jnp.bfloat16)
  text = jax.jit(lambda q, k, v: mosaic_forward(
      q, k, v, scale=0.125, is_causal=is_causal, persistent=False)
                 ).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
  assert _KERNEL_NAME in text


@pytest.mark.parametrize("head_dim, dtype, in_place", [
    (64, jnp.bfloat16, True), (64, jnp.float16, True),
    (128, jnp.bfloat16, True), (256, jnp.bfloat16, True),
    (80, jnp.bfloat16, False), (96, jnp.float16, False)])
def test_rows_off_the_tiling_lower_in_place(head_dim, dtype, in_place,
                                            cuda_lowering):
  """`rows.rows_in_place`: ViT-L/14's 577 tokens in 16 bits at d=64,
  128 or 256 reach the forward kernel unpadded (its Q, K, V
  and O through untiled views of their buffers, column tile by column
  tile beyond one swizzle tile; no pad in the lowered program); where a
  row is no whole number of swizzle tiles the call pads to 584 (the kernel's
  operands [.., 584, ..])."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention, rows
  assert rows.rows_in_place(577, 577, head_dim, dtype) == in_place
  assert not rows.rows_in_place(576, 577 + 7, head_dim, dtype)
  x = jax.ShapeDtypeStruct((2, 577, 4, head_dim), dtype)
  text = jax.jit(lambda q, k, v: attention.mosaic_attention(
      q, k, v, scale=0.125, is_causal=False,
      backward_blocks=BlockSizes.get_default(head_dim, "NVIDIA H200"))
                 ).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
  assert _KERNEL_NAME in text
  assert ("stablehlo.pad" in text) != in_place
  assert ("x584x" in text) != in_place


@pytest.mark.parametrize("head_dim, in_place", [
    (128, True), (96, False),
    # (CI's ten minutes: d=64's and d=256's under -m slow.)
    pytest.param(64, True, marks=pytest.mark.slow),
    pytest.param(256, True, marks=pytest.mark.slow)])
def test_masked_rows_off_the_tiling_lower_in_place(head_dim, in_place,
                                                   cuda_lowering,
                                                   monkeypatch):
  """The masked kernels, as the plain ones, take rows off the 8-row TMA
  tiling unpadded where a row is whole swizzle tiles
  (`rows.rows_in_place`): a causal window's forward and backward at 577
  tokens lower with no [.., 584, ..] operand; at d=96 they are padded."""
  monkeypatch.setattr(versions, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(versions, "has_gpu", lambda: True)
  x = jax.ShapeDtypeStruct((2, 577, 4, head_dim), jnp.bfloat16)

  def loss(q, k, v):
    return jax_flash.flash_attention(
        q, k, v, is_causal=True, local_window_size=(64, 0),
        implementation="mosaic", interpret=False).astype(jnp.float32).sum()
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
      lowering_platforms=("cuda",)).as_text()
  assert _KERNEL_NAME in text
  assert ("x584x" in text) != in_place


@pytest.mark.parametrize("q_len, kv_len, is_causal, head_dim", [
    (197, 197, False, 64), (261, 133, True, 128),
    # (CI's ten minutes: the other pairings under -m slow.)
    pytest.param(261, 133, True, 64, marks=pytest.mark.slow),
    pytest.param(197, 197, False, 128, marks=pytest.mark.slow),
    pytest.param(197, 197, True, 80, marks=pytest.mark.slow)])
def test_rows_off_the_tiling_reach_the_kernels(q_len, kv_len, is_causal,
                                               head_dim, monkeypatch):
  """Rows off the 8-row tiling: at d=64 and d=128 both directions'
  kernels take them unpadded (`rows.rows_in_place`); rows of no whole
  swizzle tiles (d=80) reach both padded to whole 8-row tiles
  (`attention._plain_attention`, the forward's padded keys masked by its
  kv_len). With the kernels
  replaced by the reference's formulas (the backward from the residuals
  it is given, `reference_backward`), out, lse and the gradients under
  random cotangents match the reference's. Fails if a kernel gets other
  rows."""
  from jax_flash import reference, validation
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention
  padded = lambda n: -(-n // 8) * 8
  forward_rows = ((q_len, kv_len) if head_dim in (64, 128)
                  else (padded(q_len), padded(kv_len)))
  backward_rows = forward_rows

  def forward(q, k, v, *, scale, is_causal, kv_len=None, **_):
    assert (q.shape[1], k.shape[1]) == forward_rows
    k, v = k[:, :kv_len], v[:, :kv_len]  # the real keys
    call = validation.normalise_call(q, k, v, scale=scale,
                                     is_causal=is_causal)
    out, lse = reference.reference_attention(call, q, k, v)
    return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2)

  def backward(q, k, v, out, lse, d_out, d_lse, *, scale, is_causal, **_):
    assert (q.shape[1], k.shape[1]) == backward_rows
    call = validation.normalise_call(q, k, v, scale=scale,
                                     is_causal=is_causal)
    # Padded keys: zero K and V add nothing to dq; their rows are sliced.
    return reference.reference_backward(
        call, q, k, v, out, jnp.swapaxes(lse, 1, 2), d_out,
        jnp.swapaxes(d_lse, 1, 2))

  monkeypatch.setattr(attention, "mosaic_forward", forward)
  monkeypatch.setattr(attention, "mosaic_backward", backward)
  case = Case(1, q_len, kv_len, 4, 2, head_dim)
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=3)

  def ours(q, k, v):
    out, lse = attention.mosaic_attention(
        q, k, v, scale=0.125, is_causal=is_causal,
        backward_blocks=BlockSizes.get_default(head_dim, "NVIDIA H200"))
    return out, jnp.swapaxes(lse, 1, 2)

  def theirs(q, k, v):
    call = validation.normalise_call(q, k, v, scale=0.125,
                                     is_causal=is_causal)
    out, lse = reference.reference_attention(call, q, k, v)
    return out.astype(q.dtype), lse

  def outputs_and_gradients(attend):
    outputs, vjp = jax.vjp(attend, q, k, v)
    return (*outputs, *vjp((d_out, d_lse)))

  got, want = map(outputs_and_gradients, (ours, theirs))
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), atol=2e-2,
                               rtol=2e-2, err_msg=name)


@pytest.mark.parametrize("q_len, kv_len, is_causal", [
    (1000, 1000, True), (136, 264, True), (1024, 1024, False),
    (1001, 1001, True), (264, 136, True), (1000, 1000, False),
    (197, 197, False)])
def test_ragged_lengths_route(q_len, kv_len, is_causal):
  """Plain calls of any lengths take the plain forward
  (`attention._masked`: padded to whole 8-row tiles by `_plain_attention`
  where they are not, the key tail masked where a query sees it); a
  window takes the masked one."""
  from pallas_kernels.mosaic import attention
  q = jax.ShapeDtypeStruct((1, q_len, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, kv_len, 4, 128), jnp.bfloat16)
  assert not attention._masked(q, kv, is_causal, None)
  window = MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=True,
                    window=(64, 0))
  assert attention._masked(q, kv, True, window)


@pytest.mark.parametrize("q_len, is_causal", [(256, True),
                                              _slow(197, False)])
def test_soft_cap_on_the_plain_forward(q_len, is_causal, cuda_lowering,
                                       monkeypatch):
  """`plan.PLAIN_SOFTCAP_HEAD_DIMS`: a call whose only change is a soft cap takes
  the plain forward (the masked one patched to fail) and, off
  `PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS`, the masked backward, and lowers;
  beside another change, or at a head dim off the list, the masked kernels
  take it. At d=128 the plan takes the plain forward under causal masking
  only (`PLAIN_SOFTCAP_CAUSAL_HEAD_DIMS`)."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention, plan

  def refuse(*_, **__):
    raise AssertionError("a capped plain call reached the masked forward")
  q = jax.ShapeDtypeStruct((1, q_len, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, q_len, 2, 128), jnp.bfloat16)
  capped = MaskSpec(q_len=q_len, kv_len=q_len, is_causal=is_causal,
                    logits_soft_cap=30.0)
  assert attention._masked(q, kv, is_causal, capped) == (not is_causal)
  monkeypatch.setattr(plan, "PLAIN_SOFTCAP_CAUSAL_HEAD_DIMS", ())
  assert attention._masked(q, kv, is_causal, capped)
  monkeypatch.setattr(plan, "PLAIN_SOFTCAP_HEAD_DIMS", (64, 128, 256))
  monkeypatch.setattr(plan, "PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS", ())
  assert not attention._masked(q, kv, is_causal, capped)
  windowed = MaskSpec(q_len=q_len, kv_len=q_len, is_causal=True,
                      window=(64, 0), logits_soft_cap=30.0)
  assert attention._masked(q, kv, True, windowed)
  monkeypatch.setattr(attention, "mosaic_forward_masked", refuse)
  monkeypatch.setattr(attention, "flash_backward", refuse)

  def loss(q, k, v):
    out, lse = attention.mosaic_attention(
        q, k, v, scale=128**-0.5, is_causal=is_causal, spec=capped,
        backward_blocks=BlockSizes.get_default(128, "NVIDIA H200"))
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
      q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert _KERNEL_NAME in text and "backward_masked" in text


@pytest.mark.gpu
@pytest.mark.parametrize("max_free", [None, "mma sum", "first step max"])
@pytest.mark.parametrize("case, is_causal, cap", [
    (Case(2, 1024, 1024, 8, 4, 128), True, 30.0),
    (Case(1, 2048, 2048, 8, 4, 256), True, 50.0),   # Gemma's cap, d=256
    (Case(1, 1000, 1000, 4, 2, 64), False, 20.0),   # a key tail
    (Case(1, 1024, 1024, 4, 4, 128), True, 100.0),  # not max-free
], ids=str)
def test_soft_cap_on_the_plain_forward_on_gpu(case, is_causal, cap,
                                              max_free, monkeypatch):
  """`plan.PLAIN_SOFTCAP_HEAD_DIMS`: the capped call's forward by the plain
  kernel (the masked one patched to fail), its gradients by the backward
  the plan picks, against the reference; the scale 4 / sqrt(d) so that
  logits reach the cap. With `max_free`, without a running max where the
  cap allows (`plan.PLAIN_MAX_FREE_HEAD_DIMS`), the row sum P V takes by
  the tensor cores or each row's max from its first step (`plan.
  MAX_FREE_FIRST_STEP_MAX`); without, the running max."""
  from pallas_kernels.mosaic import plan
  monkeypatch.setattr(plan, "PLAIN_MAX_FREE_HEAD_DIMS",
                      (64, 128, 256) if max_free else ())
  monkeypatch.setattr(plan, "MAX_FREE_FIRST_STEP_MAX",
                      max_free == "first step max")
  _check_plain_route_on_gpu(
      case, monkeypatch, "PLAIN_SOFTCAP_HEAD_DIMS", ("mosaic_forward_masked",),
      is_causal=is_causal, logits_soft_cap=cap,
      scale=4 * case.head_dim**-0.5)


def _check_plain_route_on_gpu(case, monkeypatch, switch: str, refused,
                              **variants):
  """`flash_attention(implementation="mosaic")` with `variants`, jitted,
  against the reference (`check_against_reference`), with `plan.<switch>`
  listing every head dim and the `attention` functions `refused` patched
  to fail (the plain route taken, not the masked one)."""
  from pallas_kernels.mosaic import attention, plan
  _require_sm90()

  def refuse(*_, **__):
    raise AssertionError(f"a call routed by plan.{switch} reached the "
                         f"masked kernels")
  monkeypatch.setattr(plan, switch, (64, 128, 256))
  for name in refused:
    monkeypatch.setattr(attention, name, refuse)

  @jax.jit
  def attend(q, k, v):
    return jax_flash.flash_attention(q, k, v, return_residual=True,
                                     implementation="mosaic", **variants)
  check_against_reference(attend, case, jnp.bfloat16, **variants)


@pytest.mark.parametrize("head_dim, is_causal", [
    (128, True), (256, True), _slow(64, False)])
def test_soft_cap_on_the_plain_backward(head_dim, is_causal, cuda_lowering,
                                        monkeypatch):
  """`plan.PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS`: a call whose only change is a
  soft cap takes the plain backward kernels (the masked backward and
  Triton's patched to fail) after either forward (the masked one at
  d=64, the plain one at d=128 and 256 causal, `PLAIN_SOFTCAP_HEAD_DIMS`),
  and lowers; off the list, the masked backward."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention, plan

  q = jax.ShapeDtypeStruct((1, 1024, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1024, 2, head_dim), jnp.bfloat16)
  capped = MaskSpec(q_len=1024, kv_len=1024, is_causal=is_causal,
                    logits_soft_cap=30.0)

  def lowered():
    def loss(q, k, v):
      out, lse = attention.mosaic_attention(
          q, k, v, scale=head_dim**-0.5, is_causal=is_causal, spec=capped,
          backward_blocks=BlockSizes.get_default(head_dim, "NVIDIA H200"))
      return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  monkeypatch.setattr(plan, "PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS", ())
  assert "backward_masked" in lowered()

  def refuse(*_, **__):
    raise AssertionError("a capped call reached the masked backward")
  monkeypatch.setattr(plan, "PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS", (64, 128, 256))
  for name in ("mosaic_backward_masked", "flash_backward"):
    monkeypatch.setattr(attention, name, refuse)
  text = lowered()
  assert "backward_masked" not in text
  assert "mosaic_flash_backward_dq" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case, is_causal", [
    (Case(2, 1024, 1024, 8, 4, 128), True),
    (Case(1, 2048, 2048, 8, 4, 256), True),   # Gemma's d=256
    (Case(1, 1000, 1000, 4, 2, 64), False),   # a key tail
], ids=str)
def test_soft_cap_on_the_plain_backward_on_gpu(case, is_causal, monkeypatch):
  """`plan.PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS`: the capped call's gradients by
  the plain backward kernels (the masked one patched to fail), against
  the reference; the scale 4 / sqrt(d) so that logits reach the cap."""
  _check_plain_route_on_gpu(
      case, monkeypatch, "PLAIN_SOFTCAP_BACKWARD_HEAD_DIMS",
      ("mosaic_backward_masked",), is_causal=is_causal, logits_soft_cap=30.0,
      scale=4 * case.head_dim**-0.5)


@pytest.mark.parametrize("head_dim", [128, _slow(64), _slow(256)])
def test_alibi_on_the_plain_kernels(head_dim, cuda_lowering, monkeypatch):
  """`plan.PLAIN_ALIBI_HEAD_DIMS`: a causal call whose only change is
  ALiBi takes the plain forward and backward kernels (the masked ones and
  Triton's patched to fail) and lowers with `jax.grad`; off the list,
  beside another change, with sinks or without a causal mask, the masked
  kernels take it."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import attention, plan

  def refuse(*_, **__):
    raise AssertionError("a plain ALiBi call reached the masked kernels")
  q = jax.ShapeDtypeStruct((2, 1024, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1024, 2, head_dim), jnp.bfloat16)
  alibi = MaskSpec(q_len=1024, kv_len=1024, is_causal=True, has_alibi=True)
  monkeypatch.setattr(plan, "PLAIN_ALIBI_HEAD_DIMS", ())
  assert attention._masked(q, kv, True, alibi)
  monkeypatch.setattr(plan, "PLAIN_ALIBI_HEAD_DIMS", (64, 128, 256))
  assert not attention._masked(q, kv, True, alibi)
  assert attention._masked(q, kv, True, alibi, sinks=jnp.zeros((4,)))
  for other in (dict(window=(64, 0)), dict(logits_soft_cap=30.0),
                dict(is_causal=False), dict(has_q_offset=True)):
    changed = MaskSpec(**{**dict(q_len=1024, kv_len=1024, is_causal=True,
                                 has_alibi=True), **other})
    assert attention._masked(q, kv, changed.is_causal, changed), other
  for name in ("mosaic_forward_masked", "mosaic_backward_masked",
               "flash_backward"):
    monkeypatch.setattr(attention, name, refuse)
  slopes = jax.ShapeDtypeStruct((2, 4), jnp.float32)

  def loss(q, k, v, slopes):
    out, lse = attention.mosaic_attention(
        q, k, v, scale=head_dim**-0.5, is_causal=True, spec=alibi,
        operands=Operands(alibi_slopes=slopes),
        backward_blocks=BlockSizes.get_default(head_dim, "NVIDIA H200"))
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
      q, kv, kv, slopes).lower(lowering_platforms=("cuda",)).as_text()
  assert _KERNEL_NAME in text and "backward_masked" not in text
  assert "mosaic_flash_backward_dq" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    Case(2, 1024, 1024, 8, 4, 128),
    Case(1, 2048, 2048, 8, 2, 256),
    Case(1, 1000, 1000, 4, 2, 64),     # lengths no tile divides
    Case(1, 1024, 2048, 4, 4, 128),    # q_len < kv_len, top-left
], ids=str)
def test_alibi_on_the_plain_kernels_on_gpu(case, monkeypatch):
  """`plan.PLAIN_ALIBI_HEAD_DIMS`: causal ALiBi by the plain forward and
  backward kernels (the masked ones patched to fail), out, lse and
  gradients against the reference, slopes by batch and head."""
  slopes = jnp.linspace(0.01, 0.5, case.batch * case.num_heads,
                        dtype=jnp.float32).reshape(case.batch, case.num_heads)
  _check_plain_route_on_gpu(
      case, monkeypatch, "PLAIN_ALIBI_HEAD_DIMS",
      ("mosaic_forward_masked", "mosaic_backward_masked"), is_causal=True,
      alibi_slopes=slopes)


@pytest.mark.parametrize("q_len, lse_rows", [(1000, 1024), (200, 256),
                                             (1024, 1024)])
def test_plain_forward_writes_the_lse_in_whole_tiles(q_len, lse_rows):
  """The plain forward's kernel writes an LSE of whole Q tiles and cuts it
  to q_len after: into one of q_len rows, on the GPU, a partial tile's
  TMA store of the rows past q_len landed on the next head's first rows
  (benchmarks/NOTES.md, "Ragged lengths on the plain kernels"), which the
  interpreter does not model."""
  q = jax.ShapeDtypeStruct((1, q_len, 4, 128), jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(lambda q, k, v: mosaic_forward(
      q, k, v, scale=0.1, is_causal=False))(q, q, q))
  assert f"f32[1,4,{lse_rows}]" in jaxpr
