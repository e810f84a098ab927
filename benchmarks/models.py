"""Attention at the shapes models train with: ours and every peer, side by side.

    python -m benchmarks.models                  # every cell, about 6 min on an H200
    python -m benchmarks.models --cells gqa32x8_causal_8k window4k_causal_32k --modes fwd_bwd
    python -m benchmarks.models --smoke --out /tmp/models.json    # CPU, seconds
    python -m benchmarks.models --render benchmarks/results/h200_models.json

Cells (`CELLS`; DESIGN.md section 5, issue 38): one model's attention call
each, bf16, q_len = kv_len. `ragged_*`: lengths not a multiple of 128;
`padded_*`: random lengths (`query_seq_lengths`, `key_value_seq_lengths`);
`packed_*`: documents of random lengths (segment ids). A window of W keys is
`local_window_size=(W - 1, 0)` with is_causal: the same keys in jax_flash,
jax.nn (cuDNN's window of length left + 1) and tokamax.

`tflops` counts the work the masks leave: 4 x attended (query, key) pairs
(`attended_pairs`) x heads x head_dim, x3.5 for fwd_bwd; for a plain causal
cell (T + 1) / T times DESIGN section 5's count, which `dense_tflops` uses
(4·B·T²·N·D, halved for causal, blind to windows, documents and lengths).

`jax_flash` is `flash_attention` as users call it (implementation=None;
`implementation`: the kernel its program runs); `jax_flash_mosaic`/`_triton`
force one (a peers.SameProgram skip where None ran it); `cudnn`, `xla`:
`jax.nn.dot_product_attention`; `tokamax_*` where tokamax imports; `matmul`:
the ceiling, a dense bf16 matmul of about the cell's FLOPs. A peer that
cannot take a cell gets a skip entry with the reason. A cell's random inputs
are shared by its implementations; each program runs once before timing,
and `max_diff`/`rel_diff` record its difference from jax_flash's (fwd: out,
rows past a padded length left out; fwd_bwd: dq, dk, dv). As `run_grid`: a
cell's programs compile concurrently, then are timed alone in `--rounds`
turns (`common.round_order`); the JSON is rewritten after every cell, and
no cell starts after `--time-budget` seconds.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jax_flash
from benchmarks import common, peers, render
from pallas_kernels import compat

# ---------------------------------------------------------------- cells


@dataclasses.dataclass(frozen=True)
class ModelCell:
  """q [batch, seq_len, num_heads, head_dim]; k, v [..., num_kv_heads, ...]."""
  name: str
  model: str
  batch: int
  seq_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  causal: bool = True
  window: int | None = None       # keys per row, its own included
  soft_cap: float | None = None
  documents: int = 0              # packed documents per row (segment ids)
  padded: bool = False            # random lengths per sequence
  dtype: str = "bfloat16"

  @property
  def window_size(self) -> tuple[int, int] | None:
    return None if self.window is None else (self.window - 1, 0)

  def fields(self) -> dict:
    """A record's or skip entry's description of the cell."""
    return {**dataclasses.asdict(self), "shape": self.shape()}

  def shape(self) -> str:
    """"2x8k 32:8 d128 causal window 4096": how tables show the cell."""
    t = self.seq_len
    parts = [f"{self.batch}x{f'{t // 1024}k' if t % 1024 == 0 else t}",
             f"{self.num_heads}:{self.num_kv_heads}", f"d{self.head_dim}",
             "causal" if self.causal else "full",
             self.window and f"window {self.window}",
             self.soft_cap and f"cap {self.soft_cap:g}",
             self.documents and f"{self.documents} docs/row",
             self.padded and "padded lengths"]
    return " ".join(p for p in parts if p)


C = ModelCell
# The measurements first, so that a run cut by its time budget has
# them. 16k-32k tokens a cell: fwd+bwd well under a second on an H200.
CELLS = (
    C("gqa32x8_causal_8k", "Llama 3 8B", 2, 8192, 32, 8, 128),
    C("window4k_causal_32k", "Mistral 7B", 1, 32768, 32, 8, 128, window=4096),
    C("ragged_causal_5000", "Llama 3 8B", 4, 5000, 32, 8, 128),
    C("dim96_causal_2k", "Phi-3 mini", 8, 2048, 32, 32, 96),
    C("gqa16x8_d256_causal_8k", "Gemma 2 9B, no cap", 2, 8192, 16, 8, 256),
    C("softcap_d256_window4k_8k", "Gemma 2 9B, local", 2, 8192, 16, 8, 256,
      window=4096, soft_cap=50.0),
    C("softcap_d256_global_8k", "Gemma 2 9B, global", 2, 8192, 16, 8, 256,
      soft_cap=50.0),
    # A cap at d=128 (Grok-1's 30): the plain forward without a running max
    # under causal masking (`plan.PLAIN_SOFTCAP_CAUSAL_HEAD_DIMS`).
    C("softcap_d128_causal_8k", "Grok-1", 2, 8192, 48, 8, 128,
      soft_cap=30.0),
    C("packed_docs_causal_8k", "Llama 3 8B", 2, 8192, 32, 8, 128, documents=6),
    C("gqa32x8_causal_4k", "Llama 3 8B", 4, 4096, 32, 8, 128),
    C("gqa32x8_causal_32k", "Llama 3 8B", 1, 32768, 32, 8, 128),
    C("gqa64x8_causal_16k", "Llama 3 70B", 1, 16384, 64, 8, 128),
    C("mqa48x1_causal_8k", "StarCoder", 2, 8192, 48, 1, 128),
    C("dim160_causal_4k", "head dim 160", 4, 4096, 32, 8, 160),
    C("dim192_causal_4k", "head dim 192", 4, 4096, 16, 16, 192),
    C("short_bert_512", "BERT large", 64, 512, 16, 16, 64, causal=False),
    C("short_gqa32x8_1k", "Llama 3 8B", 32, 1024, 32, 8, 128),
    C("ragged_causal_1000", "Llama 3 8B", 16, 1000, 32, 8, 128),
    C("ragged_causal_12000", "Llama 3 8B", 2, 12000, 32, 8, 128),
    C("padded_lengths_causal_2k", "Llama 3 8B", 16, 2048, 32, 8, 128,
      padded=True),
    # A prompt length off the 8-row tiling (seven in eight are): the Mosaic
    # kernels read and write such rows in place, at d=128 and 256 as column
    # tiles (`rows.rows_in_place`); a short one, where Triton's kernels
    # are the other candidate (`api.triton_first`); and Gemma's d=256.
    C("ragged_causal_4097", "Llama 3 8B", 4, 4097, 32, 8, 128),
    C("ragged_causal_577", "Llama 3 8B", 32, 577, 32, 8, 128),
    C("ragged_d256_causal_4097", "Gemma 2 9B, no cap", 4, 4097, 16, 8, 256),
    # A masked call off the 8-row tiling: the masked kernels read such rows
    # in place too.
    C("ragged_window4k_causal_8193", "Mistral 7B", 2, 8193, 32, 8, 128,
      window=4096),
    # A short masked one: a batch of prompts padded to 577 tokens, where
    # Triton's kernels are the other candidate (`api.triton_first`).
    C("ragged_padded_lengths_577", "Llama 3 8B", 32, 577, 32, 8, 128,
      padded=True),
    # An encoder's tokens off the 8-row tiling (196 patches and a class
    # token), without a causal mask: at d=64 the Mosaic kernels read and
    # write such rows in place (`rows.rows_in_place`).
    C("ragged_vit_197", "ViT-B/16", 128, 197, 12, 12, 64, causal=False),
    # The same family further up (where routing them elsewhere stops
    # paying, benchmarks/NOTES.md, "Ragged lengths on the plain kernels").
    C("ragged_vit_257", "ViT-L/14", 64, 257, 16, 16, 64, causal=False),
    C("ragged_vit_577", "ViT-L/14, 336 px", 32, 577, 16, 16, 64,
      causal=False),
)
CELLS_BY_NAME = {cell.name: cell for cell in CELLS}
# One cell of each kind, shrunk by `smoke_cell`: the CPU test's run.
SMOKE_CELLS = ("gqa32x8_causal_8k", "window4k_causal_32k",
               "softcap_d256_window4k_8k", "packed_docs_causal_8k",
               "dim96_causal_2k", "ragged_causal_1000",
               "padded_lengths_causal_2k")
STANDARD = dict(warmup=2, reps=5, rounds=2, seed=0)
SMOKE = dict(warmup=1, reps=2, rounds=1, seed=0)


def smoke_cell(cell: ModelCell) -> ModelCell:
  """The cell at interpret-mode size: 2 sequences of 64 (100 where the
  length is not a multiple of 128), 4 query heads grouped as the cell's,
  its head dim, a window of 16."""
  return dataclasses.replace(
      cell, batch=2, seq_len=64 if cell.seq_len % 128 == 0 else 100,
      num_heads=4, num_kv_heads=max(1, 4 * cell.num_kv_heads // cell.num_heads),
      window=cell.window and 16)


# ---------------------------------------------------------------- inputs


class Inputs(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  d_out: jax.Array                # zero on rows past a padded length
  segment_ids: jax.Array | None   # int32 [batch, seq_len]
  lengths: jax.Array | None       # int32 [batch]


def make_inputs(cell: ModelCell, seed: int) -> Inputs:
  """Standard normal q, k, v, d_out (never zeros); each row cut into
  documents at random points; lengths uniform in [seq_len / 4, seq_len]."""
  rng = np.random.default_rng(seed)
  q_shape = (cell.batch, cell.seq_len, cell.num_heads, cell.head_dim)
  kv_shape = q_shape[:2] + (cell.num_kv_heads, cell.head_dim)
  q, k, v, d_out = (common.random_array(key, shape, cell.dtype) for key, shape
                    in zip(jax.random.split(jax.random.key(seed), 4),
                           (q_shape, kv_shape, kv_shape, q_shape)))
  segment_ids = lengths = None
  if cell.documents:
    positions = np.arange(cell.seq_len)
    segment_ids = jnp.asarray(np.stack([np.searchsorted(np.sort(rng.choice(
        positions[1:], cell.documents - 1, replace=False)), positions,
        side="right") for _ in range(cell.batch)]), jnp.int32)
  if cell.padded:
    lengths = jnp.asarray(rng.integers(cell.seq_len // 4, cell.seq_len + 1,
                                       size=cell.batch), jnp.int32)
    # A loss ignores padding: rows past the length get no cotangent, so
    # the gradients agree whatever an implementation outputs there.
    d_out = d_out * valid_rows(lengths, cell.seq_len)[:, :, None, None]
  return Inputs(q, k, v, d_out, segment_ids, lengths)


def valid_rows(lengths, seq_len: int):
  """bool [batch, seq_len]: the rows before each sequence's length."""
  return jnp.arange(seq_len)[None, :] < lengths[:, None]


