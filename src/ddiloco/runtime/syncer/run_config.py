"""The syncer service's configuration: ``SyncerServerConfig``, and how a run's
``TrainConfig`` builds it.

``ddiloco syncer`` (``ddiloco.runtime.cli``) and the launchers' syncer processes and actors
(``ddiloco.runtime.launch``) build their ``SyncerServerConfig`` here
(``syncer_server_config``), from the run's [sync] and [runtime] tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ddiloco.algorithm.codecs import downlink_codec_names
from ddiloco.algorithm.syncer_state import SyncerConfig
from ddiloco.config.sections import RUNTIME_DEFAULTS, SYNC_DEFAULTS
from ddiloco.metrics.sinks import parse_sinks
from ddiloco.runtime.syncer.checkpoint import DEFAULT_KEEP
from ddiloco.runtime.transport.bulk import BulkLimits
from ddiloco.runtime.transport.shards import parse_shards

__all__ = ["DOWNLINK_CODECS", "SyncerServerConfig", "syncer_server_config"]

DOWNLINK_CODECS = downlink_codec_names()
"""Codecs of merged fragments sent to learners (the registered ones whose ``downlink`` is
set). int8 and int4 quantise the parameters themselves (learners install the quantised
values; with a quantised uplink their next delta is taken against what they installed, so
the install error does not reach the global model)."""

_RUNTIME, _SYNC = RUNTIME_DEFAULTS, SYNC_DEFAULTS
"""The run configuration's defaults, which ``SyncerServerConfig``'s fields take (compared
in tests/config/test_defaults.py)."""


@dataclass(kw_only=True, slots=True)
class SyncerServerConfig:
    token: str
    """Shared secret every call must carry."""
    host: str = _RUNTIME.host
    """Address to bind. Loopback unless told otherwise."""
    port: int = _RUNTIME.port
    """Port to bind; 0 picks a free one (read it from ``SyncerServer.port``)."""
    syncer: SyncerConfig = field(default_factory=_SYNC.syncer_config)
    """The algorithm's configuration (quorum K, grace, merge rule, outer optimizer...)."""
    downlink_codec: str = _SYNC.down_codec
    """Codec of merged fragments sent to learners: one of ``DOWNLINK_CODECS``."""
    downlink_delta: bool = _SYNC.down_delta
    """Code each learner's fetch as the merged fragment minus the copy that learner holds
    (``sync.down_delta``); the syncer keeps one copy per learner and fragment."""
    max_push_bytes: int = _RUNTIME.max_push_bytes
    """Pushes declaring a larger payload are rejected before their payload is read."""
    heartbeat_timeout_s: float = _RUNTIME.heartbeat_timeout_s
    """A learner silent for this long is declared dead (``SyncerState.leave``)."""
    heartbeat_interval_s: float = _RUNTIME.heartbeat_interval_s
    """The learners' heartbeat interval: a re-timing of the slot clock is announced
    ``max(CLOCK_LEAD_S, 4 x interval)`` ahead, so that every learner hears it first."""
    checkpoint_dir: str | None = None
    """Where checkpoints are written (``syncer.json`` and its fragment files, see
    ``checkpoint``); None disables checkpoints."""
    checkpoint_every: int = _RUNTIME.checkpoint_every
    """1: every merge is durable before it is published. N > 1: a checkpoint every N merges,
    published at once (a SIGKILL may lose up to N - 1 merges)."""
    resume: bool = False
    """Load ``checkpoint_dir/syncer.json`` at start (or, if it is damaged or holds NaN, the
    newest valid one of those kept)."""
    checkpoint_keep: int = DEFAULT_KEEP
    """Checkpoints kept on disk (``syncer.json``, ``syncer.json.1``... and their fragment
    directories): the fallbacks when the newest is damaged."""
    tls_cert: str | None = None
    tls_key: str | None = None
    bulk_port: int | None = _RUNTIME.bulk_port
    """Data port for fragment pushes and fetches (``ddiloco.runtime.transport.bulk``: framed TCP, TLS
    when the syncer has a certificate), advertised to learners in the Join reply. 0 picks
    a free one; None disables it (learners then send fragments over gRPC, a few times
    slower). Learners that cannot reach it fall back to gRPC."""
    data_limits: BulkLimits = field(default_factory=BulkLimits)
    """Connection limits of the data port (hello size, handshake deadline, connections in
    total and per peer, worker threads, request deadline)."""
    max_workers: int = 64
    """gRPC handler threads (each live learner holds up to three calls)."""
    control_reserve: int = 16
    """Handler threads only control calls (Join, Heartbeat, Leave, Status) may use: bulk
    calls (Push, Fetch, Init, Watch) together hold at most ``max_workers - control_reserve``
    threads, so stalled transfers can never starve liveness; more are refused at once
    (``E_BUSY``, retried by learners)."""
    max_streams_per_learner: int = 4
    """Concurrent pushes of one learner, gRPC and data port together (more are refused with
    ``E_BUSY``)."""
    metrics_path: str | None = None
    """Append one JSON line per merge / rejection / membership event here."""
    http_port: int | None = _RUNTIME.http_port
    """Observability HTTP port on ``host`` (Prometheus ``/metrics``, ``/healthz``,
    ``/readyz``, the live dashboard; ``ddiloco.runtime.observe``). 0 picks a free one;
    None (the default) keeps it closed."""
    metrics_sinks: tuple[str, ...] = ()
    """Sinks for the same events besides the JSONL (``ddiloco.metrics.SINKS``: tensorboard,
    wandb, mlflow), written under ``metrics_dir`` as writer ``syncer``."""
    metrics_dir: str | None = None
    """Run directory of the extra sinks; None: the folder of ``metrics_path``."""
    step_budget: int = 0
    """Total inner steps of all learners together (a global budget: a learner that lost
    time to a failure is made up for by the others). Once the learners' reported steps
    reach it, heartbeats tell every learner to finish. 0: no budget (each learner runs
    its own step count)."""
    shards: tuple[str, ...] = ()
    """A sharded syncer (``ddiloco.runtime.transport.shards``): every shard's HOST:PORT, as
    learners reach them, in shard order. Empty: a single syncer owning every fragment."""
    shard: int = 0
    """This process's index in ``shards``: it owns the fragments p with p % S == shard."""
    data_host: str | None = None
    """Host learners should reach the data port at, sent in the Join reply (e.g. the
    address of another interface, or a name behind NAT). None: the host each learner
    dialed for gRPC, which is right whenever both ports are on the same address. Never
    the bind address: 0.0.0.0 or 127.0.0.1 mean nothing to a learner elsewhere."""

    def __post_init__(self) -> None:
        self.shards = tuple(self.shards)
        if self.shards and not 0 <= self.shard < len(self.shards):
            raise ValueError(
                f"shard index {self.shard} out of range for {len(self.shards)} shard addresses"
            )
        if not self.token:
            raise ValueError("a shared-secret token is required")
        if self.downlink_codec not in downlink_codec_names():
            raise ValueError(f"downlink_codec must be one of {downlink_codec_names()}")
        if self.checkpoint_keep < 1:
            raise ValueError("checkpoint_keep must be >= 1")
        if self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key file")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be > 0")
        if not 0 < self.control_reserve < self.max_workers:
            raise ValueError(
                f"control_reserve must be in [1, max_workers) = [1, "
                f"{self.max_workers}), got {self.control_reserve}"
            )
        if self.max_streams_per_learner < 1:
            raise ValueError("max_streams_per_learner must be >= 1")
        if self.step_budget < 0:
            raise ValueError("step_budget must be >= 0 (0: no budget)")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(
                f"HTTP port must be in [0, 65535] (0: any free port; off: "
                f"leave --http-port out), got {self.http_port}"
            )
        self.metrics_sinks = tuple(s for s in parse_sinks(self.metrics_sinks) if s != "jsonl")
        if self.metrics_sinks and not (self.metrics_dir or self.metrics_path):
            raise ValueError(
                f"metrics sinks {', '.join(self.metrics_sinks)} need a folder: "
                f"pass metrics_dir (--metrics-dir) or metrics_path "
                f"(--metrics-file)"
            )
        if self.bulk_port is not None and not 0 <= self.bulk_port <= 65535:
            raise ValueError(
                f"data port must be in [0, 65535] (0: any free port; off: "
                f"--bulk-port -1 / bulk_port=None), got {self.bulk_port}"
            )


