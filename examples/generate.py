"""Batched generation with train_lm.py's model over a paged KV cache.

Prompts of different lengths (windows of the validation text) go in one
right-padded batch. Prefill runs the model over them with
`jax_flash.flash_attention` and writes every layer's keys and values into a
paged KV cache (`jax_flash.write_kv_cache`); then each step feeds every
sequence its last token, appends its keys and values, and attends with
`jax_flash.decode_attention`, several steps per compiled call
(`lax.scan`). The same greedy loop runs twice: with
jax_flash's kernels (`--implementation`, default None: the best available)
and with jax_flash's XLA path (implementation="xla"); it prints tokens/s of
each, whether they chose the same tokens, and a few continuations:

    python examples/generate.py                   # preset by device
    python examples/generate.py --preset tiny --train-steps 0 \\
        --implementation triton                   # seconds on a CPU (interpret)

The parameters come from training train_lm.py's model first for
`--train-steps` (0: random initialisation, which still times the loops but
generates noise). Presets: `gpu` is train_lm's gpu model (25M parameters,
bfloat16) with 64 prompts of 128 to 768 characters and 256 new ones; `cpu`
its cpu model with 8 prompts of 32 to 96 and 64 new; `tiny` is for tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import train_lm  # noqa: E402  (the example next to this one)

import jax_flash  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Preset:
  model: str  # train_lm.PRESETS key
  batch: int
  min_prompt: int  # prompt lengths are drawn from [min_prompt, max_prompt]
  max_prompt: int
  new_tokens: int
  page_size: int
  train_steps: int


PRESETS = {
    # Some prompt + new tokens end pages before the longest prompt: the
    # prefill's padding reaches the spare page.
    "tiny": Preset("tiny", batch=4, min_prompt=2, max_prompt=12,
                   new_tokens=5, page_size=2, train_steps=0),
    "cpu": Preset("cpu", batch=8, min_prompt=32, max_prompt=96,
                  new_tokens=64, page_size=16, train_steps=100),
    "gpu": Preset("gpu", batch=64, min_prompt=128, max_prompt=768,
                  new_tokens=256, page_size=64, train_steps=200),
}


class PageTable(nnx.Module):
  """What every layer's cache shares: where each sequence's tokens live.

  Attributes:
    block_tables: int32 [batch, pages_per_seq]: token t of sequence b is in
      page block_tables[b, t // page_size], row t % page_size.
    starts: int32 [batch]: tokens cached per sequence before this call.
    prefill: whether this call is the prompts' (static).
  """

  def __init__(self, block_tables):
    self.block_tables = nnx.Cache(block_tables)
    self.starts = nnx.Cache(jnp.zeros(block_tables.shape[:1], jnp.int32))
    self.prefill = False


class PagedAttention(nnx.Module):
  """One layer's attention on its pages of the cache, as train_lm's
  `(q, k, v) -> out` (q [batch, len, heads, dim], k/v [batch, len,
  kv_heads, dim]): the new keys and values are written at each sequence's
  next positions; the prompts attend to themselves with flash_attention
  (the cache is empty before them), a decoding step to the cache with
  decode_attention."""

  def __init__(self, table: PageTable, num_pages: int, page_size: int,
               cfg: train_lm.Config, implementation: str | None):
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    self.key_pages = nnx.Cache(jnp.zeros(shape, cfg.dtype))
    self.value_pages = nnx.Cache(jnp.zeros(shape, cfg.dtype))
    self.table = table
    self.implementation = implementation

  def __call__(self, q, k, v):
    starts, tables = self.table.starts[...], self.table.block_tables[...]
    keys, values = jax_flash.write_kv_cache(
        self.key_pages[...], self.value_pages[...], k, v, starts,
        block_tables=tables)
    self.key_pages[...], self.value_pages[...] = keys, values
    if self.table.prefill:
      # Right padding is harmless: causal rows never see the rows after them.
      return jax_flash.flash_attention(q, k, v, is_causal=True,
                                       implementation=self.implementation)
    return jax_flash.decode_attention(q, keys, values, starts + q.shape[1],
                                      block_tables=tables,
                                      implementation=self.implementation)


class Generator(nnx.Module):
  """train_lm's model with every layer's attention on a paged KV cache."""

  def __init__(self, model: train_lm.LanguageModel, cfg: train_lm.Config,
               block_tables, num_pages: int, page_size: int,
               implementation: str | None):
    self.model = model
    self.table = PageTable(block_tables)
    for block in model.blocks:
      # train_lm's attention is a function (static); this one holds state.
      block.attention.attention = nnx.data(PagedAttention(
          self.table, num_pages, page_size, cfg, implementation))

  def __call__(self, tokens, starts, last, *, prefill: bool):
    """Appends `tokens` int32 [batch, len] after `starts` int32 [batch]
    cached tokens; returns the greedy next token after position `last`
    [batch] of the call, int32 [batch]."""
    self.table.starts[...] = starts
    self.table.prefill = prefill
    positions = starts[:, None] + jnp.arange(tokens.shape[1])
    logits = self.model(tokens, positions)
    logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def allocate_pages(needed, page_size: int, seed: int):
  """Block tables giving sequence b ceil(needed[b] / page_size) pages of a
  shuffled pool, as a serving engine's allocator would: no sequence holds
  more than it needs. The last page is a spare that every unallocated
  entry names: the prefill writes each sequence's padding up to the
  longest prompt, and for a short prompt that lands there, past its length.

  Returns:
    (block_tables int32 [batch, max pages], num_pages).
  """
  pages = -(-np.asarray(needed) // page_size)
  num_pages = int(pages.sum()) + 1
  pool = np.random.default_rng(seed).permutation(num_pages - 1)
  tables = np.full((len(pages), pages.max()), num_pages - 1, np.int32)
  for b, (start, count) in enumerate(zip(np.cumsum(pages) - pages, pages)):
    tables[b, :count] = pool[start:start + count]
  return jnp.asarray(tables), num_pages


def make_prompts(corpus: train_lm.CharCorpus, preset: Preset, seed: int):
  """Windows of the validation text: (right-padded int32 [batch,
  max_prompt], lengths int32 [batch])."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(preset.min_prompt, preset.max_prompt + 1,
                         preset.batch)
  starts = rng.integers(0, len(corpus.valid) - preset.max_prompt,
                        preset.batch)
  prompts = np.zeros((preset.batch, lengths.max()), np.int32)
  for b, (start, length) in enumerate(zip(starts, lengths)):
    prompts[b, :length] = corpus.valid[start:start + length]
  return jnp.asarray(prompts), jnp.asarray(lengths, jnp.int32)


