"""The real runtime's time-driven schedule and its one goodput: real syncer and learner
processes on loopback."""

from __future__ import annotations

import json
import re

import pytest
from runtime_helpers import read_jsonl, tiny_config

from ddiloco.run_summary import RunSummary
from ddiloco.runtime.launch.launcher import Launcher
from ddiloco.runtime.launch.status import format_status
from ddiloco.runtime.observe.accounting import goodput_so_far


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_time_driven_schedule_gathers_learners_and_goodput_is_one_number(tmp_path):
    run = tmp_path / "run"
    chaos = tmp_path / "chaos.json"
    # every learner sleeps twice its compute time after a step, so four learners fit on two
    # cores and OS time-slicing does not dominate the step times; learner 3 is 18% slower
    chaos.write_text(json.dumps({"slowdown": {"0": 3.0, "1": 3.0, "2": 3.0, "3": 3.54}}))
    cfg = tiny_config(
        run, learners=4, steps=60, quorum=1, schedule="time", install="overwrite", chaos=str(chaos)
    )
    with Launcher(cfg) as la:
        s = la.run()
        st = la._status
    assert s["ok"], s
    # a merge holds several learners (a schedule on each learner's own step count gave
    # about 1.3 at this quorum K = 1: learners drift apart and each round holds one)
    assert s["learners_per_merge"] >= 2.0, s["learners_per_merge"]
    assert s["learners_per_merge"] == st["learners_per_merge"]
    clocks = [r for r in read_jsonl(run / "syncer.metrics.jsonl") if r["kind"] == "clock"]
    assert clocks and all(c["slot_s"] > 0 for c in clocks)
    # one goodput: summary.json, `ddiloco status` and the live line read the same ledger
    assert s["goodput"] == goodput_so_far(st)
    assert f"goodput so far {s['goodput']:.3f}" in format_status(st)
    # with install = overwrite the tau overlap is overwritten, not merged (tau of each
    # learner's steps between two slots of a fragment, about H of them)
    assert 0.5 < s["goodput"] < 1.0
    useful = sum(pl["time"]["useful_s"] for pl in s["per_learner"])
    assert s["goodput"] == pytest.approx(useful / (cfg.learners * s["run_s"]), rel=1e-3)
    per_step = cfg.data.batch_size * cfg.data.block_size
    for pl in s["per_learner"]:
        led = pl["ledger_steps"]
        assert pl["ledger_balance_error"] < 1e-6
        assert led["overwritten"] > 0
        assert pl["tokens_computed"] == led["computed"] * per_step
        # the syncer's token ledger counts each push once per fragment share; it counts a
        # merged push in full, where the learner moves the part of it that a late install
        # overwrote out of "merged" (into lost or overwritten)
        got = pl["syncer_tokens"]["tokens_merged"]
        assert 0.95 * led["merged"] * per_step <= got, (got, led)
        assert got <= 1.05 * (led["merged"] + led["lost"] + led["overwritten"]) * per_step, (
            got,
            led,
        )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rebased_installs_that_come_back_late_lose_no_step(tmp_path):
    run = tmp_path / "run"
    chaos = tmp_path / "chaos.json"
    # every push and every merged fragment waits 0.15 s on the link, each way: a merged
    # value comes back many steps after its install step (t + tau), often after the learner
    # has pushed the fragment again
    chaos.write_text(json.dumps({"link_latency_s": 0.15, "slowdown": {"0": 2.0, "1": 2.0}}))
    cfg = tiny_config(run, learners=2, steps=150, install="rebase", chaos=str(chaos))
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    assert s["install"] == "rebase"
    # the same summary type as the in-process engine: every field present
    assert {f for f in RunSummary.__dataclass_fields__ if f != "extra"} <= set(s)
    for pl in s["per_learner"]:
        led = pl["ledger_steps"]
        assert pl["ledger_balance_error"] < 1e-6, pl
        # installs really were late ...
        assert pl["install_delay_steps"] > cfg.sync.tau + 2, pl
        # ... and no step was thrown away: everything computed reached the global model
        assert led["lost"] == 0 and led["overwritten"] == 0, led
        assert led["merged"] >= 0.99 * led["computed"], led
    assert not s["rejections"], s["rejections"]  # every push valid (counters never negative)
    # the ledger above decides that no step was lost; goodput is wall-clock time and moves
    # with the machine's load (0.72 was measured beside a full test run), so it only
    # guards against a run that stalled on its late installs
    assert s["goodput"] > 0.5, s["goodput"]
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    logs = "".join(p.read_text() for p in run.rglob("learner_*.log"))
    # the learner processes' advice names the command line's flags, never a keyword
    assert "merged fragments come back" in logs and "A tau of" in logs
    assert re.search(r"\((--tau \d+|-H \d+ or more, with --tau \d+)\)", logs), logs[-2000:]
    assert not re.search(r"\btau=\d", logs)
