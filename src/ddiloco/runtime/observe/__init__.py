"""Observability of a run: goodput accounting, Prometheus metrics, health probes and a live
web dashboard.

``serve_syncer(status_fn, ready_fn, ...)`` opens a syncer's HTTP port (``ddiloco syncer
--http-port``): the syncer hands over its callables, so this package knows no syncer.
``ddiloco dashboard RUN_DIR_OR_HOST:PORT`` serves the same dashboard from a run directory or
from a syncer reached over gRPC (``ddiloco.runtime.observe.cli``).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

from ddiloco.runtime.observe.history import RunDirReader, StatusHistory
from ddiloco.runtime.observe.web import ObserveServer

__all__ = [
    "ObserveServer",
    "StatusHistory",
    "RunDirReader",
    "SyncerObserver",
    "serve_syncer",
]


class SyncerObserver:
    """The HTTP port of a running syncer: its history sampler and its server.

    ``status_fn()`` is the syncer's status snapshot; ``ready_fn()`` says whether it can
    serve (``/readyz``) and why; ``source`` names it on the dashboard."""

    def __init__(
        self,
        status_fn: Callable[[], dict],
        ready_fn: Callable[[], tuple[bool, str]],
        *,
        host: str,
        port: int,
        token: str,
        source: str,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.history = StatusHistory(status_fn, source)
        self.http = ObserveServer(
            host=host,
            port=port,
            token=token,
            view_fn=self.history.view,
            status_fn=status_fn,
            ready_fn=ready_fn,
            ssl_context=ssl_context,
        )
        self.port = self.http.port

    def start(self) -> int:
        self.history.start()
        return self.http.start()

    def close(self) -> None:
        self.http.close()
        self.history.close()


def serve_syncer(
    status_fn: Callable[[], dict],
    ready_fn: Callable[[], tuple[bool, str]],
    *,
    host: str,
    port: int,
    token: str,
    source: str,
    ssl_context: ssl.SSLContext | None = None,
) -> SyncerObserver:
    """Start a syncer's observability port on ``host`` (``port`` 0: a free one)."""
    obs = SyncerObserver(
        status_fn,
        ready_fn,
        host=host,
        port=port,
        token=token,
        source=source,
        ssl_context=ssl_context,
    )
    obs.start()
    return obs
