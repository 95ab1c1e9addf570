"""Learner sessions: a per-Join key that binds every later call to the process that joined.

The shared token says "a member of this run". Within a run, a Join answers a fresh random
``session`` key (32 bytes, hex) to the joining process only. Every later call that acts as
that learner (Push on either transport, Heartbeat, Leave, and a rejoin of a live learner)
carries ``mac``: the HMAC-SHA256, under the session key, of the call's header in canonical
JSON (sorted keys, no spaces, without ``mac`` and the data port's ``op``). So another token
holder cannot push, heartbeat or leave as a learner it did not join as, nor alter a captured
call; heartbeats carry a strictly increasing ``hb`` counter and pushes a sequence number the
syncer deduplicates, so a captured call replayed unchanged does nothing.

A Join also carries the process's own random ``process_key``: the syncer keeps its digest,
and a Join for a live learner id that carries the same key is the same process retrying a
Join whose reply it lost, so it is answered with a new session instead of ``E_DUPLICATE``.
The key is never reported (``status`` shows the process id, not the key).

Without TLS the key travels in the clear in the Join reply: sessions then protect learners
from each other's mistakes (a duplicate learner id, a stale process), not from an
eavesdropper on the network (``docs/security.md``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Any

__all__ = [
    "MAC_FIELD",
    "new_process_key",
    "new_session_key",
    "process_digest",
    "same_process",
    "sign",
    "verify",
]

MAC_FIELD = "mac"
_UNSIGNED = (MAC_FIELD, "op")


def new_session_key() -> bytes:
    return secrets.token_bytes(32)


def new_process_key() -> str:
    """A learner process's own secret, sent in its Joins and never reported: a Join that
    carries the key of the process holding a live learner id is that process again (it
    retries a Join whose reply was lost, and never got the session that Join made)."""
    return secrets.token_hex(16)


def process_digest(key: str | None) -> bytes | None:
    """What the syncer keeps of a process key (its SHA-256), or None without one."""
    return hashlib.sha256(key.encode()).digest() if key else None


def same_process(digest: bytes | None, key: str | None) -> bool:
    """``key`` is the process key whose digest is ``digest`` (constant time)."""
    other = process_digest(key)
    return digest is not None and other is not None and hmac.compare_digest(digest, other)


def _canonical(header: dict[str, Any]) -> bytes:
    body = {k: v for k, v in header.items() if k not in _UNSIGNED}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign(key: bytes, header: dict[str, Any]) -> dict[str, Any]:
    """``header`` with its ``mac`` under ``key``."""
    # as the syncer will parse it (dict keys become strings, tuples lists)
    body = json.loads(
        json.dumps({k: v for k, v in header.items() if k != MAC_FIELD}, allow_nan=False)
    )
    return {**body, MAC_FIELD: hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()}


def verify(key: bytes, header: dict[str, Any]) -> bool:
    """Whether ``header`` carries a valid ``mac`` under ``key`` (constant-time compare)."""
    mac = header.get(MAC_FIELD)
    if not isinstance(mac, str):
        return False
    want = hmac.new(key, _canonical(header), hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, mac)
