"""`flash_attention_backward`: gradients from given residuals (CPU: XLA and
the Triton kernels interpreted).

The property the ring's backward rests on: with the (out, lse) of attention
over keys K = [K1; K2], the backward of the call on K1 alone gives dK1, dV1
and K1's part of dQ; the two parts' dQ sum to the whole.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import flash_attention
from jax_flash.residual_backward import flash_attention_backward
from tests.attention_checks import Case, random_inputs

# q_len 16 at positions 28..43 of 44 keys, split 20 + 24: every part keeps
# a non-negative q_offset, and causal masking cuts through both parts.
CASE = Case(2, 16, 44, 4, 2, 32)
SPLIT = 20
Q_OFFSET = 28
VARIANTS = {
    "plain": {},
    "causal": dict(is_causal=True, q_offset=Q_OFFSET),
    "window": dict(local_window_size=(12, 3), q_offset=Q_OFFSET),
    "softcap+causal": dict(is_causal=True, q_offset=Q_OFFSET,
                           logits_soft_cap=5.0),
    "segments+lengths": dict(segments=True, key_value_seq_lengths=True),
}


def _arguments(variant: dict, seed: int = 1):
  """flash_attention keyword arguments on the whole K, and per part."""
  kwargs = {k: v for k, v in variant.items()
            if k not in ("segments", "key_value_seq_lengths")}
  parts = [dict(kwargs), dict(kwargs)]
  if "q_offset" in kwargs:
    parts[1]["q_offset"] = kwargs["q_offset"] - SPLIT
  if variant.get("segments"):
    keys = jax.random.split(jax.random.key(seed))
    q_seg = jax.random.randint(keys[0], (CASE.batch, CASE.q_len), 0, 2)
    kv_seg = jax.random.randint(keys[1], (CASE.batch, CASE.kv_len), 0, 2)
    kwargs["segment_ids"] = (q_seg, kv_seg)
    parts[0]["segment_ids"] = (q_seg, kv_seg[:, :SPLIT])
    parts[1]["segment_ids"] = (q_seg, kv_seg[:, SPLIT:])
  if variant.get("key_value_seq_lengths"):
    lengths = jnp.array([CASE.kv_len, 31], jnp.int32)
    kwargs["key_value_seq_lengths"] = lengths
    parts[0]["key_value_seq_lengths"] = jnp.minimum(lengths, SPLIT)
    parts[1]["key_value_seq_lengths"] = jnp.maximum(lengths - SPLIT, 0)
  return kwargs, parts


# On Triton the masked variants with `-m slow` (CI's ten minutes): XLA
# takes every variant, Triton the plain parts and the segment ids with
# lengths by default.
@pytest.mark.parametrize("name, implementation", [
    (name, impl) if impl == "xla" or name in ("plain", "segments+lengths")
    else pytest.param(name, impl, marks=pytest.mark.slow)
    for name in VARIANTS for impl in ("xla", "triton")])
def test_parts_of_a_merged_softmax_sum_to_its_gradient(name, implementation):
  q, k, v, d_out, d_lse = random_inputs(CASE, jnp.float32, 3)
  kwargs, parts = _arguments(VARIANTS[name])
  whole = lambda q, k, v: flash_attention(
      q, k, v, return_residual=True, implementation="xla", **kwargs)
  (out, lse), vjp = jax.vjp(whole, q, k, v)
  dq, dk, dv = vjp((d_out, d_lse))
  interpret = True if implementation == "triton" else None
  got = [flash_attention_backward(
      q, k[:, rows], v[:, rows], out, lse, d_out, d_lse,
      implementation=implementation, interpret=interpret, **part)
      for rows, part in zip((slice(None, SPLIT), slice(SPLIT, None)), parts)]
  scale = lambda x: float(np.max(np.abs(x)))
  tol = 2e-5 if implementation == "xla" else 2e-4
  np.testing.assert_allclose(got[0][0] + got[1][0], dq,
                             atol=tol * scale(dq))
  np.testing.assert_allclose(jnp.concatenate([g[1] for g in got], 1), dk,
                             atol=tol * scale(dk))
  np.testing.assert_allclose(jnp.concatenate([g[2] for g in got], 1), dv,
                             atol=tol * scale(dv))


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_own_residuals_give_flash_attentions_gradients(implementation):
  """With the call's own (out, lse), the VJP of `flash_attention`; and in
  bfloat16, within the tolerance of the kernels' own backward."""
  for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
    q, k, v, d_out, d_lse = random_inputs(Case(1, 24, 40, 4, 1, 64), dtype, 5)
    interpret = True if implementation == "triton" else None
    attention = lambda q, k, v: flash_attention(
        q, k, v, is_causal=True, return_residual=True,
        implementation=implementation, interpret=interpret)
    (out, lse), vjp = jax.vjp(attention, q, k, v)
    want = vjp((d_out, d_lse))
    got = flash_attention_backward(q, k, v, out, lse, d_out, d_lse,
                                   is_causal=True,
                                   implementation=implementation,
                                   interpret=interpret)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    for g, w in zip(got, want):
      w32 = np.asarray(w, np.float32)
      np.testing.assert_allclose(np.asarray(g, np.float32), w32,
                                 atol=tol * float(np.max(np.abs(w32))))


