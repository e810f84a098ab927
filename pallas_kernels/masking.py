"""The one definition of which (query, key) pairs attend and how logits change.

`attention_reference` and every kernel call the functions here on the same
positions, so mask and score semantics live in exactly one place.

Order of operations on one logit (DESIGN.md section 2)::

    s = scale * q·k
    s = s + bias + alibi
    s = score_fn(s, b, h, q_idx, kv_idx)
    s = cap * tanh(s / cap)
    s = -inf where any mask says no

Positions. Query `i` sits at position `i + q_offset` on the key axis; key `j`
at position `j`. With `q_offset = 0`, causal attention is top-left aligned,
exactly as `jax.nn.dot_product_attention(is_causal=True)`::

    q_len=2, kv_len=5, q_offset=0      q_len=2, kv_len=5, q_offset=3
    (top-left)                         (bottom-right, FlashAttention's)
        k0 k1 k2 k3 k4                     k0 k1 k2 k3 k4
    q0   1  0  0  0  0                 q0   1  1  1  1  0
    q1   1  1  0  0  0                 q1   1  1  1  1  1

A local window `(left, right)` keeps `q_pos - left <= kv_idx <= q_pos + right`
(as `jax.nn`); lengths keep `q_idx < query_seq_lengths[b]` and
`kv_idx < key_value_seq_lengths[b]`; segment ids keep equal ids.

Block classification. The kernels tile the [q_len, kv_len] square. For each
tile `classify_blocks` says EMPTY (skip it), FULL (every pair attends: no
element mask needed) or PARTIAL, from interval arithmetic on each mask alone,
so it never reads an N x N array. `block_ranges` turns a row of that map into
the `(lo, unmasked_lo, unmasked_hi, hi)` bounds that the kernel loops use.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

EMPTY, PARTIAL, FULL = 0, 1, 2

# The lowest logit a key keeps: the kernels take exp2 of logit * log2(e),
# which is -inf below this (float32's max / log2(e)), so a key there has
# weight 0 and a row of nothing else is empty (zeros), as under a mask.
# What HF's and Flax's padding biases reach (`finfo(float32).min`).
LOWEST_LOGIT = -float(jnp.finfo(jnp.float32).max) / math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Static description of the attention pattern and score changes of one call.

  Attributes:
    q_len, kv_len: sequence lengths of queries and keys.
    is_causal: keep pairs with `q_pos >= kv_idx`.
    window: `(left, right)` local window; None on a side means unbounded.
    has_q_offset: `q_offset` is given (a per-batch value in `MaskValues`).
    has_q_lengths, has_kv_lengths: right-padding lengths are given.
    has_segments: segment ids are given.
    has_dense_mask: a boolean `mask` array is given.
    mask_fn: `(b, h, q_idx, kv_idx) -> bool`, traced into the kernels.
    score_fn: `(score, b, h, q_idx, kv_idx) -> score`, elementwise in score.
    logits_soft_cap: `cap` of `cap * tanh(s / cap)`.
    has_alibi: ALiBi slopes are given: `s -= slope * |q_pos - kv_idx|`.
    has_bias: an additive `bias` array is given.
    dropout_rate: probability of dropping an attention weight, rounded to
      a multiple of 1/256 (`quantized_dropout_rate`).
  """

  q_len: int
  kv_len: int
  is_causal: bool = False
  window: tuple[int | None, int | None] | None = None
  has_q_offset: bool = False
  has_q_lengths: bool = False
  has_kv_lengths: bool = False
  has_segments: bool = False
  has_dense_mask: bool = False
  mask_fn: Callable[..., Any] | None = None
  score_fn: Callable[..., Any] | None = None
  logits_soft_cap: float | None = None
  has_alibi: bool = False
  has_bias: bool = False
  dropout_rate: float = 0.0

  def __post_init__(self):
    # The rate the hash applies (steps of 1/256), so that every scale of
    # the kept weights, 1 / (1 - rate), is the bits' own.
    object.__setattr__(self, "dropout_rate",
                       quantized_dropout_rate(self.dropout_rate))

  @property
  def is_plain(self) -> bool:
    """Whether nothing beyond the lengths and `is_causal` is asked: a call
    the plain kernels take as it is."""
    return self == MaskSpec(q_len=self.q_len, kv_len=self.kv_len,
                            is_causal=self.is_causal)

  @property
  def modifies_scores(self) -> bool:
    """Whether logits change beyond `scale * q·k` (bias, ALiBi, functions)."""
    return (self.has_bias or self.has_alibi or self.score_fn is not None
            or self.logits_soft_cap is not None)

  @property
  def unbounded_scores(self) -> bool:
    """Whether a bias or score_fn may take logits anywhere (a padding bias
    of -1e10, not -inf), with no soft cap after them: the kernels then cap
    the exponent of P at its bound, where float32's rounding at such
    magnitudes would otherwise overshoot (`triton.common.weights`)."""
    return ((self.has_bias or self.score_fn is not None)
            and self.logits_soft_cap is None)

  @property
  def scores_read_positions(self) -> bool:
    """Whether `modify_scores` reads the positions `q_idx` / `kv_idx`
    (ALiBi, `score_fn`), so that a kernel must pass its tile's."""
    return self.has_alibi or self.score_fn is not None

  @property
  def reads_batch_and_head(self) -> bool:
    """Whether `keep` or `modify_scores` read `MaskValues.batch` / `.head`
    (`mask_fn`, `score_fn`), so that a kernel must pass its tile's."""
    return self.mask_fn is not None or self.score_fn is not None

  @property
  def scores_shift_only(self) -> bool:
    """Whether every score change adds a term that does not depend on the
    score (bias, ALiBi): the final logit's slope in `scale * q·k` is 1."""
    return self.score_fn is None and self.logits_soft_cap is None

  @property
  def needs_block_map(self) -> bool:
    """Whether empty blocks can sit between non-empty ones (needs a per-block
    skip inside the loop rather than loop bounds alone)."""
    return self.mask_fn is not None


