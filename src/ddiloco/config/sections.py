"""The sections of a run's configuration, one per concern: model, data, optimization, sync
algorithm, simulated world, chaos of real runs (``ddiloco.config.chaos``), runtime and
transport.

Each section is a typed dataclass with a docstring under every field and validation on
construction; errors name the field as ``section.field`` and say what is allowed. The
command line is generated from these declarations (``ddiloco.config.flags``), and the TOML
file form (``ddiloco.config.files``) has one table per section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from ddiloco.algorithm.codecs import codec_names, downlink_codec_names, get_codec
from ddiloco.algorithm.fragments import STRATEGIES
from ddiloco.algorithm.learner_state import DEFAULT_ALPHA, DEFAULT_INSTALL, INSTALL_RULES
from ddiloco.algorithm.merge import MERGE_RULES
from ddiloco.algorithm.policy import PolicyConfig
from ddiloco.algorithm.syncer_state import FINAL_MERGES, SyncerConfig
from ddiloco.backends import backend_names
from ddiloco.config.chaos import ChaosConfig
from ddiloco.data.stream import DEFAULT_SHARD_BLOCK, SHARDINGS
from ddiloco.runtime.transport.bulk import BulkLimits

__all__ = [
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "SyncConfig",
    "WorldConfig",
    "ChaosConfig",
    "RuntimeConfig",
    "IslandLayout",
    "ISLAND_SHARDINGS",
    "SECTIONS",
    "RUNTIME_DEFAULTS",
    "SYNC_DEFAULTS",
    "METHODS",
    "ENGINES",
    "INNER_OPTIMIZERS",
    "Method",
    "Engine",
]

METHODS = ("local", "dp", "diloco", "streaming", "decoupled")
ENGINES = ("auto", "inproc", "processes")
INNER_OPTIMIZERS = ("adamw", "sgd")
Method = Literal["local", "dp", "diloco", "streaming", "decoupled"]
Engine = Literal["auto", "inproc", "processes"]


def one_of(name: str, value: object, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def at_least(name: str, value: float, low: float) -> None:
    if not value >= low:
        raise ValueError(f"{name} must be >= {low:g}, got {value}")


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def fraction(name: str, value: float) -> None:
    """A value in [0, 1)."""
    if not 0 <= value < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str = "gpt_tiny"
    """Model preset: gpt_tiny, gpt_mini, gpt_3m, gpt_small, gpt_100m, gpt_125m, moe_tiny,
    moe_small (language models), vit_digits, vit_tiny_rgb (image classifiers; see
    ``ddiloco.models``)."""

    def __post_init__(self) -> None:
        from ddiloco.models import MODEL_PRESETS

        one_of("model.name", self.name, tuple(MODEL_PRESETS))


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: str = "synthetic"
    """Data source: synthetic (a built-in language with a known entropy floor), text:PATH,
    bin:PATH, hf:PATH, digits or images:PATH."""
    batch_size: int = 16
    """Sequences (or images) per inner step per learner."""
    block_size: int = 64
    """Tokens per sequence (and the language model's context)."""
    vocab_size: int = 32
    """Vocabulary of the built-in synthetic language (and of the model trained on it)."""
    sharding: Literal["interleaved", "contiguous"] = "interleaved"
    """How token data (text, bin, hf) is shared among learners: interleaved (blocks of
    shard_block tokens dealt round-robin, so every learner samples the whole corpus and
    DP reads the same shares) or contiguous (one run of the corpus each, for non-iid
    studies)."""
    shard_block: int = DEFAULT_SHARD_BLOCK
    """Tokens per block of the interleaved sharding."""

    def __post_init__(self) -> None:
        from ddiloco.data import parse_data_spec

        try:
            parse_data_spec(self.source)  # validates the kind and the path's presence
        except ValueError as e:
            raise ValueError(f"data.source: {e}") from None
        at_least("data.batch_size", self.batch_size, 1)
        at_least("data.block_size", self.block_size, 1)
        at_least("data.vocab_size", self.vocab_size, 2)
        one_of("data.sharding", self.sharding, SHARDINGS)
        at_least("data.shard_block", self.shard_block, 2)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    inner_optimizer: Literal["adamw", "sgd"] = "adamw"
    """Inner optimizer of each learner: adamw or sgd."""
    inner_lr: float = 3e-3
    """Inner learning rate (peak of the schedule)."""
    weight_decay: float = 0.0
    """Inner AdamW weight decay."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """Inner learning-rate schedule over the run's steps: constant, or linear warm-up then
    cosine decay."""
    warmup_steps: int = 30
    """Linear warm-up steps of the cosine schedule."""
    min_lr_frac: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of ``inner_lr``."""
    eval_every: int = 100
    """Evaluate the global model every this many inner steps per learner (both engines; the
    real runtime's launcher evaluates the model the syncer publishes)."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""

    def __post_init__(self) -> None:
        one_of("optim.inner_optimizer", self.inner_optimizer, INNER_OPTIMIZERS)
        one_of("optim.lr_schedule", self.lr_schedule, ("constant", "cosine"))
        positive("optim.inner_lr", self.inner_lr)
        at_least("optim.weight_decay", self.weight_decay, 0)
        at_least("optim.warmup_steps", self.warmup_steps, 0)
        if not 0 <= self.min_lr_frac <= 1:
            raise ValueError(f"optim.min_lr_frac must be in [0, 1], got {self.min_lr_frac}")
        at_least("optim.eval_every", self.eval_every, 1)
        at_least("optim.eval_batches", self.eval_batches, 1)


if TYPE_CHECKING:
    MergeRuleName = str
    LauncherName = str
else:  # the registered names, so flags and files list and check them
    MergeRuleName = Literal[MERGE_RULES]
    LauncherName = Literal[backend_names("launcher")]

_POLICY = PolicyConfig()
_SYNCER = SyncerConfig()
_DATA_PORT = BulkLimits()
# The algorithm layer's own defaults (the policy's K, grace, gamma and tau, the state
# machine's outer step and staleness rules, the learners' alpha and install rule) and the
# transport's (the data port's limits) are the values declared there: the configuration
# reads them, so the two cannot drift. Every other library default (SyncerServerConfig,
# DecoupledLearner, the simulator's policy) reads this configuration;
# tests/config/test_defaults.py compares them all.


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    fragments: int = 8
    """P: number of fragments the model is split into (1 = the whole model at once)."""
    H: int = 24  # noqa: N815 - paper symbol
    """Inner steps between two syncs of the same fragment."""
    tau: int = _POLICY.tau
    """Overlap steps: a fragment sent at step t is installed at step t + tau."""
    quorum: int = _POLICY.quorum
    """K: minimum learners per merge."""
    grace: bool = _POLICY.grace
    """Adaptive grace window after the quorum (wait for more learners while it costs
    nothing)."""
    gamma: float = _POLICY.gamma
    """Grace window safety factor, in [0, 1): the window is gamma x (tau x step time - time to
    quorum - merge and return). With the time-driven schedule learners push fragment p at
    their first step end after its slot, up to one step apart, so covering that spread at
    tau = 2 needs gamma above 1/2 plus a margin for the merge's return."""
    outer_lr: float = _SYNCER.outer_lr
    """Outer Nesterov SGD learning rate."""
    outer_momentum: float = _SYNCER.outer_momentum
    """Outer Nesterov momentum, in [0, 1)."""
    merge_rule: MergeRuleName = _SYNCER.merge_rule
    """rda (radial-directional; embeddings averaged) or average (plain token-weighted); the
    rules registered in ``ddiloco.algorithm.merge``."""
    alpha: float = DEFAULT_ALPHA
    """Install mixing: theta <- alpha * theta_local + (1 - alpha) * Theta (0 = overwrite)."""
    install: Literal["rebase", "overwrite"] = DEFAULT_INSTALL
    """How a learner installs a merged fragment: ``rebase`` (the merged value plus the
    learner's own progress since the push it merged: no step is thrown away, however late
    the merged value) or ``overwrite`` (the paper's rule: the steps made since the push,
    the tau overlap and any late-install steps, are replaced). Alpha mixing composes with
    both. The decoupled method only; the synchronous baselines overwrite."""
    codec: str = "bf16"
    """Codec of what learners send, by name in the codec registry (an unknown name lists
    them; docs/configuration.md): fp32, bf16, int8, int4, ...; those with block scales take
    another block size as e.g. int2/4096."""
    down_codec: str = "fp32"
    """Codec of merged fragments sent back to learners (the real runtime: those whose
    ``downlink`` is set, all but 1bit). Without ``down_delta`` the merged weights themselves
    are quantised: int8 costs little, int4 and int2 are too coarse for weights
    (docs/results/wan.md)."""
    down_delta: bool = False
    """Delta-coded downlink: the syncer sends each learner the merged fragment minus the copy
    that learner already holds, through ``down_codec``, and keeps that copy in step (one per
    learner and fragment, in the syncer's memory). The rounding error is carried into the
    next fetch instead of being installed, so int4 and int2 downlinks keep quality. A learner
    without a copy (a join, a restarted syncer, a lost reply) gets one fp32 fetch."""
    fragmentation: Literal["balanced", "per-layer", "strided", "per-tensor"] = "balanced"
    """How parameters are grouped into the P fragments."""
    schedule: Literal["time", "steps"] = "time"
    """When a learner sends fragment p: ``time`` (at its slot in elapsed time: learners of
    different speeds send together, so the grace window can gather them) or ``steps``
    (every H of its own inner steps)."""
    scale_partial: bool = _SYNCER.scale_partial
    """Scale a round that merges k of n live learners to k/n of an outer step."""
    final_merge: Literal["average", "nesterov", "sgd", "none"] = cast(
        Literal["average", "nesterov", "sgd", "none"], _SYNCER.final_merge
    )
    """How every method merges the run's last, partial round: average (the global model
    becomes the learners' average, no outer step), nesterov (a regular outer step), sgd
    (the outer step without momentum) or none (left out)."""
    norm_clip: float = _SYNCER.norm_clip
    """Merge guard: an outer gradient whose norm is over norm_clip x the median of its
    fragment's last 32 merged ones is scaled down to that bound (a wild learner moves the
    model at most that far); 0 turns it off."""
    max_staleness: int = _SYNCER.max_staleness
    """Pushes more than this many versions behind are dropped."""
    staleness_discount: float = _SYNCER.staleness_discount
    """Merge weight factor per version a push is behind (1: none)."""
    anchor: Literal["current", "base"] = cast(Literal["current", "base"], _SYNCER.anchor)
    """Outer-gradient anchor: the current global fragment, or the learner's base version."""
    history: int | None = None
    """Past versions the syncer keeps per fragment (delta-encoded pushes and
    ``anchor = base`` need them). Unset: ``max_staleness`` when pushes are delta-encoded
    (``Codec.delta``: the int codecs, not fp32 or bf16) or the anchor is ``base``, else
    none."""

    def __post_init__(self) -> None:
        for name in ("fragments", "H", "quorum"):
            at_least(f"sync.{name}", getattr(self, name), 1)
        if not 0 <= self.tau < self.H:
            raise ValueError(f"sync.tau must be in [0, H={self.H}), got {self.tau}")
        if self.fragments > self.H:
            raise ValueError(f"sync.fragments P={self.fragments} must be <= H={self.H}")
        fraction("sync.gamma", self.gamma)
        fraction("sync.alpha", self.alpha)
        one_of("sync.install", self.install, INSTALL_RULES)
        fraction("sync.outer_momentum", self.outer_momentum)
        positive("sync.outer_lr", self.outer_lr)
        one_of("sync.merge_rule", self.merge_rule, MERGE_RULES)
        try:
            get_codec(self.codec)
        except ValueError as e:
            raise ValueError(f"sync.codec: {e}") from None
        one_of("sync.down_codec", self.down_codec, codec_names())
        if self.down_delta and get_codec(self.down_codec).lossless:
            lossy = [n for n in downlink_codec_names() if not get_codec(n).lossless]
            raise ValueError(
                f"sync.down_delta codes the downlink through a lossy down_codec; with "
                f"{self.down_codec} it changes nothing: set sync.down_codec "
                f"({', '.join(lossy)}) or drop it"
            )
        one_of("sync.fragmentation", self.fragmentation, STRATEGIES)
        one_of("sync.schedule", self.schedule, ("time", "steps"))
        one_of("sync.anchor", self.anchor, ("current", "base"))
        one_of("sync.final_merge", self.final_merge, FINAL_MERGES)
        at_least("sync.max_staleness", self.max_staleness, 0)
        if self.norm_clip != 0 and not 1 <= self.norm_clip < float("inf"):
            raise ValueError(f"sync.norm_clip must be 0 (off) or >= 1, got {self.norm_clip}")
        if not 0.0 < self.staleness_discount <= 1.0:
            raise ValueError(
                f"sync.staleness_discount must be in (0, 1], got {self.staleness_discount}"
            )
        if self.history is not None:
            at_least("sync.history", self.history, 0)

    def resolved_history(self) -> int:
        if self.history is not None:
            return self.history
        delta = get_codec(self.codec).delta
        return self.max_staleness if (delta or self.anchor == "base") else 0

    def syncer_config(self) -> SyncerConfig:
        """The syncer state machine's configuration: the same for the in-process engine and
        the real syncer."""
        return SyncerConfig(
            policy=PolicyConfig(
                quorum=self.quorum, grace=self.grace, gamma=self.gamma, tau=self.tau
            ),
            merge_rule=self.merge_rule,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            max_staleness=self.max_staleness,
            staleness_discount=self.staleness_discount,
            anchor=self.anchor,
            history=self.resolved_history(),
            scale_partial=self.scale_partial,
            final_merge=self.final_merge,
            norm_clip=self.norm_clip,
        )


@dataclass(kw_only=True, slots=True)
class WorldConfig:
    step_time_s: float = 1.0
    """Base inner-step time of a learner (virtual seconds; in-process engine)."""
    speeds: tuple[float, ...] = ()
    """Per-learner speed factors (1.0 = base; 0.85 = an 18% slower step). Empty: all 1.0.
    Real processes: a slower learner's steps are stretched by 1 / speed."""
    step_noise: float = 0.0
    """Relative standard deviation of step times (in-process engine)."""
    mtbi_s: float = 0.0
    """Mean up-time between failures of one learner (0 = no failures). Real processes: a
    seeded SIGKILL schedule at the same rate."""
    downtime_s: float = 0.0
    """Downtime after a failure before the learner rejoins."""
    latency_s: float = 0.05
    """One-way learner <-> syncer latency (virtual; in-process engine)."""
    bandwidth_Bps: float = 0.0  # noqa: N815
    """Learner <-> syncer bandwidth in bytes/s (0 = unlimited). Real processes: the
    learners' links are throttled to it."""
    merge_time_s: float = 0.01
    """Syncer time per merge (virtual; in-process engine)."""

    def __post_init__(self) -> None:
        self.speeds = tuple(float(s) for s in self.speeds)
        if any(not s > 0 for s in self.speeds):
            raise ValueError(f"world.speeds must all be > 0, got {list(self.speeds)}")
        positive("world.step_time_s", self.step_time_s)
        for name in (
            "step_noise",
            "mtbi_s",
            "downtime_s",
            "latency_s",
            "bandwidth_Bps",
            "merge_time_s",
        ):
            at_least(f"world.{name}", getattr(self, name), 0)
        if self.mtbi_s > 0 and self.downtime_s <= 0:
            raise ValueError("failures need a downtime: set world.downtime_s > 0 with world.mtbi_s")


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    host: str = "127.0.0.1"
    """Address the syncer binds (0.0.0.0 for other hosts)."""
    port: int = 0
    """Syncer port (0: a free one, printed and written to the port file)."""
    bulk_port: int = 0
    """Data port for fragment pushes and fetches (framed TCP beside gRPC, several times
    faster; learners learn it when they join and fall back to gRPC if they cannot reach it).
    0: a free port; -1: off. Fix it (and open it) when learners are behind a firewall."""
    http_port: int | None = None
    """The syncer's observability HTTP port on ``host``: Prometheus /metrics, /healthz,
    /readyz and the live dashboard at / (the token needed except for the probes). 0: a free
    one (under ``ddiloco train`` chosen once, so a restarted syncer keeps it, and printed
    with the run's token); unset: off."""
    handshake_timeout_s: float = _DATA_PORT.handshake_timeout_s
    """Seconds a new data-port connection has to authenticate (TLS and hello)."""
    max_connections: int = _DATA_PORT.max_connections
    """Open data-port connections in total (more are closed at once)."""
    max_connections_per_peer: int = _DATA_PORT.max_connections_per_peer
    """Open data-port connections from one IP address that no learner's session holds
    (handshaking, or authenticated by the token alone)."""
    data_workers: int = _DATA_PORT.workers
    """Threads serving data-port requests (idle connections hold none)."""
    token_file: str | None = None
    """File holding the shared secret (else ``$DDILOCO_TOKEN``)."""
    tls_cert: str | None = None
    """Syncer certificate (PEM); with ``tls_key`` it enables TLS."""
    tls_key: str | None = None
    """Syncer private key (PEM)."""
    tls_ca: str | None = None
    """CA certificate (PEM) learners use to talk TLS to the syncer."""
    heartbeat_timeout_s: float = 3.0
    """Seconds without a heartbeat before the syncer declares a learner dead."""
    heartbeat_interval_s: float = 0.25
    """Seconds between a learner's heartbeats (each carries its progress report; an idle
    long poll for merged versions lasts two of them, at least 0.5 s). Keep it several times
    under ``heartbeat_timeout_s``; a longer one saves control traffic on slow links."""
    checkpoint_every: int = 1
    """Syncer checkpoint cadence: 1 makes every merge durable before it is published; N
    checkpoints every N merges."""
    max_push_bytes: int = 1 << 30
    """Pushes declaring a larger payload are rejected before it is read."""
    step_budget: int | None = None
    """Total inner steps of all learners together (a global budget: learners run until it
    is spent, so one that lost time to a failure is made up for by the others). Unset:
    learners x steps for a syncer given a run file (``ddiloco train``, ``ddiloco syncer
    --config``), none for a bare ``ddiloco syncer``; 0: none (each learner runs its own
    steps)."""
    island_size: int = 1
    """Ranks per learner; > 1 runs each learner as a torchrun island (``island_sharding``
    inside)."""
    island_sharding: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """How an island's ranks hold the model: ddp (each rank the whole model; rank 0 talks
    to the syncer and broadcasts installs), fsdp (FSDP2 over the island's ranks: each rank
    holds, pushes and installs its own shard of every tensor; ``docs/sharding.md``) or hsdp
    (FSDP2 on a 2-D mesh: ``island_replicas`` replicas of island_size / island_replicas
    shards)."""
    island_replicas: int = 2
    """HSDP's replicas per island (must divide island_size); read with island_sharding
    hsdp only."""
    islands: str = ""
    """Learners of different layouts: one per learner, comma-separated, each single,
    ddp:R, fsdp:R or hsdp:AxB (A replicas of B shards, A x B ranks), e.g.
    fsdp:2,ddp:2,single; empty: every learner is island_size ranks of island_sharding."""
    shards: int = 1
    """Syncer processes S under ``ddiloco train``, each owning the fragments p with
    p % S == its index (``ddiloco.runtime.transport.shards``), each checkpointed to
    ``checkpoint/shard_k`` and restarted on its own."""
    connect_timeout_s: float = 300.0
    """How long a learner waits for the syncer."""
    launcher: LauncherName = "local"
    """Who starts and restarts the syncer shards and learners of ``ddiloco train``, a
    launcher of ``ddiloco.backends``: local (processes on this host,
    supervised by the built-in launcher) or ray (Ray actors with declared CPUs and GPUs,
    brought back by Ray's actor restarts; needs ``pip install 'ddiloco[ray]'``)."""
    ray_address: str | None = None
    """The Ray cluster of launcher ray: the head's HOST:PORT (or auto: the cluster this
    machine belongs to); unset: a local cluster started for the run."""
    metrics_sinks: str = "jsonl"
    """Where metrics rows go besides ``metrics.jsonl`` (always written: the summary and
    ``ddiloco report`` read it), in both engines, the syncer and the learners:
    comma-separated names of ``ddiloco.metrics.SINKS``, e.g. jsonl,tensorboard,wandb,mlflow
    (each needs its extra)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the syncer and learner processes."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of each learner rank: auto (cuda:LOCAL_RANK where CUDA is available, else
    cpu), cpu or cuda."""
    autocast: Literal["none", "bf16"] = "none"
    """Mixed precision of the inner steps' forward pass, in both engines and on CPU or CUDA:
    none (fp32) or bf16 (autocast; parameters, optimizer state and evaluation stay fp32)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"runtime.port must be in [0, 65535] (0: a free one), got {self.port}")
        if not -1 <= self.bulk_port <= 65535:
            raise ValueError(
                f"runtime.bulk_port must be in [0, 65535] (0: a free one, -1: "
                f"off), got {self.bulk_port}"
            )
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(
                f"runtime.http_port must be in [0, 65535] (0: a free one), got {self.http_port}"
            )
        positive("runtime.handshake_timeout_s", self.handshake_timeout_s)
        for name in ("max_connections", "max_connections_per_peer", "data_workers"):
            at_least(f"runtime.{name}", getattr(self, name), 1)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both runtime.tls_cert and runtime.tls_key")
        positive("runtime.heartbeat_timeout_s", self.heartbeat_timeout_s)
        positive("runtime.heartbeat_interval_s", self.heartbeat_interval_s)
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            raise ValueError(
                f"runtime.heartbeat_interval_s ({self.heartbeat_interval_s:g}) must be under "
                f"runtime.heartbeat_timeout_s ({self.heartbeat_timeout_s:g}), or every "
                "learner is declared dead between two heartbeats"
            )
        at_least("runtime.checkpoint_every", self.checkpoint_every, 1)
        at_least("runtime.max_push_bytes", self.max_push_bytes, 1)
        if self.step_budget is not None:
            at_least("runtime.step_budget", self.step_budget, 0)
        at_least("runtime.island_size", self.island_size, 1)
        one_of("runtime.island_sharding", self.island_sharding, ISLAND_SHARDINGS)
        at_least("runtime.island_replicas", self.island_replicas, 1)
        self.island(0)  # the uniform layout is valid
        self.islands = ",".join(str(x) for x in self.layouts())
        at_least("runtime.shards", self.shards, 1)
        positive("runtime.connect_timeout_s", self.connect_timeout_s)
        one_of("runtime.launcher", self.launcher, backend_names("launcher"))
        if self.ray_address is not None and self.launcher != "ray":
            raise ValueError(
                "runtime.ray_address names a Ray cluster: set runtime.launcher = ray "
                "(--launcher ray) with it"
            )
        one_of("runtime.log_level", self.log_level, ("debug", "info", "warning", "error"))
        from ddiloco.metrics.sinks import parse_sinks

        try:
            self.metrics_sinks = ",".join(parse_sinks(self.metrics_sinks)) or "jsonl"
        except ValueError as e:
            raise ValueError(f"runtime.metrics_sinks: {e}") from None
        one_of("runtime.device", self.device, ("auto", "cpu", "cuda"))
        one_of("runtime.autocast", self.autocast, ("none", "bf16"))

    def layouts(self) -> tuple[IslandLayout, ...]:
        """The learners' layouts of ``islands`` (empty when every learner has the uniform
        one)."""
        return tuple(
            IslandLayout.parse(x, "runtime.islands") for x in self.islands.split(",") if x.strip()
        )

    def island(self, m: int | None) -> IslandLayout:
        """Learner m's layout: its entry of ``islands``, else ``island_size`` ranks of
        ``island_sharding`` (also for a learner beyond the list, or without an id)."""
        per = self.layouts()
        if m is not None and 0 <= m < len(per):
            return per[m]
        if self.island_size == 1:
            return IslandLayout(1, "single")
        replicas = self.island_replicas if self.island_sharding == "hsdp" else 1
        if self.island_size % replicas:
            raise ValueError(
                f"runtime.island_replicas {replicas} does not divide runtime.island_size "
                f"{self.island_size} (an HSDP island is replicas x shards ranks)"
            )
        return IslandLayout(self.island_size, self.island_sharding, replicas)

    @property
    def max_island_size(self) -> int:
        """The most ranks of any learner's island."""
        return max([self.island(None).size, *(x.size for x in self.layouts())])


