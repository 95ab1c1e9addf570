"""The ``[chaos]`` section of a run's configuration: the seeded faults the launcher injects
into a real run (``ddiloco.runtime.chaos`` draws the schedule and logs what it injects).

It is saved in the run's ``config.toml`` with the other sections, so ``ddiloco train
--config runs/X/config.toml`` replays the same seeded schedule. ``--chaos PRESET`` (one of
``CHAOS_PRESETS``) or ``--chaos FILE.json`` (a JSON object of these fields) fills it; the
``--chaos.FIELD`` flags set single fields over it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ChaosConfig", "CHAOS_PRESETS", "INJECTED_FAULTS", "chaos_preset"]

INJECTED_FAULTS = (
    "kill_mean_interval_s",
    "stop_mean_interval_s",
    "syncer_kill_at_s",
    "kill_at_step",
    "stop_at_step",
    "syncer_kill_at_step",
    "add_learner_at_step",
    "remove_learner_at_step",
    "link_cut",
)
"""The faults that a launcher carries out by signalling its processes (kills, stops, syncer
kills, elastic membership, link cuts). The others (``slowdown``, ``link_bandwidth_Bps``,
``link_latency_s``) the learners apply to themselves, whoever started them. Which backends
inject these: ``ddiloco.backends``."""


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    seed: int | None = None
    """Seed of every random draw of the schedule; unset: the run's ``seed``."""
    kill_mean_interval_s: float = 0.0
    """Mean time between learner SIGKILLs over the whole job (exponential); 0: none."""
    kill_downtime_s: float = 10.0
    """Time a killed learner stays down before the launcher restarts it."""
    stop_mean_interval_s: float = 0.0
    """Mean time between SIGSTOPs of a learner (straggler); 0: none."""
    stop_duration_s: float = 2.0
    """How long a stopped learner stays frozen before SIGCONT."""
    start_after_s: float = 5.0
    """No fault before this time (let everyone start)."""
    slowdown: dict[int, float] = field(default_factory=dict)
    """Per-learner step-time factor (>= 1), e.g. {3: 1.5}."""
    syncer_kill_at_s: tuple[float, ...] = ()
    """Times at which the syncer is SIGKILLed and restarted with --resume."""
    syncer_downtime_s: float = 2.0
    """Time the syncer stays down after a kill."""
    kill_at_step: tuple[tuple[int, int], ...] = ()
    """Deterministic kills: ``(learner, step)`` pairs; the learner is SIGKILLed once it has
    reported ``step`` (downtime ``kill_downtime_s``)."""
    stop_at_step: tuple[tuple[int, int, float], ...] = ()
    """Deterministic stops: ``(learner, step, duration_s)`` triples; once the learner has
    reported ``step`` it is SIGSTOPped for ``duration_s``, then SIGCONTed."""
    syncer_kill_at_step: int = 0
    """SIGKILL the syncer once the learners' mean reported step reaches this (0: never)."""
    syncer_kill_shard: int = 0
    """Which shard of a sharded syncer the syncer kills hit."""
    add_learner_at_step: tuple[int, ...] = ()
    """Elastic membership: once the learners' reported steps sum to each of these, one more
    learner process starts and joins without an id (the syncer assigns one)."""
    remove_learner_at_step: tuple[tuple[int, int], ...] = ()
    """Elastic membership: ``(learner, total steps)`` pairs; once the learners' reported
    steps sum to the second, the learner is SIGTERMed and leaves gracefully (flushes its
    pushes, says Leave) and is not restarted."""
    link_bandwidth_Bps: float = 0.0  # noqa: N815
    """Emulated learner <-> syncer bandwidth, bytes/s (0: unlimited)."""
    link_latency_s: float = 0.0
    """Emulated one-way latency added to each bulk transfer."""
    link_cut: tuple[tuple[int, int, float], ...] = ()
    """Link cuts: ``(learner, step, duration_s)`` triples; once the learner has reported
    ``step``, its link to the syncer is cut for ``duration_s`` (the launcher sends it SIGUSR1,
    then SIGUSR2): it trains on, every call it starts fails as UNAVAILABLE, and past the
    syncer's heartbeat timeout it is declared dead and rejoins when the link is back."""

    def __post_init__(self) -> None:
        for name in (
            "kill_mean_interval_s",
            "kill_downtime_s",
            "stop_mean_interval_s",
            "stop_duration_s",
            "start_after_s",
            "syncer_downtime_s",
            "link_bandwidth_Bps",
            "link_latency_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"chaos.{name} must be >= 0, got {getattr(self, name)}")
        self.slowdown = {int(k): float(v) for k, v in self.slowdown.items()}
        if any(v < 1.0 for v in self.slowdown.values()):
            raise ValueError("chaos.slowdown factors must be >= 1")
        self.syncer_kill_at_s = tuple(float(t) for t in self.syncer_kill_at_s)
        self.kill_at_step = tuple((int(m), int(s)) for m, s in self.kill_at_step)
        self.add_learner_at_step = tuple(int(s) for s in self.add_learner_at_step)
        self.remove_learner_at_step = tuple(
            (int(m), int(s)) for m, s in self.remove_learner_at_step
        )
        self.link_cut = tuple((int(m), int(s), float(d)) for m, s, d in self.link_cut)
        self.stop_at_step = tuple((int(m), int(s), float(d)) for m, s, d in self.stop_at_step)
        for name in ("link_cut", "stop_at_step"):
            if any(d <= 0 for _, _, d in getattr(self, name)):
                raise ValueError(f"chaos.{name} durations must be > 0, got {getattr(self, name)}")

    @property
    def active(self) -> bool:
        return bool(
            self.kill_mean_interval_s
            or self.stop_mean_interval_s
            or self.slowdown
            or self.syncer_kill_at_s
            or self.kill_at_step
            or self.stop_at_step
            or self.syncer_kill_at_step
            or self.add_learner_at_step
            or self.remove_learner_at_step
            or self.link_bandwidth_Bps
            or self.link_latency_s
            or self.link_cut
        )

    def injected_faults(self) -> tuple[str, ...]:
        """The ``INJECTED_FAULTS`` this chaos asks for (those set)."""
        return tuple(f for f in INJECTED_FAULTS if getattr(self, f))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["syncer_kill_at_s"] = list(self.syncer_kill_at_s)
        d["kill_at_step"] = [list(x) for x in self.kill_at_step]
        d["add_learner_at_step"] = list(self.add_learner_at_step)
        d["remove_learner_at_step"] = [list(x) for x in self.remove_learner_at_step]
        d["link_cut"] = [list(x) for x in self.link_cut]
        d["stop_at_step"] = [list(x) for x in self.stop_at_step]
        return d


CHAOS_PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    "kill30": {"kill_mean_interval_s": 30.0, "kill_downtime_s": 10.0},
    "stragglers": {"stop_mean_interval_s": 10.0, "stop_duration_s": 2.0, "slowdown": {0: 1.5}},
    "syncer-kill": {"syncer_kill_at_s": (15.0,), "syncer_downtime_s": 3.0},
    "wan": {"link_bandwidth_Bps": 12.5e6, "link_latency_s": 0.05},
}
"""Named chaos: ``--chaos NAME`` fills the [chaos] section with these fields."""


def chaos_preset(name_or_path: str, seed: int | None = None) -> ChaosConfig:
    """A named preset (``none``, ``kill30``, ``stragglers``, ``syncer-kill``, ``wan``) or a
    JSON file of ChaosConfig fields (its ``seed``, if it gives one, over ``seed``)."""
    if name_or_path in CHAOS_PRESETS:
        return ChaosConfig(seed=seed, **CHAOS_PRESETS[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown chaos preset {name_or_path!r}: use one of "
            f"{', '.join(CHAOS_PRESETS)} or a JSON file of ChaosConfig fields"
        )
    fields = json.loads(path.read_text())
    if not isinstance(fields, dict):
        raise ValueError(f"chaos file {name_or_path!r} must hold a JSON object of fields")
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ChaosConfig)})
    if unknown:
        raise ValueError(f"chaos file {name_or_path!r}: unknown field(s) {', '.join(unknown)}")
    fields.setdefault("seed", seed)
    return ChaosConfig(**fields)
