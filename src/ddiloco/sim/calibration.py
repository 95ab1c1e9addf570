"""One set of physical parameters that reproduces the paper's published goodput grid.

The parameters describe mechanisms, not cells: how big a slice is, how long a slice takes
to come back, how long an elastic job pauses to re-form its mesh, how long a non-elastic job
takes to restart, how often it checkpoints. Every cell, published or not, is then simulated
from the same :func:`paper_costs`. See ``docs/simulator.md`` for the reasoning, the
reproduction table, the predicted full table and the sensitivity to each cost.

Why these values (MTBI 1 year per chip, so a cluster of N chips fails every 3.16e7/N s):

* non-elastic DP loses ``restart_s`` per failure plus the work since its last checkpoint;
  goodput ~ 1 / (1 + lambda * restart_s) when checkpoints are per step (in-memory
  snapshots). 72/57/38/27% at 150k..1.2M gives restart_s ~ 77 s.
* elastic DP pays one reconfiguration (``reconfig_s``) to drop a failed slice and one to
  re-admit it after repair, about 2 * reconfig_s per failure at low failure rates. At high
  rates the costs overlap: changes during a reconfiguration are folded into it and repaired
  slices wait ``rejoin_wait_s`` to ride along with the next downscale. This is what bends
  88/80/69/58% below a straight line, and fixes reconfig_s ~ 14 s, rejoin_wait_s ~ 20 s.
* a Decoupled learner is the same elastic job on N/M chips whose pauses stop only itself,
  which gives the published rule "M learners on N chips ~ elastic DP on N/M chips".
"""

from __future__ import annotations

import dataclasses

from ddiloco.sim.failures import FailureConfig
from ddiloco.sim.systems import CostModel, SimConfig

__all__ = [
    "PUBLISHED",
    "PAPER_CHIPS",
    "PAPER_LEARNERS",
    "paper_costs",
    "field_costs",
    "paper_config",
    "cell_label",
]

PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000)
PAPER_LEARNERS = (2, 4, 8, 16)

PUBLISHED: dict[tuple[str, int, int], float] = {
    # (system, M, chips) -> published goodput (fraction); MTBI 1 year per chip, 5B dense
    ("dp", 1, 150_000): 0.72,
    ("dp", 1, 300_000): 0.57,
    ("dp", 1, 600_000): 0.38,
    ("dp", 1, 1_200_000): 0.27,
    ("elastic-dp", 1, 150_000): 0.88,
    ("elastic-dp", 1, 300_000): 0.80,
    ("elastic-dp", 1, 600_000): 0.69,
    ("elastic-dp", 1, 1_200_000): 0.58,
    ("decoupled", 8, 150_000): 0.98,
    ("decoupled", 8, 300_000): 0.96,
    ("decoupled", 8, 600_000): 0.94,
    ("decoupled", 8, 1_200_000): 0.88,
    ("decoupled", 2, 1_200_000): 0.70,
    ("decoupled", 4, 1_200_000): 0.82,
    ("decoupled", 16, 1_200_000): 0.93,
}


def paper_costs() -> CostModel:
    """The calibrated mechanism parameters (optimistic, as the published grid implies)."""
    return CostModel(
        chips_per_slice=256,
        slice_recovery_s=300.0,
        reconfig_s=14.0,
        rejoin_wait_s=20.0,
        reconfig_absorbs_changes=True,
        lost_work_s=0.5,
        restart_s=77.0,
        restart_absorbs_failures=True,
        checkpoint_interval_s=1.0,
        checkpoint_cost_s=0.0,
        step_time_s=1.0,
        step_time_cv=0.0,
        sync_s=0.2,
        syncer_overhead=0.0,
    )


def field_costs() -> CostModel:
    """Costs closer to what large jobs report in the field: minutes, not seconds."""
    return dataclasses.replace(
        paper_costs(),
        slice_recovery_s=3600.0,
        reconfig_s=120.0,
        rejoin_wait_s=600.0,
        lost_work_s=5.0,
        restart_s=600.0,
        checkpoint_interval_s=1800.0,
        reconfig_absorbs_changes=False,
        restart_absorbs_failures=False,
    )


def paper_config(
    system: str,
    n_chips: int,
    learners: int = 1,
    quorum: int = 1,
    *,
    mtbi_years: float = 1.0,
    costs: CostModel | None = None,
    **overrides,
) -> SimConfig:
    """A :class:`SimConfig` in the paper's setting, with the calibrated costs."""
    return SimConfig(
        system=system,
        n_chips=n_chips,
        learners=learners,
        quorum=quorum,
        failures=FailureConfig(mtbi_years=mtbi_years),
        costs=costs if costs is not None else paper_costs(),
        **overrides,
    )


def cell_label(system: str, learners: int) -> str:
    return {"dp": "DP, not elastic", "elastic-dp": "DP, elastic"}.get(
        system, f"Decoupled, M = {learners}"
    )
