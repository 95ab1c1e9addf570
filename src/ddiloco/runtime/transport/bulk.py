"""The bulk transport: fragment pushes and fetches over a plain TCP (or TLS) connection.

gRPC carries the control plane (Join, Watch, Heartbeat, Leave, Status). Python gRPC copies
every message several times and runs each call through its thread pool, which caps a
syncer at a few percent of what a socket moves (``bench/perf_syncer.py``), so the syncer
also listens on a *data port*, advertised in the Join reply (``bulk_port``), speaking this
minimal protocol:

  message      12-byte prefix ``>IQ`` (header length, payload length), a UTF-8 JSON header,
               then the payload (codec output, never pickled). Payloads are read straight
               into one preallocated buffer and sent from memory views (no joins).
  connection   the client's first message is ``{"op": "hello", "token": ...}`` (at most
               ``BulkLimits.hello_max_bytes``, within ``handshake_timeout_s``); the server
               answers ``{"ok": true}`` or an ``E_AUTH`` error and closes.
  push         ``{"op": "push", <the Push header>}`` + payload  ->  ``{"status": ...}``
  fetch        ``{"op": "fetch", "fragments": [...]}``  ->  ``{"items": [{"fragment",
               "version", "codec", "numels", "nbytes"}, ...]}`` + the payloads, concatenated
  error        ``{"error": "E_SHAPE: ...", "grpc": "INVALID_ARGUMENT"}``; after an error the
               server closes the connection if the request's payload was not consumed.

Limits are checked before anything is allocated: a hello over ``hello_max_bytes``, a header
over ``MAX_HEADER_BYTES``, or a payload over the server's limit, closes the connection. No
thread waits on a handshake or an idle connection (a selector does); connections are
bounded in total and per peer address (``BulkLimits``). Client errors are ``BulkError``, a
``grpc.RpcError`` with ``code()`` / ``details()``, so callers handle both transports alike
(connection failures are ``UNAVAILABLE``: retryable).
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.auth import check_token
from ddiloco.runtime.transport.schema import Hello, SchemaError, loads, parse

__all__ = [
    "BulkClient",
    "BulkError",
    "BulkLimits",
    "BulkServer",
    "BulkReject",
    "empty_buffer",
    "split_host",
]

log = logging.getLogger("ddiloco.bulk")

_PREFIX = struct.Struct(">IQ")
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_IOV_MAX = 512
SOCK_BUF = 8 << 20
"""Kernel socket buffer asked for on both ends (multi-megabyte fragments in few syscalls)."""


class BulkError(grpc.RpcError):
    """A bulk request that failed; ``code()`` and ``details()`` as a gRPC error's."""

    def __init__(self, code: grpc.StatusCode, details: str, connect_failed: bool = False) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details
        self.connect_failed = connect_failed
        """The connection could not be opened (as opposed to failing mid-request)."""

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class BulkReject(Exception):
    """Raised by a server handler: sent to the client as an error reply."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def split_host(address: str) -> str:
    """The host part of ``host:port`` (``[v6]:port`` too)."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]") or "127.0.0.1"


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass


def _set_deadline(sock: socket.socket, timeout_s: float) -> None:
    """Bound every send and receive on ``sock`` by ``timeout_s``. A plain socket stays in
    blocking mode with kernel timeouts (SO_RCVTIMEO / SO_SNDTIMEO), so that whole payloads
    move in single calls (``_recv_exact``); a timeout then surfaces as ``BlockingIOError``.
    TLS sockets use Python's own timeout."""
    if isinstance(sock, ssl.SSLSocket) or not hasattr(socket, "SO_RCVTIMEO"):
        sock.settimeout(timeout_s)
        return
    sock.settimeout(None)
    sec = max(0.001, float(timeout_s))
    tv = struct.pack("ll", int(sec), int((sec - int(sec)) * 1e6))
    for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, opt, tv)


