"""The learner's connection to a syncer: ``SyncerClient`` (gRPC control plane, data-port
pushes and fetches, retries), ``LinkLimits`` (emulated bandwidth and latency), ``LINK_CUT``
(the process's emulated link cut), ``SyncerError`` (a failure talking to the syncer) and
``TransportError`` (one in transport).

Every failure of a call reaches the caller as a ``grpc.RpcError`` with a status code (the
data port's ``BulkError`` is one, and so is every ``TransportError``), never as another
exception:

- grpc raises ``ValueError`` for a call started on a closed channel: ``SyncerClient``
  opens a new channel and makes the call again on it (a channel closed under a call, e.g.
  by another thread's reconnect) or, once the client itself is closed, raises
  ``ChannelClosedError`` (CANCELLED); a call in flight when its channel closes fails as
  CANCELLED (grpc's own error);
- anything else that goes wrong in a call (a reply that cannot be read: a malformed frame,
  a missing field, a payload of the wrong size; a socket error the data port did not
  expect; grpc refusing a call for another reason) is a ``TransportError`` with code
  INTERNAL and ``E_TRANSPORT`` in its details.

``TransportError`` is a ``SyncerError`` too. The learner's threads retry the codes in
``RETRYABLE`` (every transport failure among them) and report the others; no failure of a
call ends a learner thread."""

from __future__ import annotations

import contextlib
import logging
import math
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.transport import session, wire
from ddiloco.runtime.transport.auth import channel_credentials, client_ssl_context
from ddiloco.runtime.transport.bulk import BulkClient, BulkError, split_host

__all__ = [
    "LinkLimits",
    "LinkCut",
    "LinkCutError",
    "LINK_CUT",
    "ChannelClosedError",
    "SyncerClient",
    "SyncerError",
    "TransportError",
    "RETRYABLE",
    "rpc_code",
    "rpc_details",
]

log = logging.getLogger("ddiloco.learner")

RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
}


_SIGNED = ("Join", "Heartbeat", "Leave")
"""Calls signed with the session (Push too, in ``push``); a Join is signed only to prove a
rejoining learner is the live process itself."""


