"""A push kept as it arrived: the codec's bytes, decoded one tensor at a time when a merge
reads it.

A round holds each learner's pending push until it merges or folds it
(``SyncerState._fold``). Decoded, a push of fragment p is an fp32 copy of the fragment; kept
encoded it is the codec's size (bf16: half, int4: about a seventh), and it is read one
tensor, or one piece of a tensor (``chunks``), at a time, so the syncer's memory for
pending pushes is their wire bytes plus one piece.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import torch

from ddiloco.algorithm import kernels
from ddiloco.algorithm.codecs import Codec
from ddiloco.algorithm.merge import all_finite

__all__ = ["CHUNK", "EncodedParams", "encode_push", "encoded_finite"]

CHUNK = 1 << 20
"""Elements per piece when a push is read a piece at a time (``EncodedParams.chunks``)."""


def encoded_finite(codec: Codec, buf, numel: int) -> bool:
    """The ``numel`` values a codec's bytes ``buf`` hold are all finite: read where they
    arrived by the kernels where they read the codec (bf16: its exponent bits), else
    decoded."""
    raw = kernels.elements(codec.name, buf, numel)
    if raw is not None:
        return kernels.finite_elements(*raw)
    return all_finite(codec.decode(buf, numel))


def encode_push(
    codec: Codec, params: Sequence[torch.Tensor], base: Sequence[torch.Tensor] | None
) -> tuple[bytes, bool]:
    """The wire bytes of a push of ``params`` and whether they are a delta: through a
    ``delta`` codec, the difference from ``base`` (the learner's installed copy of the
    version the push names), else the parameters themselves (also when there is no base).
    The runtime learner and the in-process engine both encode with this."""
    if codec.delta and base is not None:
        return b"".join(codec.encode(x.float() - b.float()) for x, b in zip(params, base)), True
    return b"".join(codec.encode(x) for x in params), False


class EncodedParams(Sequence[torch.Tensor]):
    """The tensors of one push in ``codec``'s encoding, one after the other in ``buf``.

    ``delta``: the push is the difference from the learner's installed copy of version
    ``Contribution.base_version``; reading tensor j gives that difference (the syncer adds
    its version to it). Tensors read are fp32, shaped, and must not be written (fp32 ones
    alias ``buf``)."""

    __slots__ = ("codec", "buf", "shapes", "delta", "_spans")

    def __init__(
        self,
        codec: Codec,
        buf: bytearray | memoryview,
        shapes: Sequence[tuple[int, ...]],
        *,
        delta: bool = False,
    ) -> None:
        self.codec = codec
        self.buf = buf
        self.shapes = [tuple(s) for s in shapes]
        self.delta = delta
        spans, off = [], 0
        for s in self.shapes:
            k = math.prod(s)
            nb = codec.nbytes(k)
            spans.append((off, nb, k))
            off += nb
        if off != len(buf):
            raise ValueError(f"{codec.name} payload must be {off} bytes, got {len(buf)}")
        self._spans = spans

    def __len__(self) -> int:
        return len(self.shapes)

    @overload
    def __getitem__(self, j: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, j: slice) -> list[torch.Tensor]: ...
    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        off, nb, k = self._spans[j]
        return self.codec.decode(memoryview(self.buf)[off : off + nb], k).view(self.shapes[j])

    def chunks(self, j: int, size: int = CHUNK) -> Iterator[tuple[int, torch.Tensor]]:
        """Tensor j flat, as (offset, fp32 values) pieces of about ``size`` elements: a codec
        whose elements decode on their own (``Codec.element_bytes``) is read a piece at a
        time, so reading a tensor holds one piece, not the tensor; any other codec gives
        the whole tensor as one piece. The pieces must not be written."""
        off, nb, k = self._spans[j]
        eb = self.codec.element_bytes
        if eb is None or k <= size:
            yield 0, self[j].reshape(-1)
            return
        view = memoryview(self.buf)[off : off + nb]
        for a in range(0, k, size):
            b = min(k, a + size)
            yield a, self.codec.decode(view[a * eb : b * eb], b - a)

    def elements(self, j: int) -> tuple[np.ndarray, bool] | None:
        """Tensor j's elements as they arrived, flat, and whether they are bf16, for the
        kernels to read (``kernels.elements``: fp32 and bf16 parameters); None otherwise."""
        if self.delta:
            return None
        off, nb, k = self._spans[j]
        return kernels.elements(self.codec.name, memoryview(self.buf)[off : off + nb], k)

    def finite(self, j: int) -> bool:
        """Tensor j holds no NaN or inf: read where it arrived by the kernels where they read
        its codec (bf16: its exponent bits), else decoded a piece at a time (``chunks``)."""
        off, nb, k = self._spans[j]
        raw = kernels.elements(self.codec.name, memoryview(self.buf)[off : off + nb], k)
        if raw is not None:
            return kernels.finite_elements(*raw)
        return all(all_finite(x) for _, x in self.chunks(j))

    @property
    def nbytes(self) -> int:
        return len(self.buf)
