"""Decode attention against a KV cache: ours and every peer, side by side.

    python -m benchmarks.decode                  # the default cells, ~5 min on an H200
    python -m benchmarks.decode --cells 8x32k 1x128k --q-lens 1 --page-sizes 0 16
    python -m benchmarks.decode --smoke --out /tmp/decode    # CPU, seconds
    python -m benchmarks.decode --render benchmarks/results/h200_decode.json

Cells (DESIGN.md sections 2b and 5): bf16, 32 query heads on 8 KV heads,
head_dim 128; `q_len` new tokens per sequence (1 when decoding, 4 for
speculative decoding, by default on four of the cells only) against caches
of `batch x kv_len`, every sequence
full (`BxL:ragged`: random lengths), stored dense (page size 0) or in pages
of 16, 64 and 256 rows whose order in the pool is a random permutation. A
cell's implementations see the same keys and values, each in the layout its
API takes (built before timing); they compile concurrently and are then
timed in `--rounds` turns (`common.round_order`), each keeping the median
of its rounds. GB/s counts the K and V bytes a step must read:
2 * sum(lengths) * num_kv_heads * head_dim * itemsize
(`pallas_kernels.triton.decode.cache_bytes_read`); the H200's HBM moves
4.8 TB/s.

Implementations (a record's `impl`):
  jax_flash, jax_flash_paged: `jax_flash.decode_attention` as users call it
    (implementation=None; the record's `implementation` says which ran, read
    from the compiled program). `..._triton` and `..._mosaic` force one;
    a forced one that is the program None already ran is not timed twice
    (a skip entry says so), and one that raises NotImplementedError is a
    skip entry, so a Mosaic kernel added later is timed without a change here.
  cudnn, xla: `jax.nn.dot_product_attention` on the dense cache.
  cudnn_paged: `jax._src.cudnn.fused_attention_stablehlo.paged_attention`.
  pallas_decode, pallas_paged: JAX's `pallas.ops.gpu.decode_attention.gqa`
    and `paged_attention`.
A peer that cannot run a cell (no GPU, an assert on its shapes, out of
memory) gets a skip entry with the reason; the JSON is rewritten after every
cell, so a run cut short keeps what it measured, and no new cell starts
after `--time-budget` seconds.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import gc
import importlib
import re
import statistics
import sys
import time
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jax_flash
from benchmarks import common, peers, render
from pallas_kernels import compat
from pallas_kernels.triton.decode import cache_bytes_read

# (batch, cache length) pairs: the three headline cells first, so a
# run cut short by its time budget still has them; 4 GiB of cache at most.
DEFAULT_CELLS = ("8x32k", "64x4k", "1x128k", "4x64k", "16x16k", "32x8k",
                 "1x32k", "64x16k", "16x16k:ragged")
# Without --cells, q_len > 1 (speculative decoding) runs on these only, so
# that the default run fits in about 5 minutes of an H200.
SPECULATIVE_CELLS = ("8x32k", "64x4k", "1x128k", "4x64k")
STANDARD = dict(q_lens=[1, 4], page_sizes=[0, 16, 64, 256], num_heads=32,
                num_kv_heads=8, head_dim=128, warmup=2, reps=5, rounds=2)
# Tiny sizes for CPU tests: XLA's paths only, a few seconds in all.
SMOKE_CELLS = ("2x256", "3x128:ragged")
SMOKE = dict(q_lens=[1, 4], page_sizes=[0, 16], num_heads=4, num_kv_heads=2,
             head_dim=32, warmup=1, reps=2, rounds=1)
# A last-row difference from the oracle above this is not rounding: the
# implementation computes something else (a wrong layout, scale or mask).
SUSPECT_DIFF = 0.05
HBM_GBPS = {"H200": 4800.0}  # device-kind substring -> HBM bandwidth, GB/s

OURS = {False: "jax_flash", True: "jax_flash_paged"}  # by "is paged"
FORCED = ("triton", "mosaic")  # implementations also timed by name


# ---------------------------------------------------------------- cells


@dataclasses.dataclass(frozen=True)
class DecodeCell:
  """One decode step's shapes: a row of the results (with `impl`).

  kv_len is the cache's capacity per sequence (max_len, or pages_per_seq *
  page_size); every sequence is that long unless `ragged`.
  """
  batch: int
  kv_len: int
  q_len: int
  page_size: int  # 0: a dense cache
  ragged: bool
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str = "bfloat16"

  @property
  def paged(self) -> bool:
    return self.page_size > 0

  def fields(self) -> dict:
    """The fields that identify the cell in a record or skip entry."""
    return dict(batch=self.batch, q_len=self.q_len, kv_len=self.kv_len,
                num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, page_size=self.page_size,
                dtype=self.dtype, lengths="ragged" if self.ragged else "full")

  def label(self) -> str:
    """"8x32k q1 p16": how progress bars and logs name the cell."""
    layout = f"p{self.page_size}" if self.paged else "dense"
    return (f"{self.batch}x{render._short(self.kv_len)}"
            f"{' ragged' if self.ragged else ''} q{self.q_len} {layout}")


def parse_cell(text: str) -> tuple[int, int, bool]:
  """"8x32k" -> (8, 32768, False); "16x16k:ragged" -> (16, 16384, True)."""
  match = re.fullmatch(r"(\d+)x(\d+)(k?)(:ragged)?", text)
  if not match:
    raise argparse.ArgumentTypeError(
        f"a cell is BATCHxLEN[k][:ragged] (e.g. 8x32k), got {text!r}")
  batch, length, kilo, ragged = match.groups()
  return int(batch), int(length) * (1024 if kilo else 1), bool(ragged)


# ---------------------------------------------------------------- inputs


class Sequences(NamedTuple):
  """A cell's query, dense cache and lengths, shared by its layouts."""
  query: jax.Array    # [batch, q_len, num_heads, head_dim]
  key: jax.Array      # [batch, kv_len, num_kv_heads, head_dim]
  value: jax.Array
  lengths: jax.Array  # int32 [batch]