def chunk_length(steps: int, most: int = 64) -> int:
  """The largest divisor of `steps` up to `most`: steps per compiled chunk
  of the decoding loop, so that every chunk is the same program."""
  return max(n for n in range(1, min(steps, most) + 1) if steps % n == 0)


def compile_loop(model, cfg: train_lm.Config, preset: Preset, prompts,
                 lengths, *, implementation: str | None, seed: int):
  """The generation loop's two compiled programs and their inputs.

  Decoding steps run `chunk_length(new_tokens - 1)` at a time in one
  program (a `lax.scan`): one step of this small model is ~160 kernels of a
  few µs each, so dispatching steps one by one from Python would time the
  host, not the GPU.

  Returns:
    (prefill, decode, params, empty_cache): `prefill(params, cache,
    prompts, lengths)` returns (each prompt's greedy next token int32
    [batch], cache); `decode(params, cache, token [batch], starts [batch])`
    returns (tokens int32 [batch, chunk], cache): the chunk's greedy tokens
    after `token`, which sits at position `starts` of each sequence. Both
    donate the cache; `empty_cache` is the paged cache before the prompts.
  """
  tables, num_pages = allocate_pages(lengths + preset.new_tokens,
                                     preset.page_size, seed)
  generator = Generator(model, cfg, tables, num_pages, preset.page_size,
                        implementation)
  graphdef, params, empty_cache = nnx.split(generator, nnx.Param, nnx.Cache)
  chunk = chunk_length(preset.new_tokens - 1)

  def forward(params, cache, tokens, starts, last, prefill):
    generator = nnx.merge(graphdef, params, cache)
    next_token = generator(tokens, starts, last, prefill=prefill)
    return next_token, nnx.state(generator, nnx.Cache)

  @functools.partial(jax.jit, donate_argnums=1)
  def prefill(params, cache, prompts, lengths):
    return forward(params, cache, prompts, jnp.zeros_like(lengths),
                   lengths - 1, prefill=True)

  @functools.partial(jax.jit, donate_argnums=1)
  def decode(params, cache, token, starts):
    def step(carry, _):
      cache, token, starts = carry
      token, cache = forward(params, cache, token[:, None], starts,
                             jnp.zeros_like(starts), prefill=False)
      return (cache, token, starts + 1), token
    (cache, _, _), tokens = jax.lax.scan(step, (cache, token, starts),
                                         length=chunk)
    return tokens.T, cache

  return (prefill.lower(params, empty_cache, prompts, lengths).compile(),
          decode.lower(params, empty_cache, lengths, lengths).compile(),
          params, empty_cache)


