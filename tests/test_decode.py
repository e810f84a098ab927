"""`decode_attention` and `write_kv_cache` against the dense-cache oracle.

The oracle (DESIGN.md section 2b): for a dense cache, decode equals
`flash_attention(query, key_cache, value_cache, is_causal=True,
q_offset=cache_lengths - q_len, key_value_seq_lengths=cache_lengths)` on
the reference implementation, computed on clean caches; the kernels see the
same caches with NaN and Inf past every length and in every page no table
names.
"""
from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import decode
from pallas_kernels.triton import decode as decode_kernel
from tests.attention_checks import assert_within_rule


@dataclasses.dataclass(frozen=True)
class DecodeCase:
  batch: int
  q_len: int
  capacity: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  lengths: tuple[int, ...]

  def __str__(self):
    return (f"b{self.batch}-q{self.q_len}-cap{self.capacity}-h{self.num_heads}"
            f":{self.num_kv_heads}-d{self.head_dim}-len{self.lengths}")


# Awkward on purpose: a length of 1, odd lengths, a full cache, a length
# below q_len (rows before position 0), head dims 40 (padded tiles) and 32,
# GQA 8:2, MQA 4:1 and MHA.
CASES = [
    DecodeCase(3, 1, 37, 8, 2, 40, (1, 20, 37)),
    DecodeCase(2, 4, 50, 4, 1, 32, (3, 50)),
    DecodeCase(2, 5, 33, 2, 2, 16, (33, 9)),
]


def _inputs(case: DecodeCase, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (case.batch, case.q_len, case.num_heads,
                                  case.head_dim), jnp.float32).astype(dtype)
  shape = (case.batch, case.capacity, case.num_kv_heads, case.head_dim)
  k = jax.random.normal(keys[1], shape, jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], shape, jnp.float32).astype(dtype)
  lengths = jnp.asarray(case.lengths, jnp.int32)
  return q, k, v, lengths


def _poison(cache, lengths):
  """NaN and Inf at every position at or past a sequence's length."""
  pos = jnp.arange(cache.shape[1])[None, :, None, None]
  past = pos >= lengths[:, None, None, None]
  garbage = jnp.where(pos % 2 == 0, jnp.nan, jnp.inf).astype(cache.dtype)
  return jnp.where(past, garbage, cache)


