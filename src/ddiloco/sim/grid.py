"""The goodput grid: systems x chip counts, as a table, a PNG and a reproduction check."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ddiloco.sim.calibration import PUBLISHED, cell_label, paper_config
from ddiloco.sim.stats import SEEDS, Summary, simulate
from ddiloco.sim.systems import CostModel, SimConfig

__all__ = [
    "GRID_CHIPS",
    "GRID_SYSTEMS",
    "GridCell",
    "run_grid",
    "format_grid",
    "format_reproduction",
    "plot_grid",
]

GRID_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
GRID_SYSTEMS: tuple[tuple[str, int], ...] = (
    ("dp", 1),
    ("elastic-dp", 1),
    ("decoupled", 2),
    ("decoupled", 4),
    ("decoupled", 8),
    ("decoupled", 16),
)


@dataclass(frozen=True, slots=True)
class GridCell:
    system: str
    learners: int
    n_chips: int
    summary: Summary

    @property
    def published(self) -> float | None:
        return PUBLISHED.get((self.system, self.learners, self.n_chips))

    def as_dict(self) -> dict:
        return {
            "system": self.system,
            "learners": self.learners,
            "chips": self.n_chips,
            "published": self.published,
            **self.summary.as_dict(),
        }


_SIM = SimConfig()  # the declared defaults of one simulated system


def run_grid(
    *,
    systems: Sequence[tuple[str, int]] = GRID_SYSTEMS,
    chips: Sequence[int] = GRID_CHIPS,
    seeds: int = SEEDS,
    mtbi_years: float = _SIM.failures.mtbi_years,
    costs: CostModel | None = None,
    horizon_s: float = _SIM.horizon_s,
    progress: bool = True,
) -> list[GridCell]:
    """Simulate every (system, M) at every chip count with the calibrated costs."""
    cells: list[GridCell] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(systems) * len(chips) * seeds, desc="simulating", unit="run", file=sys.stderr
        )
    for system, m in systems:
        for n in chips:
            cfg = paper_config(
                system, n, m, mtbi_years=mtbi_years, costs=costs, horizon_s=horizon_s
            )
            s = simulate(cfg, seeds, on_seed=(lambda _: bar.update(1)) if bar else None)
            cells.append(GridCell(system, m, n, s))
    if bar is not None:
        bar.close()
    return cells


def _chips_label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n // 1000}k"


def format_grid(cells: Sequence[GridCell], *, with_ci: bool = True) -> str:
    """Markdown table, one row per system, one column per chip count (goodput %)."""
    chips = sorted({c.n_chips for c in cells})
    rows = list(dict.fromkeys((c.system, c.learners) for c in cells))
    by = {(c.system, c.learners, c.n_chips): c for c in cells}
    out = [
        "| system | " + " | ".join(_chips_label(n) for n in chips) + " |",
        "|---|" + "---|" * len(chips),
    ]
    for system, m in rows:
        vals = []
        for n in chips:
            c = by.get((system, m, n))
            if c is None:
                vals.append("")
                continue
            g = 100 * c.summary.goodput
            vals.append(f"{g:.1f} ± {100 * c.summary.goodput_ci95:.1f}" if with_ci else f"{g:.1f}")
        out.append(f"| {cell_label(system, m)} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def format_reproduction(cells: Sequence[GridCell]) -> tuple[str, float]:
    """Published vs simulated for every published cell; returns (table, worst |error| pp)."""
    out = [
        "| system | chips | published | simulated (95% CI) | error (pp) |",
        "|---|---|---|---|---|",
    ]
    worst = 0.0
    for c in cells:
        if c.published is None:
            continue
        err = 100 * (c.summary.goodput - c.published)
        worst = max(worst, abs(err))
        out.append(
            f"| {cell_label(c.system, c.learners)} | {_chips_label(c.n_chips)} | "
            f"{100 * c.published:.0f} | {100 * c.summary.goodput:.1f} ± "
            f"{100 * c.summary.goodput_ci95:.1f} | {err:+.1f} |"
        )
    return "\n".join(out), worst


def plot_grid(cells: Sequence[GridCell], path: str) -> None:
    """Goodput against chips, one line per system; published cells as open markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = list(dict.fromkeys((c.system, c.learners) for c in cells))
    for system, m in rows:
        cs = sorted(
            (c for c in cells if (c.system, c.learners) == (system, m)), key=lambda c: c.n_chips
        )
        x = [c.n_chips for c in cs]
        y = [100 * c.summary.goodput for c in cs]
        e = [100 * c.summary.goodput_ci95 for c in cs]
        line = ax.errorbar(x, y, yerr=e, marker="o", ms=4, capsize=2, label=cell_label(system, m))
        pub = [(c.n_chips, 100 * c.published) for c in cs if c.published is not None]
        if pub:
            ax.scatter(
                *zip(*pub), marker="s", s=40, facecolors="none", edgecolors=line[0].get_color()
            )
    ax.set_xscale("log")
    ax.set_xlabel("chips (MTBI 1 year per chip)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 102)
    ax.set_title("Simulated goodput (lines) vs published (squares)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