def finite_only(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by None (JSON has no NaN; the syncer refuses
    it)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_only(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_only(v) for v in obj]
    return obj


class SyncerError(RuntimeError):
    """A failure talking to the syncer, as a typed result: a call it rejected for good (bad
    token, mismatched model...), which the learner reports, or a ``TransportError``."""


class TransportError(SyncerError, grpc.RpcError):
    """A call that failed in transport, with a gRPC status code (``code()``,
    ``details()``) like the syncer's own errors: the learner's threads retry it when the
    code is in ``RETRYABLE`` (every code this module gives is) and report it otherwise."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass(kw_only=True, slots=True)
class LinkLimits:
    """Emulated link between this learner and the syncer (chaos / WAN experiments)."""

    bandwidth_bytes_per_s: float = 0.0
    """0: unlimited."""
    latency_s: float = 0.0
    """One-way latency added to every bulk transfer."""

    def delay_s(self, nbytes: int) -> float:
        bw = nbytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s > 0 else 0.0
        return self.latency_s + bw


class LinkCutError(TransportError):
    """A call made while the link is cut: it fails as UNAVAILABLE without sending a byte."""

    def __init__(self, address: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"link to {address} cut (chaos)")


class LinkCut:
    """The emulated cut of this process's link to the syncer (chaos ``link_cut``). While it
    is cut, every call a ``SyncerClient`` starts (control, gRPC bulk, data port) fails as
    UNAVAILABLE before any byte is sent, so the syncer hears nothing from this learner."""

    def __init__(self) -> None:
        self._cut = threading.Event()

    @property
    def is_cut(self) -> bool:
        return self._cut.is_set()

    def cut(self) -> None:
        self._cut.set()

    def restore(self) -> None:
        self._cut.clear()

    def check(self, address: str) -> None:
        if self._cut.is_set():
            raise LinkCutError(address)


LINK_CUT = LinkCut()
"""The process-wide link switch (one learner per process)."""

T = TypeVar("T")


class ChannelClosedError(TransportError):
    """A call on a closed gRPC channel (grpc raises ``ValueError`` for it, before anything
    is sent), as a typed failure: CANCELLED once the ``SyncerClient`` itself is closed,
    UNAVAILABLE when the channel opened in place of a closed one was closed too."""

    def __init__(self, address: str, client_closed: bool) -> None:
        why = "the client is closed" if client_closed else "the channel was closed under the call"
        super().__init__(
            grpc.StatusCode.CANCELLED if client_closed else grpc.StatusCode.UNAVAILABLE,
            f"E_CLOSED: call to {address} on a closed channel ({why})",
        )


def _closed_channel(e: ValueError) -> bool:
    """Whether grpc raised ``e`` for a call started on a closed channel."""
    msg = str(e).lower()
    return "closed" in msg and ("rpc" in msg or "channel" in msg)


_TRANSPORT_FAILURES = (
    ValueError,  # a malformed frame or JSON; grpc refusing a call
    KeyError,  # a reply without a field it must have
    TypeError,
    IndexError,
    struct.error,
    OSError,
    EOFError,
    RuntimeError,  # torch refusing a payload of the wrong size
)
"""What reading a call's reply or making the call can raise besides ``grpc.RpcError``
(a bug in this code, e.g. ``AttributeError``, is not among them, and still raises)."""


class SyncerClient:
    """Thin typed wrapper over the syncer's calls: gRPC channels for control (and bulk when
    the syncer has no data port), and a ``BulkClient`` for fragments once a Join reply has
    advertised the syncer's data port (``ddiloco.runtime.transport.bulk``)."""

    def __init__(
        self, address: str, token: str, tls_ca: str | None = None, tls: bool = False
    ) -> None:
        self.address = address
        self._token, self._tls, self._tls_ca = token, bool(tls or tls_ca), tls_ca
        self._md = ((wire.TOKEN_METADATA, token),)
        self._closed = False
        self._channel_lock = threading.Lock()
        self.bulk = self._channel("bulk")
        self.control = self._channel("control")
        self.data: BulkClient | None = None
        """The data-port connection for pushes, or None: fragments go over gRPC."""
        self.session: tuple[int, bytes] | None = None
        """(learner, key) of the session the last Join through this client opened."""
        self._hb, self._hb_lock = 0, threading.Lock()
        self.data_fetch: BulkClient | None = None
        """A second connection for fetches, so that a fetch never queues behind a push
        (the sender and receiver threads each have their own)."""
        self._mirrors: dict[int, tuple[int, list[torch.Tensor]]] = {}
        """Delta-coded downlinks: fragment -> (the syncer's token, the copy this learner
        holds); each delta reply is added to it."""
        self._fetch_lock = threading.Lock()
        """One fetch at a time: on the fetch connection, and against the copies it names."""

    def _channel(self, kind: str) -> grpc.Channel:
        # a distinct channel arg keeps grpc from sharing the bulk connection with the
        # control one (liveness must not queue behind multi-megabyte pushes)
        opts = wire.GRPC_OPTIONS + ([("ddiloco.channel", "control")] if kind == "control" else [])
        if self._tls:
            return grpc.secure_channel(self.address, channel_credentials(self._tls_ca), opts)
        return grpc.insecure_channel(self.address, opts)

    def _invoke(self, control: bool, call: Callable[[grpc.Channel], T]) -> T:
        """``call(channel)`` on the control (or bulk) channel. A call started on a closed
        channel fails before anything is sent (grpc's ``ValueError``): while this client is
        open the channel is replaced by a new one and the call made again on it; otherwise
        (or if the new one is closed too) it raises ``ChannelClosedError``."""
        kind = "control" if control else "bulk"
        for attempt in range(2):
            ch = getattr(self, kind)
            try:
                return call(ch)
            except ValueError as e:
                if not _closed_channel(e):
                    raise
                if self._closed or attempt:
                    raise ChannelClosedError(self.address, self._closed) from None
                with self._channel_lock:
                    if not self._closed and getattr(self, kind) is ch:
                        setattr(self, kind, self._channel(kind))
                        log.info(
                            "gRPC %s channel to %s was closed under a call: opened a new one",
                            kind,
                            self.address,
                        )
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _typed(self, name: str) -> Iterator[None]:
        """Every failure of call ``name`` inside as a typed one: a ``grpc.RpcError`` or
        ``SyncerError`` as it is, anything else that the transport or the reading of the
        reply raises (``_TRANSPORT_FAILURES``) as a ``TransportError`` (INTERNAL)."""
        try:
            yield
        except (grpc.RpcError, SyncerError):
            raise
        except _TRANSPORT_FAILURES as e:
            raise TransportError(
                grpc.StatusCode.INTERNAL,
                f"E_TRANSPORT: {name} to {self.address} failed: {type(e).__name__}: {e}",
            ) from e

    def close(self) -> None:
        with self._channel_lock:
            self._closed = True
        self.use_data_port(None)
        self.bulk.close()
        self.control.close()

    def use_data_port(self, port: int | None, host: str | None = None) -> None:
        """Send pushes and fetches to the syncer's data port (None: over gRPC). Called with
        every Join reply's ``bulk_port`` (a restarted syncer may listen elsewhere), at the
        reply's ``bulk_host`` when the syncer names one, else at the host this client
        dialed."""
        host = host or split_host(self.address)
        if self.data is not None and self.data.port == port and self.data.host == host:
            return
        for c in (self.data, self.data_fetch):
            if c is not None:
                c.close()
        self.data = self.data_fetch = None
        if port is not None:
            ctx = client_ssl_context(self._tls_ca) if self._tls else None
            # each connection's hello proves this client's session: the data port then
            # counts its requests as this learner's, not as its host's
            self.data, self.data_fetch = (
                BulkClient(
                    host,
                    int(port),
                    self._token,
                    ssl_context=ctx,
                    learner_session=lambda: self.session,
                )
                for _ in range(2)
            )

    def _set_session(self, sess: tuple[int, bytes] | None) -> None:
        """Act as the learner of ``sess`` from now on; the data-port connections say so in
        a new hello at their next request."""
        if sess == self.session:
            return
        self.session = sess
        for c in (self.data, self.data_fetch):
            if c is not None:
                c.renew()

    def credentials(self) -> dict:
        """What another rank of this learner's island needs to push and fetch as it: the
        session this client's Join opened and the data port it uses."""
        sess = self.session
        return {
            "session": None if sess is None else [sess[0], sess[1].hex()],
            "data": None if self.data is None else [self.data.host, self.data.port],
        }

    def adopt(self, creds: dict) -> None:
        """Act as the learner whose root rank's client gave ``credentials()``."""
        sess = creds.get("session")
        self._set_session(None if sess is None else (int(sess[0]), bytes.fromhex(sess[1])))
        data = creds.get("data")
        self.use_data_port(
            None if data is None else int(data[1]), None if data is None else data[0]
        )

    def sign(self, header: dict) -> dict:
        """``header`` with the MAC of this client's session when it acts as the learner that
        joined through it (``transport.session``); unchanged otherwise."""
        sess = self.session
        if sess is None or header.get("learner") != sess[0]:
            return header
        return session.sign(sess[1], header)

    def unary(
        self, name: str, header: dict, timeout_s: float = 10.0, control: bool = False
    ) -> dict:
        with self._typed(name):
            return self._unary(name, header, timeout_s, control)

    def _unary(self, name: str, header: dict, timeout_s: float, control: bool) -> dict:
        LINK_CUT.check(self.address)
        if name in _SIGNED:
            if name == "Heartbeat":
                with self._hb_lock:
                    self._hb += 1
                    header = {**header, "hb": self._hb}
            if "report" in header:
                header = {**header, "report": finite_only(header["report"])}
            header = self.sign(header)
        req = wire.pack(header)
        resp = self._invoke(
            control,
            lambda ch: ch.unary_unary(wire.method(name))(req, timeout=timeout_s, metadata=self._md),
        )
        r = wire.unpack(resp)[0]
        if name == "Join" and not r.get("need_init"):
            self.use_data_port(r.get("bulk_port"), r.get("bulk_host"))
            if isinstance(r.get("session"), str):  # keyed to the id the syncer gave
                self._set_session(
                    (r.get("learner", header.get("learner")), bytes.fromhex(r["session"]))
                )
        return r

    def stream(self, name: str, frames, timeout_s: float = 60.0) -> dict:
        LINK_CUT.check(self.address)
        with self._typed(name):
            # a call refused by a closed channel has not taken a frame from ``frames``
            resp = self._invoke(
                False,
                lambda ch: ch.stream_unary(wire.method(name))(
                    frames, timeout=timeout_s, metadata=self._md
                ),
            )
            return wire.unpack(resp)[0]

    def _data_request(
        self, header: dict, payload: list, timeout_s: float, fetch: bool = False
    ) -> tuple[dict, memoryview] | None:
        """A request on the data port; None when there is none or it cannot be reached
        (the caller then uses gRPC: the data port may be firewalled off)."""
        data = self.data_fetch if fetch else self.data
        if data is None:
            return None
        try:
            return data.request(header, payload, timeout_s)
        except BulkError as e:
            if not e.connect_failed:
                raise
            log.warning(
                "syncer data port %s:%d unreachable (%s): sending fragments over gRPC "
                "until the next join",
                data.host,
                data.port,
                e.details(),
            )
            if data in (self.data, self.data_fetch):
                self.use_data_port(None)
            return None

    def push(self, header: dict, data: bytes | memoryview, timeout_s: float = 60.0) -> dict:
        """Push one fragment (``header`` as the Push call's); returns the syncer's reply."""
        LINK_CUT.check(self.address)
        with self._typed("Push"):
            header = self.sign(header)
            r = self._data_request({"op": "push", **header}, [data], timeout_s)
            if r is not None:
                return r[0]
            return self.stream("Push", wire.chunks(header, data), timeout_s)

    def fetch(
        self,
        fragments: list[int] | None,
        timeout_s: float = 60.0,
        learner: int | None = None,
        exact: bool = False,
        slices: list[list[int]] | None = None,
    ) -> dict[int, tuple[int, list[torch.Tensor], int]]:
        """Published fragments: p -> (version, flat fp32 tensors, wire bytes), through the
        downlink codec. ``learner``: who fetches, so that a syncer with a delta-coded
        downlink (``sync.down_delta``) sends each fragment as a delta against the copy this
        client holds. ``exact``: the published fp32 values themselves (an export or an
        evaluation of the global model, not a learner's install). ``slices``: only these
        ``[fragment, j, offset, numel]`` runs (a rank of a sharded island), one flat tensor
        per run, in the order given."""
        with self._fetch_lock, self._typed("Fetch"):
            return self._fetch(fragments, timeout_s, learner, exact, slices)

    def _fetch(
        self,
        fragments: list[int] | None,
        timeout_s: float,
        learner: int | None,
        exact: bool,
        slices: list[list[int]] | None = None,
    ) -> dict[int, tuple[int, list[torch.Tensor], int]]:
        out: dict[int, tuple[int, list[torch.Tensor], int]] = {}

        def decode(h: dict, buf: memoryview) -> None:
            codec = get_codec(h["codec"])
            p, numels = h["fragment"], h["numels"]
            if h.get("delta"):
                # the encoded steps of the fragment's chain from this client's copy
                # (ddiloco.algorithm.downlink), applied in order
                mine = self._mirrors.get(p)
                if mine is None or len(mine[1]) != len(numels):
                    raise ValueError(
                        f"syncer {self.address} sent fragment {p} as a delta against a copy "
                        f"this client does not hold"
                    )
                ts, off = list(mine[1]), 0
                for _ in range(int(h.get("steps", 1))):
                    for j, k in enumerate(numels):
                        nb = codec.nbytes(k)
                        ts[j] = ts[j] + codec.decode(buf[off : off + nb], k)
                        off += nb
                if off != len(buf):
                    raise ValueError(
                        f"syncer {self.address} sent fragment {p} with {len(buf)} bytes for "
                        f"{h.get('steps', 1)} steps of {off} bytes"
                    )
            else:
                ts, off = [], 0
                for k in numels:
                    nb = codec.nbytes(k)
                    ts.append(codec.decode(buf[off : off + nb], k))
                    off += nb
            if "token" in h:
                # the copy is kept as it is returned: neither side writes it in place
                self._mirrors[p] = (int(h["token"]), ts)
            out[p] = (h["version"], ts, len(buf))

        LINK_CUT.check(self.address)
        req: dict = {"fragments": fragments}
        if slices is not None:
            req["slices"] = slices
        if exact:
            req["exact"] = True
        elif learner is not None:
            req["learner"] = learner
            req["mirrors"] = [[p, tok] for p, (tok, _) in sorted(self._mirrors.items())]
        r = self._data_request({"op": "fetch", **req}, [], timeout_s, fetch=True)
        if r is not None:
            h, buf = r
            mv, off = memoryview(buf), 0
            for item in h["items"]:
                decode(item, mv[off : off + item["nbytes"]])
                off += item["nbytes"]
            return out
        packed = wire.pack(req)
        call = self._invoke(
            False,
            lambda ch: ch.unary_stream(wire.method("Fetch"))(
                packed, timeout=timeout_s, metadata=self._md
            ),
        )
        cur: dict | None = None
        buf = bytearray()
        for frame in call:
            h, payload = wire.unpack(frame)
            if "cont" not in h:
                if cur is not None:
                    decode(cur, memoryview(buf))
                cur, buf = h, bytearray()
            buf += payload
        if cur is not None:
            decode(cur, memoryview(buf))
        return out

    def status(self, timeout_s: float = 5.0) -> dict:
        return self.unary("Status", {}, timeout_s, control=True)


def rpc_code(e: grpc.RpcError) -> grpc.StatusCode:
    try:
        return e.code()
    except Exception:  # noqa: BLE001 - non-call errors
        return grpc.StatusCode.UNKNOWN


def rpc_details(e: grpc.RpcError) -> str:
    try:
        return e.details() or ""
    except Exception:  # noqa: BLE001
        return str(e)
