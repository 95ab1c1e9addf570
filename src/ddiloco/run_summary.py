"""``summary.json``: one type for what every engine and launcher writes at the end of a run.

The in-process engine (``ddiloco.engine.run``), the built-in and Ray launchers
(``ddiloco.runtime.launch.summary``) and the Slurm job (``ddiloco launch --backend slurm``,
``summarise``) all build a ``RunSummary`` and write it with :meth:`RunSummary.write`
(atomically: a crash leaves the previous file or the new one, never a torn one). Its fields
are the keys every run has, under one name each; what only one engine measures (the
in-process virtual time, the real runtime's membership and syncer counters, a Slurm job's
id) goes in ``extra`` and is written beside them at the top level of the JSON, so readers
(the results table, ``ddiloco report``, the dashboard) find every key where it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunSummary", "SUMMARY_FILE"]

SUMMARY_FILE = "summary.json"


@dataclass(kw_only=True, slots=True)
class RunSummary:
    """The end of one run. Losses are of the final global model on the held-out batches."""

    method: str
    """local, dp, diloco, streaming or decoupled."""
    engine: str
    """inproc or processes."""
    learners: int
    """M: learners that took part (learner ids seen, for an elastic run)."""
    steps: int
    """Inner steps per learner of the budget (``--steps``)."""
    tokens: int | None
    """Tokens the learners trained: M x steps x tokens per step (x the island size) in
    process; the real runtime's learners' steps (they share a step budget, and a run that
    was interrupted trained fewer) x tokens per step (x the island size)."""
    final_eval_loss: float | None
    """None when the run ended without a final model."""
    initial_eval_loss: float | None
    entropy_floor: float | None
    """The synthetic language's entropy rate per token (None for other data)."""
    entropy_rate: float | None = None
    eval_accuracy: float | None = None
    """Next-token (or class) accuracy of the final model, where measured."""
    data: str | None = None
    model: str | None = None
    goodput: float | None = None
    """Chip-time of merged inner steps over total chip-time (``docs/architecture.md``)."""
    uptime: float | None = None
    bytes_up: int | None = None
    bytes_down: int | None = None
    merges: int | None = None
    learners_per_merge: float | None = None
    install: str | None = None
    """The install rule of a decoupled run (``sync.install``)."""
    wall_s: float | None = None
    per_learner: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    """The run's resolved configuration (``config.toml``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys only some engines have; written at the top level beside the fields."""

    def __post_init__(self) -> None:
        clash = sorted(set(self.extra) & (_FIELDS | {"gap_to_floor"}))
        if clash:
            raise ValueError(f"extra keys {clash} are RunSummary fields: set the fields")

    @property
    def gap_to_floor(self) -> float | None:
        if self.final_eval_loss is None or self.entropy_floor is None:
            return None
        return self.final_eval_loss - self.entropy_floor

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: every field (``extra`` flattened in) and ``gap_to_floor``."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d["gap_to_floor"] = self.gap_to_floor
        return {**d, **self.extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSummary:
        """Read the JSON form back (keys that are not fields go to ``extra``)."""
        known = {k: v for k, v in d.items() if k in _FIELDS}
        extra = {k: v for k, v in d.items() if k not in _FIELDS and k != "gap_to_floor"}
        return cls(**known, extra=extra)

    def write(self, out: str | os.PathLike) -> dict[str, Any]:
        """Write ``out/summary.json`` atomically (fsync, then rename); returns the dict."""
        d = self.to_dict()
        path = Path(out) / SUMMARY_FILE
        tmp = path.with_name(SUMMARY_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(d, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return d

    @classmethod
    def read(cls, out: str | os.PathLike) -> RunSummary:
        return cls.from_dict(json.loads((Path(out) / SUMMARY_FILE).read_text()))


_FIELDS = frozenset(f.name for f in dataclasses.fields(RunSummary) if f.name != "extra")
