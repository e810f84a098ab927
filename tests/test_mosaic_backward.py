"""The Mosaic GPU (sm90) backward: cross-lowered for CUDA on CPU, checked on a GPU.

As in test_mosaic_lowering.py, lowering runs Pallas -> Mosaic GPU -> NVVM in
Python and so catches most kernel errors without a GPU; PTX generation and
the numerics need the `-m gpu` test.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat as versions
from pallas_kernels.config import BlockSizes
from tests.attention_checks import Case, check_against_reference, random_inputs
from tests.conftest import BOTH_SEMANTICS

try:
  from pallas_kernels.mosaic import backward, dkdv, plan
  from pallas_kernels.mosaic.backward import mosaic_backward
  from pallas_kernels.mosaic.forward import mosaic_forward
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

_CUSTOM_CALL = "mosaic_gpu_v2"
_KERNEL_NAME = re.compile(
    r"mosaic_flash_backward_(dq_dkdv|dkdv|dk|dv|dq)(?![a-z])")
_SHAPE_FIELDS = ("batch", "q_len", "kv_len", "num_heads", "num_kv_heads",
                 "dtype")


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


def _lower(head_dim, is_causal, **shape_and_options):
  """The lowered text of `mosaic_backward` at a call's shapes (GQA 4:2,
  q_len 256, kv_len 384 unless given) with the rest as its options."""
  shape = {name: shape_and_options.pop(name) for name in _SHAPE_FIELDS
           if name in shape_and_options}
  args = _structs(head_dim=head_dim, **shape)

  def backward(*args):
    return mosaic_backward(*args, scale=head_dim**-0.5, is_causal=is_causal,
                           **shape_and_options)

  lowered = jax.jit(backward).trace(*args).lower(lowering_platforms=("cuda",))
  for grad, primal in zip(lowered.out_info, args[:3]):
    assert grad.shape == primal.shape and grad.dtype == primal.dtype
  return lowered.as_text()


def _length_within(bounds) -> int:
  """A length in `bounds` (a `plan.Range`) that whole 128-row tiles
  divide."""
  lo, hi = bounds
  return hi // 128 * 128 if hi is not None else max(lo, 16384)


def _configs(head_dim, is_causal=False, *, q_len=256, kv_len=384, **options):
  """`backward.configure`'s (dq static or None, dK/dV statics)."""
  q, kv = _structs(head_dim=head_dim, q_len=q_len, kv_len=kv_len)[:2]
  return backward.configure(q, kv, scale=0.1, is_causal=is_causal, **options)


@BOTH_SEMANTICS
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_lowers_for_cuda(head_dim, is_causal, lowering_semantics):
  # GQA 4:2 and q_len 256 != kv_len 384, each head dim on its plan (d=256:
  # the persistent grid at this kv_len, where dK and dV take a pass each:
  # two 64 x 256 f32 accumulators do not fit one warpgroup's registers).
  text = _lower(head_dim, is_causal)
  assert _CUSTOM_CALL in text
  expected = {"dq", "dk", "dv"} if head_dim == 256 else {"dq", "dkdv"}
  assert _kernels(text) == expected


