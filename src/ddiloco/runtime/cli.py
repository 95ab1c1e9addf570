"""Command-line entry points of the runtime: ``syncer``, ``learner`` and ``status``.

``syncer`` and ``learner`` read the run's configuration (``--config run.toml`` and flags
generated from its declarations, ``ddiloco.config.flags``); the main CLI (``ddiloco.cli``)
lists them and hands them their arguments. ``python -m ddiloco.runtime.cli
{syncer,learner,status} ...`` runs them directly.
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

__all__ = [
    "add_syncer_parser",
    "add_learner_parser",
    "add_status_parser",
    "syncer_from_args",
    "cmd_syncer",
    "cmd_learner",
    "RAW_COMMANDS",
    "main",
]


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


# -- syncer ----------------------------------------------------------------------------------
def add_syncer_parser(subparsers) -> argparse.ArgumentParser:
    """``syncer`` in the command list; its flags are generated from the configuration
    (``ddiloco.config.flags.parse_syncer``), so ``main`` hands it the raw arguments."""
    p = subparsers.add_parser("syncer", help="run the syncer service (gRPC)", add_help=False)
    p.set_defaults(func=None, raw_command="syncer")
    return p


def syncer_from_args(args):
    """``SyncerServerConfig`` of parsed ``ddiloco syncer`` arguments."""
    from ddiloco.runtime.syncer.run_config import syncer_server_config
    from ddiloco.runtime.transport.auth import load_token

    return syncer_server_config(
        args.run,
        token=load_token(args.run.runtime.token_file),
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        metrics_path=args.metrics_file,
        metrics_dir=args.metrics_dir,
        from_file=args.config is not None,
        shards=args.shards,
        shard=args.shard,
        data_host=args.data_host,
    )


def cmd_syncer(argv: list[str]) -> int:
    from ddiloco.config.flags import ConfigError, parse_syncer
    from ddiloco.runtime.syncer.server import SyncerServer

    try:
        args = parse_syncer(argv)
        cfg = syncer_from_args(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"ddiloco syncer: error: {e}", file=sys.stderr)
        return 2
    _logging(args.run.runtime.log_level)
    import torch

    torch.set_num_threads(1)
    if args.ha or args.ha_name:
        return _replicated_syncer(args, cfg)
    try:
        server = SyncerServer(cfg)
    except (ValueError, FileNotFoundError, ImportError) as e:
        # no valid checkpoint to resume from, or a metrics sink's package missing
        print(f"ddiloco syncer: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        port = server.start()
    except RuntimeError as e:
        print(f"ddiloco syncer: error: {e}", file=sys.stderr)
        return 2
    if args.port_file:
        tmp = Path(args.port_file).with_suffix(".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, args.port_file)
    data = f"data port {server.bulk_port}" if server.bulk_port is not None else "data port off"
    if server.http_port is not None:
        data += (
            f", dashboard and /metrics on http{'s' if cfg.tls_cert else ''}://{cfg.host}:"
            f"{server.http_port}/"
        )
    print(f"ddiloco syncer listening on {cfg.host}:{port} ({data})", flush=True)
    while not stop.wait(1.0):
        pass
    logging.getLogger("ddiloco.syncer").info("stopping: final checkpoint")
    server.close()
    return 0


def _write_port(port_file: str | None, port: int) -> None:
    if port_file:
        tmp = Path(port_file).with_suffix(".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, port_file)


def _replicated_syncer(args, cfg) -> int:
    """``ddiloco syncer --ha etcd://HOST:PORT --ha-name RUN``: stand by, lead when elected
    (``ddiloco.runtime.syncer.ha``)."""
    from ddiloco.runtime.syncer.ha import HAConfig, run_replicated

    try:
        if not (args.ha and args.ha_name):
            raise ValueError("--ha and --ha-name go together")
        ha = HAConfig(
            endpoint=args.ha,
            name=args.ha_name,
            address=args.ha_address or "",
            ttl_s=args.ha_ttl_s,
            replicate=args.ha_replicate,
            replica_dir=args.ha_replica_dir or "",
        )
    except ValueError as e:
        print(f"ddiloco syncer: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def bound(port: int) -> None:
        _write_port(args.port_file, port)
        print(f"ddiloco syncer on {cfg.host}:{port}: standing by in run {ha.name}", flush=True)

    try:
        return run_replicated(cfg, ha, stop, on_bound=bound)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        print(f"ddiloco syncer: error: {e}", file=sys.stderr)
        return 2


# -- learner ---------------------------------------------------------------------------------
def add_learner_parser(subparsers) -> argparse.ArgumentParser:
    """``learner`` in the command list; its flags are generated from the configuration."""
    p = subparsers.add_parser(
        "learner", add_help=False, help="run one learner (or torchrun island) of a built-in model"
    )
    p.set_defaults(func=None, raw_command="learner")
    return p


def cmd_learner(argv: list[str]) -> int:
    from ddiloco.config.flags import ConfigError, parse_learner
    from ddiloco.runtime.learner.client import SyncerError
    from ddiloco.runtime.learner.main import run_learner

    try:
        args = parse_learner(argv)
    except ConfigError as e:
        print(f"ddiloco learner: error: {e}", file=sys.stderr)
        return 2
    _logging(args.run.runtime.log_level)
    try:
        run_learner(
            args.run,
            syncer=args.syncer,
            learner=args.learner,
            run_dir=args.run_dir,
            metrics_dir=args.metrics_dir,
            resume_optimizer=not args.fresh_optimizer,
            wait_for_merge=args.wait_for_merge,
        )
    except (ValueError, OSError, SyncerError, ImportError) as e:
        # a missing data path, P above the model's tensors, a syncer that refused: one line
        print(f"ddiloco learner: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from ddiloco.runtime.learner.island import exit_island_rank

        exit_island_rank()
    return 0


# -- status ----------------------------------------------------------------------------------
def add_status_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "status",
        help="show a syncer's learners, versions and goodput",
        description="Show a syncer's learners, fragment versions and goodput so far. TARGET is "
        "HOST:PORT of a syncer (token from $DDILOCO_TOKEN or --token-file), or the run "
        "directory of a `ddiloco train` run: its syncer's address and token are read from "
        "it, and a run that is over is summarised from what the directory records.",
    )
    p.add_argument("address", metavar="RUN_DIR_OR_HOST:PORT", help="a run directory or a syncer")
    p.add_argument("--token-file")
    p.add_argument("--tls-ca")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(func=cmd_status)
    return p


def cmd_status(args) -> int:
    import grpc

    from ddiloco.runtime.launch.status import (
        StatusTargetError,
        fetch_status,
        format_finished_run,
        format_status,
        run_dir_target,
    )
    from ddiloco.runtime.learner.client import rpc_code, rpc_details

    def error(msg: str) -> int:
        print(f"ddiloco status: error: {msg}", file=sys.stderr)
        return 2

    address, token_file, tls_ca, where = args.address, args.token_file, args.tls_ca, ""
    try:
        target = run_dir_target(args.address, token_file=token_file, tls_ca=tls_ca)
    except StatusTargetError as e:
        return error(str(e))
    if target is not None:
        if target.summary is not None:  # the run is over: what its directory records
            print(
                json.dumps(target.summary, indent=2)
                if args.json
                else format_finished_run(args.address, target.summary)
            )
            return 0
        address, token_file, tls_ca = target.address, target.token_file, target.tls_ca
        where = f", the address {args.address} records"
    try:
        st = fetch_status(address, token_file=token_file, tls_ca=tls_ca)
    except grpc.RpcError as e:
        code = rpc_code(e)
        # the innermost reason, without the brackets of the gRPC core's nested messages
        why = rpc_details(e).rsplit(": ", 1)[-1].strip().rstrip("]").strip()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return error(f"the syncer at {address}{where} refused the token ({why})")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            if where:
                return error(
                    f"no syncer answers at {address}{where} ({code.name}: {why}): the run "
                    f"is not running, and it ended without a summary.json (stopped by a "
                    f"signal or a crash; its logs/ tell)"
                )
            return error(
                f"no syncer answers at {address} ({code.name}: {why}); check the address, "
                f"that it runs, and --tls-ca for a TLS syncer"
            )
        return error(f"the syncer at {address}{where} answered {code.name}: {why}")
    except (ValueError, OSError) as e:  # no token, an unreadable token or CA file
        return error(str(e))
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


RAW_COMMANDS = {"syncer": cmd_syncer, "learner": cmd_learner}
"""Commands whose flags are generated from the configuration: they parse their own argv."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in RAW_COMMANDS:
        return RAW_COMMANDS[argv[0]](argv[1:])
    parser = argparse.ArgumentParser(prog="python -m ddiloco.runtime.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_syncer_parser(sub)
    add_learner_parser(sub)
    add_status_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
