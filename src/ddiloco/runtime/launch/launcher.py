"""``ddiloco train --engine processes``: a syncer and M learner processes on loopback.

The launcher starts the syncer (``python -m ddiloco.runtime.cli syncer``) and M learners
(``python -m ddiloco.runtime.cli learner``, or ``torchrun --nproc-per-node n -m ...`` for
islands of n ranks), each in its own process group. It supervises them: a learner that
crashes (or is killed by chaos) is restarted after its downtime and resumes from its
progress file with the current global parameters; a syncer that dies is restarted with
``--resume`` on the same port. It shows live progress, injects the seeded chaos schedule,
shuts everything down on Ctrl-C (no orphans: every process group is SIGTERMed, then
SIGKILLed), and writes the same ``summary.json`` / ``metrics.jsonl`` as the in-process
engine, plus ``logs/*.log``, ``chaos.jsonl`` and per-learner directories.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddiloco.metrics.sinks import read_jsonl
from ddiloco.runtime.launch.backends import check_runnable
from ddiloco.runtime.launch.summary import (
    GlobalEval,
    Member,
    fetch_global,
    final_model,
    poll_status,
    write_summary,
)

__all__ = ["LaunchOptions", "Launcher", "LaunchError", "free_ports"]


class LaunchError(RuntimeError):
    """The run cannot go on: the syncer did not start, or a learner crashes at start-up
    every time. The message says which process, why (its log's last lines) and where its
    log is."""


def log_tail(path: Path, lines: int = 6) -> str:
    """The last ``lines`` non-empty lines of a process's log since its last start, indented
    (empty if there are none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    last = text.rsplit("\n=== start ", 1)[-1].splitlines()[1:]
    return "\n".join("    " + ln for ln in [ln for ln in last if ln.strip()][-lines:])


def cli_command(island_size: int) -> list[str]:
    """The command that runs ``ddiloco.runtime.cli`` for a learner: the interpreter itself,
    or a single-node torchrun of ``island_size`` ranks."""
    if island_size <= 1:
        return [sys.executable, "-m", "ddiloco.runtime.cli"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={island_size}",
        "-m",
        "ddiloco.runtime.cli",
    ]


@dataclass(kw_only=True, slots=True)
class LaunchOptions:
    """How the launcher supervises its processes. What runs (the chaos, islands, shards,
    ports, heartbeat timeout, checkpoints, step budget) is the run's ``TrainConfig``."""

    restart_crashed: bool = True
    """Restart a learner that exits with an error (after ``crash_downtime_s``)."""
    crash_downtime_s: float = 1.0
    max_restarts: int = 1000
    max_startup_crashes: int = 3
    """A learner that exits with an error this many times in a row without reporting a new
    step (a deterministic error: a missing data path, P above the model's tensor count)
    ends the run: every process is stopped and the launcher raises ``LaunchError`` with
    the learner's last log lines."""
    startup_timeout_s: float = 120.0
    """How long the syncer may take to bind."""
    progress_interval_s: float = 2.0
    """Seconds between progress lines when the output is not a terminal (a terminal gets a
    live table, redrawn with every status poll)."""
    fork_server: bool = True
    """Fork the syncer and single-process learners from a warm server that has imported
    torch once (``ddiloco.runtime.launch.forkserver``): a restart after a kill costs a fraction of
    a second instead of seconds of start-up that also compete with the running learners for
    the CPU. Islands (torchrun) are always started afresh."""
    extra_syncer_args: list[str] = field(default_factory=list)
    extra_learner_args: list[str] = field(default_factory=list)
    """Flags added to every ``ddiloco learner`` command (e.g. ``--fresh-optimizer``)."""


@dataclass(slots=True)
class _Proc:
    name: str
    cmd: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None
    state: str = "new"  # running, stopped, down, finished, failed
    restart_at: float | None = None
    starts: int = 0
    startup_crashes: int = 0
    """Exits with an error in a row, each before the learner reported a new step."""
    step_at_start: int | None = None
    """The learner's reported step when it was last started."""
    kills: int = 0
    stops: int = 0
    cont_at: float | None = None
    exit_codes: list = field(default_factory=list)
    learner: int | None = None
    """The learner id (None for a process that joined without one until it is known)."""
    first_start_s: float | None = None
    removed_s: float | None = None
    """When the launcher told it to leave (elastic membership)."""
    link_cut: tuple[int, float] | None = None
    """(pid, restore time) of the process whose link to the syncer is cut now."""


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback (the shards must know each other's addresses
    before they start)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _check_bind(host: str, port: int) -> None:
    """Raise ValueError, in one line, unless the syncer can bind ``host:port`` here (the local
    launcher runs it on this host)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, port))
    except socket.gaierror as e:
        raise ValueError(f"runtime.host {host!r} does not resolve ({e.strerror})") from None
    except OSError as e:
        if port and e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"runtime.port {port} on {host} is in use (another syncer?): choose another "
                f"--port (0: a free one) or stop the process holding it"
            ) from None
        raise ValueError(
            f"runtime.host {host!r} is not an address of this host ({e.strerror}): the local "
            f"launcher runs the syncer here; use 127.0.0.1, 0.0.0.0 or one of this host's "
            f"addresses (--launcher ray places it on a cluster node)"
        ) from None


def _check_data(config) -> None:
    """Raise ValueError, in one line, unless the run's data path is on this host: the local
    launcher starts every learner here, and each would fail at start-up without it."""
    from ddiloco.data import parse_data_spec

    spec = parse_data_spec(config.data.source)
    if spec.source.needs_path and spec.path and not Path(spec.path).exists():
        raise ValueError(
            f"data.source {config.data.source!r}: {spec.path} does not exist; check the path "
            f"(relative paths are resolved from {Path.cwd()})"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """Runs one ``TrainConfig`` with real processes. ``run()`` returns the summary."""

    def __init__(self, config, options: LaunchOptions | None = None) -> None:
        from ddiloco.runtime.chaos import chaos_for_run

        config = check_runnable(config, "local")
        _check_bind(config.runtime.host, config.runtime.port if config.runtime.shards == 1 else 0)
        _check_data(config)
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        # the run's eval set and model, built here: a missing optional dependency of the
        # data or the model is one error now, not a crash loop of every learner
        self.evals = GlobalEval(config, self.wall0)
        self.cfg = config
        self.opts = options or LaunchOptions()
        from ddiloco.rundir import fresh_run_dir

        self.out = fresh_run_dir(config.out)  # nothing of an earlier run in OUT
        (self.out / "logs").mkdir(exist_ok=True)
        self.chaos = chaos_for_run(config)
        if self.chaos.link_cut and config.runtime.max_island_size > 1:
            raise ValueError(
                "chaos link_cut needs single-process learners (island_size 1): "
                "the cut is signalled to the learner process"
            )
        self.procs: dict[str, _Proc] = {}
        self.port = config.runtime.port
        # a free observability port chosen once, so that a restarted syncer serves the same
        # address
        self.http_port = config.runtime.http_port
        if self.http_port == 0:
            self.http_port = _free_port()
        self.ports: list[int] = []
        """The shards' ports (sharded syncer only)."""
        self._reports: dict[tuple[int, int], dict] = {}
        self._status: dict | None = None
        self._closed = False
        self._stop_requested = False
        self._fired: set = set()
        self.env = dict(os.environ)
        from ddiloco.runtime.transport.auth import TOKEN_ENV, new_token

        self.env[TOKEN_ENV] = new_token()
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self._client = None
        self._forkserver = None
        self._progress = None

    # -- processes ------------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _syncer_name(self, k: int) -> str:
        return "syncer" if self.cfg.runtime.shards == 1 else f"syncer_{k}"

    def _syncers(self) -> list[_Proc]:
        return [p for n, p in self.procs.items() if n.startswith("syncer")]

    @property
    def config_path(self) -> Path:
        """The resolved run configuration every process reads."""
        from ddiloco.config import CONFIG_FILE

        return self.out / CONFIG_FILE

    def write_config(self) -> Path:
        """Write the resolved run configuration that the syncers and learners read, the
        run's model record (``rundir.MODEL_FILE``, what ``ddiloco.load_model`` builds) and
        its token (``rundir.TOKEN_FILE``, mode 0600: ``ddiloco status RUN_DIR`` reads it)."""
        from ddiloco.config import dump_config
        from ddiloco.rundir import TOKEN_FILE
        from ddiloco.runtime.export import write_model_record
        from ddiloco.runtime.transport.auth import TOKEN_ENV

        write_model_record(self.cfg, self.out)
        fd = os.open(self.out / TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.env[TOKEN_ENV] + "\n")
        return dump_config(self.cfg, self.config_path)

    def _syncer_cmd(self, resume: bool, k: int = 0) -> list[str]:
        # every setting comes from the run file; the flags are this process's own (its
        # port, files, shard) and the port the first start got, so a restart binds it again
        name = self._syncer_name(k)
        sharded = self.cfg.runtime.shards > 1
        port = self.ports[k] if sharded else self.port
        shard = (
            []
            if not sharded
            else ["--shards", ",".join(f"127.0.0.1:{q}" for q in self.ports), "--shard", str(k)]
        )
        cmd = [
            sys.executable,
            "-m",
            "ddiloco.runtime.cli",
            "syncer",
            "--config",
            str(self.config_path),
            "--port",
            str(port),
            "--port-file",
            str(self.out / f"{name}.port"),
            "--checkpoint-dir",
            str(self.out / "checkpoint" / (f"shard_{k}" if sharded else "")),
            "--metrics-file",
            str(self.out / f"{name}.metrics.jsonl"),
            *shard,
            "--metrics-dir",
            str(self.out),
            *self.opts.extra_syncer_args,
        ]
        if self.http_port is not None and k == 0:  # the dashboard on shard 0
            cmd += ["--http-port", str(self.http_port)]
        if resume:
            cmd.append("--resume")
        return cmd

    def _learner_cmd(self, m: int | None) -> list[str]:
        """Learner m's command; m None: a learner that joins without an id (elastic)."""
        head = cli_command(self.cfg.runtime.island(m).size)
        ident = [] if m is None else ["--learner", str(m)]
        cmd = head + [
            "learner",
            "--syncer",
            f"127.0.0.1:{self.port}",
            *ident,
            "--config",
            str(self.config_path),
            "--run-dir",
            str(self.out / ("learner_{learner}" if m is None else f"learner_{m}")),
            "--metrics-dir",
            str(self.out),
            *self.opts.extra_learner_args,
        ]
        return cmd

    def _spawn(self, p: _Proc) -> None:
        # the syncer and single-process learners fork from the warm server; islands are
        # started by torchrun
        forked = self._forkserver is not None and (
            p.name.startswith("syncer")
            or p.cmd[:3] == [sys.executable, "-m", "ddiloco.runtime.cli"]
        )
        with open(p.log_path, "ab") as log:
            log.write(
                f"\n=== start {p.starts} at t={self._now():.3f}s"
                f"{' (forked)' if forked else ''}: {' '.join(p.cmd)}\n".encode()
            )
            log.flush()
            if forked:  # p.cmd is [python, -m, ddiloco.runtime.cli, syncer|learner, ...]
                p.popen = self._forkserver.spawn(p.cmd[2], p.cmd[3:], str(p.log_path))
            else:
                p.popen = subprocess.Popen(
                    p.cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
        p.starts += 1
        p.step_at_start = self._step_of(p.name) if p.name.startswith("learner") else None
        p.state = "running"
        if p.first_start_s is None:
            p.first_start_s = self._now()
        p.restart_at = None

    def _signal(self, p: _Proc, sig: int) -> None:
        if p.popen is not None and p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, sig)
            except ProcessLookupError:
                try:  # a just-forked learner may not lead its own session yet
                    os.kill(p.popen.pid, sig)
                except ProcessLookupError:
                    pass

    def _wait_port(self, syncer: _Proc) -> None:
        path = self.out / f"{syncer.name}.port"
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while time.monotonic() < deadline:
            if path.is_file():
                if syncer.name in ("syncer", "syncer_0"):
                    self.port = int(path.read_text())
                return
            if syncer.popen.poll() is not None:
                raise LaunchError(
                    f"the syncer exited with code {syncer.popen.returncode} before it "
                    f"listened. Its last lines ({syncer.log_path}):\n{log_tail(syncer.log_path)}"
                )
            time.sleep(0.05)
        raise LaunchError(
            f"the syncer did not bind within {self.opts.startup_timeout_s} s; see {syncer.log_path}"
        )

    def close(self) -> None:
        """Stop every process group: SIGCONT (stopped ones), SIGTERM, then SIGKILL."""
        if self._closed:
            return
        self._closed = True
        # learners first, the syncer last (its SIGTERM writes a final checkpoint)
        self._stop(self._learners())
        self._stop(self._syncers())
        if self._forkserver is not None:
            self._forkserver.close()
        if self._client is not None:
            self._client.close()

    def _stop(self, group: list[_Proc]) -> None:
        """SIGCONT (stopped ones) and SIGTERM every process of ``group``; SIGKILL those
        still running 10 s later."""
        for p in group:
            self._signal(p, signal.SIGCONT)
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for p in group:
            if p.popen is None:
                continue
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.popen.wait(timeout=5.0)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the run --------------------------------------------------------------------------
    def run(self) -> dict:
        from ddiloco.runtime.chaos import ChaosLog, chaos_schedule

        c = self.cfg
        self.write_config()
        self.chaos_log = ChaosLog(self.out / "chaos.jsonl", self.t0)
        events = chaos_schedule(self.chaos, horizon_s=24 * 3600.0)
        interrupted = False
        if threading.current_thread() is threading.main_thread():
            # Ctrl-C and SIGTERM set a flag that the supervision loop acts on: an exception
            # raised inside a blocking gRPC status call could be swallowed as an RPC error
            def _stop(*_):
                self._stop_requested = True

            signal.signal(signal.SIGTERM, _stop)
            signal.signal(signal.SIGINT, _stop)
        if c.progress:
            from ddiloco.runtime.launch.progress import LiveProgress

            self._progress = LiveProgress(c.learners, interval_s=self.opts.progress_interval_s)
        try:
            if self.opts.fork_server:
                from ddiloco.runtime.launch.forkserver import ForkServer

                self._forkserver = ForkServer(
                    self.env,
                    str(self.out / "logs" / "forkserver.log"),
                    self.opts.startup_timeout_s,
                    str(self.out),
                )
            self.ports = free_ports(self.cfg.runtime.shards) if self.cfg.runtime.shards > 1 else []
            for k in range(self.cfg.runtime.shards):
                name = self._syncer_name(k)
                self.procs[name] = _Proc(
                    name, self._syncer_cmd(False, k), self.out / "logs" / f"{name}.log"
                )
                self._spawn(self.procs[name])
            for k in range(self.cfg.runtime.shards):
                self._wait_port(self.procs[self._syncer_name(k)])
                self.procs[self._syncer_name(k)].cmd = self._syncer_cmd(True, k)
            if self.http_port is not None:
                print(
                    f"ddiloco: live dashboard on {self.dashboard_url}", file=sys.stderr, flush=True
                )
            self._client = self._make_client()
            self.t_learners = self._now()
            for m in range(c.learners):
                p = _Proc(
                    f"learner_{m}",
                    self._learner_cmd(m),
                    self.out / "logs" / f"learner_{m}.log",
                    learner=m,
                )
                self.procs[p.name] = p
                self._spawn(p)
            self._supervise(events)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if self._progress is not None:
                self._show_progress()
                self._progress.close()
        if interrupted:
            print("\nddiloco: interrupted, stopping all processes", file=sys.stderr)
        self.t_end = self._now()
        if interrupted and self._client is not None:
            # the learners leave (their last pushes merged, their ledgers reported), then
            # the summary reads the syncer that saw it all
            self._stop(self._learners())
            self._poll_status()
        final_params = None
        if not interrupted:
            self._poll_status()
            final_params = fetch_global(self._client)
        self.evals.wait()
        self.close()  # the syncers' final checkpoints
        self.chaos_log.close()
        params, source = final_model(self.cfg, self.out, final_params, interrupted=interrupted)
        return self._summarise(params, source, interrupted)

    @property
    def dashboard_url(self) -> str | None:
        """The syncer's dashboard, with the run's token (once; the page then keeps a
        session cookie)."""
        from ddiloco.runtime.transport.auth import TOKEN_ENV

        if self.http_port is None:
            return None
        return f"http://127.0.0.1:{self.http_port}/?token={self.env[TOKEN_ENV]}"

    def _make_client(self):
        from ddiloco.runtime.learner.sharded import ShardedClient
        from ddiloco.runtime.transport.auth import TOKEN_ENV

        return ShardedClient(
            f"127.0.0.1:{self.port}",
            self.env[TOKEN_ENV],
            shards=tuple(f"127.0.0.1:{q}" for q in self.ports),
        )

    def _learners(self) -> list[_Proc]:
        return [p for n, p in self.procs.items() if not n.startswith("syncer")]

    def _supervise(self, events) -> None:
        next_status = 0.0
        ev_i = 0
        rng_pick = lambda draw, pool: pool[min(int(draw * len(pool)), len(pool) - 1)]  # noqa: E731
        while True:
            if self._stop_requested:
                raise KeyboardInterrupt
            now = self._now()
            for p in self._learners():
                if p.state in ("running", "stopped") and p.popen.poll() is not None:
                    rc = p.popen.returncode
                    p.exit_codes.append(rc)
                    if rc == 0 or p.removed_s is not None:
                        p.state = "finished"
                        self.chaos_log.write("learner-finished", target=p.name, rc=rc)
                    elif p.starts <= self.opts.max_restarts and self.opts.restart_crashed:
                        self._count_crash(p, rc)  # raises LaunchError on a crash loop
                        p.state = "down"
                        p.restart_at = now + self.opts.crash_downtime_s
                        self.chaos_log.write("learner-crashed", target=p.name, rc=rc)
                    else:
                        p.state = "failed"
                if p.state == "down" and (self._status or {}).get("budget_spent"):
                    p.state = "finished"  # nothing left to do: not restarted
                    self.chaos_log.write(
                        "learner-not-restarted", target=p.name, reason="step budget spent"
                    )
                if p.state == "down" and p.restart_at is not None and now >= p.restart_at:
                    self._spawn(p)
                    self.chaos_log.write("restart-learner", target=p.name)
                if p.link_cut is not None and now >= p.link_cut[1]:
                    if p.popen is not None and p.popen.pid == p.link_cut[0]:
                        self._signal(p, signal.SIGUSR2)  # a restarted process has its link
                        self.chaos_log.write(
                            "restore-link", target=p.name, step=self._step_of(p.name)
                        )
                    p.link_cut = None
                if p.state == "stopped" and p.cont_at is not None and now >= p.cont_at:
                    self._signal(p, signal.SIGCONT)
                    p.state, p.cont_at = "running", None
                    self.chaos_log.write("cont-learner", target=p.name)
            for syncer in self._syncers():
                if syncer.state == "running" and syncer.popen.poll() is not None:
                    self.chaos_log.write(
                        "syncer-exited", target=syncer.name, rc=syncer.popen.returncode
                    )
                    syncer.state, syncer.restart_at = "down", now + 1.0
                if syncer.state == "down" and now >= syncer.restart_at:
                    self._spawn(syncer)
                    self.chaos_log.write("restart-syncer", target=syncer.name)
            if all(p.state in ("finished", "failed") for p in self._learners()):
                return
            while ev_i < len(events) and events[ev_i].at_s <= now - self.t_learners:
                self._inject(events[ev_i], rng_pick)
                ev_i += 1
            if now >= next_status:
                next_status = now + 0.5
                self._poll_status()
                self.evals.poll(self._client, self._status)
                self._step_triggers()
                self._show_progress()
            time.sleep(0.05)

    def _count_crash(self, p: _Proc, rc: int) -> None:
        """Count a crash of learner ``p``; raise ``LaunchError`` once it has crashed
        ``max_startup_crashes`` times in a row without a new step (restarting it cannot
        help)."""
        self._poll_status()  # its last report, if it made one
        step = self._step_of(p.name)
        p.startup_crashes = p.startup_crashes + 1 if step == p.step_at_start else 1
        if p.startup_crashes < self.opts.max_startup_crashes:
            return
        self.chaos_log.write("learner-gave-up", target=p.name, rc=rc, crashes=p.startup_crashes)
        where = "at start-up" if not step else f"at step {step}"
        raise LaunchError(
            f"{p.name} failed {p.startup_crashes} times in a row {where} (exit code {rc}), "
            f"without a new step; not restarting it. Its last lines ({p.log_path}):\n"
            f"{log_tail(p.log_path)}"
        )

    def _step_triggers(self) -> None:
        """Deterministic, progress-based faults (``kill_at_step``, ``stop_at_step``,
        ``link_cut``, ``syncer_kill_at_step``)."""
        from ddiloco.runtime.chaos import ChaosEvent

        st = self._status or {}
        steps = {
            int(m): (i.get("report") or {}).get("global_step") or 0
            for m, i in st.get("learners", {}).items()
        }

        def due(kind: str, m: int, step: int) -> _Proc | None:
            """Learner m's process, once it is running and has reported ``step``, the first
            time only (the event is then marked fired)."""
            p = self.procs.get(f"learner_{m}")
            key = (kind, m, step)
            if key in self._fired or p is None or p.state != "running":
                return None
            if steps.get(m, 0) < step or (kind == "cut" and p.link_cut is not None):
                return None
            self._fired.add(key)
            return p

        for m, step in self.chaos.kill_at_step:
            if (p := due("kill", m, step)) is not None:
                self._inject(
                    ChaosEvent(0.0, "kill-learner", 0.0, self.chaos.kill_downtime_s),
                    lambda draw, pool, p=p: p,
                )
        for m, step, dur in self.chaos.stop_at_step:
            if (p := due("stop", m, step)) is not None:
                self._inject(ChaosEvent(0.0, "stop-learner", 0.0, dur), lambda draw, pool, p=p: p)
        for m, step, dur in self.chaos.link_cut:
            if (p := due("cut", m, step)) is not None:
                self._signal(p, signal.SIGUSR1)
                p.link_cut = (p.popen.pid, self._now() + dur)
                self.chaos_log.write(
                    "cut-link", target=p.name, duration_s=dur, step=self._step_of(p.name)
                )
        self._elastic_triggers(int(st.get("steps_done") or 0))
        s = self.chaos.syncer_kill_at_step
        if (
            s
            and "syncer" not in self._fired
            and steps
            and sum(steps.values()) / self.cfg.learners >= s
        ):
            self._fired.add("syncer")
            self._inject(ChaosEvent(0.0, "kill-syncer", 0.0, self.chaos.syncer_downtime_s), None)

    def _elastic_triggers(self, steps_done: int) -> None:
        """Elastic membership declared in the chaos config: add a learner (it joins without
        an id) or make one leave (SIGTERM: it flushes its pushes and says Leave)."""
        if (self._status or {}).get("budget_spent"):
            return
        for i, at in enumerate(self.chaos.add_learner_at_step):
            if ("add", i) not in self._fired and steps_done >= at:
                self._fired.add(("add", i))
                k = sum(1 for n in self.procs if n.startswith("learner_+"))
                p = _Proc(
                    f"learner_+{k}",
                    self._learner_cmd(None),
                    self.out / "logs" / f"learner_+{k}.log",
                )
                self.procs[p.name] = p
                self._spawn(p)
                self.chaos_log.write("add-learner", target=p.name, steps_done=steps_done)
        for m, at in self.chaos.remove_learner_at_step:
            p = self.procs.get(f"learner_{m}")
            if (
                ("remove", m) not in self._fired
                and p is not None
                and steps_done >= at
                and p.state == "running"
            ):
                self._fired.add(("remove", m))
                p.removed_s = self._now()
                self._signal(p, signal.SIGTERM)
                self.chaos_log.write("remove-learner", target=p.name, steps_done=steps_done)

    def _learner_ids(self) -> dict[int, _Proc]:
        """Learner id -> its process, for every learner of the run: those started with an
        id, and those the syncer assigned one (found by pid in their ``learner_start`` rows)."""
        out = {p.learner: p for p in self._learners() if p.learner is not None}
        pids = {p.popen.pid: p for p in self._learners() if p.learner is None and p.popen}
        for d in sorted(self.out.glob("learner_*")):
            path = d / "metrics.jsonl"
            if not d.name[len("learner_") :].isdigit() or not path.is_file():
                continue
            for r in read_jsonl(path, containing='"learner_start"'):
                p = pids.get(r.get("pid"))
                if p is not None:
                    p.learner = int(r["learner"])
                    out[p.learner] = p
        return dict(sorted(out.items()))

    def _inject(self, ev, pick) -> None:
        now = self._now()
        if ev.kind == "kill-syncer":
            s = self.procs[
                self._syncer_name(min(self.chaos.syncer_kill_shard, self.cfg.runtime.shards - 1))
            ]
            if s.state == "running":
                self._signal(s, signal.SIGKILL)
                s.popen.wait()
                # downtime counts from the moment the process is gone
                s.state, s.restart_at, s.kills = "down", self._now() + ev.duration_s, s.kills + 1
                self.chaos_log.write("kill-syncer", target=s.name, downtime_s=ev.duration_s)
            return
        pool = [p for p in self._learners() if p.state == "running"]
        if not pool:
            return
        p = pick(ev.draw, pool)
        if ev.kind == "kill-learner":
            self._signal(p, signal.SIGKILL)
            p.popen.wait()
            p.exit_codes.append(p.popen.returncode)
            p.state, p.restart_at, p.kills = "down", self._now() + ev.duration_s, p.kills + 1
            self.chaos_log.write(
                "kill-learner", target=p.name, downtime_s=ev.duration_s, step=self._step_of(p.name)
            )
        elif ev.kind == "stop-learner":
            self._signal(p, signal.SIGSTOP)
            p.state, p.cont_at, p.stops = "stopped", now + ev.duration_s, p.stops + 1
            self.chaos_log.write("stop-learner", target=p.name, duration_s=ev.duration_s)

    def _step_of(self, name: str):
        st = self._status or {}
        rep = st.get("learners", {}).get(name.split("_")[1], {}).get("report", {})
        return rep.get("global_step")

    def _poll_status(self) -> None:
        st = poll_status(self._client, self._reports)
        if st is not None:
            self._status = st

    def _show_progress(self) -> None:
        if self._progress is not None:
            self._progress.update(
                self._now(),
                self._status,
                {
                    m: p.state
                    for m in range(self.cfg.learners)
                    if (p := self.procs.get(f"learner_{m}")) is not None
                },
            )

    # -- summary --------------------------------------------------------------------------
    def _summarise(
        self, final_params: dict | None, final_source: dict | None, interrupted: bool
    ) -> dict:
        members = {
            m: Member(starts=p.starts, failures=p.kills, stops=p.stops)
            for m, p in self._learner_ids().items()
        }
        return write_summary(
            self.cfg,
            self.out,
            status=self._status,
            reports=self._reports,
            members=members,
            processes_ok=all(p.state == "finished" for p in self._learners()),
            interrupted=interrupted,
            final_params=final_params,
            final_source=final_source,
            evals=self.evals,
            wall0=self.wall0,
            t_learners=self.t_learners,
            t_end=self.t_end,
            wall_s=self._now(),
            chaos=self.chaos.to_dict(),
            extra={"launcher": "local"},
        )
