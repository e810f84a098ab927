"""jax-flash: FlashAttention for JAX on NVIDIA GPUs, written in Pallas."""
from jax_flash import numerics
from jax_flash.api import flash_attention
from jax_flash.decode import decode_attention, write_kv_cache
from jax_flash.fp8 import (Fp8Tensor, flash_attention_fp8, hadamard_rotation,
                           quantize_fp8, quantize_qkv)
from jax_flash.masking import BlockMask, MaskSpec
from jax_flash.reference import attention_reference
from jax_flash.sharding import ring_attention, sequence_parallel_attention
from pallas_kernels.config import BlockSizes

__all__ = ["BlockMask", "BlockSizes", "Fp8Tensor", "MaskSpec",
           "attention_reference", "decode_attention", "flash_attention",
           "flash_attention_fp8", "hadamard_rotation", "numerics",
           "quantize_fp8", "quantize_qkv", "ring_attention",
           "sequence_parallel_attention", "write_kv_cache"]
__version__ = "0.1.0"
