"""Forward, LSE and gradients of the Triton kernels against the reference.

jit, grad, vmap, checkpoint, scan, shard_map and pmap of every
implementation: tests/test_transformations.py."""
from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import BlockSizes
from pallas_kernels import config
from tests.attention_checks import Case, check_against_reference, random_inputs

# Small tiles in interpret mode so that every shape spans several blocks and
# ends in a partial one.
SMALL_BLOCKS = BlockSizes(block_q=32, block_k=16, block_q_dkv=16,
                          block_kv_dkv=32, block_q_dq=32, block_kv_dq=16)

CPU_CASES = [
    Case(2, 97, 97, 4, 4, 40),      # tails on both axes, head dim padded 40->64
    Case(1, 1, 257, 8, 2, 64),      # single query (decode), GQA 8:2
    Case(1, 257, 33, 8, 1, 96),     # q_len > kv_len, MQA 8:1, d 96->128
    Case(2, 64, 128, 2, 2, 16),     # smallest head dim, exact tiles
    Case(1, 33, 70, 4, 2, 128),     # q_len != kv_len
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _triton(block_sizes, is_causal=False, interpret=True, **variants):
  def attention(q, k, v):
    return jax_flash.flash_attention(
        q, k, v, is_causal=is_causal, return_residual=True,
        implementation="triton", block_sizes=block_sizes, interpret=interpret,
        **variants)
  return attention


# Each case without and with a causal mask, each time in another dtype, so
# that every (dtype, causal) pair runs and every case runs in two dtypes:
# the kernels' code paths differ by dtype and by mask, not by their product
# with the shape, and each combination is an interpret-mode compile of its
# own (the whole product, 30 tests, took twice as long as these 10).
MATRIX = [(case, is_causal, DTYPES[(i + is_causal) % len(DTYPES)])
          for i, case in enumerate(CPU_CASES) for is_causal in (False, True)]


@pytest.mark.parametrize(
    "case, is_causal, dtype", MATRIX,
    ids=[f"{case}-{'causal' if is_causal else 'full'}-{jnp.dtype(dtype).name}"
         for case, is_causal, dtype in MATRIX])
def test_matches_reference(case, is_causal, dtype):
  check_against_reference(_triton(SMALL_BLOCKS, is_causal), case, dtype,
                          is_causal=is_causal, seed=hash(str(case)) % 1000)


def test_default_block_sizes_match_reference():
  case = Case(1, 150, 150, 2, 1, 64)
  check_against_reference(_triton(None, True), case, jnp.float32,
                          is_causal=True, seed=3)


def test_short_keys_take_their_own_forward_tiles():
  """At most `_GPU_SHORT_FORWARD`'s length, d=64 (ViT's 197 and 257
  tokens), the forward's tiles change and the backward's do not; longer
  keys, other head dims and the CPU keep the defaults."""
  gpu = functools.partial(BlockSizes.get_default, device_kind="NVIDIA H200")
  longest = config._GPU_SHORT_FORWARD[64][0]
  default, short = gpu(64), gpu(64, kv_len=197)
  assert gpu(64, kv_len=longest) == short != default
  assert (short.block_q, short.block_k) == (64, 32)
  forward = ("block_q", "block_k", "num_warps", "num_stages")
  assert dataclasses.replace(
      short, **{f: getattr(default, f) for f in forward}) == default
  assert gpu(64, kv_len=longest + 1) == gpu(64, kv_len=None) == default
  assert gpu(128, kv_len=197) == gpu(128)
  assert (BlockSizes.get_default(64, "cpu", kv_len=197)
          == BlockSizes.get_default(64, "cpu"))


class JitAndEagerTest(chex.TestCase):
  """The same call traced under jit and run op by op (`chex.variants`), a
  scale of the caller's, against the reference: output, lse and every
  gradient, with shapes and dtypes as given."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_custom_scale_matches_reference(self):
    case = Case(1, 40, 50, 2, 2, 32)
    q, k, v, d_out, d_lse = random_inputs(case, jnp.float32, 6)

    def run(attention):
      @self.variant
      def forward_and_vjp(q, k, v, d_out, d_lse):
        (out, lse), vjp = jax.vjp(attention, q, k, v)
        return (out, lse), vjp((d_out, d_lse))
      return forward_and_vjp(q, k, v, d_out, d_lse)

    (out, lse), grads = run(_triton(SMALL_BLOCKS, scale=0.37))
    chex.assert_shape(out, q.shape)
    chex.assert_shape(lse, (1, 40, 2))
    chex.assert_type([out, lse, *grads], jnp.float32)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, (q, k, v))
    want = run(functools.partial(jax_flash.attention_reference, scale=0.37,
                                 return_residual=True))
    chex.assert_trees_all_close(((out, lse), grads), want, atol=2e-5)


def test_matches_jax_nn_dot_product_attention():
  """Called like jax.nn.dot_product_attention, the results are the same."""
  q, k, v, _, _ = random_inputs(Case(2, 45, 45, 4, 2, 32), jnp.float32, 7)
  for is_causal in (False, True):
    ours, lse = jax_flash.flash_attention(q, k, v, is_causal=is_causal,
                                          return_residual=True,
                                          implementation="triton")
    theirs, their_lse = jax.nn.dot_product_attention(
        q, k, v, is_causal=is_causal, return_residual=True)
    np.testing.assert_allclose(ours, theirs, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, their_lse, atol=2e-6, rtol=0)


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_unbatched_inputs_and_low_rank_bias_like_jax_nn(implementation):
  """jax.nn's layouts: rank-3 q/k/v are a batch of one, and a bias or mask
  of rank < 4 gains leading axes; out, lse and every gradient (dbias in
  the caller's shape) come back in those layouts, with jax.nn's values.

  lse's cotangent is zero: jax.nn does not differentiate its residual
  (ours does; `check_against_reference` tests that)."""
  q, k, v, d_out, _ = random_inputs(Case(1, 37, 45, 4, 2, 32),
                                    jnp.float32, 21)
  q, k, v, d_out = q[0], k[0], v[0], d_out[0]
  d_lse = jnp.zeros(q.shape[:-1], jnp.float32)
  keys = jax.random.split(jax.random.key(22), 2)
  bias = jax.random.normal(keys[0], (4, 37, 45))           # [heads, Tq, Tk]
  mask = jax.random.bernoulli(keys[1], 0.8, (37, 45))      # [Tq, Tk]
  kwargs = dict(is_causal=True, return_residual=True)

  def run(fn, **extra):
    def attention(q, k, v, bias):
      return fn(q, k, v, bias, mask, **kwargs, **extra)
    def with_vjp(q, k, v, bias):  # one compilation
      (out, lse), vjp = jax.vjp(attention, q, k, v, bias)
      return (out, lse) + vjp((d_out, d_lse))
    return jax.jit(with_vjp)(q, k, v, bias)

  ours = run(jax_flash.flash_attention, implementation=implementation,
             block_sizes=SMALL_BLOCKS)
  theirs = run(jax.nn.dot_product_attention)
  # out, lse, dq, dk, dv, dbias: shapes (dbias in the bias's) and values.
  chex.assert_trees_all_close(ours, theirs, atol=1e-4, rtol=1e-4)
  chex.assert_shape(ours[1], (37, 4))                      # lse [Tq, heads]
  chex.assert_shape(ours[5], bias.shape)


def test_per_batch_arguments_without_the_batch_axis():
  """Lengths, q_offset and segment ids without their batch axis are the
  same for every batch element: the results equal the broadcast ones."""
  q, k, v, _, _ = random_inputs(Case(3, 30, 30, 2, 1, 16), jnp.float32, 23)
  ids = jnp.repeat(jnp.arange(3), 10)
  shared = dict(segment_ids=ids, key_value_seq_lengths=jnp.asarray(27),
                q_offset=jnp.asarray(2, jnp.int32))
  broadcast = {name: jnp.broadcast_to(x, (3,) + x.shape)
               for name, x in shared.items()}
  results = {}
  for name, fn in (("ours", functools.partial(jax_flash.flash_attention,
                                               implementation="triton",
                                               block_sizes=SMALL_BLOCKS)),
                   ("reference", jax_flash.attention_reference)):
    results[name] = fn(q, k, v, is_causal=True, **shared)
    chex.assert_trees_all_equal(results[name],
                                fn(q, k, v, is_causal=True, **broadcast))
  chex.assert_trees_all_close(results["ours"], results["reference"],
                              atol=2e-6)


def test_vmap_over_unbatched_calls():
  """A per-example function (q, k, v [T, N, D], segment ids [T], a scalar
  length) under vmap gives the batched call's output and gradients."""
  q, k, v, d_out, _ = random_inputs(Case(3, 20, 20, 2, 1, 16), jnp.float32,
                                    24)
  ids = jnp.stack([jnp.repeat(jnp.arange(2), 10), jnp.zeros(20, jnp.int32),
                   jnp.repeat(jnp.arange(4), 5)]).astype(jnp.int32)
  lengths = jnp.array([20, 13, 7], jnp.int32)

  def per_example(q, k, v, ids, length):
    return jax_flash.flash_attention(
        q, k, v, is_causal=True, segment_ids=ids,
        key_value_seq_lengths=length, implementation="triton",
        block_sizes=SMALL_BLOCKS)

  def batched(q, k, v):
    return jax_flash.attention_reference(q, k, v, is_causal=True,
                                         segment_ids=ids,
                                         key_value_seq_lengths=lengths)

  def with_vjp(fn):  # one compilation for out and gradients
    return jax.jit(lambda q, k, v: (lambda out, vjp: (out, vjp(d_out)))(
        *jax.vjp(fn, q, k, v)))(q, k, v)
  got = with_vjp(lambda q, k, v: jax.vmap(per_example)(q, k, v, ids,
                                                       lengths))
  want = with_vjp(batched)
  chex.assert_trees_all_close(got[0], want[0], atol=2e-6)
  chex.assert_trees_all_close(got[1], want[1], atol=1e-5)


def test_deterministic_bitwise():
  case = Case(1, 70, 90, 4, 2, 40)
  q, k, v, d_out, _ = random_inputs(case, jnp.bfloat16, 11)

  @jax.jit
  def run(q, k, v):
    out, vjp = jax.vjp(_triton(SMALL_BLOCKS, True), q, k, v)
    return out, vjp((d_out, jnp.zeros_like(out[1])))

  chex.assert_trees_all_equal(run(q, k, v), run(q, k, v))


def test_signatures_name_shapes_without_checking_them():
  """The public signatures carry jaxtyping shapes, which resolve; nothing
  checks them at run time (no `jaxtyped` wrapper), so calls trace as
  without them."""
  import typing
  for fn in (jax_flash.flash_attention, jax_flash.attention_reference):
    hints = typing.get_type_hints(fn)
    assert "*batch q_len heads dim" in str(hints["query"])
    assert "*batch kv_len kv_heads dim" in str(hints["key"])
    assert "*batch q_len heads" in str(hints["return"])
    assert not hasattr(fn, "__wrapped__"), fn


def test_decode_single_query_and_single_key():
  q, k, v, _, _ = random_inputs(Case(1, 1, 1, 2, 1, 16), jnp.float32, 2)
  out = jax_flash.flash_attention(q, k, v, implementation="triton")
  # One key: softmax is 1, the output is that key's value.
  np.testing.assert_allclose(out, jnp.repeat(v, 2, axis=2), atol=1e-6)


def test_implementation_none_on_cpu_uses_xla_unless_interpret():
  q, k, v, _, _ = random_inputs(Case(1, 20, 30, 2, 2, 16), jnp.float32, 4)
  traced = lambda **kw: str(jax.make_jaxpr(functools.partial(
      jax_flash.flash_attention, is_causal=True, **kw))(q, k, v))
  assert "pallas_call" not in traced()
  assert "pallas_call" in traced(interpret=True)
  auto = jax_flash.flash_attention(q, k, v, is_causal=True)
  triton = jax_flash.flash_attention(q, k, v, is_causal=True,
                                     implementation="triton")
  np.testing.assert_allclose(auto, triton, atol=2e-6)


def test_large_head_dim_falls_back_to_xla():
  q, k, v, _, _ = random_inputs(Case(1, 8, 8, 1, 1, 288), jnp.float32, 4)
  out = jax_flash.flash_attention(q, k, v, interpret=True)
  np.testing.assert_allclose(out, jax_flash.attention_reference(q, k, v),
                             atol=1e-6)
  with pytest.raises(NotImplementedError, match="head_dim up to 256"):
    jax_flash.flash_attention(q, k, v, implementation="triton")


def test_no_nan_for_extreme_logits():
  case = Case(1, 50, 50, 2, 2, 32)
  q, k, v, _, _ = random_inputs(case, jnp.float32, 9)
  out = jax_flash.flash_attention(q * 300.0, k * 300.0, v, is_causal=True,
                                  implementation="triton",
                                  block_sizes=SMALL_BLOCKS)
  assert bool(jnp.all(jnp.isfinite(out)))
  ref = jax_flash.attention_reference(q * 300.0, k * 300.0, v, is_causal=True)
  np.testing.assert_allclose(out, ref, atol=1e-4)


@pytest.mark.parametrize("q_len, kv_len, head_dim, extra, first", [
    (197, 197, 96, {}, "triton"),    # ViT-B/16 lengths: off the 8-row
    (577, 577, 80, {}, "triton"),    # tiling, rows of no whole swizzle tiles
    (197, 197, 64, {}, "mosaic"),    # 128-byte rows: read in place
    (577, 577, 128, {"is_causal": True}, "mosaic"),  # as column tiles
    (197, 197, 256, {}, "mosaic"),
    (577, 577, 64, {"is_causal": True}, "mosaic"),
    (197, 197, 64, {"local_window_size": 16}, "triton"),  # masked d=64
    (197, 197, 64, {"bias": True}, "triton"),
    (577, 577, 128, {"local_window_size": 16}, "mosaic"),  # masked in place
    (197, 197, 256, {"bias": True}, "mosaic"),
    (197, 197, 96, {"local_window_size": 16}, "triton"),  # masked d=96
    (512, 512, 64, {"local_window_size": 16}, "triton"),  # masked d=64 on
    (384, 384, 64, {"bias": True}, "triton"),             # the tiling too
    (512, 512, 64, {"logits_soft_cap": 30.0}, "mosaic"),  # plain kernels
    (512, 512, 128, {"local_window_size": 16}, "mosaic"),
    (648, 648, 64, {"local_window_size": 16}, "mosaic"),  # past the bound
    (50, 641, 128, {}, "mosaic"),    # longer than TRITON_FIRST_UP_TO
    (200, 200, 128, {}, "mosaic"),   # whole 8-row tiles: no copies
    (1001, 1001, 128, {}, "mosaic"),
])
def test_implementation_none_tries_triton_first_for_short_ragged_lengths(
    q_len, kv_len, head_dim, extra, first, monkeypatch):
  """`implementation=None` on a GPU: the Mosaic kernels first, but the
  Triton ones for short lengths off Mosaic's 8-row TMA tiling
  (`api.TRITON_FIRST_UP_TO`) where the Mosaic path pads by copies (rows
  of no whole 128-byte swizzle tiles) or Triton's forward wins (masked
  calls at d=64, on the tiling or off it); a forced
  implementation is the only one tried."""
  from jax_flash import api
  from pallas_kernels import compat
  monkeypatch.setattr(compat, "has_gpu", lambda: True)
  tried = []

  def run(name, _):
    tried.append(name)
    raise NotImplementedError(name)
  q = jnp.zeros((1, q_len, 2, head_dim), jnp.bfloat16)
  kv = jnp.zeros((1, kv_len, 2, head_dim), jnp.bfloat16)
  if extra.get("bias"):
    extra = {"bias": jnp.zeros((1, 2, q_len, kv_len), jnp.float32)}
  monkeypatch.setattr(api, "_IMPLEMENTATIONS", {
      name: lambda *_, name=name, **__: run(name, None)
      for name in api.IMPLEMENTATIONS})
  with pytest.raises(NotImplementedError, match="no implementation"):
    jax_flash.flash_attention(q, kv, kv, **extra)
  assert tried[0] == first and sorted(tried) == sorted(api.IMPLEMENTATIONS)
  tried.clear()
  with pytest.raises(NotImplementedError):
    jax_flash.flash_attention(q, kv, kv, implementation="mosaic", **extra)
  assert tried == ["mosaic"]


def test_mosaic_row_tile_is_the_kernels():
  """`api`'s copies of the Mosaic kernels' TMA row tiling and swizzle
  width, kept apart since Mosaic GPU is not importable everywhere."""
  from jax_flash import api
  common = pytest.importorskip("pallas_kernels.mosaic.common")
  assert api._MOSAIC_ROW_TILE == common.TMA_ROW_TILE
  assert api._SWIZZLE_BYTES == common.SWIZZLES[0]
