"""The syncer's books: the token ledger, push sequence numbers and the versions learners
can still push against.

Per learner a ``LedgerEntry`` counts tokens and pushes merged, dropped, pending and
rejected. A push of fragment p counts its ``c_tokens`` times p's byte share, so a
learner's tokens summed over the fragments are the tokens it computed. Per (learner,
fragment) the last push sequence number received makes a retried push a duplicate. Per
(learner, fragment) the pin is the oldest version that learner can still push against,
which bounds the history of published versions the syncer keeps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ddiloco.algorithm.rounds import Contribution

__all__ = ["LedgerEntry", "Ledger", "vars_of"]


@dataclass(slots=True)
class LedgerEntry:
    """Per-learner token ledger on the syncer. A push of fragment p counts its ``c_tokens``
    times p's byte share (the learners' step ledger splits steps the same way), so a
    learner's tokens summed over the fragments are the tokens it computed, not P times."""

    tokens_merged: float = 0.0
    tokens_dropped: float = 0.0
    tokens_pending: float = 0.0
    pushes_merged: int = 0
    pushes_dropped: int = 0
    pushes_rejected: int = 0


def vars_of(e: LedgerEntry) -> dict:
    return {k: getattr(e, k) for k in e.__slots__}


class Ledger:
    """Tokens and pushes per learner, sequence numbers, and pins (``LedgerEntry``)."""

    def __init__(self, shares: list[float]) -> None:
        self.share = shares
        """Fragment p's share of the model's bytes: a push's tokens count that share."""
        self.entries: dict[int, LedgerEntry] = {}
        self.seen_seq: dict[tuple[int, int], int] = {}
        """(learner, fragment) -> the last push sequence number received."""
        self.pins: dict[int, dict[int, int]] = {}
        """learner -> fragment -> the oldest version it can still push against."""

    def tokens(self, c: Contribution) -> float:
        """A push's tokens in the ledger: its counter times the fragment's byte share."""
        return c.c_tokens * self.share[c.fragment]

    def join(self, learner: int, versions: list[int]) -> None:
        """It installs what it fetches from now on: at least the current ``versions``."""
        self.entries.setdefault(learner, LedgerEntry())
        self.pins[learner] = dict(enumerate(versions))

    def leave(self, learner: int) -> None:
        self.pins.pop(learner, None)

    def received(self, learner: int, p: int, seq: int) -> bool:
        """Push ``seq`` of fragment p from ``learner`` (or a later one) was submitted."""
        return self.seen_seq.get((learner, p), -1) >= seq

    def drop(self, c: Contribution) -> None:
        """A push dropped on arrival (stale)."""
        led = self.entries[c.learner]
        led.pushes_dropped += 1
        led.tokens_dropped += self.tokens(c)

    def pin(self, c: Contribution) -> None:
        """Push c names its base version: its learner's pin of the fragment moves up to it."""
        pins = self.pins.setdefault(c.learner, {})
        pins[c.fragment] = max(pins.get(c.fragment, c.base_version), c.base_version)

    def floor(self, live: Iterable[int], p: int, floor: int) -> int:
        """The lowest pin of fragment p among the ``live`` learners, at most ``floor``."""
        for m in live:
            floor = min(floor, self.pins.get(m, {}).get(p, floor))
        return floor

    def pend(self, c: Contribution, old: Contribution | None) -> None:
        """Push c waits in a round, superseding ``old`` (the learner's earlier push there)."""
        led = self.entries[c.learner]
        if old is not None:
            led.tokens_pending -= self.tokens(old)
        led.tokens_pending += self.tokens(c)

    def settle(self, contribs: list[Contribution], *, merged: bool) -> None:
        """A round closed: its pushes' tokens move from pending to merged/dropped."""
        for c in contribs:
            led = self.entries[c.learner]
            led.tokens_pending -= self.tokens(c)
            if merged:
                led.tokens_merged += self.tokens(c)
                led.pushes_merged += 1
            else:
                led.tokens_dropped += self.tokens(c)
                led.pushes_dropped += 1

    def state_dict(self) -> dict:
        """The ledger and the sequence numbers (as [learner, fragment, seq] rows): JSON."""
        return {
            "ledger": {m: vars_of(e) for m, e in self.entries.items()},
            "seen_seq": [[*k, v] for k, v in self.seen_seq.items()],
        }

    def load_state_dict(self, sd: dict) -> None:
        """Resume from a ``SyncerState.state_dict()``: pending tokens are zero (pending
        pushes are not saved); pins start again as learners join."""
        self.entries.clear()
        self.entries.update({int(m): LedgerEntry(**e) for m, e in sd["ledger"].items()})
        for e in self.entries.values():
            e.tokens_pending = 0
        seen = sd.get("seen_seq", [])  # rows, or (an earlier checkpoint) a dict
        rows = [[*k, v] for k, v in seen.items()] if isinstance(seen, dict) else seen
        self.seen_seq = {(int(m), int(p)): int(v) for m, p, v in rows}
