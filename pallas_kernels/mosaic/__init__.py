"""Pallas Mosaic GPU kernels for Hopper (sm90): wgmma, TMA, warp specialisation.

`mosaic_forward` is the FlashAttention-3 forward; `flash_attention_mosaic`
wires it with the Triton family's backward by `jax.custom_vjp`.
"""
from pallas_kernels.mosaic.attention import flash_attention_mosaic
from pallas_kernels.mosaic.forward import mosaic_forward

__all__ = ["flash_attention_mosaic", "mosaic_forward"]
