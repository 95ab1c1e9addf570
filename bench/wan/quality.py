"""The quality side of the WAN bandwidth headline: eval loss of Decoupled DiLoCo settings
against DP at equal tokens, with the in-process engine (deterministic, so the machine's load
does not matter), and the bytes per inner step the planner gives each setting.

    python bench/wan/quality.py [--out runs/wan_quality] [--steps 2000] [--only NAME,...]

Each run is ``ddiloco train --engine inproc`` (printed before it starts); runs whose
``summary.json`` exists are kept. The planner's bytes use the protocol traffic calibrated on
the WAN runs (``docs/results/wan.json``, ``planner_calibration``) when present, and one pull
per push (each learner fetches only the merge that holds its push).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from ddiloco.bandwidth import BandwidthConfig, period  # noqa: E402

N_PARAMS = 108_288
"""gpt_tiny's parameters."""
STEP_S = 0.065
"""The scaled setting's inner-step time (``docs/results/wan.md``)."""
COMMON = ["--gamma", "0.8", "--schedule", "time"]

RUNS: dict[str, list[str]] = {
    "dp": ["--method", "dp"],
    "fp32_p8_h24": ["--method", "decoupled", "--codec", "fp32", "--down-codec", "fp32",
                    "-P", "8", "-H", "24", "--tau", "2", *COMMON],
    "fp32_p4_h24": ["--method", "decoupled", "--codec", "fp32", "--down-codec", "fp32",
                    "-P", "4", "-H", "24", "--tau", "2", *COMMON],
    "fp32_p4_h48": ["--method", "decoupled", "--codec", "fp32", "--down-codec", "fp32",
                    "-P", "4", "-H", "48", "--tau", "2", *COMMON],
    "int4_int8_p8_h24": ["--method", "decoupled", "--codec", "int4", "--down-codec", "int8",
                         "-P", "8", "-H", "24", "--tau", "2", *COMMON],
    "int4_int8_p4_h48": ["--method", "decoupled", "--codec", "int4", "--down-codec", "int8",
                         "-P", "4", "-H", "48", "--tau", "2", *COMMON],
    "int4_int8_p4_h48_tau6": ["--method", "decoupled", "--codec", "int4", "--down-codec",
                              "int8", "-P", "4", "-H", "48", "--tau", "6", *COMMON],
    "int4_bf16_p4_h48": ["--method", "decoupled", "--codec", "int4", "--down-codec", "bf16",
                         "-P", "4", "-H", "48", "--tau", "2", *COMMON],
    "int4_int4_p4_h48": ["--method", "decoupled", "--codec", "int4", "--down-codec", "int4",
                         "-P", "4", "-H", "48", "--tau", "2", *COMMON],
}  # fmt: skip
DELTA = ["--method", "decoupled", "--codec", "int4", "--down-delta", "--tau", "2", *COMMON]
"""int4 up, a delta-coded downlink (``sync.down_delta``)."""
RUNS.update({
    "int4_int4d_p4_h24": [*DELTA, "--down-codec", "int4", "-P", "4", "-H", "24"],
    "int4_int4d_p4_h28": [*DELTA, "--down-codec", "int4", "-P", "4", "-H", "28"],
    "int4_int4d_p3_h27": [*DELTA, "--down-codec", "int4", "-P", "3", "-H", "27"],
    "int4_int4d_p3_h27_tau4": [*DELTA, "--down-codec", "int4", "-P", "3", "-H", "27",
                               "--tau", "4"],
    "int4_int4d_p4_h28_tau4": [*DELTA, "--down-codec", "int4", "-P", "4", "-H", "28",
                               "--tau", "4"],
    "int4_int4d_p2_h28": [*DELTA, "--down-codec", "int4", "-P", "2", "-H", "28"],
    "int4_int4d_p4_h32": [*DELTA, "--down-codec", "int4", "-P", "4", "-H", "32"],
    "int4_int4d_p6_h28": [*DELTA, "--down-codec", "int4", "-P", "6", "-H", "28"],
    "int4_int4d_p6_h30": [*DELTA, "--down-codec", "int4", "-P", "6", "-H", "30"],
    "int4_int4d_p8_h30": [*DELTA, "--down-codec", "int4", "-P", "8", "-H", "30"],
    "int4_int4d_p8_h32": [*DELTA, "--down-codec", "int4", "-P", "8", "-H", "32"],
    "int4_int4d_p4_h48": [*DELTA, "--down-codec", "int4", "-P", "4", "-H", "48"],
    "int4_int2d_p4_h24": [*DELTA, "--down-codec", "int2", "-P", "4", "-H", "24"],
})  # fmt: skip


