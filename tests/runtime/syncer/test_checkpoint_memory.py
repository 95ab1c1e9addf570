"""The memory of a syncer checkpoint write and resume at N = 20M fp32 parameters (80 MB):
``bench/checkpoint_stream.py`` runs each in a fresh process of a real ``SyncerServer`` and
reads its peak RSS (VmHWM).

A write holds references to the live tensors and streams them out: it adds about nothing.
A resume builds the state for the spec and replaces it fragment by fragment: it peaks at
the live state (theta and momentum, 2 x 4N bytes) plus about one fragment (2 x 4N / P at
P = 4). The single-file format before
it (``torch.save`` of cloned tensors into a BytesIO) measured 4.26 x 4N above the live
state for a write and 4.01 x 4N for a resume on this test's settings, so each bound below
fails for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "checkpoint_stream.py"

WRITE_MAX_X_MODEL = 0.5
"""A write's peak RSS above the live state, in units of 4N bytes (measured: 0.01)."""
RESUME_MAX_X_MODEL = 1.5
"""A resume's peak RSS above the live state, in units of 4N (measured: 0.62)."""


@pytest.mark.timeout(300)
def test_a_checkpoint_write_and_a_resume_add_at_most_about_a_fragment(tmp_path):
    out = tmp_path / "ck.json"
    r = subprocess.run(
        [sys.executable, str(BENCH), "--params", "2e7", "--fragments", "4", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["resumed_equal"], res
    w, s = res["write"], res["resume"]
    assert w["peak_above_live_x_model"] <= WRITE_MAX_X_MODEL, res
    assert s["peak_above_live_x_model"] <= RESUME_MAX_X_MODEL, res
    assert res["checkpoint_bytes"] >= 2 * res["model_bytes"]  # theta and momentum on disk