def attended_pairs(cell: ModelCell, segment_ids=None, lengths=None) -> int:
  """(batch, query, key) triples the cell's masks keep. Every mask here
  keeps an interval of keys per row; a row counts their intersection."""
  rows = np.arange(cell.seq_len)[None, :].repeat(cell.batch, 0)
  low, high = np.zeros_like(rows), np.full_like(rows, cell.seq_len - 1)
  if cell.causal or cell.window:
    high = np.minimum(high, rows)
  if cell.window:
    low = np.maximum(low, rows - (cell.window - 1))
  if segment_ids is not None:
    for b, ids in enumerate(np.asarray(segment_ids)):  # documents are runs
      low[b] = np.maximum(low[b], np.searchsorted(ids, ids, side="left"))
      high[b] = np.minimum(high[b], np.searchsorted(ids, ids, "right") - 1)
  if lengths is not None:
    n = np.asarray(lengths)[:, None]
    high = np.where(rows < n, np.minimum(high, n - 1), -1)
  return int(np.maximum(high - low + 1, 0).sum())


def work_flops(cell: ModelCell, pairs: int, mode: str) -> float:
  """FlashAttention's count with the attended pairs for Tq x Tk."""
  return common.attention_flops(1, pairs, 1, cell.num_heads, cell.head_dim,
                                False, mode)