def test_backward_plan_follows_its_rows():
  """`plan.backward_config` gives each row of `BACKWARD_PLAN` at lengths in
  its ranges, options replace its fields, and what the kernels cannot take
  falls back unless asked for by name."""
  config = lambda d, causal, n, q_len=None, **kw: plan.backward_config(
      head_dim=d, is_causal=causal, q_len=q_len or n, kv_len=n, **kw)
  for d, causal, _, kv_range, row in plan.BACKWARD_PLAN:
    assert config(d, causal, _length_within(kv_range)) == row
  assert config(64, False, 4096).block_q == 128
  assert config(64, False, 4096, q_len=192).block_q == 64   # 128 ∤ 192
  assert config(64, False, 4096).scores_ahead
  assert not config(64, False, 1024).scores_ahead            # persistent
  assert not config(64, False, 4096, max_concurrent_steps=1).scores_ahead
  assert config(64, True, 16384).dq_tiles == (64, 128)
  assert config(64, True, 16384 + 64,
                q_len=16384 + 128).dq_tiles is None  # 128 ∤ kv_len
  # Lengths that no 64-row tile divides (`common.ragged_lengths`) take any
  # tiles: the plan's stay.
  assert config(64, True, 16384 + 8).dq_tiles == (64, 128)
  assert config(64, True, 1000).block_q == 128
  assert config(64, True, 1000 + 4).block_q == 64          # off 8-row TMA
  # The persistent grid keeps the plan's dQ tiles.
  assert config(64, True, 16384, persistent=True).dq_tiles == (64, 128)
  assert config(128, False, 16384).fused_dq
  assert not config(128, False, 16384 + 64).fused_dq         # one consumer
  assert not config(128, False, 16384, persistent=True).fused_dq
  assert not config(128, False, 16384, dq_tiles=(64, 128)).fused_dq
  assert config(128, False, 16384, dq_tiles=(64, 64)).fused_dq  # the same
  assert not config(128, False, 1024, fused_dq=True).persistent
  assert not config(128, True, 1024).lean_producer
  assert config(128, True, 2048).prefetch_lse
  assert config(256, True, 2048).shared_rows
  assert not config(256, True, 1024).shared_rows
  # Head dims between the rows' run on the next one's rows, less what
  # their width cannot take: the fused dQ's whole 64-column pieces (96),
  # shared rows' halves of whole swizzle tiles (176: 88 columns a half).
  assert config(96, False, 1024) == config(128, False, 1024)
  assert not config(96, False, 16384).fused_dq
  assert config(96, False, 16384).prefetch_lse
  assert config(160, True, 2048).shared_rows
  assert config(192, True, 2048).shared_rows
  assert not config(176, True, 2048).shared_rows
  with pytest.raises(NotImplementedError, match="head_dim"):
    config(320, False, 1024)
  with pytest.raises(TypeError, match="prefetch_stats"):
    config(128, False, 1024, prefetch_stats=True)


def test_kv_head_copies_fill_four_waves_of_ctas():
  """`plan.planned_kv_copies`: the fewest copies dividing the group that
  give the dK/dV kernel `DKDV_MIN_CTAS` CTAs (K/V tiles of two consumers'
  rows); 1 for the fused dQ and persistent grids; named copies checked."""
  base = plan.backward_config(head_dim=128, is_causal=True, q_len=8192,
                              kv_len=8192)
  copies = lambda config=base, **kw: plan.planned_kv_copies(
      config, **{**dict(batch=2, num_kv_heads=1, group=48, kv_len=8192),
                 **kw})
  assert plan.DKDV_MIN_CTAS == 528
  assert copies() == 6             # 128 CTAs; x4 = 512 < 528; x6 = 768
  assert copies(group=8) == 8      # the whole group when still short
  assert copies(num_kv_heads=8, group=4) == 1          # 1024 CTAs
  assert copies(batch=1, num_kv_heads=4, group=8) == 4  # 256; x2 = 512
  fused = dataclasses.replace(base, fused_dq=True)
  assert copies(fused) == 1
  assert copies(dataclasses.replace(base, persistent=True)) == 1
  assert copies(dataclasses.replace(base, kv_head_copies=3)) == 3
  with pytest.raises(ValueError, match="kv_head_copies must divide"):
    copies(dataclasses.replace(base, kv_head_copies=5))
  with pytest.raises(NotImplementedError, match="launch grid"):
    copies(dataclasses.replace(fused, kv_head_copies=2))


