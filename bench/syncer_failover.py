"""Failover time of a replicated syncer: SIGKILL the leader, time until the standby serves.

Starts a real etcd (Debian's etcd-server) on loopback and two ``ddiloco syncer --ha``
processes sharing a checkpoint directory, sets up the model (Init and one merge, so the
checkpoint holds it), then ``--kills`` times: SIGKILL the leader and time until the other
one answers a Join as the leader with a larger epoch (the key's new creation revision);
the killed one is started again as the next standby. Writes ``failover.json`` and
``failover.md`` under ``--out``.

    PYTHONPATH=src python bench/syncer_failover.py --kills 5 --ttl-s 3 --out /tmp/failover
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--ttl-s", type=int, default=3)
    ap.add_argument("--out", default="/tmp/failover")
    a = ap.parse_args()
    from ddiloco.runtime.launch.launcher import free_ports
    from ddiloco.runtime.learner.client import SyncerClient
    from ddiloco.runtime.transport.etcd import EtcdClient, EtcdError

    exe = shutil.which("etcd")
    if exe is None:
        sys.exit("etcd is not installed: apt-get install etcd-server")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="failover-"))
    cport, pport, pa, pb = free_ports(4)
    url = f"http://127.0.0.1:{cport}"
    etcd = subprocess.Popen(
        [exe, "--name", "b", "--data-dir", str(tmp / "etcd"), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{pport}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
         "--initial-cluster", f"b=http://127.0.0.1:{pport}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    ec = EtcdClient(url)
    while True:
        try:
            ec.get("/ping")
            break
        except EtcdError:
            time.sleep(0.1)
    env = {**os.environ, "DDILOCO_TOKEN": "tok"}

    def start(port: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "ddiloco.runtime.cli", "syncer", "--port", str(port),
             "--ha", f"etcd://127.0.0.1:{cport}", "--ha-name", "bench",
             "--ha-ttl-s", str(a.ttl_s), "--checkpoint-dir", str(tmp / "ck")],
            env=env, stdout=open(tmp / f"syncer-{port}.log", "ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip

    def leader() -> tuple[str, int] | None:
        kv = ec.get("/ddiloco/bench/leader")
        return None if kv is None else (json.loads(kv.value)["address"], kv.create_revision)

    def serves(address: str) -> bool:
        c = SyncerClient(address, "tok")
        try:
            c.unary("Join", {"learner": 0, "incarnation": -1}, timeout_s=1.0)
            return True
        except grpc.RpcError:
            return False
        finally:
            c.close()

    procs = {pa: start(pa)}
    while leader() is None:
        time.sleep(0.05)
    procs[pb] = start(pb)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from runtime_helpers import init_syncer, tiny_model

    first = leader()
    assert first is not None
    c = SyncerClient(first[0], "tok")
    init_syncer(c, tiny_model())
    c.close()
    time.sleep(2.0)  # the standby binds its port
    rows = []
    for k in range(a.kills):
        old = leader()
        assert old is not None
        port = int(old[0].rsplit(":", 1)[1])
        t0 = time.monotonic()
        os.kill(procs[port].pid, signal.SIGKILL)
        procs[port].wait()
        while (ld := leader()) is None or ld[1] <= old[1]:
            time.sleep(0.01)
        elected = time.monotonic() - t0
        while not serves(ld[0]):
            time.sleep(0.01)
        serving = time.monotonic() - t0
        rows.append({"kill": k, "elected_s": round(elected, 3), "serving_s": round(serving, 3)})
        print(rows[-1], flush=True)
        procs[port] = start(port)  # the next standby
        time.sleep(3.0)
    for p in procs.values():
        p.kill()
    etcd.kill()
    shutil.rmtree(tmp, ignore_errors=True)
    el = [r["elected_s"] for r in rows]
    sv = [r["serving_s"] for r in rows]
    doc = {
        "ttl_s": a.ttl_s,
        "kills": rows,
        "elected_median_s": statistics.median(el),
        "elected_max_s": max(el),
        "serving_median_s": statistics.median(sv),
        "serving_max_s": max(sv),
    }
    (out / "failover.json").write_text(json.dumps(doc, indent=2))
    md = [
        f"# Syncer failover (TTL {a.ttl_s} s, {a.kills} SIGKILLs of the leader)",
        "",
        "| kill | new leader elected (s) | new leader serving a Join (s) |",
        "|---|---|---|",
        *(f"| {r['kill']} | {r['elected_s']} | {r['serving_s']} |" for r in rows),
        "",
        f"Median {doc['elected_median_s']} s to election, {doc['serving_median_s']} s to "
        f"serving (max {doc['elected_max_s']} / {doc['serving_max_s']}).",
    ]
    (out / "failover.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
