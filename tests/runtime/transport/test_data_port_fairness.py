"""The data port after authentication: one client's stalled requests never delay another
learner. A stalled request header holds no thread (the selector reads headers), stalled
payloads hold a bounded number (per session and per peer), so another learner's fetch and
push are served at once, on plain TCP and on TLS. A client that leaves or stalls
mid-message ends its request as an ordinary, counted ending (``E_CANCELLED``,
``E_TIMEOUT``), never ``E_INTERNAL`` and never a traceback in the syncer's log."""

from __future__ import annotations

import json
import logging
import socket
import ssl
import struct
import time

import pytest
from runtime_helpers import (
    SyncerProcess,
    assert_no_internal_error,
    init_syncer,
    live_syncer,
    push_header,
    self_signed_cert,
    tiny_model,
)

from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.transport.bulk import BulkLimits
from ddiloco.runtime.transport.spec import fragmentation_from_spec, spec_fingerprint

STALLED = 20


def _frame(header: dict, payload: bytes = b"", plen: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack(">IQ", len(h), len(payload) if plen is None else plen) + h + payload


def _authenticated(port: int, token: str, ctx: ssl.SSLContext | None) -> socket.socket:
    """A raw data-port connection past its hello: what any token holder can open."""
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    if ctx is not None:
        c = ctx.wrap_socket(c, server_hostname="127.0.0.1")
    c.sendall(_frame({"op": "hello", "token": token}))
    pre = c.recv(12, socket.MSG_WAITALL) if ctx is None else _recv_n(c, 12)
    hlen, _ = struct.unpack(">IQ", pre)
    assert json.loads(_recv_n(c, hlen)) == {"ok": True}
    return c


def _recv_n(c: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = c.recv(n - len(out))
        assert chunk, "closed"
        out += chunk
    return out


def _reply(c: socket.socket, timeout_s: float) -> dict:
    c.settimeout(timeout_s)
    hlen, _ = struct.unpack(">IQ", _recv_n(c, 12))
    return json.loads(_recv_n(c, hlen))


def _join(client: SyncerClient, spec: dict, learner: int) -> int:
    r = client.unary(
        "Join", {"learner": learner, "incarnation": -1, "fingerprint": spec_fingerprint(spec)}
    )
    return r["incarnation"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_stalled_requests_never_delay_another_learners_fetch_or_push(tmp_path, tls):
    args: list[str] = []
    ctx = None
    if tls:
        cert, key = self_signed_cert(tmp_path)
        args = ["--tls-cert", str(cert), "--tls-key", str(key)]
        ctx = ssl.create_default_context(cafile=str(cert))
    s = SyncerProcess(tmp_path, "tok", *args, "--heartbeat-timeout", "600")
    ca = str(tmp_path / "cert.pem") if tls else None
    try:
        attacker = SyncerClient(s.address, "tok", tls_ca=ca)
        spec, inc0 = init_syncer(attacker, tiny_model())
        frag = fragmentation_from_spec(spec)
        port = attacker.data.port
        data0 = b"\0" * frag.fragments[0].nbytes

        # a token holder opens 20 data-port connections, starts a request header on each
        # and stops (more than the 16 data-port workers)
        heads = [_authenticated(port, "tok", ctx) for _ in range(STALLED)]
        for c in heads:
            c.sendall(struct.pack(">IQ", 200, 0) + b'{"op": "fe')
        # and, as the learner it joined as, pushes whose payload stops half-way: more than
        # the session may have in progress
        pays = [_authenticated(port, "tok", ctx) for _ in range(6)]
        for i, c in enumerate(pays):
            h = attacker.sign(push_header(frag, 0, data0, inc0, 100 + i))
            c.sendall(_frame({"op": "push", **h}, data0[: len(data0) // 2], plen=len(data0)))
        time.sleep(0.5)

        # another learner's fetch and push are served at once
        victim = SyncerClient(s.address, "tok", tls_ca=ca)
        inc1 = _join(victim, spec, 1)
        assert victim.data is not None
        t0 = time.monotonic()
        got = victim.fetch(None, timeout_s=5.0)
        fetch_s = time.monotonic() - t0
        assert sorted(got) == list(range(frag.P)) and fetch_s < 5.0, fetch_s
        data1 = b"".join(t.numpy().tobytes() for t in got[1][1])
        t0 = time.monotonic()
        r = victim.push(
            push_header(frag, 1, data1, inc1, 1, learner=1, base_version=got[1][0]),
            data1,
            timeout_s=5.0,
        )
        assert r["status"] == "accepted" and time.monotonic() - t0 < 5.0
        for _ in range(3):  # and again: nothing queues behind the stalled requests
            t0 = time.monotonic()
            victim.fetch([0], timeout_s=5.0)
            assert time.monotonic() - t0 < 5.0

        # the session's pushes over its bound were refused at once (retryable)
        busy = 0
        for c in pays:
            c.settimeout(0.5)
            try:
                rep = _reply(c, 0.5)
            except (TimeoutError, OSError, AssertionError):
                continue
            assert rep["error"].startswith("E_BUSY"), rep
            busy += 1
        assert busy == 2, busy
        st = victim.status()
        assert st["rejections"].get("E_BUSY", 0) >= 2, st["rejections"]
        for c in heads + pays:
            c.close()
        assert_no_internal_error(victim.status(), (tmp_path / "syncer.log").read_text())
        victim.close()
        attacker.close()
    finally:
        s.close()


@pytest.fixture
def quick(caplog):
    """A real syncer in this process whose data-port messages have a 1 s deadline."""
    caplog.set_level(logging.INFO)
    limits = BulkLimits(message_timeout_s=1.0)
    with live_syncer(heartbeat_timeout_s=600.0, data_limits=limits) as live:
        yield live.server, live.client, live.spec, live.inc


def _wait_for(client: SyncerClient, code: str, n: int, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        rej = client.status()["rejections"]
        if rej.get(code, 0) >= n or time.monotonic() > deadline:
            return rej
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_client_that_leaves_or_stalls_mid_message_is_an_ordinary_ending(quick, caplog):
    server, client, spec, inc = quick
    frag = fragmentation_from_spec(spec)
    data = b"\0" * frag.fragments[0].nbytes
    port = server.bulk_port

    # a valid, signed push header, then a payload 100 bytes short, then the client closes
    c = _authenticated(port, "tok", None)
    h = client.sign(push_header(frag, 0, data, inc, 1))
    c.sendall(_frame({"op": "push", **h}, data[:-100], plen=len(data)))
    c.close()
    rej = _wait_for(client, "E_CANCELLED", 1)
    assert rej.get("E_CANCELLED", 0) == 1, rej

    # the same payload stalled: ended at its deadline (1 s + its size at 64 KiB/s)
    c = _authenticated(port, "tok", None)
    h = client.sign(push_header(frag, 0, data, inc, 2))
    t0 = time.monotonic()
    c.sendall(_frame({"op": "push", **h}, data[:-100], plen=len(data)))
    rep = _reply(c, 10.0)
    assert rep["error"].startswith("E_TIMEOUT") and rep["grpc"] == "DEADLINE_EXCEEDED", rep
    assert time.monotonic() - t0 < 1.0 + len(data) / 65536 + 2.0
    c.close()

    # a header stalled, and one cut short by a close: the selector ends both
    c = _authenticated(port, "tok", None)
    c.sendall(struct.pack(">IQ", 200, 0) + b'{"op"')
    c2 = _authenticated(port, "tok", None)
    c2.sendall(struct.pack(">IQ", 200, 0) + b'{"op"')
    c2.close()
    rej = _wait_for(client, "E_TIMEOUT", 2)
    assert rej.get("E_TIMEOUT", 0) == 2 and rej.get("E_CANCELLED", 0) == 2, rej
    c.close()

    # a fetch whose client closes before the reply: no error beyond a count
    c = _authenticated(port, "tok", None)
    c.sendall(_frame({"op": "fetch", "fragments": None}))
    c.close()

    # the port still serves; nothing was counted as a bug or logged with a traceback
    assert client.fetch([0])[0][0] == 0
    h = client.sign(push_header(frag, 0, data, inc, 3))
    assert client.push(h, data)["status"] == "accepted"
    st = client.status()
    assert st["rejections"].get("E_INTERNAL", 0) == 0, st["rejections"]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR
    ]
