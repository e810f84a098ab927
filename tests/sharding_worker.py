"""Multi-device checks of `jax_flash.sharding`, run in a subprocess.

JAX fixes the number of CPU devices when it first initialises, and other test
files initialise it with one. `tests/test_sharding.py` therefore runs this
file as a script with `XLA_FLAGS=--xla_force_host_platform_device_count=8`
(`run_in_subprocesses`); it prints one JSON line per check: {"name",
"status": ok|fail|skip, "detail", "seconds"}. Another test module's `CHECKS`
run the same way with `--module` (tests/test_transformations.py's).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python tests/sharding_worker.py [--module tests.x] [check names...]
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Callable

if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

import jax_flash
from jax_flash import sharding
from jax_flash.sharding import (ring_attention, sequence_parallel_attention,
                                zigzag_indices)
from tests.attention_checks import Case, check_against_reference

CHECKS: dict[str, Callable[[], dict]] = {}
F32_TOL = 2e-5  # outputs and gradients, relative to the reference's magnitude
NUM_DEVICES = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_in_subprocesses(names, *, module: str | None = None,
                        num_workers: int = 2) -> tuple[dict, str]:
  """Runs the checks `names` of this file's `CHECKS` (or `module`'s), each
  process with NUM_DEVICES CPU devices, `num_workers` processes at once.

  Returns ({name: result}, the failed processes' stderr).
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count="
                        f"{NUM_DEVICES}"))
  flags = ["--module", module] if module else []
  workers = [
      subprocess.Popen(
          [sys.executable, os.path.join(ROOT, "tests", "sharding_worker.py"),
           *flags, *names[i::num_workers]],
          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True)
      for i in range(num_workers)]
  results, errors = {}, []
  for worker in workers:
    stdout, stderr = worker.communicate(timeout=900)
    for line in stdout.splitlines():
      if line.startswith("{"):
        result = json.loads(line)
        results[result["name"]] = result
    if worker.returncode:
      errors.append(f"worker exited with {worker.returncode}:\n"
                    + stderr[-4000:])
  return results, "\n".join(errors)


def _check(name):
  def register(fn):
    CHECKS[name] = fn
    return fn
  return register


def _mesh(num_devices: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:num_devices]), ("sp",))


def _summary(errors):
  """JSON-able errors: float32 gives err, low precision (err, yardstick)."""
  return {k: (float(v) if np.ndim(v) == 0 else [float(x) for x in v])
          for k, v in errors.items()}


def _sequence_parallel(num_devices, **kwargs):
  """`(q, k, v) -> (out, lse)` on global arrays, jitted."""
  mesh = _mesh(num_devices)
  return jax.jit(lambda q, k, v: sequence_parallel_attention(
      q, k, v, mesh=mesh, axis_name="sp", return_residual=True, **kwargs))


# ---------------------------------------------------------------------------
# Both strategies against the single-device reference: outputs, lse and all
# gradients under a random cotangent of (out, lse), float32 and bfloat16.

GQA = Case(batch=2, q_len=64, kv_len=64, num_heads=4, num_kv_heads=2,
           head_dim=16)


def _strategy_check(num_devices, strategy, is_causal, load_balance,
                    dtype=jnp.float32, case=GQA, **kwargs):
  attention = _sequence_parallel(num_devices, strategy=strategy,
                                 is_causal=is_causal,
                                 load_balance=load_balance,
                                 implementation="xla", **kwargs)
  return _summary(check_against_reference(attention, case, dtype,
                                          is_causal=is_causal,
                                          f32_tol=F32_TOL))


# The grid's 8-device half runs under `pytest -m slow` (CI's ten minutes):
# the 4-device half takes every strategy and layout, and 8 devices stay in
# the default run with "ring-p8-causal-zigzag-scale-mha".
SLOW_CHECKS = set()
for _p in (4, 8):
  for _strategy in sharding.STRATEGIES:
    for _causal, _balance in ((False, False), (True, False), (True, True)):
      _name = (f"{_strategy}-p{_p}-{'causal' if _causal else 'full'}"
               f"{'-zigzag' if _balance else ''}")
      _check(_name)(functools.partial(_strategy_check, _p, _strategy,
                                      _causal, _balance))
      # p=8, and causal without the zig-zag (which the default's zig-zag
      # causal checks cover), with -m slow: CI's ten minutes.
      if _p == 8 or (_causal and not _balance):
        SLOW_CHECKS.add(_name)

