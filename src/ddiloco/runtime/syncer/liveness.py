"""Liveness and time: the syncer's timer thread fires grace-window deadlines and declares
learners dead whose heartbeats stopped."""

from __future__ import annotations

import heapq
import logging
import time

from ddiloco.algorithm.syncer_state import Merged

__all__ = ["Liveness"]

log = logging.getLogger("ddiloco.syncer")


class Liveness:
    """The timer thread of ``SyncerServer`` (a mixin)."""

    def _timer_loop(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                wait = 0.25
                if self._timers:
                    wait = min(wait, max(0.0, self._timers[0][0] - now))
                if wait > 0:
                    self._timer_cv.wait(wait)
                if self._closed or self.state is None:
                    continue
                now = time.monotonic()
                if self._publish_retry:
                    self._retry_publish()
                while self._timers and self._timers[0][0] <= now:
                    _, p = heapq.heappop(self._timers)
                    t0 = time.monotonic()
                    out = self.state.on_timer(p, now)
                    if isinstance(out, Merged):
                        self._on_merged(out, time.monotonic() - t0)
                    elif out is not None:
                        self._add_timer(out.at_s, p)
                    self._followups(t0)
                for m in sorted(self.state.live):
                    info = self._learners.get(m)
                    if info is not None and now - info.last_hb_s > self.config.heartbeat_timeout_s:
                        info.state = "dead"
                        log.warning(
                            "[learner %d] no heartbeat for %.1f s: declared dead",
                            m,
                            now - info.last_hb_s,
                        )
                        t0 = time.monotonic()
                        self._handle_merges(self.state.leave(m, now), t0)
                        self._forget_copies(m)
                        self.members.note("dead", m, info.incarnation, len(self.state.live))
                        self._event("dead", learner=m, live=len(self.state.live))
