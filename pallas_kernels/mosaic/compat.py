"""The one place that knows how Mosaic GPU differs between JAX 0.10.2 and 0.11.2.

The kernels in this package use only the part of `jax.experimental.pallas.
mosaic_gpu` whose spelling is the same in both versions (checked against both
sources):

| what                        | 0.10.2                           | 0.11.2                          |
|-----------------------------|----------------------------------|---------------------------------|
| default lowering_semantics  | Lane                             | Warpgroup                       |
| transpose an SMEM ref       | ref.transpose(perm) or           | ref.transpose(perm);            |
|                             | plgpu.transpose_ref              | plgpu.transpose_ref deprecated  |
| plgpu.Barrier() shape       | num_barriers defaults to (1,)    | defaults to () (a scalar ref)   |
| plgpu.kernel outputs/scratch| out_type=, scratch_types=        | the same; out_shape=/scratch_   |
|                             | (out_shape=/scratch_shapes= warn)| shapes= removed                 |
| plgpu.load(ref, idx)        | idx positional, required         | idx deprecated: load(ref.at[i]) |
| copy_gmem_to_smem barrier   | required                         | optional; predicate= added      |
| barrier_arrive predicate=   | absent                           | added                           |

So the kernels always give `num_barriers` and index `.at[i]`, transpose with
`ref.transpose`, pass `out_type=`/`scratch_types=`, and set the lowering
semantics here, explicitly, rather than inheriting a default that changed.
"""
from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

# Warpgroup semantics: arrays are warpgroup-wide values and Mosaic infers
# their register layouts, guided by the hints the kernels give
# (`plgpu.layout_cast`, `broadcasted_iota(..., layout=)`). It is 0.11's default
# and what JAX 0.11.2's own Hopper kernels run under on the H200. The kernels
# also lower under Lane semantics (0.10's default, layouts taken exactly from
# the hints); tests/test_mosaic_lowering.py lowers both, so switching is this
# one line.
LOWERING_SEMANTICS = plgpu.LoweringSemantics.Warpgroup


def compiler_params(**kwargs) -> plgpu.CompilerParams:
  """`plgpu.CompilerParams` with the lowering semantics set explicitly."""
  return plgpu.CompilerParams(lowering_semantics=LOWERING_SEMANTICS, **kwargs)
