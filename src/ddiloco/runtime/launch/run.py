"""``ddiloco train --engine processes``: pick the run's launcher and run it.

``runtime.launcher`` names it: ``local`` (``Launcher``: processes on this host) or ``ray``
(``RayLauncher``: Ray actors).
"""

from __future__ import annotations

__all__ = ["launcher_class", "run_processes"]


def launcher_class(config) -> type:
    """The launcher of ``runtime.launcher``: ``Launcher`` (local) or ``RayLauncher`` (ray)."""
    if config.runtime.launcher == "ray":
        from ddiloco.runtime.launch.ray_backend import RayLauncher

        return RayLauncher
    from ddiloco.runtime.launch.launcher import Launcher

    return Launcher


def run_processes(config) -> dict:
    """Run ``config`` (a TrainConfig) with a real syncer and learner processes: on this host
    (``runtime.launcher = local``) or as Ray actors (``ray``). Returns the run's summary
    (``summary.json``; ``ok`` says whether every process finished)."""
    with launcher_class(config)(config) as launcher:
        return launcher.run()
