"""Head dims between 64, 128 and 256 on the Mosaic kernels, at their own width.

A head dim that is a multiple of 16 from 64 to 256 runs at its own width
(`common.own_width_head_dim`) on the plan of the next of 64, 128 and 256
(`plan.plan_head_dim`), its shared-memory tiles in the widest swizzle whose
tiles divide a row (`common.swizzled`); any other is zero-padded to the next
such (`attention._pad_head_dim`). Here: those rules, and each kernel
cross-lowered for CUDA at 80, 96, 160 and 192 (Mosaic GPU checks wgmma's
shapes and swizzles and the TMA boxes as it lowers); the interpreter's
numerics at those dims are in test_mosaic_interpret*.py; `-m gpu` checks
them against the reference on an H200.
"""
from __future__ import annotations

import dataclasses

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import lower_mosaic
from tests.attention_checks import Case, check_against_reference

try:
  from pallas_kernels.mosaic import attention, common, plan
  from pallas_kernels.mosaic.backward import mosaic_backward
  from pallas_kernels.mosaic.forward import mosaic_forward
  from pallas_kernels.mosaic.masked import mosaic_forward_masked
  from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

from tests.test_mosaic_backward import (_kernels, _require_sm90, _structs,
                                        mosaic_attention_with)

BF16 = jnp.dtype(jnp.bfloat16)
# head_dim: the swizzle (bytes) of its 16-bit [rows, head_dim] tiles.
SWIZZLE_OF = {80: 32, 96: 64, 160: 64, 192: 128}
_SWIZZLE = re.compile(r"swizzle<(\d+) : i32>")


def _lowered(fn, *args) -> tuple[str, set[int]]:
  """The text of `fn` lowered for CUDA (`lower_mosaic.canonical`: with each
  Mosaic GPU kernel's module), and the swizzles of its kernels'
  shared-memory tiles."""
  text = lower_mosaic.canonical(fn, args)
  return text, {int(s) for s in _SWIZZLE.findall(text)}


