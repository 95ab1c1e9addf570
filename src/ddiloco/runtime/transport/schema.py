"""One schema per message, shared by both transports (gRPC frames and the data port).

Every header a learner sends is checked here before any of its fields reaches the syncer:
exact JSON types (no bool for an int, no string for a number), finite numbers, documented
ranges, bounded lists without duplicates. The JSON parser itself bounds the nesting depth
(``MAX_JSON_DEPTH``) and rejects NaN/Infinity, before authentication too. Ranges are wide
enough for any real run and narrow enough that no sum, product or float conversion the
syncer does with them can overflow:

  learner         [0, MAX_LEARNER]           incarnation  [-1, MAX_INCARNATION]
  fragment        [0, MAX_FRAGMENTS)         seq          [0, (incarnation + 1) << 32)
  c_steps         [0, MAX_COUNT]             c_tokens     [0, MAX_COUNT] (2**53: exact as float)
  base_version    [0, MAX_COUNT]             numels       <= MAX_TENSORS entries
  step_s, fetch_s finite, [0, MAX_SECONDS]   timeout_s    finite, [0, 30]

A message that fails its schema is rejected with ``E_FRAME`` (``wire.ErrorCode.BAD_FRAME``)
and a message naming the field; ``parse`` raises ``SchemaError`` with that message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import pydantic
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "MAX_LEARNER",
    "MAX_INCARNATION",
    "MAX_FRAGMENTS",
    "MAX_TENSORS",
    "MAX_COUNT",
    "MAX_SECONDS",
    "MAX_JSON_DEPTH",
    "MAX_PIECES",
    "SchemaError",
    "loads",
    "parse",
    "JoinRequest",
    "InitHeader",
    "PushHeader",
    "FetchRequest",
    "WatchRequest",
    "Report",
    "HeartbeatRequest",
    "LeaveRequest",
    "Hello",
]

MAX_LEARNER = (1 << 20) - 1
"""Largest learner id."""
MAX_INCARNATION = 1 << 28
"""Largest incarnation (joins of one learner id); wire sequence numbers are
``(incarnation << 32) + n``."""
MAX_FRAGMENTS = 1 << 16
"""Most fragments (P) a model may be split into."""
MAX_TENSORS = 1 << 20
"""Most tensors one fragment may hold."""
MAX_COUNT = 1 << 53
"""Largest step, token or version count (exact as a float64)."""
MAX_SECONDS = 86_400.0
"""Largest duration a report may state (a day)."""
MAX_JSON_DEPTH = 200
"""Deepest JSON nesting accepted (the parser's own bound; deeper input is rejected)."""

_CONFIG = ConfigDict(strict=True, extra="ignore", frozen=True)

LearnerId = Annotated[int, Field(ge=0, le=MAX_LEARNER)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Field(ge=0.0, le=MAX_SECONDS, allow_inf_nan=False)]
Incarnation = Annotated[int, Field(ge=0, le=MAX_INCARNATION)]
ShortStr = Annotated[str, Field(max_length=256)]

M = TypeVar("M", bound=BaseModel)


class SchemaError(ValueError):
    """A message that does not fit its schema; the text names the field and the rule."""


def loads(raw: bytes | bytearray | memoryview) -> Any:
    """Parse JSON with bounded depth and no NaN/Infinity; raises ``SchemaError``."""
    try:
        return pydantic_core.from_json(bytes(raw), allow_inf_nan=False)
    except ValueError as e:
        raise SchemaError(f"header is not valid JSON: {e}") from None


def parse(model: type[M], header: Any, what: str = "") -> M:
    """Validate a parsed header against ``model``; raises ``SchemaError`` naming the first
    bad fields."""
    try:
        return model.model_validate(header)
    except pydantic.ValidationError as e:
        errs = e.errors(include_url=False, include_input=False)
        shown = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'header'}: {err['msg']}" for err in errs[:3]
        )
        more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
        raise SchemaError(f"{what or model.__name__} rejected: {shown}{more}") from None


def _unique(xs: list[int] | None, name: str) -> None:
    if xs is not None and len(set(xs)) != len(xs):
        raise ValueError(f"{name} lists an entry twice")


class JoinRequest(BaseModel):
    model_config = _CONFIG
    learner: Annotated[int, Field(ge=-1, le=MAX_LEARNER)] | None = None
    """None or -1: the syncer assigns an id (elastic membership)."""
    incarnation: Annotated[int, Field(ge=-1, le=MAX_INCARNATION)] = -1
    fingerprint: ShortStr | None = None
    spec: dict[str, Any] | None = None
    """The learner's model spec: a mismatch is answered naming the fields that differ."""
    host: ShortStr | None = None
    pid: Annotated[int, Field(ge=0, le=1 << 40)] | None = None
    process: ShortStr | None = None
    """Id of the learner process: another one than before is a restart (its ledger starts
    from zero; the syncer carries the earlier process's totals)."""
    session: ShortStr | None = None
    process_key: ShortStr | None = None
    """The learner process's own secret (``session.new_process_key``), never reported: a Join
    carrying the key of a live learner's process is that process again."""


MAX_PIECES = 1 << 20
"""Most pieces (runs of a tensor) one push, fetch or initial upload may name."""

Run = Annotated[list[Count], Field(min_length=3, max_length=3)]
"""``[tensor, offset, numel]``: elements ``[offset, offset + numel)`` of a tensor, flat."""