def generate(model, cfg: train_lm.Config, preset: Preset, prompts, lengths,
             *, implementation: str | None, name: str, seed: int,
             repeats: int) -> dict:
  """Greedy generation of `preset.new_tokens` per prompt, `repeats` times
  from an empty cache (the first run also warms up what compilation does
  not: memory pools, kernel loading).

  Returns:
    {"tokens": int32 [batch, new_tokens], "prefill_s", "decode_s",
    "tokens_per_s"}: the fastest run's times, without compilation.
  """
  prefill, decode, params, empty_cache = compile_loop(
      model, cfg, preset, prompts, lengths, implementation=implementation,
      seed=seed)
  batch = prompts.shape[0]
  chunk = chunk_length(preset.new_tokens - 1)
  runs = []
  for run in range(repeats):
    cache = jax.tree.map(jnp.copy, empty_cache)  # each call donates it
    start = time.perf_counter()
    token, cache = prefill(params, cache, prompts, lengths)
    token.block_until_ready()
    prefill_s = time.perf_counter() - start
    tokens, starts = [token[:, None]], lengths
    start = time.perf_counter()
    # Chunks are dispatched without waiting for each other: the bar follows
    # dispatch, and the time stops when the last token is ready.
    for _ in tqdm(range((preset.new_tokens - 1) // chunk), unit="chunk",
                  leave=False, desc=f"{name} {run + 1}/{repeats}"):
      chunk_tokens, cache = decode(params, cache, tokens[-1][:, -1], starts)
      tokens.append(chunk_tokens)
      starts = starts + chunk
    tokens = np.asarray(jnp.concatenate(tokens, axis=1))
    runs.append((prefill_s, time.perf_counter() - start, tokens))
  prefill_s = min(r[0] for r in runs)
  decode_s = min(r[1] for r in runs)
  result = {"tokens": runs[0][2], "prefill_s": prefill_s,
            "decode_s": decode_s,
            "tokens_per_s": runs[0][2].size / (prefill_s + decode_s)}
  tqdm.write(
      f"[{name}] prefill {batch} prompts ({int(lengths.sum())} tokens) "
      f"{prefill_s * 1e3:.1f} ms; decode {decode_s * 1e3:.1f} ms "
      f"({batch * (preset.new_tokens - 1) / decode_s:,.0f} tokens/s, "
      f"{chunk} steps a call); overall {result['tokens_per_s']:,.0f} new "
      "tokens/s")
  return result


def compare(flash: dict, xla: dict) -> None:
  """Prints the speed ratio and whether both loops chose the same tokens."""
  same = flash["tokens"] == xla["tokens"]
  speedup = flash["tokens_per_s"] / xla["tokens_per_s"]
  print(f"speed: jax_flash {flash['tokens_per_s']:,.0f} new tokens/s, xla "
        f"{xla['tokens_per_s']:,.0f} ({speedup:.2f}x); decoding alone "
        f"{xla['decode_s'] / flash['decode_s']:.2f}x")
  if same.all():
    print(f"identical tokens: True ({same.size} tokens, {len(same)} "
          "sequences)")
    return
  # Greedy choices differ where two logits tie within rounding (bfloat16),
  # and the sequence then continues from a different token.
  differing = np.flatnonzero(~same.all(axis=1))
  first = [int(np.argmin(same[b])) for b in differing]
  print(f"identical tokens: False ({len(differing)} of {len(same)} sequences"
        f" differ, first at steps {sorted(first)[:8]})")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=sorted(PRESETS),
                      help="default: gpu on a GPU, else cpu")
  parser.add_argument("--implementation", default="auto",
                      choices=("auto", "mosaic", "triton", "xla"),
                      help="jax_flash backend of the first loop (auto: "
                      "None, the best available; triton on a CPU runs the "
                      "kernels in interpret mode)")
  parser.add_argument("--train-steps", type=int,
                      help="train train_lm's model first (0: random init)")
  parser.add_argument("--batch", type=int)
  parser.add_argument("--new-tokens", type=int)
  parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                      help="compute dtype (and the cache's)")
  parser.add_argument("--repeats", type=int, default=2,
                      help="runs of each loop; the fastest is reported")
  parser.add_argument("--show", type=int, default=3,
                      help="continuations to print")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  preset = PRESETS[args.preset or ("gpu" if jax.default_backend() == "gpu"
                                   else "cpu")]
  preset = dataclasses.replace(preset, **{
      k: v for k, v in (("batch", args.batch),
                        ("new_tokens", args.new_tokens),
                        ("train_steps", args.train_steps)) if v is not None})
  cfg = train_lm.PRESETS[preset.model]
  if args.dtype:
    cfg = dataclasses.replace(cfg, dtype=args.dtype)
  implementation = None if args.implementation == "auto" else (
      args.implementation)
  corpus = train_lm.CharCorpus()
  params = None
  if preset.train_steps:
    params = train_lm.train(
        dataclasses.replace(cfg, steps=preset.train_steps), corpus,
        attention="flash", implementation=None, use_pmap=False,
        seed=args.seed, log_every=max(preset.train_steps // 4, 1))["params"]

  def model():  # a fresh one per loop: each gets its own cache
    lm = train_lm.LanguageModel(cfg, len(corpus.vocab), None,
                                nnx.Rngs(args.seed))
    if params is not None:
      nnx.update(lm, params)
    return lm

  prompts, lengths = make_prompts(corpus, preset, args.seed)
  print(f"{preset}\n{cfg}\n{jax.devices()[0].device_kind}: {preset.batch} "
        f"prompts of {int(lengths.min())}..{int(lengths.max())} characters,"
        f" {preset.new_tokens} new each, pages of {preset.page_size}")
  runs = [generate(model(), cfg, preset, prompts, lengths,
                   implementation=impl, name=name, seed=args.seed,
                   repeats=args.repeats)
          for impl, name in ((implementation,
                              f"jax_flash ({args.implementation})"),
                             ("xla", "xla"))]
  compare(*runs)
  text = lambda ids: "".join(corpus.vocab[i] for i in ids)
  for b in range(min(args.show, preset.batch)):
    prompt = text(np.asarray(prompts[b, :lengths[b]]))[-60:]
    print(f"--- {b}: ...{prompt!r}\n+++ {text(runs[0]['tokens'][b])!r}")


if __name__ == "__main__":
  main()
