"""A learner's push made of slices: the ranks of a sharded island each push their own
slice of every tensor of fragment p, and the syncer merges the fragment once every slice
has arrived.

A *piece* is one contiguous run of a tensor: ``(j, offset, numel)``, the fragment's j-th
tensor from flat element ``offset`` on, in the codec's encoding. A rank of an FSDP2 island
holds a dim-0 shard of each tensor, which is one such run of the flattened tensor. The
pieces of learner m's push ``seq`` of fragment p come from several pushes (one per rank);
``SliceAssembler`` keeps them until they tile every tensor of the fragment exactly, and
then hands the state machine one ``Contribution`` whose ``params`` are a ``SlicedParams``.
The merge reads it one tensor at a time, as it reads an ``EncodedParams``: the merge guard's
norm and the merge rule's norms are those of the whole fragment's outer gradient, whatever
the sharding of the learner that pushed it, so islands of any layout merge together.

Each rank encodes its own pieces, and a rank that holds no copy of the version its push
names sends parameters while another sends a delta: ``delta`` is a property of each piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import overload

import torch

from ddiloco.algorithm.codecs import Codec

__all__ = [
    "InitUpload",
    "Piece",
    "PieceError",
    "SliceAssembler",
    "SlicedParams",
    "check_pieces",
]


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[offset, offset + numel)`` of the fragment's tensor ``j`` (flattened)."""

    j: int
    offset: int
    numel: int


class PieceError(ValueError):
    """Pieces that do not fit their fragment: out of range, overlapping, or pushes of one
    contribution that disagree on its counters."""


def check_pieces(pieces: Sequence[Piece], numels: Sequence[int]) -> None:
    """Raise ``PieceError`` unless every piece lies inside its tensor (``numels[j]``
    elements) and no two overlap."""
    for pc in pieces:
        if not 0 <= pc.j < len(numels):
            raise PieceError(f"piece of tensor {pc.j}: the fragment has {len(numels)} tensors")
        if pc.offset < 0 or pc.numel < 1 or pc.offset + pc.numel > numels[pc.j]:
            raise PieceError(
                f"piece [{pc.offset}, {pc.offset + pc.numel}) of tensor {pc.j} lies outside "
                f"its {numels[pc.j]} elements"
            )
    _disjoint(pieces)


def _disjoint(pieces: Sequence[Piece]) -> None:
    by_j: dict[int, list[Piece]] = {}
    for pc in pieces:
        by_j.setdefault(pc.j, []).append(pc)
    for j, ps in by_j.items():
        ps.sort(key=lambda x: x.offset)
        for a, b in zip(ps, ps[1:]):
            if b.offset < a.offset + a.numel:
                raise PieceError(
                    f"pieces [{a.offset}, {a.offset + a.numel}) and [{b.offset}, "
                    f"{b.offset + b.numel}) of tensor {j} overlap"
                )


@dataclass(slots=True)
class _Part:
    piece: Piece
    codec: Codec
    buf: memoryview
    delta: bool


class SlicedParams(Sequence[torch.Tensor]):
    """A push of fragment p assembled from the pieces of several pushes, one tensor at a
    time when a merge reads it.

    ``self[j]`` is tensor j as pushed when no piece of it is a delta; a merge reads
    ``pushed(j, reference)``, which adds the syncer's copy of the named version to the
    pieces that are deltas. Tensors read are new fp32 tensors (never views of the bytes)."""

    __slots__ = ("shapes", "_parts", "_numels")

    def __init__(self, shapes: Sequence[tuple[int, ...]]) -> None:
        self.shapes = [tuple(s) for s in shapes]
        self._numels = [math.prod(s) for s in self.shapes]
        self._parts: list[list[_Part]] = [[] for _ in self.shapes]

    def add(self, piece: Piece, codec: Codec, buf: memoryview, delta: bool) -> None:
        """One piece, its codec bytes (exactly ``codec.nbytes(piece.numel)``)."""
        codec.check_size(buf, piece.numel)
        self._parts[piece.j].append(_Part(piece, codec, buf, delta))

    def covered(self, j: int) -> int:
        return sum(p.piece.numel for p in self._parts[j])

    @property
    def complete(self) -> bool:
        """Every tensor tiled by its pieces (they never overlap: ``check_pieces``)."""
        return all(self.covered(j) == n for j, n in enumerate(self._numels))

    @property
    def delta(self) -> bool:
        """Some piece is a delta: the syncer must hold the version the push names."""
        return any(p.delta for ps in self._parts for p in ps)

    @property
    def nbytes(self) -> int:
        return sum(len(p.buf) for ps in self._parts for p in ps)

    def pieces(self, j: int) -> list[Piece]:
        return [p.piece for p in self._parts[j]]

    def __len__(self) -> int:
        return len(self.shapes)

    @overload
    def __getitem__(self, j: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, j: slice) -> list[torch.Tensor]: ...
    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        if any(p.delta for p in self._parts[j]):
            raise ValueError("a tensor with delta pieces is read with pushed(j, reference)")
        return self.pushed(j, None)

    def pushed(self, j: int, reference: Callable[[], torch.Tensor] | None) -> torch.Tensor:
        """Tensor j of theta_{m,p} as pushed: each piece decoded into its run, the pieces
        that are deltas added to ``reference()`` (tensor j of the version the push names,
        asked for only when some piece needs it)."""
        out = torch.empty(self._numels[j], dtype=torch.float32)
        ref = None
        for part in self._parts[j]:
            pc = part.piece
            x = part.codec.decode(part.buf, pc.numel)
            run = out[pc.offset : pc.offset + pc.numel]
            if part.delta:
                if ref is None:
                    if reference is None:
                        raise ValueError("a delta piece needs the version its push names")
                    ref = reference().reshape(-1)
                torch.add(ref[pc.offset : pc.offset + pc.numel], x, out=run)
            else:
                run.copy_(x)
        return out.view(self.shapes[j])


