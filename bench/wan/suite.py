"""The WAN measurements behind ``docs/results/wan.md``: every run of ``bench/wan/run.py``
with its flags. Runs whose ``result.json`` exists are kept (delete the folder to redo one).

    python bench/wan/suite.py [--only NAME,...] [--out runs/wan]
    python bench/wan/report.py --out runs/wan     # tables, plot, docs/results/wan.json

Scaled setting (see the doc): gpt_tiny (108k parameters), 4 regions, each region's link
shaped to RATE Mbit/s both ways with a LATENCY_MS one-way delay, the syncer in its own hub
region (4 x RATE). Each run records the machine's load average (timing depends on it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as wan_run  # noqa: E402

RATE = "2.5"
STEPS = "2000"
LATENCY_MS = "1.2"
"""One-way propagation delay, scaled from the paper's 30-70 ms round trips between US
regions by this setting's step time (0.065 s here against 2 s): 35 ms x 0.065 / 2 = 1.1 ms."""
COMMON = [
    "--regions",
    "4",
    "--steps",
    STEPS,
    "--rate-mbit",
    RATE,
    "--latency-ms",
    LATENCY_MS,
    "--gamma",
    "0.8",
    "--snapshot-s",
    "2",
    "--heartbeat-interval-s",
    "1",
]
DEC = ["--method", "decoupled", "--schedule", "time", "--tau", "2", "--install", "overwrite"]
"""Decoupled as these runs were measured: the paper's install rule (the merged value
replaces the steps made since the push). The ``_rb`` runs rebase instead (``sync.install``)."""
PAPER = [*DEC, "-P", "8", "-H", "24", "--codec", "int4", "--down-codec", "int8"]
"""Decoupled with the paper's uplink codec (int4) and the downlink codec chosen by quality."""
HEADLINE = [*DEC, "-P", "4", "-H", "48", "--codec", "int4", "--down-codec", "int8"]
"""The fewest bytes per step within the quality bound (chosen with the in-process engine)."""

DELTA = [*DEC, "-P", "3", "-H", "27", "--codec", "int4", "--down-codec", "int4", "--down-delta"]
"""The bandwidth headline with a delta-coded int4 downlink (``sync.down_delta``), P and H
chosen with the in-process engine (``bench/wan/quality.py``)."""

HETERO = ["--steps", "600", "--slowdowns", "1,1,2,2"]


def _p6(h: int, tau: int, *extra: str) -> list[str]:
    """The delta-coded setting at P = 6 with rebased installs, H = ``h``, tau = ``tau``."""
    run = [*DELTA, *COMMON, "-P", "6", "-H", str(h), "--tau", str(tau)]
    return [*run, "--install", "rebase", *extra]


RUNS: dict[str, list[str]] = {
    # in this order: the runs whose timing does not depend on the machine's load first
    # (DP is bound by its link; the unshaped DP run gives the loss at each step)
    "dp_free": ["--method", "dp", *COMMON, "--rate-mbit", "10000", "--snapshot-s", "5"],
    "dp": ["--method", "dp", *COMMON, "--max-wall-s", "240", "--snapshot-s", "10"],
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
    # heterogeneous regions: two of four run at half speed (stated run-time sleeps), 600
    # steps per region as the engine's heterogeneous table
    "hetero_kM": [*PAPER, *COMMON, *HETERO, "-K", "4", "--no-grace"],
    "hetero_k1": [*PAPER, *COMMON, *HETERO, "-K", "1", "--no-grace"],
    "hetero_k1g": [*PAPER, *COMMON, *HETERO, "-K", "1"],
    "decoupled_cut": [*PAPER, *COMMON, "--cut-for-s", "30", "--cut-at-s", "15"],
    # the three methods over the same shaped links
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
    "decoupled": [*PAPER, *COMMON, "--pcap"],
    # the bandwidth headline
    "decoupled_bw": [*HEADLINE, *COMMON, "--pcap"],
    # tau = 6: time for the grace window to gather the learners' pushes on these links
    "decoupled_bw_t6": [*HEADLINE, *COMMON, "--tau", "6", "--pcap"],
    # the same with a bf16 downlink: better quality, more bytes
    "decoupled_bw16": [*HEADLINE[:-1], "bf16", *COMMON],
    # int4 both ways, the downlink delta-coded against each learner's copy; tau = 6 gives
    # the grace window time to gather the pushes on these links
    "decoupled_dd": [*DELTA, *COMMON, "--pcap"],
    "decoupled_dd_t6": [*DELTA, *COMMON, "--tau", "6"],
    # smaller fragments (10.2 kB: 33 ms each way), so that tau = 2-3 covers a push and its
    # merge's return
    "decoupled_dd_p6": [*DELTA, *COMMON, "-P", "6", "-H", "28"],
    "decoupled_dd_p6_t3": [*DELTA, *COMMON, "-P", "6", "-H", "28", "--tau", "3"],
    # rebased installs (the default rule): the learners' steps since a push are kept, so
    # tau can cover the links without throwing steps away
    "decoupled_dd_rb": [*DELTA, *COMMON, "--install", "rebase", "--pcap"],
    "decoupled_dd_t6_rb": [*DELTA, *COMMON, "--tau", "6", "--install", "rebase", "--pcap"],
    "decoupled_dd_t4_rb": [*DELTA, *COMMON, "--tau", "4", "--install", "rebase", "--pcap"],
    # longer rounds for fewer bytes per step: H = 32 (P = 3 and P = 4), tau = 4
    "decoupled_dd_h32_t4_rb": [*DELTA, *COMMON, "-H", "32", "--tau", "4", "--install", "rebase"],
    "decoupled_dd_p4_h32_t4_rb": [
        *DELTA,
        *COMMON,
        "-P",
        "4",
        "-H",
        "32",
        "--tau",
        "4",
        "--install",
        "rebase",
    ],
    # six fragments (a push and its merge's return fit a tau = 3 overlap on these links),
    # rebased, with rounds long enough for the bytes
    "decoupled_dd_p6_h28_t2_rb": _p6(28, 2),
    "decoupled_dd_p6_h28_t3_rb": _p6(28, 3),
    "decoupled_dd_p6_h30_t3_rb": _p6(30, 3),
    "decoupled_dd_p6_h32_t3_rb": _p6(32, 3),
    # the same with an outer momentum of 0.8 and 0.7 instead of 0.9 (chosen in-process over
    # 3 seeds)
    "decoupled_dd_p6_h30_t3_m08_rb": _p6(30, 3, "--outer-momentum", "0.8"),
    "decoupled_dd_p6_h30_t3_m07_rb": _p6(30, 3, "--outer-momentum", "0.7"),
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