class MaskValues(NamedTuple):
  """Traced values the masks read, broadcastable against `q_idx`/`kv_idx`.

  In the reference they are [batch, 1, 1, 1]-shaped (segment ids
  [batch, 1, q_len, 1] / [batch, 1, 1, kv_len]); in a kernel, scalars and
  [block_q, 1] / [1, block_k] tiles. Fields of absent features are None.
  """

  batch: Any = None
  head: Any = None
  q_offset: Any = 0
  q_lengths: Any = None
  kv_lengths: Any = None
  q_segments: Any = None
  kv_segments: Any = None
  dense_mask: Any = None
  alibi_slope: Any = None
  bias: Any = None


class Operands(NamedTuple):
  """The traced, non-differentiable inputs of the masks (None when absent).

  q_offset, q_lengths, kv_lengths: int32 [batch]; q_segments int32
  [batch, q_len]; kv_segments int32 [batch, kv_len]; dense_mask bool,
  broadcastable to [batch, heads, q_len, kv_len]; alibi_slopes float32
  [batch, heads]; dropout_seed int32 []; block_mask a `masking.BlockMask`.
  """

  q_offset: Any = None
  q_lengths: Any = None
  kv_lengths: Any = None
  q_segments: Any = None
  kv_segments: Any = None
  dense_mask: Any = None
  alibi_slopes: Any = None
  dropout_seed: Any = None
  block_mask: Any = None


def keep(spec: MaskSpec, q_idx, kv_idx, values: MaskValues):
  """True where query `q_idx` attends to key `kv_idx` (broadcasting).

  Keys past `spec.kv_len` (a kernel's tail block) never attend.
  """
  q_pos = q_idx + values.q_offset
  result = kv_idx < spec.kv_len
  if spec.is_causal:
    result = result & (q_pos >= kv_idx)
  if spec.window is not None:
    left, right = spec.window
    if left is not None:
      result = result & (kv_idx >= q_pos - left)
    if right is not None:
      result = result & (kv_idx <= q_pos + right)
  if spec.has_q_lengths:
    result = result & (q_idx < values.q_lengths)
  if spec.has_kv_lengths:
    result = result & (kv_idx < values.kv_lengths)
  if spec.has_segments:
    result = result & (values.q_segments == values.kv_segments)
  if spec.has_dense_mask:
    result = result & values.dense_mask
  if spec.mask_fn is not None:
    result = result & (spec.mask_fn(values.batch, values.head, q_idx, kv_idx))
  return result


