"""``ddiloco train --launcher ray`` on a real Ray cluster of two nodes on this machine: the
syncer and three learners as Ray actors, one learner's Ray worker SIGKILLed from outside,
brought back by Ray's actor restart, and the run completes with goodput >= 0.8."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ray_helpers import first_step_s, train_with_kills, two_node_cluster
from runtime_helpers import read_jsonl

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ddiloco[ray]')")


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster(cpus=2) as c:
        yield c


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_learner_worker_killed_from_outside_is_restarted_by_ray(cluster, tmp_path):
    out = tmp_path / "run"
    # 4 CPUs in the cluster: the syncer (1 CPU, the driver's node) and three learners (1 CPU
    # each) cannot all sit on one node
    args = ["--ray-address", cluster.address, "-M", "3", "--steps", "1200", "--seed", "1"]
    run = train_with_kills(
        out, [*args, "--no-progress"], cluster.env, kill_at_steps=(150,), timeout_s=360
    )
    log = (tmp_path / "run.log").read_text()
    assert run.rc == 0, log[-3000:]
    s = run.summary
    assert s["ok"] and s["launcher"] == "ray"

    # the kill hit a Ray worker, the process the learner trained in
    (kill,) = run.kills
    assert kill["cmdline"].startswith("ray::LearnerActor"), kill

    # Ray restarted the actor: a second process of learner 1 resumed its step and joined as
    # a new incarnation of the same id
    starts = [
        r for r in read_jsonl(out / "learner_1" / "metrics.jsonl") if r["kind"] == "learner_start"
    ]
    assert [r["pid"] for r in starts][0] == kill["pid"]
    assert len(starts) == 2 and starts[1]["pid"] != kill["pid"]
    assert starts[1]["incarnation"] > starts[0]["incarnation"]
    assert starts[1]["step"] >= kill["step"] - 10  # progress is saved every 10 steps
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(kill["pid"], 0)
    pl = {p["learner"]: p for p in s["per_learner"]}
    assert sorted(pl) == [0, 1, 2]  # no new id: the restart asked for its own
    assert (pl[1]["starts"], pl[1]["failures"]) == (2, 1)
    assert s["membership"]["join"] == 4

    # placed on both nodes; the run completes and trains
    assert s["ray"]["nodes"] == 2
    assert len(set(s["ray"]["learner_nodes"].values())) == 2
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    for p in pl.values():
        assert p["ledger_balance_error"] < 1e-6
    assert s["goodput"] >= 0.8, (s["goodput"], {m: p["ledger_steps"] for m, p in pl.items()})
    assert first_step_s(out) is not None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_syncer_worker_killed_from_outside_resumes_on_its_port(cluster, tmp_path):
    out = tmp_path / "run"
    args = ["--ray-address", cluster.address, "-M", "2", "--steps", "400", "--no-progress"]
    run = train_with_kills(
        out, args, cluster.env, learner=0, kill_at_steps=(100,), timeout_s=240, syncer=True
    )
    assert run.rc == 0, (tmp_path / "run.log").read_text()[-3000:]
    (kill,) = run.kills
    assert kill["cmdline"].startswith("ray::SyncerActor"), kill
    s = run.summary
    assert s["ok"]
    # Ray restarted the actor on the driver's node: it resumed from its checkpoint, on the
    # port the learners know, and they trained on to the step budget against it
    events = [r["kind"] for r in read_jsonl(out / "syncer.metrics.jsonl")]
    assert events.count("resume") == 1
    assert sum(p["steps"] for p in s["per_learner"]) >= 800
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    for p in s["per_learner"]:
        assert p["ledger_balance_error"] < 1e-6


def _train(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(120)
def test_launcher_chaos_and_settings_are_refused_with_what_to_do(tmp_path):
    r = _train(["--launcher", "ray", "--chaos", "kill30", "--out", str(tmp_path / "x")])
    assert r.returncode == 2
    assert "does not inject the launcher's chaos (kill_mean_interval_s" in r.stderr
    assert "--launcher local" in r.stderr
    r = _train(["--ray-address", "10.0.0.1:6379", "--out", str(tmp_path / "y")])
    assert r.returncode == 2 and "set runtime.launcher = ray" in r.stderr


@pytest.mark.timeout(120)
def test_without_ray_the_error_says_how_to_install_it(tmp_path):
    # the same command in an interpreter where ``import ray`` fails
    code = (
        "import sys; sys.modules['ray'] = None; from ddiloco.cli import main; "
        f"sys.exit(main(['train', '--launcher', 'ray', '--out', {str(tmp_path / 'z')!r}]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "pip install 'ddiloco[ray]'" in r.stderr, r.stderr
