"""Hypothesis draws shapes and options; the kernel must match the reference."""
from __future__ import annotations

import jax
import numpy as np
from hypothesis import given, settings, strategies as st

import jax_flash
from jax_flash import BlockSizes


@settings(max_examples=8, deadline=None)
@given(
    q_len=st.integers(1, 80), kv_len=st.integers(1, 80),
    kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([16, 24, 48]), is_causal=st.booleans(),
    block=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
def test_forward_and_grads_match_reference(q_len, kv_len, kv_heads, group,
                                           head_dim, is_causal, block, seed):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (1, q_len, kv_heads * group, head_dim))
  k = jax.random.normal(keys[1], (1, kv_len, kv_heads, head_dim))
  v = jax.random.normal(keys[2], (1, kv_len, kv_heads, head_dim))
  d_out = jax.random.normal(keys[3], q.shape)
  blocks = BlockSizes(block_q=block, block_k=block, block_q_dkv=block,
                      block_kv_dkv=block, block_q_dq=block, block_kv_dq=block)

  def ours(q, k, v):
    return jax_flash.flash_attention(q, k, v, is_causal=is_causal,
                                     implementation="triton",
                                     block_sizes=blocks)

  def reference(q, k, v):
    return jax_flash.attention_reference(q, k, v, is_causal=is_causal)

  # Forward and VJP in one jit each: one compile per example, where op by
  # op each of the reference's small ops compiles for every new shape.
  @jax.jit
  def forward_and_grads(q, k, v, d_out):
    (out, vjp), (ref, ref_vjp) = (jax.vjp(fn, q, k, v)
                                  for fn in (ours, reference))
    return out, ref, vjp(d_out), ref_vjp(d_out)

  out, ref, grads, ref_grads = forward_and_grads(q, k, v, d_out)
  np.testing.assert_allclose(out, ref, atol=2e-5)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(got, want, atol=1e-4)
