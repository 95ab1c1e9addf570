"""Simulator benchmark and the published/predicted tables.

    python bench/sim_bench.py            # writes bench/results/sim.json, bench/results/
                                         # goodput_grid.png and docs/results/sim_bench.md

1. Benchmark: 2.4M chips, every system, seeds added until the goodput 95% CI half-width
   is <= 0.5 pp; wall time measured end to end.
2. Reproduction (every published cell) and the predicted full grid, calibrated costs.
3. Sensitivity: goodput at 1.2M chips against each cost, one at a time.
4. The full grid with field-typical costs.
5. Heterogeneous learners (4 at speed 1, 4 at 1/1.18, 10% step noise): K = 8, K = 1, K = 1
   with the grace window.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

from ddiloco.sim.calibration import field_costs, paper_config, paper_costs
from ddiloco.sim.failures import FailureConfig
from ddiloco.sim.grid import format_grid, format_reproduction, plot_grid, run_grid
from ddiloco.sim.stats import simulate
from ddiloco.sim.systems import SimConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "results" / "sim_bench.md"

SENSITIVITY = {  # field -> values (the calibrated value is marked in the table)
    "reconfig_s": [5.0, 14.0, 30.0, 60.0, 120.0, 300.0],
    "rejoin_wait_s": [0.0, 20.0, 120.0, 600.0],
    "slice_recovery_s": [60.0, 300.0, 1800.0, 3600.0],
    "chips_per_slice": [64, 256, 1024, 4096],
    "lost_work_s": [0.5, 5.0, 30.0],
    "restart_s": [30.0, 77.0, 300.0, 600.0],
    "checkpoint_interval_s": [1.0, 60.0, 600.0, 1800.0],
    "syncer_overhead": [0.0, 0.02, 0.05],
    "reconfig_absorbs_changes": [True, False],
}


def benchmark() -> dict:
    rows = []
    t_all = time.perf_counter()
    for system, m in (("dp", 1), ("elastic-dp", 1), ("decoupled", 8)):
        cfg = paper_config(system, 2_400_000, m, horizon_s=24 * 3600.0)
        t0 = time.perf_counter()
        s = simulate(cfg, seeds=5, target_ci95=0.005, max_seeds=400)
        rows.append(
            {
                "system": system,
                "learners": m,
                "chips": 2_400_000,
                "hours_per_seed": 24,
                "wall_s": time.perf_counter() - t0,
                **s.as_dict(),
            }
        )
    return {"rows": rows, "wall_s_total": time.perf_counter() - t_all}


def sensitivity() -> list[dict]:
    out = []
    base = paper_costs()
    for field, values in SENSITIVITY.items():
        for v in values:
            costs = dataclasses.replace(base, **{field: v})
            row = {"field": field, "value": v, "calibrated": getattr(base, field) == v}
            for system, m in (("dp", 1), ("elastic-dp", 1), ("decoupled", 8)):
                s = simulate(paper_config(system, 1_200_000, m, costs=costs), seeds=6)
                row[f"{system}-{m}"] = s.goodput
            out.append(row)
    return out


def heterogeneous() -> list[dict]:
    costs = dataclasses.replace(paper_costs(), step_time_cv=0.10)
    out = []
    for mtbi, (k, grace) in [
        (y, kg) for y in (1e9, 1.0) for kg in ((8, True), (1, False), (1, True))
    ]:
        cfg = SimConfig(
            system="decoupled",
            n_chips=1_200_000,
            learners=8,
            quorum=k,
            grace=grace,
            speed_factors=(1.0,) * 4 + (1.18,) * 4,
            costs=costs,
            failures=FailureConfig(mtbi_years=mtbi),
            horizon_s=3 * 3600.0,
            warmup_s=1800.0,
        )
        s = simulate(cfg, seeds=3)
        size = sum(r.mean_merge_size for r in s.runs) / len(s.runs)
        out.append(
            {
                "mtbi_years": mtbi,
                "quorum": k,
                "grace": grace,
                "goodput": s.goodput,
                "goodput_ci95": s.goodput_ci95,
                "uptime": s.uptime,
                "mean_merge_size": size,
            }
        )
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def main() -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    DOC.parent.mkdir(parents=True, exist_ok=True)
    bench = benchmark()
    print(f"benchmark: {bench['wall_s_total']:.1f} s", file=sys.stderr)
    cells = run_grid(seeds=20, progress=True)
    plot_grid(cells, str(RESULTS / "goodput_grid.png"))
    repro, worst = format_reproduction(cells)
    field_cells = run_grid(seeds=10, costs=field_costs(), progress=True)
    sens = sensitivity()
    het = heterogeneous()
    result = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "benchmark_2_4M": bench,
        "grid": [c.as_dict() for c in cells],
        "worst_error_pp": worst,
        "grid_field_costs": [c.as_dict() for c in field_cells],
        "paper_costs": dataclasses.asdict(paper_costs()),
        "field_costs": dataclasses.asdict(field_costs()),
        "sensitivity_1_2M": sens,
        "heterogeneous": het,
    }
    (RESULTS / "sim.json").write_text(json.dumps(result, indent=1))

    md = [
        "# Simulator benchmark",
        "",
        "Produced by `python bench/sim_bench.py` (raw numbers: `bench/results/sim.json`).",
        "",
        "## 2.4M chips, 95% CI half-width <= 0.5 pp",
        "",
        "| system | goodput | CI95 (pp) | uptime | seeds x 24 h | failures/seed | wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in bench["rows"]:
        md.append(
            f"| {r['system']} (M = {r['learners']}) | {_pct(r['goodput'])} | "
            f"{100 * r['goodput_ci95']:.2f} | {_pct(r['uptime'])} | {r['seeds']} | "
            f"{r['failures_per_seed']:.0f} | {r['wall_s']:.2f} |"
        )
    md += [
        "",
        f"Total wall time: **{bench['wall_s_total']:.1f} s** "
        f"({os.cpu_count()} CPUs, Python {platform.python_version()}).",
        "",
        "## Reproduction of the published cells (20 seeds x 6 h)",
        "",
        repro,
        "",
        f"Worst error: {worst:.1f} pp.",
        "",
        "## Predicted full grid, calibrated costs (goodput %, ± 95% CI)",
        "",
        format_grid(cells),
        "",
        "## Full grid with field-typical costs (`field_costs()`, 10 seeds x 6 h)",
        "",
        format_grid(field_cells),
        "",
        "## Sensitivity at 1.2M chips (goodput %, one cost changed at a time, 6 seeds)",
        "",
        "| cost | value | DP | elastic DP | Decoupled M = 8 |",
        "|---|---|---|---|---|",
    ]
    for r in sens:
        mark = " (calibrated)" if r["calibrated"] else ""
        md.append(
            f"| {r['field']} | {r['value']}{mark} | {_pct(r['dp-1'])} | "
            f"{_pct(r['elastic-dp-1'])} | {_pct(r['decoupled-8'])} |"
        )
    md += [
        "",
        "## Heterogeneous learners at 1.2M chips (4 x speed 1, 4 x 1/1.18, 10% noise)",
        "",
        "| failures | K | grace | goodput | uptime | learners per merge |",
        "|---|---|---|---|---|---|",
    ]
    for r in het:
        fail = "none" if r["mtbi_years"] > 1e6 else f"MTBI {r['mtbi_years']:g} y"
        md.append(
            f"| {fail} | {r['quorum']} | {r['grace']} | {_pct(r['goodput'])} ± "
            f"{100 * r['goodput_ci95']:.1f} | {_pct(r['uptime'])} | "
            f"{r['mean_merge_size']:.2f} |"
        )
    DOC.write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
