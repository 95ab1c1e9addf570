"""The data port (``ddiloco.runtime.transport.bulk``): pushes and fetches over framed TCP beside gRPC,
against a real ``ddiloco syncer`` process on 127.0.0.1. Same results as gRPC, the same
typed rejections, hostile bytes never reach the state machine, and a learner that cannot
reach the data port falls back to gRPC."""

from __future__ import annotations

import socket
import struct

import grpc
import pytest
import torch
from runtime_helpers import (
    assert_no_internal_error,
    expect_rejection,
    init_syncer,
    push_header,
    tiny_model,
)

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.transport import bulk, wire
from ddiloco.runtime.transport.bulk import BulkClient, BulkError, split_host
from ddiloco.runtime.transport.spec import fragmentation_from_spec


def _setup(s):
    client = SyncerClient(s.address, s.token)
    spec, inc = init_syncer(client, tiny_model())
    return client, fragmentation_from_spec(spec), inc


@pytest.mark.timeout(60)
def test_data_port_pushes_and_fetches_match_grpc(syncer_factory):
    s = syncer_factory()
    client, frag, inc = _setup(s)
    assert client.data is not None, "the Join reply advertises the data port"
    grpc_only = SyncerClient(s.address, s.token)  # never joins: fetches over gRPC
    assert grpc_only.data is None
    before = client.fetch(None)
    via_grpc = grpc_only.fetch(None)
    for p in before:
        assert before[p][0] == via_grpc[p][0] == 0
        assert all(torch.equal(a, b) for a, b in zip(before[p][1], via_grpc[p][1]))

    bytes_in = client.status()["counters"]["bytes_in"]  # the initial model so far
    moved = [t.clone().view(-1) - 0.01 for t in before[0][1]]
    data = b"".join(get_codec("fp32").encode(t) for t in moved)
    r = client.push(push_header(frag, 0, data, inc, seq=1), data)
    assert r["status"] == "accepted" and r["target_version"] == 1
    assert client.push(push_header(frag, 0, data, inc, seq=1), data)["status"] == "duplicate"
    after, after_grpc = client.fetch([0, 1]), grpc_only.fetch([0, 1])
    assert after[0][0] == after_grpc[0][0] == 1 and after[1][0] == 0
    for a, b, old in zip(after[0][1], after_grpc[0][1], before[0][1]):
        assert torch.equal(a, b) and not torch.equal(a, old)
    # an int8 delta push over the data port is reconstructed like one over gRPC
    c8 = get_codec("int8")
    data8 = b"".join(c8.encode(torch.full_like(t.view(-1), -0.02)) for t in before[1][1])
    r = client.push(push_header(frag, 1, data8, inc, seq=2, codec="int8", delta=True), data8)
    assert r["status"] == "accepted"
    st = client.status()
    assert st["versions"] == [1, 1] and st["merges"] == 2
    assert st["counters"]["bytes_in"] - bytes_in == len(data) * 2 + len(data8)