def test_backward_kernels_follow_their_plan():
  """The kernels' statics carry the plan's choices: the fused dQ with its
  own launch order, registers and opaque resident rows (where the zero's
  cell fits), the two kernels launched tile-fastest, lse read early and
  Sᵀ issued ahead in the dK/dV kernel only."""
  dq, [fused] = _configs(128, q_len=512, kv_len=512, fused_dq=True)
  assert dq is None and fused.fused_dq and fused.opaque_resident
  assert not (fused.tile_fastest or fused.lean_producer or fused.persistent)
  assert fused.prefetch_lse and fused.overlap_softmax
  _, [fused64] = _configs(64, q_len=512, kv_len=512, fused_dq=True,
                          persistent=False)
  assert not fused64.opaque_resident  # 128-row Q tiles: no room for the zero
  dq, [dkdv] = _configs(64, q_len=512, kv_len=2048)
  assert dkdv.scores_ahead and not dq.scores_ahead
  assert dq.tile_fastest and dkdv.tile_fastest and not dkdv.persistent
  assert (dq.block_q, dkdv.block_q) == (128, 128)
  dq, [dkdv] = _configs(128, True, kv_len=2048)
  assert dkdv.prefetch_lse and not dq.prefetch_lse
  assert dq.lean_producer and dkdv.lean_producer
  dq, dkdvs = _configs(256, True)
  assert dq.persistent and [c.outputs for c in dkdvs] == [("dk",), ("dv",)]
  _, [shared] = _configs(256, True, kv_len=2048)
  assert shared.shared_rows and shared.outputs == ("dk", "dv")


def test_backward_default_is_its_plan(cuda_lowering):
  """With no options the kernels are the ones their plan row spells out."""
  for head_dim, causal in ((64, False), (128, True)):
    row = plan.backward_config(head_dim=head_dim, is_causal=causal,
                               q_len=256, kv_len=384)
    assert _lower(head_dim, causal) == _lower(
        head_dim, causal, **dataclasses.asdict(row))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_overlapped_backward_lowers_and_changes_the_kernels(
    head_dim, is_causal, cuda_lowering):
  """`overlap_softmax` (P while dP runs, dS while dV runs) lowers with the
  same kernels (at 256 one pass per output, where only the dK pass has a
  dP), and changes them."""
  text = _lower(head_dim, is_causal, overlap_softmax=True)
  expected = {"dq", "dk", "dv"} if head_dim == 256 else {"dq", "dkdv"}
  assert _kernels(text) == expected
  assert text != _lower(head_dim, is_causal, overlap_softmax=False)


