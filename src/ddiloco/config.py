"""Run configuration: one typed dataclass, validated on construction, shared by the
in-process engine and the process launcher. CLI flags override its fields."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ddiloco.algorithm.codecs import CODECS, get_codec
from ddiloco.algorithm.fragments import STRATEGIES
from ddiloco.algorithm.merge import MERGE_RULES

__all__ = ["TrainConfig", "METHODS", "ENGINES", "INNER_OPTIMIZERS", "preset", "PRESETS"]

METHODS = ("local", "dp", "diloco", "streaming", "decoupled")
ENGINES = ("inproc", "processes")
INNER_OPTIMIZERS = ("adamw", "sgd")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    # -- what runs ----------------------------------------------------------------------
    method: str = "decoupled"
    """Training method: local (no sync), dp, diloco, streaming or decoupled."""
    engine: str = "inproc"
    """inproc: all learners in one process on a virtual clock (deterministic);
    processes: a real syncer and learner processes on loopback."""
    learners: int = 4
    """M: number of learners (independent data-parallel islands)."""
    steps: int = 2000
    """Inner steps per learner (methods compare at equal tokens)."""
    seed: int = 0
    """Seed of the model init, data streams, speeds and failures."""
    out: str = "runs/latest"
    """Run directory: summary.json, metrics.jsonl, logs."""

    # -- model, data, inner optimizer ---------------------------------------------------
    model: str = "gpt_tiny"
    """Model preset (see ``ddiloco.models.MODEL_PRESETS``)."""
    data: str = "synthetic"
    """Data source: synthetic, text:PATH, bin:PATH, hf:PATH, digits or images:PATH."""
    batch_size: int = 16
    """Sequences per inner step per learner."""
    block_size: int = 64
    """Tokens per sequence."""
    vocab_size: int = 32
    """Vocabulary of the built-in synthetic language (and the model)."""
    inner_optimizer: str = "adamw"
    """Inner optimizer of each learner: adamw or sgd."""
    inner_lr: float = 3e-3
    """Inner learning rate."""
    weight_decay: float = 0.0
    """Inner AdamW weight decay."""
    lr_schedule: str = "cosine"
    """Inner learning-rate schedule over ``steps``: constant, or linear warmup then cosine."""
    warmup_steps: int = 30
    """Linear warmup steps of the cosine schedule."""
    min_lr_frac: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of ``inner_lr``."""
    eval_every: int = 100
    """Evaluate the global model every this many inner steps (per learner)."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""

    # -- Decoupled / Streaming DiLoCo ---------------------------------------------------
    fragments: int = 8
    """P: number of fragments (1 = whole model)."""
    H: int = 24  # noqa: N815 - paper symbol
    """Inner steps between two syncs of the same fragment."""
    tau: int = 2
    """Overlap steps: a fragment sent at step t is installed at step t + tau."""
    quorum: int = 1
    """K: minimum learners per merge."""
    grace: bool = True
    """Adaptive grace window after the quorum."""
    gamma: float = 0.5
    """Grace window safety factor, in [0, 1)."""
    outer_lr: float = 0.7
    """Outer Nesterov SGD learning rate."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum."""
    merge_rule: str = "rda"
    """rda (radial-directional; embeddings averaged) or average."""
    alpha: float = 0.0
    """Install mixing: theta <- alpha*theta_local + (1-alpha)*Theta (0 = overwrite)."""
    codec: str = "bf16"
    """Codec of what learners send (outer-gradient deltas)."""
    down_codec: str = "fp32"
    """Codec of merged fragments sent back."""
    fragmentation: str = "balanced"
    """Fragmentation strategy."""
    schedule: str = "time"
    """When a learner sends fragment p: ``time`` (at its slot in elapsed time, in units of
    step_time_s: learners of different speeds send together, so the grace window can
    gather them) or ``steps`` (every H of its own inner steps)."""
    scale_partial: bool = True
    """Scale a round that merges k of n live learners to k/n of an outer step."""
    max_staleness: int = 16
    """Pushes more than this many versions behind are dropped."""
    staleness_discount: float = 1.0
    """Merge weight factor per version a push is behind (1: none; see SyncerConfig)."""
    anchor: str = "current"
    """Outer-gradient anchor: current global fragment, or the learner's base version."""

    # -- the simulated world (inproc engine; chaos presets for processes) ---------------
    step_time_s: float = 1.0
    """Base inner-step time of a learner (virtual seconds in the inproc engine)."""
    speeds: tuple[float, ...] = ()
    """Per-learner speed factors (1.0 = base; 0.85 = 18% slower step). Empty: all 1.0."""
    step_noise: float = 0.0
    """Relative standard deviation of step times."""
    mtbi_s: float = 0.0
    """Mean up-time between failures of one learner (0 = no failures)."""
    downtime_s: float = 0.0
    """Downtime after a failure before the learner rejoins."""
    latency_s: float = 0.05
    """One-way learner <-> syncer latency."""
    bandwidth_Bps: float = 0.0  # noqa: N815
    """Learner <-> syncer bandwidth in bytes/s (0 = unlimited)."""
    merge_time_s: float = 0.01
    """Syncer time per merge."""
    progress: bool = True
    """Show a progress bar."""
    metrics_sinks: str = "jsonl"
    """Where metrics rows go besides ``metrics.jsonl`` (always written: the summary and
    ``ddiloco report`` read it): comma-separated names of ``ddiloco.metrics.SINKS``, e.g.
    ``jsonl,tensorboard,wandb,mlflow``."""

    # -- devices (learner processes) ----------------------------------------------------
    device: str = "auto"
    """Device of each learner rank: auto (cuda:LOCAL_RANK where CUDA is available, else
    cpu), cpu or cuda."""
    autocast: str = "none"
    """Mixed precision of the inner steps on a CUDA device: none or bf16 (autocast)."""

    def __post_init__(self) -> None:
        def one_of(name: str, value: str, allowed) -> None:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")

        one_of("method", self.method, METHODS)
        one_of("engine", self.engine, ENGINES)
        one_of("inner_optimizer", self.inner_optimizer, INNER_OPTIMIZERS)
        one_of("merge_rule", self.merge_rule, MERGE_RULES)
        one_of("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        if self.warmup_steps < 0 or not 0 <= self.min_lr_frac <= 1:
            raise ValueError("warmup_steps must be >= 0 and min_lr_frac in [0, 1]")
        get_codec(self.codec)  # raises ValueError naming what is allowed
        one_of("down_codec", self.down_codec, tuple(CODECS))
        one_of("fragmentation", self.fragmentation, STRATEGIES)
        one_of("anchor", self.anchor, ("current", "base"))
        one_of("schedule", self.schedule, ("time", "steps"))
        one_of("device", self.device, ("auto", "cpu", "cuda"))
        one_of("autocast", self.autocast, ("none", "bf16"))
        from ddiloco.metrics.sinks import parse_sinks
        self.metrics_sinks = ",".join(parse_sinks(self.metrics_sinks)) or "jsonl"
        from ddiloco.data import parse_data_spec
        from ddiloco.models import MODEL_PRESETS
        parse_data_spec(self.data)  # validates the kind and the path's presence
        one_of("model", self.model, tuple(MODEL_PRESETS))
        if self.model.startswith("vit") != (self.data.split(":")[0] in ("digits", "images")):
            raise ValueError(f"model {self.model!r} does not fit data {self.data!r}: image models "
                             f"(vit_*) need image data (digits, images:PATH) and vice versa")
        for name in ("learners", "steps", "batch_size", "block_size", "fragments", "H", "quorum",
                     "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.tau < 0 or self.tau >= self.H:
            raise ValueError(f"tau must be in [0, H={self.H}), got {self.tau}")
        if self.fragments > self.H:
            raise ValueError(f"fragments P={self.fragments} must be <= H={self.H}")
        if self.quorum > self.learners:
            raise ValueError(f"quorum K={self.quorum} cannot exceed learners M={self.learners}")
        if not 0 <= self.gamma < 1:
            raise ValueError(f"gamma must be in [0, 1), got {self.gamma}")
        if not 0 <= self.alpha < 1:
            raise ValueError(f"alpha must be in [0, 1), got {self.alpha}")
        for name in ("inner_lr", "outer_lr", "step_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        for name in ("step_noise", "mtbi_s", "downtime_s", "latency_s", "bandwidth_Bps",
                     "merge_time_s", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.mtbi_s > 0 and self.downtime_s <= 0:
            raise ValueError("failures need a downtime: set downtime_s > 0 with mtbi_s")
        self.speeds = tuple(float(s) for s in self.speeds)
        if self.speeds and len(self.speeds) != self.learners:
            raise ValueError(f"speeds has {len(self.speeds)} entries for {self.learners} learners")
        if any(not s > 0 for s in self.speeds):
            raise ValueError("speeds must all be > 0")

    def lr_at(self, step: int) -> float:
        """Inner learning rate for inner step ``step`` (0-based)."""
        if self.lr_schedule == "constant":
            return self.inner_lr
        if step < self.warmup_steps:
            return self.inner_lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.inner_lr * (self.min_lr_frac + (1.0 - self.min_lr_frac) * cos)

    def speed(self, m: int) -> float:
        return self.speeds[m] if self.speeds else 1.0

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _hetero(m: int) -> tuple[float, ...]:
    """Half the learners 18% slower (the paper's two chip generations)."""
    return tuple(1.0 if i < (m + 1) // 2 else 1 / 1.18 for i in range(m))


PRESETS = {
    "default": lambda c: c,
    # each learner down ~15% of the time: mean up 170 s, down 30 s (step = 1 s)
    "failures": lambda c: c.replace(mtbi_s=170.0, downtime_s=30.0),
    # half the learners 18% slower, 10% step noise
    "hetero": lambda c: c.replace(speeds=_hetero(c.learners), step_noise=0.1),
}


def preset(name: str, base: TrainConfig | None = None) -> TrainConfig:
    """A named preset applied on top of ``base`` (defaults if None)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name](base or TrainConfig())



