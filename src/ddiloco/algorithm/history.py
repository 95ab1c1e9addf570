"""The syncer's past versions of a fragment, kept compactly and only while a push can name
them.

A push sent as a delta (``Codec.delta``) is the difference from the copy the learner
installed, and names that copy's version v. The syncer adds it to its own version v of the
fragment, so it keeps version v as long as some learner can still push against it:

* a learner can push fragment p against the version of its last push of p or a newer one
  (it installs what it fetched, never an older copy), and a learner that joins pushes
  against the version it fetches, at least the one current at its join. The floor of a
  fragment is the lowest of those *pins* over its live learners and its pending pushes;
  older versions are dropped;
* nothing older than ``max_staleness`` versions is kept (such a push is dropped as stale),
  nor more than the configured ``history`` versions.

A past version is not kept as a whole copy. Each merge records its step,
``u_v = Theta_p(v) - Theta_p(v + 1)``, through ``HISTORY_CODEC``; version v is the current
fragment plus the recorded steps from v on. bf16 keeps each step to 2^-8 of its own size
(the step is a fraction of an outer gradient, far smaller than the weights), so a version
reconstructed ``k`` merges back is within ``k * 2^-8`` of a step of the version itself, at
half an fp32 copy per version held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from ddiloco.algorithm.codecs import get_codec

__all__ = ["HISTORY_CODEC", "FragmentHistory"]

HISTORY_CODEC = "bf16"
"""The encoding of the recorded merge steps (``docs/architecture.md``, "Memory")."""


class FragmentHistory:
    """The recorded merge steps of one fragment: version v -> ``u_v`` per tensor (encoded)."""

    __slots__ = ("_codec", "_steps", "shapes")

    def __init__(self, shapes: Sequence[tuple[int, ...]], codec: str = HISTORY_CODEC) -> None:
        self._codec = get_codec(codec)
        self._steps: deque[tuple[int, list[bytearray]]] = deque()  # oldest first, consecutive
        self.shapes = [tuple(s) for s in shapes]

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def nbytes(self) -> int:
        """Bytes held by the recorded steps."""
        return sum(len(b) for _, bs in self._steps for b in bs)

    @property
    def oldest(self) -> int | None:
        """The oldest version that can be reconstructed (besides the current one)."""
        return self._steps[0][0] if self._steps else None

    def record(self, version: int, old: Sequence[torch.Tensor], new: Sequence[torch.Tensor]):
        """The merge from ``version`` (tensors ``old``) to ``version + 1`` (``new``)."""
        self.append(version, [self.encode_step(a, b) for a, b in zip(old, new)])

    def encode_step(self, old: torch.Tensor, new: torch.Tensor) -> bytearray:
        """One tensor's recorded step ``old - new``, encoded (``record`` takes these)."""
        return bytearray(self._codec.encode(old.float() - new.float()))

    def append(self, version: int, steps: list[bytearray]) -> None:
        """Record the merge from ``version``, its steps encoded by ``encode_step``."""
        if self._steps and self._steps[-1][0] != version - 1:
            self._steps.clear()  # not consecutive (a resume): nothing older can be rebuilt
        self._steps.append((version, steps))

    def trim(self, floor: int, keep: int) -> None:
        """Drop the steps of versions below ``floor``, and all but the newest ``keep``."""
        while self._steps and (self._steps[0][0] < floor or len(self._steps) > keep):
            self._steps.popleft()

    def clear(self) -> None:
        self._steps.clear()

    def holds(self, version: int, current: int) -> bool:
        """Version ``version`` can be reconstructed while the fragment is at ``current``."""
        if version == current:
            return True
        oldest = self.oldest
        return oldest is not None and oldest <= version < current

    def tensor(self, theta: Sequence[torch.Tensor], version: int, j: int) -> torch.Tensor:
        """Tensor j of ``version`` (a new fp32 tensor), from the current tensors ``theta``:
        ``theta[j]`` plus the steps recorded from ``version`` on."""
        out = theta[j].detach().float().clone()
        k = out.numel()
        for v, bs in self._steps:
            if v >= version:
                out.add_(self._codec.decode(bs[j], k).view(out.shape))
        return out

    def version(self, theta: Sequence[torch.Tensor], version: int) -> list[torch.Tensor]:
        """Every tensor of ``version`` (new fp32 tensors)."""
        return [self.tensor(theta, version, j) for j in range(len(theta))]