_check("ring-p2-causal-zigzag")(functools.partial(
    _strategy_check, 2, "ring", True, True))
_check("ring-p4-causal-zigzag-bf16")(functools.partial(
    _strategy_check, 4, "ring", True, True, jnp.bfloat16))
# Non-causal attention ignores load_balance (the layout stays contiguous).
_check("ring-p4-full-load_balance-ignored")(functools.partial(
    _strategy_check, 4, "ring", False, True))


@_check("ring-p8-causal-zigzag-scale-mha")
def _custom_scale():
  attention = _sequence_parallel(8, strategy="ring", is_causal=True,
                                 implementation="xla", scale=0.3)
  return _summary(check_against_reference(
      attention, Case(1, 32, 32, 2, 2, 32), jnp.float32, is_causal=True,
      scale=0.3, f32_tol=F32_TOL))


@_check("ring-p4-cross-attention")
def _cross_attention():
  """Non-causal, kv_len != q_len (different shard lengths)."""
  return _strategy_check(4, "ring", False, False,
                         case=Case(1, 32, 64, 4, 1, 16))


@_check("ring-p4-causal-zigzag-triton")
def _triton_ring():
  """The Pallas kernel (interpret mode) in every pair, forward and backward."""
  attention = _sequence_parallel(4, strategy="ring", is_causal=True,
                                 load_balance=True, implementation="triton")
  errors = check_against_reference(attention, Case(1, 128, 128, 2, 1, 16),
                                   jnp.float32, is_causal=True,
                                   f32_tol=F32_TOL)
  return _summary(errors)


@_check("all_gather-p4-full-triton")
def _triton_all_gather():
  attention = _sequence_parallel(4, strategy="all_gather", is_causal=False,
                                 implementation="triton")
  errors = check_against_reference(attention, Case(1, 64, 64, 2, 1, 16),
                                   jnp.float32, is_causal=False,
                                   f32_tol=F32_TOL)
  return _summary(errors)


@_check("explicit-mesh")
def _explicit_mesh():
  """A `jax.make_mesh` mesh (Explicit axes) takes unsharded inputs too."""
  mesh = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4])
  attention = jax.jit(lambda q, k, v: sequence_parallel_attention(
      q, k, v, mesh=mesh, axis_name="sp", is_causal=True,
      return_residual=True, implementation="xla"))
  errors = check_against_reference(attention, GQA, jnp.float32,
                                   is_causal=True, f32_tol=F32_TOL)
  return _summary(errors)


# ---------------------------------------------------------------------------
# ring_attention inside a user's shard_map.


def _user_shard_map(is_causal, load_balance):
  mesh = _mesh(4)
  spec = PartitionSpec(None, "sp", None, None)
  lse_spec = PartitionSpec(None, "sp", None)

  @jax.jit
  def attention(q, k, v):
    if load_balance:  # the user lays tokens out zig-zag, once
      order = zigzag_indices(q.shape[1], 4)
      q, k, v = q[:, order], k[:, order], v[:, order]
    body = functools.partial(ring_attention, axis_name="sp",
                             is_causal=is_causal, return_residual=True,
                             implementation="xla", load_balance=load_balance)
    # check_vma=True (the default): the ring's types must be right.
    out, lse = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec),
                             out_specs=(spec, lse_spec))(q, k, v)
    if load_balance:
      inverse = jnp.argsort(zigzag_indices(q.shape[1], 4))
      out, lse = out[:, inverse], lse[:, inverse]
    return out, lse

  errors = check_against_reference(attention, GQA, jnp.float32,
                                   is_causal=is_causal, f32_tol=F32_TOL)
  return _summary(errors)


_check("user-shard_map-causal")(functools.partial(_user_shard_map, True,
                                                  False))
