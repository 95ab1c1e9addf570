"""Checkpoint integrity: a damaged or non-finite checkpoint is never served; the syncer
falls back to the newest valid one it kept, says so loudly, removes stale temp files, and a
SIGTERM while the disk is full ends it cleanly."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from runtime_helpers import SyncerProcess, init_syncer, tiny_model

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.syncer.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_newest_valid,
    remove_stale_temps,
    save_atomic,
)
from ddiloco.runtime.transport.spec import fragmentation_from_spec


def _flip(path, at: float = 0.6) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def test_checksum_finite_check_fallback_and_temp_cleanup(tmp_path, caplog):
    path = tmp_path / "syncer.pt"
    for i in range(4):
        save_atomic({"x": torch.full((64,), float(i)), "i": i}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["syncer.pt", "syncer.pt.1", "syncer.pt.2"]
    assert load_checkpoint(path)["i"] == 3
    _flip(path)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)
    ck, used = load_newest_valid(path)
    assert ck["i"] == 2 and used.name == "syncer.pt.1"
    assert "CHECKPOINT REJECTED" in caplog.text and "OLDER CHECKPOINT" in caplog.text
    save_atomic({"x": torch.tensor([1.0, float("nan")]), "i": 9}, tmp_path / "nan.pt")
    with pytest.raises(CheckpointError, match="NaN"):
        load_checkpoint(tmp_path / "nan.pt")
    (tmp_path / ".syncer.pt.tmp.12345").write_bytes(b"partial")
    assert remove_stale_temps(tmp_path) == 1
    assert not list(tmp_path.glob(".syncer.pt.tmp.*"))


def _push_one(client, frag, inc, seq, shift):
    base = client.fetch([0])[0][1]
    data = b"".join(get_codec("fp32").encode(t.view(-1) + shift) for t in base)
    h = {
        "learner": 0,
        "incarnation": inc,
        "fragment": 0,
        "seq": seq,
        "base_version": 0,
        "c_steps": 4,
        "c_tokens": 400,
        "codec": "fp32",
        "delta": False,
        "numels": list(frag.fragments[0].numels),
        "nbytes": len(data),
        "step": 4,
    }
    return client.push(h, data)


@pytest.mark.timeout(120)
def test_resume_skips_a_corrupt_and_a_nan_checkpoint_and_keeps_the_data_port(tmp_path):
    ck_dir = tmp_path / "ck"
    s = SyncerProcess(tmp_path, "tok", "--checkpoint-dir", str(ck_dir))
    client = SyncerClient(s.address, s.token)
    spec, inc = init_syncer(client, tiny_model())
    frag = fragmentation_from_spec(spec)
    port = client.data.port
    for k in range(1, 4):  # three published versions of fragment 0, each durable first
        _push_one(client, frag, inc, (inc << 32) + k, 0.01)
        deadline = time.monotonic() + 20
        while client.status()["versions"][0] < k:
            assert time.monotonic() < deadline, "published once durable"
            time.sleep(0.05)
    client.close()
    s.proc.kill()
    s.proc.wait()
    s.log.close()
    (ck_dir / ".syncer.pt.tmp.99999").write_bytes(b"left by a killed writer")
    _flip(ck_dir / "syncer.pt")  # newest: damaged
    nan = load_checkpoint(ck_dir / "syncer.pt.1")
    nan["state"]["theta"][0][0].view(-1)[0] = float("nan")
    save_atomic(nan, ck_dir / "nan.pt")
    (ck_dir / "nan.pt").replace(ck_dir / "syncer.pt.1")  # the one before: NaN
    good_version = load_checkpoint(ck_dir / "syncer.pt.2")["state"]["versions"][0]

    (tmp_path / "port").unlink()
    s2 = SyncerProcess(tmp_path, "tok", "--checkpoint-dir", str(ck_dir), "--resume")
    try:
        c2 = SyncerClient(s2.address, s2.token)
        st = c2.status()
        assert st["versions"][0] == good_version
        r = c2.unary("Join", {"learner": 0, "incarnation": -1, "fingerprint": st["fingerprint"]})
        assert r["bulk_port"] == port, "the data port survives a restart"
        assert all(torch.isfinite(t).all() for t in c2.fetch([0])[0][1])
        c2.close()
    finally:
        s2.close()
    log = (tmp_path / "syncer.log").read_text()
    assert "CHECKPOINT REJECTED" in log and "checksum" in log and "NaN" in log, log
    assert not list(ck_dir.glob(".syncer.pt.tmp.*"))


def _disk_full(limit: int):
    def pre() -> None:  # a file-size limit: every write past it fails as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


@pytest.mark.timeout(120)
def test_sigterm_while_the_disk_is_full_exits_cleanly(tmp_path):
    ck_dir = tmp_path / "ck"
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddiloco.runtime.cli",
            "syncer",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--checkpoint-dir",
            str(ck_dir),
        ],
        env={**__import__("os").environ, "DDILOCO_TOKEN": "tok"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_disk_full(64 << 10),
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.is_file():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        client = SyncerClient(f"127.0.0.1:{port_file.read_text()}", "tok")
        spec, inc = init_syncer(client, tiny_model())
        _push_one(client, fragmentation_from_spec(spec), inc, (inc << 32) + 1, 0.01)
        deadline = time.monotonic() + 30
        while client.status()["counters"].get("checkpoint_errors", 0) < 1:
            assert time.monotonic() < deadline, "checkpoint writes should fail"
            time.sleep(0.1)
        client.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.decode()
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text
    assert "final checkpoint not written" in text, text
    assert not list(ck_dir.glob(".syncer.pt.tmp.*"))
