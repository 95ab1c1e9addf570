"""A small deterministic discrete-event kernel: a heap of (time, priority, seq, event).

Ties are broken first by ``priority`` (lower runs first) and then by ``seq``, the order in
which events were scheduled, so a run is a pure function of its inputs and seed. Handlers
are plain callables ``handler(kernel, event)``; they may schedule more events. Errors in a
handler propagate to the caller of :meth:`EventKernel.run`. A driver that keeps its own
dispatch loop uses :meth:`EventKernel.push` and :meth:`EventKernel.pop` instead of handlers.

The kernel knows nothing about chips or learners, and imports nothing of the package. It is
the one event kernel of the package, owned by neither of its users: the simulator
(``ddiloco.sim.systems``) builds the failure, repair and reconfiguration processes on top of
it, and the in-process engine (``ddiloco.engine.decoupled``) orders its learners' steps,
pushes, merges and broadcasts with it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Event", "EventKernel", "LogEntry"]


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happens at one instant. ``kind`` selects the handler."""

    kind: str
    target: int = -1
    """Index of the entity concerned (slice, learner, fragment...), -1 if none."""
    data: Any = None
    """Optional payload (e.g. a generation counter to recognise cancelled timers)."""


@dataclass(frozen=True, slots=True)
class LogEntry:
    time_s: float
    kind: str
    target: int


Handler = Callable[["EventKernel", Event], None]


@dataclass(slots=True)
class EventKernel:
    """Virtual clock plus an event heap; see the module docstring for the ordering rule."""

    now_s: float = 0.0
    log_events: bool = False
    """Record every dispatched event in ``log`` (for tests and debugging)."""
    log: list[LogEntry] = field(default_factory=list)
    handlers: dict[str, Handler] = field(default_factory=dict)
    n_dispatched: int = 0
    _heap: list[tuple[float, int, int, Event]] = field(default_factory=list)
    _seq: int = 0

    def on(self, kind: str, handler: Handler) -> None:
        """Register the handler for events of ``kind`` (one handler per kind)."""
        if kind in self.handlers:
            raise ValueError(f"a handler for event kind {kind!r} is already registered")
        self.handlers[kind] = handler

    def schedule(self, time_s: float, event: Event, priority: int = 0) -> None:
        """Schedule ``event`` at absolute virtual time ``time_s`` (never in the past)."""
        if time_s < self.now_s:
            raise ValueError(f"cannot schedule {event.kind} at {time_s} < now {self.now_s}")
        heapq.heappush(self._heap, (time_s, priority, self._seq, event))
        self._seq += 1

    def after(self, delay_s: float, event: Event, priority: int = 0) -> None:
        """Schedule ``event`` ``delay_s`` seconds from now."""
        self.schedule(self.now_s + delay_s, event, priority)

    def push(self, time_s: float, priority: int, kind: str, data: Any = None) -> None:
        """``schedule(time_s, Event(kind, data=data), priority)``, for a driver with its own
        dispatch loop (:meth:`pop`)."""
        self.schedule(time_s, Event(kind, data=data), priority)

    def pop(self) -> tuple[float, str, Any]:
        """Take the next event without dispatching it: advances the clock to its time and
        returns ``(time_s, kind, data)``; raises IndexError when the heap is empty."""
        time_s, _, _, event = heapq.heappop(self._heap)
        self.now_s = time_s
        self.n_dispatched += 1
        if self.log_events:
            self.log.append(LogEntry(time_s, event.kind, event.target))
        return time_s, event.kind, event.data

    def __bool__(self) -> bool:
        return bool(self._heap)

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

    def step(self) -> bool:
        """Dispatch the next event; False when the heap is empty."""
        if not self._heap:
            return False
        time_s, _, _, event = heapq.heappop(self._heap)
        self.now_s = time_s
        handler = self.handlers.get(event.kind)
        if handler is None:
            raise KeyError(f"no handler registered for event kind {event.kind!r}")
        if self.log_events:
            self.log.append(LogEntry(time_s, event.kind, event.target))
        self.n_dispatched += 1
        handler(self, event)
        return True

    def run(self, until_s: float) -> None:
        """Dispatch events with time <= ``until_s``, then advance the clock to ``until_s``."""
        while self._heap and self._heap[0][0] <= until_s:
            self.step()
        self.now_s = max(self.now_s, until_s)
