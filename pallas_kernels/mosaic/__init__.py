"""Pallas Mosaic GPU kernels for Hopper (sm90): wgmma, TMA, warp specialisation.

`mosaic_forward` is the FlashAttention-3 forward; the backward is not built yet.
"""
from pallas_kernels.mosaic.forward import mosaic_forward

__all__ = ["mosaic_forward"]
