"""Codecs for what travels between learners and the syncer.

``fp32`` and ``bf16`` are plain casts. ``int8``, ``int4``, ``int2`` quantise blockwise to
2^b uniform levels spanning [-absmax, absmax] of each block (one fp32 scale per block);
``1bit`` sends signs plus the mean magnitude of each block. Everything is vectorised torch;
values are accumulated and optimised in fp32 on both ends. Byte counts are exact:
``len(codec.encode(x)) == codec.nbytes(x.numel())``.

Error bounds per element: int-b: absmax_block / (2^b - 1); bf16: 2^-8 relative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Codec", "CODECS", "get_codec"]


@dataclass(frozen=True, slots=True)
class Codec:
    name: str
    bits: int
    """Bits per element of the payload (excluding per-block scales)."""
    block: int = 64
    """Elements per quantisation block (quantised codecs only)."""

    @property
    def quantised(self) -> bool:
        return self.bits < 16

    def nbytes(self, numel: int) -> int:
        """Exact encoded size of a tensor with ``numel`` elements."""
        if not self.quantised:
            return numel * self.bits // 8
        n_blocks = math.ceil(numel / self.block)
        return n_blocks * 4 + math.ceil(numel * self.bits / 8)

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().reshape(-1)
        if self.name == "fp32":
            return x.float().contiguous().numpy().tobytes()
        if self.name == "bf16":
            return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
        numel = x.numel()
        nb = math.ceil(numel / self.block)
        padded = torch.zeros(nb * self.block, dtype=torch.float32)
        padded[:numel] = x.float()
        blocks = padded.view(nb, self.block)
        if self.bits == 1:
            counts = torch.full((nb,), float(self.block))
            counts[-1] = numel - (nb - 1) * self.block
            scale = blocks.abs().sum(dim=1) / counts
            q = (blocks >= 0).to(torch.uint8)
        else:
            levels = (1 << self.bits) - 1
            scale = blocks.abs().amax(dim=1)
            step = torch.where(scale > 0, 2 * scale / levels, torch.ones_like(scale))
            q = torch.round((blocks + scale[:, None]) / step[:, None]).clamp_(0, levels)
            q = q.to(torch.uint8)
        packed = _pack(q.reshape(-1), self.bits)[: math.ceil(numel * self.bits / 8)]
        return scale.numpy().astype(np.float32).tobytes() + packed.numpy().tobytes()

    def decode(self, buf: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """Decode to a flat fp32 tensor; raises ValueError if the size does not match."""
        expected = self.nbytes(numel)
        if len(buf) != expected:
            raise ValueError(f"{self.name} payload for {numel} elements must be {expected} bytes, "
                             f"got {len(buf)}")
        if numel == 0:
            return torch.zeros(0)
        if self.name == "fp32":
            return torch.frombuffer(bytearray(buf), dtype=torch.float32)
        if self.name == "bf16":
            return torch.frombuffer(bytearray(buf), dtype=torch.bfloat16).float()
        nb = math.ceil(numel / self.block)
        raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        scale = raw[: nb * 4].view(torch.float32)
        packed = torch.zeros(nb * self.block * self.bits // 8, dtype=torch.uint8)
        packed[: raw.numel() - nb * 4] = raw[nb * 4:]
        q = _unpack(packed, self.bits).view(nb, self.block).float()
        if self.bits == 1:
            vals = (q * 2 - 1) * scale[:, None]
        else:
            levels = (1 << self.bits) - 1
            step = 2 * scale / levels
            vals = q * step[:, None] - scale[:, None]
        return vals.reshape(-1)[:numel].contiguous()

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` reshaped like x (what the receiver sees)."""
        return self.decode(self.encode(x), x.numel()).view(x.shape)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return q
    per = 8 // bits
    q = q.view(-1, per)
    out = torch.zeros(q.shape[0], dtype=torch.uint8)
    for i in range(per):
        out |= q[:, i] << (i * bits)
    return out


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (i * bits)) & mask for i in range(per)], dim=1).reshape(-1)


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", 32),
    "bf16": Codec("bf16", 16),
    "int8": Codec("int8", 8),
    "int4": Codec("int4", 4),
    "int2": Codec("int2", 2),
    "1bit": Codec("1bit", 1),
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose one of {tuple(CODECS)}") from None
