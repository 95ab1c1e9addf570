"""The syncer service: a gRPC server driven by the syncer state machine on the wall clock.

One lock guards the ``SyncerState`` (the single implementation of quorum, grace window,
token-weighted RDA merge and Nesterov outer step). Around it the server adds what a real
network needs: authentication, validation of every incoming message before it reaches the
state machine, chunked transfers, liveness from heartbeats, a timer thread for grace
deadlines, durable publication and atomic checkpoints.

Publication: a merged fragment becomes visible to learners (``Fetch``/``Watch``) once it is
*published*. With a checkpoint directory and ``checkpoint_every == 1`` a version is published
only after a checkpoint containing it is on disk, so a SIGKILLed syncer restarted with
``--resume`` never goes back on a version any learner has seen. Writes are coalesced: merges
that happen during a write are covered by the next one.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter
from concurrent import futures
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import torch

from ddiloco.algorithm.codecs import Codec, get_codec
from ddiloco.algorithm.merge import all_finite
from ddiloco.algorithm.syncer_state import (Contribution, Merged, Status, SyncerConfig,
                                            SyncerState, vars_of)
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.auth import check_token, server_credentials, server_ssl_context
from ddiloco.runtime.transport.bulk import BulkReject, BulkServer
from ddiloco.runtime.syncer.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_atomic
from ddiloco.runtime.transport.spec import check_spec, fragmentation_from_spec, spec_fingerprint
from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = ["SyncerServerConfig", "SyncerServer"]

log = logging.getLogger("ddiloco.syncer")

DOWNLINK_CODECS = ("fp32", "bf16", "int8")
"""Codecs of merged fragments sent to learners. int8 quantises the parameters themselves
(learners install the quantised values; with a quantised uplink their next delta is taken
against what they installed, so the install error does not reach the global model)."""


@dataclass(kw_only=True, slots=True)
class SyncerServerConfig:
    token: str
    """Shared secret every call must carry."""
    host: str = "127.0.0.1"
    """Address to bind. Loopback unless told otherwise."""
    port: int = 0
    """Port to bind; 0 picks a free one (read it from ``SyncerServer.port``)."""
    syncer: SyncerConfig = field(default_factory=SyncerConfig)
    """The algorithm's configuration (quorum K, grace, merge rule, outer optimizer...)."""
    downlink_codec: str = "fp32"
    """Codec of merged fragments sent to learners: fp32, bf16 or int8."""
    max_push_bytes: int = 1 << 30
    """Pushes declaring a larger payload are rejected before their payload is read."""
    heartbeat_timeout_s: float = 5.0
    """A learner silent for this long is declared dead (``SyncerState.leave``)."""
    checkpoint_dir: str | None = None
    """Where ``syncer.pt`` is written; None disables checkpoints."""
    checkpoint_every: int = 1
    """1: every merge is durable before it is published. N > 1: a checkpoint every N merges,
    published at once (a SIGKILL may lose up to N - 1 merges)."""
    resume: bool = False
    """Load ``checkpoint_dir/syncer.pt`` at start."""
    tls_cert: str | None = None
    tls_key: str | None = None
    bulk_port: int | None = 0
    """Data port for fragment pushes and fetches (``ddiloco.runtime.transport.bulk``: framed TCP, TLS
    when the syncer has a certificate), advertised to learners in the Join reply. 0 picks
    a free one; None disables it (learners then send fragments over gRPC, a few times
    slower). Learners that cannot reach it fall back to gRPC."""
    max_workers: int = 64
    """gRPC handler threads (each live learner holds up to three calls)."""
    metrics_path: str | None = None
    """Append one JSON line per merge / rejection / membership event here."""
    step_budget: int = 0
    """Total inner steps of all learners together (a global budget: a learner that lost
    time to a failure is made up for by the others). Once the learners' reported steps
    reach it, heartbeats tell every learner to finish. 0: no budget (each learner runs
    its own step count)."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("a shared-secret token is required")
        if self.downlink_codec not in DOWNLINK_CODECS:
            raise ValueError(f"downlink_codec must be one of {DOWNLINK_CODECS}")
        if self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key file")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be > 0")
        if self.step_budget < 0:
            raise ValueError("step_budget must be >= 0 (0: no budget)")
        if self.bulk_port is not None and not 0 <= self.bulk_port <= 65535:
            raise ValueError(f"data port must be in [0, 65535] (0: any free port; off: "
                             f"--bulk-port -1 / bulk_port=None), got {self.bulk_port}")


def tune_malloc() -> bool:
    """Set glibc's allocator for a syncer: one heap shared by all threads, buffers up to
    32 MiB served from it, and up to 256 MiB of free heap kept instead of returned.

    - ``M_ARENA_MAX = 1``: by default each thread that allocates gets its own heap, and a
      heap keeps its peak: with M learners pushing at once through M connection threads
      resident memory grows like M x model although what the syncer holds is O(model) +
      O(M x fragment) (bench/perf_memory.py). One heap reuses a freed push buffer for the
      next push, whichever thread receives it.
    - ``M_MMAP_THRESHOLD`` / ``M_TRIM_THRESHOLD``: otherwise every multi-megabyte tensor
      a merge creates is a fresh mapping whose pages fault in one by one, and freed ones
      are unmapped: a merge of a cold 2.4 MB fragment took 5.2 ms that way and 0.86 ms
      from reused heap memory (bench/perf_syncer.py measures the syncer end to end).

    Process-wide; a no-op off glibc. Returns whether every setting applied."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
        return all([bool(libc.mallopt(m_arena_max, 1)),
                    bool(libc.mallopt(m_mmap_threshold, 32 << 20)),
                    bool(libc.mallopt(m_trim_threshold, 256 << 20))])
    except (OSError, AttributeError):
        return False


