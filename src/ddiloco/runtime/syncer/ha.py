"""A replicated syncer: leader election and fencing through etcd (``ddiloco syncer --ha``).

Two or more syncer processes of one run (``--ha etcd://HOST:PORT --ha-name RUN``) campaign
for the key ``/ddiloco/RUN/leader``. A campaign is one etcd transaction: create the key
under a fresh lease if no such key exists. The process that created it leads; the others
stand by. The key's creation revision is the leader's **epoch**, the fencing token: etcd
gives every creation a larger revision, so a later leader always has a larger epoch.

**The leader** runs the ordinary ``SyncerServer``, and every reply it sends (each gRPC
call, each data-port reply) carries ``"epoch": E`` in its header. It renews its lease every
``ttl_s / 3`` (``Lease``) and answers a call only while

    now < t_sent + TTL - margin_s

where ``t_sent`` is when it *sent* its last keepalive that etcd acknowledged (its own
monotonic clock) and TTL the lease time etcd granted with it. etcd started that TTL when
it *received* the keepalive, after ``t_sent``, so the lease cannot lapse (and no other
process can create the key) before ``t_sent + TTL`` by etcd's clock. ``margin_s`` covers
the two clocks' rate difference over a TTL (ppm for real clocks; the default 1 s over a
6 s TTL covers a rate error of 16%) and the time between the check and the reply's
bytes leaving. When the check fails the leader answers ``E_NOT_LEADER`` to every call,
closes its server and stands by again: it stops publishing before a new leader can be
elected, whether it lost the lease to a pause (SIGSTOP, a long GC), a partition from etcd
or a slow disk. A reply already checked and then delayed past that point (a pause of
the process between the check and the send) is what the epoch is for: learners refuse
every reply of an epoch older than the newest they have heard
(``ddiloco.runtime.learner.leader``).

**A standby** binds the syncer's port and answers every call ``E_NOT_LEADER`` with the
leader's address and epoch (Status answers its role), so learners given every syncer's
address can follow. It polls the key every ``poll_s`` and campaigns when the key is gone.
It leads within TTL + ``poll_s`` of the old leader's last keepalive (plus the resume).

**State** (this first form): the leaders share the checkpoint directory (a shared disk).
Leader E writes its checkpoints under ``CHECKPOINT_DIR/epoch-E``. A new leader takes the
newest earlier epoch's checkpoints into its own directory and resumes from them
(``prepare_epoch_dir``): each intact manifest with every fragment file it names, which in
an incremental checkpoint (manifest version 3) lies in that checkpoint's fragment
directory or an earlier one's, hard-linked under the same relative path, so every path
the manifest names resolves in the new directory. Checkpoint files are never written in
place, so the links make the directories independent: a deposed leader that still writes
(its final checkpoint, a clean-up) changes nothing the new leader resumed from, and the
new leader's clean-up removes only its own links, never a file another epoch's manifest
needs. With ``checkpoint_every = 1`` every version a learner saw was durable before it
was sent, and so before the old lease lapsed: the new leader holds it. Pushes not yet
merged are lost, as on a ``--resume``: learners count them dropped and push again.

**Hot standbys** (``replicate``): the leader also sends each checkpoint to every standby
and publishes once they hold it; an elected standby resumes from its own copy, so the
directories need not be shared (``ddiloco.runtime.syncer.replica``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.auth import check_token, server_credentials
from ddiloco.runtime.transport.bulk import BulkReject
from ddiloco.runtime.transport.etcd import (
    EtcdClient,
    EtcdError,
    KeyValue,
    leader_key,
    parse_endpoint,
)
from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = [
    "HAConfig",
    "Lease",
    "Election",
    "Fence",
    "StandbyServer",
    "prepare_epoch_dir",
    "run_replicated",
]

log = logging.getLogger("ddiloco.syncer.ha")

EPOCH_DIR = re.compile(r"^epoch-(\d+)$")
KEEP_EPOCH_DIRS = 3
"""Epoch directories kept in the checkpoint directory: the leader's and two before it."""


