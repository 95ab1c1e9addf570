"""summary.json: one RunSummary type, written by both engines with the same keys."""

from __future__ import annotations

import json

import pytest

from ddiloco.config import TrainConfig
from ddiloco.engine import run
from ddiloco.run_summary import SUMMARY_FILE, RunSummary

FIELDS = {f for f in RunSummary.__dataclass_fields__ if f != "extra"} | {"gap_to_floor"}


def test_the_json_form_round_trips_and_extra_keys_sit_beside_the_fields(tmp_path):
    s = RunSummary(
        method="decoupled",
        engine="inproc",
        learners=2,
        steps=10,
        tokens=100,
        final_eval_loss=1.5,
        initial_eval_loss=3.0,
        entropy_floor=1.0,
        extra={"virtual_time_s": 12.0},
    )
    d = s.write(tmp_path)
    on_disk = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert on_disk == d and d["gap_to_floor"] == 0.5 and d["virtual_time_s"] == 12.0
    assert FIELDS <= set(d)
    assert not (tmp_path / (SUMMARY_FILE + ".tmp")).exists()
    back = RunSummary.read(tmp_path)
    assert back == s
    with pytest.raises(ValueError, match="RunSummary fields"):
        RunSummary(
            **{**{k: getattr(s, k) for k in FIELDS - {"gap_to_floor"}}, "extra": {"goodput": 1}}
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["dp", "streaming", "decoupled"])
def test_every_in_process_method_writes_every_field(tmp_path, method):
    cfg = TrainConfig(
        out=str(tmp_path), method=method, engine="inproc", learners=2, steps=24, H=12,
        fragments=2, batch_size=4, block_size=16, eval_every=12, eval_batches=2, progress=False,
    )  # fmt: skip
    s = run(cfg)
    assert FIELDS <= set(s)
    assert set(s) == set(json.loads((tmp_path / SUMMARY_FILE).read_text()))
    assert s["method"] == method and s["engine"] == "inproc" and s["steps"] == 24
    assert s["wall_s"] > 0 and s["config"]["method"] == method
    assert (s["install"] is not None) == (method == "decoupled")
