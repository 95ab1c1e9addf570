"""Fused CPU kernels for the syncer's outer step and for reading pushes, from the optional C
extension ``ddiloco._kernels`` (built by ``pip install`` where a C compiler is present).

One Nesterov outer step on a learner's push, written as torch operations, is five or six
memory-bound passes over the fragment, each a separate call that releases and retakes the
GIL. The kernel does it in one pass with the GIL released (``bench/perf_syncer.py``
measures both on a 2.4 MB fragment, and what the kernel does to a syncer's throughput).

A push of fp32 or bf16 parameters (``payload.EncodedParams``) is read by the merge guard's
norm and by its fold (``merge.Fold``); decoded by torch, each read first writes the push as
a new fp32 tensor a piece at a time and then reads it back. The kernels read its elements
where they arrived, widening bf16 in registers: ``diff_norm`` is the norm's pass (the
difference from the anchor into a scratch of ``NORM_CHUNK`` elements, which stays in the
cache, and numpy's dot of it, as ``round_merge.distance`` takes it), ``diff_fold`` the
fold's (``out += c * (anchor - x)``), ``diff_fold_norm`` both in one pass, and
``finite_elements`` the check for NaN and inf (bf16: its exponent bits, nothing decoded).
They give the torch path's bits (``tests/algorithm/test_fused_fold.py``).

Every function returns ``None`` (``diff_fold``: False) when it cannot run: the extension is
missing, the kernels are switched off (``DDILOCO_KERNELS=0`` in the environment, or
``set_enabled(False)``), or a tensor is not a contiguous fp32 CPU tensor of the expected
size (``elements`` is None then, and ``finite_elements`` takes what it gives). Callers then
use the torch operations, which give the same values up to fp32 rounding.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch

try:
    from ddiloco import _kernels as _ext
except ImportError:  # built without a C compiler
    _ext = None

__all__ = [
    "available",
    "enabled",
    "set_enabled",
    "nesterov_stepped",
    "all_finite",
    "is_plain_f32",
    "empty_f32",
    "NORM_CHUNK",
    "elements",
    "finite_elements",
    "readable",
    "diff_norm",
    "diff_fold",
    "diff_fold_norm",
]

_enabled = os.environ.get("DDILOCO_KERNELS", "1") != "0"


def available() -> bool:
    """The C extension was built, imports, and has kernels for this CPU (x86-64 with AVX2
    and FMA, or aarch64)."""
    return _ext is not None and bool(_ext.FAST)


def enabled() -> bool:
    """The kernels are available and switched on."""
    return _enabled and available()


def set_enabled(on: bool) -> bool:
    """Switch the kernels on or off for this process; returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(on)
    return prev