@dataclass(kw_only=True, slots=True)
class HAConfig:
    endpoint: str
    """etcd's client address, ``etcd://HOST:PORT`` (its JSON gateway)."""
    name: str
    """The run's name: every syncer of the run campaigns for ``/ddiloco/NAME/leader``."""
    address: str = ""
    """This syncer's HOST:PORT as learners reach it, told to learners that ask a standby
    and written in the key. Empty: the bind host and port."""
    ttl_s: int = 6
    """The lease's time to live: a dead leader's lease lapses this long after its last
    keepalive, and a standby leads within it (plus ``poll_s`` and the resume)."""
    margin_s: float = 1.0
    """The leader stops answering this long before its lease can lapse (module doc)."""
    poll_s: float = 0.5
    """A standby reads the key this often."""
    replicate: bool = False
    """A hot standby (``ddiloco.runtime.syncer.replica``): the leader sends every checkpoint
    to the standbys and publishes once they hold it; an elected standby resumes from its
    copy, so the old leader's disk may be lost."""
    replica_dir: str = ""
    """Where a standby writes its copy (with ``replicate``); empty:
    ``CHECKPOINT_DIR/replica-PORT``."""

    def __post_init__(self) -> None:
        parse_endpoint(self.endpoint)
        if not self.name or "/" in self.name:
            raise ValueError(f"ha name must be a non-empty name without '/', got {self.name!r}")
        if self.ttl_s < 2:
            raise ValueError(f"ha ttl_s must be >= 2 (etcd's smallest lease), got {self.ttl_s}")
        if not 0 < self.margin_s < self.ttl_s * 2 / 3:
            raise ValueError(
                f"ha margin_s must be in (0, 2/3 of ttl_s = {self.ttl_s * 2 / 3:g}): a "
                f"keepalive goes every ttl_s / 3, and the leader must stay valid between "
                f"two of them; got {self.margin_s}"
            )
        if self.poll_s <= 0:
            raise ValueError("ha poll_s must be > 0")

    @property
    def keepalive_s(self) -> float:
        """Interval between keepalives: three per TTL, so one lost keepalive costs nothing."""
        return self.ttl_s / 3


