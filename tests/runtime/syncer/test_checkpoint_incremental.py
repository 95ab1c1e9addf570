"""A merge's checkpoint writes only the merged fragment: the manifest names the other
fragments' files from earlier checkpoints, a version is still published only once its
checkpoint is on disk, a writer SIGKILLed at any point of such a write leaves a loadable
checkpoint, and a syncer SIGKILLed while it checkpoints resumes with every published
version."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from runtime_helpers import SyncerProcess, init_syncer, live_syncer, tiny_model

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import SyncerClient, SyncerError
from ddiloco.runtime.syncer.checkpoint import (
    _canonical,
    load_checkpoint,
    load_newest_valid,
    remove_stale_temps,
    save_atomic,
    stored_fragments,
)
from ddiloco.runtime.transport.spec import fragmentation_from_spec


def _push(client, frag, inc: int, p: int, seq: int, shift: float = 0.01) -> dict:
    """Learner 0 pushes fragment ``p`` (its published values moved by ``shift``)."""
    version, base, _ = client.fetch([p])[p]
    data = b"".join(get_codec("fp32").encode(t.view(-1) + shift) for t in base)
    h = {
        "learner": 0,
        "incarnation": inc,
        "fragment": p,
        "seq": (inc << 32) + seq,
        "base_version": version,
        "c_steps": 4,
        "c_tokens": 400,
        "codec": "fp32",
        "delta": False,
        "numels": list(frag.fragments[p].numels),
        "nbytes": len(data),
        "step": 4,
    }
    return client.push(h, data)


def _merged(client, p: int, version: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while client.status()["versions"][p] < version:
        assert time.monotonic() < deadline, f"fragment {p} v{version} published once durable"
        time.sleep(0.05)


def _on_disk(d) -> dict:
    """Every file under ``d``: (inode, mtime, contents)."""
    return {
        f.relative_to(d).as_posix(): (f.stat().st_ino, f.stat().st_mtime_ns, f.read_bytes())
        for f in sorted(d.rglob("*"))
        if f.is_file()
    }


@pytest.mark.timeout(180)
def test_a_merge_checkpoint_writes_only_its_fragment(tmp_path):
    from ddiloco.runtime.syncer.server import SyncerServer, SyncerServerConfig

    ck = tmp_path / "ck"
    P = 4  # noqa: N806 - the paper's symbol
    with live_syncer(checkpoint_dir=str(ck), P=P) as s:
        frag, c = s.frag, s.client
        _push(c, frag, s.inc, 0, 1)
        _merged(c, 0, 1)  # the first checkpoint writes every fragment
        first = s.server.counters["checkpoint_fragment_files"]
        assert first == P, s.server.counters
        seq = 2
        for p in (1, 1, 3):
            before = _on_disk(ck)
            files0 = s.server.counters["checkpoint_fragment_files"]
            version = c.status()["versions"][p] + 1
            _push(c, frag, s.inc, p, seq)
            seq += 1
            _merged(c, p, version)
            doc = json.loads((ck / "syncer.json").read_text())
            new = sorted(n for n in set(_on_disk(ck)) - set(before) if "/" in n)
            # one fragment file and the manifest's copy beside it (and the manifests)
            assert new == [
                f"{doc['data']}/fragment-{p:04d}.safetensors",
                f"{doc['data']}/syncer.json",
            ]
            assert s.server.counters["checkpoint_fragment_files"] == files0 + 1
            entry = doc["fragments"][p]
            manifest = (ck / "syncer.json").read_bytes()
            assert s.server.counters["checkpoint_bytes"] == entry["bytes"] + 2 * len(manifest)
            numel = sum(frag.fragments[p].numels)
            assert 8 * numel <= entry["bytes"] < 8 * numel + 4096  # its theta and momentum
            # no fragment file written before was touched; the others are named again
            after = _on_disk(ck)
            for name, was in before.items():
                if "fragment-" in name and name in after:
                    assert after[name] == was, name
            for q in set(range(P)) - {p}:
                assert doc["fragments"][q]["file"] in before, q
        versions = c.status()["versions"]
        published = {p: [t.clone() for t in c.fetch([p], exact=True)[p][1]] for p in range(P)}

    config = SyncerServerConfig(token="tok", checkpoint_dir=str(ck), resume=True, port=0)
    with SyncerServer(config) as s2:  # resumed: every fragment as published
        c2 = SyncerClient(f"127.0.0.1:{s2.port}", "tok")
        try:
            assert c2.status()["versions"] == versions
            for p in range(P):
                got = c2.fetch([p], exact=True)[p][1]
                assert all(torch.equal(a, b) for a, b in zip(got, published[p])), p
            # and the resumed fragments' files are named again, not rewritten
            r = c2.unary(
                "Join", {"learner": 0, "incarnation": -1, "fingerprint": c2.status()["fingerprint"]}
            )
            files0 = s2.counters.get("checkpoint_fragment_files", 0)
            _push(c2, fragmentation_from_spec(s2.spec), r["incarnation"], 2, 1)
            _merged(c2, 2, versions[2] + 1)
            assert s2.counters["checkpoint_fragment_files"] == files0 + 1
        finally:
            c2.close()


def test_a_write_reuses_only_files_that_are_there(tmp_path):
    path = tmp_path / "syncer.json"
    theta = [[torch.full((64,), 1.0)], [torch.full((8,), 2.0)]]
    snap = {"state": {"theta": theta, "momentum": [[t * 0 for t in f] for f in theta]}}
    w1 = save_atomic(snap, path)
    assert w1.written == [0, 1]
    w2 = save_atomic(snap, path, reuse={0: w1.fragments[0], 1: w1.fragments[1]})
    assert w2.written == [] and w2.fragments == w1.fragments
    (tmp_path / w1.fragments[1]["file"]).unlink()  # gone (by hand): written again
    w3 = save_atomic(snap, path, reuse={0: w1.fragments[0], 1: w1.fragments[1]})
    assert w3.written == [1]
    ck = load_checkpoint(path)
    assert torch.equal(ck["state"]["theta"][1][0], torch.full((8,), 2.0))
    bad = {**w1.fragments[0], "file": "../elsewhere/fragment-0000.safetensors"}
    assert save_atomic(snap, path, reuse={0: bad}).written == [0, 1]


def test_the_earlier_manifest_version_still_resumes_and_is_named_again(tmp_path):
    """A version-2 checkpoint (each checkpoint's files in its own directory, named
    relative to it) loads, and a version-3 write names its files."""
    path = tmp_path / "syncer.json"
    theta = [[torch.full((64,), 1.0)], [torch.full((8,), 2.0)]]
    snap = {"state": {"theta": theta, "momentum": [[t * 0 for t in f] for f in theta]}}
    save_atomic(snap, path)
    doc = json.loads(path.read_text())
    doc.pop("manifest_sha256")
    doc["version"] = 2
    for e in doc["fragments"]:
        e["file"] = e["file"].split("/", 1)[1]
    digest = hashlib.sha256(_canonical(doc)).hexdigest()  # the manifest's own checksum
    path.write_text(json.dumps({**doc, "manifest_sha256": digest}))
    ck = load_checkpoint(path, lazy=True)
    stored = stored_fragments(ck)
    assert stored is not None and stored[1]["file"] == f"{doc['data']}/fragment-0001.safetensors"
    assert torch.equal(ck["state"]["theta"][1][0], torch.full((8,), 2.0))
    w = save_atomic(snap, path, reuse={1: stored[1]})
    assert w.written == [0]
    assert torch.equal(load_checkpoint(path)["state"]["theta"][1][0], torch.full((8,), 2.0))


_TORN = """
import os, signal, sys
import torch
from ddiloco.runtime.syncer import checkpoint as C

