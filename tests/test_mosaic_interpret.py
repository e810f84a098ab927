"""The Mosaic GPU kernels' numerics on a CPU, under JAX's Mosaic GPU
interpreter (`tests/mosaic_interpret.py` teaches it what the kernels use).

The interpreter simulates the kernels' threads, shared memory, barriers, TMA
and wgmma, so these tests run the real kernel bodies (warp specialisation,
the K/V ring, online softmax, causal block skipping, the persistent walk;
the backward's dQ and dK/dV kernels) at small shapes, against the reference
with FlashAttention's tolerance rule. What it cannot see (wgmma pipelining, shared-memory limits,
registers, speed) stays with `-m gpu` on an H200.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash.reference import naive_attention
from tests import mosaic_interpret
from tests.attention_checks import (Case, assert_within_rule,
                                    forward_and_grads, random_inputs)

if mosaic_interpret.WHY_NOT is not None:
  pytest.skip(mosaic_interpret.WHY_NOT, allow_module_level=True)
try:
  from pallas_kernels.mosaic.forward import mosaic_forward
except ImportError as e:  # a jaxlib built without Mosaic GPU
  pytest.skip(f"Mosaic GPU is not importable: {e}", allow_module_level=True)

# (case, is_causal, mosaic_forward options). The default grid is the
# persistent one; a CPU has no SM count, so it gets two CTAs.
CASES = [
    (Case(1, 128, 128, 1, 1, 64), False, dict(persistent=False)),
    (Case(1, 128, 128, 1, 1, 64), True, dict(persistent=False)),
    (Case(1, 256, 256, 2, 2, 64), False, dict(num_ctas=2)),
    (Case(1, 256, 256, 2, 2, 64), True, dict(num_ctas=2)),
    # GQA 2:1, and kv_len != q_len both ways under causal masking (empty
    # and partly masked K/V blocks, rows that attend to nothing).
    (Case(1, 128, 256, 2, 1, 64), True, dict(persistent=False)),
    (Case(1, 256, 128, 1, 1, 64), True, dict(persistent=False)),
    # Three consumers (d=64's default from q_len 1024) on a short tile;
    # four warpgroups, skipped where they could deadlock
    # (`mosaic_interpret.MAX_WARPGROUPS`).
    (Case(1, 192, 128, 1, 1, 64), False, dict(persistent=False,
                                              num_consumers=3)),
    # The consumer schedules: the intra-warpgroup overlap, ring turns, and
    # P's row sum after P V.
    (Case(1, 128, 256, 1, 1, 64), True, dict(persistent=False,
                                             overlap_scores=True)),
    (Case(1, 128, 128, 1, 1, 64), True, dict(persistent=False,
                                             ring_turns=True)),
    (Case(1, 128, 128, 2, 2, 64), False, dict(num_ctas=2,
                                              sum_after_pv=True)),
    # head_dim 128's 128-row K/V tiles; without a mask its default takes
    # the row sum after P V (`forward.SUM_AFTER_PV_HEAD_DIMS`).
    (Case(1, 128, 256, 1, 1, 128), True, dict(persistent=False)),
    (Case(1, 128, 256, 1, 1, 128), False, dict(num_ctas=2)),
]


@pytest.mark.parametrize("case, is_causal, options", CASES, ids=str)
def test_interpreted_mosaic_forward_matches_reference(case, is_causal,
                                                      options):
  """out and lse against the float32 reference, within twice the plain
  bf16 computation's error (DESIGN's rule)."""
  warpgroups = options.get("num_consumers", 2) + 1
  if warpgroups > mosaic_interpret.MAX_WARPGROUPS:
    pytest.skip(f"{warpgroups} warpgroups could deadlock the interpreter on "
                f"{mosaic_interpret.MAX_WARPGROUPS - 1} cores")
  q, k, v, _, _ = random_inputs(case, jnp.bfloat16, seed=7)
  try:
    with mosaic_interpret.interpreted():
      out, lse = mosaic_forward(q, k, v, scale=case.head_dim**-0.5,
                                is_causal=is_causal, **options)
      out, lse = np.asarray(out, np.float32), np.asarray(lse)
  finally:
    mosaic_interpret.reset()
  lse = np.swapaxes(lse, 1, 2)  # [batch, q_len, heads], as the reference's
  exact = naive_attention(q, k, v, is_causal=is_causal,
                          compute_dtype=jnp.float32)
  lowp = naive_attention(q, k, v, is_causal=is_causal,
                         compute_dtype=jnp.bfloat16)
  for i, (name, ours) in enumerate((("out", out), ("lse", lse))):
    assert_within_rule(name, ours, exact[i], lowp[i])


# (case, is_causal, mosaic_backward options): the two kernels (dQ, and
# dK/dV); the fused dQ's semaphores are beyond the interpreter.
BACKWARD_CASES = [
    # d=64's 128-row Q tiles on the persistent grid (its default up to
    # kv_len 1024), GQA 2:1.
    (Case(1, 256, 256, 2, 1, 64), True, dict(block_q=128, num_ctas=2)),
    (Case(1, 128, 128, 1, 1, 64), False, dict(persistent=False)),
    # d=128 on the launch grid, lse read early (its default without a mask)
    # and lean producers (bitwise scheduling, here the same numbers).
    (Case(1, 128, 256, 1, 1, 128), False, dict(persistent=False)),
]


@pytest.mark.parametrize("case, is_causal, options", BACKWARD_CASES, ids=str)
def test_interpreted_mosaic_backward_matches_reference(case, is_causal,
                                                       options):
  """dq, dk, dv of the two Mosaic backward kernels under a random
  cotangent of out and of lse, against the float32 reference's, within
  twice the plain bf16 computation's error. delta (`row_statistics`, a
  Triton kernel the Mosaic GPU interpreter cannot take) is computed
  outside it."""
  from pallas_kernels.mosaic import backward
  q, k, v, d_out, d_lse = random_inputs(case, jnp.bfloat16, seed=11)

  def reference(compute_dtype):
    cast = lambda x: x.astype(compute_dtype)
    return forward_and_grads(
        lambda q, k, v: naive_attention(q, k, v, is_causal=is_causal,
                                        compute_dtype=compute_dtype),
        cast(q), cast(k), cast(v), cast(d_out), d_lse)

  exact, lowp = reference(jnp.float32), reference(jnp.bfloat16)
  out, lse = exact["out"], exact["lse"]
  lse_t = jnp.swapaxes(lse, 1, 2)  # [batch, heads, q_len], the kernels'
  dq_config, dkdv_configs = backward.configure(
      q, k, scale=case.head_dim**-0.5, is_causal=is_causal, **options)
  stats = backward.row_statistics(out.astype(q.dtype), lse_t, d_out,
                                  jnp.swapaxes(d_lse, 1, 2))
  try:
    with mosaic_interpret.interpreted():
      grads = backward.gradients(q, k, v, d_out, stats, dq_config,
                                 dkdv_configs)
      grads = [np.asarray(g, np.float32) for g in grads]
  finally:
    mosaic_interpret.reset()
  for name, ours in zip(("dq", "dk", "dv"), grads):
    assert_within_rule(name, ours, exact[name], lowp[name])
