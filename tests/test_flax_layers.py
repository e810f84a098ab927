"""flax_layers against Flax's own attention: same parameters, same outputs.

Each comparison runs jax_flash's XLA path and its Triton kernels (in Pallas
interpret mode on a CPU). Calls that run fused are asserted to (no
FlashFallbackWarning); those that fall back must still give Flax's result.
Decoding, dense and paged, must equal the full causal pass.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import flax_layers
from flax_layers import FlashFallbackWarning, flash_attention_fn

IMPLEMENTATIONS = [pytest.param("xla", id="xla"),
                   pytest.param("triton", id="triton")]

@contextlib.contextmanager
def fused():
  """No FlashFallbackWarning may leave the block: the call ran fused."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", FlashFallbackWarning)
    yield
  fallbacks = [w for w in caught if w.category is FlashFallbackWarning]
  assert not fallbacks, str(fallbacks[0].message)


def assert_close(actual, expected, tol=2e-5):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected),
                             rtol=tol, atol=tol)


@functools.partial(nnx.jit, static_argnames=("options",))
def _run(module, args, arrays, options):
  return module(*args, **arrays, **dict(options))


def run(module, *args, **kwargs):
  """`module(*args, **kwargs)`, compiled: one compilation costs less than
  eager dispatch of every op, and decoding steps reuse it."""
  options = tuple(sorted((k, v) for k, v in kwargs.items()
                         if isinstance(v, bool)))
  arrays = {k: v for k, v in kwargs.items() if not isinstance(v, bool)}
  return _run(module, args, arrays, options)


def jit(fn, **static):
  """`fn` compiled with `static` bound (Python values stay static)."""
  return jax.jit(functools.partial(fn, **static))


def flash(implementation):
  return functools.partial(flash_attention_fn, implementation=implementation)


def normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def random_mask(seed, shape):
  """A random mask in which every query row keeps at least its diagonal
  key, so no row is empty (there jax_flash gives 0 and Flax mean(V))."""
  keep = jax.random.bernoulli(jax.random.key(seed), 0.6, shape)
  return keep | jnp.eye(shape[-2], shape[-1], dtype=bool)


@pytest.fixture(autouse=True)
def _float32_dots():
  # Flax's XLA attention multiplies float32 in TF32 on a GPU by default;
  # compare exact arithmetic with exact arithmetic.
  with jax.default_matmul_precision("highest"):
    yield


# flash_attention_fn as a function.

