"""Liveness under load: stalled transfers cannot take the threads heartbeats and status
need; a learner's concurrent pushes are bounded."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from runtime_helpers import live_syncer

from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.transport import wire


@pytest.mark.timeout(90)
def test_stalled_push_streams_leave_heartbeats_and_status_alive():
    with live_syncer(max_workers=24, control_reserve=8, heartbeat_timeout_s=30.0) as live:
        server, a, inc = live.server, live.client, live.inc
        release = threading.Event()
        stalled: list[grpc.Future] = []
        attackers = [SyncerClient(live.address, "tok") for _ in range(4)]

        def never():  # an authenticated push stream that never sends its first frame
            release.wait(60)
            return
            yield

        try:
            for i in range(70):
                c = attackers[i % len(attackers)]
                stalled.append(
                    c.bulk.stream_unary(wire.method("Push")).future(
                        never(), timeout=60, metadata=c._md
                    )
                )
            time.sleep(1.0)
            t0 = time.monotonic()
            for _ in range(5):
                r = a.unary(
                    "Heartbeat", {"learner": 0, "incarnation": inc}, timeout_s=3.0, control=True
                )
                assert r["rejoin"] is False
                assert a.status(timeout_s=3.0)["live"] == [0]
            assert time.monotonic() - t0 < 10
            busy = [f for f in stalled if f.done()]
            assert len(busy) >= 70 - 16, "streams beyond the bulk slots are refused at once"
            for f in busy:
                assert f.exception().code() == grpc.StatusCode.UNAVAILABLE
                assert f.exception().details().startswith("E_BUSY")
            assert server.status()["rejections"]["E_BUSY"] >= 70 - 16
        finally:
            release.set()
            for f in stalled:
                f.cancel()
            for c in attackers:
                c.close()
