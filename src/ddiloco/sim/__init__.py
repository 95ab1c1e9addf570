"""Datacenter-scale chaos simulator (torch-free): goodput and uptime of data-parallel,
elastic data-parallel and Decoupled DiLoCo under per-chip failures.

The systems run on the package's deterministic event kernel (``ddiloco.kernel``; its
``Event`` and ``EventKernel`` are handed on here). ``failures`` holds the per-chip failure
processes, ``systems`` the three simulated systems, ``stats`` seeds and confidence intervals,
``calibration`` the physical parameters that reproduce the published grid, ``grid`` the
table and plot, ``cli`` the ``simulate`` and ``bandwidth`` subcommands.
"""

from ddiloco.kernel import Event, EventKernel
from ddiloco.sim.calibration import PUBLISHED, field_costs, paper_config, paper_costs
from ddiloco.sim.failures import FailureConfig
from ddiloco.sim.stats import Summary, simulate
from ddiloco.sim.systems import SYSTEMS, CostModel, RunResult, SimConfig, run_once

__all__ = [
    "PUBLISHED",
    "SYSTEMS",
    "CostModel",
    "Event",
    "EventKernel",
    "FailureConfig",
    "RunResult",
    "SimConfig",
    "Summary",
    "field_costs",
    "paper_config",
    "paper_costs",
    "run_once",
    "simulate",
]
