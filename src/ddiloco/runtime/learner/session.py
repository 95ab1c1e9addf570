"""The learner's session with the syncer: Join (initialising a syncer that has no model
yet), the fetch of the whole global model, the heartbeat thread, and the rejoin after a
syncer restart or after being declared dead. ``Session`` keeps what the syncer said of the
session (step budget, earlier steps of this learner id, the slot clock announced at Join)
and writes the ids it assigns into the context; the heartbeat thread is rank 0's."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import grpc
import torch

from ddiloco.runtime.learner.client import (
    RETRYABLE,
    SyncerError,
    TransportError,
    rpc_code,
    rpc_details,
)
from ddiloco.runtime.learner.context import LearnerContext
from ddiloco.runtime.learner.inbox import ClockHeard, Inbox, SyncerRestarted
from ddiloco.runtime.learner.links import DeltaBases
from ddiloco.runtime.learner.sharded import ShardedClient
from ddiloco.runtime.transport import wire

__all__ = ["DUPLICATE_WAIT_S", "Session"]

log = logging.getLogger("ddiloco.learner")

DUPLICATE_WAIT_S = 15.0
"""How long a learner whose id is live in another process keeps asking before it gives up
(longer than the syncer's heartbeat timeout, so a killed predecessor is declared dead)."""


class Session:
    """Join, fetch the global model, heartbeat, rejoin (a sharded island's rank 0, or the
    one process that talks to the syncer); a sharded island's other ranks adopt rank 0's."""

    def __init__(
        self,
        ctx: LearnerContext,
        client: ShardedClient | None,
        inbox: Inbox,
        bases: DeltaBases,
        report: Callable[[], dict],
        upload_part: Callable[[], None] | None = None,
    ) -> None:
        """``report``: what the heartbeat and the Leave carry. ``upload_part``: (a sharded
        island's rank) upload this rank's part of the initial model: the ranks' parts
        together set up a syncer that has none, and each rank fetches its own runs (the
        session fetches nothing); without it, the session uploads and fetches the whole
        model."""
        self.ctx = ctx
        self.client = client
        self.inbox = inbox
        self.bases = bases
        self.report = report
        self.upload_part = upload_part
        self.step_budget = 0
        """The syncer's global step budget (0: none), learned when joining."""
        self.step_offset = 0
        """Steps this learner id did in earlier processes (the syncer's record, from the
        latest report of its previous incarnation): ``global_step`` counts from it."""
        self.joined_clock: dict | None = None
        self._heard_clock: dict | None = None  # the heartbeat thread's last announcement
        self.connected = True
        """False while the heartbeat finds the syncer unreachable."""
        self.leaving = threading.Event()
        """Set before the Leave: the heartbeat thread must not rejoin after it."""

    def _client(self) -> ShardedClient:
        assert self.client is not None
        return self.client

    def join(self) -> dict:
        ctx = self.ctx
        h = {
            "learner": ctx.learner,
            "incarnation": ctx.incarnation,
            "fingerprint": ctx.fingerprint,
            "spec": ctx.spec,  # a mismatch names the field
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process": ctx.process_id,
            "process_key": ctx.process_key,
        }
        r = self._client().unary("Join", h, timeout_s=10.0, control=True)
        if not r.get("need_init") and not all(k in r for k in ("incarnation", "boot_id")):
            raise TransportError(
                grpc.StatusCode.INTERNAL, "E_TRANSPORT: a Join reply without incarnation or boot id"
            )
        if not r.get("need_init") and isinstance(r.get("learner"), int):
            ctx.learner = r["learner"]  # assigned by the syncer when we asked for none
        return r

    def join_and_fetch(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Join (initialising a syncer that has no model yet) and fetch the global model
        (only its versions for a sharded island's rank): retried with backoff within
        ``connect_timeout``."""
        ctx, client = self.ctx, self._client()
        started = time.monotonic()
        deadline = started + ctx.connect_timeout_s
        backoff = 0.1
        dup_deadline: float | None = None
        note_at = started + 1.0  # say what we wait for, then every 10 s
        while True:
            try:
                fresh = ctx.incarnation < 0
                r = self.join()
                if r.get("need_init") and self.upload_part is not None:
                    # every rank uploads its runs; the model is set up once they tile it
                    self.upload_part()
                    while r.get("need_init") and time.monotonic() < deadline:
                        time.sleep(0.1)
                        r = self.join()
                    if r.get("need_init"):
                        raise SyncerError(
                            f"[learner {ctx.learner}] the island's ranks did not upload the "
                            f"whole initial model within {ctx.connect_timeout_s:.0f} s"
                        )
                elif r.get("need_init"):
                    self.upload_initial()
                    r = self.join()
                if fresh:  # a new process of this learner id carries on its step count
                    self.step_offset = int(r.get("steps_done") or 0)
                ctx.incarnation = r["incarnation"]
                ctx.boot_id = r["boot_id"]
                self.inbox.merged_seq = {int(k): v for k, v in r.get("merged_seq", {}).items()}
                self.note_budget(r)
                self.joined_clock = r.get("clock")
                params: dict[str, torch.Tensor] = {}
                if self.upload_part is not None:  # every rank fetches its runs
                    versions = list(r["versions"])
                else:
                    versions, params = self.fetch_all()
                ctx.joined.set()
                log.info(
                    "[learner %d] joined syncer %s (incarnation %d), versions %s",
                    ctx.learner,
                    ctx.boot_id,
                    ctx.incarnation,
                    versions,
                )
                return versions, params
            except grpc.RpcError as e:
                if "E_DUPLICATE" in rpc_details(e):
                    # the id is live elsewhere: a killed predecessor is declared dead within
                    # the syncer's heartbeat timeout; a second live process never is
                    now = time.monotonic()
                    if dup_deadline is None:
                        dup_deadline = now + DUPLICATE_WAIT_S
                        log.warning(
                            "[learner %d] %s; waiting up to %.0f s",
                            ctx.learner,
                            rpc_details(e),
                            DUPLICATE_WAIT_S,
                        )
                    if now > dup_deadline:
                        raise SyncerError(
                            f"[learner {ctx.learner}] syncer "
                            f"{client.address} refused: "
                            f"{rpc_details(e)}"
                        ) from None
                    time.sleep(0.5)
                    continue
                if rpc_code(e) not in RETRYABLE:
                    raise SyncerError(
                        f"[learner {ctx.learner}] syncer {client.address} "
                        f"refused: {rpc_code(e).name}: {rpc_details(e)}"
                    ) from None
                now = time.monotonic()
                if now > deadline:
                    raise SyncerError(
                        f"[learner {ctx.learner}] syncer {client.address} "
                        f"unreachable for {ctx.connect_timeout_s:.0f} s: "
                        f"{rpc_details(e)}"
                    ) from None
                if now >= note_at:
                    note_at = now + 10.0
                    log.warning(
                        "[learner %s] waiting for the syncer at %s: unreachable for %.0f s "
                        "(%s); giving up after %.0f s (connect_timeout)",
                        ctx.learner,
                        client.address,
                        now - started,
                        rpc_details(e).rsplit(": ", 1)[-1],
                        ctx.connect_timeout_s,
                    )
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def note_budget(self, r: dict) -> None:
        self.step_budget = int(r.get("step_budget") or 0)
        if r.get("stop"):
            self.ctx.stop.set()

    def fetch_all(self, timeout_s: float = 60.0) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The published global model: (versions, name -> tensor in the model's shapes)."""
        ctx = self.ctx
        got = self._client().fetch(None, timeout_s=timeout_s, learner=ctx.learner)
        versions = [got[p][0] for p in range(ctx.fragmentation.P)]
        params: dict[str, torch.Tensor] = {}
        for p, f in enumerate(ctx.fragmentation.fragments):
            shaped = [t.view(ctx.params[n].shape) for n, t in zip(f.names, got[p][1])]
            params.update(zip(f.names, shaped))
            self.bases.remember(p, got[p][0], shaped)
            ctx.stats.bytes_received += got[p][2]
        return versions, params

    def upload_initial(self) -> None:
        ctx = self.ctx
        with torch.no_grad():
            data = b"".join(
                t.detach().float().cpu().contiguous().numpy().tobytes() for t in ctx.params.values()
            )
        who = ctx.learner if ctx.learner >= 0 else None  # not assigned yet
        r = self._client().stream(
            "Init", wire.chunks({"learner": who, "spec": ctx.spec, "nbytes": len(data)}, data)
        )
        ctx.stats.bytes_sent += len(data)
        log.info(
            "[learner %d] initial model upload: %s",
            ctx.learner,
            "accepted" if r.get("accepted") else "another learner was first",
        )

    def credentials(self) -> dict:
        """What another rank of the island needs to act as this learner (``adopt``)."""
        ctx = self.ctx
        return {
            "creds": self._client().credentials(),
            "learner": ctx.learner,
            "incarnation": ctx.incarnation,
            "boot_id": ctx.boot_id,
        }

    def adopt(self, d: dict) -> None:
        """Act as the learner rank 0 joined as (a rank other than 0)."""
        ctx = self.ctx
        self._client().adopt(d["creds"])
        ctx.learner, ctx.incarnation, ctx.boot_id = d["learner"], d["incarnation"], d["boot_id"]
        ctx.joined.set()

    def leave(self) -> None:
        """Tell the syncer this learner is done (its final report); the heartbeat thread
        stops rejoining."""
        ctx = self.ctx
        self.leaving.set()  # the heartbeat thread must not rejoin after the Leave
        try:
            self._client().unary(
                "Leave",
                {"learner": ctx.learner, "incarnation": ctx.incarnation, "report": self.report()},
                timeout_s=3.0,
                control=True,
            )
        except grpc.RpcError:
            pass

    def heartbeater(self) -> None:
        """The heartbeat thread: liveness and the report, the stop flag and the slot clock
        back; rejoins when the syncer asks or has restarted."""
        ctx, client = self.ctx, self._client()
        while not ctx.closed.wait(ctx.heartbeat_s):
            if self.leaving.is_set():
                return
            try:
                if not ctx.joined.is_set():
                    self.rejoin()
                    continue
                r = client.unary(
                    "Heartbeat",
                    {
                        "learner": ctx.learner,
                        "incarnation": ctx.incarnation,
                        "report": self.report(),
                    },
                    timeout_s=max(2.0, 4 * ctx.heartbeat_s),
                    control=True,
                )
                if r.get("stop"):
                    ctx.stop.set()
                if r.get("clock") and r["clock"] != self._heard_clock:
                    self._heard_clock = r["clock"]
                    self.inbox.put(ClockHeard(r["clock"]))
                if not self.connected:
                    log.info(
                        "[learner %d step %d] syncer reachable again", ctx.learner, ctx.sync.step
                    )
                    self.connected = True
                if r.get("rejoin") or r.get("boot_id") != ctx.boot_id:
                    ctx.joined.clear()
                    self.rejoin()
            except grpc.RpcError as e:
                if self.connected:
                    log.warning(
                        "[learner %d step %d] syncer unreachable (%s); training on, reconnecting",
                        ctx.learner,
                        ctx.sync.step,
                        rpc_code(e).name,
                    )
                    self.connected = False
                    ctx.stats.reconnects += 1

    def rejoin(self) -> None:
        if self.leaving.is_set():
            return
        ctx, client = self.ctx, self._client()
        old_boot = ctx.boot_id
        try:
            r = self.join()
        except grpc.RpcError as e:
            if "E_DUPLICATE" in rpc_details(e):  # another process holds this id now: stop
                raise SyncerError(
                    f"[learner {ctx.learner}] syncer {client.address} "
                    f"refused the rejoin: {rpc_details(e)}"
                ) from None
            raise
        if r.get("need_init"):
            if self.upload_part is not None:
                raise SyncerError(
                    f"[learner {ctx.learner}] syncer {client.address} restarted without "
                    f"its model: a sharded island's ranks upload one together only at start "
                    f"(restart the syncer with --resume, or restart the island)"
                )
            # a fresh syncer without a checkpoint: give it our current parameters
            self.upload_initial()
            r = self.join()
        self.inbox.set_merged(r)
        self.note_budget(r)
        if r.get("clock"):
            self.inbox.put(ClockHeard(r["clock"]))
        ctx.incarnation = r["incarnation"]
        if r["boot_id"] != old_boot:
            log.warning(
                "[learner %d step %d] syncer restarted (boot %s -> %s), versions %s",
                ctx.learner,
                ctx.sync.step,
                old_boot,
                r["boot_id"],
                r["versions"],
            )
            self.inbox.put(SyncerRestarted(self.inbox.merged(), old_boot))
            ctx.boot_id = r["boot_id"]
        self.connected = True
        ctx.joined.set()
