"""Pallas Mosaic GPU kernels for Hopper (sm90): wgmma, TMA, warp specialisation.

`mosaic_forward` is the FlashAttention-3 forward (`mosaic_forward_fp8` its
FP8 form, `mosaic_forward_masked` its masked form), `mosaic_backward` the
recomputing backward (`mosaic_backward_masked` its masked form);
`flash_attention_mosaic` wires them by `jax.custom_vjp`, and
`mosaic_attention` pads head dims (`mosaic_attention_backward`: its
gradients from given residuals).
"""
from pallas_kernels.mosaic.attention import (flash_attention_mosaic,
                                             mosaic_attention,
                                             mosaic_attention_backward)
from pallas_kernels.mosaic.forward import mosaic_forward
from pallas_kernels.mosaic.fp8 import mosaic_forward_fp8
from pallas_kernels.mosaic.masked import mosaic_forward_masked
from pallas_kernels.mosaic.masked_backward import mosaic_backward_masked

__all__ = ["flash_attention_mosaic", "mosaic_attention",
           "mosaic_attention_backward",
           "mosaic_backward_masked", "mosaic_forward", "mosaic_forward_fp8",
           "mosaic_forward_masked"]