# ---------------------------------------------------------------- implementations

# attention_for(cell, mode, interpret) -> (q, k, v, segment_ids, lengths) -> out
AttentionFor = Callable[[ModelCell, str, bool], Callable[..., jax.Array]]


def _jax_flash(implementation: str | None) -> AttentionFor:
  def attention_for(cell, mode, interpret):
    if implementation == "mosaic":
      peers.require_gpu("the Mosaic GPU kernels", sm=(9, 0))
    elif implementation == "triton" and not interpret:
      peers.require_gpu("the Triton kernels")
    if implementation == "mosaic" or (implementation is None
                                      and compat.has_gpu()):
      peers.mosaic_module()  # imported before tracing, under its lock
    def attention(q, k, v, segment_ids, lengths):
      return jax_flash.flash_attention(
          q, k, v, is_causal=cell.causal, local_window_size=cell.window_size,
          logits_soft_cap=cell.soft_cap, segment_ids=segment_ids,
          query_seq_lengths=lengths, key_value_seq_lengths=lengths,
          implementation=implementation,
          interpret=interpret if implementation == "triton" else None)
    return attention
  return attention_for


def _jax_nn(implementation: str) -> AttentionFor:
  """`jax.nn.dot_product_attention`: lengths, windows and GQA, no soft cap;
  documents only as a dense mask, which XLA fuses into its scores."""
  def attention_for(cell, mode, interpret):
    if cell.soft_cap:
      raise NotImplementedError("jax.nn.dot_product_attention has no "
                                "logits_soft_cap")
    if implementation == "cudnn":
      peers.require_gpu("cuDNN attention")
      if cell.documents:
        raise NotImplementedError("jax.nn takes no segment ids; cuDNN would "
                                  "read a dense [B, 1, T, T] mask as a bias")
    # XLA materialises f32 logits (fwd+bwd holds about 2.5 of them); an
    # out-of-memory failure would poison the CUDA context (`peers.TooLarge`).
    logits = cell.batch * cell.num_heads * cell.seq_len**2 * 4
    needed = logits * (2.5 if mode == "fwd_bwd" else 1.0)
    if (implementation == "xla" and compat.has_gpu()
        and needed >= peers.XLA_MAX_BYTES):
      raise peers.TooLarge(f"XLA attention would need about "
                           f"{needed / 2**30:.0f} GiB of logits")
    def attention(q, k, v, segment_ids, lengths):
      mask = None if segment_ids is None else (
          segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
      return jax.nn.dot_product_attention(
          q, k, v, mask=mask, is_causal=cell.causal,
          query_seq_lengths=lengths, key_value_seq_lengths=lengths,
          local_window_size=cell.window_size, implementation=implementation)
    return attention
  return attention_for


def _tokamax(implementation: str) -> AttentionFor:
  """`tokamax.dot_product_attention`: jax.nn's arguments and a soft cap;
  documents only as a dense mask, so not here. Arguments a cell does not
  use are left out (an older tokamax may lack them)."""
  def attention_for(cell, mode, interpret):
    peers.require_gpu(f"tokamax {implementation}")
    try:
      with peers.IMPORT_LOCK:  # builds run in threads (`peers.mosaic_module`)
        import tokamax
    except Exception as e:  # ImportError, or a wheel built for another JAX
      raise peers.Unavailable(f"tokamax not importable "
                              f"({common.describe_error(e)})") from e
    if cell.documents:
      raise NotImplementedError("tokamax.dot_product_attention takes no "
                                "segment ids (a dense mask only)")
    extras = {name: value for name, value in (
        ("local_window_size", cell.window_size),
        ("logits_soft_cap", cell.soft_cap)) if value is not None}
    def attention(q, k, v, segment_ids, lengths):
      padding = {} if lengths is None else dict(
          query_seq_lengths=lengths, key_value_seq_lengths=lengths)
      return tokamax.dot_product_attention(
          q, k, v, is_causal=cell.causal, implementation=implementation,
          **extras, **padding)
    return attention
  return attention_for


CEILING = "matmul"
IMPLS: dict[str, AttentionFor | None] = {
    "jax_flash": _jax_flash(None), "jax_flash_mosaic": _jax_flash("mosaic"),
    "jax_flash_triton": _jax_flash("triton"), "cudnn": _jax_nn("cudnn"),
    "xla": _jax_nn("xla"), "tokamax_mosaic": _tokamax("mosaic"),
    "tokamax_triton": _tokamax("triton"),
    CEILING: None}  # built by `program`: not an attention call
OURS = ("jax_flash", "jax_flash_mosaic", "jax_flash_triton")
FORCED = {"jax_flash_mosaic": "mosaic", "jax_flash_triton": "triton"}
# Their compilation runs XLA's autotuner, which times kernels on the GPU.
AUTOTUNED = frozenset({"xla", "cudnn", "matmul"})
# A rel_diff above this is not bf16 rounding: a different computation.
SUSPECT_DIFF = 0.05


def program(impl: str, cell: ModelCell, mode: str, inputs: Inputs,
            pairs: int, interpret: bool) -> tuple[Callable, tuple, float]:
  """(jitted step, its arguments, its FLOPs). fwd: the output; fwd_bwd:
  (dq, dk, dv) of sum(out * d_out)."""
  flops = work_flops(cell, pairs, mode)
  if impl == CEILING:  # [B·T, N·D] @ [N·D, n], a projection's shape
    m, k = cell.batch * cell.seq_len, cell.num_heads * cell.head_dim
    n = max(1, round(flops / (2 * m * k)))
    a, b = (common.random_array(key, shape, cell.dtype) for key, shape in zip(
        jax.random.split(jax.random.key(1)), ((m, k), (k, n))))
    return jax.jit(jnp.matmul), (a, b), 2.0 * m * k * n
  attention = IMPLS[impl](cell, mode, interpret)
  extras = (inputs.segment_ids, inputs.lengths)
  if mode == "fwd":
    return jax.jit(attention), (*inputs[:3], *extras), flops

  def grads(q, k, v, d_out, segment_ids, lengths):
    _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids, lengths),
                     q, k, v)
    return vjp(d_out)
  return jax.jit(grads), (*inputs[:4], *extras), flops