class Lease:
    """The leader's lease and the deadline of its validity (``valid``). A thread renews it
    every ``keepalive_s``; ``lost`` is set once it is no longer valid, for good."""

    def __init__(
        self,
        client: EtcdClient,
        cfg: HAConfig,
        lease_id: int,
        t_sent: float,
        ttl_s: float,
        what: str = "leader's lease",
    ) -> None:
        self.client, self.cfg, self.id, self.what = client, cfg, lease_id, what
        self._deadline = t_sent + ttl_s - cfg.margin_s
        self.lost = threading.Event()
        self.why = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="ddiloco-lease", daemon=True)
        self._thread.start()

    def valid(self) -> bool:
        """Whether this process may still act as the leader now (module doc)."""
        return not self.lost.is_set() and time.monotonic() < self._deadline

    def remaining_s(self) -> float:
        return self._deadline - time.monotonic()

    def _lose(self, why: str) -> None:
        if not self.lost.is_set():
            self.why = why
            self.lost.set()
            log.error("%s %x lost: %s", self.what, self.id, why)

    def _renew(self) -> None:
        interval = self.cfg.keepalive_s
        while not self._stop.is_set():
            t0 = time.monotonic()
            if t0 >= self._deadline:
                self._lose("no keepalive acknowledged within TTL - margin")
                return
            try:
                ttl = self.client.keepalive(
                    self.id, timeout_s=max(0.1, min(interval, self.remaining_s()))
                )
            except EtcdError as e:
                log.warning(
                    "lease keepalive failed (%s); valid for %.1f s more", e, self.remaining_s()
                )
                ttl = None
            if ttl == 0:
                self._lose("etcd says the lease expired")
                return
            if ttl:
                self._deadline = max(self._deadline, t0 + ttl - self.cfg.margin_s)
            self._stop.wait(max(0.0, min(t0 + interval, self._deadline) - time.monotonic()))

    def close(self, revoke: bool) -> None:
        """Stop renewing; with ``revoke`` end the lease at once (its key goes with it, so a
        standby leads without waiting for the TTL)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.lost.set()
        if revoke:
            with contextlib.suppress(EtcdError):
                self.client.revoke(self.id)


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    address: str
    epoch: int


def _leader_of(kv: KeyValue | None) -> LeaderInfo | None:
    if kv is None:
        return None
    try:
        v = json.loads(kv.value)
        return LeaderInfo(str(v["address"]), kv.create_revision)
    except (ValueError, KeyError, TypeError):
        return LeaderInfo("", kv.create_revision)


class Election:
    """Campaign for the run's key; ``leader`` is the leader last read from etcd."""

    def __init__(self, cfg: HAConfig, address: str, client: EtcdClient | None = None) -> None:
        self.cfg, self.address = cfg, address
        self.client = client or EtcdClient(parse_endpoint(cfg.endpoint))
        self.key = leader_key(cfg.name)
        self.leader: LeaderInfo | None = None

    def _value(self) -> bytes:
        """The key's value: where learners reach this syncer."""
        return json.dumps(
            {"address": self.address, "host": socket.gethostname(), "pid": os.getpid()}
        ).encode()

    def campaign(
        self,
        stop: threading.Event,
        ready: Callable[[LeaderInfo | None], bool] | None = None,
    ) -> tuple[int, Lease] | None:
        """Block until this process leads: (its epoch, its lease); None once ``stop`` is
        set. etcd unreachable: keep trying. ``ready(leader)``, at each read of the key:
        whether this process may campaign now (a hot standby's rule, ``replica``)."""
        warned = 0.0
        while not stop.is_set():
            try:
                kv = self.client.get(self.key)
                ok = ready(_leader_of(kv)) if ready is not None else True
                if kv is None and ok:
                    t0 = time.monotonic()
                    ttl = self.cfg.ttl_s
                    lease_id = self.client.grant(ttl)
                    won, kv = self.client.create(self.key, self._value(), lease_id)
                    if won:
                        assert kv is not None
                        self.leader = LeaderInfo(self.address, kv.create_revision)
                        log.info(
                            "elected leader of %s: epoch %d, lease %x (TTL %d s)",
                            self.cfg.name,
                            kv.create_revision,
                            lease_id,
                            ttl,
                        )
                        return kv.create_revision, Lease(self.client, self.cfg, lease_id, t0, ttl)
                    with contextlib.suppress(EtcdError):
                        self.client.revoke(lease_id)
                self.leader = _leader_of(kv)
            except EtcdError as e:
                if time.monotonic() > warned:
                    log.warning("etcd unreachable (%s); standing by", e)
                    warned = time.monotonic() + 10.0
            stop.wait(self.cfg.poll_s)
        return None


