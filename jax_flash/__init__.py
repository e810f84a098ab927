"""jax-flash: FlashAttention for JAX on NVIDIA GPUs, written in Pallas."""
from jax_flash import numerics
from jax_flash.api import flash_attention
from jax_flash.masking import BlockMask, MaskSpec
from jax_flash.reference import attention_reference
from jax_flash.sharding import ring_attention, sequence_parallel_attention
from pallas_kernels.config import BlockSizes

__all__ = ["BlockMask", "BlockSizes", "MaskSpec", "attention_reference",
           "flash_attention", "numerics", "ring_attention", "sequence_parallel_attention"]
__version__ = "0.1.0"
