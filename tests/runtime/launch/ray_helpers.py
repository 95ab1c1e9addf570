"""A real Ray cluster of two nodes on this machine, and a ``ddiloco train --launcher ray`` run
whose learner worker is SIGKILLed from outside (the Ray backend's test and
``bench/ray_launch.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from runtime_helpers import read_jsonl

RAY = Path(sys.executable).parent / "ray"
DDILOCO = Path(sys.executable).parent / "ddiloco"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    address: str
    env: dict
    """The environment every process of the cluster and its drivers needs (the cluster's
    auth token)."""
    logs: list[Path] = field(default_factory=list)


@contextlib.contextmanager
def two_node_cluster(cpus: int = 2, timeout_s: float = 180.0) -> Iterator[Cluster]:
    """``ray start --head`` and a second ``ray start --address ...`` (each ``cpus`` CPUs; the
    second also has the custom resource ``node2``), token authentication on, each node with
    its own temp dir; ``ray stop`` at the end (it stops every Ray node of the machine)."""
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
    }
    port = _free_port()
    dirs = [tempfile.mkdtemp(prefix="ray", dir="/tmp") for _ in range(2)]  # short socket paths
    common = ["--num-gpus", "0", "--disable-usage-stats"]
    cmds = [
        [str(RAY), "start", "--head", "--port", str(port), "--num-cpus", str(cpus), *common]
        + ["--include-dashboard", "false", "--temp-dir", dirs[0]],
        [str(RAY), "start", "--address", f"127.0.0.1:{port}", "--num-cpus", str(cpus), *common]
        + ["--resources", json.dumps({"node2": cpus})],
    ]
    cluster = Cluster(f"127.0.0.1:{port}", env)
    try:
        for i, cmd in enumerate(cmds):
            log = Path(dirs[i]) / "start.log"
            cluster.logs.append(log)
            with open(log, "wb") as f:
                r = subprocess.run(
                    cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s
                )
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {log.read_text()[-2000:]}")
        yield cluster
    finally:
        subprocess.run([str(RAY), "stop", "--force"], env=env, capture_output=True, timeout=120)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


@dataclass
class KilledRun:
    rc: int
    wall_s: float
    summary: dict
    kills: list[dict]
    """One per SIGKILL: pid, the learner's step, the process's command line, when (seconds
    since the start, and Unix time)."""


def _learner_rows(out: Path, m: int) -> list[dict]:
    path = out / f"learner_{m}" / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else []


def _syncer_pid(out: Path) -> int | None:
    """The pid of syncer shard 0's Ray worker, as the driver wrote it in ``OUT/ray.json``."""
    path = out / "ray.json"
    return json.loads(path.read_text())["syncers"][0]["pid"] if path.is_file() else None


def train_with_kills(
    out: Path,
    args: list[str],
    env: dict,
    *,
    learner: int = 1,
    kill_at_steps: tuple[int, ...] = (),
    timeout_s: float = 600.0,
    syncer: bool = False,
) -> KilledRun:
    """Run ``ddiloco train --launcher ray ARGS --out OUT``; each time learner ``learner`` has
    reached a step of ``kill_at_steps`` (the steps of its current process), SIGKILL the
    Ray worker process it trains in (its pid from its ``learner_start`` row), or with
    ``syncer`` the Ray worker of syncer shard 0 (its first process only)."""
    t0 = time.monotonic()
    cmd = [str(DDILOCO), "train", "--launcher", "ray", "--out", str(out), *args]
    kills: list[dict] = []
    pending = list(kill_at_steps)
    with open(f"{out}.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{' '.join(cmd)} ran past {timeout_s} s")
                rows = _learner_rows(out, learner)
                starts = [r for r in rows if r["kind"] == "learner_start"]
                pid = _syncer_pid(out) if syncer else (starts[-1]["pid"] if starts else None)
                if pending and pid is not None and pid not in {k["pid"] for k in kills}:
                    steps = [r["step"] for r in rows if r["kind"] == "step"]
                    if steps and steps[-1] >= pending[0]:
                        try:
                            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                            os.kill(pid, signal.SIGKILL)
                        except (FileNotFoundError, ProcessLookupError):
                            continue  # it just ended
                        kills.append(
                            {
                                "pid": pid,
                                "step": steps[-1],
                                "cmdline": cmdline.replace(b"\0", b" ").decode().strip(),
                                "t_s": round(time.monotonic() - t0, 3),
                                "wall": time.time(),
                            }
                        )
                        pending.pop(0)
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return KilledRun(proc.returncode, time.monotonic() - t0, summary, kills)


def first_step_s(out: Path) -> float | None:
    """Seconds from the launch to the run's first inner step (``metrics.jsonl``)."""
    rows = read_jsonl(out / "metrics.jsonl")
    steps = [r["t_s"] for r in rows if r.get("kind") == "step"]
    return min(steps) if steps else None
