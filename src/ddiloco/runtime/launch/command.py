"""``ddiloco launch --backend B``: write (and optionally submit) a cluster job for a run.

The run is described by the flags of ``ddiloco train`` (``--config FILE``, ``--model``,
``-M``, ``--steps``, ``--island-size``, ``--shards``, ``--out``...); the launch flags say
where and how it runs. Backends: ``slurm`` (``ddiloco.runtime.launch.slurm``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import tyro
from tyro.constructors import PrimitiveConstructorSpec

from ddiloco.runtime.launch.slurm import SlurmOptions

if TYPE_CHECKING:
    from ddiloco.config import TrainConfig

__all__ = ["add_launch_parser", "cmd_launch", "parse_launch", "LaunchArgs", "BACKENDS"]


def add_launch_parser(subparsers) -> argparse.ArgumentParser:
    """``launch`` in the command list; it parses its own arguments (``cmd_launch``)."""
    p = subparsers.add_parser(
        "launch", add_help=False, help="write (and submit) a cluster job: --backend slurm"
    )
    p.set_defaults(func=None)
    return p


def _launch_slurm(cfg: TrainConfig, args: LaunchArgs) -> int:
    from ddiloco.runtime.launch.slurm import submit, write_slurm_job

    opts = args.slurm
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


BACKENDS: dict[str, Callable[[TrainConfig, LaunchArgs], int]] = {"slurm": _launch_slurm}
"""Backend name -> ``(TrainConfig, launch arguments) -> exit status``."""


def _backend_name(args: list[str]) -> str:
    return args[0]


@dataclass(kw_only=True, slots=True)
class LaunchArgs:
    """``ddiloco launch``'s own options: the backend, what to do with the job once written,
    and the Slurm options (``SlurmOptions``' fields, one flag each). The run itself is
    described by ``ddiloco train``'s flags, parsed apart (``cmd_launch``)."""

    backend: Annotated[
        str | None,
        PrimitiveConstructorSpec(
            nargs=1,
            metavar="{" + ",".join(sorted(BACKENDS)) + "}",
            instance_from_str=_backend_name,
            is_instance=lambda x: x is None or isinstance(x, str),
            str_from_instance=lambda x: [x],
            choices=tuple(sorted(BACKENDS)),
        ),
        tyro.conf.arg(help_behavior_hint="(required)"),
    ] = None
    """Where the job runs."""
    submit: bool = False
    """Submit the job once written."""
    test_only: bool = False
    """Ask the scheduler whether and when it would run the job (sbatch --test-only)."""
    slurm: Annotated[SlurmOptions, tyro.conf.arg(name="")] = field(default_factory=SlurmOptions)
    """Slurm: where and how the job runs."""


SLURM_ALIASES = {"time_limit": ("--time",), "sbatch_args": ("--sbatch-arg",)}
"""Shorter spellings of ``SlurmOptions``' flags, kept working."""


def _launch_registry():
    """tyro's rule for ``SlurmOptions``: every field a flag, ``--sbatch-args`` repeatable
    (one #SBATCH option each), with the aliases above."""
    from tyro.constructors import ConstructorRegistry, StructConstructorSpec
    from tyro.constructors._struct_spec_dataclass import dataclass_rule

    reg = ConstructorRegistry()

    @reg.struct_rule
    def slurm(info):
        if info.type is not SlurmOptions:
            return None
        spec = dataclass_rule(info)
        if spec is None:
            return None
        fields = []
        for f in spec.fields:
            marks: list[Any] = []
            if f.name in SLURM_ALIASES:
                marks.append(tyro.conf.arg(aliases=SLURM_ALIASES[f.name]))
            if f.name == "sbatch_args":
                marks += [tyro.conf.UseAppendAction, tyro.conf.arg(metavar="OPTION")]
            fields.append(dataclasses.replace(f, type=Annotated[(f.type, *marks)]) if marks else f)
        return StructConstructorSpec(instantiate=spec.instantiate, fields=tuple(fields))

    return reg


def parse_launch(argv: list[str]) -> tuple[LaunchArgs, list[str]]:
    """``ddiloco launch``'s own options and the rest of ``argv`` (the run's flags)."""
    return tyro.cli(
        LaunchArgs,
        args=argv,
        prog="ddiloco launch",
        description="Write a cluster job for a run: its script, config.toml and token file "
        "in the run directory (--out). Every flag of `ddiloco train` (--config FILE, "
        "--model, -M, --steps, --island-size, --shards, --port, --out...) describes the run.",
        registry=_launch_registry(),
        return_unknown_args=True,
    )


def cmd_launch(argv: list[str]) -> int:
    from ddiloco.config.flags import ConfigError, train_config

    try:
        args, rest = parse_launch(argv)
        if args.backend is None:
            raise ValueError(f"give --backend {{{','.join(sorted(BACKENDS))}}}")
        cfg, _ = train_config(rest)
        return BACKENDS[args.backend](cfg, args)
    except (ConfigError, ValueError, RuntimeError) as e:
        print(f"ddiloco launch: error: {e}", file=sys.stderr)
        return 2
