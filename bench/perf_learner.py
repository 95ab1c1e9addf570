"""Target 1: learner overhead. One learner (gpt_small on CPU, AdamW) trains in this process
against a syncer in its own process, Decoupled DiLoCo with P = H = 24, tau = 2, bf16 codec.
Short blocks of inner steps alternate between sync on (``DecoupledLearner.step`` after every
optimizer step: snapshot, sends, installs; the background threads encode, push, fetch,
decode) and sync off (the same loop without ``step``), same model, same run, in pairs of
adjacent blocks ordered on-off, off-on, on-off, ... Ratio = off step time / on step time of
each pair; the headline is the median over the pairs.

Why pairs of short blocks: on a shared VM the speed of the training thread drifts by several
percent over tens of seconds, more than the effect measured. Two adjacent blocks of a few
seconds see nearly the same machine, and alternating the order cancels a linear drift.

Steady state: the learner goes idle (send queue empty) before every block, and the first
step of a block is not timed (in both modes). Every timed on-step therefore overlaps the
communication of exactly one push, the previous step's, as in a long run with P = H (one
fragment sent per step), and every off-step overlaps none.

Cores: the training thread computes on one core with one torch thread (on and off alike);
the learner's communication threads and the syncer process run on the other cores, as on a
training host whose accelerators compute while its CPU cores communicate. (On a machine
with a single core everything shares it.) What the ratio then measures is the training
thread's own cost of synchronisation: the snapshot copy, the install, the bookkeeping, and
waiting for the GIL behind the communication threads. The time spent inside
``DecoupledLearner.step`` is reported beside it: the direct part of that cost."""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta

import torch
from perf_common import PROFILES, SyncerProc, pyspy_start, row, summarise_collapsed, wait_proc

THRESHOLD = 0.97


def _cores() -> tuple[set[int], set[int]] | None:
    """(compute core, communication cores), or None where affinity cannot be set."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[0]}, set(cpus[1:])


def main(quick: bool = False) -> dict:
    cores = _cores()
    threads = torch.get_num_threads()
    all_cpus = os.sched_getaffinity(0) if cores else None
    torch.set_num_threads(1)
    try:
        if cores:  # the syncer process and every thread started from here: comm cores
            os.sched_setaffinity(0, cores[1])
        return _run(quick, cores)
    finally:
        torch.set_num_threads(threads)
        if cores:
            os.sched_setaffinity(0, all_cpus)


def _run(quick: bool, cores) -> dict:
    from ddiloco.models import build_model
    from ddiloco.runtime.learner.hook import DecoupledLearner

    H, P, tau = 24, 24, 2  # noqa: N806
    if quick:
        model = build_model("gpt_tiny", n_layer=4)
        B, T, n, pairs, name = 8, 64, 4, 4, "gpt_tiny(n_layer=4)"  # noqa: N806
    else:
        model = build_model("gpt_small")
        B, T, n, pairs, name = 8, 128, 6, 24, "gpt_small"  # noqa: N806
    P = min(P, len(list(model.parameters())))  # noqa: N806
    V = model.cfg.vocab_size if hasattr(model, "cfg") else 256  # noqa: N806
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()

    for _ in range(3):
        train_step()
    block_s: dict[str, list[float]] = {"on": [], "off": []}
    in_step_s: list[float] = []  # training-thread time inside DecoupledLearner.step
    spy = None
    with (
        SyncerProc(threads=1) as sy,
        DecoupledLearner(
            model,
            syncer=sy.address,
            learner=0,
            P=P,
            H=H,
            tau=tau,
            codec="bf16",
            token="perf-bench-token",
            heartbeat_interval=timedelta(milliseconds=500),
        ) as dl,
    ):
        if not quick:
            # estimate the run length for the profiler from a few steps
            t = time.perf_counter()
            for _ in range(4):
                train_step()
            est = (time.perf_counter() - t) / 4 * (n + 1) * 2 * pairs * 1.3 + 30
            spy = pyspy_start(os.getpid(), est, PROFILES / "learner.raw")
        if cores:  # only the training thread moves to the compute core
            os.sched_setaffinity(0, cores[0])
        for i in range(pairs):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                while not dl.links.sendq.empty():  # idle between blocks
                    time.sleep(0.01)
                time.sleep(0.2)
                t0 = 0.0
                for k in range(n + 1):
                    if k == 1:  # the first step of a block is not timed
                        t0 = time.perf_counter()
                    train_step()
                    if mode == "on":
                        a = time.perf_counter()
                        dl.step(B * T)
                        if k >= 1:
                            in_step_s.append(time.perf_counter() - a)
                block_s[mode].append((time.perf_counter() - t0) / n)
        stats = dict(dl.stats)
    wait_proc(spy, 120)
    prof = ""
    if spy is not None:
        prof = summarise_collapsed(
            PROFILES / "learner.raw",
            PROFILES / "learner.txt",
            f"learner process ({name}, P=H={H}, tau={tau}, bf16) "
            f"during perf_learner, sync on and off blocks",
        )
    ratios = sorted(off / on for on, off in zip(block_s["on"], block_s["off"]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    ratio = statistics.median(ratios)
    on, off = statistics.median(block_s["on"]), statistics.median(block_s["off"])
    direct = statistics.mean(in_step_s)
    return {
        "rows": [
            row(
                "1. learner throughput with sync / without (P=H=24, tau=2, bf16)",
                f"{ratio:.1%} (median of {pairs} pairs; quartiles {q[0]:.1%} / "
                f"{q[2]:.1%}; step {on * 1e3:.0f} ms on, {off * 1e3:.0f} ms off)",
                f">= {THRESHOLD:.0%}",
                ratio >= THRESHOLD,
                f"{name}, batch {B}x{T}; {pairs} pairs of adjacent on and off blocks of "
                f"{n} timed steps, order alternating; time inside "
                f"DecoupledLearner.step {direct * 1e3:.2f} ms per step "
                f"({direct / on:.2%} of a step); pushes {stats['pushes']}, installs "
                f"{stats['installs']}; fp32 compute on CPU (bf16 = wire codec); "
                + (
                    f"training thread on core {sorted(cores[0])}, 1 torch thread; "
                    f"communication threads and syncer on cores {sorted(cores[1])}"
                    if cores
                    else "one core shared by everything"
                ),
                ratio=ratio,
                quartiles=[q[0], q[2]],
                in_step_s=direct,
            )
        ],
        "details": {
            "block_step_s": block_s,
            "pair_ratios": ratios,
            "stats": stats,
            "model": name,
            "profile": bool(prof),
            "in_step_s_mean": direct,
            "cores": None
            if not cores
            else {"compute": sorted(cores[0]), "communication": sorted(cores[1])},
        },
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main(quick=True), indent=1))
