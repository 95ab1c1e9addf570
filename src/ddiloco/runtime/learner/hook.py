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

Results flow back to the training thread as typed events (``inbox``) through a queue
drained at every ``step``. An island (a torchrun group running DDP) passes
``process_group``: rank 0 talks to the syncer and broadcasts the global model and every
installed fragment to the other ranks.

``DecoupledLearner`` is a facade over parts it owns, each with its own state: the
``context`` (ids, spec, fragmentation, schedule, codec, ``LearnerSync``, the lock), the
``inbox``, the ``session`` (Join, fetch, heartbeat, rejoin), the ``links`` (sender and
receiver threads, the delta base cache) and one ``island``, picked when it is built: one
process (``island.solo``), a replicated torchrun group (``island.replicated``) or a sharded
one (``island.sharded``).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from datetime import timedelta

import torch

from ddiloco.algorithm.learner_state import LearnerSync
from ddiloco.algorithm.schedule import StepTimer
from ddiloco.config.sections import RUNTIME_DEFAULTS, SyncConfig
from ddiloco.runtime.learner.client import LinkLimits, SyncerError
from ddiloco.runtime.learner.context import LearnerContext, LearnerStats, build_context
from ddiloco.runtime.learner.inbox import Inbox
from ddiloco.runtime.learner.island import Island, late_install_advice
from ddiloco.runtime.learner.island.replicated import Replicated
from ddiloco.runtime.learner.island.sharded import Sharded
from ddiloco.runtime.learner.island.solo import Solo
from ddiloco.runtime.learner.layout import unwrap_model
from ddiloco.runtime.learner.links import DeltaBases, Links
from ddiloco.runtime.learner.session import DUPLICATE_WAIT_S
from ddiloco.runtime.learner.sharded import ShardedClient
from ddiloco.runtime.transport.auth import load_token

__all__ = ["DUPLICATE_WAIT_S", "DecoupledLearner", "late_install_advice"]