class Built(NamedTuple):
  compiled: Callable
  args: tuple
  flops: float
  implementation: str | None  # ours: the kernel the program runs


def build(impl: str, cell: ModelCell, mode: str, inputs: Inputs, pairs: int,
          interpret: bool, default=None) -> Built:
  """Lowers and compiles `impl` (safe from several threads). `default`: the
  future of jax_flash's build; a forced implementation that is the program
  it runs raises peers.SameProgram."""
  forced = FORCED.get(impl)
  if forced and default is not None:
    try:
      ran = default.result().implementation
    except Exception:  # the default failed: the forced one says why itself
      ran = None
    if ran == forced:
      raise peers.SameProgram(f"the program jax_flash ran (implementation=None "
                        f"chose {forced!r})")
  fn, args, flops = program(impl, cell, mode, inputs, pairs, interpret)
  lowered = fn.lower(*args)
  ran = forced or (peers.implementation_run(lowered.as_text())
                   if impl == "jax_flash" else None)
  with (common.autotune_lock if impl in AUTOTUNED
        else contextlib.nullcontext()):
    return Built(lowered.compile(), args, flops, ran)


# ---------------------------------------------------------------- the run


def _difference(out, reference, rows) -> tuple[float, float]:
  """(max |out - reference|, that over max |reference|) over the output
  arrays; `rows` (bool [batch, seq]) masks rows past a padded length."""
  worst = scale = 0.0
  for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(reference)):
    x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    diff = jnp.abs(x - y) * (1 if rows is None else rows[:, :, None, None])
    worst = max(worst, float(jnp.max(diff)))
    scale = max(scale, float(jnp.max(jnp.abs(y))))
  return worst, worst / max(scale, 1e-30)