class CacheInputs(NamedTuple):
  """A cell's operands in the layout of `decode_attention` and cuDNN:
  dense [batch, kv_len, Hkv, D] with tables None, or paged
  [num_pages, page_size, Hkv, D] with tables int32 [batch, pages_per_seq]."""
  query: jax.Array
  key: jax.Array
  value: jax.Array
  lengths: jax.Array
  tables: jax.Array | None


def make_sequences(cell: DecodeCell, seed: int) -> Sequences:
  """Random query, keys and values (never zeros); lengths all kv_len, or
  uniform in [kv_len / 8, kv_len] for a ragged cell."""
  keys = jax.random.split(jax.random.key(seed), 3)
  cache_shape = (cell.batch, cell.kv_len, cell.num_kv_heads, cell.head_dim)
  query = common.random_array(
      keys[0], (cell.batch, cell.q_len, cell.num_heads, cell.head_dim),
      cell.dtype)
  if cell.ragged:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(cell.q_len, cell.kv_len // 8), cell.kv_len + 1,
                           size=cell.batch)
  else:
    lengths = np.full((cell.batch,), cell.kv_len)
  return Sequences(query, common.random_array(keys[1], cache_shape, cell.dtype),
                   common.random_array(keys[2], cache_shape, cell.dtype),
                   jnp.asarray(lengths, jnp.int32))


def cache_inputs(cell: DecodeCell, seqs: Sequences, seed: int) -> CacheInputs:
  """The dense cache as is, or cut into pages whose places in the pool are
  a random permutation: page i of sequence b (its rows i*page_size ...)
  lives at block_tables[b, i]. The pool has exactly batch * pages_per_seq
  pages, no spare ones: cuDNN's paged attention requires that number."""
  if not cell.paged:
    return CacheInputs(*seqs[:3], seqs.lengths, None)
  if cell.kv_len % cell.page_size:
    raise ValueError(f"kv_len {cell.kv_len} is not a multiple of the page "
                     f"size {cell.page_size}")
  pages_per_seq = cell.kv_len // cell.page_size
  num_pages = cell.batch * pages_per_seq
  order = np.random.default_rng(seed).permutation(num_pages)
  # Pool slot order[j] holds the j-th page in sequence order.
  gather = jnp.asarray(np.argsort(order), jnp.int32)
  def paged(cache):
    pages = cache.reshape(num_pages, cell.page_size, *cache.shape[2:])
    return jnp.take(pages, gather, axis=0)
  tables = jnp.asarray(order.reshape(cell.batch, pages_per_seq), jnp.int32)
  return CacheInputs(seqs.query, paged(seqs.key), paged(seqs.value),
                     seqs.lengths, tables)


# ---------------------------------------------------------------- implementations


Step = tuple[Callable, tuple]  # (jitted step, its arguments)
Builder = Callable[[DecodeCell, CacheInputs], Step]


def _ours(implementation: str | None) -> Builder:
  """`jax_flash.decode_attention` on the cell's cache, dense or paged."""
  def build(cell: DecodeCell, inputs: CacheInputs) -> Step:
    del cell
    if implementation is not None and not compat.has_gpu():
      # It would run in Pallas interpret mode: nothing to time.
      raise peers.Unavailable(f"implementation={implementation!r} needs a GPU "
                        "(interpret mode elsewhere)")
    def step(query, key, value, lengths, tables):
      return jax_flash.decode_attention(query, key, value, lengths,
                                        block_tables=tables,
                                        implementation=implementation)
    return jax.jit(step), tuple(inputs)
  return build