@pytest.mark.parametrize("columns, dtype, swizzle", [
    (64, jnp.bfloat16, 128), (128, jnp.bfloat16, 128),
    (256, jnp.bfloat16, 128), (80, jnp.bfloat16, 32), (96, jnp.bfloat16, 64),
    (112, jnp.bfloat16, 32), (160, jnp.bfloat16, 64),
    (192, jnp.bfloat16, 128), (224, jnp.bfloat16, 64),
    (64, jnp.float8_e4m3fn, 64), (128, jnp.float8_e4m3fn, 128),
    (64, jnp.float32, 128),
])
def test_swizzle_is_the_widest_whose_tiles_divide_the_row(columns, dtype,
                                                          swizzle):
  """What the plans' dims took before (up to 128 bytes, a row at least
  as wide), and for the others the widest that divides the row."""
  tiling, swizzling = common.swizzled(columns, dtype)
  assert swizzling.swizzle == swizzle
  assert tiling.tiling == (8, swizzle // jnp.dtype(dtype).itemsize)


def test_rows_of_no_whole_swizzle_tile_are_refused():
  with pytest.raises(NotImplementedError, match="swizzle"):
    common.swizzled(72, jnp.bfloat16)   # 144 bytes


@pytest.mark.parametrize("head_dim", [16, 48, 64, 72, 80, 88, 96, 128, 144,
                                      160, 176, 192, 250, 256, 272])
def test_own_width_head_dims(head_dim):
  """16-bit: the multiples of 16 from 64 to 256; FP8: 64, 128, 256."""
  assert common.own_width_head_dim(head_dim, BF16) == (
      64 <= head_dim <= 256 and head_dim % 16 == 0)
  assert common.own_width_head_dim(head_dim, jnp.float8_e4m3fn) == (
      head_dim in (64, 128, 256))


@pytest.mark.parametrize("head_dim, width", [
    (16, 64), (40, 64), (64, 64), (72, 80), (80, 80), (96, 96), (100, 112),
    (192, 192), (200, 208), (256, 256)])
def test_mosaic_attention_pads_only_to_the_next_own_width(head_dim, width):
  x = jnp.zeros((1, 8, 1, head_dim), jnp.bfloat16)
  (padded,) = attention._pad_head_dim(x)
  assert padded.shape[-1] == width
  if width == head_dim:
    assert padded is x


def test_head_dims_above_256_are_refused():
  with pytest.raises(NotImplementedError, match="256"):
    attention._pad_head_dim(jnp.zeros((1, 8, 1, 320), jnp.bfloat16))


def test_own_width_dims_run_on_the_next_plan_dims_rows():
  """The forward's and backward's plans of the next of 64, 128, 256; the
  forwards' K/V tiles their own (128 rows up to 176, 64 above)."""
  for head_dim, planned, block_kv in ((80, 128, 128), (96, 128, 128),
                                      (160, 256, 128), (176, 256, 128),
                                      (192, 256, 64)):
    assert plan.plan_head_dim(head_dim) == planned
    assert plan.default_block_kv(head_dim) == block_kv
    for causal in (False, True):
      for seq in (1024, 4096):
        shape = dict(is_causal=causal, q_len=seq, kv_len=seq)
        assert plan.forward_config(head_dim=head_dim, **shape) == (
            dataclasses.replace(plan.forward_config(head_dim=planned,
                                                    **shape),
                                block_kv=block_kv))


@pytest.mark.parametrize("head_dim", list(SWIZZLE_OF))
@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_lowers_at_its_own_width(head_dim, is_causal,
                                         cuda_lowering):
  """The plan's forward on unpadded operands, its Q, K, V (and O) tiles
  in `SWIZZLE_OF`'s swizzle."""
  q = jax.ShapeDtypeStruct((2, 256, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 384, 2, head_dim), jnp.bfloat16)
  forward = functools.partial(mosaic_forward, scale=head_dim**-0.5,
                              is_causal=is_causal)
  text, swizzles = _lowered(forward, q, kv, kv)
  assert f"tensor<2x256x4x{head_dim}xbf16>" in text
  assert swizzles == {SWIZZLE_OF[head_dim]}


@pytest.mark.parametrize("head_dim", list(SWIZZLE_OF))
def test_masked_forward_lowers_at_its_own_width(head_dim, cuda_lowering):
  q_len, kv_len, fields, _ = lower_mosaic.MASKED_CASES["ragged causal"]
  from pallas_kernels.masking import MaskSpec
  spec = MaskSpec(q_len=q_len, kv_len=kv_len, **fields)
  q = jax.ShapeDtypeStruct((2, q_len, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), jnp.bfloat16)
  forward = functools.partial(mosaic_forward_masked, scale=0.1, spec=spec)
  assert _lowered(forward, q, kv, kv)[1] == {SWIZZLE_OF[head_dim]}


@pytest.mark.parametrize("head_dim, block_kv", [(144, 128), (160, 64)])
def test_masked_forward_halves_its_tile_beside_a_bias(head_dim, block_kv,
                                                      cuda_lowering,
                                                      monkeypatch):
  """128-key tiles up to d=176 (`plan.default_block_kv`); beside a bias's
  tile per consumer they fit at 144 and not from 160, where the masked
  forward halves them (`forward.fitting_block_kv`) rather than refusing."""
  from pallas_kernels.masking import MaskSpec
  from pallas_kernels.mosaic import forward
  tiles = []
  check = forward.check_supported
  monkeypatch.setattr(forward, "check_supported", lambda *a, **kw: (
      tiles.append(kw["block_kv"]), check(*a, **kw))[1])
  spec = MaskSpec(q_len=256, kv_len=384, is_causal=True, has_bias=True)
  q = jax.ShapeDtypeStruct((1, 256, 2, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 384, 2, head_dim), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 2, 256, 384), jnp.bfloat16)
  forward_fn = lambda q, k, v, bias: mosaic_forward_masked(
      q, k, v, bias=bias, scale=0.1, spec=spec)
  jax.jit(forward_fn).trace(q, kv, kv, bias).lower(
      lowering_platforms=("cuda",))
  assert tiles[0] == 128 and tiles[-1] == block_kv


@pytest.mark.parametrize("head_dim, kv_len, kernels, swizzles", [
    # Up to 128: the dQ and one dK/dV kernel (persistent at 1k, the launch
    # grid above).
    (80, 1024, {"dq", "dkdv"}, {32}),
    (96, 2048, {"dq", "dkdv"}, {64}),
    # Above 128, up to 1k: dK and dV in a pass each (registers), as d=256.
    (160, 1024, {"dq", "dk", "dv"}, {64}),
    # Above 1k: shared K/V rows, their halves (and the exchanged scores)
    # in the swizzle both divide: 80 columns a half take 32 bytes, 96 64.
    (160, 2048, {"dq", "dkdv"}, {64, 32}),
    (192, 2048, {"dq", "dkdv"}, {128, 64}),
])
def test_backward_lowers_at_its_own_width(head_dim, kv_len, kernels, swizzles,
                                          cuda_lowering):
  args = _structs(batch=1, q_len=kv_len, kv_len=kv_len, head_dim=head_dim)
  backward = functools.partial(mosaic_backward, scale=0.1, is_causal=True)
  text, got = _lowered(backward, *args)
  assert _kernels(text) == kernels
  assert got == swizzles


@pytest.mark.parametrize("head_dim", [96, 192])
def test_masked_backward_lowers_at_its_own_width(head_dim, cuda_lowering):
  q_len, kv_len, fields, _ = lower_mosaic.MASKED_CASES["ragged causal"]
  from pallas_kernels.masking import MaskSpec
  spec = MaskSpec(q_len=q_len, kv_len=kv_len, **fields)
  args = _structs(q_len=q_len, kv_len=kv_len, head_dim=head_dim)
  backward = functools.partial(mosaic_backward_masked, scale=0.1, spec=spec)
  assert _lowered(backward, *args)[1] == {SWIZZLE_OF[head_dim]}


