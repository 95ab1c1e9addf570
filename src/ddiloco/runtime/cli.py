"""Command-line entry points of the runtime: ``syncer``, ``learner``, ``status`` and the
process launcher behind ``ddiloco train --engine processes``.

The main CLI (``ddiloco.cli``) mounts these with ``add_syncer_parser(subparsers)`` etc.;
``python -m ddiloco.runtime.cli {syncer,learner,status} ...`` runs them directly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

__all__ = ["add_syncer_parser", "add_learner_parser", "add_status_parser", "add_train_parser",
           "run_processes", "main"]


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


# -- syncer ----------------------------------------------------------------------------------
def add_syncer_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("syncer", help="run the syncer service (gRPC)",
                              description="Run the Decoupled DiLoCo syncer. The shared-secret "
                              "token comes from $DDILOCO_TOKEN or --token-file.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; "
                   "0.0.0.0 for other hosts)")
    p.add_argument("--port", type=int, default=50051, help="port (0: pick a free one)")
    p.add_argument("--port-file", help="write the bound port here (atomic)")
    p.add_argument("--bulk-port", type=int, default=0,
                   help="data port for fragment pushes and fetches (framed TCP beside gRPC, "
                        "several times faster; learners learn it when they join and fall back "
                        "to gRPC if they cannot reach it). 0: a free port; -1: off. Fix it "
                        "(and open it) when learners are behind a firewall")
    p.add_argument("--handshake-timeout", type=float, default=5.0,
                   help="seconds a new data-port connection has to authenticate")
    p.add_argument("--max-connections", type=int, default=256,
                   help="open data-port connections in total (more are closed at once)")
    p.add_argument("--max-connections-per-peer", type=int, default=32,
                   help="open data-port connections from one IP address")
    p.add_argument("--data-workers", type=int, default=16,
                   help="threads serving data-port requests (idle connections hold none)")
    p.add_argument("--http-port", type=int, default=None,
                   help="observability HTTP port on --host: Prometheus /metrics, /healthz, "
                        "/readyz and the live dashboard at / (token needed except for the "
                        "probes). 0: a free port; off unless given")
    p.add_argument("--token-file", help="file holding the shared secret")
    p.add_argument("--tls-cert", help="server certificate (PEM) to enable TLS")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--quorum", type=int, default=1, help="K: minimum learners per merge")
    p.add_argument("--no-grace", action="store_true", help="disable the adaptive grace window")
    p.add_argument("--gamma", type=float, default=0.5, help="grace window safety factor")
    p.add_argument("--tau", type=int, default=2, help="learners' overlap steps (for the grace window)")
    p.add_argument("--merge-rule", default="rda", choices=("rda", "average"))
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--max-staleness", type=int, default=16)
    p.add_argument("--staleness-discount", type=float, default=1.0,
                   help="merge weight factor per version a push is behind (1: none)")
    p.add_argument("--anchor", default="current", choices=("current", "base"))
    p.add_argument("--history", type=int, default=4,
                   help="past versions kept per fragment (delta-encoded pushes need them)")
    p.add_argument("--downlink-codec", default="fp32", choices=("fp32", "bf16", "int8"),
                   help="codec of merged fragments sent to learners (int8: learners install "
                        "quantised parameters)")
    p.add_argument("--max-push-bytes", type=int, default=1 << 30)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds without heartbeat before a learner is declared dead")
    p.add_argument("--checkpoint-dir", help="directory for atomic checkpoints (syncer.pt)")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="1: every merge durable before publication; N: every N merges")
    p.add_argument("--resume", action="store_true", help="resume from --checkpoint-dir")
    p.add_argument("--metrics-file", help="append merge/reject/membership events (JSONL)")
    p.add_argument("--metrics-sink", default="jsonl", metavar="SINKS",
                   help="also send those events to these sinks, comma-separated: "
                        "tensorboard, wandb (offline), mlflow (local file store); JSONL goes "
                        "to --metrics-file")
    p.add_argument("--metrics-dir", help="run directory of the --metrics-sink sinks (default: "
                   "the folder of --metrics-file)")
    p.add_argument("--step-budget", type=int, default=0,
                   help="total inner steps of all learners together; once reached, learners "
                        "are told to finish (0: each learner runs its own --steps)")
    p.add_argument("--shards", help="a sharded syncer: every shard's HOST:PORT as learners "
                   "reach them, comma-separated, in shard order (the same list for every "
                   "shard); fragment p belongs to shard p %% S")
    p.add_argument("--shard", type=int, default=0, help="this process's index in --shards")
    p.add_argument("--data-host", help="host learners should reach the data port at (default: "
                   "the host they dialed for gRPC; set it when the data port is on another "
                   "address or behind NAT)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_syncer)
    return p


def syncer_server_config(args):
    from ddiloco.algorithm.policy import PolicyConfig
    from ddiloco.algorithm.syncer_state import SyncerConfig
    from ddiloco.runtime.transport.auth import load_token
    from ddiloco.runtime.syncer.server import SyncerServerConfig
    from ddiloco.runtime.transport.bulk import BulkLimits
    from ddiloco.runtime.syncer.shards import parse_shards

    sc = SyncerConfig(policy=PolicyConfig(quorum=args.quorum, grace=not args.no_grace,
                                          gamma=args.gamma, tau=args.tau),
                      merge_rule=args.merge_rule, outer_lr=args.outer_lr,
                      outer_momentum=args.outer_momentum, max_staleness=args.max_staleness,
                      staleness_discount=args.staleness_discount,
                      anchor=args.anchor, history=args.history)
    return SyncerServerConfig(token=load_token(args.token_file), host=args.host, port=args.port,
                              syncer=sc, downlink_codec=args.downlink_codec,
                              max_push_bytes=args.max_push_bytes,
                              heartbeat_timeout_s=args.heartbeat_timeout,
                              checkpoint_dir=args.checkpoint_dir,
                              checkpoint_every=args.checkpoint_every, resume=args.resume,
                              tls_cert=args.tls_cert, tls_key=args.tls_key,
                              metrics_path=args.metrics_file,
                              metrics_sinks=tuple(args.metrics_sink.split(",")),
                              metrics_dir=args.metrics_dir, step_budget=args.step_budget,
                              http_port=args.http_port,
                              bulk_port=None if args.bulk_port == -1 else args.bulk_port,
                              data_limits=BulkLimits(
                                  handshake_timeout_s=args.handshake_timeout,
                                  max_connections=args.max_connections,
                                  max_connections_per_peer=args.max_connections_per_peer,
                                  workers=args.data_workers),
                              shards=parse_shards(args.shards), shard=args.shard,
                              data_host=args.data_host)


def cmd_syncer(args) -> int:
    from ddiloco.runtime.syncer.server import SyncerServer

    _logging(args.log_level)
    import torch
    torch.set_num_threads(1)
    try:
        cfg = syncer_server_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ddiloco syncer: {e}", file=sys.stderr)
        return 2
    try:
        server = SyncerServer(cfg)
    except (ValueError, FileNotFoundError, ImportError) as e:
        # no valid checkpoint to resume from, or a metrics sink's package missing
        print(f"ddiloco syncer: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        port = server.start()
    except RuntimeError as e:
        print(f"ddiloco syncer: {e}", file=sys.stderr)
        return 2
    if args.port_file:
        tmp = Path(args.port_file).with_suffix(".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, args.port_file)
    data = f"data port {server.bulk_port}" if server.bulk_port is not None else "data port off"
    if server.http_port is not None:
        data += (f", dashboard and /metrics on http{'s' if cfg.tls_cert else ''}://{cfg.host}:"
                 f"{server.http_port}/")
    print(f"ddiloco syncer listening on {cfg.host}:{port} ({data})", flush=True)
    while not stop.wait(1.0):
        pass
    logging.getLogger("ddiloco.syncer").info("stopping: final checkpoint")
    server.close()
    return 0


# -- learner ---------------------------------------------------------------------------------
def add_learner_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("learner", help="run one learner (or torchrun island) of a built-in model",
                              description="Train a built-in model against a syncer. Under "
                              "torchrun, the ranks form one island (DDP inside).")
    p.add_argument("--syncer", required=True, help="HOST:PORT of the syncer")
    p.add_argument("--learner", type=int, default=None,
                   help="learner id m (e.g. to resume a learner's data position); omitted, "
                        "the syncer assigns the lowest id it has not handed out yet")
    p.add_argument("--config", help="TrainConfig as JSON (fields as in ddiloco.config)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a TrainConfig field (JSON value), e.g. --set steps=200")
    p.add_argument("--run-dir", help="per-learner directory: metrics.jsonl, progress.json "
                   "('{learner}' in it is replaced by the learner's id)")
    p.add_argument("--metrics-dir", help="run directory of the sinks of the config's "
                   "metrics_sinks besides JSONL (default: --run-dir)")
    p.add_argument("--token-file", help="file holding the shared secret (else $DDILOCO_TOKEN)")
    p.add_argument("--tls-ca", help="CA certificate (PEM) to talk TLS to the syncer")
    p.add_argument("--slowdown", type=float, default=1.0, help="stretch each step by this factor")
    p.add_argument("--bandwidth", type=float, default=0.0, help="emulated link bytes/s (0: none)")
    p.add_argument("--latency", type=float, default=0.0, help="emulated one-way latency, s")
    p.add_argument("--connect-timeout", type=float, default=300.0)
    p.add_argument("--fresh-optimizer", action="store_true",
                   help="on a restart, start the inner optimizer afresh instead of resuming "
                        "its saved state (learner_state.pt in --run-dir)")
    p.add_argument("--wait-for-merge", action="store_true",
                   help="after each push wait until its merge is installed (synchronous "
                        "DiLoCo: with --set fragments=1 --set tau=0 and a syncer --quorum M)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_learner)
    return p


def train_config_from(config_path: str | None, overrides: list[str]):
    from ddiloco.config import TrainConfig

    fields = json.loads(Path(config_path).read_text()) if config_path else {}
    for item in overrides:
        k, _, v = item.partition("=")
        try:
            fields[k] = json.loads(v)
        except json.JSONDecodeError:
            fields[k] = v
    if "speeds" in fields:
        fields["speeds"] = tuple(fields["speeds"])
    return TrainConfig(**fields)


def cmd_learner(args) -> int:
    from ddiloco.runtime.learner.client import LinkLimits, SyncerError
    from ddiloco.runtime.learner.main import run_learner

    _logging(args.log_level)
    try:
        cfg = train_config_from(args.config, args.set)
        run_learner(cfg, syncer=args.syncer, learner=args.learner, run_dir=args.run_dir,
                    metrics_dir=args.metrics_dir,
                    token_file=args.token_file, tls_ca=args.tls_ca, slowdown=args.slowdown,
                    link=LinkLimits(bandwidth_bytes_per_s=args.bandwidth, latency_s=args.latency),
                    connect_timeout_s=args.connect_timeout,
                    resume_optimizer=not args.fresh_optimizer,
                    wait_for_merge=args.wait_for_merge)
    except (ValueError, SyncerError, ImportError) as e:
        print(f"ddiloco learner: {e}", file=sys.stderr)
        return 2
    return 0


# -- status ----------------------------------------------------------------------------------
def add_status_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("status", help="show a syncer's learners, versions and goodput")
    p.add_argument("address", help="HOST:PORT of the syncer")
    p.add_argument("--token-file")
    p.add_argument("--tls-ca")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(func=cmd_status)
    return p


def cmd_status(args) -> int:
    from ddiloco.runtime.launch.status import fetch_status, format_status

    try:
        st = fetch_status(args.address, token_file=args.token_file, tls_ca=args.tls_ca)
    except Exception as e:  # noqa: BLE001 - report any connection problem plainly
        print(f"ddiloco status: {e}", file=sys.stderr)
        return 2
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


# -- train --engine processes ------------------------------------------------------------------
def run_processes(config, args=None) -> int:
    """Run ``config`` (a TrainConfig) with a real syncer and learner processes on loopback.

    ``args`` may carry ``chaos`` (preset name or JSON path), ``island_size`` (ranks per
    learner), ``port``, ``http_port`` and ``shards`` (syncer processes); missing attributes
    take their defaults."""
    from ddiloco.runtime.launch.launcher import Launcher, LaunchOptions

    opts = LaunchOptions(chaos=getattr(args, "chaos", None) or "none",
                         island_size=getattr(args, "island_size", None) or 1,
                         port=getattr(args, "port", None) or 0,
                         http_port=getattr(args, "http_port", None),
                         shards=getattr(args, "shards", None) or 1)
    with Launcher(config, opts) as launcher:
        summary = launcher.run()
    return 0 if summary.get("ok") else 1


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """``train``: the launcher alone (the main CLI's ``ddiloco train --engine processes``
    calls ``run_processes`` instead)."""
    p = subparsers.add_parser("train", help="syncer + M learner processes on loopback")
    p.add_argument("--config", help="TrainConfig as JSON")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a TrainConfig field (JSON value), e.g. --set learners=4")
    p.add_argument("--chaos", default="none", help="chaos preset or JSON file")
    p.add_argument("--island-size", type=int, default=1, help="ranks per learner (torchrun)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--http-port", type=int, default=None,
                   help="the syncer's dashboard and /metrics port (0: a free one)")
    p.add_argument("--shards", type=int, default=1,
                   help="syncer processes, each owning every S-th fragment")
    p.set_defaults(func=lambda a: run_processes(
        train_config_from(a.config, a.set + ["engine=\"processes\""]), a))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddiloco.runtime.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_syncer_parser(sub)
    add_learner_parser(sub)
    add_status_parser(sub)
    add_train_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