def planner_bytes(cfg: dict, cal: dict | None) -> float:
    """Bytes both ways per inner step on one region's link (hub syncer, as the WAN runs)."""
    from ddiloco.algorithm.codecs import get_codec

    if cfg["method"] == "dp":
        k, bits, _ = period(
            BandwidthConfig(method="dp", params=N_PARAMS, datacenters=4, grad_bits=32)
        )
        return 2 * bits / 8 / k
    extra = {}
    if cal:  # one pull per push: the grace window gathers the pushes (as with tau = 6 there)
        extra = dict(
            control_bps=8 * cal["control_bytes_per_s"],
            push_overhead_bits=8 * cal["bytes_per_push"],
        )
    k, bits, _ = period(
        BandwidthConfig(
            method="decoupled",
            params=N_PARAMS,
            step_time_s=STEP_S,
            datacenters=4,
            up_bits=get_codec(cfg["codec"]).bits_per_element,
            down_bits=get_codec(cfg["down_codec"]).bits_per_element,
            fragments=cfg["fragments"],
            inner_steps=cfg["H"],
            syncer="hub",
            **extra,
        )
    )
    return bits / 8 / k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/wan_quality")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    names = [n for n in RUNS if not a.only or n in a.only.split(",")]
    for name in names:
        out = Path(a.out) / name
        if (out / "summary.json").is_file():
            continue
        cmd = ["ddiloco", "train", "--engine", "inproc", "--steps", str(a.steps)]
        cmd += [*RUNS[name], "--no-progress", "--out", str(out)]
        print(" ".join(cmd), flush=True)
        subprocess.run([sys.executable, "-m", "ddiloco.cli", *cmd[1:]], check=True)
    cal_path = ROOT / "docs" / "results" / "wan.json"
    cal = (
        json.loads(cal_path.read_text()).get("planner_calibration") if cal_path.is_file() else None
    )
    res = {}
    for name in RUNS:
        f = Path(a.out) / name / "summary.json"
        if f.is_file():
            res[name] = json.loads(f.read_text())
    dp = res.get("dp")
    ref = res.get("fp32_p8_h24")
    dp_bytes = planner_bytes({"method": "dp"}, None)
    print(
        "\n| setting | final eval loss | vs DP | vs Decoupled fp32 P=8 H=24 | "
        "planner bytes per step | DP / it |"
    )
    print("|---|---|---|---|---|---|")
    for name, s in res.items():
        cfg = {
            "method": s["method"],
            **{k: s.get(k) for k in ("codec", "down_codec", "fragments", "H")},
        }
        if s["method"] != "dp":
            cfg.update(_sync_fields(Path(a.out) / name))
        b = planner_bytes(cfg, cal)
        loss = s["final_eval_loss"]
        vs_dp = "-" if dp is None else f"{100 * (loss / dp['final_eval_loss'] - 1):+.2f}%"
        vs_ref = "-" if ref is None else f"{100 * (loss / ref['final_eval_loss'] - 1):+.2f}%"
        print(f"| {name} | {loss:.4f} | {vs_dp} | {vs_ref} | {b:.0f} | {dp_bytes / b:.0f}x |")


def _sync_fields(run: Path) -> dict:
    """codec, down_codec, fragments and H of a run, from its config.toml."""
    import tomllib

    sync = tomllib.loads((run / "config.toml").read_text())["sync"]
    return {k: sync[k] for k in ("codec", "down_codec", "fragments", "H")}


if __name__ == "__main__":
    main()
