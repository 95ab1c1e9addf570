"""Unit tests of the observability's pure parts: metric families from a status snapshot,
history events from successive snapshots, a run directory's files read incrementally."""

from __future__ import annotations

import json

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddiloco.runtime.observe.history import RunDirReader, StatusHistory
from ddiloco.runtime.observe.prom import syncer_registry


def _status(
    merges: int,
    steps: tuple[int, int],
    *,
    boot: str = "b1",
    inc1: int = 1,
    state1: str = "live",
    rejections: dict | None = None,
    mean_quorum=1.5,
) -> dict:
    learners = {}
    for m, (step, inc, state) in enumerate(((steps[0], 1, "live"), (steps[1], inc1, state1))):
        learners[str(m)] = {
            "state": state,
            "incarnation": inc,
            "last_heartbeat_age_s": 0.1,
            "report": {
                "global_step": step,
                "loss": 3.0 - step / 100,
                "step_s": 0.01,
                "compute_s": step * 0.01,
                "ledger": {"computed": step, "merged": step / 2},
            },
        }
    return {
        "boot_id": boot,
        "uptime_s": 10.0,
        "run_s": 10.0,
        "initialised": True,
        "versions": [merges, merges],
        "merges": merges,
        "live": [int(m) for m, i in learners.items() if i["state"] == "live"],
        "learners": learners,
        "counters": {"bytes_in": 1000, "bytes_out": 2000, "push_accepted": 7, "push_apply_s": 0.5},
        "rejections": rejections or {},
        "mean_quorum": mean_quorum,
        "xi_step_s": 0.01,
        "grace_s": 0.02,
        "steps_done": sum(steps),
        "step_budget": 100,
        "budget_spent": False,
    }


def test_metric_families_of_a_status_snapshot():
    text = generate_latest(
        syncer_registry(lambda: _status(4, (30, 10), rejections={"E_SHAPE": 2}))
    ).decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert got[("ddiloco_merges_total", ())] == 4
    assert got[("ddiloco_merge_learners_total", ())] == 6  # 4 merges x 1.5 learners
    assert got[("ddiloco_learner_step", (("learner", "0"),))] == 30
    assert got[("ddiloco_learner_up", (("learner", "1"),))] == 1
    assert got[("ddiloco_fragment_version", (("fragment", "1"),))] == 4
    assert got[("ddiloco_learners", (("state", "dead"),))] == 0
    assert got[("ddiloco_rejections_total", (("code", "E_SHAPE"),))] == 2
    assert got[("ddiloco_pushes_total", (("status", "accepted"),))] == 7
    assert ("ddiloco_pushes_total", (("status", "apply_s"),)) not in got
    assert got[("ddiloco_received_bytes_total", ())] == 1000
    # goodput: (0.3 * 15/30 + 0.1 * 5/10) / (2 learners x 10 s)
    assert abs(got[("ddiloco_goodput", ())] - 0.2 / 20) < 1e-12


def test_history_turns_snapshot_differences_into_series_and_events():
    snaps = iter(
        [
            _status(0, (0, 0), mean_quorum=None),
            _status(4, (20, 10), mean_quorum=1.5),
            _status(6, (30, 10), inc1=1, state1="dead", mean_quorum=1.5),
            _status(8, (40, 5), inc1=2, rejections={"E_AUTH": 3}, mean_quorum=1.5),
            _status(1, (41, 6), boot="b2", inc1=2, mean_quorum=1.0),
        ]
    )
    h = StatusHistory(lambda: next(snaps), "test")
    for _ in range(5):
        h.sample()
    v = h.view()
    kinds = [e["kind"] for e in v["events"]]
    assert kinds == [
        "syncer",
        "learner-join",
        "learner-join",
        "learner-dead",
        "learner-restart",
        "reject",
        "syncer-restart",
    ]
    assert [p[1] for p in v["series"]["merges"]] == [0, 4, 6, 8, 1]
    assert [p[1] for p in v["series"]["live"]] == [2, 2, 1, 2, 2]
    # learners per merge: sum of quorum sizes over merges between two samples of one boot
    assert [p[1] for p in v["series"]["learners_per_merge"]] == [1.5, 1.5, 1.5]
    assert [p[1] for p in v["loss"]["0"]] == [3.0, 2.8, 2.7, 2.6, 2.59]
    assert v["summary"]["merges"] == 1 and v["learners"][1]["incarnation"] == 2
    h2 = StatusHistory(lambda: (_ for _ in ()).throw(ConnectionError("down")), "x")
    h2.sample()
    h2.sample()
    assert [e["kind"] for e in h2.view()["events"]] == ["syncer-unreachable"]
    assert h2.view()["reachable"] is False


def test_run_directory_is_read_incrementally_and_torn_lines_wait(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "learner_0").mkdir()
    w0 = (tmp_path / "config.json").stat().st_mtime
    lm = tmp_path / "learner_0" / "metrics.jsonl"
    lm.write_text(
        json.dumps({"kind": "learner_start", "learner": 0, "incarnation": 1, "wall": w0 + 1})
        + "\n"
        + json.dumps({"kind": "step", "learner": 0, "step": 1, "loss": 4.0, "wall": w0 + 1.5})
        + "\n"
        + '{"kind": "st'
    )
    (tmp_path / "syncer.metrics.jsonl").write_text(
        json.dumps(
            {"kind": "merge", "fragment": 1, "version": 1, "learners": [0, 1], "wall": w0 + 2}
        )
        + "\n"
    )
    (tmp_path / "chaos.jsonl").write_text(
        json.dumps({"kind": "kill-learner", "target": "learner_0", "wall": w0 + 3, "t_s": 3}) + "\n"
    )
    r = RunDirReader(tmp_path)
    v = r.view()
    assert v["learners"] == [
        {"learner": "0", "state": "killed", "incarnation": 1, "step": 1, "loss": 4.0}
    ]
    assert v["versions"] == [0, 1] and v["summary"]["merges"] == 1
    assert v["series"]["learners_per_merge"] == [[2.0, 2]]
    assert [e["kind"] for e in v["events"]] == ["kill-learner"]
    with open(lm, "a") as f:  # the torn line completes, and one more step
        f.write('ep", "learner": 0, "step": 2, "loss": 3.5, "wall": %r}\n' % (w0 + 4))
    v = r.view()
    assert v["learners"][0]["step"] == 2 and [p[1] for p in v["loss"]["0"]] == [4.0, 3.5]
    assert not v["done"]
    (tmp_path / "summary.json").write_text(json.dumps({"goodput": 0.9, "bytes_up": 5}))
    v = r.view()
    assert v["done"] and v["summary"]["goodput"] == 0.9
