"""One training run across emulated WAN regions: DP (Gloo all-reduce every step),
synchronous DiLoCo (the syncer, whole model every H steps, every learner waits for the merge)
or Decoupled DiLoCo (the syncer, P fragments, quorum K, no waiting).

Regions are network namespaces around a router namespace with tbf-shaped links
(``ddiloco.wan.Topology``); the syncer sits in its own hub region. Every process of a region
runs in its namespace (``ip netns exec``), so all traffic between regions crosses the
shaped veth links, whose kernel counters give the bytes per link. The global model is saved
every few seconds during the run (by rank 0 for DP, by a fetcher inside the hub region for the
syncer's methods) and evaluated afterwards, so evaluation takes no CPU from the run.

    python bench/wan/run.py --method decoupled --rate-mbit 3 --steps 600 --out runs/wan/dec

Writes ``OUT/result.json``: configuration, eval loss against wall-clock time, link bytes
(whole run and the training window), per-region compute utilisation and step counts.
Needs root (network namespaces). Teardown is automatic, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ddiloco.algorithm.learner_state import DEFAULT_INSTALL, INSTALL_RULES
from ddiloco.config import TrainConfig, dump_config
from ddiloco.metrics.sinks import read_jsonl
from ddiloco.recipe import eval_setup, evaluate, new_model
from ddiloco.runtime.transport.spec import fragmentation_from_spec, model_spec
from ddiloco.wan import LinkSpec, Topology

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"
SYNCER_PORT, BULK_PORT, DP_PORT = 50051, 50052, 29500
METHODS = ("dp", "diloco", "decoupled")


def train_config(a: argparse.Namespace) -> TrainConfig:
    base = dict(
        model=a.model,
        learners=a.regions,
        steps=a.steps,
        batch_size=a.batch_size,
        block_size=a.block_size,
        seed=a.seed,
        eval_batches=a.eval_batches,
        progress=False,
        engine="processes",
        heartbeat_timeout_s=a.heartbeat_timeout_s,
        heartbeat_interval_s=a.heartbeat_interval_s,
    )
    if a.method == "diloco":
        base.update(
            fragments=1,
            H=a.H,
            tau=0,
            codec=a.codec,
            down_codec=a.down_codec,
            quorum=a.regions,
            schedule="steps",  # synchronous: every learner waits for each merge
        )
    elif a.method == "decoupled":
        base.update(
            fragments=a.P,
            H=a.H,
            tau=a.tau,
            codec=a.codec,
            down_codec=a.down_codec,
            down_delta=a.down_delta,
            install=a.install,
            quorum=a.quorum,
            gamma=a.gamma,
            schedule=a.schedule,
        )
    if a.method != "dp":
        for k in ("outer_lr", "outer_momentum"):
            if getattr(a, k) is not None:
                base[k] = getattr(a, k)
    return TrainConfig(**base)


class Sampler(threading.Thread):
    """Link counters every ``every_s`` seconds: [(wall, {region: counters})]."""

    def __init__(self, topo: Topology, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.topo, self.every_s = topo, every_s
        self.rows: list[tuple[float, dict]] = []
        self.loads: list[float] = []  # 1-minute load average every 20 samples
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            self.rows.append((time.time(), self.topo.counters()))
            if n % 20 == 0:
                self.loads.append(os.getloadavg()[0])
            n += 1
            self.stop.wait(self.every_s)

    def at(self, wall: float) -> dict:
        """Counters at the last sample not after ``wall`` (the first sample if none)."""
        best = self.rows[0]
        for r in self.rows:
            if r[0] <= wall:
                best = r
        return best[1]


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": f"{SRC}:{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "wan",
    }


def _spawn(
    topo: Topology, region: str | int, argv: list[str], log: Path, env: dict
) -> subprocess.Popen:
    f = open(log, "wb")
    return subprocess.Popen(
        [*topo.exec_prefix(region), *argv],
        stdout=f,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def _stop(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, wait_s: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.time() + wait_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _cutter(topo: Topology, region: str, at_s: float, for_s: float, t0: float, log: list) -> None:
    time.sleep(max(0.0, t0 + at_s - time.time()))
    topo.set_link(region, up=False)
    log.append({"kind": "cut", "region": region, "wall": time.time()})
    time.sleep(for_s)
    topo.set_link(region, up=True)
    log.append({"kind": "restore", "region": region, "wall": time.time()})


def _jsonl(path: Path) -> list[dict]:
    return read_jsonl(path) if path.is_file() else []


def run_dp(a, cfg: TrainConfig, topo: Topology, out: Path, events: list) -> tuple[list, dict]:
    """DP ranks, one per region; returns (snapshots, per-region stats)."""
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    master = f"{topo.ip(0)}:{DP_PORT}"
    procs = [
        _spawn(
            topo,
            r,
            [
                sys.executable,
                str(HERE / "dp_worker.py"),
                "--rank",
                str(r),
                "--world",
                str(a.regions),
                "--master",
                master,
                "--config",
                str(cfg_path),
                "--out",
                str(out),
                "--max-wall-s",
                str(a.max_wall_s),
                "--snapshot-s",
                str(a.snapshot_s),
                "--latency-s",
                str(a.latency_ms / 1000),
            ],
            out / f"rank_{r}.log",
            _env(),
        )
        for r in range(a.regions)
    ]
    _wait_start_and_cut(a, topo, lambda: _jsonl(out / "rank_0.jsonl"), procs, events)
    try:
        for p in procs:
            p.wait(timeout=a.timeout_s)
    finally:
        _stop(procs)
    rows = {r: _jsonl(out / f"rank_{r}.jsonl") for r in range(a.regions)}
    regions = {}
    for r, rs in rows.items():
        if not rs:
            raise RuntimeError(f"rank {r} wrote no steps: see {out}/rank_{r}.log")
        regions[str(r)] = {
            "steps": rs[-1]["step"],
            "first_wall": rs[0]["wall"],
            "last_wall": rs[-1]["wall"],
            "compute_s": rs[-1]["compute_s"],
            "comm_s": rs[-1]["comm_s"],
            "latency_s": rs[-1].get("latency_s", 0.0),
        }
    snaps = [
        (s["wall"], s["step"], torch.load(out / s["path"], weights_only=True))
        for s in _jsonl(out / "snapshots.jsonl")
    ]
    return snaps, regions


def _wait_start_and_cut(a, topo: Topology, first_rows, procs, events: list) -> float:
    """Wait for the first training step; start the link cut timer from it."""
    deadline = time.time() + 600
    while not first_rows():
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a process failed before the first step (see the logs)")
        if time.time() > deadline:
            raise RuntimeError("no training step within 600 s")
        time.sleep(0.2)
    t0 = first_rows()[0]["wall"]
    if a.cut_for_s > 0:
        threading.Thread(
            target=_cutter,
            args=(topo, a.cut_region, a.cut_at_s, a.cut_for_s, t0, events),
            daemon=True,
        ).start()
    return t0


def run_syncer_method(
    a, cfg: TrainConfig, topo: Topology, out: Path, events: list
) -> tuple[list, dict]:
    """Syncer and model saver in the hub region, one learner per region; returns
    (snapshots, per-region stats)."""
    cfg_path = out / "config.toml"
    if a.slowdowns:  # a region's slower device: its steps stretched by the factor
        cfg = cfg.replace(
            speeds=tuple(
                1.0 / a.slowdowns[m] if m < len(a.slowdowns) else 1.0 for m in range(cfg.learners)
            )
        )
    if a.latency_ms > 0:  # every push and every fetch of a learner waits one latency
        chaos_path = out / "chaos.json"
        chaos_path.write_text(json.dumps({"link_latency_s": a.latency_ms / 1000}))
        cfg = cfg.replace(chaos=str(chaos_path))
    dump_config(cfg, cfg_path)
    env = {**_env(), "DDILOCO_TOKEN": secrets.token_hex(16)}
    sync_args = [
        "--config",
        str(cfg_path),
        "--host",
        "0.0.0.0",
        "--port",
        str(SYNCER_PORT),
        "--bulk-port",
        str(BULK_PORT),
        "--quorum",
        str(cfg.sync.quorum),
        "--tau",
        str(cfg.sync.tau),
        "--downlink-codec",
        cfg.sync.down_codec,
        "--step-budget",
        str(a.regions * a.steps),
        "--heartbeat-timeout",
        str(a.heartbeat_timeout_s),
        "--metrics-file",
        str(out / "syncer.jsonl"),
        "--log-level",
        "warning",
    ]
    if a.method == "diloco" or a.no_grace:
        sync_args.append("--no-grace")
    syncer = _spawn(
        topo,
        "s",
        [sys.executable, "-m", "ddiloco.runtime.cli", "syncer", *sync_args],
        out / "syncer.log",
        env,
    )
    time.sleep(2.0)
    snap = _spawn(
        topo,
        "s",
        [
            sys.executable,
            str(HERE / "snapshot.py"),
            "--syncer",
            f"127.0.0.1:{SYNCER_PORT}",
            "--out",
            str(out / "snaps"),
            "--every-s",
            str(a.snapshot_s),
        ],
        out / "snapshot.log",
        env,
    )
    learners = []
    for m in range(a.regions):
        argv = [
            sys.executable,
            "-m",
            "ddiloco.runtime.cli",
            "learner",
            "--syncer",
            f"{topo.ip('s')}:{SYNCER_PORT}",
            "--learner",
            str(m),
            "--config",
            str(cfg_path),
            "--run-dir",
            str(out / f"learner_{m}"),
            "--log-level",
            "warning",
        ]
        if a.method == "diloco":
            argv.append("--wait-for-merge")
        learners.append(_spawn(topo, m, argv, out / f"learner_{m}.log", env))
    try:
        _wait_start_and_cut(
            a,
            topo,
            lambda: [r for r in _jsonl(out / "learner_0" / "metrics.jsonl") if r["kind"] == "step"],
            learners + [syncer],
            events,
        )
        for p in learners:
            p.wait(timeout=a.timeout_s)
        time.sleep(a.snapshot_s + 0.5)  # one more snapshot after the last merge
    finally:
        _stop(learners)
        _stop([snap, syncer])
    regions = {}
    for m in range(a.regions):
        rows = [r for r in _jsonl(out / f"learner_{m}" / "metrics.jsonl") if r["kind"] == "step"]
        final = json.loads((out / f"learner_{m}" / "final.json").read_text())
        if not rows:
            raise RuntimeError(f"learner {m} wrote no steps")
        regions[str(m)] = {
            "steps": rows[-1]["step"],
            "first_wall": rows[0]["wall"],
            "last_wall": rows[-1]["wall"],
            "compute_s": final["compute_s"],
            "bytes_sent": final["bytes_sent"],
            "bytes_received": final["bytes_received"],
            "pushes": final["pushes"],
            "ledger": final["ledger"],
        }
    model = new_model(cfg)
    frag = fragmentation_from_spec(model_spec(model, cfg.sync.fragments, cfg.sync.fragmentation))
    shapes = {n: t.shape for n, t in model.named_parameters()}
    snaps = []
    for s in _jsonl(out / "snaps" / "snapshots.jsonl"):
        fr = torch.load(out / "snaps" / s["path"], weights_only=True)
        named = {}
        for p, f in enumerate(frag.fragments):
            for n, t in zip(f.names, fr[p]):
                named[n] = t.view(shapes[n])
        snaps.append((s["wall"], None, named))
    return snaps, regions


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=METHODS, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix", default="ddwan", help="namespace name prefix")
    ap.add_argument("--regions", type=int, default=4)
    ap.add_argument("--rate-mbit", type=float, default=3.0, help="each region's link, both ways")
    ap.add_argument(
        "--hub-mbit", type=float, default=0.0, help="the syncer region's link (0: regions x rate)"
    )
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--steps", type=int, default=600, help="inner steps per region")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("-P", type=int, default=8)
    ap.add_argument("-H", type=int, default=24)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("-K", "--quorum", type=int, default=1)
    ap.add_argument("--no-grace", action="store_true")
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--down-codec", default="int8")
    ap.add_argument(
        "--down-delta",
        action="store_true",
        help="delta-coded downlink: each fetch against the learner's copy (sync.down_delta)",
    )
    ap.add_argument(
        "--install",
        choices=INSTALL_RULES,
        default=DEFAULT_INSTALL,
        help="how learners install a merged fragment (sync.install)",
    )
    ap.add_argument(
        "--slowdowns",
        type=lambda s: [float(x) for x in s.split(",")],
        default=None,
        help="per-region step stretch factors, e.g. 1,1,2,2 (run-time sleeps)",
    )
    ap.add_argument("--max-wall-s", type=float, default=0.0, help="DP: stop after this long")
    ap.add_argument("--snapshot-s", type=float, default=3.0)
    ap.add_argument("--cut-region", default="1")
    ap.add_argument("--cut-at-s", type=float, default=20.0)
    ap.add_argument("--cut-for-s", type=float, default=0.0, help="cut one link this long")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=10.0)
    ap.add_argument(
        "--heartbeat-interval-s", type=float, default=0.25, help="the learners' heartbeats"
    )
    ap.add_argument("--gamma", type=float, default=0.8, help="grace window safety factor")
    ap.add_argument("--outer-lr", type=float, default=None, help="default: sync.outer_lr's")
    ap.add_argument(
        "--outer-momentum", type=float, default=None, help="default: sync.outer_momentum's"
    )
    ap.add_argument(
        "--schedule",
        choices=("time", "steps"),
        default="time",
        help="Decoupled: when a learner sends a fragment (the syncer's slot clock or its steps)",
    )
    ap.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="one-way propagation delay between a region and any other, emulated alike for "
        "every method: each learner push and fetch waits it once, each DP all-reduce "
        "2(regions-1) times (a ring's dependent hops)",
    )
    ap.add_argument(
        "--pcap", action="store_true", help="capture the hub's (DP: region 0's) link headers"
    )
    ap.add_argument("--timeout-s", type=float, default=900.0)
    a = ap.parse_args(argv)
    if a.slowdowns is not None and len(a.slowdowns) != a.regions:
        ap.error(f"--slowdowns needs {a.regions} values")
    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg = train_config(a)
    hub = a.hub_mbit or a.regions * a.rate_mbit
    topo = Topology(
        a.prefix,
        [LinkSpec(a.rate_mbit) for _ in range(a.regions)],
        hub=True,
        hub_link=LinkSpec(hub),
    )
    events: list[dict] = []
    load_start = os.getloadavg()
    with topo:
        sampler = Sampler(topo)
        sampler.start()
        pcap = None
        if a.pcap:  # headers only: enough to attribute every byte to its connection
            pcap = subprocess.Popen(
                [
                    *topo.exec_prefix(0 if a.method == "dp" else "s"),
                    "tcpdump",
                    "-i",
                    "wan",
                    "-s",
                    "128",
                    "-w",
                    str(out / "link.pcap"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        t_launch = time.time()
        run = run_dp if a.method == "dp" else run_syncer_method
        try:
            snaps, regions = run(a, cfg, topo, out, events)
        finally:
            if pcap is not None:
                _stop([pcap])
        sampler.stop.set()
        sampler.join()
        end_counters = topo.counters()
    t0 = min(r["first_wall"] for r in regions.values())
    t1 = max(r["last_wall"] for r in regions.values())
    c0, c1 = sampler.at(t0), sampler.at(t1)
    window = {k: {f: c1[k][f] - c0[k][f] for f in c1[k]} for k in c1}
    _, _, _, evals = eval_setup(cfg)
    model = new_model(cfg)
    named = dict(model.named_parameters())
    curve = []
    torch.set_num_threads(1)
    for wall, step, params in snaps:
        with torch.no_grad():
            for n, t in params.items():
                named[n].copy_(t)
        curve.append(
            {"t_s": round(wall - t0, 3), "step": step, "eval_loss": evaluate(model, evals)}
        )
    for r in regions.values():
        span = r["last_wall"] - r["first_wall"]
        r["utilisation"] = r["compute_s"] / span if span > 0 else None
    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "method": a.method,
        "args": vars(a),
        "config": cfg.to_dict(),
        "n_params": n_params,
        "load_avg": {
            "start": [round(x, 2) for x in load_start],
            "during": [round(x, 2) for x in sampler.loads],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
        "launch_to_first_step_s": round(t0 - t_launch, 2),
        "train_s": round(t1 - t0, 3),
        "total_steps": sum(r["steps"] for r in regions.values()),
        "regions": regions,
        "link_bytes_window": window,
        "link_bytes_total": end_counters,
        "counter_series": [(round(w - t0, 2), c) for w, c in sampler.rows],
        "events": [{**e, "t_s": round(e["wall"] - t0, 2)} for e in events],
        "curve": curve,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    last = curve[-1]["eval_loss"] if curve else float("nan")
    print(
        f"{a.method}: {result['total_steps']} steps in {result['train_s']:.1f} s, "
        f"final eval {last:.4f}, link 0 up/down {window['0']['up_bytes']}/"
        f"{window['0']['down_bytes']} B",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
