"""``ddiloco status HOST:PORT``: learners, their state, fragment versions, goodput so far."""

from __future__ import annotations

from ddiloco.runtime.observe.accounting import goodput_so_far, learner_totals
from ddiloco.runtime.transport.auth import load_token

__all__ = ["fetch_status", "format_status"]


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
