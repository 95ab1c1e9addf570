"""A rank's memory in an FSDP2 island: what syncing its own shards adds, against R.

Each case is a torchrun island of R ranks (Gloo, CPU) training one FSDP2-sharded GPT with
AdamW for ``--steps`` steps, twice: ``plain`` (the user's loop alone) and ``sync`` (the same
loop through ``ddiloco.DecoupledLearner`` against a real ``ddiloco syncer`` process, P
fragments, bf16 pushes, rebased installs). Every rank samples its resident set after each
step; reported is each rank's peak (the largest sample and the kernel's ``VmHWM``) and the
difference sync - plain, the memory that syncing adds, in units of a rank's slice of one
fragment in fp32 (4N / (P R) bytes) and of the whole model (4N). A rank that gathered its
fragment, or the model, to push or install it would add at least 4N / P, or 4N.

Usage: python bench/island_memory.py [--layers 12] [--steps 24] [--ranks 1,2] [-P 4]
Writes OUT/island_memory.json and OUT/island_memory.md (OUT: bench/results by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "DDILOCO_TOKEN": "bench-token",
    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}
BATCH, SEQ = 4, 64


def _rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _held_bytes(model, opt) -> int:
    """Bytes of the live CPU tensors beyond the model's local shards, their gradients and
    the optimizer's state (each storage once): what the process holds besides training."""
    import gc

    import torch

    def key(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.untyped_storage().data_ptr()

    own = set()
    for p in model.parameters():
        own.add(key(p))
        if p.grad is not None:
            own.add(key(p.grad))
    for st in opt.state.values():
        own.update(key(v) for v in st.values() if isinstance(v, torch.Tensor))
    seen, total = set(), 0
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor) or hasattr(o, "to_local") or o.device.type != "cpu":
            continue
        st = o.untyped_storage()
        k = st.data_ptr()
        if k in own or k in seen:
            continue
        seen.add(k)
        total += st.nbytes()
    return total


