"""Cross-lowers every Mosaic GPU kernel and option for CUDA, on any machine.

    python -m benchmarks.lower_mosaic

Lowers the forward (defaults, `overlap_scores`, `fence_softmax` +
`split_handover`, grid launch order, the persistent grid on and off,
tile-fastest launch, two consumers where three are the default, ring and
hardware-barrier turns, lean producers, P's row sum after P V, O's
lazy rescale on, off and at threshold 0), the backward (defaults,
`overlap_softmax`, the persistent grid, tile-fastest launch, no automatic
barriers, the fused dQ below head_dim 256, with and without them), and
the masked
forward and backward (defaults and `overlap_softmax`), at head dims 64, 128
and 256, causal or not, and prints one line per kernel; exits non-zero if
any fails. The test suite does the same under the CPU machines' JAX
(0.10.2); this script exists to run it under the GPU machine's JAX (0.11.2,
Python 3.12) before spending GPU time, since Mosaic GPU's API moves between
versions:

    python3.12 -m venv /tmp/venv0112
    /tmp/venv0112/bin/pip install jax==0.11.2 jaxlib==0.11.2 flax chex \\
        jaxtyping tqdm rich
    PYTHONPATH=. /tmp/venv0112/bin/python -m benchmarks.lower_mosaic
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jax_flash.masking import MaskSpec
from pallas_kernels.mosaic.backward import mosaic_backward
from pallas_kernels.mosaic.forward import mosaic_forward
from pallas_kernels.mosaic.masked import mosaic_forward_masked
from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked

FORWARD_OPTIONS = ({}, dict(overlap_scores=True),
                   dict(fence_softmax=True, split_handover=True),
                   dict(heavy_first=False, persistent=False),
                   dict(persistent=True, num_ctas=3),
                   dict(persistent=False),
                   dict(persistent=False, tile_fastest=True),
                   dict(num_consumers=2), dict(num_consumers=2, ring_turns=True),
                   dict(num_consumers=2, ring_turns=True, hw_turns=False),
                   dict(hw_turns=False),
                   dict(hw_turns=True), dict(hw_turns=True, persistent=False),
                   dict(lean_producer=True, num_consumers=2),
                   dict(lean_producer=True, num_consumers=2, persistent=False,
                        overlap_scores=True),
                   dict(sum_after_pv=True),
                   dict(sum_after_pv=True, persistent=False,
                        lean_producer=True, num_consumers=2),
                   dict(lazy_rescale=True, rescale_threshold=0.0),
                   dict(lazy_rescale=True, persistent=False),
                   dict(lazy_rescale=False),
                   dict(lazy_rescale=True, rescale_per_warp=False))
BACKWARD_OPTIONS = ({}, dict(overlap_softmax=True),
                    dict(persistent=True, num_ctas=3),
                    dict(persistent=False, tile_fastest=True),
                    dict(prefetch_lse=True),
                    dict(early_delta=True),
                    dict(early_delta=True, lean_producer=True, fused_dq=False),
                    dict(lean_producer=False, fused_dq=False))


def lowers(fn, *shapes) -> str | None:
  """None if `fn` lowers for CUDA on bfloat16 `shapes`, else the error."""
  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  except Exception as e:  # reported, the sweep goes on
    return f"{type(e).__name__}: {str(e)[:300]}"
  return None


def kernels(head_dim: int):
  """(name, fn, shapes) of every kernel variant at `head_dim`."""
  q, kv = (2, 512, 4, head_dim), (2, 768, 2, head_dim)
  lse = jax.ShapeDtypeStruct((2, 4, 512), jnp.float32)
  # Three consumers at q_len 512 = 2 * 192 + 128: a short last tile, whose
  # spare consumer skips its math by default (`skip_spare`).
  three = (dict(num_consumers=3), dict(num_consumers=3, skip_spare=False),
           dict(num_consumers=3, persistent=False, hw_turns=False))
  for causal in (False, True):
    for options in FORWARD_OPTIONS + (three if head_dim == 64 else ()):
      yield (f"forward d{head_dim} causal={causal} {options}",
             lambda q, k, v, c=causal, o=options: mosaic_forward(
                 q, k, v, scale=0.1, is_causal=c, **o), (q, kv, kv))
    fused = dict(fused_dq=True, block_q=128 if head_dim == 64 else 64,
                 merged_pieces=False)
    fused_forms = (fused,
                   dict(fused, stage_free_on_read=True, prefetch_lse=True),
                   dict(fused, deferred_dq=True, merged_pieces=True),
                   dict(fused, hw_ds_sync=True, deferred_dq=False))
    # Sᵀ issued a step ahead: the plain dK/dV kernel, where dK and dV take
    # one pass (d=64's 128-row Q tiles, either grid; d=128).
    ahead_forms = () if head_dim == 256 else (
        dict(scores_ahead=True, fused_dq=False, prefetch_stats=False,
             block_q=128 if head_dim == 64 else 64),
        dict(scores_ahead=True, persistent=True, num_ctas=3,
             prefetch_stats=False, block_q=128 if head_dim == 64 else 64,
             prefetch_lse=True))
    for options in BACKWARD_OPTIONS + ahead_forms + (
        fused_forms if head_dim < 256 else ()):
      yield (f"backward d{head_dim} causal={causal} {options}",
             lambda q, k, v, out, d_out, c=causal, o=options: mosaic_backward(
                 q, k, v, out, jnp.zeros(lse.shape, lse.dtype), d_out,
                 scale=0.1, is_causal=c, **o), (q, kv, kv, q, q))
  spec = MaskSpec(q_len=500, kv_len=700, is_causal=True, window=(64, 0))
  q, kv = (1, 500, 4, head_dim), (1, 700, 2, head_dim)
  yield (f"masked forward d{head_dim}",
         lambda q, k, v: mosaic_forward_masked(q, k, v, scale=0.1, spec=spec),
         (q, kv, kv))
  for options in BACKWARD_OPTIONS[:2]:  # no persistent ranged backward
    yield (f"masked backward d{head_dim} {options}",
           lambda q, k, v, out, d_out, o=options: mosaic_backward_masked(
               q, k, v, out, jnp.zeros((1, 4, 500), jnp.float32), d_out,
               scale=0.1, spec=spec, **o), (q, kv, kv, q, q))


def main() -> int:
  print(f"JAX {jax.__version__}", flush=True)
  failures = 0
  for head_dim in (64, 128, 256):
    for name, fn, shapes in kernels(head_dim):
      error = lowers(fn, *shapes)
      failures += error is not None
      print(f"{'ok  ' if error is None else 'FAIL'} {name}"
            + (f": {error}" if error else ""), flush=True)
  print(f"{failures} failed")
  return int(failures > 0)


if __name__ == "__main__":
  sys.exit(main())
