"""Sequence-parallel attention (`jax_flash.sharding`): ring and all-gather.

The multi-device checks need 8 CPU devices, which JAX only provides when
XLA_FLAGS is set before it initialises; this pytest process already has one
device. They run in `tests/sharding_worker.py` subprocesses (two at once, to
use both cores of CI) and each check is reported here as its own test. The
single-device pieces (merge, layout, errors, a one-device mesh) run here.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh

import jax_flash
from jax_flash import sharding
from jax_flash.sharding import sequence_parallel_attention
from tests import sharding_worker
from tests.attention_checks import Case, check_against_reference

# Its module-scoped fixtures (a child process, a trained model) are built
# once: every test of the file runs in one xdist worker (pyproject).
pytestmark = pytest.mark.xdist_group("test_sharding")

# Two subprocesses in a plain run; one under pytest-xdist, whose other
# process already keeps the second core (and memory) busy.
NUM_WORKERS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


@pytest.fixture(scope="module")
def worker_results(request):
  """Runs the multi-device checks this session selected (`-m slow` adds
  `sharding_worker.SLOW_CHECKS`) in subprocesses; {name: result}."""
  names = [item.callspec.params["name"] for item in request.session.items
           if getattr(item, "originalname", None) == "test_multi_device"]
  return sharding_worker.run_in_subprocesses(names, num_workers=NUM_WORKERS)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow)
    if name in sharding_worker.SLOW_CHECKS else name
    for name in sharding_worker.CHECKS])
def test_multi_device(name, worker_results):
  results, worker_errors = worker_results
  if name not in results:
    pytest.fail(f"the worker did not report {name!r}:\n{worker_errors}")
  result = results[name]
  assert result["status"] == "ok", result["detail"]


# ---------------------------------------------------------------------------
# Merging by log-sum-exp.


def test_merge_equals_attention_over_the_union_of_keys():
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 16, 4, 16))
  k = jax.random.normal(keys[1], (2, 40, 2, 16))
  v = jax.random.normal(keys[2], (2, 40, 2, 16))
  attend = lambda k, v: jax_flash.flash_attention(
      q, k, v, return_residual=True, implementation="xla")
  whole = attend(k, v)
  merged = sharding._merge(*attend(k[:, :25], v[:, :25]),
                           *attend(k[:, 25:], v[:, 25:]))
  np.testing.assert_allclose(merged[0], whole[0], atol=1e-6)
  np.testing.assert_allclose(merged[1], whole[1], atol=1e-6)


def test_merge_of_empty_rows_is_zero_and_minus_inf():
  out = jnp.ones((1, 3, 2, 4))
  lse = jnp.array([[[0.5, -jnp.inf], [-jnp.inf, -jnp.inf], [1.0, 2.0]]])
  empty_out = jnp.zeros_like(out)
  empty_lse = jnp.full_like(lse, -jnp.inf)
  merged_out, merged_lse = sharding._merge(empty_out, empty_lse, empty_out,
                                           empty_lse)
  np.testing.assert_array_equal(merged_out, 0.0)  # not NaN
  np.testing.assert_array_equal(merged_lse, -jnp.inf)
  merged_out, merged_lse = sharding._merge(empty_out, empty_lse, out, lse)
  # Rows with keys keep them; rows with none stay 0 with lse -inf.
  np.testing.assert_array_equal(merged_lse, lse)
  np.testing.assert_array_equal(merged_out, jnp.broadcast_to(
      jnp.where(jnp.isinf(lse)[..., None], 0.0, 1.0), out.shape))


def test_rescale_is_zero_not_nan_for_empty_rows():
  w = sharding._rescale(jnp.array([-jnp.inf, -jnp.inf, 0.0]),
                        jnp.array([-jnp.inf, 1.0, 0.0]))
  np.testing.assert_array_equal(w, [0.0, 0.0, 1.0])


# ---------------------------------------------------------------------------
# The zig-zag layout.


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
def test_zigzag_moves_produce_zigzag_indices(num_shards):
  """The two ppermutes of `_to_zigzag`, simulated on chunk labels."""
  p = num_shards
  natural = [[2 * e, 2 * e + 1] for e in range(p)]  # chunks per device
  even, odd = sharding._zigzag_moves(p)
  got_even, got_odd = [None] * p, [None] * p
  for src, dst in even:
    got_even[dst] = natural[src][0]
  for src, dst in odd:
    got_odd[dst] = natural[src][1]
  zigzag = [[got_even[d], got_odd[d]] if d % 2 == 0 else
            [got_odd[d], got_even[d]] for d in range(p)]
  assert zigzag == [[d, 2 * p - 1 - d] for d in range(p)]
  chunk = 3
  order = np.asarray(sharding.zigzag_indices(2 * p * chunk, p))
  np.testing.assert_array_equal(
      order.reshape(p, 2, chunk)[:, :, 0] // chunk, zigzag)


def test_pair_calls_cover_exactly_the_causal_triangle():
  """Every (query chunk, key chunk) pair on or below the diagonal, once; the
  diagonal ones with a causal mask."""
  p = 4
  for zigzag in (False, True):
    for positional in (False, True):
      plan = sharding._Plan(
          axis_name="sp", num_shards=p, strategy="ring", zigzag=zigzag,
          is_causal=True, scale=None, implementation=None, block_sizes=None,
          interpret=None, local_window_size=(5, 0) if positional else None)
      starts = lambda d: plan.chunk_starts(d, 2)  # chunks of 1 or 2 tokens
      covered = []
      for me in range(p):
        for src in range(p):
          kind = (sharding._DIAG if src == me else
                  sharding._BEFORE if src < me else sharding._AFTER)
          for qs, ks, causal in sharding._pair_calls(plan, kind):
            for qc in qs:
              for kc in ks:
                # Inside one causal call on the device's own shard, a later
                # local chunk is a later position: masked out entirely.
                if causal and not positional and kc > qc:
                  continue
                covered.append((starts(me)[qc], starts(src)[kc], causal))
      chunk_len, num_chunks = (1, 2 * p) if zigzag else (2, p)
      want = sorted((q * chunk_len, k * chunk_len) for q in range(num_chunks)
                    for k in range(q + 1))
      assert sorted((q, k) for q, k, _ in covered) == want, (zigzag,
                                                               positional)
      assert all(causal for q, k, causal in covered if q == k)


# ---------------------------------------------------------------------------
# One device: the ring is one pair (the case whose cost is measured on a GPU).


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_single_device_mesh_matches_flash_attention(implementation):
  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  attention = jax.jit(lambda q, k, v: sequence_parallel_attention(
      q, k, v, mesh=mesh, axis_name="sp", is_causal=True,
      return_residual=True, implementation=implementation))
  check_against_reference(attention, Case(1, 40, 40, 4, 2, 16), jnp.float32,
                          is_causal=True)


# ---------------------------------------------------------------------------
# Errors.


def _qkv(t=24):
  return (jnp.ones((1, t, 2, 16)), jnp.ones((1, t, 1, 16)),
          jnp.ones((1, t, 1, 16)))


def test_sequence_not_divisible_by_the_mesh_axis():
  mesh = AbstractMesh((4,), ("sp",))
  with pytest.raises(ValueError, match=r"divisible by 8 .*\(1, 20, 2, 16\)"):
    sequence_parallel_attention(*_qkv(20), mesh=mesh, axis_name="sp",
                                is_causal=True)
  with pytest.raises(ValueError, match=r"divisible by 4 .*\(1, 18, 2, 16\)"):
    sequence_parallel_attention(*_qkv(18), mesh=mesh, axis_name="sp")


def test_global_arguments_are_checked_before_the_shards():
  """Lengths out of range, a value of another shape and a mesh axis that
  is not there: errors naming the argument and the global shapes (inside
  shard_map the lengths are traced and the shapes are the shards')."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  q, k, v = _qkv()
  run = functools.partial(sequence_parallel_attention, mesh=mesh,
                          implementation="xla")
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in "
                     r"\[0, 24\], got \[40\]"):
    run(q, k, v, axis_name="sp", key_value_seq_lengths=jnp.array([40]))
  with pytest.raises(ValueError, match=r"query_seq_lengths must lie"):
    run(q, k, v, axis_name="sp", query_seq_lengths=jnp.array([-1]))
  with pytest.raises(ValueError, match=r"value \(1, 12, 1, 16\)"):
    run(q, k, v[:, :12], axis_name="sp")
  with pytest.raises(ValueError, match=r"axis_name 'xx' is not an axis of "
                     r"the mesh \(its axes: \('sp',\)\)"):
    run(q, k, v, axis_name="xx")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"bias": jnp.zeros((1, 2, 24, 24))}, NotImplementedError, "bias"),
    ({"q_offset": 3}, NotImplementedError, "q_offset"),
    ({"dropout_rate": 0.1}, NotImplementedError, "dropout"),
    ({"strategy": "tree"}, ValueError, "strategy must be one of"),
    ({"window": 3}, TypeError, "unexpected keyword arguments: .'window'"),
])
def test_refused_arguments(kwargs, error, match):
  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  with pytest.raises(error, match=match):
    sequence_parallel_attention(*_qkv(), mesh=mesh, axis_name="sp",
                                implementation="xla", **kwargs)
