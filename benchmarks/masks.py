"""What masks save and what score changes cost, on one long sequence.

    python -m benchmarks.masks          # -> benchmarks/results/h200_masks.{json,md}
    python -m benchmarks.masks --implementation mosaic   # h200_masks_mosaic.*
    python -m benchmarks.masks --implementation auto     # h200_masks_auto.*

bf16, batch 1, 16 heads, head_dim 128, seq 16k (`--seq`), forward and
forward+backward of `jax_flash.flash_attention` with `--implementation`
(triton; mosaic, where a call it does not take is left out; auto:
implementation=None, each record saying which kernel ran).

Each row is judged against a yardstick (`Variant.against`):
- masks by their speed-up over full attention (the work they let the
  kernels skip);
- the same mask or score change written two ways against each other: the
  causal mask as `mask_fn` and as a dense mask, and a document mask as
  `mask_fn`, against `is_causal` and `segment_ids`, ALiBi and the soft cap
  as `score_fn` against `alibi_slopes` and `logits_soft_cap`;
- score changes (soft cap, ALiBi, dropout) by their cost over the plain
  causal call;
- a dense bias against cuDNN's attention with the same bias (`jax.nn`,
  where cuDNN runs), fwd+bwd with and without its gradient (dbias, an
  O(N^2) output of its own).
`x yardstick` is the yardstick's time over the row's (above 1: faster).
TFLOP/s use the dense count 4·B·T²·N·D (x3.5 for fwd+bwd) for every row,
so they compare time, not useful work.
"""
from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks import common, peers, render
from pallas_kernels import compat


class Variant(NamedTuple):
  kwargs: dict          # flash_attention's keyword arguments
  against: str | None   # the row it is judged against (None: itself)
  peer: str | None = None  # run by jax.nn with this implementation instead
  # fwd+bwd also differentiates the bias (its forward is another row's).
  bias_grad: bool = False


