"""The install rule: ``rebase`` against ``overwrite`` (``sync.install``), in-process.

    python bench/install_rule.py [--out runs/install_rule] [--steps 2000] [--jobs 2]
                                 [--only defaults,links,moments,emulated]

- ``defaults``: the main job's settings at seeds 0, 1 and 2, each rule, with DP at the same
  seed and tokens for reference: final eval loss and goodput.
- ``links``: slow learner-syncer links at seed 0, 1000 steps per learner. The one-way
  latency is set so that a push plus its merged fragment take r x tau inner steps (r = 0.5,
  1, 2, 4: from well inside the overlap to four times it); each rule at each r.
- ``moments``: what the inner AdamW's moments should do at a rebased install: kept (the
  product's behaviour) against reset to zero for the installed fragment's tensors (step
  counts kept), at seed 0 with the default links (2000 steps) and at r = 2 (1000 steps). The reset variant runs the
  same engine with the reset added around ``LearnerSync.install_due`` (this script only).

- ``emulated``: real processes (``ddiloco train``, the default engine) on emulated slow
  links (the chaos link limits: 312.5 kB/s and 1.2 ms each way per learner), P = 3,
  H = 27, tau = 2, int4 pushes, 1000 steps, with an int4 delta-coded or an fp32 downlink,
  each rule, and the same without the link limits. These depend on the machine's timing;
  each row records the load average.

The other runs are ``ddiloco train --engine inproc`` (the virtual clock: the machine's load
does not change a figure). Every command is printed before it starts; runs whose
``summary.json`` exists are kept.
Writes ``install_rule.json`` and ``install_rule.md`` under ``--out`` and, with
``--docs``, ``docs/results/install_rule.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = ("overwrite", "rebase")
SEEDS = (0, 1, 2)
RATIOS = (0.5, 1.0, 2.0, 4.0)
TAU, STEP_S, MERGE_S = 2, 1.0, 0.01
"""The defaults the ``links`` sweep scales from (``sync.tau``, ``world.step_time_s``,
``world.merge_time_s``)."""


LINK_STEPS = ["--steps", "1000"]
"""The ``links`` sweep's budget per learner (half the main job's: eight runs)."""


def latency_for(ratio: float) -> float:
    """One-way latency at which push + merge + return take ``ratio`` x tau steps."""
    return round((ratio * TAU * STEP_S - MERGE_S) / 2, 4)


def runs(only: set[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    if "defaults" in only:
        for s in SEEDS:
            out[f"dp_s{s}"] = ["--method", "dp", "--seed", str(s)]
            for r in RULES:
                out[f"{r}_s{s}"] = ["--install", r, "--seed", str(s)]
    if "links" in only:
        for x in RATIOS:
            for r in RULES:
                out[f"{r}_r{x:g}"] = [
                    *LINK_STEPS, "--install", r, "--world.latency-s", str(latency_for(x))
                ]  # fmt: skip
    if "moments" in only:
        out["rebase_s0"] = ["--install", "rebase", "--seed", "0"]
        out["rebase_r2"] = [*LINK_STEPS, "--install", "rebase", "--world.latency-s",
                            str(latency_for(2.0))]  # fmt: skip
        out["reset_moments_s0"] = [*out["rebase_s0"], RESET]
        out["reset_moments_r2"] = [*out["rebase_r2"], RESET]
    if "emulated" in only:
        base = ["--steps", "1000", "-P", "3", "-H", "27", "--tau", "2", "--codec", "int4"]
        downs = {"int4d": ["--down-codec", "int4", "--down-delta"], "fp32": []}
        for r in RULES:
            out[f"emu_free_{r}"] = [PROC, *base, *downs["int4d"], "--install", r]
            for d, flags in downs.items():
                out[f"emu_{d}_{r}"] = [PROC, *base, *flags, "--install", r, SLOW]
    return out


PROC = "--processes"
"""Marks a real-process run (``ddiloco train`` on its default engine)."""
SLOW = "--slow-links"
"""Marks a run on the emulated slow links (a chaos file beside the run)."""
SLOW_LINKS = {"link_bandwidth_Bps": 312_500, "link_latency_s": 0.0012}


RESET = "--reset-moments"
"""Marks a run of the ``moments`` variant (not a ``ddiloco train`` flag)."""


def reset_moments_run(argv: list[str]) -> None:
    """``ddiloco train`` in this process, with each rebased install also zeroing the inner
    AdamW moments of the installed fragment's tensors."""
    import torch

    from ddiloco import cli
    from ddiloco.engine import decoupled

    workers = []
    build = decoupled.build_workers

    def recording_build(*a, **kw):
        workers.extend(build(*a, **kw))
        return workers

    class ResetSync(decoupled.LearnerSync):
        def install_due(self) -> list[int]:
            done = super().install_due()
            (w,) = [w for w in workers if w.params is self.params]
            for p in done:
                for n in self.fragmentation.fragments[p].names:
                    st = w.opt.state.get(self.params[n], {})
                    for k in ("exp_avg", "exp_avg_sq"):
                        if isinstance(st.get(k), torch.Tensor):
                            st[k].zero_()
            return done

    decoupled.build_workers = recording_build
    decoupled.LearnerSync = ResetSync  # type: ignore[misc]
    sys.exit(cli.main(["train", *argv]))


