"""The implementations a benchmark compares, each behind the same small interface.

`PEERS[name](cell, interpret=...)` returns a `Benchmark`: a jitted callable and
the inputs to call it with. For mode "fwd" the callable is `(q, k, v) -> out`;
for "fwd_bwd" it is `(q, k, v, d_out) -> (dq, dk, dv)`, the gradient of
`sum(out * d_out)` for a random cotangent `d_out` (never `.sum()` of out, which
would make every row's cotangent the same). All arrays are
[batch, seq, heads, head_dim]. A peer that cannot run here raises
`Unavailable`; any other failure (OOM, compile error, NotImplementedError) is
the caller's to record, never to crash on.
"""
from __future__ import annotations

import re
import threading
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

import jax_flash
from benchmarks import common
from pallas_kernels import compat


# Peers are built in threads; modules are imported under this lock (two
# threads importing the same modules at once have seen them half
# initialised, `mosaic_module`), and so is the warnings filter, which is
# process-wide.
IMPORT_LOCK = threading.Lock()


class Unavailable(Exception):
  """The peer cannot run on this machine (not installed, wrong device)."""


class SameProgram(Exception):
  """A forced implementation of ours is what implementation=None already
  ran (not timed twice)."""


def implementation_run(hlo_text: str) -> str:
  """Which of our implementations a lowered program runs, from its
  kernels' custom calls: Mosaic GPU's `mosaic_gpu_v2`, Pallas Triton's
  `__gpu$xla.gpu.triton`; a program with neither is XLA's."""
  targets = " ".join(re.findall(r"custom_call\s*@(\S+?)\(", hlo_text))
  if "mosaic_gpu" in targets:
    return "mosaic"
  if "xla.gpu.triton" in targets:
    return "triton"
  return "xla"


def skip_reason(error: BaseException) -> str:
  """A skip entry's reason: the error's kind and message."""
  if isinstance(error, SameProgram):
    return f"SameProgram: {error}"
  if common.is_oom(error):
    return f"OOM: {common.describe_error(error)}"
  return common.describe_error(error)


class TooLarge(Exception):
  """The peer would need more device memory than is sensible to ask for.

  Asking anyway is not harmless: an out-of-memory failure during XLA's
  command-buffer capture poisons the CUDA context, and every later
  benchmark in the process fails with "stream capture invalidated".
  """


# XLA attention materialises float32 logits [batch, heads, q_len, kv_len];
# fwd+bwd holds about 2.5 such arrays. Beyond this it is skipped.
XLA_MAX_BYTES = 64 * 2**30


class Benchmark(NamedTuple):
  fn: Callable
  args: tuple


AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _benchmark(cell: common.Cell, attention: AttentionFn,
               dtype=None) -> Benchmark:
  """Wraps `attention(q, k, v) -> out` for `cell.mode`, with random inputs."""
  q, k, v, d_out = common.attention_inputs(cell.shape, dtype or cell.dtype)
  if cell.mode == "fwd":
    return Benchmark(jax.jit(attention), (q, k, v))

  def loss_grad(q, k, v, d_out):
    _, vjp = jax.vjp(attention, q, k, v)
    return vjp(d_out)

  return Benchmark(jax.jit(loss_grad), (q, k, v, d_out))


def require_gpu(what: str, sm: tuple[int, int] = (8, 0)) -> None:
  cc = compat.gpu_compute_capability()
  if cc is None or cc < sm:
    raise Unavailable(f"{what} needs an sm{sm[0]}{sm[1]}+ GPU (found {cc})")


def jax_flash_triton(cell: common.Cell, *, interpret: bool = False,
                     block_sizes=None) -> Benchmark:
  """This project's Pallas Triton kernels (interpret mode on a CPU)."""
  def attention(q, k, v):
    return jax_flash.flash_attention(
        q, k, v, is_causal=cell.causal, implementation="triton",
        block_sizes=block_sizes, interpret=interpret)
  return _benchmark(cell, attention)


def mosaic_module():
  """`pallas_kernels.mosaic`, imported under a lock: `run_grid` builds peers
  in threads, and two threads importing its submodules at once saw them
  partially initialised (seen on the H200)."""
  with IMPORT_LOCK:
    import pallas_kernels.mosaic
    import pallas_kernels.mosaic.backward
    return pallas_kernels.mosaic


def jax_flash_mosaic(cell: common.Cell, *, interpret: bool = False
                     ) -> Benchmark:
  """This project's Mosaic GPU kernels (sm90) as `flash_attention` runs them:
  the Mosaic forward and backward (the Triton backward where the Mosaic one
  does not cover a call)."""
  del interpret
  require_gpu("the Mosaic GPU kernels", sm=(9, 0))
  mosaic_module()  # imported before tracing (see there)

  def attention(q, k, v):
    return jax_flash.flash_attention(q, k, v, is_causal=cell.causal,
                                     implementation="mosaic")
  return _benchmark(cell, attention)


