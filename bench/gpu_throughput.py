"""Target 6: learner tokens/s on a ~125M GPT (gpt_125m) on one CUDA device, bf16 autocast,
with Decoupled DiLoCo synchronisation on against off, M learner processes sharing the GPU
(each its own ``DecoupledLearner``; one syncer process on the host).

The two modes are measured in adjacent blocks, order alternating (on-off, off-on, ...),
all learners switching together at a barrier; each pair of blocks gives a ratio and the
headline is the median ratio (per learner, then over learners). ``--profile`` also records
a torch.profiler trace of one learner with sync on and reports how much of the snapshots'
device-to-host copies overlapped compute kernels, and every host synchronisation the
training thread made.

Without CUDA it writes a "skipped: no CUDA device" row and exits 0, unless ``--device cpu``
(a small CPU dry run of the same code, ``--model gpt_tiny``).

Usage: python bench/gpu_throughput.py [--learners M] [--pairs N] [--steps S] [--batch B]
       [--block T] [--profile] [--out DIR]
Writes DIR/gpu_throughput.json (default bench/results/) and returns the row for run_all."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perf_common import ROOT, TOKEN, SyncerProc, row  # noqa: E402

OUT = ROOT / "bench" / "results"


def _setup(opts: dict, device: torch.device):
    """Model, fused AdamW and one resident batch on ``device``; a train_step closure."""
    from ddiloco.models import build_model

    torch.manual_seed(0)
    model = build_model(opts["model"]).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
    vocab = model.cfg.vocab_size
    block = min(opts["block"], model.cfg.block_size)
    x = torch.randint(0, vocab, (opts["batch"], block), device=device)
    y = torch.randint(0, vocab, (opts["batch"], block), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        opt.step()

    return model, train_step, opts["batch"] * block


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(m: int, address: str, opts: dict, barrier, results) -> None:
    """One learner process: warm up, then ``pairs`` pairs of on/off blocks."""
    from ddiloco.runtime.learner.hook import DecoupledLearner

    torch.set_num_threads(1)
    device = torch.device(opts["device"])
    model, train_step, tokens = _setup(opts, device)
    for _ in range(3):
        train_step()
    _sync_device(device)
    with DecoupledLearner(
        model, syncer=address, learner=m, P=opts["P"], H=opts["P"], tau=2, codec="bf16", token=TOKEN
    ) as dl:
        ratios, on_tps, off_tps = [], [], []
        for pair in range(opts["pairs"]):
            tps = {}
            for mode in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                barrier.wait()
                step = dl.step if mode == "on" else None
                # every timed on-step overlaps the communication of one push (P = H)
                train_step()
                if step is not None:
                    step(tokens)
                _sync_device(device)
                t = time.perf_counter()
                for _ in range(opts["steps"]):
                    train_step()
                    if step is not None:
                        step(tokens)
                _sync_device(device)
                tps[mode] = opts["steps"] * tokens / (time.perf_counter() - t)
            ratios.append(tps["on"] / tps["off"])
            on_tps.append(tps["on"])
            off_tps.append(tps["off"])
        stats = dict(dl.stats)
    results.put({"learner": m, "ratios": ratios, "on": on_tps, "off": off_tps, "stats": stats})


def measure(opts: dict) -> dict:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(opts["learners"])
    results = ctx.Queue()
    with SyncerProc(threads=4, heartbeat_timeout_s=60.0) as sy:
        procs = [
            ctx.Process(target=_worker, args=(m, sy.address, opts, barrier, results))
            for m in range(opts["learners"])
        ]
        for p in procs:
            p.start()
        per = [results.get(timeout=opts["timeout_s"]) for _ in procs]
        for p in procs:
            p.join(30)
    per.sort(key=lambda r: r["learner"])
    medians = [statistics.median(r["ratios"]) for r in per]
    on = sum(statistics.median(r["on"]) for r in per)
    off = sum(statistics.median(r["off"]) for r in per)
    return {
        "device": (torch.cuda.get_device_name(0) if opts["device"].startswith("cuda") else "cpu"),
        **opts,
        "ratio": statistics.median(medians),
        "ratio_per_learner": medians,
        "tokens_per_s_on": on,
        "tokens_per_s_off": off,
        "per_learner": per,
    }


def profile_overlap(opts: dict, out_dir: Path) -> dict:
    """One learner with sync on under torch.profiler: what share of the snapshots'
    device-to-host copy time ran while a compute kernel ran on another stream, and which
    host synchronisations the training thread made during the profiled steps."""
    import threading

    from torch.profiler import ProfilerActivity, profile

    from ddiloco.runtime.learner.hook import DecoupledLearner

    device = torch.device("cuda")
    model, train_step, tokens = _setup(opts, device)
    for _ in range(3):
        train_step()
    torch.cuda.synchronize()
    trace = out_dir / "gpu_snapshot_trace.json"
    with (
        SyncerProc(threads=4, heartbeat_timeout_s=60.0) as sy,
        DecoupledLearner(
            model,
            syncer=sy.address,
            learner=0,
            P=opts["P"],
            H=opts["P"],
            tau=2,
            codec="bf16",
            token=TOKEN,
        ) as dl,
    ):
        for _ in range(opts["P"]):  # one round of every fragment before profiling
            train_step()
            dl.step(tokens)
        torch.cuda.synchronize()
        main_tid = threading.get_native_id()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                train_step()
                dl.step(tokens)
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels, d2h, syncs = [], [], {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "kernel":
            kernels.append((e["ts"], e["ts"] + e["dur"], e.get("tid")))
        elif cat == "gpu_memcpy" and "DtoH" in name:
            d2h.append((e["ts"], e["ts"] + e["dur"], e.get("tid")))
        elif cat == "cuda_runtime" and "Synchronize" in name:
            who = "training thread" if e.get("tid") == main_tid else "other threads"
            syncs.setdefault(who, {}).setdefault(name, 0)
            syncs[who][name] += 1
    busy = overlap = 0.0
    for a, b, stream in d2h:
        busy += b - a
        spans = sorted(
            (max(a, ka), min(b, kb)) for ka, kb, ks in kernels if ks != stream and ka < b and kb > a
        )
        end = a
        for s, t in spans:  # union of the kernel intervals inside [a, b]
            s = max(s, end)
            if t > s:
                overlap += t - s
                end = t
    # the final torch.cuda.synchronize() above is the profiler's, not the learner's
    return {
        "trace": trace.name,
        "d2h_copies": len(d2h),
        "d2h_us": round(busy, 1),
        "d2h_overlapped_share": (overlap / busy) if busy else None,
        "host_syncs": syncs,
        "note": "the training thread's last cudaDeviceSynchronize "
        "closes the profiled window and is the bench's own",
    }


def main(quick: bool = False, **kw) -> dict:
    opts = {
        "learners": 2,
        "pairs": 6,
        "steps": 8,
        "batch": 8,
        "block": 1024,
        "model": "gpt_125m",
        "device": "cuda",
        "P": 24,
        "timeout_s": 900.0,
        "profile": False,
        "out": str(OUT),
    }
    opts.update({k: v for k, v in kw.items() if v is not None})
    if quick:
        opts.update(pairs=2, steps=4)
    out_dir = Path(opts.pop("out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    want_profile = opts.pop("profile")
    target = "6. GPU: gpt_125m tokens/s with / without sync (bf16 autocast)"
    if opts["device"] == "cuda" and not torch.cuda.is_available():
        out = {"skipped": "skipped: no CUDA device"}
        r = row(
            target,
            "skipped: no CUDA device",
            ">= 99%",
            None,
            "run `bash bench/gpu_check.sh` on a CUDA machine",
        )
    else:
        out = measure(opts)
        if want_profile and opts["device"] == "cuda":
            out["profile"] = profile_overlap(opts, out_dir)
        r = row(
            target,
            f"{out['ratio']:.1%} ({out['tokens_per_s_on']:.0f} vs "
            f"{out['tokens_per_s_off']:.0f} tokens/s, M = {opts['learners']}) on "
            f"{out['device']}",
            ">= 99%",
            out["ratio"] >= 0.99,
            "median of adjacent on/off block pairs",
            ratio=out["ratio"],
        )
    (out_dir / "gpu_throughput.json").write_text(json.dumps(out, indent=1))
    return {"rows": [r], "details": out}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--learners", type=int)
    ap.add_argument("--pairs", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--block", type=int)
    ap.add_argument("--model")
    ap.add_argument("--device", choices=("cuda", "cpu"))
    ap.add_argument("-P", type=int, dest="P")
    ap.add_argument("--profile", action="store_true", default=None)
    ap.add_argument("--out")
    a = vars(ap.parse_args())
    res = main(a.pop("quick"), **a)
    print(json.dumps(res["rows"], indent=1))
