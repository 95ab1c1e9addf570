"""The simulated systems: non-elastic data-parallel, elastic data-parallel, Decoupled DiLoCo.

All three run on the package's event kernel (``ddiloco.kernel``) and consume the same failure stream
(``failures.py``). Chips are grouped into slices of ``chips_per_slice`` chips; a failed chip
takes its whole slice down until the slice is repaired (``slice_recovery_s``).

* ``dp``: one synchronous job over every chip. A failure stops the job; it restarts from
  the last checkpoint after ``restart_s`` (failed slices are swapped for spares during the
  restart), losing the work since that checkpoint. Checkpoints are taken every
  ``checkpoint_interval_s`` of compute and pause the job for ``checkpoint_cost_s``.
* ``elastic-dp``: one synchronous job that drops a failed slice instead of restarting. Every
  change of membership pauses the whole job for ``reconfig_s`` (re-forming the mesh); the
  step in flight (``lost_work_s``) is lost. A repaired slice rejoins at the next
  reconfiguration, or forces one after waiting ``rejoin_wait_s``.
* ``decoupled``: M learners, each an elastic job over N/M chips with exactly the elastic
  mechanism above, so a failure pauses only its own learner. A central syncer merges
  fragments using :class:`ddiloco.algorithm.policy.QuorumGracePolicy` (minimum quorum K,
  adaptive grace window); a learner that needs a merged fragment that is not ready blocks.

Goodput is the chip-time spent on computation that ends up in the model, divided by all
chip-time in the measurement window ``[warmup_s, horizon_s)``. Uptime is the fraction of
that window in which the system as a whole advances (DP: running; elastic DP: not paused;
decoupled: at least one learner running).

Two levels of detail for the decoupled learners' compute:

* fluid (default when K = 1 with equal, noise-free learners): a running learner computes
  continuously, so only failure, repair and reconfiguration events are simulated;
* step level (automatic when K > 1, step-time noise or unequal learner speeds; or forced):
  every inner step of every learner is an event, every push enters a fragment round, and
  the quorum/grace policy decides each merge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from ddiloco.algorithm.policy import MergeNow, PolicyConfig, QuorumGracePolicy, WaitUntil
from ddiloco.kernel import Event, EventKernel, LogEntry
from ddiloco.sim.failures import FailureConfig, generate_failures

_POLICY = PolicyConfig()
"""The policy's declared defaults (K, grace, gamma, tau): the run configuration's too."""

__all__ = ["SYSTEMS", "CostModel", "SimConfig", "RunResult", "run_once", "straggler_efficiency"]

SYSTEMS = ("dp", "elastic-dp", "decoupled")

# event priorities at equal times: repairs before failures before timers
_P_RECOVER, _P_FAIL, _P_TIMER = 0, 1, 2


@dataclass(slots=True)
class _Round:
    """An open fragment round of the step-level decoupled system (round t: step t's pushes)."""

    open_at_s: float
    """When its first push arrived."""
    members: set[int] = field(default_factory=set)
    """The learners that pushed into it."""
    quorum_at_s: float | None = None
    """When it first reached the quorum (the policy's grace window runs from there)."""
    gen: int = 0
    """Generation of its grace timer: a timer event of an older one is stale."""


@dataclass(kw_only=True, slots=True)
class CostModel:
    """Physical costs of the cluster. Every cost of a failure is one of these fields."""

    chips_per_slice: int = 256
    """Chips per slice, the unit that fails and is repaired as a whole."""
    slice_recovery_s: float = 600.0
    """Time from a chip failure until its slice is usable again (repair or hot swap)."""
    reconfig_s: float = 15.0
    """Pause of an elastic job (elastic DP, or one decoupled learner) to re-form its mesh
    after a membership change (slice lost or slice added)."""
    rejoin_wait_s: float = 60.0
    """A repaired slice waits this long for a reconfiguration to join; then it forces one."""
    reconfig_absorbs_changes: bool = True
    """Membership changes during a reconfiguration are folded into the mesh being formed at
    no extra cost (True: a slice failing is left out, a slice repaired joins), or force
    another reconfiguration after this one (False)."""
    lost_work_s: float = 0.5
    """Compute lost by an elastic job at a failure (the step in flight), in seconds."""
    restart_s: float = 80.0
    """Non-elastic DP: time to restart the whole job from its last checkpoint."""
    restart_absorbs_failures: bool = True
    """Non-elastic DP: failures during a restart are handled by that restart (True), or
    start it again (False)."""
    checkpoint_interval_s: float = 60.0
    """Non-elastic DP: compute time between checkpoints; work since the last one is lost."""
    checkpoint_cost_s: float = 0.0
    """Non-elastic DP: pause to take a checkpoint (0: asynchronous checkpointing)."""
    step_time_s: float = 1.0
    """Inner-step time of a learner (step-level simulation, syncer timing)."""
    step_time_cv: float = 0.0
    """Coefficient of variation of a learner's step time, step to step (step level)."""
    slice_time_cv: float = 0.0
    """Coefficient of variation of each slice's step time inside one synchronous job: the
    job waits for its slowest slice every step (straggler factor, all systems)."""
    sync_s: float = 0.2
    """Decoupled: merge plus transfer time of one fragment round (xi_sync)."""
    syncer_overhead: float = 0.0
    """Decoupled: fraction of learner compute lost to fragment traffic (copies to host RAM)."""

    def __post_init__(self) -> None:
        if self.chips_per_slice < 1:
            raise ValueError(f"chips_per_slice must be >= 1, got {self.chips_per_slice}")
        for name in (
            "slice_recovery_s",
            "reconfig_s",
            "rejoin_wait_s",
            "lost_work_s",
            "restart_s",
            "checkpoint_cost_s",
            "step_time_cv",
            "slice_time_cv",
            "sync_s",
        ):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if not self.checkpoint_interval_s > 0:
            raise ValueError(f"checkpoint_interval_s must be > 0, got {self.checkpoint_interval_s}")
        if not self.step_time_s > 0:
            raise ValueError(f"step_time_s must be > 0, got {self.step_time_s}")
        if not 0.0 <= self.syncer_overhead < 1.0:
            raise ValueError(f"syncer_overhead must be in [0, 1), got {self.syncer_overhead}")


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One simulated system on one cluster."""

    system: str = "decoupled"
    """``dp``, ``elastic-dp`` or ``decoupled``."""
    n_chips: int = 150_000
    """N: chips in the cluster (all systems use all of them)."""
    learners: int = 1
    """M: learners (decoupled only; the chips are split evenly by slice)."""
    quorum: int = _POLICY.quorum
    """K: minimum learners per merge (decoupled only); 1 <= K <= M."""
    grace: bool = _POLICY.grace
    """Decoupled: adaptive grace window after the quorum."""
    gamma: float = _POLICY.gamma
    """Decoupled: safety factor of the grace window (the run configuration's
    ``sync.gamma``)."""
    tau: int = _POLICY.tau
    """Decoupled: overlap in inner steps; a push is needed back tau steps later."""
    fragments: int = 24
    """Decoupled: P fragments, pushed round-robin one per step."""
    speed_factors: tuple[float, ...] = ()
    """Decoupled: per-learner step-time multipliers (empty: all 1.0)."""
    failures: FailureConfig = field(default_factory=FailureConfig)
    """Failure process of each chip."""
    costs: CostModel = field(default_factory=CostModel)
    """Physical costs (see :class:`CostModel`)."""
    horizon_s: float = 6 * 3600.0
    """Simulated time per seed."""
    warmup_s: float = 1800.0
    """Time discarded at the start (all slices start healthy)."""
    step_level: bool | None = None
    """Decoupled: simulate every inner step (None: only where it matters)."""
    exact_failures: bool = False
    """Generate failures chip by chip instead of by superposition (same process, slower)."""

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"system must be one of {', '.join(SYSTEMS)}; got {self.system!r}")
        if self.n_chips < 1:
            raise ValueError(f"n_chips must be >= 1, got {self.n_chips}")
        if self.learners < 1:
            raise ValueError(f"learners (M) must be >= 1, got {self.learners}")
        if self.system != "decoupled" and self.learners != 1:
            raise ValueError(
                f"learners (M) applies to system 'decoupled' only, got "
                f"M = {self.learners} with system {self.system!r}"
            )
        if not 1 <= self.quorum <= self.learners:
            raise ValueError(
                f"quorum K must satisfy 1 <= K <= M = {self.learners}, got {self.quorum}"
            )
        if self.n_slices < self.learners:
            raise ValueError(
                f"{self.n_chips} chips make {self.n_slices} slices of "
                f"{self.costs.chips_per_slice}: fewer than M = {self.learners} "
                "learners; use more chips or smaller slices"
            )
        if self.speed_factors and len(self.speed_factors) != self.learners:
            raise ValueError(
                f"speed_factors needs one value per learner ({self.learners}), "
                f"got {len(self.speed_factors)}"
            )
        if any(not f > 0 for f in self.speed_factors):
            raise ValueError("speed_factors must all be > 0")
        if self.fragments < 1 or self.tau < 0:
            raise ValueError("fragments must be >= 1 and tau >= 0")
        if not 0.0 <= self.gamma < 1.0:
            raise ValueError(f"gamma must be in [0, 1), got {self.gamma}")
        if not 0 <= self.warmup_s < self.horizon_s:
            raise ValueError(
                f"need 0 <= warmup_s < horizon_s, got {self.warmup_s}, {self.horizon_s}"
            )

    @property
    def n_slices(self) -> int:
        return max(1, self.n_chips // self.costs.chips_per_slice)

    @property
    def uses_step_level(self) -> bool:
        if self.system != "decoupled":
            return False
        if self.step_level is not None:
            return self.step_level
        uneven = len(set(self.speed_factors)) > 1
        return self.quorum > 1 or self.costs.step_time_cv > 0 or uneven


@dataclass(frozen=True, slots=True)
class RunResult:
    """One seed of one configuration."""

    goodput: float
    uptime: float
    n_failures: int
    n_reconfigs: int
    n_restarts: int
    n_merges: int
    n_events: int
    mean_merge_size: float = 0.0
    """Decoupled step level: learners per merged round (more is better for quality)."""


def straggler_efficiency(n_parallel: int, cv: float) -> float:
    """Synchronous step over ``n_parallel`` units with step-time noise ``cv``: mean / E[max].

    Uses Blom's approximation of the expected maximum of n standard normals.
    """
    if cv <= 0 or n_parallel <= 1:
        return 1.0
    n = n_parallel
    z = NormalDist().inv_cdf((n - 0.375) / (n + 0.25))
    return 1.0 / (1.0 + cv * z)


class _Meter:
    """Integral of a piecewise-constant rate over the window [t0, t1)."""

    __slots__ = ("t0", "t1", "last", "rate", "acc")

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1, self.last, self.rate, self.acc = t0, t1, 0.0, 0.0, 0.0

    def set(self, now: float, rate: float) -> None:
        a, b = max(self.last, self.t0), min(now, self.t1)
        if b > a:
            self.acc += self.rate * (b - a)
        self.last, self.rate = now, rate

    def add_interval(self, start: float, end: float, amount_per_s: float) -> None:
        a, b = max(start, self.t0), min(end, self.t1)
        if b > a:
            self.acc += amount_per_s * (b - a)

    def subtract_at(self, now: float, amount: float) -> None:
        if self.t0 <= now < self.t1:
            self.acc -= amount


# ----------------------------------------------------------------------------- topology

_ACTIVE, _DOWN, _READY = 0, 1, 2


class _Topology:
    """Chip -> slice -> group maps (groups: learners; one group for elastic DP)."""

    def __init__(self, n_chips: int, n_slices: int, n_groups: int) -> None:
        self.n_chips, self.n_slices, self.n_groups = n_chips, n_slices, n_groups
        edges = [(g * n_slices) // n_groups for g in range(n_groups + 1)]
        self.group_slices = [range(edges[g], edges[g + 1]) for g in range(n_groups)]
        self.slice_group = np.empty(n_slices, dtype=np.int64)
        for g, r in enumerate(self.group_slices):
            self.slice_group[r.start : r.stop] = g

    def slice_of(self, chips: np.ndarray) -> np.ndarray:
        return (chips * self.n_slices) // self.n_chips

    def slice_chips(self, s: int) -> int:
        return ((s + 1) * self.n_chips) // self.n_slices - (s * self.n_chips) // self.n_slices


# ----------------------------------------------------------------------------- simulation


class _Sim:
    """One run. Builds the processes on a kernel and exposes the measured totals."""

    def __init__(
        self,
        cfg: SimConfig,
        seed: int,
        log_events: bool = False,
        failures: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.cfg, self.c = cfg, cfg.costs
        self.rng = np.random.default_rng(seed)
        self.k = EventKernel(log_events=log_events)
        n_groups = cfg.learners if cfg.system == "decoupled" else 1
        self.topo = _Topology(cfg.n_chips, cfg.n_slices, n_groups)
        self.useful = _Meter(cfg.warmup_s, cfg.horizon_s)
        self.up = _Meter(cfg.warmup_s, cfg.horizon_s)
        self.n_failures = self.n_reconfigs = self.n_restarts = self.n_merges = 0
        if failures is None:
            times, chips = generate_failures(
                cfg.failures, cfg.n_chips, cfg.horizon_s, self.rng, exact=cfg.exact_failures
            )
        else:
            times, chips = (np.asarray(a) for a in failures)
            if len(times) != len(chips) or np.any(np.diff(times) < 0):
                raise ValueError("injected failures need equal-length arrays, sorted by time")
            if len(chips) and (chips.min() < 0 or chips.max() >= cfg.n_chips):
                raise ValueError(f"injected failure chip ids must be in [0, {cfg.n_chips})")
        self.fail_times, self.fail_slices = times, self.topo.slice_of(chips)
        self.fail_idx = 0
        self.k.on("fail", self._on_fail)
        if cfg.system == "dp":
            self._init_dp()
        else:
            self._init_elastic()
        self._next_failure()

    def _next_failure(self) -> None:
        if self.fail_idx < len(self.fail_times):
            self.k.schedule(
                float(self.fail_times[self.fail_idx]),
                Event("fail", int(self.fail_slices[self.fail_idx])),
                _P_FAIL,
            )
            self.fail_idx += 1

    def _on_fail(self, k: EventKernel, ev: Event) -> None:
        if k.now_s >= self.cfg.warmup_s:
            self.n_failures += 1
        self._next_failure()
        if self.cfg.system == "dp":
            self._dp_fail(ev.target)
        else:
            self._elastic_fail(ev.target)

    def run(self) -> RunResult:
        self.k.run(self.cfg.horizon_s)
        self.useful.set(self.cfg.horizon_s, 0.0)
        self.up.set(self.cfg.horizon_s, 0.0)
        window = self.cfg.horizon_s - self.cfg.warmup_s
        goodput = self.useful.acc / (self.cfg.n_chips * window)
        return RunResult(
            goodput=goodput,
            uptime=self.up.acc / window,
            n_failures=self.n_failures,
            n_reconfigs=self.n_reconfigs,
            n_restarts=self.n_restarts,
            n_merges=self.n_merges,
            n_events=self.k.n_dispatched,
            mean_merge_size=(getattr(self, "merge_members", 0) / max(1, self.n_merges)),
        )

    # ------------------------------------------------------------------ non-elastic DP
    def _init_dp(self) -> None:
        self.eff = straggler_efficiency(self.cfg.n_slices, self.c.slice_time_cv)
        self.dp_running = True
        self.dp_gen = 0  # invalidates timers scheduled before a failure
        self.dp_seg_start = 0.0  # start of the compute not yet in a checkpoint
        self.dp_ckpt_at: float | None = None  # start of the checkpoint being written
        self.k.on("dp_ckpt_start", self._dp_ckpt_start)
        self.k.on("dp_ckpt_end", self._dp_ckpt_end)
        self.k.on("dp_restart_end", self._dp_restart_end)
        self._dp_compute(0.0)

    def _dp_compute(self, now: float) -> None:
        self.dp_seg_start, self.dp_ckpt_at = now, None
        self.useful.set(now, self.cfg.n_chips * self.eff)
        self.up.set(now, 1.0)
        if self.c.checkpoint_cost_s > 0:  # free checkpoints need no events: see _dp_fail
            self.k.after(
                self.c.checkpoint_interval_s, Event("dp_ckpt_start", data=self.dp_gen), _P_TIMER
            )

    def _dp_ckpt_start(self, k: EventKernel, ev: Event) -> None:
        if ev.data != self.dp_gen:
            return
        self.dp_ckpt_at = k.now_s
        self.useful.set(k.now_s, 0.0)  # checkpoint pause: up, not computing
        k.after(self.c.checkpoint_cost_s, Event("dp_ckpt_end", data=self.dp_gen), _P_TIMER)

    def _dp_ckpt_end(self, k: EventKernel, ev: Event) -> None:
        if ev.data == self.dp_gen:
            self._dp_compute(k.now_s)  # the checkpoint is committed

    def _dp_fail(self, s: int) -> None:
        k, now = self.k, self.k.now_s
        if self.dp_running:
            # the work since the last committed checkpoint was metered as useful: take it back
            end = self.dp_ckpt_at if self.dp_ckpt_at is not None else now
            if self.c.checkpoint_cost_s == 0:  # checkpoints every interval, at no cost
                elapsed = now - self.dp_seg_start
                C = self.c.checkpoint_interval_s
                self.dp_seg_start += math.floor(elapsed / C) * C
            self.useful.set(now, 0.0)
            self.useful.add_interval(self.dp_seg_start, end, -self.cfg.n_chips * self.eff)
            self.dp_running = False
            self.dp_gen += 1
            self.up.set(now, 0.0)
            if now >= self.cfg.warmup_s:
                self.n_restarts += 1
            k.after(self.c.restart_s, Event("dp_restart_end", data=self.dp_gen), _P_TIMER)
        elif not self.c.restart_absorbs_failures:
            self.dp_gen += 1  # the restart itself failed: start it again
            k.after(self.c.restart_s, Event("dp_restart_end", data=self.dp_gen), _P_TIMER)

    def _dp_restart_end(self, k: EventKernel, ev: Event) -> None:
        if ev.data != self.dp_gen:
            return
        self.dp_running = True
        self._dp_compute(k.now_s)

    # ------------------------------------------------------------------ elastic groups
    def _init_elastic(self) -> None:
        topo, cfg = self.topo, self.cfg
        self.slice_state = np.full(topo.n_slices, _ACTIVE, dtype=np.int8)
        self.slice_chips = np.array([topo.slice_chips(s) for s in range(topo.n_slices)])
        G = topo.n_groups
        self.g_active_chips = [
            int(self.slice_chips[r.start : r.stop].sum()) for r in topo.group_slices
        ]
        self.g_ready: list[list[int]] = [[] for _ in range(G)]
        self.g_paused = [False] * G
        self.g_pending = [False] * G
        self.g_upscale_timer = [False] * G
        self.g_run_start = [0.0] * G
        self.g_rate = [0.0] * G
        self.n_running = 0
        overhead = self.c.syncer_overhead if cfg.system == "decoupled" else 0.0
        self.g_eff = [
            straggler_efficiency(len(r), self.c.slice_time_cv) * (1 - overhead)
            for r in topo.group_slices
        ]
        self.step_level = cfg.uses_step_level
        self.k.on("recover", self._on_recover)
        self.k.on("reconf_end", self._on_reconf_end)
        self.k.on("upscale", self._on_upscale)
        if self.step_level:
            self._init_steps()
        for g in range(G):
            self._group_resume(g, 0.0)

    def _set_group_rate(self, g: int, now: float, rate: float) -> None:
        if not self.step_level:
            self.useful.set(now, self.useful.rate - self.g_rate[g] + rate)
        self.g_rate[g] = rate

    def _group_resume(self, g: int, now: float) -> None:
        running = self.g_active_chips[g] > 0
        was_running = self.g_rate[g] > 0
        self._set_group_rate(g, now, self.g_active_chips[g] * self.g_eff[g] if running else 0.0)
        if running and not was_running:
            self.n_running += 1
        self.g_run_start[g] = now
        self.up.set(now, 1.0 if self.n_running > 0 else 0.0)
        if running and self.step_level:
            self._learner_resume(g, now)

    def _group_pause(self, g: int, now: float) -> None:
        if self.g_rate[g] > 0:
            self.n_running -= 1
        self._set_group_rate(g, now, 0.0)
        self.up.set(now, 1.0 if self.n_running > 0 else 0.0)
        if self.step_level:
            self._learner_pause(g, now)

    def _join_ready(self, g: int) -> None:
        for s in self.g_ready[g]:  # repaired slices join the mesh being formed
            if self.slice_state[s] == _READY:
                self.slice_state[s] = _ACTIVE
                self.g_active_chips[g] += int(self.slice_chips[s])
        self.g_ready[g] = []

    def _start_reconfig(self, g: int, now: float) -> None:
        if not self.g_paused[g]:
            self._group_pause(g, now)
        self.g_paused[g] = True
        self._join_ready(g)
        if now >= self.cfg.warmup_s:
            self.n_reconfigs += 1
        self.k.after(self.c.reconfig_s, Event("reconf_end", g), _P_TIMER)

    def _elastic_fail(self, s: int) -> None:
        now, g = self.k.now_s, int(self.topo.slice_group[s])
        state = self.slice_state[s]
        if state == _DOWN:
            return  # already being repaired: the repair covers this chip too
        self.slice_state[s] = _DOWN
        self.k.after(self.c.slice_recovery_s, Event("recover", s), _P_RECOVER)
        if state == _READY:
            return  # not in the mesh: nothing to reconfigure
        self.g_active_chips[g] -= int(self.slice_chips[s])
        if self.g_paused[g]:
            if not self.c.reconfig_absorbs_changes:
                self.g_pending[g] = True  # the mesh being formed includes it: form it again
            return
        if self.g_rate[g] > 0 and not self.step_level:
            lost_s = min(self.c.lost_work_s, now - self.g_run_start[g])
            self.useful.subtract_at(now, self.g_rate[g] * lost_s)
        self._start_reconfig(g, now)

    def _on_recover(self, k: EventKernel, ev: Event) -> None:
        s = ev.target
        g = int(self.topo.slice_group[s])
        self.slice_state[s] = _READY
        self.g_ready[g].append(s)
        if not self.g_upscale_timer[g]:
            self.g_upscale_timer[g] = True
            k.after(self.c.rejoin_wait_s, Event("upscale", g), _P_TIMER)

    def _on_upscale(self, k: EventKernel, ev: Event) -> None:
        g = ev.target
        self.g_upscale_timer[g] = False
        if not any(self.slice_state[s] == _READY for s in self.g_ready[g]):
            return
        if not self.g_paused[g]:
            self._start_reconfig(g, k.now_s)
        elif not self.c.reconfig_absorbs_changes:
            self.g_pending[g] = True
        # else: the reconfiguration in progress takes the repaired slices at its end

    def _on_reconf_end(self, k: EventKernel, ev: Event) -> None:
        g = ev.target
        if self.g_pending[g]:
            self.g_pending[g] = False
            self._start_reconfig(g, k.now_s)
            return
        if self.c.reconfig_absorbs_changes:
            self._join_ready(g)
        self.g_paused[g] = False
        self._group_resume(g, k.now_s)

    # ------------------------------------------------------------------ step level
    # Step t of any learner pushes fragment t mod P into round t (the global schedule: a
    # learner that rejoins takes the current global step). The learner needs round t merged
    # before it starts step t + tau + 1, and blocks otherwise. A round waits for the
    # learners that can still contribute to it: running learners not yet past step t.
    def _init_steps(self) -> None:
        cfg = self.cfg
        M = cfg.learners
        self.policy = QuorumGracePolicy(
            PolicyConfig(quorum=cfg.quorum, grace=cfg.grace, gamma=cfg.gamma, tau=cfg.tau)
        )
        self.speed = list(cfg.speed_factors) if cfg.speed_factors else [1.0] * M
        self.l_gen = [0] * M  # invalidates the step event of an aborted step
        self.l_step = [0] * M  # global index of the learner's next step
        self.l_step_start = [0.0] * M
        self.l_running = [False] * M
        self.l_blocked_on: list[int | None] = [None] * M  # round awaited
        self.l_waits: list[dict[int, int]] = [dict() for _ in range(M)]  # step -> round
        self.rounds: dict[int, _Round] = {}  # open rounds by t
        self.done: dict[int, float] = {}  # merged rounds: t -> install time
        self.merge_members = 0
        self.k.on("step_done", self._on_step_done)
        self.k.on("grace", self._on_grace)
        self.k.on("merge_done", self._on_merge_done)

    def _learner_resume(self, m: int, now: float) -> None:
        self.l_running[m] = True
        # a restarted learner fetches the global model and joins the global schedule
        self.l_step[m] = max(
            [self.l_step[i] for i in range(self.cfg.learners) if self.l_running[i]]
            + [self.l_step[m]]
        )
        self.l_waits[m].clear()
        self.l_blocked_on[m] = None
        self._start_step(m, now)

    def _learner_pause(self, m: int, now: float) -> None:
        self.l_running[m] = False
        self.l_gen[m] += 1  # abort the step in flight: its compute is lost
        self.l_blocked_on[m] = None
        for t in list(self.rounds):  # fewer learners can contribute: a round may be complete
            self._decide(t, now)

    def _start_step(self, m: int, now: float) -> None:
        need = self.l_waits[m].pop(self.l_step[m], None)
        if need is not None and self.done.get(need, math.inf) > now:
            self.l_blocked_on[m] = need  # the fragment pushed tau steps ago is not back
            self.l_waits[m][self.l_step[m]] = need
            return
        self.l_blocked_on[m] = None
        dur = self.c.step_time_s * self.speed[m]
        if self.c.step_time_cv > 0:
            dur *= max(0.05, 1.0 + self.c.step_time_cv * float(self.rng.standard_normal()))
        self.l_step_start[m] = now
        self.k.after(dur, Event("step_done", m, self.l_gen[m]), _P_TIMER)

    def _on_step_done(self, k: EventKernel, ev: Event) -> None:
        m, now = ev.target, k.now_s
        if ev.data != self.l_gen[m] or not self.l_running[m]:
            return
        start = self.l_step_start[m]
        self.useful.add_interval(start, now, self.g_rate[m])
        self.policy.xi_step.update(now - start)
        t = self.l_step[m]
        self.l_waits[m][t + self.cfg.tau + 1] = t
        self.l_step[m] = t + 1
        if t not in self.done:  # else: late for a merged round; it installs that result
            r = self.rounds.get(t)
            if r is None:
                r = self.rounds[t] = _Round(open_at_s=now)
            r.members.add(m)
            self._decide(t, now)
        if self.l_running[m]:
            self._start_step(m, now)

    def _decide(self, t: int, now: float) -> None:
        r = self.rounds[t]
        members = r.members
        can_still = sum(
            1
            for i in range(self.cfg.learners)
            if self.l_running[i] and i not in members and self.l_step[i] <= t
        )
        d = self.policy.decide(
            now_s=now,
            n_arrived=len(members),
            n_live=max(1, len(members) + can_still),
            quorum_at_s=r.quorum_at_s,
        )
        if (isinstance(d, MergeNow) or isinstance(d, WaitUntil)) and r.quorum_at_s is None:
            r.quorum_at_s = now
            self.policy.xi_quorum.update(now - r.open_at_s)
        if isinstance(d, MergeNow):
            self.done[t] = now + self.c.sync_s
            self.k.after(self.c.sync_s, Event("merge_done", t), _P_TIMER)
            if now >= self.cfg.warmup_s:
                self.n_merges += 1
                self.merge_members += len(members)
            del self.rounds[t]
        elif isinstance(d, WaitUntil):
            r.gen += 1
            self.k.schedule(d.at_s, Event("grace", t, r.gen), _P_TIMER)

    def _on_grace(self, k: EventKernel, ev: Event) -> None:
        r = self.rounds.get(ev.target)
        if r is not None and r.gen == ev.data:
            self._decide(ev.target, k.now_s)

    def _on_merge_done(self, k: EventKernel, ev: Event) -> None:
        self.policy.xi_sync.update(self.c.sync_s)
        for m in range(self.cfg.learners):
            if self.l_running[m] and self.l_blocked_on[m] == ev.target:
                self._start_step(m, k.now_s)


def run_once(
    cfg: SimConfig,
    seed: int,
    *,
    log_events: bool = False,
    failures: tuple[Sequence[float], Sequence[int]] | None = None,
    log: list[LogEntry] | None = None,
) -> RunResult:
    """Simulate one seed of ``cfg``.

    ``failures`` injects a fixed failure stream ``(times_s, chip_ids)`` instead of drawing
    one (deterministic fault injection). With ``log_events``, the dispatched events are
    appended to ``log``.
    """
    arrays = None
    if failures is not None:
        arrays = (np.asarray(failures[0], dtype=float), np.asarray(failures[1], dtype=np.int64))
    sim = _Sim(cfg, seed, log_events, arrays)
    result = sim.run()
    if log is not None:
        log.extend(sim.k.log)
    return result
