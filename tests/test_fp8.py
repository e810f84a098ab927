"""FP8 attention in the public API (`jax_flash.fp8`): the Hadamard rotation,
quantisation, `flash_attention_fp8` on its portable path (CPU), and the
Mosaic kernel against it on a Hopper GPU."""
from __future__ import annotations

import inspect
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import fp8_accuracy
from benchmarks.fp8_accuracy import (emulated_fp8_attention, outlier_qkv,
                                     reference_float64, rmse)
from benchmarks.lower_mosaic import FP8_TILES
from jax_flash import (Fp8Tensor, attention_reference, flash_attention_fp8,
                       hadamard_rotation, numerics, quantize_fp8,
                       quantize_qkv)
from jax_flash.fp8 import FP8_MAX, K_BLOCK_ROWS, Q_BLOCK_ROWS
from pallas_kernels import compat

FP8 = jnp.float8_e4m3fn
ON_SM90 = (compat.gpu_compute_capability() or (0,))[0] == 9


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


# The rotation.


@pytest.mark.parametrize("head_dim", [1, 2, 16, 128, 256])
def test_hadamard_rotation_is_orthogonal(head_dim):
  h = np.asarray(hadamard_rotation(head_dim, seed=3), np.float64)
  assert h.shape == (head_dim, head_dim) and h.dtype == np.float64
  np.testing.assert_allclose(h @ h.T, np.eye(head_dim), atol=1e-6)
  # Every entry ±1/sqrt(d): an outlier feature spreads evenly over all.
  np.testing.assert_allclose(np.abs(h), head_dim**-0.5, rtol=1e-6)


def test_hadamard_rotation_is_seeded():
  same = hadamard_rotation(64, seed=7), hadamard_rotation(64, seed=7)
  other = hadamard_rotation(64, seed=8)
  np.testing.assert_array_equal(*same)
  # Another seed flips the signs of some rows of the same Walsh-Hadamard
  # matrix.
  signs = np.asarray(other[:, 0] / same[0][:, 0])
  assert set(np.round(signs).tolist()) == {-1.0, 1.0}
  np.testing.assert_allclose(other, signs[:, None] * same[0], rtol=1e-6)
  # A key, and a traced seed under jit, give the same matrix as the int.
  np.testing.assert_array_equal(hadamard_rotation(64, jax.random.key(7)),
                                same[0])
  traced = jax.jit(hadamard_rotation, static_argnums=0)(64, 7)
  np.testing.assert_array_equal(traced, same[0])


@pytest.mark.parametrize("head_dim", [0, 40, 96])
def test_hadamard_rotation_rejects_other_head_dims(head_dim):
  with pytest.raises(ValueError, match="head_dim must be a power of two"):
    hadamard_rotation(head_dim)


@pytest.mark.parametrize("head_dim", [2.0, jnp.int32(64)])
def test_hadamard_rotation_wants_a_python_int(head_dim):
  with pytest.raises(TypeError, match="head_dim must be a Python int"):
    hadamard_rotation(head_dim)


def test_rotation_leaves_logits_unchanged():
  """(QH)(KH)ᵀ = QKᵀ to float32 rounding, with outliers in Q and K."""
  q, k, _ = outlier_qkv(0, batch=1, seq=64, heads=2, head_dim=128)
  h = hadamard_rotation(128, seed=1)
  dot = lambda a, b: jnp.einsum("bqhd,bkhd->bhqk", a, b,
                                precision=jax.lax.Precision.HIGHEST)
  matmul = lambda x: jnp.matmul(x, h, precision=jax.lax.Precision.HIGHEST)
  exact = dot(q, k)
  rotated = dot(matmul(q), matmul(k))
  scale = float(jnp.linalg.norm(q, axis=-1).max()
                * jnp.linalg.norm(k, axis=-1).max())
  assert float(jnp.abs(rotated - exact).max()) < 1e-5 * scale
  # ... while the largest entry shrinks: the outliers are spread.
  assert float(jnp.abs(matmul(q)).max()) < 0.5 * float(jnp.abs(q).max())


# Quantisation.


@pytest.mark.parametrize("granularity, block_rows, blocks", [
    ("tensor", None, None), ("block", 64, 2), ("block", 32, 4)])
