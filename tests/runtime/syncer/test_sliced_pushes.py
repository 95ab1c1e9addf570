"""A real syncer takes pushes, fetches and the initial model in slices (the ranks of a
sharded island each send their runs of a fragment's tensors): a push merges once its runs
tile the fragment, as the same values pushed whole, and runs that do not fit are refused."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from runtime_helpers import expect_rejection, live_syncer, push_header, tiny_model

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.syncer.server import SyncerServer, SyncerServerConfig
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.spec import model_spec, spec_fingerprint


def _halves(numels) -> list[list[list[int]]]:
    """Two ranks' runs of every tensor: the first half of its elements and the rest."""
    first, second = [], []
    for j, n in enumerate(numels):
        first.append([j, 0, n // 2 + n % 2])
        if n // 2:
            second.append([j, n // 2 + n % 2, n // 2])
    return [first, second]


def _data(values: list[torch.Tensor], runs: list[list[int]], codec) -> bytes:
    return b"".join(
        codec.encode(values[j].reshape(-1)[off : off + n].contiguous()) for j, off, n in runs
    )


def test_a_push_in_slices_merges_once_they_tile_the_fragment():
    with live_syncer(P=2) as live:
        frag, c = live.frag, live.client
        codec = get_codec("bf16")
        p = 0
        names = frag.fragments[p].names
        theta = {n: t.clone() for n, t in live.server.state.global_params().items()}
        values = [theta[n] + 0.01 for n in names]
        first, second = _halves(frag.fragments[p].numels)
        d1, d2 = _data(values, first, codec), _data(values, second, codec)
        # a run holding a NaN or an inf is refused, and names its tensor and elements
        for bad_value, name in ((float("nan"), "bf16"), (float("inf"), "fp32")):
            broken = [v.clone() for v in values]
            broken[0].view(-1)[1] = bad_value
            dx = _data(broken, first, get_codec(name))
            hx = push_header(frag, p, dx, live.inc, seq=1, codec=name, slices=first)
            expect_rejection(
                grpc.StatusCode.INVALID_ARGUMENT, "E_NONFINITE", lambda h=hx, d=dx: c.push(h, d)
            )
        h1 = push_header(frag, p, d1, live.inc, seq=1, codec="bf16", slices=first)
        r = c.push(h1, d1)
        assert r["status"] == "accepted" and r["partial"] and r["target_version"] == 1
        assert live.server.state.version(p) == 0  # half a push merges nothing
        # the other rank's push must carry the same counters
        bad = push_header(frag, p, d2, live.inc, seq=1, codec="bf16", slices=second, c_steps=5)
        expect_rejection(grpc.StatusCode.INVALID_ARGUMENT, "E_SHAPE", lambda: c.push(bad, d2))
        overlap = push_header(frag, p, d1, live.inc, seq=1, codec="bf16", slices=first)
        expect_rejection(grpc.StatusCode.INVALID_ARGUMENT, "E_SHAPE", lambda: c.push(overlap, d1))
        h2 = push_header(frag, p, d2, live.inc, seq=1, codec="bf16", slices=second)
        r = c.push(h2, d2)
        assert r["status"] == "accepted" and not r.get("partial")
        assert live.server.state.version(p) == 1
        assert c.push(h2, d2)["status"] == "duplicate"  # a retried part: merged already
        # the merge is the whole push's: learner 0 alone, one outer step on theta - pushed
        whole = SyncerServer(SyncerServerConfig(token="t2"))
        try:
            port = whole.start()
            c2 = SyncerClient(f"127.0.0.1:{port}", "t2")
            from runtime_helpers import init_syncer

            _, inc2 = init_syncer(c2, tiny_model(), P=2)
            data = b"".join(codec.encode(v) for v in values)
            assert (
                c2.push(push_header(frag, p, data, inc2, seq=1, codec="bf16"), data)["status"]
                == "accepted"
            )
            a = live.server.state.frags[p].theta
            b = whole.state.frags[p].theta
            assert all(torch.equal(x, y) for x, y in zip(a, b))
            c2.close()
        finally:
            whole.close()
        # a rank fetches its runs of the published fragment (fp32: the values themselves)
        got = c.fetch([p], slices=[[p, j, off, n] for j, off, n in second])
        v, ts, _ = got[p]
        assert v == 1
        for (j, off, n), t in zip(second, ts):
            assert torch.equal(t, live.server.state.frags[p].theta[j].reshape(-1)[off : off + n])


def test_runs_outside_their_tensors_and_a_delta_coded_downlink_are_refused():
    with live_syncer(P=2, downlink_delta=True) as live:
        frag, c = live.frag, live.client
        n0 = frag.fragments[0].numels[0]
        data = get_codec("fp32").encode(torch.zeros(4))
        h = push_header(frag, 0, data, live.inc, seq=1, slices=[[0, n0 - 2, 4]])
        expect_rejection(grpc.StatusCode.INVALID_ARGUMENT, "E_SHAPE", lambda: c.push(h, data))
        expect_rejection(
            grpc.StatusCode.FAILED_PRECONDITION,
            "E_SPEC",
            lambda: c.fetch([0], learner=0, slices=[[0, 0, 0, 4]]),
        )


def test_the_initial_model_from_the_uploads_of_an_islands_ranks():
    model = tiny_model()
    spec = model_spec(model, 2)
    params = [t.detach().float() for t in model.parameters()]
    numels = [math.prod(s) for s in spec["shapes"]]
    server = SyncerServer(SyncerServerConfig(token="tok"))
    try:
        port = server.start()
        c = SyncerClient(f"127.0.0.1:{port}", "tok")
        for k, runs in enumerate(_halves(numels)):
            data = _data(params, runs, get_codec("fp32"))
            head = {"spec": spec, "nbytes": len(data), "pieces": runs, "upload": "island-1"}
            r = c.stream("Init", wire.chunks(head, data))
            assert r["accepted"] == (k == 1) and bool(r.get("partial")) == (k == 0)
        fp = spec_fingerprint(spec)
        assert not c.unary("Join", {"learner": 0, "incarnation": -1, "fingerprint": fp})[
            "need_init"
        ]
        got = server.state.global_params()
        for n, t in zip(spec["names"], params):
            assert torch.equal(got[n].reshape(-1), t.reshape(-1))
        c.close()
    finally:
        server.close()


@pytest.mark.parametrize("R", [2, 3])
def test_island_plans_tile_every_tensor_and_share_the_pushes(R):  # noqa: N803
    from ddiloco.algorithm.fragments import fragment_parameters
    from ddiloco.runtime.learner.layout import IslandPlan, Run

    shapes = {"a": (6, 4), "b": (5,), "c": (3,)}
    frag = fragment_parameters([(n, math.prod(s), 4) for n, s in shapes.items()], P=2)
    runs = []
    for r in range(R):  # an FSDP2 shard of dim 0 each; c replicated on every rank
        d = {}
        for n, s in shapes.items():
            rows, per = s[0], math.prod(s[1:])
            step = -(-rows // R)
            a, b = min(rows, r * step), min(rows, (r + 1) * step)
            d[n] = Run(a * per, (b - a) * per) if n != "c" else Run(0, 3)
        runs.append(d)
    plans = [IslandPlan(frag, runs, r) for r in range(R)]
    for p, f in enumerate(frag.fragments):
        for j, n in enumerate(f.names):
            pushed = sorted(
                (pc.offset, pc.numel) for pl in plans for pc in pl.pushes(p) if pc.j == j
            )
            total = sum(k for _, k in pushed)
            assert total == math.prod(shapes[n])  # each element pushed by exactly one rank
        if "c" in f.names:  # the replicated tensor is pushed by rank p mod R
            j = f.names.index("c")
            assert [r for r, pl in enumerate(plans) if any(pc.j == j for pc in pl.pushes(p))] == [
                p % R
            ]
    bad = [dict(runs[0]) for _ in range(R)]  # every rank the same half of "a"
    with pytest.raises(ValueError, match="hold"):
        IslandPlan(frag, bad, 0)
