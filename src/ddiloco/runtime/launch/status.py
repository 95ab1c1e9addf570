"""``ddiloco status RUN_DIR_OR_HOST:PORT``: learners, their state, fragment versions,
goodput so far; of a run directory, its syncer's (address and token read from the
directory), or, once the run is over, what the directory records."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ddiloco.runtime.observe.accounting import goodput_so_far, learner_totals
from ddiloco.runtime.transport.auth import TOKEN_ENV, load_token

__all__ = [
    "RunTarget",
    "StatusTargetError",
    "fetch_status",
    "format_finished_run",
    "format_status",
    "run_dir_target",
]

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")


class StatusTargetError(ValueError):
    """``ddiloco status`` cannot tell whose status to show; the message says why."""


@dataclass(frozen=True, slots=True)
class RunTarget:
    """What a run directory says about its syncer: ``summary`` (summary.json) once the run
    is over, else the address, token file and CA to ask it with."""

    summary: dict | None = None
    address: str = ""
    token_file: str | None = None
    tls_ca: str | None = None


def run_dir_target(
    target: str, *, token_file: str | None = None, tls_ca: str | None = None
) -> RunTarget | None:
    """None for ``HOST:PORT``; for a run directory of ``ddiloco train``, its summary once
    the run is over, else its syncer's address (``runtime.host`` of its config.toml, the
    port in ``syncer.port``), token (``--token-file``, else the run's ``token`` file, else
    ``$DDILOCO_TOKEN``) and CA (``runtime.tls_ca``). Anything else is an error."""
    from ddiloco.config import CONFIG_FILE, load_config
    from ddiloco.rundir import TOKEN_FILE

    run = Path(target)
    if not run.is_dir():
        if _ADDRESS.match(target):
            return None
        raise StatusTargetError(
            f"{target} is neither a run directory nor a syncer's HOST:PORT (e.g. "
            f"`ddiloco status runs/latest` or `ddiloco status 127.0.0.1:50051`)"
        )
    summary = run / "summary.json"
    if summary.is_file():
        try:
            return RunTarget(summary=json.loads(summary.read_text()))
        except (OSError, ValueError) as e:
            raise StatusTargetError(f"{summary} is not readable ({e})") from None
    if not (run / CONFIG_FILE).is_file():
        raise StatusTargetError(
            f"{run} is not a run directory (no {CONFIG_FILE}): give the --out of a "
            f"`ddiloco train` run or a syncer's HOST:PORT"
        )
    port_file = next(
        (run / n for n in ("syncer.port", "syncer_0.port") if (run / n).is_file()), None
    )
    if port_file is None:
        raise StatusTargetError(
            f"{run} records no syncer address (no syncer.port): its run has not started a "
            f"syncer yet, or runs in-process (no syncer); give a syncer's HOST:PORT"
        )
    try:
        cfg = load_config(run / CONFIG_FILE)
        port = int(port_file.read_text().strip())
    except (OSError, ValueError) as e:
        raise StatusTargetError(f"{run}: {e}") from None
    host = cfg.runtime.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if token_file is None and (run / TOKEN_FILE).is_file():
        token_file = str(run / TOKEN_FILE)
    if token_file is None and not os.environ.get(TOKEN_ENV, "").strip():
        raise StatusTargetError(
            f"{run} holds no token for its syncer at {address}: set ${TOKEN_ENV} to the "
            f"run's token or pass --token-file"
        )
    return RunTarget(address=address, token_file=token_file, tls_ca=tls_ca or cfg.runtime.tls_ca)


def format_finished_run(run: str, s: dict) -> str:
    """A finished run, from its summary.json: one line that it is over, then what it
    records."""
    state = (
        "interrupted (Ctrl-C)"
        if s.get("interrupted")
        else ("FAILED (see logs/)" if s.get("ok") is False else "finished")
    )

    def num(x, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    rows = [
        ("method", f"{s.get('method')} ({s.get('engine')}, M={s.get('learners')}), {state}"),
        ("inner steps / learner", f"{s.get('steps')}"),
        (
            "eval loss",
            f"{num(s.get('initial_eval_loss'), '.4f')} -> {num(s.get('final_eval_loss'), '.4f')}",
        ),
        ("goodput", num(s.get("goodput"), ".3f")),
        ("merges", f"{s.get('merges')}"),
        ("wall time", f"{num(s.get('wall_s'), '.1f')} s"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(
        [f"the run in {run} is over: no syncer runs for it; its summary.json records:"]
        + [f"  {k:<{w}}  {v}" for k, v in rows]
        + [f"(ddiloco report {run} for more)"]
    )


def fetch_status(
    address: str,
    *,
    token_file: str | None = None,
    tls_ca: str | None = None,
    timeout_s: float = 5.0,
) -> dict:
    from ddiloco.runtime.learner.sharded import ShardedClient

    # a sharded syncer answers with its map: the snapshot then covers every shard
    client = ShardedClient(address, load_token(token_file), tls_ca)
    try:
        return client.status(timeout_s)
    finally:
        client.close()


def format_status(st: dict) -> str:
    shards = st.get("shards")
    head = (
        []
        if not shards
        else [
            "shards "
            + "  ".join(
                f"{sh['index']}:{'up' if sh['up'] else 'DOWN'}"
                f"({sh['merges'] if sh['up'] else '-'} merges)"
                for sh in shards
            )
        ]
    )
    lines = head + [
        f"syncer boot {st['boot_id']}  up {st['uptime_s']:.1f} s  merges {st['merges']}  "
        f"live {len(st['live'])}  initialised {st['initialised']}"
    ]
    g = goodput_so_far(st)
    lines.append(f"versions {st['versions']}")
    lines.append(f"goodput so far {g:.3f}" if g is not None else "goodput so far: n/a")
    xi = st.get("xi_step_s")
    lines.append(
        f"xi_step {xi if xi is None else round(xi, 4)} s  grace "
        f"{st.get('grace_s') if st.get('grace_s') is None else round(st['grace_s'], 4)} s  "
        f"learners per merge "
        f"{'-' if st.get('mean_quorum') is None else round(st['mean_quorum'], 2)}"
    )
    mem = st.get("membership")
    if mem:
        recent = "  ".join(
            f"{e['t_s']:.1f}s {e['kind']} {e['learner']}" for e in mem.get("events", [])[-6:]
        )
        lines.append(
            f"members: {mem.get('join', 0)} joins, {mem.get('leave', 0)} leaves, "
            f"{mem.get('dead', 0)} dead" + (f"  | {recent}" if recent else "")
        )
    if st.get("rejections"):
        lines.append(f"rejections {st['rejections']}")
    clipped = (st.get("counters") or {}).get("clipped_pushes")
    if clipped:
        lines.append(f"merge guard: {clipped} outer gradients clipped (sync.norm_clip)")
    lines.append(
        f"{'learner':>7} {'state':>6} {'inc':>4} {'step':>7} {'loss':>8} {'step_s':>8} "
        f"{'merged':>8} {'hb_age':>7}"
    )
    for m, info in st.get("learners", {}).items():
        rep = info.get("report") or {}
        led = learner_totals(info)["ledger"]
        steps = rep.get("global_step", learner_totals(info)["steps"])
        loss = rep.get("loss")
        step_s = rep.get("step_s")
        lines.append(
            f"{m:>7} {info['state']:>6} {info['incarnation']:>4} "
            f"{steps:>7} "
            f"{'-' if loss is None else f'{loss:.4f}':>8} "
            f"{'-' if step_s is None else f'{step_s:.4f}':>8} "
            f"{led.get('merged', 0.0):>8.1f} {info['last_heartbeat_age_s']:>7.2f}"
        )
    return "\n".join(lines)
