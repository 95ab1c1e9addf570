"""A chaos run in CI: learner SIGKILL, a SIGSTOP longer than the liveness timeout, syncer
SIGKILL + resume and a slow, laggy link in one real run, with int4 pushes and a delta-coded
int4 downlink. It must end cleanly, lose no
published version and balance every learner's token ledger. A second run cuts one learner's
link for longer than the liveness timeout: it trains on, is declared dead and rejoins. (A
duplicate learner id and corrupt or NaN checkpoints are in test_sessions.py and
test_checkpoint_integrity.py.)"""

from __future__ import annotations

import json

import pytest
from runtime_helpers import read_jsonl, tiny_config

from ddiloco.runtime.launch.launcher import Launcher


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_chaos_loses_no_published_version_and_balances_the_ledger(tmp_path):
    run = tmp_path / "run"
    chaos = tmp_path / "chaos.json"
    chaos.write_text(
        json.dumps(
            {
                "seed": 3,
                "kill_at_step": [[1, 30]],
                "kill_downtime_s": 1.0,
                # early: the mean step reaches 60 (the syncer's kill) only well after the
                # stopped learner has been declared dead (2 s)
                "stop_at_step": [[2, 5, 4.0]],
                "syncer_kill_at_step": 60,
                "syncer_downtime_s": 1.0,
                "slowdown": {"0": 3.0, "1": 3.0, "2": 3.0},
                "link_latency_s": 0.01,
            }
        )
    )
    cfg = tiny_config(
        run,
        learners=3,
        steps=120,
        batch_size=16,
        block_size=64,
        chaos=str(chaos),
        heartbeat_timeout_s=2.0,
        # the delta-coded downlink through every fault: restarted learners and a restarted
        # syncer hold no copy the other side knows, and must get whole fragments again
        codec="int4",
        down_codec="int4",
        down_delta=True,
    )
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.3, s
    kinds = [r["kind"] for r in read_jsonl(run / "chaos.jsonl")]
    for k in ("kill-learner", "stop-learner", "kill-syncer", "restart-syncer"):
        assert k in kinds, (k, kinds)
    syncer_rows = read_jsonl(run / "syncer.metrics.jsonl")
    kill = next(r["wall"] for r in read_jsonl(run / "chaos.jsonl") if r["kind"] == "kill-syncer")
    resume = next(r for r in syncer_rows if r["kind"] == "resume")
    stop = next(r["wall"] for r in read_jsonl(run / "chaos.jsonl") if r["kind"] == "stop-learner")
    assert any(
        r["kind"] == "dead" and r["learner"] == 2 and r["wall"] > stop for r in syncer_rows
    ), "the stopped learner was declared dead"
    cont = next(r["wall"] for r in read_jsonl(run / "chaos.jsonl") if r["kind"] == "cont-learner")
    assert any(
        r["kind"] == "step" and r["wall"] > cont and r["installed"]
        for r in read_jsonl(run / "learner_2" / "metrics.jsonl")
    ), "the learner back from its freeze installs merged versions again"
    for m in range(3):
        for r in read_jsonl(run / f"learner_{m}" / "metrics.jsonl"):
            if r["kind"] == "step" and r["wall"] < kill:
                for p, v in r["installed"].items():  # nothing published before the kill is lost
                    assert resume["versions"][int(p)] >= v, (m, p, v, resume["versions"])
    for pl in s["per_learner"]:
        assert pl["ledger_balance_error"] < 1e-6, pl
    assert s["syncer_counters"].get("resumes") == 1
    assert s.get("syncer_rejections", {}).get("E_INTERNAL", 0) == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_cut_link_trains_on_is_declared_dead_and_rejoins(tmp_path):
    run = tmp_path / "run"
    chaos = tmp_path / "chaos.json"
    chaos.write_text(json.dumps({"link_cut": [[1, 10, 3.0]], "slowdown": {"1": 2.0}}))
    cfg = tiny_config(
        run,
        learners=2,
        steps=400,  # long enough on idle cores to outlast the 3 s cut and rejoin
        batch_size=16,
        block_size=64,
        chaos=str(chaos),
        heartbeat_timeout_s=1.0,
    )
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    chaos_rows = read_jsonl(run / "chaos.jsonl")
    cut = next(r["wall"] for r in chaos_rows if r["kind"] == "cut-link")
    back = next(r["wall"] for r in chaos_rows if r["kind"] == "restore-link")
    assert back - cut >= 3.0
    steps = [
        r["step"]
        for r in read_jsonl(run / "learner_1" / "metrics.jsonl")
        if r["kind"] == "step" and cut < r["wall"] < back
    ]
    assert len(steps) >= 2 and steps[-1] > steps[0], ("no training while cut", steps)
    syncer_rows = read_jsonl(run / "syncer.metrics.jsonl")
    assert any(
        r["kind"] == "dead" and r["learner"] == 1 and cut < r["wall"] < back for r in syncer_rows
    ), "the cut learner was declared dead during the cut"
    assert not any(r["kind"] == "dead" and r["learner"] == 0 for r in syncer_rows)
    assert any(
        r["kind"] == "join" and r["learner"] == 1 and r["wall"] > back for r in syncer_rows
    ), "the cut learner rejoined once its link was back"
    assert any(
        r["kind"] == "merge" and 1 in r["learners"] and r["wall"] > back for r in syncer_rows
    ), "the cut learner's pushes were merged after the cut"
    for pl in s["per_learner"]:
        assert pl["ledger_balance_error"] < 1e-6, pl
    assert s.get("syncer_rejections", {}).get("E_INTERNAL", 0) == 0