@pytest.mark.timeout(60)
def test_data_port_rejects_bad_requests_and_keeps_the_model(syncer_factory):
    s = syncer_factory("--max-push-bytes", "200000")
    client, frag, inc = _setup(s)
    port = client.data.port
    before = client.fetch(None)
    good = [t.clone().view(-1) for t in before[0][1]]
    data = b"".join(t.numpy().tobytes() for t in good)

    bad = BulkClient("127.0.0.1", port, "not-the-token")
    expect_rejection(
        grpc.StatusCode.UNAUTHENTICATED,
        "E_AUTH",
        lambda: bad.request({"op": "fetch", "fragments": [0]}),
    )
    wrong = list(frag.fragments[0].numels)
    wrong[0] += 1
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_SHAPE",
        lambda: client.push(push_header(frag, 0, data, inc, 1, numels=wrong), data),
    )
    nan = [t.clone() for t in good]
    nan[0][5] = float("inf")
    nan_data = b"".join(t.numpy().tobytes() for t in nan)
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_NONFINITE",
        lambda: client.push(push_header(frag, 0, nan_data, inc, 2), nan_data),
    )
    # the declared size and the bytes that follow disagree
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_SIZE",
        lambda: client.data.request(
            {"op": "push", **client.sign(push_header(frag, 0, data, inc, 3))}, [data, b"\0" * 8]
        ),
    )
    expect_rejection(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "E_OVERSIZE",
        lambda: client.data.request(
            {"op": "push", **client.sign(push_header(frag, 0, data, inc, 4))}, [b"\0" * 300_000]
        ),
    )
    expect_rejection(grpc.StatusCode.INVALID_ARGUMENT, "E_FRAGMENT", lambda: client.fetch([0, 9]))
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_FRAME",
        lambda: client.data.request({"op": "delete-everything"}),
    )
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION,
        "E_UNKNOWN_LEARNER",
        lambda: client.push(push_header(frag, 0, data, inc, 5, learner=3), data),
    )

    # hostile bytes: a header length over the limit, non-JSON, a prefix cut short
    for junk in (struct.pack(">IQ", 1 << 31, 0), struct.pack(">IQ", 3, 0) + b"\xff{]", b"\x00\x00"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(junk)
            raw.shutdown(socket.SHUT_WR)
            assert raw.recv(1 << 16) == b"", "the server closes without a reply"

    after = client.fetch(None)
    for p in before:
        assert after[p][0] == before[p][0] == 0
        assert all(torch.equal(a, b) for a, b in zip(after[p][1], before[p][1]))
    st = client.status()
    assert st["merges"] == 0
    for code in (
        "E_AUTH",
        "E_SHAPE",
        "E_NONFINITE",
        "E_SIZE",
        "E_FRAGMENT",
        "E_FRAME",
        "E_UNKNOWN_LEARNER",
    ):
        assert st["rejections"].get(code, 0) >= 1, (code, st["rejections"])
    assert_no_internal_error(st, (s.tmp / "syncer.log").read_text())
    # after all that, a good push over the data port still merges
    assert client.push(push_header(frag, 0, data, inc, 9), data)["status"] == "accepted"
    assert client.status()["versions"][0] == 1


@pytest.mark.timeout(60)
def test_unreachable_data_port_falls_back_to_grpc(syncer_factory):
    s = syncer_factory()
    client, frag, inc = _setup(s)
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    client.use_data_port(dead)
    before = client.fetch(None)  # falls back
    assert client.data is None and client.data_fetch is None and before[0][0] == 0
    moved = [t.clone().view(-1) + 0.01 for t in before[0][1]]
    data = b"".join(t.numpy().tobytes() for t in moved)
    assert client.push(push_header(frag, 0, data, inc, 1), data)["status"] == "accepted"
    # the next Join restores the advertised port
    client.unary("Join", {"learner": 0, "incarnation": inc}, control=True)
    assert client.data is not None and client.data.port != dead
    assert client.fetch([0])[0][0] == 1


@pytest.mark.timeout(60)
def test_data_port_off(syncer_factory):
    s = syncer_factory("--bulk-port", "-1")
    client, frag, inc = _setup(s)
    assert client.data is None
    before = client.fetch([0])
    data = b"".join(t.view(-1).numpy().tobytes() for t in before[0][1])
    assert client.push(push_header(frag, 0, data, inc, 1), data)["status"] == "accepted"


def test_split_host():
    assert split_host("10.0.0.5:50051") == "10.0.0.5"
    assert split_host("[::1]:50051") == "::1"
    assert split_host("syncer.internal:1") == "syncer.internal"


def test_deferred_pieces_are_made_in_their_turn():
    """A ``wire.Deferred`` piece (a delta-coded downlink's whole copy, tensor by tensor) is
    made when it is sent, in order, on both transports; the bytes are those of the pieces."""
    made: list[int] = []

    def piece(i: int, data: bytes) -> wire.Deferred:
        return wire.Deferred(len(data), lambda: made.append(i) or data)

    pieces = [b"ab", piece(0, b"cde"), memoryview(b"f"), b"", piece(1, b"gh"), b"ij"]
    assert bytes(wire.joined(pieces)) == b"abcdefghij" and made == [0, 1]

    class Plain:  # no sendmsg (as over TLS): one sendall per piece
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def sendall(self, b) -> None:
            self.sent.append(bytes(b))

    plain = Plain()
    bulk._send(plain, {"op": "x"}, pieces)  # type: ignore[arg-type]
    assert b"".join(plain.sent[1:]) == b"abcdefghij" and made == [0, 1] * 2
    a, b = socket.socketpair()
    with a, b:
        bulk._send(a, {"op": "x"}, pieces)
        hlen, plen = struct.unpack(">IQ", b.recv(12, socket.MSG_WAITALL))
        assert plen == 10 and b.recv(hlen, socket.MSG_WAITALL) == b'{"op":"x"}'
        assert b.recv(plen, socket.MSG_WAITALL) == b"abcdefghij"
    assert made == [0, 1] * 3
    with pytest.raises(ValueError, match="deferred piece of 3 bytes made 2"):
        wire.Deferred(3, lambda: b"ab").get()


@pytest.mark.timeout(30)
def test_connect_failure_is_retryable_and_marked():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    with pytest.raises(BulkError) as ei:
        BulkClient("127.0.0.1", dead, "t", connect_timeout_s=2).request({"op": "fetch"})
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and ei.value.connect_failed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_downlink(syncer_factory, bits):
    s = syncer_factory("--downlink-codec", f"int{bits}")
    client = SyncerClient(s.address, s.token)
    model = tiny_model()
    spec, _ = init_syncer(client, model)
    exact = {n: p.detach().float().view(-1) for n, p in model.named_parameters()}
    got = client.fetch(None)
    codec = get_codec(f"int{bits}")
    for f in fragmentation_from_spec(spec).fragments:
        version, tensors, nbytes = got[f.index]
        assert nbytes == sum(codec.nbytes(k) for k in f.numels) < sum(f.numels) * (bits + 1) / 8
        for name, t in zip(f.names, tensors):  # blockwise int-b: error <= absmax / (2^b - 1)
            x = exact[name]
            assert t.shape == x.shape
            assert (t - x).abs().max() <= x.abs().max() / (2**bits - 1) + 1e-7


def _silent_server(read: bool):
    """A data port that authenticates, then never answers (and, with ``read=False``, never
    reads either)."""
    import threading

    from ddiloco.runtime.transport import bulk as B

    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(20)

    def serve():
        c, _ = srv.accept()
        B._recv_header(c)
        B._send(c, {"ok": True})
        if read:
            scratch = bytearray(1 << 20)
            while c.recv_into(scratch):
                pass
        else:
            threading.Event().wait(15)
        c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


@pytest.mark.timeout(30)
@pytest.mark.parametrize("read", [True, False], ids=["no-reply", "no-read"])
def test_request_timeout_is_deadline_exceeded(read):
    """A syncer that stops answering (or reading) mid-request: the request ends after its
    timeout as DEADLINE_EXCEEDED, the connection is dropped, and the next request reconnects."""
    import time

    srv = _silent_server(read)
    client = BulkClient("127.0.0.1", srv.getsockname()[1], "t")
    payload = [bytes(8 << 20)] * (1 if read else 8)  # 64 MiB: more than the socket buffers
    t0 = time.monotonic()
    with pytest.raises(BulkError) as ei:
        client.request({"op": "push"}, payload, timeout_s=0.5)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value.details()
    assert time.monotonic() - t0 < 10
    assert client._sock is None
    srv.close()