def empty_f32(shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A new fp32 CPU tensor, not initialised."""
    # numpy allocates without releasing the GIL (torch.empty releases and retakes it)
    return torch.from_numpy(np.empty(tuple(shape), dtype=np.float32))


def is_plain_f32(t: torch.Tensor) -> bool:
    """A contiguous fp32 CPU tensor outside autograd: its memory is the flat fp32 array."""
    return (
        t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.is_contiguous()
        and not t.requires_grad
    )


def _fits(t: torch.Tensor, numel: int) -> bool:
    return t.numel() == numel and is_plain_f32(t)


def nesterov_stepped(
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    scale: float = 1.0,
    grads: Sequence[torch.Tensor] | None = None,
    anchors: Sequence[torch.Tensor] | None = None,
    pushes: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], bool] | None:
    """``OuterNesterov.stepped`` into new tensors, fused: ``b' = mu*b + s*g``,
    ``theta' = theta - lr*s*g - lr*mu*b'`` with ``g = grads`` or ``g = anchors - pushes``
    (computed on the fly, never stored). Returns (theta', b', every theta' finite), or
    ``None`` where the kernel cannot run. Inputs are never written. The kernel rounds as
    torch's CPU operations do, step by step (``tests/algorithm/test_kernels.py`` checks bit
    equality where torch runs its AVX2 or AVX-512 kernels)."""
    if not enabled():
        return None
    if (grads is None) == (anchors is None or pushes is None):
        raise ValueError("give either grads or both anchors and pushes")
    n = len(params)
    ins = [list(grads)] if grads is not None else [list(anchors), list(pushes)]
    if len(buffers) != n or any(len(x) != n for x in ins):
        raise ValueError("params, buffers and gradients must have one tensor each per slot")
    for j, p in enumerate(params):
        k = p.numel()
        if not all(_fits(t[j], k) for t in ([params, buffers] + ins)):
            return None
    new_p, new_b, finite = [], [], True
    for j, (p, b) in enumerate(zip(params, buffers)):
        a = ins[0][j]
        x = ins[1][j].data_ptr() if len(ins) == 2 else 0
        np_, nb = empty_f32(p.shape), empty_f32(b.shape)
        if p.numel():
            finite &= _ext.nesterov(
                p.data_ptr(),
                b.data_ptr(),
                a.data_ptr(),
                x,
                np_.data_ptr(),
                nb.data_ptr(),
                p.numel(),
                momentum,
                scale,
                -lr,
                -lr * scale,
                -lr * momentum,
                scale == 1.0,
            )
        new_p.append(np_)
        new_b.append(nb)
    return new_p, new_b, finite


def all_finite(t: torch.Tensor) -> bool | None:
    """No NaN or inf in a contiguous fp32 CPU tensor (one pass, GIL released); ``None``
    where the kernel cannot run."""
    if not enabled() or not _fits(t, t.numel()):
        return None
    return t.numel() == 0 or _ext.finite(t.data_ptr(), t.numel())


# -- pushes read where they arrived (fp32 or bf16 parameters) ------------------------------
NORM_CHUNK = 1 << 15
"""Elements per dot product of a norm (``round_merge.distance`` takes its norms so too: the
same pieces and the same dots give the same bits)."""

_ELEMENTS = {"fp32": (np.float32, False), "bf16": (np.uint16, True)}
"""Codec name -> (dtype of its elements as they arrive, whether they are bf16)."""


def elements(codec_name: str, buf, numel: int) -> tuple[np.ndarray, bool] | None:
    """The ``numel`` elements of ``buf`` (a codec's bytes) as they arrived, flat, and whether
    they are bf16 (as int16 bits: read by the kernels only), for the codecs the kernels read
    (fp32, bf16); ``None`` for any other codec, or where the kernels cannot run."""
    kind = _ELEMENTS.get(codec_name)
    if kind is None or not enabled():
        return None
    dtype, bf16 = kind
    x = np.frombuffer(buf, dtype=dtype, count=numel)
    return x, bf16


def finite_elements(x: np.ndarray, bf16: bool) -> bool:
    """No NaN or inf among ``elements`` ``x`` (one pass, GIL released)."""
    if x.size == 0:
        return True
    if bf16:
        return bool(_ext.finite_bf16(x.ctypes.data, x.size))
    return bool(_ext.finite(x.ctypes.data, x.size))


def readable(anchor: torch.Tensor, x: np.ndarray, out: torch.Tensor | None = None) -> bool:
    """The kernels below can run on these: switched on, and ``anchor`` (and ``out``) flat
    contiguous fp32 CPU tensors of x's size."""
    return (
        enabled()
        and anchor.dim() == 1
        and _fits(anchor, x.size)
        and (out is None or (out.dim() == 1 and _fits(out, x.size)))
    )


def diff_norm(
    anchor: torch.Tensor, x: np.ndarray, bf16: bool, piece: int, scratch: np.ndarray
) -> tuple[float, bool] | None:
    """``|anchor - x|`` of ``elements`` ``x`` and whether every x is finite, in one pass: x
    in pieces of ``piece`` elements, each the dot products of its ``NORM_CHUNK``-element
    runs of the difference added in a float, its norm the root of that; the norm is the
    root of the pieces' squared norms. (That is the arithmetic, and so the bits, of
    ``round_merge.distance`` applied to each piece.) ``scratch``: fp32, ``NORM_CHUNK``
    elements or more (written). An overflow or a NaN gives an inf or NaN norm. ``None``
    where the kernels cannot run (``readable``)."""
    if not readable(anchor, x):
        return None
    return _norm_pass(anchor, x, bf16, None, 0.0, False, piece, scratch)


def diff_fold(
    out: torch.Tensor,
    anchor: torch.Tensor,
    x: np.ndarray,
    bf16: bool,
    c: float,
    *,
    fresh: bool = False,
) -> bool:
    """``out += c * (anchor - x)`` of ``elements`` ``x`` in one pass, rounded as torch's
    ``out.add_(anchor - x, alpha=c)`` is (a fused multiply-add); ``fresh``: ``out`` is
    taken as zeros and not read (its memory may be uninitialised). False (nothing done)
    where the kernels cannot run (``readable``)."""
    if not readable(anchor, x, out):
        return False
    if x.size:
        _ext.diff_fold(anchor.data_ptr(), x.ctypes.data, bf16, 0, out.data_ptr(), c, fresh, x.size)
    return True


def diff_fold_norm(
    out: torch.Tensor,
    anchor: torch.Tensor,
    x: np.ndarray,
    bf16: bool,
    c: float,
    piece: int,
    scratch: np.ndarray,
    *,
    fresh: bool = False,
) -> tuple[float, bool] | None:
    """``diff_fold`` and ``diff_norm`` in the same pass; ``None`` (nothing done) where the
    kernels cannot run."""
    if not readable(anchor, x, out):
        return None
    return _norm_pass(anchor, x, bf16, out, c, fresh, piece, scratch)


def _norm_pass(
    anchor: torch.Tensor,
    x: np.ndarray,
    bf16: bool,
    out: torch.Tensor | None,
    c: float,
    fresh: bool,
    piece: int,
    scratch: np.ndarray,
) -> tuple[float, bool]:
    """``diff_norm``, and with ``out`` the fold in the same pass (``diff_fold_norm``)."""
    if scratch.dtype != np.float32 or scratch.size < NORM_CHUNK or not piece > 0:
        raise ValueError(f"scratch must hold {NORM_CHUNK} fp32 elements, piece must be > 0")
    n, eb = x.size, x.itemsize
    a0, x0, d0 = anchor.data_ptr(), x.ctypes.data, scratch.ctypes.data
    o0 = 0 if out is None else out.data_ptr()
    finite, sq = True, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for o in range(0, n, piece):
            end, total = min(n, o + piece), 0.0
            for i in range(o, end, NORM_CHUNK):
                k = min(NORM_CHUNK, end - i)
                dst = o0 and o0 + 4 * i
                ok = _ext.diff_fold(a0 + 4 * i, x0 + eb * i, bf16, d0, dst, c, fresh, k)
                finite = finite and ok
                d = scratch[:k]
                total += float(np.dot(d, d))
            sq += math.sqrt(total) ** 2
    return math.sqrt(sq), finite
