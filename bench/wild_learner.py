"""A wild learner against the merge guard (``sync.norm_clip``), on the in-process engine.

The default run (``ddiloco train --engine inproc``: M = 4, K = 1, outer Nesterov lr 0.7,
momentum 0.9, 2000 inner steps per learner), except that learner 0, at its inner step
WILD_AT, is restarted with a fresh AdamW at a constant lr of WILD_LR (1e-2; the run's inner
lr is 3e-3 with a cosine decay) for WILD_STEPS steps (100), the way a user's restart with a
wrong configuration would be; then it gets a fresh optimizer of the run's own
configuration and goes on. The other learners are untouched. Deterministic for a seed.

Reported per guard setting (``--clips``: 0 is no guard), and with ``--reference`` for the
same run without the bad restart: the global model's eval loss just before the bad restart,
the largest one in the window from the restart to 300 steps after it, the final one, each
as a gap to the entropy floor, and the pushes the guard clipped.

Writes bench/results/wild_learner.json and prints a markdown table (the measured figures
are in docs/results/reliability.md).

Usage: python bench/wild_learner.py [--steps 2000] [--wild-at 1000] [--clips 0,3,5]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import ddiloco.engine.decoupled as decoupled
from ddiloco.algorithm.syncer_state import SyncerState
from ddiloco.config import TrainConfig
from ddiloco.engine import run
from ddiloco.engine.common import Worker, build_workers
from ddiloco.recipe import new_optimizer

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 300
"""Steps after the bad restart over which the worst eval loss is taken."""


class WildWorker(Worker):
    """Learner 0 with a bad restart: a fresh AdamW at ``wild_lr`` for ``wild_steps`` steps
    from its inner step ``wild_at``, then a fresh optimizer of the run's configuration."""

    wild_at: int = 0
    wild_steps: int = 100
    wild_lr: float = 1e-2

    def train_step(self) -> float:
        if self.steps == self.wild_at:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.wild_lr)
        if self.wild_at <= self.steps < self.wild_at + self.wild_steps:
            x, y = self.stream.next_batch()
            self.opt.zero_grad(set_to_none=True)
            _, loss = self.model(x, y)
            loss.backward()
            self.opt.step()  # its own constant lr: the run's schedule is not applied
            self.steps += 1
            if self.steps == self.wild_at + self.wild_steps:
                self.opt = new_optimizer(self.cfg, self.model)
            return float(loss.detach())
        return Worker.train_step(self)


def run_one(args, clip: float, out: Path, wild: bool = True) -> dict:
    cfg = TrainConfig(
        engine="inproc",
        method="decoupled",
        out=str(out),
        steps=args.steps,
        seed=args.seed,
        progress=False,
        norm_clip=clip,
    )
    states: list[SyncerState] = []

    def workers(cfg_, data, init):
        ws = build_workers(cfg_, data, init)
        w0 = ws[0]
        wild = WildWorker(
            w0.index, w0.model, w0.opt, w0.stream, w0.params, w0.tokens_per_step, cfg_
        )
        wild.wild_at, wild.wild_steps, wild.wild_lr = args.wild_at, args.wild_steps, args.wild_lr
        return [wild, *ws[1:]]

    class Recording(SyncerState):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            states.append(self)

    saved = decoupled.build_workers, decoupled.SyncerState
    decoupled.build_workers = workers if wild and args.wild_steps > 0 else build_workers
    decoupled.SyncerState = Recording
    t0 = time.perf_counter()
    try:
        summary = run(cfg)
    finally:
        decoupled.build_workers, decoupled.SyncerState = saved
    wall = time.perf_counter() - t0
    evals = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    evals = [e for e in evals if e.get("kind") == "eval" and e.get("gap") is not None]
    floor = summary["entropy_floor"]
    before = [e for e in evals if e["step"] <= args.wild_at]
    after = [e for e in evals if args.wild_at < e["step"] <= args.wild_at + WINDOW]
    return {
        "wild": wild,
        "norm_clip": clip,
        "gap_before": round(before[-1]["gap"], 4) if before else None,
        "worst_gap_after": round(max(e["gap"] for e in after), 4) if after else None,
        "final_loss": round(summary["final_eval_loss"], 4),
        "final_gap": round(summary["final_eval_loss"] - floor, 4),
        "clipped_pushes": states[0].clipped_pushes,
        "merges": summary["merges"],
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--wild-at", type=int, default=1000)
    ap.add_argument("--wild-steps", type=int, default=100)
    ap.add_argument("--wild-lr", type=float, default=1e-2)
    ap.add_argument("--clips", default="0,3,5", help="norm_clip values (0: no guard)")
    ap.add_argument("--reference", action="store_true", help="also the run without it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "runs" / "wild_learner"))
    args = ap.parse_args()
    rows = []
    if args.reference:
        rows.append(run_one(args, 0.0, Path(args.out) / "reference", wild=False))
        print(json.dumps(rows[-1]), flush=True)
    for clip in (float(c) for c in args.clips.split(",")):
        r = run_one(args, clip, Path(args.out) / f"clip{clip:g}")
        rows.append(r)
        print(json.dumps(r), flush=True)
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "wild_learner.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(
        "\n| run | norm_clip | gap before | worst gap after (300 steps) | final loss (gap) "
        "| clipped pushes |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'wild learner' if r['wild'] else 'no wild learner'} | {r['norm_clip']:g} | "
            f"{r['gap_before']} | {r['worst_gap_after']} | "
            f"{r['final_loss']} ({r['final_gap']:+.4f}) | {r['clipped_pushes']} |"
        )


if __name__ == "__main__":
    main()
