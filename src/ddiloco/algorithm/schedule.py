"""The staggered fragment schedule for (P, H, tau).

Fragment p is sent after inner step t (t = 1, 2, ...) when ``t % H == offset_p`` with
``offset_p = ((p + 1) * H // P) % H``: every fragment is synchronised every H inner steps,
and the P fragments are spread evenly over the period. With P = H exactly one fragment
leaves each learner per step; with P = 1 the whole model leaves every H steps (DiLoCo).
The merged value of a fragment sent at step t is installed after step ``t + tau``
(tau = 0: installed before the next step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["FragmentSchedule"]


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
            raise ValueError(f"P={self.P} fragments cannot be staggered over H={self.H} steps: "
                             f"use P <= H (P = H sends one fragment per step)")
        if self.tau < 0:
            raise ValueError(f"tau (overlap steps) must be >= 0, got {self.tau}")
        if self.tau >= self.H:
            raise ValueError(f"tau={self.tau} must be < H={self.H}: a fragment's merged value "
                             f"must be installed before the fragment is sent again")
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
        return tuple(p for p in range(self.P)
                     if self.slots_until(p, now_steps) > self.slots_until(p, prev_steps))

    def send_steps(self, p: int, n_steps: int) -> list[int]:
        """All steps in [1, n_steps] at which fragment p is sent."""
        o = self.offset(p)
        first = o if o >= 1 else self.H
        return list(range(first, n_steps + 1, self.H))