def modify_scores(spec: MaskSpec, scores, q_idx, kv_idx, values: MaskValues):
  """Applies bias, ALiBi, `score_fn` and the soft cap to scaled logits.

  `scores` are float32 `scale * q·k`. Elementwise, so the kernels' backward
  gets the derivative from `jax.jvp` of this same function.
  """
  if spec.has_bias:
    scores = scores + values.bias
  if spec.has_alibi:
    q_pos = q_idx + values.q_offset
    scores = scores - values.alibi_slope * jnp.abs(q_pos - kv_idx).astype(
        jnp.float32)
  if spec.score_fn is not None:
    scores = spec.score_fn(scores, values.batch, values.head, q_idx, kv_idx)
  if spec.logits_soft_cap is not None:
    # Times 1 / cap, not over cap: a division lowers to IEEE div.rn.f32 in
    # Mosaic GPU, about 15 SASS instructions a score (FFMAs, FCHK and a
    # slow-path branch) beside the tanh and the exponential.
    cap = spec.logits_soft_cap
    scores = cap * jnp.tanh(scores * (1.0 / cap))
  return scores


def cap_only(spec: MaskSpec) -> bool:
  """Whether a soft cap is the only change to the scores (Gemma's), so
  that its slope in `scale * q·k` is 1 - tanh(scale * q·k / cap)²."""
  return (spec.logits_soft_cap is not None and not dataclasses.replace(
      spec, logits_soft_cap=None).modifies_scores)


def modify_scores_folded(spec: MaskSpec, qk, scale, q_idx, kv_idx,
                         values: MaskValues):
  """(t, factor) with factor * t = `modify_scores(spec, scale * qk, ...)`
  up to rounding: the soft cap's two multiplies, by 1 / cap before the tanh
  and by cap after it, folded into the score's `scale` (where nothing
  changes the scores before the cap) and into the returned factor, which a
  kernel folds into its exponential's scale. `scale` may be traced (FP8's
  factors). Without a cap: (`modify_scores`, 1.0)."""
  cap = spec.logits_soft_cap
  if cap is None:
    return modify_scores(spec, qk * scale, q_idx, kv_idx, values), 1.0
  uncapped = dataclasses.replace(spec, logits_soft_cap=None)
  if uncapped.modifies_scores:
    scores = modify_scores(uncapped, qk * scale, q_idx, kv_idx, values)
    return jnp.tanh(scores * (1.0 / cap)), cap
  return jnp.tanh(qk * (scale * (1.0 / cap))), cap


def apply_sinks(out, lse, sinks):
  """Adds per-head sink logits to the softmax denominator (GPT-OSS).

  Args:
    out: [batch, q_len, heads, dim]; lse: float32 [batch, q_len, heads].
    sinks: float32 [heads].

  Returns:
    (out * exp(lse - lse_total), lse_total) with lse_total = logaddexp(lse, sink).
  """
  lse_total = jnp.logaddexp(lse, sinks.astype(jnp.float32))
  weight = jnp.exp(lse - lse_total)
  return (out * weight[..., None]).astype(out.dtype), lse_total


# --- Dropout ------------------------------------------------------------------

def _mix32(x):
  """murmur3's 32-bit finaliser: a bijection that scrambles every bit."""
  x = x ^ lax.shift_right_logical(x, jnp.uint32(16))
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ lax.shift_right_logical(x, jnp.uint32(13))
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ lax.shift_right_logical(x, jnp.uint32(16))


def dropout_keep(seed, batch, head, q_idx, kv_idx, rate: float):
  """Counter-based dropout mask from (seed, batch, head, q_idx, kv_idx).

  The same bits in the forward kernel, the backward kernels and the reference:
  no RNG state is carried. Keeps a weight with probability `1 - rate`, for a
  rate that is a multiple of 1/256 (`quantized_dropout_rate`).

  One 32-bit hash serves a quad of weights, {q, q + 8} x {k, k + 8} with bit
  3 of q and of k clear: the four weights that one thread of a wgmma
  accumulator holds (rows r and r + 8, columns c and c + 8, in the score
  tile and in its transpose), as FlashAttention-2 compares its Philox
  output a byte at a time. Each weight takes its byte of the hash
  (`dropout_byte_shift`) and is kept when the byte is at least rate * 256.

  The hash is murmur3's finaliser of the xor of a query word and a key
  word, both linear in the position (`dropout_query_hash`,
  `dropout_key_hash`); the finaliser's first xor-shift is linear over xor,
  so each word takes its own (`_spread`), and the xor is mixed by the rest
  (`dropout_quad_hash`). A kernel evaluates the words apart (the query's
  once a row, the key's once a column) and hashes a quad once.
  `tests/test_dropout_hash.py` checks the mixing's avalanche and the mask's
  statistics.
  """
  q_idx, kv_idx = _u32(q_idx), _u32(kv_idx)
  quad = dropout_quad_hash(
      dropout_query_hash(dropout_stream(seed, batch, head),
                         quad_first(q_idx)),
      dropout_key_hash(quad_first(kv_idx)))
  return dropout_keep_byte(quad, dropout_byte_shift(q_idx, kv_idx), rate)