def worker(a: argparse.Namespace) -> None:
    """One rank: build, shard, train, print a JSON line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddiloco import DecoupledLearner  # imported in both modes: the same code resident
    from ddiloco.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model("gpt_100m", n_layer=a.layers, block_size=SEQ)
    numel = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    rss: list[int] = []
    held: list[int] = []
    start_rss = _rss_bytes()[0]

    def loop(dl=None) -> None:
        rss.append(_rss_bytes()[0])  # after the learner's start (its first fetch)
        for _ in range(a.steps):
            x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
            loss = model(x[:, :-1], x[:, 1:])[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            rss.append(_rss_bytes()[0])
            held.append(_held_bytes(model, opt))

    stats: dict = {}
    if a.mode == "sync":
        with DecoupledLearner(
            model, opt, syncer=a.syncer, learner=0, P=a.P, H=a.H, tau=2, codec="bf16",
            install="rebase", tokens_per_step=BATCH * SEQ * world,
        ) as dl:  # fmt: skip
            loop(dl)
        report = dl.report()
        stats = {
            "pushes": dl.stats["pushes"],
            "installs": report["installs"],
            "bytes_sent": dl.stats["bytes_sent"],
        }
    else:
        loop()
    hwm = _rss_bytes()[1]
    warm = rss[min(3, len(rss) - 1)]  # after the optimizer's state exists
    Path(a.result_dir, f"rank_{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "mode": a.mode,
                "N": numel,
                "shard_bytes": shard_bytes,
                "start_rss": start_rss,
                "warm_rss": warm,
                "peak_rss": max(rss),
                "median_rss": statistics.median(rss[len(rss) // 2 :]),
                "hwm": hwm,
                "rss_series": rss,
                "held_series": held,
                "held_max": max(held),
                **stats,
            }
        )
    )
    dist.destroy_process_group()


def _syncer(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = tmp / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco.runtime.cli", "syncer", "--port", "0"]
        + ["--port-file", str(port), "--log-level", "warning"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "syncer.log", "wb"),
    )
    while not port.is_file():
        if proc.poll() is not None:
            raise RuntimeError((tmp / "syncer.log").read_text())
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port.read_text()}"


def island(a: argparse.Namespace, ranks: int, mode: str) -> list[dict]:
    """One torchrun island of ``ranks`` ranks; its ranks' JSON lines, by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        syncer, address = _syncer(Path(tmp)) if mode == "sync" else (None, "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={ranks}", __file__, "--worker", "--mode", mode]
        cmd += ["--layers", str(a.layers), "--steps", str(a.steps), "-P", str(a.P)]
        cmd += ["-H", str(a.H), "--syncer", address, "--result-dir", tmp]
        try:
            out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1800)
        finally:
            if syncer is not None:
                syncer.terminate()
                syncer.wait(30)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-4000:]}")
        return [json.loads(Path(tmp, f"rank_{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="gpt_100m's layers (12: 85M)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--ranks", default="1,2", help="island sizes R, comma-separated")
    ap.add_argument("-P", type=int, default=4)
    ap.add_argument("-H", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("plain", "sync"), default="plain", help=argparse.SUPPRESS)
    ap.add_argument("--syncer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    cases = []
    for r in (int(x) for x in a.ranks.split(",")):
        runs = {}
        for mode in ("plain", "sync"):
            t0 = time.monotonic()
            runs[mode] = island(a, r, mode)
            print(f"R={r} {mode}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        n = runs["plain"][0]["N"]
        slice_bytes = 4 * n / (a.P * r)
        per_rank = []
        for plain, sync in zip(runs["plain"], runs["sync"], strict=True):
            added = sync["peak_rss"] - plain["peak_rss"]
            held = sync["held_max"] - plain["held_max"]
            per_rank.append(
                {
                    "rank": plain["rank"],
                    "held_plain_max": plain["held_max"],
                    "held_sync_max": sync["held_max"],
                    "held_x_slice": held / slice_bytes,
                    "held_x_model": held / (4 * n),
                    "plain_held_series": plain["held_series"],
                    "sync_held_series": sync["held_series"],
                    "shard_bytes": plain["shard_bytes"],
                    "plain_peak_rss": plain["peak_rss"],
                    "sync_peak_rss": sync["peak_rss"],
                    "plain_hwm": plain["hwm"],
                    "sync_hwm": sync["hwm"],
                    "added_bytes": added,
                    "added_hwm_bytes": sync["hwm"] - plain["hwm"],
                    "added_x_slice": added / slice_bytes,
                    "added_x_model": added / (4 * n),
                    "pushes": sync.get("pushes"),
                    "installs": sync.get("installs"),
                    "bytes_sent": sync.get("bytes_sent"),
                    "plain_rss_series": plain["rss_series"],
                    "sync_rss_series": sync["rss_series"],
                }
            )
        cases.append({"R": r, "N": n, "P": a.P, "slice_bytes": slice_bytes, "ranks": per_rank})
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "layers": a.layers,
        "steps": a.steps,
        "P": a.P,
        "H": a.H,
        "cases": cases,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "island_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    mb = 1e6
    lines = [
        f"N = {cases[0]['N']:,} (4N = {4 * cases[0]['N'] / mb:.0f} MB), P = {a.P}, "
        f"{a.steps} steps; MB per rank",
        "",
        "| R | rank | shard | held by the learner, max | / (4N/(PR)) | / 4N "
        "| RSS peak, plain | RSS peak, sync | RSS added | pushes | installs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        for r in c["ranks"]:
            held = r["held_sync_max"] - r["held_plain_max"]
            lines.append(
                f"| {c['R']} | {r['rank']} | {r['shard_bytes'] / mb:.0f} "
                f"| {held / mb:.0f} | {r['held_x_slice']:.2f} | {r['held_x_model']:.3f} "
                f"| {r['plain_peak_rss'] / mb:.0f} | {r['sync_peak_rss'] / mb:.0f} "
                f"| {r['added_bytes'] / mb:.0f} | {r['pushes']} | {r['installs']} |"
            )
    (a.out / "island_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