_check("user-shard_map-causal-zigzag")(functools.partial(_user_shard_map,
                                                         True, True))


# ---------------------------------------------------------------------------
# Variant arguments across shards. `sharding` adjusts them per pair (kv
# segment ids travel, global lengths become per-shard prefixes, windows get a
# per-pair q_offset); the result must equal one-device attention with the
# same arguments.


@_check("backward_lowers_without_scatters")
def _no_scatters():
  """XLA 0.11.2's SPMD partitioner segfaults compiling scatters (what `.at[]`
  makes) inside the sweeps' shard_map: seen on 2 H200s, and on CPU host
  devices under 0.11.2 (CI's 0.10.2 compiles them). The sweeps write row
  ranges with dynamic-update-slices; the load-balanced causal layout gives
  partial ranges, the case that needs a write at all."""
  q = k = v = jnp.ones((1, 64, 2, 16))
  found = {}
  for strategy in ("ring", "all_gather"):
    attention = lambda q, k, v, s=strategy: sequence_parallel_attention(
        q, k, v, mesh=_mesh(4), axis_name="sp", is_causal=True, strategy=s,
        load_balance=True, implementation="xla")
    loss = lambda q, k, v, a=attention: jnp.sum(a(q, k, v))
    text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).as_text()
    found[strategy] = (text.count("stablehlo.scatter"),
                       text.count("dynamic_update_slice"))
  assert all(s == 0 and u > 0 for s, u in found.values()), found
  return found


@_check("ring_backward_runs_no_forward_kernel")
def _no_forward_in_backward():
  """The ring's backward gets each pair's share from the merged (out, lse)
  (`flash_attention_backward`): the forward kernel appears in the gradient's
  program as often as in the forward's (before, once more per non-local
  pair: 9 against 5 here)."""
  import re
  attention = lambda q, k, v: sequence_parallel_attention(
      q, k, v, mesh=_mesh(4), axis_name="sp", is_causal=True,
      load_balance=True, implementation="triton", interpret=True)
  q = k = v = jnp.ones((1, 128, 2, 16))
  count = lambda fn: len(re.findall(r"name=flash_forward\b",
                                    str(jax.make_jaxpr(fn)(q, k, v))))
  loss = lambda q, k, v: jnp.sum(attention(q, k, v))
  forward, gradient = count(attention), count(jax.grad(loss, (0, 1, 2)))
  assert forward > 0 and gradient == forward, (forward, gradient)
  return {"forward kernels": forward, "in the gradient": gradient}


def _variant_inputs(seed=0):
  b, t, n, nk, d = 2, 64, 4, 2, 16
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (b, t, n, d))
  k = jax.random.normal(keys[1], (b, t, nk, d))
  v = jax.random.normal(keys[2], (b, t, nk, d))
  d_out = jax.random.normal(keys[3], q.shape)
  d_lse = jax.random.normal(keys[4], (b, t, n))
  # Three segments of uneven length in row 0, two in row 1.
  segments = jnp.stack([jnp.searchsorted(jnp.array([13, 40]), jnp.arange(t),
                                         side="right"),
                        jnp.searchsorted(jnp.array([29]), jnp.arange(t),
                                         side="right")]).astype(jnp.int32)
  return q, k, v, d_out, d_lse, segments


VARIANTS = {
    "segments": lambda seg: {"segment_ids": seg},
    "segments-pair": lambda seg: {"segment_ids": (seg, seg[:, ::-1])},
    "lengths": lambda seg: {"query_seq_lengths": jnp.array([64, 37]),
                            "key_value_seq_lengths": jnp.array([50, 21])},
    "window": lambda seg: {"local_window_size": (9, 3)},
    "softcap": lambda seg: {"logits_soft_cap": 2.0},
}