def _u32(v):
  return jnp.asarray(v).astype(jnp.uint32)


# Odd multipliers: the position steps of the two words (xxHash's primes),
# and murmur3's finaliser's two.
_QUERY_STEP = 0x27D4EB2F
_KEY_STEP = 0x165667B1
DROPOUT_MIX_1 = 0x85EBCA6B
DROPOUT_MIX_2 = 0xC2B2AE35
# A quad's second query and second key lie this far from its first
# (`dropout_keep`): the row and column strides of a wgmma thread's values.
QUAD_STRIDE = 8
# A rate is a multiple of 1 / DROPOUT_LEVELS: each weight compares a byte.
DROPOUT_LEVELS = 256


def _spread(x):
  """murmur3's first xor-shift, x ^ (x >> 16): linear over xor, so that
  _spread(a) ^ _spread(b) = _spread(a ^ b) and each word takes its own."""
  return x ^ lax.shift_right_logical(x, jnp.uint32(16))


def dropout_stream(seed, batch, head):
  """Two uint32 words of (seed, batch, head), one stream per attention
  matrix: the query word's offset and the word it is xored with.

  Two words so that streams never repeat each other's bits: with the
  offset alone, two streams whose offsets differ by a multiple of
  `_QUERY_STEP` would give equal rows, shifted.
  """
  offset = _mix32(_u32(seed) ^ _mix32(_u32(batch) * jnp.uint32(0x9E3779B1)
                                      + _u32(head)))
  return offset, _mix32(offset ^ jnp.uint32(0x9E3779B9))


def dropout_query_hash(stream, q_idx, q_start=0):
  """uint32 query word: `_spread` of ((q_start + q_idx) * step + offset)
  ^ word. The product is written q_idx * step + (q_start * step + offset),
  the same modulo 2^32, so that a kernel whose q_idx is an iota keeps
  q_idx * step and adds one scalar per tile."""
  offset, word = stream
  base = _u32(q_start) * jnp.uint32(_QUERY_STEP) + offset
  return _spread((_u32(q_idx) * jnp.uint32(_QUERY_STEP) + base) ^ word)


def dropout_key_hash(kv_idx, kv_start=0):
  """uint32 key word: `_spread` of (kv_start + kv_idx) * step, the same in
  every stream (split as in `dropout_query_hash`)."""
  return _spread(_u32(kv_idx) * jnp.uint32(_KEY_STEP)
                 + _u32(kv_start) * jnp.uint32(_KEY_STEP))


def quad_first(idx):
  """uint32: the position of the first query (key) of `idx`'s quad, bit 3
  cleared (`dropout_keep`)."""
  return _u32(idx) & jnp.uint32(~QUAD_STRIDE & 0xFFFFFFFF)


def dropout_quad_hash(query_hash, key_hash):
  """uint32: a quad's four bytes (`dropout_keep`), murmur3's finaliser
  after its first xor-shift, of the two words' xor. Every output bit
  depends on every input bit with probability about 1/2, the low bytes as
  much as the high ones."""
  x = (query_hash ^ key_hash) * jnp.uint32(DROPOUT_MIX_1)
  x = x ^ lax.shift_right_logical(x, jnp.uint32(13))
  x = x * jnp.uint32(DROPOUT_MIX_2)
  return x ^ lax.shift_right_logical(x, jnp.uint32(16))


