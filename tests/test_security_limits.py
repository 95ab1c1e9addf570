"""docs/security.md's table of limits and defaults says what the code declares: each row's
default is read from the declaration it names, so a changed default fails here until the
page says it too."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ddiloco.config import RuntimeConfig, SyncConfig
from ddiloco.runtime.learner.session import DUPLICATE_WAIT_S
from ddiloco.runtime.syncer.checkpoint import DEFAULT_KEEP
from ddiloco.runtime.syncer.server import SyncerServerConfig
from ddiloco.runtime.transport.bulk import BulkLimits
from ddiloco.runtime.transport.schema import MAX_JSON_DEPTH
from ddiloco.runtime.transport.wire import MAX_HEADER_BYTES

pytestmark = pytest.mark.timeout(30)

DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return str(n)


def _field(cls: type, name: str):
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


def expected() -> dict[str, str]:
    """Row label -> the start of its Default cell, from the code."""
    run, limits = RuntimeConfig(), BulkLimits()
    return {
        "hello size before authentication": _bytes(limits.hello_max_bytes),
        "data-port handshake deadline": f"{run.handshake_timeout_s:g} s",
        "data-port connections in total": str(run.max_connections),
        "data-port connections per peer address (no learner's session)": str(
            run.max_connections_per_peer
        ),
        "data-port worker threads": str(run.data_workers),
        "data-port requests in service per session": str(limits.max_requests_per_session),
        "data-port message deadline (header, payload, reply)": (
            f"{limits.message_timeout_s:g} s + size / {_bytes(int(limits.min_rate_bytes_s))}/s"
        ),
        "JSON header size": _bytes(MAX_HEADER_BYTES),
        "JSON nesting depth": str(MAX_JSON_DEPTH),
        "push payload": _bytes(run.max_push_bytes),
        "gRPC handler threads": str(_field(SyncerServerConfig, "max_workers")),
        "threads kept for control calls": str(_field(SyncerServerConfig, "control_reserve")),
        "concurrent pushes per learner (gRPC and data port together)": str(
            _field(SyncerServerConfig, "max_streams_per_learner")
        ),
        "merge guard: outer-gradient norm over this x the fragment's recent median is "
        "clipped": f"{SyncConfig().norm_clip:g}",
        "heartbeat timeout (declared dead)": f"{run.heartbeat_timeout_s:g} s",
        "checkpoints kept": str(DEFAULT_KEEP),
        "wait of a learner whose id is live elsewhere": f"{DUPLICATE_WAIT_S:g} s",
    }


def documented() -> dict[str, str]:
    """Row label -> Default cell of the table under "Limits, defaults and flags"."""
    text = DOC.read_text().split("## Limits, defaults and flags", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("Limit",) and not re.fullmatch(r"-+", cells[0]):
            rows[cells[0]] = cells[1]
    return rows


def test_every_documented_default_is_the_codes():
    doc, code = documented(), expected()
    assert sorted(doc) == sorted(code), "a row of docs/security.md has no check here, or none"
    wrong = {k: (doc[k], v) for k, v in code.items() if not doc[k].startswith(v)}
    assert not wrong, f"docs/security.md (documented, declared): {wrong}"
