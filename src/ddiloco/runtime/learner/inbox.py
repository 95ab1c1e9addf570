"""What the learner's background threads hand to the training thread (``DecoupledLearner``'s
inbox, drained at every ``step``): typed events, and ``Inbox``, which holds them and the
syncer's merged-push notices, applies them in a safe order and keeps the schedule's slot
clock."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from ddiloco.algorithm.schedule import SlotClock
from ddiloco.runtime.learner.context import LearnerContext
from ddiloco.runtime.learner.sharded import ShardedClient

__all__ = ["ClockHeard", "Event", "Inbox", "PushResult", "Received", "SyncerRestarted"]

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


class Inbox:
    """The training thread's side of the background threads: their events, the syncer's
    merged-push notices, and the schedule's slot clock."""

    def __init__(self, ctx: LearnerContext, client: ShardedClient | None) -> None:
        """``client``: the connection whose boot ids the syncer's restarts are told by."""
        self.ctx = ctx
        self.client = client
        self.queue: queue.Queue[Event] = queue.Queue()
        self.merged_seq: dict[int, int] = {}
        """p -> the newest push seq the syncer has merged (Join, rejoin and Watch; under
        ``ctx.lock``)."""
        self.accepted_by_boot: dict[int, str] = {}
        """seq -> the syncer boot that accepted it (sender threads)."""
        self.results_known: dict[int, list[int]] = {p: [] for p in range(ctx.fragmentation.P)}
        """p -> the pushes whose verdict the training thread has applied, not yet merged."""
        self.merged_applied: dict[int, int] = {}
        self._x = 0.0  # nominal steps at the last step boundary

    def put(self, ev: Event) -> None:
        self.queue.put(ev)

    def take(self) -> list[Event]:
        """Every event delivered so far, in order."""
        out: list[Event] = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def set_merged(self, r: dict) -> None:
        """The merged-push notices of a syncer's answer (``merged_seq``)."""
        with self.ctx.lock:
            self.merged_seq = {int(k): v for k, v in r.get("merged_seq", {}).items()}

    def merged(self) -> dict[int, int]:
        with self.ctx.lock:
            return dict(self.merged_seq)

    def nominal_now(self) -> float | None:
        """The time-driven schedule's clock at this step boundary, in nominal steps: the
        syncer's slot clock, or one step per step until the syncer has announced one."""
        if not self.ctx.time_driven:
            return None
        x = self.ctx.clock.nominal(time.time())
        self._x = self._x + 1.0 if x is None else x
        return self._x

    def hear_clock(self, d: dict) -> None:
        """An announced slot clock (training thread). A new run clock restarts the slot
        count at its current value: no burst of sends for slots this learner never had."""
        ctx = self.ctx
        try:
            c = SlotClock.from_dict(d)
        except ValueError as e:
            log.warning("[learner %d] ignoring the syncer's clock: %s", ctx.learner, e)
            return
        if ctx.clock.hear(c) and ctx.time_driven:
            # a clock just heard gives a time
            self._x = cast(float, ctx.clock.nominal(time.time()))
            ctx.sync.last_s = self._x

    def forget_lost(self, merged_seq: dict[int, int], old_boot: str, boots: dict[int, str]) -> None:
        """A restarted syncer: pushes the old one accepted (``boots``: seq -> the boot that
        accepted it) but never published (above ``merged_seq``) are gone with it."""
        sync, client = self.ctx.sync, self.client
        assert client is not None
        for p in range(self.ctx.fragmentation.P):
            ms = merged_seq.get(p, -1)
            for seq in list(sync.frags[p].in_flight):
                if seq > ms and boots.get(seq) == client.boot_part(old_boot, p):
                    sync.on_push_result(p, seq, accepted=False)

    def apply_merged(self, merged_seq: dict[int, int]) -> None:
        """Mark merged the newest push of each fragment whose verdict is known and whose
        seq the syncer has merged."""
        for p, ms in merged_seq.items():
            known = [s for s in self.results_known.get(p, []) if s <= ms]
            if known:
                s = max(known)
                if s > self.merged_applied.get(p, -1):
                    self.ctx.sync.mark_merged(p, s)
                    self.merged_applied[p] = s
                self.results_known[p] = [x for x in self.results_known[p] if x > s]

    def drain(self) -> None:
        """Apply what the background threads delivered, in a safe order: push verdicts,
        received fragments, then merged-seq notices (only for pushes whose verdict is known)."""
        sync = self.ctx.sync
        results: list[PushResult] = []
        recvs: list[Received] = []
        restarts: list[SyncerRestarted] = []
        for ev in self.take():
            if isinstance(ev, ClockHeard):
                self.hear_clock(ev.clock)
            elif isinstance(ev, PushResult):
                results.append(ev)
            elif isinstance(ev, Received):
                recvs.append(ev)
            else:
                restarts.append(ev)
        for rs in restarts:
            self.forget_lost(rs.merged_seq, rs.old_boot, self.accepted_by_boot)
        for r in results:
            sync.on_push_result(r.fragment, r.seq, r.accepted, r.target_version)
            self.results_known[r.fragment].append(r.seq)
        for rv in recvs:
            sync.receive(rv.fragment, rv.version, rv.tensors, rv.ready)
        self.apply_merged(self.merged())
