"""A gRPC channel closed under a learner's threads (as a reconnect on another thread closes
one) is a typed, retried failure: the call is made again on a new channel, the learner
trains on and its pushes arrive; a call on a closed client fails as ``ChannelClosedError``
(CANCELLED), never as grpc's ``ValueError``. Every other failure of a call (a reply that
cannot be read) is a ``TransportError``; and a learner whose channels and data-port
connections are cut under calls in flight while its syncer is restarted trains on."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from concurrent import futures
from datetime import timedelta

import grpc
import pytest
import torch
from runtime_helpers import init_syncer, tiny_model

from ddiloco.runtime import DecoupledLearner
from ddiloco.runtime.learner.client import (
    RETRYABLE,
    ChannelClosedError,
    SyncerClient,
    SyncerError,
    TransportError,
)
from ddiloco.runtime.syncer.server import SyncerServer, SyncerServerConfig
from ddiloco.runtime.transport import wire


@pytest.mark.timeout(60)
def test_a_call_on_a_closed_channel_is_made_on_a_new_one_and_a_closed_client_fails_typed():
    with SyncerServer(SyncerServerConfig(token="tok", bulk_port=None)) as server:
        client = SyncerClient(f"127.0.0.1:{server.port}", "tok")
        spec, _ = init_syncer(client, tiny_model())
        client.bulk.close()
        client.control.close()
        assert client.status()["fingerprint"]  # control: a new channel
        got = client.fetch([0])  # bulk, a streamed reply: a new channel
        assert got[0][0] == 0 and got[0][1]
        client.close()
        for call in (client.status, lambda: client.fetch([0])):
            with pytest.raises(ChannelClosedError) as ei:
                call()
            assert ei.value.code() == grpc.StatusCode.CANCELLED
            assert ei.value.code() in RETRYABLE and ei.value.details().startswith("E_CLOSED")


def _learner(model, opt, port: int) -> DecoupledLearner:
    """Learner 0 of a syncer on ``port``: two fragments, a push every step, heartbeats
    every 0.1 s."""
    return DecoupledLearner(
        model,
        opt,
        syncer=f"127.0.0.1:{port}",
        learner=0,
        P=2,
        H=2,
        tau=1,
        schedule="steps",
        tokens_per_step=64,
        token="tok",
        heartbeat_interval=timedelta(seconds=0.1),
    )


def _train(model, opt, x, steps: int) -> None:
    for _ in range(steps):
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        time.sleep(0.02)  # a step of real length: the threads' calls overlap the steps
        opt.step()  # the learner's step runs in the optimizer's post-step hook
        opt.zero_grad()


def _wait(what: str, ok, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_channels_closed_under_the_learners_threads_cost_no_training_and_no_push():
    # no data port: pushes, fetches, long polls and heartbeats all travel over gRPC
    with SyncerServer(SyncerServerConfig(token="tok", bulk_port=None)) as server:
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        with _learner(model, opt, server.port) as dl:
            _train(model, opt, x, 8)
            _wait("pushes accepted before", lambda: dl.stats["pushes_accepted"] >= 2)
            client = dl.client.primary
            stop, closes = threading.Event(), [0]

            def close_under_them() -> None:  # another thread, as a reconnect would
                while not stop.is_set():
                    client.bulk.close()
                    client.control.close()
                    closes[0] += 1
                    time.sleep(0.01)

            closer = threading.Thread(target=close_under_them, daemon=True)
            closer.start()
            try:
                _train(model, opt, x, 40)  # pushes and heartbeats meet closed channels
            finally:
                stop.set()
                closer.join()
            assert closes[0] > 20 and dl._thread_error is None
            accepted, merges = dl.stats["pushes_accepted"], server.state.merges
            _train(model, opt, x, 12)
            _wait(
                "pushes sent after the closes arrive and are merged",
                lambda: dl.stats["pushes_accepted"] > accepted + 2 and server.state.merges > merges,
            )
            st = SyncerClient(f"127.0.0.1:{server.port}", "tok")
            try:
                assert st.status()["learners"]["0"]["state"] == "live", "never declared dead"
            finally:
                st.close()
        assert dl._thread_error is None
        assert dl.report()["step"] == 60


def _garbling_syncer() -> tuple[grpc.Server, int]:
    """A gRPC server of the syncer's service whose replies cannot be read: a Join reply
    without its fields, a Status that is no frame, a Fetch stream of garbage."""
    junk = b"\x00\x00\x00\x09not json!"
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(lambda req, ctx: wire.pack({})),
        "Status": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"\x01"),
        "Watch": grpc.unary_unary_rpc_method_handler(lambda req, ctx: junk),
        "Fetch": grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter([junk])),
        "Push": grpc.stream_unary_rpc_method_handler(lambda it, ctx: (list(it), b"")[1]),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.mark.timeout(60)
def test_a_reply_that_cannot_be_read_is_a_typed_retryable_failure():
    from ddiloco.runtime.learner.sharded import ShardedClient

    server, port = _garbling_syncer()
    client = SyncerClient(f"127.0.0.1:{port}", "tok")
    try:
        calls = {
            "Status": client.status,
            "Watch": lambda: client.unary("Watch", {"learner": 0}),
            "Fetch": lambda: client.fetch([0]),
            "Push": lambda: client.push({"learner": 0, "fragment": 0}, b"x"),
        }
        for name, call in calls.items():
            with pytest.raises(TransportError) as ei:
                call()
            e = ei.value
            assert isinstance(e, SyncerError) and isinstance(e, grpc.RpcError), name
            assert e.code() == grpc.StatusCode.INTERNAL and e.code() in RETRYABLE, name
            assert e.details().startswith(f"E_TRANSPORT: {name} to 127.0.0.1:{port}"), e.details()
        # a Join reply without incarnation and boot id: typed before the learner reads it
        from ddiloco.runtime.learner.session import Session

        class Ctx:
            learner, incarnation, fingerprint, spec, process_id, process_key = (
                0,
                -1,
                "fp",
                {},
                "p",
                "k",
            )

        session = Session(Ctx(), ShardedClient(f"127.0.0.1:{port}", "tok"), None, None, dict)
        with pytest.raises(TransportError, match="E_TRANSPORT: a Join reply"):
            session.join()
        session.client.close()
    finally:
        client.close()
        server.stop(0)


def _cut_under_calls(client, stop: threading.Event, cuts: list) -> None:
    """Another thread cutting what the learner's calls travel on while they are in flight,
    as a reconnect does: the gRPC channels closed, the data-port sockets shut down under
    their requests, and the data port given up and taken up again."""
    i = 0
    while not stop.is_set():
        client.bulk.close()
        client.control.close()
        for c in (client.data, client.data_fetch):
            sock = getattr(c, "_sock", None)
            if sock is not None:
                try:  # a request in flight on it fails at once
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if i % 10 == 9 and client.data is not None:
            port, host = client.data.port, client.data.host
            client.use_data_port(None)  # pushes over gRPC for a moment
            time.sleep(0.02)
            client.use_data_port(port, host)
        cuts[0] += 1
        i += 1
        time.sleep(0.01)


@pytest.mark.timeout(240)
def test_a_learner_trains_on_through_cut_connections_and_a_syncer_restart(tmp_path):
    ck = tmp_path / "ck"
    config = dict(token="tok", checkpoint_dir=str(ck), heartbeat_timeout_s=30.0)
    server = SyncerServer(SyncerServerConfig(**config))  # the data port on (the default)
    port = server.start()
    assert server.bulk_port is not None
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    try:
        with _learner(model, opt, port) as dl:
            _train(model, opt, x, 8)
            _wait("pushes accepted before", lambda: dl.stats["pushes_accepted"] >= 2)
            client = dl.client.primary
            stop, cuts = threading.Event(), [0]
            cutter = threading.Thread(target=_cut_under_calls, args=(client, stop, cuts))
            cutter.start()
            try:
                _train(model, opt, x, 20)  # calls in flight meet cut connections
                server.close()  # the syncer goes away under load, and comes back
                _train(model, opt, x, 10)
                server = SyncerServer(SyncerServerConfig(**config, port=port, resume=True))
                server.start()
                _train(model, opt, x, 20)
            finally:
                stop.set()
                cutter.join()
            assert cuts[0] > 20 and dl._thread_error is None, dl._thread_error
            _wait("the learner rejoined the restarted syncer", lambda: dl.stats["reconnects"] >= 1)
            accepted, merges = dl.stats["pushes_accepted"], server.state.merges
            _train(model, opt, x, 12)
            _wait(
                "pushes arrive at the restarted syncer and are merged",
                lambda: dl.stats["pushes_accepted"] > accepted + 2 and server.state.merges > merges,
            )
        assert dl._thread_error is None
        assert dl.report()["step"] == 70
    finally:
        server.close()


class _GarblingProxy:
    """A TCP proxy in front of a syncer's data port that passes every byte through, except
    that the first ``garble`` fetch replies reach the learner without their ``items`` (a
    reply it cannot read)."""

    _PREFIX = struct.Struct(">IQ")  # the data port's frame prefix: header and payload lengths

    def __init__(self, upstream: int, garble: int) -> None:
        self.upstream, self.garble, self.garbled = upstream, garble, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pipe, args=(down, up), daemon=True).start()
            threading.Thread(target=self._replies, args=(up, down), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    @staticmethod
    def _exact(sock: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            got = sock.recv(n - len(buf))
            if not got:
                raise OSError("closed")
            buf += got
        return bytes(buf)

    def _replies(self, up: socket.socket, down: socket.socket) -> None:
        try:
            while True:
                hlen, plen = self._PREFIX.unpack(self._exact(up, self._PREFIX.size))
                head = self._exact(up, hlen)
                payload = self._exact(up, plen)
                h = json.loads(head)
                if "items" in h and self.garbled < self.garble:
                    self.garbled += 1
                    head = json.dumps({k: v for k, v in h.items() if k != "items"}).encode()
                down.sendall(self._PREFIX.pack(len(head), len(payload)) + head + payload)
        except OSError:
            pass
        finally:
            for s in (up, down):
                s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.timeout(120)
def test_fetch_replies_the_learner_cannot_read_cost_it_no_thread_and_no_install():
    with SyncerServer(SyncerServerConfig(token="tok")) as server:
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        proxy = _GarblingProxy(server.bulk_port, garble=3)
        try:
            with _learner(model, opt, server.port) as dl:
                dl.client.primary.use_data_port(proxy.port, "127.0.0.1")  # through the proxy
                installs = dl.stats["installs"]
                _train(model, opt, x, 30)
                _wait("three fetch replies garbled", lambda: proxy.garbled == 3)
                assert dl._thread_error is None, dl._thread_error
                _train(model, opt, x, 10)
                _wait("merged fragments installed after", lambda: dl.stats["installs"] > installs)
                _train(model, opt, x, 4)
            assert dl._thread_error is None
            assert dl.report()["step"] == 44
        finally:
            proxy.close()