# Causal where the mask matters, both for the rest (CI's ten minutes: the
# other pairs with -m slow).
@pytest.mark.parametrize("shape, is_causal", [
    (shape, causal) if causal or shape.get("q_len") == 192
    else pytest.param(shape, causal, marks=pytest.mark.slow)
    for shape in (
        dict(q_len=512, kv_len=128),                    # causal: rows past kv_len
        dict(q_len=128, kv_len=512),                    # causal: keys never seen
        dict(q_len=192, kv_len=320, num_heads=4, num_kv_heads=1),  # MQA
        dict(q_len=256, kv_len=256, block_q=128, max_concurrent_steps=3),
        dict(q_len=256, kv_len=256, dtype=jnp.float16))
    for causal in (False, True)], ids=str)
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
    # Off the 8-row TMA tiling, rows of no whole number of swizzle tiles
    # (rows of whole ones are read in place: `rows.rows_in_place`).
    (dict(q_len=204, head_dim=96), "q_len 204"),
    (dict(kv_len=204, head_dim=96), "kv_len 204"),
    (dict(head_dim=72), "head_dim"),    # not a multiple of 16
    (dict(dtype=jnp.float32), "bfloat16 and float16"),
    (dict(block_q=96), "multiples of 64"),
    (dict(head_dim=96, fused_dq=True), "head_dim multiples of 64"),
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
  # One K/V copy on both sides: the planned copies (GQA 8:2 here, few
  # CTAs) round dK and dV per copy on the launch grid only.
  kwargs = dict(kv_head_copies=1) | kwargs
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
@pytest.mark.parametrize("head_dim, option, kwargs", [
    # Each step's P while dP runs and dS while dV runs.
    (64, "overlap_softmax", {}), (128, "overlap_softmax", {}),
    (256, "overlap_softmax", {}),
    # lse read before the matmuls, in the fused, plain and (d=256)
    # shared-rows consumers, on either grid.
    (128, "prefetch_lse", dict(fused_dq=True)),
    (128, "prefetch_lse", dict(persistent=False)),
    (128, "prefetch_lse", dict(persistent=True, num_ctas=5)),
    (128, "prefetch_lse", dict(overlap_softmax=False, persistent=False)),
    (64, "prefetch_lse", dict(persistent=False)),
    (256, "prefetch_lse", {}),
    # Registers moved from the producers to the consumers (setmaxnreg): a
    # budget that did not add up would hang or corrupt.
    (128, "lean_producer", dict(persistent=False)),
    (128, "lean_producer", dict(persistent=True, num_ctas=5)),
    (64, "lean_producer", {}), (256, "lean_producer", {}),
    # The launch grid and persistent grids: each tile computed as the
    # launch grid does, for CTAs walking one tile to dozens (a ring slot or
    # barrier phase off by one across tiles would not).
    (64, "persistent", dict(num_ctas=3)), (64, "persistent", {}),
    (128, "persistent", dict(num_ctas=3)), (256, "persistent", {}),
    # The dQ kernel's own tiles on either grid.
    (64, "persistent", dict(dq_tiles=(64, 128), num_ctas=3)),
], ids=str)
def test_schedule_choices_are_bitwise_on_gpu(head_dim, option, kwargs,
                                             is_causal):
  """The backward's schedule choices change when things run, not what is
  computed: the gradients equal the kernels' without each bit for bit, two
  runs (a register read before its wgmma finished, or a race, would
  not)."""
  _assert_bitwise_either_way(option, head_dim, is_causal, 59, runs=2,
                             **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, num_kv_heads, copies", [
    (64, 2, 4), (128, 2, 2), (128, 1, 8), (256, 2, 4)], ids=str)