FN_CASES = {
    "plain": dict(q_len=9, kv_len=9, heads=4, kv_heads=4),
    "causal": dict(q_len=9, kv_len=9, heads=4, kv_heads=4, is_causal=True),
    "gqa-causal-cross": dict(q_len=5, kv_len=11, heads=4, kv_heads=2,
                             is_causal=True),
    "bool-mask": dict(q_len=7, kv_len=7, heads=2, kv_heads=2, mask=bool),
    "float-mask-gqa": dict(q_len=7, kv_len=7, heads=4, kv_heads=1,
                           mask=jnp.float32),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", FN_CASES.values(), ids=FN_CASES.keys())
def test_attention_fn_matches_flax(case, implementation):
  d = 16
  q = normal(0, (2, case["q_len"], case["heads"], d))
  k = normal(1, (2, case["kv_len"], case["kv_heads"], d))
  v = normal(2, (2, case["kv_len"], case["kv_heads"], d))
  mask = None
  if "mask" in case:
    mask = random_mask(3, (2, 1, case["q_len"], case["kv_len"]))
    mask = mask.astype(case["mask"])
  is_causal = case.get("is_causal", False)
  expected = jit(nnx.dot_product_attention, is_causal=is_causal)(
      q, k, v, mask=mask)
  with fused():
    out = jit(flash_attention_fn, is_causal=is_causal,
              implementation=implementation)(q, k, v, mask=mask)
  assert_close(out, expected)


@pytest.mark.parametrize("batch_shape", [(), (2, 3)], ids=["none", "two"])
def test_attention_fn_takes_flax_batch_dims(batch_shape):
  q = normal(0, batch_shape + (5, 2, 8))
  k = normal(1, batch_shape + (6, 2, 8))
  mask = random_mask(2, (5, 6))[None]  # [heads=1, q_len, kv_len]
  expected = jit(nnx.dot_product_attention)(q, k, k, mask=mask)
  with fused():
    out = jit(flash_attention_fn)(q, k, k, mask=mask)
  assert out.shape == q.shape
  assert_close(out, expected)


def test_dot_algorithm_falls_back_to_flax():
  q = normal(0, (1, 6, 2, 8))
  precision = jax.lax.DotAlgorithmPreset.F32_F32_F32
  with pytest.warns(FlashFallbackWarning, match="dot algorithm"):
    out = flash_attention_fn(q, q, q, precision=precision)
  assert_close(out, linen.dot_product_attention(q, q, q,
                                                precision=precision))


def test_linen_einsum_overrides_fall_back_to_flax():
  q = normal(0, (1, 6, 2, 8))
  einsum = functools.partial(jnp.einsum, precision="highest")
  with pytest.warns(FlashFallbackWarning, match="einsums"):
    out = flash_attention_fn(q, q, q, qk_attn_weights_einsum=einsum,
                             attn_weights_value_einsum=einsum)
  assert_close(out, linen.dot_product_attention(q, q, q))


def test_flax_modules_take_flash_attention_fn():
  """Flax's own modules with `attention_fn=flash_attention_fn`."""
  x = normal(0, (2, 7, 16))
  mask = linen.make_causal_mask(jnp.ones((2, 7)))
  theirs = linen.MultiHeadDotProductAttention(num_heads=4)
  ours = linen.MultiHeadDotProductAttention(num_heads=4,
                                            attention_fn=flash_attention_fn)
  variables = theirs.init(jax.random.key(0), x)
  with fused():
    out = jit(ours.apply)(variables, x, mask=mask)
  assert_close(out, jit(theirs.apply)(variables, x, mask=mask))

  kwargs = dict(num_heads=4, num_kv_heads=2, in_features=16, decode=False)
  theirs = nnx.MultiHeadAttention(rngs=nnx.Rngs(0), **kwargs)
  ours = nnx.MultiHeadAttention(rngs=nnx.Rngs(0),
                                attention_fn=flash_attention_fn, **kwargs)
  with fused():
    out = run(ours, x, is_causal=True)
  assert_close(out, run(theirs, x, is_causal=True))


# nnx.MultiHeadAttention.

def nnx_pair(implementation, **kwargs):
  """Flax's module and ours, ours loaded from Flax's state."""
  kwargs.setdefault("decode", False)
  theirs = nnx.MultiHeadAttention(rngs=nnx.Rngs(0), **kwargs)
  ours = flax_layers.nnx.MultiHeadAttention(
      rngs=nnx.Rngs(1), attention_fn=flash(implementation), **kwargs)
  state = nnx.state(theirs, nnx.Param)
  assert (jax.tree.structure(nnx.state(ours, nnx.Param))
          == jax.tree.structure(state))
  nnx.update(ours, state)
  return theirs, ours


NNX_CASES = {
    "gqa-causal": dict(module=dict(num_heads=4, num_kv_heads=2),
                       call=dict(is_causal=True)),
    "cross-mask": dict(module=dict(num_heads=2, in_kv_features=12), kv_len=9,
                       mask=True),
    "qk-norm-causal": dict(module=dict(num_heads=4, normalize_qk=True,
                                       qkv_features=32, out_features=8),
                           call=dict(is_causal=True)),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", NNX_CASES.values(), ids=NNX_CASES.keys())
def test_nnx_module_matches_flax(case, implementation):
  theirs, ours = nnx_pair(implementation, in_features=16, **case["module"])
  x = normal(0, (2, 7, 16))
  kv = normal(1, (2, case["kv_len"], 12)) if "kv_len" in case else None
  options = dict(case.get("call", {}))
  if case.get("mask"):
    options["mask"] = random_mask(2, (2, 1, 7, case["kv_len"]))
  with fused():
    out = run(ours, x, kv, **options)
  assert_close(out, run(theirs, x, kv, **options))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nnx_module_gradients_match_flax(implementation):
  """d(output)/d(params, inputs) under a random cotangent."""
  theirs, ours = nnx_pair(implementation, num_heads=4, num_kv_heads=2,
                          in_features=16)
  x = normal(0, (2, 7, 16))
  cotangent = normal(1, (2, 7, 16))

  def vjp(module):
    graphdef, params = nnx.split(module)

    @jax.jit
    def pullback(params, x):
      def forward(params, x):
        return nnx.merge(graphdef, params)(x, is_causal=True)
      return jax.vjp(forward, params, x)[1](cotangent)
    return pullback(params, x)

  for expected, actual in zip(jax.tree.leaves(vjp(theirs)),
                              jax.tree.leaves(vjp(ours))):
    assert_close(actual, expected, tol=1e-4)


@pytest.mark.filterwarnings(  # Flax 0.12 deprecates sow outside nnx.capture
    "ignore:Using 'Module.sow\\(\\)':DeprecationWarning")
def test_nnx_sow_weights_falls_back_to_flax():
  theirs, ours = nnx_pair(None, num_heads=2, in_features=8)
  x = normal(0, (1, 5, 8))
  with pytest.warns(FlashFallbackWarning, match="sowing"):
    out = run(ours, x, sow_weights=True)
  assert_close(out, run(theirs, x, sow_weights=True))
  assert_close(ours.attention_weights.get_value()[0],
               theirs.attention_weights.get_value()[0])


def test_broadcast_dropout_falls_back_to_flax_exactly():
  theirs, ours = nnx_pair(None, num_heads=2, in_features=8, dropout_rate=0.3,
                          deterministic=False)
  x = normal(0, (2, 6, 8))
  with pytest.warns(FlashFallbackWarning, match="broadcast_dropout"):
    out = run(ours, x, rngs=nnx.Rngs(dropout=7))
  assert_close(out, run(theirs, x, rngs=nnx.Rngs(dropout=7)))


def test_fused_dropout():
  theirs, ours = nnx_pair(None, num_heads=2, in_features=8, dropout_rate=0.3,
                          broadcast_dropout=False, deterministic=False)
  x = normal(0, (2, 6, 8))
  with warnings.catch_warnings():
    warnings.simplefilter("error", FlashFallbackWarning)
    a = run(ours, x, rngs=nnx.Rngs(dropout=1))
    b = run(ours, x, rngs=nnx.Rngs(dropout=1))
    c = run(ours, x, rngs=nnx.Rngs(dropout=2))
    plain = run(ours, x, deterministic=True)
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  assert_close(plain, run(theirs, x, deterministic=True))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nnx_decode_reproduces_causal_forward(implementation):
  """Token by token (and a chunked prefill) equals the full causal pass and
  Flax's own decoding."""
  kwargs = dict(num_heads=4, num_kv_heads=2, in_features=16)
  theirs, ours = nnx_pair(implementation, **kwargs)
  batch, length = 2, 6
  x = normal(0, (batch, length, 16))
  full = run(ours, x, is_causal=True)
  assert_close(full, run(theirs, x, is_causal=True))

  for module in (ours, theirs):
    module.init_cache((batch, length, 16))
  with fused():
    ours_steps = [run(ours, x[:, t:t + 1], decode=True)
                  for t in range(length)]
  theirs_steps = [run(theirs, x[:, t:t + 1], decode=True)
                  for t in range(length)]
  assert_close(jnp.concatenate(ours_steps, axis=1), full)
  assert_close(jnp.concatenate(theirs_steps, axis=1), full)

  ours.init_cache((batch, length, 16))
  with fused():
    chunks = [run(ours, x[:, :4], decode=True),
              run(ours, x[:, 4:5], decode=True),
              run(ours, x[:, 5:], decode=True)]
  assert_close(jnp.concatenate(chunks, axis=1), full)


@pytest.mark.parametrize("page_size", [None, 2], ids=["dense", "paged"])
def test_decode_with_flax_attention_fn_matches_flash(page_size):
  """A foreign attention_fn gets the cache as keys (a paged one gathered,
  with what lies past the lengths zeroed) and the positions as a mask."""
  kwargs = dict(num_heads=2, in_features=8)
  _, ours = nnx_pair(None, **kwargs)
  dense = flax_layers.nnx.MultiHeadAttention(
      rngs=nnx.Rngs(2), decode=False,
      attention_fn=nnx.dot_product_attention, **kwargs)
  nnx.update(dense, nnx.state(ours, nnx.Param))
  x = normal(0, (1, 5, 8))
  for module in (ours, dense):
    module.init_cache(x.shape, page_size=page_size)
    poison(module)
  with fused():
    expected = run(ours, x[:, :3], decode=True)
  assert_close(run(dense, x[:, :3], decode=True), expected)
  assert_close(run(dense, x, is_causal=True), run(ours, x, is_causal=True))


# Decoding a ragged batch through the layers, dense and paged.

PROMPTS = (4, 1, 2)  # each sequence's prompt length
STEPS = 3  # tokens decoded one at a time after the prompts
MAX_LEN = 8  # >= max(PROMPTS) + STEPS
PAGE_SIZE = 2
LAYOUTS = [pytest.param(None, id="dense"), pytest.param(PAGE_SIZE, id="paged")]


def decode_cases(defaults):
  """(page_size, implementation) parameters of the decode modules' tests:
  the (layout, implementation) pairs named in `defaults` in the default
  run, the others with `-m slow` (CI's ten minutes)."""
  return [pytest.param(page_size, impl, id=f"{layout}-{impl}",
                       marks=() if (layout, impl) in defaults
                       else pytest.mark.slow)
          for layout, page_size in (("dense", None), ("paged", PAGE_SIZE))
          for impl in ("xla", "triton")]


def ragged_calls(x):
  """The calls of a ragged generation over x [batch, len, features]: the
  prompts right-padded with noise into one prefill call (and their
  lengths), then each sequence's next input, one per step."""
  lengths = jnp.array(PROMPTS, jnp.int32)
  prompts = x[:, :max(PROMPTS)]
  valid = jnp.arange(prompts.shape[1])[None, :, None] < lengths[:, None, None]
  # Loud padding: had its keys reached a valid row, the outputs would show it.
  prompts = jnp.where(valid, prompts, 10 * normal(99, prompts.shape))
  batch = jnp.arange(x.shape[0])
  steps = [x[batch, lengths + s][:, None] for s in range(STEPS)]
  return prompts, lengths, steps


def assert_ragged_matches(prefill, steps, full):
  """Each sequence's prompt outputs then step outputs equal its rows of
  the full causal pass."""
  for b, length in enumerate(PROMPTS):
    decoded = jnp.concatenate([prefill[b, :length]] + [y[b] for y in steps])
    assert_close(decoded, full[b, :length + STEPS])


def shuffled_tables(num_pages, batch):
  """Every sequence's pages, scattered over the pool."""
  pages = jax.random.permutation(jax.random.key(5), num_pages)
  return pages.reshape(batch, -1).astype(jnp.int32)


def poison(module):
  """NaN in every cache row: those not written must never be read."""
  for cache in (module.cached_key, module.cached_value):
    cache[...] = jnp.full_like(cache[...], jnp.nan)


@pytest.mark.parametrize("page_size, implementation", decode_cases(
    {("dense", "xla"), ("paged", "triton")}))
def test_nnx_decode_ragged_batch(page_size, implementation):
  """Prompts of different lengths in one prefill call, then single tokens,
  through a dense or a paged (shuffled, NaN-poisoned) cache, equal the
  full causal pass; every step reuses one trace."""
  _, ours = nnx_pair(implementation, num_heads=4, num_kv_heads=2,
                     in_features=16)
  x = normal(0, (len(PROMPTS), MAX_LEN - 1, 16))
  full = run(ours, x, is_causal=True)
  ours.init_cache((len(PROMPTS), MAX_LEN, 16), page_size=page_size)
  poison(ours)
  if page_size:
    ours.block_tables[...] = shuffled_tables(ours.cached_key.shape[0],
                                             len(PROMPTS))
  prompts, lengths, step_inputs = ragged_calls(x)
  traces = []

  @nnx.jit
  def step(module, x):
    traces.append(x.shape)
    return module(x, decode=True)

  with fused():
    prefill = run(ours, prompts, decode=True, input_lengths=lengths)
    steps = [step(ours, y) for y in step_inputs]
  assert len(traces) == 1, traces
  np.testing.assert_array_equal(ours.cache_index[...],
                                lengths + len(step_inputs))
  assert_ragged_matches(prefill, steps, full)


@pytest.mark.parametrize("page_size, implementation", decode_cases(
    {("dense", "triton"), ("paged", "xla")}))
def test_linen_decode_ragged_batch(page_size, implementation):
  kwargs = dict(num_heads=2, qkv_features=8)
  ours = flax_layers.linen.MultiHeadDotProductAttention(
      attention_fn=flash(implementation), page_size=page_size, **kwargs)
  x = normal(0, (len(PROMPTS), MAX_LEN - 1, 16))
  variables = linen.MultiHeadDotProductAttention(**kwargs).init(
      jax.random.key(0), x)
  full = jit(ours.apply, is_causal=True)(variables, x)

  decoder = ours.clone(decode=True)
  cache = decoder.init(jax.random.key(0),
                       jnp.zeros((len(PROMPTS), MAX_LEN, 16)))["cache"]
  cache = dict(cache, cached_key=jnp.full_like(cache["cached_key"], jnp.nan),
               cached_value=jnp.full_like(cache["cached_value"], jnp.nan))
  if page_size:
    cache["block_tables"] = shuffled_tables(cache["cached_key"].shape[0],
                                            len(PROMPTS))
  prompts, lengths, step_inputs = ragged_calls(x)
  traces = []

  @jax.jit
  def apply(cache, x, input_lengths=None):
    traces.append(x.shape)
    return decoder.apply({**variables, "cache": cache}, x,
                         input_lengths=input_lengths, mutable=["cache"])

  with fused():
    prefill, mutated = apply(cache, prompts, lengths)
    steps = []
    for y in step_inputs:
      out, mutated = apply(mutated["cache"], y)
      steps.append(out)
  assert len(traces) == 2, traces  # the prefill's and the steps' one
  np.testing.assert_array_equal(mutated["cache"]["cache_index"],
                                lengths + len(step_inputs))
  assert_ragged_matches(prefill, steps, full)


def test_decode_errors_name_the_argument():
  _, ours = nnx_pair(None, num_heads=2, in_features=8)
  x = normal(0, (2, 3, 8))
  with pytest.raises(ValueError, match="input_lengths applies to decode"):
    ours(x, input_lengths=jnp.array([3, 1]))
  ours.init_cache((2, MAX_LEN, 8), page_size=PAGE_SIZE)
  with pytest.raises(ValueError, match=r"input_lengths must be .* \(2,\)"):
    ours(x, decode=True, input_lengths=jnp.array([3, 1, 2]))
  ours.init_cache((3, MAX_LEN, 8), page_size=PAGE_SIZE)
  with pytest.raises(ValueError, match="block_tables"):
    ours(x, decode=True)  # a batch of 2 against tables for 3
  ours.init_cache((2, 2, 8))
  with pytest.raises(ValueError, match="do not fit the cache"):
    ours(x, decode=True)  # 3 tokens, room for 2


def test_cache_variables_are_flax():
  """The dense cache is Flax's, variable for variable, so Flax's cache
  flows into ours; the paged one adds block_tables and pages."""
  theirs, ours = nnx_pair(None, num_heads=4, num_kv_heads=2, in_features=16)
  for module in (ours, theirs):
    module.init_cache((2, MAX_LEN, 16))
  shapes = lambda tree: jax.tree.map(lambda v: (v.shape, v.dtype), tree)
  assert shapes(nnx.state(ours)) == shapes(nnx.state(theirs))
  ours.init_cache((2, MAX_LEN, 16), page_size=PAGE_SIZE)
  assert shapes(nnx.state(ours, nnx.Cache)) == shapes(nnx.State({
      "block_tables": nnx.Cache(jnp.zeros((2, 4), jnp.int32)),
      "cache_index": nnx.Cache(jnp.zeros((2,), jnp.int32)),
      "cached_key": nnx.Cache(jnp.zeros((8, PAGE_SIZE, 2, 4))),
      "cached_value": nnx.Cache(jnp.zeros((8, PAGE_SIZE, 2, 4)))}))

  x = normal(0, (2, MAX_LEN, 16))
  variables = linen.MultiHeadDotProductAttention(num_heads=2, decode=True).init(
      jax.random.key(0), x)
  ours = flax_layers.linen.MultiHeadDotProductAttention(num_heads=2,
                                                        decode=True)
  assert shapes(ours.init(jax.random.key(1), x)) == shapes(variables)
  with fused():
    out, _ = jit(ours.apply, mutable=["cache"])(variables, x[:, :1])
  expected, _ = jit(linen.MultiHeadDotProductAttention(
      num_heads=2, decode=True).apply, mutable=["cache"])(variables, x[:, :1])
  assert_close(out, expected)
  paged = ours.clone(page_size=PAGE_SIZE).init(jax.random.key(1), x)
  assert shapes(paged["params"]) == shapes(variables["params"])
  assert shapes(paged["cache"]) == {
      "block_tables": ((2, 4), jnp.int32), "cache_index": ((2,), jnp.int32),
      "cached_key": ((8, PAGE_SIZE, 2, 8), jnp.float32),
      "cached_value": ((8, PAGE_SIZE, 2, 8), jnp.float32)}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_segment_ids_match_separate_sequences(implementation):
  """Two sequences packed in one row attend as if run apart."""
  _, ours = nnx_pair(implementation, num_heads=2, in_features=8)
  x = normal(0, (1, 9, 8))
  segment_ids = jnp.array([[0] * 4 + [1] * 5], jnp.int32)
  with fused():
    packed = run(ours, x, is_causal=True, segment_ids=segment_ids)
  apart = jnp.concatenate([run(ours, x[:, :4], is_causal=True),
                           run(ours, x[:, 4:], is_causal=True)], axis=1)
  assert_close(packed, apart)


# Fused paths leave no dense mask behind.

def _shapes_outside_kernels(jaxpr):
  """(shape, dtype) of every value in `jaxpr`, not looking into kernels."""
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      yield tuple(var.aval.shape), var.aval.dtype
    if eqn.primitive.name == "pallas_call":
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _shapes_outside_kernels(sub)


def test_causal_builds_no_square_mask():
  _, ours = nnx_pair("triton", num_heads=4, num_kv_heads=2, in_features=16)
  length = 24
  graphdef, state = nnx.split(ours)
  x = normal(0, (2, length, 16))

  def loss(state, x):
    return nnx.merge(graphdef, state)(x, is_causal=True).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss))(state, x)
  square = [s for s, _ in _shapes_outside_kernels(jaxpr.jaxpr)
            if s[-2:] == (length, length)]
  assert not square, square


