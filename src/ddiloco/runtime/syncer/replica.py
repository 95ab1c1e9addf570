"""A hot standby that loses nothing acknowledged (``ddiloco syncer --ha ... --ha-replicate``).

The leader of a replicated syncer (``ddiloco.runtime.syncer.ha``) sends each checkpoint
it takes to every registered standby before it publishes the versions in it
(``Replicator``): the same publish-after-durable rule as the checkpoint's, with each
standby's acknowledgement as durability. A standby holds the state it was sent
(``ReplicaStore``) and writes it as a checkpoint in its own directory; elected, it resumes
from that, not from the old leader's disk, so the old leader's machine and disk may die.

**Registration.** A standby registers under ``/ddiloco/RUN/standby/ADDRESS`` with a lease
of its own (``Registration``), ``"synced": false``, then ``true`` once it holds a whole
state. The leader reads the registrations before each round and waits for every one. A
standby whose registration lease it cannot keep (``Lease.valid``, the same arithmetic as
the leader's) forgets its state before etcd can drop the key, so a standby the leader
stopped waiting for never leads from a stale state.

**A round** (one per checkpoint, so one per merge with ``checkpoint_every = 1``) is one
``Replicate`` call (gRPC, client streaming, on the standby's own port) per standby. Its
header: the leader's ``epoch``, the round's ``seq``, ``base`` (the round before it), the
checkpoint's snapshot without its tensors (versions, the token ledger, merge sequence
numbers per learner, incarnations, counters, the clock: what a resume reads), and
``fragments``: ``[p, theta, momentum]`` with each tensor's dtype and shape; the payload is
those tensors' bytes. A standby that acknowledged round ``seq - 1`` of this epoch gets the
fragments merged since (one fragment per merge: a fragment's merge is replicated, not the
model); any other (a new standby, one that missed a round, the first round of a new
leader) gets every fragment. The standby answers with the round it now holds, after the
checkpoint holding it is on its disk.

**Fencing.** A standby refuses (``E_STALE_EPOCH``) a round of an epoch older than the
newest it has seen, in a round or in the leader key it reads, and a delta whose base is not
what it holds (``E_REPLICA_BASE``: the leader sends everything again). The leader stops a
round once its own lease is no longer valid and publishes nothing of it.

**Who may lead.** A standby that holds a state (``synced``, under a registration still
valid and still in etcd) campaigns and resumes from it. One that holds none campaigns only
while no registered standby is synced (then it resumes from the checkpoint directory, as
in the first form). Every version a learner installed was acknowledged by every standby
registered when it was published, so whichever synced standby wins holds it.

**Not covered**: a standby that is registered but cannot be reached by the leader (cut off
from the leader and not from etcd) stalls publication until its lease lapses; no eviction.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import torch

from ddiloco.runtime.syncer.checkpoint import (
    CHECKPOINT_NAME,
    DEFAULT_KEEP,
    TENSOR_FIELDS,
    _canonical,
    save_atomic,
)
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.auth import channel_credentials
from ddiloco.runtime.transport.etcd import EtcdClient, EtcdError, standby_prefix
from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = [
    "REPLICATE",
    "Registration",
    "ReplicaStore",
    "ReplicaRefused",
    "Replicator",
    "RoundStats",
    "standbys",
]

log = logging.getLogger("ddiloco.syncer.ha")

REPLICATE = "Replicate"
"""The standby's gRPC method that takes a round."""
REPLICA_BASE = "E_REPLICA_BASE"


class _Valid(Protocol):
    def valid(self) -> bool: ...


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"a replicated tensor of unknown dtype {name!r}")
    return dt


def _meta(ts: list[torch.Tensor]) -> list[list[Any]]:
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in ts]


def _bytes(t: torch.Tensor) -> memoryview:
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return memoryview(b)  # type: ignore[arg-type]  # numpy arrays are buffers


def _same(refs: tuple[weakref.ref, ...], tensors: list[torch.Tensor]) -> bool:
    return len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors))


