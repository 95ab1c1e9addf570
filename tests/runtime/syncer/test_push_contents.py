"""What a push carries, on the real syncer: NaN or inf is refused before the merge on both
transports (whole fp32 parameters and codec-coded deltas), and the merge guard
(``sync.norm_clip``) clips a wild outer gradient and counts it where ``ddiloco status``
shows it."""

from __future__ import annotations

import contextlib

import grpc
import pytest
import torch
from runtime_helpers import expect_rejection, live_syncer, push_header

from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.syncer_state import SyncerConfig
from ddiloco.runtime.launch.status import format_status
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.transport import wire


@contextlib.contextmanager
def _live(syncer: SyncerConfig):
    with live_syncer(heartbeat_timeout_s=600.0, syncer=syncer) as live:
        assert live.client.data is not None
        yield live.server, live.client, live.frag, live.inc


def _send(client: SyncerClient, transport: str, header: dict, data: bytes) -> dict:
    if transport == "data":
        return client.push(header, data)  # signs it; the data port
    return client.stream("Push", wire.chunks(client.sign(header), data, chunk_bytes=4096))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["grpc", "data"])
def test_non_finite_pushes_are_refused_before_the_merge(transport):
    with _live(SyncerConfig(history=2)) as (server, client, frag, inc):
        before = client.fetch(None)
        good = [t.clone().view(-1) for t in before[0][1]]
        seq = 0
        for codec, delta, bad in (
            ("fp32", False, float("nan")),
            ("fp32", False, float("-inf")),
            ("bf16", True, float("inf")),
            ("bf16", True, float("nan")),
            ("fp32", True, float("nan")),
        ):
            c = get_codec(codec)
            ts = [torch.zeros_like(t) if delta else t.clone() for t in good]
            ts[-1][-1] = bad  # the last element of the last tensor
            data = b"".join(c.encode(t) for t in ts)
            seq += 1
            h = push_header(frag, 0, data, inc, seq, codec, delta=delta)
            expect_rejection(
                grpc.StatusCode.INVALID_ARGUMENT,
                "E_NONFINITE",
                lambda h=h, data=data: _send(client, transport, h, data),
            )
        st = client.status()
        assert st["rejections"].get("E_NONFINITE", 0) == 5, st["rejections"]
        assert st["merges"] == 0 and st["versions"] == [0, 0]
        assert server.state.ledger[0].pushes_merged == 0
        after = client.fetch(None)
        assert all(torch.equal(a, b) for a, b in zip(after[0][1], before[0][1]))
        # a finite push still merges
        data = b"".join(t.numpy().tobytes() for t in good)
        assert (
            _send(client, transport, push_header(frag, 0, data, inc, 99), data)["status"]
            == "accepted"
        )


@pytest.mark.timeout(60)
def test_the_real_syncer_clips_a_wild_outer_gradient_and_counts_it():
    with _live(SyncerConfig(norm_clip=3.0)) as (server, client, frag, inc):
        p = 0
        for seq in range(1, 13):  # ordinary pushes, then the wild one
            version, theta, _ = client.fetch([p])[p]
            step = 1e-3 if seq < 12 else 1.0
            moved = [t.view(-1) - step for t in theta]
            data = b"".join(t.numpy().tobytes() for t in moved)
            h = push_header(frag, p, data, inc, seq, base_version=version)
            assert client.push(h, data)["status"] == "accepted"
        _, after, _ = client.fetch([p])[p]
        # one learner, K = 1: the wild push moved the fragment about 3 x an ordinary one
        # (the outer step's momentum adds the earlier ones), not 1000 x
        shift = max(float((a.view(-1) - t.view(-1)).abs().max()) for a, t in zip(after, theta))
        assert shift < 0.05, shift
        st = client.status()
        assert st["counters"]["clipped_pushes"] == 1, st["counters"]
        assert "merge guard: 1 outer gradients clipped" in format_status(st)
