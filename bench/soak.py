"""Soak test: a real run (``ddiloco train --engine processes``) under mixed chaos for a fixed
wall time, sampling the syncer's resident memory and thread count.

Chaos mixes learner SIGKILLs, SIGSTOPs longer than the heartbeat timeout, a slow learner,
syncer SIGKILL + resume, and an emulated slow link. Every ``--sample-s`` the syncer process
(found by its port file; a new one after each syncer kill) is read from /proc. At the end
the run is interrupted (SIGINT, as Ctrl-C) and the script prints, and writes to
``OUT/soak.json``: RSS and threads in the first and last fifth of the samples (per syncer
process), the chaos events injected, the learners' and the syncer's final state.

    python bench/soak.py --minutes 30 --out runs/soak

Flat means: the last fifth's median RSS within 10% (or 20 MiB) of the first fifth's, and
the thread count bounded (no growth with connections or time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHAOS = {
    "seed": 7,
    "kill_mean_interval_s": 60.0,
    "kill_downtime_s": 2.0,
    "stop_mean_interval_s": 45.0,
    "stop_duration_s": 6.0,  # longer than the launcher's 3 s heartbeat timeout
    "slowdown": {2: 1.5},
    "syncer_kill_at_s": [],  # filled in from --minutes: every 5 minutes
    "syncer_downtime_s": 2.0,
    "link_latency_s": 0.005,
    "start_after_s": 10.0,
}


def _proc_stats(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, threads) of ``pid`` from /proc, or None if it is gone."""
    try:
        rss = threads = None
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        return (rss, threads) if rss is not None and threads is not None else None
    except OSError:
        return None


def _syncer_pid(out: Path) -> int | None:
    """The process listening on the port in ``out/syncer.port`` (the syncer may be forked
    from the launcher's fork server, so its command line does not name it)."""
    try:
        port = int((out / "syncer.port").read_text())
    except (OSError, ValueError):
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{f[9]}]")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(d.name)
        except OSError:
            continue
    return None


def _fifths(xs: list[float]) -> tuple[float, float]:
    k = max(1, len(xs) // 5)
    return statistics.median(xs[:k]), statistics.median(xs[-k:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--out", default="runs/soak")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--sample-s", type=float, default=5.0)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    horizon_s = args.minutes * 60
    chaos = dict(
        CHAOS, syncer_kill_at_s=[t for t in range(300, int(horizon_s) - 30, 300)] or [horizon_s / 2]
    )
    (out / "chaos.json").write_text(json.dumps(chaos))
    cmd = [
        sys.executable,
        "-m",
        "ddiloco.cli",
        "train",
        "--engine",
        "processes",
        "--method",
        "decoupled",
        "--learners",
        str(args.learners),
        "--steps",
        "10000000",
        "--model",
        "gpt_tiny",
        "--batch-size",
        "8",
        "--eval-every",
        "1000000",
        "--chaos",
        str(out / "chaos.json"),
        "--out",
        str(out / "run"),
        "--no-progress",
    ]
    log = open(out / "train.log", "wb")
    t0 = time.monotonic()
    train = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    samples: list[dict] = []
    try:
        while time.monotonic() - t0 < horizon_s and train.poll() is None:
            pid = _syncer_pid(out / "run")
            st = _proc_stats(pid) if pid else None
            if st:
                samples.append(
                    {
                        "t_s": round(time.monotonic() - t0, 1),
                        "pid": pid,
                        "rss_bytes": st[0],
                        "threads": st[1],
                    }
                )
            time.sleep(args.sample_s)
    finally:
        if train.poll() is None:
            train.send_signal(signal.SIGINT)
            try:
                train.wait(120)
            except subprocess.TimeoutExpired:
                train.kill()
                train.wait()
        log.close()
    with open(out / "samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    per_pid: dict[int, list[dict]] = {}
    for s in samples:
        per_pid.setdefault(s["pid"], []).append(s)
    procs = []
    for pid, ss in per_pid.items():
        rss0, rss1 = _fifths([s["rss_bytes"] / 2**20 for s in ss])
        procs.append(
            {
                "pid": pid,
                "samples": len(ss),
                "from_s": ss[0]["t_s"],
                "to_s": ss[-1]["t_s"],
                "rss_mib_first_fifth": round(rss0, 1),
                "rss_mib_last_fifth": round(rss1, 1),
                "threads_min": min(s["threads"] for s in ss),
                "threads_max": max(s["threads"] for s in ss),
            }
        )
    events: dict[str, int] = {}
    chaos_log = out / "run" / "chaos.jsonl"
    if chaos_log.is_file():
        for line in chaos_log.read_text().splitlines():
            kind = json.loads(line).get("kind", "?")
            events[kind] = events.get(kind, 0) + 1
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "minutes": args.minutes,
        "wall_s": round(time.monotonic() - t0, 1),
        "train_returncode": train.returncode,
        "syncer_processes": procs,
        "chaos_events": events,
    }
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