def jax_flash_all_mosaic(cell: common.Cell, *, interpret: bool = False
                         ) -> Benchmark:
  """The Mosaic forward and backward, skipping cells the Mosaic backward
  does not cover (where `jax_flash_mosaic` would time the Triton one)."""
  del interpret
  require_gpu("the Mosaic GPU kernels", sm=(9, 0))
  from pallas_kernels.config import BlockSizes
  flash_attention_mosaic = mosaic_module().flash_attention_mosaic
  mosaic_backward = mosaic_module().backward.mosaic_backward
  # The Mosaic backward falls back to the Triton one for calls it does not
  # cover; here that must be a skip, not a mislabelled timing.
  x = jax.ShapeDtypeStruct(cell.shape, cell.dtype)
  lse = jax.ShapeDtypeStruct((cell.batch, cell.num_heads, cell.seq_len),
                             jnp.float32)
  jax.eval_shape(lambda *a: mosaic_backward(
      *a, scale=cell.head_dim**-0.5, is_causal=cell.causal),
      x, x, x, x, lse, x)

  def attention(q, k, v):
    out, _ = flash_attention_mosaic(q, k, v, cell.head_dim**-0.5, cell.causal,
                                    BlockSizes.get_default(cell.head_dim))
    return out
  return _benchmark(cell, attention)


def jax_flash_mosaic_fp8(cell: common.Cell, *, interpret: bool = False,
                         **options) -> Benchmark:
  """The FP8 (e4m3) Mosaic forward on inputs quantised beforehand (untimed:
  per-tensor scales, bf16 output). Forward only. `options`: more of
  `mosaic_forward_fp8`'s (a sweep's candidate, `tune_mosaic`)."""
  del interpret
  require_gpu("the FP8 Mosaic forward", sm=(9, 0))
  if cell.mode != "fwd":
    raise NotImplementedError("the FP8 kernel is forward only")
  mosaic_forward_fp8 = mosaic_module().mosaic_forward_fp8
  q, k, v, _ = common.attention_inputs(cell.shape, cell.dtype)
  (q8, qs), (k8, ks), (v8, vs) = (
      (x.data, x.descale) for x in map(jax_flash.fp8.quantize_fp8, (q, k, v)))

  def attention(q8, k8, v8, qs, ks, vs):
    out, _ = mosaic_forward_fp8(q8, k8, v8, q_descale=qs, k_descale=ks,
                                v_descale=vs, scale=cell.head_dim**-0.5,
                                is_causal=cell.causal, **options)
    return out
  return Benchmark(jax.jit(attention), (q8, k8, v8, qs, ks, vs))


def xla(cell: common.Cell, *, interpret: bool = False) -> Benchmark:
  """`jax.nn.dot_product_attention`'s XLA path: materialises the scores."""
  del interpret
  logits = cell.batch * cell.num_heads * cell.seq_len**2 * 4
  needed = logits * (2.5 if cell.mode == "fwd_bwd" else 1.0)
  if needed > XLA_MAX_BYTES and compat.has_gpu():
    raise TooLarge(f"XLA attention would need about {needed / 2**30:.0f} GiB "
                   f"of logits (limit {XLA_MAX_BYTES / 2**30:.0f} GiB)")
  def attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=cell.causal,
                                        implementation="xla")
  return _benchmark(cell, attention)


def cudnn(cell: common.Cell, *, interpret: bool = False) -> Benchmark:
  """cuDNN's fused attention through `jax.nn.dot_product_attention`."""
  del interpret
  require_gpu("cuDNN attention")
  def attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=cell.causal,
                                        implementation="cudnn")
  return _benchmark(cell, attention)


def cudnn_fp8(cell: common.Cell, *, interpret: bool = False) -> Benchmark:
  """cuDNN's FP8 (e4m3) attention forward, through JAX's cuDNN bindings
  (`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` with
  `use_fp8=True`; private), on inputs quantised beforehand with per-tensor
  factors (untimed). Forward only, e4m3 output; no GQA."""
  del interpret
  require_gpu("cuDNN FP8 attention", sm=(9, 0))
  if cell.mode != "fwd":
    raise NotImplementedError("timed as a forward only")
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  except ImportError as e:
    raise Unavailable(f"JAX's cuDNN bindings: {common.describe_error(e)}")
  q, k, v, _ = common.attention_inputs(cell.shape, cell.dtype)
  quantized = [jax_flash.fp8.quantize_fp8(x) for x in (q, k, v)]
  one = jnp.ones((1, 1, 1, 1), jnp.float32)
  # Every factor of FP8Params; the forward reads the descales of q, k and
  # v (one per tensor: cuDNN takes scalars) and the score/output scales.
  params = {name: one for name in cudnn_attention.fp8_params_keys}
  for name, x in zip(("descale_q", "descale_k", "descale_v"), quantized):
    params[name] = jnp.max(x.descale).reshape(1, 1, 1, 1)
  mask = (cudnn_attention.MaskType.CAUSAL if cell.causal
          else cudnn_attention.MaskType.NO_MASK)

  def attention(q8, k8, v8, params):
    out, _, _ = cudnn_attention.dot_product_attention(
        q8, k8, v8, fp8_params=params, scale=cell.head_dim**-0.5,
        mask_type=mask, qkv_layout="BTNH", use_fp8=True)
    return out
  return Benchmark(jax.jit(attention),
                   (*(x.data for x in quantized), params))


