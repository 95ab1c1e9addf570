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

from ddiloco.algorithm.kernels import is_plain_f32

__all__ = ["Codec", "CODECS", "get_codec"]

_CHUNK = 1 << 18
"""Elements processed per pass: the fp32 temporaries of one chunk (1 MiB) stay in cache,
so each elementwise op runs at cache rather than memory speed, and there are few enough
chunks that per-op dispatch does not dominate (64 Ki-element chunks were 1.8x slower)."""
_ROUND_MAGIC = float(1 << 23)


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
        B = self.block
        nb = math.ceil(numel / B)
        if numel == nb * B and x.dtype == torch.float32 and x.device.type == "cpu":
            flat = x.contiguous()  # whole blocks: no padded copy
        else:
            flat = torch.zeros(nb * B, dtype=torch.float32)
            flat[:numel] = x
        n_packed = math.ceil(numel * self.bits / 8)
        out = torch.empty(nb * 4 + (nb * B * self.bits) // 8, dtype=torch.uint8)
        scale = out[: nb * 4].view(torch.float32)
        payload = out[nb * 4 :]
        cb = _CHUNK // B  # blocks per chunk
        chunks = [(b0, min(nb, b0 + cb)) for b0 in range(0, nb, cb)]
        if self.bits == 1:
            for b0, b1 in chunks:
                blocks = flat[b0 * B : b1 * B].view(b1 - b0, B)
                torch.sum(blocks.abs(), dim=1, out=scale[b0:b1])
                q = (blocks >= 0).view(torch.uint8).view(-1, 8)
                acc = q[:, 0].clone()
                for i in range(1, 8):
                    acc |= q[:, i] << i
                payload[b0 * B // 8 : b1 * B // 8] = acc
            counts = torch.full((nb,), float(B))
            counts[-1] = numel - (nb - 1) * B
            scale.div_(counts)
            return out[: nb * 4 + n_packed].numpy().tobytes()
        levels = (1 << self.bits) - 1
        per = 8 // self.bits
        lo = torch.empty(nb)
        for b0, b1 in chunks:  # absmax per block = max(max, -min): no abs temporary
            blocks = flat[b0 * B : b1 * B].view(b1 - b0, B)
            torch.amax(blocks, dim=1, out=scale[b0:b1])
            torch.amin(blocks, dim=1, out=lo[b0:b1])
        torch.maximum(scale, lo.neg_(), out=scale)
        # q = round((x + absmax) / step), step = 2 absmax / levels, in [0, levels]
        inv = torch.where(scale > 0, levels / (2 * scale), torch.ones_like(scale))[:, None]
        offset = scale[:, None] * inv
        qf = torch.empty(cb, B)
        cbuf = torch.empty(cb * B, dtype=torch.uint8)
        for b0, b1 in chunks:
            q = qf[: b1 - b0]
            torch.mul(flat[b0 * B : b1 * B].view(b1 - b0, B), inv[b0:b1], out=q)
            q.add_(offset[b0:b1])
            # adding 2^23 rounds to the nearest integer (ties to even, like torch.round) and
            # leaves it in the low mantissa bits: the low byte of each fp32 word is the code,
            # and an int32 -> uint8 copy keeps exactly that byte
            q.add_(_ROUND_MAGIC)
            words = q.view(-1).view(torch.int32)
            dst = payload[b0 * B * self.bits // 8 : b1 * B * self.bits // 8]
            if per == 1:
                dst.copy_(words)
                continue
            # pack `per` codes per byte, code i of a group in bits [i*b, (i+1)*b): read the
            # group's `per` code bytes as one little-endian integer w; the low byte of
            # w | w >> (8-b) | w >> 2(8-b) ... is the packed byte
            codes = cbuf[: words.numel()]
            codes.copy_(words)
            w = codes.view(torch.int16 if per == 2 else torch.int32)
            acc = w >> (8 - self.bits)
            acc |= w
            for i in range(2, per):
                acc |= w >> (i * (8 - self.bits))
            dst.copy_(acc)
        return out[: nb * 4 + n_packed].numpy().tobytes()

    def encode_many(self, tensors: list[torch.Tensor]) -> list[memoryview]:
        """The encodings of ``tensors``, concatenated, as a list of read-only byte views.
        fp32 views the tensors' own memory when they are contiguous fp32 CPU tensors (no
        copy: the caller must not modify them while the views are in use); bf16 casts into
        one preallocated buffer; quantised codecs encode tensor by tensor."""
        if self.quantised:
            return [memoryview(self.encode(t)) for t in tensors]
        if self.name == "fp32":
            return [memoryview(_flat_f32(t)).cast("B").toreadonly() for t in tensors]
        out = torch.empty(sum(self.nbytes(t.numel()) for t in tensors), dtype=torch.uint8)
        off = 0
        for t in tensors:
            nb = self.nbytes(t.numel())
            out[off : off + nb].view(torch.bfloat16).copy_(t.detach().reshape(-1))
            off += nb
        return [memoryview(out.numpy()).toreadonly()]

    def decode(self, buf: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """Decode to a flat fp32 tensor; raises ValueError if the size does not match."""
        expected = self.nbytes(numel)
        if len(buf) != expected:
            raise ValueError(
                f"{self.name} payload for {numel} elements must be {expected} bytes, got {len(buf)}"
            )
        if numel == 0:
            return torch.zeros(0)
        if self.name == "fp32":  # numpy's view holds the GIL (torch.frombuffer releases it)
            return torch.from_numpy(np.frombuffer(_writable(buf), dtype=np.float32))
        if self.name == "bf16":
            return torch.frombuffer(_writable(buf), dtype=torch.bfloat16).float()
        B = self.block
        nb = math.ceil(numel / B)
        raw = torch.frombuffer(_writable(buf), dtype=torch.uint8)
        scale_all = raw[: nb * 4].view(torch.float32)
        packed = raw[nb * 4 :]
        full = nb * B * self.bits // 8
        if packed.numel() != full:
            packed = torch.cat([packed, packed.new_zeros(full - packed.numel())])
        out = torch.empty(nb * B, dtype=torch.float32)
        levels = (1 << self.bits) - 1
        per = 8 // self.bits
        cb = _CHUNK // B
        if self.bits == 1:
            step, neg = 2 * scale_all[:, None], -scale_all[:, None]
        else:
            step, neg = (2 * scale_all / levels)[:, None], -scale_all[:, None]
        for b0 in range(0, nb, cb):
            b1 = min(nb, b0 + cb)
            pv = packed[b0 * B * self.bits // 8 : b1 * B * self.bits // 8].view(b1 - b0, -1)
            o2 = out[b0 * B : b1 * B].view(b1 - b0, B)
            if per == 1:
                o2.copy_(pv)
            else:  # unpack the codes into fp32
                ov = o2.view(b1 - b0, B // per, per)
                for i in range(per):
                    ov[:, :, i] = (pv >> (i * self.bits)) & levels if i else pv & levels
            o2.mul_(step[b0:b1]).add_(neg[b0:b1])  # x = q * step - absmax (addcmul is slower)
        return out if numel == out.numel() else out[:numel].contiguous()

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` reshaped like x (what the receiver sees)."""
        return self.decode(self.encode(x), x.numel()).view(x.shape)


def _flat_f32(t: torch.Tensor) -> np.ndarray:
    """``t`` as a flat fp32 numpy array: its own memory for a contiguous fp32 CPU tensor
    (one call that keeps the GIL; the chain of torch calls it replaces releases and retakes
    the GIL once per call, which a busy syncer pays for in thread switches), a copy
    otherwise."""
    if is_plain_f32(t):
        return t.numpy().reshape(-1)
    return t.detach().reshape(-1).float().contiguous().numpy()


def _writable(buf: bytes | bytearray | memoryview) -> bytearray | memoryview:
    """A writable buffer over the same bytes: a bytearray (or a writable view of one) is
    used as is, so fp32 decoding aliases the received buffer instead of copying it; read-only
    bytes are copied (torch wants writable memory). Callers hand over ``buf``."""
    if isinstance(buf, bytearray) or (isinstance(buf, memoryview) and not buf.readonly):
        return buf
    return bytearray(buf)


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", 32),
    "bf16": Codec("bf16", 16),
    "int8": Codec("int8", 8),
    "int4": Codec("int4", 4),
    "int2": Codec("int2", 2),
    "1bit": Codec("1bit", 1),
}


def get_codec(name: str) -> Codec:
    """A codec by name: one of ``CODECS``, or a quantised one with another block size,
    ``"int2/4096"`` (a power of two from 8 to 65536 elements per scale)."""
    if name in CODECS:
        return CODECS[name]
    base, sep, block = str(name).partition("/")
    if sep and base in CODECS and CODECS[base].quantised:
        b = int(block) if block.isdigit() else 0
        if 8 <= b <= _CHUNK and b & (b - 1) == 0:
            return Codec(name, CODECS[base].bits, b)
        raise ValueError(
            f"codec {name!r}: the block size must be a power of two from 8 to "
            f"{_CHUNK}, got {block!r}"
        )
    raise ValueError(
        f"unknown codec {name!r}; choose one of {tuple(CODECS)} (quantised ones "
        f"with another block size as e.g. 'int2/4096')"
    )
