"""The launch backends by name: who starts a real run's syncer shards and learners.

A backend is one of two kinds:

* ``launcher``: ``ddiloco train`` runs the job itself, through the backend named by
  ``runtime.launcher``. Its entry is a class built from the run's ``TrainConfig``, a context
  manager whose ``run()`` returns the run's summary. Built in: ``local`` (processes on this
  host, ``ddiloco.runtime.launch.launcher``) and ``ray`` (Ray actors,
  ``ddiloco.runtime.launch.ray_backend``).
* ``job``: ``ddiloco launch --backend NAME`` writes a job for a cluster scheduler, and
  submits it when asked. Its entry is a function ``(TrainConfig, options, *, submit_job,
  test_only) -> exit status``, and its options dataclass gives ``ddiloco launch`` one flag
  per field. Built in: ``slurm`` (``ddiloco.runtime.launch.slurm``).

Every backend calls ``ddiloco.runtime.launch.backends.check_runnable`` before it starts
anything. A backend only says whether it injects the faults that need a launcher to signal
its processes (``injects_faults``; they are listed once, in
``ddiloco.config.chaos.INJECTED_FAULTS``).

Adding a backend is its module and one ``register_backend`` line at the end of this one.
Entries name their module as a string, so this registry imports none of them, nor anything
of the package: the configuration (``runtime.launcher``'s choices) and the command line read
the names without importing a launcher, the runtime or torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "BACKENDS",
    "Backend",
    "backend_names",
    "get_backend",
    "register_backend",
]


@dataclass(frozen=True, slots=True)
class Backend:
    """One launch backend: where its code is and what it can run."""

    name: str
    """Its name: a value of ``runtime.launcher`` (launchers) or of ``ddiloco launch
    --backend`` (jobs)."""
    kind: Literal["launcher", "job"]
    """launcher: ``ddiloco train`` runs it; job: ``ddiloco launch`` writes a job for it."""
    module: str
    """The module that holds ``entry`` (and ``options``), imported when the backend is used."""
    entry: str
    """A launcher class ``(TrainConfig)`` with ``run() -> summary``, or a job function
    ``(TrainConfig, options, *, submit_job: bool, test_only: bool) -> int``."""
    title: str
    """How messages name it, e.g. ``the Ray launcher``."""
    help: str
    """One line for the command's help."""
    injects_faults: bool = False
    """It carries out the chaos faults that a launcher injects (``INJECTED_FAULTS``)."""
    instead: str = ""
    """What to do with a run whose chaos asks for faults it does not inject."""
    layouts: bool = False
    """It runs sharded islands (``runtime.island_sharding`` fsdp or hsdp) and learners of
    different layouts (``runtime.islands``); without it, every learner is one process or a
    DDP island of ``runtime.island_size`` ranks."""
    options: str | None = None
    """Jobs: the options dataclass in ``module``, one ``ddiloco launch`` flag per field."""
    flag_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Jobs: more spellings of option flags, by field name (``{"time_limit": ("--time",)}``)."""
    repeatable: Mapping[str, str] = field(default_factory=dict)
    """Jobs: tuple-valued options given once per value, by field name -> the value's metavar."""

    def load(self) -> Any:
        """The backend's entry (imports its module)."""
        return getattr(importlib.import_module(self.module), self.entry)

    def options_class(self) -> type | None:
        """The job's options dataclass (imports its module); None for launchers."""
        if self.options is None:
            return None
        return getattr(importlib.import_module(self.module), self.options)


BACKENDS: dict[str, Backend] = {}
"""Every registered backend by name, in registration order."""


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` under its name; returns it. A name is taken once."""
    if not backend.name or backend.name in BACKENDS:
        raise ValueError(f"launch backend {backend.name!r} is empty or already registered")
    if (backend.options is None) != (backend.kind == "launcher"):
        raise ValueError(f"launch backend {backend.name!r}: a job has options, a launcher none")
    BACKENDS[backend.name] = backend
    return backend


def backend_names(kind: Literal["launcher", "job"]) -> tuple[str, ...]:
    """The registered backends of ``kind``, in registration order."""
    return tuple(n for n, b in BACKENDS.items() if b.kind == kind)


def get_backend(name: str, kind: Literal["launcher", "job"] | None = None) -> Backend:
    """A backend by name (of ``kind`` if given); an unknown name lists the known ones."""
    b = BACKENDS.get(name)
    if b is None or (kind is not None and b.kind != kind):
        known = backend_names(kind) if kind else tuple(BACKENDS)
        raise ValueError(f"unknown launch backend {name!r}; choose one of {', '.join(known)}")
    return b


register_backend(
    Backend(
        name="local",
        kind="launcher",
        module="ddiloco.runtime.launch.launcher",
        entry="Launcher",
        title="the local launcher",
        help="processes on this host, supervised by the built-in launcher",
        injects_faults=True,
        layouts=True,
    )
)
register_backend(
    Backend(
        name="ray",
        kind="launcher",
        module="ddiloco.runtime.launch.ray_backend",
        entry="RayLauncher",
        title="the Ray launcher",
        help="Ray actors with declared CPUs and GPUs, brought back by Ray's actor restarts "
        "(needs pip install 'ddiloco[ray]')",
        instead="kill Ray workers from outside, or run this chaos with --launcher local",
    )
)
register_backend(
    Backend(
        name="slurm",
        kind="job",
        module="ddiloco.runtime.launch.slurm",
        entry="launch",
        options="SlurmOptions",
        title="the Slurm backend",
        help="one sbatch script: the syncer on the first node, a torchrun island per learner",
        instead="drop them from [chaos] (and world.mtbi_s) for a Slurm job, or run it with "
        "`ddiloco train`",
        flag_aliases={"time_limit": ("--time",), "sbatch_args": ("--sbatch-arg",)},
        repeatable={"sbatch_args": "OPTION"},
    )
)
