"""When to merge a fragment round: minimum quorum K and the adaptive grace window.

Pure code, no torch and no clock: the caller passes the current time. The same policy
object decides merges in the real gRPC syncer (wall clock), the in-process engine
(virtual clock) and the datacenter-scale simulator.

Symbols follow the paper:
  K        minimum number of learners whose fragment must have arrived (quorum)
  tau      overlap in inner steps: a fragment sent at step t is installed at step t + tau
  gamma    safety factor < 1 applied to the slack
  xi_step  learner inner-step time, xi_quorum time from round open to quorum,
  xi_sync  time of merge plus transfer back; each tracked by an exponential moving average.

  slack = tau * xi_step - (xi_quorum + xi_sync)
  grace = max(0, gamma * slack)
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "Ema",
    "PolicyConfig",
    "QuorumGracePolicy",
    "MergeNow",
    "WaitUntil",
    "WaitForMore",
    "grace_window_s",
]


@dataclass(slots=True)
class Ema:
    """Exponential moving average; ``value`` is None until the first observation."""

    alpha: float = 0.2
    """Weight of a new observation, in (0, 1]."""
    value: float | None = None

    def update(self, x: float) -> float:
        if x != x or x < 0:  # NaN or negative durations are ignored: they carry no timing signal
            return self.value if self.value is not None else 0.0
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


def grace_window_s(
    tau: int, xi_step_s: float, xi_quorum_s: float, xi_sync_s: float, gamma: float
) -> float:
    """Grace window after the quorum: ``max(0, gamma * (tau*xi_step - (xi_quorum + xi_sync)))``."""
    slack = tau * xi_step_s - (xi_quorum_s + xi_sync_s)
    return max(0.0, gamma * slack)


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    quorum: int = 1
    """K: minimum learners per merge. Capped at the number of live learners."""
    grace: bool = True
    """Wait for more learners after the quorum, within the adaptive grace window."""
    gamma: float = 0.8
    """Safety factor on the slack; must be in [0, 1). At tau = 2 a window that covers one
    step's spread of arrivals needs gamma above 1/2 (see ``SyncConfig.gamma``)."""
    tau: int = 2
    """Overlap in inner steps (the slack the grace window may use)."""
    ema_alpha: float = 0.2
    """Weight of a new timing observation in the EMAs."""

    def __post_init__(self) -> None:
        if self.quorum < 1:
            raise ValueError(f"quorum K must be >= 1, got {self.quorum}")
        if not 0.0 <= self.gamma < 1.0:
            raise ValueError(f"gamma must be in [0, 1), got {self.gamma}")
        if self.tau < 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")


@dataclass(frozen=True, slots=True)
class MergeNow:
    """Merge the round now."""

    reason: str  # "all-live", "grace-expired", "no-grace"


@dataclass(frozen=True, slots=True)
class WaitUntil:
    """Quorum reached; merge at ``at_s`` unless every live learner arrives first."""

    at_s: float


@dataclass(frozen=True, slots=True)
class WaitForMore:
    """Quorum not reached yet: wait for more contributions (no timer)."""


Decision = MergeNow | WaitUntil | WaitForMore


@dataclass(slots=True)
class QuorumGracePolicy:
    """Timing EMAs plus the quorum / grace decision for one fragment (or a whole syncer)."""

    config: PolicyConfig = field(default_factory=PolicyConfig)
    xi_step: Ema = field(init=False)
    xi_quorum: Ema = field(init=False)
    xi_sync: Ema = field(init=False)

    def __post_init__(self) -> None:
        a = self.config.ema_alpha
        self.xi_step, self.xi_quorum, self.xi_sync = Ema(a), Ema(a), Ema(a)

    def effective_quorum(self, n_live: int) -> int:
        """K capped by the live learners (at least 1), so a dead learner never blocks K = M."""
        return max(1, min(self.config.quorum, n_live))

    def grace_s(self) -> float:
        if not self.config.grace:
            return 0.0
        return grace_window_s(
            self.config.tau,
            self.xi_step.get(),
            self.xi_quorum.get(),
            self.xi_sync.get(),
            self.config.gamma,
        )

    def decide(
        self, *, now_s: float, n_arrived: int, n_live: int, quorum_at_s: float | None
    ) -> Decision:
        """Decide for a round with ``n_arrived`` distinct contributions.

        ``quorum_at_s`` is when the round reached its quorum (None if not yet); the caller
        records it the first time this returns something other than WaitForMore.
        """
        if n_arrived < self.effective_quorum(n_live):
            return WaitForMore()
        if n_arrived >= n_live:
            return MergeNow("all-live")
        grace = self.grace_s()
        if grace <= 0.0:
            return MergeNow("no-grace")
        start = now_s if quorum_at_s is None else quorum_at_s
        deadline = start + grace
        if now_s >= deadline:
            return MergeNow("grace-expired")
        return WaitUntil(deadline)
