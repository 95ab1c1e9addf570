"""Synchronous DiLoCo on the real runtime: P = 1, tau = 0, quorum K = M and
``DecoupledLearner.wait_installs`` after each step. Every learner leaves each sync point
holding the same merged model, one version per round."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
from runtime_helpers import tiny_model

H, ROUNDS, M = 4, 3, 2


def _train(address: str, m: int, start: threading.Barrier, out: dict) -> None:
    from ddiloco.runtime import DecoupledLearner

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + m)
    seen = []
    with DecoupledLearner(
        model,
        syncer=address,
        learner=m,
        P=1,
        H=H,
        tau=0,
        schedule="steps",  # a push every H of its own steps, as synchronous DiLoCo does
        codec="fp32",
        token="test-token",
        heartbeat_interval=timedelta(milliseconds=200),
    ) as dl:
        start.wait(timeout=60)
        for step in range(1, H * ROUNDS + 1):
            x = torch.randint(0, 64, (4, 16), generator=g)
            opt.zero_grad()
            model(x, x)[1].backward()
            opt.step()
            dl.step(64)
            installed = dl.wait_installs(timeout=timedelta(seconds=60))
            if step % H == 0:
                assert installed == [0], (m, step, installed)
                assert not dl.sync.frags[0].waiting
                seen.append(
                    (
                        dl.sync.frags[0].base_version,
                        torch.cat([p.detach().flatten().clone() for p in model.parameters()]),
                    )
                )
            else:
                assert installed == []
    out[m] = seen


@pytest.mark.timeout(120)
def test_every_learner_waits_for_and_installs_the_same_merge(syncer_factory):
    s = syncer_factory("--quorum", str(M), "--no-grace", "--tau", "0")
    start, out = threading.Barrier(M), {}
    threads = [threading.Thread(target=_train, args=(s.address, m, start, out)) for m in range(M)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert sorted(out) == list(range(M)), "a learner thread failed (see the log)"
    for r in range(ROUNDS):
        (v0, p0), (v1, p1) = out[0][r], out[1][r]
        assert v0 == v1 == r + 1  # one merge of both pushes per round
        assert torch.equal(p0, p1)
    # the learners really trained apart between sync points: rounds differ
    assert not torch.equal(out[0][0][1], out[0][1][1])


def test_wait_installs_refuses_islands():
    from ddiloco.runtime import DecoupledLearner

    dl = DecoupledLearner.__new__(DecoupledLearner)
    dl.group = object()
    with pytest.raises(ValueError, match="islands"):
        dl.wait_installs()
