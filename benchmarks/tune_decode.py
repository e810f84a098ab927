"""Sweeps the decode kernel's schedule (`DecodeTiling`) on a few cells.

For each cell (batch, cache length, q_len, page size) it times the default
schedule and variants of block_k, pipeline depth, warps and split count, side
by side with cuDNN's dense decode, and reports GB/s of cache read. The
defaults in `pallas_kernels/triton/decode.py` are chosen from its output.

    python -m benchmarks.tune_decode --out results/h200_decode_tuning.json
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks import decode as decode_benchmark
from jax_flash import decode
from pallas_kernels import compat
from pallas_kernels.triton import decode as decode_kernel

# (batch, cache length, q_len, page size): the three headline cells,
# dense and with small pages.
CELLS = [(1, 131072, 1, 0), (8, 32768, 1, 0), (64, 4096, 1, 0),
         (1, 131072, 1, 16), (8, 32768, 1, 16), (64, 4096, 1, 16),
         (8, 32768, 4, 0), (8, 32768, 1, 64), (1, 32768, 1, 0),
         (16, 16384, 1, 0, "ragged"), (16, 16384, 1, 16, "ragged")]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def make_cache(batch, length, q_len, page_size, ragged=False,
               heads=(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)):
  """(q, key_cache, value_cache, lengths, tables) as `benchmarks.decode`
  builds a cell: random values, full or ragged lengths, shuffled pages;
  `heads` = (query heads, K/V heads, head_dim)."""
  cell = decode_benchmark.DecodeCell(batch, length, q_len, page_size,
                                     bool(ragged), *heads)
  return decode_benchmark.cache_inputs(
      cell, decode_benchmark.make_sequences(cell, seed=0), seed=0)


def split_variants(default: decode_kernel.DecodeTiling):
  """Split counts from 1 to 32."""
  for splits in (1, 2, 4, 8, 16, 32):
    t = dataclasses.replace(default, num_splits=splits)
    yield f"splits{splits}" + (" (default)" if t == default else ""), t


def variants(default: decode_kernel.DecodeTiling):
  """The default, then one change at a time around it (and block_k with
  the depth together, since a wider tile needs fewer stages in flight)."""
  yield "default", default
  seen = {default}
  for block_k, stages in itertools.product((64, 128, 256), (2, 4)):
    t = dataclasses.replace(default, block_k=block_k, num_stages=stages)
    if t not in seen:
      seen.add(t)
      yield f"k{block_k}_s{stages}", t
  yield "w8", dataclasses.replace(default, num_warps=8)
  for factor in (0.5, 2.0, 4.0):
    splits = max(1, int(default.num_splits * factor))
    t = dataclasses.replace(default, num_splits=splits)
    if t not in seen:
      seen.add(t)
      yield f"splits{splits}", t


def _ours(call, tiling, q, k, v, lengths, tables):
  return decode_kernel.flash_decode(
      q, k, v, lengths, tables, None, scale=call.scale, spec=call.spec,
      page_size=call.page_size, interpret=False, tiling=tiling)[0]


def _kernel_only(call, tiling, q, k, v, lengths, tables):
  return decode_kernel._decode_partials(
      q, k, v, lengths, tables, None, scale=call.scale, spec=call.spec,
      page_size=call.page_size, tiling=tiling, interpret=False)[0]


def _xla(call, q, k, v, lengths, tables):
  """jax_flash's XLA path (a dense view of the cache, then attention)."""
  return decode._run_xla(call, q, k, v, lengths, tables, None)[0]


