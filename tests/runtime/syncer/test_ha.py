"""A replicated syncer (``ddiloco.runtime.syncer.ha``) against a real etcd: the election and
its fencing arithmetic, a leader SIGKILLed under real learners, a deposed leader refused by
itself and by learners. etcd runs on loopback (``etcd_helpers``); the tests skip only where
it is not installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from etcd_helpers import EtcdProcess
from runtime_helpers import SyncerProcess, init_syncer, push_header, read_jsonl, tiny_model

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.learner.leader import FollowingClient, LeaderFinder
from ddiloco.runtime.syncer.checkpoint import (
    CHECKPOINT_NAME,
    Written,
    load_checkpoint,
    save_atomic,
    stored_fragments,
)
from ddiloco.runtime.syncer.ha import Election, Fence, HAConfig, prepare_epoch_dir
from ddiloco.runtime.transport.etcd import leader_key
from ddiloco.runtime.transport.spec import fragmentation_from_spec


@pytest.fixture
def etcd(tmp_path):
    e = EtcdProcess(tmp_path / "etcd")
    yield e
    e.close()


@pytest.mark.timeout(60)
def test_a_key_is_created_once_and_goes_with_its_lease(etcd):
    c = etcd.client
    lease = c.grant(5)
    won, kv = c.create("/k", b"a", lease)
    assert won and kv is not None and kv.value == b"a"
    again, held = c.create("/k", b"b", c.grant(5))
    assert not again and held is not None
    assert held.value == b"a" and held.create_revision == kv.create_revision
    assert c.keepalive(lease) == 5
    c.revoke(lease)
    assert c.get("/k") is None
    assert c.keepalive(lease) == 0  # expired: the leader must know it lost
    won, kv2 = c.create("/k", b"c", c.grant(5))
    assert won and kv2 is not None and kv2.create_revision > kv.create_revision


@pytest.mark.timeout(60)
def test_a_dead_leader_stops_before_its_successor_is_elected(etcd):
    """The fencing arithmetic: leader A's lease stops being renewed (a pause or a
    partition); A stops counting itself the leader before B can be elected, and B's epoch is
    larger."""
    cfg = HAConfig(endpoint=etcd.endpoint, name="run", ttl_s=2, margin_s=0.5, poll_s=0.05)
    stop = threading.Event()
    won_a = Election(cfg, "a:1").campaign(stop)
    assert won_a is not None
    epoch_a, lease_a = won_a
    b = Election(cfg, "b:1")
    got: dict = {}

    def standby() -> None:
        got["b"] = b.campaign(stop)
        got["b_at"] = time.monotonic()

    t = threading.Thread(target=standby)
    t.start()
    time.sleep(1.0)
    assert "b" not in got and b.leader is not None and b.leader.address == "a:1"
    assert b.leader.epoch == epoch_a
    lease_a._stop.set()  # A's keepalives stop: it is paused or cut off from etcd
    invalid_at = None
    while invalid_at is None:
        if not lease_a.valid():
            invalid_at = time.monotonic()
        time.sleep(0.005)
    t.join(timeout=10)
    assert got["b"] is not None, "the standby was not elected"
    epoch_b, lease_b = got["b"]
    assert epoch_b > epoch_a
    assert invalid_at < got["b_at"], "the old leader still counted itself valid"
    # the margin is kept: at least margin_s between A's end and B's start (less the poll)
    assert got["b_at"] - invalid_at > cfg.margin_s - 0.2, got["b_at"] - invalid_at
    lease_b.close(revoke=True)
    stop.set()


@pytest.mark.timeout(60)
def test_a_leader_cut_off_from_etcd_gives_up_within_its_lease(etcd):
    cfg = HAConfig(endpoint=etcd.endpoint, name="run", ttl_s=2, margin_s=0.5, poll_s=0.05)
    won = Election(cfg, "a:1").campaign(threading.Event())
    assert won is not None
    _, lease = won
    time.sleep(1.0)
    assert lease.valid()
    os.kill(etcd.proc.pid, signal.SIGSTOP)  # etcd unreachable: keepalives time out
    try:
        cut = time.monotonic()
        assert lease.lost.wait(cfg.ttl_s + 1.0), "the leader did not give up"
        assert time.monotonic() - cut <= cfg.ttl_s - cfg.margin_s + 0.2
        assert not lease.valid()
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)
    lease.close(revoke=True)


def _snap(values: list[float], versions: list[int]) -> dict:
    """A checkpoint snapshot of ``len(values)`` fragments, fragment p's tensors all
    ``values[p]``."""
    return {
        "state": {
            "theta": [[torch.full((5,), v), torch.full((3,), v)] for v in values],
            "momentum": [[torch.full((5,), -v), torch.full((3,), -v)] for v in values],
        },
        "versions": versions,
    }


def _write(directory: Path, values: list[float], versions: list[int], prev=None, same=()):
    """An incremental checkpoint: the fragments in ``same`` named from ``prev``'s files."""
    reuse = {p: prev.fragments[p] for p in same} if prev is not None else None
    return save_atomic(_snap(values, versions), directory / CHECKPOINT_NAME, reuse=reuse)


