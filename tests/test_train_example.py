"""examples/train_lm.py trains, with jit and with pmap over 4 host devices."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
FINAL = re.compile(r"\[(?P<name>[^\]]+)\] final train loss (?P<train>[\d.]+)"
                   r"\s+valid loss (?P<valid>[\d.]+)")


def train(tmp_path, *args, devices: int = 1) -> dict[str, float]:
  """Runs the tiny preset with both attentions; returns final train losses."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                      f"device_count={devices}").strip()
  env["PYTHONPATH"] = os.pathsep.join(
      [str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
  plot = tmp_path / "loss.png"
  result = subprocess.run(
      [sys.executable, str(REPO / "examples" / "train_lm.py"), "--preset",
       "tiny", "--steps", "12", "--attention", "both", "--log-every", "4",
       "--implementation", "triton",  # the kernel (interpret mode), not XLA
       "--plot", str(plot), *args],
      env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert plot.stat().st_size > 10_000
  losses = {m["name"]: float(m["train"]) for m in FINAL.finditer(result.stdout)}
  assert len(losses) == 2, result.stdout[-3000:]
  return losses


@pytest.fixture(scope="module")
def jit_losses(tmp_path_factory):
  return train(tmp_path_factory.mktemp("jit"))


def test_jit_trains_and_attentions_agree(jit_losses):
  assert jit_losses["flash"] < 4.0  # from log(74 characters) = 4.3
  assert jit_losses["flash"] == pytest.approx(jit_losses["xla"], abs=1e-3)


def test_pmap_matches_jit(tmp_path, jit_losses):
  """Data parallel over 4 devices sees the same global batches as jit."""
  losses = train(tmp_path, "--pmap", devices=4)
  assert losses["flash (pmap)"] == pytest.approx(jit_losses["flash"],
                                                 abs=1e-3)
  assert losses["xla (pmap)"] == pytest.approx(jit_losses["xla"], abs=1e-3)
