"""Fused CPU kernels for the syncer's outer step, from the optional C extension
``ddiloco._kernels`` (built by ``pip install`` where a C compiler is present).

One Nesterov outer step on a learner's push, written as torch operations, is five or six
memory-bound passes over the fragment, each a separate call that releases and retakes the
GIL. The kernel does it in one pass with the GIL released (``bench/perf_syncer.py``
measures both on a 2.4 MB fragment, and what the kernel does to a syncer's throughput).

Every function returns ``None`` when it cannot run: the extension is missing, the kernels are
switched off (``DDILOCO_KERNELS=0`` in the environment, or ``set_enabled(False)``), or a
tensor is not a contiguous fp32 CPU tensor of the expected size. Callers then use the torch
operations, which give the same values up to fp32 rounding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

try:
    from ddiloco import _kernels as _ext
except ImportError:  # built without a C compiler
    _ext = None

__all__ = ["available", "enabled", "set_enabled", "nesterov_stepped", "all_finite", "is_plain_f32"]

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


def _empty_f32(shape: torch.Size) -> torch.Tensor:
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
        np_, nb = _empty_f32(p.shape), _empty_f32(b.shape)
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