def standbys(client: EtcdClient, name: str) -> dict[str, tuple[int, bool]]:
    """The registered standbys of run ``name``: address -> (the registration's creation
    revision, whether it holds a whole state)."""
    out = {}
    for kv in client.prefix(standby_prefix(name)).values():
        try:
            v = json.loads(kv.value)
            out[str(v["address"])] = (kv.create_revision, bool(v.get("synced")))
        except (ValueError, KeyError, TypeError):
            continue
    return out


@dataclass(frozen=True, slots=True)
class RoundStats:
    """What one round cost the leader."""

    seq: int
    bytes: int
    """Bytes sent, summed over standbys (headers and payloads)."""
    seconds: float
    """From the round's start to the last acknowledgement."""
    standbys: int
    full: int
    """Standbys sent every fragment."""


class Replicator:
    """The leader's side: ``round(snapshot)`` sends a checkpoint to every registered standby
    and returns once each has acknowledged it (module doc)."""

    def __init__(
        self,
        epoch: int,
        lease: _Valid,
        token: str,
        registered: Callable[[], dict[str, tuple[int, bool]]],
        *,
        tls_ca: str | None = None,
        tls: bool = False,
        timeout_s: float = 30.0,
        retry_s: float = 0.2,
        counters: MutableMapping[str, Any] | None = None,
    ) -> None:
        """``registered()``: the standbys now (``standbys``); ``lease.valid()``: whether
        this leader may still act."""
        self.epoch, self.lease, self.registered = epoch, lease, registered
        self._md = ((wire.TOKEN_METADATA, token),)
        self._tls, self._tls_ca = bool(tls or tls_ca), tls_ca
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.counters = counters if counters is not None else {}
        self.seq = 0
        self.acked: dict[str, tuple[int, int, int]] = {}
        """address -> (its registration's revision, epoch, seq) it acknowledged."""
        self._refs: list[tuple[weakref.ref, ...]] = []
        self._channels: dict[str, grpc.Channel] = {}
        self._closed = False

    def _channel(self, address: str) -> grpc.Channel:
        ch = self._channels.get(address)
        if ch is None:
            opts = wire.GRPC_OPTIONS
            ch = (
                grpc.secure_channel(address, channel_credentials(self._tls_ca), opts)
                if self._tls
                else grpc.insecure_channel(address, opts)
            )
            self._channels[address] = ch
        return ch

    def round(self, snapshot: dict) -> RoundStats | None:
        """Replicate ``snapshot`` (a checkpoint's, ``durability.snapshot``; its tensors are
        read, not kept); None when this leader's lease ended first (publish nothing)."""
        t0 = time.monotonic()
        state = snapshot["state"]
        tensors = [[*th, *mo] for th, mo in zip(state["theta"], state["momentum"])]
        changed = [
            p
            for p in range(len(tensors))
            if p >= len(self._refs) or not _same(self._refs[p], tensors[p])
        ]
        body = json.loads(
            _canonical(
                {
                    **snapshot,
                    "state": {k: v for k, v in state.items() if k not in TENSOR_FIELDS},
                }
            )
        )
        self.seq += 1
        sent = full_n = 0
        n = 0
        while True:
            if self._closed or not self.lease.valid():
                return None
            try:
                now = self.registered()
            except EtcdError as e:
                log.warning("replication round %d: standbys unknown (%s); again", self.seq, e)
                time.sleep(self.retry_s)
                continue
            n = len(now)
            pending = [
                a for a, (rev, _) in now.items() if self.acked.get(a) != (rev, self.epoch, self.seq)
            ]
            if not pending:
                break
            for a in pending:
                rev = now[a][0]
                full = self.acked.get(a) != (rev, self.epoch, self.seq - 1)
                frags = range(len(tensors)) if full else changed
                h = {
                    "epoch": self.epoch,
                    "seq": self.seq,
                    "base": 0 if full else self.seq - 1,
                    "full": full,
                    "snapshot": body,
                    "fragments": [
                        [p, _meta(state["theta"][p]), _meta(state["momentum"][p])] for p in frags
                    ],
                }
                payload = b"".join(_bytes(t) for p in frags for t in tensors[p])
                try:
                    self._send(a, h, payload)
                except grpc.RpcError as e:
                    details = e.details() if hasattr(e, "details") else str(e)
                    log.warning("replication round %d to %s failed: %s", self.seq, a, details)
                    if REPLICA_BASE in (details or ""):
                        self.acked.pop(a, None)
                    continue
                self.acked[a] = (rev, self.epoch, self.seq)
                sent += len(payload) + len(json.dumps(h))
                full_n += full
            if any(self.acked.get(a) != (now[a][0], self.epoch, self.seq) for a in now):
                time.sleep(self.retry_s)
        self._refs = [tuple(weakref.ref(t) for t in ts) for ts in tensors]
        stats = RoundStats(self.seq, sent, time.monotonic() - t0, n, full_n)
        c = self.counters
        c["replications"] = c.get("replications", 0) + 1
        c["replication_bytes"] = stats.bytes
        c["replication_bytes_total"] = c.get("replication_bytes_total", 0) + stats.bytes
        c["replication_s_total"] = c.get("replication_s_total", 0) + stats.seconds
        c["standbys"] = n
        return stats

    def _send(self, address: str, header: dict, payload: bytes) -> dict:
        call = self._channel(address).stream_unary(wire.method(REPLICATE))
        resp = call(wire.chunks(header, payload), timeout=self.timeout_s, metadata=self._md)
        return wire.unpack(resp)[0]

    def close(self) -> None:
        """Stop: a round in progress ends unacknowledged (None: nothing of it published)."""
        self._closed = True
        for ch in list(self._channels.values()):
            ch.close()
        self._channels.clear()


