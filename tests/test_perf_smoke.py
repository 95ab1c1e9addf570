"""Smoke test of the performance bench harness: tiny settings, checks the result format
(not the figures, which depend on the machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_run_all_quick_writes_rows(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import run_all

        out = tmp_path / "perf.json"
        only = "codecs" if torch.cuda.is_available() else "codecs,gpu"  # gpu: the skip entry
        res = run_all.main(["--quick", "--only", only, "--out", str(out)])
    finally:
        sys.path.remove(str(BENCH))
    assert not res["errors"], res["errors"]
    saved = json.loads(out.read_text())
    targets = [r["target"] for r in saved["rows"]]
    assert any(t.startswith("3.") for t in targets)
    assert torch.cuda.is_available() or any(t.startswith("6.") for t in targets)
    for r in saved["rows"]:
        assert {"target", "measured", "threshold", "met", "notes"} <= set(r)
    codecs = saved["details"]["codecs"]["codecs"]
    assert codecs["int4"]["bytes_vs_fp32"] < codecs["int8"]["bytes_vs_fp32"] < 0.3
