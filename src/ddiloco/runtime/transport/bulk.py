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
               ``BulkLimits.hello_max_bytes``, within ``handshake_timeout_s``); a learner
               that has joined adds ``"learner": m`` and ``"mac"``, the message's HMAC
               under its session key (``transport.session``). The server answers
               ``{"ok": true}`` or an ``E_AUTH`` error and closes.
  push         ``{"op": "push", <the Push header>}`` + payload  ->  ``{"status": ...}``
  fetch        ``{"op": "fetch", "fragments": [...]}``  ->  ``{"items": [{"fragment",
               "version", "codec", "numels", "nbytes"}, ...]}`` + the payloads, concatenated
  error        ``{"error": "E_SHAPE: ...", "grpc": "INVALID_ARGUMENT"}``; after an error the
               server closes the connection if the request's payload was not consumed.

Limits are checked before anything is allocated: a hello over ``hello_max_bytes``, a header
over ``MAX_HEADER_BYTES``, or a payload over the server's limit, closes the connection. No
thread waits on a handshake, an idle connection or a request header (a selector reads them
without blocking); a worker thread takes a request only once its whole header is in.

Limits before authentication count hosts, limits after it sessions (``BulkLimits``).
Connections are bounded in total and per peer address while they handshake (against a
flood). A connection whose hello proves a learner's session (``session_of``) is that
learner's from then on: it no longer counts against its host, and its requests in service
count against the learner's share, so any number of learners on one host are served alike.
A connection the token alone authenticated (no learner, or a session the server does not
know, as after its restart) stays its host's: it counts against the host's connections,
and the requests of all such connections of one host share one session's share. A request
over its session's share is refused with ``E_BUSY`` (retryable); the workers above one
session's share stay free for the others. Every message has a deadline that fits its size:
``message_timeout_s + bytes / min_rate_bytes_s``. A client that closes mid-message ends its
request as ``E_CANCELLED``, one that misses the deadline as ``E_TIMEOUT`` (counted through
``on_refused``, or by the handler from ``read_payload``'s ``BulkAborted``); neither is an
internal error. Client errors are ``BulkError``, a ``grpc.RpcError`` with ``code()`` /
``details()``, so callers handle both transports alike (connection failures are
``UNAVAILABLE``: retryable).
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

from ddiloco.runtime.transport import session, wire
from ddiloco.runtime.transport.auth import check_token
from ddiloco.runtime.transport.schema import Hello, SchemaError, loads, parse

__all__ = [
    "BulkClient",
    "BulkError",
    "BulkLimits",
    "hello",
    "BulkServer",
    "BulkReject",
    "BulkAborted",
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


class BulkAborted(Exception):
    """Raised by ``read_payload``: the client closed the connection before the whole
    payload arrived (``code`` ``E_CANCELLED``) or missed its deadline (``E_TIMEOUT``). An
    ordinary ending of the request, not a handler failure; the connection is closed."""

    def __init__(self, code: str, status: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.status, self.message = code, status, message


def hello(token: str, learner_session: tuple[int, bytes] | None = None) -> dict:
    """A data-port connection's first message: the token, and with ``learner_session``
    ((learner, key) of a Join) the learner and the message's MAC under the key, which makes
    the connection one of that learner's session."""
    h: dict = {"op": "hello", "token": token}
    if learner_session is None:
        return h
    m, key = learner_session
    return session.sign(key, {**h, "learner": m})


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


def _send(
    sock: socket.socket, header: dict, payload: Sequence[bytes | memoryview | wire.Deferred] = ()
) -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    size = sum(len(b) for b in payload)
    head = _PREFIX.pack(len(h), size) + h
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        sock.sendall(head)
        for b in payload:
            if len(b):
                sock.sendall(b.get() if isinstance(b, wire.Deferred) else b)
        return
    # one gathering call for the header and every piece (no joins, one wake-up of the peer);
    # a deferred piece is made at its turn and let go once sent, with what came before it
    views = [memoryview(head)]
    for b in payload:
        if not len(b):
            continue
        if isinstance(b, wire.Deferred):
            views.append(b.get())
            _sendmsg_all(sock, views)
            views = []
        else:
            views.append(memoryview(b).cast("B"))
    _sendmsg_all(sock, views)


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every byte of ``views`` (emptied), ``_IOV_MAX`` pieces per call."""
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
    """Open connections from one IP address that are not a learner session's (handshaking,
    or authenticated by the token alone); more are closed at once."""
    workers: int = 16
    """Threads serving requests; idle connections and request headers hold none (a
    selector reads them)."""
    max_requests_per_session: int = 8
    """Requests of one session in service at once (reading a payload, handling, sending a
    reply): a learner's connections, or those of one IP address that the token alone
    authenticated. More are refused at once with ``E_BUSY`` (retryable). At most
    ``workers - 1``: the rest is the reserve that one session's stalled requests cannot
    take."""
    message_timeout_s: float = 10.0
    """Fixed part of every message's deadline (a request's header from its first byte, its
    payload, the reply): ``message_timeout_s + bytes / min_rate_bytes_s``."""
    min_rate_bytes_s: float = float(1 << 16)
    """Slowest transfer rate a message may have (64 KiB/s: a 2 Mbit/s link shared by
    four learners); a message slower than that misses its deadline (``E_TIMEOUT``)."""

    def __post_init__(self) -> None:
        for name in (
            "hello_max_bytes",
            "max_connections",
            "max_connections_per_peer",
            "workers",
            "max_requests_per_session",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("handshake_timeout_s", "message_timeout_s", "min_rate_bytes_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number")

    @property
    def session_requests(self) -> int:
        """``max_requests_per_session``, kept below ``workers`` (one worker: no reserve)."""
        return max(1, min(self.max_requests_per_session, self.workers - 1))

    def deadline_s(self, nbytes: int) -> float:
        """Time a message of ``nbytes`` bytes may take (sent or received)."""
        return self.message_timeout_s + nbytes / self.min_rate_bytes_s


class _Pending:
    """A connection in its handshake: TLS (if any), then the hello, read without blocking."""

    __slots__ = ("sock", "peer", "deadline", "buf", "tls_done")

    def __init__(self, sock: socket.socket, peer: str, deadline: float, tls: bool) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.buf = bytearray()
        self.tls_done = not tls


Session = tuple[str, str | int]
"""Whose share a connection's requests count against: ``("learner", m)`` for a connection
whose hello proved learner m's session, ``("host", address)`` for one the token alone
authenticated."""


def _who(sess: Session) -> str:
    return (
        f"learner {sess[1]}" if sess[0] == "learner" else f"the token-only connections of {sess[1]}"
    )


class _Incoming:
    """An authenticated connection whose next request header is being read without
    blocking (``buf``: the prefix, then the header), or which is being drained before it
    is closed (``drain``: an error reply was sent and the request's payload is discarded)."""

    __slots__ = ("sock", "peer", "session", "started", "deadline", "buf", "drain")

    def __init__(
        self, sock: socket.socket, peer: str, sess: Session, deadline: float, drain: bool
    ) -> None:
        self.sock, self.peer, self.session = sock, peer, sess
        self.deadline, self.drain = deadline, drain
        self.started = time.monotonic()
        self.buf = bytearray()


class BulkServer:
    """Serves the data port. One selector thread accepts connections, runs every handshake
    without blocking (under a deadline and a small hello limit), watches idle
    authenticated connections and reads each request's header, also without blocking; a
    bounded pool of ``limits.workers`` threads serves the requests whose header is in
    (payload, handler, reply), at most ``limits.session_requests`` of one session at a
    time. Connections are bounded in total, and per peer address until a hello proves a
    learner's session (``session_of``: given a hello whose token is right, the learner
    whose session its MAC proves, or None; the module doc)."""

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
        session_of: Callable[[dict], int | None] | None = None,
    ) -> None:
        self.token, self.handler, self.max_payload = token, handler, max_payload
        self.session_of = session_of
        self.ssl_context = ssl_context
        self.on_auth_failure = on_auth_failure
        self.on_refused = on_refused
        """Called with (peer, code, reason) when a connection or a request is ended by the
        port rather than served: before authentication ``E_BUSY`` (a connection limit) or
        ``E_HANDSHAKE`` (no valid hello in time, or one too large); after it ``E_BUSY``
        (the session's requests in service), ``E_CANCELLED`` (closed mid-message),
        ``E_TIMEOUT`` (a message past its deadline), ``E_FRAME`` / ``E_OVERSIZE`` (a header
        that is not a JSON object, or too large)."""
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
        self._peer_of: dict[socket.socket, str] = {}  # every open connection -> its host
        self._per_peer: Counter[str] = Counter()  # host -> its connections of no learner
        self._session_of: dict[socket.socket, Session] = {}  # authenticated connections
        self._incoming: dict[socket.socket, _Incoming] = {}  # headers being read, drains
        self._serving: Counter[Session] = Counter()  # session -> its requests held by workers
        self._ready: list[tuple[socket.socket, bool]] = []  # served: (conn, drain) back
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
            for conn, drain in ready:
                if drain:
                    self._start_drain(conn)
                else:
                    self._watch_idle(conn)
            for key, _ev in self._sel.select(timeout=0.25):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                elif key.data == "idle":
                    self._begin_request(key.fileobj)
                elif isinstance(key.data, _Incoming):
                    self._read_request(key.data)
                else:
                    self._handshake(key.data)
            now = time.monotonic()
            for pend in [p for p in self._pending.values() if p.deadline <= now]:
                self._refuse(pend, f"no valid hello within {self.limits.handshake_timeout_s} s")
            for inc in [i for i in self._incoming.values() if i.deadline <= now]:
                self._end_incoming(
                    inc,
                    None if inc.drain else wire.ErrorCode.TIMEOUT,
                    f"request header not received within {inc.deadline - inc.started:.1f} s",
                )

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
            if old in self._session_of:
                self._session_of[new] = self._session_of.pop(old)
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
        learner = None
        if hello.learner is not None and self.session_of is not None:
            try:
                learner = self.session_of(raw)
            except Exception:  # noqa: BLE001 - a failed check proves no session
                log.exception("data connection from %s: session check failed", pend.peer)
        with self._lock:
            if learner is not None and conn in self._peer_of:
                # a learner's from now on: its host's connection limit no longer counts it
                self._session_of[conn] = ("learner", learner)
                self._per_peer[pend.peer] -= 1
                if self._per_peer[pend.peer] <= 0:
                    del self._per_peer[pend.peer]
            else:
                self._session_of[conn] = ("host", pend.peer)
        del self._pending[conn]
        self._sel.unregister(conn)
        try:
            conn.setblocking(True)
            conn.settimeout(self.limits.message_timeout_s)
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
        log.debug("data connection from %s: %s: %s", peer, code, reason)
        if self.on_refused:
            self.on_refused(peer, code, reason)

    def _watch_idle(self, conn: socket.socket) -> None:
        """An authenticated connection between requests: no thread, the selector waits."""
        try:
            conn.setblocking(False)
            if isinstance(conn, ssl.SSLSocket) and conn.pending():
                self._begin_request(conn)  # bytes already decrypted: the selector won't see them
                return
            self._sel.register(conn, selectors.EVENT_READ, "idle")
        except (OSError, ValueError, KeyError):
            self._drop(conn)

    # -- request headers, read by the selector thread ---------------------------------------
    def _begin_request(self, conn: socket.socket) -> None:
        """The first bytes of a request arrived: its header is read without a thread, under
        a deadline that grows with the header's announced size."""
        with self._lock:
            peer = self._peer_of.get(conn, "?")
            sess = self._session_of.get(conn, ("host", peer))
        deadline = time.monotonic() + self.limits.deadline_s(_PREFIX.size)
        inc = _Incoming(conn, peer, sess, deadline, False)
        self._incoming[conn] = inc
        try:
            self._sel.modify(conn, selectors.EVENT_READ, inc)
        except KeyError:  # not registered (TLS bytes already decrypted)
            self._sel.register(conn, selectors.EVENT_READ, inc)
        self._read_request(inc)

    def _read_request(self, inc: _Incoming) -> None:
        if inc.drain:
            self._drain(inc)
            return
        conn, lim = inc.sock, self.limits
        try:
            while True:
                want = _PREFIX.size
                if len(inc.buf) >= _PREFIX.size:
                    want += _PREFIX.unpack_from(inc.buf)[0]
                if len(inc.buf) >= want:
                    break
                try:
                    chunk = conn.recv(want - len(inc.buf))
                except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    return  # more later (or the deadline)
                if not chunk:  # between requests a close is the ordinary end
                    code = wire.ErrorCode.CANCELLED if inc.buf else None
                    self._end_incoming(inc, code, "connection closed mid-header")
                    return
                inc.buf += chunk
                if len(inc.buf) == _PREFIX.size:
                    hlen, _ = _PREFIX.unpack_from(inc.buf)
                    if hlen > wire.MAX_HEADER_BYTES:
                        self._end_incoming(
                            inc,
                            wire.ErrorCode.OVERSIZE,
                            f"header of {hlen} bytes exceeds {wire.MAX_HEADER_BYTES}",
                        )
                        return
                    inc.deadline = inc.started + lim.deadline_s(_PREFIX.size + hlen)
        except (OSError, ValueError) as e:
            self._end_incoming(inc, wire.ErrorCode.CANCELLED, f"{type(e).__name__}: {e}")
            return
        _, plen = _PREFIX.unpack_from(inc.buf)
        try:
            header = loads(inc.buf[_PREFIX.size :])
            if not isinstance(header, dict):
                raise ValueError("header must be a JSON object")
        except ValueError as e:  # SchemaError too: closed without a reply
            self._end_incoming(inc, wire.ErrorCode.BAD_FRAME, str(e))
            return
        del self._incoming[conn]
        self._sel.unregister(conn)
        peer, sess = inc.peer, inc.session
        with self._lock:
            busy = self._serving[sess] >= lim.session_requests
            if not busy:
                self._serving[sess] += 1
        if busy:
            self._note_refused(
                peer,
                wire.ErrorCode.BUSY,
                f"{lim.session_requests} requests of {_who(sess)} in service",
            )
            self._reply_now(
                conn,
                {
                    "error": f"{wire.ErrorCode.BUSY}: {lim.session_requests} requests of "
                    f"{_who(sess)} are in service; retry",
                    "grpc": "UNAVAILABLE",
                },
                drain=plen > 0,
            )
            return
        try:
            self._pool.submit(self._serve_one, conn, peer, sess, header, plen)
        except RuntimeError:  # shut down
            self._release(sess)
            self._drop(conn)

    def _reply_now(self, conn: socket.socket, header: dict, drain: bool) -> None:
        """An error reply from the selector thread, without blocking (if the client does not
        take it at once it is closed); then the connection waits for its next request, or
        with a request's payload unread is drained and closed."""
        try:
            _send(conn, header)
        except (OSError, ValueError):
            self._drop(conn)
            return
        if drain:
            self._start_drain(conn)
        else:
            self._watch_idle(conn)

    def _start_drain(self, conn: socket.socket) -> None:
        """Close a connection whose request was not read: stop sending and discard what
        arrives until the client closes or 2 s pass (closing with unread bytes would reset
        the connection, and the client could lose the error reply sent just before). No
        thread waits on it."""
        with self._lock:
            peer = self._peer_of.get(conn, "?")
            sess = self._session_of.get(conn, ("host", peer))
        try:
            conn.setblocking(False)
            conn.shutdown(socket.SHUT_WR)
            inc = _Incoming(conn, peer, sess, time.monotonic() + 2.0, True)
            self._sel.register(conn, selectors.EVENT_READ, inc)
        except (OSError, ValueError, KeyError):
            self._drop(conn)
            return
        self._incoming[conn] = inc

    def _drain(self, inc: _Incoming) -> None:
        scratch = bytearray(1 << 16)
        try:
            while inc.sock.recv_into(scratch):
                pass
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except (OSError, ValueError):
            pass
        self._end_incoming(inc, None, "drained")

    def _end_incoming(self, inc: _Incoming, code: str | None, reason: str) -> None:
        """Close a connection the selector was reading; ``code`` counts it (None: an
        ordinary close)."""
        self._incoming.pop(inc.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(inc.sock)
        if code is not None:
            self._note_refused(inc.peer, code, reason)
        self._drop(inc.sock)

    def _release(self, sess: Session) -> None:
        with self._lock:
            self._serving[sess] -= 1
            if self._serving[sess] <= 0:
                del self._serving[sess]

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            peer = self._peer_of.pop(conn, None)
            sess = self._session_of.pop(conn, None)
            if peer is not None and (sess is None or sess[0] != "learner"):
                self._per_peer[peer] -= 1
                if self._per_peer[peer] <= 0:
                    del self._per_peer[peer]
        with contextlib.suppress(OSError):
            conn.close()

    # -- the workers ------------------------------------------------------------------------
    def _serve_one(
        self, conn: socket.socket, peer: str, sess: Session, header: dict, plen: int
    ) -> None:
        after = "close"
        try:
            after = self._request(conn, peer, header, plen)
        except BulkAborted as a:  # a handler that let it through: still an ordinary ending
            self._note_refused(peer, a.code, a.message)
        except (TimeoutError, BlockingIOError) as e:  # the reply was not taken in time
            self._note_refused(peer, wire.ErrorCode.TIMEOUT, f"reply not taken in time: {e}")
        except ConnectionError as e:  # the client left before its reply was sent
            self._note_refused(peer, wire.ErrorCode.CANCELLED, f"reply not taken: {e}")
        except (OSError, ValueError) as e:
            log.debug("bulk connection closed: %s", e)
        except Exception:  # noqa: BLE001 - a handler bug ends this connection, not the port
            log.exception("bulk request failed")
        finally:
            self._release(sess)
        if after != "close":
            with self._lock:
                if not self._closed:
                    self._ready.append((conn, after == "drain"))
                else:
                    after = "close"
        if after != "close":
            self._wake()
        else:
            self._drop(conn)

    def _request(self, conn: socket.socket, peer: str, h: dict, plen: int) -> str:
        """Serve one request whose header the selector read; returns what becomes of the
        connection: ``idle`` (the next request), ``drain`` (the payload was not read) or
        ``close``."""
        lim = self.limits
        conn.setblocking(True)
        if plen > self.max_payload:
            conn.settimeout(lim.message_timeout_s)
            _send(
                conn,
                {
                    "error": f"{wire.ErrorCode.OVERSIZE}: payload of {plen} bytes exceeds "
                    f"the limit of {self.max_payload}",
                    "grpc": "RESOURCE_EXHAUSTED",
                },
            )
            return "drain"
        consumed = plen == 0
        aborted: BulkAborted | None = None

        def read_payload() -> memoryview:
            nonlocal consumed, aborted
            buf = empty_buffer(plen)
            timeout_s = lim.deadline_s(plen)
            try:
                _set_deadline(conn, timeout_s)
                _recv_exact(conn, buf, time.monotonic() + timeout_s)
            except (TimeoutError, BlockingIOError):
                aborted = BulkAborted(
                    wire.ErrorCode.TIMEOUT,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"payload of {plen} bytes not received within its {timeout_s:.1f} s",
                )
            except (OSError, ConnectionError) as e:
                aborted = BulkAborted(
                    wire.ErrorCode.CANCELLED,
                    grpc.StatusCode.CANCELLED,
                    f"the client ended the request mid-payload ({type(e).__name__}: {e})",
                )
            if aborted is not None:
                raise aborted
            consumed = True
            return buf

        try:
            reply, pieces = self.handler(str(h.get("op")), h, plen, read_payload)
        except BulkReject as r:
            if aborted is not None:  # the client is gone or stalled: try, then close
                with contextlib.suppress(OSError, ValueError):
                    conn.settimeout(1.0)
                    _send(conn, {"error": r.message, "grpc": r.status.name})
                return "close"
            conn.settimeout(lim.message_timeout_s)
            _send(conn, {"error": r.message, "grpc": r.status.name})
            return "idle" if consumed else "drain"
        _set_deadline(conn, lim.deadline_s(sum(len(b) for b in pieces)))
        _send(conn, reply, pieces)
        return "idle"


class BulkClient:
    """One authenticated connection to a syncer's data port, one request at a time
    (a lock serialises callers). Reconnects on the next request after any failure.
    ``learner_session`` gives (learner, key) of the session the connection's hello proves
    (None: the token alone); ``renew`` makes the next request open a new connection, as
    when that session changes."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout_s: float = 5.0,
        learner_session: Callable[[], tuple[int, bytes] | None] | None = None,
    ) -> None:
        self.host, self.port, self.token = host, port, token
        self.ssl_context = ssl_context
        self.connect_timeout_s = connect_timeout_s
        self.learner_session = learner_session
        self._sock: socket.socket | None = None
        self._timeout_s: float | None = None  # the timeouts set on _sock
        self._lock = threading.Lock()
        self._renew = False

    def renew(self) -> None:
        """Open a new connection (with a new hello) at the next request; a request in
        progress is not waited for."""
        self._renew = True

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
            _send(s, hello(self.token, self.learner_session() if self.learner_session else None))
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
            if self._renew:
                self._renew = False
                self._drop()
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