def _values(manifest: Path) -> tuple[list[float], list[int]]:
    ck = load_checkpoint(manifest)
    theta = ck["state"]["theta"]
    for p, ts in enumerate(theta):
        assert all(torch.equal(m, -t) for m, t in zip(ck["state"]["momentum"][p], ts))
    return [float(ts[0][0]) for ts in theta], ck["versions"]


@pytest.mark.timeout(60)
def test_a_take_over_after_incremental_checkpoints_brings_every_file_its_manifests_name(
    tmp_path,
):
    base = tmp_path / "ck"
    old = base / "epoch-000000000003"
    # four incremental checkpoints: each writes only the fragment merged since the last
    w = _write(old, [1, 2, 3], [1, 1, 1])
    w = _write(old, [4, 2, 3], [2, 1, 1], w, same=(1, 2))
    w = _write(old, [4, 5, 3], [2, 2, 1], w, same=(0, 2))
    w = _write(old, [6, 5, 3], [3, 2, 1], w, same=(1, 2))
    named = {e["file"] for e in w.fragments if e}
    assert named == {
        "syncer-000004/fragment-0000.safetensors",
        "syncer-000003/fragment-0001.safetensors",
        "syncer-000001/fragment-0002.safetensors",
    }
    (old / ".syncer-000005.tmp.1").mkdir()  # a write in progress: not taken
    mine, resume = prepare_epoch_dir(base, 9)
    assert resume and mine.name == "epoch-000000000009"
    assert not (mine / ".syncer-000005.tmp.1").exists()
    # every file the kept manifests name is there, the same inode (a link, not a copy)
    for f in named:
        assert (mine / f).stat().st_ino == (old / f).stat().st_ino
    assert _values(mine / CHECKPOINT_NAME) == ([6, 5, 3], [3, 2, 1])
    assert _values(mine / f"{CHECKPOINT_NAME}.1") == ([4, 5, 3], [2, 2, 1])
    assert _values(mine / f"{CHECKPOINT_NAME}.2") == ([4, 2, 3], [2, 1, 1])
    assert (mine / "syncer-000004" / CHECKPOINT_NAME).is_file()  # the recovery copy

    # the deposed leader goes on writing in its own directory: three full checkpoints, whose
    # clean-up removes every file of the four above there; nothing of the new leader's moves
    w_old = w
    for k in range(3):
        w_old = _write(old, [10 + k] * 3, [9, 9, 9])
    assert not (old / "syncer-000001").exists() and not (old / "syncer-000004").exists()
    assert _values(mine / CHECKPOINT_NAME) == ([6, 5, 3], [3, 2, 1])

    # the new leader writes incrementally in its directory (fragment 0 only), reusing the
    # linked files; its clean-up drops only its own links that no manifest of it names
    stored = stored_fragments(load_checkpoint(mine / CHECKPOINT_NAME, lazy=True))
    assert stored is not None
    w = Written(0, stored, [])
    for k in range(4):
        w = _write(mine, [20 + k, 5, 3], [4 + k, 2, 1], w, same=(1, 2))
    assert not (mine / "syncer-000004").exists()  # fragment 0 of v3 is named by none now
    assert (mine / "syncer-000001" / "fragment-0002.safetensors").is_file()  # still named
    assert _values(mine / CHECKPOINT_NAME) == ([23, 5, 3], [7, 2, 1])
    assert _values(old / CHECKPOINT_NAME) == ([12, 12, 12], [9, 9, 9])  # untouched by it
    assert w_old.written == [0, 1, 2]

    # a third leader takes over from the second: the fragment files its manifests name
    # lie in four fragment directories, two of them linked in from the first epoch
    third, resume = prepare_epoch_dir(base, 15)
    assert resume and _values(third / CHECKPOINT_NAME) == ([23, 5, 3], [7, 2, 1])
    assert sorted(p.name for p in base.iterdir()) == [
        "epoch-000000000003",
        "epoch-000000000009",
        "epoch-000000000015",
    ]
    first, resume = prepare_epoch_dir(tmp_path / "fresh", 2)
    assert not resume and first.is_dir()


