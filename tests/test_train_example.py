"""examples/train_lm.py trains, with jit and with pmap over 4 host devices."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

# Its module-scoped fixtures (a child process, a trained model) are built
# once: every test of the file runs in one xdist worker (pyproject).
pytestmark = pytest.mark.xdist_group("test_train_example")

REPO = pathlib.Path(__file__).resolve().parents[1]
FINAL = re.compile(r"\[(?P<name>[^\]]+)\] final train loss (?P<train>[\d.]+)"
                   r"\s+valid loss (?P<valid>[\d.]+)")


def train(tmp_path, *args, devices: int = 1, attention: str = "both",
          plot: bool = True) -> dict[str, float]:
  """Runs the tiny preset; returns the final train loss of each attention."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                      f"device_count={devices}").strip()
  env["PYTHONPATH"] = os.pathsep.join(
      [str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
  image = tmp_path / "loss.png"
  result = subprocess.run(
      [sys.executable, str(REPO / "examples" / "train_lm.py"), "--preset",
       "tiny", "--steps", "12", "--attention", attention, "--log-every", "4",
       "--implementation", "triton",  # the kernel (interpret mode), not XLA
       *(["--plot", str(image)] if plot else []), *args],
      env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  if plot:
    assert image.stat().st_size > 10_000
  losses = {m["name"]: float(m["train"]) for m in FINAL.finditer(result.stdout)}
  assert len(losses) == (2 if attention == "both" else 1), result.stdout[-3000:]
  return losses


@pytest.fixture(scope="module")
def jit_losses(tmp_path_factory):
  return train(tmp_path_factory.mktemp("jit"))


def test_jit_trains_and_attentions_agree(jit_losses):
  assert jit_losses["flash"] < 4.0  # from log(74 characters) = 4.3
  assert jit_losses["flash"] == pytest.approx(jit_losses["xla"], abs=1e-3)


def test_pmap_matches_jit(tmp_path, jit_losses):
  """Data parallel over 4 devices sees the same global batches as jit: the
  flash model's losses agree (XLA's attention under pmap is not ours to
  check, and the jit run already compares the two)."""
  losses = train(tmp_path, "--pmap", devices=4, attention="flash",
                 plot=False)
  assert losses["flash (pmap)"] == pytest.approx(jit_losses["flash"],
                                                 abs=1e-3)
