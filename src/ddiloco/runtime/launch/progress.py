"""The process launcher's live display: one row per learner (process state, step, merged
steps, goodput, loss) under a line of run totals.

On a terminal it is a ``rich`` live table redrawn in place; when the output is not a
terminal (a pipe, a log file, CI) it degrades to one plain line every ``interval_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.console import Console, JustifyMethod
from rich.live import Live
from rich.table import Table

from ddiloco.runtime.observe.accounting import goodput_so_far, learner_totals

__all__ = ["LearnerRow", "LiveProgress", "learner_rows", "plain_line", "progress_table"]

PROC_MARK = {"running": "", "down": "x", "stopped": "z", "finished": "", "failed": "!"}
"""Suffix of a learner's step in the plain line: x killed or crashed (restarting), z frozen
(SIGSTOP), ! failed for good."""


@dataclass(frozen=True, slots=True)
class LearnerRow:
    learner: int
    process: str
    """The launcher's view: running, down, stopped, finished, failed (or -)."""
    syncer: str
    """The syncer's view: live, dead, left (or - before it joined)."""
    step: int
    merged_steps: float | None
    goodput: float | None
    """This learner's chip-time of merged steps, over all its processes, divided by the
    run's time so far (``observe.accounting``; the run's goodput is their mean)."""
    loss: float | None


def learner_rows(status: dict, proc_states: dict[int, str], learners: int) -> list[LearnerRow]:
    """One row per learner from a syncer status snapshot and the launcher's process states."""
    rows = []
    run_s = status.get("run_s") or 0.0
    for m in range(learners):
        info = (status.get("learners") or {}).get(str(m)) or {}
        rep = info.get("report") or {}
        tot = learner_totals(info) if info else None
        rows.append(
            LearnerRow(
                m,
                proc_states.get(m, "-"),
                info.get("state", "-"),
                int(rep.get("global_step", tot["steps"] if tot else 0) or 0),
                tot["ledger"]["merged"] if tot else None,
                tot["useful_s"] / run_s if tot and run_s > 0 else None,
                rep.get("loss"),
            )
        )
    return rows


def _totals(t_s: float, status: dict) -> str:
    g = goodput_so_far(status) if status else None
    budget = f" / {status['step_budget']}" if status.get("step_budget") else ""
    return (
        f"t {t_s:.1f} s  steps {status.get('steps_done', 0)}{budget}  merges "
        f"{status.get('merges', 0)}  goodput {'-' if g is None else f'{g:.3f}'}"
    )


def plain_line(t_s: float, status: dict, rows: list[LearnerRow]) -> str:
    """The non-terminal form: ``[  12.0s] steps 40 38x 41 (119/300)  merges 17  loss 3.412
    goodput~0.91``."""
    losses = [r.loss for r in rows if r.loss is not None]
    g = goodput_so_far(status) if status else None
    budget = (
        f" ({status.get('steps_done', 0)}/{status['step_budget']})"
        if status.get("step_budget")
        else ""
    )
    steps = " ".join(f"{r.step}{PROC_MARK.get(r.process, '')}" for r in rows)
    loss = sum(losses) / len(losses) if losses else math.nan
    return (
        f"[{t_s:6.1f}s] steps {steps}{budget}  merges {status.get('merges', 0)}  "
        f"loss {loss:.3f}  goodput~{'-' if g is None else round(g, 3)}"
    )


def progress_table(t_s: float, status: dict, rows: list[LearnerRow]) -> Table:
    """The terminal form: a rich table with the run's totals as its title."""
    table = Table(title=_totals(t_s, status), title_justify="left", expand=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("learner", "right"),
        ("process", "left"),
        ("syncer", "left"),
        ("step", "right"),
        ("merged steps", "right"),
        ("goodput", "right"),
        ("loss", "right"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify)
    style = {"down": "red", "failed": "bold red", "stopped": "yellow", "finished": "dim"}
    for r in rows:
        table.add_row(
            str(r.learner),
            r.process,
            r.syncer,
            str(r.step),
            "-" if r.merged_steps is None else f"{r.merged_steps:.1f}",
            "-" if r.goodput is None else f"{r.goodput:.3f}",
            "-" if r.loss is None else f"{r.loss:.4f}",
            style=style.get(r.process),
        )
    return table


class LiveProgress:
    """``update()`` with each new status; ``close()`` leaves the last table on screen.

    ``console`` defaults to standard error; whether it is a terminal picks the form."""

    def __init__(
        self, learners: int, *, console: Console | None = None, interval_s: float = 2.0
    ) -> None:
        self.learners = learners
        self.console = console or Console(stderr=True)
        self.interval_s = interval_s
        self._next_line_s = 0.0
        self._live: Live | None = None
        if self.console.is_terminal:
            self._live = Live(
                console=self.console, refresh_per_second=4, transient=False, auto_refresh=False
            )
            self._live.start()

    @property
    def terminal(self) -> bool:
        return self._live is not None

    def update(self, t_s: float, status: dict | None, proc_states: dict[int, str]) -> None:
        status = status or {}
        rows = learner_rows(status, proc_states, self.learners)
        if self._live is not None:
            self._live.update(progress_table(t_s, status, rows), refresh=True)
        elif t_s >= self._next_line_s:
            self._next_line_s = t_s + self.interval_s
            self.console.file.write(plain_line(t_s, status, rows) + "\n")
            self.console.file.flush()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> LiveProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
