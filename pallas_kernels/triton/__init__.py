"""FlashAttention-2 kernels in Pallas, lowered through Triton (sm80+, and CPU interpret)."""
from pallas_kernels.triton.attention import flash_attention_triton

__all__ = ["flash_attention_triton"]