def test_kv_head_copies_on_gpu(head_dim, num_kv_heads, copies, is_causal):
  """dK/dV on K/V copies (`kv_head_copies`), GQA 8:2 and MQA 8:1: dK and
  dV against the reference within the rule; dQ (its kernel reads the
  call's K/V heads) bit for bit the plain kernels'."""
  _require_sm90()
  case = Case(2, 1024, 1536, 8, num_kv_heads, head_dim)
  options = dict(persistent=False, fused_dq=False)
  attention = jax.jit(functools.partial(
      mosaic_attention_with(kv_head_copies=copies, **options),
      is_causal=is_causal))
  check_against_reference(attention, case, jnp.bfloat16, is_causal=is_causal)
  q, k, v, d_out, _ = random_inputs(case, jnp.bfloat16, 5)
  scale = head_dim**-0.5
  out, lse = mosaic_forward(q, k, v, scale=scale, is_causal=is_causal)
  dq = {c: jax.jit(functools.partial(
      mosaic_backward, scale=scale, is_causal=is_causal, kv_head_copies=c,
      **options))(q, k, v, out, lse, d_out)[0] for c in (1, copies)}
  np.testing.assert_array_equal(np.asarray(dq[copies]), np.asarray(dq[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kwargs", [
    (64, dict(persistent=False)),
    (64, dict(persistent=True, num_ctas=5)),
    # 32 steps a tile in three stages: the CTAs' later tiles start in
    # other slots than 0 (the ring's `base`)
    (64, dict(persistent=True, num_ctas=5, max_concurrent_steps=3)),
    (64, dict(persistent=False, prefetch_lse=True)),
    (64, dict(persistent=False, max_concurrent_steps=3)),
    (128, dict(persistent=False)),
    (128, dict(persistent=False, prefetch_lse=False)),
], ids=str)
def test_scores_ahead_is_bitwise_the_default_on_gpu(head_dim, kwargs):
  """`scores_ahead` issues each step's Sᵀ right behind the step before's dV
  and dK, before waiting for those: the gradients equal the kernels'
  without it bit for bit, three runs (an accumulator read before its
  wgmma finished, a slot released before dK read it, or a Q tile
  overwritten under the Sᵀ issued ahead would not), across the GQA
  group's heads, on both grids."""
  _assert_bitwise_either_way("scores_ahead", head_dim, False, 73, runs=3,
                             **kwargs)


def test_scores_ahead_lowers_where_it_applies(lowering_semantics):
  """The option changes the plain dK/dV kernel without a causal mask
  (64- and 128-row Q tiles, either grid), and the rest is refused by
  name."""
  for head_dim, kwargs in ((64, dict(persistent=False)),
                           (64, dict(persistent=True)),
                           (128, dict(persistent=False))):
    assert (_lower(head_dim, False, scores_ahead=True, **kwargs)
            != _lower(head_dim, False, scores_ahead=False, **kwargs))
  for head_dim, is_causal, kwargs, match in (
      (64, True, {}, "causal"),
      (256, False, dict(shared_rows=True), "shared rows"),
      (256, False, dict(shared_rows=False), "one pass"),
      (64, False, dict(max_concurrent_steps=1), "two stages"),
      (64, False, dict(overlap_softmax=False), "overlap_softmax")):
    with pytest.raises(NotImplementedError, match=match):
      _lower(head_dim, is_causal, scores_ahead=True, **kwargs)


class _FakePipeline:
  """A stand-in for `plgpu` in `dkdv.walk_scores_ahead`: wgmma groups complete
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
  """`dkdv.walk_scores_ahead`'s order of issues, waits and releases, on a
  stand-in for `plgpu`: no slot released while a wgmma reads its tiles, no
  accumulator read or zeroed while a wgmma into it runs, nothing in flight
  where the loop turns (ptxas C7514), at most two wgmmas in flight
  (dK_t and Sᵀ_{t+1}: with dV_t too, C7512), and each step's tiles awaited
  and released once, in order."""
  from types import SimpleNamespace

  fake = _FakePipeline()

  def fori_loop(lower, upper, body, carry):
    for i in range(lower, upper):
      carry = body(i, carry)
      assert not fake.pending, "a wgmma in flight across the back edge"
    return carry

  def wgmma(acc, a, b):  # `rows.wgmma` of unsplit operands: one group
    fake.wgmma(acc, a, b)
    return 1

  monkeypatch.setattr(dkdv, "plgpu", fake)
  monkeypatch.setattr(dkdv, "wgmma", wgmma)
  monkeypatch.setattr(dkdv, "lax", SimpleNamespace(fori_loop=fori_loop))
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
    wgmma(dv_ref, p, ("dO", slot))
    return wgmma(dk_ref, "dS", ("Q", slot))  # dK's wgmmas

  dkdv.walk_scores_ahead(
      s_ref, dp_ref, num_steps=num_steps, arrived=[ref("q_arrived"),
                                                   ref("do_arrived")],
      consumed=ref("consumed"), slot_of=slot_of, products=products,
      probabilities=probabilities, gradients=gradients)
  slots = [slot_of(step) for step in range(num_steps)]
  assert not fake.pending and fake.most_in_flight <= 2
  assert reads == slots and fake.released == slots
  assert fake.waited == {"q_arrived": slots, "do_arrived": slots}




@pytest.mark.parametrize("head_dim, option, kwargs", [
    (128, "prefetch_lse", dict(fused_dq=True)),
    pytest.param(128, "prefetch_lse", dict(persistent=False),  # CI's ten
                 marks=pytest.mark.slow),                      # minutes
    (256, "prefetch_lse", {}),
    (128, "lean_producer", dict(persistent=False)),
    pytest.param(128, "lean_producer", dict(persistent=True, num_ctas=5),
                 marks=pytest.mark.slow),
    (64, "lean_producer", {}),
    pytest.param(256, "lean_producer", {}, marks=pytest.mark.slow),
], ids=str)
def test_options_lower_and_change_the_kernels(head_dim, option, kwargs,
                                              cuda_lowering):
  """lse read early changes the dK/dV kernels (fused, plain, shared rows),
  lean producers both kernels' register budgets."""
  assert (_lower(head_dim, True, **{option: True}, **kwargs)
          != _lower(head_dim, True, **{option: False}, **kwargs))


def test_lean_producers_spend_the_same_budget():
  """The lean split moves registers from the producer to the consumers and
  spends the budget the default one does; the fused dQ keeps its own."""
  from pallas_kernels.mosaic.common import register_split
  lean, default = register_split(lean=True), register_split(lean=False)
  assert lean != default
  assert 2 * lean[0] + lean[1] == 2 * default[0] + default[1]
  _, [fused] = _configs(128, q_len=512, kv_len=512, fused_dq=True,
                        lean_producer=True)
  assert not fused.lean_producer


@pytest.mark.parametrize("is_causal", [False, True])
def test_dq_tiles_lower_and_change_the_dq_kernel_only(is_causal,
                                                      cuda_lowering):
  """`dq_tiles` gives the dQ kernel tiles of its own: its lowered kernel
  changes, the dK/dV kernel's does not; tiles equal to the dK/dV kernel's
  are its; the ranged kernels and a malformed pair are refused, and so are
  lengths off the 8-row TMA tiling."""
  configs = lambda **kw: _configs(64, is_causal, q_len=512, kv_len=512,
                                  persistent=False, **kw)
  (dq, [dkdv]), (own_dq, [own_dkdv]) = (configs(dq_tiles=(128, 64)),
                                        configs(dq_tiles=(64, 128)))
  assert (dq.block_q, dq.block_kv) == (128, 64)
  assert (own_dq.block_q, own_dq.block_kv) == (64, 128) and own_dkdv == dkdv
  q, kv = _structs(head_dim=64, q_len=512, kv_len=512)[:2]
  with pytest.raises(NotImplementedError, match="ranged"):
    backward.statics(q, kv, scale=0.1, is_causal=is_causal,
                     config=plan.BackwardConfig(dq_tiles=(64, 128)),
                     spec=object())
  with pytest.raises(ValueError, match="dq_tiles"):
    _lower(64, is_causal, dq_tiles=(64,))
  text = lambda **kw: _lower(64, is_causal, q_len=512, kv_len=512,
                             persistent=False, **kw)
  assert text(dq_tiles=(64, 128)) != text(dq_tiles=(128, 64))
  # Lengths of whole 8-row TMA tiles take any tiles, and rows of whole
  # swizzle tiles any lengths (read in place); others are refused.
  _lower(128, is_causal, q_len=512, kv_len=388, dq_tiles=(64, 128))
  with pytest.raises(NotImplementedError, match="multiple of block_kv"):
    _lower(96, is_causal, q_len=512, kv_len=388, dq_tiles=(64, 128))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, block_q", [(64, 128), (128, 64)])
def test_fused_dq_lowers_as_one_kernel(head_dim, block_q, is_causal,
                                       lowering_semantics):
  """`fused_dq=True`: one kernel computes dq, dk and dv (GQA 2:1, kv_len >
  q_len), at the tiles each head dim plans."""
  text = _lower(head_dim, is_causal, block_q=block_q, fused_dq=True)
  assert _kernels(text) == {"dq_dkdv"}
  assert "mosaic_flash_backward_dq\"" not in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=256), "one pass"),
    (dict(head_dim=128, persistent=True), "launch grid"),
    (dict(head_dim=128, overlap_softmax=False), "overlap_softmax"),
    (dict(head_dim=64, block_q=64), "one \\[64, 64\\] piece"),
    # kv_len 192: three K/V tiles, one consumer, two pieces for it
    (dict(head_dim=128, kv_len=192), "one \\[64, 64\\] piece"),
])
def test_fused_dq_refuses_what_it_does_not_cover(kwargs, match,
                                                 cuda_lowering):
  with pytest.raises(NotImplementedError, match=match):
    _lower(kwargs.pop("head_dim"), False, **{"fused_dq": True, **kwargs})


