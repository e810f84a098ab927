"""Bad input gets a clear error naming the argument and the shapes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import BlockSizes


def _qkv(q_shape=(2, 8, 4, 16), kv_shape=(2, 8, 2, 16), dtype=jnp.float32):
  return (jnp.ones(q_shape, dtype), jnp.ones(kv_shape, dtype),
          jnp.ones(kv_shape, dtype))


@pytest.mark.parametrize("fn", [jax_flash.flash_attention,
                                jax_flash.attention_reference])
@pytest.mark.parametrize("q_shape, kv_shape, match", [
    ((2, 8, 4, 16), (2, 8, 2, 32), r"same head_dim.*query \(2, 8, 4, 16\)"),
    ((2, 8, 4, 16), (3, 8, 2, 16), r"same batch size"),
    ((2, 8, 4, 16), (2, 8, 3, 16), r"num_heads \(4\) must be divisible by"
                                   r" num_kv_heads \(3\)"),
    # An unbatched query is a batch of one (as jax.nn), here against 2.
    ((8, 4, 16), (2, 8, 2, 16), r"same batch size.*query \(1, 8, 4, 16\)"
                                r".*as given: query \(8, 4, 16\)"),
    ((2, 8, 4, 16), (2, 8, 2, 16, 1), r"key must have rank 4.*or 3"),
    ((4, 16), (8, 2, 16), r"query must have rank 4.*\(4, 16\) \(rank 2\)"),
])
def test_shape_errors(fn, q_shape, kv_shape, match):
  q, k, v = _qkv(q_shape, kv_shape)
  with pytest.raises(ValueError, match=match):
    fn(q, k, v)


def test_key_value_mismatch():
  q, k, _ = _qkv()
  v = jnp.ones((2, 9, 2, 16))
  with pytest.raises(ValueError, match=r"key and value must have the same shape"):
    jax_flash.flash_attention(q, k, v)


def test_integer_dtype():
  q, k, v = _qkv(dtype=jnp.int32)
  with pytest.raises(TypeError, match=r"query must be float16, bfloat16 or"
                                      r" float32, got int32"):
    jax_flash.flash_attention(q, k, v)


def test_mixed_dtypes():
  q, k, v = _qkv()
  with pytest.raises(TypeError, match=r"same dtype.*bfloat16"):
    jax_flash.flash_attention(q, k.astype(jnp.bfloat16), v)


def test_bad_implementation_and_arguments():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"implementation must be one of"):
    jax_flash.flash_attention(q, k, v, implementation="cuda")
  with pytest.raises(TypeError, match=r"block_sizes must be a BlockSizes"):
    jax_flash.flash_attention(q, k, v, block_sizes={"block_q": 64})
  with pytest.raises(TypeError, match=r"is_causal must be a bool"):
    jax_flash.flash_attention(q, k, v, is_causal="yes")
  with pytest.raises(ValueError, match=r"scale must be finite"):
    jax_flash.flash_attention(q, k, v, scale=float("inf"))
  for bad in ("half", [0.5]):  # float() raises ValueError / TypeError
    with pytest.raises(TypeError, match=r"scale must be a Python number"):
      jax_flash.flash_attention(q, k, v, scale=bad)


def test_dropout_arguments():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"dropout_rate must be a number in \[0, 1\)"):
    jax_flash.flash_attention(q, k, v, dropout_rate=1.5)
  with pytest.raises(ValueError, match=r"needs a dropout_rng"):
    jax_flash.flash_attention(q, k, v, dropout_rate=0.1)
  # Rates are steps of 1/256: one that rounds to none or all is refused.
  for rate, levels in ((0.001, 0), (0.999, 256)):
    with pytest.raises(ValueError, match=rf"rounds to {levels}/256"):
      jax_flash.flash_attention(q, k, v, dropout_rate=rate,
                                dropout_rng=jax.random.key(0))


@pytest.mark.parametrize("field, value, error", [
    ("block_q", 48, ValueError), ("block_k", 8, ValueError),
    ("num_warps", 3, ValueError), ("num_stages", 0, ValueError),
    ("block_q", 64.0, TypeError),
])
def test_block_sizes_validation(field, value, error):
  with pytest.raises(error, match=field):
    BlockSizes(**{field: value})


def test_block_sizes_hashable_and_frozen():
  a, b = BlockSizes(block_q=128), BlockSizes(block_q=128)
  assert hash(a) == hash(b) and a == b
  with pytest.raises(Exception):
    a.block_q = 64  # type: ignore[misc]


@pytest.mark.parametrize("name", ["mask_fn", "score_fn"])
def test_functions_closing_over_arrays_fall_back_to_xla(name):
  """A mask_fn or score_fn that closes over an array (document ids per
  position, slopes per head: Pallas kernels cannot capture constants):
  a forced kernel refuses it with a NotImplementedError naming the
  argument and what to pass instead; implementation=None takes XLA, whose
  result it is."""
  q, k, v = _qkv((1, 16, 2, 16), (1, 16, 2, 16))
  q = q * jnp.arange(16.0)[None, :, None, None] / 16
  doc = jnp.array([0] * 8 + [1] * 8)
  slopes = jnp.array([0.1, 0.2])
  kwargs = {"mask_fn": dict(mask_fn=lambda b, h, i, j: doc[i] == doc[j]),
            "score_fn": dict(score_fn=lambda s, b, h, i, j:
                             s - slopes[h] * jnp.abs(i - j))}[name]
  with pytest.raises(NotImplementedError, match=f"{name} closes over arrays"
                     r".*segment_ids.*alibi_slopes"):
    jax_flash.flash_attention(q, k, v, implementation="triton",
                              interpret=True, **kwargs)
  fallback = jax_flash.flash_attention(q, k, v, interpret=True, **kwargs)
  want = jax_flash.flash_attention(q, k, v, implementation="xla", **kwargs)
  assert jnp.array_equal(fallback, want)


def test_scalar_arguments_of_other_types():
  """NumPy and concrete JAX scalars are numbers (dropout_rate); what is
  not a number gets an error naming its argument; a window side past any
  sequence (2^30 and more, where q_pos + right would overflow int32) is
  unbounded, as None."""
  key = jax.random.key(0)
  q, k, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in
             enumerate(((2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16))))
  for rate in (np.float32(0.25), jnp.float32(0.25)):
    got = jax_flash.flash_attention(q, k, v, dropout_rate=rate,
                                    dropout_rng=key, implementation="xla")
    want = jax_flash.flash_attention(q, k, v, dropout_rate=0.25,
                                     dropout_rng=key, implementation="xla")
    assert jnp.array_equal(got, want)
  with pytest.raises(TypeError, match="local_window_size must be an int"):
    jax_flash.flash_attention(q, k, v, local_window_size=("a", 2))
  with pytest.raises(TypeError, match="logits_soft_cap must be a number"):
    jax_flash.flash_attention(q, k, v, logits_soft_cap="a")
  with pytest.raises(ValueError, match="dropout_rate must be a number"):
    jax_flash.flash_attention(q, k, v, dropout_rate="a", dropout_rng=key)
  for side in (2**31 - 1, 2**31, 2**40):
    got = jax_flash.flash_attention(q, k, v, local_window_size=(side, 0),
                                    implementation="xla")
    want = jax_flash.flash_attention(q, k, v, is_causal=True,
                                     implementation="xla")
    assert jnp.array_equal(got, want)
