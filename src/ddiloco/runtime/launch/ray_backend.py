"""``ddiloco train --launcher ray``: the syncer shards and the learners as Ray actors.

Each syncer shard is an actor (``runtime.shards`` of them, one CPU each) holding a
``SyncerServer`` in its own worker process; each learner (an island of ``island_size`` ranks)
is an actor with one CPU per rank, and one GPU per rank where the cluster has GPUs and
``runtime.device`` is not cpu. A single-process learner trains inside its actor's worker
process (``run_learner``), so the worker *is* the learner: when it dies (SIGKILL, OOM killer,
a lost node), Ray restarts the actor (``max_restarts``) and retries its ``run`` call
(``max_task_retries``); the new process asks for the same learner id, resumes its step, data
position and optimizer state from its run directory where that directory is reachable, and
joins the syncer as a new incarnation of that id (elastic membership: the syncer folds the
dead process's ledger into the id's totals; a learner without an id would get a new one). An
island runs ``torchrun`` as a child of its actor, killed with the actor (``PR_SET_PDEATHSIG``)
and, should a rank outlive it, by the next incarnation of the actor.

The syncer actors are pinned to the driver's node (the ports are chosen there and the
checkpoint, ``syncer*.metrics.jsonl`` and the final summary are written there); a syncer
actor that dies is restarted by Ray on that node, on the same port, resuming from its
checkpoint. Learners go wherever Ray has room. ``OUT`` must be reachable at the same path
from every node (a shared file system, or one machine); where a learner's node cannot see
it, the learner's files are copied back to the driver at the end.

The run's ``summary.json`` and ``metrics.jsonl`` are written by the same code as the built-in
launcher's (``ddiloco.runtime.launch.summary``); ``ray`` in the summary adds the cluster's
address, its nodes, where each learner ran and the time it took to connect.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.runtime.launch.ray_actors import LearnerActor, SyncerActor
from ddiloco.runtime.launch.summary import (
    GlobalEval,
    Member,
    fetch_global,
    final_model,
    poll_status,
    write_summary,
)

__all__ = ["RayOptions", "RayLauncher", "import_ray"]

INSTALL_HINT = "pip install 'ddiloco[ray]'"


def import_ray():
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"runtime.launcher = ray needs Ray, which is not installed ({e}): {INSTALL_HINT}"
        ) from None
    return ray


@dataclass(kw_only=True, slots=True)
class RayOptions:
    """How the Ray backend asks for resources and restarts. What runs is the run's
    ``TrainConfig`` (``runtime.launcher = ray``, ``runtime.ray_address``)."""

    max_restarts: int = 100
    """Ray actor restarts per learner or syncer shard (their ``run`` calls are retried as
    often)."""
    crash_retries: int = 3
    """Times a learner whose ``run`` raised (an error, not a dead process) is run again."""
    cpus_per_rank: float = 1.0
    """CPUs declared per learner rank."""
    syncer_cpus: float = 1.0
    """CPUs declared per syncer shard."""
    startup_timeout_s: float = 300.0
    """How long the syncer actors may take to be placed and bind."""
    progress_interval_s: float = 2.0


# -- the driver -----------------------------------------------------------------------------
class RayLauncher:
    """Runs one ``TrainConfig`` on a Ray cluster. ``run()`` returns the summary."""

    def __init__(self, config, options: RayOptions | None = None) -> None:
        from ddiloco.runtime.launch.backends import check_runnable

        self.ray = import_ray()
        config = check_runnable(config, "ray")
        self.cfg = config
        self.opts = options or RayOptions()
        self.out = Path(config.out).resolve()
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        # the run's eval set and model: a missing optional dependency fails here, at once
        self.evals = GlobalEval(config, self.wall0)
        self._started_ray = False
        self._syncers: list[Any] = []
        self._learners: dict[int, Any] = {}
        self._client: Any = None
        self._closed = False
        self._stop_requested = False
        self._reports: dict[tuple[int, int], dict] = {}
        self._status: dict | None = None
        self.info: dict[str, Any] = {"address": config.runtime.ray_address}

    def _now(self) -> float:
        return time.monotonic() - self.t0

    # -- cluster ---------------------------------------------------------------------------
    def _connect(self) -> None:
        from ddiloco.runtime.transport.auth import TOKEN_ENV, load_token, new_token

        c = self.cfg
        token = load_token(c.runtime.token_file) if c.runtime.token_file else new_token()
        self.token = token
        env = {TOKEN_ENV: token, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        kw: dict[str, Any] = dict(
            runtime_env={"env_vars": env},
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        if c.runtime.ray_address is None:  # a cluster of this machine, for this run
            need = c.runtime.shards * self.opts.syncer_cpus + (
                c.learners * c.runtime.island_size * self.opts.cpus_per_rank
            )
            kw.update(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False)
            self._started_ray = True
        else:
            kw["address"] = c.runtime.ray_address
        t = time.monotonic()
        try:
            self.ray.init(**kw)
        except (ConnectionError, RuntimeError) as e:
            where = c.runtime.ray_address or "a local cluster"
            raise ConnectionError(f"could not connect to the Ray cluster at {where}: {e}") from None
        self.info["connect_s"] = round(time.monotonic() - t, 3)
        self.node = self.ray.get_runtime_context().get_node_id()
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        self.info["nodes"] = len(nodes)
        self.info["driver_node"] = self.node
        self.gpus = self.ray.cluster_resources().get("GPU", 0)
        if c.runtime.device == "cuda" and self.gpus < c.runtime.island_size:
            raise ValueError(
                f"runtime.device = cuda, but the Ray cluster has {self.gpus:g} GPUs "
                f"(an island needs {c.runtime.island_size})"
            )

    def _start_syncers(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ddiloco.runtime.launch.launcher import free_ports

        c = self.cfg
        S = c.runtime.shards
        ports = free_ports(S) if S > 1 or c.runtime.port == 0 else [c.runtime.port]
        http = c.runtime.http_port
        if http == 0:
            http = free_ports(1)[0]
        cfg = c.replace(http_port=http)
        actor = self.ray.remote(SyncerActor).options(
            num_cpus=self.opts.syncer_cpus,
            max_restarts=self.opts.max_restarts,
            max_task_retries=self.opts.max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node, soft=False),
        )
        self._syncers = [
            actor.remote(cfg, shard=k, ports=ports, out=str(self.out)) for k in range(S)
        ]
        try:
            where = self.ray.get(
                [s.address.remote() for s in self._syncers], timeout=self.opts.startup_timeout_s
            )
        except self.ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the syncer actors did not start within {self.opts.startup_timeout_s:g} s: "
                f"they need {self.opts.syncer_cpus:g} CPU each on the driver's node; the "
                f"cluster has {self.ray.available_resources()} free; see {self.out / 'logs'}"
            ) from None
        self.addresses = [w["address"] for w in where]
        self.info["syncers"] = where
        # where the syncers serve (address, node, pid of their Ray worker), for operators
        (self.out / "ray.json").write_text(json.dumps(self.info, indent=2))
        from ddiloco.runtime.learner.sharded import ShardedClient

        self._client = ShardedClient(
            self.addresses[0], self.token, shards=tuple(self.addresses) if S > 1 else ()
        )
        if http is not None:
            host = self.addresses[0].rsplit(":", 1)[0]
            print(
                f"ddiloco: live dashboard on http://{host}:{http}/?token={self.token}",
                file=sys.stderr,
                flush=True,
            )

    def _learner_actor(self, m: int):
        c = self.cfg
        n = c.runtime.island_size
        gpus = n if c.runtime.device != "cpu" and self.gpus >= n else 0
        return (
            self.ray.remote(LearnerActor)
            .options(
                num_cpus=n * self.opts.cpus_per_rank,
                num_gpus=gpus,
                max_restarts=self.opts.max_restarts,
                max_task_retries=self.opts.max_restarts,
            )
            .remote(c, learner=m, syncer=self.addresses[0], out=str(self.out))
        )

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict:
        c = self.cfg
        from ddiloco.config import CONFIG_FILE, dump_config
        from ddiloco.rundir import fresh_run_dir

        fresh_run_dir(self.out)  # nothing of an earlier run in OUT
        (self.out / "logs").mkdir(exist_ok=True)
        dump_config(c, self.out / CONFIG_FILE)
        from ddiloco.runtime.export import write_model_record

        write_model_record(c, self.out)
        if threading.current_thread() is threading.main_thread():

            def _stop(*_):
                self._stop_requested = True

            signal.signal(signal.SIGTERM, _stop)
            signal.signal(signal.SIGINT, _stop)
        progress = None
        if c.progress:
            from ddiloco.runtime.launch.progress import LiveProgress

            progress = LiveProgress(c.learners, interval_s=self.opts.progress_interval_s)
        interrupted = False
        self.t_learners = 0.0
        results: dict[int, dict] = {}
        states: dict[int, str] = {}
        try:
            self._connect()
            self._start_syncers()
            self.t_learners = self._now()
            pending = {}
            crashes = dict.fromkeys(range(c.learners), 0)
            for m in range(c.learners):
                self._learners[m] = self._learner_actor(m)
            self._wait_placed()
            for m in range(c.learners):  # placed and warm: they join within moments
                pending[self._learners[m].run.remote()] = m
                states[m] = "running"
            next_status = 0.0
            while pending:
                if self._stop_requested:
                    raise KeyboardInterrupt
                done, _ = self.ray.wait(list(pending), num_returns=len(pending), timeout=0.25)
                for ref in done:
                    m = pending.pop(ref)
                    try:
                        results[m] = self.ray.get(ref)
                        states[m] = "finished"
                    except self.ray.exceptions.RayActorError as e:  # out of restarts
                        print(f"ddiloco: learner {m} is gone: {e}", file=sys.stderr)
                        states[m] = "failed"
                    except self.ray.exceptions.RayTaskError as e:
                        crashes[m] += 1
                        print(f"ddiloco: learner {m} failed: {e}", file=sys.stderr)
                        if crashes[m] <= self.opts.crash_retries:
                            pending[self._learners[m].run.remote()] = m
                        else:
                            states[m] = "failed"
                if self._now() >= next_status:
                    next_status = self._now() + 0.5
                    self._status = poll_status(self._client, self._reports) or self._status
                    self.evals.poll(self._client, self._status)
                    if progress is not None:
                        progress.update(self._now(), self._status, states)
        except KeyboardInterrupt:
            interrupted = True
            print("\nddiloco: interrupted, stopping the actors", file=sys.stderr)
        finally:
            if progress is not None:
                progress.close()
        self.t_end = self._now()
        fetched = None
        if not interrupted and self._client is not None:
            self._status = poll_status(self._client, self._reports) or self._status
            fetched = fetch_global(self._client)
        self.evals.wait()
        self._copy_back(results)
        self.close()
        members = self._members(states)
        params, source = final_model(c, self.out, fetched, interrupted=interrupted)
        return write_summary(
            c,
            self.out,
            status=self._status,
            reports=self._reports,
            members=members,
            processes_ok=bool(states) and all(s == "finished" for s in states.values()),
            interrupted=interrupted,
            final_params=params,
            final_source=source,
            evals=self.evals,
            wall0=self.wall0,
            t_learners=self.t_learners,
            t_end=self.t_end,
            wall_s=self._now(),
            chaos={},
            extra={
                "launcher": "ray",
                "ray": {
                    **self.info,
                    "learner_nodes": {str(m): r["node"] for m, r in sorted(results.items())},
                },
            },
        )

    def _wait_placed(self) -> None:
        """Every learner actor placed and its imports done, or a TimeoutError that says what
        the cluster lacks."""
        refs = {a.ready.remote(): m for m, a in self._learners.items()}
        ready, _ = self.ray.wait(
            list(refs), num_returns=len(refs), timeout=self.opts.startup_timeout_s
        )
        if len(ready) < len(refs):
            missing = sorted(m for r, m in refs.items() if r not in ready)
            n = self.cfg.runtime.island_size
            raise TimeoutError(
                f"learners {missing} were not placed within {self.opts.startup_timeout_s:g} s: "
                f"each needs {n * self.opts.cpus_per_rank:g} CPUs"
                f"{f' and {n} GPUs' if self.cfg.runtime.device != 'cpu' and self.gpus else ''}; "
                f"the cluster has {self.ray.available_resources()} free"
            )
        self.ray.get(ready)  # an actor whose construction failed raises here

    def _copy_back(self, results: dict[int, dict]) -> None:
        """Learners that ended on another node than the driver: their files, where the
        driver does not see the same (a node without the shared file system)."""
        for m, r in results.items():
            if r["node"] == self.node:
                continue
            try:
                files = self.ray.get(self._learners[m].files.remote(), timeout=60)
            except Exception as e:  # noqa: BLE001 - a lost node: its rows stay there
                print(f"ddiloco: learner {m}'s files: {e}", file=sys.stderr)
                continue
            for rel, data in files.items():
                p = self.out / rel
                if not p.is_file() or p.read_bytes() != data:
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.write_bytes(data)

    def _members(self, states: dict[int, str]) -> dict[int, Member]:
        """Starts from each learner's ``learner_start`` rows (one per process); every start
        after the first, and a learner that failed for good, count as failures."""
        members = {}
        for m in range(self.cfg.learners):
            path = self.out / f"learner_{m}" / "metrics.jsonl"
            text = path.read_text() if path.is_file() else ""
            starts = sum(1 for line in text.splitlines() if '"kind": "learner_start"' in line)
            fails = max(0, starts - 1) + (states.get(m) == "failed")
            members[m] = Member(starts=starts, failures=fails)
        return members

    def close(self) -> None:
        """Stop the learners, close the syncers (final checkpoints), leave the cluster (and
        stop it if this run started it)."""
        if self._closed:
            return
        self._closed = True
        if not self.ray.is_initialized():
            return
        for a in self._learners.values():
            self.ray.kill(a, no_restart=True)
        try:
            self.ray.get([s.close.remote() for s in self._syncers], timeout=60)
        except Exception as e:  # noqa: BLE001
            print(f"ddiloco: closing the syncers: {e}", file=sys.stderr)
        for s in self._syncers:
            self.ray.kill(s, no_restart=True)
        if self._client is not None:
            self._client.close()
        self.ray.shutdown()

    def __enter__(self) -> RayLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
