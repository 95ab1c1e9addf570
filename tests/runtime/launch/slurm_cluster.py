"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd (the Debian
packages ``munge`` and ``slurm-wlm``) on this host, every file in a temporary directory.

``SlurmCluster(tmp).start()`` raises ``SlurmUnavailable`` with the reason where the cluster
cannot run here (packages missing, not root, a daemon that does not come up); the node
takes several job steps at once (``OverSubscribe=FORCE``), so one node plays the syncer's
and every island's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")


class SlurmUnavailable(Exception):
    """The cluster cannot run on this machine; the message says why."""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).is_file()), None
    )


def _tail(path: Path, n: int = 8) -> str:
    if not path.is_file():
        return f"({path.name}: no log)"
    lines = path.read_text(errors="replace").splitlines()[-n:]
    return f"{path.name}: " + " | ".join(lines)


class SlurmCluster:
    """One node (this host, ``hostname -s``), partition ``debug``, munge auth with a key of
    its own, no accounting database. ``env`` points the Slurm clients at it."""

    def __init__(self, tmp: Path) -> None:
        self.dir = Path(tmp)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.bins: dict[str, str] = {}

    def _check(self) -> None:
        missing = [n for n in DAEMONS + CLIENTS if _which(n) is None]
        if missing:
            raise SlurmUnavailable(
                f"Slurm is not installed ({', '.join(missing)} missing; the Debian packages "
                f"slurm-wlm and munge, which `make test` installs as root)"
            )
        if os.geteuid() != 0:
            raise SlurmUnavailable(
                "a one-node Slurm cluster needs root (slurmd runs the job's tasks and munged "
                "runs as root with --force)"
            )
        self.bins = {n: str(_which(n)) for n in DAEMONS + CLIENTS}

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        self._check()
        d = self.dir
        munge = d / "munge"
        for sub in (munge, d / "state", d / "spool", d / "log"):
            sub.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = munge / "munge.socket"
        self._spawn(
            "munged",
            [
                self.bins["munged"],
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={sock}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={d / 'log' / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        self._wait(lambda: sock.exists(), 10.0, "munged did not create its socket")
        ctld_port, d_port = _free_ports(2)
        cpus = os.cpu_count() or 1
        self.conf.write_text(
            f"""\
ClusterName=ddiloco-test
SlurmctldHost={self.node}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "slurmd.pid"}
SlurmctldLogFile={d / "log" / "slurmctld.log"}
SlurmdLogFile={d / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=10
NodeName={self.node} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:16
"""
        )
        self._spawn("slurmctld", [self.bins["slurmctld"], "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [self.bins["slurmd"], "-D", "-f", str(self.conf)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    self.close()
                    raise SlurmUnavailable(
                        f"{name} exited with {p.returncode} at start-up: "
                        f"{_tail(d / 'log' / f'{name}.log')}"
                    )
            r = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
            if r.returncode == 0 and r.stdout.strip() == "idle":
                return self
            time.sleep(0.5)
        state = self.run("sinfo", "-h", "-N", "-o", "%T %E", check=False).stdout.strip()
        self.close()
        raise SlurmUnavailable(
            f"the node did not become idle within {timeout_s:.0f} s (sinfo: {state!r}); "
            f"{_tail(d / 'log' / 'slurmctld.log')}; {_tail(d / 'log' / 'slurmd.log')}"
        )

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()

    @staticmethod
    def _wait(cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise SlurmUnavailable(what)
            time.sleep(0.05)

    def run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client (sbatch, squeue...) against this cluster."""
        return subprocess.run(
            [self.bins[tool], *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
            check=check,
        )

    def submit(self, script: Path) -> int:
        out = self.run("sbatch", "--parsable", str(script)).stdout.strip()
        return int(out.split(";")[0])

    def job_state(self, job: int) -> str:
        """PENDING, RUNNING, COMPLETED, FAILED... (``scontrol show job``: no accounting
        database needed)."""
        out = self.run("scontrol", "show", "job", str(job), check=False).stdout
        for tok in out.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job: int, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return state
            time.sleep(0.5)
        self.run("scancel", str(job), check=False)
        raise TimeoutError(f"job {job} still {self.job_state(job)} after {timeout_s} s")

    def close(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--user", "root", check=False)
            time.sleep(1.0)
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=5)
        self.procs.clear()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
