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


def run_processes(config) -> int:
    """Run ``config`` (a TrainConfig) with a real syncer and learner processes: on this host
    (``runtime.launcher = local``) or as Ray actors (``ray``)."""
    with launcher_class(config)(config) as launcher:
        summary = launcher.run()
    return 0 if summary.get("ok") else 1