@dataclass(slots=True)
class _Pending:
    params: SlicedParams
    counters: tuple
    """What every push of one contribution must agree on (counters, base version, final)."""
    taken: list[Piece] = field(default_factory=list)


class SliceAssembler:
    """The pieces of contributions in progress, keyed by (learner, fragment, seq).

    ``add`` returns the assembled ``SlicedParams`` once the pieces tile the fragment, else
    None. A newer seq of the same learner and fragment drops an older one still incomplete
    (its pushes were superseded or some of them refused), so at most one contribution per
    learner and fragment is held; ``forget(learner)`` drops a learner's (it left or was
    declared dead). What is held is the pieces' wire bytes."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, int], tuple[int, _Pending]] = {}

    def add(
        self,
        learner: int,
        fragment: int,
        seq: int,
        shapes: Sequence[tuple[int, ...]],
        counters: tuple,
        pieces: Sequence[tuple[Piece, Codec, memoryview, bool]],
    ) -> SlicedParams | None:
        """Add one push's pieces. Raises ``PieceError`` for pieces that overlap ones already
        held or pushes that disagree on ``counters``; nothing is added then."""
        key = (learner, fragment)
        held = self._open.get(key)
        if held is not None and held[0] > seq:
            raise PieceError(f"push {seq} of fragment {fragment} is older than one in progress")
        if held is None or held[0] < seq:
            held = (seq, _Pending(SlicedParams(shapes), counters))
        pend = held[1]
        if pend.counters != counters:
            raise PieceError(
                f"pushes of one contribution (seq {seq}) disagree: {pend.counters} and "
                f"{counters} (counters, base version, final)"
            )
        new = [pc for pc, *_ in pieces]
        check_pieces(pend.taken + new, [math.prod(s) for s in shapes])
        for pc, codec, buf, delta in pieces:
            pend.params.add(pc, codec, buf, delta)
        pend.taken += new
        if pend.params.complete:
            self._open.pop(key, None)
            return pend.params
        self._open[key] = held
        return None

    def newer(self, learner: int, fragment: int, seq: int) -> bool:
        """A later push than ``seq`` of this learner and fragment is in progress."""
        held = self._open.get((learner, fragment))
        return held is not None and held[0] > seq

    def forget(self, learner: int) -> None:
        for key in [k for k in self._open if k[0] == learner]:
            del self._open[key]

    @property
    def nbytes(self) -> int:
        """Bytes of the pieces held."""
        return sum(p.params.nbytes for _, p in self._open.values())

    def __len__(self) -> int:
        return len(self._open)


class InitUpload:
    """A sharded island's initial model, put together from its ranks' uploads: each sends
    the fp32 values of its runs (``Piece``, ``j`` the tensor's index in the model spec).
    ``buf`` holds the model's tensors one after the other, as a whole-model upload does."""

    def __init__(self, numels: Sequence[int]) -> None:
        self.numels = list(numels)
        self._starts = [0]
        for n in self.numels:
            self._starts.append(self._starts[-1] + n)
        self.buf = bytearray(4 * self._starts[-1])
        self._taken: list[Piece] = []

    def add(self, pieces: Sequence[Piece], data: memoryview) -> None:
        """The fp32 values of ``pieces``, one after the other in ``data``. Raises
        ``PieceError`` for runs outside their tensors or overlapping ones already given."""
        if len(data) != 4 * sum(pc.numel for pc in pieces):
            raise PieceError(
                f"an upload of {sum(pc.numel for pc in pieces)} elements must be "
                f"{4 * sum(pc.numel for pc in pieces)} bytes, got {len(data)}"
            )
        check_pieces([*self._taken, *pieces], self.numels)
        off = 0
        for pc in pieces:
            at = 4 * (self._starts[pc.j] + pc.offset)
            self.buf[at : at + 4 * pc.numel] = data[off : off + 4 * pc.numel]
            off += 4 * pc.numel
        self._taken += pieces

    @property
    def complete(self) -> bool:
        return sum(pc.numel for pc in self._taken) == self._starts[-1]
