"""``ddiloco simulate`` and ``ddiloco bandwidth``: argparse subcommands.

The main CLI wires them in with :func:`add_simulate_parser` and :func:`add_bandwidth_parser`;
``python -m ddiloco.sim.cli simulate ...`` runs them standalone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from ddiloco.argtypes import positive_float, positive_int

__all__ = ["add_simulate_parser", "add_bandwidth_parser", "build_parser", "main"]


def _fraction(text: str) -> float:
    v = positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


# ------------------------------------------------------------------------------ simulate


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``simulate`` to an argparse subparsers object; sets ``func``."""
    p = subparsers.add_parser(
        "simulate",
        help="goodput of dp / elastic-dp / decoupled under chip failures",
        description="Event-driven chaos simulation with the calibrated costs "
        "(see docs/simulator.md). Goodput and uptime with 95%% CIs over seeds.",
    )
    p.add_argument("--system", choices=("dp", "elastic-dp", "decoupled"))
    p.add_argument("--chips", type=positive_int, help="N: chips in the cluster")
    p.add_argument("--learners", type=positive_int, help="M (decoupled only; default 8)")
    p.add_argument("--quorum", type=positive_int, help="K, 1 <= K <= M (decoupled only)")
    p.add_argument("--no-grace", action="store_true", help="decoupled: no grace window")
    p.add_argument(
        "--mtbi-years",
        type=positive_float,
        default=1.0,
        help="per-chip mean time between interruptions (default 1)",
    )
    p.add_argument(
        "--weibull-shape",
        type=positive_float,
        help="Weibull failures with this shape instead of Poisson",
    )
    p.add_argument("--seeds", type=positive_int, default=5)
    p.add_argument(
        "--hours", type=positive_float, default=6.0, help="simulated hours per seed (default 6)"
    )
    p.add_argument(
        "--target-ci",
        type=positive_float,
        help="add seeds until the goodput 95%% half-width is <= this (in pp)",
    )
    p.add_argument(
        "--field-costs",
        action="store_true",
        help="use field-typical costs instead of the calibrated ones",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a cost, e.g. --set reconfig_s=60 (repeatable)",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="whole table: every system at 150k..2.4M chips, plus a PNG",
    )
    p.add_argument("--png", default="goodput_grid.png", help="PNG path for --grid")
    p.add_argument("--json", action="store_true", help="print one JSON object, no progress")
    p.set_defaults(func=_run_simulate, _parser=p)
    return p


