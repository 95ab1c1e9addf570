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

Results flow back to the training thread as typed events (``events``) through a queue
drained at every ``step``. An island (a torchrun group running DDP) passes
``process_group``: rank 0 talks to the syncer and broadcasts the global model and every
installed fragment to the other ranks.

The class is split along its seams: this module holds the public hook and the training
thread's side; ``session`` the Join, fetch, heartbeat and rejoin protocol; ``links`` the
sender and receiver threads with the delta base cache; ``island`` the broadcasts of a
multi-rank island.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import asdict
from datetime import timedelta

import grpc
import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.learner_state import LearnerSync
from ddiloco.algorithm.schedule import ClockTrack, FragmentSchedule, StepTimer
from ddiloco.config.sections import RUNTIME_DEFAULTS, SyncConfig
from ddiloco.runtime.learner.client import LinkLimits, SyncerError, rpc_details
from ddiloco.runtime.learner.context import LearnerStats
from ddiloco.runtime.learner.device import DeviceCopier
from ddiloco.runtime.learner.events import InboxMixin, Received
from ddiloco.runtime.learner.island import IslandMixin
from ddiloco.runtime.learner.layout import (
    IslandPlan,
    island_group,
    local_runs,
    mesh_group,
    unwrap_model,
)
from ddiloco.runtime.learner.links import LinksMixin
from ddiloco.runtime.learner.session import DUPLICATE_WAIT_S, SessionMixin
from ddiloco.runtime.learner.shard_island import ShardIslandMixin
from ddiloco.runtime.learner.sharded import SendQueues, ShardedClient
from ddiloco.runtime.transport.auth import load_token
from ddiloco.runtime.transport.spec import fragmentation_from_spec, model_spec, spec_fingerprint

__all__ = ["DUPLICATE_WAIT_S", "DecoupledLearner", "late_install_advice"]

log = logging.getLogger("ddiloco.learner")

_SYNC = SyncConfig()
_RUNTIME = RUNTIME_DEFAULTS
"""The run configuration's defaults, which ``DecoupledLearner``'s keyword arguments take
(compared in tests/config/test_defaults.py)."""

_FLAGS = {"tau": "--tau", "H": "-H", "P": "-P", "codec": "--codec"}
"""The command line's names of the settings that advice names (``ddiloco learner`` and
``ddiloco train``)."""


def late_install_advice(
    delay_steps: float,
    *,
    H: int,  # noqa: N803
    P: int,  # noqa: N803
    codec: str,
    flags: bool = False,
) -> str:
    """What to change when merged fragments come back ``delay_steps`` after their push, in
    the names of the interface that took the settings: keyword arguments (``tau=74``) or
    command-line flags (``--tau 74``, ``flags``). A tau that covers the delay is advised only
    when it is valid (below H); otherwise what lowers the delay instead: a larger H (each
    fragment synced less often, fewer bytes per step), fewer bytes per push or merge (a
    compressed push codec, the syncer's downlink codec), or fewer fragments in flight."""

    def setting(name: str, value) -> str:
        if flags:
            return f"{_FLAGS[name]} {value}"
        return f"{name}={value!r}"

    need = math.ceil(delay_steps)
    if need < H:
        return f"A tau of {need} covers the link ({setting('tau', need)})."
    down = "--down-codec int8" if flags else "downlink codec int8 (sync.down_codec)"
    fewer = [f"{setting('codec', 'int4')} for the pushes"] if codec in ("fp32", "bf16") else []
    fewer.append(f"the syncer's {down} for the merges")
    ways = [
        f"sync each fragment less often ({setting('H', need + 1)} or more, with "
        f"{setting('tau', need)})",
        f"send fewer bytes: {', '.join(fewer)}",
    ]
    if P > 1:
        ways.append(f"put fewer fragments in flight ({setting('P', max(1, P // 2))})")
    return (
        f"A tau of {need} would cover the link, but tau must be below H = {H}. Instead: "
        f"{'; '.join(ways[:-1])}; or {ways[-1]}."
    )