def test_quantize_fp8_round_trip(granularity, block_rows, blocks):
  """Within e4m3's rounding; each slice's amax on 448; zero slices kept."""
  x = _normal(0, (2, 100, 3, 32)) * jnp.array([1.0, 30.0, 1e-3])[:, None]
  x = x.at[1, :, 2].set(0.0)        # an all-zero (batch, head)
  x = x.at[0, :32, 0].set(0.0)      # an all-zero block (or a part)
  x8 = quantize_fp8(x, granularity=granularity, block_rows=block_rows)
  assert x8.data.dtype == FP8 and x8.data.shape == x.shape
  assert x8.descale.dtype == jnp.float32
  assert x8.descale.shape == ((2, 3) if blocks is None else (2, 3, blocks))
  assert x8.block_rows == block_rows and not x8.rotated
  factor = Fp8Tensor(jnp.ones(x.shape, FP8), x8.descale,
                     block_rows).dequantize()          # per element
  # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value; below its
  # normals (2^-6 of 448), half a subnormal step, 2^-10 of the factor.
  error = jnp.abs(x8.dequantize() - x)
  assert bool(jnp.all(error <= 2**-4 * jnp.abs(x) + 2**-10 * factor))
  data = np.abs(np.asarray(x8.data.astype(jnp.float32)))
  assert np.isfinite(data).all() and data.max() == FP8_MAX
  assert float(x8.descale[1, 2].min()) == 1.0          # zero: descale 1
  assert not np.asarray(x8.data[1, :, 2].astype(jnp.float32)).any()
  if blocks == 4:
    assert float(x8.descale[0, 0, 0]) == 1.0
    assert float(x8.descale[0, 0, 1]) != 1.0


def test_block_scales_beat_tensor_scales_where_blocks_differ_in_range():
  """A block 2^-16 below the tensor's range falls under e4m3's subnormals
  with one scale per tensor (flushed to 0), and keeps its 2^-4 relative
  steps with its own."""
  x = _normal(1, (1, 256, 2, 64)) * jnp.repeat(
      2.0 ** jnp.array([-16.0, 0.0, -4.0, 2.0]), 64)[:, None, None]
  error = lambda t: float(jnp.abs(t.dequantize() - x)[:, :64].max())
  assert error(quantize_fp8(x, granularity="block")) < 0.1 * error(
      quantize_fp8(x))


def test_quantize_qkv_layouts():
  q, k, v = (_normal(i, s) for i, s in enumerate(
      [(2, 100, 8, 64), (2, 300, 2, 64), (2, 300, 2, 64)]))
  q8, k8, v8 = quantize_qkv(q, k, v)
  assert (q8.descale.shape, k8.descale.shape, v8.descale.shape) == (
      (2, 8, 2), (2, 2, 2), (2, 2))
  assert (q8.block_rows, k8.block_rows, v8.block_rows) == (64, 256, None)
  q8, k8, v8 = quantize_qkv(q, k, v, granularity="tensor", incoherent=True)
  assert (q8.descale.shape, k8.descale.shape) == ((2, 8), (2, 2))
  assert q8.rotated and k8.rotated and not v8.rotated
  # V is never rotated; Q and K are rotated by the same H.
  np.testing.assert_array_equal(v8.data, quantize_fp8(v).data)
  rotated = jnp.matmul(q, hadamard_rotation(64, seed=0),
                       precision="highest")
  assert bool(jnp.all(jnp.abs(q8.dequantize() - rotated)
                      <= 2**-4 * jnp.abs(rotated) + 2**-10 * q8.descale.max()))
  # A pytree: two leaves, the rest static.
  assert len(jax.tree.leaves(q8)) == 2
  rebuilt = jax.tree.map(lambda x: x, q8)
  assert (rebuilt.block_rows, rebuilt.rotated) == (None, True)


def test_block_scales_cover_whole_kernel_tiles():
  """A K factor of the default block scales spans whole K/V tiles of the
  FP8 kernel at every head dim (else the kernel falls back to shorter
  tiles), and a Q factor whole Q tiles."""
  from pallas_kernels.mosaic import plan
  from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8
  assert all(K_BLOCK_ROWS % tile == 0 for tile in plan.FP8_BLOCK_KV.values())
  assert Q_BLOCK_ROWS % inspect.signature(
      mosaic_forward_fp8).parameters["block_q"].default == 0