def _costs(args, parser_error):
    from ddiloco.sim.calibration import field_costs, paper_costs

    costs = field_costs() if args.field_costs else paper_costs()
    fields = {f.name: f for f in dataclasses.fields(costs)}
    changes = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            parser_error(
                f"--set expects FIELD=VALUE with FIELD one of {', '.join(fields)}; got {item!r}"
            )
        cur = getattr(costs, name)
        try:
            if isinstance(cur, bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                changes[name] = value.lower() in ("true", "1")
            else:
                changes[name] = type(cur)(value)
        except ValueError:
            parser_error(f"--set {name}: cannot read {value!r} as {type(cur).__name__}")
    try:
        return dataclasses.replace(costs, **changes)
    except ValueError as e:
        parser_error(str(e))


def _run_simulate(args) -> int:
    from ddiloco.sim.failures import FailureConfig
    from ddiloco.sim.systems import SimConfig

    parser = args._parser
    costs = _costs(args, parser.error)
    if args.grid:
        return _run_grid(args, costs)
    if args.system is None or args.chips is None:
        parser.error(
            "give --system {dp,elastic-dp,decoupled} and --chips N, e.g. `ddiloco simulate "
            "--system decoupled --chips 150000`, or --grid for the whole table"
        )
    if args.system != "decoupled" and (args.learners is not None or args.quorum is not None):
        parser.error(f"--learners/--quorum apply to --system decoupled only, not {args.system}")
    m = args.learners if args.learners is not None else (8 if args.system == "decoupled" else 1)
    k = args.quorum if args.quorum is not None else 1
    if k > m:
        parser.error(f"--quorum K = {k} exceeds --learners M = {m}; need 1 <= K <= M")
    failures = FailureConfig(
        mtbi_years=args.mtbi_years,
        distribution="weibull" if args.weibull_shape else "poisson",
        weibull_shape=args.weibull_shape or 1.0,
    )
    try:
        cfg = SimConfig(
            system=args.system,
            n_chips=args.chips,
            learners=m,
            quorum=k,
            grace=not args.no_grace,
            failures=failures,
            costs=costs,
            horizon_s=args.hours * 3600.0,
            warmup_s=min(1800.0, args.hours * 900.0),
        )
    except ValueError as e:
        parser.error(str(e))
    return _simulate_one(args, cfg)


def _simulate_one(args, cfg) -> int:
    from ddiloco.sim.stats import simulate

    bar = None
    if not args.json:
        from tqdm import tqdm

        bar = tqdm(
            total=args.seeds, desc=f"{cfg.system} N={cfg.n_chips}", unit="seed", file=sys.stderr
        )
    target = args.target_ci / 100 if args.target_ci else None
    s = simulate(
        cfg,
        args.seeds,
        target_ci95=target,
        on_seed=(lambda n: bar.update(n - bar.n)) if bar else None,
    )
    if bar is not None:
        bar.close()
    out = {
        "system": cfg.system,
        "chips": cfg.n_chips,
        "learners": cfg.learners,
        "quorum": cfg.quorum,
        "mtbi_years": cfg.failures.mtbi_years,
        "hours_per_seed": cfg.horizon_s / 3600.0,
        **s.as_dict(),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"{cfg.system} (M = {cfg.learners}, K = {cfg.quorum}) on {cfg.n_chips} chips, "
            f"MTBI {cfg.failures.mtbi_years:g} y, {s.seeds} seeds x {out['hours_per_seed']:g} h"
        )
        print(f"  goodput {100 * s.goodput:.1f}% ± {100 * s.goodput_ci95:.1f} pp (95% CI)")
        print(f"  uptime  {100 * s.uptime:.1f}% ± {100 * s.uptime_ci95:.1f} pp")
        print(f"  failures per seed {out['failures_per_seed']:.0f}")
    return 0


def _run_grid(args, costs) -> int:
    from ddiloco.sim.grid import format_grid, format_reproduction, plot_grid, run_grid

    cells = run_grid(
        seeds=args.seeds,
        mtbi_years=args.mtbi_years,
        costs=costs,
        horizon_s=args.hours * 3600.0,
        progress=not args.json,
    )
    plot_grid(cells, args.png)
    if args.json:
        print(json.dumps({"cells": [c.as_dict() for c in cells], "png": args.png}))
        return 0
    print(format_grid(cells))
    if not args.field_costs and not args.set and args.mtbi_years == 1.0:
        table, worst = format_reproduction(cells)
        print()
        print(table)
        print(f"\nworst |simulated - published| = {worst:.1f} pp")
    print(f"\nwrote {args.png}")
    return 0


# ------------------------------------------------------------------------------ bandwidth


def add_bandwidth_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bandwidth`` to an argparse subparsers object; sets ``func``."""
    from ddiloco.bandwidth import METHODS

    p = subparsers.add_parser(
        "bandwidth",
        help="WAN bandwidth vs compute utilisation across datacenters",
        description="Compute-utilisation model of DP, DiLoCo, Streaming DiLoCo and Decoupled "
        "DiLoCo across D datacenters (see docs/bandwidth.md for the assumptions).",
    )
    p.add_argument("--method", choices=METHODS, help="one method (default: all)")
    p.add_argument("--params", type=positive_float, default=5e9, help="N parameters")
    p.add_argument("--step-time", type=positive_float, default=1.0, help="T seconds")
    p.add_argument("--datacenters", type=positive_int, default=8, help="D >= 2")
    p.add_argument(
        "--up-bits",
        type=positive_float,
        default=16,
        help="bits/param a learner sends, per-block scales included (16 bf16, "
        "4.5 int4 with 64-element blocks)",
    )
    p.add_argument(
        "--down-bits",
        type=positive_float,
        default=16,
        help="bits/param of merged parameters sent back (8.5: int8)",
    )
    p.add_argument(
        "--grad-bits",
        type=positive_float,
        default=16,
        help="DP: bits per gradient element (32: fp32, as Gloo sends them)",
    )
    p.add_argument(
        "--syncer",
        choices=("sharded", "hub"),
        default="sharded",
        help="syncer split over the datacenters (default) or in its own (hub)",
    )
    p.add_argument(
        "--pulls-per-push",
        type=positive_float,
        default=1.0,
        help="Decoupled: merged versions downloaded per push (measured: see docs/results/wan.md)",
    )
    p.add_argument(
        "--control-bps",
        type=float,
        default=0.0,
        help="per-second protocol traffic per learner link (heartbeats), bits/s",
    )
    p.add_argument(
        "--push-overhead-bits",
        type=float,
        default=0.0,
        help="protocol bits per push beyond the payload (headers, replies)",
    )
    p.add_argument("--fragments", type=positive_int, default=24, help="P")
    p.add_argument("--inner-steps", type=positive_int, default=24, help="H")
    p.add_argument("--tau", type=int, default=2)
    p.add_argument("--latency", type=float, default=0.0, help="seconds per transfer")
    p.add_argument(
        "--target-cu",
        type=_fraction,
        default=0.95,
        help="utilisation for the minimum-bandwidth answer (default 0.95)",
    )
    p.add_argument(
        "--bandwidth-gbps",
        type=positive_float,
        help="also report utilisation (and training time) at this bandwidth",
    )
    p.add_argument("--tokens", type=positive_float, help="token budget for time to train")
    p.add_argument("--tokens-per-step", type=positive_float, default=4 * 2**20)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_bandwidth, _parser=p)
    return p


def _ring(method: str, syncer: str) -> bool:
    """Whether the planner's bits for ``method`` are one direction of an all-reduce."""
    return method in ("dp", "streaming") or (method == "diloco" and syncer != "hub")


def _run_bandwidth(args) -> int:
    from ddiloco.bandwidth import (
        METHODS,
        BandwidthConfig,
        min_bandwidth,
        period,
        time_to_train,
        utilisation,
    )

    parser = args._parser
    if args.tokens is not None and args.bandwidth_gbps is None:
        parser.error("--tokens needs --bandwidth-gbps (time to train at that bandwidth)")
    rows = []
    for method in [args.method] if args.method else METHODS:
        try:
            cfg = BandwidthConfig(
                method=method,
                params=args.params,
                step_time_s=args.step_time,
                datacenters=args.datacenters,
                grad_bits=args.grad_bits,
                up_bits=args.up_bits,
                down_bits=args.down_bits,
                fragments=args.fragments,
                inner_steps=args.inner_steps,
                tau=args.tau,
                latency_s=args.latency,
                syncer=args.syncer,
                pulls_per_push=args.pulls_per_push,
                control_bps=args.control_bps,
                push_overhead_bits=args.push_overhead_bits,
            )
        except ValueError as e:
            parser.error(str(e))
        k, bits, _ = period(cfg)
        row = {
            "method": method,
            "target_cu": args.target_cu,
            "min_bandwidth_gbps": min_bandwidth(cfg, args.target_cu) / 1e9,
            # both ways on one datacenter's link (a ring all-reduce sends what it receives)
            "link_bytes_per_step": (2 if _ring(method, args.syncer) else 1) * bits / 8 / k,
        }
        if args.bandwidth_gbps is not None:
            bw = args.bandwidth_gbps * 1e9
            row["bandwidth_gbps"] = args.bandwidth_gbps
            row["utilisation"] = utilisation(cfg, bw)
            if args.tokens is not None:
                row["time_to_train_days"] = (
                    time_to_train(cfg, bw, args.tokens, args.tokens_per_step) / 86400
                )
        rows.append(row)
    if args.bandwidth_gbps is not None and "dp" in [r["method"] for r in rows]:
        dp = next(r for r in rows if r["method"] == "dp")
        for r in rows:
            r["speedup_vs_dp"] = r["utilisation"] / dp["utilisation"]
    setting = {
        "params": args.params,
        "step_time_s": args.step_time,
        "datacenters": args.datacenters,
        "up_bits": args.up_bits,
        "down_bits": args.down_bits,
        "fragments": args.fragments,
        "inner_steps": args.inner_steps,
        "tau": args.tau,
        "syncer": args.syncer,
    }
    if args.json:
        print(json.dumps({"setting": setting, "methods": rows}))
        return 0
    print(
        f"N = {args.params:.3g} params, T = {args.step_time:g} s/step, D = {args.datacenters}, "
        f"P = {args.fragments}, H = {args.inner_steps}, tau = {args.tau}, "
        f"bits up/down {args.up_bits}/{args.down_bits}"
    )
    for r in rows:
        line = (
            f"  {r['method']:<10} min bandwidth for {100 * args.target_cu:g}% CU: "
            f"{r['min_bandwidth_gbps']:.4g} Gbit/s | link bytes per step, both ways: "
            f"{r['link_bytes_per_step']:.4g}"
        )
        if "utilisation" in r:
            line += f" | CU at {args.bandwidth_gbps:g} Gbit/s: {100 * r['utilisation']:.1f}%"
        if "speedup_vs_dp" in r:
            line += f" ({r['speedup_vs_dp']:.1f}x DP)"
        if "time_to_train_days" in r:
            line += f" | {r['time_to_train_days']:.1f} days"
        print(line)
    return 0


# ------------------------------------------------------------------------------ standalone


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddiloco")
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(sub)
    add_bandwidth_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
