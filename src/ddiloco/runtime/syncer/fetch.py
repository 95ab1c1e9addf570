"""Fetches: the published fragments as a learner asks for them, on either transport.

A fetch names the fragments it wants (all this shard owns, by default) and gets, for each,
its published version as one of: the downlink codec's bytes of the whole fragment (views of
the published tensors for fp32); its exact fp32 tensors (``exact``); a sharded island's
rank's runs of the tensors (``slices``); or, with the delta-coded downlink
(``sync.down_delta``), the encoded steps of the fragment's chain from the copy the learner
holds, or the chain's copy whole when the steps would outweigh it.

``Fetches`` builds those replies (``items``) from the ``Publication`` it is given, and
moves the delta-coded downlink's copies the learners hold; it owns no state. ``Data``
sends what it builds, over gRPC (``frames``) or the data port."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import grpc

from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.downlink import ChainCopy
from ddiloco.algorithm.slices import Piece, PieceError, check_pieces
from ddiloco.algorithm.syncer_state import SyncerState
from ddiloco.runtime.syncer.common import Reject, validate
from ddiloco.runtime.syncer.publication import Publication
from ddiloco.runtime.syncer.run_config import SyncerServerConfig
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.schema import FetchRequest
from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = ["Fetches", "Item", "frames"]

Item = tuple[int, int, list, dict]
"""One fragment of a fetch's reply: (fragment, version, its byte pieces, the rest of its
header). A piece is a byte view, or a ``wire.Deferred`` made when it is sent."""


def _whole_copy(copy: ChainCopy, shapes: list[tuple[int, ...]]) -> list[wire.Deferred]:
    """A chain's R (``copy``: immutable, read after the lock) in fp32 on the wire, one piece
    per tensor, each built when it is sent."""

    def tensor_bytes(j: int) -> memoryview:
        # a view of R's new tensor, or of Theta's own where the residual is zero
        t = copy.theta[j] if copy.residual[j] is None else copy.tensor(j)
        return get_codec("fp32").encode_many([t])[0]

    return [
        wire.Deferred(4 * math.prod(s), functools.partial(tensor_bytes, j))
        for j, s in enumerate(shapes)
    ]


def frames(items: list[Item]) -> Iterator[bytes]:
    """A gRPC fetch's reply: each item's frames, its pieces made as they are sent."""
    for p, version, pieces, head in items:
        data = wire.joined(pieces)  # a deferred piece is made now, one at a time
        yield from wire.chunks(
            {"fragment": p, "version": version, "nbytes": len(data), **head}, data
        )


class Fetches:
    """The replies to fetches of ``SyncerServer``'s published fragments (for ``Data``)."""

    _validate = staticmethod(validate)

    def __init__(
        self,
        lock: threading.Lock,
        config: SyncerServerConfig,
        counters: MutableMapping[str, Any],
        publication: Publication,
        *,
        require_ready: Callable[[], SyncerState],
        require_owned: Callable[[int], None],
        owns: Callable[[int], bool],
    ) -> None:
        """``lock``: the server's, taken where a method says so. ``config``: the server's
        settings (the downlink's codec, and whether it is delta-coded). ``counters``: the
        server's (bytes out, fetches sent as steps or whole). ``publication``: what
        fetches read. ``require_ready()``: the state, or a ``Reject``;
        ``require_owned(p)``/``owns(p)``: this shard's fragments (lock held for these)."""
        self._lock = lock
        self.config = config
        self.counters = counters
        self.publication = publication
        self._require_ready, self._require_owned, self._owns = require_ready, require_owned, owns

    def items(self, raw: dict) -> list[Item]:
        """(fragment, version, downlink byte pieces, the rest of its header) of the published
        fragments asked for. A piece is a byte view, or a ``wire.Deferred`` made when it is
        sent."""
        req = self._validate(FetchRequest, raw, "fetch")
        if req.slices is not None:
            items = self._slices(req)
        elif req.exact:
            fp32 = get_codec("fp32")
            items = [
                (p, v, fp32.encode_many(ts), {"codec": "fp32", "numels": [t.numel() for t in ts]})
                for p, (v, ts) in self._published_f32(req.fragments).items()
            ]
        elif self.config.downlink_delta and req.learner is not None:
            items = self._delta(
                req.fragments, req.learner, dict((k, v) for k, v in req.mirrors or [])
            )
        else:
            with self._lock:
                frags = self._require_ready().fragmentation.fragments
                items = [
                    (
                        p,
                        *self.publication.pub[p],
                        {"codec": self.config.downlink_codec, "numels": list(frags[p].numels)},
                    )
                    for p in self._wanted(req.fragments)
                ]
        with self._lock:
            self.counters["bytes_out"] += sum(len(b) for _, _, d, _ in items for b in d)
        return items

    def _slices(self, req: FetchRequest) -> list[Item]:
        """A sharded island's rank fetches its runs of the published fragments, each
        encoded by itself through the downlink codec (fp32: views of the published tensors,
        no copy). The delta-coded downlink sends whole fragments only: refused."""
        if self.config.downlink_delta and not req.exact:
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                E.SPEC,
                "a rank of a sharded island fetches its slices of each fragment, which the "
                "delta-coded downlink (sync.down_delta) does not send: run the syncer "
                "without --down-delta, or this learner as one process or a DDP island",
            )
        runs: dict[int, list[Piece]] = {}
        for p, j, off, n in req.slices or ():
            runs.setdefault(p, []).append(Piece(j, off, n))
        codec = get_codec("fp32" if req.exact else self.config.downlink_codec)
        with self._lock:
            frags = self._require_ready().fragmentation.fragments
        got = self._published_f32(sorted(runs))
        for p in got:
            try:
                check_pieces(runs[p], frags[p].numels)
            except PieceError as e:
                raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SHAPE, str(e)) from None
        items = []
        for p, (v, ts) in got.items():  # published tensors are never written: no lock
            flat = [ts[pc.j].reshape(-1)[pc.offset : pc.offset + pc.numel] for pc in runs[p]]
            head = {
                "codec": codec.name,
                "numels": [pc.numel for pc in runs[p]],
                "slices": [[pc.j, pc.offset, pc.numel] for pc in runs[p]],
            }
            items.append((p, v, codec.encode_many(flat), head))
        return items

    def _published_f32(self, want: list[int] | None) -> dict[int, tuple[int, list]]:
        """fragment -> (version, the published fp32 tensors) of the fragments asked for."""
        with self._lock:
            pub = self.publication
            return {p: (pub.pub[p][0], pub.theta[p]) for p in self._wanted(want)}

    def _wanted(self, want: list[int] | None) -> list[int]:
        """The fragments a fetch asks for, checked (the caller holds the lock)."""
        P = self._require_ready().fragmentation.P  # noqa: N806
        if want is None:  # every fragment this shard owns
            return [p for p in range(P) if self._owns(p)]
        if any(p >= P for p in want):
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                E.FRAGMENT,
                f"fragments must be a list of ints in [0, {P})",
            )
        for p in want:
            self._require_owned(p)
        return want

    def _delta(self, want: list[int] | None, m: int, held: dict[int, int]) -> list[Item]:
        """A delta-coded fetch (``ddiloco.algorithm.downlink``): each fragment as the encoded
        steps of its chain from the copy learner m holds (``held``: fragment -> the token of
        that copy) to the published version; a copy the chain does not know by its token,
        or one whose steps would outweigh the fragment, is replaced whole, in fp32 (the
        chain's R, built tensor by tensor as the reply is sent: ``wire.Deferred``). Each
        reply names the copy it leaves the learner with by its token."""
        items: list[Item] = []
        with self._lock:
            ps = self._wanted(want)
            for p in ps:
                chain = self.publication.chains[p]
                v = chain.version_of(held.get(p))
                steps = None if v is None else chain.steps_since(v)
                whole = 4 * sum(math.prod(s) for s in chain.shapes)
                if steps is not None and sum(len(b) for st in steps for b in st) < whole:
                    pieces: list
                    pieces = [memoryview(b) for st in steps for b in st]
                    head = {"codec": chain.codec.name, "delta": True, "steps": len(steps)}
                else:  # R whole, each tensor built from the chain's copy as it is sent
                    pieces = _whole_copy(chain.copy(), chain.shapes)
                    head = {"codec": "fp32", "delta": False}
                head["token"] = chain.token
                head["numels"] = [math.prod(s) for s in chain.shapes]
                items.append((p, chain.version, pieces, head))
                # the copy it holds once the reply lands
                self.publication.held[(m, p)] = chain.version
            for p in ps:
                self.publication.trim_chain(p)
            n_delta = sum(1 for *_, head in items if head["delta"])
            self.counters["fetch_delta"] += n_delta
            self.counters["fetch_whole"] += len(items) - n_delta
        return items
