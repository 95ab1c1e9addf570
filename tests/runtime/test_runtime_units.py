"""Small pieces of the runtime: wire frames, atomic checkpoints, the chaos schedule, TLS,
``status`` and a clean Ctrl-C of the launcher."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from runtime_helpers import SyncerProcess, init_syncer, self_signed_cert, tiny_model

from ddiloco.runtime.chaos import ChaosConfig, chaos_preset, chaos_schedule
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.syncer.checkpoint import load_checkpoint, save_atomic
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.bulk import BulkClient, BulkError


def test_frames_roundtrip_and_chunking():
    h, p = wire.unpack(wire.pack({"a": 1}, b"xyz"))
    assert h == {"a": 1} and bytes(p) == b"xyz"
    frames = list(wire.chunks({"k": 2}, b"0123456789", chunk_bytes=4))
    assert len(frames) == 3
    assert wire.unpack(frames[0])[0] == {"k": 2} and wire.unpack(frames[2])[0] == {"cont": 2}
    assert b"".join(bytes(wire.unpack(f)[1]) for f in frames) == b"0123456789"
    for bad in (b"", b"\x00\x00\x00\x09{}", b"\x00\x00\x00\x02[]"):
        with pytest.raises(ValueError):
            wire.unpack(bad)


def test_checkpoint_is_atomic(tmp_path):
    path = tmp_path / "ck" / "syncer.json"
    for n in (3, 4):
        x = torch.arange(float(n))
        save_atomic({"v": [n], "state": {"theta": [[x]], "momentum": [[x * 0]]}}, path)
    ck = load_checkpoint(path)
    assert torch.equal(ck["state"]["theta"][0][0], torch.arange(4.0)) and ck["v"] == [4]
    assert sorted(p.name for p in path.parent.iterdir()) == [  # no temp
        "syncer-000001",
        "syncer-000002",
        "syncer.json",
        "syncer.json.1",
    ]
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.json")


def test_chaos_schedule_is_seeded():
    cfg = chaos_preset("kill30", seed=3)
    a, b = chaos_schedule(cfg, 600.0), chaos_schedule(cfg, 600.0)
    assert a == b and all(e.kind == "kill-learner" and e.duration_s == 10.0 for e in a)
    assert 10 <= len(a) <= 35  # ~ (600 - 5) / 30
    assert chaos_schedule(chaos_preset("kill30", seed=4), 600.0) != a
    assert chaos_schedule(ChaosConfig(), 600.0) == []
    with pytest.raises(ValueError):
        ChaosConfig(slowdown={0: 0.5})
    with pytest.raises(ValueError):
        chaos_preset("no-such-preset")


@pytest.mark.timeout(60)
def test_tls_and_status_command(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    s = SyncerProcess(tmp_path, "tok", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert SyncerClient(s.address, "tok", tls_ca=str(cert)).status()["initialised"] is False
        with pytest.raises(grpc.RpcError):
            SyncerClient(s.address, "tok").status(timeout_s=2.0)  # plaintext client
        token_file = tmp_path / "token"
        token_file.write_text("tok\n")
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddiloco.runtime.cli",
                "status",
                s.address,
                "--token-file",
                str(token_file),
                "--tls-ca",
                str(cert),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env={k: v for k, v in os.environ.items() if k != "DDILOCO_TOKEN"},
        )
        assert out.returncode == 0, out.stderr
        assert "syncer boot" in out.stdout and "versions []" in out.stdout
        # the data port speaks TLS too: fragments travel encrypted, plaintext is refused
        client = SyncerClient(s.address, "tok", tls_ca=str(cert))
        init_syncer(client, tiny_model())
        assert client.data is not None and client.data.ssl_context is not None
        got = client.fetch(None)
        assert client.data is not None and sorted(got) == [0, 1]
        with pytest.raises(BulkError):
            BulkClient("127.0.0.1", client.data.port, "tok", connect_timeout_s=2).request(
                {"op": "fetch", "fragments": [0]}, timeout_s=5
            )
    finally:
        s.close()


def _procs_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace"
                ):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_stops_everything_with_no_orphans(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "train",
            "--out",
            str(run),
            "-M",
            "2",
            "--steps",
            "100000",
            "--batch-size",
            "4",
            "--block-size",
            "16",
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    metrics = run / "learner_1" / "metrics.jsonl"
    while not (metrics.is_file() and b'"step"' in metrics.read_bytes()):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "learners never started"
        time.sleep(0.2)
    assert len(_procs_mentioning(str(run))) >= 3  # syncer + 2 learners
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)  # a clean stop evaluates and writes the summary first
    assert _procs_mentioning(str(run)) == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["ok"] is False


def test_learner_state_file_roundtrip_and_damage(tmp_path):
    """The inner optimizer's state survives a restart; a damaged file costs only the moments."""
    from ddiloco.runtime.learner.main import load_learner_state, save_learner_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path / "learner_state.pt"
    save_learner_state(path, 30, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learner_state.pt"]  # no temp left
    st = load_learner_state(path)
    assert st["step"] == 30
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(st["optimizer"])
    for p in model.parameters():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state[p][k], opt.state[p][k]), k
    path.write_bytes(b"truncated")
    assert load_learner_state(path) is None
    assert load_learner_state(tmp_path / "none.pt") is None