@pytest.mark.parametrize("head_dim, width", [(96, 96), (72, 80)])
def test_mosaic_route_pads_only_what_the_kernels_do_not_take(
    head_dim, width, cuda_lowering, monkeypatch):
  """Through `mosaic_attention` with gradients, as on an H200: head dim 96
  reaches the kernels as it is (no pad in the module), 72 padded to 80.
  (The backward's delta kernel, in Triton, masks the columns past a tile
  of 128 compiled; interpreted, Pallas would pad its operands.)"""
  from pallas_kernels import compat as versions
  from pallas_kernels.config import BlockSizes
  monkeypatch.setattr(versions, "has_gpu", lambda: True)
  x = jax.ShapeDtypeStruct((1, 256, 2, head_dim), jnp.bfloat16)

  def loss(q, k, v):
    out, lse = attention.mosaic_attention(
        q, k, v, scale=head_dim**-0.5, is_causal=True,
        backward_blocks=BlockSizes.get_default(head_dim, "NVIDIA H200"))
    return out.astype(jnp.float32).sum() + lse.sum()

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
      lowering_platforms=("cuda",))
  assert [g.shape for g in lowered.out_info] == [x.shape] * 3
  padded_to = re.findall(r"stablehlo\.pad [^\n]*-> tensor<1x256x2x(\d+)xbf16>",
                         lowered.as_text())
  if width == head_dim:
    assert not padded_to
  else:  # the operands padded (and their cotangents sliced, by a pad)
    assert str(width) in padded_to


def _public_attention(is_causal):
  import jax_flash
  return jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, is_causal=is_causal, return_residual=True,
      implementation="mosaic"))


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", [
    Case(2, 1024, 1024, 8, 2, 80),    # 32-byte swizzle, GQA 4:1
    Case(1, 2048, 2048, 8, 8, 96),    # Phi-3's dim, the launch grid
    Case(1, 512, 1024, 4, 1, 112),    # MQA, kv_len > q_len
    Case(1, 1024, 1536, 8, 2, 160),   # shared rows in 32-byte tiles
    Case(1, 2048, 2048, 4, 4, 192),   # shared rows in 64-byte tiles
    Case(1, 1024, 512, 4, 2, 224),    # q_len > kv_len, two dK/dV passes
    Case(1, 1000, 1537, 8, 2, 96),    # ragged: the masked backward
    Case(1, 777, 300, 4, 4, 176),     # ragged, 176 (no shared rows)
], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_own_width_matches_reference_on_gpu(case, is_causal, dtype):
  """Output, LSE and gradients through `flash_attention` on its Mosaic
  path, at head dims the kernels take at their own width."""
  _require_sm90()
  check_against_reference(_public_attention(is_causal), case, dtype,
                          is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, variants", [
    # 128-key tiles with a score change (window, soft cap).
    (144, dict(is_causal=True, local_window_size=(300, 0),
               logits_soft_cap=30.0)),
    (176, dict(is_causal=True, local_window_size=(300, 0),
               logits_soft_cap=30.0)),
    # A bias beside them does not fit from 160: the tiles halve.
    (160, dict(is_causal=True, bias=True)),
])
def test_masked_between_dims_match_reference_on_gpu(head_dim, variants):
  """The masked kernels at head dims between 128 and 256 on 128-key tiles
  (`plan.default_block_kv`; halved beside a bias, `forward.
  fitting_block_kv`), through `flash_attention`, ragged lengths."""
  import jax_flash
  _require_sm90()
  case = Case(1, 1000, 1100, 4, 2, head_dim)
  variants = dict(variants)
  if variants.pop("bias", False):
    variants["bias"] = jax.random.normal(
        jax.random.key(3), (1, 4, case.q_len, case.kv_len), jnp.bfloat16)
  attention = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, return_residual=True, implementation="mosaic", **variants))
  check_against_reference(attention, case, jnp.bfloat16, **variants)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, options", [
    (96, dict(persistent=True)),
    (96, dict(dq_tiles=(64, 128), persistent=False)),
    (96, dict(scores_ahead=True, persistent=False)),
    (160, dict(shared_rows=True, persistent=True)),
    (160, dict(shared_rows=False, persistent=False)),
    (192, dict(shared_rows=True, persistent=False)),
    (192, dict(shared_rows=False, persistent=True)),
])
def test_own_width_backward_forms_match_reference_on_gpu(head_dim, options,
                                                          is_causal):
  """The backward's forms other than the plan's at these lengths (the
  persistent grid, the dQ kernel's own tiles, Sᵀ ahead, shared rows and
  two passes) at their own width, against the reference."""
  _require_sm90()
  if is_causal and options.get("scores_ahead"):
    pytest.skip("scores_ahead runs without a causal mask")
  attention_fn = jax.jit(functools.partial(
      mosaic_attention_with(**options), is_causal=is_causal))
  check_against_reference(attention_fn, Case(1, 1024, 1024, 4, 2, head_dim),
                          jnp.bfloat16, is_causal=is_causal)
