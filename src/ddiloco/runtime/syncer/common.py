"""What the syncer's parts share: a typed rejection, what is known of a learner, and the
wrapper that turns every handler's failure into a typed, counted error."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = ["Reject", "LearnerInfo", "handler"]

log = logging.getLogger("ddiloco.syncer")


class Reject(Exception):
    """A call refused with a gRPC status and a typed code (``wire.ErrorCode``)."""

    def __init__(self, status: grpc.StatusCode, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.status, self.code, self.message = status, code, message


@dataclass(slots=True)
class LearnerInfo:
    """The syncer's view of one learner id: incarnation, liveness and its last report."""
    incarnation: int = 0
    last_hb_s: float = 0.0
    state: str = "live"
    report: dict = field(default_factory=dict)
    joins: int = 0
    process: str = ""
    """Id of the learner process behind ``report`` (a restart is a new process)."""
    carried: dict | None = None
    """Totals of the learner's earlier processes (``accounting.fold``)."""
    session_key: bytes | None = None
    """The key issued by this learner's latest Join (``transport.session``)."""
    hb: int = -1
    """The last heartbeat counter accepted in this session."""
    host: str | None = None
    pid: int | None = None


def handler(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a gRPC handler of ``SyncerServer``: check the token, then run it; a ``Reject``
    becomes its status and typed code, any other exception an ``E_INTERNAL`` error (logged
    with its traceback). Both are counted in ``rejections``; none escapes to gRPC."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(self, req: Any, ctx: grpc.ServicerContext) -> Any:
            try:
                self._auth(ctx)
                return fn(self, req, ctx)
            except Reject as r:
                err = r
            except Exception as e:  # noqa: BLE001 - a handler bug must not escape untyped
                log.exception("%s failed", what)
                err = Reject(grpc.StatusCode.INTERNAL, E.INTERNAL, f"{type(e).__name__}: {e}")
            self._fail(ctx, err, what)

        return run

    return wrap
