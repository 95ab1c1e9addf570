"""``ddiloco train --engine processes``: pick the run's launcher and run it.

``runtime.launcher`` names it, a launcher of the backend registry
(``ddiloco.backends``): ``local`` (``Launcher``: processes on this host),
``ray`` (``RayLauncher``: Ray actors).
"""

from __future__ import annotations

__all__ = ["launcher_class", "run_processes"]


def launcher_class(config) -> type:
    """The launcher class of ``runtime.launcher``: ``Launcher`` (local), ``RayLauncher``
    (ray)."""
    from ddiloco.backends import get_backend

    return get_backend(config.runtime.launcher, "launcher").load()


def run_processes(config) -> dict:
    """Run ``config`` (a TrainConfig) with a real syncer and learner processes: on this host
    (``runtime.launcher = local``) or as Ray actors (``ray``). Returns the run's summary
    (``summary.json``; ``ok`` says whether every process finished)."""
    with launcher_class(config)(config) as launcher:
        return launcher.run()
