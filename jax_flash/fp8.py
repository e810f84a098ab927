"""FP8 (e4m3) attention: quantisation, incoherent processing, the forward.

FlashAttention-3 (Shah et al. 2024, §3.3) runs Q·Kᵀ and P·V as FP8 matmuls
with float32 accumulation. Its two accuracy devices are here:

  block quantisation   one scale per block of sequence rows instead of per
                       tensor, so that a block of small activations keeps its
                       range;
  incoherent           Q and K multiplied by the same random orthogonal
    processing         matrix H (random signs times a Walsh-Hadamard matrix)
                       before quantising. (QH)(KH)ᵀ = QKᵀ, so the logits
                       and the softmax scale (head_dim**-0.5) are unchanged,
                       while an outlier entry is spread over all head_dim
                       features. e4m3's steps are relative, so an outlier
                       carries a large absolute rounding error; spread, it
                       no longer lands on a few logits: on FA3's outlier
                       inputs the largest logit error fell from 1.5 to 0.55
                       (d=128) at about the same mean square, and the
                       output's RMSE 1.5-2.6x, more at longer sequences
                       (`benchmarks.fp8_accuracy`).

    q8, k8, v8 = quantize_qkv(q, k, v, incoherent=True)
    out = flash_attention_fp8(q8, k8, v8, is_causal=True)    # bf16

`flash_attention_fp8` runs the Mosaic FP8 kernel on Hopper (sm90) and
elsewhere attention in float32 on the dequantised inputs. Forward only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jax_flash import api, masking, reference, validation
from jax_flash.reference import KeyValue, Lse, Out, Query
from pallas_kernels import compat

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
# Largest finite e4m3 value: quantisation maps a block's amax onto it.
FP8_MAX = 448.0
Granularity = Literal["tensor", "block"]
GRANULARITIES = ("tensor", "block")
# Rows per Q and K scale in `quantize_qkv`'s block quantisation: the FP8
# kernel's Q tile (block_q 64), and a multiple of its K/V tile at every
# head dim (`pallas_kernels.mosaic.plan.FP8_BLOCK_KV`: 256 keys at head_dim
# <= 128, 128 at 256), so that no factor spans two tiles.
Q_BLOCK_ROWS = 64
K_BLOCK_ROWS = 256

# Shapes (jaxtyping; documentation only, as in `jax_flash.reference`).
Tokens = Float[Array, "batch seq heads dim"]
Descale = Float[Array, "batch heads *blocks"]
Rotation = Float[Array, "dim dim"]


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
  """An e4m3 tensor and its descale factors: the true values are about
  `data * descale`, the factor broadcast over its rows and head_dim.

  A pytree: `data` and `descale` are its leaves, `block_rows` and `rotated`
  static (part of a jit cache key).

  Attributes:
    data: float8_e4m3fn [batch, seq, heads, head_dim].
    descale: float32 [batch, heads] (one factor per (batch, head),
      `block_rows` None) or [batch, heads, cdiv(seq, block_rows)] (one per
      block of `block_rows` sequence rows; the last block may be short).
    block_rows: None, or the rows per factor.
    rotated: whether head_dim was rotated by a Hadamard transform before
      quantising (`quantize_qkv(incoherent=True)`): Q and K must agree.
  """

  data: Tokens
  descale: Descale
  block_rows: int | None = None
  rotated: bool = False

  @property
  def shape(self) -> tuple[int, ...]:
    return self.data.shape

  def dequantize(self, dtype=jnp.float32) -> Tokens:
    """The values in `dtype`: data times its factors, [batch, seq, heads,
    head_dim] (still rotated where `rotated`)."""
    return (self.data.astype(jnp.float32)
            * _factor_per_row(self.descale, self.block_rows,
                              self.data.shape[1])).astype(dtype)


jax.tree_util.register_dataclass(Fp8Tensor, data_fields=["data", "descale"],
                                 meta_fields=["block_rows", "rotated"])


def hadamard_rotation(head_dim: int, seed: int | jax.Array = 0
                      ) -> Rotation:
  """A seeded random orthogonal matrix for incoherent processing (FA3 §3.3).

  H = diag(s) · W / sqrt(head_dim), with s random ±1 signs drawn from `seed`
  and W the Sylvester Walsh-Hadamard matrix (entries ±1, W Wᵀ = head_dim·I).
  H is orthogonal, so rotating queries and keys alike, `q @ H` and `k @ H`
  along head_dim, leaves every logit unchanged; the random signs make the
  spreading independent of where the outlier features sit.

  Applied as a head_dim x head_dim matmul (`quantize_qkv`), not as the
  O(d log d) butterfly: one GEMM, one pass over the tensor, where the
  butterfly is log2(d) dependent steps that each cost a pass unless XLA
  fuses them all. The GEMM's FLOPs, 2·d² per row of Q and of K, are
  head_dim / kv_len of the attention's (0.8% at d=128, 16k), and at the
  default matmul precision (TF32 on a GPU) it runs on tensor cores, bound
  by memory. TF32 rounds H and the inputs to 2^-11, 128 times finer than
  e4m3's 2^-4 step (on a CPU the product is float32).

  Args:
    head_dim: a power of two (ValueError otherwise: no Walsh-Hadamard matrix
      of other orders is built here; the FP8 kernel's head dims 64, 128 and
      256 all are).
    seed: int, int32 scalar (may be traced: a fresh rotation per step under
      one compilation) or a `jax.random.key`.

  Returns:
    float32 [head_dim, head_dim].
  """
  if not isinstance(head_dim, (int, np.integer)):
    raise TypeError(f"head_dim must be a Python int (a static size), got "
                    f"{head_dim!r}")
  if head_dim < 1 or head_dim & (head_dim - 1):
    raise ValueError("head_dim must be a power of two for the Hadamard "
                     f"rotation, got {head_dim!r}")
  walsh = np.ones((1, 1), np.float32)
  while walsh.shape[0] < head_dim:  # Sylvester: W_2n = [[W, W], [W, -W]]
    walsh = np.block([[walsh, walsh], [walsh, -walsh]])
  key = seed
  if not (isinstance(seed, jax.Array)
          and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key)):
    key = jax.random.key(seed)
  signs = jax.random.rademacher(key, (head_dim,), jnp.float32)
  return signs[:, None] * jnp.asarray(walsh / math.sqrt(head_dim))


def quantize_fp8(x: Tokens, *,
                 granularity: Granularity = "tensor",
                 block_rows: int | None = None) -> Fp8Tensor:
  """e4m3 quantisation with one scale per (batch, head) or per block of rows.

  Each factor maps its slice's largest magnitude (amax) onto e4m3's largest
  finite value, 448; e4m3 then keeps a relative error of at most 2^-4 (its
  3-bit mantissa) down to its smallest normal, 2^-6 (amax · 2^-6 / 448 in
  x's units), and steps of 2^-9 below. An all-zero slice gets descale 1.

  Args:
    x: [batch, seq, heads, head_dim], float16, bfloat16 or float32.
    granularity: "tensor": one factor per (batch, head), descale
      [batch, heads]; "block": one per block of `block_rows` sequence rows,
      descale [batch, heads, cdiv(seq, block_rows)].
    block_rows: rows per block with granularity "block" (default 64); seq
      need not be a multiple (the last block is short).

  Returns:
    An `Fp8Tensor` with x ≈ data * descale.
  """
  return _quantize(x, granularity, block_rows, "x")


def quantize_qkv(
    query: Query, key: KeyValue, value: KeyValue, *,
    granularity: Granularity = "block", q_block_rows: int | None = None,
    k_block_rows: int | None = None, incoherent: bool = False,
    seed: int | jax.Array = 0,
) -> tuple[Fp8Tensor, Fp8Tensor, Fp8Tensor]:
  """Q, K and V quantised for `flash_attention_fp8`, as FlashAttention-3.

  Args:
    query: [batch, q_len, num_heads, head_dim].
    key, value: [batch, kv_len, num_kv_heads, head_dim].
    granularity: of Q's and K's scales (see `quantize_fp8`): "block" (FA3's
      block quantisation) or "tensor".
    q_block_rows, k_block_rows: rows per Q / K scale with "block"
      (default 64 and 256). The kernel takes multiples of its tiles: of 64
      for Q; for K its 256-key tile at head_dim <= 128 and 128-key tile at
      256 run where the factor's rows are whole tiles, and a shorter tile
      (down to 64 keys, slower) where they are not.
    incoherent: rotate Q and K by `hadamard_rotation(head_dim, seed)` before
      quantising (exact: the logits do not change). head_dim must then be a
      power of two.
    seed: the rotation's seed; may be traced (see `hadamard_rotation`).
      `granularity`, the block rows and `incoherent` are static.

  V is always quantised per (batch, head) and never rotated: the kernel
  runs P·V with one V factor for the whole K/V loop (a factor per block
  would rescale the float32 accumulator at every step; FA3's descale_v is
  per (batch, head) too), and a rotated V would give a rotated output.

  Returns:
    (query, key, value) as `Fp8Tensor`s.
  """
  if incoherent:
    query, key = _checked(query, "query"), _checked(key, "key")
    if query.shape[-1] != key.shape[-1]:
      raise ValueError(f"query and key must have the same head_dim, got "
                       f"{query.shape} and {key.shape}")
    rotation = hadamard_rotation(query.shape[-1], seed)
    # At the default precision (see `hadamard_rotation`).
    query, key = (jnp.matmul(x.astype(jnp.float32), rotation)
                  for x in (query, key))
  if granularity == "block":
    q_block_rows = Q_BLOCK_ROWS if q_block_rows is None else q_block_rows
    k_block_rows = K_BLOCK_ROWS if k_block_rows is None else k_block_rows
  q8 = _quantize(query, granularity, q_block_rows, "query")
  k8 = _quantize(key, granularity, k_block_rows, "key")
  v8 = _quantize(value, "tensor", None, "value")
  if incoherent:
    q8, k8 = (dataclasses.replace(x, rotated=True) for x in (q8, k8))
  return q8, k8, v8


def flash_attention_fp8(
    query: Fp8Tensor, key: Fp8Tensor, value: Fp8Tensor, mask=None, *,
    scale: float | None = None, is_causal: bool = False,
    query_seq_lengths=None, key_value_seq_lengths=None,
    local_window_size=None, segment_ids=None, q_offset=None,
    logits_soft_cap: float | None = None, alibi_slopes=None, mask_fn=None,
    score_fn=None,
    return_residual: bool = False, out_dtype=jnp.bfloat16,
    implementation: api.Implementation | None = None,
) -> Out | tuple[Out, Lse]:
  """Softmax attention on e4m3 inputs (FlashAttention-3's FP8 forward).

  Args:
    query: `Fp8Tensor` [batch, q_len, num_heads, head_dim], per (batch, head)
      or per block of rows (`quantize_qkv`).
    key: `Fp8Tensor` [batch, kv_len, num_kv_heads, head_dim], the same.
    value: `Fp8Tensor` like key, per (batch, head) only (see `quantize_qkv`).
      num_heads must be a multiple of num_kv_heads (GQA/MQA).
    scale: multiplies q·k; default head_dim**-0.5, also for rotated Q and K
      ((QH)(KH)ᵀ = QKᵀ).
    is_causal: query i attends keys j <= i, top-left aligned as
      `jax.nn.dot_product_attention`::

        q_len=2, kv_len=4:   k0 k1 k2 k3
                         q0   1  0  0  0
                         q1   1  1  0  0

    mask, query_seq_lengths, key_value_seq_lengths, local_window_size,
      segment_ids, q_offset, logits_soft_cap, alibi_slopes, mask_fn,
      score_fn: as `flash_attention`'s (`jax_flash.masking`'s one
      definition), applied to the true (descaled) logits; in the kernel
      through the masked kernel's plan rows, with any kv_len. No bias
      and no dropout (inference).

    return_residual: also return the logsumexp of the logits, float32
      [batch, q_len, num_heads].
    out_dtype: the output's dtype: bfloat16 or float16 in the kernel; any
      float in "xla" (float32 takes that path under None).
    implementation: None: the Mosaic FP8 kernel on an sm90 GPU where it takes
      the call, else "xla". "mosaic" forces the kernel (NotImplementedError
      off sm90, at head dims other than 64/128/256, kv_len not a multiple of
      its K/V tile without a mask beyond is_causal, or block rows not
      multiples of its tiles); any q_len is padded to its tile inside. "xla": attention in float32 on the
      dequantised inputs (`Fp8Tensor.dequantize`), on any device; it holds
      the [batch, heads, q_len, kv_len] logits in memory.

  Forward only: differentiating raises NotImplementedError (FP8 training
  needs a backward in FP8, which this is not).

  Returns:
    out [batch, q_len, num_heads, head_dim] in `out_dtype`, or (out, lse).
  """
  for x, name in ((query, "query"), (key, "key"), (value, "value")):
    _check_fp8_tensor(x, name)
  _check_layout(query, key, value)
  out_dtype = jnp.dtype(out_dtype)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise TypeError(f"out_dtype must be a float dtype, got {out_dtype}")
  # The masks, checked and normalised as flash_attention's, on stand-ins of
  # the dequantised shapes.
  masks = validation.normalise_call(
      *(jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
        for x in (query, key, value)),
      scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      q_offset=q_offset, logits_soft_cap=logits_soft_cap,
      alibi_slopes=alibi_slopes, mask=mask, mask_fn=mask_fn,
      score_fn=score_fn)
  call = _Fp8Call(scale=masks.scale, shape=masks.shape, spec=masks.spec,
                  out_dtype=out_dtype, implementation=implementation,
                  q_block_rows=query.block_rows, k_block_rows=key.block_rows)
  out, lse = _forward(call, query.data, key.data, value.data, query.descale,
                      key.descale, value.descale, masks.operands)
  return (out, lse) if return_residual else out


@dataclasses.dataclass(frozen=True)
class _Fp8Call:
  """The static part of one `flash_attention_fp8` call."""

  scale: float
  shape: validation.AttentionShape
  spec: masking.MaskSpec       # the masks (is_causal among them)
  out_dtype: jnp.dtype
  implementation: str | None
  q_block_rows: int | None
  k_block_rows: int | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _forward(call: _Fp8Call, q, k, v, q_descale, k_descale, v_descale,
             masks: validation.Operands):
  operands = (q, k, v, q_descale, k_descale, v_descale)
  return api.dispatch(call.implementation, None, lambda name, interpret: (
      _IMPLEMENTATIONS[name](call, *operands, masks, interpret=interpret)))


def _forward_fwd(call, *operands):
  return _forward(call, *operands), None


def _forward_bwd(call, residuals, cotangents):
  raise NotImplementedError(
      "flash_attention_fp8 is forward only (inference): it has no backward. "
      "Differentiate flash_attention on bfloat16 inputs instead.")


_forward.defvjp(_forward_fwd, _forward_bwd)


def _run_mosaic(call: _Fp8Call, q, k, v, q_descale, k_descale, v_descale,
                masks: validation.Operands, *, interpret: bool):
  """The sm90 FP8 kernel; NotImplementedError where it cannot run."""
  cc = compat.gpu_compute_capability()
  if cc is None or cc[0] != 9:
    raise NotImplementedError(
        f"the Mosaic FP8 kernel needs an sm90 GPU (FP8 wgmma), got {cc}")
  if interpret:
    raise NotImplementedError("the Mosaic FP8 kernel has no interpret mode")
  try:  # Imported here: Mosaic GPU is absent from some jaxlib builds.
    from pallas_kernels.mosaic.attention import masked_operand_kwargs
    from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8
  except ImportError as e:
    raise NotImplementedError(f"Mosaic GPU is not importable: {e}") from e
  spec = call.spec
  ranged = {} if spec.is_plain else dict(
      spec=spec, **{name: x for name, x in masked_operand_kwargs(masks).items()
                    if x is not None})
  out, lse = mosaic_forward_fp8(
      q, k, v, q_descale=q_descale, k_descale=k_descale,
      v_descale=v_descale, q_descale_rows=call.q_block_rows,
      k_descale_rows=call.k_block_rows, scale=call.scale,
      is_causal=spec.is_causal, out_dtype=call.out_dtype, **ranged)
  return out, jnp.swapaxes(lse, 1, 2)


def _run_triton(*_, **__):
  raise NotImplementedError("there is no FP8 Triton kernel")


def _run_xla(call: _Fp8Call, q, k, v, q_descale, k_descale, v_descale,
             masks: validation.Operands, *, interpret: bool):
  """float32 attention on the dequantised inputs (any device), with the
  masks as the reference applies them."""
  del interpret
  query, key, value = (
      Fp8Tensor(x, s, rows).dequantize() for x, s, rows in (
          (q, q_descale, call.q_block_rows), (k, k_descale, call.k_block_rows),
          (v, v_descale, None)))
  out, lse = reference.reference_attention(
      validation.AttentionCall(call.shape, call.scale, call.spec, masks),
      query, key, value)
  return out.astype(call.out_dtype), lse


_IMPLEMENTATIONS = {"mosaic": _run_mosaic, "triton": _run_triton,
                    "xla": _run_xla}


def _checked(x, name: str):
  """x as an array, checked to be a float [batch, seq, heads, head_dim]."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == FP8_DTYPE:
    raise TypeError(f"{name} must be float16, bfloat16 or float32 to be "
                    f"quantised, got {x.dtype}")
  if x.ndim != 4:
    raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got "
                     f"shape {x.shape}")
  return x


