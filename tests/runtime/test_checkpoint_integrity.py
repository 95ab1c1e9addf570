"""Checkpoint integrity: a damaged or non-finite checkpoint is never served; the syncer
falls back to the newest valid one it kept, says so loudly, removes stale temp files and a
killed writer's fragment files, a writer killed at any point of a write leaves the previous
checkpoint, and a SIGTERM while the disk is full ends it cleanly."""

from __future__ import annotations

import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from runtime_helpers import SyncerProcess, init_syncer, live_syncer, tiny_model
from safetensors import safe_open

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.syncer.checkpoint import (
    LEGACY_MAGIC,
    CheckpointError,
    has_checkpoint,
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


def _snap(i: int, value: float | None = None) -> dict:
    """A snapshot of two fragments (the second with two tensors) and a marker ``i``."""
    v = float(i) if value is None else value
    theta = [[torch.full((64,), v)], [torch.full((8,), 2.0), torch.arange(3.0)]]
    return {"i": i, "state": {"theta": theta, "momentum": [[t * 0.5 for t in f] for f in theta]}}


def _fragment_file(manifest, p: int = 0):
    return manifest.parent / json.loads(manifest.read_text())["fragments"][p]["file"]


def _names(d):
    return sorted(p.name for p in d.iterdir())


def test_checksum_finite_check_fallback_and_temp_cleanup(tmp_path, caplog):
    path = tmp_path / "syncer.json"
    for i in range(4):
        save_atomic(_snap(i), path)
    # the last 3 kept: their manifests and fragment directories, nothing else
    assert _names(tmp_path) == [
        "syncer-000002", "syncer-000003", "syncer-000004",
        "syncer.json", "syncer.json.1", "syncer.json.2",
    ]  # fmt: skip
    ck = load_checkpoint(path)
    assert ck["i"] == 3 and torch.equal(ck["state"]["theta"][0][0], torch.full((64,), 3.0))
    assert torch.equal(ck["state"]["momentum"][1][1], torch.arange(3.0) * 0.5)
    with safe_open(str(_fragment_file(path, 1)), framework="pt") as f:  # plain safetensors
        assert sorted(f.keys()) == ["momentum.0", "momentum.1", "theta.0", "theta.1"]
    _flip(_fragment_file(path))  # a damaged fragment file
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)
    ck, used = load_newest_valid(path)
    assert ck["i"] == 2 and used.name == "syncer.json.1"
    assert "CHECKPOINT REJECTED" in caplog.text and "OLDER CHECKPOINT" in caplog.text
    _flip(tmp_path / "syncer.json.1", at=0.3)  # a damaged manifest
    with pytest.raises(CheckpointError, match="checksum|not a ddiloco"):
        load_checkpoint(tmp_path / "syncer.json.1")
    _fragment_file(tmp_path / "syncer.json.2", 1).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(tmp_path / "syncer.json.2")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        load_newest_valid(path)
    save_atomic(_snap(9, float("nan")), tmp_path / "nan.json")
    with pytest.raises(CheckpointError, match="NaN"):
        load_checkpoint(tmp_path / "nan.json")
    d = tmp_path / "stale"
    save_atomic(_snap(1), d / "syncer.json")
    save_atomic(_snap(2), d / "syncer.json")
    (d / "syncer.json.1").unlink()  # syncer-000001: older than the newest, named by none
    (d / ".syncer.json.tmp.12345").write_bytes(b"partial")
    (d / ".syncer-000003.tmp.12345").mkdir()  # a killed writer's unfinished fragment files
    (d / "syncer-000099").mkdir()  # newer than every manifest: its manifest may be lost
    assert remove_stale_temps(d) == 3
    assert _names(d) == ["syncer-000002", "syncer-000099", "syncer.json"]


def test_lazy_load_reads_a_fragment_when_it_is_taken(tmp_path):
    path = tmp_path / "syncer.json"
    save_atomic(_snap(1), path)
    _flip(_fragment_file(path, 1))
    ck = load_checkpoint(path, lazy=True)  # the manifest is fine
    assert len(ck["state"]["theta"]) == 2
    assert torch.equal(ck["state"]["theta"][0][0], torch.full((64,), 1.0))
    with pytest.raises(CheckpointError, match="checksum"):
        ck["state"]["momentum"][1]


def test_a_snapshot_that_is_not_json_is_refused_before_anything_is_written(tmp_path):
    snap = _snap(1)
    snap["stray"] = torch.zeros(2)
    with pytest.raises(TypeError, match="only JSON values"):
        save_atomic(snap, tmp_path / "syncer.json")
    assert _names(tmp_path) == []