def _variant_check(name, strategy, is_causal):
  q, k, v, d_out, d_lse, seg = _variant_inputs()
  kwargs = VARIANTS[name](seg)
  run = _sequence_parallel(4, strategy=strategy, is_causal=is_causal,
                           implementation="xla", **kwargs)
  got_fwd, got_vjp = jax.vjp(run, q, k, v)
  got = (*got_fwd, *got_vjp((d_out, d_lse)))
  want_fwd, want_vjp = jax.vjp(
      lambda q, k, v: jax_flash.attention_reference(
          q, k, v, is_causal=is_causal, return_residual=True, **kwargs),
      q, k, v)
  want = (*want_fwd, *want_vjp((d_out, d_lse)))
  errors = {}
  for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    a, b = np.asarray(a), np.asarray(b)
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
      raise AssertionError(f"{label}: non-finite entries differ")
    finite = np.isfinite(b)
    errors[label] = float(np.max(np.abs(a[finite] - b[finite]), initial=0))
    assert errors[label] <= F32_TOL * max(1.0, np.max(np.abs(b[finite]))), (
        label, errors[label])
  return errors


# Causal runs the zig-zag layout (sequence_parallel_attention's default), the
# harder case for positions; the non-causal all-gather is a single call.
_VARIANT_CASES = [
    ("segments", "ring", True), ("segments", "all_gather", False),
    ("segments-pair", "ring", False), ("segments-pair", "all_gather", True),
    ("lengths", "ring", True), ("lengths", "all_gather", False),
    ("window", "ring", True), ("window", "ring", False),
    ("window", "all_gather", False), ("softcap", "ring", True),
]
# By default each variant once, on the ring (CI's ten minutes); the rest
# with `-m slow`.
_seen_variants = set()
for _variant, _strategy, _causal in _VARIANT_CASES:
  _suffix = f"{_variant}-{_strategy}-{'causal' if _causal else 'full'}"
  _check(f"variant-{_suffix}")(functools.partial(
      _variant_check, _variant, _strategy, _causal))
  if _variant in _seen_variants or _strategy != "ring":
    SLOW_CHECKS.add(f"variant-{_suffix}")
  else:
    _seen_variants.add(_variant)


# ---------------------------------------------------------------------------
# Memory: the ring never holds the whole K/V on one device.