def skip_entry(impl: str, cell: ModelCell, mode: str, reason: str) -> dict:
  return {"impl": impl, "mode": mode, **cell.fields(), "reason": reason}


def time_mode(cell, mode, builds: dict, inputs, pairs, args, result
              ) -> list[dict]:
  """Runs each built program once (its difference from jax_flash's), then
  times them in `args.rounds` turns; a record per implementation with the
  median of its rounds. A failure is a skip entry."""
  runnable, checks, times = {}, {}, collections.defaultdict(list)
  reference = None
  rows = (None if inputs.lengths is None or mode == "fwd_bwd"
          else valid_rows(inputs.lengths, cell.seq_len))
  for impl, future in builds.items():  # jax_flash first
    try:
      built = future.result()
      out = jax.block_until_ready(built.compiled(*built.args))
    except Exception as e:  # one implementation's failure ends nothing else
      result["skipped"].append(skip_entry(impl, cell, mode, peers.skip_reason(e)))
      continue
    runnable[impl] = built
    if impl == "jax_flash":
      reference = out
    elif reference is not None and impl != CEILING:
      checks[impl] = _difference(out, reference, rows)
    del out
  del reference
  for round_index in range(args.rounds):
    for impl, built in common.round_order(list(runnable.items()), round_index):
      try:
        times[impl].append(common.measure(built.compiled, built.args,
                                          warmup=args.warmup, reps=args.reps))
      except Exception as e:
        result["skipped"].append(skip_entry(impl, cell, mode, peers.skip_reason(e)))
        del runnable[impl]
  dense = common.attention_flops(cell.batch, cell.seq_len, cell.seq_len,
                                 cell.num_heads, cell.head_dim, cell.causal,
                                 mode)
  records = []
  for impl, built in runnable.items():
    ms = statistics.median(m.ms for m in times[impl])
    max_diff, rel_diff = checks.get(impl, (None, None))
    records.append({
        "impl": impl, "mode": mode, **cell.fields(), "ms": ms,
        "tflops": built.flops / ms / 1e9,
        "dense_tflops": None if impl == CEILING else dense / ms / 1e9,
        "attended_pairs": pairs, "flops": built.flops,
        "peak_gib": times[impl][0].peak_gib,
        "implementation": built.implementation,
        "max_diff": max_diff, "rel_diff": rel_diff})
  return records


