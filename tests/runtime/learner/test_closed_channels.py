"""A gRPC channel closed under a learner's threads (as a reconnect on another thread closes
one) is a typed, retried failure: the call is made again on a new channel, the learner
trains on and its pushes arrive; a call on a closed client fails as ``ChannelClosedError``
(CANCELLED), never as grpc's ``ValueError``."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import grpc
import pytest
import torch
from runtime_helpers import init_syncer, tiny_model

from ddiloco.runtime import DecoupledLearner
from ddiloco.runtime.learner.client import RETRYABLE, ChannelClosedError, SyncerClient
from ddiloco.runtime.syncer.server import SyncerServer, SyncerServerConfig


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
        with DecoupledLearner(
            model,
            opt,
            syncer=f"127.0.0.1:{server.port}",
            learner=0,
            P=2,
            H=2,
            tau=1,
            schedule="steps",
            tokens_per_step=64,
            token="tok",
            heartbeat_interval=timedelta(seconds=0.1),
        ) as dl:
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
