"""The mask and score semantics, re-exported from `pallas_kernels.masking`.

The definition lives below both packages (DESIGN.md section 1: imports run
`flax_layers` -> `jax_flash` -> `pallas_kernels`), so that the kernels obey it
without importing the public API. This module keeps `jax_flash.masking` as
the name users and the reference know it by.
"""
from pallas_kernels.masking import (  # noqa: F401
    DROPOUT_LEVELS, EMPTY, FULL, LOWEST_LOGIT, PARTIAL, BlockMask, MaskSpec,
    MaskValues, Operands, apply_sinks, block_ranges, classify_blocks,
    dense_block_states, dropout_keep, dropout_levels, keep, modify_scores,
    quantized_dropout_rate)
