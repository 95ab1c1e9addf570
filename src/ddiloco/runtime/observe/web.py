"""The observability HTTP port: Prometheus ``/metrics``, ``/healthz``, ``/readyz`` and the
live dashboard (``/`` and its JSON document ``/api/state``).

Authentication: the dashboard, ``/api/state`` and ``/metrics`` need the run's shared secret,
given as ``Authorization: Bearer TOKEN`` (what Prometheus sends with ``authorization:
credentials_file``), or once as ``/?token=TOKEN``: the answer sets an HttpOnly, SameSite=Lax
session cookie (a keyed hash of the token, never the token itself) and redirects to ``/`` so
the secret leaves the address bar. Every comparison is constant-time. ``/healthz`` and
``/readyz`` answer without the token: orchestrators' probes carry no secrets, and the two
answers reveal only whether the process is up and holds a model.

With a TLS certificate the port speaks HTTPS (the syncer's certificate); the cookie is then
marked ``Secure``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import ssl
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

from ddiloco.runtime.transport.auth import check_token

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["ObserveServer", "COOKIE", "session_cookie_value", "dashboard_html"]

log = logging.getLogger("ddiloco.observe")

COOKIE = "ddiloco_session"


def session_cookie_value(token: str) -> str:
    """The dashboard's session cookie: HMAC-SHA256 of a fixed label under the token."""
    return hmac.new(token.encode(), b"ddiloco-dashboard-session", hashlib.sha256).hexdigest()


def dashboard_html() -> bytes:
    return resources.files("ddiloco.runtime.observe").joinpath("dashboard.html").read_bytes()


_UNAUTHORIZED = (
    b"<!doctype html><title>ddiloco: token needed</title><p>This page needs the "
    b"run's shared secret: open <code>/?token=TOKEN</code> once (a session cookie "
    b"is set), or send <code>Authorization: Bearer TOKEN</code>.</p>"
)


