"""Where a link's bytes go: frame bytes per TCP connection of a run's capture
(``bench/wan/run.py --pcap`` writes ``OUT/link.pcap``, headers only).

    python bench/wan/pcap_bytes.py runs/wan/x

Prints, per connection (client address and port, server port), frames, bytes and bytes per
second both ways, and the requests per second (frames carrying data from the client), so
that the syncer's port (gRPC: Join, Watch long polls on one channel, heartbeats on their own
channel) and its data port (pushes and fetches) can be told apart. Needs ``tcpdump``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path

LINE = re.compile(
    r"^(?P<t>[\d.]+) .*?length (?P<len>\d+): (?P<src>[\d.]+)\.(?P<sp>\d+) > "
    r"(?P<dst>[\d.]+)\.(?P<dp>\d+): .*?length (?P<payload>\d+)"
)


def connections(
    pcap: Path, server_ports: set[int], t0: float = 0.0, t1: float = float("inf")
) -> tuple[dict, float]:
    """(connection -> {frames, bytes, requests, first, last}, span_s) of the frames
    captured between Unix times t0 and t1."""
    out = subprocess.run(
        ["tcpdump", "-nn", "-tt", "-e", "-r", str(pcap), "tcp"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    conns: dict = defaultdict(lambda: {"frames": 0, "bytes": 0, "requests": 0})
    t_min = t_max = None
    for line in out.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        t, n = float(m["t"]), int(m["len"])
        if not t0 <= t <= t1:
            continue
        sp, dp = int(m["sp"]), int(m["dp"])
        if dp in server_ports:
            key, from_client = (m["src"], sp, dp), True
        elif sp in server_ports:
            key, from_client = (m["dst"], dp, sp), False
        else:
            key, from_client = (m["src"], sp, dp), True
        c = conns[key]
        c["frames"] += 1
        c["bytes"] += n
        if from_client and int(m["payload"]) > 0:
            c["requests"] += 1
        c.setdefault("first", t)
        c["last"] = t
        t_min = t if t_min is None else min(t_min, t)
        t_max = t if t_max is None else max(t_max, t)
    return dict(conns), (t_max - t_min) if t_min is not None else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="run directory holding link.pcap")
    ap.add_argument("--ports", default="50051,50052", help="the syncer's ports")
    a = ap.parse_args()
    ports = {int(p) for p in a.ports.split(",")}
    run = Path(a.run)
    # the training window: the run's first to last inner step (as the link counters)
    regions = json.loads((run / "result.json").read_text())["regions"].values()
    t0 = min(r["first_wall"] for r in regions)
    t1 = max(r["last_wall"] for r in regions)
    conns, span = connections(run / "link.pcap", ports, t0, t1)
    print(f"training window {t1 - t0:.1f} s, frames in it {span:.1f} s")
    print("| client | server port | frames | bytes | B/s | requests/s | B per request |")
    print("|---|---|---|---|---|---|---|")
    total = 0
    for (host, cport, sport), c in sorted(conns.items(), key=lambda kv: -kv[1]["bytes"]):
        total += c["bytes"]
        life = max(1e-9, c["last"] - c["first"])
        per = c["bytes"] / c["requests"] if c["requests"] else float("nan")
        print(
            f"| {host}:{cport} | {sport} | {c['frames']} | {c['bytes']} | "
            f"{c['bytes'] / max(span, 1e-9):.0f} | {c['requests'] / life:.2f} | {per:.0f} |"
        )
    print(f"total {total} B, {total / max(span, 1e-9):.0f} B/s")


if __name__ == "__main__":
    main()