def test_the_earlier_single_file_format_is_still_read(tmp_path):
    payload = io.BytesIO()
    torch.save(_snap(5), payload)
    body = payload.getvalue()
    (tmp_path / "syncer.pt").write_bytes(LEGACY_MAGIC + hashlib.sha256(body).digest() + body)
    assert has_checkpoint(tmp_path)
    ck, used = load_newest_valid(tmp_path / "syncer.json")
    assert ck["i"] == 5 and used.name == "syncer.pt"
    save_atomic(_snap(6), tmp_path / "syncer.json")  # a new checkpoint beside it: read first
    assert load_newest_valid(tmp_path / "syncer.json")[0]["i"] == 6


_TORN = """
import os, signal, sys
import torch
from ddiloco.runtime.syncer import checkpoint as C

def snap(i):
    theta = [[torch.full((1000,), float(i))], [torch.full((10,), float(i))]]
    return {"i": i, "state": {"theta": theta, "momentum": [[t * 0 for t in f] for f in theta]}}

path = sys.argv[1] + "/syncer.json"
C.save_atomic(snap(1), path)
where, nth = sys.argv[2], int(sys.argv[3])
real, calls = getattr(C, where) if hasattr(C, where) else getattr(os, where), [0]

def killing(*a, **k):
    calls[0] += 1
    if calls[0] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)

setattr(C if hasattr(C, where) else C.os, where, killing)
C.save_atomic(snap(2), path)
"""


@pytest.mark.parametrize(
    ("where", "nth", "kept"),
    [
        ("_write_fragment", 2, []),  # one fragment file written, the next not
        ("_fsync_dir", 1, []),  # every fragment file written, no manifest yet
        ("rename", 1, []),  # the fragment directory still under its temp name
        # renamed, no manifest names it: kept at start, removed by the next write
        ("_fsync_dir", 2, ["syncer-000002"]),
        ("replace", 1, []),  # the manifest in its temp file, not renamed
        ("replace", 2, []),  # the manifests moved down, the new one not renamed in yet
    ],
)
def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path, where, nth, kept):
    r = subprocess.run([sys.executable, "-c", _TORN, str(tmp_path), where, str(nth)], check=False)
    assert r.returncode == -signal.SIGKILL
    ck, used = load_newest_valid(tmp_path / "syncer.json")
    assert ck["i"] == 1 and torch.equal(ck["state"]["theta"][1][0], torch.full((10,), 1.0))
    remove_stale_temps(tmp_path)  # what a syncer does at start
    assert _names(tmp_path) == ["syncer-000001", *kept, used.name]
    save_atomic(_snap(3), tmp_path / "syncer.json")  # and the next write goes on from there
    assert load_newest_valid(tmp_path / "syncer.json")[0]["i"] == 3
    assert not [n for n in _names(tmp_path) if n.startswith(".") or n in kept]


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
    (ck_dir / ".syncer.json.tmp.99999").write_bytes(b"left by a killed writer")
    _flip(_fragment_file(ck_dir / "syncer.json"))  # newest: a damaged fragment file
    nan = load_checkpoint(ck_dir / "syncer.json.1")
    nan["state"]["theta"][0][0].view(-1)[0] = float("nan")
    save_atomic(nan, ck_dir / "nan.json")
    (ck_dir / "nan.json").replace(ck_dir / "syncer.json.1")  # the one before: NaN
    good_version = load_checkpoint(ck_dir / "syncer.json.2")["state"]["versions"][0]

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
    assert not list(ck_dir.glob(".syncer.json.tmp.*"))


def _damage(manifest, how: str) -> None:
    raw = manifest.read_bytes()
    if how == "truncated":
        raw = raw[: len(raw) // 2]
    elif how == "empty":
        raw = b""
    elif how == "garbage":
        raw = b"\x00\xff not a manifest \x7f" * 16
    else:  # one byte flipped: the last digit of the fragment directory's name
        at = raw.index(b'"data": "syncer-') + len(b'"data": "syncer-000000')
        raw = raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :]
    manifest.write_bytes(raw)


def _files(d) -> dict:
    return {
        f.relative_to(d).as_posix(): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()
    }


