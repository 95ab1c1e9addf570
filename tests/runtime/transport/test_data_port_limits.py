"""The data port before authentication: a small hello, a handshake deadline, connections
bounded in total and per peer, and no thread held by a slow, silent or idle connection, on
plain TCP and on TLS."""

from __future__ import annotations

import json
import socket
import ssl
import struct
import time
from pathlib import Path

import pytest
from runtime_helpers import (
    SyncerProcess,
    assert_no_internal_error,
    init_syncer,
    self_signed_cert,
    tiny_model,
)

from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.transport.bulk import BulkClient

LIMITS = (
    "--handshake-timeout",
    "1",
    "--max-connections",
    "128",
    "--max-connections-per-peer",
    "64",
)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count")


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """True if the server closes ``sock`` (EOF or reset) within ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (socket.timeout, TimeoutError):
        return False


def _hello(token: str) -> bytes:
    h = json.dumps({"op": "hello", "token": token}).encode()
    return struct.pack(">IQ", len(h), 0) + h


@pytest.mark.timeout(120)
def test_pre_auth_limits_on_plain_tcp(syncer_factory):
    s = syncer_factory(*LIMITS)
    client = SyncerClient(s.address, s.token)
    init_syncer(client, tiny_model())
    port = client.data.port
    base_threads = _threads(s.proc.pid)

    # 200 prefixes announcing a 1 MiB header: each refused before anything is allocated
    socks = []
    for _ in range(200):
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        with __import__("contextlib").suppress(OSError):
            c.sendall(struct.pack(">IQ", 1 << 20, 0))
        socks.append(c)
    assert all(_closed_within(c, 5.0) for c in socks)
    for c in socks:
        c.close()

    # a sender of one byte every 0.3 s is cut off at the 1 s handshake deadline
    slow = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0 = time.monotonic()
    closed = False
    for b in _hello(s.token):
        try:
            slow.sendall(bytes([b]))
        except OSError:
            closed = True
            break
        time.sleep(0.3)
        if time.monotonic() - t0 > 4:
            break
    assert closed or _closed_within(slow, 1.0), "a slow hello is not held past the deadline"
    assert time.monotonic() - t0 < 5
    slow.close()

    # silent connections: beyond 64 from one peer they are closed at once, the rest at
    # the deadline; none holds a thread meanwhile
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(70)]
    time.sleep(0.3)
    assert _threads(s.proc.pid) <= base_threads + 2
    refused_at_once = sum(_closed_within(c, 0.2) for c in silent)
    assert refused_at_once >= 70 - 64, refused_at_once  # at least those over the peer's cap
    assert all(_closed_within(c, 3.0) for c in silent)
    for c in silent:
        c.close()

    # 30 authenticated idle connections hold no thread either
    clients = [BulkClient("127.0.0.1", port, s.token) for _ in range(30)]
    for c in clients:
        assert c.request({"op": "fetch", "fragments": [0]})[0]["items"][0]["fragment"] == 0
    time.sleep(0.3)
    assert _threads(s.proc.pid) <= base_threads + 16 + 2  # at most the worker pool
    idle_threads = _threads(s.proc.pid)
    more = [BulkClient("127.0.0.1", port, s.token) for _ in range(20)]
    for c in more:
        c.request({"op": "fetch", "fragments": [1]})
    assert _threads(s.proc.pid) <= idle_threads + 1
    for c in clients + more:
        c.close()

    st = client.status()
    rej = st["rejections"]
    # each of the 200 prefixes, the slow hello and the 70 silent connections is refused
    # once: for its handshake, or at once as busy when more than 64 of this peer's are
    # open (the 200 prefixes too, on a machine slow to close them)
    assert rej.get("E_HANDSHAKE", 0) + rej.get("E_BUSY", 0) >= 200 + 1 + 70, rej
    assert rej.get("E_BUSY", 0) >= 70 - 64, rej
    assert client.fetch([0])[0][0] == 0  # the port still serves
    assert_no_internal_error(client.status(), (s.tmp / "syncer.log").read_text())
    client.close()


@pytest.mark.timeout(120)
def test_pre_auth_limits_on_tls(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    s = SyncerProcess(tmp_path, "tok", "--tls-cert", str(cert), "--tls-key", str(key), *LIMITS)
    try:
        client = SyncerClient(s.address, "tok", tls_ca=str(cert))
        init_syncer(client, tiny_model())
        port = client.data.port
        base_threads = _threads(s.proc.pid)
        ctx = ssl.create_default_context(cafile=str(cert))
        # no TLS handshake at all, and a TLS handshake then nothing: both closed in time
        bare = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(10)]
        tls = [
            ctx.wrap_socket(
                socket.create_connection(("127.0.0.1", port), timeout=5),
                server_hostname="127.0.0.1",
            )
            for _ in range(10)
        ]
        assert _threads(s.proc.pid) <= base_threads + 2
        t0 = time.monotonic()
        assert all(_closed_within(c, 4.0) for c in bare + tls)
        assert time.monotonic() - t0 < 5
        # an oversized hello over TLS is refused at once
        big = ctx.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="127.0.0.1"
        )
        big.sendall(struct.pack(">IQ", 1 << 20, 0))
        assert _closed_within(big, 1.0)
        for c in bare + tls + [big]:
            c.close()
        assert client.fetch([0])[0][0] == 0
        st = client.status()
        assert st["rejections"].get("E_HANDSHAKE", 0) >= 21, st["rejections"]
        assert_no_internal_error(st, (tmp_path / "syncer.log").read_text())
        client.close()
    finally:
        s.close()
