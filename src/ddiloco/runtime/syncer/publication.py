"""Publication: the merged fragments learners see (``Fetch``/``Watch``) and the merge
sequence numbers they are told.

``Publication`` owns, per fragment, the published version with its downlink bytes and its
fp32 tensors, the delta-coded downlink's reference chains and the copies learners hold of
them, the sequence numbers of every merge and of the published ones, the versions whose
publication failed (retried by the timer thread), and the condition ``Watch`` waits on.
Every call into it holds the server's lock."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.downlink import DeltaChain
from ddiloco.algorithm.syncer_state import Merged

__all__ = ["Publication"]

log = logging.getLogger("ddiloco.syncer")


class Publication:
    """What ``SyncerServer`` has published, and the delta-coded downlink's chains."""

    def __init__(
        self,
        lock: threading.Lock,
        counters: Counter,
        *,
        downlink_codec: str,
        downlink_delta: bool,
        max_staleness: int,
        owns: Callable[[int], bool],
    ) -> None:
        """``lock``: the server's, held by every call. ``counters``: the server's, where
        failed publications are counted. ``owns(p)``: whether this shard owns fragment p
        (another shard's fragments are never published here)."""
        self.counters = counters
        self.downlink_codec = downlink_codec
        self.downlink_delta = downlink_delta
        self.max_staleness = max_staleness
        self._owns = owns
        self.cv = threading.Condition(lock)
        """Notified on every publication (``Watch`` waits on it) and on close."""
        self.pub: list[tuple[int, list[memoryview]]] = []
        """Per fragment: (published version, its downlink bytes)."""
        self.theta: dict[int, list[torch.Tensor]] = {}
        """p -> the fp32 tensors of version ``pub[p][0]`` (never written again)."""
        self.chains: dict[int, DeltaChain] = {}
        """Delta-coded downlinks: p -> its reference chain (``ddiloco.algorithm.downlink``)."""
        self.held: dict[tuple[int, int], int] = {}
        """(learner, p) -> the version of the chain's copy of p that learner holds."""
        self.merged_seq: dict[int, dict[int, int]] = {}
        """m -> p -> the sequence number of m's latest push merged into p (all merges)."""
        self.merged_seq_pub: dict[int, dict[int, int]] = {}
        """The published part of ``merged_seq`` (replaced, never changed in place)."""
        self.retry: dict[int, Merged] = {}
        """Merged versions whose publication failed: retried by the timer thread."""

    def reset(self, P: int) -> None:  # noqa: N803
        """A model of P fragments, nothing published yet."""
        self.pub = [(0, []) for _ in range(P)]
        self.theta, self.chains, self.held = {}, {}, {}

    def versions(self) -> list[int]:
        """The published version of every fragment."""
        return [v for v, _ in self.pub]

    def encode_down(self, params: list[torch.Tensor]) -> list[memoryview]:
        """The downlink bytes of a fragment, as pieces to send one after the other (fp32:
        views of the published tensors themselves, which are never written again)."""
        return get_codec(self.downlink_codec).encode_many(params)

    def publish(self, p: int, version: int, params: list[torch.Tensor]) -> None:
        if not self._owns(p):
            return  # another shard's fragment
        self.pub[p] = (version, self.encode_down(params))
        self.theta[p] = params  # the published tensors: never written again
        if self.downlink_delta:
            chain = self.chains.get(p)
            if chain is None:  # the first version published here (an init or a resume)
                codec = get_codec(self.downlink_codec)
                self.chains[p] = DeltaChain(codec, params, version)
            else:
                chain.advance(version, params)
                self.trim_chain(p)

    def note_merged(self, mg: Merged) -> None:
        """The sequence numbers of the pushes merged into ``mg``."""
        for m, seq in zip(mg.learners, mg.seqs):
            self.merged_seq.setdefault(m, {})[mg.fragment] = seq

    def merged_seq_copy(self) -> dict[int, dict[int, int]]:
        return {m: dict(d) for m, d in self.merged_seq.items()}

    def publish_merged(self, mg: Merged, merged_seq: dict | None = None) -> bool:
        """Publish a merged version. A failure (out of memory while encoding) is counted
        and the version kept for a retry by the timer thread: the state machine has
        committed the merge, so it is published late, never lost. ``merged_seq``: the
        sequence numbers to publish with it (those of a checkpoint), else the current ones
        of its learners."""
        try:
            if mg.version > self.pub[mg.fragment][0]:
                self.publish(mg.fragment, mg.version, mg.params)
        except Exception as e:  # noqa: BLE001 - counted, logged and retried
            self.counters["publish_errors"] += 1
            self.retry[mg.fragment] = mg
            log.error(
                "publishing version %d of fragment %d failed (%s: %s): retrying",
                mg.version,
                mg.fragment,
                type(e).__name__,
                e,
            )
            return False
        self.retry.pop(mg.fragment, None)
        # copy on write: watchers hold the old mapping; only these learners' entries moved
        self.merged_seq_pub = (
            {m: dict(d) for m, d in merged_seq.items()}
            if merged_seq is not None
            else {**self.merged_seq_pub, **{m: dict(self.merged_seq[m]) for m in mg.learners}}
        )
        self.cv.notify_all()
        return True

    def retry_failed(self) -> None:
        """Publish the versions whose publication failed (the timer thread)."""
        for mg in list(self.retry.values()):
            self.publish_merged(mg)

    def restore(self, merged_seq: dict[int, dict[int, int]]) -> None:
        """A resume: the merge sequence numbers of the checkpoint, all published."""
        self.merged_seq = {m: dict(d) for m, d in merged_seq.items()}
        self.merged_seq_pub = self.merged_seq_copy()

    def trim_chain(self, p: int) -> None:
        """Keep the steps of fragment p's chain that a live learner's copy still needs, at
        most ``max_staleness`` of them (an older copy is replaced whole)."""
        chain = self.chains[p]
        held = [v for (_, q), v in self.held.items() if q == p]
        oldest = min(held, default=chain.version)
        chain.trim(max(oldest, chain.version - self.max_staleness))

    def forget_copies(self, m: int) -> None:
        """Learner m left or was declared dead: its copies no longer hold steps of the
        delta-coded downlink (a returning learner gets whole fragments again)."""
        for k in [k for k in self.held if k[0] == m]:
            del self.held[k]
        for p in list(self.chains):
            self.trim_chain(p)