@pytest.mark.parametrize("page_size", LAYOUTS)
def test_decode_builds_no_mask(page_size):
  """Decoding goes through decode_attention's kernel: no mask over the
  cache exists outside it."""
  _, ours = nnx_pair("triton", num_heads=2, in_features=8)
  max_len = 24
  ours.init_cache((1, max_len, 8), page_size=page_size)
  graphdef, state = nnx.split(ours)

  def step(state, x):
    return nnx.merge(graphdef, state)(x, decode=True)
  jaxpr = jax.make_jaxpr(step)(state, normal(0, (1, 1, 8)))
  assert "pallas_call" in str(jaxpr)
  masks = [s for s, dtype in _shapes_outside_kernels(jaxpr.jaxpr)
           if dtype == jnp.bool_ and s and s[-1] == max_len]
  assert not masks, masks


# linen.MultiHeadDotProductAttention.

LINEN_CASES = {
    "plain": dict(module=dict(num_heads=4)),
    "mask": dict(module=dict(num_heads=2, qkv_features=8), mask=True),
    "qk-norm": dict(module=dict(num_heads=4, normalize_qk=True,
                                out_features=6)),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", LINEN_CASES.values(), ids=LINEN_CASES.keys())
def test_linen_module_matches_flax(case, implementation):
  theirs = linen.MultiHeadDotProductAttention(**case["module"])
  ours = flax_layers.linen.MultiHeadDotProductAttention(
      attention_fn=flash(implementation), **case["module"])
  x = normal(0, (2, 7, 16))
  variables = theirs.init(jax.random.key(0), x)
  assert (jax.tree.structure(ours.init(jax.random.key(1), x))
          == jax.tree.structure(variables))
  mask = random_mask(1, (2, 1, 7, 7)) if case.get("mask") else None
  with fused():
    out = jit(ours.apply)(variables, x, mask=mask)
  assert_close(out, jit(theirs.apply)(variables, x, mask=mask))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linen_causal_matches_flax_causal_mask(implementation):
  theirs = linen.MultiHeadDotProductAttention(num_heads=4)
  ours = flax_layers.linen.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=flash(implementation))
  x = normal(0, (2, 7, 16))
  variables = theirs.init(jax.random.key(0), x)
  with fused():
    out = jit(ours.apply, is_causal=True)(variables, x)
  expected = jit(theirs.apply)(variables, x,
                               mask=linen.make_causal_mask(jnp.ones((2, 7))))
  assert_close(out, expected)


