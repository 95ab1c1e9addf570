"""The wire format between learners and the syncer: gRPC with our own byte framing.

Every gRPC message is one *frame*: a 4-byte big-endian header length, a UTF-8 JSON header,
then raw payload bytes (codec output, never pickled). The service uses grpc's generic
handlers with identity (de)serialisers, so no protoc code generation is needed.

Service ``ddiloco.Syncer`` (all calls carry the shared-secret token in metadata):

  Join       unary          learner joins (or rejoins); gets versions, incarnation, boot id
  Init       stream->unary  first learner uploads the initial model (fp32 chunks)
  Push       stream->unary  fragment parameters (or a delta against the base version), chunked
  Fetch      unary->stream  published global fragments, chunked
  Watch      unary          long-poll: returns when a published version moves past a cursor
  Heartbeat  unary          small liveness/metadata call on its own channel
  Leave      unary          clean departure
  Status     unary          JSON snapshot for ``ddiloco status`` and the launcher

Tensors are chunked (``CHUNK_BYTES`` per frame) so no model size hits gRPC's message limit.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Sequence

from ddiloco.runtime.transport.schema import loads

__all__ = [
    "SERVICE",
    "CHUNK_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_FRAME_BYTES",
    "pack",
    "unpack",
    "method",
    "chunks",
    "Deferred",
    "joined",
    "ErrorCode",
    "TOKEN_METADATA",
    "GRPC_OPTIONS",
    "GRPC_SERVER_OPTIONS",
]

SERVICE = "ddiloco.Syncer"
CHUNK_BYTES = 1 << 20
"""Payload bytes per frame."""
MAX_HEADER_BYTES = 1 << 20
"""Largest JSON header accepted (a fragment spec of a large model fits easily)."""
MAX_FRAME_BYTES = CHUNK_BYTES + MAX_HEADER_BYTES + 4
TOKEN_METADATA = "x-ddiloco-token"
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_FRAME_BYTES + 1024),
    ("grpc.max_send_message_length", MAX_FRAME_BYTES + 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
GRPC_SERVER_OPTIONS = GRPC_OPTIONS + [
    # accept the clients' keepalive pings on an idle connection (gRPC's default minimum is
    # 5 minutes; faster pings earn a GOAWAY "too_many_pings" and a reconnect)
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC binds with SO_REUSEPORT by default: a second syncer on the same port would also
    # "listen" and the kernel would split learners between the two. Off: a port in use is
    # an error.
    ("grpc.so_reuseport", 0),
]
_LEN = struct.Struct(">I")


class ErrorCode:
    """Typed rejection codes; every error message starts with one (``E_SHAPE: ...``)."""

    AUTH = "E_AUTH"
    BAD_FRAME = "E_FRAME"
    UNKNOWN_LEARNER = "E_UNKNOWN_LEARNER"
    FRAGMENT = "E_FRAGMENT"
    CODEC = "E_CODEC"
    SHAPE = "E_SHAPE"
    SIZE = "E_SIZE"
    OVERSIZE = "E_OVERSIZE"
    NONFINITE = "E_NONFINITE"
    BASE = "E_BASE"
    SPEC = "E_SPEC"
    NOT_READY = "E_NOT_READY"
    INVALID = "E_INVALID"
    SESSION = "E_SESSION"
    """A call acting as a learner without that learner's valid session MAC; Join again."""
    DUPLICATE = "E_DUPLICATE"
    """A Join for a learner id that another live process holds."""
    BUSY = "E_BUSY"
    """A connection or stream limit was reached; retry later."""
    HANDSHAKE = "E_HANDSHAKE"
    """A data-port connection sent no valid hello in time, or one too large."""
    CANCELLED = "E_CANCELLED"
    """The client ended a streamed call (or a data-port message) before sending all of it."""
    TIMEOUT = "E_TIMEOUT"
    """A data-port message did not arrive (or its reply was not taken) within its deadline."""
    INTERNAL = "E_INTERNAL"
    """A handler failed on a bug; the call changed nothing it had not committed."""
    NOT_LEADER = "E_NOT_LEADER"
    """A syncer of a replicated run that does not lead now (a standby, or a leader whose
    lease lapsed); the message names the leader where it is known
    (``ddiloco.runtime.syncer.ha``)."""
    STALE_EPOCH = "E_STALE_EPOCH"
    """(learner side) a reply from a leader older than the newest one heard: refused."""


def pack(header: dict, payload: bytes | memoryview = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(h)), h, payload))


def unpack(buf: bytes) -> tuple[dict, memoryview]:
    """Split a frame into (header, payload); raises ValueError on a malformed frame."""
    if len(buf) < 4:
        raise ValueError("frame shorter than its 4-byte length prefix")
    (n,) = _LEN.unpack_from(buf, 0)
    if n > MAX_HEADER_BYTES or 4 + n > len(buf):
        raise ValueError(f"frame header length {n} invalid for a {len(buf)}-byte frame")
    header = loads(buf[4 : 4 + n])
    if not isinstance(header, dict):
        raise ValueError("frame header must be a JSON object")
    return header, memoryview(buf)[4 + n :]


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def chunks(
    header: dict, payload: bytes | bytearray | memoryview, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """Frames of a chunked transfer: the header rides on the first frame, continuation
    frames carry ``{"cont": i}``. An empty payload still yields one frame."""
    mv = memoryview(payload)
    if len(mv) <= chunk_bytes:
        yield pack(header, mv)
        return
    yield pack(header, mv[:chunk_bytes])
    for i, off in enumerate(range(chunk_bytes, len(mv), chunk_bytes), start=1):
        yield pack({"cont": i}, mv[off : off + chunk_bytes])


class Deferred:
    """A payload piece of known length whose bytes are made when it is sent (either
    transport), so that a reply of many pieces holds one made piece at a time: e.g. a
    delta-coded downlink's whole copy, built tensor by tensor
    (``ddiloco.algorithm.downlink``). ``len()`` is the length it will have."""

    __slots__ = ("nbytes", "make")

    def __init__(self, nbytes: int, make: Callable[[], bytes | memoryview]) -> None:
        self.nbytes = nbytes
        self.make = make

    def __len__(self) -> int:
        return self.nbytes

    def get(self) -> memoryview:
        """The bytes, made now (a byte view; they live as long as it does)."""
        b = memoryview(self.make()).cast("B")
        if len(b) != self.nbytes:
            raise ValueError(f"a deferred piece of {self.nbytes} bytes made {len(b)}")
        return b


def joined(pieces: Sequence[bytes | memoryview | Deferred]) -> bytes | bytearray:
    """The pieces concatenated; a ``Deferred`` one is made when its turn comes and let go
    once copied (so the result and one piece are held, not every piece made)."""
    if not any(isinstance(b, Deferred) for b in pieces):
        return b"".join(pieces)  # type: ignore[arg-type]
    out = bytearray(sum(len(b) for b in pieces))
    off = 0
    for b in pieces:
        n = len(b)
        out[off : off + n] = b.get() if isinstance(b, Deferred) else b
        off += n
    return out
