"""What the learner's background threads hand to the training thread (``DecoupledLearner``'s
inbox, drained at every ``step``): typed events, and ``InboxMixin``, which applies them in a
safe order and keeps the schedule's slot clock. A mixin of ``DecoupledLearner``: the state
it uses is set in ``DecoupledLearner.__init__``."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddiloco.algorithm.schedule import SlotClock

__all__ = ["ClockHeard", "Event", "InboxMixin", "PushResult", "Received", "SyncerRestarted"]

log = logging.getLogger("ddiloco.learner")


@dataclass(frozen=True, slots=True)
class PushResult:
    """The syncer's verdict on push ``seq`` of ``fragment`` (sender thread)."""

    fragment: int
    seq: int
    accepted: bool
    target_version: int
    """The version the push will be merged into (-1 when refused)."""


@dataclass(frozen=True, slots=True)
class Received:
    """A merged version of ``fragment`` fetched (receiver thread), staged for the device."""

    fragment: int
    version: int
    tensors: list[torch.Tensor]
    ready: Callable[[], None] | None
    """Call before reading ``tensors`` (an asynchronous host-to-device copy), when set."""


@dataclass(frozen=True, slots=True)
class ClockHeard:
    """The syncer announced its slot clock (Join, Heartbeat or a rejoin)."""

    clock: dict


@dataclass(frozen=True, slots=True)
class SyncerRestarted:
    """A rejoin met another syncer boot: pushes the old one accepted but never published
    (above ``merged_seq``) are gone with it."""

    merged_seq: dict[int, int]
    old_boot: str


Event = PushResult | Received | ClockHeard | SyncerRestarted


class InboxMixin:
    """The training thread's side: drain the inbox, follow the syncer's slot clock."""

    def _nominal_now(self) -> float | None:
        """The time-driven schedule's clock at this step boundary, in nominal steps: the
        syncer's slot clock, or one step per step until the syncer has announced one."""
        if not self.time_driven:
            return None
        x = self.clock.nominal(time.time())
        self._x = self._x + 1.0 if x is None else x
        return self._x

    def _hear_clock(self, d: dict) -> None:
        """An announced slot clock (training thread). A new run clock restarts the slot
        count at its current value: no burst of sends for slots this learner never had."""
        try:
            c = SlotClock.from_dict(d)
        except ValueError as e:
            log.warning("[learner %d] ignoring the syncer's clock: %s", self.learner, e)
            return
        if self.clock.hear(c) and self.time_driven:
            self._x = self.clock.nominal(time.time())
            self.sync.last_s = self._x

    def _drain(self) -> None:
        """Apply what the background threads delivered, in a safe order: push verdicts,
        received fragments, then merged-seq notices (only for pushes whose verdict is known)."""
        results: list[PushResult] = []
        recvs: list[Received] = []
        restarts: list[SyncerRestarted] = []
        while True:
            try:
                ev: Event = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(ev, ClockHeard):
                self._hear_clock(ev.clock)
            elif isinstance(ev, PushResult):
                results.append(ev)
            elif isinstance(ev, Received):
                recvs.append(ev)
            else:
                restarts.append(ev)
        for rs in restarts:
            # pushes the old syncer accepted but never published are gone with it
            for p in range(self.fragmentation.P):
                ms = rs.merged_seq.get(p, -1)
                for seq in list(self.sync.frags[p].in_flight):
                    if seq > ms and self._accepted_by_boot.get(seq) == self.client.boot_part(
                        rs.old_boot, p
                    ):
                        self.sync.on_push_result(p, seq, accepted=False)
        for r in results:
            self.sync.on_push_result(r.fragment, r.seq, r.accepted, r.target_version)
            self._results_known[r.fragment].append(r.seq)
        for rv in recvs:
            self.sync.receive(rv.fragment, rv.version, rv.tensors, rv.ready)
        with self._lock:
            merged_seq = dict(self._merged_seq)
        for p, ms in merged_seq.items():
            known = [s for s in self._results_known.get(p, []) if s <= ms]
            if known:
                s = max(known)
                if s > self._merged_applied.get(p, -1):
                    self.sync.mark_merged(p, s)
                    self._merged_applied[p] = s
                self._results_known[p] = [x for x in self._results_known[p] if x > s]