@pytest.mark.parametrize("call, error, match", [
    (lambda: quantize_fp8(jnp.ones((1, 8, 1, 16), jnp.int32)),
     TypeError, "x must be float"),
    (lambda: quantize_fp8(jnp.ones((8, 1, 16))), ValueError, "x must be"),
    (lambda: quantize_fp8(jnp.ones((1, 8, 1, 16)), granularity="row"),
     ValueError, "granularity"),
    (lambda: quantize_fp8(jnp.ones((1, 8, 1, 16)), block_rows=4),
     ValueError, "block_rows"),
    (lambda: quantize_fp8(jnp.ones((1, 8, 1, 16)), granularity="block",
                          block_rows=0), ValueError, "block_rows"),
    (lambda: quantize_qkv(jnp.ones((1, 8, 1, 16)),
                          jnp.ones((1, 8, 1, 16), jnp.int8),
                          jnp.ones((1, 8, 1, 16))), TypeError, "key"),
    (lambda: quantize_qkv(jnp.ones((1, 8, 1, 16)), jnp.ones((1, 8, 1, 32)),
                          jnp.ones((1, 8, 1, 32)), incoherent=True),
     ValueError, "head_dim"),
    (lambda: quantize_qkv(*[jnp.ones((1, 8, 1, 48))] * 3, incoherent=True),
     ValueError, "power of two"),
])
def test_quantize_rejects(call, error, match):
  with pytest.raises(error, match=match):
    call()


# flash_attention_fp8 on the portable path.


@pytest.mark.parametrize("q_len, kv_len, heads, kv_heads, head_dim, causal, "
                         "granularity, incoherent", [
                             (97, 130, 8, 2, 40, True, "block", False),
                             (1, 257, 4, 4, 64, False, "tensor", True),
                             (130, 64, 6, 1, 32, True, "block", True),
                         ])
def test_portable_path_is_the_reference_on_dequantised_inputs(
    q_len, kv_len, heads, kv_heads, head_dim, causal, granularity,
    incoherent):
  q = _normal(0, (2, q_len, heads, head_dim))
  k, v = (_normal(i, (2, kv_len, kv_heads, head_dim)) for i in (1, 2))
  fp8 = quantize_qkv(q, k, v, granularity=granularity, incoherent=incoherent,
                     seed=5)
  out, lse = flash_attention_fp8(*fp8, is_causal=causal, return_residual=True,
                                 out_dtype=jnp.float32)
  want, want_lse = attention_reference(*(x.dequantize() for x in fp8),
                                       is_causal=causal, return_residual=True)
  assert out.shape == q.shape and lse.shape == q.shape[:3]
  np.testing.assert_allclose(out, want, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=1e-5)
  # ... and close to attention on the unquantised inputs, rotation or not
  # (e4m3's 2^-4 relative steps, partly averaged over the keys).
  exact = attention_reference(q, k, v, is_causal=causal)
  assert float(jnp.abs(out - exact).max()) < 0.25
  default = flash_attention_fp8(*fp8, is_causal=causal)
  assert default.dtype == jnp.bfloat16
  np.testing.assert_allclose(default.astype(jnp.float32), out, atol=2e-2)


# flash_attention's mask arguments, on [2, 100, 4, 64] queries and
# [2, 200, 2, 64] keys: what flash_attention_fp8 takes beyond is_causal.
_FP8_MASKS = dict(is_causal=True, q_offset=jnp.array([100, 20]),
                  local_window_size=(60, 0),
                  key_value_seq_lengths=jnp.array([200, 70]),
                  segment_ids=(jnp.repeat(jnp.arange(2), 50),
                               jnp.repeat(jnp.arange(2), 100)),
                  logits_soft_cap=8.0, alibi_slopes=jnp.array([0.5, 0.2,
                                                               0.1, 0.05]))


def test_portable_path_takes_the_masks_of_flash_attention():
  """Lengths, a window, bottom-right causal, segment ids, the soft cap and
  ALiBi on the dequantised inputs, as `attention_reference` applies them
  (one definition), including rows that see nothing (0, lse -inf)."""
  q = _normal(0, (2, 100, 4, 64))
  k, v = (_normal(i, (2, 200, 2, 64)) for i in (1, 2))
  fp8 = quantize_qkv(q, k, v, seed=3)
  out, lse = flash_attention_fp8(*fp8, return_residual=True,
                                 out_dtype=jnp.float32, **_FP8_MASKS)
  want, want_lse = attention_reference(*(x.dequantize() for x in fp8),
                                       return_residual=True, **_FP8_MASKS)
  np.testing.assert_allclose(out, want, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=1e-5)
  assert bool(jnp.isneginf(lse).any())  # batch 1's rows past its segment


