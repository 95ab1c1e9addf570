"""The bulk transport: fragment pushes and fetches over a plain TCP (or TLS) connection.

gRPC carries the control plane (Join, Watch, Heartbeat, Leave, Status). Python gRPC copies
every message several times and runs each call through its thread pool, which caps a
syncer at a few percent of what a socket moves (``bench/perf_syncer.py``), so the syncer
also listens on a *data port*, advertised in the Join reply (``bulk_port``), speaking this
minimal protocol:

  message      12-byte prefix ``>IQ`` (header length, payload length), a UTF-8 JSON header,
               then the payload (codec output, never pickled). Payloads are read straight
               into one preallocated buffer and sent from memory views (no joins).
  connection   the client's first message is ``{"op": "hello", "token": ...}``; the server
               answers ``{"ok": true}`` or an ``E_AUTH`` error and closes.
  push         ``{"op": "push", <the Push header>}`` + payload  ->  ``{"status": ...}``
  fetch        ``{"op": "fetch", "fragments": [...]}``  ->  ``{"items": [{"fragment",
               "version", "codec", "numels", "nbytes"}, ...]}`` + the payloads, concatenated
  error        ``{"error": "E_SHAPE: ...", "grpc": "INVALID_ARGUMENT"}``; after an error the
               server closes the connection if the request's payload was not consumed.

Limits are checked before anything is allocated: a header over ``MAX_HEADER_BYTES``, or a
payload over the server's limit, closes the connection. Client errors are ``BulkError``, a
``grpc.RpcError`` with ``code()`` / ``details()``, so callers handle both transports alike
(connection failures are ``UNAVAILABLE``: retryable).
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence

import grpc
import numpy as np

from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.auth import check_token
from ddiloco.runtime.transport.schema import Hello, SchemaError, loads, parse

__all__ = ["BulkClient", "BulkError", "BulkServer", "BulkReject", "empty_buffer", "split_host"]

log = logging.getLogger("ddiloco.bulk")

_PREFIX = struct.Struct(">IQ")
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_IOV_MAX = 512
SOCK_BUF = 8 << 20
"""Kernel socket buffer asked for on both ends (multi-megabyte fragments in few syscalls)."""


class BulkError(grpc.RpcError):
    """A bulk request that failed; ``code()`` and ``details()`` as a gRPC error's."""

    def __init__(self, code: grpc.StatusCode, details: str, connect_failed: bool = False
                 ) -> None:
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


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    n, total = 0, len(view)
    # MSG_WAITALL on a blocking socket: the kernel fills the whole view in one call (one
    # GIL release and one wake-up, not one per socket-buffer's worth); TLS takes no flags
    flags = 0 if isinstance(sock, ssl.SSLSocket) or sock.gettimeout() is not None \
        else _WAITALL
    while n < total:
        k = sock.recv_into(view[n:], 0, flags)
        if k == 0:
            raise ConnectionError("connection closed mid-message")
        n += k


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


def _recv_header(sock: socket.socket) -> tuple[dict, int]:
    pre = bytearray(_PREFIX.size)
    _recv_exact(sock, memoryview(pre))
    hlen, plen = _PREFIX.unpack(pre)
    if hlen > wire.MAX_HEADER_BYTES:
        raise ValueError(f"header of {hlen} bytes exceeds {wire.MAX_HEADER_BYTES}")
    raw = bytearray(hlen)
    _recv_exact(sock, memoryview(raw))
    header = loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header must be a JSON object")
    return header, plen


Handler = Callable[[str, dict, int, Callable[[], memoryview]], tuple[dict, Sequence[bytes]]]
"""``handler(op, header, payload_len, read_payload) -> (reply header, reply payload
pieces)``; it calls ``read_payload()`` once it has validated the header (and the payload
length); raises ``BulkReject``."""


class BulkServer:
    """Accepts bulk connections; one thread per connection (a syncer has few learners)."""

    def __init__(self, host: str, port: int, token: str, handler: Handler, *,
                 max_payload: int, ssl_context: ssl.SSLContext | None = None,
                 on_auth_failure: Callable[[str], None] | None = None) -> None:
        self.token, self.handler, self.max_payload = token, handler, max_payload
        self.ssl_context = ssl_context
        self.on_auth_failure = on_auth_failure
        self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host
                                          else socket.AF_INET, backlog=128)
        self.port = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="bulk-accept",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="bulk-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            _tune(conn)
            if self.ssl_context is not None:
                conn.settimeout(30.0)
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
                conn.settimeout(None)
            h, plen = _recv_header(conn)
            try:
                hello = parse(Hello, h, "hello") if not plen else None
            except SchemaError:
                hello = None
            if hello is None or not check_token(self.token, hello.token):
                if self.on_auth_failure:
                    self.on_auth_failure(str(peer))
                _send(conn, {"error": f"{wire.ErrorCode.AUTH}: missing or wrong token (set "
                                      f"$DDILOCO_TOKEN or --token-file to the syncer's secret)",
                             "grpc": "UNAUTHENTICATED"})
                return
            _send(conn, {"ok": True})
            while self._request(conn):
                pass
        except (OSError, ValueError, ConnectionError, ssl.SSLError) as e:
            log.debug("bulk connection from %s closed: %s", peer, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _request(self, conn: socket.socket) -> bool:
        """Serve one request; False ends the connection."""
        try:
            h, plen = _recv_header(conn)
        except ConnectionError:
            return False
        if plen > self.max_payload:
            _send(conn, {"error": f"{wire.ErrorCode.OVERSIZE}: payload of {plen} bytes exceeds "
                                  f"the limit of {self.max_payload}",
                         "grpc": "RESOURCE_EXHAUSTED"})
            _linger(conn)
            return False
        consumed = plen == 0

        def read_payload() -> memoryview:
            nonlocal consumed
            buf = empty_buffer(plen)
            _recv_exact(conn, buf)
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

    def __init__(self, host: str, port: int, token: str, *,
                 ssl_context: ssl.SSLContext | None = None, connect_timeout_s: float = 5.0
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

    def request(self, header: dict, payload: Sequence[bytes | memoryview] = (),
                timeout_s: float = 60.0) -> tuple[dict, memoryview]:
        """Send one request; returns (reply header, reply payload)."""
        with self._lock:
            if self._sock is None:
                try:
                    self._sock = self._connect()
                except (OSError, ValueError, ConnectionError) as e:
                    raise BulkError(grpc.StatusCode.UNAVAILABLE,
                                    f"cannot connect to {self.host}:{self.port}: "
                                    f"{type(e).__name__}: {e}", connect_failed=True) from None
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
                code = (grpc.StatusCode.DEADLINE_EXCEEDED
                        if isinstance(e, (TimeoutError, BlockingIOError))
                        else grpc.StatusCode.UNAVAILABLE)
                raise BulkError(code, f"bulk connection to {self.host}:{self.port}: "
                                      f"{type(e).__name__}: {e}") from None
            if "error" in h:
                self._drop()  # the server may have closed it (unread payload)
                raise self._error(h)
            return h, buf
