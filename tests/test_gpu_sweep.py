"""Random calls through `implementation=None` on the GPU against the reference.

Each draw is a seeded mix of what users pass: head dims between and at the
powers of two, lengths on and off every tile size (1 to 2,049 tokens, q_len
and kv_len apart), GQA and MQA, 16-bit and float32 inputs, and any
combination of the masks and score changes `flash_attention` takes (causal
top-left or bottom-right, windows, lengths, segment ids, dense and
key-padding masks, `mask_fn`, biases of every broadcast shape and of the
inputs' dtype or float32, ALiBi, `score_fn`, the soft cap, dropout, sinks).
out, lse, dq, dk and dv obey FlashAttention's rule against the float32
reference (`attention_checks.check_against_reference`: a random cotangent of
both outputs). The draws reach the routes `api.triton_first` and the kernels'
own refusals choose between, so a combination no hand-written case names
is still checked. `SWEEP_DRAWS` sets how many (default 48); a failing
draw's id is its seed, and `describe(seed)` prints its call.
"""
from __future__ import annotations

import os
import random

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from tests.attention_checks import Case, check_against_reference

pytestmark = pytest.mark.gpu

HEAD_DIMS = (32, 64, 64, 80, 96, 128, 128, 160, 192, 256)
LENGTHS = (1, 7, 64, 77, 128, 197, 256, 333, 577, 640, 1000, 1024, 1537,
           2047, 2049)
HEADS = ((4, 4), (4, 2), (6, 1), (3, 3), (8, 2))
DTYPES = (jnp.bfloat16, jnp.bfloat16, jnp.float16, jnp.float32)


def draw(seed: int):
  """(Case, dtype, flash_attention keyword arguments) of draw `seed`."""
  rng = random.Random(seed)
  head_dim = rng.choice(HEAD_DIMS)
  dtype = rng.choice(DTYPES)
  q_len = rng.choice(LENGTHS)
  kv_len = q_len if rng.random() < 0.6 else rng.choice(LENGTHS)
  num_heads, num_kv_heads = rng.choice(HEADS)
  batch = rng.choice((1, 2, 3))
  case = Case(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim)
  kw = {}
  maybe = lambda p: rng.random() < p
  if maybe(0.5):
    kw["is_causal"] = True
    if q_len != kv_len and maybe(0.5):  # bottom-right, as with a cache
      kw["q_offset"] = kv_len - q_len
  if maybe(0.2):
    kw["local_window_size"] = (rng.choice((16, 100, 300)),
                               0 if maybe(0.5) else rng.choice((16, 100)))
  if maybe(0.25):
    kw["key_value_seq_lengths"] = jnp.array(
        [rng.randint(0, kv_len) for _ in range(batch)], jnp.int32)
  if maybe(0.15):
    kw["query_seq_lengths"] = jnp.array(
        [rng.randint(0, q_len) for _ in range(batch)], jnp.int32)
  if maybe(0.15):
    docs = lambda n: jnp.sort(jax.random.randint(
        jax.random.key(seed), (batch, n), 0, 4), axis=1).astype(jnp.int32)
    kw["segment_ids"] = docs(q_len) if q_len == kv_len else (
        docs(q_len), docs(kv_len))
  if maybe(0.12):
    key = jax.random.key(seed + 1)
    if maybe(0.5):  # key padding, the same for every head
      kw["mask"] = jax.random.bernoulli(key, 0.8, (batch, 1, 1, kv_len))
    else:
      kw["mask"] = jax.random.bernoulli(key, 0.7, (1, 1, q_len, kv_len))
  if maybe(0.1):
    kw["mask_fn"] = lambda b, h, i, j: (i + 2 * j + h + b) % 5 != 0
  if maybe(0.2):
    shape = rng.choice(((batch, num_heads, q_len, kv_len),
                        (batch, 1, 1, kv_len), (1, num_heads, q_len, 1),
                        (q_len, kv_len)))
    bias_dtype = jnp.float32 if maybe(0.3) else dtype
    kw["bias"] = jax.random.normal(jax.random.key(seed + 2), shape,
                                   bias_dtype)
  if maybe(0.12):
    kw["alibi_slopes"] = jnp.linspace(0.01, 0.3, num_heads)
  if maybe(0.1):
    kw["score_fn"] = lambda s, b, h, i, j: s - 0.01 * (h + 1) * jnp.abs(
        i - j).astype(s.dtype)
  if maybe(0.15):
    kw["logits_soft_cap"] = rng.choice((5.0, 30.0, 50.0))
  if maybe(0.1):
    kw["dropout_rate"] = rng.choice((0.1, 0.3))
    kw["dropout_rng"] = jax.random.key(seed + 3)
  if maybe(0.1):
    kw["sinks"] = jnp.linspace(-1.0, 1.0, num_heads)
  return case, dtype, kw


def describe(seed: int) -> str:
  case, dtype, kw = draw(seed)
  shown = {k: (v.shape if hasattr(v, "shape") else v) for k, v in kw.items()}
  return f"{case} {jnp.dtype(dtype).name} {shown}"


DRAWS = int(os.environ.get("SWEEP_DRAWS", "48"))
# Draws past the default that failed once, kept in every run: 186, a
# float32 dK/dV kernel over Triton's shared memory (`common.fit_stages`);
# 125, rows of one to four keys under a soft cap, whose Mosaic dk was 2.9x
# the plain computation's error while the max-free forward normalised O by
# the unrounded row sum (`KernelStatic.max_free`).
REGRESSIONS = (125, 186)
# Draws that fail for a reason not yet mended: {seed: the reason}.
OPEN: dict[int, str] = {}


def one_key_under_dropout(case: Case, kw) -> bool:
  """Dropout where every row attends one key (a single query, causal from
  the top left): the backward's delta = rowsum(dO * O) reads the output as
  stored, rounded to 16 bits after its 1 / (1 - rate) scale, so dS = dP' -
  delta, exactly 0 in real arithmetic for one key, is dO . (O - round(O))
  instead, ~9x the plain 16-bit computation's error in dq (whose softmax
  VJP cancels exactly). Every FlashAttention backward computes delta so;
  benchmarks/NOTES.md, "Delta from the stored output"."""
  masks_the_key = ("q_offset", "query_seq_lengths", "key_value_seq_lengths",
                   "local_window_size", "segment_ids", "mask", "mask_fn")
  return (kw.get("dropout_rate", 0) > 0 and case.q_len == 1
          and kw.get("is_causal", False)
          and not any(name in kw for name in masks_the_key))


@pytest.mark.parametrize("seed", sorted(set(range(DRAWS)) | set(REGRESSIONS)))
def test_random_call_matches_reference_on_gpu(seed, request):
  case, dtype, kw = draw(seed)
  if one_key_under_dropout(case, kw) and dtype != jnp.float32:
    request.applymarker(pytest.mark.xfail(
        strict=True, raises=AssertionError,
        reason="delta from the stored 16-bit output, one key a row"))
  if seed in OPEN:
    request.applymarker(pytest.mark.xfail(
        strict=True, raises=AssertionError, reason=OPEN[seed]))

  @jax.jit
  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, return_residual=True, **kw)
  try:
    check_against_reference(attention, case, dtype, seed=seed, **kw)
  except AssertionError as e:
    raise AssertionError(f"draw {seed}: {describe(seed)}: {e}") from e
