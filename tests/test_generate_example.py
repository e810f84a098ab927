"""examples/generate.py at its tiny size on a CPU: the kernels' loop (Pallas
interpret mode) and the XLA loop choose the same tokens, and those are the
model's own greedy tokens computed without a cache."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# Its module-scoped fixtures (a child process, a trained model) are built
# once: every test of the file runs in one xdist worker (pyproject).
pytestmark = pytest.mark.xdist_group("test_generate_example")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / (
    "generate.py")


@pytest.fixture(scope="module")
def generate():
  spec = importlib.util.spec_from_file_location("generate_example", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)  # also imports train_lm beside it
  return module


def test_kernel_and_xla_loops_agree(generate, capsys):
  generate.main(["--preset", "tiny", "--train-steps", "0",
                 "--implementation", "triton", "--repeats", "1",
                 "--show", "1"])
  out = capsys.readouterr().out
  assert "identical tokens: True (20 tokens, 4 sequences)" in out, out
  assert "new tokens/s" in out and "+++ " in out, out


def test_tokens_are_greedy_without_a_cache(generate):
  """Token s of sequence b is the argmax of the model run over its prompt
  and tokens 0 .. s - 1, from scratch: the paged cache (shuffled pages,
  ragged prompts, padding written to the spare page) changes nothing."""
  train_lm = generate.train_lm
  preset = generate.PRESETS["tiny"]
  cfg = train_lm.PRESETS[preset.model]
  corpus = train_lm.CharCorpus()
  prompts, lengths = generate.make_prompts(corpus, preset, seed=0)

  def model(attention):
    return train_lm.LanguageModel(cfg, len(corpus.vocab), attention,
                                  nnx.Rngs(0))

  tokens = generate.generate(
      model(None), cfg, preset, prompts, lengths, implementation="xla",
      name="xla", seed=0, repeats=1)["tokens"]
  reference = model(train_lm.make_attention("flash", "xla"))
  # Right padding after each sequence is harmless under causal attention.
  width = prompts.shape[1] + preset.new_tokens
  rows = np.zeros((len(tokens), width), np.int32)
  for b, length in enumerate(np.asarray(lengths)):
    rows[b, :length] = prompts[b, :length]
    rows[b, length:length + preset.new_tokens] = tokens[b]
  greedy = np.asarray(jnp.argmax(reference(jnp.asarray(rows)), axis=-1))
  for b, length in enumerate(np.asarray(lengths)):
    np.testing.assert_array_equal(
        greedy[b, length - 1:length - 1 + preset.new_tokens], tokens[b])
