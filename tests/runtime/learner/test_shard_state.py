"""A sharded island's resumable state (``ddiloco.runtime.learner.shard_state``): every rank
saves its shards of the model and the inner optimizer with DCP; a restarted island resumes
them, also on fewer ranks; a rank SIGKILLed mid-run brings its island back through the
launcher, and the run completes with a balanced ledger."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from runtime_helpers import read_jsonl, tiny_config

from ddiloco.config.files import dump_config

SRC = str(Path(__file__).resolve().parents[3] / "src")


def _learner(syncer, config: Path, run_dir: Path, ranks: int) -> subprocess.CompletedProcess:
    head = [sys.executable]
    if ranks > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd = [*head, "-m", "ddiloco.runtime.cli", "learner", "--config", str(config)]
    cmd += ["--syncer", syncer.address, "--learner", "0", "--run-dir", str(run_dir)]
    env = {**syncer.env, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_fsdp_island_resumes_its_checkpoint_on_fewer_ranks(syncer_factory, tmp_path):
    s = syncer_factory()
    run_dir = tmp_path / "learner_0"
    cfg = tiny_config(tmp_path / "run", learners=1, steps=30, islands="fsdp:2")
    first = _learner(s, dump_config(cfg, tmp_path / "a.toml"), run_dir, 2)
    assert first.returncode == 0, first.stderr[-4000:]
    assert json.loads((run_dir / "learner_dcp" / "step.json").read_text())["step"] == 30
    assert not (run_dir / "learner_state.pt").exists()  # the shards are in the DCP checkpoint
    # the same learner on one rank: the 2-rank checkpoint resharded into one process
    again = _learner(s, dump_config(cfg.replace(steps=40), tmp_path / "b.toml"), run_dir, 1)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "started with 1 rank(s): it runs as single" in again.stderr
    starts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "learner_start"]
    assert [(r["step"], r["resumed_optimizer"]) for r in starts] == [(0, False), (30, True)]
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "step"]
    assert steps[-1]["step"] == 40
    final = json.loads((run_dir / "final.json").read_text())
    assert final["island_layout"] == "single" and final["global_step"] == 40
    # resuming the moments keeps the loss where it was (a fresh AdamW at this learning rate
    # would not blow it up either on this tiny model, so this checks continuity only)
    before = [r["loss"] for r in steps if 20 < r["step"] <= 30]
    after = [r["loss"] for r in steps if 30 < r["step"] <= 40]
    assert sum(after) / len(after) < 1.2 * sum(before) / len(before)


def _ranks_of(pid: int) -> list[int]:
    """The child processes of ``pid`` (a torchrun's ranks)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_rank_brings_its_island_back_from_its_checkpoint(tmp_path):
    from ddiloco.runtime.launch.launcher import Launcher

    run = tmp_path / "run"
    cfg = tiny_config(run, learners=2, steps=120, islands="fsdp:2,single", step_budget=0)
    killed: list[int] = []

    def kill_one_rank(la) -> None:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not killed:
            p = la.procs.get("learner_0")
            path = run / "learner_0" / "metrics.jsonl"
            rows = read_jsonl(path) if p is not None and path.is_file() else []
            steps = [r["step"] for r in rows if r["kind"] == "step"]
            if p is not None and p.popen is not None and steps and steps[-1] >= 40:
                ranks = _ranks_of(p.popen.pid)
                if len(ranks) == 2:
                    os.kill(ranks[1], signal.SIGKILL)  # one rank of the island, not torchrun
                    killed.append(steps[-1])
                    return
            time.sleep(0.2)

    with Launcher(cfg) as la:
        th = threading.Thread(target=kill_one_rank, args=(la,), daemon=True)
        th.start()
        s = la.run()
        th.join(5)
    assert killed, "no rank was killed"
    assert s["ok"], s
    rows = read_jsonl(run / "learner_0" / "metrics.jsonl")
    starts = [r for r in rows if r["kind"] == "learner_start"]
    assert len(starts) == 2 and starts[1]["resumed_optimizer"], starts
    assert starts[1]["step"] >= killed[0] - 10  # from its last checkpoint (every 10 steps)
    assert starts[1]["incarnation"] == 2  # it joined again as a new process
    for pl in s["per_learner"]:
        assert pl["steps"] >= 120 and pl["ledger_balance_error"] < 1e-6, pl
    assert s["per_learner"][0]["ledger_steps"]["lost"] > 0  # the killed process's unpushed work
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