@pytest.mark.timeout(60)
def test_a_take_over_leaves_out_a_manifest_whose_files_are_gone(tmp_path):
    """A manifest read while the deposed leader's clean-up removes what it names is left
    out (here: a file of the newest is gone); a damaged one too; the rest are taken."""
    base = tmp_path / "ck"
    old = base / "epoch-000000000003"
    w = _write(old, [1, 2], [1, 1])
    w = _write(old, [3, 2], [2, 1], w, same=(1,))
    w = _write(old, [3, 4], [2, 2], w, same=(0,))
    (old / "syncer-000003" / "fragment-0001.safetensors").unlink()
    mine, resume = prepare_epoch_dir(base, 4, attempts=1)
    assert resume
    assert _values(mine / CHECKPOINT_NAME) == ([3, 2], [2, 1])
    assert _values(mine / f"{CHECKPOINT_NAME}.1") == ([1, 2], [1, 1])
    assert not (mine / f"{CHECKPOINT_NAME}.2").exists()
    # nothing intact at all in the newest epoch: the one before it is taken, loudly
    newer = base / "epoch-000000000005"
    newer.mkdir()
    (newer / CHECKPOINT_NAME).write_text("{}")
    again, resume = prepare_epoch_dir(base, 6, attempts=1)
    assert resume and _values(again / CHECKPOINT_NAME) == ([3, 2], [2, 1])


@pytest.mark.timeout(60)
def test_learners_refuse_a_reply_of_an_older_epoch(tmp_path):
    """A deposed leader that still answers (its check passed, then it paused) is refused by
    a learner that has heard a newer leader, on gRPC and on the data port."""
    from ddiloco.runtime.syncer.server import SyncerServer, SyncerServerConfig

    class ValidLease:  # a leader that believes its lease is valid
        why = ""

        def valid(self) -> bool:
            return True

        def remaining_s(self) -> float:
            return 5.0

    server = SyncerServer(SyncerServerConfig(token="tok", port=0))
    server.fence = Fence(3, ValidLease(), "run", "old")  # type: ignore[arg-type]
    port = server.start()
    try:
        plain = SyncerClient(f"127.0.0.1:{port}", "tok")
        spec, inc = init_syncer(plain, tiny_model())
        assert plain.unary("Join", {"learner": 0, "incarnation": inc})["epoch"] == 3
        assert plain.fetch([0], learner=None, exact=True)  # over the data port, stamped
        plain.close()
        follower = FollowingClient(f"127.0.0.1:{port},127.0.0.1:1", "tok")
        follower.unary("Status", {})
        assert follower.epoch == 3
        follower.epoch = 4  # a newer leader has been heard
        follower.use_data_port(server.bulk_port)  # the fetch goes over the data port
        for call in (
            lambda: follower.unary("Status", {}),
            lambda: follower.fetch([0], exact=True),
        ):
            with pytest.raises(grpc.RpcError) as ei:
                call()
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            assert ei.value.details().startswith("E_STALE_EPOCH"), ei.value.details()
        follower.use_data_port(None)  # the gRPC fetch is checked too
        with pytest.raises(grpc.RpcError) as ei:
            follower.fetch([0], exact=True)
        assert ei.value.details().startswith("E_STALE_EPOCH"), ei.value.details()
        follower.close()
    finally:
        server.close()


def _syncer(tmp: Path, name: str, etcd: EtcdProcess, ck: Path, *extra: str) -> SyncerProcess:
    (tmp / name).mkdir()
    return SyncerProcess(
        tmp / name,
        "tok",
        "--ha",
        etcd.endpoint,
        "--ha-name",
        "run",
        "--ha-ttl-s",
        "3",
        "--checkpoint-dir",
        str(ck),
        "--heartbeat-timeout-s",
        "3",
        *extra,
    )


