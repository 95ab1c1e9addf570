"""Foundation figures on the in-process engine (M = 4, equal tokens, built-in task):

1. no failures: decoupled vs dp (and diloco, streaming, local) final eval loss;
2. learner failures (each learner down ~15% of the time): goodput of decoupled vs diloco vs dp;
3. heterogeneous speeds (half the learners 18% slower, 10% step noise):
   K = M vs K = 1 vs K = 1 + grace window.

Writes bench/results/foundation.json and docs/results/foundation.md.
Usage: python bench/foundation.py [--steps N] [--seeds S] [--only quality,failures,hetero]
                                  [--methods dp,decoupled,...]
Sections not run keep their earlier results (each section records its own command).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

from ddiloco.config import TrainConfig, preset
from ddiloco.engine import run

ROOT = Path(__file__).resolve().parent.parent
POOL: concurrent.futures.ProcessPoolExecutor | None = None


def _one(args: tuple[str, TrainConfig]) -> dict:
    name, cfg = args
    t = time.perf_counter()
    r = run(cfg)
    print(
        f"  {name} seed {cfg.seed}: loss {r['final_eval_loss']:.4f} goodput {r['goodput']:.3f} "
        f"({time.perf_counter() - t:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return r


def cell(name: str, cfg: TrainConfig, seeds: list[int], out: Path) -> dict:
    jobs = [
        (name, cfg.replace(seed=s, out=str(out / f"{name}-s{s}"), progress=False)) for s in seeds
    ]
    rows = list(POOL.map(_one, jobs)) if POOL else [_one(j) for j in jobs]
    mean = lambda k: statistics.fmean(r[k] for r in rows)  # noqa: E731
    return {
        "name": name,
        "seeds": seeds,
        "final_eval_loss": mean("final_eval_loss"),
        "entropy_floor": rows[0]["entropy_floor"],
        "goodput": mean("goodput"),
        "goodput_available": mean("goodput_available"),
        "uptime": mean("uptime"),
        "merges": mean("merges"),
        "mean_quorum": mean("mean_quorum") if "mean_quorum" in rows[0] else None,
        "bytes_up": mean("bytes_up"),
        "losses": [r["final_eval_loss"] for r in rows],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=TrainConfig().steps)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--only", default="quality,failures,hetero")
    ap.add_argument(
        "--methods",
        default="dp,decoupled,diloco,streaming,local",
        help="methods of the no-failure section",
    )
    ap.add_argument("--workers", type=int, default=2, help="runs in parallel")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a TrainConfig field of the base config",
    )
    args = ap.parse_args()
    seeds = list(range(args.seeds))
    out = ROOT / "bench" / "results" / "foundation-runs"
    overrides = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        try:
            overrides[k] = json.loads(v)
        except json.JSONDecodeError:
            overrides[k] = v
    base = TrainConfig(learners=4, steps=args.steps, **overrides)
    res_base = {
        k: v
        for k, v in base.to_dict().items()
        if k in overrides
        or k
        in (
            "vocab_size",
            "batch_size",
            "block_size",
            "fragments",
            "H",
            "tau",
            "outer_lr",
            "outer_momentum",
            "inner_lr",
            "codec",
        )
    }
    global POOL
    if args.workers > 1:
        POOL = concurrent.futures.ProcessPoolExecutor(args.workers)
    parts = set(args.only.split(","))
    path = ROOT / "bench" / "results" / "foundation.json"
    res: dict = json.loads(path.read_text()) if path.is_file() else {}
    res = {k: v for k, v in res.items() if k in ("quality", "failures", "hetero", "meta")}
    meta = res.setdefault("meta", {})
    info = {
        "steps": args.steps,
        "learners": 4,
        "seeds": seeds,
        "base": res_base,
        "command": "python bench/foundation.py " + " ".join(sys.argv[1:]),
    }
    t0 = time.perf_counter()
    if "quality" in parts:
        res["quality"] = [
            cell(m, base.replace(method=m), seeds, out) for m in args.methods.split(",")
        ]
    if "failures" in parts:
        f = preset("failures", base)
        res["failures"] = [
            cell(f"{m}+failures", f.replace(method=m), seeds, out)
            for m in ("decoupled", "diloco", "dp")
        ]
    if "hetero" in parts:
        h = preset("hetero", base)
        res["hetero"] = [
            cell("K=M", h.replace(quorum=4, grace=False), seeds, out),
            cell("K=1", h.replace(quorum=1, grace=False), seeds, out),
            cell("K=1+grace", h.replace(quorum=1, grace=True), seeds, out),
            cell(
                "K=1, whole step per merge",
                h.replace(quorum=1, grace=False, scale_partial=False),
                seeds,
                out,
            ),
            cell(
                "K=M, step schedule", h.replace(quorum=4, grace=False, schedule="steps"), seeds, out
            ),
            cell(
                "K=1+grace, step schedule",
                h.replace(quorum=1, grace=True, schedule="steps"),
                seeds,
                out,
            ),
        ]
    info["wall_s"] = round(time.perf_counter() - t0, 1)
    for part in parts & {"quality", "failures", "hetero"}:
        meta[part] = info
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    write_markdown(res, ROOT / "docs" / "results" / "foundation.md")
    print(json.dumps({"wall_s": info["wall_s"]}))
    return 0


def write_markdown(res: dict, path: Path) -> None:
    lines = [
        "# Foundation results (in-process engine)",
        "",
        "M = 4 learners at equal tokens on the built-in synthetic language, on a shared "
        "2-core CPU; each section names the command that produced it (steps are inner "
        "steps per learner).",
        "",
    ]

    def produced(part: str) -> list[str]:
        m = res.get("meta", {}).get(part)
        if not m:
            return []
        return [
            f"{m['steps']} inner steps per learner, seeds {m['seeds']}, base settings "
            f"`{json.dumps(m['base'])}`. Produced by `{m['command']}` in {m['wall_s']:.0f} s.",
            "",
        ]

    def table(rows, cols):
        out = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            out.append("| " + " | ".join(f(r) for _, f in cols) + " |")
        return out

    if "quality" in res:
        dp = next(r for r in res["quality"] if r["name"] == "dp")["final_eval_loss"]
        lines += ["## 1. No failures: final eval loss at equal tokens", ""] + produced("quality")
        lines += table(
            res["quality"],
            [
                ("method", lambda r: r["name"]),
                ("final eval loss", lambda r: f"{r['final_eval_loss']:.4f}"),
                ("vs dp", lambda r: f"{100 * (r['final_eval_loss'] / dp - 1):+.2f}%"),
                ("per seed", lambda r: ", ".join(f"{x:.4f}" for x in r["losses"])),
                ("gap to floor", lambda r: f"{r['final_eval_loss'] - r['entropy_floor']:.4f}"),
                ("bytes up (MiB)", lambda r: f"{r['bytes_up'] / 2**20:.1f}"),
            ],
        )
        lines.append("")
    if "failures" in res:
        lines += (
            ["## 2. Learner failures (each learner down ~15% of the time)", ""]
            + produced("failures")
            + [
                "Goodput counts all chip-time, a failed learner's own downtime included "
                "(so it cannot exceed ~0.85 here); 'of up-time' leaves out the failed "
                "learner's own downtime.",
                "",
            ]
        )
        lines += table(
            res["failures"],
            [
                ("method", lambda r: r["name"]),
                ("goodput", lambda r: f"{r['goodput']:.3f}"),
                ("goodput of up-time", lambda r: f"{r['goodput_available']:.3f}"),
                ("uptime", lambda r: f"{r['uptime']:.3f}"),
                ("final eval loss", lambda r: f"{r['final_eval_loss']:.4f}"),
            ],
        )
        lines.append("")
    if "hetero" in res:
        lines += ["## 3. Heterogeneous learners (half 18% slower, 10% step noise)", ""] + produced(
            "hetero"
        )
        lines += table(
            res["hetero"],
            [
                ("quorum", lambda r: r["name"]),
                ("goodput", lambda r: f"{r['goodput']:.3f}"),
                ("mean learners per merge", lambda r: f"{r['mean_quorum']:.2f}"),
                ("final eval loss", lambda r: f"{r['final_eval_loss']:.4f}"),
            ],
        )
        lines += [
            "",
            "Paper (M = 8): K = 8: goodput 84%, text 54.4; K = 1: 100%, 51.4; "
            "K = 1 + grace: 100%, 55.3. 'step schedule': each learner sends fragment p "
            "every H of its own steps (fast learners run ahead); default 'time' schedule: "
            "learners send p at the same elapsed-time slot. 'whole step per merge': a "
            "single-learner merge takes a full outer step instead of 1/M of one.",
            "",
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
