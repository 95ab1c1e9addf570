"""A learner's connection to a replicated syncer: it follows the leader and refuses the
replies of a deposed one (``ddiloco.runtime.syncer.ha``).

``--syncer`` names the syncers of a replicated run in one of two forms:

- ``HOST:PORT,HOST:PORT,...``: every syncer's address; the leader is the one whose
  Status says it leads (the largest epoch, if two do);
- ``etcd://HOST:PORT/RUN``: the etcd the syncers campaign in; the leader is the address in
  the run's key.

``FollowingClient`` is a ``SyncerClient`` that talks to one syncer at a time. When a call
fails as unreachable, times out, or is answered ``E_NOT_LEADER`` (a standby, which names
the leader, or a leader whose lease lapsed), it finds the leader (``LeaderFinder``, at most
every ``FIND_EVERY_S``) and moves its channels there; the call's error goes back to its
caller as it is, a retryable one, and the learner's threads retry as they do against a
restarted syncer: the heartbeat meets a new boot id and rejoins (a new session, its
pending pushes counted dropped and pushed again). The training thread makes none of these
calls, so a failover never stops the inner loop.

Every reply of a replicated syncer carries its epoch. The client keeps the newest epoch
it has heard and refuses a reply of an older one with ``E_STALE_EPOCH`` (UNAVAILABLE, so
retried, and the leader is looked up again): nothing from a deposed leader is installed
once a newer leader has been heard. The check is on arrival; a fetch that arrived before
the newer epoch was first heard may still be installed (it was sent while its leader's
lease was valid, so the new leader resumed from a checkpoint holding it).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from ddiloco.runtime.learner.client import SyncerClient, TransportError, rpc_code, rpc_details
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.auth import channel_credentials
from ddiloco.runtime.transport.etcd import EtcdClient, EtcdError, leader_key, parse_endpoint

__all__ = ["FIND_EVERY_S", "LeaderFinder", "FollowingClient", "StaleEpochError", "connect"]

log = logging.getLogger("ddiloco.learner")

FIND_EVERY_S = 0.5
"""The leader is looked up at most this often (every failing thread asks)."""
NO_LEADER = "127.0.0.1:1"
"""Where a client points before any leader is known: calls fail at once, and look again."""
_HINT = re.compile(r"the leader is (\S+) \(epoch (\d+)\)")

T = TypeVar("T")


def is_replicated(address: str) -> bool:
    """Whether ``--syncer`` names a replicated syncer (a list, or an etcd endpoint)."""
    return "," in address or address.startswith("etcd://")


class StaleEpochError(TransportError):
    """A reply from a leader older than the newest one heard: refused (UNAVAILABLE, so the
    learner's threads retry it as any transport failure)."""

    def __init__(self, address: str, epoch: int, newest: int) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            f"{wire.ErrorCode.STALE_EPOCH}: reply of epoch {epoch} from {address}; a newer "
            f"leader (epoch {newest}) has been heard: refused",
        )


class LeaderFinder:
    """Where the leader of a replicated syncer is (``find``)."""

    def __init__(
        self,
        target: str,
        token: str,
        tls_ca: str | None = None,
        tls: bool = False,
        probe_timeout_s: float = 1.0,
    ) -> None:
        self.target = target
        self._md = ((wire.TOKEN_METADATA, token),)
        self._tls, self._tls_ca = bool(tls or tls_ca), tls_ca
        self.probe_timeout_s = probe_timeout_s
        self.etcd: EtcdClient | None = None
        self.key = ""
        self.addresses: list[str] = []
        if target.startswith("etcd://"):
            endpoint, _, name = target[len("etcd://") :].partition("/")
            if not name:
                raise ValueError(f"an etcd syncer address is etcd://HOST:PORT/RUN, got {target!r}")
            self.etcd = EtcdClient(parse_endpoint(f"etcd://{endpoint}"), timeout_s=probe_timeout_s)
            self.key = leader_key(name)
        else:
            self.addresses = [a.strip() for a in target.split(",") if a.strip()]
            if not self.addresses:
                raise ValueError(f"no syncer address in {target!r}")

    def find(self) -> tuple[str, int] | None:
        """(the leader's address, its epoch), or None if none is known now."""
        if self.etcd is not None:
            try:
                kv = self.etcd.get(self.key)
            except EtcdError as e:
                log.warning("leader lookup: %s", e)
                return None
            if kv is None:
                return None
            try:
                return str(json.loads(kv.value)["address"]), kv.create_revision
            except (ValueError, KeyError, TypeError):
                return None
        best: tuple[str, int] | None = None
        for a in self.addresses:
            ha = self._probe(a)
            if ha and ha.get("role") == "leader" and isinstance(ha.get("epoch"), int):
                if best is None or ha["epoch"] > best[1]:
                    best = (a, ha["epoch"])
        return best

    def _probe(self, address: str) -> dict | None:
        """The ``ha`` part of ``address``'s Status, or None."""
        opts = wire.GRPC_OPTIONS
        ch = (
            grpc.secure_channel(address, channel_credentials(self._tls_ca), opts)
            if self._tls
            else grpc.insecure_channel(address, opts)
        )
        try:
            resp = ch.unary_unary(wire.method("Status"))(
                wire.pack({}), timeout=self.probe_timeout_s, metadata=self._md
            )
            ha = wire.unpack(resp)[0].get("ha")
            return ha if isinstance(ha, dict) else None
        except (grpc.RpcError, ValueError):
            return None
        finally:
            ch.close()

    def first(self) -> str:
        """An address to start with: the first one listed (or etcd's leader, if known)."""
        if self.addresses:
            return self.addresses[0]
        got = self.find()
        return got[0] if got else NO_LEADER


