"""The data port's limits after authentication count sessions, not hosts: learners on one
host whose requests are all in service at once are each their own session and all served,
while the connections the token alone authenticated, and every connection before its
hello, still count against their host."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest
from runtime_helpers import live_syncer, push_header

from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.transport.bulk import BulkLimits
from ddiloco.runtime.transport.spec import spec_fingerprint

LEARNERS = 8


def _frame(header: dict, payload: bytes = b"", plen: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack(">IQ", len(h), len(payload) if plen is None else plen) + h + payload


def _recv_n(c: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = c.recv(n - len(out))
        assert chunk, "closed"
        out += chunk
    return out


def _reply(c: socket.socket) -> dict:
    hlen, _ = struct.unpack(">IQ", _recv_n(c, 12))
    return json.loads(_recv_n(c, hlen))


def _token_only(port: int, token: str) -> socket.socket:
    """A raw data-port connection past a hello that carries the token alone."""
    c = socket.create_connection(("127.0.0.1", port), timeout=20)
    c.sendall(_frame({"op": "hello", "token": token}))
    assert _reply(c) == {"ok": True}
    return c


def _refused(c: socket.socket) -> bool:
    """Whether the port closed ``c`` (a connection limit); False while it waits for a
    hello."""
    c.setblocking(False)
    try:
        return c.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.timeout(120)
def test_learners_on_one_host_are_each_a_session_and_hosts_stay_capped_before_it():
    limits = BulkLimits(handshake_timeout_s=30.0)  # the flood below waits for no deadline
    with live_syncer(heartbeat_timeout_s=600.0, data_limits=limits) as live:
        bulk, room = live.server._bulk_server, live.server.data.push_room
        assert bulk is not None and live.client.data is not None
        port, fp = live.client.data.port, spec_fingerprint(live.spec)
        clients, incs = [live.client], [live.inc]
        for m in range(1, LEARNERS + 2):  # learners 1..7, and 8, 9 to fill the push room
            c = SyncerClient(live.address, "tok")
            incs.append(c.unary("Join", {"learner": m, "incarnation": -1, "fingerprint": fp})[
                "incarnation"
            ])  # fmt: skip
            clients.append(c)
        got = live.client.fetch(None)
        data = {p: b"".join(t.numpy().tobytes() for t in ts) for p, (_, ts, _) in got.items()}
        big = max(data, key=lambda p: len(data[p]))

        # learners 8 and 9, on connections the token alone authenticated, each start a push
        # of the largest fragment and stop half-way: between them they hold the whole push
        # room, so every push after them waits for room while in service
        blockers = []
        for m in (8, 9):
            s = _token_only(port, "tok")
            h = clients[m].sign(push_header(live.frag, big, data[big], incs[m], 1, learner=m))
            half = len(data[big]) // 2
            s.sendall(_frame({"op": "push", **h}, data[big][:half], plen=len(data[big])))
            blockers.append((s, data[big][half:]))
        deadline = time.monotonic() + 10
        while room.used < room.capacity:
            assert time.monotonic() < deadline, "the push room fills"
            time.sleep(0.02)

        # 8 learners of this host push at once: all 8 are in service together (with the 2
        # above: 10 requests of 127.0.0.1)
        results: list = [None] * LEARNERS
        barrier = threading.Barrier(LEARNERS)

        def push(m: int) -> None:
            p = m % live.frag.P
            h = push_header(live.frag, p, data[p], incs[m], 1, learner=m)
            barrier.wait()
            try:
                results[m] = clients[m].push(h, data[p], timeout_s=30.0)["status"]
            except Exception as e:  # noqa: BLE001 - the test reports it
                results[m] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=push, args=(m,)) for m in range(LEARNERS)]
        waits0 = room.waits
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while room.waits - waits0 + sum(r is not None for r in results) < LEARNERS:
            assert time.monotonic() < deadline, "every push is in service or answered"
            time.sleep(0.02)
        for s, rest in blockers:  # the room frees: the waiting pushes go on
            s.sendall(rest)
            assert _reply(s)["status"] == "accepted"
        for t in threads:
            t.join(30)
        assert results == ["accepted"] * LEARNERS, results
        st = live.client.status()
        assert st["rejections"].get("E_BUSY", 0) == 0, st["rejections"]

        # before authentication a host is still capped: its connections beyond
        # max_connections_per_peer are closed at once. The learners' 16 authenticated
        # connections do not count against it; the token-only ones do.
        for s, _ in blockers[1:]:
            s.close()
        flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
        try:
            cap = limits.max_connections_per_peer - 1  # one token-only connection is open
            deadline = time.monotonic() + 10
            while sum(map(_refused, flood)) < len(flood) - cap:
                assert time.monotonic() < deadline, "the connections over the cap are closed"
                time.sleep(0.05)
            time.sleep(0.3)
            assert sum(map(_refused, flood)) == len(flood) - cap
            assert live.client.status()["rejections"].get("E_BUSY", 0) == len(flood) - cap
            # and the learners' own connections still serve them
            for m in range(LEARNERS):
                p = m % live.frag.P
                h = push_header(live.frag, p, data[p], incs[m], 2, learner=m)
                assert clients[m].push(h, data[p], timeout_s=10.0)["status"] == "accepted"
        finally:
            for s in flood:
                s.close()
            blockers[0][0].close()
            for c in clients[1:]:
                c.close()
