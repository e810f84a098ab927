"""Train a small decoder-only language model with FlashAttention (Flax NNX).

A character-level transformer (RoPE, grouped-query attention, pre-norm
RMSNorm, SwiGLU, tied embeddings) on three Shakespeare plays shipped in
`examples/data/`. The attention is one call, so switching it is one flag:

    python examples/train_lm.py                          # jax.jit, jax_flash
    python examples/train_lm.py --attention xla          # jax.nn attention
    python examples/train_lm.py --attention both --plot examples/loss_curve.png
    python examples/train_lm.py --pmap                   # data parallel (pmap)
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python examples/train_lm.py --pmap               # over 4 CPU devices

`--attention flash` calls `jax_flash.flash_attention(..., implementation=I)`
with `--implementation I`: `auto` passes None and lets jax_flash choose (the
Pallas kernels on a GPU; on a CPU, jax_flash's default there); `triton` forces
the kernels, which on a CPU run in Pallas interpret mode (exact, but several
times slower than XLA); `xla` is jax_flash's XLA path. `--attention xla` is
`jax.nn.dot_product_attention(implementation="xla")`, the baseline.

The preset follows the device: `cpu` (0.8M parameters, 300 steps on 2 cores:
about 2 minutes with XLA attention), `gpu` (25M parameters, sequences of 1024,
bfloat16); `tiny` is for tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jax_flash

DATA = pathlib.Path(__file__).parent / "data" / "shakespeare.txt"


@dataclasses.dataclass(frozen=True)
class Config:
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  seq_len: int
  batch_size: int  # global: split across devices with --pmap
  steps: int
  learning_rate: float
  dtype: str = "float32"  # compute dtype; parameters stay float32
  warmup_steps: int = 50
  rope_base: float = 10_000.0

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


PRESETS = {
    "tiny": Config(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   seq_len=32, batch_size=8, steps=20, learning_rate=3e-3,
                   warmup_steps=5),
    "cpu": Config(d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                  seq_len=128, batch_size=32, steps=300, learning_rate=3e-3),
    "gpu": Config(d_model=512, num_layers=8, num_heads=8, num_kv_heads=2,
                  seq_len=1024, batch_size=32, steps=2000, learning_rate=1e-3,
                  dtype="bfloat16", warmup_steps=200),
}


# Data.

class CharCorpus:
  """The text as int32 character ids, split 90/10 into train/validation."""

  def __init__(self, path: pathlib.Path = DATA):
    text = path.read_text(encoding="ascii")
    self.vocab = sorted(set(text))
    ids = np.frombuffer(text.encode("ascii"), np.uint8)
    lookup = np.zeros(128, np.int32)
    lookup[[ord(c) for c in self.vocab]] = np.arange(len(self.vocab))
    ids = lookup[ids]
    split = int(0.9 * len(ids))
    self.train, self.valid = ids[:split], ids[split:]

  def batches(self, split: str, batch_size: int, length: int, seed: int):
    """Endless random windows [batch_size, length + 1] (inputs and targets)."""
    ids = self.train if split == "train" else self.valid
    rng = np.random.default_rng(seed)
    offsets = np.arange(length + 1)
    while True:
      starts = rng.integers(0, len(ids) - length - 1, batch_size)
      yield ids[starts[:, None] + offsets]


# Model.

def rope(x, positions, base: float):
  """Rotary position embedding (Su et al. 2021) on [batch, len, heads, dim];
  positions [len] or [batch, len]."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[..., None].astype(jnp.float32) * freq  # [..., len, half]
  cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return rotated.astype(x.dtype)


def make_attention(kind: str, implementation: str | None):
  """`(q, k, v) -> out`, causal, [batch, len, heads, head_dim] (GQA k/v)."""
  if kind == "flash":
    return functools.partial(jax_flash.flash_attention, is_causal=True,
                             implementation=implementation)
  return functools.partial(jax.nn.dot_product_attention, is_causal=True,
                           implementation="xla")


