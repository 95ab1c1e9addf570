"""Elastic membership: learner ids assigned on Join, learners joining and leaving mid-run."""

from __future__ import annotations

import json

import pytest
from runtime_helpers import SyncerProcess, init_syncer, read_jsonl, tiny_config, tiny_model

from ddiloco.runtime.launch.launcher import Launcher
from ddiloco.runtime.syncer.membership import MembershipLog, assign_learner_id


def test_assign_learner_id_lowest_never_used_or_requested():
    assert assign_learner_id(None, []) == 0
    assert assign_learner_id(-1, [0, 1, 3]) == 2
    assert assign_learner_id(7, [0, 1]) == 7  # a requested id stays possible
    log = MembershipLog(0.0)
    log.note("join", 0, 1, 1)
    log.note("dead", 0, 1, 0)
    assert log.counts == {"join": 1, "leave": 0, "dead": 1}
    assert [e["kind"] for e in log.to_list()] == ["join", "dead"]
    with pytest.raises(ValueError, match="kind must be one of"):
        log.note("vanish", 0, 1, 0)


@pytest.mark.timeout(60)
def test_syncer_assigns_ids_on_join_and_status_shows_members(tmp_path):
    from ddiloco.runtime.launch.status import format_status
    from ddiloco.runtime.learner.client import SyncerClient
    from ddiloco.runtime.transport.spec import model_spec, spec_fingerprint

    s = SyncerProcess(tmp_path)
    c = SyncerClient(s.address, s.token)
    clients = [c]
    try:
        model = tiny_model()
        init_syncer(c, model)  # learner 0, asked for
        fp = spec_fingerprint(model_spec(model, 2))
        ca = SyncerClient(s.address, s.token)  # each learner its own client (session)
        clients.append(ca)
        a = ca.unary("Join", {"incarnation": -1, "fingerprint": fp})
        b = c.unary("Join", {"learner": -1, "incarnation": -1, "fingerprint": fp})
        assert (a["learner"], b["learner"]) == (1, 2)
        assert c.unary("Join", {"learner": 9, "incarnation": -1, "fingerprint": fp})["learner"] == 9
        ca.unary("Leave", {"learner": 1, "incarnation": a["incarnation"]})
        # an id once handed out is not given to a newcomer
        assert c.unary("Join", {"incarnation": -1, "fingerprint": fp})["learner"] == 3
        st = c.status()
        assert sorted(st["live"]) == [0, 2, 3, 9]
        assert st["membership"]["join"] == 5 and st["membership"]["leave"] == 1
        text = format_status(st)
        assert "5 joins, 1 leaves" in text and "leave 1" in text
    finally:
        for cl in clients:
            cl.close()
        s.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_learners_a_third_joins_one_leaves_ledger_balances(tmp_path):
    run = tmp_path / "run"
    chaos = tmp_path / "elastic.json"
    # 2 learners; a third (no id: the syncer assigns 2) joins once 60 steps are done; learner 0
    # leaves gracefully at 400. Global budget 2 x 500: long enough on idle cores for the
    # newcomer to start (a new process) and train before the budget is spent.
    chaos.write_text(
        json.dumps({"add_learner_at_step": [60], "remove_learner_at_step": [[0, 400]]})
    )
    cfg = tiny_config(run, learners=2, steps=500, chaos=str(chaos))
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    assert s["learners"] == 3 and [pl["learner"] for pl in s["per_learner"]] == [0, 1, 2]
    assert s["membership"]["join"] >= 3 and s["membership"]["leave"] >= 1
    by_id = {pl["learner"]: pl for pl in s["per_learner"]}
    for pl in s["per_learner"]:
        assert pl["ledger_balance_error"] < 1e-6, pl
        assert pl["ledger_steps"]["merged"] > 0, pl
    # the newcomer started from the global model, not from its own random init
    rows = read_jsonl(run / "learner_2" / "metrics.jsonl")
    first = next(r["loss"] for r in rows if r["kind"] == "step")
    assert first < s["initial_eval_loss"] - 0.3, (first, s["initial_eval_loss"])
    # learner 0 left before the end and learner 2 trained on after it
    ends = {
        m: max(
            r["t_s"]
            for r in read_jsonl(run / "metrics.jsonl")
            if r["kind"] == "step" and r.get("learner") == m
        )
        for m in (0, 2)
    }
    assert ends[0] < ends[2]
    assert by_id[0]["steps"] < by_id[1]["steps"]
    events = [r for r in read_jsonl(run / "syncer.metrics.jsonl") if r["kind"] in ("join", "leave")]
    assert any(e["kind"] == "join" and e["learner"] == 2 and e.get("assigned") for e in events)
    assert any(e["kind"] == "leave" and e["learner"] == 0 for e in events)
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    assert 0.0 < s["goodput"] <= 1.0
