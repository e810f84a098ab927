"""Block sizes for the attention kernels, with measured defaults per device.

`BlockSizes` is frozen and hashable so it can be a static argument of `jax.jit`
and a non-differentiable argument of `jax.custom_vjp`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Triton's tl.dot needs every tile dimension to be at least 16.
MIN_BLOCK = 16


def _is_power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch settings of the three attention kernels.

  Attributes:
    block_q, block_k: query and key/value tile of the forward kernel.
    block_q_dkv, block_kv_dkv: tiles of the dK/dV kernel (grid over K/V blocks).
    block_q_dq, block_kv_dq: tiles of the dQ kernel (grid over Q blocks).
    num_warps, num_stages: Triton launch settings of the forward kernel.
    num_warps_dkdv, num_stages_dkdv: the same for the dK/dV kernel.
    num_warps_dq, num_stages_dq: the same for the dQ kernel.
  """

  block_q: int = 64
  block_k: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  num_warps: int = 4
  num_stages: int = 2
  num_warps_dkdv: int = 4
  num_stages_dkdv: int = 2
  num_warps_dq: int = 4
  num_stages_dq: int = 2

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"BlockSizes.{field.name} must be an int, got {value!r}")
      if field.name.startswith("block_"):
        if value < MIN_BLOCK or not _is_power_of_two(value):
          raise ValueError(
              f"BlockSizes.{field.name} must be a power of two >= {MIN_BLOCK},"
              f" got {value}")
      elif field.name.startswith("num_warps"):
        if value not in (1, 2, 4, 8, 16):
          raise ValueError(f"BlockSizes.{field.name} must be 1, 2, 4, 8 or 16,"
                           f" got {value}")
      elif value < 1:
        raise ValueError(f"BlockSizes.{field.name} must be >= 1, got {value}")

  @classmethod
  def get_default(cls, head_dim: int, device_kind: str | None = None,
                  dtype=None, kv_len: int | None = None) -> "BlockSizes":
    """Measured defaults for `head_dim` on `device_kind` (default: device 0)
    and, where given, the keys' length `kv_len` (`_GPU_SHORT_FORWARD`).

    GPU values were chosen by the block sweep on an H200
    (`benchmarks/results/h200_block_sweep.json`) for 16-bit inputs. float32
    (`dtype`) gets smaller tiles on a GPU: its tiles take twice the shared
    memory, and the 16-bit tiles at head dim 128 took over a minute to
    compile (`benchmarks/diagnostics/float32_probe.py`). On the CPU
    (interpret mode) large tiles mean fewer interpreted steps, which is all
    that matters there.
    """
    if device_kind is None:
      device_kind = jax.devices()[0].device_kind
    if "cpu" in device_kind.lower():
      return cls(block_q=64, block_k=64, block_q_dkv=64, block_kv_dkv=64,
                 block_q_dq=64, block_kv_dq=64)
    if dtype is not None and jnp.dtype(dtype).itemsize > 2:
      return _GPU_FLOAT32_DEFAULTS[256 if head_dim > 128 else 128]
    dim_class = _head_dim_class(head_dim)
    longest, forward = _GPU_SHORT_FORWARD.get(dim_class, (0, {}))
    if kv_len is not None and kv_len <= longest:
      return dataclasses.replace(_GPU_DEFAULTS[dim_class], **forward)
    return _GPU_DEFAULTS[dim_class]


def _head_dim_class(head_dim: int) -> int:
  for limit in (64, 128):
    if head_dim <= limit:
      return limit
  return 256


# Defaults keyed by padded head dim, measured on an H200 at seq 4096, bf16
# (benchmarks/results/h200_block_sweep.json): each kernel's fastest setting.
_GPU_DEFAULTS = {
    64: BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=3,
                   block_q_dkv=64, block_kv_dkv=64, num_warps_dkdv=4,
                   num_stages_dkdv=3, block_q_dq=128, block_kv_dq=64,
                   num_warps_dq=4, num_stages_dq=3),
    128: BlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=3,
                    block_q_dkv=64, block_kv_dkv=64, num_warps_dkdv=4,
                    num_stages_dkdv=3, block_q_dq=128, block_kv_dq=64,
                    num_warps_dq=8, num_stages_dq=3),
    256: BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=2,
                    block_q_dkv=64, block_kv_dkv=64, num_warps_dkdv=8,
                    num_stages_dkdv=2, block_q_dq=128, block_kv_dq=32,
                    num_warps_dq=8, num_stages_dq=2),
}

# The forward's tiles for short keys, by padded head dim: (longest kv_len,
# forward fields). Measured on an H100 at ViT's lengths, d=64, no mask,
# each at its model's batch and heads (`h200_check.sh vit_tiles`,
# results/h100_block_sweep_vit_*.json): 32-key tiles leave the last, partial
# tile less padding (197 keys: 27 padded of 224 against 59 of 256), and
# the forward ran 131 against 123 TFLOP/s at 197 keys, 149 against 144 at
# 257; at 577 keys the default is within 2.5% of the best.
_GPU_SHORT_FORWARD = {
    64: (320, dict(block_q=64, block_k=32, num_warps=4, num_stages=3)),
}

# float32 on a GPU (`benchmarks/diagnostics/float32_probe.py`, H200):
# half-size K/V tiles (a float32 tile takes twice the shared memory), and at
# head dim 256 32-row tiles in one stage: 64x32 tiles in two stages asked
# for 256 KiB there (Triton's layout scratch for the split TF32 products
# comes on top of the tiles that `common.fit_stages` counts).
_GPU_FLOAT32_DEFAULTS = {
    128: BlockSizes(block_q=64, block_k=32, num_warps=4, num_stages=2,
                    block_q_dkv=32, block_kv_dkv=64, num_warps_dkdv=4,
                    num_stages_dkdv=2, block_q_dq=64, block_kv_dq=32,
                    num_warps_dq=4, num_stages_dq=2),
    256: BlockSizes(block_q=32, block_k=32, num_warps=4, num_stages=1,
                    block_q_dkv=32, block_kv_dkv=32, num_warps_dkdv=4,
                    num_stages_dkdv=1, block_q_dq=32, block_kv_dq=32,
                    num_warps_dq=4, num_stages_dq=1),
}
