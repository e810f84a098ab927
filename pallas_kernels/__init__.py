"""Pallas attention kernels for NVIDIA GPUs.

No Flax and no public promises here: `jax_flash` is the public API. The kernels
obey the mask semantics of `pallas_kernels.masking`.
"""