def _paged(cache, page_size: int, seed: int, spare: int = 3):
  """A dense [batch, capacity, K, D] cache as shuffled pages (NaN in the
  spare pages no table names) and its block tables."""
  batch, capacity = cache.shape[:2]
  pages_per_seq = -(-capacity // page_size)
  padded = jnp.pad(cache, ((0, 0), (0, pages_per_seq * page_size - capacity),
                           (0, 0), (0, 0)), constant_values=jnp.nan)
  num_pages = batch * pages_per_seq + spare
  order = np.random.default_rng(seed).permutation(num_pages)
  tables = order[:batch * pages_per_seq].reshape(batch, pages_per_seq)
  pages = jnp.full((num_pages, page_size) + cache.shape[2:], jnp.nan,
                   cache.dtype)
  pages = pages.at[tables.reshape(-1)].set(
      padded.reshape((-1, page_size) + cache.shape[2:]))
  return pages, jnp.asarray(tables, jnp.int32)


def _oracle(q, k, v, lengths, **kwargs):
  q_len = q.shape[1]
  return jax_flash.flash_attention(
      q, k, v, is_causal=True, q_offset=lengths - q_len,
      key_value_seq_lengths=lengths, return_residual=True,
      implementation="xla", **kwargs)


def _assert_close(ours, want, atol=2e-5):
  for got, ref in zip(ours, want):
    got = np.asarray(got, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.array_equal(np.isfinite(got), np.isfinite(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], atol=atol, rtol=0)


# A schedule with several splits and blocks at these tiny sizes (the default
# would give one block): the merge and the span arithmetic are exercised.
SMALL_TILING = decode_kernel.DecodeTiling(block_r=16, block_k=16,
                                          num_splits=3)


def _run(impl, q, k, v, lengths, tiling=None, **kwargs):
  """(out, lse) of `impl` (with the kernel's `tiling` where given), jitted:
  one compilation instead of one per operation."""
  return jax.jit(functools.partial(_attend, impl, tiling=tiling,
                                   **kwargs))(q, k, v, lengths)


def _attend(impl, q, k, v, lengths, tiling=None, **kwargs):
  if impl == "triton" and tiling is not None:
    call, (n, tables, slopes, sinks) = decode.normalise_decode_call(
        q, k, v, lengths, block_tables=kwargs.pop("block_tables", None),
        **kwargs)
    out, lse = decode_kernel.flash_decode(
        q, k, v, n, tables, slopes, scale=call.scale, spec=call.spec,
        page_size=call.page_size, interpret=True, tiling=tiling)
    if sinks is not None:
      out, lse = jax_flash.masking.apply_sinks(out, lse, sinks)
    return out, lse
  return jax_flash.decode_attention(q, k, v, lengths, implementation=impl,
                                    interpret=True, return_residual=True,
                                    **kwargs)


IMPLS = [("xla", None), ("triton", None), ("triton", SMALL_TILING)]
IMPL_IDS = ["xla", "triton", "triton-split"]


@pytest.mark.parametrize("impl, tiling", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_dense_cache_matches_oracle(case, impl, tiling):
  q, k, v, lengths = _inputs(case, jnp.float32)
  want = _oracle(q, k, v, lengths)
  ours = _run(impl, q, _poison(k, lengths), _poison(v, lengths), lengths,
              tiling)
  _assert_close(ours, want)


@pytest.mark.parametrize("impl, tiling", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_cache_matches_oracle(page_size, impl, tiling):
  case = CASES[0]
  q, k, v, lengths = _inputs(case, jnp.float32, seed=1)
  want = _oracle(q, k, v, lengths)
  k_pages, tables = _paged(_poison(k, lengths), page_size, seed=2)
  v_pages, tables_v = _paged(_poison(v, lengths), page_size, seed=2)
  np.testing.assert_array_equal(tables, tables_v)
  # Table entries past a sequence's length are never read: garbage there.
  used = (np.arange(tables.shape[1])[None] * page_size
          < np.asarray(lengths)[:, None])
  tables = jnp.where(used, tables, jnp.asarray(-7, jnp.int32))
  ours = _run(impl, q, k_pages, v_pages, lengths, tiling, block_tables=tables)
  _assert_close(ours, want)


VARIANTS = {
    "window": dict(local_window_size=(6, 0)),
    "softcap": dict(logits_soft_cap=0.7),
    "alibi": dict(alibi_slopes=jnp.asarray([0.5, 0.25, 0.125, 0.0625],
                                           jnp.float32)),
    "sinks": dict(sinks=jnp.asarray([0.3, -1.0, 2.0, 0.0], jnp.float32)),
    "scale": dict(scale=0.3),
}


@pytest.mark.parametrize("impl, tiling", IMPLS[1:], ids=IMPL_IDS[1:])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_score_and_mask_options_match_oracle(variant, impl, tiling):
  case = CASES[1]
  kwargs = VARIANTS[variant]
  q, k, v, lengths = _inputs(case, jnp.float32, seed=3)
  want = _oracle(q, k, v, lengths, **kwargs)
  ours = _run(impl, q, _poison(k, lengths), _poison(v, lengths), lengths,
              tiling, **kwargs)
  _assert_close(ours, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_within_the_rule(dtype):
  case = DecodeCase(2, 2, 64, 8, 2, 64, (64, 31))
  q, k, v, lengths = _inputs(case, dtype, seed=4)
  up = lambda x: x.astype(jnp.float32)
  exact = _oracle(up(q), up(k), up(v), lengths)
  naive = _oracle(q, k, v, lengths)
  ours = _run("triton", q, _poison(k, lengths), _poison(v, lengths), lengths,
              SMALL_TILING)
  assert ours[0].dtype == dtype
  assert_within_rule("out", ours[0], exact[0], naive[0])
  assert_within_rule("lse", ours[1], exact[1], naive[1])


def test_lengths_and_tables_are_traced_one_compile_serves_a_loop():
  case = CASES[0]
  q, k, v, _ = _inputs(case, jnp.float32)
  k_pages, tables = _paged(k, 8, seed=5)
  v_pages, _ = _paged(v, 8, seed=5)
  traces = []

  @jax.jit
  def step(q, lengths, tables):
    traces.append(1)
    return jax_flash.decode_attention(q, k_pages, v_pages, lengths,
                                      block_tables=tables)

  for lengths in ([1, 2, 3], [5, 17, 37], [37, 37, 37]):
    lengths = jnp.asarray(lengths, jnp.int32)
    got = step(q, lengths, tables)
    want, _ = _oracle(q, k, v, lengths)
    _assert_close([got], [want])
  assert len(traces) == 1


def test_rows_before_position_zero_give_zero():
  case = DecodeCase(1, 4, 16, 2, 1, 16, (2,))
  q, k, v, lengths = _inputs(case, jnp.float32)
  out, lse = _run("triton", q, k, v, lengths)
  np.testing.assert_array_equal(np.asarray(out[0, :2]), 0.0)
  assert np.all(np.isneginf(np.asarray(lse[0, :2])))
  assert np.all(np.isfinite(np.asarray(out[0, 2:])))


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_write_kv_cache_writes_only_the_new_rows(paged):
  batch, capacity, kv_heads, dim, t = 3, 24, 2, 8, 3
  keys = jax.random.split(jax.random.key(6), 4)
  cache_k = jax.random.normal(keys[0], (batch, capacity, kv_heads, dim))
  cache_v = jax.random.normal(keys[1], (batch, capacity, kv_heads, dim))
  new_k = jax.random.normal(keys[2], (batch, t, kv_heads, dim))
  new_v = jax.random.normal(keys[3], (batch, t, kv_heads, dim))
  # The last sequence's write runs past the capacity, the first's starts
  # before 0 (positions traced): those rows drop, none wraps round.
  positions = jnp.asarray([-2, 7, capacity - 1], jnp.int32)
  want_k, want_v = np.array(cache_k), np.array(cache_v)
  for b, p in enumerate(np.asarray(positions)):
    for i in range(t):
      if 0 <= p + i < capacity:
        want_k[b, p + i] = new_k[b, i]
        want_v[b, p + i] = new_v[b, i]
  if not paged:
    got = jax.jit(jax_flash.write_kv_cache, donate_argnums=(0, 1))(
        cache_k, cache_v, new_k, new_v, positions)
    chex.assert_trees_all_equal(tuple(map(np.asarray, got)), (want_k, want_v))
    return
  k_pages, tables = _paged(cache_k, 8, seed=7)
  v_pages, _ = _paged(cache_v, 8, seed=7)
  got_k, got_v = jax.jit(jax_flash.write_kv_cache)(
      k_pages, v_pages, new_k, new_v, positions, block_tables=tables)
  want_pages_k, _ = _paged(jnp.asarray(want_k), 8, seed=7)
  want_pages_v, _ = _paged(jnp.asarray(want_v), 8, seed=7)
  # Spare pages (NaN) untouched too: compare with NaN equal to NaN.
  np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_pages_k))
  np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_pages_v))


def test_write_kv_cache_refuses_concrete_negative_positions():
  cache = jnp.zeros((2, 8, 1, 4))
  new = jnp.ones((2, 3, 1, 4))
  with pytest.raises(ValueError, match=r"positions must be non-negative"):
    jax_flash.write_kv_cache(cache, cache, new, new, jnp.array([-1, 6]))


def test_generation_loop_equals_full_attention():
  """Prefill then token by token over a paged cache through write_kv_cache
  and decode_attention: each step's rows equal causal attention over the
  whole sequence."""
  batch, total, heads, kv_heads, dim, page = 2, 12, 4, 2, 16, 4
  keys = jax.random.split(jax.random.key(8), 3)
  q = jax.random.normal(keys[0], (batch, total, heads, dim))
  k = jax.random.normal(keys[1], (batch, total, kv_heads, dim))
  v = jax.random.normal(keys[2], (batch, total, kv_heads, dim))
  want = jax_flash.flash_attention(q, k, v, is_causal=True,
                                   implementation="xla")
  pages_per_seq = total // page
  tables = jnp.asarray(np.random.default_rng(9).permutation(
      batch * pages_per_seq).reshape(batch, pages_per_seq), jnp.int32)
  cache = jnp.full((batch * pages_per_seq, page, kv_heads, dim), jnp.nan)
  k_cache, v_cache = cache, cache
  prompt = 5
  k_cache, v_cache = jax_flash.write_kv_cache(
      k_cache, v_cache, k[:, :prompt], v[:, :prompt], jnp.zeros((batch,),
                                                                jnp.int32),
      block_tables=tables)
  step = jax.jit(lambda qt, kc, vc, n: jax_flash.decode_attention(
      qt, kc, vc, n, block_tables=tables, implementation="triton",
      interpret=True))
  got = step(q[:, :prompt], k_cache, v_cache, jnp.full((batch,), prompt))
  np.testing.assert_allclose(got, want[:, :prompt], atol=2e-5)
  for t in range(prompt, total):
    k_cache, v_cache = jax_flash.write_kv_cache(
        k_cache, v_cache, k[:, t:t + 1], v[:, t:t + 1],
        jnp.full((batch,), t, jnp.int32), block_tables=tables)
    got = step(q[:, t:t + 1], k_cache, v_cache, jnp.full((batch,), t + 1))
    np.testing.assert_allclose(got, want[:, t:t + 1], atol=2e-5)


def _default_tiling(**overrides):
  """`DecodeTiling.for_call` at 8 K/V heads, 4 rows, d=128 on 132 SMs."""
  args = dict(batch=1, num_kv_heads=8, rows=4, head_dim=128, capacity=4096,
              num_sms=132)
  return decode_kernel.DecodeTiling.for_call(**(args | overrides))


def test_default_tiling_fills_the_gpu():
  """One sequence: one wave of programs (two in pages). Several: up to
  four waves of spans at least 32 tiles long (ragged lengths balance)."""
  for batch, capacity, splits in ((1, 131072, 16), (1, 32768, 16),
                                  (8, 32768, 8), (16, 16384, 4),
                                  (4, 65536, 16), (64, 4096, 1)):
    tiling = _default_tiling(batch=batch, capacity=capacity)
    assert tiling.num_splits == splits, (batch, capacity, tiling)
  assert _default_tiling(capacity=131072, paged=True).num_splits == 33
  short = _default_tiling(num_kv_heads=1, rows=1, capacity=300)
  assert short.num_splits == 1 and short.block_k == 128
  assert _default_tiling(num_kv_heads=1, rows=1, capacity=20).block_k == 32
  # d=256: 64 positions a step, so that three stages fit in shared memory.
  wide = _default_tiling(batch=8, head_dim=256, capacity=32768)
  assert wide.block_k == 64 and wide.num_stages == 3


ERRORS = [
    ("cache_lengths", dict(cache_lengths=jnp.ones((2,), jnp.int32)),
     ValueError),
    ("cache_lengths", dict(cache_lengths=jnp.ones((3,), jnp.float32)),
     TypeError),
    ("cache_lengths", dict(cache_lengths=jnp.asarray([1, 2, 99])), ValueError),
    ("block_tables", dict(block_tables=jnp.zeros((3, 4), jnp.float32)),
     TypeError),
    ("num_heads", dict(query=jnp.ones((3, 1, 3, 16))), ValueError),
    ("head_dim", dict(query=jnp.ones((3, 1, 4, 8))), ValueError),
    ("same dtype", dict(query=jnp.ones((3, 1, 4, 16), jnp.bfloat16)),
     TypeError),
    ("batch size", dict(query=jnp.ones((2, 1, 4, 16))), ValueError),
    ("rank 4", dict(key_cache=jnp.ones((3, 20, 16))), ValueError),
]


@pytest.mark.parametrize("match, change, error", ERRORS,
                         ids=[e[0] for e in ERRORS])
def test_bad_arguments_name_the_argument(match, change, error):
  args = dict(query=jnp.ones((3, 1, 4, 16)), key_cache=jnp.ones((3, 20, 2, 16)),
              value_cache=jnp.ones((3, 20, 2, 16)),
              cache_lengths=jnp.asarray([1, 2, 3]))
  args.update(change)
  if "key_cache" in change:
    args["value_cache"] = change["key_cache"]
  with pytest.raises(error, match=match):
    jax_flash.decode_attention(**args)


def test_page_out_of_range_is_named():
  q = jnp.ones((2, 1, 4, 16))
  pages = jnp.ones((5, 4, 2, 16))
  tables = jnp.asarray([[0, 1, 9], [2, 3, 4]], jnp.int32)
  with pytest.raises(ValueError, match=r"block_tables\[0, 2\] = 9"):
    jax_flash.decode_attention(q, pages, pages, jnp.asarray([12, 12]),
                               block_tables=tables)
  # The same entry unread (sequence 0 is 8 long) is fine.
  jax_flash.decode_attention(q, pages, pages, jnp.asarray([8, 12]),
                             block_tables=tables)


GPU_CASES = [
    (DecodeCase(4, 1, 8192, 32, 8, 128, (8192, 1, 4097, 6000)), 0),
    (DecodeCase(2, 4, 16384, 32, 8, 128, (16384, 333)), 0),
    (DecodeCase(3, 1, 4096, 16, 2, 64, (4096, 77, 2048)), 16),
    (DecodeCase(2, 3, 4096, 8, 1, 256, (4096, 1000)), 64),
    (DecodeCase(2, 1, 2048, 8, 8, 96, (2048, 513)), 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case, page_size", GPU_CASES,
                         ids=[f"{c}-p{p}" for c, p in GPU_CASES])
def test_decode_on_gpu_within_the_rule(case, page_size):
  q, k, v, lengths = _inputs(case, jnp.bfloat16, seed=10)
  up = lambda x: x.astype(jnp.float32)
  exact = jax.jit(_oracle)(up(q), up(k), up(v), lengths)
  naive = jax.jit(_oracle)(q, k, v, lengths)
  k, v = _poison(k, lengths), _poison(v, lengths)
  tables = None
  if page_size:
    k, tables = _paged(k, page_size, seed=11)
    v, _ = _paged(v, page_size, seed=11)
  run = jax.jit(lambda q, k, v, n, t: jax_flash.decode_attention(
      q, k, v, n, block_tables=t, implementation="triton",
      return_residual=True))
  out, lse = run(q, k, v, lengths, tables)
  assert_within_rule("out", out, exact[0], naive[0])
  assert_within_rule("lse", lse, exact[1], naive[1])


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_shard_map_over_the_batch(check_vma):
  """Data parallel decoding inside a user's shard_map, with JAX's default
  check_vma=True too: the kernel declares how its outputs vary."""
  from jax.sharding import Mesh, PartitionSpec
  case = CASES[0]
  q, k, v, lengths = _inputs(case, jnp.float32, seed=12)
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  spec = PartitionSpec("data")
  run = jax.jit(jax.shard_map(
      lambda q, k, v, n: jax_flash.decode_attention(
          q, k, v, n, implementation="triton", interpret=True,
          return_residual=True),
      mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec),
      check_vma=check_vma))
  _assert_close(run(q, _poison(k, lengths), _poison(v, lengths), lengths),
                _oracle(q, k, v, lengths))