class FollowingClient(SyncerClient):
    """A ``SyncerClient`` that follows the leader of a replicated syncer (module doc)."""

    def __init__(self, target: str, token: str, tls_ca: str | None = None, tls: bool = False):
        self.finder = LeaderFinder(target, token, tls_ca, tls)
        self.target = target
        self.epoch = 0
        """The newest epoch heard."""
        self.failovers = 0
        """Times this client moved to another syncer."""
        self._find_lock = threading.Lock()
        self._next_find_s = 0.0
        super().__init__(self.finder.first(), token, tls_ca, tls)

    # -- the epoch --------------------------------------------------------------------------
    def _check(self, header: dict) -> None:
        e = header.get("epoch")
        e = int(e) if isinstance(e, int) else 0
        if e < self.epoch:
            err = StaleEpochError(self.address, e, self.epoch)
            log.warning("%s", err.details())
            self._follow(None)
            raise err
        if e > self.epoch:
            if self.epoch:
                log.info("syncer %s leads as epoch %d (was %d)", self.address, e, self.epoch)
            self.epoch = e

    def _checked(self, frames: Iterator[bytes]) -> Iterator[bytes]:
        try:
            for frame in frames:
                h = wire.unpack(frame)[0]
                if "cont" not in h:
                    self._check(h)
                yield frame
        except grpc.RpcError as e:
            self._failed(e)
            raise

    # -- SyncerClient's two ways out --------------------------------------------------------
    def _invoke(self, control: bool, call: Callable[[grpc.Channel], T]) -> T:
        try:
            out = super()._invoke(control, call)
        except grpc.RpcError as e:
            self._failed(e)
            raise
        if isinstance(out, (bytes, bytearray)):
            self._check(wire.unpack(bytes(out))[0])
            return out
        return self._checked(out)  # type: ignore[arg-type,return-value]

    def _data_request(
        self, header: dict, payload: list, timeout_s: float, fetch: bool = False
    ) -> tuple[dict, memoryview] | None:
        try:
            r = super()._data_request(header, payload, timeout_s, fetch)
        except grpc.RpcError as e:
            self._failed(e)
            raise
        if r is not None:
            self._check(r[0])
        return r

    # -- following ---------------------------------------------------------------------------
    def _failed(self, e: grpc.RpcError) -> None:
        code, msg = rpc_code(e), rpc_details(e)
        if wire.ErrorCode.NOT_LEADER in msg:
            m = _HINT.search(msg)
            self._follow((m.group(1), int(m.group(2))) if m else None)
        elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._follow(None)

    def _follow(self, hint: tuple[str, int] | None) -> None:
        """Move to the leader: ``hint`` (a standby's word) when newer than what was heard,
        else the finder's answer."""
        now = time.monotonic()
        if hint is None or hint[1] < self.epoch:
            if not self._find_lock.acquire(blocking=False):
                return  # another thread is looking
            try:
                if now < self._next_find_s:
                    return
                self._next_find_s = now + FIND_EVERY_S
                hint = self.finder.find()
            finally:
                self._find_lock.release()
        if hint is not None and hint[1] >= self.epoch and hint[0] != self.address:
            self.retarget(hint[0])

    def retarget(self, address: str) -> None:
        """Talk to ``address`` from now on: new channels (calls in flight on the old ones
        fail and are retried), the data port learned again from the next Join."""
        with self._channel_lock:
            if self._closed or address == self.address:
                return
            old = (self.bulk, self.control)
            log.warning("following the syncer leader: %s -> %s", self.address, address)
            self.address = address
            self.bulk = self._channel("bulk")
            self.control = self._channel("control")
            self.failovers += 1
        self.use_data_port(None)
        for ch in old:
            ch.close()


def connect(address: str, token: str, tls_ca: str | None = None, tls: bool = False) -> Any:
    """The client for ``--syncer``: a ``FollowingClient`` for a replicated syncer (a list
    of addresses or ``etcd://``), else a ``SyncerClient``."""
    if is_replicated(address):
        return FollowingClient(address, token, tls_ca, tls)
    return SyncerClient(address, token, tls_ca, tls)
