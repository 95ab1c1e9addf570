"""The real-text comparison's table and plots, from its run directories.

    python bench/real_text/summarize.py runs/kjv --out docs/results/real_text/runs

Reads ``summary.json`` and ``metrics.jsonl`` of every run directory under the given folder
(one per method, seed or setting, as ``docs/results/real_text.md`` names them), and writes:

- ``OUT.json``: one row per run (held-out loss, perplexity, next-token accuracy, tokens,
  the relative gap to the DP run of the same seed, bytes, goodput, the virtual and the
  process's wall seconds) and the loss curves;
- ``OUT.md``: the same rows as a markdown table, with the command that made them;
- ``OUT_tokens.png`` and ``OUT_time.png``: held-out loss against tokens, and against the
  run's clock (virtual seconds of the in-process engine: compute plus waiting on links).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.append(str(ROOT / "src"))

from ddiloco.report import RunData, load_run, loss_curve, plot_loss  # noqa: E402

COLUMNS = (
    ("run", "run"),
    ("method", "method"),
    ("seed", "seed"),
    ("tokens", "tokens"),
    ("held-out loss", "loss"),
    ("vs DP", "vs_dp"),
    ("perplexity", "perplexity"),
    ("next-token accuracy", "accuracy"),
    ("goodput", "goodput"),
    ("bytes up", "bytes_up"),
    ("virtual s", "virtual_s"),
    ("wall s", "wall_s"),
)


def _row(name: str, run: RunData) -> dict:
    s = run.summary
    if s.get("final_eval_loss") is None:
        raise SystemExit(f"summarize: run {name} has no final held-out loss (it ended early)")
    loss = float(s["final_eval_loss"])
    return {
        "run": name,
        "method": s.get("method"),
        "seed": s.get("config", {}).get("seed"),
        "tokens": s.get("tokens"),
        "loss": round(loss, 4),
        "_loss": loss,  # the ratio to DP is taken before rounding (dropped from the output)
        "perplexity": round(math.exp(loss), 2),
        "accuracy": None if s.get("eval_accuracy") is None else round(s["eval_accuracy"], 4),
        "goodput": None if s.get("goodput") is None else round(s["goodput"], 3),
        "bytes_up": s.get("bytes_up"),
        "virtual_s": None if s.get("virtual_time_s") is None else round(s["virtual_time_s"], 1),
        "wall_s": None if s.get("wall_s") is None else round(s["wall_s"]),
        "curve_tokens": loss_curve(run, "tokens")[0],
        "curve_time": loss_curve(run, "time")[0],
    }


def summarize(root: Path) -> tuple[list[dict], list[RunData]]:
    if not root.is_dir():
        raise SystemExit(f"summarize: {root} is not a folder of run directories")
    dirs = sorted(d for d in root.iterdir() if (d / "summary.json").is_file())
    if not dirs:
        raise SystemExit(f"summarize: no run directories (with summary.json) under {root}")
    runs = [load_run(d) for d in dirs]
    rows = []
    for d, run in zip(dirs, runs):
        rows.append(_row(d.name, run))
        run.label = d.name
    dp = {r["seed"]: r["_loss"] for r in rows if r["method"] == "dp"}
    for r in rows:
        base, loss = dp.get(r["seed"]), r.pop("_loss")
        r["vs_dp"] = None if base is None else f"{100 * (loss / base - 1):+.2f}%"
    return rows, runs


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| " + " | ".join(h for h, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r[k]) for _, k in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="a folder of run directories")
    p.add_argument("--out", type=Path, required=True, help="output path prefix (no suffix)")
    args = p.parse_args(argv)
    rows, runs = summarize(args.root)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/real_text/summarize.py " + " ".join(argv or sys.argv[1:])
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "runs": rows}))
    args.out.with_suffix(".md").write_text(markdown(rows, command))
    for axis in ("tokens", "time"):
        plot_loss(runs, args.out.parent / f"{args.out.name}_{axis}.png", axis)
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