class Attention(nnx.Module):
  def __init__(self, cfg: Config, attention, rngs: nnx.Rngs):
    dense = functools.partial(nnx.LinearGeneral, cfg.d_model, use_bias=False,
                              dtype=cfg.dtype, rngs=rngs)
    self.query = dense((cfg.num_heads, cfg.head_dim))
    self.key = dense((cfg.num_kv_heads, cfg.head_dim))
    self.value = dense((cfg.num_kv_heads, cfg.head_dim))
    self.out = nnx.LinearGeneral((cfg.num_heads, cfg.head_dim), cfg.d_model,
                                 axis=(-2, -1), use_bias=False,
                                 dtype=cfg.dtype, rngs=rngs)
    self.attention = attention
    self.rope_base = cfg.rope_base

  def __call__(self, x, positions=None):
    """x [batch, len, d_model]; positions int [batch, len] (generate.py's
    decoding steps), default 0 .. len - 1."""
    if positions is None:
      positions = jnp.arange(x.shape[1])
    q = rope(self.query(x), positions, self.rope_base)
    k = rope(self.key(x), positions, self.rope_base)
    return self.out(self.attention(q, k, self.value(x)))


class Block(nnx.Module):
  """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: Config, attention, rngs: nnx.Rngs):
    self.attention_norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.attention = Attention(cfg, attention, rngs)
    self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    hidden = 8 * cfg.d_model // 3  # SwiGLU at the FLOPs of a 4x MLP
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype,
                               rngs=rngs)
    self.gate = linear(cfg.d_model, hidden)
    self.up = linear(cfg.d_model, hidden)
    self.down = linear(hidden, cfg.d_model)

  def __call__(self, x, positions=None):
    x = x + self.attention(self.attention_norm(x), positions)
    h = self.mlp_norm(x)
    return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class LanguageModel(nnx.Module):
  def __init__(self, cfg: Config, vocab_size: int, attention,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab_size, cfg.d_model, dtype=cfg.dtype,
                           rngs=rngs)
    self.blocks = nnx.List([Block(cfg, attention, rngs)
                            for _ in range(cfg.num_layers)])
    self.norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, tokens, positions=None):
    """tokens int32 [batch, len] -> logits float32 [batch, len, vocab];
    positions int [batch, len], default 0 .. len - 1."""
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, positions)
    return self.embed.attend(self.norm(x)).astype(jnp.float32)


# Training.

def make_train_step(graphdef, optimizer, axis_name: str | None):
  """(params, opt_state, batch) -> (params, opt_state, loss).

  With `axis_name`, gradients and loss are averaged across the pmap axis, so
  every device applies the same update (data parallelism).
  """
  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 1:]).mean()

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    if axis_name is not None:
      loss, grads = jax.lax.pmean((loss, grads), axis_name)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return loss_fn, train_step


def train(cfg: Config, corpus: CharCorpus, *, attention: str,
          implementation: str | None, use_pmap: bool, seed: int,
          log_every: int) -> dict:
  """Trains one model; returns its losses, timing and parameters.

  The initial parameters and the batches depend on `seed` only, so runs
  with different attention (or with and without pmap) see the same data.
  """
  model = LanguageModel(cfg, len(corpus.vocab),
                        make_attention(attention, implementation),
                        nnx.Rngs(seed))
  graphdef, params = nnx.split(model)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, min(cfg.warmup_steps, cfg.steps // 2),
      cfg.steps)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, b2=0.95, weight_decay=0.1))
  opt_state = optimizer.init(params)
  loss_fn, train_step = make_train_step(
      graphdef, optimizer, "data" if use_pmap else None)
  devices = jax.local_devices()

  if use_pmap:
    if cfg.batch_size % len(devices):
      raise ValueError(f"batch size {cfg.batch_size} does not split over "
                       f"{len(devices)} devices")
    step_fn = jax.pmap(train_step, axis_name="data", donate_argnums=(0, 1))

    def replicate(tree):
      return jax.tree.map(lambda x: jnp.broadcast_to(x, (len(devices),)
                                                     + x.shape), tree)

    params, opt_state = replicate(params), replicate(opt_state)

    def shard(batch):  # [batch, len] -> [devices, batch / devices, len]
      return batch.reshape(len(devices), -1, batch.shape[-1])
  else:
    step_fn = jax.jit(train_step, donate_argnums=(0, 1))

    def shard(batch):
      return batch

  name = f"{attention}{' (pmap)' if use_pmap else ''}"
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model,
                                                           nnx.Param)))
  tqdm.write(f"[{name}] {n_params / 1e6:.2f}M parameters, "
             f"{len(devices) if use_pmap else 1} device(s), {cfg}")
  batches = corpus.batches("train", cfg.batch_size, cfg.seq_len, seed)
  losses = []
  start = time.perf_counter()
  progress = tqdm(range(cfg.steps), desc=name, unit="step", leave=False)
  for step in progress:
    params, opt_state, loss = step_fn(params, opt_state,
                                      shard(next(batches)))
    if step == 0:
      start = time.perf_counter()  # exclude compilation
    losses.append(loss)
    if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
      value = float(np.mean(np.asarray(loss)))
      progress.set_postfix(loss=f"{value:.4f}")
      tqdm.write(f"[{name}] step {step + 1:5d}  loss {value:.4f}")
  losses = [float(np.mean(np.asarray(x))) for x in losses]
  steps_per_s = (cfg.steps - 1) / max(time.perf_counter() - start, 1e-9)

  if use_pmap:
    params = jax.tree.map(lambda x: x[0], params)
  valid = corpus.batches("valid", cfg.batch_size, cfg.seq_len, seed + 1)
  eval_loss = jax.jit(loss_fn)
  valid_loss = float(np.mean([eval_loss(params, next(valid))
                              for _ in range(4)]))
  tqdm.write(f"[{name}] final train loss {losses[-1]:.4f}  valid loss "
             f"{valid_loss:.4f}  {steps_per_s:.2f} steps/s")
  return {"name": name, "losses": losses, "valid_loss": valid_loss,
          "steps_per_s": steps_per_s, "params": params}


def plot(runs: list[dict], path: pathlib.Path, title: str) -> None:
  """Loss curves, and with two runs their difference, to `path`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  pairs = len(runs) == 2
  fig, axes = plt.subplots(2 if pairs else 1, 1, sharex=True,
                           figsize=(7, 6 if pairs else 4),
                           height_ratios=[3, 1] if pairs else None,
                           squeeze=False)
  for run in runs:
    axes[0, 0].plot(np.arange(1, len(run["losses"]) + 1), run["losses"],
                    label=f"{run['name']} (valid {run['valid_loss']:.3f})",
                    linewidth=1)
  axes[0, 0].set_ylabel("training loss (nats/char)")
  axes[0, 0].set_title(title, fontsize=8)
  axes[0, 0].legend()
  if pairs:
    diff = np.subtract(runs[1]["losses"], runs[0]["losses"])
    axes[1, 0].plot(np.arange(1, len(diff) + 1), diff, color="gray",
                    linewidth=1)
    axes[1, 0].axhline(0.0, color="black", linewidth=0.5)
    axes[1, 0].set_ylabel(f"{runs[1]['name']} - {runs[0]['name']}",
                          fontsize=8)
  axes[-1, 0].set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=sorted(PRESETS),
                      help="default: gpu on a GPU, else cpu")
  parser.add_argument("--attention", choices=("flash", "xla", "both"),
                      default="flash")
  parser.add_argument("--implementation", default="auto",
                      choices=("auto", "mosaic", "triton", "xla"),
                      help="jax_flash backend for --attention flash")
  parser.add_argument("--pmap", action="store_true",
                      help="data parallel over all local devices")
  parser.add_argument("--steps", type=int)
  parser.add_argument("--batch-size", type=int)
  parser.add_argument("--seq-len", type=int)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=25)
  parser.add_argument("--plot", type=pathlib.Path,
                      help="write the loss curve(s) to this image")
  args = parser.parse_args(argv)

  preset = args.preset or ("gpu" if jax.default_backend() == "gpu"
                           else "cpu")
  overrides = {k: v for k, v in (("steps", args.steps),
                                 ("batch_size", args.batch_size),
                                 ("seq_len", args.seq_len)) if v is not None}
  cfg = dataclasses.replace(PRESETS[preset], **overrides)
  implementation = None if args.implementation == "auto" else (
      args.implementation)
  kinds = ("xla", "flash") if args.attention == "both" else (args.attention,)
  corpus = CharCorpus()
  runs = [train(cfg, corpus, attention=kind, implementation=implementation,
                use_pmap=args.pmap, seed=args.seed, log_every=args.log_every)
          for kind in kinds]
  if args.plot:
    device = jax.devices()[0].device_kind
    plot(runs, args.plot,
         f"{preset} preset: {cfg.num_layers} layers, d={cfg.d_model}, "
         f"{cfg.num_heads}:{cfg.num_kv_heads} heads, seq {cfg.seq_len}, "
         f"batch {cfg.batch_size}, {cfg.dtype}, {device}"
         f"{', pmap' if args.pmap else ''}\nxla = jax.nn.dot_product_attention"
         f"(implementation='xla')\nflash = jax_flash.flash_attention"
         f"(implementation={implementation!r})")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
