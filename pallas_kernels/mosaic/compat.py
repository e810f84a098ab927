"""The one place that knows how Mosaic GPU differs in JAX 0.10.2 and 0.11.2.

The kernels use only the part of `jax.experimental.pallas.mosaic_gpu` that is
spelled the same in both (checked against both sources). What differs:

- Default `CompilerParams.lowering_semantics`: Lane in 0.10.2, Warpgroup in
  0.11.2. Set here, explicitly.
- Transposing an SMEM ref: `plgpu.transpose_ref` is deprecated in 0.11.2;
  `ref.transpose(perm)` works in both.
- `plgpu.Barrier()` without `num_barriers`: shape (1,) in 0.10.2, a scalar
  ref in 0.11.2. The kernels always pass `num_barriers` and index `.at[i]`.
- `plgpu.kernel`: `out_type=`/`scratch_types=` in both; the old
  `out_shape=`/`scratch_shapes=` warn in 0.10.2 and are gone in 0.11.2.
- `plgpu.load(ref, idx)`: idx required in 0.10.2, deprecated in 0.11.2
  (`load(ref.at[idx])`). Not used by the forward.
- `copy_gmem_to_smem`: the barrier is optional and `predicate=` exists only
  in 0.11.2; `barrier_arrive(predicate=)` likewise. Not used.
- Inline PTX: `mosaic.gpu.utils.inline_ptx` exists only in 0.11.2;
  `named_barrier` emits `llvm.inline_asm` itself, as both versions' own
  `warpgroup_barrier` does.
- GPU interpret mode (`InterpretGPUParams`): public in 0.11.2, private in
  0.10.2 (`jax._src.pallas.mosaic_gpu.interpret.params`); 0.10.2's
  interpreter has no `pl.run_state`, no transposed wgmma operand and no
  register-held wgmma LHS, so the forward does not run under it unpatched.

The same in both: `plgpu.kernel` traces its kernel with `check_vma` off, so
the manual-axis type an output's `ShapeDtypeStruct` declares
(`pallas_kernels.compat.output_struct`) is dropped and every output comes
back invariant; `vary_like` casts them.
"""
from __future__ import annotations

import jax
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm
from jax.experimental.pallas import mosaic_gpu as plgpu

# Warpgroup semantics: arrays are warpgroup-wide values and Mosaic infers
# their register layouts, guided by the hints the kernels give
# (`plgpu.layout_cast`, `broadcasted_iota(..., layout=)`). It is 0.11's default
# and what JAX 0.11.2's own Hopper kernels (ops/gpu/*_mgpu.py) use. The kernels
# also lower under Lane semantics (0.10's default, layouts taken exactly from
# the hints); tests/test_mosaic_lowering.py lowers both, so switching is this
# one line.
LOWERING_SEMANTICS = plgpu.LoweringSemantics.Warpgroup


def compiler_params(**kwargs) -> plgpu.CompilerParams:
  """`plgpu.CompilerParams` with the lowering semantics set explicitly."""
  return plgpu.CompilerParams(lowering_semantics=LOWERING_SEMANTICS, **kwargs)


def named_barrier(operation: str, barrier_id: int, num_threads: int) -> None:
  """`bar.sync` or `bar.arrive` (`operation`) on the CTA's hardware barrier
  `barrier_id`, counting `num_threads` threads, by every thread of the
  calling warpgroup. Mosaic GPU itself uses barrier 0 and one per
  warpgroup (1, 2, ...); callers take ids from 8 up."""
  if operation not in ("sync", "arrive"):
    raise ValueError(f"operation must be 'sync' or 'arrive', got {operation}")

  @plgpu.inline_mgpu()
  def emit(_):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [],
                    f"bar.{operation} {barrier_id}, {num_threads};", "",
                    has_side_effects=True)

  emit()


def vary_like(outputs, *inputs):
  """`outputs` of a `plgpu.kernel` cast to vary along every manual mesh axis
  that one of `inputs` varies along (inside `jax.shard_map` with
  `check_vma=True`; elsewhere, and on the axes an output already varies
  along, they are returned as they are, so nothing else lowers
  differently). The kernel's outputs depend on all of its inputs, as
  `pallas_kernels.compat.output_struct` declares."""
  varying = frozenset().union(*(jax.typeof(x).mat.varying for x in inputs))

  def cast(x):
    missing = tuple(sorted(varying - jax.typeof(x).mat.varying, key=str))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, outputs)
