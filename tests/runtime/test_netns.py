"""No loopback assumptions: syncer shards and learners in network namespaces of their own.

Each process runs in its own namespace with its own address on a bridge (in a namespace of
its own too). The syncer shards bind 0.0.0.0; learners reach them by address, learn the
shard map and the data port from the Join reply, and push and fetch over the data port;
``ddiloco status`` from yet another namespace sees both shards. Needs root and iproute2;
skips, saying why, where namespaces cannot be made. Everything made is removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_helpers import TINY, read_jsonl

PREFIX = f"ddcl{os.getpid() % 100000}"
SUBNET = "10.213.7"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Namespaces:
    """A bridge namespace and one namespace per host, each with a veth into the bridge."""

    def __init__(self, hosts: list[str]) -> None:
        self.bridge = f"{PREFIX}br"
        self.made: list[str] = []
        self.addr: dict[str, str] = {}
        try:
            _ip("netns", "add", self.bridge)
            self.made.append(self.bridge)
            self._in(self.bridge, "link", "add", "br0", "type", "bridge")
            self._in(self.bridge, "link", "set", "br0", "up")
            for i, h in enumerate(hosts):
                ns = f"{PREFIX}{h}"
                _ip("netns", "add", ns)
                self.made.append(ns)
                a, b = f"{PREFIX}{i}a", f"{PREFIX}{i}b"
                _ip("link", "add", a, "type", "veth", "peer", "name", b)
                _ip("link", "set", a, "netns", ns)
                _ip("link", "set", b, "netns", self.bridge)
                self._in(self.bridge, "link", "set", b, "master", "br0")
                self._in(self.bridge, "link", "set", b, "up")
                self.addr[h] = f"{SUBNET}.{i + 1}"
                self._in(ns, "addr", "add", f"{self.addr[h]}/24", "dev", a)
                self._in(ns, "link", "set", a, "up")
                self._in(ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _in(ns: str, *args: str) -> None:
        _ip("-n", ns, *args)

    def ns(self, host: str) -> str:
        return f"{PREFIX}{host}"

    def close(self) -> None:
        for ns in reversed(self.made):  # deleting a namespace deletes its veth ends
            _ip("netns", "delete", ns, check=False)
        self.made.clear()


@pytest.fixture
def namespaces():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    try:
        nss = Namespaces(["s0", "s1", "l0", "l1", "ops"])
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
    try:
        yield nss
    finally:
        nss.close()


def _spawn(nss: Namespaces, host: str, args: list[str], log: Path, env: dict):
    return subprocess.Popen(
        ["ip", "netns", "exec", nss.ns(host), sys.executable, "-m", "ddiloco.runtime.cli", *args],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shards_and_learners_in_their_own_namespaces(namespaces, tmp_path):
    nss = namespaces
    env = {**os.environ, "DDILOCO_TOKEN": "netns-token", "OMP_NUM_THREADS": "1"}
    shards = ",".join(f"{nss.addr[h]}:50051" for h in ("s0", "s1"))
    procs = []
    try:
        for k, h in enumerate(("s0", "s1")):
            procs.append(
                _spawn(
                    nss,
                    h,
                    [
                        "syncer",
                        "--host",
                        "0.0.0.0",
                        "--port",
                        "50051",
                        "--shards",
                        shards,
                        "--shard",
                        str(k),
                        "--step-budget",
                        "120",
                        "--heartbeat-timeout",
                        "5",
                        "--metrics-file",
                        str(tmp_path / f"syncer_{k}.jsonl"),
                        "--checkpoint-dir",
                        str(tmp_path / f"ckpt_{k}"),
                    ],
                    tmp_path / f"syncer_{k}.log",
                    env,
                )
            )
        # both shards listen before the learners start: a learner whose Join reaches shard 0
        # but not a shard still starting tries again and is given the next id
        deadline = time.monotonic() + 60
        logs = [tmp_path / f"syncer_{k}.log" for k in (0, 1)]
        while not all(f.exists() and "listening" in f.read_text(errors="replace") for f in logs):
            assert time.monotonic() < deadline, "the syncer shards did not start listening"
            time.sleep(0.1)
        from ddiloco.config import TrainConfig, dump_config

        cfg = tmp_path / "cfg.toml"
        dump_config(TrainConfig(**{**TINY, "learners": 2, "steps": 60}), cfg)
        learners = [
            _spawn(
                nss,
                h,
                [
                    "learner",
                    "--syncer",
                    f"{nss.addr['s0']}:50051",
                    "--config",
                    str(cfg),
                    "--run-dir",
                    str(tmp_path / "learner_{learner}"),
                    "--connect-timeout",
                    "60",
                ],
                tmp_path / f"{h}.log",
                env,
            )
            for h in ("l0", "l1")
        ]
        procs += learners
        for p in learners:
            assert p.wait(timeout=150) == 0, [f.read_text()[-3000:] for f in tmp_path.glob("*.log")]
        # status from a third namespace, through shard 1's address: both shards answer
        probe = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                nss.ns("ops"),
                sys.executable,
                "-c",
                f"""
import json
from ddiloco.runtime.launch.status import fetch_status
from ddiloco.runtime.learner.client import SyncerClient
st = fetch_status("{nss.addr["s1"]}:50051")
c = SyncerClient("{nss.addr["s0"]}:50051", "netns-token")
r = c.unary("Join", {{"learner": 7, "incarnation": -1}})
got = c.fetch(None)       # over the advertised data port, reached from this namespace
print(json.dumps({{"shards": st["shards"], "merges": st["merges"], "live": st["live"],
                  "bulk_port": r["bulk_port"], "data_port_used": c.data is not None,
                  "fetched": sorted(got)}}))
""",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert probe.returncode == 0, probe.stderr
        out = json.loads(probe.stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert [s["up"] for s in out["shards"]] == [True, True]
    assert out["merges"] > 0
    assert out["bulk_port"] and out["data_port_used"]
    assert out["fetched"] == [p for p in range(TINY["fragments"]) if p % 2 == 0]
    for h in ("l0", "l1"):
        text = (tmp_path / f"{h}.log").read_text()
        assert "unreachable" not in text, text[-2000:]  # no fallback from the data port
    for k in (0, 1):
        rows = read_jsonl(tmp_path / f"syncer_{k}.jsonl")
        assert len([r for r in rows if r["kind"] == "join"]) >= 2
        merged = {r["fragment"] for r in rows if r["kind"] == "merge"}
        assert merged and all(p % 2 == k for p in merged), (k, merged)
    ids = sorted(int(d.name.split("_")[1]) for d in tmp_path.glob("learner_*"))
    assert ids == [0, 1]  # assigned by shard 0
    for m in ids:
        final = json.loads((tmp_path / f"learner_{m}" / "final.json").read_text())
        led = final["ledger"]
        assert led["merged"] > 0
        assert abs(led["computed"] - sum(v for k, v in led.items() if k != "computed")) < 1e-6