def variants(seq: int, num_heads: int) -> dict[str, Variant]:
  """The measured calls, by row name, yardsticks before the rows they
  judge."""
  document = seq // 16
  documents = jnp.repeat(jnp.arange(16, dtype=jnp.int32), document)[None]
  slopes = 2.0 ** -jnp.arange(1, num_heads + 1, dtype=jnp.float32)
  causal = dict(is_causal=True)

  # Written as arithmetic on the indices: mask_fn and score_fn are traced
  # into the kernels, which take no arrays they close over.
  def alibi_score(score, b, h, q_idx, kv_idx):
    del b
    slope = jnp.exp2(-(h + 1).astype(jnp.float32))
    return score - slope * jnp.abs(q_idx - kv_idx).astype(jnp.float32)

  def softcap_score(score, *_):
    return 30.0 * jnp.tanh(score / 30.0)

  # The same ALiBi through a `max` of the positions, which
  # `jax_flash.builtin_forms` does not read: the kernels call it per score
  # (the two above run as the built-ins).
  def opaque_alibi_score(score, b, h, q_idx, kv_idx):
    del b
    slope = jnp.exp2(-(h + 1).astype(jnp.float32))
    distance = jnp.maximum(q_idx - kv_idx, kv_idx - q_idx)
    return score - slope * distance.astype(jnp.float32)

  bias = jax.random.normal(jax.random.key(1), (1, num_heads, seq, seq),
                           jnp.bfloat16)
  return {
      "full": Variant({}, None),
      "causal": Variant(causal, "full"),
      "sliding window 1k (causal)": Variant(
          dict(is_causal=True, local_window_size=(1024, 0)), "full"),
      "16 documents (segment ids)": Variant(dict(segment_ids=documents),
                                            "full"),
      "causal as mask_fn": Variant(
          dict(mask_fn=lambda b, h, q, k: q >= k), "causal"),
      # The same mask through an `or` that `jax_flash.builtin_forms` does not
      # read (the row above runs as `is_causal`): mask_fn's own path.
      "causal as an opaque mask_fn": Variant(
          dict(mask_fn=lambda b, h, q, k: (q >= k) | (k < 0)), "causal"),
      "causal as a dense mask": Variant(
          dict(mask=jnp.tril(jnp.ones((seq, seq), bool))), "causal"),
      "16 documents as mask_fn": Variant(
          dict(mask_fn=lambda b, h, q, k: q // document == k // document),
          "16 documents (segment ids)"),
      "softcap 30": Variant(dict(logits_soft_cap=30.0), "full"),
      "causal + softcap 30": Variant(dict(causal, logits_soft_cap=30.0),
                                     "causal"),
      "causal + softcap as score_fn": Variant(
          dict(causal, score_fn=softcap_score), "causal + softcap 30"),
      "alibi": Variant(dict(alibi_slopes=slopes), "full"),
      "causal + alibi": Variant(dict(causal, alibi_slopes=slopes), "causal"),
      "causal + ALiBi as score_fn": Variant(
          dict(causal, score_fn=alibi_score), "causal + alibi"),
      "causal + ALiBi as an opaque score_fn": Variant(
          dict(causal, score_fn=opaque_alibi_score), "causal + alibi"),
      "dropout 0.1": Variant(
          dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "full"),
      "causal + dropout 0.1": Variant(
          dict(causal, dropout_rate=0.1, dropout_rng=jax.random.key(0)),
          "causal"),
      "causal + sinks": Variant(
          dict(causal, sinks=jnp.linspace(-1.0, 1.0, num_heads)), "causal"),
      "dense bias (cuDNN)": Variant(dict(bias=bias), None, peer="cudnn"),
      "dense bias": Variant(dict(bias=bias), "dense bias (cuDNN)"),
      "dense bias + dbias (cuDNN)": Variant(dict(bias=bias), None,
                                            peer="cudnn", bias_grad=True),
      "dense bias + dbias": Variant(dict(bias=bias),
                                    "dense bias + dbias (cuDNN)",
                                    bias_grad=True),
  }


def build(mode: str, shape, variant: Variant, interpret: bool,
          implementation: str | None = "triton"):
  """(jitted fn, inputs) of one row: the forward, or the gradients of
  <out, d_out> with respect to q, k and v (and the bias, with
  `variant.bias_grad`). The variant's arrays (bias,
  segment ids, slopes, the dropout key) are arguments of the jitted
  function, not constants folded into its program (a [1, 16, 16k, 16k]
  bias is 8.6 GB)."""
  q, k, v, d_out = common.attention_inputs(shape, jnp.bfloat16)
  arrays = {n: x for n, x in variant.kwargs.items()
            if isinstance(x, jax.Array)}
  static = {n: x for n, x in variant.kwargs.items() if n not in arrays}

  def attention(q, k, v, arrays):
    if variant.peer is not None:
      peers.require_gpu(f"jax.nn's {variant.peer} attention")
      return jax.nn.dot_product_attention(q, k, v,
                                          implementation=variant.peer,
                                          **static, **arrays)
    return jax_flash.flash_attention(q, k, v, implementation=implementation,
                                     interpret=interpret, **static, **arrays)

  if mode == "fwd":
    return jax.jit(attention), (q, k, v, arrays)
  def loss(q, k, v, d, bias, others):
    out = attention(q, k, v, dict(others, **bias))
    return jnp.sum(out.astype(jnp.float32) * d.astype(jnp.float32))

  bias = {n: arrays.pop(n) for n in ("bias",) if variant.bias_grad}
  argnums = (0, 1, 2, 4) if variant.bias_grad else (0, 1, 2)
  return jax.jit(jax.grad(loss, argnums)), (q, k, v, d_out, bias, arrays)


def kernel_ran(fn, inputs) -> str:
  """Which implementation a jitted call's program runs."""
  return peers.implementation_run(fn.lower(*inputs).as_text())


def add_cell_arguments(parser: argparse.ArgumentParser) -> None:
  """--seq, --heads, --head-dim and --reps: the cell every row runs on
  (batch 1) and the timed calls per measurement."""
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--reps", type=int, default=10)


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_cell_arguments(parser)
  parser.add_argument("--implementation", choices=("triton", "mosaic",
                                                   "auto"),
                      default="triton")
  parser.add_argument("--variants", nargs="+", metavar="NAME",
                      help="rows to measure (default: all; a row's "
                      "yardstick is measured with it)")
  parser.add_argument("--out", default=None,
                      help="default benchmarks/results/h200_masks[_IMPL].json")
  args = parser.parse_args(argv)
  suffix = "" if args.implementation == "triton" else "_" + args.implementation
  out_path = args.out or f"benchmarks/results/h200_masks{suffix}.json"
  implementation = None if args.implementation == "auto" else (
      args.implementation)
  interpret = not compat.has_gpu()
  shape = (1, args.seq, args.heads, args.head_dim)
  table = variants(args.seq, args.heads)
  if args.variants:
    unknown = set(args.variants) - set(table)
    if unknown:
      parser.error(f"unknown variants {sorted(unknown)}; known: "
                   f"{list(table)}")
    wanted = set(args.variants)
    wanted |= {table[name].against for name in args.variants} - {None}
    table = {name: v for name, v in table.items() if name in wanted}
  rows, skipped = [], []

  def save() -> str:
    """The JSON and table of the rows so far: after every row, so that a
    run cut short by a time limit keeps what it measured."""
    result = {**common.run_header("benchmarks.masks", argv),
              "implementation": args.implementation,
              "records": rows, "skipped": skipped}
    return render.write_results(
        out_path, result,
        ["variant", "mode", "ran", "ms", "dense TFLOP/s", "yardstick",
         "x yardstick"],
        [[r["variant"], r["mode"], r["implementation"], f"{r['ms']:.3f}",
          f"{r['tflops_dense']:.0f}", r["against"] or "",
          "" if r["vs_against"] is None else f"{r['vs_against']:.2f}"]
         for r in rows])

  with common.progress(total=2 * len(table), desc="masks") as bar:
    for mode in ("fwd", "fwd_bwd"):
      times = {}
      for name, variant in table.items():
        if mode == "fwd" and variant.bias_grad:  # another row's forward
          bar.update()
          continue
        fn, inputs = build(mode, shape, variant, interpret, implementation)
        try:
          # Interpreted kernels lower to plain XLA: name the request.
          ran = variant.peer or (args.implementation if interpret
                                 else kernel_ran(fn, inputs))
          ms = common.time_fn(fn, *inputs, warmup=2, reps=args.reps)
        except Exception as e:  # pylint: disable=broad-except
          # a variant this backend lacks, a peer without a GPU or one that
          # refuses the call (cuDNN's dbias has conditions of its own)
          if not (isinstance(e, (NotImplementedError, peers.Unavailable))
                  or variant.peer is not None):
            raise
          skipped.append(dict(variant=name, mode=mode,
                              reason=peers.skip_reason(e)))
          bar.update()
          continue
        times[name] = ms
        yardstick = times.get(variant.against)
        flops = common.attention_flops(1, args.seq, args.seq, args.heads,
                                       args.head_dim, False, mode)
        rows.append(dict(variant=name, mode=mode, implementation=ran,
                         seq_len=args.seq, num_heads=args.heads,
                         head_dim=args.head_dim, ms=ms,
                         tflops_dense=flops / ms / 1e9,
                         against=variant.against,
                         vs_against=yardstick / ms if yardstick else None))
        save()
        bar.update()
  print(save())
  for entry in skipped:
    print(f"skipped {entry['variant']} {entry['mode']}: {entry['reason']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
