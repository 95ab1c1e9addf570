"""Does a restarted learner gain from resuming its inner-optimizer state (AdamW moments)?

The real runtime (`ddiloco train --engine processes` defaults: M = 4, gpt_tiny, synthetic
language), learner 0 SIGKILLed at step KILL (by its reported progress) and restarted after
2 s, twice per seed: resuming its saved optimizer state (the default) and with
`--fresh-optimizer`. Reported per run: the killed learner's mean training loss over the
WINDOW steps after its restart against the WINDOW steps before the kill, the largest loss
after the restart, and the run's final eval loss (the global model).

Writes bench/results/optimizer_resume.json and docs/results/optimizer_resume.md.
Usage: python bench/optimizer_resume.py [--steps 400] [--kill-at 150] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ddiloco.config import TrainConfig
from ddiloco.metrics.sinks import read_jsonl
from ddiloco.runtime.launch.launcher import Launcher, LaunchOptions

ROOT = Path(__file__).resolve().parent.parent


def one(seed: int, fresh: bool, steps: int, kill_at: int, window: int, out: Path) -> dict:
    run = out / f"seed{seed}_{'fresh' if fresh else 'resume'}"
    run.mkdir(parents=True, exist_ok=True)
    chaos = run.parent / f"chaos_seed{seed}.json"
    chaos.write_text(json.dumps({"kill_at_step": [[0, kill_at]], "kill_downtime_s": 2.0}))
    cfg = TrainConfig(
        engine="processes", out=str(run), steps=steps, seed=seed, progress=False, chaos=str(chaos)
    )
    t0 = time.perf_counter()
    with Launcher(
        cfg, LaunchOptions(extra_learner_args=(["--fresh-optimizer"] if fresh else []))
    ) as la:
        s = la.run()
    rows = read_jsonl(run / "learner_0" / "metrics.jsonl")
    starts = [i for i, r in enumerate(rows) if r["kind"] == "learner_start"]
    if len(starts) < 2:
        raise RuntimeError(f"{run}: learner 0 was not restarted ({len(starts)} starts)")
    before = [r for r in rows[starts[0] : starts[1]] if r["kind"] == "step"]
    after = [r for r in rows[starts[1] :] if r["kind"] == "step"][:window]
    restart = rows[starts[1]]
    before_loss = statistics.mean(r["loss"] for r in before[-window:])
    after_loss = statistics.mean(r["loss"] for r in after)
    res = {
        "seed": seed,
        "mode": "fresh" if fresh else "resume",
        "resumed_optimizer": restart.get("resumed_optimizer"),
        "killed_at_step": before[-1]["step"],
        "restarted_at_step": restart["step"],
        "loss_before": round(before_loss, 4),
        "loss_after": round(after_loss, 4),
        "loss_after_minus_before": round(after_loss - before_loss, 4),
        "max_loss_after": round(max(r["loss"] for r in after), 4),
        "final_eval_loss": round(s["final_eval_loss"], 4),
        "ok": s["ok"],
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(f"  {res}", file=sys.stderr, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--kill-at", type=int, default=150)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", default="runs/optimizer_resume")
    a = ap.parse_args()
    cmd = "python bench/optimizer_resume.py " + " ".join(sys.argv[1:])
    out = Path(a.out)
    runs = [
        one(seed, fresh, a.steps, a.kill_at, a.window, out)
        for seed in (int(x) for x in a.seeds.split(","))
        for fresh in (False, True)
    ]
    summary = {}
    for mode in ("resume", "fresh"):
        rs = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            k: round(statistics.mean(r[k] for r in rs), 4)
            for k in ("loss_after_minus_before", "max_loss_after", "final_eval_loss")
        }
    result = {
        "command": cmd,
        "steps": a.steps,
        "kill_at": a.kill_at,
        "window": a.window,
        "runs": runs,
        "mean": summary,
    }
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "results" / "optimizer_resume.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Resuming a restarted learner's inner-optimizer state",
        "",
        f"Command: `{cmd}` (real runtime, defaults: M = 4, gpt_tiny, {a.steps} inner steps "
        f"per learner; learner 0 SIGKILLed at step {a.kill_at}, restarted after 2 s).",
        "",
        f"Loss of the killed learner: mean training loss over its {a.window} steps after "
        f"the restart minus the mean over its {a.window} steps before the kill.",
        "",
        "| seed | optimizer state | restarted at step | loss before | loss after | after - "
        "before | max after | final eval loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['seed']} | {r['mode']} | {r['restarted_at_step']} | {r['loss_before']}"
            f" | {r['loss_after']} | {r['loss_after_minus_before']:+.4f} | "
            f"{r['max_loss_after']} | {r['final_eval_loss']} |"
        )
    for mode, m in summary.items():
        lines.append(
            f"| mean | {mode} | | | | {m['loss_after_minus_before']:+.4f} | "
            f"{m['max_loss_after']} | {m['final_eval_loss']} |"
        )
    (ROOT / "docs" / "results" / "optimizer_resume.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
