"""Tables and the loss-against-wall-clock plot of the WAN measurements (``bench/wan/suite.py``).

    python bench/wan/report.py --out runs/wan [--target 2.0]

Prints markdown tables, writes ``docs/results/wan.json`` (every figure quoted in
``docs/results/wan.md``) and ``docs/results/wan_loss.png``.

Definitions:
* time to target: the first saved global model whose eval loss is at or below the target,
  seconds from the first training step (an upper bound by at most one save interval);
* DP's projected time to target, when its shaped run stops first: the steps the unshaped DP
  run needed (the same seeded, synchronous computation: DP's loss per step does not depend
  on the link) times the shaped run's measured seconds per step;
* bytes per inner step: bytes both ways on a region's link in the training window, over
  that region's inner steps;
* planner: ``ddiloco.bandwidth.period`` for the run's N, D, codecs, P, H, measured seconds
  per step and the syncer in its own hub region; "idealised" counts payload only (one pull
  per push), "corrected" adds the protocol traffic calibrated on two runs (Decoupled H = 24
  and DiLoCo) and takes each run's measured pulls per push: the other runs check it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from ddiloco.bandwidth import BandwidthConfig, period  # noqa: E402

SYNCED = ("diloco", "decoupled", "decoupled_bw", "decoupled_bw_t6", "decoupled_bw16")
"""The syncer's runs set against DP in the time-to-target tables."""

TARGETS = (2.0, 1.5, 1.3, 1.2, 1.15, 1.12)
"""Eval-loss targets of the speed-up table, besides the default target."""


def load(out: Path) -> dict[str, dict]:
    res = {}
    for d in sorted(out.iterdir()):
        f = d / "result.json"
        if f.is_file():
            res[d.name] = json.loads(f.read_text())
    return res


def time_to(curve: list[dict], target: float) -> float | None:
    for c in curve:
        if c["eval_loss"] <= target:
            return max(0.0, c["t_s"])
    return None


def steps_to(curve: list[dict], target: float) -> float | None:
    prev = None
    for c in curve:
        if c["eval_loss"] <= target:
            if prev is None:
                return float(c["step"])
            # linear between the two saves around the crossing
            f = (prev["eval_loss"] - target) / (prev["eval_loss"] - c["eval_loss"])
            return prev["step"] + f * (c["step"] - prev["step"])
        prev = c
    return None


def bytes_per_step(r: dict) -> dict:
    """Mean over the learner regions of (up, down) bytes per inner step of that region."""
    ups, downs = [], []
    for k, reg in r["regions"].items():
        w = r["link_bytes_window"][k]
        ups.append(w["up_bytes"] / reg["steps"])
        downs.append(w["down_bytes"] / reg["steps"])
    return {
        "up": sum(ups) / len(ups),
        "down": sum(downs) / len(downs),
        "total": (sum(ups) + sum(downs)) / len(ups),
    }


def _bits(name: str) -> float:
    """Bits per parameter on the wire of the codec ``name`` at its default 64-element blocks,
    per-block fp32 scales included."""
    from ddiloco.algorithm.codecs import get_codec

    return get_codec(name.split("/")[0]).bits_per_element


def _planner(r: dict, **extra) -> BandwidthConfig:
    c = r["config"]
    steps = r["total_steps"] / len(r["regions"])
    common = dict(params=r["n_params"], step_time_s=r["train_s"] / steps, datacenters=c["learners"])
    if r["method"] == "dp":
        return BandwidthConfig(method="dp", grad_bits=32, **common)
    return BandwidthConfig(
        method=r["method"],
        up_bits=_bits(c["codec"]),
        down_bits=_bits(c["down_codec"]),
        fragments=c["fragments"],
        inner_steps=c["H"],
        tau=c["tau"],
        syncer="hub",
        **common,
        **extra,
    )


def planner_bytes_per_step(r: dict, **extra) -> float:
    """Bytes both ways per inner step on one region's link, per the planner."""
    k, bits, _ = period(_planner(r, **extra))
    return (2 if r["method"] == "dp" else 1) * bits / 8 / k  # a ring sends what it receives


def pulls_per_push(r: dict) -> float | None:
    """Merged fragment versions a learner downloaded per push (its payload counters, less the
    first fetch of the whole model)."""
    if r["method"] == "dp":
        return None
    c = r["config"]
    down = _bits(c["down_codec"]) / 8
    whole = r["n_params"] * down
    frag = whole / c["fragments"]
    got = sum(reg["bytes_received"] - whole for reg in r["regions"].values())
    return max(1.0, got / sum(reg["pushes"] * frag for reg in r["regions"].values()))