def _cudnn(q, k, v, lengths, tables):
  del tables
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                      implementation="cudnn")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="/tmp/h200_decode_tuning.json")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--cells", type=int, nargs="*", default=None,
                      help="indices into CELLS")
  parser.add_argument("--cell", nargs="*", default=(), metavar="B:L:Q:P[:r]",
                      help="more cells: batch, cache length, q_len, page "
                      "size (0: dense), r: ragged lengths")
  parser.add_argument("--heads", default=f"{NUM_HEADS}:{NUM_KV_HEADS}:"
                      f"{HEAD_DIM}", metavar="H:KV:D",
                      help="query heads, K/V heads, head_dim")
  parser.add_argument("--sweep", choices=("tiles", "splits"),
                      default="tiles", help="tiles: block_k, stages, warps "
                      "and splits around the default; splits: split counts")
  args = parser.parse_args(argv)
  cells = CELLS if args.cells is None else [CELLS[i] for i in args.cells]
  cells = cells + [tuple(int(x) for x in c.split(":")[:4])
                   + (("ragged",) if c.count(":") == 4 else ())
                   for c in args.cell]
  heads = tuple(int(x) for x in args.heads.split(":"))
  num_kv_heads, head_dim = heads[1:]
  records = []
  for batch, length, q_len, page_size, *ragged in cells:
    q, k, v, lengths, tables = make_cache(batch, length, q_len, page_size,
                                          bool(ragged), heads)
    cell = [batch, length, q_len, page_size, *ragged]
    shape = dict(num_heads=heads[0], num_kv_heads=num_kv_heads,
                 head_dim=head_dim)
    call, (lengths, tables, slopes, _) = decode.normalise_decode_call(
        q, k, v, lengths, block_tables=tables)
    nbytes = decode_kernel.cache_bytes_read(
        np.asarray(lengths), num_kv_heads, head_dim, 2)
    default = decode_kernel.DecodeTiling.for_call(
        batch=batch, num_kv_heads=num_kv_heads, rows=q_len * call.group,
        head_dim=head_dim, capacity=call.capacity, num_sms=compat.num_sms(),
        paged=bool(page_size))
    runs = [(name, tiling, functools.partial(_ours, call, tiling))
            for name, tiling in (variants if args.sweep == "tiles"
                                 else split_variants)(default)]
    # The split kernel alone, without the LSE merge and layout around it:
    # what the launches beside the kernel cost.
    runs.append(("kernel_only", default,
                 functools.partial(_kernel_only, call, default)))
    if not page_size:
      runs.append(("cudnn", None, _cudnn))
    runs.append(("xla", None, functools.partial(_xla, call)))
    ref = None
    for name, tiling, build in runs:
      fn = jax.jit(build)
      try:
        out = fn(q, k, v, lengths, tables)
        ms = common.time_fn(fn, q, k, v, lengths, tables, reps=args.reps)
      except Exception as e:  # a variant that fails to compile is recorded
        records.append(dict(cell=cell, **shape,
                            name=name, error=common.describe_error(e)))
        print(f"{cell} {name}: "
              f"{common.describe_error(e, 120)}")
        continue
      if ref is None:
        ref = out
      err = float("nan") if out.shape != ref.shape else float(jnp.max(
          jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
      gbps = nbytes / (ms * 1e-3) / 1e9
      records.append(dict(cell=cell, **shape, name=name,
                          tiling=None if tiling is None
                          else dataclasses.asdict(tiling),
                          us=ms * 1e3, gbps=gbps, max_diff=err))
      print(f"{cell} {name:>14}: "
            f"{ms * 1e3:8.1f} us {gbps:7.0f} GB/s diff {err:.2e}")
    header = common.run_header("benchmarks.tune_decode")
    common.write_json(args.out, dict(header, records=records))
  with open(args.out.removesuffix(".json") + ".md", "w") as f:
    f.write(render_md(records))


def render_md(records) -> str:
  """One table per cell: each schedule's time and GB/s of cache read."""
  lines = ["# Decode schedules on the H200 (bf16)", "",
           "`python -m benchmarks.tune_decode`; GB/s of K and V read "
           "(the H200's HBM: 4.8 TB/s).", ""]
  cells = sorted({tuple(r["cell"]) for r in records},
                 key=lambda c: (c[3], c[2], c[0]))
  for batch, length, q_len, page, *ragged in cells:
    first = next(r for r in records
                 if r["cell"] == [batch, length, q_len, page, *ragged])
    heads = (f"{first.get('num_heads', NUM_HEADS)}:"
             f"{first.get('num_kv_heads', NUM_KV_HEADS)} heads, "
             f"d={first.get('head_dim', HEAD_DIM)}, ")
    lines += [f"## {heads}batch {batch}, cache {length}{' (ragged)' if ragged else ''}"
              f", q_len {q_len}, {'dense' if not page else f'pages of {page}'}",
              "",
              "| schedule | us | GB/s |", "|---|---|---|"]
    for r in records:
      if r["cell"] != [batch, length, q_len, page, *ragged]:
        continue
      if "error" in r:
        lines.append(f"| {r['name']} | {r['error'][:60]} | |")
      else:
        lines.append(f"| {r['name']} | {r['us']:.1f} | {r['gbps']:.0f} |")
    lines.append("")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
