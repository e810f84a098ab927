"""What masks save and what score changes cost, on one long sequence.

    python -m benchmarks.masks          # -> benchmarks/results/h200_masks.{json,md}

bf16, batch 1, 16 heads, head_dim 128, seq 16k (`--seq`), forward and
forward+backward of `jax_flash.flash_attention` (Triton kernels, or with
`--implementation mosaic` the Mosaic ones; rows they do not cover are left
out). Masks are
judged by their speed-up over full attention (the work they let the kernels
skip); score changes (soft cap, ALiBi, dropout) by their overhead over plain
attention. TFLOP/s use the dense count 4·B·T²·N·D (x3.5 for fwd+bwd) for every
row, so they compare time, not useful work.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks import common, render
from pallas_kernels import compat


def variants(seq: int, num_heads: int) -> dict[str, dict]:
  """The measured calls' keyword arguments, by row name."""
  documents = jnp.repeat(jnp.arange(16, dtype=jnp.int32), seq // 16)[None]
  return {
      "full": {},
      "causal": dict(is_causal=True),
      "sliding window 1k (causal)": dict(is_causal=True,
                                         local_window_size=(1024, 0)),
      "16 documents (segment ids)": dict(segment_ids=documents),
      "softcap 30": dict(logits_soft_cap=30.0),
      "alibi": dict(alibi_slopes=2.0 ** -jnp.arange(1, num_heads + 1,
                                                    dtype=jnp.float32)),
      "dropout 0.1": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
  }


def build(mode: str, shape, kwargs, interpret: bool,
          implementation: str = "triton"):
  q, k, v, d_out = common.attention_inputs(shape, jnp.bfloat16)

  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, implementation=implementation,
                                     interpret=interpret, **kwargs)

  if mode == "fwd":
    return jax.jit(attention), (q, k, v)
  loss = lambda q, k, v, d: jnp.sum(attention(q, k, v).astype(jnp.float32)
                                    * d.astype(jnp.float32))
  return jax.jit(jax.grad(loss, (0, 1, 2))), (q, k, v, d_out)


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--implementation", choices=("triton", "mosaic"),
                      default="triton")
  parser.add_argument("--out", default=None,
                      help="default benchmarks/results/h200_masks[_mosaic].json")
  args = parser.parse_args(argv)
  suffix = "" if args.implementation == "triton" else "_" + args.implementation
  out_path = args.out or f"benchmarks/results/h200_masks{suffix}.json"
  interpret = not compat.has_gpu()
  shape = (1, args.seq, args.heads, args.head_dim)
  rows = []
  table = variants(args.seq, args.heads)
  with common.progress(total=2 * len(table), desc="masks") as bar:
    for mode in ("fwd", "fwd_bwd"):
      base_ms = None
      for name, kwargs in table.items():
        fn, inputs = build(mode, shape, kwargs, interpret,
                           args.implementation)
        try:
          ms = common.time_fn(fn, *inputs, warmup=2, reps=args.reps)
        except NotImplementedError as e:  # a variant this backend lacks
          print(f"{name} {mode}: skipped ({e})")
          bar.update()
          continue
        base_ms = base_ms or ms
        flops = common.attention_flops(1, args.seq, args.seq, args.heads,
                                       args.head_dim, False, mode)
        rows.append(dict(variant=name, mode=mode, seq_len=args.seq,
                         num_heads=args.heads, head_dim=args.head_dim,
                         ms=ms, tflops_dense=flops / ms / 1e9,
                         speedup_vs_full=base_ms / ms))
        bar.update()
  result = {**common.run_header("benchmarks.masks", argv),
            "implementation": args.implementation,
            "records": rows}
  text = render.write_results(
      out_path, result, ["variant", "mode", "ms", "dense TFLOP/s", "x full"],
      [[r["variant"], r["mode"], f"{r['ms']:.3f}", f"{r['tflops_dense']:.0f}",
        f"{r['speedup_vs_full']:.2f}"] for r in rows])
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