def _resume_command(ck_dir, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``ddiloco syncer --resume`` started for real on ``ck_dir``, as an operator starts it."""
    return subprocess.run(
        [sys.executable, "-m", "ddiloco.runtime.cli", "syncer", "--port", "0", "--resume",
         "--checkpoint-dir", str(ck_dir)],
        env={**os.environ, "DDILOCO_TOKEN": "tok"},
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip


def _killed_writer(ck_dir) -> list:
    """What a writer SIGKILLed mid-write leaves: its temp-named fragment directory (with a
    fragment file) and its temp manifest."""
    temp = ck_dir / ".syncer-000007.tmp.99999"
    temp.mkdir()
    (temp / "fragment-0000.safetensors").write_bytes(b"half a fragment")
    (ck_dir / ".syncer.json.tmp.99999").write_bytes(b'{"format": "ddiloco-syncer-')
    return [temp, ck_dir / ".syncer.json.tmp.99999"]


@pytest.mark.timeout(300)
def test_a_refused_checkpoint_keeps_its_fragment_files_and_resumes_once_repaired(tmp_path):
    from ddiloco.runtime.syncer.server import SyncerServer, SyncerServerConfig

    ck_dir = tmp_path / "ck"
    with live_syncer(checkpoint_dir=str(ck_dir), checkpoint_keep=1) as s:
        for k in range(1, 3):  # two merged, published versions of fragment 0
            _push_one(s.client, s.frag, s.inc, (s.inc << 32) + k, 0.01)
            deadline = time.monotonic() + 20
            while s.client.status()["versions"][0] < k:
                assert time.monotonic() < deadline, "published once durable"
                time.sleep(0.05)
    manifest = ck_dir / "syncer.json"
    good = manifest.read_bytes()
    data = ck_dir / json.loads(good)["data"]
    # fragment 1 never merged: its file is the first checkpoint's, named again since
    files = [f["file"] for f in json.loads(good)["fragments"]]
    assert files[1].startswith("syncer-000001/") and not files[0].startswith("syncer-000001/")
    dirs = sorted(p for p in ck_dir.glob("syncer-*"))
    original = _files(ck_dir)
    assert set(files) <= set(original), "the checkpoint has fragment files"
    assert original[f"{data.name}/syncer.json"] == good, "a copy of the manifest is beside them"

    for how in ("truncated", "empty", "garbage", "flipped"):
        _damage(manifest, how)
        leftovers = _killed_writer(ck_dir)
        r = _resume_command(ck_dir)  # a real start: its clean-up, then the resume
        assert r.returncode == 2, f"{how}: {r.stdout}{r.stderr}"
        assert not any(p.exists() for p in leftovers), f"{how}: a killed writer's are removed"
        assert {k: v for k, v in _files(ck_dir).items() if k != "syncer.json"} == {
            k: v for k, v in original.items() if k != "syncer.json"
        }, f"{how}: every fragment file is as it was"
        err = r.stderr
        assert "CHECKPOINT REJECTED" in err and "no valid checkpoint" in err, err
        assert "Traceback" not in err, err
        # where the data is, and how to get it back
        assert all(str(d) in err for d in dirs), err
        assert str(data / "syncer.json") in err and "--resume" in err, err
        manifest.write_bytes(good)  # the repair

    _damage(manifest, "flipped")  # the recovery the message gives: its copy put back
    shutil.copy(data / "syncer.json", manifest)
    config = SyncerServerConfig(
        token="tok", checkpoint_dir=str(ck_dir), resume=True, checkpoint_keep=1, port=0
    )
    with SyncerServer(config) as s2:  # it resumes where it was
        c2 = SyncerClient(f"127.0.0.1:{s2.port}", "tok")
        assert c2.status()["versions"][0] == 2
        assert all(torch.isfinite(t).all() for t in c2.fetch([0])[0][1])
        c2.close()


def test_a_damaged_newest_manifest_keeps_its_fragment_files_beside_the_fallback(tmp_path):
    path = tmp_path / "syncer.json"
    for i in range(1, 3):
        save_atomic(_snap(i), path)
    newest = tmp_path / json.loads(path.read_text())["data"]
    before = _files(newest)
    _damage(path, "truncated")
    damaged = path.read_bytes()
    assert remove_stale_temps(tmp_path) == 0  # what a syncer does at start
    assert _files(newest) == before
    assert load_newest_valid(path)[0]["i"] == 1  # the older one, as before
    for i in range(3, 9):  # the run goes on: the damaged manifest leaves the last three
        save_atomic(_snap(i), path)
        assert _files(newest) == before, f"write {i}: the refused checkpoint's files are kept"
    pins = list(tmp_path.glob("refused-syncer.json-*"))
    assert len(pins) == 1 and (pins[0] / "syncer.json").read_bytes() == damaged
    # the clean-up goes on around them: the last three checkpoints, and what the set-aside
    # manifest may name (the fragment files written before the next intact one)
    assert _names(tmp_path) == [
        pins[0].name, "syncer-000001", newest.name, "syncer-000006", "syncer-000007",
        "syncer-000008", "syncer.json", "syncer.json.1", "syncer.json.2",
    ]  # fmt: skip
    shutil.copy(newest / "syncer.json", tmp_path / "syncer.json.2")  # the repair
    assert load_checkpoint(tmp_path / "syncer.json.2")["i"] == 2
    shutil.rmtree(pins[0])  # the operator lets the set-aside files go
    save_atomic(_snap(9), path)
    assert _names(tmp_path)[:3] == ["syncer-000007", "syncer-000008", "syncer-000009"]


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
        env={**os.environ, "DDILOCO_TOKEN": "tok"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_disk_full(16 << 10),  # below a fragment file of the tiny model
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
    # the failed writes left nothing behind: no temp manifest, no fragment directory
    assert not list(ck_dir.glob(".syncer.json.tmp.*")) and not list(ck_dir.glob("syncer-*"))
