"""Every incoming message is validated before it reaches the syncer state machine: bad
pushes are rejected with typed errors and the global model is unchanged."""

from __future__ import annotations

import time
from datetime import timedelta

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
from ddiloco.runtime.learner.client import SyncerClient, SyncerError
from ddiloco.runtime.learner.hook import DecoupledLearner
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.spec import fragmentation_from_spec


def _push(client, frag, p, tensors, *, inc, seq=1, codec="fp32", **override):
    c = get_codec(codec)
    data = b"".join(c.encode(t) for t in tensors)
    payload = override.pop("payload", data)
    h = push_header(frag, p, data, inc, seq, codec, **override)
    return client.stream("Push", wire.chunks(client.sign(h), payload, chunk_bytes=4096))


@pytest.mark.timeout(60)
def test_bad_pushes_are_rejected_and_the_global_model_is_unchanged(syncer_factory):
    s = syncer_factory("--max-push-bytes", "200000")
    client = SyncerClient(s.address, s.token)
    model = tiny_model()
    spec, inc = init_syncer(client, model)
    frag = fragmentation_from_spec(spec)
    before = client.fetch(None)
    good = [t.clone().view(-1) for t in before[0][1]]

    bad_token = SyncerClient(s.address, "not-the-token")
    expect_rejection(
        grpc.StatusCode.UNAUTHENTICATED, "E_AUTH", lambda: _push(bad_token, frag, 0, good, inc=inc)
    )
    expect_rejection(grpc.StatusCode.UNAUTHENTICATED, "E_AUTH", lambda: bad_token.status())
    wrong_shape = list(frag.fragments[0].numels)
    wrong_shape[0] += 1
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_SHAPE",
        lambda: _push(client, frag, 0, good, inc=inc, numels=wrong_shape),
    )
    nan = [t.clone() for t in good]
    nan[0][3] = float("nan")
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_NONFINITE",
        lambda: _push(client, frag, 0, nan, inc=inc),
    )
    expect_rejection(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "E_OVERSIZE",
        lambda: _push(client, frag, 0, good, inc=inc, nbytes=10**9),
    )
    expect_rejection(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "E_OVERSIZE",  # more bytes than declared
        lambda: _push(
            client,
            frag,
            0,
            good,
            inc=inc,
            payload=b"".join(t.numpy().tobytes() for t in good) + b"\0" * 8,
        ),
    )
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_SIZE",
        lambda: _push(client, frag, 0, good, inc=inc, nbytes=12),
    )
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_FRAGMENT",
        lambda: _push(client, frag, 0, good, inc=inc, fragment=7),
    )
    expect_rejection(
        grpc.StatusCode.INVALID_ARGUMENT,
        "E_CODEC",
        lambda: client.stream(
            "Push",
            iter(
                [
                    wire.pack(
                        {
                            "learner": 0,
                            "incarnation": inc,
                            "fragment": 0,
                            "seq": 1,
                            "base_version": 0,
                            "c_steps": 1,
                            "c_tokens": 1,
                            "codec": "fp64",
                            "nbytes": 8,
                            "numels": list(frag.fragments[0].numels),
                        }
                    )
                ]
            ),
        ),
    )
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION,
        "E_UNKNOWN_LEARNER",
        lambda: _push(client, frag, 0, good, inc=inc, learner=5),
    )
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION,
        "E_SPEC",
        lambda: client.unary("Join", {"learner": 1, "incarnation": -1, "fingerprint": "0" * 16}),
    )

    after = client.fetch(None)
    for p in before:
        assert after[p][0] == before[p][0] == 0
        for a, b in zip(after[p][1], before[p][1]):
            assert torch.equal(a, b)
    st = client.status()
    assert st["versions"] == [0, 0] and st["merges"] == 0
    for code in (
        "E_AUTH",
        "E_SHAPE",
        "E_NONFINITE",
        "E_OVERSIZE",
        "E_SIZE",
        "E_FRAGMENT",
        "E_CODEC",
        "E_UNKNOWN_LEARNER",
        "E_SPEC",
    ):
        assert st["rejections"].get(code, 0) >= 1, (code, st["rejections"])
    assert_no_internal_error(st, (s.tmp / "syncer.log").read_text())

    # a valid push merges (one live learner: all-live); its retry is merged at most once
    moved = [t - 0.01 for t in good]
    r = _push(client, frag, 0, moved, inc=inc, seq=11)
    assert r["status"] == "accepted" and r["target_version"] == 1
    assert client.status()["versions"][0] == 1
    r = _push(client, frag, 0, moved, inc=inc, seq=11)
    assert r["status"] == "duplicate"
    st = client.status()
    assert st["versions"] == [1, 0] and st["merges"] == 1
    # int8 delta against the base version is reconstructed on the syncer
    r = _push(
        client,
        frag,
        1,
        [torch.zeros_like(t).view(-1) for t in before[1][1]],
        inc=inc,
        seq=12,
        codec="int8",
        delta=True,
    )
    assert r["status"] == "accepted"
    bad_token.close()
    client.close()


