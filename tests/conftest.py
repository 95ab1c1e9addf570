"""Fixtures of every test directory: ``syncer_factory`` (real ``ddiloco syncer`` processes)
from ``runtime_helpers``, the harness for real syncers. This file puts ``tests/`` on the
import path (pytest's rootdir-relative ``prepend`` mode), so any test imports the harness
as ``runtime_helpers``."""

from __future__ import annotations

from runtime_helpers import syncer_factory

__all__ = ["syncer_factory"]
