"""The learner's session with the syncer: Join (initialising a syncer that has no model
yet), the fetch of the whole global model, the heartbeat thread, and the rejoin after a
syncer restart or after being declared dead. A mixin of ``DecoupledLearner``: the state it
uses is set in ``DecoupledLearner.__init__``."""

from __future__ import annotations

import logging
import os
import socket
import time

import grpc
import torch

from ddiloco.runtime.learner.client import RETRYABLE, SyncerError, rpc_code, rpc_details
from ddiloco.runtime.learner.events import ClockHeard, SyncerRestarted
from ddiloco.runtime.transport import wire

__all__ = ["DUPLICATE_WAIT_S", "SessionMixin"]

log = logging.getLogger("ddiloco.learner")

DUPLICATE_WAIT_S = 15.0
"""How long a learner whose id is live in another process keeps asking before it gives up
(longer than the syncer's heartbeat timeout, so a killed predecessor is declared dead)."""


class SessionMixin:
    """Join, fetch the global model, heartbeat, rejoin (root rank only)."""

    def _join(self) -> dict:
        h = {
            "learner": self.learner,
            "incarnation": self.incarnation,
            "fingerprint": self.fingerprint,
            "spec": self.spec,  # a mismatch names the field
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process": self.process_id,
        }
        r = self.client.unary("Join", h, timeout_s=10.0, control=True)
        if not r.get("need_init") and isinstance(r.get("learner"), int):
            self.learner = r["learner"]  # assigned by the syncer when we asked for none
        return r

    def _join_and_fetch(self, initial: bool) -> tuple[list[int], dict[str, torch.Tensor]]:
        started = time.monotonic()
        deadline = started + self.connect_timeout_s
        backoff = 0.1
        dup_deadline: float | None = None
        note_at = started + 1.0  # say what we wait for, then every 10 s
        while True:
            try:
                fresh = self.incarnation < 0
                r = self._join()
                if r.get("need_init") and self.sharded:
                    # every rank uploads its runs; the model is set up once they tile it
                    self._upload_runs()
                    while r.get("need_init") and time.monotonic() < deadline:
                        time.sleep(0.1)
                        r = self._join()
                    if r.get("need_init"):
                        raise SyncerError(
                            f"[learner {self.learner}] the island's ranks did not upload the "
                            f"whole initial model within {self.connect_timeout_s:.0f} s"
                        )
                elif r.get("need_init"):
                    self._upload_initial()
                    r = self._join()
                if fresh:  # a new process of this learner id carries on its step count
                    self.step_offset = int(r.get("steps_done") or 0)
                self.incarnation = r["incarnation"]
                self.boot_id = r["boot_id"]
                self._merged_seq = {int(k): v for k, v in r.get("merged_seq", {}).items()}
                self._note_budget(r)
                self._joined_clock = r.get("clock")
                if self.sharded:  # every rank fetches its runs (``_agreed_global``)
                    versions, params = list(r["versions"]), {}
                else:
                    versions, params = self._fetch_all()
                self._joined.set()
                log.info(
                    "[learner %d] joined syncer %s (incarnation %d), versions %s",
                    self.learner,
                    self.boot_id,
                    self.incarnation,
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
                            self.learner,
                            rpc_details(e),
                            DUPLICATE_WAIT_S,
                        )
                    if now > dup_deadline:
                        raise SyncerError(
                            f"[learner {self.learner}] syncer "
                            f"{self.client.address} refused: "
                            f"{rpc_details(e)}"
                        ) from None
                    time.sleep(0.5)
                    continue
                if rpc_code(e) not in RETRYABLE:
                    raise SyncerError(
                        f"[learner {self.learner}] syncer {self.client.address} "
                        f"refused: {rpc_code(e).name}: {rpc_details(e)}"
                    ) from None
                now = time.monotonic()
                if now > deadline:
                    raise SyncerError(
                        f"[learner {self.learner}] syncer {self.client.address} "
                        f"unreachable for {self.connect_timeout_s:.0f} s: "
                        f"{rpc_details(e)}"
                    ) from None
                if now >= note_at:
                    note_at = now + 10.0
                    log.warning(
                        "[learner %s] waiting for the syncer at %s: unreachable for %.0f s "
                        "(%s); giving up after %.0f s (connect_timeout)",
                        self.learner,
                        self.client.address,
                        now - started,
                        rpc_details(e).rsplit(": ", 1)[-1],
                        self.connect_timeout_s,
                    )
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def _note_budget(self, r: dict) -> None:
        self.step_budget = int(r.get("step_budget") or 0)
        if r.get("stop"):
            self._stop.set()

    def _fetch_all(self, timeout_s: float = 60.0) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The published global model: (versions, name -> tensor in the model's shapes)."""
        got = self.client.fetch(None, timeout_s=timeout_s, learner=self.learner)
        versions, params = [got[p][0] for p in range(self.fragmentation.P)], {}
        for p, f in enumerate(self.fragmentation.fragments):
            shaped = [t.view(self.params[n].shape) for n, t in zip(f.names, got[p][1])]
            params.update(zip(f.names, shaped))
            self._remember_base(p, got[p][0], shaped)
            self.stats.bytes_received += got[p][2]
        return versions, params

    def _upload_initial(self) -> None:
        with torch.no_grad():
            data = b"".join(
                t.detach().float().cpu().contiguous().numpy().tobytes()
                for t in self.params.values()
            )
        who = self.learner if self.learner >= 0 else None  # not assigned yet
        r = self.client.stream(
            "Init", wire.chunks({"learner": who, "spec": self.spec, "nbytes": len(data)}, data)
        )
        self.stats.bytes_sent += len(data)
        log.info(
            "[learner %d] initial model upload: %s",
            self.learner,
            "accepted" if r.get("accepted") else "another learner was first",
        )

    def _heartbeater(self) -> None:
        while not self._closed.wait(self.heartbeat_s):
            if self._leaving.is_set():
                return
            try:
                if not self._joined.is_set():
                    self._rejoin()
                    continue
                r = self.client.unary(
                    "Heartbeat",
                    {
                        "learner": self.learner,
                        "incarnation": self.incarnation,
                        "report": self.report(),
                    },
                    timeout_s=max(2.0, 4 * self.heartbeat_s),
                    control=True,
                )
                if r.get("stop"):
                    self._stop.set()
                if r.get("clock") and r["clock"] != self._heard_clock:
                    self._heard_clock = r["clock"]
                    self._inbox.put(ClockHeard(r["clock"]))
                if not self._connected:
                    log.info(
                        "[learner %d step %d] syncer reachable again", self.learner, self.sync.step
                    )
                    self._connected = True
                if r.get("rejoin") or r.get("boot_id") != self.boot_id:
                    self._joined.clear()
                    self._rejoin()
            except grpc.RpcError as e:
                if self._connected:
                    log.warning(
                        "[learner %d step %d] syncer unreachable (%s); training on, reconnecting",
                        self.learner,
                        self.sync.step,
                        rpc_code(e).name,
                    )
                    self._connected = False
                    self.stats.reconnects += 1

    def _rejoin(self) -> None:
        if self._leaving.is_set():
            return
        old_boot = self.boot_id
        try:
            r = self._join()
        except grpc.RpcError as e:
            if "E_DUPLICATE" in rpc_details(e):  # another process holds this id now: stop
                raise SyncerError(
                    f"[learner {self.learner}] syncer {self.client.address} "
                    f"refused the rejoin: {rpc_details(e)}"
                ) from None
            raise
        if r.get("need_init"):
            if self.sharded:
                raise SyncerError(
                    f"[learner {self.learner}] syncer {self.client.address} restarted without "
                    f"its model: a sharded island's ranks upload one together only at start "
                    f"(restart the syncer with --resume, or restart the island)"
                )
            # a fresh syncer without a checkpoint: give it our current parameters
            self._upload_initial()
            r = self._join()
        with self._lock:
            self._merged_seq = {int(k): v for k, v in r.get("merged_seq", {}).items()}
        self._note_budget(r)
        if r.get("clock"):
            self._inbox.put(ClockHeard(r["clock"]))
        self.incarnation = r["incarnation"]
        if r["boot_id"] != old_boot:
            log.warning(
                "[learner %d step %d] syncer restarted (boot %s -> %s), versions %s",
                self.learner,
                self.sync.step,
                old_boot,
                r["boot_id"],
                r["versions"],
            )
            self._inbox.put(SyncerRestarted(dict(self._merged_seq), old_boot))
            self.boot_id = r["boot_id"]
        self._connected = True
        self._joined.set()
