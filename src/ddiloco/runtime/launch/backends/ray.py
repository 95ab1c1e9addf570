"""Run a training job on a Ray cluster: syncer shards and learner islands as Ray actors.

``ddiloco train --launcher ray [--address HOST:PORT]`` (or ``RayLauncher``) does what the
built-in launcher does (the same commands, progress, chaos, ``summary.json`` and
``metrics.jsonl``), but places every process with Ray:

- each syncer shard and each learner island is one actor with declared resources (CPUs:
  1 per syncer shard, ``island_size`` per learner; a GPU per rank where the cluster has
  GPUs; extra custom resources from ``RayOptions``). The actor runs the process as its
  child, which dies with it (``PR_SET_PDEATHSIG``);
- actors are restartable (``max_restarts``) and their ``run`` call is retried
  (``max_task_retries``): when a learner's worker process dies (a node lost, an OOM kill,
  ``kill -9`` from outside), Ray starts the actor again and reruns the learner, which
  resumes its data position from its run directory and rejoins the syncer under the same
  id (elastic membership), taking the current global model;
- syncer shards bind 0.0.0.0 on their actor's node; learners reach them at that node's
  address (the run directory must be on storage every node sees, as with Slurm).

Without ``address`` a local Ray instance is started (and stopped at the end); with one,
the job joins that cluster (``ray start --head`` / ``ray start --address ...``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

__all__ = ["RayOptions", "RayLauncher", "ray_available"]


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(kw_only=True, slots=True)
class RayOptions:
    address: str | None = None
    """Ray cluster to join (``HOST:PORT`` of the head's GCS, or ``auto``); None: start a
    local one for this run."""
    max_restarts: int = 100
    """Times Ray restarts a dead learner actor (and reruns its learner)."""
    syncer_resources: dict[str, float] = field(default_factory=dict)
    """Custom resources each syncer shard actor asks for (e.g. ``{"syncer": 1}`` to keep
    shards on nodes that advertise it)."""
    learner_resources: dict[str, float] = field(default_factory=dict)
    """Custom resources each learner island asks for."""
    cpus_per_rank: float = 1.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed when the actor's process dies
    os.setsid()


def _actor_class():
    import ray

    class ProcessActor:
        """Runs one ddiloco process (syncer shard or learner island) as its child."""

        def __init__(self) -> None:
            self.proc: subprocess.Popen | None = None

        def info(self) -> dict:
            return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address()}

        def free_port(self) -> int:
            import socket
            with socket.socket() as s:
                s.bind(("0.0.0.0", 0))
                return s.getsockname()[1]

        def run(self, cmd: list[str], log_path: str, env: dict) -> int:
            env = {**os.environ, **env}  # the actor's own (CUDA_VISIBLE_DEVICES...) first
            with open(log_path, "ab") as log:
                log.write(f"\n=== ray actor pid {os.getpid()} on "
                          f"{ray.util.get_node_ip_address()}: {' '.join(cmd)}\n".encode())
                log.flush()
                self.proc = subprocess.Popen([sys.executable, *cmd[1:]], stdout=log,
                                             stderr=subprocess.STDOUT, env=env,
                                             preexec_fn=_die_with_parent)
            return self.proc.wait()

        def signal(self, sig: int) -> None:
            p = self.proc
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    return ray.remote(ProcessActor)


class RayProcess:
    """A ddiloco process running in a Ray actor, with the ``Popen`` methods the launcher
    uses (``pid``, ``poll``, ``wait``, ``returncode``, ``send_signal``)."""

    def __init__(self, actor, cmd: list[str], log_path: str, env: dict) -> None:
        import ray
        self.actor = actor
        self.ref = actor.run.remote(cmd, log_path, env)
        self.returncode: int | None = None
        self._ray = ray

    @property
    def pid(self) -> int:
        """The actor's worker process (a new one after each Ray restart)."""
        return self._ray.get(self.actor.info.remote(), timeout=30)["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            done, _ = self._ray.wait([self.ref], timeout=0)
            if done:
                try:
                    self.returncode = int(self._ray.get(self.ref))
                except Exception:  # noqa: BLE001 - the actor died for good (restarts spent, killed)
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("ray actor", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:  # for good: no restart
            self._ray.kill(self.actor, no_restart=True)
        else:  # SIGTERM (a graceful stop), SIGSTOP / SIGCONT (chaos) reach the process itself
            try:
                self._ray.get(self.actor.signal.remote(int(sig)), timeout=30)
            except Exception:  # noqa: BLE001 - an actor being restarted: nothing to signal
                pass


class RayBackend:
    """Creates the actors. One per syncer shard, placed first (their addresses are part of
    the learners' commands); one per learner process start."""

    def __init__(self, opts: RayOptions, island_size: int) -> None:
        import ray
        self.ray = ray
        self.opts = opts
        self.started_here = False
        if not ray.is_initialized():
            ray.init(address=opts.address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            self.started_here = True
        self.gpus = float(ray.cluster_resources().get("GPU", 0.0))
        self.island_size = island_size
        self.cls = _actor_class()
        self.syncers: dict[str, object] = {}

    def place_syncer(self, name: str) -> tuple[str, int]:
        """Create shard ``name``'s actor; (node address, a free port there)."""
        a = self.cls.options(num_cpus=1, resources=self.opts.syncer_resources or None,
                             max_restarts=0, max_concurrency=4).remote()
        self.syncers[name] = a
        info = self.ray.get(a.info.remote())
        return info["node_ip"], self.ray.get(a.free_port.remote())

    def spawn(self, name: str, cmd: list[str], log_path: str, env: dict) -> RayProcess:
        if name in self.syncers:
            actor = self.syncers[name]
        else:
            n = self.island_size
            actor = self.cls.options(
                num_cpus=self.opts.cpus_per_rank * n, num_gpus=n if self.gpus >= n else 0,
                resources=self.opts.learner_resources or None,
                max_restarts=self.opts.max_restarts, max_task_retries=-1,
                max_concurrency=4).remote()
        keep = ("DDILOCO_TOKEN", "OMP_NUM_THREADS", "PYTHONPATH", "DDILOCO_KERNELS")
        return RayProcess(actor, cmd, log_path, {k: env[k] for k in keep if k in env})

    def close(self) -> None:
        for a in self.syncers.values():
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self.started_here:
            self.ray.shutdown()


def RayLauncher(config, options=None, ray_options: RayOptions | None = None):  # noqa: N802
    """A ``Launcher`` whose processes are Ray actors (see the module doc)."""
    from ddiloco.runtime.launch.launcher import Launcher, LaunchOptions

    class _RayLauncher(Launcher):
        def __init__(self) -> None:
            opts = options or LaunchOptions()
            opts.fork_server = False  # Ray starts the processes
            opts.extra_syncer_args = [*opts.extra_syncer_args, "--host", "0.0.0.0"]
            super().__init__(config, opts)
            self.ray_opts = ray_options or RayOptions()
            t0 = time.monotonic()
            self._backend = RayBackend(self.ray_opts, self.opts.island_size)
            self.ray_init_s = time.monotonic() - t0

        def _place_syncers(self) -> None:
            placed = [self._backend.place_syncer(self._syncer_name(k))
                      for k in range(self.opts.shards)]
            self.hosts = [h for h, _ in placed]
            if self.opts.shards > 1:
                self.ports = [q for _, q in placed]
            else:
                self.port = placed[0][1]

        def close(self) -> None:
            super().close()
            if self._backend is not None:
                self._backend.close()

        def _summarise(self, final_params, interrupted: bool) -> dict:
            self.extra_summary.update(launcher="ray", ray_init_s=round(self.ray_init_s, 3),
                                      ray_address=self.ray_opts.address)
            return super()._summarise(final_params, interrupted)

    return _RayLauncher()
