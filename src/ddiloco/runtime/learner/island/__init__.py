"""The islands a learner can be: one process (``solo``), a torchrun group that broadcasts
from rank 0 (``replicated``: DDP), or a sharded one where every rank syncs its own slices
(``sharded``: FSDP2, HSDP). ``Island`` is what ``DecoupledLearner`` asks of each; it picks
one when it is built and never asks which it has.

``InstallWatch`` measures how late merged fragments come back and says once what to change
when they come back later than tau (``late_install_advice``)."""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import NoReturn, Protocol

import torch

from ddiloco.runtime.learner.context import LearnerContext
from ddiloco.runtime.learner.session import Session

__all__ = ["InstallWatch", "Island", "copy_params", "exit_island_rank", "late_install_advice"]

log = logging.getLogger("ddiloco.learner")

_FLAGS = {"tau": "--tau", "H": "-H", "P": "-P", "codec": "--codec"}
"""The command line's names of the settings that advice names (``ddiloco learner`` and
``ddiloco train``)."""


def exit_island_rank(code: int = 0) -> NoReturn:
    """End a finished torchrun rank without interpreter finalization: call it last, after
    ``dist.destroy_process_group()``.

    The Gloo process group's worker threads outlive ``destroy_process_group`` (DDP keeps
    the group referenced), and a worker that finishes a collective on a Python tensor
    drops that tensor after the caller has moved on; when that decref needs the GIL while
    the interpreter is finalizing, the thread is unwound through a noexcept destructor and
    the process aborts ("terminate called without an active exception", SIGABRT), which
    torchrun reports as a failed island. This flushes the logs and the standard streams
    and leaves with ``os._exit(code)``: close or flush any file of your own first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Island(Protocol):
    """What the learner's hook asks of its island. Every rank of an island calls each
    method at the same point of its training loop."""

    session: Session
    report: dict
    """What the island adds to the learner's report (a sharded island: its ranks' traffic)."""

    def start(self) -> bool:
        """Join the syncer, install the global model, start the threads. Returns the stop
        flag, the same on every rank."""
        ...

    def check(self) -> None:
        """Raise ``SyncerError`` at a step when a communication thread failed."""
        ...

    def exchange_after_step(self, tokens: int) -> tuple[list[int], bool]:
        """After an inner step of ``tokens`` tokens: apply the threads' events, send the
        fragments due, install those whose install step has come. Returns (the installed
        fragments, the stop flag), the same on every rank."""
        ...

    def global_model(self, timeout_s: float) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The syncer's global model: (versions, name -> this process's tensors of it)."""
        ...

    def install(self, versions: list[int], params: dict[str, torch.Tensor]) -> None:
        """Train on from the global model ``params`` at ``versions`` (its local steps not
        yet pushed are discarded)."""
        ...

    def flush(self, fetch_global: bool) -> dict[str, torch.Tensor] | None:
        """At close: the final pushes, waited for (up to ``flush_timeout``) until merged;
        then, with ``fetch_global``, the global model (None when it cannot be fetched)."""
        ...

    def install_at_exit(self, params: dict[str, torch.Tensor] | None) -> bool:
        """Copy the global model fetched at close into the model; True when it was."""
        ...

    def close(self) -> None:
        """After ``ctx.closed`` is set: stop the threads, close the connections."""
        ...


def copy_params(params: dict[str, torch.Tensor], values: dict[str, torch.Tensor] | None) -> bool:
    """Write ``values`` into the tensors ``params`` (in place, by name); False when there
    are none."""
    if values is None:
        return False
    with torch.no_grad():
        for n, t in params.items():
            t.copy_(values[n])
    return True


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


class InstallWatch:
    """How many steps a merged fragment takes to come back (``install_delay_steps`` in the
    reports: the mean over this process's installs), with a warning, once, when over the
    last max(4, P) installs it is well past tau: the grace window then cannot gather
    learners (and ``install = overwrite`` loses the late steps)."""

    def __init__(self, ctx: LearnerContext) -> None:
        self.ctx = ctx
        self.mark: tuple[int, float] = (
            0,
            0,
        )  # (installs, summed delay) at the last delay measurement
        self.warned = False

    def installed(self) -> None:
        """Merged fragments were installed at this step."""
        ctx = self.ctx
        sync = ctx.sync
        installs, delay = sync.installs, sync.install_delay_steps
        ctx.stats.install_delay_steps = round(sync.mean_install_delay_steps, 2)
        n = installs - self.mark[0]
        if n < max(4, ctx.fragmentation.P):
            return
        d = (delay - self.mark[1]) / n
        self.mark = (installs, delay)
        tau = ctx.schedule.tau
        if d > tau + 1 and not self.warned:
            self.warned = True
            log.warning(
                "[learner %d step %d] merged fragments come back %.1f steps after their push "
                "on average, later than tau = %d: the syncer's grace window cannot gather "
                "learners%s. %s",
                ctx.learner,
                sync.step,
                d,
                tau,
                ", and the late steps are lost (install = overwrite)"
                if sync.install == "overwrite"
                else "",
                late_install_advice(
                    d,
                    H=ctx.schedule.H,
                    P=ctx.fragmentation.P,
                    codec=ctx.codec.name,
                    flags=ctx.settings_as == "flags",
                ),
            )
