"""Block ranges of `MaskSpec` against brute force over every element.

The kernels trust these ranges to skip blocks and to drop the element mask, so
a wrong range means silently wrong attention.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from jax_flash.masking import MaskSpec


def _keep_matrix(spec: MaskSpec, q_pad: int, kv_pad: int):
  q = np.arange(q_pad)[:, None]
  kv = np.arange(kv_pad)[None, :]
  return np.asarray(spec.keep(q, kv)) & (q < spec.q_len)


def _classify(block):
  if not block.any():
    return "empty"
  return "full" if block.all() else "partial"


specs = st.builds(
    MaskSpec,
    q_len=st.integers(1, 300), kv_len=st.integers(1, 300),
    is_causal=st.booleans(), q_offset=st.integers(0, 64))
blocks = st.sampled_from([16, 32, 64])


@settings(max_examples=150, deadline=None)
@given(spec=specs, block_q=blocks, block_k=blocks)
def test_kv_block_range_is_exact_for_forward_and_dq(spec, block_q, block_k):
  nq, nk = -(-spec.q_len // block_q), -(-spec.kv_len // block_k)
  keep = _keep_matrix(spec, nq * block_q, nk * block_k)
  for i in range(nq):
    lo, ulo, uhi, hi = (int(x) for x in spec.kv_block_range(
        i * block_q, block_q, block_k))
    assert 0 <= lo <= ulo <= uhi <= hi <= nk
    for j in range(nk):
      tile = keep[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k]
      rows = tile[: max(0, min(block_q, spec.q_len - i * block_q))]
      kind = _classify(rows)
      if not lo <= j < hi:
        assert kind == "empty", (i, j)
      elif ulo <= j < uhi:
        # Unmasked blocks must be full for every existing row.
        assert kind == "full", (i, j)
      # Rows past q_len are never stored, so they may be anything.


@settings(max_examples=150, deadline=None)
@given(spec=specs, block_q=blocks, block_k=blocks)
def test_q_block_range_is_exact_for_dkdv(spec, block_q, block_k):
  nq, nk = -(-spec.q_len // block_q), -(-spec.kv_len // block_k)
  keep = _keep_matrix(spec, nq * block_q, nk * block_k)
  for j in range(nk):
    lo, ulo, uhi, hi = (int(x) for x in spec.q_block_range(
        j * block_k, block_q, block_k))
    assert 0 <= lo <= ulo <= uhi <= hi <= nq
    for i in range(nq):
      tile = keep[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k]
      kind = _classify(tile)
      if not lo <= i < hi:
        assert kind == "empty", (i, j)
      elif ulo <= i < uhi:
        # Unmasked in dK/dV also means every row and key exists.
        assert tile.shape == (block_q, block_k) and kind == "full", (i, j)
        assert (i + 1) * block_q <= spec.q_len
        assert (j + 1) * block_k <= spec.kv_len


def test_causal_skips_blocks_above_the_diagonal():
  spec = MaskSpec(q_len=256, kv_len=256, is_causal=True)
  ranges = [tuple(int(x) for x in spec.kv_block_range(i * 64, 64, 64))
            for i in range(4)]
  # Query block i visits key blocks 0..i; only the diagonal one is masked.
  assert ranges == [(0, 0, 0, 1), (0, 0, 1, 2), (0, 0, 2, 3), (0, 0, 3, 4)]


def test_bottom_right_alignment_with_q_offset():
  spec = MaskSpec(q_len=2, kv_len=5, is_causal=True, q_offset=3)
  keep = np.asarray(spec.keep(np.arange(2)[:, None], np.arange(5)[None, :]))
  np.testing.assert_array_equal(keep, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
