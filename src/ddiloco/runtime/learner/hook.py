"""The learner side of the runtime: hook a user's model and optimizer to a syncer.

    with DecoupledLearner(model, optimizer, syncer="127.0.0.1:50051", learner=0,
                          tokens_per_step=B * T) as dl:
        for x, y in data:
            loss = model(x, y)[1]; loss.backward(); optimizer.step(); optimizer.zero_grad()
            # with ``tokens_per_step`` the optimizer post-step hook calls dl.step() for you;
            # otherwise call dl.step(tokens) after optimizer.step().

The training thread only does bookkeeping (``LearnerSync``: counters, CPU snapshots of the
fragments due, installs of merged fragments at step t + tau). Three background threads
talk to the syncer, so a step never waits on the network:

  sender     pushes fragments (chunked stream), retries with backoff, keeps the push seq
  receiver   long-polls published versions (``Watch``) and fetches the fragments awaited
  heartbeat  small liveness/metadata call on its own channel; rejoins after a syncer restart
             or after being declared dead

Results flow back to the training thread through a queue drained at every ``step``.
An island (a torchrun group running DDP) passes ``process_group``: rank 0 talks to the
syncer and broadcasts the global model and every installed fragment to the other ranks.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import asdict
from datetime import timedelta

import grpc
import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.learner_state import LearnerSync, Outgoing
from ddiloco.algorithm.schedule import ClockTrack, FragmentSchedule, SlotClock, StepTimer
from ddiloco.config.sections import RuntimeConfig, SyncConfig
from ddiloco.runtime.learner.client import RETRYABLE, LinkLimits, SyncerError, rpc_code, rpc_details
from ddiloco.runtime.learner.device import DeviceCopier
from ddiloco.runtime.learner.sharded import SendQueues, ShardedClient
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.auth import load_token
from ddiloco.runtime.transport.spec import fragmentation_from_spec, model_spec, spec_fingerprint

__all__ = ["DecoupledLearner"]

log = logging.getLogger("ddiloco.learner")

_SYNC = SyncConfig()
_RUNTIME = RuntimeConfig()
"""The run configuration's defaults, which ``DecoupledLearner``'s keyword arguments take
(compared in tests/config/test_defaults.py)."""

DUPLICATE_WAIT_S = 15.0
"""How long a learner whose id is live in another process keeps asking before it gives up
(longer than the syncer's heartbeat timeout, so a killed predecessor is declared dead)."""


class DecoupledLearner:
    """One Decoupled DiLoCo learner bound to a user's model (and optionally optimizer).

    Parameters name the paper's symbols: P fragments, each synchronised every H inner
    steps, merged value installed tau steps after sending, alpha mixing on install;
    ``install="rebase"`` adds the learner's progress since the push to the merged value,
    ``"overwrite"`` replaces it (``ddiloco.algorithm.learner_state``).
    ``codec`` compresses pushes (a codec whose ``delta`` is set sends the delta against the
    installed base version). ``schedule="time"`` sends fragment p in the slots of the
    syncer's clock (learners of different speeds send together, so the syncer's grace
    window merges them together; until the syncer has measured a slot length, the
    learner's own step count stands in); ``"steps"`` sends every H of the learner's own
    steps. The clock is Unix time: the hosts' clocks must agree to well within one step
    (NTP does).
    Thread-safety: call ``step`` from the training thread only.

    The global model: ``global_state_dict()`` returns it at any time, ``load_global()``
    installs it into ``model`` and trains on from it, ``load_global_on_exit=True`` copies it
    into ``model`` when the learner closes. ``global_step`` counts this learner id's steps
    over its restarts (the syncer keeps the count of its earlier processes).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        syncer: str,
        learner: int | None = None,
        P: int | None = None,  # noqa: N803
        H: int = _SYNC.H,  # noqa: N803
        tau: int = _SYNC.tau,
        strategy: str = _SYNC.fragmentation,
        codec: str = _SYNC.codec,
        alpha: float = _SYNC.alpha,
        install: str = _SYNC.install,
        schedule: str = _SYNC.schedule,
        tokens_per_step: int | None = None,
        token: str | None = None,
        token_file: str | None = _RUNTIME.token_file,
        tls_ca: str | None = _RUNTIME.tls_ca,
        tls: bool = False,
        connect_timeout: timedelta = timedelta(seconds=_RUNTIME.connect_timeout_s),
        heartbeat_interval: timedelta = timedelta(seconds=_RUNTIME.heartbeat_interval_s),
        flush_timeout: timedelta = timedelta(seconds=10),
        link: LinkLimits | None = None,
        process_group=None,
        load_global_on_exit: bool = False,
    ) -> None:
        if learner is not None and learner < 0:
            raise ValueError(
                f"learner must be >= 0 (or None: the syncer assigns one), got {learner}"
            )
        if schedule not in ("time", "steps"):
            raise ValueError(f"schedule must be 'time' or 'steps', got {schedule!r}")
        self.model, self.optimizer = model, optimizer
        self.learner = -1 if learner is None else learner
        """This learner's id: the one asked for, or (-1 until the first Join) the one the
        syncer assigned."""
        self.codec = get_codec(codec)
        self.tokens_per_step = tokens_per_step
        self.link = link or LinkLimits()
        self.connect_timeout_s = connect_timeout.total_seconds()
        self.heartbeat_s = heartbeat_interval.total_seconds()
        # an idle long poll for merged versions (a merge ends it earlier)
        self.watch_s = max(0.5, 2 * self.heartbeat_s)
        self.flush_timeout_s = flush_timeout.total_seconds()
        self.load_global_on_exit = load_global_on_exit
        """At ``close``, after the last pushes are merged, copy the global model into
        ``model`` (the local model stays if the syncer cannot be reached: a warning)."""
        self.loaded_global_on_exit = False
        self.step_offset = 0
        """Steps this learner id did in earlier processes (the syncer's record, from the
        latest report of its previous incarnation): ``global_step`` counts from it."""
        self.group = process_group
        self._control_group = process_group
        self.rank = 0
        if process_group is not None:
            import torch.distributed as dist

            self.rank = dist.get_rank(process_group)
            if dist.get_backend(process_group) == "nccl":
                # NCCL takes device tensors only: the island's small control messages (install
                # mask, stop flag, budget) go over a Gloo group beside it, so reading them
                # never synchronises the device; parameters still travel over NCCL
                self._control_group = dist.new_group(
                    dist.get_process_group_ranks(process_group), backend="gloo"
                )
        n_tensors = len(list(model.parameters()))
        P = P if P is not None else min(H, n_tensors, 24)
        self.spec = model_spec(model, P, strategy)
        self.fingerprint = spec_fingerprint(self.spec)
        self.fragmentation = fragmentation_from_spec(self.spec)
        self.schedule = FragmentSchedule(P, H, tau)
        self.params = dict(model.named_parameters())
        self.copier = DeviceCopier.for_params(list(self.params.values()))
        self.time_driven = schedule == "time"
        # time-driven: ``after_step`` gets the time in nominal steps of the syncer's clock
        self.sync = LearnerSync(
            self.params,
            self.fragmentation,
            self.schedule,
            alpha=alpha,
            install=install,
            snapshot=self.copier.snapshot,
            slot_s=1.0 if self.time_driven else None,
        )
        self.clock = ClockTrack()
        self._x = 0.0  # nominal steps at the last step boundary
        self._joined_clock: dict | None = None
        self._heard_clock: dict | None = None  # the heartbeat thread's last announcement
        self._is_root = self.rank == 0
        self._token = None
        if self._is_root:
            self._token = token or load_token(token_file)
            # one syncer or a sharded one: the map comes with the first Join
            self.client = ShardedClient(syncer, self._token, tls_ca, tls)
        self._inbox: queue.Queue = queue.Queue()
        self._sendq = SendQueues(1, lambda p: 0)
        """Pushes waiting to be sent: one queue and sender thread per syncer shard."""
        self._closed = threading.Event()
        self._joined = threading.Event()
        self._lock = threading.Lock()
        self._wanted: set[int] = set()
        self._base_versions: list[int] = [-1] * P
        self._latest_seq: dict[int, int] = {}
        self._final_seqs: set[int] = set()  # the pushes of close(): the learner is finishing
        self._final_fragments: list[int] = []
        self.incarnation = -1
        self.boot_id = ""
        self._results_known: dict[int, list[int]] = {p: [] for p in range(P)}
        self._accepted_by_boot: dict[int, str] = {}
        self._merged_seq: dict[int, int] = {}
        self._merged_applied: dict[int, int] = {}
        self._delay_mark = (0, 0)  # (installs, summed delay) at the last delay measurement
        self._delay_warned = False
        self._threads: list[threading.Thread] = []
        self._last_step_t: float | None = None
        self.step_timer = StepTimer()
        """This learner's measured step time (``step_s`` in its reports): the syncer's
        slot clock is measured from it."""
        self.compute_s = 0.0
        self.tokens = 0
        """Tokens this process stepped (the syncer carries earlier processes' totals)."""
        self.process_id = uuid.uuid4().hex[:12]
        """This learner process: the syncer carries a restarted learner's earlier totals."""
        self.extra_report: dict = {}
        self.stats = {
            "bytes_sent": 0,
            "bytes_received": 0,
            "pushes": 0,
            "pushes_accepted": 0,
            "pushes_rejected": 0,
            "installs": 0,
            "install_delay_steps": 0.0,
            "reconnects": 0,
            "fetch_s": None,
            "push_errors": 0,
        }
        self._base_params: dict[int, dict[int, list[torch.Tensor]]] = {}
        self._hook = None
        self._connected = True
        self._started = False
        self.step_budget = 0
        """The syncer's global step budget (0: none), learned when joining."""
        self._stop = threading.Event()
        self._stop_seen = False
        self._thread_error: BaseException | None = None
        self._leaving = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> DecoupledLearner:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Join the syncer (initialising it if it has no model yet), fetch the current global
        parameters and install them before the first step. Blocks until done or
        ``connect_timeout``; retries with backoff while the syncer is unreachable."""
        if self._is_root:
            versions, params = self._join_and_fetch(initial=True)
            self.sync.load_global(params, versions)
            if self._joined_clock:
                self._hear_clock(self._joined_clock)
            self._base_versions = list(versions)
            self._stop_seen = self._stop.is_set()  # later, only `step` changes it
        if self.group is not None:
            import torch.distributed as dist

            src = dist.get_global_rank(self.group, 0)
            with torch.no_grad():
                for t in self.params.values():
                    dist.broadcast(t.data, src=src, group=self.group)
            budget = torch.tensor(
                [self.step_budget, int(self._stop_seen), self.learner], dtype=torch.int64
            )
            dist.broadcast(budget, src=src, group=self._control_group)
            self.step_budget = int(budget[0])
            self._stop_seen = bool(budget[1])
            self.learner = int(budget[2])  # an id the syncer assigned reaches every rank
        if self._is_root:
            self._sendq = SendQueues(self.client.n_shards, self.client.shard_of)
            senders = [
                (lambda k=k: self._sender(k), f"ddiloco-send-{k}")
                for k in range(self.client.n_shards)
            ]
            for target, name in (
                *senders,
                (self._receiver, "ddiloco-recv"),
                (self._heartbeater, "ddiloco-hb"),
            ):
                th = threading.Thread(target=self._guarded, args=(target,), name=name, daemon=True)
                th.start()
                self._threads.append(th)
        if self.optimizer is not None and self.tokens_per_step is not None:
            self._hook = self.optimizer.register_step_post_hook(
                lambda *_: self.step(self.tokens_per_step)
            )
        self._started = True
        self._last_step_t = time.monotonic()  # the first step's time counts as compute

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
                if r.get("need_init"):
                    self._upload_initial()
                    r = self._join()
                if fresh:  # a new process of this learner id carries on its step count
                    self.step_offset = int(r.get("steps_done") or 0)
                self.incarnation = r["incarnation"]
                self.boot_id = r["boot_id"]
                self._merged_seq = {int(k): v for k, v in r.get("merged_seq", {}).items()}
                self._note_budget(r)
                self._joined_clock = r.get("clock")
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
            self.stats["bytes_received"] += got[p][2]
        return versions, params

    def _global_everywhere(self, timeout_s: float) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Root fetches the global model; an island's other ranks receive it from root."""
        versions, params = [], {}
        if self._is_root:
            try:
                versions, params = self._fetch_all(timeout_s)
            except grpc.RpcError as e:
                raise SyncerError(
                    f"[learner {self.learner}] could not fetch the global model "
                    f"from {self.client.address}: {rpc_code(e).name}: "
                    f"{rpc_details(e)}"
                ) from None
        if self.group is not None:
            import torch.distributed as dist

            src = dist.get_global_rank(self.group, 0)
            ok = torch.tensor([int(bool(params))], dtype=torch.int64)
            dist.broadcast(ok, src=src, group=self.group)
            if not ok.item():
                raise SyncerError(
                    f"[learner {self.learner}] rank 0 could not fetch the global model"
                )
            if not self._is_root:
                params = {n: torch.empty_like(t) for n, t in self.params.items()}
            for n in self.params:
                dist.broadcast(params[n], src=src, group=self.group)
        return versions, params

    def global_state_dict(
        self, timeout: timedelta = timedelta(seconds=60)
    ) -> dict[str, torch.Tensor]:
        """The syncer's current global model as a ``state_dict`` (copies in the model's
        dtypes; ``model`` is not touched). Blocks on the network; every rank of an island
        calls it."""
        _, params = self._global_everywhere(timeout.total_seconds())
        return {n: params[n].to(self.params[n].dtype).clone() for n in self.params}

    def load_global(self, timeout: timedelta = timedelta(seconds=60)) -> list[int]:
        """Install the syncer's current global model into ``model`` now and go on training
        from it, as a restarted learner does; returns the installed fragment versions. The
        local steps not yet pushed are discarded (counted lost). Call it from the training
        thread, between steps (every rank of an island)."""
        versions, params = self._global_everywhere(timeout.total_seconds())
        if self._is_root:
            self.sync.fail()  # steps since each fragment's last push are overwritten
            self.sync.load_global(params, versions)
            with self._lock:
                self._base_versions = list(versions)
                self._wanted = set()
        else:
            with torch.no_grad():
                for n, t in self.params.items():
                    t.copy_(params[n])
        return versions

    @property
    def global_step(self) -> int:
        """Inner steps of this learner id over all its processes: the steps of earlier
        processes (``step_offset``, from the syncer) plus this one's."""
        return self.step_offset + self.sync.step

    @property
    def should_stop(self) -> bool:
        """True once the syncer's global step budget is spent: finish the loop (then leave
        the ``with`` block, which flushes what is left). The same on every rank of an
        island (it changes only inside ``step``)."""
        return self._stop_seen

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
        self.stats["bytes_sent"] += len(data)
        log.info(
            "[learner %d] initial model upload: %s",
            self.learner,
            "accepted" if r.get("accepted") else "another learner was first",
        )

    def close(self) -> None:
        """Wait (up to ``flush_timeout``) for pushes in flight to be merged, (with
        ``load_global_on_exit``) copy the global model into ``model``, leave, stop."""
        if self._closed.is_set():
            return
        if self._hook is not None:
            self._hook.remove()
        exit_params: dict[str, torch.Tensor] | None = None
        if self._is_root and self._started:
            finals = []
            for o in self.sync.flush():
                if o.c_steps < 1:  # installed since its last push: nothing left to contribute
                    self.sync.on_push_result(o.fragment, o.seq, accepted=False)
                    continue
                finals.append(o)
            with self._lock:  # the syncer's final rounds wait for these pushes only
                self._final_fragments = sorted(o.fragment for o in finals)
                for o in finals:
                    self._latest_seq[o.fragment] = o.seq
                    self._final_seqs.add(o.seq)
            for o in finals:
                self._sendq.put(o)
            deadline = time.monotonic() + self.flush_timeout_s
            while (
                time.monotonic() < deadline
                and self._connected
                and self._thread_error is None
                and (not self._sendq.empty() or self.sync.ledger.pending > 1e-9)
            ):
                time.sleep(0.02)
                self._drain()
            if self.load_global_on_exit:
                try:
                    exit_params = self._fetch_all(self.flush_timeout_s)[1]
                except grpc.RpcError as e:
                    log.warning(
                        "[learner %d step %d] could not fetch the global model at exit "
                        "(%s): the model keeps its local parameters",
                        self.learner,
                        self.sync.step,
                        rpc_details(e),
                    )
            self._leaving.set()  # the heartbeat thread must not rejoin after the Leave
            try:
                self.client.unary(
                    "Leave",
                    {
                        "learner": self.learner,
                        "incarnation": self.incarnation,
                        "report": self.report(),
                    },
                    timeout_s=3.0,
                    control=True,
                )
            except grpc.RpcError:
                pass
        if self.load_global_on_exit and self._started:
            self._install_at_exit(exit_params)
        self._closed.set()
        self._sendq.stop()
        for th in self._threads:
            th.join(timeout=3.0)
        if self._is_root:
            self.client.close()

    def _install_at_exit(self, params: dict[str, torch.Tensor] | None) -> None:
        if self.group is not None:  # root's fetch (or its failure) reaches every rank
            import torch.distributed as dist

            src = dist.get_global_rank(self.group, 0)
            ok = torch.tensor([int(params is not None)], dtype=torch.int64)
            dist.broadcast(ok, src=src, group=self.group)
            if not ok.item():
                return
            if params is None:
                params = {n: torch.empty_like(t) for n, t in self.params.items()}
            for n in self.params:
                dist.broadcast(params[n], src=src, group=self.group)
        if params is None:
            return
        with torch.no_grad():
            for n, t in self.params.items():
                t.copy_(params[n])
        self.loaded_global_on_exit = True

    # -- the training thread ----------------------------------------------------------------
    def step(self, tokens: int) -> list[int]:
        """Record one inner step of ``tokens`` tokens (the island's total); send the
        fragments due; install merged fragments whose install step has come. Returns the
        installed fragment indices. Never blocks on the network."""
        if self._thread_error is not None:
            raise SyncerError(
                f"[learner {self.learner}] communication thread failed: {self._thread_error!r}"
            ) from self._thread_error
        now = time.monotonic()
        if self._last_step_t is not None:
            dt = now - self._last_step_t
            self.compute_s += dt
            self.step_timer.add(dt)
        self._last_step_t = now
        self.tokens += tokens
        installed: list[int] = []
        if self._is_root:
            self._drain()
            outs = self.sync.after_step(tokens, self._nominal_now())
            with self._lock:
                for o in outs:
                    self._wanted.add(o.fragment)
                    self._latest_seq[o.fragment] = o.seq
            for o in outs:
                self._sendq.put(o)
            installed = self.sync.install_due()
            with self._lock:
                for p in installed:
                    self._base_versions[p] = self.sync.frags[p].base_version
                self._wanted = set(self.sync.waiting_fragments)
            self.stats["installs"] += len(installed)
            if installed:
                self._watch_install_delay()
        stop = self._stop.is_set() if self._is_root else False
        if self.group is not None:
            installed, stop = self._broadcast_installs(installed, stop)
        self._stop_seen = self._stop_seen or stop
        return installed

    def _watch_install_delay(self) -> None:
        """Measure how many steps a merged fragment takes to come back (``install_delay_steps``
        in the reports, over the last 4 P installs) and warn once when it is well past tau:
        the grace window then cannot gather learners (and ``install = overwrite`` loses the
        late steps)."""
        installs, delay = self.sync.installs, self.sync.install_delay_steps
        n = installs - self._delay_mark[0]
        if n < 4 * self.fragmentation.P:
            return
        d = (delay - self._delay_mark[1]) / n
        self._delay_mark = (installs, delay)
        self.stats["install_delay_steps"] = round(d, 2)
        tau = self.schedule.tau
        if d > tau + 1 and not self._delay_warned:
            self._delay_warned = True
            log.warning(
                "[learner %d step %d] merged fragments come back %.1f steps after their push "
                "on average, later than tau = %d: the syncer's grace window cannot gather "
                "learners%s. A tau of %d covers the link (--tau %d).",
                self.learner,
                self.sync.step,
                d,
                tau,
                ", and the late steps are lost (install = overwrite)"
                if self.sync.install == "overwrite"
                else "",
                math.ceil(d),
                math.ceil(d),
            )

    def wait_installs(self, timeout: timedelta = timedelta(minutes=5)) -> list[int]:
        """Block until every fragment whose install step has come is installed: call after
        ``step`` for synchronous DiLoCo (tau = 0, P = 1, quorum K = M, every learner waits
        for the merge of its push). Returns when the syncer says stop, too; raises
        ``SyncerError`` after ``timeout``. Not for islands (``process_group``)."""
        if self.group is not None:
            raise ValueError("wait_installs does not support islands (process_group)")
        deadline = time.monotonic() + timeout.total_seconds()
        installed: list[int] = []
        while not self._stop.is_set():
            due = [
                p
                for p, fr in enumerate(self.sync.frags)
                if fr.waiting and self.sync.step >= fr.due_step
            ]
            if not due:
                break
            if self._thread_error is not None or time.monotonic() > deadline:
                raise SyncerError(
                    f"[learner {self.learner} step {self.sync.step}] no merge of "
                    f"fragments {due} within {timeout}"
                )
            time.sleep(0.002)
            self._drain()
            got = self.sync.install_due()
            with self._lock:
                for p in got:
                    self._base_versions[p] = self.sync.frags[p].base_version
                self._wanted = set(self.sync.waiting_fragments)
            self.stats["installs"] += len(got)
            installed += got
        self._last_step_t = time.monotonic()  # the wait is not compute time
        return installed

    def _broadcast_installs(self, installed: list[int], stop: bool) -> tuple[list[int], bool]:
        import torch.distributed as dist

        src = dist.get_global_rank(self.group, 0)
        P = self.fragmentation.P  # noqa: N806
        mask = torch.zeros(P + 1, dtype=torch.uint8)  # installed fragments, then the stop flag
        mask[installed] = 1
        mask[P] = int(stop)
        dist.broadcast(mask, src=src, group=self._control_group)
        out = [int(p) for p in mask[:P].nonzero().flatten()]
        with torch.no_grad():
            for p in out:
                for n in self.fragmentation.fragments[p].names:
                    dist.broadcast(self.params[n].data, src=src, group=self.group)
        return out, bool(mask[P])

    def _nominal_now(self) -> float | None:
        """The time-driven schedule's clock at this step boundary, in nominal steps: the
        syncer's slot clock, or one step per step until the syncer has announced one."""
        if not self.time_driven:
            return None
        x = self.clock.nominal(time.time())
        self._x = self._x + 1.0 if x is None else x
        return self._x

    def _hear_clock(self, d: dict) -> None:
        """An announced slot clock (training thread). A new run clock restarts the slot
        count at its current value: no burst of sends for slots this learner never had."""
        try:
            c = SlotClock.from_dict(d)
        except ValueError as e:
            log.warning("[learner %d] ignoring the syncer's clock: %s", self.learner, e)
            return
        if self.clock.hear(c) and self.time_driven:
            self._x = self.clock.nominal(time.time())
            self.sync.last_s = self._x

    def _drain(self) -> None:
        """Apply what the background threads delivered, in a safe order: push verdicts,
        received fragments, then merged-seq notices (only for pushes whose verdict is known)."""
        results, recvs, restarts = [], [], []
        while True:
            try:
                ev = self._inbox.get_nowait()
            except queue.Empty:
                break
            if ev[0] == "clock":
                self._hear_clock(ev[1])
                continue
            {"result": results, "recv": recvs, "restart": restarts}[ev[0]].append(ev[1:])
        for merged_seq, old_boot in restarts:
            # pushes the old syncer accepted but never published are gone with it
            for p in range(self.fragmentation.P):
                ms = merged_seq.get(p, -1)
                for seq in list(self.sync.frags[p].in_flight):
                    if seq > ms and self._accepted_by_boot.get(seq) == self.client.boot_part(
                        old_boot, p
                    ):
                        self.sync.on_push_result(p, seq, accepted=False)
        for p, seq, accepted, target in results:
            self.sync.on_push_result(p, seq, accepted, target)
            self._results_known[p].append(seq)
        for p, version, tensors, ready in recvs:
            self.sync.receive(p, version, tensors, ready)
        with self._lock:
            merged_seq = dict(self._merged_seq)
        for p, ms in merged_seq.items():
            known = [s for s in self._results_known.get(p, []) if s <= ms]
            if known:
                s = max(known)
                if s > self._merged_applied.get(p, -1):
                    self.sync.mark_merged(p, s)
                    self._merged_applied[p] = s
                self._results_known[p] = [x for x in self._results_known[p] if x > s]

    def report(self) -> dict:
        """What the heartbeat carries: progress, timing, ledger, traffic."""
        return {
            "step": self.sync.step,
            "incarnation": self.incarnation,
            "process": self.process_id,
            "tokens": self.tokens,
            "step_s": self.step_timer.step_s,
            "compute_s": self.compute_s,
            "ledger": asdict(self.sync.ledger),
            "tokens_per_step": self.tokens_per_step,
            "fetch_s": self.stats["fetch_s"],
            "global_step": self.global_step,
            **self.stats,
            **self.extra_report,
        }

    # -- background threads -----------------------------------------------------------------
    def _wire_seq(self, o: Outgoing) -> int:
        return (self.incarnation << 32) + o.seq

    def _remember_base(self, p: int, version: int, tensors: list[torch.Tensor]) -> None:
        """Keep the last few published versions of p: pushes of a ``delta`` codec are
        deltas against the version the learner installed."""
        if not self.codec.delta:
            return
        with self._lock:
            d = self._base_params.setdefault(p, {})
            d[version] = tensors
            for v in sorted(d)[:-4]:
                del d[v]

    def _encode(self, o: Outgoing) -> tuple[bytes, bool]:
        if self.codec.delta:
            with self._lock:
                base = self._base_params.get(o.fragment, {}).get(o.base_version)
            if base is not None:
                return b"".join(self.codec.encode(x - b) for x, b in zip(o.params, base)), True
        return b"".join(self.codec.encode(x) for x in o.params), False

    def _sender(self, k: int = 0) -> None:
        """Send the pushes of syncer shard k's fragments."""
        while not self._closed.is_set():
            o = self._sendq.queues[k].get()
            if o is None:
                return
            if o.ready is not None:
                o.ready()  # the snapshot's device-to-host copy has landed
            with self._lock:
                if self._latest_seq.get(o.fragment, o.seq) > o.seq:
                    self.sync.release(o.fragment, o.params)
                    continue  # superseded: a newer push of this fragment carries its progress
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
                boot = self.boot_id
                try:
                    d = self.link.delay_s(len(data))
                    if d > 0:
                        time.sleep(d)
                    r = self.client.push(header, data, timeout_s=30.0 + len(data) / 1e6)
                    self.stats["bytes_sent"] += len(data)
                    self.stats["pushes"] += 1
                    ok = r["status"] == "accepted"
                    self.stats["pushes_accepted" if ok else "pushes_rejected"] += 1
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
                            ("result", o.fragment, o.seq, ok, r.get("target_version", -1))
                        )
                    break
                except grpc.RpcError as e:
                    code, msg = rpc_code(e), rpc_details(e)
                    if code == grpc.StatusCode.FAILED_PRECONDITION and (
                        "E_UNKNOWN_LEARNER" in msg or "E_SESSION" in msg
                    ):
                        self._joined.clear()  # the heartbeat thread rejoins
                        continue
                    if code in RETRYABLE:
                        self.stats["push_errors"] += 1
                        with self._lock:
                            if self._latest_seq.get(o.fragment, o.seq) > o.seq:
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
                    self._inbox.put(("result", o.fragment, o.seq, False, -1))
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
                        p for p in self._wanted if versions[p] > max(got[p], self._base_versions[p])
                    ]
                if need:
                    t0 = time.monotonic()
                    res = self.client.fetch(sorted(need), learner=self.learner)
                    nbytes = sum(v[2] for v in res.values())
                    d = self.link.delay_s(nbytes)
                    if d > 0:
                        time.sleep(d)
                    dt = time.monotonic() - t0
                    f = self.stats["fetch_s"]
                    self.stats["fetch_s"] = dt if f is None else 0.8 * f + 0.2 * dt
                    self.stats["bytes_received"] += nbytes
                    for p, (v, ts, _) in res.items():
                        got[p] = max(got[p], v)
                        shaped = [
                            t.view(self.params[n].shape)
                            for t, n in zip(ts, self.fragmentation.fragments[p].names)
                        ]
                        self._remember_base(p, v, shaped)
                        staged, ready = self.copier.stage(shaped)  # to the device, async
                        self._inbox.put(("recv", p, v, staged, ready))
                cursor = versions
                backoff = 0.1
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if rpc_code(e) == grpc.StatusCode.FAILED_PRECONDITION:
                    self._joined.clear()
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                cursor = None

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
                    self._inbox.put(("clock", r["clock"]))
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
                    self.stats["reconnects"] += 1

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
            # a fresh syncer without a checkpoint: give it our current parameters
            self._upload_initial()
            r = self._join()
        with self._lock:
            self._merged_seq = {int(k): v for k, v in r.get("merged_seq", {}).items()}
        self._note_budget(r)
        if r.get("clock"):
            self._inbox.put(("clock", r["clock"]))
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
            self._inbox.put(("restart", dict(self._merged_seq), old_boot))
            self.boot_id = r["boot_id"]
        self._connected = True
        self._joined.set()