def calibrate(res: dict) -> dict | None:
    """Protocol traffic from two runs with different push rates (Decoupled, H = 24 and
    DiLoCo): bytes per step beyond the payload = control * s_per_step + per_push *
    pushes_per_step, solved for (control bytes/s, bytes per push)."""
    if not all(m in res for m in ("decoupled", "diloco")):
        return None
    rows = []
    for m in ("decoupled", "diloco"):
        r = res[m]
        c = r["config"]
        payload = planner_bytes_per_step(r, pulls_per_push=pulls_per_push(r))
        over = bytes_per_step(r)["total"] - payload
        s_step = r["train_s"] / (r["total_steps"] / len(r["regions"]))
        rows.append((s_step, c["fragments"] / c["H"], over))
    (a1, b1, o1), (a2, b2, o2) = rows
    det = a1 * b2 - a2 * b1
    control = (o1 * b2 - o2 * b1) / det
    per_push = (a1 * o2 - a2 * o1) / det
    if control < 0 or per_push < 0:  # noise beats the smaller term: fit the other alone
        rows_ = [(a1, b1, o1), (a2, b2, o2)]
        if control < 0:
            control = 0.0
            per_push = sum(b * o for _, b, o in rows_) / sum(b * b for _, b, _ in rows_)
        else:
            per_push = 0.0
            control = sum(a * o for a, _, o in rows_) / sum(a * a for a, _, _ in rows_)
    return {
        "control_bytes_per_s": control,
        "bytes_per_push": per_push,
        "pulls_per_push_k1": pulls_per_push(res["decoupled"]),
    }


def utilisation(r: dict) -> list[float]:
    return [round(reg["utilisation"], 3) for reg in r["regions"].values()]


def load_avg(r: dict) -> str | None:
    """The 1-minute load average during the run: mean (min-max) of its samples."""
    xs = r.get("load_avg", {}).get("during") or []
    if not xs:
        return None
    return f"{sum(xs) / len(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def goodput(r: dict) -> float | None:
    led = [reg.get("ledger") for reg in r["regions"].values()]
    if not all(led):
        return None
    return sum(x["merged"] for x in led) / sum(x["computed"] for x in led)


def ledger(r: dict) -> dict:
    """The learners' ledgers summed: inner steps computed, merged, dropped (stale pushes),
    lost and overwritten (progress a late install replaced)."""
    out: dict[str, float] = {}
    for reg in r["regions"].values():
        for k, v in (reg.get("ledger") or {}).items():
            out[k] = out.get(k, 0.0) + v
    return out


def final_loss(r: dict) -> float:
    return r["curve"][-1]["eval_loss"]


def cut_progress(out: Path, name: str, r: dict) -> dict | None:
    ev = {e["kind"]: e for e in r.get("events", [])}
    if "cut" not in ev or "restore" not in ev:
        return None
    a, b = ev["cut"]["wall"], ev["restore"]["wall"]
    steps = {}
    for k in r["regions"]:
        f = (
            (out / name / f"rank_{k}.jsonl")
            if r["method"] == "dp"
            else (out / name / f"learner_{k}" / "metrics.jsonl")
        )
        walls = [
            json.loads(x)["wall"]
            for x in f.read_text().splitlines()
            if x.strip() and json.loads(x).get("kind", "step") == "step"
        ]
        steps[k] = sum(1 for w in walls if a <= w <= b)
    return {
        "cut_region": ev["cut"]["region"],
        "cut_s": round(b - a, 1),
        "cut_at_s": ev["cut"]["t_s"],
        "steps_during_cut": steps,
    }


