"""The delta-coded downlink (``sync.down_delta``) against a real syncer process: a learner
without a copy gets the fragment's chain copy whole in fp32, later fetches are the chain's
encoded steps from the learner's copy (its rounding error carried forward), every learner
lands on the same copy (within the rounding of the chain's int8 residual, which a copy sent
whole carries), a copy the syncer does not know by its token is sent whole again,
malformed copy lists are refused, and an exact fetch gets the published fp32 values."""

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


def _push_moved(client, frag, inc, seq, base, like, scale=0.05):
    """Learner 0 moves fragment 0 (fp32 parameters); with K = 1 it merges at once."""
    moved = [t.reshape(-1) + scale * torch.randn(t.numel()) for t in like]
    data = b"".join(get_codec("fp32").encode(t) for t in moved)
    h = push_header(frag, 0, data, inc, seq)
    h["base_version"] = base
    r = client.stream("Push", wire.chunks(client.sign(h), data))
    assert r["status"] == "accepted", r


@pytest.mark.timeout(90)
def test_fetches_are_the_chains_steps_from_the_learners_copy(syncer_factory):
    s = syncer_factory("--down-codec", "int4", "--down-delta", "--quorum", "1", "--no-grace")
    client = SyncerClient(s.address, s.token)
    spec, inc = init_syncer(client, tiny_model(), P=2)
    frag = fragmentation_from_spec(spec)
    numel = [sum(f.numels) for f in frag.fragments]
    int4 = get_codec("int4")
    step_bytes = sum(int4.nbytes(k) for k in frag.fragments[0].numels)
    exact_of = lambda: _flat(SyncerClient(s.address, s.token).fetch([0], exact=True), 0)  # noqa: E731

    first = client.fetch(None, learner=0)  # no copy yet: whole fragments, fp32
    assert [first[p][2] for p in (0, 1)] == [4 * n for n in numel]
    v0 = _flat(first, 0)
    assert torch.equal(v0, exact_of())  # the chain starts at the published version

    _push_moved(client, frag, inc, 1, 0, first[0][1])
    exact = exact_of()
    assert not torch.equal(exact, v0)

    got = client.fetch([0], learner=0)  # one encoded step of the chain
    assert got[0][0] == 1 and got[0][2] == step_bytes
    mine = _flat(got, 0)
    assert (mine - exact).abs().max().item() <= (exact - v0).abs().max().item() / 7 + 1e-7
    # a learner without a copy receives the chain's copy R whole: the copy the step built,
    # within the rounding of the chain's int8 residual (1/255 of one int4 step's rounding)
    rounding = (exact - v0).abs().max().item() / 7
    other = SyncerClient(s.address, s.token)
    whole = other.fetch([0], learner=1)
    assert whole[0][2] == 4 * numel[0]
    assert (_flat(whole, 0) - mine).abs().max().item() <= rounding / 127
    # nothing new: nothing sent, the copy stays
    again = client.fetch([0], learner=0)
    assert again[0][2] == 0 and torch.equal(_flat(again, 0), mine)

    # two more merges: learner 1's copy, two steps behind, receives both steps and lands
    # where learner 0 is (the same steps: its copies differ as they did)
    behind = client._mirrors[0]
    _push_moved(client, frag, inc, 2, 1, got[0][1])
    step2 = client.fetch([0], learner=0)
    _push_moved(client, frag, inc, 3, 2, step2[0][1])
    ahead = client.fetch([0], learner=0)
    caught_up = other.fetch([0], learner=1)
    assert caught_up[0][0] == 3 and caught_up[0][2] == 2 * step_bytes
    assert (_flat(caught_up, 0) - _flat(ahead, 0)).abs().max().item() <= rounding / 127
    # the rounding error is carried, not summed: within one step's rounding of the version
    assert (_flat(ahead, 0) - exact_of()).abs().max().item() < (exact - v0).abs().max().item() / 7
    # steps no live learner's copy needs are not kept: a copy of version 1 that learner 0
    # no longer holds (a reply it lost, say) is replaced whole
    late = SyncerClient(s.address, s.token)
    late._mirrors[0] = behind
    assert late.fetch([0], learner=0)[0][2] == 4 * numel[0]

    # a copy the syncer does not know by its token (a client that lost it, or a forged one)
    # is not built on: the fragment comes whole
    fresh = SyncerClient(s.address, s.token)
    assert fresh.fetch([0], learner=2)[0][2] == 4 * numel[0]
    fresh._mirrors[0] = (12345, fresh._mirrors[0][1])
    assert fresh.fetch([0], learner=2)[0][2] == 4 * numel[0]

    # a fetch that names no learner is not delta-coded; an exact one (an export, the
    # launcher's summary, an evaluation) gets the published fp32 values
    plain = SyncerClient(s.address, s.token).fetch([0])
    assert plain[0][2] == step_bytes
    assert not torch.equal(_flat(plain, 0), exact_of())

    # the same over the data port, where learners fetch once joined
    dp = SyncerClient(s.address, s.token)
    r = dp.unary("Join", {"learner": 5, "incarnation": -1, "fingerprint": spec_fingerprint(spec)})
    dp.use_data_port(r["bulk_port"])
    assert dp.data is not None
    assert [dp.fetch([0], learner=5)[0][2] for _ in range(2)] == [4 * numel[0], 0]


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
