"""The learner's link threads: one sender per syncer shard (pushes, encoded against the
installed base version for a ``delta`` codec, retried with backoff) and the receiver (long
polls for published versions and fetches the awaited fragments). They hand their results to
the training thread as typed events (``ddiloco.runtime.learner.events``). A mixin of
``DecoupledLearner``: the state it uses is set in ``DecoupledLearner.__init__``."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import torch

from ddiloco.algorithm.learner_state import Outgoing
from ddiloco.algorithm.payload import encode_push
from ddiloco.runtime.learner.client import RETRYABLE, rpc_code, rpc_details
from ddiloco.runtime.learner.events import PushResult, Received

__all__ = ["LinksMixin"]

log = logging.getLogger("ddiloco.learner")


class LinksMixin:
    """The background threads that move pushes out and merged fragments in."""

    def _guarded(self, target) -> None:
        """Run a background thread; an unexpected error stops training at the next ``step``
        (a learner whose sender died would otherwise train on without contributing)."""
        try:
            target()
        except Exception as e:  # noqa: BLE001 - reported to the training thread
            log.exception(
                "[learner %d] background thread %s failed",
                self.learner,
                threading.current_thread().name,
            )
            self._thread_error = e

    def _wire_seq(self, o: Outgoing) -> int:
        return (self.incarnation << 32) + o.seq

    def _remember_base(self, p: int, version: int, tensors: list[torch.Tensor]) -> None:
        """Keep the last two received versions of p: pushes of a ``delta`` codec are deltas
        against the version the learner installed (the newest), or, for a push queued
        before that install, the one before; a push whose base is gone is sent as
        parameters. The tensors are the fetch's own (never written): no copy is made."""
        if not self.codec.delta:
            return
        with self._lock:
            d = self._base_params.setdefault(p, {})
            d[version] = tensors
            for v in sorted(d)[:-2]:
                del d[v]

    def _encode(self, o: Outgoing) -> tuple[bytes, bool]:
        base = None
        if self.codec.delta:
            with self._lock:
                base = self._base_params.get(o.fragment, {}).get(o.base_version)
        plan = getattr(self, "plan", None)
        if plan is None:
            return encode_push(self.codec, o.params, base)
        # a sharded island's rank: the runs it pushes (each a whole local tensor, flat)
        pieces = plan.pushes(o.fragment)
        runs = [o.params[pc.j].reshape(-1) for pc in pieces]
        bases = None if base is None else [base[pc.j].reshape(-1) for pc in pieces]
        return encode_push(self.codec, runs, bases)

    def _sender(self, k: int = 0) -> None:
        """Send the pushes of syncer shard k's fragments."""
        while not self._closed.is_set():
            o = self._sendq.queues[k].get()
            if o is None:
                return
            if o.ready is not None:
                o.ready()  # the snapshot's device-to-host copy has landed
            with self._lock:
                # superseded: a newer push of this fragment carries its progress (a sharded
                # island's ranks send every push: a part skipped by one alone would never
                # complete at the syncer)
                if not self.sharded and self._latest_seq.get(o.fragment, o.seq) > o.seq:
                    self.sync.release(o.fragment, o.params)
                    continue
            data, delta = self._encode(o)
            self.sync.release(o.fragment, o.params)  # encoded: the snapshot buffer is free
            backoff = 0.1
            while not self._closed.is_set():
                self._joined.wait(timeout=1.0)
                if not self._joined.is_set():
                    continue
                header = {
                    "learner": self.learner,
                    "incarnation": self.incarnation,
                    "fragment": o.fragment,
                    "seq": self._wire_seq(o),
                    "base_version": o.base_version,
                    "c_steps": o.c_steps,
                    "c_tokens": o.c_tokens,
                    "codec": self.codec.name,
                    "delta": delta,
                    "numels": list(self.fragmentation.fragments[o.fragment].numels),
                    "nbytes": len(data),
                    "step": o.send_step,
                    "final": o.seq in self._final_seqs,
                    "final_fragments": (self._final_fragments if o.seq in self._final_seqs else []),
                }
                if self.plan is not None:
                    header["slices"] = [
                        [pc.j, pc.offset, pc.numel] for pc in self.plan.pushes(o.fragment)
                    ]
                boot = self.boot_id
                try:
                    d = self.link.delay_s(len(data))
                    if d > 0:
                        time.sleep(d)
                    r = self.client.push(header, data, timeout_s=30.0 + len(data) / 1e6)
                    ok = r["status"] == "accepted"
                    self.stats.pushed(len(data), ok)
                    if ok:
                        self._accepted_by_boot[o.seq] = self.client.boot_part(boot, o.fragment)
                    elif r["status"] != "duplicate":
                        log.info(
                            "[learner %d step %d] push of fragment %d: %s %s",
                            self.learner,
                            o.send_step,
                            o.fragment,
                            r["status"],
                            r.get("message", ""),
                        )
                    if r["status"] != "duplicate":
                        self._inbox.put(
                            PushResult(o.fragment, o.seq, ok, r.get("target_version", -1))
                        )
                    elif self.sharded:  # a retried part: the island's verdict needs every part
                        self._inbox.put(PushResult(o.fragment, o.seq, True, -1))
                    break
                except grpc.RpcError as e:
                    code, msg = rpc_code(e), rpc_details(e)
                    if code == grpc.StatusCode.FAILED_PRECONDITION and (
                        "E_UNKNOWN_LEARNER" in msg or "E_SESSION" in msg
                    ):
                        if self._is_root:
                            self._joined.clear()  # the heartbeat thread rejoins
                            continue
                        # another rank: rank 0 rejoins, and hands on the new session at a
                        # step boundary
                        time.sleep(backoff)
                        backoff = min(backoff * 2, 2.0)
                        continue
                    if code in RETRYABLE:
                        self.stats.push_errors += 1
                        with self._lock:
                            if not self.sharded and self._latest_seq.get(o.fragment, o.seq) > o.seq:
                                break  # superseded while the syncer was away
                        time.sleep(backoff)
                        backoff = min(backoff * 2, 2.0)
                        continue
                    log.error(
                        "[learner %d step %d] push of fragment %d rejected: %s",
                        self.learner,
                        o.send_step,
                        o.fragment,
                        msg,
                    )
                    self._inbox.put(PushResult(o.fragment, o.seq, False, -1))
                    break

    def _receiver(self) -> None:
        cursor: list[int] | None = None
        got = [-1] * self.fragmentation.P
        backoff = 0.1
        while not self._closed.is_set():
            if not self._joined.wait(timeout=0.5):
                continue
            try:
                with self._lock:
                    ms = dict(self._merged_seq)
                r = self.client.unary(
                    "Watch",
                    {
                        "learner": self.learner,
                        "cursor": cursor,
                        "merged_seq": ms,
                        "timeout_s": self.watch_s,
                    },
                    timeout_s=5.0 + self.watch_s,
                )
                versions = r["versions"]
                with self._lock:
                    self._merged_seq = {int(k): v for k, v in r.get("merged_seq", {}).items()}
                    need = [
                        p
                        for p in self._wanted
                        if versions[p] > max(got[p], self._base_versions[p])
                        and (self.plan is None or self.plan.own(p))
                    ]
                if need:
                    t0 = time.monotonic()
                    if self.plan is None:
                        res = self.client.fetch(sorted(need), learner=self.learner)
                    else:  # this rank's runs, shaped as its local tensors
                        res = self._fetch_runs(sorted(need))
                    nbytes = sum(v[2] for v in res.values())
                    d = self.link.delay_s(nbytes)
                    if d > 0:
                        time.sleep(d)
                    self.stats.fetched(nbytes, time.monotonic() - t0)
                    for p, (v, ts, _) in res.items():
                        got[p] = max(got[p], v)
                        shaped = [
                            t.view(self.params[n].shape)
                            for t, n in zip(ts, self.fragmentation.fragments[p].names)
                        ]
                        self._remember_base(p, v, shaped)
                        staged, ready = self.copier.stage(shaped)  # to the device, async
                        self._inbox.put(Received(p, v, staged, ready))
                    # the inbox holds them now; kept here they would outlive their install
                    res = ts = shaped = staged = None  # type: ignore[assignment]
                cursor = versions
                backoff = 0.1
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if rpc_code(e) == grpc.StatusCode.FAILED_PRECONDITION and self._is_root:
                    self._joined.clear()
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                cursor = None