def measure_cell(cell: ModelCell, todo: dict, pool, args, result) -> None:
  """Builds the cell's programs of every mode concurrently, then times
  them mode by mode. `todo`: mode -> the implementations to measure."""
  try:
    inputs = make_inputs(cell, args.seed)
  except Exception as e:  # out of memory for the inputs
    result["skipped"] += [skip_entry(i, cell, m, peers.skip_reason(e))
                          for m, impls in todo.items() for i in impls]
    return
  pairs = attended_pairs(cell, inputs.segment_ids, inputs.lengths)
  builds = {}
  for mode, impls in todo.items():
    # jax_flash first: the forced ones wait for it, and the pool runs in order.
    default = (pool.submit(build, "jax_flash", cell, mode, inputs, pairs,
                           args.interpret) if "jax_flash" in impls else None)
    builds[mode] = {impl: default if impl == "jax_flash" else pool.submit(
        build, impl, cell, mode, inputs, pairs, args.interpret, default)
        for impl in impls}
  # Every build finishes before any timing: XLA and tokamax autotune on the
  # GPU while they compile, and a kernel timed beside that reads slow.
  concurrent.futures.wait([f for b in builds.values() for f in b.values()])
  for mode, futures in builds.items():
    result["records"] += time_mode(cell, mode, futures, inputs, pairs, args,
                                   result)


def run(args, result: dict) -> None:
  """Measures what `result` lacks, rewriting `args.out` after every cell."""
  done = {(e["impl"], e["name"], e["mode"])
          for e in result["records"] + result["skipped"]}
  plan = []
  for cell in args.cell_list:
    todo = {m: [i for i in args.impls if (i, cell.name, m) not in done]
            for m in args.modes}
    if any(todo.values()):
      plan.append((cell, {m: impls for m, impls in todo.items() if impls}))
  deadline = time.monotonic() + args.time_budget
  total = sum(len(i) for _, todo in plan for i in todo.values())
  with common.progress(total=total, desc="models", unit="run") as bar, \
      concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
    for index, (cell, todo) in enumerate(plan):
      if time.monotonic() > deadline:
        result["unmeasured"] = [c.name for c, _ in plan[index:]]
        tqdm.write(f"time budget of {args.time_budget:.0f} s spent; not "
                   f"measured: {', '.join(result['unmeasured'])}; rerun "
                   "with --resume")
        break
      bar.set_postfix_str(cell.name, refresh=False)
      measure_cell(cell, todo, pool, args, result)
      bar.update(sum(map(len, todo.values())))
      gc.collect()  # frees this cell's inputs before the next allocates
      common.write_json(args.out, result)


