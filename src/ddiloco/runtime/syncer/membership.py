"""Elastic membership: learner ids assigned on Join and a log of members joining and leaving.

The set of learners is not fixed at launch. A process that joins without asking for an id
(``learner`` absent or negative in its Join) gets the lowest id this syncer has never
handed out, so ids stay unique over a run (a newcomer never inherits a departed learner's
ledger). A process may still ask for an id, e.g. to resume its own data position after a
restart. The quorum, grace window and token ledger of ``SyncerState`` already work on the
live set; this module only names the members and remembers how the set changed, for
``ddiloco status``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MembershipLog", "MemberEvent", "assign_learner_id"]


def assign_learner_id(requested: int | None, known: Iterable[int]) -> int:
    """The id a joining learner gets: ``requested`` when it asks for one (>= 0), else the
    lowest id not in ``known`` (every id this syncer has handed out or seen)."""
    if requested is not None and requested >= 0:
        return requested
    used = set(known)
    m = 0
    while m in used:
        m += 1
    return m


@dataclass(frozen=True, slots=True)
class MemberEvent:
    t_s: float
    """Seconds since the syncer started."""
    kind: str
    """``join``, ``leave`` (said goodbye) or ``dead`` (heartbeats stopped)."""
    learner: int
    incarnation: int
    live: int
    """Live learners after the event."""


class MembershipLog:
    """The last ``keep`` membership changes, newest last, and counts of each kind."""

    def __init__(self, started_s: float, keep: int = 64) -> None:
        self._started_s = started_s
        self._events: deque[MemberEvent] = deque(maxlen=keep)
        self.counts = {"join": 0, "leave": 0, "dead": 0}

    def note(self, kind: str, learner: int, incarnation: int, live: int) -> None:
        if kind not in self.counts:
            raise ValueError(f"membership event kind must be one of {sorted(self.counts)}")
        self.counts[kind] += 1
        self._events.append(
            MemberEvent(
                round(time.monotonic() - self._started_s, 3), kind, learner, incarnation, live
            )
        )

    def to_list(self) -> list[dict]:
        return [
            {
                "t_s": e.t_s,
                "kind": e.kind,
                "learner": e.learner,
                "incarnation": e.incarnation,
                "live": e.live,
            }
            for e in self._events
        ]
