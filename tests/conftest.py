"""Shared test helpers: random inputs, the tolerance rule, GPU gating."""
from __future__ import annotations

import jax
import pytest

from pallas_kernels import compat

compat.filter_known_warnings()

ON_GPU = compat.has_gpu()


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.default_backend() "
                          f"is {jax.default_backend()!r})")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
