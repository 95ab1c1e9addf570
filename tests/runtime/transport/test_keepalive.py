"""A learner's gRPC connection survives idle stretches: the syncer accepts the clients'
keepalive pings (gRPC servers otherwise answer pings faster than every 5 minutes on an idle
connection with GOAWAY "too_many_pings", and the client reconnects)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from ddiloco.runtime.transport import wire


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_idle_connection_keepalive_pings_do_not_earn_a_goaway(syncer_factory):
    s = syncer_factory()
    # the clients' options, with pings every 6 s instead of 10 s (still above the syncer's
    # 5 s minimum) so that gRPC's default policy would have sent GOAWAY within ~20 s
    opts = dict(wire.GRPC_OPTIONS)
    opts["grpc.keepalive_time_ms"] = 6_000
    ch = grpc.insecure_channel(s.address, list(opts.items()))
    states: list[grpc.ChannelConnectivity] = []
    lock = threading.Lock()

    def seen(state: grpc.ChannelConnectivity) -> None:
        with lock:
            states.append(state)

    try:
        ch.subscribe(seen)
        r = ch.unary_unary(wire.method("Status"))(
            wire.pack({}), timeout=10, metadata=((wire.TOKEN_METADATA, s.token),)
        )
        assert "counters" in wire.unpack(r)[0]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                if grpc.ChannelConnectivity.READY in states:
                    break
            time.sleep(0.05)
        with lock:
            ready_at = states.index(grpc.ChannelConnectivity.READY)
        time.sleep(22)  # idle: three or more pings without data
        with lock:
            after = states[ready_at + 1 :]
        assert after == [], f"the idle connection left READY: {[x.name for x in after]}"
    finally:
        ch.unsubscribe(seen)
        ch.close()
