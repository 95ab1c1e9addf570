"""Types shared by the syncer's parts: a typed rejection and what is known of a learner."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

__all__ = ["Reject", "LearnerInfo"]


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
