"""The syncer state machine: one implementation of the syncer's algorithm, driven by
events and an injected clock.

Per fragment p it holds the global tensors Theta_p, the outer momentum, the version, the
contributions pending in the current round and (optionally) a few past published
versions. It consumes events:

  ``submit(contribution, now_s)``   a learner's fragment arrived
  ``on_timer(p, now_s)``            a grace-window timer fired
  ``join(m)`` / ``leave(m, now_s)`` a learner became live / was declared dead
  ``observe_step_s`` / ``observe_sync_s``  timing observations for the EMAs

and returns decisions: ``Merged`` (a new version to broadcast) or ``WaitUntil`` (wake me at
t'). The real gRPC syncer drives it on the wall clock; the in-process engine on a virtual
clock.

Concurrency: the caller serialises events (the runtime holds a lock). The merge
arithmetic runs inside ``unlocked()``, which the runtime sets to a context that releases
that lock, so merges of different fragments proceed in parallel (torch releases the GIL).
A fragment being merged starts no second merge: pushes arriving meanwhile open its next
round, which is evaluated when the merge commits; what that produces is queued for the
caller in ``take_followups()``. Folding a push into its round (``_fold``) runs inside
``unlocked()`` too: the round does not merge while a fold runs, and a merge decided
meanwhile is made when the last fold ends (also a follow-up). With the default (no lock to
release) nothing interleaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ddiloco.algorithm.fragments import Fragmentation
from ddiloco.algorithm.history import FragmentHistory
from ddiloco.algorithm.ledger import Ledger, LedgerEntry
from ddiloco.algorithm.ledger import vars_of as vars_of  # importable from here too
from ddiloco.algorithm.merge import foldable
from ddiloco.algorithm.policy import MergeNow, QuorumGracePolicy, WaitUntil
from ddiloco.algorithm.round_merge import (
    FragmentState,
    Step,
    as_f32,
    fold_pushes,
    nbytes,
    open_folds,
    outer_step,
    round_weights,
    validate,
)
from ddiloco.algorithm.round_merge import distance as distance  # importable from here too
from ddiloco.algorithm.rounds import DROP, FOLDING, Contribution, Round, Rounds
from ddiloco.algorithm.syncer_config import ANCHORS as ANCHORS  # importable from here too
from ddiloco.algorithm.syncer_config import DEFAULT_NORM_CLIP, FINAL_MERGES, SyncerConfig

__all__ = [
    "SyncerConfig",
    "Contribution",
    "Status",
    "SubmitResult",
    "Merged",
    "SyncerState",
    "LedgerEntry",
    "DEFAULT_NORM_CLIP",
    "FINAL_MERGES",
]


class Status(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    STALE = "rejected-stale"
    FUTURE = "rejected-future"
    NO_BASE = "rejected-no-base"
    INVALID = "rejected-invalid"
    UNKNOWN_LEARNER = "rejected-unknown-learner"


@dataclass(frozen=True, slots=True)
class Merged:
    """A merge happened: broadcast ``params`` as version ``version`` of fragment ``fragment``."""

    fragment: int
    version: int
    params: list[torch.Tensor]
    learners: tuple[int, ...]
    weights: tuple[float, ...]
    reason: str
    at_s: float
    seqs: tuple[int, ...] = ()
    """The merged pushes' sequence numbers, in ``learners`` order."""
    clipped: tuple[int, ...] = ()
    """The learners whose outer gradient the merge guard scaled down (``norm_clip``)."""


@dataclass(frozen=True, slots=True)
class SubmitResult:
    status: Status
    message: str = ""
    target_version: int = -1
    """For an accepted push: the version that will contain it."""
    merged: Merged | None = None
    wake_at_s: float | None = None


