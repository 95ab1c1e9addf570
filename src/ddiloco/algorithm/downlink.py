"""The delta-coded downlink (``sync.down_delta``): one reference chain per fragment, shared
by every learner.

The syncer sends a learner the difference between the published fragment and the copy that
learner holds, through the downlink codec, so that a 4-bit downlink carries small updates
instead of weights. Both ends must agree on that copy. Rather than one model-sized copy per
learner, the syncer keeps one chain per fragment:

    R(v0) = Theta(v0)                         (the version the chain starts at)
    R(v)  = R(v - 1) + D(E(Theta(v) - R(v - 1)))   at each published version v

where E/D are the downlink codec. The rounding error of each step is carried into the next
(``Theta(v) - R(v)`` is one step's rounding, never a sum of them). A learner that holds a
copy of version v and fetches version V receives the encoded steps v+1..V, byte for byte
what the chain applied, and adds them to its copy; a learner without a copy (a start, a
rejoin, or one further behind than the steps kept) receives the syncer's R(V) whole, in
fp32. A learner's copy is named by the token of its version, so the syncer holds one chain
per fragment and the encoded steps that some live learner's copy still needs, whatever the
number of learners.

The chain holds R without an fp32 copy of the fragment: it keeps a reference to the
published tensors Theta(v) of its version (never written in place: the syncer's state holds
the same tensors, so the reference costs nothing) and the residual ``Theta(v) - R(v)``, one
step's rounding of the downlink codec, encoded by ``RESIDUAL_CODEC`` (int8 with a scale per
block of 64: 1.0625 bytes per element, about a quarter of fp32). So the syncer's R(v) is
``Theta(v) - decode(residual)``, and each step is computed against that R. The residual
codec rounds each element by up to 1/255 of its block's largest residual, so the syncer's R
and the copy a learner builds by adding the steps are no longer bit for bit the same: they
differ by the sum of those roundings over the versions the learner followed, a random walk
whose step is about 2^-8 of the downlink codec's rounding of one step, never a quantisation
step of the downlink codec. The learner's copy is therefore within one step's rounding of
Theta(v) plus that walk. Measured with int4 against the exact recurrence
(``tests/algorithm/test_downlink_chain.py``, seed 0): after 300 versions the walk is about
0.1 of int4's largest rounding of a step and the learner's error 1.01-1.04x the exact
chain's; after 3000 versions 0.24-0.29 and 1.03-1.11x. A learner that receives a copy
whole gets the syncer's R (and a walk from zero from then on). int8's levels are symmetric
about zero with zero halfway between two of them, so a residual of exactly zero (the element
of a block that the downlink codec represents exactly, its largest) rounds to the same side
every time, which adds up linearly where one element stays its block's largest (3.9x int4's
rounding after 3000 versions); the residual is stored negated at odd versions, so that those
roundings alternate in sign.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddiloco.algorithm.codecs import Codec, get_codec

__all__ = ["RESIDUAL_CODEC", "ChainCopy", "DeltaChain"]

RESIDUAL_CODEC = "int8"
"""The codec of the residual ``Theta(v) - R(v)`` a chain keeps (see the module docstring)."""


@dataclass(frozen=True, slots=True, eq=False)
class ChainCopy:
    """R(version) of a chain as the chain holds it: the published tensors and the encoded
    residual of each (None: zero). Immutable, and never written by the chain (a later
    ``advance`` builds new ones), so that a reply may build R from it after the lock."""

    version: int
    theta: tuple[torch.Tensor, ...]
    residual: tuple[bytes | None, ...]

    def residual_tensor(self, j: int) -> torch.Tensor | None:
        """Theta - R of tensor j as decoded (a new fp32 tensor of its shape), None: zero."""
        b = self.residual[j]
        if b is None:
            return None
        t = self.theta[j]
        d = get_codec(RESIDUAL_CODEC).decode(b, t.numel()).view(t.shape)
        return d.neg_() if self.version % 2 else d  # stored negated at odd versions

    def tensor(self, j: int) -> torch.Tensor:
        """R of tensor j, as a new fp32 tensor of its shape."""
        d = self.residual_tensor(j)
        t = self.theta[j].float()
        return t.clone() if d is None else torch.sub(t, d, out=d)

    def tensors(self) -> list[torch.Tensor]:
        return [self.tensor(j) for j in range(len(self.theta))]

    @property
    def nbytes(self) -> int:
        """Bytes of the residual (Theta is the published tensors, not held here)."""
        return sum(len(b) for b in self.residual if b is not None)


class DeltaChain:
    """The reference chain of one fragment (see the module docstring).

    ``theta`` must never be written in place, by the caller or anyone else, while a chain
    may hold it: the chain keeps a reference, not a copy."""

    __slots__ = ("codec", "version", "_copy", "_steps", "_tokens", "shapes")

    def __init__(self, codec: Codec, theta: Sequence[torch.Tensor], version: int) -> None:
        self.codec = codec
        self._copy = ChainCopy(version, tuple(t.detach() for t in theta), (None,) * len(theta))
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

    def copy(self) -> ChainCopy:
        """R(version) as held (immutable: R may be built from it after a later advance)."""
        return self._copy

    def reference(self) -> list[torch.Tensor]:
        """R(version), as new fp32 tensors (the fragment's size: build them one at a time
        with ``copy().tensor(j)`` where that matters)."""
        return self._copy.tensors()

    @property
    def step_bytes(self) -> int:
        """Bytes held by the kept steps."""
        return sum(len(b) for _, bs in self._steps for b in bs)

    @property
    def nbytes(self) -> int:
        """Bytes the chain holds: the residual and the kept steps (Theta is referenced)."""
        return self._copy.nbytes + self.step_bytes

    def advance(self, version: int, theta: Sequence[torch.Tensor]) -> None:
        """Version ``version`` (tensors ``theta``, referenced from now on) was published.
        Tensor by tensor: the temporaries are a few of one tensor."""
        if version <= self.version:
            return
        res = get_codec(RESIDUAL_CODEC)
        prev = self._copy
        pieces, resid = [], []
        for j, t in enumerate(theta):
            x = t.detach().float() - prev.theta[j].float()  # Theta(v) - R(v - 1) ...
            d = prev.residual_tensor(j)
            if d is not None:
                x += d  # ... = Theta(v) - Theta(v - 1) + (Theta(v - 1) - R(v - 1))
                del d
            b = self.codec.encode(x)
            x -= self.codec.decode(b, x.numel()).view(x.shape)  # Theta(v) - R(v)
            if version % 2:
                x.neg_()
            resid.append(res.encode(x))
            pieces.append(b)
            del x
        self._copy = ChainCopy(version, tuple(t.detach() for t in theta), tuple(resid))
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