def test_portable_path_takes_mask_functions_and_dense_masks():
  """A dense mask, a `mask_fn` and a `score_fn` (each of the batch and head
  it is called with) as `attention_reference` applies them."""
  q = _normal(0, (2, 100, 4, 64))
  k, v = (_normal(i, (2, 200, 2, 64)) for i in (1, 2))
  fp8 = quantize_qkv(q, k, v, seed=3)
  masks = dict(
      mask=jax.random.bernoulli(jax.random.key(4), 0.7, (2, 1, 100, 200)),
      mask_fn=lambda b, h, i, j: (i + j + b + h) % 5 != 0,
      score_fn=lambda s, b, h, i, j: s - 0.01 * (h + 1) * jnp.abs(i - j))
  out = flash_attention_fp8(*fp8, out_dtype=jnp.float32, **masks)
  want = attention_reference(*(x.dequantize() for x in fp8), **masks)
  np.testing.assert_allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(key_value_seq_lengths=jnp.array([1, 2, 3])), ValueError,
     "key_value_seq_lengths"),
    (dict(mask=jnp.ones((3, 1, 128, 128), bool)), ValueError, "mask"),
    (dict(local_window_size=(-1, 0)), ValueError, "local_window_size"),
    (dict(alibi_slopes=jnp.ones(3)), ValueError, "alibi_slopes"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
])
def test_fp8_masks_are_checked_as_flash_attentions(kwargs, error, match):
  with pytest.raises(error, match=match):
    flash_attention_fp8(_fp8(_Q), _fp8(_KV), _fp8(_KV), **kwargs)


