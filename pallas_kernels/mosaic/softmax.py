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

import functools

import jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, nvvm, scf, vector
from jax._src.lib.mlir.dialects import math as math_dialect
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mosaic.common import per_row


def exponentiate(s, m, scale_log2, *, threshold: float | None = None,
                 software_every: int = 0):
  """Online softmax on a [block_q, block_kv] tile of scores (-inf where
  masked) against the running max `m` (log2 units): (m_new, alpha = the
  factor for what was summed so far, p = the tile's exponentials, f32).

  With a `threshold` a row's max moves only when the tile's max exceeds it
  by more than that (`KernelStatic.rescale_threshold`), and its p stays
  below 2**threshold. A row whose max did not move has alpha exactly 1, or
  0 while it has seen no key (its O and l are still 0).

  `software_every` k > 0: every k-th 8-column group of p by `soft_exp2`
  on the FMA pipe, the rest on the MUFU (`exp2_split`); for tiles without
  a masked score (-inf) only."""
  m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
  if threshold:  # 0.0 moves on any growth: m_new as it is
    m_new = jnp.where(m_new > m + threshold, m_new, m)
  # A row that has seen only masked keys keeps m = -inf; exponentiate
  # against 0 there so that it stays at p = 0, l = 0 instead of NaN.
  m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_ref)
  # One FMA per score: s * (scale log2 e) - m (§3.1, exp2 on the MUFU).
  x = s * scale_log2 - per_row(m_ref, s.shape)
  p = exp2_split(x, software_every) if software_every else jnp.exp2(x)
  return m_new, alpha, p


# 2^f on [-1/2, 1/2] by a cubic, its coefficients fitted for the least
# maximum relative error (7.5e-5 in float32 Horner: far below bfloat16's
# and e4m3's steps, 2^-9 and 2^-4).
SOFT_EXP2_COEFFS = (0.9999281167984009, 0.6932609677314758,
                    0.24261054396629333, 0.05517132207751274)
# 1.5 * 2^23: x + this, in float32 rounded to nearest, leaves round(x) in
# the sum's low mantissa bits (for |x| < 2^22), and subtracting it back
# gives round(x) as a float.
_ROUNDING_SHIFTER = 12582912.0
# Below this x gives 2^x under 2^-126, whose exponent field the bit add
# would wrap: x is clamped to it (the result, ~1e-38, counts as nothing
# beside the row's max, whose p is 1).
_SOFT_EXP2_FLOOR = -126.0


def soft_exp2(x):
  """2^x by arithmetic alone (FlashAttention-4's exponential on the FMA
  pipe): n = round(x) by the rounding shifter, f = x - n in [-1/2, 1/2],
  2^f by the cubic `SOFT_EXP2_COEFFS`, and 2^n added to its exponent bits
  (n << 23). Relative error under 7.5e-5 for x >= -125. The arrays' form
  of what `exp2_split_in_threads` emits per register, and what the CPU
  interpreter runs for it."""
  x = jnp.maximum(x.astype(jnp.float32), _SOFT_EXP2_FLOOR)
  shifted = _rounded(x + _ROUNDING_SHIFTER)
  f = x - _rounded(shifted - _ROUNDING_SHIFTER)
  c0, c1, c2, c3 = SOFT_EXP2_COEFFS
  poly = ((c3 * f + c2) * f + c1) * f + c0
  bits = (jax.lax.bitcast_convert_type(poly, jnp.int32)
          + jax.lax.shift_left(
              jax.lax.bitcast_convert_type(shifted, jnp.int32), 23))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _rounded(x):
  """x as computed, kept from XLA's simplifier (which may fold (x + c) - c
  to x; PTX's `add.rn.f32` never is)."""
  return jax.lax.optimization_barrier(x)


def software_columns(num_columns: int, every: int):
  """bool [num_columns]: the columns `exp2_split` takes to `soft_exp2`,
  every `every`-th 8-column group (a WGMMA register's columns lie in one
  group, so the split is per register)."""
  return (np.arange(num_columns) // 8) % every == every - 1


def exp2_split(x, every: int):
  """2^x of a [rows, columns] WGMMA-layout tile of f32, the columns of
  `software_columns` by `soft_exp2`, the rest by ex2.approx (the MUFU), as
  `exp2_split_in_threads` emits it."""
  return plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype,
                                         plgpu.Layout.WGMMA),
  )(functools.partial(exp2_split_in_threads, every=every))(x)


def exp2_split_in_threads(_, x, *, every: int):
  """`exp2_split` on Mosaic GPU fragments: per register (two columns of one
  8-column group), the group's `software_columns` choice. The software
  form is `soft_exp2` in PTX: its adds as `add.rn.f32` (never contracted
  nor folded), the cubic in FMAs, the exponent's add in integers.
  Interpreted on a CPU as `soft_exp2` and `jnp.exp2` by those columns
  (tests/mosaic_interpret.py knows this function)."""
  f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
  constant = lambda value: arith.constant(f32, value)

  def rounded_add(a, b):
    return llvm.inline_asm(f32, [a, b], "add.rn.f32 $0, $1, $2;", "=f,f,f")

  def hardware(v):
    return llvm.inline_asm(f32, [v], "ex2.approx.ftz.f32 $0, $1;", "=f,f")

  def software(v):
    v = arith.maximumf(v, constant(_SOFT_EXP2_FLOOR))
    shifted = rounded_add(v, constant(_ROUNDING_SHIFTER))
    n = rounded_add(shifted, constant(-_ROUNDING_SHIFTER))  # round(v)
    f = rounded_add(v, arith.negf(n))
    c0, c1, c2, c3 = (constant(c) for c in SOFT_EXP2_COEFFS)
    poly = math_dialect.fma(math_dialect.fma(math_dialect.fma(c3, f, c2), f,
                                             c1), f, c0)
    exponent = arith.shli(arith.bitcast(i32, shifted),
                          arith.constant(i32, 23))
    return arith.bitcast(f32, arith.addi(arith.bitcast(i32, poly), exponent))

  # A WGMMA register index's second entry is the 8-column group.
  registers = np.empty(x.registers.shape, dtype=object)
  for index in np.ndindex(x.registers.shape):
    soft = index[1] % every == every - 1
    registers[index] = _per_element(software if soft else hardware,
                                    x.registers[index])
  return mgpu.FragmentedArray(_registers=registers, _layout=x.layout,
                              _is_signed=None)


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

  registers = np.empty(a.registers.shape, dtype=object)
  for index in np.ndindex(a.registers.shape):
    registers[index] = _per_element(add, a.registers[index],
                                    b.registers[index])
  return mgpu.FragmentedArray(_registers=registers, _layout=a.layout,
                              _is_signed=None)


def _per_element(fn, *registers):
  """`fn` of scalar MLIR values, applied to registers of one type (a
  scalar or a vector of them) element by element."""
  if not isinstance(registers[0].type, ir.VectorType):
    return fn(*registers)
  result = llvm.mlir_undef(registers[0].type)
  for i in range(ir.VectorType(registers[0].type).shape[0]):
    position = ir.DenseI64ArrayAttr.get([i])
    element = fn(*(vector.extract(r, dynamic_position=[],
                                  static_position=position)
                   for r in registers))
    result = vector.insert(element, result, dynamic_position=[],
                           static_position=position)
  return result


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