def syncer_server_config(
    cfg,
    *,
    token: str,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    metrics_path: str | None = None,
    metrics_dir: str | None = None,
    from_file: bool = True,
    shards: str | None = None,
    shard: int = 0,
    data_host: str | None = None,
) -> SyncerServerConfig:
    """The syncer service's configuration from a run's ``TrainConfig``: its [sync] and
    [runtime] tables. An unset step budget is M x steps for a run file, none without.
    Without a run file the learners' codec is theirs (a syncer takes no ``--codec``), so an
    unset history keeps ``max_staleness`` versions, as for a codec that sends deltas."""
    rt = cfg.runtime
    sync = cfg.sync
    if not from_file and sync.history is None:
        sync = replace(sync, history=sync.max_staleness)
    budget = (
        rt.step_budget
        if rt.step_budget is not None
        else (cfg.learners * cfg.steps if from_file else 0)
    )
    return SyncerServerConfig(
        token=token,
        host=rt.host,
        port=rt.port,
        syncer=sync.syncer_config(),
        downlink_codec=cfg.sync.down_codec,
        downlink_delta=cfg.sync.down_delta,
        max_push_bytes=rt.max_push_bytes,
        heartbeat_timeout_s=rt.heartbeat_timeout_s,
        heartbeat_interval_s=rt.heartbeat_interval_s,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=rt.checkpoint_every,
        resume=resume,
        tls_cert=rt.tls_cert,
        tls_key=rt.tls_key,
        metrics_path=metrics_path,
        metrics_sinks=tuple(cfg.runtime.metrics_sinks.split(",")),
        metrics_dir=metrics_dir,
        step_budget=budget,
        bulk_port=None if rt.bulk_port == -1 else rt.bulk_port,
        http_port=rt.http_port,
        data_limits=BulkLimits(
            handshake_timeout_s=rt.handshake_timeout_s,
            max_connections=rt.max_connections,
            max_connections_per_peer=rt.max_connections_per_peer,
            workers=rt.data_workers,
        ),
        shards=parse_shards(shards),
        shard=shard,
        data_host=data_host,
    )
