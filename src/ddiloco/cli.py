"""The ``ddiloco`` command line: train, syncer, learner, status, launch, simulate, bandwidth,
report, prepare.

Entry points stay thin: parse flags into typed configs, build, run, print.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser", "train_config_from_args", "cmd_train"]


def add_train_parser(sub) -> argparse.ArgumentParser:
    """``train`` in the command list; its flags are generated from the configuration
    (``ddiloco.config.flags.parse_train``), so ``main`` hands it the raw arguments."""
    p = sub.add_parser(
        "train",
        add_help=False,
        help="train a model with M learners (main job; --help for every flag)",
    )
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

        check_available(cfg.metrics_sinks)
    except (ConfigError, ValueError, ImportError) as e:
        print(f"ddiloco train: error: {e}", file=sys.stderr)
        return 2
    if cfg.engine == "processes":
        from ddiloco.runtime.launch.run import run_processes

        try:
            return run_processes(cfg)
        except (ValueError, ImportError, ConnectionError, TimeoutError) as e:
            print(f"ddiloco train: error: {e}", file=sys.stderr)
            return 2
    from ddiloco.engine import run

    summary = run(cfg)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
        print(f"\nwrote {cfg.out}/summary.json, metrics.jsonl and config.toml")
    return 0


def format_summary(s: dict) -> str:
    """A small results table for the terminal."""
    gib = 1 << 20
    rows = [
        ("method", f"{s['method']} ({s['engine']}, M={s['learners']})"),
        ("inner steps / learner", f"{s['steps']}"),
        ("tokens", f"{s['tokens']:,}"),
        ("final eval loss", f"{s['final_eval_loss']:.4f}"),
        (
            "entropy floor",
            "n/a"
            if s.get("entropy_floor") is None
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
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def build_parser() -> argparse.ArgumentParser:
    from ddiloco import __version__

    parser = argparse.ArgumentParser(prog="ddiloco", description="Decoupled DiLoCo for PyTorch")
    parser.add_argument("--version", action="version", version=f"ddiloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_train_parser(sub)
    for module, adders in (
        ("ddiloco.sim.cli", ("add_simulate_parser", "add_bandwidth_parser")),
        ("ddiloco.runtime.cli", ("add_syncer_parser", "add_learner_parser", "add_status_parser")),
        ("ddiloco.runtime.export", ("add_export_parser",)),
        ("ddiloco.runtime.launch.command", ("add_launch_parser",)),
        ("ddiloco.runtime.observe.cli", ("add_dashboard_parser",)),
        ("ddiloco.data.prepare", ("add_prepare_parser",)),
        ("ddiloco.report", ("add_report_parser",)),
    ):
        try:
            mod = __import__(module, fromlist=list(adders))
        except ImportError:
            continue
        for name in adders:
            adder = getattr(mod, name, None)
            if adder is not None:
                adder(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # commands whose flags are generated from the run configuration parse their own argv
    if argv and argv[0] == "train":
        return cmd_train(argv[1:])
    if argv and argv[0] in ("syncer", "learner"):
        from ddiloco.runtime.cli import RAW_COMMANDS

        return RAW_COMMANDS[argv[0]](argv[1:])
    if argv and argv[0] == "launch":
        from ddiloco.runtime.launch.command import cmd_launch

        return cmd_launch(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
