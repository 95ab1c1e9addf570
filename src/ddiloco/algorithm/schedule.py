"""The staggered fragment schedule for (P, H, tau).

Fragment p is sent after inner step t (t = 1, 2, ...) when ``t % H == offset_p`` with
``offset_p = ((p + 1) * H // P) % H``: every fragment is synchronised every H inner steps,
and the P fragments are spread evenly over the period. With P = H exactly one fragment
leaves each learner per step; with P = 1 the whole model leaves every H steps (DiLoCo).
The merged value of a fragment sent at step t is installed after step ``t + tau``
(tau = 0: installed before the next step).

With the time-driven schedule the slots lie on a clock shared by every learner instead of
each learner's own step count: ``SlotClock`` maps a wall-clock time to nominal steps
(elapsed time in units of the slot length), and ``fragments_due`` sends the fragments whose
slots passed. The syncer announces the clock (``next_clock``: its epoch and the slot length
measured from the learners' step times); ``ClockTrack`` holds the announcements a learner
has heard; ``StepTimer`` is a learner's step time as it reports it. Pure code: every time is
passed in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = [
    "FragmentSchedule",
    "SlotClock",
    "ClockTrack",
    "StepTimer",
    "next_clock",
    "measured_slot_s",
]


@dataclass(frozen=True, slots=True)
class FragmentSchedule:
    P: int  # noqa: N815 - paper symbol
    """Number of fragments."""
    H: int  # noqa: N815
    """Inner steps between two synchronisations of the same fragment."""
    tau: int = 0
    """Overlap: steps between sending a fragment and installing its merged value."""
    _by_phase: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.P < 1:
            raise ValueError(f"P (fragments) must be >= 1, got {self.P}")
        if self.H < 1:
            raise ValueError(f"H (inner steps per sync) must be >= 1, got {self.H}")
        if self.P > self.H:
            raise ValueError(
                f"P={self.P} fragments cannot be staggered over H={self.H} steps: "
                f"use P <= H (P = H sends one fragment per step)"
            )
        if self.tau < 0:
            raise ValueError(f"tau (overlap steps) must be >= 0, got {self.tau}")
        if self.tau >= self.H:
            raise ValueError(
                f"tau={self.tau} must be < H={self.H}: a fragment's merged value "
                f"must be installed before the fragment is sent again"
            )
        by_phase: dict[int, list[int]] = {}
        for p in range(self.P):
            by_phase.setdefault(self.offset(p), []).append(p)
        object.__setattr__(self, "_by_phase", {k: tuple(v) for k, v in by_phase.items()})

    def offset(self, p: int) -> int:
        """Phase of fragment p within the period: it is sent when ``t % H == offset(p)``."""
        if not 0 <= p < self.P:
            raise ValueError(f"fragment {p} out of range [0, {self.P})")
        return ((p + 1) * self.H // self.P) % self.H

    def fragments_to_send(self, t: int) -> tuple[int, ...]:
        """Fragments sent after inner step t (t >= 1)."""
        if t < 1:
            return ()
        return self._by_phase.get(t % self.H, ())

    def install_step(self, send_step: int) -> int:
        """Inner step after which the merged value of a fragment sent at ``send_step`` is installed."""
        return send_step + self.tau

    def slots_until(self, p: int, x_steps: float) -> int:
        """Number of fragment p's send slots at or before ``x_steps`` nominal steps
        (slots at ``offset(p) + k*H``, the first one at a step >= 1)."""
        o = self.offset(p) or self.H
        return 0 if x_steps < o else math.floor((x_steps - o) / self.H) + 1

    def fragments_due(self, prev_steps: float, now_steps: float) -> tuple[int, ...]:
        """Time-driven schedule: fragments with a send slot in (prev_steps, now_steps], where
        both are elapsed time in units of the nominal step time. Every learner then sends
        fragment p at about the same moment whatever its speed, so a grace window can
        gather them; a faster learner's push carries more steps and tokens (and weight)."""
        return tuple(
            p
            for p in range(self.P)
            if self.slots_until(p, now_steps) > self.slots_until(p, prev_steps)
        )

    def send_steps(self, p: int, n_steps: int) -> list[int]:
        """All steps in [1, n_steps] at which fragment p is sent."""
        o = self.offset(p)
        first = o if o >= 1 else self.H
        return list(range(first, n_steps + 1, self.H))