@pytest.mark.parametrize("head_dim, is_causal", [
    (64, True), (128, False), (256, True),
    *(pytest.param(d, c, marks=pytest.mark.slow)  # CI's ten minutes
      for d, c in ((64, False), (128, True), (256, False)))])
def test_persistent_backward_lowers(head_dim, is_causal, cuda_lowering):
  """`persistent=True` puts both kernels on a grid of `num_ctas` CTAs (a
  different module) and lowers; the ranged backward has no such grid."""
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
  assert persistent.as_text() != lowered(persistent=False).as_text()
  dq, dkdv = backward.statics(
      q, kv, scale=0.1, is_causal=is_causal,
      config=plan.BackwardConfig(persistent=True, shared_rows=False))
  # At most one CTA per tile (per pair of tiles under causal masking).
  tiles = 2 * 4 * 512 // (64 * dq.num_consumers)
  assert dq.num_ctas == min(132, tiles // 2 if is_causal else tiles)
  assert all(c.persistent for c in dkdv) and dq.persistent
  with pytest.raises(NotImplementedError, match="ranged"):
    backward._persistent(dataclasses.replace(dq, spec=object()), None,
                         tiles_per_head=1, num_heads=1, batch=1)


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
    (dict(q_len=256, kv_len=256, head_dim=72), {}, False),   # padded to 80
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
def test_wide_q_backward_at_d64_on_gpu(case, is_causal):
  """The backward at head_dim 64 on its planned 128-row Q tiles, through
  the dispatch, in both dtypes, against the reference."""
  _require_sm90()
  from pallas_kernels.mosaic import attention as mosaic_attention
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
    Case(2, 1024, 1024, 8, 8, 64),    # d=64's 128-row Q tiles
    Case(1, 256, 640, 4, 1, 64),      # MQA, kv_len > q_len
    Case(2, 512, 1024, 8, 2, 128),    # GQA 4:1
    Case(1, 1024, 384, 4, 2, 128),    # q_len > kv_len, odd K/V tile count
], ids=str)
def test_fused_dq_matches_reference_on_gpu(case, is_causal, monkeypatch):
  """The fused backward through the dispatch (every row of the plan
  fused), in both dtypes, against the reference; and the fused kernel is
  what ran."""
  _require_sm90()
  from pallas_kernels.mosaic import attention as mosaic_attention
  monkeypatch.setattr(plan, "BACKWARD_PLAN", tuple(
      (*key, dataclasses.replace(row, fused_dq=True, persistent=False))
      for *key, row in plan.BACKWARD_PLAN))
  attention = jax.jit(lambda q, k, v: _api_layout(*mosaic_attention.
      mosaic_attention(q, k, v, scale=q.shape[-1]**-0.5, is_causal=is_causal,
                       backward_blocks=BlockSizes.get_default(case.head_dim))))
  assert backward_kernels(attention, case) == {"dq_dkdv"}
  for dtype in (jnp.bfloat16, jnp.float16):
    check_against_reference(attention, case, dtype, is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, kwargs", [
    (64, dict(dq_tiles=(64, 128))), (128, dict(dq_tiles=(64, 128))),
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


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, is_causal, kernels", [
    (64, False, {"dq", "dkdv"}), (64, True, {"dq", "dkdv"}),
    (128, False, {"dq_dkdv"}), (128, True, {"dq", "dkdv"}),
])
def test_backward_default_at_long_kv_on_gpu(head_dim, is_causal, kernels):
  """The plan at kv_len 16384, through `flash_attention`: the fused
  backward at d=128 without a mask, else the two kernels, and its output,
  LSE and gradients obey the tolerance rule (GQA 2:1, q_len not the
  kv_len)."""
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
  run = lambda fused: jax.jit(functools.partial(
      mosaic_backward, scale=scale, is_causal=is_causal, fused_dq=fused,
      persistent=False, kv_head_copies=1))(q, k, v, out, lse, d_out, d_lse)
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