def _leader(etcd: EtcdProcess) -> tuple[str, int] | None:
    kv = etcd.client.get(leader_key("run"))
    return None if kv is None else (json.loads(kv.value)["address"], kv.create_revision)


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _learner(tmp: Path, m: int, target: str, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddiloco.runtime.cli",
            "learner",
            "--syncer",
            target,
            "--learner",
            str(m),
            "--run-dir",
            str(tmp / f"learner_{m}"),
            "--steps",
            str(steps),
            "--model",
            "gpt_tiny",
            "--batch-size",
            "8",
            "--block-size",
            "32",
            "--vocab-size",
            "64",
            "--fragments",
            "4",
            "-H",
            "8",
            "--tau",
            "2",
            "--eval-batches",
            "2",
            "--no-progress",
            "--heartbeat-interval-s",
            "0.5",
            "--chaos.slowdown",
            str(m),
            "3.0",
        ],
        env={**os.environ, "DDILOCO_TOKEN": "tok"},
        stdout=open(tmp / f"learner_{m}.log", "wb"),
        stderr=subprocess.STDOUT,
    )


def _steps(tmp: Path, m: int) -> list[dict]:
    p = tmp / f"learner_{m}" / "metrics.jsonl"
    return [r for r in read_jsonl(p) if r["kind"] == "step"] if p.exists() else []


