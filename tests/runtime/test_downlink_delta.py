"""The delta-coded downlink (``sync.down_delta``) against a real syncer process: a learner
without a copy gets whole fp32 fragments, later fetches are deltas against its copy through
the downlink codec with the rounding error carried forward, a copy the syncer does not know
by its token is sent whole again, malformed copy lists are refused, and an exact fetch gets
the published fp32 values whatever the downlink."""

from __future__ import annotations

import grpc
import pytest
import torch
from runtime_helpers import expect_rejection, init_syncer, push_header, tiny_model

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.spec import fragmentation_from_spec, spec_fingerprint


def _flat(got: dict, p: int) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in got[p][1]])


@pytest.mark.timeout(90)
def test_fetches_are_deltas_against_the_learners_copy(syncer_factory):
    s = syncer_factory("--down-codec", "int4", "--down-delta", "--quorum", "1", "--no-grace")
    client = SyncerClient(s.address, s.token)
    spec, inc = init_syncer(client, tiny_model(), P=2)
    frag = fragmentation_from_spec(spec)
    numel = [sum(f.numels) for f in frag.fragments]
    int4 = get_codec("int4")

    first = client.fetch(None, learner=0)  # no copy yet: whole fragments, fp32
    assert [first[p][2] for p in (0, 1)] == [4 * n for n in numel]
    v0 = _flat(first, 0)

    # learner 0 moves fragment 0; with K = 1 the push is merged into version 1
    moved = [t.reshape(-1) + 0.05 * torch.randn(t.numel()) for t in first[0][1]]
    data = b"".join(get_codec("fp32").encode(t) for t in moved)
    r = client.stream("Push", wire.chunks(client.sign(push_header(frag, 0, data, inc, 1)), data))
    assert r["status"] == "accepted"

    exact = _flat(SyncerClient(s.address, s.token).fetch([0], learner=1), 0)  # no copy: fp32
    assert not torch.equal(exact, v0)
    errors, nbytes = [], []
    for _ in range(3):  # the same version again and again: the rounding error shrinks
        got = client.fetch([0], learner=0)
        assert got[0][0] == 1
        nbytes.append(got[0][2])
        errors.append((_flat(got, 0) - exact).abs().max().item())
    assert nbytes == [sum(int4.nbytes(k) for k in frag.fragments[0].numels)] * 3
    assert errors[0] <= (exact - v0).abs().max().item() / 7 + 1e-7  # int4: absmax / 15 each side
    assert errors[2] < errors[1] < errors[0]

    # a copy the syncer does not know by its token (a client that lost it, or a forged one)
    # is not built on: the fragment comes whole
    fresh = SyncerClient(s.address, s.token)
    assert fresh.fetch([0], learner=0)[0][2] == 4 * numel[0]
    fresh._mirrors[0] = (12345, fresh._mirrors[0][1])
    again = fresh.fetch([0], learner=0)
    assert again[0][2] == 4 * numel[0] and torch.equal(_flat(again, 0), exact)
    # the original client's copy is gone with the token it was given: it gets the whole too
    assert client.fetch([0], learner=0)[0][2] == 4 * numel[0]

    # a fetch that names no learner is not delta-coded; an exact one (an export, the
    # launcher's summary, an evaluation) gets the published fp32 values
    plain = SyncerClient(s.address, s.token).fetch([0])
    assert plain[0][2] == sum(int4.nbytes(k) for k in frag.fragments[0].numels)
    assert not torch.equal(_flat(plain, 0), exact)
    assert torch.equal(_flat(SyncerClient(s.address, s.token).fetch([0], exact=True), 0), exact)

    # the same over the data port, where learners fetch once joined
    dp = SyncerClient(s.address, s.token)
    r = dp.unary("Join", {"learner": 5, "incarnation": -1, "fingerprint": spec_fingerprint(spec)})
    dp.use_data_port(r["bulk_port"])
    assert dp.data is not None
    sizes = [dp.fetch([0], learner=5)[0][2] for _ in range(2)]
    assert sizes == [4 * numel[0], sum(int4.nbytes(k) for k in frag.fragments[0].numels)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "mirrors",
    [[[0]], [[0, 1, 2]], [[0, -1]], [[0, 1], [0, 2]], [["0", 1]], [[1 << 20, 1]]],
    ids=["short", "long", "negative-token", "duplicate", "string", "fragment-out-of-range"],
)
def test_malformed_copy_lists_are_refused(syncer_factory, mirrors):
    s = syncer_factory("--down-codec", "int4", "--down-delta")
    client = SyncerClient(s.address, s.token)
    init_syncer(client, tiny_model(), P=2)

    def fetch():
        req = wire.pack({"fragments": [0], "learner": 0, "mirrors": mirrors})
        for _ in client.bulk.unary_stream(wire.method("Fetch"))(req, metadata=client._md):
            pass

    expect_rejection(grpc.StatusCode.INVALID_ARGUMENT, "E_FRAME", fetch)
    assert client.fetch([0], learner=0)[0][0] == 0  # and the syncer serves on