class ObserveServer:
    """A threaded HTTP server on ``host:port`` (0: a free port, read ``.port`` after
    ``start()``).

    ``view_fn`` returns the dashboard's JSON document; ``status_fn`` a syncer status snapshot
    for ``/metrics`` (None: no ``/metrics``, e.g. for a run directory); ``ready_fn`` returns
    ``(ready, reason)`` for ``/readyz`` (None: always ready)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        token: str,
        view_fn: Callable[[], dict],
        status_fn: Callable[[], dict] | None = None,
        ready_fn: Callable[[], tuple[bool, str]] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not token:
            raise ValueError("the observability port needs a shared-secret token")
        if not 0 <= port <= 65535:
            raise ValueError(f"HTTP port must be in [0, 65535] (0: any free port), got {port}")
        self.token, self.view_fn, self.ready_fn = token, view_fn, ready_fn
        self._cookie = session_cookie_value(token)
        self._registry: CollectorRegistry | None = None
        if status_fn is not None:
            from ddiloco.runtime.observe.prom import syncer_registry

            self._registry = syncer_registry(status_fn)
        self.tls = ssl_context is not None
        self._httpd = _HTTPServer((host, port), self._handler_class())
        if ssl_context is not None:
            self._httpd.socket = ssl_context.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/"

    def start(self) -> int:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="observe-http",
            daemon=True,
        )
        self._thread.start()
        return self.port

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5.0)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> ObserveServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------
    def _authorised(self, h: BaseHTTPRequestHandler) -> bool:
        auth = h.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer " and check_token(self.token, auth[7:].strip()):
            return True
        jar = SimpleCookie()
        try:
            jar.load(h.headers.get("Cookie", ""))
        except Exception:  # noqa: BLE001 - a malformed cookie header is no session
            return False
        return COOKIE in jar and check_token(self._cookie, jar[COOKIE].value)

    def _handle(self, h: BaseHTTPRequestHandler, head_only: bool) -> None:
        url = urlsplit(h.path)
        path = url.path
        if path == "/healthz":
            return _send(h, HTTPStatus.OK, b"ok\n", "text/plain", head_only)
        if path == "/readyz":
            ready, reason = self.ready_fn() if self.ready_fn else (True, "ready")
            return _send(
                h,
                HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                f"{'ready' if ready else 'not ready'}: {reason}\n".encode(),
                "text/plain",
                head_only,
            )
        query = parse_qs(url.query)
        if path in ("/", "/index.html") and "token" in query:
            if not check_token(self.token, query["token"][0]):
                log.warning("dashboard: wrong token from %s", h.client_address[0])
                return _send(h, HTTPStatus.UNAUTHORIZED, _UNAUTHORIZED, "text/html", head_only)
            h.send_response(HTTPStatus.SEE_OTHER)
            h.send_header("Location", "/")
            h.send_header(
                "Set-Cookie",
                f"{COOKIE}={self._cookie}; Path=/; HttpOnly; "
                f"SameSite=Lax{'; Secure' if self.tls else ''}",
            )
            h.send_header("Content-Length", "0")
            h.end_headers()
            return None
        if path not in ("/", "/index.html", "/api/state", "/metrics"):
            return _send(h, HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", head_only)
        if not self._authorised(h):
            return _send(
                h,
                HTTPStatus.UNAUTHORIZED,
                _UNAUTHORIZED,
                "text/html",
                head_only,
                {"WWW-Authenticate": 'Bearer realm="ddiloco"'},
            )
        if path == "/metrics":
            if self._registry is None:
                return _send(
                    h,
                    HTTPStatus.NOT_FOUND,
                    b"no syncer to take metrics from (a run directory is shown from its files)\n",
                    "text/plain",
                    head_only,
                )
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return _send(
                h, HTTPStatus.OK, generate_latest(self._registry), CONTENT_TYPE_LATEST, head_only
            )
        if path == "/api/state":
            return _send(
                h, HTTPStatus.OK, json.dumps(self.view_fn()).encode(), "application/json", head_only
            )
        return _send(h, HTTPStatus.OK, dashboard_html(), "text/html; charset=utf-8", head_only)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "ddiloco"
            sys_version = ""
            timeout = 30.0  # a client that sends nothing for this long is dropped

            def do_GET(self) -> None:  # noqa: N802 - the http.server protocol
                self._run(False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._run(True)

            def _run(self, head_only: bool) -> None:
                try:
                    server._handle(self, head_only)
                except (ConnectionError, ssl.SSLError):
                    pass  # the client went away
                except Exception:  # noqa: BLE001 - one bad request must not stop the port
                    log.exception("observability request %s failed", self.path)
                    try:
                        _send(
                            self,
                            HTTPStatus.INTERNAL_SERVER_ERROR,
                            b"internal error\n",
                            "text/plain",
                            head_only,
                        )
                    except (ConnectionError, ssl.SSLError):
                        pass

            def log_message(self, fmt: str, *args) -> None:
                log.debug("%s " + fmt, self.address_string(), *args)

        return Handler


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # a client that broke off, or spoke plain HTTP to the TLS port: not worth a traceback
        log.debug("observability connection from %s failed", client_address, exc_info=True)


def _send(
    h: BaseHTTPRequestHandler,
    code: HTTPStatus,
    body: bytes,
    ctype: str,
    head_only: bool,
    headers: dict[str, str] | None = None,
) -> None:
    h.send_response(code)
    h.send_header("Content-Type", ctype)
    h.send_header("Content-Length", str(len(body)))
    h.send_header("Cache-Control", "no-store")
    h.send_header("X-Content-Type-Options", "nosniff")
    h.send_header(
        "Content-Security-Policy",
        "default-src 'self'; script-src 'unsafe-inline'; "
        "style-src 'unsafe-inline'; img-src 'self' data:",
    )
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    if not head_only:
        h.wfile.write(body)