@dataclass(frozen=True, slots=True)
class SlotClock:
    """Wall-clock time to nominal steps: ``x(t) = x0 + (t - t0_s) / slot_s`` from ``t0_s`` on.

    Times are seconds on a clock every party reads alike (the runtime uses Unix time, so
    hosts must keep their clocks synchronised, e.g. by NTP, to well within one slot).
    ``epoch_s`` names the run's clock: a clock with another epoch is a different run or a
    syncer that started afresh, not a re-timing of this one."""

    epoch_s: float
    """When the syncer started the run's clock (x = 0 there at the first slot length)."""
    t0_s: float
    """From when this slot length holds."""
    x0: float
    """Nominal steps at ``t0_s``."""
    slot_s: float
    """Slot length: the nominal step time, seconds."""

    def __post_init__(self) -> None:
        if not self.slot_s > 0:
            raise ValueError(f"slot_s must be > 0, got {self.slot_s}")

    def nominal(self, t_s: float) -> float:
        """Nominal steps elapsed at ``t_s``."""
        return self.x0 + (t_s - self.t0_s) / self.slot_s

    def to_dict(self) -> dict:
        return {"epoch_s": self.epoch_s, "t0_s": self.t0_s, "x0": self.x0, "slot_s": self.slot_s}

    @classmethod
    def from_dict(cls, d: dict) -> SlotClock:
        try:
            return cls(
                epoch_s=float(d["epoch_s"]),
                t0_s=float(d["t0_s"]),
                x0=float(d["x0"]),
                slot_s=float(d["slot_s"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed slot clock {d!r}: {e}") from None


class StepTimer:
    """A learner's measured step time (``step_s`` in its heartbeats, which the syncer's slot
    clock is measured from): the mean of its latest step times, over the latest ``min_s``
    seconds and at least ``min_steps`` steps (over all its steps until it has ``min_s``).

    The first ``skip`` intervals are left out: the first one runs from the learner's start
    to its first step (the caller's set-up and the first forward/backward; 0.13-0.35 s
    against steps of 10-20 ms in ``ddiloco train`` with gpt_tiny). ``step_s`` is None until
    ``min_steps`` steps are measured, so that the syncer never starts or re-times its clock
    from a start-up or from one step: a slot length measured from a start-up or a scheduling
    hiccup holds until the next re-timing (seconds), and every fragment leaves that many
    times slower meanwhile."""

    def __init__(self, min_steps: int = 8, min_s: float = 1.0, skip: int = 1) -> None:
        if min_steps < 1 or min_s < 0 or skip < 0:
            raise ValueError(
                f"StepTimer needs min_steps >= 1, min_s >= 0, skip >= 0; got "
                f"{min_steps}, {min_s}, {skip}"
            )
        self.min_steps, self.min_s, self._skip = min_steps, min_s, skip
        self._dts: deque[float] = deque()
        self._sum_s = 0.0
        self._step_s: float | None = None  # one attribute: read whole from another thread

    def add(self, dt_s: float) -> None:
        """One step took ``dt_s`` seconds."""
        if self._skip > 0:
            self._skip -= 1
            return
        self._dts.append(dt_s)
        self._sum_s += dt_s
        while len(self._dts) > self.min_steps and self._sum_s - self._dts[0] >= self.min_s:
            self._sum_s -= self._dts.popleft()
        if len(self._dts) >= self.min_steps:
            self._step_s = self._sum_s / len(self._dts)

    @property
    def step_s(self) -> float | None:
        """Mean seconds per step over the window; None until ``min_steps`` are measured."""
        return self._step_s


def measured_slot_s(step_times_s: list[float]) -> float | None:
    """The slot length from the live learners' measured step times: their mean (a slower
    learner then sends each fragment with fewer steps, a faster one with more). None when
    nothing is measured yet."""
    xs = [x for x in step_times_s if x > 0 and x == x]
    return sum(xs) / len(xs) if xs else None


def next_clock(
    current: SlotClock | None,
    *,
    epoch_s: float,
    slot_s: float | None,
    now_s: float,
    lead_s: float,
    tolerance: float = 0.1,
    min_interval_s: float = 0.0,
) -> SlotClock | None:
    """The clock the syncer announces next, or None to keep ``current``.

    The first clock starts once a slot length is measured, as if that length had held since
    the epoch. A later re-timing, when the measured length differs from the current one by
    more than ``tolerance`` (relative) and at least ``min_interval_s`` after the current
    one took effect, continues the nominal steps without a jump. Either takes effect
    ``lead_s`` from now, so every learner hears it before it applies."""
    if slot_s is None or not slot_s > 0:
        return None
    at = now_s + lead_s
    if current is None:
        return SlotClock(epoch_s=epoch_s, t0_s=at, x0=(at - epoch_s) / slot_s, slot_s=slot_s)
    if (
        abs(slot_s - current.slot_s) <= tolerance * current.slot_s
        or at < current.t0_s + min_interval_s
        or at <= current.t0_s
    ):
        return None
    return SlotClock(epoch_s=current.epoch_s, t0_s=at, x0=current.nominal(at), slot_s=slot_s)


class ClockTrack:
    """The clocks a learner has heard, newest last: ``nominal(t)`` uses the newest one in
    effect at t (a re-timing is announced ahead of when it applies)."""

    def __init__(self) -> None:
        self._clocks: list[SlotClock] = []

    @property
    def epoch_s(self) -> float | None:
        return self._clocks[-1].epoch_s if self._clocks else None

    def hear(self, clock: SlotClock) -> bool:
        """Record an announcement; True when it starts a new run clock (another epoch), whose
        nominal steps do not continue the old ones."""
        new_run = not self._clocks or clock.epoch_s != self._clocks[-1].epoch_s
        if new_run:
            self._clocks = [clock]
        elif clock != self._clocks[-1]:
            self._clocks = [c for c in self._clocks if c.t0_s < clock.t0_s] + [clock]
            del self._clocks[:-3]
        return new_run

    def nominal(self, t_s: float) -> float | None:
        """Nominal steps at ``t_s``; None before any clock is heard. Before the first
        clock's ``t0_s`` the first clock is extended backwards."""
        if not self._clocks:
            return None
        for c in reversed(self._clocks):
            if c.t0_s <= t_s:
                return c.nominal(t_s)
        return self._clocks[0].nominal(t_s)
