"""Plain casts: ``fp32`` (lossless) and ``bf16`` (2^-8 relative error per element).

Neither sends deltas: a cast carries the parameters themselves. bf16's 8 mantissa bits
round a weight by at most 2^-8 of itself. As deltas (the update rounded instead of the
weight) the default run ends 0.0003 lower at seeds 0 and 1 (1.0882 against 1.0885, 1.1556
against 1.1559; DP 1.0881 and 1.1462: ``python bench/push_encoding.py``), a difference
within the seeds' noise, while the syncer would keep a past version of each fragment a
learner can still push against (half an fp32 copy of the model per version,
``ddiloco.algorithm.history``). So bf16 pushes stay parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ddiloco.algorithm.codecs.registry import Codec, flat_f32, register_codec, writable

__all__ = ["Bf16Codec", "Fp32Codec"]


@dataclass(frozen=True, slots=True)
class Fp32Codec(Codec):
    """The fp32 values themselves."""

    name: str = "fp32"

    @property
    def delta(self) -> bool:
        return False

    @property
    def lossless(self) -> bool:
        return True

    @property
    def element_bytes(self) -> int:
        return 4

    def nbytes(self, numel: int) -> int:
        return numel * 4

    def encode(self, x: torch.Tensor) -> bytes:
        return x.detach().reshape(-1).float().contiguous().numpy().tobytes()

    def encode_many(self, tensors: list[torch.Tensor]) -> list[memoryview]:
        """Views of the tensors' own memory when they are contiguous fp32 CPU tensors (no
        copy: the caller must not modify them while the views are in use)."""
        return [flat_f32(t).data.cast("B").toreadonly() for t in tensors]

    def decode(self, buf: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        self.check_size(buf, numel)
        if numel == 0:
            return torch.zeros(0)
        # numpy's view holds the GIL (torch.frombuffer releases it)
        return torch.from_numpy(np.frombuffer(writable(buf), dtype=np.float32))


@dataclass(frozen=True, slots=True)
class Bf16Codec(Codec):
    """Round to bfloat16 (nearest, ties to even)."""

    name: str = "bf16"

    @property
    def delta(self) -> bool:
        return False

    @property
    def element_bytes(self) -> int:
        return 2

    def nbytes(self, numel: int) -> int:
        return numel * 2

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().reshape(-1)
        return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()

    def encode_many(self, tensors: list[torch.Tensor]) -> list[memoryview]:
        """Cast into one preallocated buffer."""
        out = torch.empty(sum(self.nbytes(t.numel()) for t in tensors), dtype=torch.uint8)
        off = 0
        for t in tensors:
            nb = self.nbytes(t.numel())
            out[off : off + nb].view(torch.bfloat16).copy_(t.detach().reshape(-1))
            off += nb
        return [out.numpy().data.toreadonly()]

    def decode(self, buf: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        self.check_size(buf, numel)
        if numel == 0:
            return torch.zeros(0)
        return torch.frombuffer(writable(buf), dtype=torch.bfloat16).float()


register_codec(Fp32Codec())
register_codec(Bf16Codec())
