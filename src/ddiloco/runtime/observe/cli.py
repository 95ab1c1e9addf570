"""``ddiloco dashboard RUN_DIR_OR_HOST:PORT``: the live dashboard outside the syncer.

- a run directory: the dashboard follows its files as the launcher writes them (and shows a
  finished run from the same files);
- ``HOST:PORT`` of a syncer: the dashboard asks the syncer for its status over gRPC every
  second (with the shared secret) and also serves its Prometheus ``/metrics``.

The page is behind a token: the run's secret (``$DDILOCO_TOKEN`` / ``--token-file``); for
a run directory without one, a fresh token is made and printed in the URL to open.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

__all__ = ["add_dashboard_parser", "open_dashboard", "cmd_dashboard"]


def add_dashboard_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "dashboard",
        help="live web dashboard of a run directory or a syncer",
        description="Serve the live dashboard (learners, fragment versions, merges, "
        "participation, goodput, loss, chaos events) of a run directory or of a syncer "
        "at HOST:PORT. The page needs the shared secret ($DDILOCO_TOKEN or --token-file).",
    )
    p.add_argument("target", metavar="RUN_DIR_OR_HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8050, help="HTTP port (0: a free one)")
    p.add_argument("--token-file", help="file holding the shared secret (else $DDILOCO_TOKEN)")
    p.add_argument("--tls-ca", help="CA certificate (PEM) to talk TLS to the syncer")
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between status samples of a syncer"
    )
    p.set_defaults(func=cmd_dashboard)
    return p


def open_dashboard(
    target: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8050,
    token: str,
    tls_ca: str | None = None,
    interval_s: float = 1.0,
):
    """Build (not start) the ``ObserveServer`` for ``target`` and whatever feeds it.
    Returns ``(server, closers)``."""
    from ddiloco.runtime.observe.history import RunDirReader, StatusHistory
    from ddiloco.runtime.observe.web import ObserveServer

    if Path(target).is_dir():
        reader = RunDirReader(target)
        return ObserveServer(host=host, port=port, token=token, view_fn=reader.view), []
    if not _is_address(target):
        raise ValueError(f"{target!r} is neither a run directory nor HOST:PORT of a syncer")
    from ddiloco.runtime.learner.client import SyncerClient

    client = SyncerClient(target, token, tls_ca)

    def status() -> dict:
        return client.status(timeout_s=2.0)

    history = StatusHistory(status, f"syncer {target}", interval_s)

    def ready() -> tuple[bool, str]:
        try:
            st = status()
        except Exception as e:  # noqa: BLE001 - any failure means not ready
            return False, f"syncer {target} unreachable: {str(e).splitlines()[0][:200]}"
        if not st.get("initialised"):
            return False, "no model yet (waiting for the first learner's Init)"
        return True, f"syncer {target} holds a global model"

    server = ObserveServer(
        host=host, port=port, token=token, view_fn=history.view, status_fn=status, ready_fn=ready
    )
    history.start()
    return server, [history.close, client.close]


def _is_address(target: str) -> bool:
    host, sep, port = target.rpartition(":")
    return bool(sep and host and port.isdigit())


def cmd_dashboard(args) -> int:
    from ddiloco.runtime.transport.auth import load_token, new_token

    is_dir = Path(args.target).is_dir()
    if not is_dir and not _is_address(args.target):
        print(
            f"ddiloco dashboard: {args.target!r} is neither a run directory nor HOST:PORT of "
            f"a syncer",
            file=sys.stderr,
        )
        return 2
    generated = False
    try:
        token = load_token(args.token_file)
    except ValueError as e:
        if not is_dir or args.token_file:
            print(f"ddiloco dashboard: {e}", file=sys.stderr)
            return 2
        token, generated = new_token(), True
    try:
        server, closers = open_dashboard(
            args.target,
            host=args.host,
            port=args.port,
            token=token,
            tls_ca=args.tls_ca,
            interval_s=args.interval,
        )
    except (ValueError, OSError) as e:
        print(f"ddiloco dashboard: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    hint = f"?token={token}" if generated else "?token=$DDILOCO_TOKEN (once; a cookie follows)"
    print(f"ddiloco dashboard of {args.target} on {server.url}{hint}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
        for close in closers:
            close()
    return 0
