"""`python -m jax_flash`: the kernels against the reference, next to XLA attention.

For a few shapes (bf16), runs the Triton kernels (compiled on a GPU, Pallas
interpret mode on a CPU, with smaller shapes) and `jax.nn.dot_product_attention`
(XLA), forward and backward under a random cotangent, and prints per
implementation the max abs error of the output and of dq, dk, dv against the
float32 reference, the time of forward+backward and its peak memory.

The kernel passes when every error is within FlashAttention's bound,
`2 * max|naive_bf16 - ref_f32| + eps`, where `naive_bf16` is the same plain
attention computed in bf16. Exit status 1 when it does not. XLA's errors are
shown against the same bound for comparison but do not decide the status.

Needs only the installed packages: the timing and memory helpers are
`jax_flash.timing`, which the benchmarks share.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from rich import box
from rich.console import Console
from rich.progress import track
from rich.table import Table

import jax_flash
from jax_flash import timing as common
from jax_flash.reference import naive_attention
from pallas_kernels import compat

OUTPUTS = ("out", "dq", "dk", "dv")
# The rows the exit status depends on: the Triton kernels everywhere, the
# Mosaic ones (`implementation="mosaic"`) on an sm90 GPU.
OURS = ("triton", "mosaic")
# Absolute slack for values that bf16 represents exactly in both computations
# (the same as the test suite's).
EPS = 2e-3


@dataclasses.dataclass(frozen=True)
class Case:
  """q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim].
  """
  batch: int
  seq: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool

  def __str__(self):
    return (f"{self.batch}x{self.seq}x{self.heads}:{self.kv_heads}"
            f"x{self.head_dim}")


GPU_CASES = (
    Case(4, 1024, 16, 16, 64, False),
    Case(2, 4096, 16, 16, 128, True),
    Case(2, 2048, 16, 4, 128, True),     # GQA 4:1
    Case(1, 8192, 8, 8, 256, True),
)
# Interpret mode runs the kernels as XLA loops: small, and awkward (a seq_len
# that is not a multiple of the tile, a head dim that is padded).
CPU_CASES = (
    Case(2, 128, 4, 4, 64, False),
    Case(1, 256, 4, 2, 128, True),       # GQA 2:1
    Case(1, 97, 2, 2, 40, True),
)


def _inputs(case: Case, seed: int = 0):
  """(q, k, v, d_out) in bf16; d_out is the random cotangent of the output."""
  keys = jax.random.split(jax.random.key(seed), 4)
  q_shape = (case.batch, case.seq, case.heads, case.head_dim)
  kv_shape = (case.batch, case.seq, case.kv_heads, case.head_dim)
  shapes = (q_shape, kv_shape, kv_shape, q_shape)
  return tuple(common.random_array(k, s, jnp.bfloat16)
               for k, s in zip(keys, shapes))


def _forward_backward(attention):
  """Jitted (q, k, v, d_out) -> (out, dq, dk, dv): what is timed and checked."""
  def run(q, k, v, d_out):
    out, vjp = jax.vjp(attention, q, k, v)
    return (out, *vjp(d_out))
  return jax.jit(run)


def _implementations(case: Case, interpret: bool) -> dict:
  def ours(implementation):
    def attention(q, k, v):
      return jax_flash.flash_attention(q, k, v, is_causal=case.causal,
                                       implementation=implementation,
                                       interpret=interpret)
    return attention

  def xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=case.causal,
                                        implementation="xla")
  implementations = {"triton": ours("triton")}
  if not interpret and (compat.gpu_compute_capability() or (0, 0))[0] == 9:
    implementations["mosaic"] = ours("mosaic")
  return {**implementations, "xla": xla}


def _reference(case: Case, compute_dtype):
  def attention(q, k, v):
    return naive_attention(q, k, v, is_causal=case.causal,
                           compute_dtype=compute_dtype)[0]
  return attention


def _max_abs(a, b) -> float:
  """max |a - b|; inf if either has a NaN or inf (so it can never pass)."""
  diff = np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))
  return float(diff.max()) if np.isfinite(diff).all() else float("inf")


def check(case: Case, interpret: bool, reps: int) -> list[dict]:
  """One row per implementation: errors, bound ratio, time and memory."""
  q, k, v, d_out = _inputs(case)
  exact = _forward_backward(_reference(case, jnp.float32))(
      *(x.astype(jnp.float32) for x in (q, k, v, d_out)))
  naive = _forward_backward(_reference(case, jnp.bfloat16))(q, k, v, d_out)
  bounds = [2 * _max_abs(n, e) + EPS for n, e in zip(naive, exact)]
  rows = []
  for name, attention in _implementations(case, interpret).items():
    compiled = _forward_backward(attention).lower(q, k, v, d_out).compile()
    results = compiled(q, k, v, d_out)
    errors = [_max_abs(r, e) for r, e in zip(results, exact)]
    ms = common.time_fn(compiled, q, k, v, d_out, warmup=1, reps=reps)
    rows.append({"case": case, "impl": name, "errors": errors,
                 "worst": max(e / b for e, b in zip(errors, bounds)),
                 "ms": ms, "peak_gib": common.compiled_peak_gib(compiled)})
  return rows


def _table(rows: list[dict], title: str) -> Table:
  table = Table(title=title, box=box.SIMPLE_HEAD,
                caption="shape: batch x seq x heads:kv_heads x head_dim; "
                "err: max |x - x_f32ref|; err/bound: worst over out, dq, dk, "
                "dv of err / (2 x naive bf16 err + eps)")
  for column in ("shape", "mask", "impl", *OUTPUTS, "err/bound",
                 "fwd+bwd ms", "peak MiB", "status"):
    table.add_column(column, justify="left" if column in ("shape", "mask",
                                                          "impl") else "right")
  for row in rows:
    if row["impl"] in OURS:
      status = "[green]ok" if row["worst"] <= 1 else "[red]FAIL"
    else:
      status = "[dim]ref."
    peak = "—" if row["peak_gib"] is None else f"{row['peak_gib'] * 1024:.1f}"
    table.add_row(str(row["case"]), "causal" if row["case"].causal else "full",
                  row["impl"], *(f"{e:.1e}" for e in row["errors"]),
                  f"{row['worst']:.2f}", f"{row['ms']:.2f}", peak, status)
  return table


def main() -> int:
  compat.filter_known_warnings()
  on_gpu = compat.has_gpu()
  cases, reps = (GPU_CASES, 10) if on_gpu else (CPU_CASES, 3)
  device = jax.devices()[0].device_kind
  mode = "compiled" if on_gpu else "Pallas interpret mode"
  console = Console()
  if not console.is_terminal:  # a log file: do not squeeze to 80 columns
    console = Console(width=max(console.width, 120))
  rows = []
  for case in track(cases, description=f"checking on {device}",
                    console=console):
    rows += check(case, interpret=not on_gpu, reps=reps)
  console.print(_table(rows, f"jax_flash vs float32 reference, bf16, {device}"
                             f" ({mode}), JAX {jax.__version__}"))
  failed = [r for r in rows if r["impl"] in OURS and r["worst"] > 1]
  if failed:
    console.print(f"[red]FAIL: {len(failed)} case(s) exceed 2 x naive bf16 "
                  f"error + {EPS}")
    return 1
  console.print("[green]PASS: every error within 2 x naive bf16 error "
                f"+ {EPS}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