def _bottom_right_mask(lengths, q_len: int, kv_len: int):
  """bool [batch, 1, q_len, kv_len]: row i of sequence b sits at
  lengths[b] - q_len + i and sees cache positions up to it (DESIGN 2b)."""
  rows = lengths[:, None, None, None] - q_len + jnp.arange(q_len)[:, None]
  return jnp.arange(kv_len)[None, None, None, :] <= rows


def xla(cell: DecodeCell, inputs: CacheInputs) -> Step:
  """`jax.nn.dot_product_attention`'s XLA path with the exact decode mask
  (bottom-right causal, lengths), built in the step from the lengths and
  fused by XLA (no mask bytes read)."""
  def step(query, key, value, lengths):
    mask = _bottom_right_mask(lengths, cell.q_len, cell.kv_len)
    return jax.nn.dot_product_attention(query, key, value, mask=mask,
                                        implementation="xla")
  return jax.jit(step), (inputs.query, inputs.key, inputs.value,
                         inputs.lengths)


def cudnn(cell: DecodeCell, inputs: CacheInputs) -> Step:
  """cuDNN through `jax.nn.dot_product_attention` with the lengths as
  padding. Non-causal: cuDNN's causal mask is top-left (row i would see
  only positions <= i), so for q_len > 1 every row attends to the whole
  valid cache (exact for q_len 1; the same bytes read either way)."""
  del cell
  peers.require_gpu("cuDNN attention")
  def step(query, key, value, lengths):
    return jax.nn.dot_product_attention(query, key, value,
                                        key_value_seq_lengths=lengths,
                                        implementation="cudnn")
  return jax.jit(step), (inputs.query, inputs.key, inputs.value,
                         inputs.lengths)


def cudnn_paged(cell: DecodeCell, inputs: CacheInputs) -> Step:
  """cuDNN's paged attention (JAX's private binding): pages
  [num_pages, page_size, Hkv, D], page tables [batch, 1, pages_per_seq, 1],
  a padding mask from the lengths; non-causal, as `cudnn`."""
  peers.require_gpu("cuDNN paged attention")
  with peers.IMPORT_LOCK:
    cudnn_attention = importlib.import_module(
        "jax._src.cudnn.fused_attention_stablehlo")
  tables = inputs.tables[:, None, :, None]
  def step(query, key, value, lengths, tables):
    q_lengths = jnp.full(lengths.shape, cell.q_len, jnp.int32)
    return cudnn_attention.paged_attention(
        query, key, value, q_lengths, lengths, tables, tables,
        scale=cell.head_dim ** -0.5,
        mask_type=cudnn_attention.MaskType.PADDING)
  return jax.jit(step), (inputs.query, inputs.key, inputs.value,
                         inputs.lengths, tables)


def _pallas_ops(name: str):
  """`jax.experimental.pallas.ops.gpu.<name>` (JAX 0.11 deprecates these
  modules in favour of tokamax; they still work)."""
  with peers.IMPORT_LOCK, warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")


def _fold_rows(query, num_kv_heads: int):
  """[B, T, H, D] -> [B, Hkv * T * G, D], each KV head's T * G rows
  together: JAX's Pallas decode kernels take one new token per sequence,
  and several are, to them, more query heads of the same KV head (the
  rows attend non-causally, as cuDNN's)."""
  b, t, h, d = query.shape
  g = h // num_kv_heads
  folded = query.reshape(b, t, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4)
  return folded.reshape(b, num_kv_heads * t * g, d)