def test_fp8_masks_lower_to_the_masked_fp8_kernel(cuda_lowering,
                                                   monkeypatch):
  """On sm90 (cross-lowered), a masked call runs the Mosaic FP8 kernel on
  plan rows, kv_len 200 (no multiple of its tiles) included."""
  monkeypatch.setattr(compat, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(compat, "has_gpu", lambda: True)
  q8, k8, v8 = quantize_qkv(_normal(0, (2, 100, 4, 64)),
                            *(_normal(i, (2, 200, 2, 64)) for i in (1, 2)))
  text = jax.jit(lambda q8, k8, v8: flash_attention_fp8(
      q8, k8, v8, implementation="mosaic", **_FP8_MASKS)).trace(
          q8, k8, v8).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_flash_forward" in text


def test_incoherent_processing_beats_per_tensor_on_outliers():
  """FA3's experiment, small: Hadamard-rotated Q and K against per-tensor
  scales on N(0, 1) + N(0, 100)-at-0.1% inputs. 1.4-1.6x lower RMSE at
  this size over seeds 0-3 (2x at 4k, growing with seq and head_dim:
  `benchmarks.fp8_accuracy`); the unrotated block scales gain ~1.0x."""
  q, k, v = outlier_qkv(0, batch=1, seq=512, heads=4, head_dim=128)
  want = reference_float64(q, k, v)
  error = lambda **kw: rmse(flash_attention_fp8(
      *quantize_qkv(q, k, v, seed=0, **kw), out_dtype=jnp.float32), want)
  per_tensor = error(granularity="tensor")
  incoherent = error(granularity="block", incoherent=True)
  assert per_tensor > 1.25 * incoherent, (per_tensor, incoherent)


def test_jit_with_a_traced_seed():
  q = _normal(0, (1, 64, 4, 32))
  k, v = (_normal(i, (1, 64, 2, 32)) for i in (1, 2))

  @jax.jit
  def fp8_attention(q, k, v, seed):
    return flash_attention_fp8(*quantize_qkv(q, k, v, incoherent=True,
                                             seed=seed), is_causal=True)

  eager = flash_attention_fp8(*quantize_qkv(q, k, v, incoherent=True,
                                            seed=3), is_causal=True)
  np.testing.assert_array_equal(fp8_attention(q, k, v, 3), eager)
  assert not np.array_equal(fp8_attention(q, k, v, 4), eager)
  # Fp8Tensors pass through jit as pytrees (block_rows static).
  fp8 = quantize_qkv(q, k, v)
  np.testing.assert_array_equal(jax.jit(flash_attention_fp8)(*fp8),
                                flash_attention_fp8(*fp8))


def test_differentiating_raises():
  q = _normal(0, (1, 16, 2, 32))
  loss = lambda q: flash_attention_fp8(*quantize_qkv(q, q, q)).astype(
      jnp.float32).sum()
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(loss)(q)


def _fp8(shape, *, block_rows=None, rotated=False, dtype=FP8, descale=None):
  batch, seq, heads, _ = shape
  if descale is None:
    descale = (batch, heads) if block_rows is None else (
        batch, heads, -(-seq // block_rows))
  return Fp8Tensor(jnp.zeros(shape, dtype), jnp.ones(descale), block_rows,
                   rotated)


_Q, _KV = (1, 128, 4, 64), (1, 128, 2, 64)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((jnp.zeros(_Q), _fp8(_KV), _fp8(_KV)), {}, TypeError,
     "query must be an Fp8Tensor"),
    ((_fp8(_Q), _fp8(_KV, dtype=jnp.bfloat16), _fp8(_KV)), {}, TypeError,
     "key.data must be float8_e4m3fn"),
    ((_fp8(_Q, descale=(1, 3)), _fp8(_KV), _fp8(_KV)), {}, ValueError,
     r"query.descale must be \(1, 4\)"),
    ((_fp8(_Q, block_rows=64, descale=(1, 4, 3)), _fp8(_KV), _fp8(_KV)), {},
     ValueError, r"query.descale must be \(1, 4, 2\)"),
    ((_fp8(_Q), _fp8(_KV), _fp8(_KV, block_rows=64)), {}, ValueError,
     "value must be quantised per"),
    ((_fp8(_Q), _fp8((1, 128, 3, 64)), _fp8((1, 128, 3, 64))), {},
     ValueError, "multiple of num_kv_heads"),
    ((_fp8(_Q), _fp8((1, 128, 2, 32)), _fp8((1, 128, 2, 32))), {},
     ValueError, "key and value must both be"),
    ((_fp8(_Q), _fp8(_KV), _fp8((1, 64, 2, 64))), {}, ValueError,
     "key and value must both be"),
    ((_fp8(_Q, rotated=True), _fp8(_KV), _fp8(_KV)), {}, ValueError,
     "both be rotated"),
    ((_fp8(_Q), _fp8(_KV), _fp8(_KV, rotated=True)), {}, ValueError,
     "value must not be rotated"),
    ((_fp8(_Q), _fp8(_KV), _fp8(_KV)), {"implementation": "cuda"},
     ValueError, "implementation"),
    ((_fp8(_Q), _fp8(_KV), _fp8(_KV)), {"implementation": "triton"},
     NotImplementedError, "Triton"),
    ((_fp8(_Q), _fp8(_KV), _fp8(_KV)), {"out_dtype": jnp.int32}, TypeError,
     "out_dtype"),
])
def test_flash_attention_fp8_rejects(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    flash_attention_fp8(*args, **kwargs)


@pytest.mark.skipif(ON_SM90, reason="the kernel runs here")
def test_mosaic_needs_sm90():
  with pytest.raises(NotImplementedError, match="sm90"):
    flash_attention_fp8(_fp8(_Q), _fp8(_KV), _fp8(_KV),
                        implementation="mosaic")


# The benchmark.


def test_float64_reference_is_numerics():
  q, k, v = outlier_qkv(1, batch=1, seq=48, heads=2, head_dim=16)
  np.testing.assert_allclose(reference_float64(q, k, v),
                             numerics.attention_float64(q, k, v), rtol=1e-12,
                             atol=1e-12)


def test_emulation_rounds_p_only():
  """The emulated kernel differs from the exact dequantised attention by
  P's e4m3 rounding: an FP8-sized error, not zero, not more."""
  q, k, v = outlier_qkv(2, batch=1, seq=128, heads=4, head_dim=64,
                        kv_heads=2)
  fp8 = quantize_qkv(q, k, v)
  exact, exact_lse = flash_attention_fp8(*fp8, is_causal=True,
                                         return_residual=True,
                                         out_dtype=jnp.float32)
  out, lse = emulated_fp8_attention(*fp8, is_causal=True)
  np.testing.assert_allclose(lse, exact_lse, atol=1e-5)
  size = float(jnp.abs(exact).mean())
  assert 1e-4 * size < float(jnp.abs(out - exact).mean()) < 2**-4 * size


def test_benchmark_smoke(tmp_path):
  out = str(tmp_path / "fp8.json")
  assert fp8_accuracy.main(["--smoke", "--out", out]) == 0
  result = json.load(open(out))
  assert {r["method"] for r in result["records"]} == set(
      fp8_accuracy.METHODS)
  rmses = {r["method"]: r["rmse"] for r in result["records"]}
  assert all(math.isfinite(x) and x > 0 for x in rmses.values())
  assert rmses["bf16"] < 0.2 * rmses["fp8 tensor"]
  assert "tensor / block+incoherent" in open(tmp_path / "fp8.md").read()


def test_error_terms_diagnostic(tmp_path):
  """`diagnostics.fp8_error_terms`: each rounding alone is smaller than all
  of them together, and the rotation shrinks Q's and K's term (a swapped
  or missing rotation fails it)."""
  from benchmarks.diagnostics import fp8_error_terms
  out = str(tmp_path / "terms.json")
  assert fp8_error_terms.main(["--seq", "1024", "--head-dims", "64",
                               "--heads", "2", "--out", out]) == 0
  rmses = {r["term"]: r["rmse"] for r in json.load(open(out))["records"]}
  assert set(rmses) == set(fp8_error_terms.TERMS)
  for term in ("P", "V", "QK"):
    assert 0 < rmses[term] < rmses["all"]
  assert rmses["QK rotated"] < 0.8 * rmses["QK"]
  assert rmses["all rotated"] < 0.8 * rmses["all"]


# The kernel on a Hopper GPU.


@pytest.mark.gpu
@pytest.mark.parametrize("incoherent", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("seq", [1024, 2048])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mosaic_kernel_matches_dequantised_reference_on_gpu(
    head_dim, seq, is_causal, incoherent):
  """The kernel against float32 attention on the same dequantised inputs,
  within FlashAttention's rule with FP8 as the precision: a mean error at
  most 2x the emulated kernel arithmetic's (P rounded to e4m3) plus the
  bf16 output's rounding; the worst element within 2x the emulation's
  worst plus 2**-5 of the largest output. GQA 8:2, outlier inputs, q_len 1000 (padded to
  the kernel's tile) against kv_len seq."""
  _check_kernel_on_gpu(head_dim, seq, is_causal, incoherent)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mosaic_kernel_on_a_key_tail_on_gpu(head_dim, is_causal):
  """As above at kv_len 1001, which no K/V tile divides, on the plain
  kernel (no spec): K/V rows padded to 1008, TMA's zero fill past them,
  the last block masked past kv_len without a causal mask."""
  _check_kernel_on_gpu(head_dim, 1001, is_causal, False)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, block_kv", FP8_TILES)
def test_mosaic_kernel_on_each_tile_on_gpu(head_dim, block_kv, is_causal):
  """As above on every K/V tile the FP8 forward may run (the planned one
  and those it halves to, `forward.fitting_block_kv`; at d=256 on 128-key
  tiles O leaves in two column pieces), per-tensor scales (a block of K
  rows per factor must hold whole tiles): kv_len 2048."""
  _check_kernel_on_gpu(head_dim, 2048, is_causal, False, block_kv=block_kv,
                       granularity="tensor")


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mosaic_kernel_on_the_launch_grid_on_gpu(head_dim, is_causal):
  """As above on the launch grid, a CTA a tile (the plan's above
  `plan.FP8_PERSISTENT_UP_TO`; at kv_len 2048 the persistent grid's, each
  CTA's tiles of several (batch, head)s), block scales."""
  _check_kernel_on_gpu(head_dim, 2048, is_causal, False, persistent=False)


def _check_kernel_on_gpu(head_dim, seq, is_causal, incoherent, *,
                         granularity="block", **options):
  """The rule of `test_mosaic_kernel_matches_dequantised_reference_on_gpu`
  for the Mosaic kernel with `options` (`mosaic_forward_fp8`'s)."""
  if not ON_SM90:
    pytest.skip("the FP8 kernel needs sm90 (FP8 wgmma)")
  q, _, _ = outlier_qkv(seq, batch=2, seq=1000, heads=8, head_dim=head_dim)
  _, k, v = outlier_qkv(seq + 1, batch=2, seq=seq, heads=8,
                        head_dim=head_dim, kv_heads=2)
  fp8 = quantize_qkv(q, k, v, incoherent=incoherent, seed=seq,
                     granularity=granularity)
  if options:
    from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8
    q8, k8, v8 = fp8
    out, lse = mosaic_forward_fp8(
        q8.data, k8.data, v8.data, q_descale=q8.descale,
        k_descale=k8.descale, v_descale=v8.descale,
        q_descale_rows=q8.block_rows, k_descale_rows=k8.block_rows,
        scale=head_dim**-0.5, is_causal=is_causal, **options)
    lse = jnp.swapaxes(lse, 1, 2)  # as flash_attention_fp8 returns it
  else:
    out, lse = flash_attention_fp8(*fp8, is_causal=is_causal,
                                   return_residual=True,
                                   implementation="mosaic")
  # The yardsticks in float32 proper: at the GPU's default precision
  # (TF32) logits near 30 would be off by 6e-3.
  with jax.default_matmul_precision("highest"):
    exact, exact_lse = flash_attention_fp8(*fp8, is_causal=is_causal,
                                           return_residual=True,
                                           implementation="xla",
                                           out_dtype=jnp.float32)
    naive, _ = emulated_fp8_attention(*fp8, is_causal=is_causal)
  diff = lambda x: jnp.abs(x.astype(jnp.float32) - exact)
  # The bf16 output's rounding, and for the worst element FP8 wgmma's
  # accumulation, which the emulation (float32 sums) does not model: on the
  # H200 the worst element's error reached 0.39-0.61 in 4 of 24 cases, up
  # to 5.4x the emulation's worst, with the largest |out| about 22 (0.69 at
  # 2**-5); the mean stayed within 2x the emulation's everywhere.
  rounding = 2**-5 * float(jnp.abs(exact).max())
  assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
  assert float(diff(out).max()) <= 2 * float(diff(naive).max()) + rounding
  assert float(diff(out).mean()) <= 2 * float(diff(naive).mean()) + 2**-9 * (
      float(jnp.abs(exact).mean()))
  # Hopper's FP8 wgmma adds its products with fewer bits than float32
  # (about 14 by DeepSeek-V3's measurement): logits of 10-30 come out
  # within ~1e-3 relative (0.021 at most at d=128 on the H200). A wrong
  # descale factor would be off by orders of magnitude more.
  np.testing.assert_allclose(lse, exact_lse, atol=3e-2, rtol=3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mosaic_kernel_with_masks_on_gpu(head_dim):
  """The FP8 kernel on plan rows (bottom-right causal window, lengths,
  segment ids, soft cap, ALiBi; kv_len 1000, no multiple of its tiles)
  within the FP8 rule: out within 2x the emulated arithmetic's error plus
  2**-5 of the largest output, as above."""
  if not ON_SM90:
    pytest.skip("the FP8 kernel needs sm90 (FP8 wgmma)")
  q = _normal(0, (2, 500, 8, head_dim))
  k, v = (_normal(i, (2, 1000, 2, head_dim)) for i in (1, 2))
  masks = dict(_FP8_MASKS, q_offset=jnp.array([500, 100]),
               local_window_size=(300, 0),
               key_value_seq_lengths=jnp.array([1000, 350]),
               segment_ids=(jnp.repeat(jnp.arange(2), 250),
                            jnp.repeat(jnp.arange(2), 500)),
               alibi_slopes=2.0 ** -jnp.arange(1.0, 9.0))
  fp8 = quantize_qkv(q, k, v)
  out = flash_attention_fp8(*fp8, implementation="mosaic", **masks)
  with jax.default_matmul_precision("highest"):
    exact = flash_attention_fp8(*fp8, implementation="xla",
                                out_dtype=jnp.float32, **masks)
    naive, _ = emulated_fp8_attention(*fp8, **masks)
  diff = lambda x: jnp.abs(x.astype(jnp.float32) - exact)
  rounding = 2**-5 * float(jnp.abs(exact).max())
  assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
  assert float(diff(out).max()) <= 2 * float(diff(naive).max()) + rounding