class ReplicaRefused(Exception):
    """A round a standby refuses: (gRPC status, details)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class ReplicaStore:
    """A standby's copy of the leader's state: each round applied and written as a
    checkpoint in ``directory`` (incremental: a fragment not in the round is named from
    the checkpoint before) before it is acknowledged."""

    def __init__(self, directory: str | Path, keep: int = DEFAULT_KEEP) -> None:
        self.directory, self.keep = Path(directory), keep
        self.epoch = self.seq = 0
        """The round held: (its leader's epoch, its seq); (0, 0) for none."""
        self.newest_epoch = 0
        """The newest epoch seen, in a round or in the leader's key."""
        self.synced = False
        """Holds a whole state that the leader of ``epoch`` sent."""
        self.on_synced: Callable[[], None] | None = None
        self._theta: list[list[torch.Tensor]] = []
        self._momentum: list[list[torch.Tensor]] = []
        self._entries: list[dict | None] = []
        self._lock = threading.Lock()

    def note_epoch(self, epoch: int) -> None:
        with self._lock:
            self.newest_epoch = max(self.newest_epoch, epoch)

    def forget(self) -> None:
        """Hold nothing (the registration it was sent under is gone)."""
        with self._lock:
            if self.synced:
                log.warning("replica of epoch %d round %d forgotten", self.epoch, self.seq)
            self.synced = False
            self.epoch = self.seq = 0
            self._theta, self._momentum, self._entries = [], [], []

    def apply(self, h: dict, payload: memoryview) -> dict:
        """Take round ``h`` (its tensors' bytes in ``payload``); the reply's header."""
        with self._lock:
            epoch, seq = int(h["epoch"]), int(h["seq"])
            if epoch < self.newest_epoch:
                raise ReplicaRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{E.STALE_EPOCH}: a round of epoch {epoch}; epoch {self.newest_epoch} "
                    f"has been seen: refused",
                )
            full = bool(h["full"])
            if not full and (self.epoch, self.seq) != (epoch, int(h["base"])):
                raise ReplicaRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{REPLICA_BASE}: a delta on round {h['base']} of epoch {epoch}; this "
                    f"standby holds round {self.seq} of epoch {self.epoch}: send everything",
                )
            self.newest_epoch = epoch
            snap = h["snapshot"]
            P = len(h["fragments"]) if full else len(self._theta)  # noqa: N806
            theta = [[] for _ in range(P)] if full else list(self._theta)
            momentum = [[] for _ in range(P)] if full else list(self._momentum)
            off, got = 0, []
            for p, mt, mm in h["fragments"]:
                cols: list[list[torch.Tensor]] = [[], []]
                for col, meta in zip(cols, (mt, mm)):
                    for dt, shape in meta:
                        t = torch.empty(shape, dtype=_dtype(dt))
                        nb = t.numel() * t.element_size()
                        if off + nb > len(payload):
                            raise ValueError("a replication round shorter than its header")
                        t.reshape(-1).view(torch.uint8).copy_(
                            torch.frombuffer(payload[off : off + nb], dtype=torch.uint8)
                            if nb
                            else torch.empty(0, dtype=torch.uint8)
                        )
                        col.append(t)
                        off += nb
                theta[p], momentum[p] = cols
                got.append(p)
            if off != len(payload):
                raise ValueError("a replication round longer than its header")
            reuse = (
                {}
                if full
                else {p: e for p, e in enumerate(self._entries) if e is not None and p not in got}
            )
            ck = {
                **snap,
                "state": {**snap["state"], "theta": list(theta), "momentum": list(momentum)},
            }
            w = save_atomic(ck, self.directory / CHECKPOINT_NAME, self.keep, reuse=reuse)
            self._theta, self._momentum, self._entries = theta, momentum, w.fragments
            self.epoch, self.seq = epoch, seq
            first = not self.synced
            self.synced = True
        if first and self.on_synced is not None:
            self.on_synced()
        return {"epoch": epoch, "seq": seq, "bytes": w.bytes}

    def handler(self, authorised: Callable[[grpc.ServicerContext], bool]) -> Callable:
        """The gRPC handler of ``Replicate`` (client streaming)."""

        def replicate(frames: Iterator[bytes], ctx: grpc.ServicerContext) -> bytes:
            if not authorised(ctx):
                ctx.abort(grpc.StatusCode.UNAUTHENTICATED, f"{E.AUTH}: missing or wrong token")
            h: dict | None = None
            pieces = []
            for frame in frames:
                fh, payload = wire.unpack(frame)
                if h is None:
                    h = fh
                pieces.append(payload)
            if h is None:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "an empty replication round")
                raise AssertionError("unreachable")
            buf = memoryview(bytearray().join(pieces))  # writable: tensors are made from it
            del pieces
            try:
                return wire.pack(self.apply(h, buf))
            except ReplicaRefused as e:
                ctx.abort(e.code, e.details)
            except (KeyError, TypeError, ValueError, OSError) as e:
                log.error("replication round refused: %s: %s", type(e).__name__, e)
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{E.INTERNAL}: {e}")
            raise AssertionError("unreachable")

        return replicate


