"""Observability of a run: Prometheus metrics, health probes and a live web dashboard.

``serve_syncer(server, port)`` opens the syncer's HTTP port (``ddiloco syncer --http-port``);
``ddiloco dashboard RUN_DIR_OR_HOST:PORT`` serves the same dashboard from a run directory or
from a syncer reached over gRPC (``ddiloco.runtime.observe.cli``).
"""

from __future__ import annotations

from typing import Any, Protocol

from ddiloco.runtime.observe.history import RunDirReader, StatusHistory
from ddiloco.runtime.observe.web import ObserveServer

__all__ = [
    "ObserveServer",
    "StatusHistory",
    "RunDirReader",
    "ObservedSyncer",
    "SyncerObserver",
    "serve_syncer",
]


class ObservedSyncer(Protocol):
    """What the HTTP port reads of a running syncer (``SyncerServer`` is one): the syncer
    opens its port here, so this module knows it by this surface only."""

    config: Any
    """``SyncerServerConfig``: host, token, tls_cert, tls_key."""
    port: int
    state: Any
    """The syncer state machine, None until the first learner's Init."""

    def status(self) -> dict: ...


class SyncerObserver:
    """The HTTP port of a running syncer: its history sampler and its server."""

    def __init__(self, server: ObservedSyncer, port: int) -> None:
        from ddiloco.runtime.transport.auth import server_ssl_context

        cfg = server.config
        self.history = StatusHistory(server.status, f"syncer {cfg.host}:{server.port}")
        ctx = (
            server_ssl_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
        )

        def ready() -> tuple[bool, str]:
            if getattr(server, "_closed", False):
                return False, "shutting down"
            if server.state is None:
                return False, "no model yet (waiting for the first learner's Init)"
            return True, "holds a global model"

        self.http = ObserveServer(
            host=cfg.host,
            port=port,
            token=cfg.token,
            view_fn=self.history.view,
            status_fn=server.status,
            ready_fn=ready,
            ssl_context=ctx,
        )
        self.port = self.http.port

    def start(self) -> int:
        self.history.start()
        return self.http.start()

    def close(self) -> None:
        self.http.close()
        self.history.close()


def serve_syncer(server: ObservedSyncer, port: int) -> SyncerObserver:
    """Start ``server``'s observability port on its host (0: a free port)."""
    obs = SyncerObserver(server, port)
    obs.start()
    return obs
