"""The WAN measurements behind ``docs/results/wan.md``: every run of ``bench/wan/run.py``
with its flags. Runs whose ``result.json`` exists are kept (delete the folder to redo one).

    python bench/wan/suite.py [--only NAME,...] [--out runs/wan]
    python bench/wan/report.py --out runs/wan     # tables, plot, docs/results/wan.json

Scaled setting (see the doc): gpt_tiny (108k parameters), 4 regions, each region's link
shaped to RATE Mbit/s both ways, the syncer in its own hub region (4 x RATE)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as wan_run  # noqa: E402

RATE = "2.5"
STEPS = "600"
COMMON = ["--regions", "4", "--steps", STEPS, "--rate-mbit", RATE]
DEC = [
    "--method",
    "decoupled",
    "-P",
    "8",
    "-H",
    "24",
    "--tau",
    "2",
    "--codec",
    "int4",
    "--down-codec",
    "int8",
]

RUNS: dict[str, list[str]] = {
    # the three methods over the same shaped links
    "dp_free": ["--method", "dp", "--regions", "4", "--steps", STEPS, "--rate-mbit", "10000"],
    "dp": ["--method", "dp", *COMMON, "--max-wall-s", "420", "--snapshot-s", "10"],
    "diloco": [
        "--method",
        "diloco",
        *COMMON,
        "-H",
        "24",
        "--codec",
        "int4",
        "--down-codec",
        "int8",
    ],
    "decoupled": [*DEC, *COMMON],
    # one region's link cut for 30 s, 15 s into training
    "dp_cut": [
        "--method",
        "dp",
        *COMMON,
        "--max-wall-s",
        "100",
        "--snapshot-s",
        "5",
        "--cut-for-s",
        "30",
        "--cut-at-s",
        "15",
    ],
    "decoupled_cut": [*DEC, *COMMON, "--cut-for-s", "30", "--cut-at-s", "15"],
    # bandwidth headline: longer sync periods
    "decoupled_h96": [
        "--method",
        "decoupled",
        "-P",
        "8",
        "-H",
        "96",
        "--tau",
        "2",
        "--codec",
        "int4",
        "--down-codec",
        "int8",
        *COMMON,
    ],
    "decoupled_bf16": [
        "--method",
        "decoupled",
        "-P",
        "8",
        "-H",
        "24",
        "--tau",
        "2",
        "--codec",
        "bf16",
        "--down-codec",
        "bf16",
        *COMMON,
    ],
    # the 2 Gbit/s end of the scaled setting: links at 1 Mbit/s
    "dp_1m": [
        "--method",
        "dp",
        "--regions",
        "4",
        "--steps",
        STEPS,
        "--rate-mbit",
        "1",
        "--max-wall-s",
        "120",
        "--snapshot-s",
        "10",
    ],
    "decoupled_1m": [*DEC, "--regions", "4", "--steps", STEPS, "--rate-mbit", "1"],
    # heterogeneous regions: two of four run at half speed (stated run-time sleeps)
    "hetero_kM": [*DEC, *COMMON, "-K", "4", "--no-grace", "--slowdowns", "1,1,2,2"],
    "hetero_k1": [*DEC, *COMMON, "-K", "1", "--no-grace", "--slowdowns", "1,1,2,2"],
    "hetero_k1g": [*DEC, *COMMON, "-K", "1", "--slowdowns", "1,1,2,2"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/wan")
    ap.add_argument("--only", default="", help="comma-separated run names")
    a = ap.parse_args()
    names = [n for n in RUNS if not a.only or n in a.only.split(",")]
    for name in names:
        out = Path(a.out) / name
        if (out / "result.json").is_file():
            print(f"{name}: kept", flush=True)
            continue
        print(f"{name}: python bench/wan/run.py {' '.join(RUNS[name])} --out {out}", flush=True)
        wan_run.main([*RUNS[name], "--out", str(out)])


if __name__ == "__main__":
    main()
