"""Identity between token holders: each Join opens a session whose key signs every later
call acting as that learner; another token holder cannot push, heartbeat, leave or rejoin
as a live learner, a captured call cannot be altered or replayed, and a second process
started with a live learner's id is refused and exits non-zero with a clear message."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from runtime_helpers import TINY, expect_rejection, init_syncer, tiny_model

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.transport import session, wire
from ddiloco.runtime.transport.spec import fragmentation_from_spec


@pytest.mark.timeout(90)
def test_another_token_holder_cannot_act_as_a_live_learner(syncer_factory):
    s = syncer_factory()
    a = SyncerClient(s.address, s.token)
    spec, inc = init_syncer(a, tiny_model())
    frag = fragmentation_from_spec(spec)
    mallory = SyncerClient(s.address, s.token)  # holds the token, never joined as learner 0
    base = a.fetch([0])[0][1]
    data = b"".join(get_codec("fp32").encode(t.view(-1) - 0.01) for t in base)
    h = {
        "learner": 0,
        "incarnation": inc,
        "fragment": 0,
        "seq": (inc << 32) + 1,
        "base_version": 0,
        "c_steps": 4,
        "c_tokens": 400,
        "codec": "fp32",
        "delta": False,
        "numels": list(frag.fragments[0].numels),
        "nbytes": len(data),
        "step": 4,
    }

    # pushes, heartbeats and leaves as learner 0 without its session, on both transports
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION,
        "E_SESSION",
        lambda: mallory.stream("Push", wire.chunks(h, data)),
    )
    mallory.use_data_port(a.data.port)
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION, "E_SESSION", lambda: mallory.push(h, data)
    )
    forged = session.sign(b"\0" * 32, h)
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION, "E_SESSION", lambda: mallory.push(forged, data)
    )
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION,
        "E_SESSION",
        lambda: mallory.unary("Heartbeat", {"learner": 0, "incarnation": inc, "hb": 10**6}),
    )
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION,
        "E_SESSION",
        lambda: mallory.unary("Leave", {"learner": 0, "incarnation": inc}),
    )
    # a Join as the live learner 0 (to revoke it) is refused; learner 0 keeps its incarnation
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION,
        "E_DUPLICATE",
        lambda: mallory.unary("Join", {"learner": 0, "incarnation": -1}),
    )
    st = a.status()
    assert st["live"] == [0] and st["learners"]["0"]["incarnation"] == inc

    # a captured push: replayed unchanged it is a duplicate, altered (seq + 1) it is refused
    signed = a.sign(h)
    assert a.push(h, data)["status"] == "accepted"
    assert mallory.push(signed, data)["status"] == "duplicate"
    bumped = {**signed, "seq": signed["seq"] + 1}
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION, "E_SESSION", lambda: mallory.push(bumped, data)
    )
    # a captured heartbeat replayed is refused (its counter does not increase)
    assert a.unary("Heartbeat", {"learner": 0, "incarnation": inc})["rejoin"] is False
    hb = a.sign({"learner": 0, "incarnation": inc, "hb": a._hb})
    expect_rejection(
        grpc.StatusCode.FAILED_PRECONDITION,
        "E_SESSION",
        lambda: mallory.control.unary_unary(wire.method("Heartbeat"))(
            wire.pack(hb), timeout=5, metadata=mallory._md
        ),
    )
    # the live learner itself rejoins (its Join carries its session's MAC)
    assert a.unary("Join", {"learner": 0, "incarnation": inc})["incarnation"] == inc

    st = a.status()
    assert st["merges"] == 1 and st["versions"][0] == 1
    assert st["rejections"]["E_SESSION"] >= 7 and st["rejections"]["E_DUPLICATE"] == 1
    a.close()
    mallory.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_second_process_with_a_live_learner_id_exits_non_zero(syncer_factory, tmp_path):
    s = syncer_factory("--heartbeat-timeout", "3")
    from ddiloco.config import TrainConfig, dump_config

    cfg = tmp_path / "cfg.toml"
    dump_config(
        TrainConfig(
            **{
                **TINY,
                "engine": "processes",
                "learners": 1,
                "steps": 100_000,
                "eval_every": 1000,
                "speeds": (0.5,),
            }
        ),
        cfg,
    )
    cmd = [
        sys.executable,
        "-m",
        "ddiloco.runtime.cli",
        "learner",
        "--syncer",
        s.address,
        "--learner",
        "0",
        "--config",
        str(cfg),
    ]
    first = subprocess.Popen(cmd, env=s.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = SyncerClient(s.address, s.token)
        deadline = time.monotonic() + 60
        while client.status()["live"] != [0]:
            assert time.monotonic() < deadline and first.poll() is None, "first learner joins"
            time.sleep(0.2)
        second = subprocess.run(cmd, env=s.env, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert "E_DUPLICATE" in second.stderr and "already live" in second.stderr, second.stderr[
            -2000:
        ]
        assert first.poll() is None, "the first process trains on"
        st = client.status()
        assert st["live"] == [0]
        assert st["learners"]["0"]["incarnation"] == 1 and st["learners"]["0"]["joins"] == 1
        assert st["rejections"]["E_DUPLICATE"] >= 1
        client.close()
    finally:
        first.kill()
        first.wait()
