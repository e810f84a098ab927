"""Cross-lowers every Mosaic GPU kernel and option for CUDA, on any machine.

    python -m benchmarks.lower_mosaic                 # every form lowers
    python -m benchmarks.lower_mosaic --dump DIR      # each form's modules
    python -m benchmarks.lower_mosaic --dump DIR --forms "masked bias"
    python -m benchmarks.lower_mosaic --compare A B   # two dumps, form by form

Lowers the forward and the backward on their plans (`mosaic.plan`) and with
each choice of `plan.ForwardConfig` and `plan.BackwardConfig` turned the
other way, the masked forward and backward, at head dims 64, 128 and 256
and at head dims between them computed at their own width (80, 96, 160,
192: 32-, 64- and 128-byte swizzles), causal or not; prints one line per
kernel and exits non-zero if any fails.
The test suite does the same under the CPU machines' JAX (0.10.2); this
script exists to run it under the GPU machine's JAX (0.11.2, Python 3.12)
before spending GPU time, since Mosaic GPU's API moves between versions:

    python3.12 -m venv /tmp/venv0112
    /tmp/venv0112/bin/pip install jax==0.11.2 jaxlib==0.11.2 flax chex \\
        jaxtyping tqdm rich
    PYTHONPATH=. /tmp/venv0112/bin/python -m benchmarks.lower_mosaic

`--dump` writes, for these forms and for the standard grid's calls through
`mosaic_attention` (forward, and forward and backward; bf16, seq 1k, 4k,
16k), the model-shape suite's head dims between (`OWN_WIDTH_CALLS`), the
masked calls and the FP8 forward, the lowered module with each
Mosaic GPU kernel printed without its source locations (which move with
every edit of the code around them); `--compare` says which forms differ.
A change that should not touch the kernels (a refactoring) must leave
every form the same.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.masking import MaskSpec, Operands
from pallas_kernels.mosaic.backward import mosaic_backward
from pallas_kernels.mosaic.forward import mosaic_forward
from pallas_kernels.mosaic.masked import mosaic_forward_masked
from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked
from pallas_kernels.mosaic import plan

# Each choice the plans make, turned the other way (or to another value),
# beside the plan itself ({}), where the kernels take them (three
# consumers, the dQ kernel's own tiles: not at head_dim 256).
FORWARD_OPTIONS = ({}, dict(persistent=True, num_ctas=3),
                   dict(persistent=False), dict(num_consumers=2),
                   dict(hw_turns=True), dict(hw_turns=False),
                   dict(sum_after_pv=True), dict(sum_after_pv=False),
                   dict(lazy_rescale=True),
                   dict(lazy_rescale=True, rescale_threshold=0.0),
                   dict(lazy_rescale=False))
BACKWARD_OPTIONS = ({}, dict(overlap_softmax=False),
                    dict(persistent=True, num_ctas=3),
                    dict(persistent=False), dict(prefetch_lse=True),
                    dict(prefetch_lse=False), dict(lean_producer=False),
                    dict(lean_producer=True))


# The plans' head dims, and head dims between them that the kernels compute
# at their own width on the next one's plan (`plan.plan_head_dim`): 16-bit
# rows of 160, 192, 320 and 384 bytes, in 32-, 64-, 64- and 128-byte
# swizzles.
HEAD_DIMS = (64, 128, 256)
OWN_WIDTH_HEAD_DIMS = (80, 96, 160, 192)
# (head_dim, block_kv): every K/V tile the FP8 forward may run, the
# planned one (`plan.FP8_BLOCK_KV`: 256 keys at d=64 and 128, 128 at 256)
# and those it halves to where a block factor or a mask's buffers leave it
# no room (`forward.fitting_block_kv`).
FP8_TILES = ((64, 256), (64, 128), (64, 64), (128, 256), (128, 128),
             (128, 64), (256, 128), (256, 64))


# benchmarks.models' cells at those dims (name: batch, seq, heads, head
# dim), causal, through `mosaic_attention`.
OWN_WIDTH_CALLS = {"dim96_causal_2k": (8, 2048, 32, 96),
                   "dim160_causal_4k": (4, 4096, 32, 160),
                   "dim192_causal_4k": (4, 4096, 16, 192)}


def head_score(s, b, h, q_idx, kv_idx):
  """A `score_fn` of every argument: a soft cap per (batch, head) and a
  distance penalty."""
  cap = 10.0 + b + 2.0 * h
  return cap * jnp.tanh(s / cap) - 0.01 * (q_idx - kv_idx)


def head_blocks(b, h, q_idx, kv_idx):
  """A `mask_fn` of every argument: blocks of 64 (h + 1) positions, every
  seventh pair dropped by (b, h)."""
  block = 64 * (h + 1)
  return (q_idx // block == kv_idx // block) & (
      (q_idx + kv_idx + b + h) % 7 != 0)


# The masked kernels' cases (tests/test_mosaic_masked.py runs all but the
# grid-sized window in the interpreter): awkward lengths, every mask kind.
MASKED_CASES = {  # name: (q_len, kv_len, MaskSpec fields, operands)
    "ragged causal": (200, 333, dict(is_causal=True), {}),
    "bottom-right causal": (256, 512, dict(is_causal=True,
                                           has_q_offset=True),
                            dict(q_offset=[256, 100])),
    "causal window": (384, 384, dict(is_causal=True, window=(100, 0)), {}),
    "lengths": (256, 256, dict(has_q_lengths=True, has_kv_lengths=True),
                dict(q_lengths=[100, 256], kv_lengths=[256, 0])),
    "soft cap": (97, 300, dict(is_causal=True, logits_soft_cap=20.0), {}),
    "segments": (256, 200, dict(has_segments=True),
                 dict(q_segments=[[0] * 100 + [1] * 156] * 2,
                      kv_segments=[[0] * 60 + [1] * 140] * 2)),
    "grid window": (4096, 4096, dict(is_causal=True, window=(1024, 0)), {}),
    # ALiBi on every visited tile: bottom-right causal with per-batch
    # slopes; beside the soft cap (its derivative in the backward).
    "alibi causal": (200, 333, dict(is_causal=True, has_q_offset=True,
                                    has_alibi=True),
                     dict(q_offset=[133, 0],
                          alibi_slopes=[[0.5, 0.25, 0.125, 0.0625],
                                        [1.0, 0.5, 0.25, 0.125]])),
    "alibi soft cap": (97, 300, dict(logits_soft_cap=20.0, has_alibi=True),
                       dict(alibi_slopes=[[0.5, 0.25, 0.125, 0.0625]] * 2)),
    # A score_fn of the CTA's batch and head (dK/dV: each head of the
    # group), its derivative by jax.jvp in the backward.
    "score_fn causal": (200, 333, dict(is_causal=True, score_fn=head_score),
                        {}),
    # A mask_fn of the CTA's batch and head on the tiles its BlockMask
    # leaves partial (dK/dV: each head of the group), beside lengths.
    "mask_fn lengths": (256, 200, dict(has_kv_lengths=True,
                                       mask_fn=head_blocks),
                        dict(kv_lengths=[200, 150])),
    # A dense mask per head: its int8 tiles on the masked steps (dK/dV from
    # its transpose), its own tiles classified.
    "dense mask": (256, 200, dict(has_dense_mask=True),
                   dict(dense_mask=(np.arange(4)[:, None, None]
                                    + np.arange(256)[:, None] // 64
                                    + np.arange(200) // 64)[None] % 3 != 0)),
    # Dropout's keep mask regenerated from its hash on every visited tile.
    "dropout causal": (200, 333, dict(is_causal=True, dropout_rate=0.1),
                       dict(dropout_seed=1234)),
    "dropout alibi lengths": (256, 256, dict(has_kv_lengths=True,
                                             has_alibi=True,
                                             dropout_rate=0.25),
                              dict(kv_lengths=[256, 100],
                                   alibi_slopes=[[0.5, 0.25, 0.125,
                                                  0.0625]] * 2,
                                   dropout_seed=-7)),
}


def masked_operands(values: dict) -> Operands:
  """`Operands` of a MASKED_CASES entry: the ALiBi slopes float32, the
  dense mask bool, the rest int32 (the dropout seed a scalar)."""
  dtypes = {"alibi_slopes": jnp.float32, "dense_mask": jnp.bool_}
  return Operands(**{k: jnp.asarray(v, dtypes.get(k, jnp.int32))
                     for k, v in values.items()})


def lowers(fn, *shapes) -> str | None:
  """None if `fn` lowers for CUDA on bfloat16 `shapes`, else the error."""
  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  except Exception as e:  # reported, the sweep goes on
    return f"{type(e).__name__}: {str(e)[:300]}"
  return None


def kernels(head_dim: int):
  """(name, fn, shapes) of every kernel variant at `head_dim`."""
  q, kv = (2, 512, 4, head_dim), (2, 768, 2, head_dim)
  lse = jax.ShapeDtypeStruct((2, 4, 512), jnp.float32)
  # Up to 128, one consumer holds dK and dV (three forward consumers fit);
  # the fused dQ's pieces need whole 64 columns; above, shared rows split
  # head_dim in halves of whole swizzle tiles (a multiple of 32).
  narrow = head_dim <= 128
  fused = narrow and head_dim % 64 == 0
  shared = head_dim > 128 and head_dim % 32 == 0
  for causal in (False, True):
    for options in FORWARD_OPTIONS + ((dict(num_consumers=3),) * narrow):
      yield (f"forward d{head_dim} causal={causal} {options}",
             lambda q, k, v, c=causal, o=options: mosaic_forward(
                 q, k, v, scale=0.1, is_causal=c, **o), (q, kv, kv))
    forms = BACKWARD_OPTIONS + ((dict(block_q=64),) * (head_dim == 64))
    if fused:  # dK and dV in one pass, whole dQ pieces
      forms += (dict(fused_dq=True, persistent=False),)
    if narrow:  # the dQ kernel's own tiles fit, on either grid
      forms += (dict(dq_tiles=(64, 128), persistent=False),
                dict(dq_tiles=(64, 128), persistent=True, num_ctas=3))
    if shared:
      forms += (dict(shared_rows=True, persistent=False),
                dict(shared_rows=True, persistent=True, num_ctas=3),
                dict(shared_rows=False, persistent=False))
    if not causal and narrow:
      forms += (dict(scores_ahead=True, persistent=False),
                dict(scores_ahead=True, persistent=True, num_ctas=3),
                dict(scores_ahead=False, persistent=False))
    for options in forms:
      yield (f"backward d{head_dim} causal={causal} {options}",
             lambda q, k, v, out, d_out, c=causal, o=options: mosaic_backward(
                 q, k, v, out, jnp.zeros(lse.shape, lse.dtype), d_out,
                 scale=0.1, is_causal=c, **o), (q, kv, kv, q, q))
    # The plain kernels' soft cap (`BackwardStatic.soft_cap`), as planned.
    capped = lambda q, k, v, out, d_out, c=causal: mosaic_backward(
        q, k, v, out, jnp.zeros(lse.shape, lse.dtype), d_out, scale=0.1,
        is_causal=c, soft_cap=30.0)
    yield (f"backward d{head_dim} causal={causal} soft cap", capped,
           (q, kv, kv, q, q))
  spec = MaskSpec(q_len=500, kv_len=700, is_causal=True, window=(64, 0))
  q, kv = (1, 500, 4, head_dim), (1, 700, 2, head_dim)
  yield (f"masked forward d{head_dim}",
         lambda q, k, v: mosaic_forward_masked(q, k, v, scale=0.1, spec=spec),
         (q, kv, kv))
  for options in ({}, dict(overlap_softmax=True)):
    yield (f"masked backward d{head_dim} {options}",
           lambda q, k, v, out, d_out, o=options: mosaic_backward_masked(
               q, k, v, out, jnp.zeros((1, 4, 500), jnp.float32), d_out,
               scale=0.1, spec=spec, **o), (q, kv, kv, q, q))
  capped = MaskSpec(q_len=500, kv_len=700, is_causal=True,
                    logits_soft_cap=20.0)
  yield (f"masked backward d{head_dim} soft cap",
         lambda q, k, v, out, d_out: mosaic_backward_masked(
             q, k, v, out, jnp.zeros((1, 4, 500), jnp.float32), d_out,
             scale=0.1, spec=capped), (q, kv, kv, q, q))
  dropped = MaskSpec(q_len=500, kv_len=700, is_causal=True,
                     dropout_rate=0.1)
  yield (f"masked backward d{head_dim} dropout",
         lambda q, k, v, out, d_out: mosaic_backward_masked(
             q, k, v, out, jnp.zeros((1, 4, 500), jnp.float32), d_out,
             scale=0.1, spec=dropped, dropout_seed=jnp.int32(3)),
         (q, kv, kv, q, q))


def calls():
  """(name, fn, abstract args) of what `--dump` writes: the standard grid
  through `mosaic_attention`, masked calls, the FP8 forward, and
  `kernels`' forms."""
  from pallas_kernels.config import BlockSizes
  from pallas_kernels.mosaic import mosaic_attention
  from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)

  def with_gradients(attend):
    def fwd_bwd(*args):  # attend's inputs (q, k, v[, bias]), then d_out
      *inputs, d_out = args
      out, vjp = jax.vjp(lambda *x: attend(*x)[0], *inputs)
      return out, vjp(d_out)
    return fwd_bwd

  for seq in (1024, 4096, 16384):
    for d in (64, 128, 256):
      for causal in (False, True):
        x = bf16(16384 // seq, seq, 2048 // d, d)
        attend = lambda q, k, v, d=d, c=causal: mosaic_attention(
            q, k, v, scale=d**-0.5, is_causal=c,
            backward_blocks=BlockSizes.get_default(d, "NVIDIA H200"))
        name = f"grid seq{seq} d{d} causal{int(causal)}"
        yield f"{name} fwd", attend, (x, x, x)
        yield f"{name} fwdbwd", with_gradients(attend), (x, x, x, x)
  for mask, (q_len, kv_len, fields, values) in MASKED_CASES.items():
    for d in (64, 128, 256):
      spec = MaskSpec(q_len=q_len, kv_len=kv_len, **fields)
      batch = 2 if q_len < 1000 else 4
      q, kv = bf16(batch, q_len, 4, d), bf16(batch, kv_len, 2, d)
      attend = lambda q, k, v, d=d, s=spec, values=values: mosaic_attention(
          q, k, v, scale=d**-0.5, is_causal=s.is_causal,
          backward_blocks=BlockSizes.get_default(d, "NVIDIA H200"), spec=s,
          operands=masked_operands(values))
      # A plain causal spec (q_len <= kv_len) on lengths off the 8-row
      # tiling runs the plain forward, its rows padded
      # (`attention._plain_attention`).
      kind = "plain padded" if spec == MaskSpec(
          q_len=q_len, kv_len=kv_len, is_causal=spec.is_causal) else "masked"
      yield f"{kind} {mask} d{d} fwd", attend, (q, kv, kv)
      yield f"{kind} {mask} d{d} fwdbwd", with_gradients(attend), (q, kv,
                                                                   kv, q)
  # Causal ALiBi alone on the plain kernels (`plan.PLAIN_ALIBI_HEAD_DIMS`),
  # as column terms in the forward, dQ and dK/dV; lengths off the tiles.
  for d in (64, 128, 256):
    spec = MaskSpec(q_len=1000, kv_len=1000, is_causal=True, has_alibi=True)
    q, kv = bf16(2, 1000, 4, d), bf16(2, 1000, 2, d)
    values = dict(alibi_slopes=[[0.5, 0.25, 0.125, 0.0625]] * 2)
    attend = lambda q, k, v, d=d, s=spec, values=values: mosaic_attention(
        q, k, v, scale=d**-0.5, is_causal=True,
        backward_blocks=BlockSizes.get_default(d, "NVIDIA H200"), spec=s,
        operands=masked_operands(values))
    yield f"plain alibi d{d} fwd", attend, (q, kv, kv)
    yield f"plain alibi d{d} fwdbwd", with_gradients(attend), (q, kv, kv, q)
  # A bias on the masked kernels, its tiles streamed beside the K/V rings
  # (dK/dV's from its transpose), dbias from the dbias kernel: per head,
  # broadcast over the batch (dS in float32, then summed), and per batch
  # and head (dS in bf16).
  for d in (64, 128, 256):
    spec = MaskSpec(q_len=200, kv_len=333, is_causal=True, has_bias=True)
    q, kv = bf16(2, 200, 4, d), bf16(2, 333, 2, d)
    biased = lambda q, k, v, b, d=d, s=spec: mosaic_attention(
        q, k, v, scale=d**-0.5, is_causal=True, spec=s, bias=b,
        backward_blocks=BlockSizes.get_default(d, "NVIDIA H200"))
    for name, bias in (("bias", bf16(1, 4, 200, 333)),
                       ("bias per batch", bf16(2, 4, 200, 333))):
      if name == "bias":  # the forward is the same for both
        yield f"masked {name} d{d} fwd", biased, (q, kv, kv, bias)
      yield (f"masked {name} d{d} fwdbwd", with_gradients(biased),
             (q, kv, kv, bias, q))
  # Sinks in the forward's epilogue (their gradient in XLA): the plain
  # kernel on the plan's persistent grid (4k) and launch grid (16k, d=128
  # causal), and the masked one with dropout.
  for seq, d, causal in ((4096, 64, False), (4096, 128, True),
                         (4096, 256, True), (16384, 128, True)):
    x = bf16(16384 // seq, seq, 2048 // d, d)
    sinks = jax.ShapeDtypeStruct((2048 // d,), jnp.float32)
    sunk = lambda q, k, v, s, d=d, c=causal: mosaic_attention(
        q, k, v, scale=d**-0.5, is_causal=c, sinks=s,
        backward_blocks=BlockSizes.get_default(d, "NVIDIA H200"))
    name = f"sinks seq{seq} d{d} causal{int(causal)}"
    yield f"{name} fwd", sunk, (x, x, x, sinks)
    yield f"{name} fwdbwd", with_gradients(sunk), (x, x, x, sinks, x)
  q_len, kv_len, fields, values = MASKED_CASES["dropout causal"]
  for d in HEAD_DIMS:
    spec = MaskSpec(q_len=q_len, kv_len=kv_len, **fields)
    q, kv = bf16(2, q_len, 4, d), bf16(2, kv_len, 2, d)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
    sunk = lambda q, k, v, s, d=d, spec=spec: mosaic_attention(
        q, k, v, scale=d**-0.5, is_causal=True, spec=spec, sinks=s,
        operands=masked_operands(values),
        backward_blocks=BlockSizes.get_default(d, "NVIDIA H200"))
    yield f"masked sinks dropout causal d{d} fwd", sunk, (q, kv, kv, sinks)
    yield (f"masked sinks dropout causal d{d} fwdbwd", with_gradients(sunk),
           (q, kv, kv, sinks, q))
  for name, (batch, seq, heads, d) in OWN_WIDTH_CALLS.items():
    x = bf16(batch, seq, heads, d)
    attend = lambda q, k, v, d=d: mosaic_attention(
        q, k, v, scale=d**-0.5, is_causal=True,
        backward_blocks=BlockSizes.get_default(d, "NVIDIA H200"))
    yield f"{name} fwd", attend, (x, x, x)
    yield f"{name} fwdbwd", with_gradients(attend), (x, x, x, x)
  # Ragged lengths (`attention._masked`): the plain forward (the key tail
  # masked without a causal mask) and the masked backward.
  for d in HEAD_DIMS:
    for causal, name in ((True, "causal"), (False, "full")):
      q, kv = bf16(2, 1000, 4, d), bf16(2, 1000, 2, d)
      attend = lambda q, k, v, d=d, c=causal: mosaic_attention(
          q, k, v, scale=d**-0.5, is_causal=c,
          backward_blocks=BlockSizes.get_default(d, "NVIDIA H200"))
      yield f"ragged {name} d{d} fwd", attend, (q, kv, kv)
      yield f"ragged {name} d{d} fwdbwd", with_gradients(attend), (
          q, kv, kv, q)
  for d in OWN_WIDTH_HEAD_DIMS:
    q_len, kv_len, fields, _ = MASKED_CASES["ragged causal"]
    spec = MaskSpec(q_len=q_len, kv_len=kv_len, **fields)
    q, kv = bf16(2, q_len, 4, d), bf16(2, kv_len, 2, d)
    attend = lambda q, k, v, d=d, s=spec: mosaic_attention(
        q, k, v, scale=d**-0.5, is_causal=True,
        backward_blocks=BlockSizes.get_default(d, "NVIDIA H200"), spec=s)
    yield f"plain padded ragged causal d{d} fwd", attend, (q, kv, kv)
    yield f"plain padded ragged causal d{d} fwdbwd", with_gradients(
        attend), (q, kv, kv, q)
  fp8 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  for seq in (1024, 4096):
    for d in (64, 128, 256):
      for causal in (False, True):
        batch, heads = 16384 // seq, 2048 // d
        x = fp8(batch, seq, heads, d)
        for per_block in (False, True):
          q_descale = f32(batch, heads, seq // 64) if per_block else f32(
              batch, heads)
          # Per-block K factors of the planned tile's rows (the kernel's
          # default k_descale_rows).
          k_descale = f32(batch, heads, seq // plan.FP8_BLOCK_KV[d]) if (
              per_block) else f32(batch, heads)
          forward = lambda q, k, v, a, b, c, d=d, causal=causal: (
              mosaic_forward_fp8(q, k, v, q_descale=a, k_descale=b,
                                 v_descale=c, scale=d**-0.5,
                                 is_causal=causal))
          yield (f"fp8 seq{seq} d{d} causal{int(causal)} "
                 f"block{int(per_block)}", forward,
                 (x, x, x, q_descale, k_descale, f32(batch, heads)))
  # The FP8 forward on each K/V tile it may run.
  for d, block_kv in FP8_TILES:
    batch, heads, seq = 4, 2048 // d, 4096
    x = fp8(batch, seq, heads, d)
    for causal in (False, True):
      forward = lambda q, k, v, a, b, c, d=d, causal=causal, n=block_kv: (
          mosaic_forward_fp8(q, k, v, q_descale=a, k_descale=b, v_descale=c,
                             scale=d**-0.5, is_causal=causal, block_kv=n))
      yield (f"fp8 tiles seq{seq} d{d} block_kv{block_kv} "
             f"causal{int(causal)}", forward,
             (x, x, x, f32(batch, heads), f32(batch, heads),
              f32(batch, heads)))
  # The FP8 forward on the persistent grid (`plan.FP8_PERSISTENT_UP_TO`).
  for seq in (4096, 16384):
    for d in (64, 128, 256):
      batch, heads = 16384 // seq, 2048 // d
      x = fp8(batch, seq, heads, d)
      for causal in (False, True):
        forward = lambda q, k, v, a, b, c, d=d, causal=causal: (
            mosaic_forward_fp8(q, k, v, q_descale=a, k_descale=b,
                               v_descale=c, scale=d**-0.5, is_causal=causal,
                               persistent=True))
        yield (f"fp8 persistent seq{seq} d{d} causal{int(causal)}", forward,
               (x, x, x, f32(batch, heads), f32(batch, heads),
                f32(batch, heads)))
  # The plain FP8 forward on a key tail: kv_len 1001 (K/V padded to whole
  # blocks, the last one masked past kv_len without a causal mask).
  for d in (64, 128, 256):
    batch, heads = 2, 2048 // d
    q, kv = fp8(batch, 1000, heads, d), fp8(batch, 1001, heads, d)
    for causal in (False, True):
      forward = lambda q, k, v, a, b, c, d=d, causal=causal: (
          mosaic_forward_fp8(q, k, v, q_descale=a, k_descale=b, v_descale=c,
                             scale=d**-0.5, is_causal=causal))
      yield (f"fp8 key tail kv1001 d{d} causal{int(causal)}", forward,
             (q, kv, kv, f32(batch, heads), f32(batch, heads),
              f32(batch, heads)))
  for d in HEAD_DIMS + OWN_WIDTH_HEAD_DIMS:
    for name, fn, shapes in kernels(d):
      yield f"option {name}", fn, [bf16(*shape) for shape in shapes]


# A serialized kernel in the lowered text: replaced by a placeholder, the
# kernel itself printed apart.
_BLOB = re.compile(
    r'(module|kernel_hash|ir|serialized_metadata) = "(?:[^"\\]|\\.)*"')
# A kernel's dump name counts the kernels lowered before it in the process,
# so it moves when forms are added ahead of it.
_DUMP_NAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*"')


def canonical(fn, args) -> str:
  """The lowered text of `fn` at `args`, each Mosaic GPU kernel printed
  without source locations, as it is before serialization."""
  with kernels_lowered() as kernels_seen:
    text = jax.jit(fn).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
  return "\n".join([_BLOB.sub(r'\1 = "<blob>"', text)] + [
      f"// ---- mosaic kernel {i}\n" + kernel
      for i, kernel in enumerate(kernels_seen)])


@contextlib.contextmanager
def kernels_lowered():
  """A list that collects, while open, the text of each Mosaic GPU kernel
  lowered (without source locations, its dump name blanked)."""
  from jax.experimental.mosaic.gpu import core
  kernels_seen, serialize = [], core._run_serde_pass

  def capture(module, *a, **kw):
    kernel = module.operation.get_asm(enable_debug_info=False)
    kernels_seen.append(
        _DUMP_NAME.sub('mosaic_gpu.dump_basename = "<name>"', kernel))
    return serialize(module, *a, **kw)

  core._run_serde_pass = capture
  try:
    yield kernels_seen
  finally:
    core._run_serde_pass = serialize


def dump(directory: str, forms: str | None = None) -> int:
  """Writes `calls()`' canonical texts to `directory` (gzip, one file each,
  and index.tsv); a form that does not lower is written as its error.
  `forms`: a regular expression; only the forms whose names it finds."""
  os.makedirs(directory, exist_ok=True)
  index = []
  for name, fn, args in calls():
    if forms is not None and not re.search(forms, name):
      continue
    try:
      text = canonical(fn, args)
    except Exception as e:  # recorded, as what the form gives
      text = f"ERROR {type(e).__name__}: {str(e)[:500]}"
    key = hashlib.sha1(name.encode()).hexdigest()[:16]
    with gzip.open(os.path.join(directory, key + ".txt.gz"), "wt") as f:
      f.write(text)
    index.append(f"{key}\t{name}")
    print(f"{'ERROR' if text.startswith('ERROR') else 'ok   '} {name}",
          flush=True)
  with open(os.path.join(directory, "index.tsv"), "w") as f:
    f.write("\n".join(index) + "\n")
  return 0


def compare(before: str, after: str) -> int:
  """Prints each form whose text differs between two dumps, and a count;
  non-zero if any differs or is missing from `after`."""
  def load(directory):
    with open(os.path.join(directory, "index.tsv")) as f:
      return dict(line.rstrip("\n").split("\t")[::-1] for line in f if line)

  def text(directory, key):
    with gzip.open(os.path.join(directory, key + ".txt.gz"), "rt") as f:
      return f.read()

  a, b = load(before), load(after)
  differ = [name for name in sorted(set(a) & set(b))
            if text(before, a[name]) != text(after, b[name])]
  for name in differ:
    print(f"differs: {name}")
  for name in sorted(set(a) - set(b)):
    print(f"missing: {name}")
  print(f"{len(set(a) & set(b)) - len(differ)} identical, {len(differ)} "
        f"differ, {len(set(a) - set(b))} missing, {len(set(b) - set(a))} new")
  return int(bool(differ) or bool(set(a) - set(b)))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], epilog=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dump", metavar="DIR")
  parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  parser.add_argument("--forms", metavar="REGEX",
                      help="--dump only the forms whose names match")
  args = parser.parse_args(argv)
  if args.compare:
    return compare(*args.compare)
  if args.dump:
    return dump(args.dump, args.forms)
  print(f"JAX {jax.__version__}", flush=True)
  failures = 0
  for head_dim in HEAD_DIMS + OWN_WIDTH_HEAD_DIMS:
    for name, fn, shapes in kernels(head_dim):
      error = lowers(fn, *shapes)
      failures += error is not None
      print(f"{'ok  ' if error is None else 'FAIL'} {name}"
            + (f": {error}" if error else ""), flush=True)
  print(f"{failures} failed")
  return int(failures > 0)


if __name__ == "__main__":
  sys.exit(main())
