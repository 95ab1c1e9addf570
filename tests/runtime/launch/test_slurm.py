"""``ddiloco launch --backend slurm``: the sbatch script it writes, read back and run.

- Always: the script's directives and layout are parsed, ``bash -n`` checks it, and the
  script runs with stand-ins for srun, scontrol, squeue and scancel on a five-node layout
  (what would start where, the restarts of a failing shard and island).
- On a real one-node Slurm cluster started by the ``slurm`` fixture (munged, slurmctld,
  slurmd): ``sbatch --test-only``, a run that trains and merges, and a run whose syncer and
  one island are SIGKILLed and brought back by the script. Skipped, saying why, where the
  daemons cannot run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from runtime_helpers import TINY, read_jsonl, tiny_config
from slurm_cluster import SlurmCluster, SlurmUnavailable, _free_ports

from ddiloco.cli import main as ddiloco_main
from ddiloco.config import load_config
from ddiloco.runtime.launch.slurm import SlurmOptions, render_sbatch, write_slurm_job


def directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            k, _, v = line[len("#SBATCH ") :].partition("=")
            out[k] = v
    return out


def header(script: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Z_]+)=(\S*)$", script, flags=re.M))


# -- the script, parsed --------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_launch_writes_script_config_and_token(tmp_path, capsys):
    out = tmp_path / "run"
    rc = ddiloco_main(
        [
            "launch",
            "--backend",
            "slurm",
            "--model",
            "gpt_tiny",
            "-M",
            "2",
            "--steps",
            "60",
            "--island-size",
            "4",
            "--nodes-per-island",
            "2",
            "--shards",
            "2",
            "--out",
            str(out),
            "--partition",
            "gpu",
            "--time",
            "01:00:00",
            "--gpus-per-node",
            "2",
            "--sbatch-arg=--qos=high",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"submit with: sbatch {out / 'ddiloco.sbatch'}" in printed
    script = (out / "ddiloco.sbatch").read_text()
    assert directives(script) == {
        "--job-name": "ddiloco",
        "--nodes": "5",  # the syncer's node + 2 islands x 2 nodes
        "--ntasks-per-node": "1",
        "--output": f"{out}/slurm-%j.out",
        "--partition": "gpu",
        "--time": "01:00:00",
        "--gpus-per-node": "2",
        "--qos": "high",
    }
    h = header(script)
    assert (h["ISLANDS"], h["NODES_PER_ISLAND"], h["PROCS_PER_NODE"], h["SHARDS"]) == (
        "2",
        "2",
        "2",
        "2",
    )
    assert (h["PORT"], h["BULK_PORT"], h["SINGLE_NODE"]) == ("50051", "50053", "0")
    assert subprocess.run(["bash", "-n", str(out / "ddiloco.sbatch")]).returncode == 0
    # the token: a file only its owner reads, named by the config every process reads
    token = out / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(token.read_text().strip()) == 32
    cfg = load_config(out / "config.toml")
    assert cfg.runtime.token_file == str(token)
    assert cfg.runtime.host == "0.0.0.0"
    assert (cfg.learners, cfg.runtime.island_size, cfg.runtime.shards) == (2, 4, 2)
    assert "--rdzv-backend=c10d" in script and "--kill-on-bad-exit=0" in script


@pytest.mark.timeout(60)
def test_bad_input_is_refused_with_the_fix(tmp_path, capsys):
    out = tmp_path / "run"

    def render(opts: SlurmOptions | None = None, **kw):
        return render_sbatch(tiny_config(out).replace(**kw), opts or SlurmOptions(), out)

    with pytest.raises(ValueError, match="island_size 3 does not split evenly"):
        render(SlurmOptions(nodes_per_island=2), island_size=3)
    with pytest.raises(ValueError, match="runs in-process: use `ddiloco train --engine inproc`"):
        render(method="diloco", engine="inproc")
    with pytest.raises(ValueError, match="only the local launcher"):
        render(chaos="kill30")
    with pytest.raises(ValueError, match="nodes_per_island must be 1"):
        SlurmOptions(single_node=True, nodes_per_island=2)
    with pytest.raises(ValueError, match="absolute path"):
        SlurmOptions(python="python3")
    with pytest.raises(ValueError, match="one option per entry"):
        SlurmOptions(sbatch_args=("qos=high",))
    with pytest.raises(ValueError, match="no spaces"):
        SlurmOptions(partition="gpu; rm -rf /")
    with pytest.raises(ValueError, match="overlap"):
        render(port=50051, bulk_port=50052, shards=2)
    rc = ddiloco_main(
        ["launch", "--backend", "slurm", "--out", str(out), "--island-size", "3"]
        + ["--nodes-per-island", "2"]
    )
    assert rc == 2
    assert "ddiloco launch: error: runtime.island_size 3" in capsys.readouterr().err
    assert not (out / "ddiloco.sbatch").exists()


# -- the script, run with stand-ins for the Slurm tools --------------------------------------
STUBS = {
    # the job's five nodes
    "scontrol": 'printf "n0\\nn1\\nn2\\nn3\\nn4\\n"\n',
    # every srun call recorded, then its command run here
    "srun": ('echo "srun $*" >> "$CALLS"\nwhile [[ $1 == -* ]]; do shift; done\nexec "$@"\n'),
    "squeue": 'echo "42.0 syncer_0"; echo "42.3 syncer_1"; echo "42.batch batch"\n',
    "scancel": 'echo "scancel $*" >> "$CALLS"\n',
    # the Python: a shard runs until the job stops it, except that shard 1's first start
    # writes a checkpoint and dies; a learner trains until shard 1 is back (or 10 s), and
    # learner 1's first start fails
    "python": r"""echo "python $*" >> "$CALLS"
