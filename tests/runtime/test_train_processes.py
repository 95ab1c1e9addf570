"""``ddiloco train --engine processes``: real syncer and learner processes on loopback."""

from __future__ import annotations

import pytest

from ddiloco.runtime.launcher import Launcher, LaunchOptions
from runtime_helpers import max_gap_ratio, read_jsonl, step_walls, tiny_config


@pytest.mark.timeout(120)
def test_three_learners_train_and_eval_loss_falls(tmp_path):
    cfg = tiny_config(tmp_path / "run", learners=3, steps=80)
    with Launcher(cfg, LaunchOptions()) as la:
        s = la.run()
    assert s["ok"], s
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5, (s["initial_eval_loss"],
                                                                 s["final_eval_loss"])
    assert s["merges"] > 0 and s["rejections"] == {}
    for pl in s["per_learner"]:
        assert pl["steps"] == 80
        assert pl["ledger_balance_error"] < 1e-6
        assert pl["ledger_steps"]["merged"] > 0.9 * 80
    kinds = {r["kind"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert {"config", "eval", "step", "merge", "final"} <= kinds
    assert (tmp_path / "run" / "summary.json").is_file()
    assert (tmp_path / "run" / "logs" / "syncer.log").is_file()
