"""The learner's parts alone, with a fake context: the stats keep the form the reports
serialise, and the inbox applies the threads' events in its safe order."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from ddiloco.runtime.learner.context import LearnerStats
from ddiloco.runtime.learner.inbox import ClockHeard, Inbox, PushResult, Received, SyncerRestarted

pytestmark = pytest.mark.timeout(30)


def test_the_stats_read_as_the_mapping_the_reports_carry():
    stats = LearnerStats()
    assert list(dict(stats)) == [
        "bytes_sent",
        "bytes_received",
        "pushes",
        "pushes_accepted",
        "pushes_rejected",
        "installs",
        "install_delay_steps",
        "reconnects",
        "fetch_s",
        "push_errors",
    ]
    stats.pushed(100, True)
    stats.pushed(50, False)
    stats.fetched(10, 2.0)
    stats.fetched(10, 1.0)
    assert stats["bytes_sent"] == 150 and stats["pushes"] == 2
    assert stats["pushes_accepted"] == 1 and stats["pushes_rejected"] == 1
    assert stats["bytes_received"] == 20 and stats["fetch_s"] == pytest.approx(1.8)
    assert {**stats}["pushes"] == 2
    with pytest.raises(KeyError):
        stats["nope"]


class _Sync:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.frags = [SimpleNamespace(in_flight=[3, 7])]
        self.last_s = 0.0

    def on_push_result(self, p, seq, accepted, target=-1):
        self.calls.append(("result", p, seq, accepted))

    def receive(self, p, v, tensors, ready=None):
        self.calls.append(("receive", p, v))

    def mark_merged(self, p, s):
        self.calls.append(("merged", p, s))


def _inbox() -> tuple[Inbox, _Sync]:
    sync = _Sync()
    ctx = SimpleNamespace(
        sync=sync,
        fragmentation=SimpleNamespace(P=1),
        lock=threading.Lock(),
        time_driven=False,
        learner=0,
    )
    client = SimpleNamespace(boot_part=lambda boot, p: boot)
    return Inbox(ctx, client), sync  # type: ignore[arg-type]


def test_the_inbox_applies_restarts_then_verdicts_then_receipts_then_merges():
    inbox, sync = _inbox()
    inbox.accepted_by_boot[7] = "old"
    inbox.merged_seq = {0: 7}
    inbox.put(Received(0, 5, [], None))
    inbox.put(PushResult(0, 7, True, 5))
    inbox.put(SyncerRestarted({0: 3}, "old"))
    inbox.put(ClockHeard({"bad": 1}))  # an invalid clock is ignored with a warning
    inbox.drain()
    assert sync.calls == [
        ("result", 0, 7, False),  # accepted by the old boot, above its merged seq: lost
        ("result", 0, 7, True),
        ("receive", 0, 5),
        ("merged", 0, 7),
    ]
    inbox.drain()  # a merge is marked once
    assert sync.calls[-1] == ("merged", 0, 7) and len(sync.calls) == 4
