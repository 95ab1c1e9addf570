"""The runtime's test helpers (real syncer processes) for the trainer integration tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

import pytest  # noqa: E402
from runtime_helpers import SyncerProcess  # noqa: E402


@pytest.fixture
def syncer_factory(tmp_path):
    """Start ``ddiloco syncer`` processes on ephemeral ports; stop them after the test."""
    made = []

    def make(*args: str, token: str = "test-token") -> SyncerProcess:
        s = SyncerProcess(tmp_path, token, *args)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
