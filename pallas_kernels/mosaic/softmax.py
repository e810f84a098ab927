"""The forward's online softmax on a consumer's tiles.

FlashAttention-3 §3.1 and FlashAttention-2 §3.1: exp2 with log2(e) folded
into the scale (one FMA a score), the running max m kept in that base-2
domain, O unnormalised until the end (`exponentiate`). O's rescale by each
row's alpha may be lazy (FlashAttention-4's threshold, `rescale`): each
warp then multiplies its part of O only where one of its rows' maxima
moved (`multiply_rows_in_threads`, Mosaic GPU code in the kernel). The
LSE's add is rounded as written, never fused (`add_unfused`).
"""
from __future__ import annotations

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, nvvm, scf, vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mosaic.common import per_row


def exponentiate(s, m, scale_log2, *, threshold: float | None = None,
                 unbounded: bool = False):
  """Online softmax on a [block_q, block_kv] tile of scores (-inf where
  masked) against the running max `m` (log2 units): (m_new, alpha = the
  factor for what was summed so far, p = the tile's exponentials, f32).

  With a `threshold` a row's max moves only when the tile's max exceeds it
  by more than that (`KernelStatic.rescale_threshold`), and its p stays
  below 2**threshold. A row whose max did not move has alpha exactly 1, or
  0 while it has seen no key (its O and l are still 0).

  `unbounded` (a bias or score_fn may take scores anywhere, say a padding
  bias of -1e10): the exponent is capped where it belongs
  (`capped_exp2`)."""
  m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
  if threshold:  # 0.0 moves on any growth: m_new as it is
    m_new = jnp.where(m_new > m + threshold, m_new, m)
  # A row that has seen only masked keys keeps m = -inf; exponentiate
  # against 0 there so that it stays at p = 0, l = 0 instead of NaN.
  m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_ref)
  # One FMA per score: s * (scale log2 e) - m (§3.1, exp2 on the MUFU).
  p = capped_exp2(s * scale_log2 - per_row(m_ref, s.shape),
                  (threshold or 0.0) if unbounded else None)
  return m_new, alpha, p


def capped_exp2(exponent, bound: float | None):
  """exp2 of an exponent that belongs at or below `bound` (None: taken as
  it is). The forward's against its running max (bound 0, or the lazy
  rescale's threshold) and the backward's against the LSE (0) where a
  bias or score_fn may take logits anywhere (`MaskSpec.unbounded_scores`):
  at |logit| near 1e10 an ulp is 1024, and the exponent, one FMA of the
  unrounded product against a max or LSE of rounded ones, can exceed its
  bound by hundreds (P = inf, O NaN)."""
  if bound is not None:
    exponent = jnp.minimum(exponent, bound)
  return jnp.exp2(exponent)


def add_rounded(a, b, layout):
  """a + b of two arrays in `layout` by `add_rounded_in_threads`."""
  return plgpu.inline_mgpu(
      arg_types=(layout, layout),
      return_type=plgpu.ShapeDtypeStruct(a.shape, a.dtype, layout),
  )(add_rounded_in_threads)(a, b)


def add_unfused(a, b):
  """a + b of two [block_q] row vectors (WGMMA row layout), by
  `add_rounded_in_threads`: an add that ptxas never fuses with the
  multiplies before it. lse = m ln2 + log(l) holds two products (jnp.log
  is log2 times ln2), and which of them ptxas contracted into an FMA
  depended on the code around it: two schedules of one computation gave
  lse 1 ulp apart in a quarter of the rows (H200)."""
  return add_rounded(a, b, plgpu.Layout.WGMMA.reduce(1))


def add_rounded_in_threads(_, a, b):
  """`a + b` on Mosaic GPU fragments of one layout, each element by PTX
  `add.rn.f32`: an add with an explicit rounding mode is never contracted
  into an FMA (PTX ISA, `add`), nor folded with what follows. Interpreted
  on a CPU as `a + b` behind an optimization barrier
  (tests/mosaic_interpret.py knows this function)."""
  f32 = ir.F32Type.get()

  def add(x, y):
    return llvm.inline_asm(f32, [x, y], "add.rn.f32 $0, $1, $2;", "=f,f,f")

  def add_register(x, y):
    if not isinstance(x.type, ir.VectorType):
      return add(x, y)
    result = llvm.mlir_undef(x.type)
    for i in range(ir.VectorType(x.type).shape[0]):
      position = ir.DenseI64ArrayAttr.get([i])
      element = add(
          vector.extract(x, dynamic_position=[], static_position=position),
          vector.extract(y, dynamic_position=[], static_position=position))
      result = vector.insert(element, result, dynamic_position=[],
                             static_position=position)
    return result

  registers = np.empty(a.registers.shape, dtype=object)
  for index in np.ndindex(a.registers.shape):
    registers[index] = add_register(a.registers[index], b.registers[index])
  return mgpu.FragmentedArray(_registers=registers, _layout=a.layout,
                              _is_signed=None)


def rescale(acc, alpha, *, skip_ones: bool):
  """O [block_q, head_dim] times each row's alpha [block_q]; with
  `skip_ones`, each warp skips the multiply when every alpha of its rows
  is exactly 1 (`multiply_rows_in_threads`)."""
  if not skip_ones:
    return acc * per_row(alpha, acc.shape)
  return plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)),
      return_type=plgpu.ShapeDtypeStruct(acc.shape, acc.dtype,
                                         plgpu.Layout.WGMMA),
  )(multiply_rows_in_threads)(acc, alpha)


def multiply_rows_in_threads(_, acc, alpha):
  """`acc * alpha[:, None]` on Mosaic GPU fragments (WGMMA layout, alpha
  in its row layout), behind a branch in each warp: a warp multiplies its
  registers only if one of its threads' rows' alphas is not exactly 1
  (`vote.sync.any`), and skipping a multiply by 1 is exact. The warp's
  threads agree first, so that the branch never diverges within a warp
  before P V's warp-synchronous wgmma (a warpgroup-wide vote would need a
  reduction through shared memory). Interpreted on a CPU as the plain
  product (tests/mosaic_interpret.py knows this function)."""
  one = arith.constant(ir.F32Type.get(), 1.0)
  moved = None
  for register in alpha.registers.flat:
    for i in range(ir.VectorType(register.type).shape[0]):
      differs = arith.cmpf(arith.CmpFPredicate.UNE,
                           vector.extract(register, [], [i]), one)
      moved = differs if moved is None else arith.ori(moved, differs)
  every_lane = arith.constant(ir.IntegerType.get_signless(32), -1)
  moved = nvvm.vote_sync(every_lane, moved, nvvm.VoteSyncKind.any)
  registers = list(acc.registers.flat)
  branch = scf.IfOp(moved, [r.type for r in registers], has_else=True)
  with ir.InsertionPoint(branch.then_block):
    product = acc * alpha.broadcast_in_dim(acc.shape, (0,), acc.layout)
    scf.yield_(list(product.registers.flat))
  with ir.InsertionPoint(branch.else_block):
    scf.yield_(registers)
  results = np.empty(len(registers), dtype=object)
  results[:] = list(branch.results)
  return mgpu.FragmentedArray(
      _registers=results.reshape(acc.registers.shape), _layout=acc.layout,
      _is_signed=None)