def dropout_byte_shift(q_idx, kv_idx):
  """uint32: the left shift that brings a weight's byte of its quad's hash
  to the top: 16 for the quad's second query, 8 for its second key."""
  q_bit = lax.shift_right_logical(_u32(q_idx), jnp.uint32(3)) & 1
  kv_bit = lax.shift_right_logical(_u32(kv_idx), jnp.uint32(3)) & 1
  return q_bit * jnp.uint32(16) + kv_bit * jnp.uint32(8)


def dropout_levels(rate: float) -> int:
  """How many of a byte's 256 values drop a weight: rate * 256, rounded."""
  return int(round(rate * DROPOUT_LEVELS))


def quantized_dropout_rate(rate: float) -> float:
  """The rate dropout applies, `rate` rounded to a multiple of 1/256 (the
  scale of the kept weights is 1 / (1 - this))."""
  return dropout_levels(rate) / DROPOUT_LEVELS


def dropout_threshold(rate: float) -> int:
  """The uint32 below which a weight's byte, shifted to the top, drops it:
  levels << 24, so P(x < t) is the quantized rate."""
  levels = dropout_levels(rate)
  if not 0 <= levels < DROPOUT_LEVELS:
    raise ValueError(f"dropout rate {rate} rounds to {levels}/256")
  return levels << 24


def dropout_keep_byte(quad_hash, shift, rate: float):
  """Whether a weight is kept: its byte of `quad_hash` (brought to the top
  by `shift`) against the rate's threshold."""
  return lax.shift_left(quad_hash, _u32(shift)) >= jnp.uint32(
      dropout_threshold(rate))


# --- Block classification -----------------------------------------------------

def _classify(empty, full):
  return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(
      jnp.int32)


