"""Rounds, quorum and grace: the syncer policy's state.

A push of fragment p (a ``Contribution``) waits in p's open ``Round`` until the round
merges. ``Rounds`` holds what decides when: the live learners, the learners finishing
(their final pushes), and the quorum/grace policy (``ddiloco.algorithm.policy``: quorum K,
grace window gamma * xi with its timing EMAs). ``Rounds.decide`` reads a round and says
whether it merges now, waits until a deadline, waits for more pushes, or (a final round
with ``final_merge = "none"``) is dropped. The merge itself is
``ddiloco.algorithm.round_merge``'s; the state machine (``ddiloco.algorithm.syncer_state``)
acts on the decision.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ddiloco.algorithm.merge import Fold
from ddiloco.algorithm.policy import (
    MergeNow,
    PolicyConfig,
    QuorumGracePolicy,
    WaitForMore,
    WaitUntil,
)

__all__ = ["Contribution", "Round", "Rounds", "DROP", "FOLDING"]


@dataclass(slots=True)
class Contribution:
    """Learner m's fragment p: its current parameters and counters since it last received p."""

    learner: int
    fragment: int
    params: Sequence[torch.Tensor]
    """theta_{m,p}: one tensor per fragment tensor, in fragment order. An ``EncodedParams``
    is kept encoded until its round merges or folds it (``_fold``); with ``delta`` it holds
    theta_{m,p} minus the learner's copy of version ``base_version``, which the syncer adds
    back."""
    c_steps: int
    c_tokens: int
    base_version: int
    """Version of Theta_p the learner last installed (-1: never installed one)."""
    seq: int = 0
    """Per-learner push sequence number; a retried push (same seq) is merged at most once."""
    final: bool = False
    """Sent as the learner finishes (its last push of p). A round holding a final push waits
    for every live learner that will push p; when all its pushes are final the global
    fragment becomes their token-weighted average (the end of training: no outer step)."""
    final_fragments: tuple[int, ...] = ()
    """With ``final``: every fragment this learner sends a final push of (it sends nothing
    more for the others, so final rounds of those do not wait for it)."""


FOLDING = (math.nan, 1.0)
"""``Round.folded``'s entry of a push being folded."""


@dataclass(slots=True)
class Round:
    pending: dict[int, Contribution] = field(default_factory=dict)
    """learner -> its push; a folded push keeps its counters and versions, not its bytes."""
    opened_s: float | None = None
    quorum_s: float | None = None
    deadline_s: float | None = None
    folds: list[Fold] | None = None
    """The folded pushes' running merge, one ``Fold`` per tensor (see ``SyncerState._fold``)."""
    folded: dict[int, tuple[float, float]] = field(default_factory=dict)
    """learner -> (norm of its outer gradient, the merge guard's factor) of a folded push
    (``FOLDING`` while it is being folded)."""
    norms: dict[int, float] = field(default_factory=dict)
    """learner -> the outer-gradient norm of its push, measured before it is folded: the
    merge guard compares each push with the others of its round (``merge.clip_factor``)."""
    folding: int = 0
    """Callers folding pushes into the round (outside the caller's lock): it does not
    merge meanwhile."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while a push's tensor is added to the folds (``Fold.add``)."""
    wanted: str | None = None
    """A merge decided while the round was folding (its reason): made when the fold ends."""


DROP = "drop"
"""``Rounds.decide``: the round is left out of the model (a final round, ``final_merge =
"none"``)."""


class Rounds:
    """The live learners, the finishing ones and the quorum/grace policy: when a round
    merges."""

    def __init__(self, policy: PolicyConfig, final_merge: str) -> None:
        self.policy = QuorumGracePolicy(policy)
        self.final_merge = final_merge
        """How a round of final pushes only is merged (``SyncerConfig.final_merge``)."""
        self.live: set[int] = set()
        self.finishing: dict[int, frozenset[int]] = {}
        """learner -> the fragments of its final pushes."""

    def join(self, learner: int) -> None:
        self.live.add(learner)
        self.finishing.pop(learner, None)

    def leave(self, learner: int) -> None:
        self.live.discard(learner)
        self.finishing.pop(learner, None)

    def finish(self, c: Contribution) -> bool:
        """A final push: note every fragment its learner sends a final push of (final rounds
        of the others stop waiting for it). True the first time for that learner."""
        if not c.final or c.learner in self.finishing:
            return False
        self.finishing[c.learner] = frozenset(c.final_fragments) | {c.fragment}
        return True

    def n_live(self, r: Round) -> int:
        """Live learners for round r: learners declared dead after pushing still count as
        arrived."""
        return len(self.live | set(r.pending))

    def due(self, r: Round, now_s: float) -> bool:
        """A timer fired at ``now_s``: round r has pushes and no later deadline of its own."""
        if not r.pending:
            return False
        return r.deadline_s is None or now_s >= r.deadline_s

    def decide(self, p: int, r: Round, now_s: float) -> MergeNow | WaitUntil | str | None:
        """What fragment p's round r does at ``now_s``: ``MergeNow`` (with its reason),
        ``WaitUntil`` (a deadline to set a timer for; noted in the round), ``DROP`` or None
        (wait for more pushes, or the round's timer is already set)."""
        if not r.pending:
            return None
        n_live = max(1, self.n_live(r))
        if any(c.final for c in r.pending.values()):
            # the last round of a finishing learner gathers every live learner, so that the
            # final global model holds everyone's last steps at full weight (a K = 1 merge would
            # take 1 / n_live of one learner's last progress)
            waiting = [m for m in self.live - set(r.pending) if p in self.finishing.get(m, (p,))]
            if waiting:
                return None
            if self.final_merge == "none" and all(c.final for c in r.pending.values()):
                return DROP
            return MergeNow("final")
        if r.quorum_s is None and len(r.pending) >= self.policy.effective_quorum(n_live):
            r.quorum_s = now_s
            self.policy.xi_quorum.update(now_s - (r.opened_s if r.opened_s is not None else now_s))
        if r.deadline_s is not None and now_s >= r.deadline_s:
            return MergeNow("grace-expired")
        d = self.policy.decide(
            now_s=now_s, n_arrived=len(r.pending), n_live=n_live, quorum_at_s=r.quorum_s
        )
        if isinstance(d, WaitForMore):
            return None
        if isinstance(d, WaitUntil):
            if r.deadline_s is not None:
                return None  # the round's timer is already set
            r.deadline_s = d.at_s
        return d
