"""The one check that every launch backend (``ddiloco.backends``) makes before it starts
anything: the run is Decoupled DiLoCo on real processes, the downlink codec can carry merged
fragments, the backend runs the run's island layouts, and it carries out the chaos the run
asks for. The faults that need a launcher to signal its processes (kills, stops, syncer
kills, elastic membership, link cuts) are listed once, in
``ddiloco.config.chaos.INJECTED_FAULTS``; a backend only says whether it injects them
(``Backend.injects_faults``). Slow-downs and link limits are applied by the learners
themselves under every backend.
"""

from __future__ import annotations

from ddiloco.backends import get_backend

__all__ = ["check_runnable"]


def check_runnable(config, name: str):
    """``config`` (a ``TrainConfig``) with engine processes, or a ValueError in one line
    saying why backend ``name`` cannot run it and what to do instead."""
    from ddiloco.algorithm.codecs import downlink_codec_names
    from ddiloco.runtime.chaos import chaos_for_run

    b = get_backend(name)
    if config.engine == "inproc" or config.method != "decoupled":
        raise ValueError(
            f"{b.title} runs Decoupled DiLoCo's syncer and learner processes; method "
            f"{config.method!r} on engine {config.engine!r} runs in-process: use `ddiloco "
            f"train --engine inproc` for it"
        )
    config = config.replace(engine="processes")
    if config.sync.down_codec not in downlink_codec_names():
        raise ValueError(
            f"sync.down_codec {config.sync.down_codec!r}: the syncer sends merged fragments "
            f"as one of {', '.join(downlink_codec_names())}"
        )
    rt = config.runtime
    if not b.layouts and (rt.islands or rt.island(None).sharding in ("fsdp", "hsdp")):
        raise ValueError(
            f"{b.title} runs every learner as one process or a DDP island of "
            f"runtime.island_size ranks; sharded islands (runtime.island_sharding "
            f"{rt.island_sharding}) and learners of different layouts (runtime.islands "
            f"{rt.islands!r}) run under the local launcher (runtime.launcher = local)"
        )
    faults = chaos_for_run(config).injected_faults()
    if faults and not b.injects_faults:
        raise ValueError(
            f"{b.title} does not inject the launcher's chaos ({', '.join(faults)}; "
            f"world.mtbi_s becomes kill_mean_interval_s), only the local launcher does: "
            f"{b.instead} (slow-downs and link limits work with every backend)"
        )
    return config
