"""Numbers that would break the state machine are refused at the boundary, on both
transports, with typed errors; the syncer keeps merging and publishing afterwards."""

from __future__ import annotations

import json
import socket
import struct
import time

import grpc
import pytest
import torch
from runtime_helpers import expect_rejection, init_syncer, live_syncer, push_header, tiny_model

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.bulk import BulkClient, split_host
from ddiloco.runtime.transport.spec import fragmentation_from_spec


def _raw_frame(header_bytes: bytes) -> bytes:
    return struct.pack(">I", len(header_bytes)) + header_bytes


@pytest.mark.timeout(90)
def test_out_of_range_numbers_are_refused_and_merging_goes_on(syncer_factory):
    s = syncer_factory()
    client = SyncerClient(s.address, s.token)
    spec, inc = init_syncer(client, tiny_model())
    frag = fragmentation_from_spec(spec)
    grpc_only = SyncerClient(s.address, s.token)
    base = client.fetch([0])[0][1]
    data = b"".join(get_codec("fp32").encode(t.view(-1) - 0.01) for t in base)
    seq = (inc << 32) + 1
    bad = {
        "c_tokens": 10**400,
        "seq": 2**70,
        "c_steps": -1,
        "base_version": 1.5,
        "learner": True,
        "numels": [1] * 5 + [[1]],
        "fragment": "0",
    }
    for key, value in bad.items():
        h = {**push_header(frag, 0, data, inc, seq), key: value}
        expect_rejection(
            grpc.StatusCode.INVALID_ARGUMENT,
            "E_FRAME",
            lambda: grpc_only.stream("Push", wire.chunks(h, data)),  # noqa: B023
        )
        expect_rejection(grpc.StatusCode.INVALID_ARGUMENT, "E_FRAME", lambda: client.push(h, data))  # noqa: B023
    hb = lambda rep: client.unary("Heartbeat", {"learner": 0, "incarnation": inc, "report": rep})  # noqa: E731
    for rep in ({"fetch_s": "x"}, {"step_s": 1e308}, {"step_s": -1.0}, {"step": 2**64}):
        expect_rejection(grpc.StatusCode.INVALID_ARGUMENT, "E_FRAME", lambda: hb(rep))  # noqa: B023
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_FRAME",
        lambda: client.unary("Watch", {"learner": 0, "timeout_s": "abc"}),
    )
    # a fetch naming a fragment twice (the reply would repeat it), on both transports
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT, "E_FRAME", lambda: client.fetch([0] * 20_000)
    )
    expect_rejection(grpc.StatusCode.INVALID_ARGUMENT, "E_FRAME", lambda: grpc_only.fetch([0, 0]))
    # a 10k-deep header: refused as a frame error, not a crash of the handler
    deep = b'{"learner":' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_FRAME",
        lambda: grpc_only.bulk.unary_unary(wire.method("Heartbeat"))(
            _raw_frame(deep), timeout=10, metadata=grpc_only._md
        ),
    )

    # every rejection above was typed and counted, none was an internal error, and a
    # valid push still merges and is published
    r = client.push(push_header(frag, 0, data, inc, seq), data)
    assert r["status"] == "accepted" and r["target_version"] == 1
    assert hb({"fetch_s": 0.01, "step_s": 0.1, "step": 4})["rejoin"] is False
    assert client.fetch([0])[0][0] == 1
    st = client.status()
    assert st["versions"][0] == 1
    assert st["rejections"].get("E_FRAME", 0) >= 2 * len(bad) + 8, st["rejections"]
    assert st["rejections"].get("E_INTERNAL", 0) == 0, st["rejections"]
    grpc_only.close()
    client.close()


def _hello_reply(port: int, header: bytes) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(struct.pack(">IQ", len(header), 0) + header)
        pre = c.recv(12, socket.MSG_WAITALL)
        hlen, _ = struct.unpack(">IQ", pre)
        return json.loads(c.recv(hlen, socket.MSG_WAITALL))


@pytest.mark.timeout(60)
def test_data_port_hello_of_any_shape_gets_a_typed_refusal(syncer_factory):
    s = syncer_factory()
    client = SyncerClient(s.address, s.token)
    init_syncer(client, tiny_model())
    port = client.data.port
    for token in (5, [s.token], None, {"a": 1}):
        r = _hello_reply(port, json.dumps({"op": "hello", "token": token}).encode())
        assert r["grpc"] == "UNAUTHENTICATED" and r["error"].startswith("E_AUTH"), r
    deep = b'{"op":"hello","token":' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        try:  # over the hello size and depth bounds: closed (or reset), no reply
            c.sendall(struct.pack(">IQ", len(deep), 0) + deep)
            assert c.recv(1 << 16) == b""
        except (ConnectionResetError, BrokenPipeError):
            pass
    # the port still serves an honest client
    ok = BulkClient(split_host(s.address), port, s.token)
    h, _ = ok.request({"op": "fetch", "fragments": [1]})
    assert [i["fragment"] for i in h["items"]] == [1]
    ok.close()
    assert torch.is_tensor(client.fetch([0])[0][1][0])
    client.close()


@pytest.mark.timeout(60)
def test_a_failed_publication_is_counted_and_retried_never_lost():
    with live_syncer() as live:
        server, client, inc, frag = live.server, live.client, live.inc, live.frag
        real, failures = server.publication.encode_down, [1]

        def flaky(params):  # the first publication after the merge runs out of memory
            if failures:
                failures.pop()
                raise MemoryError("injected")
            return real(params)

        server.publication.encode_down = flaky  # type: ignore[method-assign]
        base = client.fetch([0])[0][1]
        data = b"".join(get_codec("fp32").encode(t.view(-1) - 0.01) for t in base)
        r = client.push(push_header(frag, 0, data, inc, (inc << 32) + 1), data)
        assert r["status"] == "accepted"
        deadline = time.monotonic() + 5
        while client.status()["versions"][0] != 1:
            assert time.monotonic() < deadline, "the merged version is published on retry"
            time.sleep(0.05)
        st = client.status()
        assert st["counters"]["publish_errors"] == 1 and st["merges"] == 1
        assert client.fetch([0])[0][0] == 1
