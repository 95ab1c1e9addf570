"""The fused outer-step kernels (``ddiloco._kernels`` through ``ddiloco.algorithm.kernels``)
against the torch operations they replace."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from ddiloco.algorithm import kernels
from ddiloco.algorithm.merge import OuterNesterov, all_finite

# where torch's CPU kernels use fused multiply-adds as the C kernel does, the two agree bit for
# bit; elsewhere up to fp32 rounding
EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason="C extension not built for this CPU"
)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) if EXACT else torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def _tensors(seed: int, numels=(100_003, 7, 1)) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    P = [torch.randn(n, generator=g) for n in numels]
    return {
        "params": P,
        "buffers": [torch.randn(p.shape, generator=g) * 0.1 for p in P],
        "anchors": [p + torch.randn(p.shape, generator=g) * 0.01 for p in P],
        "pushes": [p + torch.randn(p.shape, generator=g) * 0.01 for p in P],
        "grads": [torch.randn(p.shape, generator=g) * 0.01 for p in P],
    }


def test_extension_is_built_where_a_compiler_is():
    """``pip install`` builds the extension wherever a C compiler is (as in CI): the fast path
    is the one the tests exercise, not a silent fallback."""
    if platform.machine() not in ("x86_64", "aarch64") or not (
        shutil.which("cc") or shutil.which("gcc")
    ):
        pytest.skip("no C compiler or not a CPU the kernels are built for")
    from ddiloco import _kernels

    if platform.machine() == "x86_64" and not _kernels.FAST:
        pytest.skip("this x86-64 CPU has no AVX2/FMA")
    assert kernels.available()


@needs_kernels
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
@pytest.mark.parametrize("form", ["delta", "grads"])
def test_fused_step_matches_torch_and_leaves_inputs(scale, form):
    t = _tensors(0)
    before = {k: [x.clone() for x in v] for k, v in t.items()}
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    kw = (
        {"anchors": t["anchors"], "pushes": t["pushes"]}
        if form == "delta"
        else {"grads": t["grads"]}
    )
    new_p, new_b, finite = kernels.nesterov_stepped(
        t["params"], t["buffers"], lr=0.7, momentum=0.9, scale=scale, **kw
    )
    grads = (
        torch._foreach_sub(t["anchors"], t["pushes"])
        if form == "delta"
        else [g.clone() for g in t["grads"]]
    )
    ref_p, ref_b = outer.stepped(t["params"], grads, t["buffers"], scale)
    assert finite
    assert all(_same(a, b) for a, b in zip(new_p, ref_p))
    assert all(_same(a, b) for a, b in zip(new_b, ref_b))
    assert all(torch.equal(x, y) for k in t for x, y in zip(t[k], before[k])), "inputs written"
    # the output is new memory, never an input's
    assert {x.data_ptr() for x in new_p + new_b}.isdisjoint(
        x.data_ptr() for v in t.values() for x in v
    )


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_fused_step_reports_nonfinite_output(bad):
    t = _tensors(1)
    t["pushes"][0][12345] = bad
    _, _, finite = kernels.nesterov_stepped(
        t["params"], t["buffers"], lr=0.7, momentum=0.9, anchors=t["anchors"], pushes=t["pushes"]
    )
    assert not finite
    t = _tensors(1)  # finite inputs whose step overflows
    t["grads"][1][3] = 3e38
    _, _, finite = kernels.nesterov_stepped(
        t["params"],
        t["buffers"],
        lr=0.7,
        momentum=0.9,
        scale=1.0,
        grads=[g * 1 for g in t["grads"]],
    )
    assert not finite


@needs_kernels
def test_unsupported_tensors_fall_back_to_torch():
    t = _tensors(2, numels=(64,))
    strided = [torch.randn(128)[::2]]
    for kw in ({"anchors": strided, "pushes": t["pushes"]}, {"grads": [t["grads"][0].double()]}):
        assert (
            kernels.nesterov_stepped(t["params"], t["buffers"], lr=0.7, momentum=0.9, **kw) is None
        )
    outer = OuterNesterov()
    p, b, finite = outer.stepped_checked(
        t["params"], t["buffers"], 0.5, anchors=strided, pushes=t["pushes"]
    )
    ref_p, ref_b = outer.stepped(
        t["params"], torch._foreach_sub(strided, t["pushes"]), t["buffers"], 0.5
    )
    assert finite and torch.equal(p[0], ref_p[0]) and torch.equal(b[0], ref_b[0])
    with pytest.raises(ValueError, match="either grads or both"):
        kernels.nesterov_stepped(
            t["params"], t["buffers"], lr=0.7, momentum=0.9, anchors=t["anchors"]
        )


def test_switching_kernels_off_gives_the_same_step():
    t = _tensors(3)
    outer = OuterNesterov()
    on = outer.stepped_checked(
        t["params"], t["buffers"], 0.5, anchors=t["anchors"], pushes=t["pushes"]
    )
    prev = kernels.set_enabled(False)
    try:
        assert not kernels.enabled()
        assert (
            kernels.nesterov_stepped(
                t["params"], t["buffers"], lr=0.7, momentum=0.9, grads=t["grads"]
            )
            is None
        )
        off = outer.stepped_checked(
            t["params"], t["buffers"], 0.5, anchors=t["anchors"], pushes=t["pushes"]
        )
    finally:
        kernels.set_enabled(prev)
    assert on[2] and off[2]
    assert all(_same(a, b) for a, b in zip(on[0] + on[1], off[0] + off[1]))


def test_all_finite_with_and_without_the_kernel():
    x = torch.randn(300_001)
    for on in (True, False):
        prev = kernels.set_enabled(on)
        try:
            assert all_finite(x) and all_finite(torch.zeros(0))
            for bad in (float("nan"), float("inf"), -float("inf")):
                y = x.clone()
                y[-1] = bad
                assert not all_finite(y)
            assert all_finite(torch.full((10,), 3e38))  # finite values whose sum overflows
        finally:
            kernels.set_enabled(prev)
