"""``fp8``: float8 e4m3 (``torch.float8_e4m3fn``) with one fp32 scale per block.

Each block of ``block`` elements (64 by default) is scaled so that its absmax lands on
e4m3's largest finite value, 448, then rounded to e4m3 (nearest, ties to even): one byte
per element plus 4 bytes per block, 8.5 bits per element. e4m3 keeps 3 mantissa bits, so an
element is off by at most 2^-4 of itself, or by 2^-10 of the block's scale where it falls
among the subnormals (below 2^-6 of the scale).

Pushes are deltas (``delta``): on the weights themselves a relative error of 2^-4 (16
times bf16's 2^-8) would put noise on every weight at each merge, whatever the update; on
the difference from the installed copy it is at most 2^-4 of the update itself. The syncer
adds a decoded delta to the published version the push names, as for the int codecs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ddiloco.algorithm.codecs.registry import Codec, register_codec, writable

__all__ = ["Fp8Codec"]

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""


@dataclass(frozen=True, slots=True)
class Fp8Codec(Codec):
    """e4m3 codes, preceded by one fp32 scale (absmax / 448) per ``block`` elements."""

    name: str = "fp8"
    block: int = 64
    """Elements per scale."""

    @property
    def delta(self) -> bool:
        return True

    def with_block(self, block: int) -> Fp8Codec:
        return replace(self, name=f"fp8/{block}", block=block)

    def nbytes(self, numel: int) -> int:
        return math.ceil(numel / self.block) * 4 + numel

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as fp32 rows of ``block`` elements, the last one padded with zeros."""
        x = x.detach().reshape(-1)
        numel, B = x.numel(), self.block
        nb = math.ceil(numel / B)
        if numel == nb * B:
            return x.float().view(nb, B)
        flat = torch.zeros(nb * B, dtype=torch.float32)
        flat[:numel] = x
        return flat.view(nb, B)

    def encode(self, x: torch.Tensor) -> bytes:
        numel = x.numel()
        if numel == 0:
            return b""
        blocks = self._blocks(x)
        nb = blocks.shape[0]
        out = torch.empty(nb * 4 + nb * self.block, dtype=torch.uint8)
        scale = out[: nb * 4].view(torch.float32)
        torch.amax(blocks.abs(), dim=1, out=scale)
        scale.div_(E4M3_MAX)
        inv = torch.where(scale > 0, 1.0 / scale, torch.ones_like(scale))
        codes = out[nb * 4 :].view(torch.float8_e4m3fn).view(nb, self.block)
        codes.copy_(blocks * inv[:, None])  # |x| * inv <= 448 up to rounding: never past it
        return out[: nb * 4 + numel].numpy().tobytes()

    def decode(self, buf: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        self.check_size(buf, numel)
        if numel == 0:
            return torch.zeros(0)
        nb = math.ceil(numel / self.block)
        raw = torch.frombuffer(writable(buf), dtype=torch.uint8)
        scale = raw[: nb * 4].view(torch.float32)
        values = raw[nb * 4 :].view(torch.float8_e4m3fn).float()
        out = torch.empty(nb * self.block, dtype=torch.float32)
        out[:numel] = values
        blocks = out.view(nb, self.block)
        blocks.mul_(scale[:, None])
        return out if numel == out.numel() else out[:numel].contiguous()


register_codec(Fp8Codec())
