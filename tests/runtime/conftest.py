"""Fixtures for the runtime's integration tests."""

from __future__ import annotations

import pytest
from runtime_helpers import SyncerProcess


@pytest.fixture
def syncer_factory(tmp_path):
    made = []

    def make(*args: str, token: str = "test-token") -> SyncerProcess:
        s = SyncerProcess(tmp_path, token, *args)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
