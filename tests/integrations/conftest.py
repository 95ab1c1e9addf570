"""The runtime's test helpers (real syncer processes) for the trainer integration tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from runtime_helpers import syncer_factory  # noqa: E402

__all__ = ["syncer_factory"]
