"""The syncer's settings: quorum and grace (``PolicyConfig``), the merge rule, the outer
optimizer, staleness, the anchor of outer gradients, the history of published versions,
the final round's merge and the merge guard. Read by the rounds, the merge and the state
machine (``ddiloco.algorithm.syncer_state``); the run configuration nests it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddiloco.algorithm.merge import MERGE_RULES, OuterNesterov
from ddiloco.algorithm.policy import PolicyConfig

__all__ = ["SyncerConfig", "ANCHORS", "FINAL_MERGES", "DEFAULT_NORM_CLIP"]

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
