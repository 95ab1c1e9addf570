"""The Ray backend's actors (``ddiloco.runtime.launch.ray_backend`` starts them): a syncer
shard serving in its Ray worker, and a learner training in its Ray worker (an island: a
``torchrun`` child of the worker that dies with it). Plain classes: the driver wraps them
with ``ray.remote``, so importing this module does not import Ray."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

__all__ = ["SyncerActor", "LearnerActor"]


def _log_to(path: Path, level: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(h)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


class SyncerActor:
    """One syncer shard in a Ray worker: serves from construction until ``close``. A
    restarted actor (same arguments) resumes from its checkpoint on the same port."""

    def __init__(self, cfg, *, shard: int, ports: list[int], out: str) -> None:
        import ray
        import torch

        from ddiloco.runtime.syncer.checkpoint import has_checkpoint
        from ddiloco.runtime.syncer.run_config import syncer_server_config
        from ddiloco.runtime.syncer.server import SyncerServer
        from ddiloco.runtime.transport.auth import load_token

        torch.set_num_threads(1)
        sharded = len(ports) > 1
        name = f"syncer_{shard}" if sharded else "syncer"
        root = Path(out)
        _log_to(root / "logs" / f"{name}.log", cfg.runtime.log_level)
        ip = ray.util.get_node_ip_address()
        host = cfg.runtime.host
        bind = ip if host in ("127.0.0.1", "localhost") else host
        self.host = ip if bind == "0.0.0.0" else bind
        ckpt = root / "checkpoint" / (f"shard_{shard}" if sharded else "")
        resume = has_checkpoint(ckpt)
        scfg = syncer_server_config(
            # the dashboard on shard 0
            cfg.replace(
                host=bind,
                port=ports[shard],
                http_port=cfg.runtime.http_port if shard == 0 else None,
            ),
            token=load_token(cfg.runtime.token_file),
            checkpoint_dir=str(ckpt),
            resume=resume,
            metrics_path=str(root / f"{name}.metrics.jsonl"),
            metrics_dir=str(root),
            shards=",".join(f"{self.host}:{q}" for q in ports) if sharded else None,
            shard=shard,
        )
        logging.getLogger("ddiloco.ray").info(
            "%s on %s:%d (%s)", name, bind, ports[shard], "resumed" if resume else "fresh"
        )
        self.server = SyncerServer(scfg)
        self.port = self.server.start()

    def address(self) -> dict:
        import ray

        return {
            "address": f"{self.host}:{self.port}",
            "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def close(self) -> None:
        """Stop serving; the final checkpoint is written."""
        self.server.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LearnerActor:
    """Learner m (or an island) in a Ray worker. ``run`` trains until the syncer's step
    budget is spent and returns where it ran and the final report."""

    def __init__(self, cfg, *, learner: int, syncer: str, out: str) -> None:
        self.cfg, self.m, self.syncer, self.out = cfg, learner, syncer, Path(out)
        self.run_dir = self.out / f"learner_{learner}"
        self.log_path = self.out / "logs" / f"learner_{learner}.log"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.runtime.island_size > 1:  # an earlier incarnation's ranks must not outlive it
            pid_file = self.run_dir / "island.pgid"
            if pid_file.is_file():
                try:
                    os.killpg(int(pid_file.read_text()), signal.SIGKILL)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass
        else:
            _log_to(self.log_path, cfg.runtime.log_level)
            import importlib

            from ddiloco.runtime.launch.forkserver import PRELOAD

            # what the fork server imports once (torch, torch._dynamo, the learner's modules):
            # done before ``ready`` answers, the learners start their runs together
            for name in (*PRELOAD, "ddiloco.runtime.learner.main"):
                importlib.import_module(name)

    def ready(self) -> bool:
        """Answers once the actor is placed and its imports are done."""
        return True

    def _where(self) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def run(self) -> dict:
        if self.cfg.runtime.island_size > 1:
            return {**self._where(), "report": self._run_island()}
        from ddiloco.runtime.learner.main import run_learner

        saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
        try:
            report = run_learner(
                self.cfg,
                syncer=self.syncer,
                learner=self.m,
                run_dir=str(self.run_dir),
                metrics_dir=str(self.out),
            )
        finally:  # the worker's own SIGTERM handling (Ray stops its workers with it)
            if threading.current_thread() is threading.main_thread():
                for s, h in saved.items():
                    signal.signal(s, h)
        return {**self._where(), "report": report}

    def _run_island(self) -> dict:
        from ddiloco.config import dump_config

        n = self.cfg.runtime.island_size
        cfg_path = dump_config(self.cfg, self.run_dir / "island_config.toml")
        from ddiloco.runtime.launch.launcher import cli_command

        cmd = [
            *cli_command(n),
            "learner",
            "--syncer",
            self.syncer,
            "--learner",
            str(self.m),
            "--config",
            str(cfg_path),
            "--run-dir",
            str(self.run_dir),
            "--metrics-dir",
            str(self.out),
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            (self.run_dir / "island.pgid").write_text(str(proc.pid))
            rc = proc.wait()
        if rc != 0:
            raise RuntimeError(f"learner {self.m}'s island exited with {rc}; see {self.log_path}")
        import json

        final = self.run_dir / "final.json"
        return json.loads(final.read_text()) if final.is_file() else {}

    def files(self) -> dict[str, bytes]:
        """This learner's run directory and log as its node sees them (relative paths)."""
        got = {}
        for p in [*self.run_dir.glob("*.json*"), self.log_path]:
            if p.is_file():
                got[str(p.relative_to(self.out))] = p.read_bytes()
        return got
