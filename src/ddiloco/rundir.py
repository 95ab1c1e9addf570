"""A run directory (``--out``): what a run of ``ddiloco train`` writes there, and starting it
afresh.

Both engines write ``config.toml``, ``metrics.jsonl``, ``summary.json`` and the final global
model (``checkpoint/`` of the real runtime's syncer, ``final_model.safetensors`` of the
in-process engine; ``ddiloco export RUN_DIR`` reads either); the real runtime adds
``logs/``, ``learner_*/``, ``chaos.jsonl`` and the syncers' files, and the metrics sinks
``tensorboard/``, ``mlruns/`` and ``wandb/``. A new run in the same directory removes all of
them first, so nothing of an earlier run (a learner that run had and this one has not, its
logs, its checkpoint) is read as this run's: not by the dashboard, the report or the export.
Files the runs do not write are left alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["RUN_FILES", "FINAL_MODEL", "MODEL_FILE", "TOKEN_FILE", "fresh_run_dir"]

FINAL_MODEL = "final_model.safetensors"
"""The in-process engine's final global model (the real runtime's is its syncer's
checkpoint)."""

MODEL_FILE = "model.json"
"""The run's model, ``{"name": preset, "args": {...}}`` (``recipe.model_record``), written
when a run of the real runtime starts: ``ddiloco export`` and ``ddiloco.load_model`` build
the model from it without the run's data."""

TOKEN_FILE = "token"
"""The run's shared secret (mode 0600), written by the local launcher for ``ddiloco status
RUN_DIR``; the syncer and learners take it from the environment."""

RUN_FILES = (
    "config.toml",
    "config.json",
    "summary.json",
    "summary.json.tmp",
    "metrics.jsonl",
    "chaos.jsonl",
    FINAL_MODEL,
    MODEL_FILE,
    TOKEN_FILE,
    "syncer*.port",
    "syncer*.metrics.jsonl",
    "checkpoint",
    "logs",
    "learner_*",
    "tensorboard",
    "mlruns",
    "wandb",
)
"""Names (globs) of everything a run writes in its directory."""


def fresh_run_dir(out: str | Path) -> Path:
    """Create ``out`` (and its parents) and remove every file and folder an earlier run left
    in it (``RUN_FILES``); returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for pattern in RUN_FILES:
        for path in out.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    return out