def empty_buffer(n: int) -> memoryview:
    """A writable buffer of ``n`` bytes, not zero-filled (``bytearray(n)`` writes every byte
    once more before the socket does)."""
    return memoryview(np.empty(n, dtype=np.uint8))


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; with a ``deadline`` (monotonic seconds) a sender that
    trickles bytes is cut off there (``TimeoutError``)."""
    n, total = 0, len(view)
    # MSG_WAITALL on a blocking socket: the kernel fills the whole view in one call (one
    # GIL release and one wake-up, not one per socket-buffer's worth); TLS takes no flags
    flags = 0 if isinstance(sock, ssl.SSLSocket) or sock.gettimeout() is not None else _WAITALL
    while n < total:
        k = sock.recv_into(view[n:], 0, flags)
        if k == 0:
            raise ConnectionError("connection closed mid-message")
        n += k
        if deadline is not None and n < total and time.monotonic() > deadline:
            raise TimeoutError("message not received within its deadline")


def _send(sock: socket.socket, header: dict, payload: Sequence[bytes | memoryview] = ()) -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    size = sum(len(b) for b in payload)
    head = _PREFIX.pack(len(h), size) + h
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        sock.sendall(head)
        for b in payload:
            if len(b):
                sock.sendall(b)
        return
    # one gathering call for the header and every piece (no joins, one wake-up of the peer)
    views = [memoryview(head)] + [memoryview(b).cast("B") for b in payload if len(b)]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def _recv_header(sock: socket.socket, deadline: float | None = None) -> tuple[dict, int]:
    pre = bytearray(_PREFIX.size)
    _recv_exact(sock, memoryview(pre), deadline)
    hlen, plen = _PREFIX.unpack(pre)
    if hlen > wire.MAX_HEADER_BYTES:
        raise ValueError(f"header of {hlen} bytes exceeds {wire.MAX_HEADER_BYTES}")
    raw = bytearray(hlen)
    _recv_exact(sock, memoryview(raw), deadline)
    header = loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header must be a JSON object")
    return header, plen


Handler = Callable[[str, dict, int, Callable[[], memoryview]], tuple[dict, Sequence[bytes]]]
"""``handler(op, header, payload_len, read_payload) -> (reply header, reply payload
pieces)``; it calls ``read_payload()`` once it has validated the header (and the payload
length); raises ``BulkReject``."""


@dataclass(kw_only=True, slots=True, frozen=True)
class BulkLimits:
    """What the data port grants a connection, before and after authentication."""

    hello_max_bytes: int = 4096
    """Largest first message (the hello with the token) read before authentication."""
    handshake_timeout_s: float = 5.0
    """Time a new connection has to complete TLS and send a valid hello."""
    max_connections: int = 256
    """Open connections in total; more are closed at once."""
    max_connections_per_peer: int = 32
    """Open connections from one IP address; more are closed at once."""
    workers: int = 16
    """Threads serving requests; idle connections hold none (they wait in a selector)."""
    request_timeout_s: float = 120.0
    """Time an authenticated client has to send one whole request (header and payload)."""

    def __post_init__(self) -> None:
        for name in ("hello_max_bytes", "max_connections", "max_connections_per_peer", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("handshake_timeout_s", "request_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds")


class _Pending:
    """A connection in its handshake: TLS (if any), then the hello, read without blocking."""

    __slots__ = ("sock", "peer", "deadline", "buf", "tls_done")

    def __init__(self, sock: socket.socket, peer: str, deadline: float, tls: bool) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.buf = bytearray()
        self.tls_done = not tls


class BulkServer:
    """Serves the data port. One selector thread accepts connections, runs every handshake
    without blocking (under a deadline and a small hello limit) and watches idle
    authenticated connections; a bounded pool of ``limits.workers`` threads serves the
    requests. Connections are bounded in total and per peer address."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        handler: Handler,
        *,
        max_payload: int,
        ssl_context: ssl.SSLContext | None = None,
        on_auth_failure: Callable[[str], None] | None = None,
        on_refused: Callable[[str, str, str], None] | None = None,
        limits: BulkLimits | None = None,
    ) -> None:
        self.token, self.handler, self.max_payload = token, handler, max_payload
        self.ssl_context = ssl_context
        self.on_auth_failure = on_auth_failure
        self.on_refused = on_refused
        """Called with (peer, code, reason) when a connection is dropped before
        authentication (``E_BUSY``: a connection limit; ``E_HANDSHAKE``: no valid hello in
        time, or one too large)."""
        self.limits = limits or BulkLimits()
        self._sock = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128
        )
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._pending: dict[socket.socket, _Pending] = {}
        self._peer_of: dict[socket.socket, str] = {}
        self._per_peer: Counter[str] = Counter()
        self._ready: list[socket.socket] = []  # served: back to the selector
        self._lock = threading.Lock()
        self._closed = False
        self._pool = ThreadPoolExecutor(
            max_workers=self.limits.workers, thread_name_prefix="bulk-worker"
        )
        self._thread = threading.Thread(target=self._loop, name="bulk-loop", daemon=True)

    @property
    def connections(self) -> int:
        """Open connections (handshaking, idle or being served)."""
        with self._lock:
            return len(self._peer_of)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._peer_of)
        self._wake()
        self._thread.join(timeout=2.0)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()
        for s in (self._sock, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()
        with contextlib.suppress(OSError, ValueError):
            self._sel.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- the selector thread ----------------------------------------------------------------
    def _loop(self) -> None:
        self._sel.register(self._sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        while True:
            with self._lock:
                if self._closed:
                    return
                ready, self._ready = self._ready, []
            for conn in ready:
                self._watch_idle(conn)
            for key, _ev in self._sel.select(timeout=0.25):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                elif key.data == "idle":
                    self._sel.unregister(key.fileobj)
                    self._dispatch(key.fileobj)
                else:
                    self._handshake(key.data)
            now = time.monotonic()
            for pend in [p for p in self._pending.values() if p.deadline <= now]:
                self._refuse(pend, f"no valid hello within {self.limits.handshake_timeout_s} s")

    def _accept(self) -> None:
        for _ in range(64):
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            peer = str(addr[0])
            lim = self.limits
            with self._lock:
                full = len(self._peer_of) >= lim.max_connections
                busy = self._per_peer[peer] >= lim.max_connections_per_peer
                if not (full or busy):
                    self._peer_of[conn] = peer
                    self._per_peer[peer] += 1
            if full or busy:
                with contextlib.suppress(OSError):
                    conn.close()
                self._note_refused(
                    peer,
                    wire.ErrorCode.BUSY,
                    f"connection limit ({lim.max_connections} in total)"
                    if full
                    else f"connection limit ({lim.max_connections_per_peer} per peer)",
                )
                continue
            conn.setblocking(False)
            _tune(conn)
            tls = self.ssl_context is not None
            if tls:
                try:
                    conn = self._swap(
                        conn,
                        self.ssl_context.wrap_socket(
                            conn, server_side=True, do_handshake_on_connect=False
                        ),
                    )
                except (OSError, ValueError) as e:
                    self._drop(conn)
                    self._note_refused(peer, wire.ErrorCode.HANDSHAKE, f"TLS setup failed: {e}")
                    continue
            pend = _Pending(conn, peer, time.monotonic() + lim.handshake_timeout_s, tls)
            self._pending[conn] = pend
            self._sel.register(conn, selectors.EVENT_READ, pend)

    def _swap(self, old: socket.socket, new: socket.socket) -> socket.socket:
        with self._lock:
            self._peer_of[new] = self._peer_of.pop(old)
        return new

    def _handshake(self, pend: _Pending) -> None:
        conn = pend.sock
        try:
            if not pend.tls_done:
                try:
                    conn.do_handshake()
                except ssl.SSLWantReadError:
                    return
                except ssl.SSLWantWriteError:
                    self._sel.modify(conn, selectors.EVENT_READ | selectors.EVENT_WRITE, pend)
                    return
                pend.tls_done = True
                self._sel.modify(conn, selectors.EVENT_READ, pend)
            want = _PREFIX.size
            if len(pend.buf) >= _PREFIX.size:
                want += _PREFIX.unpack_from(pend.buf)[0]
            while len(pend.buf) < want:
                try:
                    chunk = conn.recv(want - len(pend.buf))
                except (BlockingIOError, ssl.SSLWantReadError):
                    return
                if not chunk:
                    self._refuse(pend, "closed during the handshake", reply=False)
                    return
                pend.buf += chunk
                if len(pend.buf) == _PREFIX.size:
                    hlen, plen = _PREFIX.unpack_from(pend.buf)
                    if hlen > self.limits.hello_max_bytes or plen:
                        self._refuse(
                            pend,
                            f"hello of {hlen} bytes (+{plen}) exceeds "
                            f"{self.limits.hello_max_bytes}",
                            reply=False,
                        )
                        return
                    want += hlen
        except (OSError, ValueError) as e:
            self._refuse(pend, f"handshake failed: {type(e).__name__}: {e}", reply=False)
            return
        try:
            raw = loads(pend.buf[_PREFIX.size :])
        except SchemaError as e:  # not JSON (or too deep): closed without a reply
            self._refuse(pend, str(e), reply=False)
            return
        try:
            hello = parse(Hello, raw, "hello")
        except SchemaError:
            hello = None
        if hello is None or not check_token(self.token, hello.token):
            if self.on_auth_failure:
                self.on_auth_failure(pend.peer)
            self._refuse(pend, "bad hello", reply=True, counted=False)
            return
        del self._pending[conn]
        self._sel.unregister(conn)
        try:
            conn.setblocking(True)
            _set_deadline(conn, self.limits.request_timeout_s)
            _send(conn, {"ok": True})
        except OSError:
            self._drop(conn)
            return
        self._watch_idle(conn)

    def _refuse(
        self, pend: _Pending, reason: str, reply: bool = False, counted: bool = True
    ) -> None:
        conn = pend.sock
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn)
        if reply:
            with contextlib.suppress(OSError, ValueError):
                conn.setblocking(True)
                conn.settimeout(1.0)
                _send(
                    conn,
                    {
                        "error": f"{wire.ErrorCode.AUTH}: missing or wrong token (set "
                        f"$DDILOCO_TOKEN or --token-file to the syncer's secret)",
                        "grpc": "UNAUTHENTICATED",
                    },
                )
        if counted:
            self._note_refused(pend.peer, wire.ErrorCode.HANDSHAKE, reason)
        self._drop(conn)

    def _note_refused(self, peer: str, code: str, reason: str) -> None:
        log.debug("data connection from %s dropped: %s: %s", peer, code, reason)
        if self.on_refused:
            self.on_refused(peer, code, reason)

    def _watch_idle(self, conn: socket.socket) -> None:
        """An authenticated connection between requests: no thread, the selector waits."""
        if isinstance(conn, ssl.SSLSocket) and conn.pending():
            self._dispatch(conn)  # bytes already decrypted: the selector would not see them
            return
        try:
            self._sel.register(conn, selectors.EVENT_READ, "idle")
        except (OSError, ValueError, KeyError):
            self._drop(conn)

    def _dispatch(self, conn: socket.socket) -> None:
        try:
            self._pool.submit(self._serve_one, conn)
        except RuntimeError:  # shut down
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            peer = self._peer_of.pop(conn, None)
            if peer is not None:
                self._per_peer[peer] -= 1
                if self._per_peer[peer] <= 0:
                    del self._per_peer[peer]
        with contextlib.suppress(OSError):
            conn.close()

    # -- the workers ------------------------------------------------------------------------
    def _serve_one(self, conn: socket.socket) -> None:
        keep = False
        try:
            keep = self._request(conn)
        except (OSError, ValueError, ConnectionError) as e:
            log.debug("bulk connection closed: %s", e)
        except Exception:  # noqa: BLE001 - a handler bug ends this connection, not the port
            log.exception("bulk request failed")
        if keep:
            with self._lock:
                if not self._closed:
                    self._ready.append(conn)
                    keep = True
                else:
                    keep = False
        if keep:
            self._wake()
        else:
            self._drop(conn)

    def _request(self, conn: socket.socket) -> bool:
        """Serve one request; False ends the connection."""
        deadline = time.monotonic() + self.limits.request_timeout_s
        try:
            h, plen = _recv_header(conn, deadline)
        except ConnectionError:
            return False
        if plen > self.max_payload:
            _send(
                conn,
                {
                    "error": f"{wire.ErrorCode.OVERSIZE}: payload of {plen} bytes exceeds "
                    f"the limit of {self.max_payload}",
                    "grpc": "RESOURCE_EXHAUSTED",
                },
            )
            _linger(conn)
            return False
        consumed = plen == 0

        def read_payload() -> memoryview:
            nonlocal consumed
            buf = empty_buffer(plen)
            _recv_exact(conn, buf, deadline)
            consumed = True
            return buf

        try:
            reply, pieces = self.handler(str(h.get("op")), h, plen, read_payload)
        except BulkReject as r:
            _send(conn, {"error": r.message, "grpc": r.status.name})
            if not consumed:
                _linger(conn)
            return consumed
        _send(conn, reply, pieces)
        return True


def _linger(conn: socket.socket, timeout_s: float = 2.0) -> None:
    """Before closing a connection whose request was not read: stop sending and discard
    what arrives until the client closes (closing with unread bytes would reset the
    connection, and the client could lose the error reply sent just before)."""
    try:
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(timeout_s)
        scratch = bytearray(1 << 16)
        while conn.recv_into(scratch):
            pass
    except OSError:
        pass


class BulkClient:
    """One authenticated connection to a syncer's data port, one request at a time
    (a lock serialises callers). Reconnects on the next request after any failure."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.host, self.port, self.token = host, port, token
        self.ssl_context = ssl_context
        self.connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._timeout_s: float | None = None  # the timeouts set on _sock
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
            self._timeout_s = None  # a new connection gets its timeouts set again

    def _connect(self) -> socket.socket:
        s = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        try:
            _tune(s)
            if self.ssl_context is not None:
                s = self.ssl_context.wrap_socket(s, server_hostname=self.host)
            _send(s, {"op": "hello", "token": self.token})
            h, plen = _recv_header(s)
            if "error" in h or plen:
                raise self._error(h)
        except BaseException:
            s.close()
            raise
        return s

    @staticmethod
    def _error(h: dict) -> BulkError:
        code = getattr(grpc.StatusCode, str(h.get("grpc")), grpc.StatusCode.UNKNOWN)
        return BulkError(code, str(h.get("error", "malformed error reply")))

    def request(
        self, header: dict, payload: Sequence[bytes | memoryview] = (), timeout_s: float = 60.0
    ) -> tuple[dict, memoryview]:
        """Send one request; returns (reply header, reply payload)."""
        with self._lock:
            if self._sock is None:
                try:
                    self._sock = self._connect()
                except (OSError, ValueError, ConnectionError) as e:
                    raise BulkError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"cannot connect to {self.host}:{self.port}: {type(e).__name__}: {e}",
                        connect_failed=True,
                    ) from None
            try:
                if timeout_s != self._timeout_s:  # a few syscalls: only when it changes
                    _set_deadline(self._sock, timeout_s)
                    self._timeout_s = timeout_s
                _send(self._sock, header, payload)
                h, plen = _recv_header(self._sock)
                buf = empty_buffer(plen)
                _recv_exact(self._sock, buf)
            except (OSError, ValueError, ConnectionError) as e:
                self._drop()
                code = (
                    grpc.StatusCode.DEADLINE_EXCEEDED
                    if isinstance(e, (TimeoutError, BlockingIOError))
                    else grpc.StatusCode.UNAVAILABLE
                )
                raise BulkError(
                    code, f"bulk connection to {self.host}:{self.port}: {type(e).__name__}: {e}"
                ) from None
            if "error" in h:
                self._drop()  # the server may have closed it (unread payload)
                raise self._error(h)
            return h, buf