# ---------------------------------------------------------------- rendering


def _fastest(tflops: dict[str, float], names) -> tuple[str, float] | None:
  chosen = {n: t for n, t in tflops.items() if n in names}
  return max(chosen.items(), key=lambda item: item[1]) if chosen else None


def cell_rows(result: dict, mode: str) -> dict[str, dict]:
  """name -> {impl: record} of one mode, cells in `CELLS` order, with
  "ours" (the fastest of `OURS`), "best" (the fastest other, the ceiling
  excluded) as (impl, TFLOP/s) and "ratio" (ours / best, or None)."""
  cells = collections.defaultdict(dict)
  for r in result["records"]:
    if r["mode"] == mode:
      cells[r["name"]][r["impl"]] = r
  order = {name: i for i, name in enumerate(CELLS_BY_NAME)}
  rows = {}
  for name in sorted(cells, key=lambda n: (order.get(n, len(order)), n)):
    tflops = {i: r["tflops"] for i, r in cells[name].items()}
    ours = _fastest(tflops, OURS)
    best = _fastest(tflops, set(tflops) - {*OURS, CEILING})
    rows[name] = dict(records=cells[name], ours=ours, best=best,
                      ratio=ours[1] / best[1] if ours and best else None)
  return rows


def geomean(values) -> float | None:
  values = [v for v in values if v]
  return math.exp(statistics.fmean(map(math.log, values))) if values else None


def _fmt(value: float | None) -> str:
  return "—" if value is None else f"{value:.0f}" if value >= 100 else (
      f"{value:.3g}")


def mode_table(result: dict, mode: str) -> tuple[list[str], list[list]]:
  """A row per cell: model, shape, the kernel jax_flash ran, each
  implementation's TFLOP/s, ours, the best peer, ours over it, and the
  largest rel_diff of its peers."""
  rows = cell_rows(result, mode)
  present = {i for row in rows.values() for i in row["records"]}
  impls = [i for i in IMPLS if i in present] + sorted(present - set(IMPLS))
  headers = ["cell", "model", "shape", "jax_flash ran", *impls, "ours",
             "best peer", "ours / best", "largest rel_diff"]
  table = []
  for name, row in rows.items():
    records = row["records"]
    diff = max((r["rel_diff"] for r in records.values()
                if r.get("rel_diff") is not None), default=None)
    table.append([
        name, *(next(iter(records.values()))[k] for k in ("model", "shape")),
        records.get("jax_flash", {}).get("implementation") or "—",
        *(_fmt(records[i]["tflops"]) if i in records else "—" for i in impls),
        *(f"{_fmt(row[k][1])} ({row[k][0]})" if row[k] else "—"
          for k in ("ours", "best")),
        f"{row['ratio']:.2f}" if row["ratio"] else "—",
        "—" if diff is None else f"{diff:.2g}"
        + (" **check**" if diff > SUSPECT_DIFF else "")])
  return headers, table


def render_models(path: str) -> tuple[str, str]:
  """Writes `<stem>.md` and `<stem>.png` next to the JSON `path`."""
  result = render.load(path)
  stem = path.removesuffix(".json")
  lines = render.header_lines(result, "Attention at model shapes (TFLOP/s)")
  lines += [
      "TFLOP/s: 4 x attended (query, key) pairs x heads x head_dim (x3.5 "
      "for fwd_bwd) over the median time (`dense_tflops` in the JSON: "
      f"4·B·T²·N·D, halved for causal). Ours: the fastest of {', '.join(OURS)}"
      f"; best peer: the fastest other ({CEILING}, a dense bf16 matmul of "
      "about the same FLOPs, is the ceiling). rel_diff: max |out - "
      "jax_flash| / max |jax_flash| (fwd: out; fwd_bwd: dq, dk, dv); above "
      f"{SUSPECT_DIFF:g} the call computes something else.", ""]
  for mode in common.MODES:
    rows = cell_rows(result, mode)
    if rows:
      mean = geomean(row["ratio"] for row in rows.values())
      lines += [f"## {mode}", "",
                render.markdown_table(*mode_table(result, mode)), "",
                "Geometric mean of ours / best peer over the cells a peer "
                "ran: " + (f"**{mean:.3f}**" if mean else "—"), ""]
  return render.write_suite_files(stem, lines, result, plot_ratios)