def test_empty_rows_get_zero_gradients():
  """A row whose merged lse is -inf (nothing attended anywhere) adds
  nothing, and nothing is NaN."""
  q, k, v, d_out, d_lse = random_inputs(CASE, jnp.float32, 7)
  out, lse = flash_attention(q, k, v, return_residual=True)
  out, lse = out.at[:, :3].set(0.0), lse.at[:, :3].set(-jnp.inf)
  dq, dk, dv = flash_attention_backward(q, k, v, out, lse, d_out, d_lse)
  chex.assert_tree_all_finite((dq, dk, dv))
  np.testing.assert_array_equal(dq[:, :3], 0.0)


@pytest.mark.parametrize("name, change, error, match", [
    ("out", lambda a: a.update(out=a["out"][:, :-1]), ValueError, "out must"),
    ("lse dtype", lambda a: a.update(lse=a["lse"].astype(jnp.bfloat16)),
     TypeError, "lse must be float32"),
    ("d_lse", lambda a: a.update(d_lse=a["d_lse"][..., :1]), ValueError,
     "d_lse must"),
])
def test_bad_residuals_are_named(name, change, error, match):
  del name
  q, k, v, d_out, d_lse = random_inputs(CASE, jnp.float32, 0)
  out, lse = flash_attention(q, k, v, return_residual=True)
  args = dict(out=out, lse=lse, d_out=d_out, d_lse=d_lse)
  change(args)
  with pytest.raises(error, match=match):
    flash_attention_backward(q, k, v, args["out"], args["lse"],
                             args["d_out"], args["d_lse"])


def test_bad_block_sizes_are_named():
  q, k, v, d_out, _ = random_inputs(CASE, jnp.float32, 0)
  out, lse = flash_attention(q, k, v, return_residual=True)
  with pytest.raises(TypeError, match="block_sizes must be a BlockSizes"):
    flash_attention_backward(q, k, v, out, lse, d_out, block_sizes=(64, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
@pytest.mark.parametrize("variant", [
    {},                                              # plain tiles
    dict(is_causal=True, q_offset=512),              # the ring's diagonal pair
    dict(local_window_size=(300, 0), q_offset=512),  # masked route
], ids=["plain", "causal-offset", "window"])
def test_parts_sum_to_the_merged_gradient_on_gpu(variant, implementation):
  """The ring's use on a GPU, in bfloat16: the kernels' backward of each
  half of K from the merged (out, lse) sums to the float32 gradient of
  attention over the whole K (a wrong delta or dropped d_lse is off by
  the gradient's own size)."""
  from pallas_kernels import compat as versions
  if implementation == "mosaic" and (
      versions.gpu_compute_capability() or (0, 0)) < (9, 0):
    pytest.skip("the Mosaic backward needs sm90")
  case, split = Case(2, 512, 1024, 8, 2, 128), 512
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, 11)
  parts = [dict(variant), dict(variant)]
  if "q_offset" in variant:
    parts[1]["q_offset"] = variant["q_offset"] - split
  f32 = lambda x: x.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    (_, _), vjp = jax.vjp(lambda q, k, v: flash_attention(
        q, k, v, return_residual=True, implementation="xla", **variant),
                          f32(q), f32(k), f32(v))
    want = vjp((f32(d_out), d_lse))
  out, lse = flash_attention(q, k, v, return_residual=True,
                             implementation=implementation, **variant)
  got = [jax.jit(lambda q, k, v, o, l, do, dl, part=part:
                 flash_attention_backward(q, k, v, o, l, do, dl,
                                          implementation=implementation,
                                          **part))(
      q, k[:, rows], v[:, rows], out, lse, d_out, d_lse)
         for rows, part in zip((slice(None, split), slice(split, None)),
                               parts)]
  got = [f32(got[0][0]) + f32(got[1][0]),
         jnp.concatenate([f32(g[1]) for g in got], 1),
         jnp.concatenate([f32(g[2]) for g in got], 1)]
  for g, w, name in zip(got, want, ("dq", "dk", "dv")):
    scale = float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w),
                               atol=2e-2 * scale, err_msg=name)
