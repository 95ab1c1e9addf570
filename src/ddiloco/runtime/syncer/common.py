"""What the syncer's parts share: a typed rejection, what is known of a learner, the
checks of a request frame, and the wrapper that turns every handler's failure into a
typed, counted error."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from pydantic import BaseModel

from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.schema import SchemaError, parse
from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = ["Reject", "LearnerInfo", "handler", "unpack_frame", "validate"]

M = TypeVar("M", bound=BaseModel)

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
    process_key: bytes | None = None
    """The digest of the process key its latest Join carried (``session.process_digest``)."""
    hb: int = -1
    """The last heartbeat counter accepted in this session."""
    host: str | None = None
    pid: int | None = None


def unpack_frame(req: bytes) -> tuple[dict, memoryview]:
    """A request frame's header and payload (``wire.unpack``), or ``E_BAD_FRAME``."""
    try:
        return wire.unpack(req)
    except ValueError as e:
        raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME, str(e)) from None


def validate(model: type[M], header: object, what: str) -> M:
    """``header`` checked against its message schema (``transport.schema``), or
    ``E_BAD_FRAME``."""
    try:
        return parse(model, header, what)
    except SchemaError as e:
        raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME, str(e)) from None


def handler(what: str, bulk: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a gRPC handler of ``SyncerServer``: check the token, then run it; a ``Reject``
    becomes its status and typed code, any other exception an ``E_INTERNAL`` error (logged
    with its traceback). Both are counted in ``rejections``; none escapes to gRPC.

    ``bulk`` calls (transfers and long polls) first take one of the server's bulk slots,
    without waiting: when all are taken the call is refused with ``E_BUSY``, so the
    threads kept for control calls stay free. A streamed reply keeps its slot until it
    ends."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(self, req: Any, ctx: grpc.ServicerContext) -> Any:
            held = False
            try:
                self._auth(ctx)
                if bulk:
                    held = self._bulk_slots.acquire(blocking=False)
                    if not held:
                        raise Reject(
                            grpc.StatusCode.UNAVAILABLE,
                            E.BUSY,
                            f"all {self.config.max_workers - self.config.control_reserve}"
                            f" bulk call slots are taken; retry",
                        )
                out = fn(self, req, ctx)
                if held and isinstance(out, Iterator):
                    held = False
                    return _releasing(out, self._bulk_slots)
                return out
            except Reject as r:
                err = r
            except grpc.RpcError:  # the client's request stream broke (cancelled, timed out)
                err = Reject(
                    grpc.StatusCode.CANCELLED,
                    E.CANCELLED,
                    "the client ended the call before sending all of it",
                )
            except Exception as e:  # noqa: BLE001 - a handler bug must not escape untyped
                log.exception("%s failed", what)
                err = Reject(grpc.StatusCode.INTERNAL, E.INTERNAL, f"{type(e).__name__}: {e}")
            finally:
                if held:
                    self._bulk_slots.release()
            self._fail(ctx, err, what)

        return run

    return wrap


def _releasing(it: Iterator[Any], slots: threading.BoundedSemaphore) -> Iterator[Any]:
    try:
        yield from it
    finally:
        slots.release()
