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

The server holds the model (the state machine, its spec and fingerprint) and owns six
parts, each with its own state: ``control`` (``Control``: the learners, their sessions and
reports, the run's slot clock and step budget; Join, Watch, Heartbeat, Leave, Status),
``initial`` (``Initial``: Init, the initial model), ``data`` (``Data``: pushes and
fetches on gRPC and on the data port), ``publication`` (``Publication``: what learners
see, the delta-coded downlink's chains, merge sequence numbers), ``durability``
(``Durability``: the checkpoint thread, publication once durable, resume) and
``liveness`` (``Liveness``: the timer thread, with its grace deadlines and heartbeat
timeouts). Parts act on the model and on the rest of the server through what it gives
them. The server takes every merge the state machine returns to ``Durability``
(``_on_merged``), and a checkpoint is ``durability.snapshot`` of its parts.

Slot clock: the syncer starts the run's clock (its epoch, Unix time) when it receives the
initial model, and once the learners report step times it announces the slot length (their
mean measured step time) on Join and Heartbeat, re-timed when it drifts by more than 10%.
Learners with the time-driven schedule send fragment p in the same slots, so the grace
window gathers them into one merge. The clock is checkpointed with the state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import torch

from ddiloco.algorithm.syncer_state import Merged, SyncerState
from ddiloco.metrics.sinks import open_sinks
from ddiloco.runtime.syncer.allocator import tune_malloc
from ddiloco.runtime.syncer.checkpoint import CHECKPOINT_NAME, remove_stale_temps
from ddiloco.runtime.syncer.common import Reject
from ddiloco.runtime.syncer.control import Control
from ddiloco.runtime.syncer.data import Data
from ddiloco.runtime.syncer.durability import Durability, snapshot
from ddiloco.runtime.syncer.initial import Initial
from ddiloco.runtime.syncer.liveness import Liveness
from ddiloco.runtime.syncer.publication import Publication
from ddiloco.runtime.syncer.run_config import SyncerServerConfig
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.auth import check_token, server_credentials, server_ssl_context
from ddiloco.runtime.transport.bulk import BulkServer
from ddiloco.runtime.transport.spec import check_spec, fragmentation_from_spec, spec_fingerprint
from ddiloco.runtime.transport.wire import ErrorCode as E

if TYPE_CHECKING:
    from ddiloco.runtime.observe import SyncerObserver

__all__ = ["SyncerServerConfig", "SyncerServer"]

log = logging.getLogger("ddiloco.syncer")

DATA_PORT_FILE = "data_port"
"""In the checkpoint directory: the data port of the last run, bound again on restart."""


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
        self.state: SyncerState | None = None
        """The state machine, once the model is set up (Init or a resume)."""
        self.spec: dict | None = None
        self._fp = ""
        self._bulk_slots = threading.BoundedSemaphore(config.max_workers - config.control_reserve)
        self._closed = False
        self.counters: Counter = Counter()
        self.rejections: Counter = Counter()
        self.publication = Publication(
            self._lock,
            self.counters,
            downlink_codec=config.downlink_codec,
            downlink_delta=config.downlink_delta,
            max_staleness=config.syncer.max_staleness,
            owns=self._owns,
        )
        """The published fragments, the delta-coded downlink's chains, merge sequence numbers."""
        self.durability = Durability(
            self._lock,
            self.counters,
            self.publication,
            checkpoint_dir=config.checkpoint_dir,
            checkpoint_every=config.checkpoint_every,
            checkpoint_keep=config.checkpoint_keep,
            closed=lambda: self._closed,
            snapshot=self._snapshot,
        )
        """The checkpoint thread: checkpoints, publication once durable, resume."""
        self._metrics = open_sinks(
            (("jsonl",) if config.metrics_path else ()) + config.metrics_sinks,
            config.metrics_dir or Path(config.metrics_path or ".").parent,
            name="syncer",
            jsonl_path=config.metrics_path,
            flush_rows=True,
        )
        self._server: grpc.Server | None = None
        self._bulk_server: BulkServer | None = None
        self.bulk_port: int | None = None
        self._observer: SyncerObserver | None = None
        self.http_port: int | None = None
        self._threads: list[threading.Thread] = []
        self.port = -1
        self.control = Control(
            self._lock,
            config,
            self.publication,
            boot_id=self.boot_id,
            started_s=self.started_s,
            state=lambda: self.state,
            require_ready=self._require_ready,
            spec=lambda: self.spec,
            fingerprint=lambda: self._fp,
            bulk_port=lambda: self.bulk_port,
            closed=lambda: self._closed,
            depart=self._depart,
            counters=self._status_counters,
            rejections=self.rejections,
            event=self._event,
            auth=self._auth,
            fail=self._fail,
            bulk_slots=self._bulk_slots,
        )
        """The learners, the run's clock and step budget; Join, Watch, Heartbeat, Leave,
        Status."""
        self.fence: Any = None
        """A replicated run's leader: ``ha.Fence``, set before ``start()`` (every reply
        checked against the lease and stamped with the epoch); None otherwise."""
        self.liveness = Liveness(
            self._lock,
            config.heartbeat_timeout_s,
            closed=lambda: self._closed,
            ready=lambda: self.state is not None,
            tick=self.publication.retry_failed,
            fire=self._fire_timer,
            live=lambda: self.state.live if self.state is not None else (),
            last_heartbeat_s=self.control.last_heartbeat_s,
            declare_dead=self.control.declare_dead,
        )
        """The timer thread: grace deadlines and heartbeat timeouts."""
        self.data = Data(
            self._lock,
            config,
            self.counters,
            self.publication,
            require_ready=self._require_ready,
            require_live=self.control.require_live,
            require_session=self.control.require_session,
            require_owned=self._require_owned,
            owns=self._owns,
            on_merged=self._on_merged,
            followups=self._followups,
            add_timer=self.liveness.add_timer,
            event=self._event,
            note_reject=self._note_reject,
            auth=self._auth,
            fail=self._fail,
            bulk_slots=self._bulk_slots,
        )
        """Pushes and fetches, on gRPC and on the data port."""
        self.initial = Initial(
            self._lock,
            config,
            self.data,
            self.publication,
            state=lambda: self.state,
            setup=self._setup,
            fingerprint=lambda: self._fp,
            owns=self._owns,
            event=self._event,
            auth=self._auth,
            fail=self._fail,
            bulk_slots=self._bulk_slots,
        )
        """The initial model: Init, and sharded islands' uploads."""
        if config.checkpoint_dir:
            remove_stale_temps(config.checkpoint_dir)
        if config.resume:
            assert config.checkpoint_dir  # SyncerServerConfig refuses a resume without one
            self._resume(Path(config.checkpoint_dir) / CHECKPOINT_NAME)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> int:
        handlers = {
            "Join": grpc.unary_unary_rpc_method_handler(self.control.join),
            "Init": grpc.stream_unary_rpc_method_handler(self.initial.init),
            "Push": grpc.stream_unary_rpc_method_handler(self.data.push),
            "Fetch": grpc.unary_stream_rpc_method_handler(self.data.fetch),
            "Watch": grpc.unary_unary_rpc_method_handler(self.control.watch),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self.control.heartbeat),
            "Leave": grpc.unary_unary_rpc_method_handler(self.control.leave),
            "Status": grpc.unary_unary_rpc_method_handler(self.control.status_call),
        }
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.config.max_workers),
            options=wire.GRPC_SERVER_OPTIONS,
            interceptors=() if self.fence is None else (self.fence.interceptor(),),
        )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(wire.SERVICE, handlers),)
        )
        addr = f"{self.config.host}:{self.config.port}"
        cert, key = self.config.tls_cert, self.config.tls_key  # both or neither
        try:
            if cert and key:
                self.port = self._server.add_secure_port(addr, server_credentials(cert, key))
            else:
                self.port = self._server.add_insecure_port(addr)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise RuntimeError(
                f"could not bind {addr}: the port is in use (another syncer?) "
                f"or the address is not this host's; choose another port "
                f"(0: a free one) or stop the process holding it"
            )
        if self.config.bulk_port is not None:
            self._start_data_port(self.config.bulk_port)
        self._threads.append(self.liveness.start())
        self._threads.append(self.durability.start())
        self._server.start()
        cfg = self.config
        if cfg.http_port is not None:
            from ddiloco.runtime.observe import serve_syncer

            try:
                self._observer = obs = serve_syncer(
                    self.status,
                    self._ready,
                    host=cfg.host,
                    port=cfg.http_port,
                    token=cfg.token,
                    source=f"syncer {cfg.host}:{self.port}",
                    ssl_context=(
                        server_ssl_context(cfg.tls_cert, cfg.tls_key)
                        if cfg.tls_cert and cfg.tls_key
                        else None
                    ),
                )
            except OSError as e:
                self.close()
                raise RuntimeError(
                    f"could not bind the HTTP port {self.config.host}:{self.config.http_port}: {e}"
                ) from None
            self.http_port = obs.port
        log.info(
            "syncer %s listening on %s:%d (data port %s)",
            self.boot_id,
            self.config.host,
            self.port,
            self.bulk_port if self.bulk_port is not None else "off",
        )
        return self.port

    def status(self) -> dict:
        """A JSON-able snapshot: learners, versions, ledger, counters, policy timings
        (``Control.status``)."""
        return self.control.status()

    def _status_counters(self) -> dict:
        """The counters a status shows (lock held): the server's, the merges' time, and
        the state's and the push room's."""
        st = self.state
        return {
            **self.counters,
            "merge_s": self.merge_s,
            "merge_cpu_s": self.merge_cpu_s,
            "clipped_pushes": st.clipped_pushes if st else 0,
            "carried_pushes": st.carried_pushes if st else 0,
            "pending_bytes": st.pending_bytes() if st else 0,
            "push_room_waits": self.data.push_room.waits,
        }

    def _ready(self) -> tuple[bool, str]:
        """``/readyz``: whether the syncer serves a global model, and why not."""
        if self._closed:
            return False, "shutting down"
        if self.state is None:
            return False, "no model yet (waiting for the first learner's Init)"
        return True, "holds a global model"

    def _start_data_port(self, bulk_port: int) -> None:
        """Bind the data port (``bulk_port``: the configured one). With a checkpoint
        directory and ``bulk_port == 0`` the port first bound is remembered there
        (``data_port``) and taken again after a restart, so learners keep reaching it across
        resumes (any free port if it is taken by then)."""
        cfg = self.config
        ctx = (
            server_ssl_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
        )
        remembered = Path(cfg.checkpoint_dir) / DATA_PORT_FILE if cfg.checkpoint_dir else None
        ports = [bulk_port]
        if bulk_port == 0 and remembered is not None and remembered.is_file():
            with contextlib.suppress(ValueError, OSError):
                ports.insert(0, int(remembered.read_text()))
        bulk = None
        for i, port in enumerate(ports):
            try:
                bulk = BulkServer(
                    cfg.host,
                    port,
                    cfg.token,
                    self.data.bulk if self.fence is None else self.fence.bulk(self.data.bulk),
                    max_payload=cfg.max_push_bytes,
                    ssl_context=ctx,
                    on_auth_failure=self._bulk_auth_failed,
                    on_refused=self._bulk_refused,
                    limits=cfg.data_limits,
                    session_of=self.control.session_of,
                )
                break
            except OSError as e:
                if i + 1 < len(ports):
                    log.warning(
                        "data port %d of the previous run is taken (%s): binding "
                        "another; learners learn it when they rejoin",
                        port,
                        e,
                    )
                    continue
                if self._server is not None:
                    self._server.stop(None)
                raise RuntimeError(f"could not bind the data port {cfg.host}:{port}: {e}") from None
        assert bulk is not None  # bound, or the loop raised
        self._bulk_server = bulk
        self.bulk_port = bulk.port
        if remembered is not None and bulk_port == 0:
            with contextlib.suppress(OSError):
                remembered.parent.mkdir(parents=True, exist_ok=True)
                remembered.write_text(str(self.bulk_port))
        bulk.start()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.liveness.wake()
            self.durability.wake()
            self.publication.cv.notify_all()
        if self._observer is not None:
            self._observer.close()
        if self._bulk_server is not None:
            self._bulk_server.close()
        if self._server is not None:
            self._server.stop(grace=0.5).wait(2.0)
        for t in self._threads:
            t.join(timeout=5.0)
        if self.config.checkpoint_dir and self.state is not None:
            with self._lock:
                snap = self._snapshot()
            try:
                self.durability.write(snap)
            except OSError as e:  # disk full at shutdown: the last durable checkpoint stays
                log.error(
                    "final checkpoint not written: %s (the last durable checkpoint "
                    "stays; no published version is lost)",
                    e,
                )
        self._metrics.close()

    def __enter__(self) -> SyncerServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self) -> None:
        if self._server is not None:
            self._server.wait_for_termination()

    # -- the model, merges, checkpoints ----------------------------------------------------
    def _setup(
        self, spec: dict, initial: dict[str, torch.Tensor] | None = None, copy: bool = True
    ) -> SyncerState:
        """The state for ``spec``: from ``initial``, or zeros that a resume replaces. With
        ``copy`` (views of one received buffer) each tensor is copied into its own memory,
        one at a time, so that a merge frees the one it replaces; the buffer goes when the
        caller returns. Without, the state takes the tensors themselves (each already in its
        own memory). A shard holds only the fragments it owns."""
        self.state = None  # let an earlier state go before the next is built
        check_spec(spec)
        frag = fragmentation_from_spec(spec)
        owned = {p for p in range(frag.P) if self._owns(p)}
        if initial is None:
            shapes = dict(zip(spec["names"], spec["shapes"]))
            initial = {n: torch.zeros(shapes[n]) for p in owned for n in frag.fragments[p].names}
            copy = False
        else:
            initial = {n: initial[n] for p in owned for n in frag.fragments[p].names}
        self.state = SyncerState(frag, initial, self.config.syncer, owned=owned, copy=copy)
        self.state.unlocked = self._unlocked
        self.spec = spec
        self._fp = spec_fingerprint(spec)
        self.control.start_epoch()
        self.publication.reset(frag.P)
        shape = dict(zip(spec["names"], (tuple(s) for s in spec["shapes"])))
        self.data.shapes = [[shape[n] for n in f.names] for f in frag.fragments]
        return self.state

    def _snapshot(self) -> dict:
        """What a checkpoint holds (``durability.snapshot``; caller holds the lock)."""
        assert self.state is not None
        return snapshot(
            self.state,
            self.spec,
            self.publication,
            syncer_config=self.config.syncer,
            counters=self.counters,
            learners=self.control.learners,
            incarnations=self.control.incarnations,
            steps_done=self.control.steps_done,
            epoch_s=self.control.epoch_s,
            clock=self.control.clock,
            run_started_wall=self.control.run_started_wall,
        )

    def _resume(self, path: Path) -> None:
        """Load checkpoint ``path`` (or the newest valid one kept): the state and the
        publication, then the learners, their steps, the clock and the ledger."""
        r = self.durability.load(path, self._setup)
        assert self.state is not None
        self.control.restore(r)
        self._event("resume", versions=self.state.versions(), merges=self.state.merges)

    def _on_merged(self, mg: Merged, merge_s: float) -> None:
        """Called under the lock for every Merged the state machine returns."""
        self.publication.note_merged(mg)
        self.counters["merges"] += 1
        try:  # timing and metrics: never in the way of publishing what was merged
            assert self.state is not None
            self.state.observe_sync_s(merge_s + self.control.mean_fetch_s())
            if self._metrics:
                self._event(
                    "merge",
                    fragment=mg.fragment,
                    version=mg.version,
                    learners=list(mg.learners),
                    n_learners=len(mg.learners),
                    weights=[round(w, 3) for w in mg.weights],
                    reason=mg.reason,
                    merge_s=round(merge_s, 6),
                )
        except Exception:  # noqa: BLE001 - counted and logged
            self.counters["merge_bookkeeping_errors"] += 1
            log.exception(
                "merge of fragment %d: bookkeeping failed (the merge stands)", mg.fragment
            )
        self.durability.merged(mg)

    def _handle_merges(self, merged: list[Merged], t0: float) -> None:
        for mg in merged:
            self._on_merged(mg, time.monotonic() - t0)
        self._followups(t0)

    def _depart(self, m: int, now: float) -> None:
        """Learner m leaves the state machine (a Leave, or declared dead; lock held): the
        merges its leaving completes are taken, and its downlink copies forgotten."""
        assert self.state is not None
        t0 = time.monotonic()
        self._handle_merges(self.state.leave(m, now), t0)
        self.data.forget_copies(m)

    def _followups(self, t0: float) -> None:
        """Decisions on rounds that filled while their fragment's merge ran unlocked."""
        assert self.state is not None
        for p, out in self.state.take_followups():
            if isinstance(out, Merged):
                self._on_merged(out, time.monotonic() - t0)
            else:
                self.liveness.add_timer(out.at_s, p)

    def _fire_timer(self, p: int, now: float) -> None:
        """Fragment p's grace deadline is due (the timer thread; lock held)."""
        assert self.state is not None
        t0 = time.monotonic()
        out = self.state.on_timer(p, now)
        if isinstance(out, Merged):
            self._on_merged(out, time.monotonic() - t0)
        elif out is not None:
            self.liveness.add_timer(out.at_s, p)
        self._followups(t0)

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

    # -- helpers --------------------------------------------------------------------------
    def _event(self, kind: str, **kw) -> None:
        if self._metrics:
            self._metrics.write(
                {
                    "t_s": round(time.monotonic() - self.started_s, 4),
                    "wall": time.time(),
                    "kind": kind,
                    **kw,
                }
            )

    def _auth(self, ctx: grpc.ServicerContext) -> None:
        md = dict(ctx.invocation_metadata())
        token = md.get(wire.TOKEN_METADATA)
        if not isinstance(token, str) or not check_token(self.config.token, token):
            raise Reject(
                grpc.StatusCode.UNAUTHENTICATED,
                E.AUTH,
                f"missing or wrong token from {ctx.peer()} (set $DDILOCO_TOKEN or "
                f"--token-file to the syncer's secret)",
            )

    def _note_reject(self, r: Reject, who: str) -> None:
        with self._lock:
            self.rejections[r.code] += 1
            self._event("reject", code=r.code, who=who, message=r.message)
        log.warning("%s rejected: %s: %s", who, r.code, r.message)

    def _bulk_refused(self, peer: str, code: str, reason: str) -> None:
        with self._lock:
            self.rejections[code] += 1
        log.warning("data connection from %s dropped: %s: %s", peer, code, reason)

    def _bulk_auth_failed(self, peer: str) -> None:
        with self._lock:
            self.rejections[E.AUTH] += 1
        log.warning("rejected data connection from %s: %s", peer, E.AUTH)

    def _fail(self, ctx: grpc.ServicerContext, r: Reject, who: str) -> None:
        self._note_reject(r, who)
        ctx.abort(r.status, f"{r.code}: {r.message}")

    def _owns(self, p: int) -> bool:
        S = len(self.config.shards)  # noqa: N806
        return S < 2 or p % S == self.config.shard

    def _require_owned(self, p: int) -> None:
        if not self._owns(p):
            S = len(self.config.shards)  # noqa: N806
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                E.FRAGMENT,
                f"fragment {p} belongs to shard {p % S} ({self.config.shards[p % S]}), "
                f"this is shard {self.config.shard}",
            )

    def _require_ready(self) -> SyncerState:
        if self.state is None:
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                E.NOT_READY,
                "the syncer has no model yet: Join, then Init with the initial model",
            )
        return self.state