def snap(i, a):
    theta = [[torch.full((1000,), float(a))], [torch.full((10,), 1.0)]]
    return {"i": i, "state": {"theta": theta, "momentum": [[t * 0 for t in f] for f in theta]}}

path = sys.argv[1] + "/syncer.json"
w = C.save_atomic(snap(1, 1), path, keep=2)
w = C.save_atomic(snap(2, 2), path, keep=2, reuse={1: w.fragments[1]})  # fragment 0 merged
assert w.written == [0], w
where, nth = sys.argv[2], int(sys.argv[3])
real, calls = getattr(C, where) if hasattr(C, where) else getattr(os, where), [0]

def killing(*a, **k):
    calls[0] += 1
    if calls[0] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)

setattr(C if hasattr(C, where) else C.os, where, killing)
w = C.save_atomic(snap(3, 3), path, keep=2, reuse={1: w.fragments[1]})  # merged again
"""


@pytest.mark.parametrize(
    ("where", "nth", "newest"),
    [
        ("_write_fragment", 1, 2),  # the merged fragment's file not written
        ("_write_synced", 1, 2),  # its file written, not the manifest's copy
        ("_fsync_dir", 1, 2),  # every file written, the directory under its temp name
        ("rename", 1, 2),
        ("_fsync_dir", 2, 2),  # renamed, no manifest names it
        ("_write_synced", 2, 2),  # the manifest's temp file not written
        ("replace", 1, 2),  # the manifests not moved down yet
        ("replace", 2, 2),  # moved down, the new one not renamed in
        ("_fsync_dir", 3, 3),  # renamed in, the directory not fsynced
        ("unlink", 1, 3),  # the clean-up: the superseded fragment file not removed yet
    ],
)
def test_a_writer_killed_in_an_incremental_write_leaves_a_loadable_checkpoint(
    tmp_path, where, nth, newest
):
    r = subprocess.run([sys.executable, "-c", _TORN, str(tmp_path), where, str(nth)], check=False)
    assert r.returncode == -signal.SIGKILL
    ck, _ = load_newest_valid(tmp_path / "syncer.json", keep=2)
    assert ck["i"] == newest
    assert torch.equal(ck["state"]["theta"][0][0], torch.full((1000,), float(newest)))
    assert torch.equal(ck["state"]["theta"][1][0], torch.full((10,), 1.0))  # the shared file
    remove_stale_temps(tmp_path)  # what a syncer does at start
    for m in [tmp_path / "syncer.json", tmp_path / "syncer.json.1"]:
        if m.exists():  # every manifest kept is loadable: none lost a file it names
            load_checkpoint(m)
    theta = [[torch.full((1000,), 4.0)], [torch.full((10,), 1.0)]]
    snap = {"i": 4, "state": {"theta": theta, "momentum": [[t * 0 for t in f] for f in theta]}}
    save_atomic(snap, tmp_path / "syncer.json", keep=2)  # and the next write goes on
    assert load_newest_valid(tmp_path / "syncer.json")[0]["i"] == 4
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.startswith(".")], names
    named = {
        f["file"].split("/")[0]
        for m in ("syncer.json", "syncer.json.1")
        for f in json.loads((tmp_path / m).read_text())["fragments"]
    } | {json.loads((tmp_path / m).read_text())["data"] for m in ("syncer.json", "syncer.json.1")}
    assert [n for n in names if n.startswith("syncer-")] == sorted(named), "nothing else is left"


@pytest.mark.timeout(300)
def test_a_syncer_killed_while_it_checkpoints_resumes_with_every_published_version(tmp_path):
    """Real SIGKILLs of a ``ddiloco syncer`` whose checkpoint thread writes one fragment per
    merge while a learner pushes both fragments as fast as they merge."""
    ck = tmp_path / "ck"
    s = SyncerProcess(tmp_path, "tok", "--checkpoint-dir", str(ck))
    client = SyncerClient(s.address, s.token)
    spec, inc = init_syncer(client, tiny_model())
    frag = fragmentation_from_spec(spec)
    published = []
    for kill_after_s in (0.7, 1.3, 0.2):
        start = client.status()["versions"]
        seen = list(start)  # the newest version of each fragment the learner saw published
        stop = threading.Event()

        def pushing(client=client, inc=inc, seen=seen, stop=stop) -> None:
            seq = 1
            while not stop.is_set():
                p = seq % 2
                try:
                    _push(client, frag, inc, p, seq)
                    seen[p] = max(seen[p], client.fetch([p])[p][0])
                except (SyncerError, OSError, KeyError, grpc.RpcError):
                    return  # the syncer is gone
                seq += 1

        _push(client, frag, inc, 0, 0)  # a merge in flight before the pushing starts
        t = threading.Thread(target=pushing, daemon=True)
        t.start()
        time.sleep(kill_after_s)
        s.proc.kill()  # SIGKILL, wherever the checkpoint thread is
        s.proc.wait()
        stop.set()
        t.join(30)
        client.close()
        s.log.close()
        (tmp_path / "port").unlink()
        s = SyncerProcess(tmp_path, "tok", "--checkpoint-dir", str(ck), "--resume")
        client = SyncerClient(s.address, s.token)
        versions = client.status()["versions"]
        assert all(v >= seen[p] for p, v in enumerate(versions)), (versions, seen)
        published.append(sum(seen) - sum(start))
        r = client.unary(
            "Join", {"learner": 0, "incarnation": -1, "fingerprint": client.status()["fingerprint"]}
        )
        inc = r["incarnation"]
    client.close()
    s.close()
    assert max(published) >= 2, f"merges published between the kills: {published}"
    log = (tmp_path / "syncer.log").read_text()
    assert "REJECTED" not in log and "Traceback" not in log, log
