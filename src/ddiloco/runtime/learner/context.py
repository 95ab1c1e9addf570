"""What every part of a learner shares. ``LearnerStats``: the traffic and install counters
its reports carry (``report()``, the heartbeat, the Leave)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["LearnerStats"]


@dataclass(slots=True)
class LearnerStats(Mapping):
    """A learner process's counters, as its reports carry them (``report()``, the heartbeat,
    the Leave): read as a mapping (``stats["pushes"]``, ``dict(stats)``) or by field."""

    bytes_sent: int = 0
    """Wire bytes of pushes and initial uploads."""
    bytes_received: int = 0
    """Wire bytes of fetched fragments."""
    pushes: int = 0
    pushes_accepted: int = 0
    pushes_rejected: int = 0
    installs: int = 0
    """Merged fragments installed into the model."""
    install_delay_steps: float = 0.0
    """The mean steps a merged fragment took to come back after its push."""
    reconnects: int = 0
    """Times the heartbeat found the syncer unreachable."""
    fetch_s: float | None = None
    """A fetch's time, a moving average (None before the first)."""
    push_errors: int = 0
    """Pushes retried after a transient error."""

    def __getitem__(self, key: str) -> Any:
        if key not in _STAT_NAMES:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_STAT_NAMES)

    def __len__(self) -> int:
        return len(_STAT_NAMES)

    def fetched(self, nbytes: int, dt_s: float) -> None:
        """A fetch of ``nbytes`` wire bytes that took ``dt_s`` seconds."""
        self.fetch_s = dt_s if self.fetch_s is None else 0.8 * self.fetch_s + 0.2 * dt_s
        self.bytes_received += nbytes

    def pushed(self, nbytes: int, accepted: bool) -> None:
        """A push the syncer answered (accepted, or rejected or a duplicate)."""
        self.bytes_sent += nbytes
        self.pushes += 1
        if accepted:
            self.pushes_accepted += 1
        else:
            self.pushes_rejected += 1


_STAT_NAMES = tuple(f.name for f in fields(LearnerStats))
