"""Liveness and time: the syncer's timer thread fires grace-window deadlines and declares
learners dead whose heartbeats stopped.

``Liveness`` owns the deadlines (a heap of (time, fragment)), their condition and the
thread. It runs under the server's lock and acts through what the server gives it: a
deadline that is due is handed to ``fire``, a live learner silent for longer than the
heartbeat timeout to ``declare_dead``, and every tick first calls ``tick`` (the retry of
failed publications)."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["Liveness"]


class Liveness:
    """The timer thread of ``SyncerServer``: deadlines and heartbeat timeouts."""

    def __init__(
        self,
        lock: threading.Lock,
        heartbeat_timeout_s: float,
        *,
        closed: Callable[[], bool],
        ready: Callable[[], bool],
        tick: Callable[[], None],
        fire: Callable[[int, float], None],
        live: Callable[[], Iterable[int]],
        last_heartbeat_s: Callable[[int], float | None],
        declare_dead: Callable[[int, float], None],
    ) -> None:
        """``lock``: the server's, held by every call into this part and while the thread
        acts. ``closed``/``ready``: whether the server is shutting down / holds a model.
        ``fire(p, now_s)``: fragment p's deadline is due. ``live()``: the live learners;
        ``last_heartbeat_s(m)``: when m was last heard (None: unknown);
        ``declare_dead(m, now_s)``: m is silent past ``heartbeat_timeout_s``."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.timers: list[tuple[float, int]] = []
        """The grace-window deadlines: a heap of (monotonic time, fragment)."""
        self._cv = threading.Condition(lock)
        self._closed, self._ready, self._tick = closed, ready, tick
        self._fire, self._live, self._last_hb = fire, live, last_heartbeat_s
        self._declare_dead = declare_dead
        self.thread: threading.Thread | None = None

    def start(self) -> threading.Thread:
        self.thread = threading.Thread(target=self._loop, name="syncer-timer", daemon=True)
        self.thread.start()
        return self.thread

    def add_timer(self, at_s: float, p: int) -> None:
        """Wake at ``at_s`` (monotonic) for fragment p's round. Lock held."""
        heapq.heappush(self.timers, (at_s, p))
        self._cv.notify_all()

    def wake(self) -> None:
        """Wake the thread (the server is closing). Lock held."""
        self._cv.notify_all()

    def _loop(self) -> None:
        with self._cv:
            while not self._closed():
                now = time.monotonic()
                wait = 0.25
                if self.timers:
                    wait = min(wait, max(0.0, self.timers[0][0] - now))
                if wait > 0:
                    self._cv.wait(wait)
                if self._closed() or not self._ready():
                    continue
                now = time.monotonic()
                self._tick()
                while self.timers and self.timers[0][0] <= now:
                    _, p = heapq.heappop(self.timers)
                    self._fire(p, now)
                for m in sorted(self._live()):
                    last = self._last_hb(m)
                    if last is not None and now - last > self.heartbeat_timeout_s:
                        self._declare_dead(m, now)