class InitHeader(BaseModel):
    model_config = _CONFIG
    spec: dict[str, Any]
    learner: LearnerId | None = None
    nbytes: Count | None = None
    pieces: Annotated[list[Run], Field(max_length=MAX_PIECES)] | None = None
    """A sharded island's rank uploads its runs (``[tensor index in the spec, offset,
    numel]``, fp32 in that order); the model is set up once the island's uploads tile it."""
    upload: ShortStr | None = None
    """With ``pieces``: the id of the island's upload (its uploads are put together)."""


class PushHeader(BaseModel):
    model_config = _CONFIG
    learner: LearnerId
    incarnation: Incarnation
    fragment: Annotated[int, Field(ge=0, lt=MAX_FRAGMENTS)]
    seq: Annotated[int, Field(ge=0)]
    base_version: Count
    c_steps: Count
    c_tokens: Count
    codec: ShortStr
    delta: bool = False
    numels: Annotated[
        list[Annotated[int, Field(ge=0, le=MAX_COUNT)]], Field(max_length=MAX_TENSORS)
    ]
    nbytes: Count
    step: Count | None = None
    final: bool = False
    """The learner's last push of this fragment (it is finishing)."""
    final_fragments: Annotated[
        list[Annotated[int, Field(ge=0, lt=MAX_FRAGMENTS)]], Field(max_length=MAX_FRAGMENTS)
    ] = []
    """With ``final``: every fragment the finishing learner sends a final push of."""
    slices: Annotated[list[Run], Field(max_length=MAX_PIECES)] | None = None
    """A rank of a sharded island pushes its runs of the fragment's tensors
    (``[j, offset, numel]``, in payload order, j the tensor's index in the fragment); the
    push is merged once the island's pushes of this ``seq`` tile the fragment
    (``ddiloco.algorithm.slices``). Unset: the whole fragment."""

    @model_validator(mode="after")
    def _seq_of_this_incarnation(self) -> PushHeader:
        if self.seq >= (self.incarnation + 1) << 32:
            raise ValueError(
                f"seq {self.seq} is beyond incarnation {self.incarnation}'s range "
                f"[0, {(self.incarnation + 1) << 32}) (seq = (incarnation << 32) "
                f"+ n)"
            )
        return self


class FetchRequest(BaseModel):
    model_config = _CONFIG
    fragments: (
        Annotated[
            list[Annotated[int, Field(ge=0, lt=MAX_FRAGMENTS)]], Field(max_length=MAX_FRAGMENTS)
        ]
        | None
    ) = None
    learner: LearnerId | None = None
    """Who fetches: with a delta-coded downlink, the syncer codes each fragment against the
    copy this learner holds."""
    exact: bool = False
    """The published fp32 values themselves, whatever the downlink codec (an export, an
    evaluation of the global model)."""
    mirrors: (
        Annotated[
            list[Annotated[list[Count], Field(min_length=2, max_length=2)]],
            Field(max_length=MAX_FRAGMENTS),
        ]
        | None
    ) = None
    """``[fragment, token]`` pairs: the copies the learner holds, by the token the syncer
    gave each."""
    slices: (
        Annotated[
            list[Annotated[list[Count], Field(min_length=4, max_length=4)]],
            Field(max_length=MAX_PIECES),
        ]
        | None
    ) = None
    """``[fragment, j, offset, numel]`` runs: a rank of a sharded island fetches only its
    runs of the fragments it asks for (``fragments`` then lists them)."""

    @model_validator(mode="after")
    def _no_duplicates(self) -> FetchRequest:
        _unique(self.fragments, "fragments")
        if self.mirrors is not None:
            _unique([f for f, _ in self.mirrors], "mirrors' fragments")
            if any(f >= MAX_FRAGMENTS for f, _ in self.mirrors):
                raise ValueError(f"mirrors' fragments must be < {MAX_FRAGMENTS}")
        return self


class WatchRequest(BaseModel):
    model_config = _CONFIG
    learner: LearnerId
    cursor: Annotated[list[Count], Field(max_length=MAX_FRAGMENTS)] | None = None
    merged_seq: (
        Annotated[
            dict[Annotated[str, Field(max_length=8)], Annotated[int, Field(ge=0)]],
            Field(max_length=MAX_FRAGMENTS),
        ]
        | None
    ) = None
    timeout_s: Annotated[float, Field(ge=0.0, le=30.0, allow_inf_nan=False)] = 1.0


class Report(BaseModel):
    """A learner's progress report (heartbeat, leave). The fields the syncer reads are
    typed; others are kept for ``status`` as they came."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    step: Count | None = None
    global_step: Count | None = None
    step_s: Seconds | None = None
    fetch_s: Seconds | None = None


class HeartbeatRequest(BaseModel):
    model_config = _CONFIG
    learner: LearnerId
    incarnation: Incarnation
    report: Report | None = None
    hb: Count = 0
    """The session's heartbeat counter: strictly increasing (a replay is refused)."""


class LeaveRequest(BaseModel):
    model_config = _CONFIG
    learner: LearnerId
    incarnation: Incarnation
    report: Report | None = None


class Hello(BaseModel):
    """The first message on a data-port connection (read before authentication): the
    run's token, and, from a learner that has joined, its id and the ``mac`` of this
    message under its session key (``transport.session``), which makes the connection
    one of that learner's session."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    op: Literal["hello"]
    token: Annotated[str, Field(max_length=1024)]
    learner: LearnerId | None = None
    mac: Annotated[str, Field(max_length=128)] | None = None
