"""Per-chip failure processes, generated with numpy.

Every chip fails independently. After a failure the chip is replaced (or repaired) and its
clock restarts, so each chip is a renewal process whose inter-failure times have mean MTBI:

* ``poisson``: exponential inter-failure times (memoryless); the paper's setting.
* ``weibull``: Weibull inter-failure times with shape ``k`` and scale chosen so that the
  mean is MTBI (``k < 1``: infant mortality, ``k > 1``: wear-out). All chips start new at
  t = 0, so for ``k != 1`` the rate has a transient; the simulator's warm-up absorbs most of it.

Two generators give the same process:

* :func:`per_chip_failures` (exact path): one renewal process per chip, vectorised over
  chips. Works for both distributions.
* :func:`superposed_failures` (fast path, Poisson only): the superposition of N independent
  Poisson processes of rate 1/MTBI is one Poisson process of rate N/MTBI whose events hit a
  chip chosen uniformly at random. Costs O(failures), not O(chips).

Both return ``(times_s, chip_ids)`` sorted by time, over ``[0, horizon_s)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "SECONDS_PER_YEAR",
    "FailureConfig",
    "per_chip_failures",
    "superposed_failures",
    "generate_failures",
]

SECONDS_PER_YEAR = 365.25 * 24 * 3600.0


@dataclass(kw_only=True, slots=True)
class FailureConfig:
    """How chips fail."""

    mtbi_years: float = 1.0
    """Mean time between interruptions of one chip, in years (paper: 1 year, "aggressive")."""
    distribution: str = "poisson"
    """``poisson`` (exponential inter-failure times) or ``weibull``."""
    weibull_shape: float = 1.0
    """Shape k of the Weibull distribution (ignored for ``poisson``); k = 1 is exponential."""

    def __post_init__(self) -> None:
        if not self.mtbi_years > 0:
            raise ValueError(f"mtbi_years must be > 0, got {self.mtbi_years}")
        if self.distribution not in ("poisson", "weibull"):
            raise ValueError(
                f"distribution must be 'poisson' or 'weibull', got {self.distribution!r}"
            )
        if not self.weibull_shape > 0:
            raise ValueError(f"weibull_shape must be > 0, got {self.weibull_shape}")

    @property
    def mtbi_s(self) -> float:
        return self.mtbi_years * SECONDS_PER_YEAR

    def cluster_mtbf_s(self, n_chips: int) -> float:
        """Mean time between failures anywhere among ``n_chips`` chips (stationary)."""
        return self.mtbi_s / n_chips


def _inter_failure(cfg: FailureConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    if cfg.distribution == "poisson":
        return rng.exponential(cfg.mtbi_s, size=n)
    k = cfg.weibull_shape
    scale = cfg.mtbi_s / math.gamma(1.0 + 1.0 / k)
    return scale * rng.weibull(k, size=n)


def per_chip_failures(
    cfg: FailureConfig, n_chips: int, horizon_s: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Exact path: an independent renewal process per chip, all chips new at t = 0."""
    if n_chips < 1:
        raise ValueError(f"n_chips must be >= 1, got {n_chips}")
    t = _inter_failure(cfg, rng, n_chips)
    alive = np.nonzero(t < horizon_s)[0]
    times, chips = [t[alive]], [alive]
    cur_t, cur_c = t[alive], alive
    while cur_c.size:  # renewals: a replaced chip fails again after a fresh draw
        cur_t = cur_t + _inter_failure(cfg, rng, cur_c.size)
        keep = cur_t < horizon_s
        cur_t, cur_c = cur_t[keep], cur_c[keep]
        times.append(cur_t)
        chips.append(cur_c)
    all_t = np.concatenate(times)
    all_c = np.concatenate(chips).astype(np.int64)
    order = np.argsort(all_t, kind="stable")
    return all_t[order], all_c[order]


def superposed_failures(
    cfg: FailureConfig, n_chips: int, horizon_s: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Fast path for Poisson failures: one cluster-level Poisson process, uniform chip."""
    if cfg.distribution != "poisson":
        raise ValueError(
            "the superposition fast path is exact only for poisson failures; "
            "use per_chip_failures for weibull"
        )
    if n_chips < 1:
        raise ValueError(f"n_chips must be >= 1, got {n_chips}")
    n = rng.poisson(n_chips * horizon_s / cfg.mtbi_s)
    times = np.sort(rng.uniform(0.0, horizon_s, size=n))
    chips = rng.integers(0, n_chips, size=n, dtype=np.int64)
    return times, chips


def generate_failures(
    cfg: FailureConfig,
    n_chips: int,
    horizon_s: float,
    rng: np.random.Generator,
    *,
    exact: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Failure stream for ``n_chips`` chips: the fast path when valid, unless ``exact``."""
    if exact or cfg.distribution != "poisson":
        return per_chip_failures(cfg, n_chips, horizon_s, rng)
    return superposed_failures(cfg, n_chips, horizon_s, rng)
