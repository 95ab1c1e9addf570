"""A chaos run replays from its ``config.toml``: the ``[chaos]`` section is saved with the
run, so the replay injects the same faults from the same seeded schedule, with the chaos
file that filled the section gone."""

from __future__ import annotations

import json

import pytest
from runtime_helpers import read_jsonl, tiny_config

from ddiloco.cli import main
from ddiloco.config import ChaosConfig, dump_config, load_config
from ddiloco.runtime.chaos import chaos_for_run, chaos_schedule

INJECTED = ("kill-learner", "restart-learner", "stop-learner", "cont-learner")


def _faults(run) -> list[tuple[str, str]]:
    """The injected faults of a run (kind, target), in a fixed order: the learners reach
    their trigger steps in either order."""
    rows = read_jsonl(run / "chaos.jsonl")
    return sorted((r["kind"], r["target"]) for r in rows if r["kind"] in INJECTED)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_chaos_run_replays_from_its_config_toml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, again = tmp_path / "first", tmp_path / "again"
    base = dump_config(tiny_config(first, learners=2, steps=80, seed=5), tmp_path / "base.toml")
    chaos = tmp_path / "chaos.json"
    chaos.write_text(
        json.dumps(
            {
                "kill_at_step": [[0, 15]],
                "kill_downtime_s": 0.5,
                # both learners at half speed over 80 steps: learner 0's steps after 15
                # outlast the status poll that fires the kill, and the run outlasts its
                # restart (40 steps at full speed raced both: a learner finished unkilled,
                # or the budget was spent before the restart)
                "slowdown": {"0": 2.0, "1": 2.0},
                "stop_at_step": [[1, 10, 0.5]],
                # a seeded schedule that fires later than the run lasts: the draws are in
                # summary.json and must come out the same
                "kill_mean_interval_s": 3600.0,
                "start_after_s": 600.0,
            }
        )
    )
    assert main(["train", "--config", str(base), "--chaos", str(chaos), "--out", str(first)]) == 0
    saved = load_config(first / "config.toml")
    assert saved.chaos == ChaosConfig(
        kill_at_step=((0, 15),),
        kill_downtime_s=0.5,
        slowdown={"0": 2.0, "1": 2.0},
        stop_at_step=((1, 10, 0.5),),
        kill_mean_interval_s=3600.0,
        start_after_s=600.0,
    )
    chaos.unlink()  # the replay reads its chaos from config.toml alone
    assert main(["train", "--config", str(first / "config.toml"), "--out", str(again)]) == 0

    a, b = (json.loads((d / "summary.json").read_text()) for d in (first, again))
    assert a["ok"] and b["ok"]
    assert a["chaos"] == b["chaos"] and a["chaos"]["seed"] == 5  # unset: the run's seed
    schedule = chaos_schedule(ChaosConfig(**a["chaos"]), 24 * 3600.0)
    assert schedule and schedule == chaos_schedule(ChaosConfig(**b["chaos"]), 24 * 3600.0)
    assert schedule == chaos_schedule(chaos_for_run(load_config(again / "config.toml")), 86400.0)
    assert (
        _faults(first)
        == _faults(again)
        == [
            ("cont-learner", "learner_1"),
            ("kill-learner", "learner_0"),
            ("restart-learner", "learner_0"),
            ("stop-learner", "learner_1"),
        ]
    )
    assert (again / "config.toml").read_text() == (first / "config.toml").read_text().replace(
        str(first), str(again)
    )
