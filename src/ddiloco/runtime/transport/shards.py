"""The shard map of a sharded syncer: S syncer processes, each owning a disjoint set of
fragments. Both sides speak it (the syncer shards and ``ddiloco.runtime.learner.sharded``),
so it lives with the transport.

The shard map comes from the run configuration: the shards' addresses in order
(``--shards HOST:PORT,HOST:PORT,...``) and each process's own index (``--shard k``).
Fragment p belongs to shard ``p % S``, so the map needs no knowledge of the model and
every fragment count spreads evenly. Every shard answers Join with the map; learners
(``ddiloco.runtime.learner.sharded``) join every shard, heartbeat to every shard (each
keeps its own live set, quorum, grace window and token ledger for its fragments), push
and fetch each fragment at its owner, and long-poll every shard at once.

Each shard checkpoints to its own directory and resumes on its own; while one is down,
only its fragments wait (the others' pushes, merges and installs go on). ``ddiloco
status`` and the launcher's ``summary.json`` see one syncer through ``aggregate_status``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardMap", "aggregate_status", "parse_shards"]


def parse_shards(text: str | None) -> tuple[str, ...]:
    """``HOST:PORT,HOST:PORT,...`` -> the shards' addresses (empty: not sharded)."""
    if not text:
        return ()
    out = tuple(a.strip() for a in text.split(",") if a.strip())
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"shard address {a!r} is not HOST:PORT (e.g. 10.0.0.2:50051)")
    if len(set(out)) != len(out):
        raise ValueError(f"shard addresses must differ, got {list(out)}")
    return out


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Which syncer process owns which fragment."""

    addresses: tuple[str, ...]
    """Shard k's HOST:PORT, as learners reach it."""

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("a shard map needs at least one address")

    @property
    def S(self) -> int:  # noqa: N802 - the paper's symbol
        return len(self.addresses)

    def owner(self, p: int) -> int:
        return p % self.S

    def fragments_of(self, k: int, P: int) -> list[int]:  # noqa: N803
        return [p for p in range(P) if p % self.S == k]

    def to_dict(self, index: int) -> dict:
        return {"addresses": list(self.addresses), "index": index}

    @classmethod
    def from_reply(cls, d: dict | None) -> ShardMap | None:
        """The map a Join or Status reply carries (None: a single syncer)."""
        if not d or not isinstance(d.get("addresses"), list) or len(d["addresses"]) < 2:
            return None
        return cls(tuple(str(a) for a in d["addresses"]))


def aggregate_status(parts: list[dict | None]) -> dict:
    """One ``Status`` snapshot from the shards' snapshots (shard order; None: a shard that
    did not answer). Versions come from each fragment's owner; merges, counters and
    rejections add up; a learner's syncer ledger adds up over the shards and its report is
    the freshest one."""
    live = [(k, s) for k, s in enumerate(parts) if s is not None]
    if not live:
        raise ValueError("no shard answered")
    S = len(parts)  # noqa: N806
    first = live[0][1]
    P = len(first.get("versions") or [])  # noqa: N806
    versions: list[int | None] = [None] * P
    for k, s in live:
        for p, v in enumerate(s.get("versions") or []):
            if p % S == k:
                versions[p] = v
    learners: dict[str, dict] = {}
    for _, s in live:
        for m, info in s.get("learners", {}).items():
            cur = learners.get(m)
            if cur is None:
                learners[m] = {**info, "syncer_ledger": dict(info.get("syncer_ledger") or {})}
                continue
            for key, val in (info.get("syncer_ledger") or {}).items():
                if isinstance(val, (int, float)):
                    cur["syncer_ledger"][key] = cur["syncer_ledger"].get(key, 0) + val
            if info.get("last_heartbeat_age_s", 1e9) < cur.get("last_heartbeat_age_s", 1e9):
                for key in ("state", "incarnation", "last_heartbeat_age_s", "report"):
                    cur[key] = info.get(key)

    def total(key: str) -> dict:
        out: dict = {}
        for _, s in live:
            for name, val in (s.get(key) or {}).items():
                if isinstance(val, (int, float)):
                    out[name] = out.get(name, 0) + val
        return out

    merges = sum(s.get("merges") or 0 for _, s in live)
    quorum = [
        (s["mean_quorum"], s.get("merges") or 0)
        for _, s in live
        if s.get("mean_quorum") is not None
    ]
    wq = sum(w for _, w in quorum)
    members = {
        k: sum((s.get("membership") or {}).get(k, 0) for _, s in live)
        for k in ("join", "leave", "dead")
    }
    events = sorted(
        (dict(e, shard=k) for k, s in live for e in (s.get("membership") or {}).get("events", [])),
        key=lambda e: e["t_s"],
    )
    return {
        **first,
        "boot_id": "+".join(s["boot_id"] if s else "down" for s in parts),
        "uptime_s": max(s.get("uptime_s") or 0.0 for _, s in live),
        "initialised": all(s.get("initialised") for _, s in live),
        "versions": versions,
        "merges": merges,
        "live": sorted(set().union(*(set(s.get("live") or []) for _, s in live))),
        "learners": dict(sorted(learners.items(), key=lambda kv: int(kv[0]))),
        "counters": total("counters"),
        "rejections": total("rejections"),
        "mean_quorum": sum(q * w for q, w in quorum) / wq if wq else None,
        "steps_done": max(s.get("steps_done") or 0 for _, s in live),
        "budget_spent": any(s.get("budget_spent") for _, s in live),
        "membership": {**members, "events": events[-64:]},
        "shards": [
            {
                "index": k,
                "up": s is not None,
                "boot_id": s["boot_id"] if s else None,
                "merges": s.get("merges") if s else None,
            }
            for k, s in enumerate(parts)
        ],
    }