@pytest.mark.timeout(60)
def test_a_cut_link_fails_every_call_as_unavailable_until_restored(syncer_factory):
    from ddiloco.runtime.learner.client import LINK_CUT

    sp = syncer_factory()
    c = SyncerClient(sp.address, sp.token)
    try:
        assert c.status()["initialised"] is False
        LINK_CUT.cut()
        try:
            for call in (
                c.status,
                lambda: c.unary("Heartbeat", {"learner": 0}),
                lambda: c.push({"learner": 0}, b"x"),
                lambda: c.fetch(None),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "link" in e.value.details()
        finally:
            LINK_CUT.restore()
        assert c.status()["initialised"] is False
    finally:
        c.close()
    with pytest.raises(ValueError, match="link_cut"):
        ChaosConfig(link_cut=[[0, 5, 0.0]])
    assert ChaosConfig(link_cut=[[0, 5, 2]]).to_dict()["link_cut"] == [[0, 5, 2.0]]


def test_a_sharded_heartbeat_takes_the_slot_clock_only_from_shard_0():
    """Each shard runs its own slot clock; while shard 0 is down a heartbeat answered by
    shard 1 alone must not hand the learner shard 1's clock (another epoch restarts the
    learner's slot count). Stand-in shard clients: the unit under test is the reply merge."""
    import concurrent.futures as cf

    from ddiloco.runtime.learner.sharded import ShardedClient

    class Down:
        def unary(self, *a, **k):
            raise grpc.RpcError()

    class Up:
        def __init__(self, epoch: float):
            self.epoch = epoch

        def unary(self, *a, **k):
            clock = {"epoch_s": self.epoch, "t0_s": 0.0, "x0": 0.0, "slot_s": 0.1}
            return {"boot_id": f"b{self.epoch}", "clock": clock, "stop": False}

    c = object.__new__(ShardedClient)
    c._inc, c._boots = {}, ["", ""]
    c._pool = cf.ThreadPoolExecutor(max_workers=2)
    try:
        c.clients = [Down(), Up(2.0)]
        assert "clock" not in c._each("Heartbeat", {}, 1.0, True)
        c.clients = [Up(1.0), Up(2.0)]
        assert c._each("Heartbeat", {}, 1.0, True)["clock"]["epoch_s"] == 1.0
    finally:
        c._pool.shutdown()


@pytest.mark.timeout(60)
def test_a_learner_waiting_for_an_absent_syncer_says_what_it_waits_for(caplog):
    """``DecoupledLearner`` and ``ddiloco learner`` name the address and how long they have
    waited, and give up after ``connect_timeout`` with one line."""
    from datetime import timedelta

    from ddiloco.runtime.learner.client import SyncerError
    from ddiloco.runtime.learner.hook import DecoupledLearner

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    dl = DecoupledLearner(
        tiny_model(), syncer=addr, learner=0, token="tok", connect_timeout=timedelta(seconds=3)
    )
    with caplog.at_level(logging.WARNING, logger="ddiloco.learner"):
        with pytest.raises(SyncerError, match=f"syncer {addr} unreachable for 3 s"):
            dl.start()
    dl.close()
    waits = [r.getMessage() for r in caplog.records if "waiting for the syncer" in r.getMessage()]
    assert waits and waits[0].startswith(f"[learner 0] waiting for the syncer at {addr}: ")
    assert "(Connection refused); giving up after 3 s (connect_timeout)" in waits[0]
    r = subprocess.run(
        [sys.executable, "-m", "ddiloco.runtime.cli", "learner", "--syncer", addr]
        + ["--learner", "0", "--model", "gpt_tiny", "--vocab-size", "64", "--block-size", "32"]
        + ["--connect-timeout", "3"],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "DDILOCO_TOKEN": "tok"},
    )
    assert r.returncode == 2
    assert f"WARNING [learner 0] waiting for the syncer at {addr}: unreachable for" in r.stderr
    assert r.stderr.splitlines()[-1].startswith(
        f"ddiloco learner: error: [learner 0] syncer {addr} unreachable for 3 s"
    )
