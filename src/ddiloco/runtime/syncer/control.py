"""The syncer's gRPC control calls: Join, Init, Watch, Heartbeat, Leave and Status."""

from __future__ import annotations

import logging
import math
import time

import grpc
import numpy as np
import torch

from ddiloco.algorithm.merge import all_finite
from ddiloco.algorithm.schedule import measured_slot_s, next_clock
from ddiloco.algorithm.slices import InitUpload, Piece, PieceError
from ddiloco.algorithm.syncer_state import vars_of
from ddiloco.runtime.observe.accounting import fold, goodput_of
from ddiloco.runtime.syncer.common import LearnerInfo, Reject, handler
from ddiloco.runtime.syncer.membership import assign_learner_id
from ddiloco.runtime.transport import session, wire
from ddiloco.runtime.transport.schema import (
    HeartbeatRequest,
    InitHeader,
    JoinRequest,
    LeaveRequest,
    Report,
    WatchRequest,
)
from ddiloco.runtime.transport.spec import (
    check_spec,
    fragmentation_from_spec,
    spec_diff,
    spec_fingerprint,
)
from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = ["ControlHandlers"]

log = logging.getLogger("ddiloco.syncer")

CLOCK_LEAD_S = 1.0
"""A new slot length applies this long after the syncer announces it (several heartbeats)."""
CLOCK_MIN_INTERVAL_S = 2.0
"""Re-timings of the slot clock are at least this far apart."""
MAX_UPLOADS = 4
"""Sharded islands' initial models being put together at once (each the model's size)."""


