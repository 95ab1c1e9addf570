"""bf16 pushes as parameters or as deltas: the in-process engine at the defaults.

    python bench/push_encoding.py [--out runs/push_encoding] [--seeds 0,1] [--steps 2000]

A push through a ``delta`` codec is the difference from the learner's installed copy, which
the syncer adds to its own version of that copy (``ddiloco.algorithm.history`` keeps the
versions a push can name). For bf16 the question is whether rounding the difference (2^-8
of an update) instead of the weights (2^-8 of a weight) is worth the syncer's history. Each
seed runs the defaults twice: ``weights`` (bf16 as registered) and ``deltas`` (the same
codec with ``delta`` set, in this script only), against DP at the same seed and tokens
(from ``docs/results/install_rule.json`` where it holds that seed at these steps, else run
here). Writes ``push_encoding.json`` and ``push_encoding.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DELTA = "--bf16-deltas"
"""Marks a run with bf16 pushes sent as deltas (not a ``ddiloco train`` flag)."""


def deltas_run(argv: list[str]) -> None:
    """``ddiloco train`` in this process with the bf16 codec's ``delta`` set."""
    from ddiloco import cli
    from ddiloco.algorithm.codecs import cast

    cast.Bf16Codec.delta = property(lambda self: True)  # type: ignore[assignment,method-assign]
    sys.exit(cli.main(["train", *argv]))


def run_one(out: Path, name: str, argv: list[str]) -> dict:
    d = out / name
    if not (d / "summary.json").is_file():
        cmd = ["train", "--engine", "inproc", "--out", str(d), "--no-progress", *argv]
        if DELTA in cmd:
            cmd = [sys.executable, __file__, DELTA, *[x for x in cmd[1:] if x != DELTA]]
        else:
            cmd = ["ddiloco", *cmd]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((d / "summary.json").read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == DELTA:
        deltas_run(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/push_encoding")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    known = json.loads(Path("docs/results/install_rule.json").read_text())
    dp_rows = known["rows"] if known.get("steps") == a.steps else {}
    jobs = {}
    for s in seeds:
        common = ["--seed", str(s), "--steps", str(a.steps)]
        if f"dp_s{s}" not in dp_rows:
            jobs[f"dp_s{s}"] = ["--method", "dp", *common]
        jobs[f"weights_s{s}"] = common
        jobs[f"deltas_s{s}"] = [DELTA, *common]
    with ThreadPoolExecutor(a.jobs) as ex:
        res = dict(zip(jobs, ex.map(lambda kv: run_one(out, *kv), jobs.items())))
    rows = {k: round(v["final_eval_loss"], 4) for k, v in res.items()}
    for s in seeds:
        rows.setdefault(f"dp_s{s}", dp_rows.get(f"dp_s{s}", {}).get("final_eval_loss"))
    (out / "push_encoding.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| seed | DP | bf16 weights | vs DP | bf16 deltas | vs DP |",
        "|---|---|---|---|---|---|",
    ]
    for s in seeds:
        dp, w, d = rows[f"dp_s{s}"], rows[f"weights_s{s}"], rows[f"deltas_s{s}"]
        lines.append(
            f"| {s} | {dp:.4f} | {w:.4f} | {100 * (w / dp - 1):+.2f}% | {d:.4f} | "
            f"{100 * (d / dp - 1):+.2f}% |"
        )
    md = "\n".join(lines) + f"\n\n`python bench/push_encoding.py --seeds {a.seeds}`\n"
    (out / "push_encoding.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
