"""The codec protocol and the registry of codecs by name.

A codec turns a flat tensor into the bytes that travel between learners and the syncer and
back into fp32 (values are accumulated and optimised in fp32 on both ends). Every codec
states three facts that its users read instead of its name:

* ``delta``: a push through it is the difference from the learner's installed copy of the
  fragment, which the syncer adds to the published version the push names. Lossy codecs
  whose error is relative to what they carry (few mantissa bits, block scales) lose the
  parameters themselves but not a small update, so they send deltas. The runtime learner,
  the in-process engine and the syncer's history (``SyncConfig.resolved_history``) all read
  this property;
* ``lossless``: ``decode(encode(x)) == x`` exactly (nothing to delta-code, nothing to round);
* ``downlink``: it can carry merged fragments back to learners (the syncer's
  ``downlink_codec``).

Byte counts are exact: ``len(codec.encode(x)) == codec.nbytes(x.numel())``. A codec with a
``block`` size (elements per scale) has variants named ``"name/block"``, e.g. ``int2/4096``.

Adding a codec is one module: a frozen dataclass subclassing ``Codec``, and a call to
``register_codec`` at import; ``ddiloco.algorithm.codecs`` imports the built-in ones.
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from ddiloco.algorithm.kernels import is_plain_f32

__all__ = [
    "CODECS",
    "MAX_BLOCK",
    "Codec",
    "codec_names",
    "downlink_codec_names",
    "flat_f32",
    "get_codec",
    "register_codec",
    "writable",
]

MAX_BLOCK = 1 << 18
"""Largest block size of a variant (``int2/262144``): one chunk of the blockwise codecs."""


class Codec(abc.ABC):
    """What every codec provides. Concrete codecs are frozen dataclasses with ``name`` first."""

    __slots__ = ()

    name: str
    """Name in the configuration and on the wire (the push and fetch headers' ``codec``)."""

    @property
    @abc.abstractmethod
    def delta(self) -> bool:
        """A push is sent as the delta against the learner's installed copy of the fragment."""

    @property
    def lossless(self) -> bool:
        """``decode(encode(x))`` equals ``x`` exactly."""
        return False

    @property
    def downlink(self) -> bool:
        """Can carry merged fragments (parameters, or deltas with ``down_delta``) to learners."""
        return True

    @property
    def block(self) -> int | None:
        """Elements per scale, for codecs with per-block scales; None for the others."""
        return None

    @property
    def element_bytes(self) -> int | None:
        """Bytes of each element, when element i is bytes ``[i k, (i + 1) k)`` of the
        encoding (fp32, bf16), so that a range of a tensor decodes on its own; None for
        codecs with block scales or packed bits."""
        return None

    @property
    def bits_per_element(self) -> float:
        """Bits on the wire per element of a large tensor, block scales included (int4: 4.5)."""
        n = MAX_BLOCK * 4
        return self.nbytes(n) * 8 / n

    def with_block(self, block: int) -> Codec:
        """This codec with ``block`` elements per scale, named ``f"{name}/{block}"``."""
        raise ValueError(f"codec {self.name!r} has no block size")

    @abc.abstractmethod
    def nbytes(self, numel: int) -> int:
        """Exact encoded size of a tensor with ``numel`` elements."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> bytes:
        """The bytes of ``x`` (any shape, read flat)."""

    @abc.abstractmethod
    def decode(self, buf: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """Decode to a flat fp32 tensor; raises ValueError if the size does not match."""

    def encode_many(self, tensors: list[torch.Tensor]) -> list[memoryview]:
        """The encodings of ``tensors``, concatenated, as a list of read-only byte views."""
        return [memoryview(self.encode(t)) for t in tensors]

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` reshaped like x (what the receiver sees)."""
        return self.decode(self.encode(x), x.numel()).view(x.shape)

    def check_size(self, buf: bytes | bytearray | memoryview, numel: int) -> None:
        """Raise ValueError unless ``buf`` is the encoding size of ``numel`` elements."""
        expected = self.nbytes(numel)
        if len(buf) != expected:
            raise ValueError(
                f"{self.name} payload for {numel} elements must be {expected} bytes, got {len(buf)}"
            )


CODECS: dict[str, Codec] = {}
"""Every registered codec by name (block-size variants are made on demand by ``get_codec``)."""


def register_codec(codec: Codec) -> Codec:
    """Add ``codec`` to the registry under its name; returns it. A name is taken once."""
    if not codec.name or "/" in codec.name:
        raise ValueError(f"codec name {codec.name!r} must be non-empty and without '/'")
    if codec.name in CODECS and CODECS[codec.name] != codec:
        raise ValueError(f"codec {codec.name!r} is already registered")
    CODECS[codec.name] = codec
    return codec


def codec_names() -> tuple[str, ...]:
    """The registered codecs' names, in registration order."""
    return tuple(CODECS)


def downlink_codec_names() -> tuple[str, ...]:
    """The registered codecs that can carry merged fragments to learners."""
    return tuple(n for n, c in CODECS.items() if c.downlink)


def get_codec(name: str) -> Codec:
    """A codec by name: a registered one, or one with per-block scales at another block
    size, ``"int2/4096"`` (a power of two from 8 to ``MAX_BLOCK`` elements per scale)."""
    if name in CODECS:
        return CODECS[name]
    base, sep, block = str(name).partition("/")
    if sep and base in CODECS and CODECS[base].block is not None:
        b = int(block) if block.isdigit() else 0
        if 8 <= b <= MAX_BLOCK and b & (b - 1) == 0:
            return CODECS[base].with_block(b)
        raise ValueError(
            f"codec {name!r}: the block size must be a power of two from 8 to "
            f"{MAX_BLOCK}, got {block!r}"
        )
    blockwise = [n for n, c in CODECS.items() if c.block is not None]
    variants = (
        f" (those with block scales, {', '.join(blockwise)}, with another block size as "
        f"e.g. '{blockwise[0]}/4096')"
        if blockwise
        else ""
    )
    raise ValueError(f"unknown codec {name!r}; choose one of {codec_names()}{variants}")


def flat_f32(t: torch.Tensor) -> np.ndarray:
    """``t`` as a flat fp32 numpy array: its own memory for a contiguous fp32 CPU tensor
    (one call that keeps the GIL; the chain of torch calls it replaces releases and retakes
    the GIL once per call, which a busy syncer pays for in thread switches), a copy
    otherwise."""
    if is_plain_f32(t):
        return t.numpy().reshape(-1)
    return t.detach().reshape(-1).float().contiguous().numpy()


def writable(buf: bytes | bytearray | memoryview) -> bytearray | memoryview:
    """A writable buffer over the same bytes: a bytearray (or a writable view of one) is
    used as is, so decoding may alias the received buffer instead of copying it; read-only
    bytes are copied (torch wants writable memory). Callers hand over ``buf``."""
    if isinstance(buf, bytearray) or (isinstance(buf, memoryview) and not buf.readonly):
        return buf
    return bytearray(buf)
