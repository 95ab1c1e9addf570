"""A hot standby's replication (``ddiloco.runtime.syncer.replica``): rounds over real gRPC
into a standby's store, deltas of the merged fragment only, a base the standby lacks, a
round of an older epoch refused. The election around it is in ``test_ha.py``."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from ddiloco.runtime.syncer.checkpoint import CHECKPOINT_NAME, load_checkpoint
from ddiloco.runtime.syncer.replica import REPLICATE, ReplicaRefused, ReplicaStore, Replicator
from ddiloco.runtime.transport import wire

_NEG: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _neg(t: torch.Tensor) -> torch.Tensor:
    """-t, the same tensor object for the same t (the state never writes one in place:
    a fragment not merged keeps its very tensors, which is how a round finds the merged)."""
    if id(t) not in _NEG:
        _NEG[id(t)] = (t, -t)  # t kept alive: its id is never reused
    return _NEG[id(t)][1]


def _snap(theta: list[list[torch.Tensor]], versions: list[int]) -> dict:
    return {
        "state": {
            "theta": [list(ts) for ts in theta],
            "momentum": [[_neg(t) for t in ts] for ts in theta],
            "merges": sum(versions),
        },
        "versions": versions,
        "merged_seq": {"0": {"0": 3}},
    }


class _Lease:
    def __init__(self) -> None:
        self.ok = True

    def valid(self) -> bool:
        return self.ok


@pytest.fixture
def standby(tmp_path):
    store = ReplicaStore(tmp_path / "replica")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handlers = {REPLICATE: grpc.stream_unary_rpc_method_handler(store.handler(lambda ctx: True))}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield store, f"127.0.0.1:{port}"
    server.stop(None)


def _held(store: ReplicaStore) -> tuple[list[float], list[int], dict]:
    ck = load_checkpoint(store.directory / CHECKPOINT_NAME)
    return [float(ts[0][0]) for ts in ck["state"]["theta"]], ck["versions"], ck["merged_seq"]


@pytest.mark.timeout(60)
def test_rounds_send_the_merged_fragment_and_the_standby_holds_every_version(standby):
    store, address = standby
    theta = [[torch.full((1000,), float(p)), torch.full((10,), float(p))] for p in range(4)]
    rep = Replicator(7, _Lease(), "tok", lambda: {address: (11, False)})
    first = rep.round(_snap(theta, [0, 0, 0, 0]))
    assert first is not None and first.full == 1 and first.standbys == 1
    assert store.synced and (store.epoch, store.seq) == (7, 1)
    theta[2] = [torch.full((1000,), 9.0), torch.full((10,), 9.0)]  # fragment 2 merged
    second = rep.round(_snap(theta, [0, 0, 1, 0]))
    assert second is not None and second.full == 0
    # one fragment of four: a quarter of the tensors' bytes, and the header
    assert second.bytes < first.bytes / 3, (first.bytes, second.bytes)
    assert _held(store) == ([0.0, 1.0, 9.0, 3.0], [0, 0, 1, 0], {"0": {"0": 3}})
    ck = load_checkpoint(store.directory / CHECKPOINT_NAME)
    assert torch.equal(ck["state"]["momentum"][2][0], -theta[2][0])
    assert rep.counters["replications"] == 2
    # the standby lost its state (a restart): the next round is sent whole again
    store.forget()
    theta[0] = [torch.full((1000,), 5.0), torch.full((10,), 5.0)]
    third = rep.round(_snap(theta, [1, 0, 1, 0]))
    assert third is not None and third.full == 1
    assert _held(store)[:2] == ([5.0, 1.0, 9.0, 3.0], [1, 0, 1, 0])
    rep.close()


@pytest.mark.timeout(60)
def test_a_round_of_an_older_epoch_is_refused_and_a_lost_lease_publishes_nothing(standby):
    store, address = standby
    theta = [[torch.ones(10)] for _ in range(2)]
    new = Replicator(9, _Lease(), "tok", lambda: {address: (1, False)})
    assert new.round(_snap(theta, [4, 4])) is not None
    with pytest.raises(ReplicaRefused) as ei:
        store.apply(
            {"epoch": 8, "seq": 50, "base": 0, "full": True, "snapshot": {}}, memoryview(b"")
        )
    assert "E_STALE_EPOCH" in ei.value.details
    store.note_epoch(12)  # a newer leader read from etcd
    lease = _Lease()
    old = Replicator(9, lease, "tok", lambda: {address: (1, False)}, retry_s=0.01)
    calls = []

    def refused(*a):
        calls.append(a)
        if len(calls) >= 3:
            lease.ok = False  # this leader's lease ends while the standby refuses it
        return old_send(*a)

    old_send, old._send = old._send, refused
    assert old.round(_snap(theta, [5, 5])) is None  # nothing of it may be published
    assert _held(store)[1] == [4, 4] and len(calls) >= 3