@pytest.mark.timeout(60)
def test_hook_api_trains_against_the_syncer(syncer_factory):
    """The public API: a context manager around the user's model and optimizer; the
    optimizer post-step hook drives the learner."""
    s = syncer_factory()
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 16), generator=g)
    # the step-count schedule: 24 steps send 12 pushes whatever the machine's timing
    # (the time-driven schedule has its own tests in test_schedule_goodput.py)
    with DecoupledLearner(
        model,
        opt,
        syncer=s.address,
        learner=0,
        P=2,
        H=4,
        tau=1,
        schedule="steps",
        codec="int8",
        tokens_per_step=64,
        token=s.token,
    ) as dl:
        for _ in range(24):
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            time.sleep(0.05)  # a step of real length, so merged fragments can come back in tau
            opt.step()
            opt.zero_grad()
        assert dl.sync.step == 24
    rep = dl.report()
    assert rep["pushes_accepted"] >= 10 and rep["installs"] >= 8
    assert rep["ledger"]["merged"] > 12
    st = SyncerClient(s.address, s.token).status()
    assert st["merges"] >= 10 and st["learners"]["0"]["state"] == "left"


@pytest.mark.timeout(60)
def test_a_failed_communication_thread_stops_training_with_a_clear_error(syncer_factory):
    """A learner whose sender died must not train on silently without contributing."""
    s = syncer_factory()
    model = tiny_model()
    dl = DecoupledLearner(model, syncer=s.address, learner=0, P=2, H=2, tau=1, token=s.token)

    def broken(o):
        raise RuntimeError("encoder exploded")

    dl.links._encode = broken  # type: ignore[method-assign]
    with pytest.raises(SyncerError, match="communication thread failed.*encoder exploded"):
        with dl:
            for _ in range(200):
                dl.step(64)
                time.sleep(0.01)


@pytest.mark.timeout(90)
def test_the_syncer_step_budget_tells_learners_to_stop(syncer_factory):
    s = syncer_factory("--step-budget", "30")
    model = tiny_model()
    with DecoupledLearner(
        model,
        syncer=s.address,
        learner=0,
        P=2,
        H=4,
        tau=1,
        token=s.token,
        heartbeat_interval=timedelta(milliseconds=100),
    ) as dl:
        assert dl.step_budget == 30 and not dl.should_stop
        steps = 0
        while not dl.should_stop and steps < 500:
            dl.extra_report["global_step"] = steps = steps + 1
            dl.step(64)
            time.sleep(0.01)
    assert 30 <= steps <= 30 + 40, steps  # told within a few heartbeats
    st = SyncerClient(s.address, s.token).status()
    assert st["budget_spent"] and st["step_budget"] == 30


@pytest.mark.timeout(60)
def test_a_malformed_initial_model_is_refused_and_a_good_one_is_taken_whole(syncer_factory):
    """The initial model is read tensor by tensor as its frames arrive (in chunks that cut
    across tensors): short, long and non-finite uploads are refused with their typed errors
    and leave the syncer uninitialised; then a good one is taken, bit for bit."""
    from ddiloco.runtime.transport.spec import model_spec, spec_fingerprint

    s = syncer_factory()
    client = SyncerClient(s.address, s.token)
    model = tiny_model()
    spec = model_spec(model, 2)
    fp = spec_fingerprint(spec)
    assert client.unary("Join", {"learner": 0, "incarnation": -1, "fingerprint": fp})["need_init"]
    data = b"".join(t.detach().float().numpy().tobytes() for t in model.parameters())

    def init(payload: bytes, nbytes: int | None = None):
        h = {"learner": 0, "spec": spec, "nbytes": len(data) if nbytes is None else nbytes}
        return client.stream("Init", wire.chunks(h, payload, chunk_bytes=999))

    code = grpc.StatusCode
    expect_rejection(code.INVALID_ARGUMENT, "E_SIZE", lambda: init(data[:-4]))
    expect_rejection(code.RESOURCE_EXHAUSTED, "E_OVERSIZE", lambda: init(data + b"\0" * 4))
    nan = bytearray(data)
    nan[4 * 1001 : 4 * 1002] = torch.tensor([float("nan")]).numpy().tobytes()
    expect_rejection(code.INVALID_ARGUMENT, "E_NONFINITE", lambda: init(bytes(nan)))
    assert not client.status()["initialised"]
    assert init(data)["accepted"]
    got, frag = client.fetch(None, exact=True), fragmentation_from_spec(spec)
    params = dict(model.named_parameters())
    for p, (_, tensors, _) in got.items():
        for n, t in zip(frag.fragments[p].names, tensors, strict=True):
            assert torch.equal(t.reshape(-1), params[n].detach().reshape(-1)), n
    assert sorted(got) == list(range(frag.P))
    assert_no_internal_error(client.status(), (s.tmp / "syncer.log").read_text())
