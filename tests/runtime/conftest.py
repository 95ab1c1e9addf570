"""Fixtures for the runtime's integration tests."""

from __future__ import annotations

from runtime_helpers import syncer_factory

__all__ = ["syncer_factory"]