def plot_ratios(path: str, result: dict) -> None:
  """Horizontal bars of ours / best peer per cell, one per mode."""
  import matplotlib
  matplotlib.use("Agg")  # no display on the benchmark machines
  import matplotlib.pyplot as plt

  ratios = {mode: {name: row["ratio"] for name, row in
                   cell_rows(result, mode).items() if row["ratio"]}
            for mode in common.MODES}
  names = list(dict.fromkeys(n for by_name in ratios.values() for n in by_name))
  fig, ax = plt.subplots(figsize=(8, 1.5 + 0.4 * max(1, len(names))))
  height = 0.8 / len(ratios)
  for n, (mode, by_name) in enumerate(ratios.items()):
    ax.barh([names.index(name) + n * height for name in by_name],
            list(by_name.values()), height, label=mode)
  ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
  ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names,
                fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("ours / best peer (TFLOP/s)")
  ax.grid(True, axis="x", alpha=0.3)
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  parser.add_argument("--cells", nargs="+", choices=list(CELLS_BY_NAME),
                      metavar="NAME", help="default: all of "
                      f"{' '.join(CELLS_BY_NAME)} (--smoke: "
                      f"{' '.join(SMOKE_CELLS)})")
  parser.add_argument("--impls", nargs="+", choices=list(IMPLS),
                      default=list(IMPLS), metavar="IMPL",
                      help=f"default: all of {', '.join(IMPLS)}")
  parser.add_argument("--modes", nargs="+", choices=common.MODES,
                      default=list(common.MODES))
  parser.add_argument("--rounds", type=int,
                      help="time a cell's implementations this many times "
                      "in turn; each keeps the median of its rounds")
  parser.add_argument("--out", default="benchmarks/results/h200_models.json")
  parser.add_argument("--smoke", action="store_true",
                      help="the cells at tiny sizes (jax_flash_triton in "
                      "interpret mode on a CPU), for tests")
  parser.add_argument("--resume", action="store_true",
                      help="keep the entries in --out; measure the rest")
  parser.add_argument("--time-budget", type=float, default=360.0,
                      help="seconds after which no new cell starts")
  parser.add_argument("--compile-workers", type=int, default=8,
                      help="threads compiling one cell's programs")
  parser.add_argument("--render", nargs="+", metavar="JSON",
                      help="only render these results again")
  args = parser.parse_args(argv)
  for name, value in (SMOKE if args.smoke else STANDARD).items():
    if getattr(args, name, None) is None:
      setattr(args, name, value)
  if args.rounds < 1:
    parser.error(f"--rounds must be at least 1, got {args.rounds}")
  args.interpret = not compat.has_gpu()
  names = args.cells or (SMOKE_CELLS if args.smoke else list(CELLS_BY_NAME))
  args.cell_list = [smoke_cell(CELLS_BY_NAME[n]) if args.smoke
                    else CELLS_BY_NAME[n] for n in names]
  args.out = args.out.removesuffix(".json") + ".json"
  return args


def main(argv=None) -> int:
  compat.filter_known_warnings()
  args = parse_args(argv)
  if args.render:
    for path in args.render:
      print(*render_models(path))
    return 0
  result = common.suite_result("benchmarks.models", argv, args)
  if args.resume and os.path.exists(args.out):
    previous = render.load(args.out)
    result["records"] = previous["records"]
    # A peer unavailable then (a wheel missing) is tried again.
    result["skipped"] = [e for e in previous["skipped"]
                         if not e["reason"].startswith("Unavailable")]
  paths = common.run_suite(run, args, result, args.out, render_models)
  for mode in args.modes:
    print(f"\n{mode}\n" + render.markdown_table(*mode_table(result, mode)))
  print("wrote", args.out, *paths)
  return 0


if __name__ == "__main__":
  sys.exit(main())