def _learners_at(tmp: Path, a, b, etcd, steps: int, at: int) -> list[subprocess.Popen]:
    """Two learners of ``steps`` steps, one given both syncers' addresses and one the etcd
    endpoint, once both have trained ``at`` steps (neither may exit before)."""
    learners = [
        _learner(tmp, 0, f"{a.address},{b.address}", steps),
        _learner(tmp, 1, f"{etcd.endpoint}/run", steps),
    ]

    def reached() -> bool:
        for m, p in enumerate(learners):
            assert p.poll() is None, (tmp / f"learner_{m}.log").read_text()[-3000:]
        return all(len(_steps(tmp, m)) >= at for m in (0, 1))

    _wait(reached, 180, f"step {at}")
    return learners


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_leader_sigkill_the_standby_leads_and_learners_follow(etcd, tmp_path):
    ck = tmp_path / "ck"  # the shared disk
    a = _syncer(tmp_path, "a", etcd, ck)
    _wait(lambda: _leader(etcd), 30, "a leader")
    b = _syncer(tmp_path, "b", etcd, ck)
    try:
        assert _leader(etcd)[0] == a.address
        # a standby answers with its role, and refuses training calls naming the leader
        finder = LeaderFinder(f"{a.address},{b.address}", "tok")
        assert finder._probe(b.address)["role"] == "standby"
        c = SyncerClient(b.address, "tok")
        with pytest.raises(grpc.RpcError) as ei:
            c.unary("Join", {"learner": 0, "incarnation": -1})
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "E_NOT_LEADER" in ei.value.details() and a.address in ei.value.details()
        c.close()
        steps = 500
        learners = _learners_at(tmp_path, a, b, etcd, steps, 80)
        epoch_a = _leader(etcd)[1]
        a.proc.kill()
        killed = time.monotonic()
        killed_wall = time.time()
        new = _wait(lambda: (ld := _leader(etcd)) and ld[0] == b.address and ld, 30, "b leads")
        elected_s = time.monotonic() - killed
        assert new[1] > epoch_a
        assert elected_s <= 3 + 0.5 + 1.0, elected_s  # TTL + poll, and a loaded machine
        for p in learners:
            assert p.wait(240) == 0, (tmp_path / "learner_0.log").read_text()[-3000:]
        resume = next(
            r for r in read_jsonl(tmp_path / "b" / "syncer.jsonl") if r["kind"] == "resume"
        )
        merges_after = [
            r for r in read_jsonl(tmp_path / "b" / "syncer.jsonl") if r["kind"] == "merge"
        ]
        assert merges_after, "the new leader merged nothing"
        for m in (0, 1):
            rows = _steps(tmp_path, m)
            assert rows[-1]["step"] == steps
            # nothing a learner installed before the kill is missing from the new leader
            for r in rows:
                if r["wall"] < killed_wall:
                    for p, v in r["installed"].items():
                        assert resume["versions"][int(p)] >= v, (m, p, v, resume["versions"])
            # the learner trained on through the failover: no gap of more than a few steps
            walls = [r["wall"] for r in rows if killed_wall - 5 < r["wall"] < killed_wall + 15]
            gaps = [y - x for x, y in zip(walls, walls[1:])]
            assert max(gaps) < 2.0, max(gaps)
            log = (tmp_path / f"learner_{m}.log").read_text()
            assert f"-> {b.address}" in log, log[-3000:]
            installed_after = [r for r in rows if r["wall"] > killed_wall + elected_s]
            assert any(
                any(v > resume["versions"][int(p)] for p, v in r["installed"].items())
                for r in installed_after
            ), "no version of the new leader was installed"
        print(f"failover: the standby led {elected_s:.2f} s after the SIGKILL (TTL 3 s)")
    finally:
        a.close()
        b.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_paused_leader_is_deposed_and_fences_itself(etcd, tmp_path):
    ck = tmp_path / "ck"
    a = _syncer(tmp_path, "a", etcd, ck)
    _wait(lambda: _leader(etcd), 30, "a leader")
    b = _syncer(tmp_path, "b", etcd, ck)
    try:
        ca = SyncerClient(a.address, "tok")
        spec, inc = init_syncer(ca, tiny_model())
        frag = fragmentation_from_spec(spec)
        base = ca.fetch([0])[0][1]
        data = b"".join(get_codec("fp32").encode(t.view(-1) + 0.01) for t in base)
        h = push_header(frag, 0, data, inc, (inc << 32) + 1)
        assert ca.push(h, data)["status"] == "accepted"
        # published once durable: version 1 is on the shared disk when a learner sees it
        _wait(lambda: ca.fetch([0])[0][0] == 1, 30, "version 1 published")
        epoch_a = _leader(etcd)[1]
        os.kill(a.proc.pid, signal.SIGSTOP)  # a long pause: the lease lapses
        try:
            _wait(lambda: (ld := _leader(etcd)) and ld[0] == b.address, 30, "b leads")
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        assert _leader(etcd)[1] > epoch_a
        # back from its pause, the old leader answers nothing as a leader: refused (its
        # lease lapsed), cut off (its server closing), then refused as a standby
        deadline = time.monotonic() + 30
        while True:
            with pytest.raises(grpc.RpcError) as ei:
                ca.unary("Join", {"learner": 0, "incarnation": inc}, timeout_s=5.0)
            if "E_NOT_LEADER" in ei.value.details():
                break
            assert ei.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            assert time.monotonic() < deadline, ei.value.details()
            time.sleep(0.1)
        ca.close()
        finder = LeaderFinder(f"{a.address},{b.address}", "tok")
        assert _wait(lambda: finder.find(), 30, "a leader found")[0] == b.address
        _wait(lambda: (finder._probe(a.address) or {}).get("role") == "standby", 30, "a stands by")
        # the new leader resumed the old one's model from the shared disk
        cb = SyncerClient(b.address, "tok")
        r = cb.unary("Join", {"learner": 0, "incarnation": -1})
        assert r["need_init"] is False and r["versions"][0] == 1, r
        cb.close()
    finally:
        a.close()
        b.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hot_standby_leader_sigkilled_and_its_disk_lost_nothing_installed_is_missing(
    etcd, tmp_path
):
    """--ha-replicate, each syncer on its own disk: the leader is SIGKILLed and its
    checkpoint directory deleted (the machine died); the standby leads from the copy the
    leader replicated to it, and every version a learner installed is in it."""
    a = _syncer(tmp_path, "a", etcd, tmp_path / "disk-a", "--ha-replicate")
    _wait(lambda: _leader(etcd), 30, "a leader")
    b = _syncer(tmp_path, "b", etcd, tmp_path / "disk-b", "--ha-replicate")
    try:
        assert _leader(etcd)[0] == a.address
        steps = 300
        learners = _learners_at(tmp_path, a, b, etcd, steps, 60)
        a.proc.kill()
        killed_wall = time.time()
        shutil.rmtree(tmp_path / "disk-a")  # the leader's disk died with it
        _wait(lambda: (ld := _leader(etcd)) and ld[0] == b.address, 30, "b leads")
        for m, p in enumerate(learners):
            assert p.wait(240) == 0, (tmp_path / f"learner_{m}.log").read_text()[-3000:]
        events = read_jsonl(tmp_path / "b" / "syncer.jsonl")
        resume = next(r for r in events if r["kind"] == "resume")
        assert any(r["kind"] == "merge" for r in events), "the new leader merged nothing"
        log = (tmp_path / "b" / "syncer.log").read_text()
        assert "the standby's copy" in log, log[-3000:]
        installed_before = 0
        for m in (0, 1):
            rows = _steps(tmp_path, m)
            assert rows[-1]["step"] == steps
            for r in rows:
                if r["wall"] < killed_wall:
                    for p, v in r["installed"].items():
                        installed_before = max(installed_before, v)
                        assert resume["versions"][int(p)] >= v, (m, p, v, resume["versions"])
        assert installed_before > 0, "no learner installed a merged version before the kill"
        print(f"hot standby: resumed at versions {resume['versions']}")
    finally:
        a.close()
        b.close()