def _unfold_rows(out, shape, num_kv_heads: int):
  b, t, h, d = shape
  out = out.reshape(b, num_kv_heads, t, h // num_kv_heads, d)
  return out.transpose(0, 2, 1, 3, 4).reshape(shape)


def _halve_until(splits: int, fits: Callable[[int], bool]) -> int:
  while splits > 1 and not fits(splits):
    splits //= 2
  if not fits(splits):
    raise NotImplementedError("no split count satisfies the kernel's asserts")
  return splits


def pallas_decode(cell: DecodeCell, inputs: CacheInputs, *,
                  interpret: bool = False) -> Step:
  """JAX's split-K Pallas kernel (`decode_attention.gqa`, its default
  tiles: block_h 16, block_k 128, 16 splits, fewer where the length needs).

  Its kernel reads the cache as [B, Hkv, L, D]; `gqa` takes [B, L, Hkv, D]
  and transposes it. The cache is stored in the kernel's layout (untimed,
  as for `pallas_paged`) and handed to `gqa` through a transpose that
  `gqa`'s own cancels, so XLA copies nothing. `interpret`: Pallas
  interpret mode (the tests' check of the call on a CPU)."""
  if not interpret:
    peers.require_gpu("pallas.ops.gpu.decode_attention")
  gqa = _pallas_ops("decode_attention").gqa
  block_k = 128
  def fits(splits):
    span = cell.kv_len // splits
    return (cell.kv_len % splits == 0 and span >= 16
            and span % min(block_k, span) == 0)
  splits = _halve_until(16, fits)
  key_t, value_t = (jnp.swapaxes(x, 1, 2) for x in (inputs.key, inputs.value))
  def step(query, key_t, value_t, lengths):
    out = gqa(_fold_rows(query, cell.num_kv_heads), jnp.swapaxes(key_t, 1, 2),
              jnp.swapaxes(value_t, 1, 2), kv_seq_len=lengths,
              block_k=block_k, k_splits=splits, interpret=interpret)
    return _unfold_rows(out, query.shape, cell.num_kv_heads)
  return jax.jit(step), (inputs.query, key_t, value_t, inputs.lengths)


def pallas_paged(cell: DecodeCell, inputs: CacheInputs, *,
                 interpret: bool = False) -> Step:
  """JAX's Pallas paged attention on pages [Hkv, num_pages, page_size, D]
  (its layout, built untimed). Its defaults (block_h 16, 8 pages a step,
  16 splits), with a step capped at 512 rows (pages of 256: 2 a step) and
  the splits halved until they divide the pages (its asserts). It applies
  no softmax scale: 1/sqrt(D) is folded into the query."""
  if not interpret:
    peers.require_gpu("pallas.ops.gpu.paged_attention")
  paged_attention = _pallas_ops("paged_attention").paged_attention
  pages_per_seq = inputs.tables.shape[1]
  per_step = max(1, min(8, 512 // cell.page_size))
  def fits(splits):
    part = pages_per_seq // splits
    return (pages_per_seq % splits == 0 and part >= 1
            and part % min(per_step, part) == 0)
  splits = _halve_until(16, fits)
  k_pages, v_pages = (jnp.moveaxis(x, 2, 0) for x in (inputs.key, inputs.value))
  def step(query, k_pages, v_pages, lengths, tables):
    scaled = query * jnp.asarray(cell.head_dim ** -0.5, query.dtype)
    out = paged_attention(_fold_rows(scaled, cell.num_kv_heads), k_pages,
                          v_pages, tables, lengths,
                          pages_per_compute_block=per_step, k_splits=splits,
                          interpret=interpret)
    return _unfold_rows(out, query.shape, cell.num_kv_heads)
  return jax.jit(step), (inputs.query, k_pages, v_pages, inputs.lengths,
                         inputs.tables)


def implementations(paged: bool) -> dict[str, Builder]:
  """A layout's implementations, in table order: ours, then its forced
  variants, then the peers."""
  ours = OURS[paged]
  impls = {ours: _ours(None)}
  impls.update({f"{ours}_{name}": _ours(name) for name in FORCED})
  if paged:
    impls.update(cudnn_paged=cudnn_paged, pallas_paged=pallas_paged)
  else:
    impls.update(cudnn=cudnn, xla=xla, pallas_decode=pallas_decode)
  return impls


ALL_IMPLS = [*implementations(False), *implementations(True)]
# Peers whose compilation runs XLA's autotuner: one at a time
# (`common.autotune_lock`).
AUTOTUNED = frozenset({"xla", "cudnn", "cudnn_paged"})


def forced_implementation(impl: str) -> str | None:
  """"jax_flash_paged_triton" -> "triton"; None for the others."""
  for ours in OURS.values():
    name = impl.removeprefix(ours + "_")
    if name in FORCED:
      return name
  return None


# ---------------------------------------------------------------- building


class Built(NamedTuple):
  compiled: Callable
  args: tuple
  implementation: str | None  # ours: which ran; None for a peer
  temp_mib: float | None      # XLA's temporaries: copies of the cache show


def build(impl: str, cell: DecodeCell, inputs: CacheInputs,
          default: concurrent.futures.Future | None = None) -> Built:
  """Lowers and compiles `impl` on the cell (safe from several threads).

  `default`: for a forced implementation of ours, the build of
  implementation=None; when that ran the same one, peers.SameProgram."""
  forced = forced_implementation(impl)
  if forced is not None and default is not None:
    try:
      ran = default.result().implementation
    except Exception:  # the default failed: the forced one says why itself
      ran = None
    if ran == forced:
      raise peers.SameProgram(f"the program {OURS[cell.paged]} ran "
                        f"(implementation=None chose {forced!r})")
  fn, args = implementations(cell.paged)[impl](cell, inputs)
  lowered = fn.lower(*args)
  ran = (peers.implementation_run(lowered.as_text())
         if impl.startswith("jax_flash") else None)
  with common.autotune_lock if impl in AUTOTUNED else contextlib.nullcontext():
    compiled = lowered.compile()
  stats = compiled.memory_analysis()
  temp = None if stats is None else stats.temp_size_in_bytes / 2**20
  return Built(compiled, args, ran, temp)


def skip_entry(impl: str, cell: DecodeCell, reason: str) -> dict:
  """A row of the results' "skipped" list."""
  return {"impl": impl, **cell.fields(), "reason": reason}


# ---------------------------------------------------------------- timing


def _last_row_diff(out, reference) -> float:
  """max |out - reference| on the last query row: the row every
  implementation computes exactly (a non-causal peer's earlier rows of a
  q_len > 1 step see a few later tokens too)."""
  diff = jnp.abs(out[:, -1].astype(jnp.float32) - reference)
  return float(jnp.max(diff))


def time_cell(cell: DecodeCell, built: dict, reference, lengths, args,
              result: dict) -> list[dict]:
  """Times the cell's implementations (`built`: impl -> future of Built)
  `args.rounds` times in turn; returns a record per implementation with the
  median of its rounds. A failure (to build or to run) becomes a skip entry
  and that implementation is not timed again."""
  runnable, diffs, rounds = {}, {}, collections.defaultdict(list)
  for impl, future in built.items():
    try:
      b = future.result()
      out = b.compiled(*b.args)
      diffs[impl] = None if reference is None else _last_row_diff(out,
                                                                   reference)
      runnable[impl] = b
      del out
    except Exception as e:  # one implementation's failure ends nothing else
      result["skipped"].append(skip_entry(impl, cell, peers.skip_reason(e)))
  for round_index in range(args.rounds):
    for impl, b in common.round_order(list(runnable.items()), round_index):
      try:
        rounds[impl].append(common.time_fn(b.compiled, *b.args,
                                           warmup=args.warmup, reps=args.reps))
      except Exception as e:
        result["skipped"].append(skip_entry(impl, cell, peers.skip_reason(e)))
        del runnable[impl]
  nbytes = cache_bytes_read(lengths, cell.num_kv_heads, cell.head_dim,
                            jnp.dtype(cell.dtype).itemsize)
  records = []
  for impl, b in runnable.items():
    ms = statistics.median(rounds[impl])
    records.append({"impl": impl, **cell.fields(), "us": ms * 1e3,
                    "gbps": nbytes / (ms * 1e-3) / 1e9,
                    "implementation": b.implementation,
                    "max_diff": diffs[impl], "temp_mib": b.temp_mib})
  return records


def oracle_last_row(seqs: Sequences):
  """The last query row of `decode_attention`'s XLA path on the dense
  cache (the oracle of the tests), float32; None if it cannot run."""
  try:
    fn = jax.jit(lambda q, k, v, n: jax_flash.decode_attention(
        q, k, v, n, implementation="xla")[:, -1].astype(jnp.float32))
    return jax.block_until_ready(fn(*seqs))
  except Exception as e:  # the timings stand without the check
    tqdm.write(f"no oracle ({peers.skip_reason(e)}); max_diff left empty")
    return None


# ---------------------------------------------------------------- the run


def run(args, result: dict) -> None:
  """Measures every (cell, implementation), appending to `result` and
  rewriting `args.json` after every cell."""
  deadline = time.monotonic() + args.time_budget
  groups = args.groups
  impls_of = {paged: [i for i in implementations(paged) if i in args.impls]
              for paged in (False, True)}
  total = sum(len(impls_of[p > 0]) for _ in groups for p in args.page_sizes)
  with common.progress(total=total, desc="decode", unit="run") as bar, \
      concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
    for index, (q_len, batch, kv_len, ragged) in enumerate(groups):
      base = DecodeCell(batch, kv_len, q_len, 0, ragged, args.num_heads,
                        args.num_kv_heads, args.head_dim)
      layouts = [dataclasses.replace(base, page_size=p)
                 for p in args.page_sizes]
      if time.monotonic() > deadline:
        left = [f"{b}x{render._short(n)}{' ragged' if r else ''} q{q}"
                for q, b, n, r in groups[index:]]
        result["unmeasured"] = left
        tqdm.write(f"time budget of {args.time_budget:.0f} s spent; not "
                   f"measured: {', '.join(left)}")
        break
      try:
        seqs = make_sequences(base, args.seed)
        reference = oracle_last_row(seqs)
      except Exception as e:  # e.g. out of memory for the caches
        for cell in layouts:
          result["skipped"] += [skip_entry(impl, cell, peers.skip_reason(e))
                                for impl in impls_of[cell.paged]]
        bar.update(sum(len(impls_of[c.paged]) for c in layouts))
        continue
      lengths = np.asarray(seqs.lengths)
      for cell in layouts:
        impls = impls_of[cell.paged]
        bar.set_postfix_str(cell.label(), refresh=False)
        _measure_layout(cell, impls, seqs, reference, lengths, pool, args,
                        result)
        bar.update(len(impls))
        common.write_json(args.json, result)
      del seqs, reference
      gc.collect()


def _measure_layout(cell, impls, seqs, reference, lengths, pool, args,
                    result) -> None:
  """Builds the cell's implementations concurrently, then times them."""
  try:
    inputs = cache_inputs(cell, seqs, args.seed)
  except Exception as e:
    result["skipped"] += [skip_entry(impl, cell, peers.skip_reason(e)) for impl in impls]
    return
  ours = OURS[cell.paged]
  futures = {}
  # Ours with implementation=None first: a forced one waits for it (to
  # learn whether it is the same program), and the pool runs in order.
  default = (pool.submit(build, ours, cell, inputs) if ours in impls
             else None)
  for impl in impls:
    futures[impl] = default if impl == ours else pool.submit(
        build, impl, cell, inputs, default)
  # Every build finishes before any timing: XLA autotunes on the GPU while
  # it compiles, and a kernel timed beside that reads slow.
  concurrent.futures.wait(futures.values())
  result["records"] += time_cell(cell, futures, reference, lengths, args,
                                 result)
  del futures, inputs
  gc.collect()  # frees this layout's caches before the next allocates


# ---------------------------------------------------------------- rendering


def _row_key(record: dict) -> tuple:
  return (record["batch"], record["kv_len"], record["lengths"])


def _fmt_cell(record: dict | None) -> str:
  if record is None:
    return "—"
  return f"{record['us']:,.0f} ({record['gbps']:,.0f})"


def _hbm_gbps(result: dict) -> float | None:
  return next((v for k, v in HBM_GBPS.items() if k in result["device"]), None)


# Table columns: a dense implementation and its paged counterpart share one
# (a row is one layout, so one of the two at most has a time there).
COLUMNS = {"jax_flash[_paged]": ("jax_flash", "jax_flash_paged"),
           **{f"jax_flash[_paged]_{name}": (f"jax_flash_{name}",
                                            f"jax_flash_paged_{name}")
              for name in FORCED},
           "cudnn[_paged]": ("cudnn", "cudnn_paged"),
           "xla": ("xla",),
           "pallas_decode / pallas_paged": ("pallas_decode", "pallas_paged")}


def decode_table(result: dict, q_len: int) -> tuple[list[str], list[list]]:
  """Rows: (batch x kv_len, layout) of one q_len; columns: each
  implementation's µs (GB/s), the best peer, ours over it, ours against
  the HBM bandwidth and, for pages, ours paged over ours dense."""
  records = [r for r in result["records"] if r["q_len"] == q_len]
  present = {r["impl"] for r in records}
  columns = {title: impls for title, impls in COLUMNS.items()
             if present & set(impls)}
  columns.update({name: (name,) for name in sorted(
      present - {i for impls in COLUMNS.values() for i in impls})})
  hbm = _hbm_gbps(result)
  rows = collections.defaultdict(dict)
  for r in records:
    rows[(_row_key(r), r["page_size"])][r["impl"]] = r
  order = list(dict.fromkeys(_row_key(r) for r in records))
  headers = ["batch x cache", "layout",
             *(f"{title} µs (GB/s)" for title in columns),
             "best peer", "ours / best peer",
             *([f"ours % of {hbm / 1000:g} TB/s"] if hbm else []),
             "paged / dense (ours)"]
  table = []
  for key, page in sorted(rows, key=lambda k: (order.index(k[0]), k[1])):
    cell = rows[(key, page)]
    ours = _fastest(cell, lambda n: n.startswith("jax_flash"))
    best = _fastest(cell, lambda n: not n.startswith("jax_flash"))
    dense = _fastest(rows.get((key, 0), {}),
                     lambda n: n.startswith("jax_flash"))
    batch, kv_len, lengths = key
    table.append([
        f"{batch} x {render._short(kv_len)}"
        + (" ragged" if lengths == "ragged" else ""),
        f"pages of {page}" if page else "dense",
        *(_fmt_cell(next((cell[i] for i in impls if i in cell), None))
          for impls in columns.values()),
        best["impl"] if best else "—",
        f"{best['us'] / ours['us']:.2f}" if ours and best else "—",
        *([f"{100 * ours['gbps'] / hbm:.0f}%" if ours else "—"]
          if hbm else []),
        f"{ours['us'] / dense['us']:.2f}" if page and ours and dense else "—"])
  return headers, table


def _column_order(record: dict) -> int:
  """Ours first, then the peers, in `ALL_IMPLS` order (others last)."""
  impl = record["impl"]
  return ALL_IMPLS.index(impl) if impl in ALL_IMPLS else len(ALL_IMPLS)


def _fastest(cell: dict, keep) -> dict | None:
  chosen = [r for n, r in cell.items() if keep(n)]
  return min(chosen, key=lambda r: r["us"]) if chosen else None


NOTES = """\
Each entry: µs per decode step (GB/s of K and V read: 2 * sum(lengths) *
num_kv_heads * head_dim * 2 bytes over the time), the median of
`--rounds` interleaved rounds (each the median of timed samples after
warm-up). "ours / best peer": the best peer's time over ours (above 1:
ours faster), ours being the fastest of the `jax_flash*` columns;
"paged / dense (ours)": our paged time over our dense time, same cell.

- `jax_flash`, `jax_flash_paged`: `jax_flash.decode_attention` with
  implementation=None; `_triton`/`_mosaic` force one (not timed when it is
  the program None ran; see Skipped).
- `cudnn`: `jax.nn.dot_product_attention(..., key_value_seq_lengths=lengths,
  implementation="cudnn")`; `cudnn_paged`: `jax._src.cudnn.
  fused_attention_stablehlo.paged_attention` (pages [num_pages, page_size,
  Hkv, D], page table [batch, 1, pages, 1], `MaskType.PADDING`).
- `xla`: `jax.nn.dot_product_attention(..., mask=...,
  implementation="xla")`, the exact decode mask (bottom-right causal and
  the lengths) built from the lengths inside the step.
- `pallas_decode`: `pallas.ops.gpu.decode_attention.gqa` (block_k 128, 16
  splits) with the cache stored in its kernel's layout [B, Hkv, L, D] (its
  API's transpose cancelled, so no copy is timed); `pallas_paged`:
  `pallas.ops.gpu.paged_attention` on pages [Hkv, num_pages, page_size, D],
  8 pages a step (2 for pages of 256), 16 splits, 1/sqrt(D) folded into
  the query (its kernel applies no scale).
- q_len 4 (speculative): cuDNN's causal mask is top-left (row i would see
  positions <= i only), so `cudnn` and `cudnn_paged` run non-causal with
  the lengths as padding, and the Pallas kernels (one new token per
  sequence) take the 4 rows as more query heads of each KV head: their
  first 3 rows also see the 1-3 newest tokens. They read the same bytes
  and do the same work as a causal step, so the times compare; ours and
  `xla` compute the causal step exactly.
- Pages lie in a random permutation of a pool of exactly batch *
  pages_per_seq pages (cuDNN's paged attention requires that count).
- `max_diff` in the JSON: max |out - oracle| on the last query row (the
  row every implementation computes exactly), the oracle being
  `decode_attention`'s XLA path in float32; `temp_mib`: XLA's temporary
  buffers of the step (a copy of the cache inside a step would show there).
"""


def render_decode(path: str) -> tuple[str, str]:
  """Writes `<stem>.md` and `<stem>.png` next to the JSON `path`."""
  result = render.load(path)
  stem = path.removesuffix(".json")
  lines = render.header_lines(result, "Decode attention (GB/s of KV cache "
                              "read)")
  cells = result["records"] + result["skipped"]
  if cells:
    c = cells[0]
    lines += [f"{c['dtype']}, {c['num_heads']} query heads on "
              f"{c['num_kv_heads']} KV heads, head_dim {c['head_dim']}."
              + (f" HBM: {_hbm_gbps(result) / 1000:g} TB/s."
                 if _hbm_gbps(result) else ""), ""]
  lines += [NOTES]
  ran = collections.Counter(
      (r["impl"], r["implementation"]) for r in result["records"]
      if r["impl"] in OURS.values())
  if ran:
    lines += ["implementation=None ran: " + "; ".join(
        f"`{impl}` {name} ({n} cells)"
        for (impl, name), n in sorted(ran.items())) + ".", ""]
  for q_len in sorted({r["q_len"] for r in result["records"]}):
    lines += [f"## q_len {q_len}", "",
              render.markdown_table(*decode_table(result, q_len)), ""]
  diffs = collections.defaultdict(float)
  for r in result["records"]:
    if r.get("max_diff") is not None:
      diffs[r["impl"]] = max(diffs[r["impl"]], r["max_diff"])
  if diffs:
    lines += ["## Largest last-row difference from the oracle", "",
              f"Above {SUSPECT_DIFF:g} (bf16 rounding is about 0.01): "
              "**check** the call.", "",
              render.markdown_table(["impl", "largest max_diff"], [
                  [i, f"{d:.3g}" + (" **check**" if d > SUSPECT_DIFF else "")]
                  for i, d in diffs.items()]), ""]
  return render.write_suite_files(stem, lines, result, plot_gbps)


def plot_gbps(path: str, result: dict) -> None:
  """Bars of GB/s: a panel per (q_len, layout), a group of bars per
  (batch, cache) and a bar per implementation; the HBM bandwidth dashed."""
  import matplotlib
  matplotlib.use("Agg")  # no display on the benchmark machines
  import matplotlib.pyplot as plt

  records = result["records"]
  q_lens = sorted({r["q_len"] for r in records}) or [1]
  pages = sorted({r["page_size"] for r in records}) or [0]
  # A bar per table column: a dense implementation and its paged
  # counterpart (never in the same panel) share a colour and a legend entry.
  column = {i: title for title, impls in COLUMNS.items() for i in impls}
  titles = list(dict.fromkeys(column.get(r["impl"], r["impl"])
                              for r in sorted(records, key=_column_order)))
  palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  colours = {t: palette[n % len(palette)] for n, t in enumerate(titles)}
  fig, axes = plt.subplots(len(q_lens), len(pages), squeeze=False,
                           figsize=(4.5 * len(pages), 3.4 * len(q_lens)))
  hbm = _hbm_gbps(result)
  for row, q_len in enumerate(q_lens):
    for col, page in enumerate(pages):
      ax = axes[row][col]
      chosen = [r for r in records
                if r["q_len"] == q_len and r["page_size"] == page]
      groups = list(dict.fromkeys(_row_key(r) for r in chosen))
      names = [t for t in titles
               if any(column.get(r["impl"], r["impl"]) == t for r in chosen)]
      width = 0.8 / max(1, len(names))
      for n, title in enumerate(names):
        by_group = {_row_key(r): r["gbps"] for r in chosen
                    if column.get(r["impl"], r["impl"]) == title}
        xs = [g + n * width for g, key in enumerate(groups) if key in by_group]
        ax.bar(xs, [by_group[k] for k in groups if k in by_group], width,
               label=title, color=colours[title])
      if hbm:
        ax.axhline(hbm, color="grey", linestyle="--", linewidth=1)
      ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                    [f"{b}x{render._short(n)}{' ragged' if l == 'ragged' else ''}"
                     for b, n, l in groups], fontsize=7, rotation=45)
      ax.set_title(f"q_len {q_len}, "
                   + (f"pages of {page}" if page else "dense"), fontsize=10)
      ax.set_ylabel("GB/s")
      ax.grid(True, axis="y", alpha=0.3)
  handles = {}
  for ax in axes.flat:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      handles.setdefault(label, handle)
  fig.legend(handles.values(), handles.keys(), loc="lower center",
             ncol=min(len(handles), 6) or 1, fontsize=8)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  parser.add_argument("--cells", nargs="+", type=parse_cell,
                      metavar="BxL[:ragged]",
                      help=f"default: {' '.join(DEFAULT_CELLS)} for q_len "
                      f"1, {' '.join(SPECULATIVE_CELLS)} for the others")
  parser.add_argument("--q-lens", nargs="+", type=int)
  parser.add_argument("--page-sizes", nargs="+", type=int,
                      help="0: a dense cache (default: 0 16 64 256)")
  parser.add_argument("--impls", nargs="+", choices=ALL_IMPLS,
                      default=ALL_IMPLS, metavar="IMPL",
                      help=f"default: all of {', '.join(ALL_IMPLS)}")
  parser.add_argument("--num-heads", type=int)
  parser.add_argument("--num-kv-heads", type=int)
  parser.add_argument("--head-dim", type=int)
  parser.add_argument("--warmup", type=int)
  parser.add_argument("--reps", type=int)
  parser.add_argument("--rounds", type=int,
                      help="time a cell's implementations this many times "
                      "in turn; each keeps the median of its rounds")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="benchmarks/results/h200_decode",
                      help="path prefix of the .json, .md and .png")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes (XLA on a CPU), for tests")
  parser.add_argument("--time-budget", type=float, default=400.0,
                      help="seconds after which no new cell starts")
  parser.add_argument("--compile-workers", type=int, default=4,
                      help="threads compiling one cell's implementations")
  parser.add_argument("--render", nargs="+", metavar="JSON",
                      help="only render these results again")
  args = parser.parse_args(argv)
  preset = SMOKE if args.smoke else STANDARD
  for name, value in preset.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  # (q_len, batch, kv_len, ragged) in the order measured: every q_len 1
  # cell first, the headline cells first among them.
  def cells_for(q_len):
    if args.cells is not None:
      return args.cells
    if args.smoke:
      return map(parse_cell, SMOKE_CELLS)
    return map(parse_cell, DEFAULT_CELLS if q_len == 1 else SPECULATIVE_CELLS)
  args.groups = [(q_len, *cell) for q_len in args.q_lens
                 for cell in cells_for(q_len)]
  if args.rounds < 1:
    parser.error(f"--rounds must be at least 1, got {args.rounds}")
  if any(p < 0 for p in args.page_sizes) or any(q < 1 for q in args.q_lens):
    parser.error("page sizes must be >= 0 and q_lens >= 1")
  args.json = args.out.removesuffix(".json") + ".json"
  return args


def main(argv=None) -> int:
  compat.filter_known_warnings()
  args = parse_args(argv)
  if args.render:
    for path in args.render:
      print(*render_decode(path))
    return 0
  result = common.suite_result("benchmarks.decode", argv, args)
  paths = common.run_suite(run, args, result, args.json, render_decode)
  for q_len in sorted({r["q_len"] for r in result["records"]}):
    print(f"\nq_len {q_len}\n"
          + render.markdown_table(*decode_table(result, q_len)))
  print("wrote", args.json, *paths)
  return 0


if __name__ == "__main__":
  sys.exit(main())
