"""The checks every attention test uses: random inputs, reference, tolerance rule.

Tolerance (FlashAttention's): for float16/bfloat16,
`max|ours - ref_f32| <= 2 * max|ref_lowp - ref_f32| + eps`, where `ref_lowp`
is the naive computation in the input dtype. For float32, a fixed bound
relative to the magnitude of the reference.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import chex
import jax
import pytest
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash.reference import naive_attention


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int

  def __str__(self):
    return (f"b{self.batch}-q{self.q_len}-k{self.kv_len}-h{self.num_heads}:"
            f"{self.num_kv_heads}-d{self.head_dim}")


def random_inputs(case: Case, dtype, seed: int):
  """(q, k, v, d_out, d_lse): normal inputs and a random cotangent."""
  keys = jax.random.split(jax.random.key(seed), 5)
  b, tq, tk = case.batch, case.q_len, case.kv_len
  q = jax.random.normal(keys[0], (b, tq, case.num_heads, case.head_dim), dtype)
  k = jax.random.normal(keys[1], (b, tk, case.num_kv_heads, case.head_dim),
                        dtype)
  v = jax.random.normal(keys[2], (b, tk, case.num_kv_heads, case.head_dim),
                        dtype)
  d_out = jax.random.normal(keys[3], q.shape, dtype)
  d_lse = jax.random.normal(keys[4], (b, tq, case.num_heads), jnp.float32)
  return q, k, v, d_out, d_lse


def forward_and_grads(attention, q, k, v, d_out, d_lse):
  """Runs `attention(q, k, v) -> (out, lse)` and its VJP with both
  cotangents, jitted: one compilation instead of one per operation."""
  def run(q, k, v, d_out, d_lse):
    (out, lse), vjp = jax.vjp(attention, q, k, v)
    grads = vjp((d_out, d_lse))
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1],
            "dv": grads[2]}
  return jax.jit(run)(q, k, v, d_out, d_lse)


def reference_gradients(q, k, v, d_out, d_lse, **variants):
  """(float32, bf16) `forward_and_grads` of the reference with
  `flash_attention`'s arguments `variants`, under cotangents d_out and
  d_lse ([batch, q_len, heads]); with a bias among them, also its
  gradient ("dbias")."""
  def reference(compute_dtype):
    cast = lambda x: x.astype(compute_dtype)
    if "bias" not in variants:
      return forward_and_grads(
          lambda q, k, v: naive_attention(
              q, k, v, compute_dtype=compute_dtype, **variants),
          cast(q), cast(k), cast(v), cast(d_out), d_lse)
    others = {n: x for n, x in variants.items() if n != "bias"}
    (out, lse), vjp = jax.vjp(
        lambda q, k, v, bias: naive_attention(
            q, k, v, bias=bias, compute_dtype=compute_dtype, **others),
        cast(q), cast(k), cast(v), cast(variants["bias"]))
    grads = vjp((cast(d_out), d_lse))
    return dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv", "dbias"),
                                             grads)))
  return reference(jnp.float32), reference(jnp.bfloat16)


def _max_err(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32))
  b = np.asarray(jnp.asarray(b, jnp.float32))
  finite = np.isfinite(b)
  assert np.array_equal(np.isfinite(a), finite), "non-finite values differ"
  if not finite.any():
    return 0.0
  return float(np.max(np.abs(a[finite] - b[finite])))


def assert_forward_within_rule(q, k, v, out, lse, **variants) -> None:
  """Asserts a kernel's out and lse ([batch, heads, q_len], as the kernels
  return it) against the float32 reference with `flash_attention`'s
  arguments `variants`, within twice the plain computation's error in the
  inputs' dtype (DESIGN's rule)."""
  lse = np.swapaxes(lse, 1, 2)  # [batch, q_len, heads], as the reference's
  exact = naive_attention(q, k, v, compute_dtype=jnp.float32, **variants)
  lowp = naive_attention(q, k, v, compute_dtype=q.dtype, **variants)
  for i, (name, ours) in enumerate((("out", out), ("lse", lse))):
    assert_within_rule(name, ours, exact[i], lowp[i])


def assert_within_rule(name: str, ours, exact, naive) -> tuple[float, float]:
  """FlashAttention's tolerance rule for a 16-bit result `name`: its error
  against the float32 reference `exact` at most twice the plain
  low-precision computation's (`naive`), plus an eps for values exactly
  representable in both. Returns (error, yardstick)."""
  err = _max_err(ours, exact)
  yardstick = _max_err(naive, exact)
  eps = 1e-5 if name == "lse" else 2e-3
  assert err <= 2 * yardstick + eps, (name, err, yardstick)
  return err, yardstick


def _reference(compute_dtype, **variants):
  """`forward_and_grads` of the plain reference in `compute_dtype`, jitted:
  op by op, each of the reference's many small ops would be compiled on its
  own (minutes on a GPU for the whole suite)."""
  def run(q, k, v):
    return naive_attention(q, k, v, compute_dtype=compute_dtype, **variants)
  return jax.jit(functools.partial(forward_and_grads, run))


@functools.cache
def _cached_reference(compute_dtype, variants: tuple):
  """`_reference` once per dtype and (hashable) variants, so that tests at
  the same shapes (the float32 one of each dtype's test, the sharding
  checks of one case) compile it once."""
  return _reference(compute_dtype, **dict(variants))


def check_against_reference(attention, case: Case, dtype, *, seed: int = 0,
                            f32_tol: float = 2e-5, **variants):
  """Asserts that `attention(q, k, v) -> (out, lse)` obeys the tolerance rule.

  `variants` are the `flash_attention` keyword arguments (is_causal, masks,
  score changes) that `attention` applies; the reference applies the same.
  Checks the output, the LSE and dq, dk, dv under a random cotangent of both.
  Returns the errors, for the caller to print.
  """
  q, k, v, d_out, d_lse = random_inputs(case, dtype, seed)
  items = tuple(sorted(variants.items()))
  try:  # hashable variants (flags, numbers, functions) share one jit
    hash(items)
    reference_in = lambda compute: _cached_reference(compute, items)
  except TypeError:  # arrays among them
    reference_in = lambda compute: _reference(compute, **variants)

  ours = forward_and_grads(attention, q, k, v, d_out, d_lse)
  up = lambda x: x.astype(jnp.float32)
  exact = reference_in(jnp.float32)(up(q), up(k), up(v), up(d_out), d_lse)
  # Shapes as the reference's; out and the gradients in the inputs' dtype,
  # lse in float32.
  chex.assert_trees_all_equal_shapes(ours, exact)
  chex.assert_type([ours[name] for name in ("out", "dq", "dk", "dv")], dtype)
  chex.assert_type(ours["lse"], jnp.float32)
  errors = {}
  if dtype == jnp.float32:
    for name, ref in exact.items():
      err = _max_err(ours[name], ref)
      scale_of_ref = max(1.0, float(jnp.max(jnp.abs(jnp.where(
          jnp.isfinite(ref), ref, 0.0)))))
      errors[name] = err
      assert err <= f32_tol * scale_of_ref, (name, err, scale_of_ref)
    return errors
  naive = reference_in(dtype)(q, k, v, d_out, d_lse)
  return {name: assert_within_rule(name, ours[name], ref, naive[name])
          for name, ref in exact.items()}


# ALiBi slopes of 8 heads for a batch of two: the standard ones, and a
# spread whose heads differ by batch.
ALIBI_SLOPES = jnp.stack([2.0 ** -jnp.arange(1, 9, dtype=jnp.float32),
                          jnp.linspace(0.01, 0.5, 8)])


def blocks_and_stripes(b, h, i, j):
  """A `mask_fn` of every argument: queries and keys in blocks of
  128 (h + 1) positions see only their own block, where keys past the
  first 128 drop every fifth pair by (b, h). At 64- and 128-position tiles
  some tiles are empty, some full and some partial, and which differs
  between heads (a tile empty for head 0 is kept whole for head 1)."""
  block = 128 * (h + 1)
  return (i // block == j // block) & (
      (j < 128) | ((i + 2 * j + h + b) % 5 != 0))


def position_score(s, b, h, q_idx, kv_idx):
  """A `score_fn` that reads all its arguments: a soft cap that depends on
  the batch and the query head, and a distance penalty per head (its slope
  in s is not 1, so the backward's chain rule counts; a kernel that passes
  the wrong b or h is off by far more than rounding)."""
  cap = 1.5 + b + 4.0 * h
  return cap * jnp.tanh(s / cap) - 0.05 * (h + 1) * (q_idx - kv_idx)


# `implementation=None` on an sm90 GPU, as (dtype, q_len, flash_attention
# keyword arguments) of a [1, q_len, 4, 64] self-attention call: the calls
# that run on Mosaic (tile-aligned, ragged lengths, ALiBi, dropout, a
# score_fn, a mask_fn, a bias in q's dtype and a dense mask, the last six
# through the masked forward), and those that stay on Triton (float32, a
# short masked call off the 8-row tiling, a float32 bias beside bfloat16
# q, a mask broadcast along the queries).
# `test_gpu` checks them on a GPU, `test_mosaic_lowering` cross-lowered.
# d=64: masked calls up to `api.TRITON_FIRST_UP_TO` tokens go to Triton
# first, so the masked ones here are longer.
DISPATCHED_TO_MOSAIC = [
    (jnp.bfloat16, 512, {}), (jnp.bfloat16, 1001, {}),
    (jnp.bfloat16, 197, {}),   # off the 8-row tiling, rows read in place
    (jnp.bfloat16, 1024, dict(alibi_slopes=jnp.ones(4))),
    (jnp.bfloat16, 1024, dict(dropout_rate=0.1,
                              dropout_rng=jax.random.key(0))),
    (jnp.bfloat16, 1024, dict(score_fn=lambda s, *_: s * 0.5)),
    # causal through an `or`, which `builtin_forms` leaves to mask_fn's
    # own path (`i >= j` alone runs as is_causal)
    (jnp.bfloat16, 1024, dict(mask_fn=lambda b, h, i, j: (i >= j) | (j < 0))),
    (jnp.bfloat16, 1024, dict(bias=jnp.zeros((1024, 1024), jnp.bfloat16))),
    (jnp.bfloat16, 1024, dict(mask=jnp.tril(jnp.ones((1024, 1024), bool)))),
    # a key-padding mask, the same for every head: as segment ids
    (jnp.bfloat16, 1024, dict(mask=jnp.ones((1, 1024), bool))),
]
DISPATCHED_TO_TRITON = [
    (jnp.float32, 512, {}),
    # short and masked at d=64, off Mosaic's 8-row tiling or on it:
    # Triton's forward wins
    (jnp.bfloat16, 197, dict(local_window_size=16)),
    (jnp.bfloat16, 512, dict(mask=jnp.ones((1, 512), bool))),
    (jnp.bfloat16, 1024, dict(bias=jnp.zeros((1024, 1024)))),  # f32 bias
    # a key mask per head: the masked Mosaic kernels stream only [q_len,
    # kv_len] mask tiles (the same key mask for every head runs as segment
    # ids, on Mosaic)
    (jnp.bfloat16, 1024, dict(mask=jnp.ones((4, 1, 1024), bool))),
]


def one_head_dim_each(names, head_dims=(64, 128, 256), *, in_turn=None,
                      always=()):
  """(name, head_dim) parameters: each name at one head dim by default,
  taking `in_turn` (default `head_dims`) in turn so that each of them is
  covered, the others under `-m slow` (CI's ten minutes;
  `benchmarks.lower_mosaic` and the GPU round lower every form).
  `always`: (name, head_dim) pairs kept in the default run."""
  in_turn = head_dims if in_turn is None else in_turn
  params = []
  for i, name in enumerate(names):
    for d in head_dims:
      if d == in_turn[i % len(in_turn)] or (name, d) in always:
        params.append((name, d))
      else:
        params.append(pytest.param(name, d, marks=pytest.mark.slow))
  return params


# Kernel names in a lowered module: the masked Mosaic backward's, and the
# Triton backward's (the fallback), not the Mosaic ones.
_MASKED_BACKWARD_KERNEL = re.compile(
    r"mosaic_flash_backward_masked_(dkdv|dk|dv|dq|dbias)(?![a-z])")
TRITON_BACKWARD = re.compile(r"(?<!mosaic_)flash_backward_(dkdv|dq)")


def masked_backward_kernels(text: str) -> set:
  """Which masked backward kernels (dq, dkdv, dk, dv, dbias) a lowered
  module contains."""
  return set(_MASKED_BACKWARD_KERNEL.findall(text))


def triton_attention(block_sizes, **variants):
  """`attention(q, k, v) -> (out, lse)` for `check_against_reference`:
  `flash_attention` with `variants` on the Triton kernels (interpreted on
  a CPU) at `block_sizes`."""
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, return_residual=True,
                                     implementation="triton",
                                     block_sizes=block_sizes, **variants)
  return attention