class DecoupledLearner(InboxMixin, SessionMixin, LinksMixin, IslandMixin, ShardIslandMixin):
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

    ``model`` may come plain, wrapped in ``DistributedDataParallel`` (or ``DataParallel``,
    or ``torch.compile``) or sharded by FSDP2: the syncer knows its tensors by the names of
    the user's own module (``ddiloco.runtime.learner.layout``), so learners wrapped
    differently train one model. Without ``process_group``, a DDP wrapper's group is the
    island's.

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
        self.model = unwrap_model(model)
        """The user's module, unwrapped (``layout``): its parameter names are the ones the
        syncer knows, whether the model came plain, DDP-wrapped or FSDP2-sharded."""
        self.optimizer = optimizer
        self.learner = -1 if learner is None else learner
        """This learner's id: the one asked for, or (-1 until the first Join) the one the
        syncer assigned."""
        self.codec = get_codec(codec)
        self.settings_as = "keywords"
        """How warnings name a setting to change: ``keywords``, this class's arguments
        (``tau=4``), or ``flags``, the command line's (``--tau 4``; ``ddiloco learner``
        sets it)."""
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
        local = local_runs(self.model)
        self.sharded = local is not None
        """An FSDP2 or HSDP island: every rank syncs its own shards (``shard_island``)."""
        if process_group is None:  # the island the user set up: a DDP wrapper's, a mesh's
            process_group = mesh_group(self.model) if self.sharded else island_group(model)
        self.group = process_group
        self._control_group = process_group
        self.rank = 0
        self._root_rank = 0
        if process_group is not None:
            import torch.distributed as dist

            self.rank = dist.get_rank(process_group)
            self._root_rank = dist.get_global_rank(process_group, 0)
            if self.sharded:
                # the step-boundary exchange has a Gloo group of its own (small Python
                # objects; never interleaved with the sharded model's own collectives)
                self._control_group = dist.new_group(
                    dist.get_process_group_ranks(process_group), backend="gloo"
                )
            elif dist.get_backend(process_group) == "nccl":
                # NCCL takes device tensors only: the island's small control messages (install
                # mask, stop flag, budget) go over a Gloo group beside it, so reading them
                # never synchronises the device; parameters still travel over NCCL
                self._control_group = dist.new_group(
                    dist.get_process_group_ranks(process_group), backend="gloo"
                )
        model = self.model
        n_tensors = len(list(model.parameters()))
        P = P if P is not None else min(H, n_tensors, 24)
        self.spec = model_spec(model, P, strategy)
        self.fingerprint = spec_fingerprint(self.spec)
        self.fragmentation = fragmentation_from_spec(self.spec)
        self.schedule = FragmentSchedule(P, H, tau)
        self.params = dict(model.named_parameters()) if local is None else local[0]
        """Name -> the tensor this process syncs: the parameter, or (sharded) its local
        shard, which installs write in place."""
        self.plan: IslandPlan | None = None
        if local is not None:
            runs = [local[1]]
            if self.group is not None:
                import torch.distributed as dist

                runs = [{}] * dist.get_world_size(self.group)
                dist.all_gather_object(runs, local[1], group=self._control_group)
            self.plan = IslandPlan(self.fragmentation, runs, self.rank)
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
        if self._is_root or self.sharded:  # every rank of a sharded island moves its runs
            self._token = token or load_token(token_file, how="token=SECRET or token_file=PATH")
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
        self.stats = LearnerStats()
        """Traffic and install counters (a mapping: ``stats["pushes"]``)."""
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
        # a sharded island's step-boundary exchange (``shard_island``)
        self._held_recv: dict[int, Received] = {}  # the newest version of p fetched
        self._verdicts: dict[tuple[int, int], dict[int, tuple]] = {}  # (p, seq) -> rank's
        self._island_boot: dict[int, str] = {}  # seq -> the boot that accepted every part
        self._fed: list[int] = [-1] * P  # the newest version of p every rank holds
        self._creds_sent: tuple[int, str] | None = None
        self._island_report: dict = {}
        self._upload_id = ""

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
        if self.sharded:
            self._start_sharded()
            self._creds_sent = (self.incarnation, self.boot_id)
        elif self._is_root:
            versions, params = self._join_and_fetch(initial=True)
            self.sync.load_global(params, versions)
            if self._joined_clock:
                self._hear_clock(self._joined_clock)
            self._base_versions = list(versions)
            self._stop_seen = self._stop.is_set()  # later, only `step` changes it
        if self.group is not None and not self.sharded:
            self._broadcast_start()
        if self._is_root or self.sharded:
            self._sendq = SendQueues(self.client.n_shards, self.client.shard_of)
            senders = [
                (lambda k=k: self._sender(k), f"ddiloco-send-{k}")
                for k in range(self.client.n_shards)
            ]
            heartbeat = [(self._heartbeater, "ddiloco-hb")] if self._is_root else []
            for target, name in (*senders, (self._receiver, "ddiloco-recv"), *heartbeat):
                th = threading.Thread(target=self._guarded, args=(target,), name=name, daemon=True)
                th.start()
                self._threads.append(th)
        if self.optimizer is not None and self.tokens_per_step is not None:
            self._hook = self.optimizer.register_step_post_hook(
                lambda *_: self.step(self.tokens_per_step)
            )
        self._started = True
        self._last_step_t = time.monotonic()  # the first step's time counts as compute

    def global_state_dict(
        self, timeout: timedelta = timedelta(seconds=60)
    ) -> dict[str, torch.Tensor]:
        """The syncer's current global model as a ``state_dict`` (copies in the model's
        dtypes; ``model`` is not touched). Blocks on the network; every rank of an island
        calls it. A rank of a sharded island gets its own shard of each tensor (shaped as
        its local tensor)."""
        if self.sharded:
            _, params = self._agreed_global(timeout.total_seconds())
        else:
            _, params = self._global_everywhere(timeout.total_seconds())
        return {n: params[n].to(self.params[n].dtype).clone() for n in self.params}

    def load_global(self, timeout: timedelta = timedelta(seconds=60)) -> list[int]:
        """Install the syncer's current global model into ``model`` now and go on training
        from it, as a restarted learner does; returns the installed fragment versions. The
        local steps not yet pushed are discarded (counted lost). Call it from the training
        thread, between steps (every rank of an island)."""
        if self.sharded:
            versions, params = self._agreed_global(timeout.total_seconds())
            self.sync.fail()
            self.sync.load_global(params, versions)
            self._fed = list(versions)
            with self._lock:
                self._base_versions = list(versions)
                self._wanted = set()
            return versions
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

    def close(self) -> None:
        """Wait (up to ``flush_timeout``) for pushes in flight to be merged, (with
        ``load_global_on_exit``) copy the global model into ``model``, leave, stop."""
        if self._closed.is_set():
            return
        if self._hook is not None:
            self._hook.remove()
        exit_params: dict[str, torch.Tensor] | None = None
        if self.sharded and self._started:
            exit_params = self._close_sharded()
        elif self._is_root and self._started:
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
        if self._is_root and self._started:
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
            if self.sharded:
                if exit_params is not None:
                    with torch.no_grad():
                        for n, t in self.params.items():
                            t.copy_(exit_params[n])
                    self.loaded_global_on_exit = True
            else:
                self._install_at_exit(exit_params)
        self._closed.set()
        self._sendq.stop()
        for th in self._threads:
            th.join(timeout=3.0)
        if self._is_root or self.sharded:
            self.client.close()

    # -- the training thread ----------------------------------------------------------------
    def step(self, tokens: int) -> list[int]:
        """Record one inner step of ``tokens`` tokens (the island's total); send the
        fragments due; install merged fragments whose install step has come. Returns the
        installed fragment indices. Never blocks on the network (a sharded island's ranks
        exchange one small message: every rank calls it)."""
        if self._thread_error is not None and not self.sharded:
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
        if self.sharded:
            installed, stop = self._sharded_step(tokens)
            self._stop_seen = self._stop_seen or stop
            return installed
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
            self.stats.installs += len(installed)
            if installed:
                self._watch_install_delay()
        stop = self._stop.is_set() if self._is_root else False
        if self.group is not None:
            installed, stop = self._broadcast_installs(installed, stop)
        self._stop_seen = self._stop_seen or stop
        return installed

    def _watch_install_delay(self) -> None:
        """Measure how many steps a merged fragment takes to come back (``install_delay_steps``
        in the reports: the mean over this process's installs) and warn once when, over the
        last max(4, P) installs, it is well past tau: the grace window then cannot gather
        learners (and ``install = overwrite`` loses the late steps)."""
        installs, delay = self.sync.installs, self.sync.install_delay_steps
        self.stats.install_delay_steps = round(self.sync.mean_install_delay_steps, 2)
        n = installs - self._delay_mark[0]
        if n < max(4, self.fragmentation.P):
            return
        d = (delay - self._delay_mark[1]) / n
        self._delay_mark = (installs, delay)
        tau = self.schedule.tau
        if d > tau + 1 and not self._delay_warned:
            self._delay_warned = True
            log.warning(
                "[learner %d step %d] merged fragments come back %.1f steps after their push "
                "on average, later than tau = %d: the syncer's grace window cannot gather "
                "learners%s. %s",
                self.learner,
                self.sync.step,
                d,
                tau,
                ", and the late steps are lost (install = overwrite)"
                if self.sync.install == "overwrite"
                else "",
                late_install_advice(
                    d,
                    H=self.schedule.H,
                    P=self.fragmentation.P,
                    codec=self.codec.name,
                    flags=self.settings_as == "flags",
                ),
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
            self.stats.installs += len(got)
            installed += got
        self._last_step_t = time.monotonic()  # the wait is not compute time
        return installed

    def report(self) -> dict:
        """What the heartbeat carries: progress, timing, ledger, traffic (of a sharded
        island: its ranks' traffic summed, and each rank's bytes in ``rank_bytes_sent`` and
        ``rank_bytes_received``, as of the last step)."""
        return {
            "step": self.sync.step,
            "incarnation": self.incarnation,
            "process": self.process_id,
            "tokens": self.tokens,
            "step_s": self.step_timer.step_s,
            "compute_s": self.compute_s,
            "ledger": asdict(self.sync.ledger),
            "tokens_per_step": self.tokens_per_step,
            "fetch_s": self.stats.fetch_s,
            "global_step": self.global_step,
            **self.stats,
            **self._island_report,
            **self.extra_report,
        }

    # -- background threads -----------------------------------------------------------------
