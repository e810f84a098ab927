"""jax-flash: FlashAttention for JAX on NVIDIA GPUs, written in Pallas."""
from jax_flash.api import flash_attention
from jax_flash.masking import MaskSpec
from jax_flash.reference import attention_reference
from pallas_kernels.config import BlockSizes

__all__ = ["BlockSizes", "MaskSpec", "attention_reference", "flash_attention"]
__version__ = "0.1.0"
