"""The syncer service's configuration from a run's ``TrainConfig``.

``ddiloco syncer`` (``ddiloco.runtime.cli``) and the launchers' syncer processes and actors
(``ddiloco.runtime.launch``) build their ``SyncerServerConfig`` here, from the run's [sync]
and [runtime] tables.
"""

from __future__ import annotations

from dataclasses import replace

from ddiloco.runtime.syncer.server import SyncerServerConfig
from ddiloco.runtime.transport.bulk import BulkLimits
from ddiloco.runtime.transport.shards import parse_shards

__all__ = ["syncer_server_config"]


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