args=" $* "
cfg=""; prev=""
for a in "$@"; do [[ $prev == --config ]] && cfg=$a; prev=$a; done
out=$(dirname "$cfg")
if [[ $args == *" syncer "* ]]; then
  if [[ $args == *" --shard 1 "* && ! -e $out/shard1.died ]]; then
    mkdir -p "$out/checkpoint/shard_1"; touch "$out/checkpoint/shard_1/syncer.json"
    touch "$out/shard1.died"; exit 9
  fi
  [[ $args == *" --shard 1 "* ]] && touch "$out/shard1.back"
  while [[ ! -e $out/logs/stop.$SLURM_JOB_ID ]]; do sleep 0.05; done
  exit 0
fi
if [[ $args == *" learner "* ]]; then
  for _ in $(seq 200); do [[ -e $out/shard1.back ]] && break; sleep 0.05; done
fi
if [[ $args == *" --learner 1 "* && ! -e $out/learner1.failed ]]; then
  touch "$out/learner1.failed"; exit 1
fi
exit 0
""",
}


@pytest.mark.timeout(60)
def test_five_node_layout_and_restarts_under_stub_tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        p = bin_dir / name
        p.write_text("#!/bin/bash\n" + body)
        p.chmod(0o755)
    out = tmp_path / "run"
    cfg = tiny_config(out, learners=2, steps=60, island_size=4, shards=2)
    job = write_slurm_job(
        cfg, SlurmOptions(nodes_per_island=2, python=str(bin_dir / "python"), restart_delay_s=0)
    )
    calls = tmp_path / "calls"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "n[0-4]",
    }
    r = subprocess.run(
        ["bash", str(job.script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    lines = calls.read_text().splitlines()
    srun = [ln for ln in lines if ln.startswith("srun ")]
    shards = [ln for ln in srun if " syncer " in ln]
    # both shards on the first node, each on its own ports, knowing the whole map
    for k in (0, 1):
        mine = [ln for ln in shards if f"--job-name=syncer_{k} " in ln]
        assert mine, shards
        for ln in mine:
            assert "--nodes=1 --ntasks=1 --relative=0 " in ln
            assert f"--port {50051 + k} --bulk-port {50053 + k} " in ln
            assert "--shards n0:50051,n0:50052" in ln and f"--shard {k}" in ln
            assert "--host 0.0.0.0" in ln
    # shard 1 died once: started again, resuming from its checkpoint; shard 0 ran once
    s1 = [ln for ln in shards if "--job-name=syncer_1 " in ln]
    assert len(s1) == 2 and "--resume" not in s1[0] and s1[1].endswith("--resume")
    assert len([ln for ln in shards if "--job-name=syncer_0 " in ln]) == 1
    # island m on nodes 1 + 2m and 2 + 2m: torchrun over two nodes, rendezvous on the first
    for m, first in ((0, 1), (1, 3)):
        mine = [ln for ln in srun if f"--job-name=learner_{m} " in ln]
        assert mine
        for ln in mine:
            assert f"--nodes=2 --ntasks=2 --ntasks-per-node=1 --relative={first} " in ln
            assert "-m torch.distributed.run --nnodes=2 --nproc-per-node=2" in ln
            assert f"--rdzv-endpoint=n{first}:{29400 + m} --rdzv-id=42-learner-{m}" in ln
            assert f"learner --syncer n0:50051 --learner {m} " in ln
    assert len([ln for ln in srun if "--job-name=learner_0 " in ln]) == 1
    assert len([ln for ln in srun if "--job-name=learner_1 " in ln]) == 2  # failed once
    assert (out / "logs" / "learner_1.rc").read_text().strip() == "0"
    # then: the status, SIGTERM to both shards' steps, the summary
    tail = [ln for ln in lines if not ln.startswith("srun ") and " syncer " not in ln]
    tail = [ln for ln in tail if " learner " not in ln]
    assert tail == [
        f"python -m ddiloco.runtime.launch.slurm status {out} --syncer n0:50051",
        "scancel --signal=TERM 42.0",
        "scancel --signal=TERM 42.3",
        f"python -m ddiloco.runtime.launch.slurm summarise {out}",
    ]
    assert "syncer_1 exited (9): restart 1" in r.stderr
    assert "learner_1 exited (1): start 2" in r.stderr


# -- a real one-node Slurm cluster -----------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm cluster on this machine: {e}")
    yield cluster
    cluster.close()


def one_node_job(out: Path, **kw):
    port, rdzv = _free_ports(2)
    cfg = tiny_config(out, port=port, **{"learners": 2, "steps": 60, **kw})
    return write_slurm_job(cfg, SlurmOptions(single_node=True, rdzv_port=rdzv))


def job_log(out: Path, job: int) -> str:
    parts = [f"--- slurm-{job}.out ---\n" + (out / f"slurm-{job}.out").read_text()]
    for p in sorted((out / "logs").glob("*.log")):
        parts.append(f"--- {p.name} ---\n" + "\n".join(p.read_text().splitlines()[-15:]))
    return "\n".join(parts)


@pytest.mark.timeout(60)
def test_sbatch_test_only_accepts_the_script(slurm, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    out = tmp_path / "one"
    rc = ddiloco_main(
        ["launch", "--backend", "slurm", "--single-node", "--test-only", "--out", str(out)]
        + ["--model", "gpt_tiny", "-M", "2", "--island-size", "2"]
    )
    printed = capsys.readouterr().out
    assert rc == 0 and "to start at" in printed, printed
    assert f"using 1 processors on nodes {slurm.node} in partition debug" in printed
    # the five-node layout asks for five nodes, which this cluster does not have
    cfg = tiny_config(tmp_path / "five", learners=2, island_size=2)
    five = write_slurm_job(cfg, SlurmOptions(nodes_per_island=2))
    r = slurm.run("sbatch", "--test-only", str(five.script), check=False)
    assert r.returncode != 0 and "node configuration is not available" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_on_slurm_trains_and_merges(slurm, tmp_path, monkeypatch, capsys):
    """Two torchrun islands of two ranks and two syncer shards, all job steps of one
    sbatch job."""
    out = tmp_path / "run"
    port, rdzv = _free_ports(2)
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    rc = ddiloco_main(
        ["launch", "--backend", "slurm", "--single-node", "--submit", "--out", str(out)]
        + ["--rdzv-port", str(rdzv), "--port", str(port), "-M", "2", "--steps", "60"]
        + ["--island-size", "2", "--shards", "2"]
        + [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k not in ("H", "progress")]
        + ["-H", str(TINY["H"])]
    )
    printed = capsys.readouterr().out
    assert rc == 0 and "Submitted batch job" in printed, printed
    jid = int(printed.split("Submitted batch job")[1].split()[0])
    state = slurm.wait_job(jid, timeout_s=150)
    log = job_log(out, jid)
    assert state == "COMPLETED", log
    s = json.loads((out / "summary.json").read_text())
    assert s["ok"], log
    assert s["merges"] > 0 and s["job_id"] == str(jid)
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    for pl in s["per_learner"]:
        m = pl["learner"]
        island_log = (out / "logs" / f"learner_{m}.log").read_text(errors="replace")[-3000:]
        assert pl["exit_code"] == 0 and pl["starts"] == 1, f"{log}\n--- learner_{m}:\n{island_log}"
        # each island trained and installed merges (one that starts late under the global
        # step budget begins from the merged model and does fewer steps); the median of its
        # last steps, because one batch's loss can spike (3.73 against a median near 3.3)
        assert pl["steps"] > 0 and pl["tail_loss"] < s["initial_eval_loss"] - 0.5, pl
        assert pl["island_size"] == 2 and pl["island_max_param_diff"] == 0.0
    assert sum(pl["steps"] for pl in s["per_learner"]) >= 2 * 60  # the step budget M x steps
    for k in (0, 1):  # both islands joined both shards, under the ids the script gave them
        joins = [r for r in read_jsonl(out / f"syncer_{k}.metrics.jsonl") if r["kind"] == "join"]
        assert sorted(r["learner"] for r in joins) == [0, 1]
    assert (out / "checkpoint" / "shard_1" / "syncer.json").is_file()


def _pid_of_syncer(config: Path) -> int | None:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"syncer" in argv and str(config).encode() in argv and b"-m" in argv:
                if argv[0].endswith(b"python") or b"python" in argv[0]:
                    return int(d.name)
    return None


def _wait_step(path: Path, step: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = read_jsonl(path) if path.is_file() else []
        steps = [r for r in rows if r["kind"] == "step" and r["step"] >= step]
        if steps:
            return {"rows": rows, "at": steps[0]}
        time.sleep(0.02)
    raise TimeoutError(f"{path}: no step {step} within {timeout_s} s")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_job_restarts_a_killed_island_and_syncer(slurm, tmp_path):
    out = tmp_path / "run"
    job = one_node_job(out, steps=400)
    jid = slurm.submit(job.script)
    # SIGKILL learner 0's process (torchrun's worker) once it has trained 30 steps: the
    # island's srun step fails and the script starts it again with the same learner id
    got = _wait_step(out / "learner_0" / "metrics.jsonl", 30, timeout_s=90)
    pid = next(r["pid"] for r in got["rows"] if r["kind"] == "learner_start")
    os.kill(pid, signal.SIGKILL)
    # then SIGKILL the syncer: the script restarts it with --resume from its checkpoint
    _wait_step(out / "learner_1" / "metrics.jsonl", 60, timeout_s=60)
    syncer = _pid_of_syncer(job.config)
    assert syncer is not None
    os.kill(syncer, signal.SIGKILL)
    state = slurm.wait_job(jid, timeout_s=150)
    log = job_log(out, jid)
    assert state == "COMPLETED", log
    s = json.loads((out / "summary.json").read_text())
    assert s["ok"], log
    assert s["syncer_counters"].get("resumes") == 1, log
    l0 = s["per_learner"][0]
    assert l0["starts"] == 2, log  # the restarted island rejoined as learner 0...
    starts = [r for r in read_jsonl(out / "learner_0" / "metrics.jsonl")]
    starts = [r for r in starts if r["kind"] == "learner_start"]
    assert starts[1]["step"] >= 30 - 10  # ...resuming its progress (saved every 10 steps)
    assert s["merges"] > 0 and s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    slurm_out = (out / f"slurm-{jid}.out").read_text()
    assert "learner_0 exited" in slurm_out and "syncer exited" in slurm_out


@pytest.mark.slow
@pytest.mark.timeout(420)  # bounds for a loaded 2-core machine; about 60 s when quiet
def test_a_cancelled_job_resumes_when_submitted_again(slurm, tmp_path):
    out = tmp_path / "run"
    job = one_node_job(out, steps=150)
    first = slurm.submit(job.script)
    _wait_step(out / "learner_0" / "metrics.jsonl", 30, timeout_s=180)
    slurm.run("scancel", str(first))  # SIGTERM to every step: checkpoint, save, leave
    assert slurm.wait_job(first, timeout_s=60) == "CANCELLED"

    def progress(m: int) -> tuple[int, list[int]]:
        """Learner m's saved step (0: none) and the steps its starts began at."""
        p, metrics = (out / f"learner_{m}" / f for f in ("progress.json", "metrics.jsonl"))
        rows = read_jsonl(metrics) if metrics.is_file() else []
        starts = [r["step"] for r in rows if r["kind"] == "learner_start"]
        return (json.loads(p.read_text())["step"] if p.is_file() else 0), starts

    before = [progress(m) for m in (0, 1)]
    assert before[0][0] >= 30 and before[0][1] == [0]
    second = slurm.submit(job.script)
    state = slurm.wait_job(second, timeout_s=200)
    log = job_log(out, second)
    assert state == "COMPLETED", log
    s = json.loads((out / "summary.json").read_text())
    assert s["ok"] and s["syncer_counters"].get("resumes") == 1, log
    for m in (0, 1):  # each resumed where it left off (learner 1 may not have started yet)
        saved, starts = before[m]
        assert progress(m)[1] == starts + [saved], log
    assert sum(pl["steps"] for pl in s["per_learner"]) >= 2 * 150
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