def pallas_triton_mha(cell: common.Cell, *, interpret: bool = False
                      ) -> Benchmark:
  """JAX's own Pallas Triton kernel (`pallas.ops.gpu.attention.mha`).

  Its default tiles are 128 (forward) and 32 (backward); it needs seq_len
  to be a multiple of the forward tile when longer than it.
  """
  if not interpret:
    require_gpu("pallas.ops.gpu.attention")
  with warnings.catch_warnings():
    # JAX 0.11 deprecates the module in favour of tokamax; it still works.
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
  scale = cell.head_dim ** -0.5
  def attention(q, k, v):
    return pallas_attention.mha(q, k, v, None, sm_scale=scale,
                                causal=cell.causal, interpret=interpret)
  return _benchmark(cell, attention)


def pallas_mgpu(cell: common.Cell, *, interpret: bool = False) -> Benchmark:
  """JAX's Mosaic GPU kernel (`pallas.ops.gpu.attention_mgpu`), Hopper only.

  Float16 only (its shared-memory scratch is float16), no softmax scale (it is
  folded into q), head_dim a multiple of 64, seq_len a multiple of 128, and
  its backward has no causal case (NotImplementedError, recorded as skipped).
  """
  del interpret
  require_gpu("attention_mgpu", sm=(9, 0))
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  config = attention_mgpu.TuningConfig(
      block_q=64, block_kv=128, max_concurrent_steps=2, causal=cell.causal,
      block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
  scale = cell.head_dim ** -0.5
  def attention(q, k, v):
    return attention_mgpu.attention(q * jnp.asarray(scale, q.dtype), k, v,
                                    config)
  return _benchmark(cell, attention, dtype=jnp.float16)


def _tokamax(cell: common.Cell, implementation: str) -> Benchmark:
  require_gpu(f"tokamax {implementation}")
  try:
    import tokamax
  except Exception as e:  # ImportError, or a wheel built for another JAX
    raise Unavailable(f"tokamax not importable ({common.describe_error(e)}); "
                      "see benchmarks/README.md") from e
  def attention(q, k, v):
    return tokamax.dot_product_attention(q, k, v, is_causal=cell.causal,
                                         implementation=implementation)
  return _benchmark(cell, attention)


def tokamax_mosaic(cell: common.Cell, *, interpret: bool = False
                   ) -> Benchmark:
  """tokamax's Mosaic GPU FlashAttention (sm90)."""
  del interpret
  return _tokamax(cell, "mosaic")


def tokamax_triton(cell: common.Cell, *, interpret: bool = False
                   ) -> Benchmark:
  """tokamax's Pallas Triton FlashAttention."""
  del interpret
  return _tokamax(cell, "triton")


def matmul(cell: common.Cell, *, interpret: bool = False) -> Benchmark:
  """The ceiling: one dense bf16 matmul with exactly the cell's FLOPs.

  [batch·seq, hidden] @ [hidden, n], the shape of a projection in the same
  model, with n = flops / (2·batch·seq·hidden) = 2·seq·(mode and causal
  factor).
  """
  del interpret
  m, k = cell.batch * cell.seq_len, cell.num_heads * cell.head_dim
  n = round(cell.flops / (2 * m * k))
  if 2 * m * k * n != cell.flops:
    raise ValueError(f"no integer matmul width gives {cell.flops} FLOPs")
  key_a, key_b = jax.random.split(jax.random.key(0))
  a = common.random_array(key_a, (m, k), cell.dtype)
  b = common.random_array(key_b, (k, n), cell.dtype)
  return Benchmark(jax.jit(jnp.matmul), (a, b))


PeerFn = Callable[..., Benchmark]
PEERS: dict[str, PeerFn] = {
    "jax_flash_triton": jax_flash_triton,
    "jax_flash_mosaic": jax_flash_mosaic,
    "jax_flash_all_mosaic": jax_flash_all_mosaic,
    "jax_flash_mosaic_fp8": jax_flash_mosaic_fp8,
    "xla": xla,
    "cudnn": cudnn,
    "cudnn_fp8": cudnn_fp8,
    "pallas_triton_mha": pallas_triton_mha,
    "pallas_mgpu": pallas_mgpu,
    "tokamax_mosaic": tokamax_mosaic,
    "tokamax_triton": tokamax_triton,
    "matmul": matmul,
}
# This project's implementations; tables compare the faster of them.
OURS = ("jax_flash_mosaic", "jax_flash_all_mosaic", "jax_flash_triton")
# Shown, but neither ours nor a peer in the ratios: another precision.
OTHER_PRECISION = ("jax_flash_mosaic_fp8", "cudnn_fp8")
# Not a peer to beat but the hardware's ceiling for the same FLOPs.
CEILING = "matmul"
