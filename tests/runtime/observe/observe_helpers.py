"""Helpers for the observability tests: a launcher run in the background with the syncer's
HTTP port open, and small HTTP calls."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from runtime_helpers import tiny_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(
    url: str,
    token: str | None = None,
    headers: dict | None = None,
    timeout_s: float = 5.0,
    context=None,
) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a GET, without following redirects (``context``: the
    ``ssl.SSLContext`` of an https URL)."""
    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None

    opener = urllib.request.build_opener(NoRedirect, urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(urllib.request.Request(url, headers=h), timeout=timeout_s) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_for(pred, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class BackgroundRun:
    """``Launcher(...).run()`` in a thread: real syncer and learner processes, the syncer's
    observability port on ``http_port``. ``token`` is the run's secret."""

    def __init__(
        self, out: Path, *, learners: int, steps: int, chaos: dict | None = None, **cfg
    ) -> None:
        from ddiloco.runtime.launch.launcher import Launcher

        self.out = out
        chaos_arg = "none"
        if chaos:
            out.mkdir(parents=True, exist_ok=True)
            (out.parent / "chaos.json").write_text(json.dumps(chaos))
            chaos_arg = str(out.parent / "chaos.json")
        self.launcher = Launcher(
            tiny_config(out, learners=learners, steps=steps, chaos=chaos_arg, http_port=0, **cfg)
        )
        self.token = self.launcher.env["DDILOCO_TOKEN"]
        self.http_port = self.launcher.http_port
        assert self.launcher.dashboard_url.endswith(f":{self.http_port}/?token={self.token}")
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.summary = self.launcher.run()
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e

    def __enter__(self) -> BackgroundRun:
        self._thread.start()
        return self

    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float = 120.0) -> dict:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the run did not finish"
        if self.error is not None:
            raise self.error
        return self.summary

    def __exit__(self, *exc) -> None:
        self.launcher.close()
        self._thread.join(30.0)


class DashboardProcess:
    """``ddiloco dashboard TARGET --port 0`` as a process; ``url`` is the page to open
    (with ``?token=`` when the command made the token itself)."""

    def __init__(self, target: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", "dashboard", target, "--port", "0"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = self.proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+/)(\?token=\w+)?", line)
        assert m, f"unexpected first line from ddiloco dashboard: {line!r}"
        self.base, self.query = m.group(1), m.group(2) or ""
        self.token = self.query[len("?token=") :] if self.query else None

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> DashboardProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