def test_linen_names_match_inside_a_parent():
  """Automatic names come from the class name, so parents' trees match."""
  def parent(cls):
    class Block(linen.Module):
      @linen.compact
      def __call__(self, x):
        return cls(num_heads=2)(cls(num_heads=2)(x))
    return Block()

  x = normal(0, (1, 4, 8))
  theirs = parent(linen.MultiHeadDotProductAttention).init(jax.random.key(0), x)
  ours = parent(flax_layers.linen.MultiHeadDotProductAttention)
  assert jax.tree.structure(ours.init(jax.random.key(0), x)) == \
      jax.tree.structure(theirs)
  assert_close(ours.apply(theirs, x),
               parent(linen.MultiHeadDotProductAttention).apply(theirs, x))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linen_decode_reproduces_causal_forward(implementation):
  kwargs = dict(num_heads=2, qkv_features=8)
  ours = flax_layers.linen.MultiHeadDotProductAttention(
      attention_fn=flash(implementation), **kwargs)
  decoder = ours.clone(decode=True)
  batch, length = 2, 5
  x = normal(0, (batch, length, 8))
  variables = linen.MultiHeadDotProductAttention(**kwargs).init(
      jax.random.key(0), x)
  full = jit(ours.apply, is_causal=True)(variables, x)

  cache = decoder.init(jax.random.key(0), x)["cache"]
  step = jit(decoder.apply, mutable=["cache"])
  steps = []
  with fused():
    for t in range(length):
      out, mutated = step({**variables, "cache": cache}, x[:, t:t + 1])
      cache = mutated["cache"]
      steps.append(out)
  assert_close(jnp.concatenate(steps, axis=1), full)


# On a GPU: the compiled kernels at realistic sizes.

@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_modules_match_flax_on_gpu(is_causal):
  theirs, ours = nnx_pair(None, num_heads=8, num_kv_heads=2, in_features=512)
  x = normal(0, (2, 1000, 512))
  assert_close(run(ours, x, is_causal=is_causal),
               run(theirs, x, is_causal=is_causal), tol=5e-5)

  batch, length = 2, 40
  for module in (ours, theirs):
    module.init_cache((batch, length, 512))
  steps = [run(ours, x[:batch, t:t + 1], decode=True) for t in range(length)]
  assert_close(jnp.concatenate(steps, axis=1),
               run(theirs, x[:, :length], is_causal=True), tol=5e-5)
