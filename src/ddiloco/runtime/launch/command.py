"""``ddiloco launch --backend B``: write (and optionally submit) a cluster job for a run.

The run is described by the flags of ``ddiloco train`` (``--config FILE``, ``--model``,
``-M``, ``--steps``, ``--island-size``, ``--shards``, ``--out``...); the launch flags say
where and how it runs. The backends are the jobs of the backend registry
(``ddiloco.backends``: ``slurm``); each one's options dataclass adds its
fields as flags here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import field
from typing import TYPE_CHECKING, Annotated, Any

import tyro
from tyro.constructors import PrimitiveConstructorSpec

from ddiloco.backends import backend_names, get_backend
from ddiloco.flag_errors import parse_flags

if TYPE_CHECKING:
    from ddiloco.config import TrainConfig

__all__ = ["add_launch_parser", "cmd_launch", "parse_launch", "launch_args_class"]


def add_launch_parser(subparsers) -> argparse.ArgumentParser:
    """``launch`` in the command list; it parses its own arguments (``cmd_launch``)."""
    p = subparsers.add_parser(
        "launch",
        add_help=False,
        help=f"write (and submit) a cluster job: --backend {'|'.join(backend_names('job'))}",
    )
    p.set_defaults(func=None)
    return p


def launch_args_class() -> type:
    """``ddiloco launch``'s own options, as a dataclass: the backend, what to do with the job
    once written, and one field per job backend holding its options (their fields are flags
    without a prefix: ``--partition``, not ``--slurm.partition``). The run itself is
    described by ``ddiloco train``'s flags, parsed apart (``cmd_launch``)."""
    jobs = backend_names("job")
    backend = Annotated[
        str | None,
        PrimitiveConstructorSpec(
            nargs=1,
            metavar="{" + ",".join(jobs) + "}",
            instance_from_str=lambda args: args[0],
            is_instance=lambda x: x is None or isinstance(x, str),
            str_from_instance=lambda x: [x],
            choices=jobs,
        ),
        tyro.conf.arg(help="Where the job runs.", help_behavior_hint="(required)"),
    ]
    fields: list[tuple[str, Any, Any]] = [
        ("backend", backend, None),
        ("submit", Annotated[bool, tyro.conf.arg(help="Submit the job once written.")], False),
        (
            "test_only",
            Annotated[
                bool,
                tyro.conf.arg(
                    help="Ask the scheduler whether and when it would run the job "
                    "(sbatch --test-only)."
                ),
            ],
            False,
        ),
    ]
    for name in jobs:
        cls = get_backend(name).options_class()
        assert cls is not None  # a job has options (register_backend checks)
        fields.append((name, Annotated[cls, tyro.conf.arg(name="")], field(default_factory=cls)))
    return dataclasses.make_dataclass("LaunchArgs", fields, kw_only=True, slots=True)


def _launch_registry():
    """tyro's rule for the job backends' options: every field a flag, with the backend's
    aliases (``Backend.flag_aliases``), its repeatable fields given once per value
    (``Backend.repeatable``)."""
    from tyro.constructors import ConstructorRegistry, StructConstructorSpec
    from tyro.constructors._struct_spec_dataclass import dataclass_rule

    reg = ConstructorRegistry()
    by_class = {get_backend(n).options_class(): get_backend(n) for n in backend_names("job")}

    @reg.struct_rule
    def options(info):
        b = by_class.get(info.type)
        if b is None:
            return None
        spec = dataclass_rule(info)
        if spec is None:
            return None
        fields = []
        for f in spec.fields:
            marks: list[Any] = []
            if f.name in b.flag_aliases:
                marks.append(tyro.conf.arg(aliases=b.flag_aliases[f.name]))
            if f.name in b.repeatable:
                marks += [tyro.conf.UseAppendAction, tyro.conf.arg(metavar=b.repeatable[f.name])]
            fields.append(dataclasses.replace(f, type=Annotated[(f.type, *marks)]) if marks else f)
        return StructConstructorSpec(instantiate=spec.instantiate, fields=tuple(fields))

    return reg


def parse_launch(argv: list[str]) -> tuple[Any, list[str]]:
    """``ddiloco launch``'s own options (a ``launch_args_class()``) and the rest of ``argv``
    (the run's flags)."""
    return parse_flags(
        launch_args_class(),
        argv,
        prog="ddiloco launch",
        description="Write a cluster job for a run: its script, config.toml and token file "
        "in the run directory (--out). Every flag of `ddiloco train` (--config FILE, "
        "--model, -M, --steps, --island-size, --shards, --port, --out...) describes the run.",
        registry=_launch_registry(),
        return_unknown_args=True,
    )


def run_job(cfg: TrainConfig, args: Any) -> int:
    """Hand the run to the job backend ``args.backend`` names, with its options."""
    b = get_backend(args.backend, "job")
    job = b.load()
    return int(job(cfg, getattr(args, b.name), submit_job=args.submit, test_only=args.test_only))


def cmd_launch(argv: list[str]) -> int:
    from ddiloco.config.flags import ConfigError, train_config

    try:
        args, rest = parse_launch(argv)
        if args.backend is None:
            raise ValueError(f"give --backend {{{','.join(backend_names('job'))}}}")
        cfg, _ = train_config(rest)
        return run_job(cfg, args)
    except (ConfigError, ValueError, RuntimeError) as e:
        print(f"ddiloco launch: error: {e}", file=sys.stderr)
        return 2
