"""exp2 partly in software: some of a tile's exponentials off the MUFU.

Why: at head_dim 64 the forward's two matmuls per score take the tensor
cores as long as its exp2 takes the MUFU (4 * 64 = 256 FLOPs per
exponential at 4096 FLOPs a clock per SM, against 16 exp2s a clock), so the
tensor cores wait whenever the exponentials of the consumers in flight
queue on the MUFU. FlashAttention-4 moves part of the exponentials to the
FMA units; so does `exp2`, by column groups: of every `GROUP_CYCLE` groups
of 8 columns of a [rows, cols] WGMMA-layout tile, the last `soft_groups`
are computed here, the rest by `ex2.approx.ftz.f32` on the MUFU.

The software exp2 (`reference` is the same arithmetic in jnp):

    x = max(x, -126)                       clamp: 2**j stays a normal float
    t = x + 1.5 * 2**23                    round to nearest: j = round(x)
    f = x - (t - 1.5 * 2**23)              in [-0.5, 0.5]
    p = ((C3 f + C2) f + C1) f + C0        2**f, relative error < 7.5e-5
    2**x = bits(p) + (bits(t) << 23)       j into the exponent field

Six FP32 instructions and two integer ones on pipes the softmax leaves
mostly free, against one MUFU instruction that takes the MUFU 8 clocks a
warp. Its error (7.5e-5 relative) is a 26th of bfloat16's rounding of P
(2**-9). Only for scores with no -inf: the clamp gives 2**-126, not 0, so
the kernels use it on unmasked tiles only (a masked or empty row must sum
to exactly 0). NaN stays NaN (the clamp is `max.NaN`).
"""
from __future__ import annotations

import numpy as np

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental.mosaic import gpu as mgpu

# Degree-3 minimax fit of 2**f on [-0.5, 0.5] for relative error (Remez),
# C0 first; max relative error 7.48e-5 in float32 Horner form.
COEFFICIENTS = (0.9999280571937561, 0.6932609677314758, 0.2426111400127411,
                0.05517168715596199)
MAX_RELATIVE_ERROR = 7.5e-5
# 1.5 * 2**23: adding it rounds a float in (-2**22, 2**22) to an integer,
# held in the low mantissa bits (two's complement under the 0x4B4 prefix).
_ROUNDER = 12582912.0
_ROUNDER_BITS = 0x4B400000
_LEAST_EXPONENT = -126.0
# Columns per group (a WGMMA-layout register's column block) and groups per
# cycle of the soft/hard pattern.
GROUP_COLUMNS = 8
GROUP_CYCLE = 8


def soft_columns(num_cols: int, soft_groups: int) -> np.ndarray:
  """bool [num_cols]: which columns of a tile take the software exp2."""
  group = np.arange(num_cols) // GROUP_COLUMNS
  return group % GROUP_CYCLE >= GROUP_CYCLE - soft_groups


def reference(x: jnp.ndarray) -> jnp.ndarray:
  """The software exp2 in jnp (float32), as `exp2` computes it in a kernel
  (up to the FMA's single rounding)."""
  x = jnp.maximum(x.astype(jnp.float32), _LEAST_EXPONENT)
  t_bits = lax.bitcast_convert_type(x + _ROUNDER, jnp.int32)
  # j = t - 1.5 * 2**23, exact; taken from t's bits here because XLA folds
  # (x + c) - c to x (the kernel subtracts in float: the same j).
  j = (t_bits - _ROUNDER_BITS).astype(jnp.float32)
  f = x - j
  p = jnp.float32(COEFFICIENTS[3])
  for c in COEFFICIENTS[2::-1]:
    p = p * f + jnp.float32(c)
  bits = lax.bitcast_convert_type(p, jnp.int32) + lax.shift_left(t_bits, 23)
  return lax.bitcast_convert_type(bits, jnp.float32)


