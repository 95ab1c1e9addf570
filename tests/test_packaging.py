"""The wheel, installed with no extras into a fresh virtual environment, runs the main job
and the simulator (``.ci/wheel_smoke.sh``): no import on a default path can hide behind a
test extra."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_runs_without_extras() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the wheel is built from the tracked files)")
    r = subprocess.run(
        ["bash", str(ROOT / ".ci" / "wheel_smoke.sh")], capture_output=True, text=True, timeout=580
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "wheel smoke: ok" in r.stdout
    assert "goodput" in r.stdout  # the simulator's report