def plot(res: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {
        "dp": ("DP (Gloo all-reduce)", "C3", "-"),
        "diloco": ("DiLoCo (sync, H=24)", "C1", "-"),
        "decoupled": ("Decoupled (P=8, H=24, int4 up, int8 down)", "C0", "-"),
        "decoupled_bw": ("Decoupled (P=4, H=48, int4 up, int8 down)", "C2", "-"),
        "decoupled_bw_t6": ("Decoupled (P=4, H=48, tau=6, int4 up, int8 down)", "C5", "-"),
        "decoupled_bw16": ("Decoupled (P=4, H=48, int4 up, bf16 down)", "C4", "-"),
        "dp_free": ("DP, unshaped links", "C3", ":"),
    }
    for name, (label, color, ls) in styles.items():
        if name in res:
            c = [x for x in res[name]["curve"] if x["t_s"] >= 0]
            ax.plot(
                [x["t_s"] for x in c],
                [x["eval_loss"] for x in c],
                ls,
                color=color,
                label=label,
                marker=".",
                markersize=3,
            )
    ax.axhline(target, color="grey", lw=0.8, ls="--", label=f"target {target:g}")
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlim(left=0)
    ax.set_xlabel("wall-clock seconds from the first step")
    ax.set_ylabel("eval loss")
    ax.set_title("4 regions, links shaped to 2.5 Mbit/s each way, 1.2 ms one-way delay")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/wan")
    ap.add_argument(
        "--target",
        type=float,
        default=None,
        help="eval loss target (default: the worst best loss of DiLoCo and Decoupled)",
    )
    ap.add_argument("--docs", default=str(ROOT / "docs" / "results"))
    a = ap.parse_args()
    out = Path(a.out)
    res = load(out)
    target = a.target
    if target is None:
        target = max(
            min(c["eval_loss"] for c in res[m]["curve"])
            for m in ("diloco", "decoupled")
            if m in res
        )
        target = round(target + 0.005, 2)
    summary: dict = {"target_eval_loss": target, "runs": {}}
    print(f"target eval loss {target}\n")
    print(
        "| run | train s | steps (all regions) | s per step | final eval | time to target s | "
        "utilisation per region | goodput | load average |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        t = time_to(r["curve"], target)
        sps = r["train_s"] / (r["total_steps"] / len(r["regions"]))
        g = goodput(r)
        row = {
            "method": r["method"],
            "train_s": r["train_s"],
            "total_steps": r["total_steps"],
            "s_per_step": sps,
            "final_eval": final_loss(r),
            "time_to_target_s": t,
            "utilisation": utilisation(r),
            "goodput": g,
            "bytes_per_step": bytes_per_step(r),
            "planner_bytes_per_step": planner_bytes_per_step(r),
            "cut": cut_progress(out, name, r),
            "load_avg": load_avg(r),
            "latency_ms": r["args"].get("latency_ms", 0.0),
        }
        summary["runs"][name] = row
        print(
            f"| {name} | {r['train_s']:.1f} | {r['total_steps']} | {sps:.3f} | "
            f"{final_loss(r):.4f} | {'not reached' if t is None else f'{t:.1f}'} | "
            f"{row['utilisation']} | {'-' if g is None else f'{g:.3f}'} | "
            f"{row['load_avg'] or '-'} |"
        )
    if "dp" in res and "dp_free" in res:
        s = steps_to(res["dp_free"]["curve"], target)
        dp = summary["runs"]["dp"]
        proj = None if s is None else s * dp["s_per_step"]
        summary["dp_projected_time_to_target_s"] = proj
        summary["dp_steps_to_target"] = s
        print(
            f"\nDP: {s} steps to target (unshaped run) x {dp['s_per_step']:.3f} s per shaped "
            f"step = {proj} s"
        )
        for m in SYNCED:
            tm = summary["runs"].get(m, {}).get("time_to_target_s")
            dp_t = dp["time_to_target_s"] or proj
            if tm and dp_t:
                summary[f"speedup_{m}_vs_dp"] = dp_t / tm
                print(f"speed-up {m} vs DP: {dp_t / tm:.1f}x")
    if "dp" in res and "dp_free" in res:
        print(
            "\n| target eval loss | DP s | DP steps (unshaped run) | "
            + " | ".join(f"{m} s | speed-up" for m in SYNCED)
            + " |"
        )
        print("|---|---|---|" + "---|---|" * len(SYNCED))
        summary["targets"] = []
        fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
        for tgt in sorted(set(TARGETS) | {target}, reverse=True):
            steps = steps_to(res["dp_free"]["curve"], tgt)
            dp_t = time_to(res["dp"]["curve"], tgt)
            kind = "measured"
            if dp_t is None:
                dp_t = None if steps is None else steps * summary["runs"]["dp"]["s_per_step"]
                kind = "projected"
            row = {"target": tgt, "dp_s": dp_t, "dp_kind": kind, "dp_steps": steps}
            cells = []
            for m in SYNCED:
                tm = time_to(res[m]["curve"], tgt) if m in res else None
                row[f"{m}_s"] = tm
                row[f"{m}_speedup"] = dp_t / tm if dp_t and tm else None
                cells.append(f"{fmt(tm)} | {fmt(row[f'{m}_speedup'], '{:.1f}x')}")
            summary["targets"].append(row)
            print(
                f"| {tgt:g} | {fmt(dp_t)} ({kind}) | {fmt(steps, '{:.0f}')} | "
                + " | ".join(cells)
                + " |"
            )
    if all(n in res for n in ("dp_1m", "decoupled_1m", "dp_free")):
        s = steps_to(res["dp_free"]["curve"], target)
        dp_sps = summary["runs"]["dp_1m"]["s_per_step"]
        tm = time_to(res["decoupled_1m"]["curve"], target)
        proj = None if s is None else s * dp_sps
        summary["at_1mbit"] = {
            "dp_s_per_step": dp_sps,
            "dp_projected_s": proj,
            "decoupled_s": tm,
            "speedup": proj / tm if proj and tm else None,
        }
        print(
            f"\n1 Mbit/s links: DP {dp_sps:.2f} s per step, projected {proj} s to target; "
            f"Decoupled {tm} s; speed-up {summary['at_1mbit']['speedup']}"
        )
    cal = calibrate(res)
    summary["planner_calibration"] = cal
    if cal:
        print(
            f"\nprotocol traffic (from decoupled + diloco): {cal['control_bytes_per_s']:.0f} B/s "
            f"+ {cal['bytes_per_push']:.0f} B per push; pulls per push with K < M: "
            f"{cal['pulls_per_push_k1']:.2f}"
        )
    print(
        "\n| run | up B/step | down B/step | both B/step | pulls/push | planner, idealised | "
        "error | planner, corrected | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in summary["runs"].items():
        r = res[name]
        b, p = row["bytes_per_step"], row["planner_bytes_per_step"]
        row["planner_error"] = (p - b["total"]) / b["total"]
        row["pulls_per_push"] = pulls_per_push(r)
        pc = p
        if cal and r["method"] != "dp":
            # the run's own pulls per push (the learners' payload counters): how often a
            # learner fetches merges without its push depends on whether the grace window
            # gathers the pushes, which the planner does not model
            pc = planner_bytes_per_step(
                r,
                pulls_per_push=row["pulls_per_push"],
                control_bps=8 * cal["control_bytes_per_s"],
                push_overhead_bits=8 * cal["bytes_per_push"],
            )
        row["planner_corrected_bytes_per_step"] = pc
        row["planner_corrected_error"] = (pc - b["total"]) / b["total"]
        pulls = "-" if row["pulls_per_push"] is None else f"{row['pulls_per_push']:.2f}"
        print(
            f"| {name} | {b['up']:.0f} | {b['down']:.0f} | {b['total']:.0f} | {pulls} | "
            f"{p:.0f} | {100 * row['planner_error']:+.1f}% | {pc:.0f} | "
            f"{100 * row['planner_corrected_error']:+.1f}% |"
        )
    ref_dp = next((n for n in ("dp_free", "dp") if n in summary["runs"]), None)
    if ref_dp is not None:
        # the unshaped DP run's bytes: the all-reduce alone, no retransmissions
        dpb = summary["runs"][ref_dp]["bytes_per_step"]["total"]
        summary["dp_bytes_per_step"] = {"run": ref_dp, "total": dpb}
        print(
            f"\n| run | DP ({ref_dp}: {dpb:.0f} B) / its bytes per inner step | "
            "eval vs DP unshaped final |"
        )
        print("|---|---|---|")
        for name, row in summary["runs"].items():
            if row["method"] == "dp":
                continue
            row["ratio_vs_dp"] = dpb / row["bytes_per_step"]["total"]
            ref = summary["runs"].get("dp_free", {}).get("final_eval")
            row["eval_vs_dp"] = None if ref is None else row["final_eval"] / ref - 1
            cost = "-" if ref is None else f"{100 * row['eval_vs_dp']:+.2f}%"
            print(f"| {name} | {row['ratio_vs_dp']:.0f}x | {cost} |")
    hetero = [n for n in ("hetero_kM", "hetero_k1", "hetero_k1g") if n in res]
    if hetero:
        print(
            "\n| run | quorum | steps per region | goodput | merged / dropped / lost / "
            "overwritten steps | learners per merge | final eval |"
        )
        print("|---|---|---|---|---|---|---|")
        for name in hetero:
            merges = [
                json.loads(x)
                for x in (out / name / "syncer.jsonl").read_text().splitlines()
                if '"merge"' in x
            ]
            per = sum(len(m["learners"]) for m in merges) / max(1, len(merges))
            row = summary["runs"][name]
            row["learners_per_merge"] = per
            row["steps_per_region"] = [reg["steps"] for reg in res[name]["regions"].values()]
            k = res[name]["args"]
            label = f"K={k['quorum']}" + ("" if k["no_grace"] else "+grace")
            row["ledger"] = ledger(res[name])
            led = " / ".join(
                f"{row['ledger'][f]:.0f}" for f in ("merged", "dropped", "lost", "overwritten")
            )
            print(
                f"| {name} | {label} | {row['steps_per_region']} | {row['goodput']:.3f} | "
                f"{led} | {per:.2f} | {row['final_eval']:.4f} |"
            )
    for name, row in summary["runs"].items():
        if row["cut"]:
            if row["method"] != "dp":
                row["ledger"] = ledger(res[name])
            print(f"\ncut {name}: {row['cut']} ledger {row.get('ledger')}")
    docs = Path(a.docs)
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "wan.json").write_text(json.dumps(summary, indent=1))
    plot(res, target, docs / "wan_loss.png")
    print(f"\nwrote {docs / 'wan.json'} and {docs / 'wan_loss.png'}")


if __name__ == "__main__":
    main()
