"""The ``ddiloco`` command line: train, syncer, learner, status, launch, simulate, bandwidth,
report, prepare.

Entry points stay thin: parse flags into typed configs, build, run, print.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ddiloco.backends import backend_names

__all__ = ["main", "build_parser", "train_config_from_args", "cmd_train", "COMMANDS"]

TRAIN_HELP = "train a model with M learners (main job; --help for every flag)"


def add_train_parser(sub) -> argparse.ArgumentParser:
    """``train`` in the command list; its flags are generated from the configuration
    (``ddiloco.config.flags.parse_train``), so ``main`` hands it the raw arguments."""
    p = sub.add_parser("train", add_help=False, help=TRAIN_HELP)
    p.set_defaults(func=None)
    return p


def train_config_from_args(argv: Sequence[str]):
    """The run configuration of ``ddiloco train`` arguments (``ddiloco.config.flags.
    train_config``), with ``engine = auto`` resolved."""
    from ddiloco.config.flags import train_config

    return train_config(list(argv))


def cmd_train(argv: Sequence[str]) -> int:
    from ddiloco.config.flags import ConfigError

    try:
        cfg, args = train_config_from_args(argv)
        from ddiloco.metrics.sinks import check_available

        check_available(cfg.runtime.metrics_sinks)
    except (ConfigError, ValueError, ImportError) as e:
        print(f"ddiloco train: error: {e}", file=sys.stderr)
        return 2
    errors: tuple[type[Exception], ...] = (ValueError, OSError, ImportError)
    try:
        if cfg.engine == "processes":
            from ddiloco.runtime.launch.launcher import LaunchError
            from ddiloco.runtime.launch.run import run_processes

            errors += (LaunchError,)
            summary = run_processes(cfg)
        else:
            from ddiloco.engine import run

            summary = run(cfg)
    except errors as e:
        # the run cannot start as configured (a data path, P above the model's tensors, an
        # address the syncer cannot bind, a learner that crashes at start-up): one line
        print(f"ddiloco train: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
        print(f"\nwrote {cfg.out}/summary.json, metrics.jsonl and config.toml")
    if summary.get("interrupted"):
        return 130  # 128 + SIGINT, as a shell reports an interrupted command
    return 0 if summary.get("ok", True) else 1


def format_summary(s: dict) -> str:
    """A small results table for the terminal."""
    gib = 1 << 20
    rows = [
        ("method", f"{s['method']} ({s['engine']}, M={s['learners']})"),
        ("inner steps / learner", _steps(s)),
        ("tokens", f"{s['tokens']:,}"),
        ("final eval loss", _num(s.get("final_eval_loss"))),
        (
            "entropy floor",
            "n/a"
            if s.get("entropy_floor") is None or s.get("final_eval_loss") is None
            else f"{s['entropy_floor']:.4f}  (gap {s['final_eval_loss'] - s['entropy_floor']:.4f})",
        ),
        ("eval accuracy", "n/a" if s.get("eval_accuracy") is None else f"{s['eval_accuracy']:.3f}"),
        (
            "goodput",
            f"{s['goodput']:.3f}  (of up-time: {s.get('goodput_available', s['goodput']):.3f})",
        ),
        ("uptime", f"{s['uptime']:.3f}"),
        ("merges", f"{s['merges']}"),
        ("bytes up / down", f"{s['bytes_up'] / gib:.1f} / {s['bytes_down'] / gib:.1f} MiB"),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    if s.get("final_model"):
        rows.insert(4, ("global model", _model_source(s)))
    if s.get("interrupted"):
        rows.insert(0, ("status", "interrupted (Ctrl-C)"))
    elif s.get("ok") is False:
        rows.insert(0, ("status", "FAILED (see logs/ in the run directory)"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _steps(s: dict) -> str:
    """Inner steps per learner: the budget's, or, where learners share a global step budget
    (the real runtime), the range they trained and the budget that explains it."""
    budget = s.get("step_budget")
    steps = [p["steps"] for p in s.get("per_learner") or [] if isinstance(p.get("steps"), int)]
    if not budget or not steps:
        return f"{s['steps']:,}"
    lo, hi = min(steps), max(steps)
    span = f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"
    if s.get("interrupted"):
        return f"{span} ({sum(steps):,} of a shared budget of {budget:,})"
    return f"{span} (shared budget of {budget:,})"


def _model_source(s: dict) -> str:
    """Which global model the run ended with, and how to get it."""
    src = s["final_model"]
    if src.get("source") != "checkpoint":
        return "the global model fetched from the syncers at the end"
    which = "last" if s.get("interrupted") else "final"
    merges = src.get("merges")
    after = f" ({merges:,} merges)" if isinstance(merges, int) else ""
    out = (s.get("config") or {}).get("out", "RUN_DIR")
    return f"the syncer's {which} checkpoint{after}; `ddiloco export {out}` writes it"


def _num(x: float | None) -> str:
    return "n/a (no final model)" if x is None else f"{x:.4f}"


COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("ddiloco.cli", "add_train_parser", TRAIN_HELP),
    "simulate": (
        "ddiloco.sim.cli",
        "add_simulate_parser",
        "goodput of dp / elastic-dp / decoupled under chip failures",
    ),
    "bandwidth": (
        "ddiloco.sim.cli",
        "add_bandwidth_parser",
        "WAN bandwidth vs compute utilisation across datacenters",
    ),
    "syncer": ("ddiloco.runtime.cli", "add_syncer_parser", "run the syncer service (gRPC)"),
    "learner": (
        "ddiloco.runtime.cli",
        "add_learner_parser",
        "run one learner (or torchrun island) of a built-in model",
    ),
    "status": (
        "ddiloco.runtime.cli",
        "add_status_parser",
        "show a syncer's learners, versions and goodput",
    ),
    "export": (
        "ddiloco.runtime.export",
        "add_export_parser",
        "write the global model as a safetensors state_dict",
    ),
    "launch": (
        "ddiloco.runtime.launch.command",
        "add_launch_parser",
        f"write (and submit) a cluster job: --backend {'|'.join(backend_names('job'))}",
    ),
    "dashboard": (
        "ddiloco.runtime.observe.cli",
        "add_dashboard_parser",
        "live web dashboard of a run directory or a syncer",
    ),
    "prepare": (
        "ddiloco.data.prepare",
        "add_prepare_parser",
        "tokenize text into token shards for --data bin:DIR",
    ),
    "report": (
        "ddiloco.report",
        "add_report_parser",
        "plots and an HTML page for one or more run directories",
    ),
}
"""Command -> (module, the function that adds its parser, its line in ``ddiloco --help``).
A command's module is imported only when it runs (``ddiloco --help`` imports none of them:
several import torch)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ddiloco`` parser: every command listed with its help line; ``command``'s own
    flags added from its module (the others are imported only when they run)."""
    import importlib

    from ddiloco import __version__

    parser = argparse.ArgumentParser(prog="ddiloco", description="Decoupled DiLoCo for PyTorch")
    parser.add_argument("--version", action="version", version=f"ddiloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, adder, help_line) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_line, add_help=False)
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # an optional dependency of that command is missing
            raise SystemExit(f"ddiloco {name}: error: {e}") from None
        getattr(mod, adder)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C where a command has nothing to clean up: no traceback
        print(f"ddiloco{' ' + argv[0] if argv else ''}: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports an interrupted command
    except BrokenPipeError:
        # the reader went away (`ddiloco train --help | head`): stop quietly, and keep the
        # interpreter's final flush of stdout from failing too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a pipe writer that stopped


def _main(argv: list[str]) -> int:
    # commands whose flags are generated from the run configuration parse their own argv
    if argv and argv[0] == "train":
        return cmd_train(argv[1:])
    if argv and argv[0] in ("syncer", "learner"):
        from ddiloco.runtime.cli import RAW_COMMANDS

        return RAW_COMMANDS[argv[0]](argv[1:])
    if argv and argv[0] == "launch":
        from ddiloco.runtime.launch.command import cmd_launch

        return cmd_launch(argv[1:])
    if argv and argv[0] == "bandwidth":
        from ddiloco.sim.cli import cmd_bandwidth

        return cmd_bandwidth(argv[1:])
    if argv and argv[0] == "simulate":
        from ddiloco.sim.cli import cmd_simulate

        return cmd_simulate(argv[1:])
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