def _quantize(x, granularity: str, block_rows: int | None,
              name: str) -> Fp8Tensor:
  """`quantize_fp8`, with errors naming the argument `name`."""
  x = _checked(x, name)
  if granularity not in GRANULARITIES:
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got "
                     f"{granularity!r}")
  batch, seq, heads, dim = x.shape
  magnitude = jnp.abs(x.astype(jnp.float32))
  if granularity == "tensor":
    if block_rows is not None:
      raise ValueError(f"block_rows ({block_rows}) is for granularity "
                       f"'block', not 'tensor' ({name})")
    amax = jnp.max(magnitude, axis=(1, 3))                     # [B, H]
  else:
    block_rows = Q_BLOCK_ROWS if block_rows is None else block_rows
    if not isinstance(block_rows, (int, np.integer)) or block_rows < 1:
      raise ValueError(f"block_rows for {name} must be a positive int, got "
                       f"{block_rows!r}")
    block_rows = int(block_rows)
    blocks = -(-seq // block_rows)
    padded = jnp.pad(magnitude,
                     ((0, 0), (0, blocks * block_rows - seq), (0, 0), (0, 0)))
    amax = jnp.max(padded.reshape(batch, blocks, block_rows, heads, dim),
                   axis=(2, 4)).transpose(0, 2, 1)             # [B, H, n]
  descale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
  data = (x.astype(jnp.float32)
          / _factor_per_row(descale, block_rows, seq)).astype(FP8_DTYPE)
  return Fp8Tensor(data, descale, block_rows)


def _factor_per_row(descale, block_rows: int | None, seq: int):
  """descale [B, H] or [B, H, n] as factors [B, seq, H, 1] (or [B, 1, H, 1])
  that broadcast against [batch, seq, heads, head_dim]."""
  if block_rows is None:
    return descale[:, None, :, None]
  return jnp.repeat(jnp.swapaxes(descale, 1, 2), block_rows,
                    axis=1)[:, :seq, :, None]


def _check_fp8_tensor(x, name: str) -> None:
  """TypeError / ValueError naming `name` unless x is a well-formed
  `Fp8Tensor`."""
  if not isinstance(x, Fp8Tensor):
    raise TypeError(f"{name} must be an Fp8Tensor (from quantize_fp8 or "
                    f"quantize_qkv), got {type(x).__name__}")
  if jnp.dtype(x.data.dtype) != FP8_DTYPE:
    raise TypeError(f"{name}.data must be float8_e4m3fn, got "
                    f"{x.data.dtype}")
  if x.data.ndim != 4:
    raise ValueError(f"{name}.data must be [batch, seq, heads, head_dim], "
                     f"got shape {x.data.shape}")
  if not jnp.issubdtype(x.descale.dtype, jnp.floating):
    raise TypeError(f"{name}.descale must be float32, got "
                    f"{x.descale.dtype}")
  batch, seq, heads, _ = x.data.shape
  if x.block_rows is None:
    expected = (batch, heads)
  elif isinstance(x.block_rows, (int, np.integer)) and x.block_rows > 0:
    expected = (batch, heads, -(-seq // x.block_rows))
  else:
    raise ValueError(f"{name}.block_rows must be None or a positive int, got "
                     f"{x.block_rows!r}")
  if x.descale.shape != expected:
    raise ValueError(
        f"{name}.descale must be {expected} for {name}.data {x.data.shape} "
        f"with block_rows={x.block_rows}, got {x.descale.shape}")


def _check_layout(query: Fp8Tensor, key: Fp8Tensor, value: Fp8Tensor) -> int:
  """head_dim of a consistent call; else a ValueError naming the shapes."""
  batch, _, num_heads, head_dim = query.shape
  if key.shape != value.shape or key.shape[0] != batch or (
      key.shape[3] != head_dim):
    raise ValueError(
        f"key and value must both be [batch={batch}, kv_len, num_kv_heads, "
        f"head_dim={head_dim}] for query {query.shape}; got {key.shape}, "
        f"{value.shape}")
  if num_heads % key.shape[2]:
    raise ValueError(f"num_heads {num_heads} (query) must be a multiple of "
                     f"num_kv_heads {key.shape[2]} (key, value)")
  if value.block_rows is not None:
    raise ValueError(
        f"value must be quantised per (batch, head) (block_rows None), got "
        f"block_rows={value.block_rows}: P·V runs with one V factor for the "
        "whole K/V loop")
  if value.rotated:
    raise ValueError("value must not be rotated: the output would come out "
                     "rotated (quantize_qkv rotates only query and key)")
  if query.rotated != key.rotated:
    raise ValueError(
        f"query and key must both be rotated or neither (query.rotated="
        f"{query.rotated}, key.rotated={key.rotated}): the logits are exact "
        "only for (QH)(KH)ᵀ")
  return head_dim