def run_one(name: str, argv: list[str], out: Path, steps: int) -> dict:
    d = out / name
    if not (d / "summary.json").is_file():
        if PROC in argv:
            cmd = ["ddiloco", "train", "--out", str(d), "--no-progress"]
            if SLOW in argv:
                chaos = out / f"{name}.chaos.json"
                chaos.write_text(json.dumps(SLOW_LINKS))
                cmd += ["--chaos", str(chaos)]
            cmd += [x for x in argv if x not in (PROC, SLOW)]
            print("$", " ".join(cmd), flush=True)
            load0 = os.getloadavg()[0]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            s = json.loads((d / "summary.json").read_text())
            s["load_avg"] = [round(load0, 1), round(os.getloadavg()[0], 1)]
            (d / "summary.json").write_text(json.dumps(s, indent=1))
            return s
        own = "--steps" in argv
        cmd = ["ddiloco", "train", "--engine", "inproc", "--out", str(d), "--no-progress"]
        cmd += ([] if own else ["--steps", str(steps)]) + [x for x in argv if x != RESET]
        if RESET in argv:
            cmd = [sys.executable, __file__, RESET, *cmd[2:]]
        print("$", " ".join(cmd).replace(str(ROOT) + "/", ""), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((d / "summary.json").read_text())


def row(name: str, s: dict) -> dict:
    led = [pl["ledger_steps"] for pl in s.get("per_learner", []) if "ledger_steps" in pl]
    computed = sum(x["computed"] for x in led)
    return {
        "name": name,
        "final_eval_loss": round(s["final_eval_loss"], 4),
        "goodput": round(s.get("goodput", 1.0), 4),
        "install_delay_steps": s.get("install_delay_steps") or _mean_delay(s),
        "overwritten_frac": round(sum(x["overwritten"] for x in led) / computed, 4)
        if computed
        else None,
        "lost_frac": round(sum(x["lost"] for x in led) / computed, 4) if computed else None,
        "learners_per_merge": s.get("learners_per_merge"),
        "load_avg": s.get("load_avg"),
    }


def _mean_delay(s: dict) -> float | None:
    """The learners' mean install delay (real processes report it per learner)."""
    d = [pl.get("install_delay_steps") for pl in s.get("per_learner", [])]
    d = [x for x in d if x]
    return round(sum(d) / len(d), 2) if d else None


def markdown(rows: dict[str, dict], steps: int) -> str:
    lines = [
        "# Install rule: rebase against overwrite",
        "",
        f"In-process engine; {steps} steps per learner, the slow-link sweep "
        f"{LINK_STEPS[1]}; `python bench/install_rule.py`.",
        "",
    ]
    if any(k.startswith("dp_s") for k in rows):
        lines += [
            "| seed | DP | overwrite: loss, goodput | rebase: loss, goodput |"
            " overwrite vs DP | rebase vs DP |",
            "|---|---|---|---|---|---|",
        ]
        for s in SEEDS:
            dp, o, r = (rows.get(f"{k}_s{s}") for k in ("dp", "overwrite", "rebase"))
            if not (dp and o and r):
                continue
            base = dp["final_eval_loss"]
            lines.append(
                f"| {s} | {base:.4f} | {o['final_eval_loss']:.4f}, {o['goodput']:.3f} | "
                f"{r['final_eval_loss']:.4f}, {r['goodput']:.3f} | "
                f"{100 * (o['final_eval_loss'] / base - 1):+.2f}% | "
                f"{100 * (r['final_eval_loss'] / base - 1):+.2f}% |"
            )
        lines.append("")
    if "reset_moments_s0" in rows:
        lines += [
            "| inner AdamW moments at a rebased install | default links: loss, goodput |"
            " r = 2: loss, goodput |",
            "|---|---|---|",
        ]
        for label, k in (("kept", "rebase"), ("reset to zero", "reset_moments")):
            a, b = rows.get(f"{k}_s0"), rows.get(f"{k}_r2")
            if a and b:
                lines.append(
                    f"| {label} | {a['final_eval_loss']:.4f}, {a['goodput']:.3f} | "
                    f"{b['final_eval_loss']:.4f}, {b['goodput']:.3f} |"
                )
        lines.append("")
    if any(k.startswith("emu_") for k in rows):
        lines += [
            "| real processes, P3 H27 tau 2, int4 up, 1000 steps | overwrite: loss, goodput,"
            " lost, install delay | rebase: loss, goodput, lost, install delay |",
            "|---|---|---|",
        ]
        for d, label in (
            ("free", "no link limits, int4 delta-coded down"),
            ("int4d", "312.5 kB/s + 1.2 ms, int4 delta-coded down"),
            ("fp32", "312.5 kB/s + 1.2 ms, fp32 down"),
        ):
            cells = []
            for r in RULES:
                x = rows.get(f"emu_{d}_{r}")
                cells.append(
                    "-"
                    if x is None
                    else f"{x['final_eval_loss']:.4f}, {x['goodput']:.3f}, {x['lost_frac']:.3f},"
                    f" {x['install_delay_steps']} (load {x['load_avg']})"
                )
            lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
        lines.append("")
    if any("_r" in k and not k.startswith("reset") for k in rows):
        lines += [
            "| push + return / tau steps (set) | one-way latency | measured install delay"
            " (steps): overwrite, rebase | overwrite: loss, goodput, lost | rebase: loss,"
            " goodput, lost |",
            "|---|---|---|---|---|",
        ]
        for x in RATIOS:
            o, r = rows.get(f"overwrite_r{x:g}"), rows.get(f"rebase_r{x:g}")
            if not (o and r):
                continue
            lines.append(
                f"| {x:g} | {latency_for(x)} s | {o['install_delay_steps']}, "
                f"{r['install_delay_steps']} | {o['final_eval_loss']:.4f}, {o['goodput']:.3f},"
                f" {o['lost_frac']:.3f} | {r['final_eval_loss']:.4f}, {r['goodput']:.3f}, "
                f"{r['lost_frac']:.3f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for rule, style in (("overwrite", "o--"), ("rebase", "s-")):
        xs = [x for x in RATIOS if f"{rule}_r{x:g}" in rows]
        loss = [rows[f"{rule}_r{x:g}"]["final_eval_loss"] for x in xs]
        good = [rows[f"{rule}_r{x:g}"]["goodput"] for x in xs]
        axes[0].plot(xs, loss, style, label=rule)
        axes[1].plot(xs, good, style, label=rule)
    for ax, ylabel in zip(axes, ("final eval loss", "goodput")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(RATIOS), [f"{x:g}" for x in RATIOS])
        ax.set_xlabel("push + return time / (tau x step time)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Slow links, in-process ({LINK_STEPS[1]} steps per learner, seed 0, defaults otherwise)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if sys.argv[1:2] == [RESET]:
        return reset_moments_run(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/install_rule")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=2, help="in-process runs at once (one core each)")
    ap.add_argument("--only", default="defaults,links,moments", help="comma-separated parts")
    ap.add_argument("--docs", action="store_true", help="also write docs/results/install_rule.*")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = runs(set(a.only.split(",")))
    inproc = [k for k in todo if PROC not in todo[k]]
    with ThreadPoolExecutor(max_workers=a.jobs) as ex:
        done = dict(zip(inproc, ex.map(lambda k: run_one(k, todo[k], out, a.steps), inproc)))
    for k in todo:  # real processes: one run at a time (they share the cores)
        if k not in done:
            done[k] = run_one(k, todo[k], out, a.steps)
    rows = {k: row(k, s) for k, s in done.items()}
    (out / "install_rule.json").write_text(json.dumps({"steps": a.steps, "rows": rows}, indent=1))
    md = markdown(rows, a.steps)
    (out / "install_rule.md").write_text(md)
    print(md)
    if a.docs:
        res = ROOT / "docs" / "results"
        (res / "install_rule.json").write_text(
            json.dumps({"steps": a.steps, "rows": rows}, indent=1) + "\n"
        )
        (res / "install_rule.md").write_text(md)
        plot(rows, res / "install_rule.png")


if __name__ == "__main__":
    main()