class Fence:
    """What the leading ``SyncerServer`` does with every reply: refuse it unless the lease
    is valid, and stamp the epoch into its header (``SyncerServer.fence``)."""

    def __init__(self, epoch: int, lease: Lease, name: str, address: str) -> None:
        self.epoch, self.lease, self.name, self.address = epoch, lease, name, address
        self.refused = 0

    def message(self) -> str:
        return (
            f"{E.NOT_LEADER}: syncer {self.address} of run {self.name} no longer leads "
            f"(epoch {self.epoch}, lease lapsed: {self.lease.why or 'past its margin'}); "
            f"the leader is elected anew through etcd"
        )

    def check(self) -> None:
        if not self.lease.valid():
            self.refused += 1
            raise _NotLeader(self.message())

    def ha_status(self) -> dict:
        return {
            "role": "leader",
            "epoch": self.epoch,
            "leader": self.address,
            "lease_s": round(self.lease.remaining_s(), 3),
        }

    def stamp(self, frame: bytes, method: str = "") -> bytes:
        h, payload = wire.unpack(frame)
        h["epoch"] = self.epoch
        if method == "Status":
            h["ha"] = self.ha_status()
        return wire.pack(h, payload)

    def interceptor(self) -> grpc.ServerInterceptor:
        return _FenceInterceptor(self)

    def bulk(self, handler: Callable[..., tuple[dict, list]]) -> Callable[..., tuple[dict, list]]:
        """The data port's handler, fenced: a reply leaves only while the lease is valid,
        with the epoch in its header."""

        def fenced(op: str, h: dict, plen: int, read_payload: Any) -> tuple[dict, list]:
            try:
                self.check()
                reply, pieces = handler(op, h, plen, read_payload)
                self.check()
            except _NotLeader as e:
                raise BulkReject(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            return {**reply, "epoch": self.epoch}, pieces

        return fenced


class _NotLeader(Exception):
    pass


class _FenceInterceptor(grpc.ServerInterceptor):
    def __init__(self, fence: Fence) -> None:
        self.fence = fence

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001
        h = continuation(handler_call_details)
        if h is None:
            return None
        fence = self.fence
        method = handler_call_details.method.rsplit("/", 1)[-1]

        def guard(ctx: grpc.ServicerContext) -> None:
            try:
                fence.check()
            except _NotLeader as e:
                ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))

        def stamp(frame: bytes, ctx: grpc.ServicerContext) -> bytes:
            guard(ctx)
            return fence.stamp(frame, method)

        kw = {
            "request_deserializer": h.request_deserializer,
            "response_serializer": h.response_serializer,
        }
        if h.unary_unary is not None:
            fn = h.unary_unary

            def uu(req: bytes, ctx: grpc.ServicerContext) -> bytes:
                guard(ctx)
                return stamp(fn(req, ctx), ctx)

            return grpc.unary_unary_rpc_method_handler(uu, **kw)
        if h.stream_unary is not None:
            fsu = h.stream_unary

            def su(it: Iterator[bytes], ctx: grpc.ServicerContext) -> bytes:
                guard(ctx)
                return stamp(fsu(it, ctx), ctx)

            return grpc.stream_unary_rpc_method_handler(su, **kw)
        if h.unary_stream is not None:
            fus = h.unary_stream

            def us(req: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
                guard(ctx)
                first = True
                for frame in fus(req, ctx):
                    if first:  # the header rides on the first frame of each item
                        frame, first = stamp(frame, ctx), False
                    else:
                        guard(ctx)
                    yield frame

            return grpc.unary_stream_rpc_method_handler(us, **kw)
        return h


class StandbyServer:
    """A standby's gRPC port: every call is answered ``E_NOT_LEADER`` with the leader's
    address, Status with this syncer's role (``ddiloco status``)."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        election: Election,
        tls: tuple[str, str] | None = None,
        store: Any = None,
    ) -> None:
        """``store``: a hot standby's ``replica.ReplicaStore``, which takes the leader's
        rounds (``Replicate``)."""
        self.election, self.token = election, token
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8), options=wire.GRPC_SERVER_OPTIONS
        )
        names = ("Join", "Init", "Push", "Fetch", "Watch", "Heartbeat", "Leave", "Status")
        handlers = {}
        for n in names:
            if n in ("Init", "Push"):
                handlers[n] = grpc.stream_unary_rpc_method_handler(self._refuse)
            elif n == "Fetch":
                handlers[n] = grpc.unary_stream_rpc_method_handler(self._refuse)
            elif n == "Status":
                handlers[n] = grpc.unary_unary_rpc_method_handler(self._status)
            else:
                handlers[n] = grpc.unary_unary_rpc_method_handler(self._refuse)
        if store is not None:
            from ddiloco.runtime.syncer.replica import REPLICATE

            handlers[REPLICATE] = grpc.stream_unary_rpc_method_handler(
                store.handler(self._authorised)
            )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(wire.SERVICE, handlers),)
        )
        addr = f"{host}:{port}"
        try:
            if tls is not None:
                self.port = self._server.add_secure_port(addr, server_credentials(*tls))
            else:
                self.port = self._server.add_insecure_port(addr)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise RuntimeError(f"could not bind {addr}: the port is in use")
        self._server.start()

    def _authorised(self, ctx: grpc.ServicerContext) -> bool:
        token = dict(ctx.invocation_metadata()).get(wire.TOKEN_METADATA)
        return isinstance(token, str) and check_token(self.token, token)

    def _refuse(self, req: Any, ctx: grpc.ServicerContext) -> bytes:
        if not self._authorised(ctx):
            ctx.abort(grpc.StatusCode.UNAUTHENTICATED, f"{E.AUTH}: missing or wrong token")
        ld = self.election.leader
        where = (
            f"the leader is {ld.address} (epoch {ld.epoch})"
            if ld is not None and ld.address
            else "no leader is known yet"
        )
        ctx.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"{E.NOT_LEADER}: syncer {self.election.address} of run {self.election.cfg.name} "
            f"is a standby; {where}",
        )
        raise AssertionError("unreachable")

    def _status(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        if not self._authorised(ctx):
            ctx.abort(grpc.StatusCode.UNAUTHENTICATED, f"{E.AUTH}: missing or wrong token")
        ld = self.election.leader
        return wire.pack(
            {
                "initialised": False,
                "ha": {
                    "role": "standby",
                    "leader": ld.address if ld else None,
                    "epoch": ld.epoch if ld else None,
                },
            }
        )

    def close(self) -> None:
        self._server.stop(None).wait(2.0)


def _epoch_dirs(base: Path) -> list[tuple[int, Path]]:
    from ddiloco.runtime.syncer.checkpoint import numbered_dirs

    return numbered_dirs(base, EPOCH_DIR)


def _link(src: Path, dst: Path) -> None:
    """``dst`` a hard link of ``src`` (a copy where the file system refuses one)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        if dst.stat().st_ino == src.stat().st_ino:
            return
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _adopt(src: Path, dst: Path, keep: int) -> int:
    """Link the checkpoints of ``src`` into ``dst`` (a new epoch's directory, without a
    manifest yet): each intact manifest among ``syncer.json``, ``.1``... (read once, as
    bytes: a deposed leader may still be rotating them) with every fragment file it names,
    wherever in ``src`` it is (a version 3 manifest names files of earlier checkpoints'
    directories), and the copy of the manifest in its own fragment directory. A manifest
    whose files are not all there at their sizes (removed meanwhile by the deposed
    leader's clean-up) is left out. The manifests adopted are written newest last, as
    ``syncer.json``, ``.1``... in the order of their fragment directories; returns how many.

    Hard links make the two directories independent: checkpoint files are never written
    in place (a write makes new files, a rotation renames, a clean-up unlinks), so nothing
    the old leader still does in ``src`` changes a byte ``dst`` holds, and a clean-up in
    ``dst`` removes only ``dst``'s own names, never a file another epoch's manifest needs."""
    from ddiloco.runtime.syncer.checkpoint import CHECKPOINT_NAME, LEGACY_NAME, manifest_files

    dst.mkdir(parents=True, exist_ok=True)
    found: dict[str, bytes] = {}  # fragment directory -> manifest
    for i in range(keep):
        m = src / (CHECKPOINT_NAME if i == 0 else f"{CHECKPOINT_NAME}.{i}")
        try:
            raw = m.read_bytes()
        except OSError:
            continue
        got = manifest_files(raw)
        if got is None:
            log.warning("take-over: %s is damaged; not taken", m)
            continue
        data, files = got
        try:
            for f, size in files:
                if (src / f).stat().st_size != size:
                    raise FileNotFoundError(f"{src / f} is not {size} bytes")
                _link(src / f, dst / f)
                if (dst / f).stat().st_size != size:
                    raise FileNotFoundError(f"{dst / f} is not {size} bytes")
        except OSError as e:
            log.warning("take-over: %s names a fragment file that is gone (%s); not taken", m, e)
            continue
        with contextlib.suppress(OSError):
            _link(src / data / CHECKPOINT_NAME, dst / data / CHECKPOINT_NAME)
        found[data] = raw
    order = sorted(found, key=lambda d: (len(d), d), reverse=True)[:keep]  # newest first
    if not order:
        legacy = [src / LEGACY_NAME] + [src / f"{LEGACY_NAME}.{i}" for i in range(1, keep)]
        for old in legacy:
            with contextlib.suppress(OSError):
                _link(old, dst / old.name)
        return sum((dst / old.name).is_file() for old in legacy)
    for i in reversed(range(len(order))):
        name = CHECKPOINT_NAME if i == 0 else f"{CHECKPOINT_NAME}.{i}"
        tmp = dst / f".{name}.tmp.{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(found[order[i]])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dst / name)
    _fsync_dir(dst)
    return len(order)


def prepare_epoch_dir(
    base: str | Path,
    epoch: int,
    keep: int | None = None,
    attempts: int = 5,
    source: Path | None = None,
) -> tuple[Path, bool]:
    """Leader ``epoch``'s checkpoint directory under ``base``, holding the newest earlier
    checkpoint (``_adopt``: another epoch's, or a run's checkpoint in ``base`` itself):
    (the directory, whether there is a checkpoint to resume). An epoch directory whose
    checkpoints cannot be taken whole (its writer still cleaning up) is read again up to
    ``attempts`` times before an older one is taken, loudly. ``source``: take this
    directory's checkpoints first (a hot standby's copy). Epoch directories older than the
    one taken, past the newest ``KEEP_EPOCH_DIRS``, are removed."""
    from ddiloco.runtime.syncer.checkpoint import DEFAULT_KEEP, has_checkpoint

    keep = keep or DEFAULT_KEEP
    base = Path(base)
    mine = base / f"epoch-{epoch:012d}"
    sources = [d for e, d in reversed(_epoch_dirs(base)) if e < epoch]
    sources = [d for d in sources if has_checkpoint(d, keep)]
    if has_checkpoint(base, keep):  # a run started without --ha
        sources.append(base)
    if source is not None and has_checkpoint(source, keep):
        sources.insert(0, source)
    taken: Path | None = None
    if not has_checkpoint(mine, keep):
        for k, src in enumerate(sources):
            for attempt in range(attempts):
                if _adopt(src, mine, keep):
                    taken = src
                    break
                time.sleep(0.05 * (attempt + 1))
            if taken is not None:
                if k:
                    log.error(
                        "TAKE-OVER FROM AN OLDER EPOCH: no checkpoint of %s could be taken "
                        "whole; resuming from %s (merges after it are lost)",
                        ", ".join(str(d) for d in sources[:k]),
                        taken,
                    )
                break
    mine.mkdir(parents=True, exist_ok=True)
    below = EPOCH_DIR.match(taken.name) if taken is not None else None
    if below is not None and taken is not None and taken.parent == base:
        for e, d in _epoch_dirs(base)[:-KEEP_EPOCH_DIRS]:
            if e < int(below.group(1)) and d != mine:
                shutil.rmtree(d, ignore_errors=True)
    return mine, has_checkpoint(mine, keep)


def run_replicated(
    cfg: Any,
    ha: HAConfig,
    stop: threading.Event,
    on_bound: Callable[[int], None] | None = None,
    on_lead: Callable[[Any], None] | None = None,
) -> int:
    """Serve as one syncer of a replicated run until ``stop``: stand by, lead when elected,
    stand by again if the lease is lost. ``cfg``: the ``SyncerServerConfig`` (its
    ``checkpoint_dir`` is the shared base directory). ``on_bound(port)`` once the port is
    bound; ``on_lead(server)`` each time this process starts leading. Returns 0."""
    from ddiloco.runtime.syncer.server import SyncerServer

    if not cfg.checkpoint_dir:
        raise ValueError("a replicated syncer (--ha) needs a --checkpoint-dir on a shared disk")
    if cfg.checkpoint_every != 1:
        raise ValueError(
            "a replicated syncer (--ha) needs --checkpoint-every 1: a new leader resumes "
            "from the checkpoint, which must hold every version learners saw"
        )
    tls = (cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
    port = cfg.port
    announced = False
    store: Any = None
    while not stop.is_set():
        address = ha.address or f"{cfg.host}:{port}"
        election = Election(ha, address)
        if ha.replicate and store is None:
            from ddiloco.runtime.syncer.replica import ReplicaStore

            store = ReplicaStore("", cfg.checkpoint_keep)  # its directory once the port is known
        standby = StandbyServer(cfg.host, port, cfg.token, election, tls, store)
        port = standby.port
        if not ha.address:  # the key names the port bound
            address = election.address = f"{cfg.host}:{port}"
        if store is not None and str(store.directory) == ".":
            store.directory = Path(ha.replica_dir or Path(cfg.checkpoint_dir) / f"replica-{port}")
        if not announced:
            announced = True
            if on_bound is not None:
                on_bound(port)
        log.info("syncer %s of run %s standing by", address, ha.name)
        hot = _HotStandby(election, store, ha, address) if store is not None else None
        won = election.campaign(stop, hot.ready if hot is not None else None)
        standby.close()
        from_replica = hot is not None and hot.close()
        if won is None:
            break
        epoch, lease = won
        directory, resume = prepare_epoch_dir(
            cfg.checkpoint_dir,
            epoch,
            cfg.checkpoint_keep,
            source=store.directory if from_replica else None,
        )
        if store is not None:
            store.forget()  # this process leads now: its copy is of the epoch before
        server = SyncerServer(replace(cfg, port=port, checkpoint_dir=str(directory), resume=resume))
        server.fence = Fence(epoch, lease, ha.name, address)
        replicator = None
        if ha.replicate:
            from ddiloco.runtime.syncer.replica import Replicator, standbys

            def registered(
                me: str = address, client: EtcdClient = election.client
            ) -> dict[str, tuple[int, bool]]:
                return {a: v for a, v in standbys(client, ha.name).items() if a != me}

            replicator = Replicator(epoch, lease, cfg.token, registered, counters=server.counters)
            server.durability.replicate = replicator.round
        server.start()
        log.info(
            "leading run %s as epoch %d on %s (%s)",
            ha.name,
            epoch,
            address,
            f"resumed from {directory}" + (" (the standby's copy)" if from_replica else "")
            if resume
            else "no checkpoint: waiting for Init",
        )
        if on_lead is not None:
            on_lead(server)
        while not stop.is_set() and lease.valid():
            stop.wait(min(0.1, max(0.01, lease.remaining_s())))
        lost = not lease.valid()
        if replicator is not None:
            replicator.close()  # a round waiting on a standby ends, unpublished
        server.close()  # its final checkpoint goes to its own epoch directory
        lease.close(revoke=not lost)  # a clean stop hands over at once
        if lost:
            log.warning("epoch %d over (%s): standing by again", epoch, lease.why)
    return 0


class _HotStandby:
    """A hot standby's registration and its rule for campaigning (``replica`` module doc)."""

    def __init__(self, election: Election, store: Any, ha: HAConfig, address: str) -> None:
        self.election, self.store, self.ha, self.address = election, store, ha, address
        self.registration: Any = None

    def _register(self) -> None:
        from ddiloco.runtime.syncer.replica import Registration

        if self.registration is not None and not self.registration.lease.valid():
            self.store.forget()  # the leader may have stopped waiting for this standby
            self.registration.close()
            self.registration = None
        if self.registration is None:
            try:
                reg = Registration(self.election.client, self.ha, self.address, Lease)
            except EtcdError as e:
                log.warning("standby registration failed (%s); again", e)
                return
            self.store.forget()
            self.store.on_synced = reg.mark_synced
            self.registration = reg

    def ready(self, leader: LeaderInfo | None) -> bool:
        """Register (again); whether this standby may campaign now: it holds the leader's
        state under a registration still current, or no registered standby holds one."""
        from ddiloco.runtime.syncer.replica import standbys

        if leader is not None:
            self.store.note_epoch(leader.epoch)
        self._register()
        if leader is not None or self.registration is None:
            return False
        if self.store.synced:
            if self.registration.current():
                return True
            self.store.forget()
        try:
            others = standbys(self.election.client, self.ha.name)
        except EtcdError:
            return False
        return not any(synced for a, (_, synced) in others.items() if a != self.address)

    def close(self) -> bool:
        """End the registration (before leading: a leader is no standby); whether the
        copy held is whole, to resume from."""
        whole = bool(self.store.synced)
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        return whole
