"""The learner's link threads: one sender per syncer shard (pushes, encoded against the
installed base version for a ``delta`` codec, retried with backoff) and the receiver (long
polls for published versions and fetches the awaited fragments). They hand their results to
the training thread as typed events (``ddiloco.runtime.learner.inbox``).

``Links`` owns the send queues, what the receiver waits for (the fragments awaited and the
versions installed), the final pushes of ``close`` and the threads; ``DeltaBases`` the
delta codec's base versions, which the session's fetches fill too. A sharded island's rank
(``ctx.plan``) pushes and fetches only its own runs of each fragment."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import grpc
import torch

from ddiloco.algorithm.codecs import Codec
from ddiloco.algorithm.learner_state import Outgoing
from ddiloco.algorithm.payload import encode_push
from ddiloco.runtime.learner.client import RETRYABLE, TransportError, rpc_code, rpc_details
from ddiloco.runtime.learner.context import LearnerContext
from ddiloco.runtime.learner.inbox import Inbox, PushResult, Received
from ddiloco.runtime.learner.sharded import SendQueues, ShardedClient

__all__ = ["DeltaBases", "Links"]

log = logging.getLogger("ddiloco.learner")

_QUIET = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
"""Failures of the receiver's calls that are the syncer being away or restarted: retried
without a word (the heartbeat thread says when the syncer is unreachable)."""

Fetched = dict[int, tuple[int, list[torch.Tensor], int]]
"""p -> (version, the fragment's tensors, wire bytes)."""


class DeltaBases:
    """The last two received versions of each fragment: pushes of a ``delta`` codec are
    deltas against the version the learner installed (the newest), or, for a push queued
    before that install, the one before; a push whose base is gone is sent as parameters."""

    def __init__(self, codec: Codec, lock: threading.Lock) -> None:
        self.codec = codec
        self.lock = lock
        self.params: dict[int, dict[int, list[torch.Tensor]]] = {}

    def remember(self, p: int, version: int, tensors: list[torch.Tensor]) -> None:
        """Keep version ``version`` of p. The tensors are the fetch's own (never written):
        no copy is made."""
        if not self.codec.delta:
            return
        with self.lock:
            d = self.params.setdefault(p, {})
            d[version] = tensors
            for v in sorted(d)[:-2]:
                del d[v]

    def get(self, p: int, version: int) -> list[torch.Tensor] | None:
        if not self.codec.delta:
            return None
        with self.lock:
            return self.params.get(p, {}).get(version)


class Links:
    """The background threads that move pushes out and merged fragments in."""

    def __init__(
        self,
        ctx: LearnerContext,
        client: ShardedClient | None,
        inbox: Inbox,
        bases: DeltaBases,
    ) -> None:
        self.ctx = ctx
        self.client = client
        self.inbox = inbox
        self.bases = bases
        P = ctx.fragmentation.P  # noqa: N806
        self.sendq = SendQueues(1, lambda p: 0)
        """Pushes waiting to be sent: one queue and sender thread per syncer shard."""
        self.wanted: set[int] = set()
        """The fragments whose merged version the learner awaits."""
        self.base_versions: list[int] = [-1] * P
        """The version of each fragment installed."""
        self.latest_seq: dict[int, int] = {}
        self.final_seqs: set[int] = set()  # the pushes of close(): the learner is finishing
        self.final_fragments: list[int] = []
        self.threads: list[threading.Thread] = []
        self.thread_error: BaseException | None = None

    # -- the training thread's side -------------------------------------------------------
    def start(self, extra: Iterable[tuple[Callable[[], None], str]] = ()) -> None:
        """Start a sender per syncer shard, the receiver and the ``extra`` threads
        (target, name)."""
        client = self.client
        assert client is not None
        self.sendq = SendQueues(client.n_shards, client.shard_of)
        senders = [
            (lambda k=k: self._sender(k), f"ddiloco-send-{k}") for k in range(client.n_shards)
        ]
        for target, name in (*senders, (self._receiver, "ddiloco-recv"), *extra):
            th = threading.Thread(target=self._guarded, args=(target,), name=name, daemon=True)
            th.start()
            self.threads.append(th)

    def stop(self) -> None:
        """After ``ctx.closed`` is set: end the senders, wait for the threads."""
        self.sendq.stop()
        for th in self.threads:
            th.join(timeout=3.0)

    def sent(self, outs: list[Outgoing]) -> None:
        """Fragments the schedule sends at this step: their merged versions are awaited."""
        with self.ctx.lock:
            for o in outs:
                self.wanted.add(o.fragment)
                self.latest_seq[o.fragment] = o.seq

    def install_due(self) -> list[int]:
        """Install the merged fragments whose install step has come; returns them."""
        sync = self.ctx.sync
        installed = sync.install_due()
        with self.ctx.lock:
            for p in installed:
                self.base_versions[p] = sync.frags[p].base_version
            self.wanted = set(sync.waiting_fragments)
        self.ctx.stats.installs += len(installed)
        return installed

    def installed_global(self, versions: list[int]) -> None:
        """The global model at ``versions`` was installed: nothing is awaited."""
        with self.ctx.lock:
            self.base_versions = list(versions)
            self.wanted = set()

    def final_pushes(self) -> list[Outgoing]:
        """The pushes of ``close``: each fragment's steps since its last push (a fragment
        installed since has nothing left to contribute). The syncer's final rounds wait for
        these pushes only."""
        sync = self.ctx.sync
        finals = []
        for o in sync.flush():
            if o.c_steps < 1:  # installed since its last push: nothing left to contribute
                sync.on_push_result(o.fragment, o.seq, accepted=False)
                continue
            finals.append(o)
        with self.ctx.lock:
            self.final_fragments = sorted(o.fragment for o in finals)
            for o in finals:
                self.latest_seq[o.fragment] = o.seq
                self.final_seqs.add(o.seq)
        return finals

    # -- the threads ----------------------------------------------------------------------
    def _guarded(self, target) -> None:
        """Run a background thread; an unexpected error stops training at the next ``step``
        (a learner whose sender died would otherwise train on without contributing)."""
        try:
            target()
        except Exception as e:  # noqa: BLE001 - reported to the training thread
            log.exception(
                "[learner %d] background thread %s failed",
                self.ctx.learner,
                threading.current_thread().name,
            )
            self.thread_error = e

    def _wire_seq(self, o: Outgoing) -> int:
        return (self.ctx.incarnation << 32) + o.seq

    def _encode(self, o: Outgoing) -> tuple[bytes, bool]:
        codec, plan = self.ctx.codec, self.ctx.plan
        base = self.bases.get(o.fragment, o.base_version)
        if plan is None:
            return encode_push(codec, o.params, base)
        # a sharded island's rank: the runs it pushes (each a whole local tensor, flat)
        pieces = plan.pushes(o.fragment)
        runs = [o.params[pc.j].reshape(-1) for pc in pieces]
        bases = None if base is None else [base[pc.j].reshape(-1) for pc in pieces]
        return encode_push(codec, runs, bases)

    def _superseded(self, o: Outgoing) -> bool:
        """A newer push of this fragment carries its progress (a sharded island's ranks send
        every push: a part skipped by one alone would never complete at the syncer). Under
        ``ctx.lock``."""
        return self.ctx.plan is None and self.latest_seq.get(o.fragment, o.seq) > o.seq

    def _sender(self, k: int = 0) -> None:
        """Send the pushes of syncer shard k's fragments."""
        ctx, client, stats = self.ctx, self.client, self.ctx.stats
        assert client is not None
        while not ctx.closed.is_set():
            o = self.sendq.queues[k].get()
            if o is None:
                return
            if o.ready is not None:
                o.ready()  # the snapshot's device-to-host copy has landed
            with ctx.lock:
                if self._superseded(o):
                    ctx.sync.release(o.fragment, o.params)
                    continue
            data, delta = self._encode(o)
            ctx.sync.release(o.fragment, o.params)  # encoded: the snapshot buffer is free
            backoff = 0.1
            while not ctx.closed.is_set():
                ctx.joined.wait(timeout=1.0)
                if not ctx.joined.is_set():
                    continue
                header = {
                    "learner": ctx.learner,
                    "incarnation": ctx.incarnation,
                    "fragment": o.fragment,
                    "seq": self._wire_seq(o),
                    "base_version": o.base_version,
                    "c_steps": o.c_steps,
                    "c_tokens": o.c_tokens,
                    "codec": ctx.codec.name,
                    "delta": delta,
                    "numels": list(ctx.fragmentation.fragments[o.fragment].numels),
                    "nbytes": len(data),
                    "step": o.send_step,
                    "final": o.seq in self.final_seqs,
                    "final_fragments": (self.final_fragments if o.seq in self.final_seqs else []),
                }
                if ctx.plan is not None:
                    header["slices"] = [
                        [pc.j, pc.offset, pc.numel] for pc in ctx.plan.pushes(o.fragment)
                    ]
                boot = ctx.boot_id
                try:
                    d = ctx.link.delay_s(len(data))
                    if d > 0:
                        time.sleep(d)
                    r = client.push(header, data, timeout_s=30.0 + len(data) / 1e6)
                    if not isinstance(r.get("status"), str):
                        raise TransportError(
                            grpc.StatusCode.INTERNAL,
                            f"E_TRANSPORT: a push reply without status: {r}",
                        )
                    ok = r["status"] == "accepted"
                    stats.pushed(len(data), ok)
                    if ok:
                        self.inbox.accepted_by_boot[o.seq] = client.boot_part(boot, o.fragment)
                    elif r["status"] != "duplicate":
                        log.info(
                            "[learner %d step %d] push of fragment %d: %s %s",
                            ctx.learner,
                            o.send_step,
                            o.fragment,
                            r["status"],
                            r.get("message", ""),
                        )
                    if r["status"] != "duplicate":
                        self.inbox.put(
                            PushResult(o.fragment, o.seq, ok, r.get("target_version", -1))
                        )
                    elif (
                        ctx.plan is not None
                    ):  # a retried part: the island's verdict needs every part
                        self.inbox.put(PushResult(o.fragment, o.seq, True, -1))
                    break
                except grpc.RpcError as e:
                    code, msg = rpc_code(e), rpc_details(e)
                    if code == grpc.StatusCode.FAILED_PRECONDITION and (
                        "E_UNKNOWN_LEARNER" in msg or "E_SESSION" in msg
                    ):
                        if ctx.is_root:
                            ctx.joined.clear()  # the heartbeat thread rejoins
                            continue
                        # another rank: rank 0 rejoins, and hands on the new session at a
                        # step boundary
                        time.sleep(backoff)
                        backoff = min(backoff * 2, 2.0)
                        continue
                    if code in RETRYABLE:
                        stats.push_errors += 1
                        with ctx.lock:
                            if self._superseded(o):
                                break  # superseded while the syncer was away
                        time.sleep(backoff)
                        backoff = min(backoff * 2, 2.0)
                        continue
                    log.error(
                        "[learner %d step %d] push of fragment %d rejected: %s",
                        ctx.learner,
                        o.send_step,
                        o.fragment,
                        msg,
                    )
                    self.inbox.put(PushResult(o.fragment, o.seq, False, -1))
                    break

    def _receiver(self) -> None:
        ctx, client = self.ctx, self.client
        assert client is not None
        cursor: list[int] | None = None
        got = [-1] * ctx.fragmentation.P
        backoff = 0.1
        while not ctx.closed.is_set():
            if not ctx.joined.wait(timeout=0.5):
                continue
            try:
                r = client.unary(
                    "Watch",
                    {
                        "learner": ctx.learner,
                        "cursor": cursor,
                        "merged_seq": self.inbox.merged(),
                        "timeout_s": ctx.watch_s,
                    },
                    timeout_s=5.0 + ctx.watch_s,
                )
                versions = r.get("versions")
                if not isinstance(versions, list) or len(versions) != len(got):
                    raise TransportError(
                        grpc.StatusCode.INTERNAL,
                        f"E_TRANSPORT: a Watch reply without the {len(got)} fragments' versions",
                    )
                with ctx.lock:
                    self.inbox.merged_seq = {int(k): v for k, v in r.get("merged_seq", {}).items()}
                    need = [
                        p
                        for p in self.wanted
                        if versions[p] > max(got[p], self.base_versions[p])
                        and (ctx.plan is None or ctx.plan.own(p))
                    ]
                if need:
                    t0 = time.monotonic()
                    if ctx.plan is None:
                        res = client.fetch(sorted(need), learner=ctx.learner)
                    else:  # this rank's runs, shaped as its local tensors
                        res = self.fetch_runs(sorted(need))
                    nbytes = sum(v[2] for v in res.values())
                    d = ctx.link.delay_s(nbytes)
                    if d > 0:
                        time.sleep(d)
                    ctx.stats.fetched(nbytes, time.monotonic() - t0)
                    for p, (v, ts, _) in res.items():
                        got[p] = max(got[p], v)
                        shaped = [
                            t.view(ctx.params[n].shape)
                            for t, n in zip(ts, ctx.fragmentation.fragments[p].names)
                        ]
                        self.bases.remember(p, v, shaped)
                        staged, ready = ctx.copier.stage(shaped)  # to the device, async
                        self.inbox.put(Received(p, v, staged, ready))
                    # the inbox holds them now; kept here they would outlive their install
                    res = ts = shaped = staged = None  # type: ignore[assignment]
                cursor = versions
                backoff = 0.1
            except grpc.RpcError as e:
                if ctx.closed.is_set():
                    return
                if rpc_code(e) not in _QUIET:  # a reply that could not be read, say
                    log.warning(
                        "[learner %d step %d] watch or fetch failed (%s: %s); retrying",
                        ctx.learner,
                        ctx.sync.step,
                        rpc_code(e).name,
                        rpc_details(e),
                    )
                if rpc_code(e) == grpc.StatusCode.FAILED_PRECONDITION and ctx.is_root:
                    ctx.joined.clear()
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                cursor = None

    # -- a sharded island's runs ----------------------------------------------------------
    def fetch_runs(self, fragments: list[int], timeout_s: float = 60.0) -> Fetched:
        """This rank's runs of ``fragments`` (those it holds some of): p -> (version, one
        tensor per fragment tensor shaped as the local tensor, wire bytes)."""
        plan, client = self.ctx.plan, self.client
        assert plan is not None and client is not None
        mine = [p for p in fragments if plan.own(p)]
        if not mine:
            return {}
        slices = [[p, pc.j, pc.offset, pc.numel] for p in mine for pc in plan.own(p)]
        got = client.fetch(mine, timeout_s=timeout_s, learner=self.ctx.learner, slices=slices)
        return {p: (v, self.local_tensors(p, ts), nb) for p, (v, ts, nb) in got.items()}

    def local_tensors(self, p: int, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fetched runs of fragment p as its tensors' local shapes (an empty tensor where
        this rank holds none of one)."""
        plan, params = self.ctx.plan, self.ctx.params
        assert plan is not None
        f = self.ctx.fragmentation.fragments[p]
        out = [torch.empty(params[n].shape) for n in f.names]
        for pc, t in zip(plan.own(p), flat):
            out[pc.j] = t.view(params[f.names[pc.j]].shape)
        return out
