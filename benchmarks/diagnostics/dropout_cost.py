"""What each part of dropout's hash costs the Mosaic kernels (issue 39).

    python -m benchmarks.diagnostics.dropout_cost   # on an sm90 GPU

`benchmarks.masks`' "causal + dropout 0.1" row (bf16, 1 x 16k, 16 heads,
d=128) and its yardstick "causal", forward and fwd+bwd, with the masked
kernels' hash traced in other forms. Every form but the first gives wrong
bits: they are diagnostics of cost, never of the mask.

  as is           `masking.dropout_keep`: per weight the xor of a query
                  half and a key half, murmur3's multiply, xor-shift,
                  multiply, the compare and the select (7 ops); the
                  streamed side's half (the key's in the forward and dQ,
                  the query's in dK/dV) hashed again every step
  step half free  the streamed side's half taken at position 0 every step.
                  Then both halves, so the whole mask, are the same every
                  step and the compiler may hoist all of the hash out of
                  the step loop: it bounds what any cheaper hash could
                  save, not what the step's half alone costs (taking that
                  half during S's matmul instead, bit for bit the same,
                  gained nothing: NOTES.md)
  step half read  the streamed side's half taken at position 0 and xored
                  with the step's start: one op a value where hashing it
                  takes three, and still a new value every step, so the
                  weights' hash stays in the loop. Against "as is": what
                  halves computed outside the kernels and read per step
                  would save
  add form        as is, but the halves added instead of xored, with the
                  first multiply folded into each half ((a + b) M1 =
                  a M1 + b M1): 6 ops a weight, the step's half one
                  multiply dearer
  add form, free  both (hoisted as above)
  xor only        the halves' xor compared directly (3 ops a weight),
                  hoisted as above: the floor of any hash of two halves

Each form's kernels are compiled first (tracing under the form's patch),
then timed `--rounds` times in turn, each keeping its median.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import jax.numpy as jnp
from jax import lax

from benchmarks import common, masks, render
from pallas_kernels import compat, masking
from pallas_kernels.mosaic import dkdv, dq, forward_kernel

_KERNEL_MODULES = (forward_kernel, dq, dkdv)


def _from_zero(fn, start_index):
  """`fn` with its start argument (a position) replaced by 0."""
  def patched(*args):
    args = list(args)
    args[start_index] = 0
    return fn(*args)
  return patched


def _from_zero_xor_start(fn, start_index):
  """`fn` from position 0, its halves xored with the true start: one op a
  value that still changes every step, as a half read from memory would."""
  def patched(*args):
    start = jnp.asarray(args[start_index]).astype(jnp.uint32)
    return _from_zero(fn, start_index)(*args) ^ start
  return patched


def _times_m1(fn):
  return lambda *args: fn(*args) * jnp.uint32(masking._MIX_1)


def _add_form(query_hash, key_hash, rate):
  x = query_hash + key_hash
  x = x ^ lax.shift_right_logical(x, jnp.uint32(13))
  return x * jnp.uint32(masking._MIX_2) >= jnp.uint32(
      masking.dropout_threshold(rate))


def _xor_only(query_hash, key_hash, rate):
  return query_hash ^ key_hash >= jnp.uint32(masking.dropout_threshold(rate))


@contextlib.contextmanager
def hash_form(name: str):
  """The kernels traced inside take dropout's hash in form `name`."""
  free = name in ("step half free", "add form, free", "xor only")
  added = name.startswith("add form")
  with contextlib.ExitStack() as stack:
    for module in _KERNEL_MODULES:
      for attr, start_index in (("dropout_key_hashes", 0),
                                ("dropout_query_hashes", 3)):
        if not hasattr(module, attr):
          continue
        fn = getattr(module, attr)
        if free:
          fn = _from_zero(fn, start_index)
        elif name == "step half read":
          fn = _from_zero_xor_start(fn, start_index)
        if added:
          fn = _times_m1(fn)
        stack.enter_context(mock.patch.object(module, attr, fn))
    if added:
      stack.enter_context(mock.patch.object(masking, "dropout_keep_hashed",
                                            _add_form))
    if name == "xor only":
      stack.enter_context(mock.patch.object(masking, "dropout_keep_hashed",
                                            _xor_only))
    yield


FORMS = ("as is", "step half read", "step half free", "add form",
         "add form, free", "xor only")


def main(argv=None) -> int:
  compat.filter_known_warnings()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  masks.add_cell_arguments(parser)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out",
                      default="benchmarks/results/h200_dropout_cost.json")
  args = parser.parse_args(argv)
  if not compat.has_gpu():
    parser.error("times the Mosaic kernels: needs an sm90 GPU")
  table = masks.variants(args.seq, args.heads)
  shape = (1, args.seq, args.heads, args.head_dim)
  candidates = [("causal", None)] + [("causal + dropout 0.1", f)
                                     for f in FORMS]
  compiled = {}
  for mode in ("fwd", "fwd_bwd"):
    for variant, form in candidates:
      with hash_form(form) if form else contextlib.nullcontext():
        fn, inputs = masks.build(mode, shape, table[variant], False,
                                 "mosaic")
        compiled[mode, variant, form] = (fn.lower(*inputs).compile(),
                                         inputs)
  times = {key: [] for key in compiled}
  for r in range(args.rounds):
    for key in common.round_order(list(compiled), r):
      exe, inputs = compiled[key]
      times[key].append(common.time_fn(exe, *inputs, warmup=2,
                                       reps=args.reps))
  rows = []
  for (mode, variant, form), ms in times.items():
    ms = sorted(ms)[len(ms) // 2]
    rows.append(dict(mode=mode, variant=variant, hash_form=form or "",
                     seq_len=args.seq, num_heads=args.heads,
                     head_dim=args.head_dim, ms=ms, rounds=args.rounds))
  base = {r["mode"]: r["ms"] for r in rows if r["variant"] == "causal"}
  for r in rows:
    r["x_causal"] = base[r["mode"]] / r["ms"]
  result = {**common.run_header("benchmarks.diagnostics.dropout_cost", argv),
            "records": rows}
  print(render.write_results(
      args.out, result, ["mode", "variant", "hash form", "ms", "x causal"],
      [[r["mode"], r["variant"], r["hash_form"], f"{r['ms']:.3f}",
        f"{r['x_causal']:.3f}"] for r in rows]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