class SyncerState:
    """Global fragments, outer optimizer state, versions, rounds and the token ledger.

    Composed of its parts: ``rounds`` (live learners, quorum and grace:
    ``ddiloco.algorithm.rounds``), ``books`` (the token ledger, sequence numbers and pins:
    ``ddiloco.algorithm.ledger``) and one ``FragmentState`` per fragment, which the merge's
    steps read and build (``ddiloco.algorithm.round_merge``)."""

    def __init__(
        self,
        fragmentation: Fragmentation,
        initial: dict[str, torch.Tensor],
        config: SyncerConfig | None = None,
        *,
        owned: set[int] | None = None,
        copy: bool = True,
    ) -> None:
        """``initial``: the model's tensors by name, copied; with ``copy=False`` its
        contiguous fp32 CPU tensors are taken as they are (the caller hands them over and
        never writes them). ``owned``: hold only these fragments (``initial`` may then lack
        the others)."""
        self.config = config or SyncerConfig()
        self.fragmentation = fragmentation
        self.rounds = Rounds(self.config.policy, self.config.final_merge)
        self.outer = self.config.outer_optimizer()
        missing = [
            n
            for p, f in enumerate(fragmentation.fragments)
            if owned is None or p in owned
            for n in f.names
            if n not in initial
        ]
        if missing:
            raise ValueError(f"initial parameters lack {len(missing)} tensors, e.g. {missing[:3]}")
        self.frags: list[FragmentState] = []
        for p, f in enumerate(fragmentation.fragments):
            if owned is not None and p not in owned:  # another shard's: no tensors here
                theta: list[torch.Tensor] = []
            else:
                theta = [as_f32(initial[n], copy) for n in f.names]
            self.frags.append(
                FragmentState(
                    theta=theta,
                    momentum=[torch.zeros_like(t) for t in theta],
                    history=FragmentHistory([t.shape for t in theta]),
                )
            )
        self.owned = owned
        """The fragments this state holds tensors of (a shard of a sharded syncer); None: all."""
        total = fragmentation.total_bytes
        self.books = Ledger([f.nbytes / total for f in fragmentation.fragments])
        self.merges = 0
        self.nonfinite_merges = 0
        self.clipped_pushes = 0
        """Pushes whose outer gradient the merge guard scaled down (``norm_clip``)."""
        self.carried_pushes = 0
        """Pushes that arrived after their learner's earlier push of the fragment was folded
        into a round, and so went to the next round (``FragmentState.carry``)."""
        self.quorum_sizes: list[int] = []
        self._f32_bytes = [4 * sum(t.numel() for t in s.theta) for s in self.frags]
        """A fragment's size in fp32: a round folds its pushes once their bytes exceed it."""
        self.unlocked: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """Context the merge arithmetic runs in (see the module docstring)."""
        self._followups: list[tuple[int, Merged | WaitUntil]] = []

    def take_followups(self) -> list[tuple[int, Merged | WaitUntil]]:
        """Decisions on rounds that filled while their fragment was being merged:
        (fragment, ``Merged`` or ``WaitUntil``), oldest first. Empty unless ``unlocked``
        releases a lock."""
        out, self._followups = self._followups, []
        return out

    # -- the parts' state, read through the state machine -------------------------------
    @property
    def live(self) -> set[int]:
        """The live learners (``Rounds.live``)."""
        return self.rounds.live

    @property
    def policy(self) -> QuorumGracePolicy:
        """The quorum/grace policy and its timing EMAs (``Rounds.policy``)."""
        return self.rounds.policy

    @property
    def ledger(self) -> dict[int, LedgerEntry]:
        """learner -> its token ledger (``Ledger.entries``)."""
        return self.books.entries

    # -- membership ---------------------------------------------------------------------
    def join(self, learner: int) -> None:
        self.rounds.join(learner)
        self.books.join(learner, self.versions())

    def leave(self, learner: int, now_s: float) -> list[Merged]:
        """Declare a learner dead. Its already-arrived contributions stay valid; rounds that
        were only waiting for it may now merge."""
        self.rounds.leave(learner)
        self.books.leave(learner)
        out = [self._evaluate(p, now_s) for p in range(len(self.frags))]
        return [m for m in out if isinstance(m, Merged)]

    @property
    def n_live(self) -> int:
        return len(self.live)

    # -- reads --------------------------------------------------------------------------
    def version(self, p: int) -> int:
        return self.frags[p].version

    def versions(self) -> list[int]:
        return [f.version for f in self.frags]

    def global_params(self) -> dict[str, torch.Tensor]:
        """The current global model (views of the syncer's tensors; copy before mutating)."""
        return {
            n: t
            for f, s in zip(self.fragmentation.fragments, self.frags)
            for n, t in zip(f.names, s.theta)
        }

    def published(self, p: int, version: int) -> list[torch.Tensor] | None:
        """Fragment p as published at ``version`` if still held: the current tensors
        themselves (never written), or new tensors rebuilt from the history."""
        s = self.frags[p]
        if version == s.version:
            return s.theta
        if not s.history.holds(version, s.version):
            return None
        return s.history.version(s.theta, version)

    def received(self, learner: int, p: int, seq: int) -> bool:
        """Push ``seq`` of fragment p from ``learner`` (or a later one) was submitted."""
        return self.books.received(learner, p, seq)

    def target_version(self, p: int) -> int:
        """The version a push of fragment p accepted now would be merged into."""
        s = self.frags[p]
        return s.version + 1 + int(s.merging)

    def holds(self, p: int, version: int) -> bool:
        """Version ``version`` of fragment p can be rebuilt (a delta push against it)."""
        s = self.frags[p]
        return s.history.holds(version, s.version)

    def largest_fragment_bytes(self) -> int:
        """The largest fragment this state holds, in fp32 bytes (0 before it holds any)."""
        return max(self._f32_bytes, default=0)

    def history_bytes(self) -> int:
        """Bytes held by every fragment's history (``ddiloco.algorithm.history``)."""
        return sum(s.history.nbytes for s in self.frags)

    def pending_bytes(self) -> int:
        """Bytes the open rounds hold: folds, pushes not yet folded, carried pushes."""
        total = 0
        for s in self.frags:
            r = s.round
            total += sum(f.nbytes for f in r.folds or ())
            held = [c for m, c in r.pending.items() if m not in r.folded]
            total += sum(nbytes(c.params) for c in [*held, *s.carry.values()])
        return total

    def _trim(self, p: int) -> None:
        """Let go of the versions of fragment p no push can name any more: older than the
        pins of its live learners and the bases of its pending pushes (and than ``history``
        versions back)."""
        s = self.frags[p]
        if len(s.history) and not s.merging and not s.round.folding:
            floor = self.books.floor(self.live, p, s.version)
            for c in [*s.round.pending.values(), *s.carry.values()]:
                floor = min(floor, c.base_version)
            keep = min(self.config.history, self.config.max_staleness)
            s.history.trim(max(floor, s.version - keep), keep)

    # -- timing -------------------------------------------------------------------------
    def observe_step_s(self, step_s: float) -> None:
        self.policy.xi_step.update(step_s)

    def observe_sync_s(self, sync_s: float) -> None:
        self.policy.xi_sync.update(sync_s)

    # -- events -------------------------------------------------------------------------
    def submit(
        self, c: Contribution, now_s: float, *, finite_checked: bool = False
    ) -> SubmitResult:
        """A contribution arrived. Validates, stages it in fragment p's round and decides.
        ``finite_checked``: the caller already rejected NaN/inf values (skips that pass)."""
        rejected = self._admit(c, finite_checked)
        if rejected is not None:
            return rejected
        s = self.frags[c.fragment]
        self.books.pin(c)
        r = s.round
        if c.learner in r.folded or c.learner in s.carry:
            # its earlier push is folded into a round and cannot be taken out: this one goes
            # to the round after that one (counters are cumulative since the last receipt)
            old = s.carry.get(c.learner)
            target = s.version + 2
            s.carry[c.learner] = c
            self.carried_pushes += 1
        else:
            if r.opened_s is None:
                r.opened_s = now_s
            # counters are cumulative since the last receipt: the newer push supersedes
            old = r.pending.get(c.learner)
            target = s.version + 1 + int(s.merging)
            r.pending[c.learner] = c
        self.books.pend(c, old)
        self._fold(c.fragment, now_s)
        self._trim(c.fragment)  # its pin moved: versions no push can name any more go
        if self.rounds.finish(c):
            # a finishing learner: final rounds of the fragments it will not push stop
            # waiting for it (decisions for the caller in ``take_followups``)
            for q, fq in enumerate(self.frags):
                if q != c.fragment and fq.round.pending and not fq.merging:
                    d = self._evaluate(q, now_s)
                    if d is not None:
                        self._followups.append((q, d))
        out = self._evaluate(c.fragment, now_s)
        if isinstance(out, Merged):
            return SubmitResult(Status.ACCEPTED, target_version=target, merged=out)
        return SubmitResult(
            Status.ACCEPTED,
            target_version=target,
            wake_at_s=out.at_s if isinstance(out, WaitUntil) else None,
        )

    def _admit(self, c: Contribution, finite_checked: bool) -> SubmitResult | None:
        """``submit``'s checks, in order: None when push c enters a round, else why not
        (counted in its learner's ledger)."""
        led = self.ledger.get(c.learner)
        if led is None or c.learner not in self.live:
            return SubmitResult(
                Status.UNKNOWN_LEARNER, f"learner {c.learner} has not joined (or was declared dead)"
            )
        err = validate(c, self.fragmentation, self.frags, self.owned, finite_checked)
        if err:
            led.pushes_rejected += 1
            return SubmitResult(Status.INVALID, err)
        key = (c.learner, c.fragment)
        if self.books.seen_seq.get(key, -1) >= c.seq:
            return SubmitResult(Status.DUPLICATE, f"push seq {c.seq} already received")
        s = self.frags[c.fragment]
        if c.base_version < 0:
            led.pushes_rejected += 1
            return SubmitResult(
                Status.NO_BASE,
                "learner has not installed a published version "
                "of this fragment; fetch the global parameters first",
            )
        if c.base_version > s.version:
            led.pushes_rejected += 1
            return SubmitResult(
                Status.FUTURE, f"base version {c.base_version} is ahead of the syncer's {s.version}"
            )
        self.books.seen_seq[key] = c.seq
        if s.version - c.base_version > self.config.max_staleness:
            self.books.drop(c)
            return SubmitResult(
                Status.STALE,
                f"base version {c.base_version} is "
                f"{s.version - c.base_version} behind (max {self.config.max_staleness})",
            )
        if (self.config.anchor == "base" or getattr(c.params, "delta", False)) and not self.holds(
            c.fragment, c.base_version
        ):
            self.books.drop(c)
            return SubmitResult(Status.STALE, f"base version {c.base_version} no longer held")
        return None

    def on_timer(self, p: int, now_s: float) -> Merged | WaitUntil | None:
        """A timer for fragment p fired. Merges if the round's grace window has expired
        (an earlier round's timer finds this round's own deadline still ahead)."""
        if not self.rounds.due(self.frags[p].round, now_s):
            return None
        return self._evaluate(p, now_s)

    def flush(self, now_s: float) -> list[Merged]:
        """Merge every round holding contributions, quorum or not (end of training); the
        pushes a merged round carried to the next one are merged after it."""
        merged: list[Merged] = []
        while todo := [p for p, s in enumerate(self.frags) if s.round.pending and not s.merging]:
            out = [self._merge(p, now_s, "flush") for p in todo]
            if not any(out):
                break
            merged += [m for m in out if m is not None]
        return merged

    # -- folding pushes into their round ------------------------------------------------
    def _fold(self, p: int, now_s: float) -> None:
        """Fold fragment p's round's pushes into one fp32 buffer per tensor once the bytes
        they hold exceed the fragment in fp32 (a round of a push or two merges them as they
        came), so that a round holds at most about one fragment whatever the number of
        learners. Not while the fragment merges: a push then belongs to the next round,
        whose anchor is the version being made. Final pushes stay whole (a round of final
        pushes only is their average, not an outer step).

        The caller folds the pushes it finds, inside ``unlocked()``: pushes of other callers
        fold at the same time (each tensor's sum is added to under the round's own lock), a
        newer push of a learner being folded goes to the carry, and a merge decided while
        any fold runs is made when the last one ends (``Round.wanted``; the decision goes
        to ``take_followups``). So a push's bytes are let go before its caller returns."""
        s = self.frags[p]
        r = s.round
        if s.merging or not foldable(self.config.merge_rule):
            return
        todo = [c for m, c in r.pending.items() if m not in r.folded and not c.final]
        if not todo:
            return
        if r.folds is None:
            if sum(nbytes(c.params) for c in todo) <= self._f32_bytes[p]:
                return
            r.folds = open_folds(self.config, s, self.fragmentation.fragments[p].embedding)
        for c in todo:
            r.folded[c.learner] = FOLDING
        r.folding += 1
        try:
            with self.unlocked():
                done = list(zip(todo, fold_pushes(self.config, s, r, todo)))
        finally:
            r.folding -= 1
        for c, guard in done:
            r.folded[c.learner] = guard
            r.pending[c.learner] = dataclasses.replace(c, params=())  # its bytes go
        if r.folding == 0 and r.wanted is not None:
            reason, r.wanted = r.wanted, None
            out = self._merge(p, now_s, reason)
            if out is not None:
                self._followups.append((p, out))

    def _take_carry(self, p: int, now_s: float) -> None:
        """Fragment p's round merged: the pushes it carried open the next one."""
        s = self.frags[p]
        r = s.round
        for m, c in s.carry.items():
            if m in r.pending:  # cannot happen (a push of m goes to the carry), kept safe
                self.ledger[m].tokens_pending -= self.books.tokens(c)
                continue
            if r.opened_s is None:
                r.opened_s = now_s
            r.pending[m] = c
        s.carry = {}
        self._fold(p, now_s)

    # -- deciding and merging -----------------------------------------------------------
    def _evaluate(self, p: int, now_s: float) -> Merged | WaitUntil | None:
        s = self.frags[p]
        d = self.rounds.decide(p, s.round, now_s)
        if d == DROP:
            r, s.round = s.round, Round()  # the final partial round is left out of the model
            self.books.settle([r.pending[m] for m in sorted(r.pending)], merged=False)
            return None
        if isinstance(d, MergeNow):
            return self._merge(p, now_s, d.reason)
        assert d is None or isinstance(d, WaitUntil)
        return d

    def _merge(self, p: int, now_s: float, reason: str) -> Merged | None:
        """Merge fragment p's round (the steps are ``round_merge``'s), commit the new
        version, and open the next round."""
        s = self.frags[p]
        if s.merging:
            return None  # evaluated again when the running merge commits
        if s.round.folding:
            s.round.wanted = reason  # made when the fold in progress ends
            return None
        r = s.round
        contribs = [r.pending[m] for m in sorted(r.pending)]
        weights, scale = round_weights(self.config, s, contribs, self.rounds.n_live(r))
        version0 = s.version
        s.round = Round()  # pushes arriving during the arithmetic open the next round
        s.merging = True
        try:
            with self.unlocked():
                embedding = self.fragmentation.fragments[p].embedding
                step = outer_step(
                    self.config, self.outer, s, r, contribs, weights, scale, embedding
                )
        finally:
            s.merging = False
        merged = None
        if not step.finite:
            # finite pushes can still overflow (a diverging learner): never publish inf/NaN
            self.books.settle(contribs, merged=False)
            self.nonfinite_merges += 1
        else:
            merged = self._commit(p, version0, step, contribs, weights, reason, now_s)
        self._next_round(p, now_s)
        return merged

    def _commit(
        self,
        p: int,
        version0: int,
        step: Step,
        contribs: list[Contribution],
        weights: list[float],
        reason: str,
        now_s: float,
    ) -> Merged:
        """The merge's new tensors become version ``version0 + 1`` of fragment p."""
        s = self.frags[p]
        if self.config.history > 0:
            s.history.append(version0, step.steps)
        s.theta, s.momentum = step.theta, step.momentum
        s.version += 1
        self._trim(p)
        self.books.settle(contribs, merged=True)
        self.merges += 1
        self.quorum_sizes.append(len(contribs))
        s.norms.extend(n * f for n, f in zip(step.norms, step.factors))
        clipped = tuple(c.learner for c, f in zip(contribs, step.factors) if f < 1.0)
        self.clipped_pushes += len(clipped)
        return Merged(
            fragment=p,
            version=s.version,
            params=list(s.theta),
            learners=tuple(c.learner for c in contribs),
            weights=tuple(weights),
            reason=reason,
            at_s=now_s,
            seqs=tuple(c.seq for c in contribs),
            clipped=clipped,
        )

    def _next_round(self, p: int, now_s: float) -> None:
        """After a merge: the carried pushes, or those that arrived meanwhile, fold into the
        next round, which is evaluated (its decision goes to ``take_followups``)."""
        s = self.frags[p]
        if s.carry:
            self._take_carry(p, now_s)
        else:
            self._fold(p, now_s)  # pushes that arrived during the merge
        if s.round.pending:  # arrived while the lock was released
            nxt = self._evaluate(p, now_s)
            if nxt is not None:
                self._followups.append((p, nxt))

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume: global fragments, momentum, versions, ledger.

        ``theta`` and ``momentum`` hold the current tensors themselves, not copies (new
        lists, one per fragment). That is safe because this state never writes a theta or
        momentum tensor in place: every merge builds new tensors and swaps them into the
        per-fragment lists (the published theta is shared with readers for the same
        reason). So a checkpoint taken under the caller's lock can be written outside it
        while merges go on, and costs no model-sized copy. Keep that invariant.

        Pending (unmerged) contributions are not saved: their learners re-push. Every
        other value is JSON (``seen_seq`` as [learner, fragment, seq] rows)."""
        books = self.books.state_dict()
        return {
            "theta": [list(s.theta) for s in self.frags],
            "momentum": [list(s.momentum) for s in self.frags],
            "versions": self.versions(),
            "ledger": books["ledger"],
            "merges": self.merges,
            "seen_seq": books["seen_seq"],
        }

    def load_state_dict(self, sd: dict) -> None:
        """Resume from ``state_dict()``. Its fp32 contiguous tensors are taken over, not
        copied (hand over tensors nobody else writes); ``sd["theta"]`` and
        ``sd["momentum"]`` are read fragment by fragment, in order, so they may be
        sequences that load each fragment when it is taken."""
        if len(sd["theta"]) != len(self.frags):
            raise ValueError(
                f"checkpoint has {len(sd['theta'])} fragments, syncer has {len(self.frags)}"
            )
        for s, th, mo, v in zip(self.frags, sd["theta"], sd["momentum"], sd["versions"]):
            if [tuple(t.shape) for t in th] != [tuple(t.shape) for t in s.theta]:
                raise ValueError("checkpoint tensor shapes do not match the model")
            s.theta = [as_f32(t, copy=False) for t in th]
            s.momentum = [as_f32(t, copy=False) for t in mo]
            s.version = int(v)
            s.history = FragmentHistory([t.shape for t in s.theta])
            s.round = Round()
            s.carry = {}
        self.books.load_state_dict(sd)
        self.merges = int(sd["merges"])


def fragment_tensors(params: dict[str, torch.Tensor], names: Sequence[str]) -> list[torch.Tensor]:
    return [params[n] for n in names]
