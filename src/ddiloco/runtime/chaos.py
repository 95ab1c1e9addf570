"""Chaos engineering for real runs: a seeded schedule of faults the launcher injects.

Faults: SIGKILL of a learner (exponential inter-arrival over the whole job, fixed downtime
before its restart), SIGSTOP/SIGCONT of a learner (a straggler frozen for a while), a
per-learner slow-down factor, SIGKILL and restart of the syncer, emulated per-link
bandwidth and latency, and a cut of one learner's link to the syncer for a while (the
learner trains on; every call it starts fails as unreachable until the link comes back).
The schedule is a pure function of the run's ``[chaos]`` section (``ddiloco.config.chaos``:
times and random draws); which learner a draw hits is decided at fire time among the
learners then running, from the same draw, so a run is reproducible given the same
progress. Every injected event is appended to ``chaos.jsonl`` in the run directory with its
time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddiloco.config.chaos import CHAOS_PRESETS, ChaosConfig, chaos_preset
from ddiloco.metrics.sinks import JsonlSink

__all__ = [
    "ChaosConfig",
    "ChaosEvent",
    "chaos_schedule",
    "chaos_preset",
    "chaos_for_run",
    "CHAOS_PRESETS",
    "ChaosLog",
]


def chaos_for_run(cfg) -> ChaosConfig:
    """The chaos of a run (a ``TrainConfig``): its ``[chaos]`` section (an unset seed is the
    run's), plus the world's failures (per-learner MTBI -> a job-wide kill rate M / MTBI),
    learner speeds (step-time factors) and bandwidth where the chaos does not set them. The
    launcher and every learner process compute it alike from the same run file."""
    chaos = cfg.chaos
    d = chaos.to_dict()
    if d["seed"] is None:
        d["seed"] = cfg.seed
    w = cfg.world
    if w.mtbi_s > 0 and not chaos.kill_mean_interval_s:
        d.update(kill_mean_interval_s=w.mtbi_s / cfg.learners, kill_downtime_s=w.downtime_s)
    if w.speeds and not chaos.slowdown:
        d["slowdown"] = {
            m: max(1.0, 1.0 / cfg.speed(m)) for m in range(cfg.learners) if cfg.speed(m) < 1.0
        }
    if w.bandwidth_Bps and not chaos.link_bandwidth_Bps:
        d["link_bandwidth_Bps"] = w.bandwidth_Bps
    return ChaosConfig(**d)


@dataclass(frozen=True, slots=True)
class ChaosEvent:
    at_s: float
    kind: str
    """kill-learner, stop-learner, kill-syncer."""
    draw: float
    """Uniform draw in [0, 1) that picks the target among running learners."""
    duration_s: float


def chaos_schedule(cfg: ChaosConfig, horizon_s: float) -> list[ChaosEvent]:
    """All fault events in [0, horizon_s), sorted by time."""
    rng = np.random.default_rng([cfg.seed or 0, 4242])
    events: list[ChaosEvent] = []
    for kind, mean, dur in (
        ("kill-learner", cfg.kill_mean_interval_s, cfg.kill_downtime_s),
        ("stop-learner", cfg.stop_mean_interval_s, cfg.stop_duration_s),
    ):
        if mean <= 0:
            continue
        t = cfg.start_after_s
        while True:
            t += float(rng.exponential(mean))
            if t >= horizon_s:
                break
            events.append(ChaosEvent(t, kind, float(rng.random()), dur))
    for t in cfg.syncer_kill_at_s:
        events.append(ChaosEvent(t, "kill-syncer", 0.0, cfg.syncer_downtime_s))
    return sorted(events, key=lambda e: (e.at_s, e.kind))


class ChaosLog:
    """Append-only JSONL log of injected events."""

    def __init__(self, path: str | Path, t0: float) -> None:
        self._sink = JsonlSink(path, mode="a", flush_rows=True)
        self.t0 = t0

    def write(self, kind: str, **kw) -> dict:
        rec = {"t_s": round(time.monotonic() - self.t0, 3), "wall": time.time(), "kind": kind, **kw}
        self._sink.write(rec)
        return rec

    def close(self) -> None:
        self._sink.close()
