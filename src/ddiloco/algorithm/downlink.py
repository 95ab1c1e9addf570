"""The delta-coded downlink (``sync.down_delta``): one reference chain per fragment, shared
by every learner.

The syncer sends a learner the difference between the published fragment and the copy that
learner holds, through the downlink codec, so that a 4-bit downlink carries small updates
instead of weights. Both ends must agree on that copy. Rather than one model-sized copy per
learner, the syncer keeps one chain per fragment:

    R(v0) = Theta(v0)                         (the version the chain starts at)
    R(v)  = R(v - 1) + D(E(Theta(v) - R(v - 1)))   at each published version v

where E/D are the downlink codec. The rounding error of each step is carried into the next
(``Theta(v) - R(v)`` is one step's rounding, never a sum of them). A learner that holds
R(v) and fetches version V receives the encoded steps v+1..V, byte for byte what the chain
applied, and so holds R(V) exactly; a learner without a copy (a start, a rejoin, or one
further behind than the steps kept) receives R(V) whole, in fp32. A learner's copy is named
by the token of its version, so the syncer holds one fp32 copy per fragment (R) and the
encoded steps that some live learner's copy still needs, whatever the number of learners.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Sequence

import torch

from ddiloco.algorithm.codecs import Codec

__all__ = ["DeltaChain"]


class DeltaChain:
    """The reference chain of one fragment (see the module docstring).

    ``ref`` holds R(version), new tensors at every step (never written in place: a reply
    being sent may still read the previous ones)."""

    __slots__ = ("codec", "ref", "version", "_steps", "_tokens", "shapes")

    def __init__(self, codec: Codec, theta: Sequence[torch.Tensor], version: int) -> None:
        self.codec = codec
        self.ref = [t.detach().float().clone() for t in theta]
        self.shapes = [tuple(t.shape) for t in theta]
        self.version = version
        self._steps: deque[tuple[int, list[bytes]]] = deque()  # (v, the step to v), in order
        self._tokens: dict[int, int] = {version: secrets.randbits(52)}

    @property
    def token(self) -> int:
        """The token of the current copy R(version)."""
        return self._tokens[self.version]

    def version_of(self, token: int | None) -> int | None:
        """The version whose copy ``token`` names, if this chain made it."""
        if token is None:
            return None
        for v, t in self._tokens.items():
            if t == token:
                return v
        return None

    @property
    def step_bytes(self) -> int:
        """Bytes held by the kept steps."""
        return sum(len(b) for _, bs in self._steps for b in bs)

    def advance(self, version: int, theta: Sequence[torch.Tensor]) -> None:
        """Version ``version`` (tensors ``theta``) was published."""
        if version <= self.version:
            return
        pieces, ref = [], []
        for r, t in zip(self.ref, theta):
            b = self.codec.encode(t.detach().float() - r)
            ref.append(r + self.codec.decode(b, r.numel()).view(r.shape))
            pieces.append(b)
        self.ref = ref
        if version != self.version + 1:
            self._steps.clear()  # a gap: no copy older than this one can be brought up
            self._tokens = {}
        self.version = version
        self._steps.append((version, pieces))
        self._tokens[version] = secrets.randbits(52)

    def steps_since(self, version: int) -> list[list[bytes]] | None:
        """The encoded steps (each one piece per tensor) that take R(version) to
        R(self.version), in order (empty when it is current), or None when they are no
        longer kept."""
        if version == self.version:
            return []
        out = [bs for v, bs in self._steps if v > version]
        if len(out) != self.version - version:
            return None
        return out

    def trim(self, oldest_held: int) -> None:
        """Keep only the steps a copy of version ``oldest_held`` or newer still needs."""
        while self._steps and self._steps[0][0] <= oldest_held:
            self._steps.popleft()
        for v in [v for v in self._tokens if v < oldest_held]:
            del self._tokens[v]