def mixed_reference(x: jnp.ndarray, soft_groups: int) -> jnp.ndarray:
  """`exp2`'s result in jnp: [..., cols] with the software exp2 on the
  columns `soft_columns` picks, jnp.exp2 on the rest."""
  soft = jnp.asarray(soft_columns(x.shape[-1], soft_groups))
  return jnp.where(soft, reference(x), jnp.exp2(x))


def exp2(_, x, *, soft_groups: int):
  """`plgpu.inline_mgpu` body: 2**x of a float32 WGMMA-layout array, the
  last `soft_groups` column groups of every `GROUP_CYCLE` in software
  (`reference`), the others on the MUFU."""
  if x.layout != mgpu.WGMMA_LAYOUT:
    raise NotImplementedError(f"soft exp2 takes WGMMA_LAYOUT, got {x.layout}")
  # WGMMA_LAYOUT's register array is indexed [row tile, column group, ...]:
  # register [i, g, ...] holds columns 8 g + 2 (lane % 4) + {0, 1}.
  registers = x.registers
  out = np.empty(registers.shape, dtype=object)
  for index in np.ndindex(registers.shape):
    soft = index[1] % GROUP_CYCLE >= GROUP_CYCLE - soft_groups
    out[index] = (_software(registers[index]) if soft
                  else _on_mufu(registers[index]))
  return mgpu.FragmentedArray(_registers=out, _layout=x.layout,
                              _is_signed=None)


def _splat(value, like: ir.Value) -> ir.Value:
  """A constant shaped like the register `like` (vector or scalar)."""
  ty = like.type
  if isinstance(ty, ir.VectorType):
    element = ir.VectorType(ty).element_type
    attr = (ir.FloatAttr.get(element, value)
            if isinstance(element, ir.FloatType)
            else ir.IntegerAttr.get(element, value))
    return arith.constant(ty, ir.DenseElementsAttr.get_splat(ty, attr))
  if isinstance(ty, ir.FloatType):
    return arith.constant(ty, ir.FloatAttr.get(ty, value))
  return arith.constant(ty, ir.IntegerAttr.get(ty, value))


def _as_int(ty: ir.Type) -> ir.Type:
  i32 = ir.IntegerType.get_signless(32)
  if isinstance(ty, ir.VectorType):
    return ir.VectorType.get(ir.VectorType(ty).shape, i32)
  return i32


def _software(register: ir.Value) -> ir.Value:
  """`reference` on one register (f32 or vector of f32)."""
  x = arith.maximumf(register, _splat(_LEAST_EXPONENT, register))
  rounder = _splat(_ROUNDER, register)
  t = arith.addf(x, rounder)
  f = arith.subf(x, arith.subf(t, rounder))
  p = _splat(COEFFICIENTS[3], register)
  for c in COEFFICIENTS[2::-1]:
    p = mlir_math.fma(p, f, _splat(c, register))
  int_type = _as_int(register.type)
  t_bits = arith.bitcast(int_type, t)
  exponent = arith.shli(t_bits, _splat(23, t_bits))
  bits = arith.addi(arith.bitcast(int_type, p), exponent)
  return arith.bitcast(register.type, bits)


def _on_mufu(register: ir.Value) -> ir.Value:
  """ex2.approx.ftz.f32 on each element of one register (the MUFU)."""
  f32 = ir.F32Type.get()

  def one(value):
    return llvm.inline_asm(f32, [value], "ex2.approx.ftz.f32 $0, $1;",
                           "=f,f")

  if not isinstance(register.type, ir.VectorType):
    return one(register)
  result = llvm.mlir_undef(register.type)
  for i in range(ir.VectorType(register.type).shape[0]):
    element = vector.extract(register, dynamic_position=[],
                             static_position=ir.DenseI64ArrayAttr.get([i]))
    result = vector.insert(one(element), result, dynamic_position=[],
                           static_position=ir.DenseI64ArrayAttr.get([i]))
  return result
