"""Key padding as a bool mask [batch, 1, 1, kv_len] (jax.nn's form) and as
an additive bias of that shape (Flax BERT's), against the routes before.

    python -m benchmarks.diagnostics.key_padding_mask \
        --out benchmarks/results/h100_key_padding_mask.json

`flash_attention(q, k, v, mask=keys)` now runs such a mask as segment ids
(`validation._vector_mask_as_segments`), on the Mosaic kernels for 16-bit
inputs on sm90; the same mask given for every head, [batch, heads, 1,
kv_len], is not converted and takes the route every such call took before
(the Triton kernels' dense mask: the Mosaic kernels stream only [q_len,
kv_len] mask tiles). A bias per key (0 or -1e4, bf16) runs on the masked
Mosaic kernels from a tile's extent of repeated rows
(`common.repeat_broadcast_axes`), against the Triton kernels, which it
took before. Forward and fwd+bwd, bf16, lengths drawn per
sequence between half and all of seq_len; TFLOP/s count the dense
4·B·T²·N·D (x3.5 for fwd+bwd), not the attended pairs.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks import common
from jax_flash import timing

# (name, batch, seq_len, heads, kv_heads, head_dim, causal)
SHAPES = (
    ("BERT large 512", 64, 512, 16, 16, 64, False),
    ("encoder d128 2k", 8, 2048, 16, 16, 128, False),
    ("Llama 3 8B 4k, causal", 2, 4096, 32, 8, 128, True),
)


def measure(name, batch, seq, heads, kv_heads, head_dim, causal) -> list:
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim),
                            jnp.bfloat16) for key in keys[1:3])
  lengths = jax.random.randint(keys[3], (batch,), seq // 2, seq + 1)
  keep = jnp.arange(seq)[None, :] < lengths[:, None]
  key_bias = jnp.where(keep, 0.0, -1e4).astype(jnp.bfloat16)[:, None, None]
  routes = {"mask as segment ids": dict(mask=keep[:, None, None, :]),
            "mask per head (before)": dict(mask=jnp.broadcast_to(
                keep[:, None, None, :], (batch, heads, 1, seq))),
            "bias per key": dict(bias=key_bias),
            "bias per key, Triton (before)": dict(
                bias=key_bias, implementation="triton")}
  records = []
  for route, kwargs in routes.items():
    attend = lambda q, k, v, kwargs=kwargs: jax_flash.flash_attention(
        q, k, v, is_causal=causal, **kwargs)
    loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
    for mode, fn in (("fwd", jax.jit(attend)),
                     ("fwd_bwd", jax.jit(jax.grad(loss, argnums=(0, 1, 2))))):
      ms = timing.time_fn(fn, q, k, v)
      flops = common.attention_flops(batch, seq, seq, heads, head_dim,
                                     causal, mode)
      records.append(dict(shape=name, route=route, mode=mode, ms=ms,
                          tflops=flops / ms / 1e9))
      print(f"{name:24} {route:26} {mode:8} {ms:8.3f} ms "
            f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
  return records


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  result = {**common.run_header("benchmarks.diagnostics.key_padding_mask",
                                argv), "records": []}
  for shape in SHAPES:
    result["records"] += measure(*shape)
  if args.out:
    common.write_json(args.out, result)
    rows = ["| shape | route | mode | ms | TFLOP/s |", "|---|---|---|---|---|"]
    rows += [f"| {r['shape']} | {r['route']} | {r['mode']} | {r['ms']:.3f} "
             f"| {r['tflops']:.1f} |" for r in result["records"]]
    with open(args.out.removesuffix(".json") + ".md", "w") as f:
      f.write(f"# Key padding: mask and bias routes\n\n"
              f"Device: {result['device']}; JAX {result['jax_version']}.\n\n"
              f"Command: `{result['command']}`\n\n" + "\n".join(rows) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
