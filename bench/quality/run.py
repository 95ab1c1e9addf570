"""The quality study (issue 5): Decoupled DiLoCo beside its baselines and ablations on the
in-process engine, every cell seeded.

  a) local / DP / DiLoCo / Streaming / Decoupled at equal tokens, no failures
  b) the same under learner failures (each learner down ~15% of the time)
  c) heterogeneous speeds: K = M vs K = 1 vs K = 1 + grace (quality and goodput)
  d) RDA vs plain averaging at M = 8 and 16
  e) codecs bf16 / int4 / int2 / 1-bit
  f) fragmentation strategies, with the peak bytes per step of each
  g) MoE vs dense
  h) the vision task (vit_digits)

Writes bench/results/quality.json, docs/results/quality.md and PNGs in docs/results/quality/.
Usage: python bench/quality/run.py [--quick] [--out DIR] [--workers 2] [--resume]
(--out DIR puts everything under DIR instead: DIR/quality.json, DIR/quality.md,
DIR/quality/*.png, DIR/runs/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
if str(ROOT / "src") not in sys.path:
    sys.path.append(str(ROOT / "src"))

from cells import SECTIONS, base_config, cells, resolve  # noqa: E402
from tqdm import tqdm  # noqa: E402


def _run_one(job: dict) -> dict:
    """One engine run in a worker process (one torch thread)."""
    import torch

    torch.set_num_threads(1)
    from ddiloco.config import TrainConfig
    from ddiloco.engine import run

    known = set(TrainConfig().to_dict())
    config = {k: v for k, v in job["config"].items() if k in known}
    cfg = TrainConfig(**config, seed=job["seed"], out=job["dir"], progress=False)
    summary = run(cfg)
    return {"key": job["key"], "summary": summary}


def _cached(job: dict) -> dict | None:
    p = Path(job["dir"]) / "summary.json"
    if not p.exists():
        return None
    s = json.loads(p.read_text())
    want = {**_jsonable(job["config"]), "seed": job["seed"]}
    have = s.get("config", {})
    if all(have.get(k) == v for k, v in want.items()):
        return s
    return None


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def peak_bytes_per_step(config: dict) -> dict:
    """Per learner: the largest upload after one inner step under the staggered schedule
    (fragments sent at the same phase add up) through the run's codec, and the ideal
    (whole model / P)."""
    import torch

    from ddiloco.algorithm.codecs import get_codec
    from ddiloco.algorithm.fragments import fragment_model
    from ddiloco.algorithm.schedule import FragmentSchedule
    from ddiloco.models import build_model, embedding_param_names

    torch.manual_seed(0)
    model = build_model(
        config["model"], vocab_size=config["vocab_size"], block_size=config["block_size"]
    )
    frag = fragment_model(
        model, config["fragments"], config["fragmentation"], embedding_param_names(model)
    )
    sched = FragmentSchedule(P=frag.P, H=config["H"], tau=config["tau"])
    codec = get_codec(config["codec"])
    per_phase: dict[int, int] = {}
    for f in frag.fragments:
        o = sched.offset(f.index)
        per_phase[o] = per_phase.get(o, 0) + codec.nbytes(f.numel)
    total = codec.nbytes(sum(f.numel for f in frag.fragments))
    return {
        "P": frag.P,
        "peak_bytes": max(per_phase.values()),
        "ideal_bytes": total / frag.P,
        "model_bytes": total,
        "imbalance": frag.imbalance(),
    }


def aggregate(cell, summaries: list[dict], dirs: list[Path]) -> dict:
    def stat(key):
        vals = [s[key] for s in summaries if s.get(key) is not None]
        if not vals:
            return None, None
        return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)

    out = {
        "section": cell.section,
        "name": cell.name,
        "seeds": cell.seeds,
        "overrides": _jsonable(cell.overrides),
        **cell.extra,
        "runs": [str(d) for d in dirs],
    }
    for k in (
        "final_eval_loss",
        "gap_to_floor",
        "eval_accuracy",
        "goodput",
        "goodput_available",
        "uptime",
        "merges",
        "mean_quorum",
        "bytes_up",
        "bytes_down",
        "tokens",
        "wall_s",
        "failures",
        "virtual_time_s",
    ):
        m, sd = stat(k)
        out[k] = m
        if k in ("final_eval_loss", "eval_accuracy", "goodput"):
            out[k + "_sd"] = sd
    out["per_seed_loss"] = [s["final_eval_loss"] for s in summaries]
    out["per_seed_accuracy"] = [s.get("eval_accuracy") for s in summaries]
    out["entropy_floor"] = summaries[0].get("entropy_floor")
    out["learners"] = summaries[0]["learners"]
    out["steps"] = summaries[0]["steps"]
    out["fragments"] = summaries[0].get("fragments")
    from report import eval_curve  # report imports matplotlib: only where it is needed

    curves = [eval_curve(d) for d in dirs]
    n = min(len(c) for c in curves)
    out["curve"] = [
        [statistics.fmean(c[i][0] for c in curves), statistics.fmean(c[i][1] for c in curves)]
        for i in range(n)
    ]
    steps_total = summaries[0]["steps"] * summaries[0]["learners"]
    out["bytes_up_per_learner_step"] = (
        out["bytes_up"] / steps_total if out["bytes_up"] is not None else None
    )
    return out


def _pinning(base: dict) -> dict:
    """TrainConfig fields the study leaves at their defaults, and base keys the installed
    TrainConfig does not know (both reported in the markdown, never silent)."""
    from ddiloco.config import TrainConfig

    default = TrainConfig().to_dict()  # flat: every field by its flat name
    fields = set(default)
    unpinned = {
        n: default[n] for n in fields if n not in base and n not in ("seed", "out", "progress")
    }
    return {
        "unpinned_defaults": _jsonable(unpinned),
        "unknown_base_keys": sorted(k for k in base if k not in fields),
    }


def _git_state() -> str:
    """The commit the study ran on, noting uncommitted changes under src/."""
    import subprocess

    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + (f" (uncommitted changes in {', '.join(dirty[1::2])})" if dirty else "")


def _display(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny runs: a smoke test (< 2 min)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write everything under DIR (default: bench/results + docs/results)",
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--resume",
        action="store_true",
        help="reuse finished runs whose summary.json matches the cell's config",
    )
    ap.add_argument("--only", default="abcdefgh", help="sections to run, e.g. abe")
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the markdown and plots from the existing quality.json (no runs)",
    )
    args = ap.parse_args(argv)

    if args.out is None:
        json_path = ROOT / "bench" / "results" / "quality.json"
        md_path = ROOT / "docs" / "results" / "quality.md"
        png_dir = ROOT / "docs" / "results" / "quality"
        runs_dir = ROOT / "bench" / "results" / "quality-runs"
    else:
        json_path, md_path = args.out / "quality.json", args.out / "quality.md"
        png_dir, runs_dir = args.out / "quality", args.out / "runs"
    if args.quick and args.out is None:
        json_path = json_path.with_name("quality-quick.json")
        md_path = ROOT / "bench" / "results" / "quality-quick.md"
        png_dir = ROOT / "bench" / "results" / "quality-quick"
        runs_dir = ROOT / "bench" / "results" / "quality-quick-runs"
    if args.render_only:
        from report import write_report

        write_report(json.loads(json_path.read_text()), md_path, png_dir)
        print(json.dumps({"markdown": str(md_path), "plots": str(png_dir)}))
        return 0
    if runs_dir.exists() and not args.resume:
        shutil.rmtree(runs_dir)

    all_cells = [c for c in cells(args.quick) if c.section in args.only]
    jobs: dict[str, dict] = {}  # one job per distinct (config, seed)
    cell_keys: list[list[str]] = []
    names: dict[str, str] = {}
    for c in all_cells:
        cfg = resolve(c, args.quick)
        ident = json.dumps(_jsonable(cfg), sort_keys=True)
        if ident not in names:
            names[ident] = (
                f"{c.section}-{c.name}".replace(" ", "_").replace("=", "").replace("+", "_")
            )
        keys = []
        for s in c.seeds:
            key = f"{names[ident]}-s{s}"
            jobs.setdefault(key, {"key": key, "config": cfg, "seed": s, "dir": str(runs_dir / key)})
            keys.append(key)
        cell_keys.append(keys)

    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    todo = []
    for j in jobs.values():
        s = _cached(j) if args.resume else None
        if s is not None:
            results[j["key"]] = s
        else:
            todo.append(j)
    # longest first so the two workers finish together
    todo.sort(
        key=lambda j: (
            -j["config"]["steps"]
            * j["config"]["learners"]
            * (2.5 if j["config"]["model"].startswith("moe") else 1.0)
            * (0.3 if j["config"]["model"].startswith("vit") else 1.0)
        )
    )
    bar = tqdm(total=len(todo), desc="quality runs", unit="run", file=sys.stderr)
    with ProcessPoolExecutor(max_workers=args.workers) as ex:
        futs = {ex.submit(_run_one, j): j for j in todo}
        for f in as_completed(futs):
            r = f.result()
            results[r["key"]] = r["summary"]
            bar.set_postfix_str(f"{r['key']}: {r['summary']['final_eval_loss']:.4f}")
            bar.update(1)
    bar.close()
    wall_s = time.perf_counter() - t0

    agg = []
    for c, keys in zip(all_cells, cell_keys):
        a = aggregate(c, [results[k] for k in keys], [Path(jobs[k]["dir"]) for k in keys])
        a["config"] = _jsonable(resolve(c, args.quick))
        if c.section == "f":
            a.update(peak_bytes_per_step(a["config"]))
        agg.append(a)

    cmd = (
        "python bench/quality/run.py"
        + (" --quick" if args.quick else "")
        + (f" --out {args.out}" if args.out is not None else "")
    )
    res = {
        "command": cmd,
        "quick": args.quick,
        "wall_s": round(wall_s, 1),
        "runs": len(jobs),
        "runs_executed": len(todo),
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
        "loadavg_end": list(os.getloadavg()),
        "run_cpu_s": round(sum(results[k].get("wall_s", 0.0) for k in jobs), 1),
        "base": _jsonable(base_config(args.quick)),
        "cells": agg,
        "git": _git_state(),
        **_pinning(base_config(args.quick)),
        "sections": SECTIONS,
        "json_name": _display(json_path),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(res, indent=2))
    from report import write_report

    write_report(res, md_path, png_dir)
    print(
        json.dumps(
            {
                "wall_s": res["wall_s"],
                "json": str(json_path),
                "markdown": str(md_path),
                "plots": str(png_dir),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