class _Reject(Exception):
    def __init__(self, status: grpc.StatusCode, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.status, self.code, self.message = status, code, message


@dataclass(slots=True, frozen=True)
class _PushCheck:
    """A push header that passed validation: what reading and applying its payload needs."""
    m: int
    p: int
    inc: int
    seq: int
    base: int
    c_steps: int
    c_tokens: int
    nbytes: int
    codec: Codec
    names: tuple[str, ...]
    numels: tuple[int, ...]
    shapes: list[tuple[int, ...]]
    delta: bool
    who: str


@dataclass(slots=True)
class _LearnerInfo:
    incarnation: int = 0
    last_hb_s: float = 0.0
    state: str = "live"
    report: dict = field(default_factory=dict)
    joins: int = 0


class SyncerServer:
    """The gRPC syncer. ``start()`` binds and serves; ``close()`` checkpoints and stops."""

    def __init__(self, config: SyncerServerConfig) -> None:
        self.config = config
        tune_malloc()
        self.boot_id = uuid.uuid4().hex[:12]
        self.started_s = time.monotonic()
        self.merge_s = 0.0
        """Time in merge arithmetic (wall, and CPU of the merging thread), seconds."""
        self.merge_cpu_s = 0.0
        self._lock = threading.Lock()
        self._published_cv = threading.Condition(self._lock)
        self._timer_cv = threading.Condition(self._lock)
        self._ckpt_cv = threading.Condition(self._lock)
        self.state: SyncerState | None = None
        self.spec: dict | None = None
        self._fp = ""
        self._pub: list[tuple[int, list[memoryview]]] = []  # per fragment: (version, downlink bytes)
        self._shapes: list[list[tuple[int, ...]]] = []  # per fragment: its tensors' shapes
        self._unpublished: dict[int, Merged] = {}       # merged, waiting for durability
        self._merged_seq: dict[int, dict[int, int]] = {}       # m -> p -> seq (all merges)
        self._merged_seq_pub: dict[int, dict[int, int]] = {}   # the published part
        self._learners: dict[int, _LearnerInfo] = {}
        self._incarnations: dict[int, int] = {}
        self._timers: list[tuple[float, int]] = []
        self._dirty_merges = 0
        self._steps_done: dict[int, int] = {}  # learner -> its latest reported total steps
        self.budget_spent = False
        self._ckpt_requested = False
        self._closed = False
        self.counters: Counter = Counter()
        self.rejections: Counter = Counter()
        self._metrics_f = open(config.metrics_path, "a") if config.metrics_path else None
        self._server: grpc.Server | None = None
        self._bulk_server: BulkServer | None = None
        self.bulk_port: int | None = None
        self._threads: list[threading.Thread] = []
        self.port = -1
        if config.resume:
            self._load(Path(config.checkpoint_dir) / CHECKPOINT_NAME)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> int:
        handlers = {
            "Join": grpc.unary_unary_rpc_method_handler(self._join),
            "Init": grpc.stream_unary_rpc_method_handler(self._init),
            "Push": grpc.stream_unary_rpc_method_handler(self._push),
            "Fetch": grpc.unary_stream_rpc_method_handler(self._fetch),
            "Watch": grpc.unary_unary_rpc_method_handler(self._watch),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self._heartbeat),
            "Leave": grpc.unary_unary_rpc_method_handler(self._leave),
            "Status": grpc.unary_unary_rpc_method_handler(self._status),
        }
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.config.max_workers),
                                   options=wire.GRPC_SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
        addr = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert:
            self.port = self._server.add_secure_port(
                addr, server_credentials(self.config.tls_cert, self.config.tls_key))
        else:
            self.port = self._server.add_insecure_port(addr)
        if self.port == 0:
            raise RuntimeError(f"could not bind {addr}")
        if self.config.bulk_port is not None:
            ctx = (server_ssl_context(self.config.tls_cert, self.config.tls_key)
                   if self.config.tls_cert else None)
            try:
                self._bulk_server = BulkServer(
                    self.config.host, self.config.bulk_port, self.config.token, self._bulk,
                    max_payload=self.config.max_push_bytes, ssl_context=ctx,
                    on_auth_failure=self._bulk_auth_failed)
            except OSError as e:
                self._server.stop(None)
                raise RuntimeError(f"could not bind the data port {self.config.host}:"
                                   f"{self.config.bulk_port}: {e}") from None
            self.bulk_port = self._bulk_server.port
            self._bulk_server.start()
        for target, name in ((self._timer_loop, "syncer-timer"), (self._ckpt_loop, "syncer-ckpt")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self._server.start()
        log.info("syncer %s listening on %s:%d (data port %s)", self.boot_id, self.config.host,
                 self.port, self.bulk_port if self.bulk_port is not None else "off")
        return self.port

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._timer_cv.notify_all()
            self._ckpt_cv.notify_all()
            self._published_cv.notify_all()
        if self._bulk_server is not None:
            self._bulk_server.close()
        if self._server is not None:
            self._server.stop(grace=0.5).wait(2.0)
        for t in self._threads:
            t.join(timeout=5.0)
        if self.config.checkpoint_dir and self.state is not None:
            with self._lock:
                snap = self._snapshot()
            self._write(snap)
        if self._metrics_f:
            self._metrics_f.close()
            self._metrics_f = None

    def __enter__(self) -> SyncerServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self) -> None:
        if self._server is not None:
            self._server.wait_for_termination()

    @property
    def _durable(self) -> bool:
        return bool(self.config.checkpoint_dir) and self.config.checkpoint_every == 1

    # -- helpers --------------------------------------------------------------------------
    def _event(self, kind: str, **kw) -> None:
        if self._metrics_f:
            rec = {"t_s": round(time.monotonic() - self.started_s, 4), "wall": time.time(),
                   "kind": kind, **kw}
            self._metrics_f.write(json.dumps(rec) + "\n")
            self._metrics_f.flush()

    def _auth(self, ctx: grpc.ServicerContext) -> None:
        md = dict(ctx.invocation_metadata())
        if not check_token(self.config.token, md.get(wire.TOKEN_METADATA)):
            self.rejections[E.AUTH] += 1
            log.warning("rejected call from %s: %s", ctx.peer(), E.AUTH)
            ctx.abort(grpc.StatusCode.UNAUTHENTICATED,
                      f"{E.AUTH}: missing or wrong token (set $DDILOCO_TOKEN or --token-file to "
                      f"the syncer's secret)")

    def _note_reject(self, r: _Reject, who: str) -> None:
        with self._lock:
            self.rejections[r.code] += 1
            self._event("reject", code=r.code, who=who, message=r.message)
        log.warning("%s rejected: %s: %s", who, r.code, r.message)

    def _bulk_auth_failed(self, peer: str) -> None:
        with self._lock:
            self.rejections[E.AUTH] += 1
        log.warning("rejected data connection from %s: %s", peer, E.AUTH)

    def _fail(self, ctx: grpc.ServicerContext, r: _Reject, who: str) -> None:
        self._note_reject(r, who)
        ctx.abort(r.status, f"{r.code}: {r.message}")

    @staticmethod
    def _parse(req: bytes) -> tuple[dict, memoryview]:
        try:
            return wire.unpack(req)
        except ValueError as e:
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME, str(e)) from None

    @staticmethod
    def _int(h: dict, key: str, default: int | None = None) -> int:
        v = h.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool):
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME,
                          f"header field {key!r} must be an integer, got {v!r}")
        return v

    def _require_ready(self) -> SyncerState:
        if self.state is None:
            raise _Reject(grpc.StatusCode.FAILED_PRECONDITION, E.NOT_READY,
                          "the syncer has no model yet: Join, then Init with the initial model")
        return self.state

    def _require_live(self, m: int, incarnation: int) -> SyncerState:
        st = self._require_ready()
        info = self._learners.get(m)
        if m not in st.live or info is None or info.incarnation != incarnation:
            raise _Reject(grpc.StatusCode.FAILED_PRECONDITION, E.UNKNOWN_LEARNER,
                          f"learner {m} (incarnation {incarnation}) is not joined or was declared "
                          f"dead; Join again")
        return st

    def _encode_down(self, params: list[torch.Tensor]) -> list[memoryview]:
        """The downlink bytes of a fragment, as pieces to send one after the other (fp32:
        views of the published tensors themselves, which are never written again)."""
        return get_codec(self.config.downlink_codec).encode_many(params)

    def _publish(self, p: int, version: int, params: list[torch.Tensor]) -> None:
        self._pub[p] = (version, self._encode_down(params))

    def _on_merged(self, mg: Merged, merge_s: float) -> None:
        """Called under the lock for every Merged the state machine returns."""
        for m, seq in zip(mg.learners, mg.seqs):
            self._merged_seq.setdefault(m, {})[mg.fragment] = seq
        self.counters["merges"] += 1
        fetch_s = [i.report.get("fetch_s", 0.0) for i in self._learners.values()
                   if i.state == "live" and i.report.get("fetch_s") is not None]
        self.state.observe_sync_s(merge_s + (sum(fetch_s) / len(fetch_s) if fetch_s else 0.0))
        if self._metrics_f:
            self._event("merge", fragment=mg.fragment, version=mg.version,
                        learners=list(mg.learners), weights=[round(w, 3) for w in mg.weights],
                        reason=mg.reason, merge_s=round(merge_s, 6))
        self._dirty_merges += 1
        if self._durable:
            self._unpublished[mg.fragment] = mg
            self._ckpt_requested = True
            self._ckpt_cv.notify_all()
        else:
            self._publish(mg.fragment, mg.version, mg.params)
            # copy on write: watchers hold the old mapping; only these learners' entries moved
            self._merged_seq_pub = {**self._merged_seq_pub,
                                    **{m: dict(self._merged_seq[m]) for m in mg.learners}}
            self._published_cv.notify_all()
            if self.config.checkpoint_dir and self._dirty_merges >= self.config.checkpoint_every:
                self._ckpt_requested = True
                self._ckpt_cv.notify_all()

    def _handle_merges(self, merged: list[Merged], t0: float) -> None:
        for mg in merged:
            self._on_merged(mg, time.monotonic() - t0)
        self._followups(t0)

    def _followups(self, t0: float) -> None:
        """Decisions on rounds that filled while their fragment's merge ran unlocked."""
        for p, out in self.state.take_followups():
            if isinstance(out, Merged):
                self._on_merged(out, time.monotonic() - t0)
            else:
                self._add_timer(out.at_s, p)

    @contextlib.contextmanager
    def _unlocked(self):
        """The state machine's merge arithmetic runs with the lock released, so merges of
        different fragments (and every other call) proceed meanwhile. Its wall and CPU time
        (of the merging thread) are counted here."""
        self._lock.release()
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall, cpu = time.perf_counter() - t_wall, time.thread_time() - t_cpu
            self._lock.acquire()
            self.merge_s += wall
            self.merge_cpu_s += cpu

    def _add_timer(self, at_s: float, p: int) -> None:
        heapq.heappush(self._timers, (at_s, p))
        self._timer_cv.notify_all()

    # -- background threads ----------------------------------------------------------------
    def _timer_loop(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                wait = 0.25
                if self._timers:
                    wait = min(wait, max(0.0, self._timers[0][0] - now))
                if wait > 0:
                    self._timer_cv.wait(wait)
                if self._closed or self.state is None:
                    continue
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    _, p = heapq.heappop(self._timers)
                    t0 = time.monotonic()
                    out = self.state.on_timer(p, now)
                    if isinstance(out, Merged):
                        self._on_merged(out, time.monotonic() - t0)
                    elif out is not None:
                        self._add_timer(out.at_s, p)
                    self._followups(t0)
                for m in sorted(self.state.live):
                    info = self._learners.get(m)
                    if info is not None and now - info.last_hb_s > self.config.heartbeat_timeout_s:
                        info.state = "dead"
                        log.warning("[learner %d] no heartbeat for %.1f s: declared dead", m,
                                    now - info.last_hb_s)
                        self._event("dead", learner=m)
                        t0 = time.monotonic()
                        self._handle_merges(self.state.leave(m, now), t0)

    def _snapshot(self) -> dict:
        return {
            "format": 1,
            "spec": self.spec,
            "state": self.state.state_dict(),
            "pub_versions": [v for v, _ in self._pub],
            "merged_seq": {m: dict(d) for m, d in self._merged_seq.items()},
            "incarnations": dict(self._incarnations),
            "counters": dict(self.counters),
            "syncer_config": asdict(self.config.syncer),
            "saved_wall": time.time(),
        }

    def _write(self, snap: dict) -> None:
        t0 = time.monotonic()
        n = save_atomic(snap, Path(self.config.checkpoint_dir) / CHECKPOINT_NAME)
        self.counters["checkpoints"] += 1
        self.counters["checkpoint_bytes"] = n
        self.counters["checkpoint_s_total"] = self.counters.get("checkpoint_s_total", 0) + (
            time.monotonic() - t0)

    def _ckpt_loop(self) -> None:
        if not self.config.checkpoint_dir:
            return
        while True:
            with self._lock:
                while not self._ckpt_requested and not self._closed:
                    self._ckpt_cv.wait(1.0)
                if self._closed:
                    return
                self._ckpt_requested = False
                self._dirty_merges = 0
                snap = self._snapshot()
                to_publish = dict(self._unpublished)
                self._unpublished.clear()
                merged_seq = {m: dict(d) for m, d in self._merged_seq.items()}
            try:
                self._write(snap)
            except OSError as e:  # disk trouble is an event, not a crash; retry next merge
                log.error("checkpoint write failed: %s", e)
                with self._lock:
                    self._unpublished = {**to_publish, **self._unpublished}
                    self.counters["checkpoint_errors"] += 1
                continue
            with self._lock:
                for p, mg in to_publish.items():
                    if mg.version > self._pub[p][0]:
                        self._publish(p, mg.version, mg.params)
                self._merged_seq_pub = merged_seq
                self._published_cv.notify_all()

    def _load(self, path: Path) -> None:
        ck = load_checkpoint(path)
        self._setup(ck["spec"])
        self.state.load_state_dict(ck["state"])
        for p in range(len(self._pub)):
            self._publish(p, self.state.version(p), self.state.frags[p].theta)
        self._merged_seq = {int(m): {int(p): int(s) for p, s in d.items()}
                            for m, d in ck["merged_seq"].items()}
        self._merged_seq_pub = {m: dict(d) for m, d in self._merged_seq.items()}
        self._incarnations = {int(m): int(v) for m, v in ck["incarnations"].items()}
        self.counters.update(ck.get("counters", {}))
        self.counters["resumes"] += 1
        self._event("resume", versions=self.state.versions(), merges=self.state.merges)
        log.info("resumed from %s: versions %s, %d merges", path, self.state.versions(),
                 self.state.merges)

    def _setup(self, spec: dict) -> None:
        check_spec(spec)
        frag = fragmentation_from_spec(spec)
        initial = {n: torch.zeros(s) for n, s in zip(spec["names"], spec["shapes"])}
        self.state = SyncerState(frag, initial, self.config.syncer)
        self.state.unlocked = self._unlocked
        self.spec = spec
        self._fp = spec_fingerprint(spec)
        self._pub = [(0, []) for _ in range(frag.P)]
        shape = dict(zip(spec["names"], (tuple(s) for s in spec["shapes"])))
        self._shapes = [[shape[n] for n in f.names] for f in frag.fragments]  # per fragment

    # -- handlers -------------------------------------------------------------------------
    def _join(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        self._auth(ctx)
        try:
            h, _ = self._parse(req)
            m = self._int(h, "learner")
            if m < 0:
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME, "learner must be >= 0")
            inc = self._int(h, "incarnation", -1)
            with self._lock:
                if self.state is None:
                    return wire.pack({"need_init": True, "boot_id": self.boot_id})
                if h.get("fingerprint") not in (None, self._fp):
                    raise _Reject(grpc.StatusCode.FAILED_PRECONDITION, E.SPEC,
                                  f"model/fragmentation spec {h.get('fingerprint')} differs from "
                                  f"the syncer's {self._fp}: same model, P and strategy everywhere")
                if inc < 0 or inc != self._incarnations.get(m):
                    inc = self._incarnations.get(m, 0) + 1
                    self._incarnations[m] = inc
                info = self._learners.setdefault(m, _LearnerInfo())
                info.incarnation, info.last_hb_s, info.state = inc, time.monotonic(), "live"
                info.joins += 1
                self.state.join(m)
                self._event("join", learner=m, incarnation=inc, host=h.get("host"),
                            pid=h.get("pid"))
                log.info("[learner %d] joined (incarnation %d)", m, inc)
                return wire.pack({
                    "need_init": False, "boot_id": self.boot_id, "incarnation": inc,
                    "versions": [v for v, _ in self._pub], "spec": self.spec,
                    "fingerprint": self._fp, "downlink_codec": self.config.downlink_codec,
                    "history": self.config.syncer.history,
                    "merged_seq": self._merged_seq_pub.get(m, {}),
                    "step_budget": self.config.step_budget, "stop": self.budget_spent,
                    "bulk_port": self.bulk_port,
                })
        except _Reject as r:
            self._fail(ctx, r, "join")

    def _init(self, it, ctx: grpc.ServicerContext) -> bytes:
        self._auth(ctx)
        try:
            first = next(it, None)
            if first is None:
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME, "empty Init stream")
            h, payload = self._parse(first)
            spec = h.get("spec")
            try:
                check_spec(spec)
                frag = fragmentation_from_spec(spec)
            except (ValueError, TypeError) as e:
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SPEC, str(e)) from None
            numels = [math.prod(s) for s in spec["shapes"]]
            expected = 4 * sum(numels)
            if expected > self.config.max_push_bytes * max(1, frag.P):
                raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, E.OVERSIZE,
                              f"initial model of {expected} bytes exceeds the limit")
            buf = self._read_stream(payload, it, expected)
            params = {}
            off = 0
            for n, s, k in zip(spec["names"], spec["shapes"], numels):
                params[n] = torch.frombuffer(buf, dtype=torch.float32, count=k,
                                             offset=off).view(s).clone()
                off += 4 * k
            if not all(all_finite(t) for t in params.values()):
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.NONFINITE,
                              "initial model has NaN/inf values")
            with self._lock:
                if self.state is not None:
                    return wire.pack({"accepted": False, "fingerprint": self._fp})
                self._setup(spec)
                self.state = SyncerState(frag, params, self.config.syncer)
                self.state.unlocked = self._unlocked
                for p in range(frag.P):
                    self._publish(p, 0, self.state.frags[p].theta)
                log.info("initialised by learner %s: %d tensors, P=%d, %d bytes", h.get("learner"),
                         len(numels), frag.P, expected)
                self._event("init", learner=h.get("learner"), nbytes=expected)
                return wire.pack({"accepted": True, "fingerprint": self._fp})
        except _Reject as r:
            self._fail(ctx, r, "init")

    def _read_stream(self, payload: memoryview, it, nbytes: int) -> bytearray:
        buf = bytearray(payload)
        if len(buf) > nbytes:
            raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, E.OVERSIZE,
                          f"payload exceeds its declared {nbytes} bytes")
        for frame in it:
            _, more = self._parse(frame)
            if len(buf) + len(more) > nbytes:
                raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, E.OVERSIZE,
                              f"payload exceeds its declared {nbytes} bytes")
            buf += more
        if len(buf) != nbytes:
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SIZE,
                          f"payload has {len(buf)} bytes, header declared {nbytes}")
        self.counters["bytes_in"] += len(buf)
        return buf

    @staticmethod
    def _push_who(h: dict) -> str:
        return f"[learner {h.get('learner')} step {h.get('step')}] push of fragment {h.get('fragment')}"

    def _push_check(self, h: dict) -> _PushCheck:
        """Validate a push header before its payload is read (either transport)."""
        m, p = self._int(h, "learner"), self._int(h, "fragment")
        seq, base = self._int(h, "seq"), self._int(h, "base_version")
        c_steps, c_tokens = self._int(h, "c_steps"), self._int(h, "c_tokens")
        nbytes, inc = self._int(h, "nbytes"), self._int(h, "incarnation")
        try:
            codec = get_codec(str(h.get("codec")))
        except ValueError as e:
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.CODEC, str(e)) from None
        if nbytes > self.config.max_push_bytes:
            raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, E.OVERSIZE,
                          f"declared payload {nbytes} bytes exceeds max_push_bytes "
                          f"{self.config.max_push_bytes}")
        with self._lock:
            st = self._require_live(m, inc)
            if not 0 <= p < st.fragmentation.P:
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.FRAGMENT,
                              f"fragment {p} out of range [0, {st.fragmentation.P})")
            fr = st.fragmentation.fragments[p]
            shapes = self._shapes[p]
        numels = h.get("numels")
        if numels != list(fr.numels):
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SHAPE,
                          f"fragment {p} has tensors of {list(fr.numels)} elements, push "
                          f"declares {numels}")
        expected = sum(codec.nbytes(n) for n in fr.numels)
        if nbytes != expected:
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SIZE,
                          f"{codec.name} payload of fragment {p} must be {expected} bytes, "
                          f"push declares {nbytes}")
        return _PushCheck(m=m, p=p, inc=inc, seq=seq, base=base, c_steps=c_steps,
                          c_tokens=c_tokens, nbytes=nbytes, codec=codec, names=fr.names,
                          numels=fr.numels, shapes=shapes, delta=bool(h.get("delta", False)),
                          who=self._push_who(h))

    def _push_apply(self, pc: _PushCheck, buf: bytearray) -> dict:
        """Decode a validated push's payload and hand it to the state machine."""
        t_wall = time.perf_counter()
        codec, p = pc.codec, pc.p
        params, off = [], 0
        for k, shape in zip(pc.numels, pc.shapes):
            nb = codec.nbytes(k)
            params.append(codec.decode(memoryview(buf)[off:off + nb], k).view(shape))
            off += nb
        if pc.delta:
            with self._lock:
                ref = self._require_ready().published(p, pc.base)
                ref = None if ref is None else [t.clone() for t in ref]
            if ref is None:
                raise _Reject(grpc.StatusCode.FAILED_PRECONDITION, E.BASE,
                              f"delta push against version {pc.base} of fragment {p}, which the "
                              f"syncer no longer holds (raise --history or send parameters)")
            params = [r.add_(d) for r, d in zip(ref, params)]
        # fp32 pushes: one check of the whole payload, tensor by tensor only to name a culprit
        if not (codec.name == "fp32" and not pc.delta
                and all_finite(codec.decode(memoryview(buf), sum(pc.numels)))):
            for name, t in zip(pc.names, params):
                if not all_finite(t):
                    raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.NONFINITE,
                                  f"tensor {name} has NaN/inf values")
        m, seq = pc.m, pc.seq
        c = Contribution(learner=m, fragment=p, params=params, c_steps=pc.c_steps,
                         c_tokens=pc.c_tokens, base_version=pc.base, seq=seq)
        with self._lock:
            st = self._require_live(m, pc.inc)
            t0 = time.monotonic()
            res = st.submit(c, t0, finite_checked=True)
            self.counters["push_apply_s"] += time.perf_counter() - t_wall
            self.counters[f"push_{res.status.value}"] += 1
            if res.status is Status.INVALID:
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.INVALID, res.message)
            if res.status is Status.UNKNOWN_LEARNER:
                raise _Reject(grpc.StatusCode.FAILED_PRECONDITION, E.UNKNOWN_LEARNER,
                              res.message)
            if res.status is Status.ACCEPTED:
                if res.merged is not None:
                    self._on_merged(res.merged, time.monotonic() - t0)
                elif res.wake_at_s is not None:
                    self._add_timer(res.wake_at_s, p)
                self._followups(t0)
            elif res.status is not Status.DUPLICATE:
                self._event("push-" + res.status.value, learner=m, fragment=p,
                            message=res.message)
                log.info("%s: %s (%s)", pc.who, res.status.value, res.message)
        return {"status": res.status.value, "message": res.message,
                "target_version": res.target_version}

    def _push(self, it, ctx: grpc.ServicerContext) -> bytes:
        self._auth(ctx)
        who = "push"
        try:
            first = next(it, None)
            if first is None:
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME, "empty Push stream")
            h, payload = self._parse(first)
            who = self._push_who(h)
            pc = self._push_check(h)
            return wire.pack(self._push_apply(pc, self._read_stream(payload, it, pc.nbytes)))
        except _Reject as r:
            self._fail(ctx, r, who)

    def _fetch_items(self, h: dict) -> list[tuple[int, int, list[memoryview], list[int]]]:
        """(fragment, version, downlink byte pieces, numels) of the published fragments asked
        for."""
        with self._lock:
            st = self._require_ready()
            want = h.get("fragments")
            if want is None:
                want = list(range(st.fragmentation.P))
            if not isinstance(want, list) or not all(
                    isinstance(p, int) and not isinstance(p, bool) and 0 <= p < st.fragmentation.P
                    for p in want):
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.FRAGMENT,
                              f"fragments must be a list of ints in [0, {st.fragmentation.P})")
            items = [(p, *self._pub[p], list(st.fragmentation.fragments[p].numels))
                     for p in want]
            self.counters["bytes_out"] += sum(len(b) for _, _, d, _ in items for b in d)
        return items

    def _fetch(self, req: bytes, ctx: grpc.ServicerContext):
        self._auth(ctx)
        try:
            h, _ = self._parse(req)
            items = self._fetch_items(h)
        except _Reject as r:
            self._fail(ctx, r, "fetch")
            return
        for p, version, pieces, numels in items:
            data = b"".join(pieces)
            yield from wire.chunks({"fragment": p, "version": version, "nbytes": len(data),
                                    "codec": self.config.downlink_codec, "numels": numels}, data)

    def _bulk(self, op: str, h: dict, plen: int, read_payload) -> tuple[dict, list[bytes]]:
        """Requests on the data port (``ddiloco.runtime.transport.bulk``): push and fetch."""
        who = f"bulk {op!r}"
        try:
            if op == "push":
                who = self._push_who(h)
                pc = self._push_check(h)
                if plen != pc.nbytes:
                    raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SIZE,
                                  f"payload has {plen} bytes, header declared {pc.nbytes}")
                buf = read_payload()
                self.counters["bytes_in"] += len(buf)
                return self._push_apply(pc, buf), []
            if op == "fetch":
                if plen:
                    raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME,
                                  "a fetch request carries no payload")
                items = self._fetch_items(h)
                return ({"items": [{"fragment": p, "version": v,
                                    "nbytes": sum(len(b) for b in d),
                                    "codec": self.config.downlink_codec, "numels": n}
                                   for p, v, d, n in items]},
                        [b for _, _, d, _ in items for b in d])
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME,
                          f"unknown bulk op {op!r} (push, fetch)")
        except _Reject as r:
            self._note_reject(r, who)
            raise BulkReject(r.status, f"{r.code}: {r.message}") from None

    def _watch(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        self._auth(ctx)
        try:
            h, _ = self._parse(req)
            m = self._int(h, "learner")
            cursor = h.get("cursor")
            timeout_s = min(max(float(h.get("timeout_s", 1.0)), 0.0), 30.0)
            deadline = time.monotonic() + timeout_s
            with self._lock:
                self._require_ready()
                while (not self._closed and [v for v, _ in self._pub] == cursor
                       and self._merged_seq_pub.get(m, {}) == {
                           int(k): v for k, v in (h.get("merged_seq") or {}).items()}):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._published_cv.wait(left)
                return wire.pack({"versions": [v for v, _ in self._pub], "boot_id": self.boot_id,
                                  "merged_seq": self._merged_seq_pub.get(m, {})})
        except _Reject as r:
            self._fail(ctx, r, "watch")

    def _heartbeat(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        self._auth(ctx)
        try:
            h, _ = self._parse(req)
            m, inc = self._int(h, "learner"), self._int(h, "incarnation")
            with self._lock:
                st = self._require_ready()
                info = self._learners.get(m)
                if m not in st.live or info is None or info.incarnation != inc:
                    return wire.pack({"rejoin": True, "boot_id": self.boot_id})
                info.last_hb_s = time.monotonic()
                rep = h.get("report") or {}
                if isinstance(rep, dict):
                    info.report = rep
                    step_s = rep.get("step_s")
                    if isinstance(step_s, (int, float)) and step_s > 0:
                        st.observe_step_s(float(step_s))
                    self._count_steps(m, rep)
                return wire.pack({"rejoin": False, "boot_id": self.boot_id,
                                  "versions": [v for v, _ in self._pub], "live": len(st.live),
                                  "stop": self.budget_spent})
        except _Reject as r:
            self._fail(ctx, r, "heartbeat")

    def _leave(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        self._auth(ctx)
        try:
            h, _ = self._parse(req)
            m, inc = self._int(h, "learner"), self._int(h, "incarnation")
            with self._lock:
                st = self._require_ready()
                info = self._learners.get(m)
                if info is not None and info.incarnation == inc:
                    info.state = "left"
                    if isinstance(h.get("report"), dict):
                        info.report = h["report"]
                        self._count_steps(m, info.report)
                    self._event("leave", learner=m)
                    t0 = time.monotonic()
                    self._handle_merges(st.leave(m, t0), t0)
                return wire.pack({"ok": True})
        except _Reject as r:
            self._fail(ctx, r, "leave")

    def _count_steps(self, m: int, rep: dict) -> None:
        """Track the global step budget from a learner's report (caller holds the lock).
        A learner's total is its latest report (``global_step``, counted over its restarts,
        else ``step``): a restarted learner that resumes from an earlier step lowers it."""
        n = rep.get("global_step", rep.get("step"))
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
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
                    "state": info.state, "incarnation": info.incarnation, "joins": info.joins,
                    "last_heartbeat_age_s": round(now - info.last_hb_s, 3),
                    "report": info.report,
                    "syncer_ledger": vars_of(led) if led else {},
                }
            pol = st.policy if st else None
            return {
                "boot_id": self.boot_id, "uptime_s": round(now - self.started_s, 3),
                "initialised": st is not None,
                "versions": [v for v, _ in self._pub],
                "merges": st.merges if st else 0,
                "live": sorted(st.live) if st else [],
                "learners": learners,
                "counters": {**self.counters,
                             "merge_s": self.merge_s, "merge_cpu_s": self.merge_cpu_s},
                "rejections": dict(self.rejections),
                "mean_quorum": (sum(st.quorum_sizes) / len(st.quorum_sizes)
                                if st and st.quorum_sizes else None),
                "xi_step_s": pol.xi_step.value if pol else None,
                "xi_quorum_s": pol.xi_quorum.value if pol else None,
                "xi_sync_s": pol.xi_sync.value if pol else None,
                "grace_s": pol.grace_s() if pol else None,
                "fingerprint": self._fp,
                "step_budget": self.config.step_budget,
                "steps_done": sum(self._steps_done.values()),
                "budget_spent": self.budget_spent,
            }

    def _status(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        self._auth(ctx)
        return wire.pack(self.status())
