"""What every part of a learner shares: ``LearnerContext`` (its ids, the model spec, the
fragmentation, the schedule, the codec, the ``LearnerSync`` bookkeeping, the island's
process groups and rank, the lock and the events between threads) and ``LearnerStats``
(the traffic and install counters its reports carry).

The context is built once, by ``build_context``, when ``DecoupledLearner`` is; the parts
(``inbox``, ``session``, ``links``, ``island``) each take it as an argument and keep their
own state. Of its fields only the ids (``learner``, ``incarnation``, ``boot_id``), the
events and ``stats`` change after it is built."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch

from ddiloco.algorithm.codecs import Codec, get_codec
from ddiloco.algorithm.fragments import Fragmentation
from ddiloco.algorithm.learner_state import LearnerSync
from ddiloco.algorithm.schedule import ClockTrack, FragmentSchedule
from ddiloco.runtime.learner.client import LinkLimits
from ddiloco.runtime.learner.device import DeviceCopier
from ddiloco.runtime.learner.layout import IslandPlan, island_group, local_runs, mesh_group
from ddiloco.runtime.transport.session import new_process_key
from ddiloco.runtime.transport.spec import fragmentation_from_spec, model_spec, spec_fingerprint

__all__ = ["LearnerContext", "LearnerStats", "build_context"]


@dataclass(slots=True)
class LearnerStats(Mapping):
    """A learner process's counters, as its reports carry them (``report()``, the heartbeat,
    the Leave): read as a mapping (``stats["pushes"]``, ``dict(stats)``) or by field."""

    bytes_sent: int = 0
    """Wire bytes of pushes and initial uploads."""
    bytes_received: int = 0
    """Wire bytes of fetched fragments."""
    pushes: int = 0
    pushes_accepted: int = 0
    pushes_rejected: int = 0
    installs: int = 0
    """Merged fragments installed into the model."""
    install_delay_steps: float = 0.0
    """The mean steps a merged fragment took to come back after its push."""
    reconnects: int = 0
    """Times the heartbeat found the syncer unreachable."""
    fetch_s: float | None = None
    """A fetch's time, a moving average (None before the first)."""
    push_errors: int = 0
    """Pushes retried after a transient error."""

    def __getitem__(self, key: str) -> Any:
        if key not in _STAT_NAMES:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_STAT_NAMES)

    def __len__(self) -> int:
        return len(_STAT_NAMES)

    def fetched(self, nbytes: int, dt_s: float) -> None:
        """A fetch of ``nbytes`` wire bytes that took ``dt_s`` seconds."""
        self.fetch_s = dt_s if self.fetch_s is None else 0.8 * self.fetch_s + 0.2 * dt_s
        self.bytes_received += nbytes

    def pushed(self, nbytes: int, accepted: bool) -> None:
        """A push the syncer answered (accepted, or rejected or a duplicate)."""
        self.bytes_sent += nbytes
        self.pushes += 1
        if accepted:
            self.pushes_accepted += 1
        else:
            self.pushes_rejected += 1


_STAT_NAMES = tuple(f.name for f in fields(LearnerStats))


