"""The ``ddiloco`` command line: train, syncer, learner, status, simulate, bandwidth, report,
prepare.

Entry points stay thin: parse flags into typed configs, build, run, print.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ddiloco.argtypes import codec_name, nonneg_float, positive_int

__all__ = ["main", "build_parser", "train_config_from_args"]


def _speeds(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated speed factors like 1,1,0.85,0.85, got {s!r}") from None


def add_train_parser(sub) -> argparse.ArgumentParser:
    from ddiloco.algorithm.codecs import CODECS
    from ddiloco.algorithm.fragments import STRATEGIES
    from ddiloco.algorithm.merge import MERGE_RULES
    from ddiloco.config import ENGINES, INNER_OPTIMIZERS, METHODS, PRESETS

    p = sub.add_parser("train", help="train a model with M learners (main job)",
                       description="Train the built-in GPT on the built-in synthetic language "
                       "with M learners. Runs on one machine with no downloads.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--engine", choices=ENGINES, default=None,
                   help="processes: a real gRPC syncer and learner processes on loopback; "
                   "inproc: all learners in one process on a virtual clock, deterministic "
                   "(default: processes for --method decoupled, inproc for the baselines)")
    g.add_argument("--method", choices=METHODS, default="decoupled")
    g.add_argument("--preset", choices=tuple(PRESETS), default="default",
                   help="failures: each learner down ~15%% of the time; hetero: half the "
                   "learners 18%% slower plus 10%% step noise")
    g.add_argument("--learners", "-M", type=positive_int, default=4)
    g.add_argument("--steps", type=positive_int, default=2000, help="inner steps per learner")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default="runs/latest", help="run directory")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    g.add_argument("--json", action="store_true", help="print summary.json instead of a table")
    g.add_argument("--metrics-sink", default=None, dest="metrics_sinks", metavar="SINKS",
                   help="metrics sinks besides metrics.jsonl, comma-separated: tensorboard, "
                   "wandb (offline), mlflow (local file store), e.g. jsonl,tensorboard "
                   "(each needs its extra: pip install ddiloco[tensorboard])")
    g = p.add_argument_group("processes engine")
    g.add_argument("--chaos", default=None,
                   help="chaos preset (none, kill30, stragglers, syncer-kill, wan) or a JSON file")
    g.add_argument("--island-size", type=positive_int, default=None,
                   help="ranks per learner (a torchrun island running DDP inside)")
    g.add_argument("--port", type=int, default=None, help="syncer port (default: ephemeral)")
    g.add_argument("--http-port", type=int, default=None,
                   help="open the syncer's live dashboard and Prometheus /metrics on this "
                        "port (0: a free one); its address, with the run's token, is printed")
    g.add_argument("--shards", type=positive_int, default=None,
                   help="syncer shards S: S syncer processes, fragment p on shard p %% S")
    g = p.add_argument_group("model and inner optimizer")
    g.add_argument("--model", default="gpt_tiny",
                   help="model preset: gpt_tiny, gpt_small, moe_tiny, vit_digits, ...")
    g.add_argument("--data", default=None,
                   help="synthetic (default), text:PATH, bin:PATH, hf:PATH, digits, images:PATH")
    g.add_argument("--batch-size", type=positive_int, default=16)
    g.add_argument("--inner-optimizer", choices=INNER_OPTIMIZERS, default="adamw")
    g.add_argument("--inner-lr", type=float, default=None)
    g.add_argument("--eval-every", type=positive_int, default=100)
    g = p.add_argument_group("synchronisation")
    g.add_argument("--fragments", "-P", type=positive_int, default=None)
    g.add_argument("-H", type=positive_int, default=None, dest="H",
                   help="inner steps between syncs of a fragment")
    g.add_argument("--tau", type=int, default=None, help="overlap steps")
    g.add_argument("--quorum", "-K", type=positive_int, default=None)
    g.add_argument("--no-grace", action="store_true", help="disable the adaptive grace window")
    g.add_argument("--gamma", type=float, default=None)
    g.add_argument("--outer-lr", type=float, default=None)
    g.add_argument("--outer-momentum", type=float, default=None)
    g.add_argument("--merge-rule", choices=MERGE_RULES, default=None)
    g.add_argument("--alpha", type=float, default=None)
    g.add_argument("--codec", type=codec_name, default=None,
                   help=f"{', '.join(CODECS)}; quantised ones with another block size as "
                        "e.g. int2/4096 (default: bf16)")
    g.add_argument("--fragmentation", choices=STRATEGIES, default=None)
    g.add_argument("--max-staleness", type=int, default=None)
    g.add_argument("--staleness-discount", type=float, default=None,
                   help="merge weight factor per version a push is behind (1: none)")
    g.add_argument("--schedule", choices=("time", "steps"), default=None,
                   help="send fragments on elapsed time (learners in step) or own step count")
    g.add_argument("--no-scale-partial", action="store_true",
                   help="give a partial round a whole outer step")
    g = p.add_argument_group("simulated world (inproc)")
    g.add_argument("--speeds", type=_speeds, default=None,
                   help="per-learner speed factors, e.g. 1,1,0.85,0.85")
    g.add_argument("--step-noise", type=nonneg_float, default=None)
    g.add_argument("--mtbi-s", type=nonneg_float, default=None,
                   help="mean up-time between a learner's failures (step = 1 s)")
    g.add_argument("--downtime-s", type=nonneg_float, default=None)
    g.add_argument("--latency-s", type=nonneg_float, default=None)
    g.add_argument("--bandwidth-Bps", type=nonneg_float, default=None, dest="bandwidth_Bps")
    p.set_defaults(func=_cmd_train)
    return p


_FLAG_FIELDS = ("method", "learners", "steps", "seed", "out", "metrics_sinks", "model", "data",
                "batch_size", "inner_optimizer", "inner_lr", "eval_every", "fragments", "H", "tau", "quorum",
                "gamma", "outer_lr", "outer_momentum", "merge_rule", "alpha", "codec",
                "fragmentation", "max_staleness", "staleness_discount", "schedule", "speeds",
                "step_noise", "mtbi_s",
                "downtime_s", "latency_s", "bandwidth_Bps")


def train_config_from_args(args: argparse.Namespace):
    """TrainConfig from defaults, then the preset, then explicit flags."""
    from ddiloco.config import TrainConfig, preset

    base = TrainConfig(learners=args.learners)
    cfg = preset(args.preset, base)
    changes = {f: getattr(args, f) for f in _FLAG_FIELDS if getattr(args, f, None) is not None}
    if args.no_grace:
        changes["grace"] = False
    if args.no_scale_partial:
        changes["scale_partial"] = False
    if args.no_progress or args.json:
        changes["progress"] = False
    method = changes.get("method", cfg.method)
    if args.engine is None:  # the real runtime runs Decoupled DiLoCo; baselines run in-process
        changes["engine"] = "processes" if method == "decoupled" else "inproc"
    elif args.engine == "processes" and method != "decoupled":
        raise ValueError(f"--engine processes runs --method decoupled; run {method} with "
                         f"--engine inproc")
    else:
        changes["engine"] = args.engine
    if "learners" in changes and "speeds" not in changes and cfg.speeds:
        changes["speeds"] = preset(args.preset, TrainConfig(learners=changes["learners"])).speeds
    return cfg.replace(**changes)


def _cmd_train(args: argparse.Namespace) -> int:
    try:
        cfg = train_config_from_args(args)
        from ddiloco.metrics.sinks import check_available
        check_available(cfg.metrics_sinks)
    except (ValueError, ImportError) as e:
        print(f"ddiloco train: error: {e}", file=sys.stderr)
        return 2
    if cfg.engine == "processes":
        try:
            from ddiloco.runtime.cli import run_processes
        except ImportError:
            print("ddiloco train: error: the processes engine is not available in this build; "
                  "use --engine inproc", file=sys.stderr)
            return 2
        return run_processes(cfg, args)
    from ddiloco.engine import run

    summary = run(cfg)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
        print(f"\nwrote {cfg.out}/summary.json and {cfg.out}/metrics.jsonl")
    return 0


def format_summary(s: dict) -> str:
    """A small results table for the terminal."""
    gib = 1 << 20
    rows = [
        ("method", f"{s['method']} ({s['engine']}, M={s['learners']})"),
        ("inner steps / learner", f"{s['steps']}"),
        ("tokens", f"{s['tokens']:,}"),
        ("final eval loss", f"{s['final_eval_loss']:.4f}"),
        ("entropy floor", "n/a" if s.get("entropy_floor") is None else
         f"{s['entropy_floor']:.4f}  (gap {s['final_eval_loss'] - s['entropy_floor']:.4f})"),
        ("eval accuracy", "n/a" if s.get("eval_accuracy") is None else f"{s['eval_accuracy']:.3f}"),
        ("goodput", f"{s['goodput']:.3f}  (of up-time: {s.get('goodput_available', s['goodput']):.3f})"),
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
    for module, adders in (("ddiloco.sim.cli", ("add_simulate_parser", "add_bandwidth_parser")),
                           ("ddiloco.runtime.cli", ("add_syncer_parser", "add_learner_parser",
                                                    "add_status_parser")),
                           ("ddiloco.runtime.export", ("add_export_parser",)),
                           ("ddiloco.runtime.observe.cli", ("add_dashboard_parser",)),
                           ("ddiloco.data.prepare", ("add_prepare_parser",)),
                           ("ddiloco.report", ("add_report_parser",))):
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
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
