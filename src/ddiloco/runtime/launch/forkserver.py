"""A warm fork server for learner processes: restarts in milliseconds, not seconds.

Starting a learner from scratch imports torch and builds the model: 2-3 s of CPU, and 10-20 s
of wall time on a small machine whose cores are busy with the other learners. Under chaos
that start-up is lost work after every kill. The launcher therefore starts one *fork
server*: a process that imports torch and the ddiloco modules once and then forks a learner
per request. A forked learner is an ordinary process in its own session (process group):
SIGKILL, SIGSTOP and SIGCONT reach it exactly as before.

The server is single-threaded (forking a multi-threaded process is unsafe) and never runs a
torch operation or imports gRPC itself: each child imports what it needs after the fork.
Protocol: one JSON object per line on stdin (requests) and stdout (replies and exits):

    -> {"op": "spawn", "id": 3, "module": "ddiloco.runtime.cli", "argv": ["learner", ...],
        "log": "/path/learner_0.log"}
    <- {"spawned": 3, "pid": 12345}
    <- {"exit": 12345, "rc": -9}        (whenever a child ends; rc as ``Popen.returncode``)

A child runs ``MODULE.main(argv)``, the forked equivalent of ``python -m MODULE *argv``: the
server knows its commands by name only (it imports no entry point).

``ForkServer`` is the launcher's client; ``ForkServer.spawn`` returns a ``ForkedProcess``
with the ``Popen`` methods the launcher uses (``pid``, ``poll``, ``wait``, ``returncode``).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

__all__ = ["ForkServer", "ForkedProcess", "PRELOAD"]

PRELOAD = (
    "torch",
    "torch._dynamo",
    "numpy",
    "ddiloco.config",
    "ddiloco.models",
    "ddiloco.data",
    "ddiloco.recipe",
    "ddiloco.algorithm.learner_state",
    "ddiloco.algorithm.codecs",
    "ddiloco.runtime.transport.spec",
)
"""Modules imported once by the server (none of them starts a thread or imports gRPC).
``torch._dynamo`` is what the first ``torch.optim`` optimizer imports (about 800 modules,
2 s of CPU): without it here every learner would pay for it again."""


# -- the server process ------------------------------------------------------------------------
def _child(module: str, argv: list[str], log_path: str) -> None:
    """In the forked child: own session, output to the log, run ``module.main(argv)``, never
    return."""
    rc = 1
    try:
        os.setsid()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        import importlib

        rc = importlib.import_module(module).main(argv) or 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - report anything, then exit
        traceback.print_exc()
        rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _emit(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())  # unbuffered: nothing left for a child


def serve() -> int:
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    for name in PRELOAD:
        importlib.import_module(name)
    # Every object imported so far is shared copy-on-write with the children. A child's
    # full garbage collection would touch all of them (and copy every page: a pause of a
    # large fraction of a second): freeze them out of the collector's reach instead.
    gc.collect()
    gc.freeze()
    _emit({"ready": True, "pid": os.getpid()})
    children: set[int] = set()
    buf = b""
    stdin_open = True
    while stdin_open or children:
        if stdin_open:
            r, _, _ = select.select([0], [], [], 0.02)
        else:
            r = []
            time.sleep(0.02)
        if r:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                stdin_open = False  # the launcher is gone or done: finish when children are
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                req = json.loads(line)
                if req.get("op") != "spawn":
                    _emit({"error": f"unknown op {req.get('op')!r}"})
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(str(req["module"]), list(req["argv"]), req["log"])
                children.add(pid)
                _emit({"spawned": req["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _emit({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
    return 0


# -- the launcher's client ---------------------------------------------------------------------
class ForkedProcess:
    """A learner forked by the server, with the ``subprocess.Popen`` surface the launcher
    uses. Its exit status arrives through the server (it is the server's child)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._exits.get(self.pid)
            if self.returncode is None and not self._server.alive():
                self.returncode = self._server._exits.get(self.pid, -signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            with self._server._cv:
                self._server._cv.wait(0.02)
        return self.returncode


class ForkServer:
    """Starts ``python -m ddiloco.runtime.launch.forkserver`` and forks learners through it."""

    def __init__(
        self, env: dict, log_path: str, startup_timeout_s: float = 120.0, run_dir: str = ""
    ) -> None:
        self._log = open(log_path, "ab")
        # the run directory on the command line names the server and its children in ps
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddiloco.runtime.launch.forkserver", "--run-dir", run_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,
        )
        self._cv = threading.Condition()
        self._exits: dict[int, int] = {}
        self._spawned: dict[int, int] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        line = self._readline(startup_timeout_s)
        if not line or not json.loads(line).get("ready"):
            self.close()
            raise RuntimeError(f"the learner fork server did not start; see {log_path}")
        self._reader = threading.Thread(target=self._read, name="ddiloco-forkserver", daemon=True)
        self._reader.start()

    def _readline(self, timeout_s: float) -> bytes:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline() if r else b""

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cv:
                if "exit" in msg:
                    self._exits[msg["exit"]] = msg["rc"]
                elif "spawned" in msg:
                    self._spawned[msg["spawned"]] = msg["pid"]
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(
        self, module: str, argv: list[str], log_path: str, timeout_s: float = 30.0
    ) -> ForkedProcess:
        """Fork ``python -m module *argv`` (``module.main(argv)``) with output appended to
        ``log_path``."""
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            self.proc.stdin.write(
                (
                    json.dumps(
                        {
                            "op": "spawn",
                            "id": rid,
                            "module": module,
                            "argv": argv,
                            "log": str(log_path),
                        }
                    )
                    + "\n"
                ).encode()
            )
            self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while rid not in self._spawned:
                if not self.alive() or time.monotonic() > deadline:
                    raise RuntimeError("the learner fork server did not answer")
                self._cv.wait(0.05)
            return ForkedProcess(self, self._spawned.pop(rid))

    def close(self) -> None:
        """Stop the server (its children are the launcher's to stop, before this)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5.0)
        self._log.close()


if __name__ == "__main__":
    sys.exit(serve())  # argv (--run-dir DIR) only labels the process
