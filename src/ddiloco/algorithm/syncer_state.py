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
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ddiloco.algorithm.fragments import Fragmentation
from ddiloco.algorithm.history import FragmentHistory
from ddiloco.algorithm.merge import (
    MERGE_RULES,
    NORM_WINDOW,
    Fold,
    OuterNesterov,
    all_finite,
    clip_bound,
    fold_for,
    foldable,
    merge_tensor,
    token_weight,
)
from ddiloco.algorithm.payload import EncodedParams
from ddiloco.algorithm.policy import (
    MergeNow,
    PolicyConfig,
    QuorumGracePolicy,
    WaitForMore,
    WaitUntil,
)
from ddiloco.algorithm.slices import SlicedParams

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

ANCHORS = ("current", "base")
FINAL_MERGES = ("average", "nesterov", "sgd", "none")
"""How the last, partial round of a run is merged (``SyncerConfig.final_merge``; the
synchronous baselines take the same setting)."""
_OUTER = OuterNesterov()
"""The outer optimizer's declared defaults (lr, momentum)."""
DEFAULT_NORM_CLIP = 2.5
"""The merge guard's default bound, in medians (docs/results/reliability.md: it clipped no
push of the default run nor of ``--preset failures``, and halved a wild learner's damage)."""


@dataclass(kw_only=True, slots=True)
class SyncerConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Quorum K, grace window (gamma, tau)."""
    merge_rule: str = "rda"
    """``rda`` (radial-directional, embeddings averaged) or ``average`` (plain weighted)."""
    outer_lr: float = _OUTER.lr
    """Outer Nesterov SGD learning rate."""
    outer_momentum: float = _OUTER.momentum
    """Outer Nesterov SGD momentum."""
    max_staleness: int = 16
    """A push whose base version is more than this many versions behind is dropped."""
    staleness_discount: float = 1.0
    """Weight factor per version of staleness: a push based on version v of a fragment now
    at version V enters the merge with weight ``tokens * staleness_discount ** (V - v)``,
    and the round's outer step is scaled by its token-weighted mean discount. 1.0 weighs stale work like fresh work (up to ``max_staleness``); below 1 discounts the
    work of a learner that was paused or slow (docs/results/reliability.md measures it)."""
    anchor: str = "current"
    """Outer gradient anchor: ``current`` global fragment (paper) or the learner's ``base``."""
    history: int = 0
    """Past published versions kept at most per fragment (needed for ``anchor='base'`` and
    for reconstructing delta-encoded pushes), compactly and only while a learner can still
    push against them (``ddiloco.algorithm.history``). 0 keeps none beyond the current one."""
    scale_partial: bool = True
    """Scale the outer gradient of a round that merges k of n live learners by k/n, so that
    asynchronous small merges add up to about one outer step per round (with K = M or all
    learners present the factor is 1)."""
    final_merge: str = "average"
    """How a round of learners' final pushes (their last partial round, as they finish) is
    merged (``FINAL_MERGES``): ``average`` (the global fragment becomes their token-weighted
    average, no outer step, momentum untouched), ``nesterov`` (a regular outer step),
    ``sgd`` (the outer step without momentum: ``Theta - outer_lr * Delta``) or ``none``
    (the final pushes are dropped)."""
    norm_clip: float = DEFAULT_NORM_CLIP
    """Merge guard: an outer gradient Delta_{m,p} whose norm exceeds ``norm_clip`` times the
    median norm of fragment p's last ``NORM_WINDOW`` merged ones is scaled down to that bound
    before it is merged (a wild learner moves the model at most that far); 0 turns it off.
    It acts once the fragment has merged ``NORM_MIN_HISTORY`` pushes; a clipped push enters
    the median at its bound, so a lasting change of scale is followed."""

    def __post_init__(self) -> None:
        if self.merge_rule not in MERGE_RULES:
            raise ValueError(f"merge_rule must be one of {MERGE_RULES}, got {self.merge_rule!r}")
        if self.anchor not in ANCHORS:
            raise ValueError(f"anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if not 0.0 < self.staleness_discount <= 1.0:
            raise ValueError(f"staleness_discount must be in (0, 1], got {self.staleness_discount}")
        if self.history < 0:
            raise ValueError(f"history must be >= 0, got {self.history}")
        if self.norm_clip != 0 and not 1.0 <= self.norm_clip < float("inf"):
            raise ValueError(f"norm_clip must be 0 (off) or >= 1, got {self.norm_clip}")
        if self.final_merge not in FINAL_MERGES:
            raise ValueError(f"final_merge must be one of {FINAL_MERGES}, got {self.final_merge!r}")
        if self.anchor == "base" and self.history < self.max_staleness:
            self.history = self.max_staleness
        self.outer_optimizer()  # validates

    def outer_optimizer(self, final: str | None = None) -> OuterNesterov:
        """The outer optimizer of every method (DiLoCo, Streaming, Decoupled): Nesterov SGD
        at ``outer_lr`` and ``outer_momentum``; for a final round merged ``sgd``
        (``final_merge``), the same step without momentum."""
        momentum = 0.0 if final == "sgd" else self.outer_momentum
        return OuterNesterov(lr=self.outer_lr, momentum=momentum)


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


@dataclass(slots=True)
class _Round:
    pending: dict[int, Contribution] = field(default_factory=dict)
    """learner -> its push; a folded push keeps its counters and versions, not its bytes."""
    opened_s: float | None = None
    quorum_s: float | None = None
    deadline_s: float | None = None
    folds: list[Fold] | None = None
    """The folded pushes' running merge, one ``Fold`` per tensor (see ``_fold``)."""
    folded: dict[int, tuple[float, float]] = field(default_factory=dict)
    """learner -> (norm of its outer gradient, the merge guard's factor) of a folded push
    (``_FOLDING`` while it is being folded)."""
    folding: int = 0
    """Callers folding pushes into the round (outside the caller's lock): it does not
    merge meanwhile."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while a push's tensor is added to the folds (``Fold.add``)."""
    wanted: str | None = None
    """A merge decided while the round was folding (its reason): made when the fold ends."""


@dataclass(slots=True)
class _FragmentState:
    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    history: FragmentHistory
    version: int = 0
    round: _Round = field(default_factory=_Round)
    merging: bool = False  # its merge arithmetic is running (outside the caller's lock)
    norms: deque = field(default_factory=lambda: deque(maxlen=NORM_WINDOW))
    """Norms of the last merged outer gradients (the merge guard's statistic)."""
    carry: dict[int, Contribution] = field(default_factory=dict)
    """Pushes of learners whose earlier push of this fragment is already folded into a round
    (a folded push cannot be taken out again): each enters the round after that one, as a
    push arriving during a merge does."""


class SyncerState:
    """Global fragments, outer optimizer state, versions, rounds and the token ledger."""

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
        self.policy = QuorumGracePolicy(self.config.policy)
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
        self.frags: list[_FragmentState] = []
        for p, f in enumerate(fragmentation.fragments):
            if owned is not None and p not in owned:  # another shard's: no tensors here
                theta: list[torch.Tensor] = []
            else:
                theta = [_as_f32(initial[n], copy) for n in f.names]
            self.frags.append(
                _FragmentState(
                    theta=theta,
                    momentum=[torch.zeros_like(t) for t in theta],
                    history=FragmentHistory([t.shape for t in theta]),
                )
            )
        self.owned = owned
        """The fragments this state holds tensors of (a shard of a sharded syncer); None: all."""
        self.live: set[int] = set()
        self._pins: dict[int, dict[int, int]] = {}
        """learner -> fragment -> the oldest version it can still push against."""
        self.ledger: dict[int, LedgerEntry] = {}
        self._seen_seq: dict[tuple[int, int], int] = {}
        self.merges = 0
        self.nonfinite_merges = 0
        self.clipped_pushes = 0
        self.carried_pushes = 0
        """Pushes that arrived after their learner's earlier push of the fragment was folded
        into a round, and so went to the next round (``_FragmentState.carry``)."""
        """Pushes whose outer gradient the merge guard scaled down (``norm_clip``)."""
        self.quorum_sizes: list[int] = []
        total = fragmentation.total_bytes
        self._share = [f.nbytes / total for f in fragmentation.fragments]
        self._f32_bytes = [4 * sum(t.numel() for t in s.theta) for s in self.frags]
        """A fragment's size in fp32: a round folds its pushes once their bytes exceed it."""
        self.unlocked: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """Context the merge arithmetic runs in (see the module docstring)."""
        self._followups: list[tuple[int, Merged | WaitUntil]] = []
        self._finishing: dict[int, frozenset[int]] = {}  # learner -> fragments of its final pushes

    def take_followups(self) -> list[tuple[int, Merged | WaitUntil]]:
        """Decisions on rounds that filled while their fragment was being merged:
        (fragment, ``Merged`` or ``WaitUntil``), oldest first. Empty unless ``unlocked``
        releases a lock."""
        out, self._followups = self._followups, []
        return out

    # -- membership ---------------------------------------------------------------------
    def join(self, learner: int) -> None:
        self.live.add(learner)
        self.ledger.setdefault(learner, LedgerEntry())
        self._finishing.pop(learner, None)
        # it installs what it fetches from now on: at least the current versions
        self._pins[learner] = {p: s.version for p, s in enumerate(self.frags)}

    def leave(self, learner: int, now_s: float) -> list[Merged]:
        """Declare a learner dead. Its already-arrived contributions stay valid; rounds that
        were only waiting for it may now merge."""
        self.live.discard(learner)
        self._finishing.pop(learner, None)
        self._pins.pop(learner, None)
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
        return self._seen_seq.get((learner, p), -1) >= seq

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

    def _floor(self, p: int) -> int:
        """The oldest version of fragment p a push can still name: the pins of its live
        learners and the bases of its pending pushes."""
        s = self.frags[p]
        floor = s.version
        for m in self.live:
            floor = min(floor, self._pins.get(m, {}).get(p, floor))
        for c in [*s.round.pending.values(), *s.carry.values()]:
            floor = min(floor, c.base_version)
        return floor

    def _trim(self, p: int) -> None:
        s = self.frags[p]
        if len(s.history) and not s.merging and not s.round.folding:
            keep = min(self.config.history, self.config.max_staleness)
            s.history.trim(max(self._floor(p), s.version - keep), keep)

    def _tokens(self, c: Contribution) -> float:
        """A push's tokens in the ledger: its counter times the fragment's byte share."""
        return c.c_tokens * self._share[c.fragment]

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
        led = self.ledger.get(c.learner)
        if led is None or c.learner not in self.live:
            return SubmitResult(
                Status.UNKNOWN_LEARNER, f"learner {c.learner} has not joined (or was declared dead)"
            )
        err = self._validate(c, finite_checked)
        if err:
            led.pushes_rejected += 1
            return SubmitResult(Status.INVALID, err)
        key = (c.learner, c.fragment)
        if self._seen_seq.get(key, -1) >= c.seq:
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
        self._seen_seq[key] = c.seq
        if s.version - c.base_version > self.config.max_staleness:
            led.pushes_dropped += 1
            led.tokens_dropped += self._tokens(c)
            return SubmitResult(
                Status.STALE,
                f"base version {c.base_version} is "
                f"{s.version - c.base_version} behind (max {self.config.max_staleness})",
            )
        if (self.config.anchor == "base" or getattr(c.params, "delta", False)) and not self.holds(
            c.fragment, c.base_version
        ):
            led.pushes_dropped += 1
            led.tokens_dropped += self._tokens(c)
            return SubmitResult(Status.STALE, f"base version {c.base_version} no longer held")
        pins = self._pins.setdefault(c.learner, {})
        pins[c.fragment] = max(pins.get(c.fragment, c.base_version), c.base_version)
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
        if old is not None:
            led.tokens_pending -= self._tokens(old)
        led.tokens_pending += self._tokens(c)
        self._fold(c.fragment, now_s)
        self._trim(c.fragment)  # its pin moved: versions no push can name any more go
        if c.final and c.learner not in self._finishing:
            # a finishing learner: final rounds of the fragments it will not push stop
            # waiting for it (decisions for the caller in ``take_followups``)
            self._finishing[c.learner] = frozenset(c.final_fragments) | {c.fragment}
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

    def on_timer(self, p: int, now_s: float) -> Merged | WaitUntil | None:
        """A timer for fragment p fired. Merges if the round's grace window has expired."""
        r = self.frags[p].round
        if not r.pending:
            return None
        if r.deadline_s is not None and now_s < r.deadline_s:
            return None  # an earlier round's timer; this round's timer is still pending
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
    def pending_bytes(self) -> int:
        """Bytes the open rounds hold: folds, pushes not yet folded, carried pushes."""
        total = 0
        for s in self.frags:
            r = s.round
            total += sum(f.nbytes for f in r.folds or ())
            held = [c for m, c in r.pending.items() if m not in r.folded]
            total += sum(_nbytes(c.params) for c in [*held, *s.carry.values()])
        return total

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
        any fold runs is made when the last one ends (``_Round.wanted``; the decision goes
        to ``take_followups``). So a push's bytes are let go before its caller returns."""
        s = self.frags[p]
        r = s.round
        if s.merging or not foldable(self.config.merge_rule):
            return
        todo = [c for m, c in r.pending.items() if m not in r.folded and not c.final]
        if not todo:
            return
        if r.folds is None:
            if sum(_nbytes(c.params) for c in todo) <= self._f32_bytes[p]:
                return
            embedding = self.fragmentation.fragments[p].embedding
            r.folds = [
                cast_fold(fold_for(self.config.merge_rule, embedding[j], t.shape))
                for j, t in enumerate(s.theta)
            ]
        for c in todo:
            r.folded[c.learner] = _FOLDING
        r.folding += 1
        try:
            with self.unlocked():
                done = [(c, self._fold_push(p, r, c)) for c in todo]
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

    def _fold_push(self, p: int, r: _Round, c: Contribution) -> tuple[float, float]:
        """Add push c's outer gradient, after the merge guard, to round r's folds; returns
        its norm and the guard's factor. The anchor, the guard's bound and the staleness discount are the
        ones its merge would use: the fragment does not change until its round merges
        (which waits for a fold in progress)."""
        s = self.frags[p]
        assert r.folds is not None
        if (
            isinstance(c.params, EncodedParams)
            and not c.params.delta
            and c.params.codec.element_bytes is not None
        ):
            return self._fold_pieces(p, r, c)
        norm = self._push_norm(p, c) if self.config.norm_clip > 0 else 0.0
        factor = self._guard_factor(s, norm)
        w = self._weight(s, c)
        # an encoded push is read into new tensors that nobody else reads (the push is
        # consumed here): each becomes its outer gradient in place
        owned = isinstance(c.params, (EncodedParams, SlicedParams))
        for j, fold in enumerate(r.folds):
            x = self._pushed(p, c, j)
            if owned and x.dtype == torch.float32 and x.is_contiguous():
                v = torch.sub(self._anchor(p, c, j), x, out=x)
            else:
                v = torch.sub(self._anchor(p, c, j), x.float())
            del x
            if factor < 1.0:
                v.mul_(factor) if factor > 0 else v.zero_()
            with r.lock:
                fold.add(v, w)
        return norm, factor

    def _fold_pieces(self, p: int, r: _Round, c: Contribution) -> tuple[float, float]:
        """``_fold_push`` of a push whose tensors decode a piece at a time (fp32, bf16
        parameters): two passes over each tensor's pieces, its norm, then the sum, so that
        folding holds one piece of the push decoded, not a tensor."""
        s = self.frags[p]
        assert r.folds is not None and isinstance(c.params, EncodedParams)
        anchors = [self._anchor(p, c, j).reshape(-1) for j in range(len(s.theta))]
        norms = [
            math.sqrt(
                sum(distance([a[o : o + x.numel()]], [x]) ** 2 for o, x in c.params.chunks(j))
            )
            for j, a in enumerate(anchors)
        ]
        norm = math.sqrt(sum(n * n for n in norms))
        factor = self._guard_factor(s, norm)
        w = self._weight(s, c)
        for j, (fold, a) in enumerate(zip(r.folds, anchors)):
            with r.lock:
                fold.add_pieces(a, c.params.chunks(j), w, norms[j], factor)
        return (norm if self.config.norm_clip > 0 else 0.0), factor

    def _push_norm(self, p: int, c: Contribution) -> float:
        """``|Delta_{m,p}|`` of push c over its fragment's tensors."""
        return math.sqrt(
            sum(
                distance([self._anchor(p, c, j)], [self._pushed(p, c, j)]) ** 2
                for j in range(len(self.frags[p].theta))
            )
        )

    def _guard_factor(self, s: _FragmentState, norm: float) -> float:
        """The merge guard's scale for an outer gradient of ``norm``: 1, or its bound over
        the norm (0 when the norm overflowed)."""
        bound = clip_bound(s.norms, self.config.norm_clip)
        return bound / norm if bound is not None and norm > bound else 1.0

    def _weight(self, s: _FragmentState, c: Contribution) -> float:
        """A push's merge weight: its token weight times the staleness discount."""
        decay = self.config.staleness_discount ** max(0, s.version - c.base_version)
        return token_weight(c.c_tokens, c.c_steps) * decay

    def _take_carry(self, p: int, now_s: float) -> None:
        """Fragment p's round merged: the pushes it carried open the next one."""
        s = self.frags[p]
        r = s.round
        for m, c in s.carry.items():
            if m in r.pending:  # cannot happen (a push of m goes to the carry), kept safe
                self.ledger[m].tokens_pending -= self._tokens(c)
                continue
            if r.opened_s is None:
                r.opened_s = now_s
            r.pending[m] = c
        s.carry = {}
        self._fold(p, now_s)

    def _evaluate(self, p: int, now_s: float) -> Merged | WaitUntil | None:
        s = self.frags[p]
        r = s.round
        if not r.pending:
            return None
        # learners declared dead after pushing still count as arrived
        n_live = max(1, len(self.live | set(r.pending)))
        if any(c.final for c in r.pending.values()):
            # the last round of a finishing learner gathers every live learner, so that the
            # final global model holds everyone's last steps at full weight (a K = 1 merge would
            # take 1 / n_live of one learner's last progress)
            waiting = [m for m in self.live - set(r.pending) if p in self._finishing.get(m, (p,))]
            if waiting:
                return None
            if self.config.final_merge == "none" and all(c.final for c in r.pending.values()):
                s.round = _Round()  # the final partial round is left out of the model
                self._settle([r.pending[m] for m in sorted(r.pending)], merged=False)
                return None
            return self._merge(p, now_s, "final")
        if r.quorum_s is None and len(r.pending) >= self.policy.effective_quorum(n_live):
            r.quorum_s = now_s
            self.policy.xi_quorum.update(now_s - (r.opened_s if r.opened_s is not None else now_s))
        if r.deadline_s is not None and now_s >= r.deadline_s:
            d = MergeNow("grace-expired")
        else:
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
        return self._merge(p, now_s, d.reason)

    def _merge(self, p: int, now_s: float, reason: str) -> Merged | None:
        s = self.frags[p]
        if s.merging:
            return None  # evaluated again when the running merge commits
        if s.round.folding:
            s.round.wanted = reason  # made when the fold in progress ends
            return None
        frag = self.fragmentation.fragments[p]
        r = s.round
        contribs = [r.pending[m] for m in sorted(r.pending)]
        raw_w = [token_weight(c.c_tokens, c.c_steps) for c in contribs]
        weights = [self._weight(s, c) for c in contribs]
        n_live = max(len(contribs), len(self.live | set(s.round.pending)))
        scale = 1.0
        if self.config.scale_partial and len(contribs) < n_live:
            # a round merging some of the live learners takes that share of an outer step, so
            # that asynchronous single-learner merges add up to about one step per round
            scale = len(contribs) / n_live
        if self.config.staleness_discount < 1.0:
            # stale work also moves the model less: the step shrinks by the round's
            # token-weighted discount (a lone stale push is not renormalised back to 1)
            scale *= sum(weights) / sum(raw_w)
        theta0, momentum0, version0 = s.theta, s.momentum, s.version
        s.round = _Round()  # pushes arriving during the arithmetic open the next round
        s.merging = True
        k = self.config.norm_clip
        factors = [1.0] * len(contribs)
        norms: list[float] = []
        record = self.config.history > 0
        theta: list[torch.Tensor] = []
        momentum: list[torch.Tensor] = []
        steps: list[bytearray] = []
        finite = True
        try:
            with self.unlocked():
                # tensor by tensor: a fragment's pushes are read (decoded) one tensor at a time
                # and the new tensors are built beside the published ones, which are never
                # written (Merged shares them), so a merge holds one tensor of each push
                folds = None
                if r.folds is not None:  # a folded round: fold the rest, step from the folds
                    for c in contribs:
                        if c.learner not in r.folded:
                            r.folded[c.learner] = self._fold_push(p, r, c)
                    folds, r.folds = r.folds, None
                    factors = [r.folded[c.learner][1] for c in contribs]
                    if k > 0:
                        norms = [r.folded[c.learner][0] for c in contribs]
                elif k > 0:  # the merge guard: clip an outer gradient far above the recent ones
                    norms = [self._push_norm(p, c) for c in contribs]
                    factors = [self._guard_factor(s, n) for n in norms]
                final = self.config.final_merge if all(c.final for c in contribs) else None
                all_final = final == "average"
                outer = self.outer
                if final == "sgd":  # the outer gradient's own step, no momentum
                    outer = self.config.outer_optimizer(final)
                for j in range(len(theta0)):
                    if folds is not None:
                        g = folds[j].take()
                        t, b, fin = self.outer.stepped_into(theta0[j], momentum0[j], g, scale)
                        th, mo = [t], [b]
                    elif all_final:
                        t = _average(
                            [[self._clipped(p, c, j, f)] for c, f in zip(contribs, factors)],
                            weights,
                        )[0]
                        th, mo, fin = [t], [momentum0[j]], all_finite(t)
                    elif len(contribs) == 1:  # the merged outer gradient is the push's own
                        c = contribs[0]
                        th, mo, fin = outer.stepped_checked(
                            [theta0[j]],
                            [momentum0[j]],
                            scale,
                            anchors=[self._anchor(p, c, j)],
                            pushes=[self._clipped(p, c, j, factors[0])],
                        )
                    else:
                        deltas = _Deltas(self, p, j, contribs, factors)
                        update = merge_tensor(
                            deltas, weights, frag.embedding[j], self.config.merge_rule
                        )
                        th, mo, fin = outer.stepped_checked(
                            [theta0[j]], [momentum0[j]], scale, grads=[update]
                        )
                    finite = finite and fin
                    if not finite:
                        break
                    theta += th
                    momentum += mo
                    if record:
                        steps.append(s.history.encode_step(theta0[j], th[0]))
        finally:
            s.merging = False
        merged = None
        if not finite:
            # finite pushes can still overflow (a diverging learner): never publish inf/NaN
            self._settle(contribs, merged=False)
            self.nonfinite_merges += 1
        else:
            if record:
                s.history.append(version0, steps)
            s.theta, s.momentum = theta, momentum
            s.version += 1
            self._trim(p)
            self._settle(contribs, merged=True)
            self.merges += 1
            self.quorum_sizes.append(len(contribs))
            s.norms.extend(n * f for n, f in zip(norms, factors))
            clipped = tuple(c.learner for c, f in zip(contribs, factors) if f < 1.0)
            self.clipped_pushes += len(clipped)
            merged = Merged(
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
        if s.carry:
            self._take_carry(p, now_s)
        else:
            self._fold(p, now_s)  # pushes that arrived during the merge
        if s.round.pending:  # arrived while the lock was released
            nxt = self._evaluate(p, now_s)
            if nxt is not None:
                self._followups.append((p, nxt))
        return merged

    # -- reading pushes, one tensor at a time -------------------------------------------
    def _reference(self, p: int, version: int, j: int) -> torch.Tensor:
        """Tensor j of fragment p at ``version`` (the current tensor itself, or rebuilt)."""
        s = self.frags[p]
        if version == s.version:
            return s.theta[j]
        return s.history.tensor(s.theta, version, j)

    def _anchor(self, p: int, c: Contribution, j: int) -> torch.Tensor:
        """Tensor j of the fragment c's outer gradient is taken from (``anchor``)."""
        if self.config.anchor == "current":
            return self.frags[p].theta[j]
        return self._reference(p, c.base_version, j)

    def _pushed(self, p: int, c: Contribution, j: int) -> torch.Tensor:
        """Tensor j of theta_{m,p} as pushed (a delta push added to its base version)."""
        if isinstance(c.params, SlicedParams):  # a sharded island's pieces, some deltas
            return c.params.pushed(j, lambda: self._reference(p, c.base_version, j))
        x = c.params[j]
        if getattr(c.params, "delta", False):
            return self._reference(p, c.base_version, j).add(x)
        return x

    def _clipped(self, p: int, c: Contribution, j: int, f: float) -> torch.Tensor:
        """``_pushed`` after the merge guard: ``anchor - f (anchor - theta)``."""
        x = self._pushed(p, c, j)
        if f >= 1.0:
            return x
        a = self._anchor(p, c, j)
        return torch.lerp(a, x.float(), f) if f > 0 else a.clone()

    def _settle(self, contribs: list[Contribution], *, merged: bool) -> None:
        """A round closed: its pushes' tokens move from pending to merged/dropped."""
        for c in contribs:
            led = self.ledger[c.learner]
            led.tokens_pending -= self._tokens(c)
            if merged:
                led.tokens_merged += self._tokens(c)
                led.pushes_merged += 1
            else:
                led.tokens_dropped += self._tokens(c)
                led.pushes_dropped += 1

    def _validate(self, c: Contribution, finite_checked: bool = False) -> str:
        if not 0 <= c.fragment < len(self.frags):
            return f"fragment {c.fragment} out of range [0, {len(self.frags)})"
        if c.c_steps < 1 or c.c_tokens < 1:
            return f"counters must be >= 1 (c_steps={c.c_steps}, c_tokens={c.c_tokens})"
        if self.owned is not None and c.fragment not in self.owned:
            return f"fragment {c.fragment} is held by another shard"
        theta = self.frags[c.fragment].theta
        if len(c.params) != len(theta):
            return f"fragment {c.fragment} has {len(theta)} tensors, push has {len(c.params)}"
        if isinstance(c.params, (EncodedParams, SlicedParams)):  # fp32 when read, checked
            for j, (shape, ref) in enumerate(zip(c.params.shapes, theta)):
                if shape != tuple(ref.shape):
                    return (
                        f"tensor {self.fragmentation.fragments[c.fragment].names[j]} has shape "
                        f"{tuple(ref.shape)}, push has {shape}"
                    )
            return ""
        for j, (x, ref) in enumerate(zip(c.params, theta)):
            if tuple(x.shape) != tuple(ref.shape):
                return (
                    f"tensor {self.fragmentation.fragments[c.fragment].names[j]} has shape "
                    f"{tuple(ref.shape)}, push has {tuple(x.shape)}"
                )
            if not x.is_floating_point():
                return f"tensor {j} has dtype {x.dtype}; a floating dtype is required"
            if not finite_checked and not all_finite(x):
                return (
                    f"tensor {self.fragmentation.fragments[c.fragment].names[j]} has NaN/inf values"
                )
        return ""

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
        return {
            "theta": [list(s.theta) for s in self.frags],
            "momentum": [list(s.momentum) for s in self.frags],
            "versions": self.versions(),
            "ledger": {m: vars_of(e) for m, e in self.ledger.items()},
            "merges": self.merges,
            "seen_seq": [[*k, v] for k, v in self._seen_seq.items()],
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
            s.theta = [_as_f32(t, copy=False) for t in th]
            s.momentum = [_as_f32(t, copy=False) for t in mo]
            s.version = int(v)
            s.history = FragmentHistory([t.shape for t in s.theta])
            s.round = _Round()
            s.carry = {}
        self.ledger = {int(m): LedgerEntry(**e) for m, e in sd["ledger"].items()}
        for e in self.ledger.values():
            e.tokens_pending = 0
        self.merges = int(sd["merges"])
        seen = sd.get("seen_seq", [])  # rows, or (an earlier checkpoint) a dict
        rows = [[*k, v] for k, v in seen.items()] if isinstance(seen, dict) else seen
        self._seen_seq = {(int(m), int(p)): int(v) for m, p, v in rows}


_FOLDING = (math.nan, 1.0)
"""``_Round.folded``'s entry of a push being folded."""


def cast_fold(fold: Fold | None) -> Fold:
    if fold is None:  # _fold checks the rule first
        raise AssertionError("merge rule has no fold")
    return fold


def _nbytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes a push holds: its encoded bytes, or its tensors'."""
    nb = getattr(params, "nbytes", None)
    if isinstance(nb, int):
        return nb
    return sum(t.numel() * t.element_size() for t in params)


def _as_f32(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """An fp32 copy of ``t``, or (``copy=False``) ``t`` itself where it is a contiguous fp32
    CPU tensor."""
    t = t.detach()
    if not copy and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.float().contiguous().clone()


class _Deltas(Sequence[torch.Tensor]):
    """Tensor j of each push's outer gradient ``anchor - theta_{m,p}`` (after the merge
    guard), computed when the merge rule reads it: the rule reads each once, in order."""

    def __init__(self, st: SyncerState, p: int, j: int, contribs, factors) -> None:
        self._st, self._p, self._j, self._c, self._f = st, p, j, contribs, factors

    def __len__(self) -> int:
        return len(self._c)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        c, f = self._c[i], self._f[i]
        a = self._st._anchor(self._p, c, self._j)
        return a - self._st._clipped(self._p, c, self._j, f).float()


def _average(pushed: Sequence[Sequence[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    """Token-weighted average of the pushed parameters, tensor by tensor (new tensors)."""
    total = sum(weights)
    out = [torch.zeros_like(t, dtype=torch.float32) for t in pushed[0]]
    for ps, w in zip(pushed, weights):
        torch._foreach_add_(out, [x.float() for x in ps], alpha=w / total)
    return out


_CHUNK = 1 << 15


def distance(anchors: Sequence[torch.Tensor], pushes: Sequence[torch.Tensor]) -> float:
    """``||Delta_{m,p}|| = ||Theta_p - theta_{m,p}||`` over a fragment's tensors, without a
    fragment-sized temporary: chunk by chunk through a 128 KiB scratch buffer, in one thread
    (numpy). Measured per merge on a busy 2-core machine, this is several times faster than
    torch's multi-threaded subtract and norm, whose thread pool stalls when the cores are
    taken (``bench/merge_guard_cost.py``)."""
    scratch = np.empty(_CHUNK, dtype=np.float32)
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is an inf norm
        for a, x in zip(anchors, pushes):
            av = a.detach().float().reshape(-1).numpy()
            xv = x.detach().float().reshape(-1).numpy()
            for i in range(0, av.size, _CHUNK):
                d = scratch[: min(_CHUNK, av.size - i)]
                np.subtract(av[i : i + _CHUNK], xv[i : i + _CHUNK], out=d)
                total += float(np.dot(d, d))
    return math.sqrt(total)


def vars_of(e: LedgerEntry) -> dict:
    return {k: getattr(e, k) for k in e.__slots__}


def fragment_tensors(params: dict[str, torch.Tensor], names: Sequence[str]) -> list[torch.Tensor]:
    return [params[n] for n in names]
