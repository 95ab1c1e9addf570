"""Smoke test of the quality study (bench/quality/run.py --quick): every section a-h is
written, with numbers in the JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quality_quick(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "quality" / "run.py"),
            "--quick",
            "--out",
            str(tmp_path),
        ],
        check=True,
        timeout=230,
        cwd=ROOT,
    )
    md = (tmp_path / "quality.md").read_text()
    for s in "abcdefgh":
        assert f"## ({s}) " in md, f"section ({s}) missing"
    assert "## Targets" in md and "measured wall time" in md
    res = json.loads((tmp_path / "quality.json").read_text())
    assert res["wall_s"] > 0
    assert {c["section"] for c in res["cells"]} == set("abcdefgh")
    for c in res["cells"]:
        assert math.isfinite(c["final_eval_loss"]), c["name"]
        assert c["curve"], c["name"]
    assert all(c["eval_accuracy"] is not None for c in res["cells"] if c["section"] == "h")
    assert all(c["peak_bytes"] > 0 for c in res["cells"] if c["section"] == "f")
    assert sorted(p.name for p in (tmp_path / "quality").glob("*.png")) == [
        f"{s}.png" for s in "abcdefgh"
    ]