class ControlHandlers:
    """The control-plane handlers of ``SyncerServer`` (a mixin)."""

    @handler("join")
    def _join(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        raw = self._parse(req)[0]
        h = self._validate(JoinRequest, raw, "join")
        # no id (None or -1): the syncer assigns one (elastic membership)
        req_id, inc = (-1 if h.learner is None else h.learner), h.incarnation
        with self._lock:
            if self.state is None:
                return wire.pack(
                    {"need_init": True, "boot_id": self.boot_id, "shards": self.shard_map}
                )
            if req_id < 0 and self.config.shards and self.config.shard != 0:
                # ids are handed out by shard 0 only: answer with the map, join nobody
                return wire.pack(
                    {
                        "need_init": False,
                        "redirect": True,
                        "boot_id": self.boot_id,
                        "shards": self.shard_map,
                    }
                )
            m = assign_learner_id(req_id, self._incarnations)
            if h.fingerprint not in (None, self._fp):
                what = ""
                if h.spec is not None:
                    try:
                        check_spec(h.spec)
                        what = spec_diff(self.spec, h.spec)
                    except (ValueError, TypeError):  # a malformed spec: the fingerprint says it
                        pass
                raise Reject(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    E.SPEC,
                    f"model/fragmentation spec {h.fingerprint} differs from the "
                    f"syncer's {self._fp}{': ' + what if what else ''}; every learner "
                    f"must pass the same model (names, shapes, dtypes), P and strategy",
                )
            now = time.monotonic()
            info = self._learners.get(m)
            if (
                info is not None
                and info.state == "live"
                and m in self.state.live
                and now - info.last_hb_s <= self.config.heartbeat_timeout_s
                and not (info.session_key and session.verify(info.session_key, raw))
            ):
                raise Reject(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    E.DUPLICATE,
                    f"learner {m} is already live in another process (host "
                    f"{info.host}, pid {info.pid}, incarnation {info.incarnation}, "
                    f"last heartbeat {now - info.last_hb_s:.1f} s ago): give every "
                    f"learner its own id, or start this one once the other has "
                    f"stopped (it is declared dead "
                    f"{self.config.heartbeat_timeout_s:g} s after its last heartbeat)",
                )
            if inc < 0 or inc != self._incarnations.get(m):
                inc = self._incarnations.get(m, 0) + 1
                self._incarnations[m] = inc
            info = self._learners.setdefault(m, LearnerInfo())
            info.incarnation, info.last_hb_s, info.state = inc, now, "live"
            info.joins += 1
            self._note_process(info, h.process)
            if self.run_started_wall is None:
                self.run_started_wall = time.time()
            self.run_ended_wall = None
            info.session_key, info.hb = session.new_session_key(), -1
            info.host, info.pid = h.host, h.pid
            self.state.join(m)
            self.members.note("join", m, inc, len(self.state.live))
            self._event(
                "join",
                learner=m,
                incarnation=inc,
                host=h.host,
                pid=h.pid,
                assigned=req_id < 0,
                live=len(self.state.live),
            )
            log.info(
                "[learner %d] joined (incarnation %d%s), %d live",
                m,
                inc,
                ", id assigned" if req_id < 0 else "",
                len(self.state.live),
            )
            return wire.pack(
                {
                    "need_init": False,
                    "boot_id": self.boot_id,
                    "incarnation": inc,
                    "learner": m,
                    "shards": self.shard_map,
                    "versions": self.publication.versions(),
                    "spec": self.spec,
                    "fingerprint": self._fp,
                    "downlink_codec": self.config.downlink_codec,
                    "history": self.config.syncer.history,
                    "merged_seq": self.publication.merged_seq_pub.get(m, {}),
                    "step_budget": self.config.step_budget,
                    "stop": self.budget_spent,
                    "bulk_port": self.bulk_port,
                    "bulk_host": self.config.data_host,
                    "session": info.session_key.hex(),
                    # this learner's steps over its earlier processes (its latest report)
                    "steps_done": self._steps_done.get(m, 0),
                    "clock": self.clock.to_dict() if self.clock else None,
                }
            )

    @handler("init", bulk=True)
    def _init(self, it, ctx: grpc.ServicerContext) -> bytes:
        first = next(it, None)
        if first is None:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME, "empty Init stream")
        raw, payload = self._parse(first)
        h = self._validate(InitHeader, raw, "init")
        spec = h.spec
        try:
            check_spec(spec)
            frag = fragmentation_from_spec(spec)
        except (ValueError, TypeError) as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SPEC, str(e)) from None
        numels = [math.prod(s) for s in spec["shapes"]]
        expected = 4 * sum(numels)
        if expected > self.config.max_push_bytes * max(1, frag.P):
            raise Reject(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                E.OVERSIZE,
                f"initial model of {expected} bytes exceeds the limit",
            )
        if h.pieces is not None:  # one rank of a sharded island: its runs of the tensors
            pieces = [Piece(*r) for r in h.pieces]
            part = self.data.read_stream(payload, it, 4 * sum(pc.numel for pc in pieces))
            got = self._add_upload(h.upload or "", spec, numels, pieces, part)
            if got is None:
                return wire.pack({"accepted": False, "partial": True, "fingerprint": self._fp})
            buf = got
            params, copy = {}, True
            off = 0
            for n, s, k in zip(spec["names"], spec["shapes"], numels):
                # views of the uploads' buffer: the state copies them one tensor at a time
                params[n] = torch.frombuffer(buf, dtype=torch.float32, count=k, offset=off)
                params[n] = params[n].view(s)
                off += 4 * k
        else:
            # each tensor read into its own memory as its bytes arrive, no buffer of the
            # whole model beside them: the state takes them as they are; a shard keeps the
            # tensors of its own fragments and reads the others through one at a time
            mine = {n for p, f in enumerate(frag.fragments) if self._owns(p) for n in f.names}
            keep = [n in mine for n in spec["names"]]
            tensors = self._read_tensors(payload, it, numels, keep)
            params = {
                n: t.view(s)
                for n, s, t in zip(spec["names"], spec["shapes"], tensors)
                if t is not None
            }
            del tensors
            copy = False
        if not all(all_finite(t) for t in params.values()):
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT, E.NONFINITE, "initial model has NaN/inf values"
            )
        with self._lock:
            if self.state is not None:
                return wire.pack({"accepted": False, "fingerprint": self._fp})
            self._setup(spec, params, copy=copy)
            del params  # a shard drops the tensors of the fragments it does not own
            for p in range(frag.P):
                self.publication.publish(p, 0, self.state.frags[p].theta)
            log.info(
                "initialised by learner %s: %d tensors, P=%d, %d bytes",
                h.learner,
                len(numels),
                frag.P,
                expected,
            )
            self._event("init", learner=h.learner, nbytes=expected)
            return wire.pack({"accepted": True, "fingerprint": self._fp})

    def _add_upload(
        self, upload: str, spec: dict, numels: list[int], pieces: list[Piece], data: bytearray
    ) -> bytearray | None:
        """Add a sharded island's rank's runs to its upload ``upload`` (the island's id):
        the whole model's buffer once the island's uploads tile it, else None. At most
        ``MAX_UPLOADS`` are kept (the oldest goes), none once the model is set up."""
        key = f"{upload}/{spec_fingerprint(spec)}"
        with self._lock:
            if self.state is not None:
                self._uploads.clear()
                return None
            up = self._uploads.get(key)
            if up is None:
                while len(self._uploads) >= MAX_UPLOADS:
                    del self._uploads[next(iter(self._uploads))]
                up = self._uploads[key] = InitUpload(numels)
            try:
                up.add(pieces, memoryview(data))
            except PieceError as e:
                raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SHAPE, str(e)) from None
            if not up.complete:
                return None
            del self._uploads[key]
            return up.buf

    def _read_tensors(
        self, payload: memoryview, it, numels: list[int], keep: list[bool] | None = None
    ) -> list[torch.Tensor | None]:
        """The stream's fp32 tensors of ``numels`` elements, each filled in its own memory
        as the frames arrive; with ``keep``, only those it marks (the others are read into
        memory that is let go as each one ends: None in their place). The errors are
        ``Data.chunks``'."""
        keep = keep or [True] * len(numels)
        out: list[torch.Tensor | None] = [None] * len(numels)
        i, pos = -1, 0
        dst = np.empty(0, dtype=np.uint8)  # the tensor being filled, as bytes
        for chunk in self.data.chunks(payload, it, 4 * sum(numels)):
            src = np.frombuffer(chunk, dtype=np.uint8)
            a = 0
            while a < len(src):
                while len(dst) == pos:  # a full (or empty) tensor: the next one
                    i, pos = i + 1, 0
                    t = torch.empty(numels[i], dtype=torch.float32)
                    out[i] = t if keep[i] else None
                    dst = t.numpy().view(np.uint8)
                n = min(len(dst) - pos, len(src) - a)
                dst[pos : pos + n] = src[a : a + n]
                pos, a = pos + n, a + n
        for j in range(i + 1, len(numels)):  # empty tensors after the last bytes
            out[j] = torch.empty(0, dtype=torch.float32) if keep[j] else None
        return out

    @handler("watch", bulk=True)
    def _watch(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        h = self._parse_as(WatchRequest, req, "watch")
        m, cursor = h.learner, h.cursor
        seen = {int(k): v for k, v in (h.merged_seq or {}).items() if k.isdigit()}
        deadline = time.monotonic() + h.timeout_s
        with self._lock:
            self._require_ready()
            while (
                not self._closed
                and self.publication.versions() == cursor
                and self.publication.merged_seq_pub.get(m, {}) == seen
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.publication.cv.wait(left)
            return wire.pack(
                {
                    "versions": self.publication.versions(),
                    "boot_id": self.boot_id,
                    "merged_seq": self.publication.merged_seq_pub.get(m, {}),
                }
            )

    @handler("heartbeat")
    def _heartbeat(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        raw = self._parse(req)[0]
        h = self._validate(HeartbeatRequest, raw, "heartbeat")
        m, inc = h.learner, h.incarnation
        with self._lock:
            st = self._require_ready()
            info = self._learners.get(m)
            if m not in st.live or info is None or info.incarnation != inc:
                return wire.pack({"rejoin": True, "boot_id": self.boot_id})
            self._require_session(m, raw, "heartbeat")
            if h.hb <= info.hb:
                raise Reject(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    E.SESSION,
                    f"heartbeat {h.hb} of learner {m} replayed (last was {info.hb})",
                )
            info.hb = h.hb
            info.last_hb_s = time.monotonic()
            if h.report is not None:
                self._take_report(info, h.report.model_dump())
                if h.report.step_s:
                    st.observe_step_s(h.report.step_s)
                self._count_steps(m, h.report)
            self._retime()
            return wire.pack(
                {
                    "rejoin": False,
                    "boot_id": self.boot_id,
                    "versions": self.publication.versions(),
                    "live": len(st.live),
                    "stop": self.budget_spent,
                    "clock": self.clock.to_dict() if self.clock else None,
                }
            )

    @handler("leave")
    def _leave(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        raw = self._parse(req)[0]
        h = self._validate(LeaveRequest, raw, "leave")
        m, inc = h.learner, h.incarnation
        with self._lock:
            st = self._require_ready()
            info = self._learners.get(m)
            if info is not None and info.incarnation == inc and info.state != "left":
                self._require_session(m, raw, "leave")
                info.state = "left"
                if h.report is not None:
                    self._take_report(info, h.report.model_dump())
                    self._count_steps(m, h.report)
                if all(i.state != "live" for i in self._learners.values()):
                    self.run_ended_wall = time.time()
                t0 = time.monotonic()
                self._handle_merges(st.leave(m, t0), t0)
                self.data.forget_copies(m)
                self.members.note("leave", m, inc, len(st.live))
                self._event("leave", learner=m, live=len(st.live))
                log.info("[learner %d] left, %d live", m, len(st.live))
            return wire.pack({"ok": True})

    def _last_heartbeat_s(self, m: int) -> float | None:
        info = self._learners.get(m)
        return None if info is None else info.last_hb_s

    def _declare_dead(self, m: int, now: float) -> None:
        """Learner m's heartbeats stopped (the timer thread, ``Liveness``; lock held): it
        leaves the state machine."""
        info = self._learners[m]
        info.state = "dead"
        log.warning("[learner %d] no heartbeat for %.1f s: declared dead", m, now - info.last_hb_s)
        t0 = time.monotonic()
        self._handle_merges(self.state.leave(m, now), t0)
        self.data.forget_copies(m)
        self.members.note("dead", m, info.incarnation, len(self.state.live))
        self._event("dead", learner=m, live=len(self.state.live))

    @staticmethod
    def _note_process(info: LearnerInfo, process: str | None) -> None:
        """A learner id heard from a process: another process than the one behind its last
        report is a restart, and the ended process's totals are carried (caller holds the
        lock). Reports without a process id count as the same process."""
        if not process:
            return
        if info.process and process != info.process:
            info.carried = fold(info.carried, info.report)
            info.report = {}
        info.process = process

    def _take_report(self, info: LearnerInfo, rep: dict) -> None:
        p = rep.get("process")
        self._note_process(info, p if isinstance(p, str) else None)
        info.report = rep

    def _retime(self) -> None:
        """Start or re-time the slot clock from the live learners' measured step times
        (caller holds the lock). A change applies ``CLOCK_LEAD_S`` (or four heartbeat
        intervals, if longer) ahead, so that every learner hears it first."""
        if self.epoch_s is None or self.state is None:
            return
        steps = [
            info.report.get("step_s")
            for m, info in self._learners.items()
            if m in self.state.live and info.state == "live"
        ]
        slot = measured_slot_s([float(x) for x in steps if isinstance(x, (int, float))])
        lead = max(CLOCK_LEAD_S, 4 * self.config.heartbeat_interval_s)
        nxt = next_clock(
            self.clock,
            epoch_s=self.epoch_s,
            slot_s=slot,
            now_s=time.time(),
            lead_s=lead,
            min_interval_s=max(CLOCK_MIN_INTERVAL_S, 2 * lead),
        )
        if nxt is not None:
            self.clock = nxt
            self._event("clock", slot_s=nxt.slot_s, t0_s=nxt.t0_s, x0=nxt.x0)

    def _count_steps(self, m: int, rep: Report) -> None:
        """Track the global step budget from a learner's report (caller holds the lock).
        A learner's total is its latest report (``global_step``, counted over its restarts,
        else ``step``): a restarted learner that resumes from an earlier step lowers it."""
        n = rep.global_step if rep.global_step is not None else rep.step
        if n is None:
            return
        self._steps_done[m] = n
        budget = self.config.step_budget
        if budget and not self.budget_spent and sum(self._steps_done.values()) >= budget:
            self.budget_spent = True
            self._event("budget-spent", steps=sum(self._steps_done.values()), budget=budget)
            log.info("step budget of %d inner steps spent: learners are told to finish", budget)

    def status(self) -> dict:
        """A JSON-able snapshot: learners, versions, ledger, counters, policy timings."""
        with self._lock:
            now = time.monotonic()
            st = self.state
            learners = {}
            for m, info in sorted(self._learners.items()):
                led = st.ledger.get(m) if st else None
                learners[str(m)] = {
                    "state": info.state,
                    "incarnation": info.incarnation,
                    "joins": info.joins,
                    "last_heartbeat_age_s": round(now - info.last_hb_s, 3),
                    "report": info.report,
                    "carried": info.carried,
                    "syncer_ledger": {
                        k: round(v, 3) if isinstance(v, float) else v
                        for k, v in vars_of(led).items()
                    }
                    if led
                    else {},
                }
            pol = st.policy if st else None
            t_end = self.run_ended_wall or time.time()
            out = {
                "boot_id": self.boot_id,
                "uptime_s": round(now - self.started_s, 3),
                "initialised": st is not None,
                "versions": self.publication.versions(),
                "merges": st.merges if st else 0,
                "live": sorted(st.live) if st else [],
                "learners": learners,
                "counters": {
                    **self.counters,
                    "merge_s": self.merge_s,
                    "merge_cpu_s": self.merge_cpu_s,
                    "clipped_pushes": st.clipped_pushes if st else 0,
                    "carried_pushes": st.carried_pushes if st else 0,
                    "pending_bytes": st.pending_bytes() if st else 0,
                    "push_room_waits": self.data.push_room.waits,
                },
                "rejections": dict(self.rejections),
                "mean_quorum": (
                    sum(st.quorum_sizes) / len(st.quorum_sizes) if st and st.quorum_sizes else None
                ),
                "xi_step_s": pol.xi_step.value if pol else None,
                "xi_quorum_s": pol.xi_quorum.value if pol else None,
                "xi_sync_s": pol.xi_sync.value if pol else None,
                "grace_s": pol.grace_s() if pol else None,
                "fingerprint": self._fp,
                "step_budget": self.config.step_budget,
                "steps_done": sum(self._steps_done.values()),
                "budget_spent": self.budget_spent,
                "run_s": (
                    round(t_end - self.run_started_wall, 3)
                    if self.run_started_wall is not None
                    else None
                ),
                "membership": {**self.members.counts, "events": self.members.to_list()},
                "shard_map": self.shard_map,
            }
            out["goodput"] = goodput_of(out)
            out["learners_per_merge"] = out["mean_quorum"]
            return out

    @handler("status")
    def _status(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        try:
            h, _ = wire.unpack(req)
        except ValueError:  # an empty or odd request asks for the plain snapshot
            h = {}
        st = self.status()
        if h.get("spec") is True:  # `ddiloco export HOST:PORT` needs the tensor names and shapes
            with self._lock:
                st["spec"] = self.spec
        return wire.pack(st)
