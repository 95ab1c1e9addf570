"""Fragment traffic on both transports: pushes and fetches over gRPC streams and over the
data port (``ddiloco.runtime.transport.bulk``), one validation and one apply path for both.

``Data`` owns the fragments' tensor shapes, the pushes in progress per learner, the room
for pushes' payloads (``PushRoom``) and the pieces of sharded islands' incomplete pushes
(``SliceAssembler``), and reads the payload of every gRPC stream. Fetches are answered by
the ``Fetches`` it owns (``fetch``), from the ``Publication`` it is given; it acts on the
rest of the server through the callbacks the server gives it."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import grpc

from ddiloco.algorithm.codecs import Codec, get_codec
from ddiloco.algorithm.payload import EncodedParams, encoded_finite
from ddiloco.algorithm.slices import Piece, PieceError, SliceAssembler, SlicedParams, check_pieces
from ddiloco.algorithm.syncer_state import Contribution, Merged, Status, SyncerState
from ddiloco.runtime.syncer.common import Reject, handler, unpack_frame, validate
from ddiloco.runtime.syncer.fetch import Fetches, frames
from ddiloco.runtime.syncer.publication import Publication
from ddiloco.runtime.syncer.push_room import PushRoom, Taken
from ddiloco.runtime.syncer.run_config import SyncerServerConfig
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.bulk import BulkAborted, BulkReject
from ddiloco.runtime.transport.schema import PushHeader
from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = ["Data"]

log = logging.getLogger("ddiloco.syncer")


@dataclass(slots=True, frozen=True)
class PushCheck:
    """A push header that passed validation: what reading and applying its payload needs."""

    m: int
    p: int
    inc: int
    seq: int
    base: int
    c_steps: int
    c_tokens: int
    nbytes: int
    codec: Codec
    names: tuple[str, ...]
    numels: tuple[int, ...]
    shapes: list[tuple[int, ...]]
    delta: bool
    who: str
    final: bool = False
    final_fragments: tuple[int, ...] = ()
    pieces: tuple[Piece, ...] | None = None
    """A sharded island's rank: its runs of the fragment's tensors, in payload order."""


class Data:
    """Push and fetch handlers of ``SyncerServer``, on gRPC and on the data port."""

    _parse = staticmethod(unpack_frame)
    _validate = staticmethod(validate)

    def __init__(
        self,
        lock: threading.Lock,
        config: SyncerServerConfig,
        counters: MutableMapping[str, Any],
        publication: Publication,
        *,
        require_ready: Callable[[], SyncerState],
        require_live: Callable[[int, int], SyncerState],
        require_session: Callable[[int, dict, str], object],
        require_owned: Callable[[int], None],
        owns: Callable[[int], bool],
        on_merged: Callable[[Merged, float], None],
        followups: Callable[[float], None],
        add_timer: Callable[[float, int], None],
        event: Callable[..., None],
        note_reject: Callable[[Reject, str], None],
        auth: Callable[[Any], None],
        fail: Callable[[Any, Reject, str], None],
        bulk_slots: threading.BoundedSemaphore,
    ) -> None:
        """``lock``: the server's, taken where a method says so. ``config``: the server's
        ``SyncerServerConfig``. ``counters``: the server's. ``publication``: what fetches
        read (``Fetches``). ``require_ready()``/``require_live(m, incarnation)``: the state, or a
        ``Reject`` (no model yet / m not live in that incarnation);
        ``require_session(m, raw, what)``: rejects a call without m's session MAC;
        ``require_owned(p)``/``owns(p)``: this shard's fragments (lock held for all of
        these). ``on_merged(mg, merge_s)``, ``followups(t0)``, ``add_timer(at_s, p)``:
        what the server does with a merge, the rounds that filled meanwhile, a grace
        deadline. ``event``/``note_reject``: metrics and counted rejections.
        ``auth``/``fail``/``bulk_slots``: the gRPC handlers' token check, their abort and
        the bulk call slots (``common.handler``)."""
        self._lock = lock
        self.config = config
        self.counters = counters
        self.publication = publication
        self._require_ready, self._require_live = require_ready, require_live
        self._require_session, self._require_owned = require_session, require_owned
        self._on_merged, self._followups, self._add_timer = on_merged, followups, add_timer
        self._event, self._note_reject = event, note_reject
        self._auth, self._fail, self._bulk_slots = auth, fail, bulk_slots
        self.shapes: list[list[tuple[int, ...]]] = []
        """Per fragment: its tensors' shapes (set with the model)."""
        self.slices = SliceAssembler()
        """The incomplete pushes of sharded islands."""
        self.pushing: Counter = Counter()
        """learner -> its pushes in progress, on either transport."""
        self.push_room = PushRoom()
        """Room for pushes' payloads (sized once the model is known)."""
        self.fetches = Fetches(
            lock,
            config,
            counters,
            publication,
            require_ready=require_ready,
            require_owned=require_owned,
            owns=owns,
        )
        """The replies to fetches: the published fragments as each fetch asks for them."""

    @staticmethod
    def _push_who(h: object) -> str:
        g = h.get if isinstance(h, dict) else (lambda k: None)
        return f"[learner {g('learner')} step {g('step')}] push of fragment {g('fragment')}"

    def _push_check(self, raw: dict) -> PushCheck:
        """Validate a push header before its payload is read (either transport)."""
        h = self._validate(PushHeader, raw, "push")
        m, p, inc, nbytes = h.learner, h.fragment, h.incarnation, h.nbytes
        try:
            codec = get_codec(h.codec)
        except ValueError as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.CODEC, str(e)) from None
        if nbytes > self.config.max_push_bytes:
            raise Reject(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                E.OVERSIZE,
                f"declared payload {nbytes} bytes exceeds max_push_bytes "
                f"{self.config.max_push_bytes}",
            )
        with self._lock:
            st = self._require_live(m, inc)
            self._require_session(m, raw, "push")
            if not 0 <= p < st.fragmentation.P:
                raise Reject(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    E.FRAGMENT,
                    f"fragment {p} out of range [0, {st.fragmentation.P})",
                )
            self._require_owned(p)
            fr = st.fragmentation.fragments[p]
            shapes = self.shapes[p]
        if h.numels != list(fr.numels):
            shown = h.numels if len(h.numels) <= 16 else f"{len(h.numels)} tensors"
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                E.SHAPE,
                f"fragment {p} has tensors of {list(fr.numels)} elements, push declares {shown}",
            )
        pieces = None
        if h.slices is not None:  # a rank of a sharded island: its runs of the tensors
            pieces = tuple(Piece(*r) for r in h.slices)
            try:
                check_pieces(pieces, fr.numels)
            except PieceError as e:
                raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SHAPE, str(e)) from None
            expected = sum(codec.nbytes(pc.numel) for pc in pieces)
        else:
            expected = sum(codec.nbytes(n) for n in fr.numels)
        if nbytes != expected:
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                E.SIZE,
                f"{codec.name} payload of fragment {p} must be {expected} bytes, "
                f"push declares {nbytes}",
            )
        return PushCheck(
            m=m,
            p=p,
            inc=inc,
            seq=h.seq,
            base=h.base_version,
            c_steps=h.c_steps,
            c_tokens=h.c_tokens,
            nbytes=nbytes,
            codec=codec,
            names=fr.names,
            numels=fr.numels,
            shapes=shapes,
            delta=h.delta,
            who=self._push_who(raw),
            final=h.final,
            final_fragments=tuple(h.final_fragments),
            pieces=pieces,
        )

    def _push_room_take(self, pc: PushCheck) -> Taken:
        """Room for the payload of push ``pc`` (``push_room``): one fp32 fragment of pushes
        held at once, half of it by one learner (two bf16 pushes of different learners),
        waiting at most as long as the payload may take to arrive."""
        room = self.push_room
        with self._lock:
            if not room.capacity:
                room.capacity = self._require_ready().largest_fragment_bytes()
        taken = room.take(pc.nbytes, self.config.data_limits.deadline_s(pc.nbytes), pc.m)
        if taken is None:
            raise Reject(
                grpc.StatusCode.UNAVAILABLE,
                E.BUSY,
                f"no room for a push of {pc.nbytes} bytes in time (pushes of {room.used} "
                "bytes wait for the syncer); retry",
            )
        return taken

    def _push_apply(self, pc: PushCheck, buf: bytearray) -> dict:
        """Decode a validated push's payload and hand it to the state machine."""
        t_wall = time.perf_counter()
        codec, p = pc.codec, pc.p
        # kept encoded until its round merges or folds it (read a piece at a time)
        params: EncodedParams | SlicedParams | None = None
        if pc.pieces is None:
            params = EncodedParams(codec, buf, pc.shapes, delta=pc.delta)
        if pc.delta:
            with self._lock:
                held = self._require_ready().holds(p, pc.base)
            if not held:
                raise Reject(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    E.BASE,
                    f"delta push against version {pc.base} of fragment {p}, which the "
                    f"syncer no longer holds (raise --history or send parameters)",
                )
        # fp32 pushes: one check of the whole payload, tensor by tensor only to name a culprit
        # (a delta's values are finite if the delta is: the version it is added to is)
        if pc.pieces is not None:
            parts = self._piece_bytes(pc, buf)
        elif not (
            codec.name == "fp32"
            and not pc.delta
            and encoded_finite(codec, memoryview(buf), sum(pc.numels))
        ):
            assert isinstance(params, EncodedParams)
            for name, j in zip(pc.names, range(len(params))):
                if not params.finite(j):
                    raise Reject(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        E.NONFINITE,
                        f"tensor {name} has NaN/inf values",
                    )
        m, seq = pc.m, pc.seq
        with self._lock:
            st = self._require_live(m, pc.inc)
            if pc.pieces is not None:
                got = self._add_pieces(st, pc, parts)
                if isinstance(got, dict):  # more pieces to come, or a retried push
                    self.counters["push_apply_s"] += time.perf_counter() - t_wall
                    return got
                params = got
            assert params is not None
            c = Contribution(
                learner=m,
                fragment=p,
                params=params,
                c_steps=pc.c_steps,
                c_tokens=pc.c_tokens,
                base_version=pc.base,
                seq=seq,
                final=pc.final,
                final_fragments=pc.final_fragments,
            )
            t0 = time.monotonic()
            res = st.submit(c, t0, finite_checked=True)
            self.counters["push_apply_s"] += time.perf_counter() - t_wall
            self.counters[f"push_{res.status.value}"] += 1
            if res.status is Status.INVALID:
                raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.INVALID, res.message)
            if res.status is Status.UNKNOWN_LEARNER:
                raise Reject(grpc.StatusCode.FAILED_PRECONDITION, E.UNKNOWN_LEARNER, res.message)
            if res.status is Status.ACCEPTED:
                if res.merged is not None:
                    self._on_merged(res.merged, time.monotonic() - t0)
                elif res.wake_at_s is not None:
                    self._add_timer(res.wake_at_s, p)
                self._followups(t0)
            elif res.status is not Status.DUPLICATE:
                self._event("push-" + res.status.value, learner=m, fragment=p, message=res.message)
                log.info("%s: %s (%s)", pc.who, res.status.value, res.message)
        return {
            "status": res.status.value,
            "message": res.message,
            "target_version": res.target_version,
        }

    def _piece_bytes(self, pc: PushCheck, buf: bytearray) -> list:
        """(piece, codec, its bytes, delta) of each run a push carries, each checked finite
        (a delta is finite if its values are: the version it is added to is)."""
        parts, off = [], 0
        view = memoryview(buf)
        for piece in pc.pieces or ():
            nb = pc.codec.nbytes(piece.numel)
            b = view[off : off + nb]
            off += nb
            if not encoded_finite(pc.codec, b, piece.numel):
                raise Reject(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    E.NONFINITE,
                    f"tensor {pc.names[piece.j]} has NaN/inf values in "
                    f"[{piece.offset}, {piece.offset + piece.numel})",
                )
            parts.append((piece, pc.codec, b, pc.delta))
        return parts

    def _add_pieces(self, st, pc: PushCheck, parts: list) -> SlicedParams | dict:
        """Add a sharded island's push to its contribution (the caller holds the lock): the
        assembled push once the island's pushes tile the fragment, else the reply (the
        target version it will be merged into if the rest arrives now; a retried push of
        a contribution already submitted answers ``duplicate``)."""
        if st.received(pc.m, pc.p, pc.seq):
            self.counters["push_duplicate"] += 1
            return {"status": "duplicate", "message": "", "target_version": -1}
        if self.slices.newer(pc.m, pc.p, pc.seq):
            self.counters["push_rejected-stale"] += 1
            return {
                "status": "rejected-stale",
                "message": f"a later push of fragment {pc.p} is in progress",
                "target_version": -1,
            }
        counters = (pc.c_steps, pc.c_tokens, pc.base, pc.final, pc.final_fragments)
        try:
            got = self.slices.add(pc.m, pc.p, pc.seq, pc.shapes, counters, parts)
        except PieceError as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SHAPE, str(e)) from None
        if got is None:
            self.counters["push_pieces"] += 1
            return {
                "status": "accepted",
                "partial": True,
                "message": "",
                "target_version": st.target_version(pc.p),
            }
        return got

    @handler("push", bulk=True)
    def push(self, it, ctx: grpc.ServicerContext) -> bytes:
        first = next(it, None)
        if first is None:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME, "empty Push stream")
        h, payload = self._parse(first)
        pc = self._push_check(h)
        self._push_start(pc.m)
        try:
            taken = self._push_room_take(pc)
            try:
                buf = self.read_stream(payload, it, pc.nbytes)
                return wire.pack(self._push_apply(pc, buf))
            finally:
                taken.give_back()
        finally:
            with self._lock:
                self.pushing[pc.m] -= 1

    def _push_start(self, m: int) -> None:
        """One more push of learner m (its session) in progress, on either transport; over
        ``max_streams_per_learner`` it is refused (``E_BUSY``, retried by learners), so one
        session's stalled pushes hold a bounded number of threads."""
        limit = self.config.max_streams_per_learner
        with self._lock:
            if self.pushing[m] >= limit:
                raise Reject(
                    grpc.StatusCode.UNAVAILABLE,
                    E.BUSY,
                    f"learner {m} already has {limit} pushes in progress; retry",
                )
            self.pushing[m] += 1

    def read_stream(self, payload: memoryview, it, nbytes: int) -> bytearray:
        """The stream's payload in one buffer (the errors are ``chunks``')."""
        buf = bytearray()
        for chunk in self.chunks(payload, it, nbytes):
            buf += chunk
        return buf

    def chunks(self, payload: memoryview, it, nbytes: int) -> Iterator[memoryview]:
        """The payload of the first frame, then of each continuation frame of ``it``: at most
        ``nbytes`` in all (E_OVERSIZE as soon as they exceed it), exactly ``nbytes`` once the
        stream ends (E_SIZE), then counted in ``bytes_in``."""
        got = 0
        for chunk in itertools.chain([payload], (self._parse(f)[1] for f in it)):
            got += len(chunk)
            if got > nbytes:
                raise Reject(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    E.OVERSIZE,
                    f"payload exceeds its declared {nbytes} bytes",
                )
            yield chunk
        if got != nbytes:
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                E.SIZE,
                f"payload has {got} bytes, header declared {nbytes}",
            )
        self.counters["bytes_in"] += got

    def forget_copies(self, m: int) -> None:
        """Learner m left or was declared dead: its copies no longer hold steps of the
        delta-coded downlink (a returning learner gets whole fragments again), and the
        pieces of its incomplete sharded pushes go. Caller holds the lock."""
        self.publication.forget_copies(m)
        self.slices.forget(m)

    @handler("fetch", bulk=True)
    def fetch(self, req: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
        return frames(self.fetches.items(self._parse(req)[0]))

    def bulk(self, op: str, h: dict, plen: int, read_payload) -> tuple[dict, list[bytes]]:
        """Requests on the data port (``ddiloco.runtime.transport.bulk``): push and fetch."""
        who = f"bulk {op!r}"
        try:
            if op == "push":
                who = self._push_who(h)
                pc = self._push_check(h)
                if plen != pc.nbytes:
                    raise Reject(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        E.SIZE,
                        f"payload has {plen} bytes, header declared {pc.nbytes}",
                    )
                self._push_start(pc.m)
                try:
                    taken = self._push_room_take(pc)
                    try:
                        buf = read_payload()
                        self.counters["bytes_in"] += len(buf)
                        return self._push_apply(pc, buf), []
                    finally:
                        taken.give_back()
                finally:
                    with self._lock:
                        self.pushing[pc.m] -= 1
            if op == "fetch":
                if plen:
                    raise Reject(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        E.BAD_FRAME,
                        "a fetch request carries no payload",
                    )
                items = self.fetches.items(h)
                return (
                    {
                        "items": [
                            {
                                "fragment": p,
                                "version": v,
                                "nbytes": sum(len(b) for b in d),
                                **head,
                            }
                            for p, v, d, head in items
                        ]
                    },
                    [b for _, _, d, _ in items for b in d],
                )
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                E.BAD_FRAME,
                f"unknown bulk op {op!r} (push, fetch)",
            )
        except Reject as r:
            err = r
        except BulkAborted as a:  # the client left or stalled mid-payload: no bug
            err = Reject(a.status, a.code, a.message)
        except Exception as e:  # noqa: BLE001 - a handler bug must not escape untyped
            log.exception("%s failed", who)
            err = Reject(grpc.StatusCode.INTERNAL, E.INTERNAL, f"{type(e).__name__}: {e}")
        self._note_reject(err, who)
        raise BulkReject(err.status, f"{err.code}: {err.message}")
