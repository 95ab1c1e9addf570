"""``ddiloco launch --backend B``: write (and optionally submit) a cluster job for a run.

The run is described by the flags of ``ddiloco train`` (``--config FILE``, ``--model``,
``-M``, ``--steps``, ``--island-size``, ``--shards``, ``--out``...); the launch flags say
where and how it runs. Backends: ``slurm`` (``ddiloco.runtime.launch.slurm``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

__all__ = ["add_launch_parser", "cmd_launch", "BACKENDS"]


def add_launch_parser(subparsers) -> argparse.ArgumentParser:
    """``launch`` in the command list; it parses its own arguments (``cmd_launch``)."""
    p = subparsers.add_parser(
        "launch", add_help=False, help="write (and submit) a cluster job: --backend slurm"
    )
    p.set_defaults(func=None)
    return p


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddiloco launch",
        allow_abbrev=False,
        description="Write a cluster job for a run: its script, config.toml and token file "
        "in the run directory (--out). Every flag of `ddiloco train` (--config FILE, "
        "--model, -M, --steps, --island-size, --shards, --port, --out...) describes the run.",
    )
    p.add_argument("--backend", required=True, choices=sorted(BACKENDS))
    p.add_argument("--submit", action="store_true", help="submit the job once written")
    p.add_argument(
        "--test-only",
        action="store_true",
        help="ask the scheduler whether and when it would run the job (sbatch --test-only)",
    )
    s = p.add_argument_group("slurm")
    s.add_argument(
        "--nodes-per-island",
        type=int,
        default=1,
        help="nodes of each island; its --island-size ranks are split evenly across them",
    )
    s.add_argument(
        "--single-node",
        action="store_true",
        help="the syncer and every island on one node (else one node for the syncer and "
        "--nodes-per-island nodes for each island)",
    )
    s.add_argument("--partition", help="sbatch --partition")
    s.add_argument("--time", dest="time_limit", help="sbatch --time, e.g. 02:00:00")
    s.add_argument("--account", help="sbatch --account")
    s.add_argument("--gpus-per-node", type=int, help="sbatch --gpus-per-node")
    s.add_argument("--job-name", default="ddiloco", help="sbatch --job-name")
    s.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        dest="sbatch_args",
        metavar="OPTION",
        help="one more #SBATCH option (repeatable), e.g. --sbatch-arg=--qos=high",
    )
    s.add_argument(
        "--python", default=sys.executable, help="Python with ddiloco, the same path on every node"
    )
    s.add_argument(
        "--rdzv-port",
        type=int,
        default=29400,
        help="island m's c10d rendezvous listens on its first node at this port + m",
    )
    s.add_argument(
        "--syncer-restarts",
        type=int,
        default=100,
        help="times a syncer shard that exits is restarted (resuming from its checkpoint)",
    )
    s.add_argument(
        "--island-restarts",
        type=int,
        default=3,
        help="times an island that exits with an error is started again (same learner id)",
    )
    s.add_argument(
        "--torchrun-restarts",
        type=int,
        default=0,
        help="torchrun --max-restarts: restarts of an island's ranks inside one start",
    )
    return p


def _launch_slurm(cfg, args: argparse.Namespace) -> int:
    from ddiloco.runtime.launch.slurm import SlurmOptions, submit, write_slurm_job

    opts = SlurmOptions(
        nodes_per_island=args.nodes_per_island,
        single_node=args.single_node,
        partition=args.partition,
        time_limit=args.time_limit,
        account=args.account,
        gpus_per_node=args.gpus_per_node,
        job_name=args.job_name,
        sbatch_args=tuple(args.sbatch_args),
        python=args.python,
        rdzv_port=args.rdzv_port,
        syncer_restarts=args.syncer_restarts,
        island_restarts=args.island_restarts,
        torchrun_restarts=args.torchrun_restarts,
    )
    job = write_slurm_job(cfg, opts)
    layout = (
        "one node"
        if opts.single_node
        else f"{job.nodes} nodes: the syncer on the first, {cfg.learners} island(s) x "
        f"{opts.nodes_per_island} node(s)"
    )
    print(f"wrote {job.script} ({layout}), {job.config.name} and the token {job.token_file}")
    if args.test_only:
        print(submit(job, test_only=True))
    if args.submit:
        print(submit(job))
    elif not args.test_only:
        print(f"submit with: {job.submit_command()}")
    return 0


BACKENDS: dict[str, Callable[..., int]] = {"slurm": _launch_slurm}
"""Backend name -> ``(TrainConfig, launch arguments) -> exit status``."""


def cmd_launch(argv: list[str]) -> int:
    from ddiloco.config.flags import ConfigError, train_config

    args, rest = _parser().parse_known_args(argv)
    try:
        cfg, _ = train_config(rest)
        return BACKENDS[args.backend](cfg, args)
    except (ConfigError, ValueError, RuntimeError) as e:
        print(f"ddiloco launch: error: {e}", file=sys.stderr)
        return 2
