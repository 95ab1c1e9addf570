"""Room for push payloads on the syncer: the bytes of pushes being read from their
connections, checked and folded into their round.

Learners push at their own times, and on a fast link eight pushes of a fragment can arrive
at once. Read whole, they would all be held beside the model until each is folded into its
round (``SyncerState._fold``); at P = 8 with bf16 pushes that is half an fp32 model. The
room bounds them: a push waits for room before its payload is read (its bytes stay in the
kernel's socket buffers and TCP flow control slows its sender), and gives the room back
once the state machine has taken it (folded it, or staged it in a round that holds at most
about a fragment). A push over the room takes it alone, once it is empty.

One learner holds at most half the room, so a learner whose pushes stall half-way (a
broken link, or a hostile token holder) leaves the other half to the rest. A push that
finds no room within its payload's deadline is refused with ``E_BUSY``, which learners
retry.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

__all__ = ["PushRoom", "Taken"]


class Taken:
    """Room held by one push; ``give_back`` returns it (once, whoever calls it first)."""

    __slots__ = ("_room", "_n", "_who")

    def __init__(self, room: PushRoom | None, n: int, who: int) -> None:
        self._room, self._n, self._who = room, n, who

    def give_back(self) -> None:
        room, self._room = self._room, None
        if room is not None:
            room._give(self._n, self._who)


class PushRoom:
    """At most ``capacity`` bytes of push payloads held at once, at most half of them by
    one learner (0: no bound)."""

    def __init__(self, capacity: int = 0) -> None:
        self._cv = threading.Condition()
        self._used = 0
        self._by: Counter[int] = Counter()
        self._capacity = capacity
        self.waits = 0
        """Pushes that had to wait for room."""
        self.wait_s = 0.0
        """Their summed waiting time."""

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"push room must be >= 0 bytes, got {n}")
        with self._cv:
            self._capacity = n
            self._cv.notify_all()

    @property
    def used(self) -> int:
        return self._used

    def take(self, n: int, timeout_s: float, learner: int = 0) -> Taken | None:
        """Room for ``learner``'s payload of ``n`` bytes, waiting at most ``timeout_s``;
        None if none freed in time."""
        with self._cv:
            if not self._capacity:
                return Taken(None, 0, learner)
            share = max(1, self._capacity // 2)
            need = min(n, share)  # a push over a learner's share takes all of it

            def fits() -> bool:
                return self._used + need <= self._capacity and self._by[learner] + need <= share

            if not fits():
                t0 = time.monotonic()
                self.waits += 1
                ok = self._cv.wait_for(fits, timeout_s)
                self.wait_s += time.monotonic() - t0
                if not ok:
                    return None
            self._used += need
            self._by[learner] += need
            return Taken(self, need, learner)

    def _give(self, n: int, learner: int) -> None:
        with self._cv:
            self._used -= n
            self._by[learner] -= n
            if not self._by[learner]:
                del self._by[learner]
            self._cv.notify_all()