ISLAND_SHARDINGS = ("ddp", "fsdp", "hsdp")
"""How an island's ranks hold the model (``runtime.island_sharding``)."""


@dataclass(frozen=True, slots=True)
class IslandLayout:
    """One learner's ranks and how they hold the model: ``single`` (one process), ``ddp``,
    ``fsdp``, or ``hsdp`` with ``replicas`` replicas of size / replicas shards."""

    size: int
    sharding: Literal["single", "ddp", "fsdp", "hsdp"]
    replicas: int = 1

    @classmethod
    def parse(cls, text: str, name: str = "layout") -> IslandLayout:
        """``single``, ``ddp:R``, ``fsdp:R`` or ``hsdp:AxB``; a ValueError naming ``name``
        and the forms otherwise."""
        t = text.strip().lower()
        forms = "single, ddp:R, fsdp:R or hsdp:AxB (A replicas of B shards)"
        kind, _, n = t.partition(":")
        try:
            if t == "single":
                return cls(1, "single")
            if kind in ("ddp", "fsdp") and int(n) >= 1:
                return cls(int(n), "single" if int(n) == 1 else cast(Any, kind))
            if kind == "hsdp":
                a, b = (int(x) for x in n.split("x"))
                if a >= 1 and b >= 1:
                    return cls(a * b, "hsdp", a)
        except ValueError:
            pass
        raise ValueError(f"{name}: {text!r} is no layout; each is {forms}")

    def __str__(self) -> str:
        if self.sharding == "single":
            return "single"
        if self.sharding == "hsdp":
            return f"hsdp:{self.replicas}x{self.size // self.replicas}"
        return f"{self.sharding}:{self.size}"


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "sync": SyncConfig,
    "world": WorldConfig,
    "chaos": ChaosConfig,
    "runtime": RuntimeConfig,
}
"""Section name -> section class, in file order."""

RUNTIME_DEFAULTS = RuntimeConfig()
"""The [runtime] section's defaults, the one instance from which the library's own entry
points (``SyncerServerConfig``, ``DecoupledLearner``) take theirs (compared in
tests/config/test_defaults.py)."""
SYNC_DEFAULTS = SyncConfig()
"""The [sync] section's defaults, taken the same way."""