_SYNC = SyncConfig()
_RUNTIME = RUNTIME_DEFAULTS
"""The run configuration's defaults, which ``DecoupledLearner``'s keyword arguments take
(compared in tests/config/test_defaults.py)."""


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
        self.tokens_per_step = tokens_per_step
        self.load_global_on_exit = load_global_on_exit
        """At ``close``, after the last pushes are merged, copy the global model into
        ``model`` (the local model stays if the syncer cannot be reached: a warning)."""
        self.loaded_global_on_exit = False
        self.ctx: LearnerContext = build_context(
            self.model,
            model,
            learner=learner,
            P=P,
            H=H,
            tau=tau,
            strategy=strategy,
            codec=codec,
            alpha=alpha,
            install=install,
            schedule=schedule,
            link=link,
            connect_timeout=connect_timeout,
            heartbeat_interval=heartbeat_interval,
            flush_timeout=flush_timeout,
            process_group=process_group,
        )
        ctx = self.ctx
        self.group = ctx.group
        self.client: ShardedClient | None = None
        """The connection to the syncer (one syncer or a sharded one: the map comes with the
        first Join); None on the ranks of a replicated island other than 0."""
        if ctx.is_root or ctx.plan is not None:  # every rank of a sharded island moves its runs
            self.client = ShardedClient(
                syncer,
                token or load_token(token_file, how="token=SECRET or token_file=PATH"),
                tls_ca,
                tls,
            )
        self.inbox = Inbox(ctx, self.client)
        bases = DeltaBases(ctx.codec, ctx.lock)
        self.links = Links(ctx, self.client, self.inbox, bases)
        self.island: Island = self._pick_island(bases)
        self.session = self.island.session
        self.step_timer = StepTimer()
        """This learner's measured step time (``step_s`` in its reports): the syncer's
        slot clock is measured from it."""
        self.compute_s = 0.0
        self.tokens = 0
        """Tokens this process stepped (the syncer carries earlier processes' totals)."""
        self.extra_report: dict = {}
        self._hook = None
        self._started = False
        self._stop_seen = False
        self._last_step_t: float | None = None

    def _pick_island(self, bases: DeltaBases) -> Island:
        ctx, parts = self.ctx, (self.inbox, self.links, bases, self.report)
        if ctx.plan is not None:
            assert self.client is not None
            return Sharded(ctx, self.client, *parts)
        if ctx.group is not None:
            return Replicated(ctx, self.client, *parts)
        return Solo(ctx, self.client, *parts)

    # -- what the parts hold --------------------------------------------------------------
    @property
    def learner(self) -> int:
        """This learner's id: the one asked for, or (-1 until the first Join) the one the
        syncer assigned."""
        return self.ctx.learner

    @property
    def incarnation(self) -> int:
        return self.ctx.incarnation

    @property
    def boot_id(self) -> str:
        return self.ctx.boot_id

    @property
    def process_id(self) -> str:
        """This learner process: the syncer carries a restarted learner's earlier totals."""
        return self.ctx.process_id

    @property
    def sync(self) -> LearnerSync:
        return self.ctx.sync

    @property
    def stats(self) -> LearnerStats:
        """Traffic and install counters (a mapping: ``stats["pushes"]``)."""
        return self.ctx.stats

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Name -> the tensor this process syncs: the parameter, or (sharded) its local
        shard, which installs write in place."""
        return self.ctx.params

    @property
    def sharded(self) -> bool:
        """An FSDP2 or HSDP island: every rank syncs its own shards."""
        return self.ctx.plan is not None

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def settings_as(self) -> str:
        """How warnings name a setting to change: ``keywords``, this class's arguments
        (``tau=4``), or ``flags``, the command line's (``--tau 4``; ``ddiloco learner``
        sets it)."""
        return self.ctx.settings_as

    @settings_as.setter
    def settings_as(self, value: str) -> None:
        self.ctx.settings_as = value

    @property
    def step_budget(self) -> int:
        """The syncer's global step budget (0: none), learned when joining."""
        return self.session.step_budget

    @property
    def step_offset(self) -> int:
        """Steps this learner id did in earlier processes (the syncer's record, from the
        latest report of its previous incarnation): ``global_step`` counts from it."""
        return self.session.step_offset

    @property
    def _thread_error(self) -> BaseException | None:
        return self.links.thread_error

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
        self._stop_seen = self.island.start()
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
        _, params = self.island.global_model(timeout.total_seconds())
        return {n: params[n].to(self.params[n].dtype).clone() for n in self.params}

    def load_global(self, timeout: timedelta = timedelta(seconds=60)) -> list[int]:
        """Install the syncer's current global model into ``model`` now and go on training
        from it, as a restarted learner does; returns the installed fragment versions. The
        local steps not yet pushed are discarded (counted lost). Call it from the training
        thread, between steps (every rank of an island)."""
        versions, params = self.island.global_model(timeout.total_seconds())
        self.island.install(versions, params)
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
        if self.ctx.closed.is_set():
            return
        if self._hook is not None:
            self._hook.remove()
        if self._started:
            exit_params = self.island.flush(self.load_global_on_exit)
            if self.ctx.is_root:
                self.session.leave()
            if self.load_global_on_exit and self.island.install_at_exit(exit_params):
                self.loaded_global_on_exit = True
        self.ctx.closed.set()
        self.island.close()

    # -- the training thread ----------------------------------------------------------------
    def step(self, tokens: int) -> list[int]:
        """Record one inner step of ``tokens`` tokens (the island's total); send the
        fragments due; install merged fragments whose install step has come. Returns the
        installed fragment indices. Never blocks on the network (a sharded island's ranks
        exchange one small message: every rank calls it)."""
        self.island.check()
        now = time.monotonic()
        if self._last_step_t is not None:
            dt = now - self._last_step_t
            self.compute_s += dt
            self.step_timer.add(dt)
        self._last_step_t = now
        self.tokens += tokens
        installed, stop = self.island.exchange_after_step(tokens)
        self._stop_seen = self._stop_seen or stop
        return installed

    def wait_installs(self, timeout: timedelta = timedelta(minutes=5)) -> list[int]:
        """Block until every fragment whose install step has come is installed: call after
        ``step`` for synchronous DiLoCo (tau = 0, P = 1, quorum K = M, every learner waits
        for the merge of its push). Returns when the syncer says stop, too; raises
        ``SyncerError`` after ``timeout``. Not for islands (``process_group``)."""
        if self.group is not None:
            raise ValueError("wait_installs does not support islands (process_group)")
        deadline = time.monotonic() + timeout.total_seconds()
        installed: list[int] = []
        while not self.ctx.stop.is_set():
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
            self.inbox.drain()
            installed += self.links.install_due()
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
            **self.island.report,
            **self.extra_report,
        }
