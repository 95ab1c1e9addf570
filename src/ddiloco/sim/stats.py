"""Repeat a configuration over seeds and summarise with 95% confidence intervals."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ddiloco.sim.systems import RunResult, SimConfig, run_once

__all__ = ["SEEDS", "Summary", "ci95_halfwidth", "simulate", "t_quantile_975"]

# two-sided 95% Student-t quantiles for 1..30 degrees of freedom
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t_quantile_975(df: int) -> float:
    """0.975 quantile of Student's t with ``df`` degrees of freedom (normal beyond 30)."""
    if df < 1:
        return math.inf
    return _T975[df - 1] if df <= 30 else 1.96


def ci95_halfwidth(values: Sequence[float]) -> float:
    """Half-width of the 95% t-interval of the mean; inf for fewer than two values."""
    n = len(values)
    if n < 2:
        return math.inf
    return t_quantile_975(n - 1) * float(np.std(values, ddof=1)) / math.sqrt(n)


@dataclass(frozen=True, slots=True)
class Summary:
    """Mean over seeds with 95% confidence half-widths (fractions, not percent)."""

    goodput: float
    goodput_ci95: float
    uptime: float
    uptime_ci95: float
    seeds: int
    runs: tuple[RunResult, ...]

    def as_dict(self) -> dict:
        return {
            "goodput": self.goodput,
            "goodput_ci95": self.goodput_ci95,
            "uptime": self.uptime,
            "uptime_ci95": self.uptime_ci95,
            "seeds": self.seeds,
            "failures_per_seed": float(np.mean([r.n_failures for r in self.runs])),
            "events_per_seed": float(np.mean([r.n_events for r in self.runs])),
        }


def _summarise(runs: list[RunResult]) -> Summary:
    g = [r.goodput for r in runs]
    u = [r.uptime for r in runs]
    return Summary(
        goodput=float(np.mean(g)),
        goodput_ci95=ci95_halfwidth(g),
        uptime=float(np.mean(u)),
        uptime_ci95=ci95_halfwidth(u),
        seeds=len(runs),
        runs=tuple(runs),
    )


SEEDS = 5
"""Seeds simulated per configuration by default (``simulate``, the grid, the CLI)."""


def simulate(
    cfg: SimConfig,
    seeds: int = SEEDS,
    *,
    first_seed: int = 0,
    target_ci95: float | None = None,
    max_seeds: int = 200,
    on_seed: Callable[[int], None] | None = None,
) -> Summary:
    """Run ``seeds`` seeds; with ``target_ci95``, keep adding seeds (up to ``max_seeds``)
    until the goodput half-width is at most ``target_ci95``."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    runs: list[RunResult] = []
    s = first_seed
    while True:
        runs.append(run_once(cfg, s))
        s += 1
        if on_seed is not None:
            on_seed(len(runs))
        if len(runs) < seeds:
            continue
        if target_ci95 is None or len(runs) >= max_seeds:
            break
        if ci95_halfwidth([r.goodput for r in runs]) <= target_ci95:
            break
    return _summarise(runs)