def _temp_bytes(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().memory_analysis(
      ).temp_size_in_bytes


def _with_grads(fn):
  def run(q, k, v):
    out, vjp = jax.vjp(fn, q, k, v)
    return vjp(out)
  return run


@_check("memory")
def _memory():
  """Compiled temp bytes per device against an explicit budget.

  Budget = one pair's own temp (`flash_attention` on a query shard and a
  K/V shard, compiled alone) + the K/V shard in hand and the next one in
  flight + 3 query shards (float32 accumulator, merged copy, kernel output)
  + 15%; the backward adds the dK/dV accumulators in hand and in flight and
  one more query shard (dQ). Positive control: the all-gather strategy, which
  does hold the whole K/V, exceeds the size of the whole K/V.
  """
  b, t, n, d = 1, 512, 2, 64
  full = jax.ShapeDtypeStruct((b, t, n, d), jnp.float32)
  whole_kv = 2 * full.size * 4
  pair = lambda q, k, v: jax_flash.flash_attention(q, k, v,
                                                   implementation="xla")
  budget = {}
  for p in (4, 8):
    shard = jax.ShapeDtypeStruct((b, t // p, n, d), jnp.float32)
    shard_bytes = shard.size * 4
    kv_shard = 2 * shard_bytes  # one K shard and one V shard
    budget[p, "fwd"] = 1.15 * (_temp_bytes(pair, shard, shard, shard)
                               + 2 * kv_shard + 3 * shard_bytes)
    budget[p, "fwd+bwd"] = 1.15 * (
        _temp_bytes(_with_grads(pair), shard, shard, shard)
        + 4 * kv_shard + 4 * shard_bytes)

  def temp(p, strategy, causal, mode):
    fn = lambda q, k, v: sequence_parallel_attention(
        q, k, v, mesh=_mesh(p), axis_name="sp", strategy=strategy,
        is_causal=causal, implementation="xla")
    return _temp_bytes(fn if mode == "fwd" else _with_grads(fn), full, full,
                       full)

  report = {}
  for p, causal in ((4, True), (8, True), (8, False)):
    for mode in ("fwd", "fwd+bwd"):
      key = f"ring-p{p}-{'causal' if causal else 'full'}-{mode}"
      report[key] = temp(p, "ring", causal, mode)
      assert report[key] <= budget[p, mode], (key, report[key],
                                              budget[p, mode])
    # At P = 8 the whole K/V (16 shards) exceeds all the ring needs in the
    # forward.
    if p == 8:
      assert report[f"ring-p8-{'causal' if causal else 'full'}-fwd"] < whole_kv
  for p in (4, 8):  # positive control: the all-gather holds the whole K/V
    report[f"all_gather-p{p}-causal-fwd"] = gathered = temp(
        p, "all_gather", True, "fwd")
    assert gathered >= whole_kv, (p, gathered, whole_kv)
  for mode in ("fwd", "fwd+bwd"):  # falls as 1/P
    ratio = report[f"ring-p8-causal-{mode}"] / report[f"ring-p4-causal-{mode}"]
    report[f"ring p8/p4 causal {mode}"] = round(ratio, 3)
    assert ratio <= 0.6, (mode, ratio)
  report["budgets"] = {f"p{p}-{mode}": int(v)
                       for (p, mode), v in budget.items()}
  report["whole K/V"] = whole_kv
  return report


# ---------------------------------------------------------------------------
# flash_attention inside a pmap training step.


@_check("pmap-training-step")
def _pmap_training_step():
  """One SGD step of a tiny attention model, data-parallel over 4 devices
  with `jax.pmap` (Pallas kernel in interpret mode), equals the same step
  computed on one device."""
  devices, t, e, n, d = 4, 32, 16, 2, 16
  keys = jax.random.split(jax.random.key(7), 6)
  params = {
      "qkv": jax.random.normal(keys[0], (e, 3 * n * d)) * e ** -0.5,
      "out": jax.random.normal(keys[1], (n * d, e)) * (n * d) ** -0.5,
  }
  x = jax.random.normal(keys[2], (devices, 1, t, e))
  y = jax.random.normal(keys[3], (devices, 1, t, e))

  def loss_fn(params, x, y, implementation):
    qkv = (x @ params["qkv"]).reshape(x.shape[0], t, 3, n, d)
    h = jax_flash.flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                  is_causal=True,
                                  implementation=implementation)
    pred = h.reshape(x.shape[0], t, n * d) @ params["out"]
    return jnp.mean((pred - y) ** 2)

  def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  @functools.partial(jax.pmap, axis_name="batch")
  def step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, "triton")
    grads = jax.lax.pmean(grads, "batch")
    return sgd(params, grads), jax.lax.pmean(loss, "batch")

  replicated = jax.tree.map(lambda p: jnp.stack([p] * devices), params)
  new_params, loss = step(replicated, x, y)
  want_loss, want_grads = jax.value_and_grad(loss_fn)(
      params, x.reshape(devices, t, e), y.reshape(devices, t, e), "xla")
  want = sgd(params, want_grads)
  errors = {"loss": float(jnp.abs(loss[0] - want_loss))}
  for name in params:
    got = new_params[name]
    assert all(np.array_equal(got[0], got[i]) for i in range(devices))
    errors[name] = float(jnp.max(jnp.abs(got[0] - want[name])))
    assert errors[name] <= 1e-5, (name, errors[name])
  assert errors["loss"] <= 1e-5, errors
  return errors


def main(args):
  assert jax.device_count() >= NUM_DEVICES, (
      f"needs {NUM_DEVICES} devices, got {jax.device_count()}: set XLA_FLAGS="
      f"--xla_force_host_platform_device_count={NUM_DEVICES}")
  checks = CHECKS
  if args[:1] == ["--module"]:
    checks = importlib.import_module(args[1]).CHECKS
    args = args[2:]
  for name in args or checks:
    start = time.perf_counter()
    try:
      status, detail = "ok", checks[name]()
    except Exception:  # reported to the pytest side, which fails the test
      status, detail = "fail", traceback.format_exc()
    print(json.dumps({"name": name, "status": status, "detail": detail,
                      "seconds": round(time.perf_counter() - start, 2)}),
          flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
