"""The learner's view of a sharded syncer: one client that routes each fragment to its shard.

``ShardedClient`` has the calls ``DecoupledLearner`` makes on a ``SyncerClient``. Against a
single syncer it is that client. When a Join reply carries a shard map
(``ddiloco.runtime.transport.shards``), it opens a client per shard and from then on:

- **Join** joins every shard, shard 0 first (it hands out learner ids; the others take the
  id it gave). The reply is one: shard 0's incarnation, each fragment's version and merged
  push from its owner, and a boot id made of every shard's (so a restarted shard reads as
  a restarted syncer and the learner rejoins). Each shard keeps its own incarnation of the
  learner; the client puts the right one in every call.
- **Push** and **Fetch** go to each fragment's owner. **Heartbeat** and **Leave** go to
  every shard at once; a shard that does not answer is left out as long as another does.
- **Watch** long-polls every shard at once and answers as soon as one reports news; the
  others keep what they last said. A shard that is down delays none of the others.
- **Init** uploads the initial model to every shard (each initialises once).

``SendQueues`` gives the learner one push queue (and sender thread) per shard, so a push
retrying against a dead shard holds up no other shard's fragments.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue

import grpc

from ddiloco.runtime.learner.client import ChannelClosedError, SyncerClient, SyncerError, rpc_code
from ddiloco.runtime.learner.leader import connect
from ddiloco.runtime.transport.shards import ShardMap, aggregate_status

__all__ = ["ShardedClient", "SendQueues"]


class ShardedClient:
    """``SyncerClient``'s calls over one syncer or a sharded one (see the module doc)."""

    def __init__(
        self,
        address: str,
        token: str,
        tls_ca: str | None = None,
        tls: bool = False,
        shards: tuple[str, ...] = (),
    ) -> None:
        self.address = address
        self._args = (token, tls_ca, tls)
        self.primary = connect(address, token, tls_ca, tls)  # follows a replicated syncer
        self.map: ShardMap | None = None
        self.clients: list[SyncerClient] = [self.primary]
        self._inc: dict[int, int] = {}
        self._boots: list[str] = []
        self._versions: list[list[int] | None] = []
        self._merged: list[dict] = []
        self._partial: dict[int, dict] = {}
        self._pool: cf.ThreadPoolExecutor | None = None
        if len(shards) > 1:
            self._use_map(
                ShardMap(tuple(shards)), shards.index(address) if address in shards else None
            )

    # -- the map ----------------------------------------------------------------------------
    @property
    def n_shards(self) -> int:
        return self.map.S if self.map else 1

    def shard_of(self, p: int) -> int:
        return self.map.owner(p) if self.map else 0

    def boot_part(self, boot_id: str, p: int) -> str:
        """The part of a (combined) boot id that belongs to fragment p's shard."""
        if not self.map:
            return boot_id
        parts = boot_id.split("+")
        return parts[self.shard_of(p)] if len(parts) == self.map.S else boot_id

    def _use_map(self, smap: ShardMap, primary_index: int | None) -> None:
        if self.map is not None:
            if smap != self.map:  # reported: the learner cannot follow its fragments
                raise SyncerError(
                    f"shard map changed: {self.map.addresses} -> {smap.addresses} (restart "
                    f"the learners with the syncers' new addresses)"
                )
            return
        self.map = smap
        token, tls_ca, tls = self._args
        self.clients = [
            self.primary if k == primary_index else SyncerClient(a, token, tls_ca, tls)
            for k, a in enumerate(smap.addresses)
        ]
        if primary_index is None:  # the address we were given is not in the map
            self.primary.close()
            self.primary = self.clients[0]
        self._boots = [""] * smap.S
        self._versions = [None] * smap.S
        self._merged = [{} for _ in range(smap.S)]
        self._pool = cf.ThreadPoolExecutor(
            max_workers=2 * smap.S, thread_name_prefix="ddiloco-shard"
        )

    def close(self) -> None:
        for c in self.clients:
            c.close()
        if self.primary not in self.clients:
            self.primary.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, fn, *args) -> cf.Future:
        """``fn(*args)`` on the shards' pool; a call after ``close`` (the pool shut down
        under a learner thread) fails as the closed client it is (``ChannelClosedError``)."""
        assert self._pool is not None
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError:
            raise ChannelClosedError(self.address, client_closed=True) from None

    # -- calls ------------------------------------------------------------------------------
    def unary(
        self, name: str, header: dict, timeout_s: float = 10.0, control: bool = False
    ) -> dict:
        if self.map is None:
            r = self.primary.unary(name, header, timeout_s, control)
            smap = ShardMap.from_reply(r.get("shards")) if name == "Join" else None
            if smap is None:
                return r
            self._use_map(smap, int(r["shards"]["index"]))
            if r.get("need_init"):
                return r
            return self._join(header, timeout_s, first=(int(r["shards"]["index"]), r))
        if name == "Join":
            return self._join(header, timeout_s)
        if name == "Watch":
            return self._watch(header, timeout_s)
        if name in ("Heartbeat", "Leave"):
            return self._each(name, header, timeout_s, control)
        if name == "Status":
            return self.status(timeout_s)
        return self.primary.unary(name, header, timeout_s, control)

    def _hdr(self, k: int, header: dict) -> dict:
        """``header`` with shard k's own incarnation of this learner."""
        if (
            "incarnation" in header
            and header["incarnation"] >= 0
            and k in self._inc
            and self._inc[k] != header["incarnation"]
        ):
            h = {**header, "incarnation": self._inc[k]}
            if "seq" in h:  # a push's seq is (incarnation << 32) + n, in the shard's terms
                h["seq"] = (self._inc[k] << 32) + (h["seq"] & 0xFFFFFFFF)
            return h
        return header

    def _join(self, header: dict, timeout_s: float, first: tuple[int, dict] | None = None) -> dict:
        S = self.map.S  # noqa: N806
        # shards this process already joined when another asked for the initial model: they
        # stay joined, so the id shard 0 gave is kept, not given up for a new one
        replies: dict[int, dict] = dict(self._partial)
        self._partial = {}
        if first is not None and not first[1].get("redirect"):
            replies[first[0]] = first[1]
        learner = header.get("learner")
        if 0 in replies and "learner" in replies[0]:
            learner = replies[0]["learner"]
        if first is not None and "learner" in first[1]:
            learner = first[1]["learner"]
        for k in [0] + [k for k in range(1, S)]:
            if k in replies:
                continue
            h = {**self._hdr(k, header), "learner": -1 if learner is None else learner}
            if k not in self._inc:
                h["incarnation"] = -1
            try:
                r = self.clients[k].unary("Join", h, timeout_s, control=True)
            except grpc.RpcError as e:
                if (
                    k == 0
                    or k not in self._inc
                    or rpc_code(e) == grpc.StatusCode.FAILED_PRECONDITION
                ):
                    raise
                continue  # a shard that is down: joined again when it is back (new boot id)
            if r.get("need_init"):
                self._partial = replies
                return r  # the learner uploads its model to every shard, then joins again
            if r.get("redirect"):
                raise SyncerError(
                    f"shard {k} of {self.map.addresses} redirected an id-less "
                    f"join: shard 0 must answer first"
                )
            replies[k] = r
            learner = r["learner"]
        for k, r in replies.items():
            self._inc[k] = int(r["incarnation"])
            self._boots[k] = r["boot_id"]
            self._versions[k] = list(r["versions"])
            self._merged[k] = dict(r.get("merged_seq") or {})
        out = dict(replies[0])
        out.update(
            boot_id="+".join(self._boots),
            versions=self._combined_versions(),
            merged_seq=self._combined_merged(),
            stop=any(r.get("stop") for r in replies.values()),
        )
        return out

    def _combined_versions(self) -> list[int]:
        P = max(len(v) for v in self._versions if v is not None)  # noqa: N806
        return [(self._versions[p % self.map.S] or [0] * P)[p] for p in range(P)]

    def _combined_merged(self) -> dict:
        S = self.map.S  # noqa: N806
        return {p: s for k in range(S) for p, s in self._merged[k].items() if int(p) % S == k}

    def _each(self, name: str, header: dict, timeout_s: float, control: bool) -> dict:
        """``name`` on every shard at once: shard 0's reply with the boot id, stop flag and
        rejoin request of all that answered. Raises only when none answered."""
        futs = {
            k: self._submit(c.unary, name, self._hdr(k, header), timeout_s, control)
            for k, c in enumerate(self.clients)
        }
        replies, errors = {}, {}
        for k, f in futs.items():
            try:
                replies[k] = f.result()
            except grpc.RpcError as e:
                errors[k] = e
        if not replies:
            raise next(iter(errors.values()))
        for k, r in replies.items():
            if r.get("boot_id"):
                self._boots[k] = r["boot_id"]
        out = dict(replies.get(0) or next(iter(replies.values())))
        if 0 not in replies:
            # the run's slot clock is shard 0's: another shard's (its own epoch) would make
            # the learner restart its slot count while shard 0 is down, and again on its return
            out.pop("clock", None)
        out["boot_id"] = "+".join(self._boots)
        out["stop"] = any(r.get("stop") for r in replies.values())
        out["rejoin"] = any(r.get("rejoin") for r in replies.values())
        return out

    def _watch(self, header: dict, timeout_s: float) -> dict:
        fresh = header.get("cursor") is None
        futs = {}
        for k, c in enumerate(self.clients):
            h = {
                **header,
                "cursor": None if fresh else self._versions[k],
                "merged_seq": {} if fresh else self._merged[k],
            }
            futs[self._submit(c.unary, "Watch", h, timeout_s)] = k
        got, errors = 0, []
        pending = set(futs)
        while pending and not got:  # until one shard answers (a dead one answers at once)
            done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for f in done:
                k = futs[f]
                try:
                    r = f.result()
                except grpc.RpcError as e:
                    if rpc_code(e) == grpc.StatusCode.FAILED_PRECONDITION:
                        raise  # not joined there: the learner joins again
                    errors.append(e)
                    continue
                got += 1
                self._versions[k] = list(r["versions"])
                self._merged[k] = dict(r.get("merged_seq") or {})
                self._boots[k] = r.get("boot_id", self._boots[k])
        for f in pending:
            f.cancel()
        if not got:
            raise errors[0]
        return {
            "versions": self._combined_versions(),
            "merged_seq": self._combined_merged(),
            "boot_id": "+".join(self._boots),
        }

    def stream(self, name: str, frames, timeout_s: float = 60.0) -> dict:
        if self.map is None or name != "Init":
            return self.primary.stream(name, frames, timeout_s)
        frames = list(frames)
        replies = [c.stream(name, iter(frames), timeout_s) for c in self.clients]
        return {**replies[0], "accepted": any(r.get("accepted") for r in replies)}

    def push(self, header: dict, data, timeout_s: float = 60.0) -> dict:
        k = self.shard_of(header["fragment"])
        return self.clients[k].push(self._hdr(k, header), data, timeout_s)

    def fetch(
        self,
        fragments: list[int] | None,
        timeout_s: float = 60.0,
        learner: int | None = None,
        exact: bool = False,
        slices: list[list[int]] | None = None,
    ) -> dict:
        """Published fragments, each from its owner. ``None``: every fragment (every shard
        must answer); a list: those the reachable shards hold (a dead shard's are left
        out, to be asked again). ``slices``: ``SyncerClient.fetch``'s, each run asked of
        its fragment's owner."""
        if self.map is None:
            return self.primary.fetch(fragments, timeout_s, learner, exact, slices)
        by_shard: dict[int, list[int] | None] = {}
        if fragments is None:
            by_shard = {k: None for k in range(self.map.S)}
        else:
            for p in fragments:
                by_shard.setdefault(self.shard_of(p), []).append(p)
        runs: dict[int, list[list[int]]] = {}
        for r in slices or ():
            runs.setdefault(self.shard_of(r[0]), []).append(r)
        futs = {
            k: self._submit(
                self.clients[k].fetch,
                want,
                timeout_s,
                learner,
                exact,
                None if slices is None else runs.get(k, []),
            )
            for k, want in by_shard.items()
        }
        out, errors = {}, []
        for _k, f in futs.items():
            try:
                out.update(f.result())
            except grpc.RpcError as e:
                errors.append(e)
        if errors and (fragments is None or not out):
            raise errors[0]
        return out

    def credentials(self) -> dict:
        """What another rank of this learner's island needs to push and fetch as it: the
        shard map, and each shard's session, incarnation and data port."""
        return {
            "map": None if self.map is None else list(self.map.addresses),
            "clients": [c.credentials() for c in self.clients],
            "inc": {str(k): v for k, v in self._inc.items()},
        }

    def adopt(self, creds: dict) -> None:
        """Act as the learner whose root rank's client gave ``credentials()``."""
        if creds["map"] and self.map is None:
            addresses = tuple(creds["map"])
            idx = addresses.index(self.address) if self.address in addresses else None
            self._use_map(ShardMap(addresses), idx)
        for c, cred in zip(self.clients, creds["clients"]):
            c.adopt(cred)
        self._inc = {int(k): int(v) for k, v in creds["inc"].items()}

    def status(self, timeout_s: float = 5.0) -> dict:
        """The syncer's Status; over every shard (``aggregate_status``) when sharded. A
        client built without the map learns it from the first shard's answer."""
        if self.map is None:
            st = self.primary.status(timeout_s)
            smap = ShardMap.from_reply(st.get("shard_map"))
            if smap is None:
                return st
            self._use_map(smap, int(st["shard_map"]["index"]))
        parts: list[dict | None] = []
        for c in self.clients:
            try:
                parts.append(c.status(timeout_s))
            except grpc.RpcError:
                parts.append(None)
        return aggregate_status(parts)


class SendQueues:
    """One push queue per shard (``put`` routes by fragment); ``None`` stops a sender."""

    def __init__(self, n: int, shard_of) -> None:
        self.queues = [queue.Queue() for _ in range(max(1, n))]
        self._shard_of = shard_of

    def put(self, o) -> None:
        self.queues[self._shard_of(o.fragment) if len(self.queues) > 1 else 0].put(o)

    def stop(self) -> None:
        for q in self.queues:
            q.put(None)

    def empty(self) -> bool:
        return all(q.empty() for q in self.queues)