class Registration:
    """A standby's key ``/ddiloco/RUN/standby/ADDRESS`` under a lease of its own, renewed
    like the leader's (``ha.Lease``); ``mark_synced`` once it holds a whole state."""

    def __init__(
        self, client: EtcdClient, cfg: Any, address: str, make_lease: Callable[..., Any]
    ) -> None:
        """``make_lease``: ``ha.Lease`` (passed in: ``ha`` imports this module)."""
        self.client, self.cfg, self.address = client, cfg, address
        self.key = standby_prefix(cfg.name) + address
        t0 = time.monotonic()
        lease_id = client.grant(cfg.ttl_s)
        self.revision = client.put(self.key, self._value(False), lease_id)
        self.lease = make_lease(client, cfg, lease_id, t0, cfg.ttl_s, what="standby registration")

    def _value(self, synced: bool) -> bytes:
        return json.dumps({"address": self.address, "synced": synced}).encode()

    def mark_synced(self) -> None:
        try:
            self.client.put(self.key, self._value(True), self.lease.id)
        except EtcdError as e:
            log.warning("standby registration: cannot mark synced (%s)", e)

    def current(self) -> bool:
        """Still valid, and still the key in etcd (the leader has not seen it lapse)."""
        if not self.lease.valid():
            return False
        try:
            kv = self.client.get(self.key)
        except EtcdError:
            return False
        return kv is not None and kv.lease == self.lease.id and self.lease.valid()

    def close(self) -> None:
        self.lease.close(revoke=True)
