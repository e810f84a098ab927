"""The one definition of which (query, key) pairs attend.

`attention_reference` and every kernel call `MaskSpec.keep` on the same
positions, so there is exactly one place where mask semantics live.

Positions. Query `i` sits at position `i + q_offset` on the key axis; key `j`
at position `j`. With `q_offset = 0`, causal attention is top-left aligned,
exactly as `jax.nn.dot_product_attention(is_causal=True)`::

    q_len=2, kv_len=5, q_offset=0      q_len=2, kv_len=5, q_offset=3
    (top-left)                         (bottom-right, FlashAttention's)
        k0 k1 k2 k3 k4                     k0 k1 k2 k3 k4
    q0   1  0  0  0  0                 q0   1  1  1  1  0
    q1   1  1  0  0  0                 q1   1  1  1  1  1

Block ranges. The kernels walk key blocks for a query block (forward, dQ) or
query blocks for a key block (dK/dV). `kv_block_range` and `q_block_range`
return `(lo, unmasked_lo, unmasked_hi, hi)`: blocks outside `[lo, hi)` are
empty and skipped; blocks inside `[unmasked_lo, unmasked_hi)` are full and need
no element mask; the rest need `keep`. The bounds work on traced int32 values
(the program id) as well as on Python ints.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax


def _cdiv_nonneg(a, b: int):
  """ceil(max(a, 0) / b) for b > 0; exact for traced ints (no negative division)."""
  return lax.div(jnp.maximum(a, 0) + (b - 1), b)


def _floordiv_nonneg(a, b: int):
  """floor(max(a, 0) / b) for b > 0."""
  return lax.div(jnp.maximum(a, 0), b)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Static description of the attention pattern of one call.

  Attributes:
    q_len, kv_len: sequence lengths of queries and keys.
    is_causal: keep pairs with `q_pos >= kv_idx`.
    q_offset: position of query 0 on the key axis (see module docstring).
  """

  q_len: int
  kv_len: int
  is_causal: bool = False
  q_offset: int = 0

  def keep(self, q_idx, kv_idx):
    """True where query `q_idx` attends to key `kv_idx` (broadcasting ints).

    Keys past `kv_len` (a kernel's tail block) never attend.
    """
    keep = kv_idx < self.kv_len
    if self.is_causal:
      keep = jnp.logical_and(keep, q_idx + self.q_offset >= kv_idx)
    return keep

  @property
  def has_element_mask(self) -> bool:
    """Whether any pair inside the [q_len, kv_len] square can be masked."""
    return self.is_causal

  def kv_block_range(self, q_start, block_q: int, block_k: int):
    """Key blocks visited by the query block starting at `q_start`.

    Returns `(lo, unmasked_lo, unmasked_hi, hi)`; see the module docstring.
    """
    hi = (self.kv_len + block_k - 1) // block_k
    full = self.kv_len // block_k  # blocks without a tail
    lo = 0
    unmasked_hi = full
    if self.is_causal:
      # Last key any row of the block sees: q_start + block_q - 1 + q_offset.
      hi = jnp.minimum(hi, _cdiv_nonneg(q_start + block_q + self.q_offset,
                                        block_k))
      # A block is full when its last key is <= the first row's position.
      unmasked_hi = jnp.minimum(
          unmasked_hi,
          _floordiv_nonneg(q_start + self.q_offset + 1, block_k))
    unmasked_hi = jnp.maximum(jnp.minimum(unmasked_hi, hi), lo)
    return lo, lo, unmasked_hi, hi

  def q_block_range(self, kv_start, block_q: int, block_k: int):
    """Query blocks visited by the key block starting at `kv_start`.

    Returns `(lo, unmasked_lo, unmasked_hi, hi)`; see the module docstring.
    """
    hi = (self.q_len + block_q - 1) // block_q
    unmasked_hi = self.q_len // block_q  # a partial last query block is masked
    lo = 0
    unmasked_lo = 0
    if self.is_causal:
      # First query whose position reaches the block: q + q_offset >= kv_start.
      lo = _floordiv_nonneg(kv_start - self.q_offset, block_q)
      # Full when the first row sees the block's last key.
      unmasked_lo = _cdiv_nonneg(kv_start + block_k - 1 - self.q_offset,
                                 block_q)
    if self.kv_len % block_k:
      # The key block holding the tail is masked for every query block.
      # (Arithmetic, not jnp.where: Pallas' Triton lowering types a select of
      # two literals as i1.)
      is_tail = jnp.asarray(kv_start + block_k > self.kv_len, jnp.int32)
      unmasked_lo = jnp.maximum(unmasked_lo, is_tail * hi)
    lo = jnp.minimum(lo, hi)
    unmasked_lo = jnp.clip(unmasked_lo, lo, hi)
    unmasked_hi = jnp.clip(unmasked_hi, unmasked_lo, hi)
    return lo, unmasked_lo, unmasked_hi, hi
