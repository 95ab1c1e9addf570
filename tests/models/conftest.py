"""Shared fixtures: run each test on one intra-op thread.

The models here are tiny, so a second thread buys nothing, and on a shared machine
oversubscribed threads slow training tests by an order of magnitude. The previous
setting is restored after each test so other test folders are unaffected.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
