"""One rank of synchronous data-parallel training across WAN regions (run by
``bench/wan/run.py`` inside a region's network namespace).

Gloo on CPU; every step the ranks average their gradients with one ``all_reduce`` of a flat
fp32 buffer (what DDP does for a model that fits one bucket), so compute and communication
time are measured apart. Rank 0 ends the run at ``--steps`` or at ``--max-wall-s`` (a flag
carried in the same all-reduce, so every rank stops at the same step) and saves the model
every ``--snapshot-s`` seconds for evaluation after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ddiloco.config import TrainConfig
from ddiloco.data import build_stream
from ddiloco.recipe import data_config, new_model, new_optimizer, set_lr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="HOST:PORT of rank 0's store")
    ap.add_argument("--config", required=True, help="TrainConfig JSON file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-wall-s", type=float, default=0.0, help="0: run all --steps")
    ap.add_argument("--snapshot-s", type=float, default=3.0)
    ap.add_argument(
        "--latency-s",
        type=float,
        default=0.0,
        help="emulated one-way latency: each all-reduce waits 2(world-1) of them",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = TrainConfig(**json.loads(Path(a.config).read_text()))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}",
        rank=a.rank,
        world_size=a.world,
        timeout=timedelta(minutes=10),
    )
    model = new_model(cfg)
    params = [p for p in model.parameters()]
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)
    opt = new_optimizer(cfg, model)
    stream = build_stream(
        data_config(cfg),
        learner=a.rank,
        n_learners=a.world,
        batch_size=cfg.data.batch_size,
        block_size=cfg.data.block_size,
        seed=cfg.seed,
    )
    numel = sum(p.numel() for p in params)
    flat = torch.zeros(numel + 1)  # gradients, then the stop flag
    metrics = open(out / f"rank_{a.rank}.jsonl", "w")
    snaps = open(out / "snapshots.jsonl", "w") if a.rank == 0 else None
    compute_s = comm_s = latency_s = 0.0
    # a ring all-reduce is 2(D-1) dependent hops (reduce-scatter, then all-gather), each
    # one link latency: the propagation delay the namespaces' links do not have
    hops_s = 2 * (a.world - 1) * a.latency_s
    t_first = time.time()
    next_snap = t_first
    step = 0
    while step < cfg.steps:
        now = time.time()
        if snaps is not None and now >= next_snap:
            path = out / f"snap_{step:06d}.pt"
            torch.save({n: t.detach().clone() for n, t in model.named_parameters()}, path)
            snaps.write(json.dumps({"wall": now, "step": step, "path": path.name}) + "\n")
            snaps.flush()
            next_snap = now + a.snapshot_s
        t0 = time.perf_counter()
        x, y = stream.next_batch()
        opt.zero_grad(set_to_none=False)
        _, loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        off = 0
        for p in params:
            flat[off : off + p.numel()].copy_(p.grad.reshape(-1))
            off += p.numel()
        flat[numel] = (
            float(a.rank == 0 and a.max_wall_s > 0 and time.time() - t_first >= a.max_wall_s)
            * a.world
        )
        dist.all_reduce(flat)
        if hops_s > 0:
            time.sleep(hops_s)
            latency_s += hops_s
        flat.div_(a.world)
        t2 = time.perf_counter()
        off = 0
        for p in params:
            p.grad.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        set_lr(opt, cfg.lr_at(step))
        opt.step()
        t3 = time.perf_counter()
        compute_s += (t1 - t0) + (t3 - t2)
        comm_s += t2 - t1
        step += 1
        metrics.write(
            json.dumps(
                {
                    "step": step,
                    "wall": time.time(),
                    "loss": round(loss.item(), 5),
                    "compute_s": round(compute_s, 4),
                    "comm_s": round(comm_s, 4),
                    "latency_s": round(latency_s, 4),
                }
            )
            + "\n"
        )
        metrics.flush()  # the harness times the link cut from the first step
        if flat[numel] > 0.5:
            break
    if snaps is not None:
        path = out / f"snap_{step:06d}.pt"
        torch.save({n: t.detach().clone() for n, t in model.named_parameters()}, path)
        snaps.write(json.dumps({"wall": time.time(), "step": step, "path": path.name}) + "\n")
        snaps.close()
    metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "wan")
    main()