def classify_blocks(spec: MaskSpec, block_q: int, block_k: int, *,
                    q_offset=None, q_lengths=None, kv_lengths=None,
                    q_segments=None, kv_segments=None, fine_map=None,
                    dense_mask=None):
  """EMPTY / PARTIAL / FULL for every [block_q, block_k] tile.

  Args:
    q_offset, q_lengths, kv_lengths: int32 [batch] or None.
    q_segments: int32 [batch, q_len]; kv_segments: int32 [batch, kv_len].
    fine_map: `BlockMask.states` for `mask_fn`, or None.
    dense_mask: the `spec.has_dense_mask` array, bool [batch | 1,
      heads | 1, q_len | 1, kv_len | 1] (`dense_block_states`), or None:
      then every tile is PARTIAL for it.

  Returns:
    int32 [batch | 1, heads | 1, num_q_blocks, num_kv_blocks].
  """
  nq = -(-spec.q_len // block_q)
  nk = -(-spec.kv_len // block_k)
  q_lo = (jnp.arange(nq) * block_q)[None, :, None]          # [1, nq, 1]
  q_hi = q_lo + block_q - 1                                 # last row
  k_lo = (jnp.arange(nk) * block_k)[None, None, :]          # [1, 1, nk]
  k_hi = k_lo + block_k - 1
  off = 0 if q_offset is None else q_offset[:, None, None]  # [B, 1, 1]
  empty = jnp.zeros((1, nq, nk), bool)
  # A partial last block on either axis always takes the masked path (its
  # loads need row masks).
  full = (q_hi < spec.q_len) & (k_hi < spec.kv_len)
  if spec.is_causal:
    empty = empty | (q_hi + off < k_lo)
    full = full & (q_lo + off >= k_hi)
  if spec.window is not None:
    left, right = spec.window
    if left is not None:
      empty = empty | (k_hi < q_lo + off - left)
      full = full & (k_lo >= q_hi + off - left)
    if right is not None:
      empty = empty | (k_lo > q_hi + off + right)
      full = full & (k_hi <= q_lo + off + right)
  if spec.has_q_lengths:
    n = q_lengths[:, None, None]
    empty = empty | (q_lo >= n)
    full = full & (q_hi < n)
  if spec.has_kv_lengths:
    n = kv_lengths[:, None, None]
    empty = empty | (k_lo >= n)
    full = full & (k_hi < n)
  if spec.has_segments:
    q_min, q_max = _block_min_max(q_segments, block_q)      # [B, nq]
    k_min, k_max = _block_min_max(kv_segments, block_k)     # [B, nk]
    empty = empty | (q_max[:, :, None] < k_min[:, None, :]) | (
        k_max[:, None, :] < q_min[:, :, None])
    full = full & ((q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]
                   & (q_min[:, :, None] == k_min[:, None, :]))
  if spec.has_dense_mask and dense_mask is None:
    full = full & False
  states = _classify(empty, full)[:, None]                  # [B|1, 1, nq, nk]
  if fine_map is not None:
    states = jnp.minimum(states, fine_map.coarsen(block_q, block_k,
                                                  states.shape[2:]))
  if spec.has_dense_mask and dense_mask is not None:
    states = jnp.minimum(states,
                         dense_block_states(dense_mask, block_q, block_k))
  return states


def dense_block_states(mask, block_q: int, block_k: int):
  """EMPTY / PARTIAL / FULL of each [block_q, block_k] tile of a dense
  mask (any kept, all kept), one reduction over it; positions past its
  ends count as neither (`classify_blocks` makes a partial last tile
  PARTIAL). Combined with the other masks' states by `jnp.minimum`.

  Args:
    mask: bool [batch | 1, heads | 1, q_len | 1, kv_len | 1].

  Returns:
    int32 [batch | 1, heads | 1, num_q_blocks | 1, num_kv_blocks | 1]: an
    axis the mask broadcasts along stays of size 1.
  """
  b, h, q, k = mask.shape
  bq, bk = (block_q if q > 1 else 1), (block_k if k > 1 else 1)
  nq, nk = -(-q // bq), -(-k // bk)
  pad = ((0, 0), (0, 0), (0, nq * bq - q), (0, nk * bk - k))
  tiles = lambda fill: jnp.pad(mask, pad, constant_values=fill).reshape(
      b, h, nq, bq, nk, bk)
  return _classify(~tiles(False).any((3, 5)), tiles(True).all((3, 5)))


def _block_min_max(ids, block: int):
  """Per-block min and max of int32 [batch, length] ids; the tail pads with
  the last id so it widens nothing."""
  b, n = ids.shape
  nb = -(-n // block)
  padded = jnp.pad(ids, ((0, 0), (0, nb * block - n)), mode="edge")
  tiles = padded.reshape(b, nb, block)
  return tiles.min(-1), tiles.max(-1)


def block_ranges(states):
  """Loop bounds per block row of a classification map.

  Args:
    states: int32 [..., n_rows, n_cols] of EMPTY / PARTIAL / FULL.

  Returns:
    int32 [..., n_rows, 4]: `(lo, unmasked_lo, unmasked_hi, hi)`. Columns
    outside `[lo, hi)` are empty; `[unmasked_lo, unmasked_hi)` is the first
    run of FULL columns; the rest of `[lo, hi)` takes the masked path.
  """
  n = states.shape[-1]
  col = jnp.arange(n, dtype=jnp.int32)
  nonempty = states > EMPTY
  any_nonempty = nonempty.any(-1)
  lo = jnp.where(any_nonempty, jnp.argmax(nonempty, -1), 0)
  hi = jnp.where(any_nonempty, n - jnp.argmax(nonempty[..., ::-1], -1), 0)
  full = states == FULL
  unmasked_lo = jnp.where(full.any(-1), jnp.argmax(full, -1), lo)
  after_run = (~full) & (col >= unmasked_lo[..., None])
  unmasked_hi = jnp.where(after_run.any(-1), jnp.argmax(after_run, -1), n)
  unmasked_hi = jnp.where(full.any(-1), unmasked_hi, unmasked_lo)
  return jnp.stack([lo, unmasked_lo, unmasked_hi, hi], -1).astype(jnp.int32)


# Mask evaluations per step of `BlockMask.from_mask_fn`'s loop.
_STRIP_EVALUATIONS = 1 << 24
# `BlockMask.for_call` keeps states up to this many (one byte each: a 32k
# square at tile 16, for one batch and head) as a constant of the program.
CONSTANT_BLOCK_MASK_STATES = 1 << 22


def check_no_captured_arrays(spec: MaskSpec):
  """NotImplementedError where `spec`'s mask_fn or score_fn closes over an
  array (a document id per position, a slope per head): a Pallas kernel
  cannot capture constants, so such a call is XLA's (where
  `implementation=None` falls back). Read from one trace on scalars; a
  function that does not trace there is left to the kernels."""
  i = jax.ShapeDtypeStruct((), jnp.int32)
  functions = (("mask_fn", spec.mask_fn, (i, i, i, i)),
               ("score_fn", spec.score_fn,
                (jax.ShapeDtypeStruct((), jnp.float32), i, i, i, i)))
  for name, fn, args in functions:
    if fn is None:
      continue
    try:
      consts = jax.make_jaxpr(fn)(*args).consts
    except Exception:  # noqa: BLE001  (the kernels' own trace will say)
      continue
    if consts:
      shapes = ", ".join(str(getattr(c, "shape", ())) for c in consts)
      raise NotImplementedError(
          f"{name} closes over arrays (shapes {shapes}), which a Pallas "
          f"kernel cannot capture: per-position ids go in segment_ids, "
          f"per-head slopes in alibi_slopes, other terms in bias; "
          f"implementation='xla' evaluates it as written")


def arguments_used(mask_fn) -> tuple[bool, bool]:
  """Whether `mask_fn(b, h, q_idx, kv_idx)` reads `b` and `h`, from one
  trace of it on small int32 arguments. Conservative: an argument counts
  as read if any equation takes it, and a function that does not trace
  there (indexing arrays it closes over in a way these shapes break) is
  taken to read both."""
  args = [jax.ShapeDtypeStruct(shape, jnp.int32)
          for shape in ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 2, 1),
                        (1, 1, 1, 2))]
  try:
    jaxpr = jax.make_jaxpr(mask_fn)(*args).jaxpr
  except Exception:  # noqa: BLE001  (any failure: assume it reads both)
    return True, True
  taken = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
  taken |= {id(v) for v in jaxpr.outvars}
  return tuple(id(v) in taken for v in jaxpr.invars[:2])


@jax.tree_util.register_pytree_node_class
class BlockMask:
  """Block-level sparsity of a `mask_fn`, computed once and reusable.

  Evaluates `mask_fn` on every (query, key) pair, one [tile, kv_len] strip
  at a time (never the whole square at once), and keeps only the state of
  each [tile, tile] block: EMPTY, PARTIAL or FULL. Kernels coarsen it to
  their own tile sizes. Build it once per mask and pass it as `mask_fn`'s
  partner (`block_mask=`) across layers.

  Pass it as `mask_fn=` in place of the function itself.

  Attributes:
    states: int32 [batch | 1, heads | 1, q_len / tile, kv_len / tile].
    tile: the block size the states are kept at.
    mask_fn: the function they summarise.
    lengths: the (q_len, kv_len) they were evaluated for, or None (not
      known: only the states' shape is checked against a call's).
  """

  def __init__(self, states, tile: int, mask_fn,
               lengths: tuple[int, int] | None = None):
    self.states = states
    self.tile = tile
    self.mask_fn = mask_fn
    self.lengths = lengths

  def __call__(self, b, h, q_idx, kv_idx):
    return self.mask_fn(b, h, q_idx, kv_idx)

  def tree_flatten(self):
    return (self.states,), (self.tile, self.mask_fn, self.lengths)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  @classmethod
  def from_mask_fn(cls, mask_fn, *, batch: int, num_heads: int, q_len: int,
                   kv_len: int, tile: int = 16, per_batch: bool | None = None,
                   per_head: bool | None = None) -> "BlockMask":
    """Evaluates `mask_fn(b, h, q_idx, kv_idx) -> bool` block by block.

    `per_batch` / `per_head`: whether the mask depends on `b` / `h`; None
    finds out by tracing `mask_fn` once (`arguments_used`). A mask that
    ignores one is evaluated for one batch / head only, so the map and its
    cost shrink by that factor (16x for a document mask over 16 heads).
    """
    if per_batch is None or per_head is None:
      uses_batch, uses_head = arguments_used(mask_fn)
      per_batch = uses_batch if per_batch is None else per_batch
      per_head = uses_head if per_head is None else per_head
    nb = batch if per_batch else 1
    nh = num_heads if per_head else 1
    nq, nk = -(-q_len // tile), -(-kv_len // tile)
    # Strips of about 2**24 evaluations: few sequential steps of `lax.map`
    # (one tile row each made 1,024 steps at 16k), bounded memory.
    per_strip = max(1, min(nq, _STRIP_EVALUATIONS // (nb * nh * tile * tile
                                                       * nk)))
    strips = -(-nq // per_strip)
    rows = per_strip * tile
    b = jnp.arange(nb)[:, None, None, None]
    h = jnp.arange(nh)[None, :, None, None]
    kv_idx = jnp.arange(nk * tile)[None, None, None, :]

    def strip(i):
      q_idx = (i * rows + jnp.arange(rows))[None, None, :, None]
      inside = (q_idx < q_len) & (kv_idx < kv_len)
      shape = (nb, nh, per_strip, tile, nk, tile)
      kept = jnp.broadcast_to(mask_fn(b, h, q_idx, kv_idx),
                              (nb, nh, rows, nk * tile)).reshape(shape)
      inside = jnp.broadcast_to(inside, (nb, nh, rows, nk * tile)).reshape(
          shape)
      any_kept = (kept & inside).any((3, 5))
      all_kept = (kept | ~inside).all((3, 5))
      return _classify(~any_kept, all_kept)         # [nb, nh, per_strip, nk]

    states = lax.map(strip, jnp.arange(strips))     # [strips, nb, nh, ...]
    states = jnp.moveaxis(states, 0, 2).reshape(nb, nh, strips * per_strip,
                                                nk)
    return cls(states[:, :, :nq], tile, mask_fn, (q_len, kv_len))

  @classmethod
  def for_call(cls, mask_fn, *, batch: int, num_heads: int, q_len: int,
               kv_len: int, tile: int = 16) -> "BlockMask":
    """The BlockMask a call builds for its `mask_fn`: evaluated once, as
    the call is traced, and kept as a constant of the program (int8
    states) where `mask_fn` reads nothing but its arguments (as the
    kernels need) and the states number at most
    `CONSTANT_BLOCK_MASK_STATES`; else `from_mask_fn` inside the call,
    which evaluates `mask_fn` on every (query, key) pair on every call.

    The constant passes through `lax.optimization_barrier`, so that what
    the kernels derive from it (their tiles' states, the plan rows, a few
    hundred KiB) XLA computes at run time rather than folds while
    compiling (seconds for a megabyte of states).
    """
    per_batch, per_head = arguments_used(mask_fn)
    count = ((batch if per_batch else 1) * (num_heads if per_head else 1)
             * -(-q_len // tile) * -(-kv_len // tile))
    build = functools.partial(
        cls.from_mask_fn, mask_fn, batch=batch, num_heads=num_heads,
        q_len=q_len, kv_len=kv_len, tile=tile, per_batch=per_batch,
        per_head=per_head)
    if count > CONSTANT_BLOCK_MASK_STATES:
      return build()
    with jax.ensure_compile_time_eval():
      built = build()
      if isinstance(built.states, jax.core.Tracer):  # read a traced value
        return built
      states = built.states.astype(jnp.int8)
    return cls(lax.optimization_barrier(states), tile, mask_fn,
               built.lengths)

  def coarsen(self, block_q: int, block_k: int,
              counts: tuple[int, int] | None = None):
    """States for [block_q, block_k] tiles. A block that is a multiple of
    `tile` takes the states of the tiles it covers together; one that
    divides it (a kernel's tile shrunk to a short sequence) takes its
    tile's state. `counts`: the kernel's numbers of blocks (nq, nk), cut
    to."""
    lo = hi = self.states
    for axis, block in ((2, block_q), (3, block_k)):
      if block % self.tile == 0:
        factor, n = block // self.tile, lo.shape[axis]
        pad = [(0, 0)] * 4
        pad[axis] = (0, -(-n // factor) * factor - n)
        split = (*lo.shape[:axis], -(-n // factor), factor,
                 *lo.shape[axis + 1:])
        # Padding blocks are EMPTY for "any" and FULL for "all".
        lo = jnp.pad(lo, pad, constant_values=FULL).reshape(split).min(
            axis + 1)
        hi = jnp.pad(hi, pad, constant_values=EMPTY).reshape(split).max(
            axis + 1)
      elif self.tile % block == 0:
        lo = jnp.repeat(lo, self.tile // block, axis=axis)
        hi = jnp.repeat(hi, self.tile // block, axis=axis)
      else:
        raise ValueError(
            f"block sizes ({block_q}, {block_k}) must be multiples or "
            f"divisors of the BlockMask tile {self.tile}")
    states = jnp.where(hi == EMPTY, EMPTY,
                       jnp.where(lo == FULL, FULL, PARTIAL))
    if counts is not None:
      states = states[:, :, :counts[0], :counts[1]]
    return states
