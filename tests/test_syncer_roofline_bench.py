"""The syncer roofline bench (``bench/syncer_roofline.py``) at a tiny size: a real syncer,
two synthetic learners, one round. Checks the JSON it writes (not the figures, which depend
on the machine), so that the bench keeps running."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_roofline_bench_writes_sane_figures(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import syncer_roofline

        out = syncer_roofline.main(
            [
                "--params",
                "1e6",
                "--settings",
                "default",
                "--learners",
                "2",
                "--rounds",
                "1",
                "--tcp-s",
                "0.3",
                "--out",
                str(tmp_path),
            ]
        )
    finally:
        sys.path.remove(str(BENCH))
    saved = json.loads((tmp_path / "roofline.json").read_text())
    assert saved["command"].startswith("python bench/syncer_roofline.py")
    (r,) = saved["runs"]
    assert r["error"] is None, r["error"]
    assert r["case"] == {"setting": "default", "N": 10**6, "P": 8, "M": 2}
    assert r["merges"] == 8  # one round of P fragments, K = M: one merge each
    pm = r["per_merge"]
    for k in ("wall_s", "cpu_s", "span_median_s", "socket_bytes", "roofline_s", "socket_s"):
        assert pm[k] > 0, (k, pm[k])
    # bf16 pushes in, fp32 fragments out: 2 x (2 + 4) bytes per element of a fragment
    n = 10**6 / 8
    assert pm["push_bytes_in"] == pytest.approx(2 * 2 * n, rel=0.01)
    assert pm["fetch_bytes_out"] == pytest.approx(2 * 4 * n, rel=0.01)
    assert pm["memory_bytes"]["total"] == pytest.approx((2 * 2 + 4 + 8 + 20) * n, rel=0.01)
    mach = r["machine"]["mean"]
    assert mach["tcp_bytes_per_s"] > 1e7 and mach["copy_bytes_per_s"] > 1e8
    # the roofline cannot be beaten by much (it is a bound up to the noise of its rates)
    assert pm["wall_x_roofline"] >= 0.5
    assert pm["cpu_x_roofline"] >= 0.5
    assert pm["roofline_overlap_s"] <= pm["roofline_s"]
    assert (tmp_path / "roofline.md").read_text().count("| default |") == 1
    (line,) = out["rows"]
    assert line["target"].startswith("7. ") and line["met"] is None