@dataclass(eq=False)
class LearnerContext:
    """The ids, the model's layout and the shared bookkeeping of one learner process."""

    model: torch.nn.Module
    """The user's module, unwrapped (``layout``)."""
    params: dict[str, torch.Tensor]
    """Name -> the tensor this process syncs: the parameter, or (sharded) its local shard,
    which installs write in place."""
    spec: dict
    fingerprint: str
    fragmentation: Fragmentation
    schedule: FragmentSchedule
    codec: Codec
    sync: LearnerSync
    copier: DeviceCopier
    clock: ClockTrack
    """The syncer's slot clock as last heard."""
    time_driven: bool
    """``schedule="time"``: sends follow the syncer's slot clock."""
    link: LinkLimits
    connect_timeout_s: float
    heartbeat_s: float
    watch_s: float
    """An idle long poll for merged versions (a merge ends it earlier)."""
    flush_timeout_s: float
    group: Any = None
    """The island's process group (None: one process)."""
    control_group: Any = None
    """The group of the island's small control messages (a Gloo group beside an NCCL one or
    a sharded model's; the island's group otherwise)."""
    rank: int = 0
    root_rank: int = 0
    """The global rank of the island's rank 0."""
    plan: IslandPlan | None = None
    """A sharded island's plan of who pushes and fetches which runs (None: not sharded)."""
    learner: int = -1
    """This learner's id: the one asked for, or (-1 until the first Join) the one the
    syncer assigned."""
    incarnation: int = -1
    boot_id: str = ""
    process_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """This learner process: the syncer carries a restarted learner's earlier totals."""
    process_key: str = field(default_factory=new_process_key)
    """This process's secret, sent in its Joins only (``transport.session``)."""
    settings_as: str = "keywords"
    """How warnings name a setting to change: ``keywords`` or ``flags``."""
    stats: LearnerStats = field(default_factory=LearnerStats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards what the background threads and the training thread both touch."""
    closed: threading.Event = field(default_factory=threading.Event)
    """Set by ``close``: the background threads end."""
    joined: threading.Event = field(default_factory=threading.Event)
    """A session with the syncer is open (cleared when it must be rejoined)."""
    stop: threading.Event = field(default_factory=threading.Event)
    """The syncer's step budget is spent."""

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def build_context(
    model: torch.nn.Module,
    wrapped: torch.nn.Module,
    *,
    learner: int | None,
    P: int | None,  # noqa: N803
    H: int,  # noqa: N803
    tau: int,
    strategy: str,
    codec: str,
    alpha: float,
    install: str,
    schedule: str,
    link: LinkLimits | None,
    connect_timeout: timedelta,
    heartbeat_interval: timedelta,
    flush_timeout: timedelta,
    process_group: Any,
) -> LearnerContext:
    """The context of a learner of ``model`` (unwrapped; ``wrapped`` as the user passed it,
    whose DDP wrapper names the island's group when ``process_group`` is None). A sharded
    island's ranks exchange their runs here (collective)."""
    push_codec = get_codec(codec)
    local = local_runs(model)
    sharded = local is not None
    if process_group is None:  # the island the user set up: a DDP wrapper's, a mesh's
        process_group = mesh_group(model) if sharded else island_group(wrapped)
    control_group = process_group
    rank = root_rank = 0
    if process_group is not None:
        import torch.distributed as dist

        rank = dist.get_rank(process_group)
        root_rank = dist.get_global_rank(process_group, 0)
        if sharded:
            # the step-boundary exchange has a Gloo group of its own (small Python
            # objects; never interleaved with the sharded model's own collectives)
            control_group = dist.new_group(
                dist.get_process_group_ranks(process_group), backend="gloo"
            )
        elif dist.get_backend(process_group) == "nccl":
            # NCCL takes device tensors only: the island's small control messages (install
            # mask, stop flag, budget) go over a Gloo group beside it, so reading them
            # never synchronises the device; parameters still travel over NCCL
            control_group = dist.new_group(
                dist.get_process_group_ranks(process_group), backend="gloo"
            )
    n_tensors = len(list(model.parameters()))
    P = P if P is not None else min(H, n_tensors, 24)  # noqa: N806
    spec = model_spec(model, P, strategy)
    fragmentation = fragmentation_from_spec(spec)
    frag_schedule = FragmentSchedule(P, H, tau)
    params: dict[str, torch.Tensor] = dict(model.named_parameters()) if local is None else local[0]
    plan: IslandPlan | None = None
    if local is not None:
        runs = [local[1]]
        if process_group is not None:
            import torch.distributed as dist

            runs = [{}] * dist.get_world_size(process_group)
            dist.all_gather_object(runs, local[1], group=control_group)
        plan = IslandPlan(fragmentation, runs, rank)
    copier = DeviceCopier.for_params(list(params.values()))
    time_driven = schedule == "time"
    # time-driven: ``after_step`` gets the time in nominal steps of the syncer's clock
    sync = LearnerSync(
        params,
        fragmentation,
        frag_schedule,
        alpha=alpha,
        install=install,
        snapshot=copier.snapshot,
        slot_s=1.0 if time_driven else None,
    )
    heartbeat_s = heartbeat_interval.total_seconds()
    return LearnerContext(
        model=model,
        params=params,
        spec=spec,
        fingerprint=spec_fingerprint(spec),
        fragmentation=fragmentation,
        schedule=frag_schedule,
        codec=push_codec,
        sync=sync,
        copier=copier,
        clock=ClockTrack(),
        time_driven=time_driven,
        link=link or LinkLimits(),
        connect_timeout_s=connect_timeout.total_seconds(),
        heartbeat_s=heartbeat_s,
        watch_s=max(0.5, 2 * heartbeat_s),
        flush_timeout_s=flush_timeout.total_seconds(),
        group=process_group,
        control_group=control_group,
        rank=rank,
        root_rank=root_rank,
        plan=plan,
        learner=-1 if learner is None else learner,
    )
