"""The control plane: who the learners are, the run's clock and step budget, its status.

``Control`` owns the learner table (``LearnerInfo`` per id: incarnation, session key,
heartbeats, last report), the incarnations handed out, each learner's latest total of
steps and the global step budget, the membership log, the run's span on the wall clock
(first Join to the last live learner's Leave) and the slot clock with its epoch. It
answers the gRPC calls Join, Watch, Heartbeat, Leave and Status; it checks, for itself and
for ``Data``, that a call comes from a live learner's current session; it declares a
silent learner dead (for ``Liveness``). It reads the model (the state machine, its spec
and fingerprint) and the publication, and acts on the rest of the server, through what
the server gives it. Every call into it holds the server's lock, unless it says
otherwise."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc

from ddiloco.algorithm.schedule import SlotClock, measured_slot_s, next_clock
from ddiloco.algorithm.syncer_state import SyncerState, vars_of
from ddiloco.runtime.observe.accounting import fold, goodput_of
from ddiloco.runtime.syncer.common import LearnerInfo, Reject, handler, unpack_frame, validate
from ddiloco.runtime.syncer.durability import Resumed
from ddiloco.runtime.syncer.membership import MembershipLog, assign_learner_id
from ddiloco.runtime.syncer.publication import Publication
from ddiloco.runtime.syncer.run_config import SyncerServerConfig
from ddiloco.runtime.transport import session, wire
from ddiloco.runtime.transport.schema import (
    HeartbeatRequest,
    JoinRequest,
    LeaveRequest,
    Report,
    WatchRequest,
)
from ddiloco.runtime.transport.spec import check_spec, spec_diff
from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = ["Control"]

log = logging.getLogger("ddiloco.syncer")

CLOCK_LEAD_S = 1.0
"""A new slot length applies this long after the syncer announces it (several heartbeats)."""
CLOCK_MIN_INTERVAL_S = 2.0
"""Re-timings of the slot clock are at least this far apart."""


class Control:
    """The control plane of ``SyncerServer``: the learners, the run's clock and budget."""

    _parse = staticmethod(unpack_frame)
    _validate = staticmethod(validate)

    def __init__(
        self,
        lock: threading.Lock,
        config: SyncerServerConfig,
        publication: Publication,
        *,
        boot_id: str,
        started_s: float,
        state: Callable[[], SyncerState | None],
        require_ready: Callable[[], SyncerState],
        spec: Callable[[], dict | None],
        fingerprint: Callable[[], str],
        bulk_port: Callable[[], int | None],
        closed: Callable[[], bool],
        depart: Callable[[int, float], None],
        counters: Callable[[], dict],
        rejections: Counter,
        event: Callable[..., None],
        auth: Callable[[Any], None],
        fail: Callable[[Any, Reject, str], None],
        bulk_slots: threading.BoundedSemaphore,
    ) -> None:
        """``lock``: the server's. ``config``: the server's settings. ``publication``: the
        versions and merge sequence numbers replies carry, and the condition ``Watch``
        waits on. ``boot_id``/``started_s``: this syncer process's id and start
        (monotonic). ``state()``: the state machine, None before the model is set up;
        ``require_ready()``: the same, or a ``Reject``; ``spec()``/``fingerprint()``: the
        model's spec and its fingerprint. ``bulk_port()``: the data port learners are told
        (None: off, or not bound yet). ``closed()``: whether the server is shutting down.
        ``depart(m, now_s)``: learner m leaves the state machine (the server takes the
        merges that its leaving completes, and forgets m's downlink copies).
        ``counters()``/``rejections``: the server's counters as a status shows them, and
        its counted rejections. ``event``: metrics. ``auth``/``fail``/``bulk_slots``: the
        gRPC handlers' token check, their abort and the bulk call slots
        (``common.handler``)."""
        self._lock = lock
        self.config = config
        self.publication = publication
        self.boot_id, self.started_s = boot_id, started_s
        self._state, self._require_ready = state, require_ready
        self._spec, self._fingerprint = spec, fingerprint
        self._bulk_port, self._closed, self._depart = bulk_port, closed, depart
        self._counters, self._rejections, self._event = counters, rejections, event
        self._auth, self._fail, self._bulk_slots = auth, fail, bulk_slots
        self.learners: dict[int, LearnerInfo] = {}
        """Every learner id heard of: incarnation, session, heartbeats, last report."""
        self.incarnations: dict[int, int] = {}
        """learner -> its latest incarnation (every id handed out or seen)."""
        self.steps_done: dict[int, int] = {}
        """learner -> its latest reported total of inner steps (over its restarts)."""
        self.members = MembershipLog(started_s)
        self.run_started_wall: float | None = None
        """Unix time of the first Join: the run's chip-time counts from there."""
        self.run_ended_wall: float | None = None
        """Unix time the last live learner left (None while one is live)."""
        self.clock: SlotClock | None = None
        """The run's slot clock (time-driven schedule), announced on Join and Heartbeat."""
        self.epoch_s: float | None = None
        """Unix time the run's clock started (the model's initialisation)."""
        self.budget_spent = False
        """The learners' reported steps reached ``config.step_budget``: they are told to
        finish."""

    # -- the gRPC calls -------------------------------------------------------------------
    @handler("join")
    def join(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        raw = self._parse(req)[0]
        h = self._validate(JoinRequest, raw, "join")
        # no id (None or -1): the syncer assigns one (elastic membership)
        req_id, inc = (-1 if h.learner is None else h.learner), h.incarnation
        with self._lock:
            st = self._state()
            if st is None:
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
            m = assign_learner_id(req_id, self.incarnations)
            fp = self._fingerprint()
            if h.fingerprint not in (None, fp):
                what, ours = "", self._spec()
                if h.spec is not None and ours is not None:  # ours is set with the model
                    try:
                        check_spec(h.spec)
                        what = spec_diff(ours, h.spec)
                    except (ValueError, TypeError):  # a malformed spec: the fingerprint says it
                        pass
                raise Reject(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    E.SPEC,
                    f"model/fragmentation spec {h.fingerprint} differs from the "
                    f"syncer's {fp}{': ' + what if what else ''}; every learner "
                    f"must pass the same model (names, shapes, dtypes), P and strategy",
                )
            now = time.monotonic()
            info = self.learners.get(m)
            if (
                info is not None
                and info.state == "live"
                and m in st.live
                and now - info.last_hb_s <= self.config.heartbeat_timeout_s
                and not (info.session_key and session.verify(info.session_key, raw))
                # the same process again: it retries a Join whose reply was lost (that
                # Join went through, and made a session the process never got)
                and not session.same_process(info.process_key, h.process_key)
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
            if inc < 0 or inc != self.incarnations.get(m):
                inc = self.incarnations.get(m, 0) + 1
                self.incarnations[m] = inc
            info = self.learners.setdefault(m, LearnerInfo())
            info.incarnation, info.last_hb_s, info.state = inc, now, "live"
            info.joins += 1
            self._note_process(info, h.process)
            if self.run_started_wall is None:
                self.run_started_wall = time.time()
            self.run_ended_wall = None
            key = info.session_key = session.new_session_key()
            info.process_key = session.process_digest(h.process_key)
            info.hb = -1
            info.host, info.pid = h.host, h.pid
            st.join(m)
            self.members.note("join", m, inc, len(st.live))
            self._event(
                "join",
                learner=m,
                incarnation=inc,
                host=h.host,
                pid=h.pid,
                assigned=req_id < 0,
                live=len(st.live),
            )
            log.info(
                "[learner %d] joined (incarnation %d%s), %d live",
                m,
                inc,
                ", id assigned" if req_id < 0 else "",
                len(st.live),
            )
            return wire.pack(
                {
                    "need_init": False,
                    "boot_id": self.boot_id,
                    "incarnation": inc,
                    "learner": m,
                    "shards": self.shard_map,
                    "versions": self.publication.versions(),
                    "spec": self._spec(),
                    "fingerprint": fp,
                    "downlink_codec": self.config.downlink_codec,
                    "history": self.config.syncer.history,
                    "merged_seq": self.publication.merged_seq_pub.get(m, {}),
                    "step_budget": self.config.step_budget,
                    "stop": self.budget_spent,
                    "bulk_port": self._bulk_port(),
                    "bulk_host": self.config.data_host,
                    "session": key.hex(),
                    # this learner's steps over its earlier processes (its latest report)
                    "steps_done": self.steps_done.get(m, 0),
                    "clock": self.clock.to_dict() if self.clock else None,
                }
            )

    @handler("watch", bulk=True)
    def watch(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        h = self._validate(WatchRequest, self._parse(req)[0], "watch")
        m, cursor = h.learner, h.cursor
        seen = {int(k): v for k, v in (h.merged_seq or {}).items() if k.isdigit()}
        deadline = time.monotonic() + h.timeout_s
        with self._lock:
            self._require_ready()
            while (
                not self._closed()
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
    def heartbeat(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        raw = self._parse(req)[0]
        h = self._validate(HeartbeatRequest, raw, "heartbeat")
        m, inc = h.learner, h.incarnation
        with self._lock:
            st = self._require_ready()
            info = self.learners.get(m)
            if m not in st.live or info is None or info.incarnation != inc:
                return wire.pack({"rejoin": True, "boot_id": self.boot_id})
            self.require_session(m, raw, "heartbeat")
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
    def leave(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        raw = self._parse(req)[0]
        h = self._validate(LeaveRequest, raw, "leave")
        m, inc = h.learner, h.incarnation
        with self._lock:
            st = self._require_ready()
            info = self.learners.get(m)
            if info is not None and info.incarnation == inc and info.state != "left":
                self.require_session(m, raw, "leave")
                info.state = "left"
                if h.report is not None:
                    self._take_report(info, h.report.model_dump())
                    self._count_steps(m, h.report)
                if all(i.state != "live" for i in self.learners.values()):
                    self.run_ended_wall = time.time()
                self._depart(m, time.monotonic())
                self.members.note("leave", m, inc, len(st.live))
                self._event("leave", learner=m, live=len(st.live))
                log.info("[learner %d] left, %d live", m, len(st.live))
            return wire.pack({"ok": True})

    @handler("status")
    def status_call(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        try:
            h, _ = wire.unpack(req)
        except ValueError:  # an empty or odd request asks for the plain snapshot
            h = {}
        st = self.status()
        if h.get("spec") is True:  # `ddiloco export HOST:PORT` needs the tensor names and shapes
            with self._lock:
                st["spec"] = self._spec()
        return wire.pack(st)

    # -- sessions and liveness, for the other parts ----------------------------------------
    def require_session(self, m: int, raw: dict, what: str) -> LearnerInfo:
        """The call acts as learner ``m``: it must carry the MAC of ``m``'s current session
        (``m`` is live)."""
        info = self.learners[m]
        if info.session_key is None or not session.verify(info.session_key, raw):
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                E.SESSION,
                f"{what} as learner {m} without the session of its live process "
                f"(incarnation {info.incarnation}): only the process that joined "
                f"can act as it; Join again",
            )
        return info

    def require_live(self, m: int, incarnation: int) -> SyncerState:
        """The state, once learner m is live in ``incarnation``; else a ``Reject``."""
        st = self._require_ready()
        info = self.learners.get(m)
        if m not in st.live or info is None or info.incarnation != incarnation:
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                E.UNKNOWN_LEARNER,
                f"learner {m} (incarnation {incarnation}) is not joined or was declared "
                f"dead; Join again",
            )
        return st

    def session_of(self, hello: dict) -> int | None:
        """The learner whose session a data-port hello proves (its MAC under the key of
        that learner's latest Join), or None. Called by the data port's selector thread
        without the lock: it reads one learner's session key, which a Join sets in one step."""
        m = hello.get("learner")
        info = self.learners.get(m) if isinstance(m, int) else None
        key = None if info is None else info.session_key
        return m if key is not None and session.verify(key, hello) else None

    def last_heartbeat_s(self, m: int) -> float | None:
        info = self.learners.get(m)
        return None if info is None else info.last_hb_s

    def declare_dead(self, m: int, now: float) -> None:
        """Learner m's heartbeats stopped (the timer thread, ``Liveness``): it leaves the
        state machine."""
        info = self.learners[m]
        info.state = "dead"
        log.warning("[learner %d] no heartbeat for %.1f s: declared dead", m, now - info.last_hb_s)
        self._depart(m, now)
        live = len(self._require_ready().live)
        self.members.note("dead", m, info.incarnation, live)
        self._event("dead", learner=m, live=live)

    def mean_fetch_s(self) -> float:
        """The live learners' mean reported fetch time (0 when none reports one)."""
        fetch_s = [
            i.report.get("fetch_s", 0.0)
            for i in self.learners.values()
            if i.state == "live" and i.report.get("fetch_s") is not None
        ]
        return sum(fetch_s) / len(fetch_s) if fetch_s else 0.0

    # -- the run's clock, budget and ledger -------------------------------------------------
    def start_epoch(self) -> None:
        """The model was just set up: the run's clock starts now."""
        self.epoch_s = time.time()

    def restore(self, r: Resumed) -> None:
        """A resume: the learners (not live until they join again), their incarnations and
        steps, the clock and the ledger's start, as checkpointed."""
        self.incarnations = r.incarnations
        self.steps_done = r.steps_done
        self.epoch_s = r.epoch_s or self.epoch_s
        if r.clock is not None:  # the learners' slots continue where they were
            self.clock = r.clock
        self.run_started_wall = r.run_started_wall
        self.learners.update(r.learners)

    @staticmethod
    def _note_process(info: LearnerInfo, process: str | None) -> None:
        """A learner id heard from a process: another process than the one behind its last
        report is a restart, and the ended process's totals are carried. Reports without a
        process id count as the same process."""
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
        """Start or re-time the slot clock from the live learners' measured step times. A
        change applies ``CLOCK_LEAD_S`` (or four heartbeat intervals, if longer) ahead, so
        that every learner hears it first."""
        st = self._state()
        if self.epoch_s is None or st is None:
            return
        steps = [
            info.report.get("step_s")
            for m, info in self.learners.items()
            if m in st.live and info.state == "live"
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
        """Track the global step budget from a learner's report. A learner's total is its
        latest report (``global_step``, counted over its restarts, else ``step``): a
        restarted learner that resumes from an earlier step lowers it."""
        n = rep.global_step if rep.global_step is not None else rep.step
        if n is None:
            return
        self.steps_done[m] = n
        budget = self.config.step_budget
        if budget and not self.budget_spent and sum(self.steps_done.values()) >= budget:
            self.budget_spent = True
            self._event("budget-spent", steps=sum(self.steps_done.values()), budget=budget)
            log.info("step budget of %d inner steps spent: learners are told to finish", budget)

    # -- what the syncer tells -------------------------------------------------------------
    @property
    def shard_map(self) -> dict | None:
        """The shard map every Join and Status reply carries (None: not sharded)."""
        if len(self.config.shards) < 2:
            return None
        return {"addresses": list(self.config.shards), "index": self.config.shard}

    def status(self) -> dict:
        """A JSON-able snapshot: learners, versions, ledger, counters, policy timings. Takes
        the lock."""
        with self._lock:
            now = time.monotonic()
            st = self._state()
            learners = {}
            for m, info in sorted(self.learners.items()):
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
                "counters": self._counters(),
                "rejections": dict(self._rejections),
                "mean_quorum": (
                    sum(st.quorum_sizes) / len(st.quorum_sizes) if st and st.quorum_sizes else None
                ),
                "xi_step_s": pol.xi_step.value if pol else None,
                "xi_quorum_s": pol.xi_quorum.value if pol else None,
                "xi_sync_s": pol.xi_sync.value if pol else None,
                "grace_s": pol.grace_s() if pol else None,
                "fingerprint": self._fingerprint(),
                "step_budget": self.config.step_budget,
                "steps_done": sum(self.steps_done.values()),
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
