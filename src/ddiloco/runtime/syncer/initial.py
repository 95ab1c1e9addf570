"""The initial model: the gRPC call Init, which gives the syncer its model.

The first learner to Join a syncer without a model is told ``need_init`` and sends its
initial model: one process sends every tensor; each rank of a sharded island sends its runs
of the tensors (``pieces``), and the island's uploads are put together until they tile the
model (``InitUpload``). The tensors are read into memory of their own as their frames
arrive, and a shard keeps only those of its own fragments.

``Initial`` owns the sharded islands' uploads in progress. It reads the streams' payloads
through ``Data`` and sets the model up through the server's ``setup``; the first complete
model wins, and later ones are answered ``accepted: False``."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import torch

from ddiloco.algorithm.merge import all_finite
from ddiloco.algorithm.slices import InitUpload, Piece, PieceError
from ddiloco.algorithm.syncer_state import SyncerState
from ddiloco.runtime.syncer.common import Reject, handler, unpack_frame, validate
from ddiloco.runtime.syncer.data import Data
from ddiloco.runtime.syncer.publication import Publication
from ddiloco.runtime.syncer.run_config import SyncerServerConfig
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.schema import InitHeader
from ddiloco.runtime.transport.spec import check_spec, fragmentation_from_spec, spec_fingerprint
from ddiloco.runtime.transport.wire import ErrorCode as E

__all__ = ["Initial", "MAX_UPLOADS"]

log = logging.getLogger("ddiloco.syncer")

MAX_UPLOADS = 4
"""Sharded islands' initial models being put together at once (each the model's size)."""


class Initial:
    """The Init call of ``SyncerServer``: the initial model, whole or from an island's ranks."""

    _parse = staticmethod(unpack_frame)
    _validate = staticmethod(validate)

    def __init__(
        self,
        lock: threading.Lock,
        config: SyncerServerConfig,
        data: Data,
        publication: Publication,
        *,
        state: Callable[[], SyncerState | None],
        setup: Callable[[dict, dict[str, torch.Tensor], bool], SyncerState],
        fingerprint: Callable[[], str],
        owns: Callable[[int], bool],
        event: Callable[..., None],
        auth: Callable[[Any], None],
        fail: Callable[[Any, Reject, str], None],
        bulk_slots: threading.BoundedSemaphore,
    ) -> None:
        """``lock``: the server's, taken where a method says so. ``config``: the server's
        settings. ``data``: reads the streams' payloads. ``publication``: where the model's
        version 0 is published. ``state()``: the state machine, None before the model is
        set up; ``setup(spec, tensors, copy)``: sets it up (lock held);
        ``fingerprint()``: the model's spec fingerprint. ``owns(p)``: this shard's
        fragments. ``event``: metrics. ``auth``/``fail``/``bulk_slots``: the gRPC
        handlers' token check, their abort and the bulk call slots (``common.handler``)."""
        self._lock = lock
        self.config = config
        self.data = data
        self.publication = publication
        self._state, self._setup, self._fingerprint = state, setup, fingerprint
        self._owns, self._event = owns, event
        self._auth, self._fail, self._bulk_slots = auth, fail, bulk_slots
        self.uploads: dict[str, InitUpload] = {}
        """Sharded islands' initial models being put together, by island id and spec."""

    @handler("init", bulk=True)
    def init(self, it: Iterator[bytes], ctx: grpc.ServicerContext) -> bytes:
        first = next(it, None)
        if first is None:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.BAD_FRAME, "empty Init stream")
        raw, payload = self._parse(first)
        h = self._validate(InitHeader, raw, "init")
        spec = h.spec
        try:
            check_spec(spec)
            frag = fragmentation_from_spec(spec)
        except (ValueError, TypeError) as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SPEC, str(e)) from None
        numels = [math.prod(s) for s in spec["shapes"]]
        expected = 4 * sum(numels)
        if expected > self.config.max_push_bytes * max(1, frag.P):
            raise Reject(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                E.OVERSIZE,
                f"initial model of {expected} bytes exceeds the limit",
            )
        params: dict[str, torch.Tensor]
        if h.pieces is not None:  # one rank of a sharded island: its runs of the tensors
            pieces = [Piece(*r) for r in h.pieces]
            part = self.data.read_stream(payload, it, 4 * sum(pc.numel for pc in pieces))
            got = self.add_upload(h.upload or "", spec, numels, pieces, part)
            if got is None:
                return wire.pack(
                    {"accepted": False, "partial": True, "fingerprint": self._fingerprint()}
                )
            buf = got
            params, copy = {}, True
            off = 0
            for n, s, k in zip(spec["names"], spec["shapes"], numels):
                # views of the uploads' buffer: the state copies them one tensor at a time
                params[n] = torch.frombuffer(buf, dtype=torch.float32, count=k, offset=off)
                params[n] = params[n].view(s)
                off += 4 * k
        else:
            # each tensor read into its own memory as its bytes arrive, no buffer of the
            # whole model beside them: the state takes them as they are; a shard keeps the
            # tensors of its own fragments and reads the others through one at a time
            mine = {n for p, f in enumerate(frag.fragments) if self._owns(p) for n in f.names}
            keep = [n in mine for n in spec["names"]]
            tensors = self.read_tensors(payload, it, numels, keep)
            params = {
                n: t.view(s)
                for n, s, t in zip(spec["names"], spec["shapes"], tensors)
                if t is not None
            }
            del tensors
            copy = False
        if not all(all_finite(t) for t in params.values()):
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT, E.NONFINITE, "initial model has NaN/inf values"
            )
        with self._lock:
            if self._state() is not None:
                return wire.pack({"accepted": False, "fingerprint": self._fingerprint()})
            st = self._setup(spec, params, copy)
            del params  # a shard drops the tensors of the fragments it does not own
            for p in range(frag.P):
                self.publication.publish(p, 0, st.frags[p].theta)
            log.info(
                "initialised by learner %s: %d tensors, P=%d, %d bytes",
                h.learner,
                len(numels),
                frag.P,
                expected,
            )
            self._event("init", learner=h.learner, nbytes=expected)
            return wire.pack({"accepted": True, "fingerprint": self._fingerprint()})

    def add_upload(
        self, upload: str, spec: dict, numels: list[int], pieces: list[Piece], data: bytearray
    ) -> bytearray | None:
        """Add a sharded island's rank's runs to its upload ``upload`` (the island's id):
        the whole model's buffer once the island's uploads tile it, else None. At most
        ``MAX_UPLOADS`` are kept (the oldest goes), none once the model is set up. Takes
        the lock."""
        key = f"{upload}/{spec_fingerprint(spec)}"
        with self._lock:
            if self._state() is not None:
                self.uploads.clear()
                return None
            up = self.uploads.get(key)
            if up is None:
                while len(self.uploads) >= MAX_UPLOADS:
                    del self.uploads[next(iter(self.uploads))]
                up = self.uploads[key] = InitUpload(numels)
            try:
                up.add(pieces, memoryview(data))
            except PieceError as e:
                raise Reject(grpc.StatusCode.INVALID_ARGUMENT, E.SHAPE, str(e)) from None
            if not up.complete:
                return None
            del self.uploads[key]
            return up.buf

    def read_tensors(
        self,
        payload: memoryview,
        it: Iterator[bytes],
        numels: list[int],
        keep: list[bool] | None = None,
    ) -> list[torch.Tensor | None]:
        """The stream's fp32 tensors of ``numels`` elements, each filled in its own memory
        as the frames arrive; with ``keep``, only those it marks (the others are read into
        memory that is let go as each one ends: None in their place). The errors are
        ``Data.chunks``'. Without the lock."""
        keep = keep or [True] * len(numels)
        out: list[torch.Tensor | None] = [None] * len(numels)
        i, pos = -1, 0
        dst = np.empty(0, dtype=np.uint8)  # the tensor being filled, as bytes
        for chunk in self.data.chunks(payload, it, 4 * sum(numels)):
            src = np.frombuffer(chunk, dtype=np.uint8)
            a = 0
            while a < len(src):
                while len(dst) == pos:  # a full (or empty) tensor: the next one
                    i, pos = i + 1, 0
                    t = torch.empty(numels[i], dtype=torch.float32)
                    out[i] = t if keep[i] else None
                    dst = t.numpy().view(np.uint8)
                n = min(len(dst) - pos, len(src) - a)
                dst[pos : pos + n] = src[a : a + n]
                pos, a = pos + n, a + n
        for j in range(i + 1, len(numels)):  # empty tensors after the last bytes
            out[j] = torch.empty(0, dtype=torch.float32) if keep[j] else None
        return out
