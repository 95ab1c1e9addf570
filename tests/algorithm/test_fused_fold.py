"""Pushes read where they arrived (``kernels.diff_norm``, ``diff_fold``, ``diff_fold_norm``,
``finite_elements``) against the reference path they replace: each push decoded by torch a
piece at a time, then its finite check, its norm (``round_merge.distance``) and its sum
(``Fold.add_pieces``), each a pass of its own. The kernels round as that path does, so the
two agree bit for bit where torch's CPU kernels use fused multiply-adds (AVX2, AVX-512);
the norms (numpy's dot of the same differences) agree bit for bit everywhere."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ddiloco.algorithm import kernels
from ddiloco.algorithm import round_merge as rm
from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.fragments import fragment_parameters
from ddiloco.algorithm.merge import Fold, all_finite
from ddiloco.algorithm.payload import CHUNK, EncodedParams
from ddiloco.algorithm.policy import PolicyConfig
from ddiloco.algorithm.syncer_state import Contribution, Status, SyncerConfig, SyncerState

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C extension not built")

EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
NC = kernels.NORM_CHUNK
SIZES = [0, 1, 7, 17, 1000, NC - 1, NC + 5, 3 * NC + 13]


@pytest.fixture
def reference():
    """Run the body with the kernels switched off: the three-pass torch path."""

    def run(fn):
        prev = kernels.set_enabled(False)
        try:
            return fn()
        finally:
            kernels.set_enabled(prev)

    return run


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if EXACT:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)


def _push(codec: str, n: int, seed: int, scale: float = 0.01):
    """(anchor, the encoded push of anchor + noise, its elements as the kernels read them)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g)
    cd = get_codec(codec)
    buf = bytearray(cd.encode(a + scale * torch.randn(n, generator=g)))
    params = EncodedParams(cd, buf, [(n,)])
    raw = params.elements(0)
    assert raw is not None
    return a, params, raw


def _ref_norm(a: torch.Tensor, params: EncodedParams, piece: int = CHUNK) -> float:
    """``measure``'s reference: ``distance`` of each piece, its square added."""
    return math.sqrt(
        sum(rm.distance([a[o : o + x.numel()]], [x]) ** 2 for o, x in params.chunks(0, piece))
    )


@pytest.mark.parametrize("codec", ["bf16", "fp32"])
@pytest.mark.parametrize("n", SIZES)
def test_the_norm_pass_gives_the_bits_of_distance_by_pieces(codec, n):
    a, params, (x, bf16) = _push(codec, n, n)
    scratch = np.empty(NC, dtype=np.float32)
    for piece in (CHUNK, 2 * NC):  # one piece, and several of them
        norm, finite = kernels.diff_norm(a, x, bf16, piece, scratch)
        assert finite and norm == _ref_norm(a, params, piece)


@pytest.mark.parametrize("codec", ["bf16", "fp32"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("c", [1.0, 0.37, 1 / 3, 2.5e-7, 12345.678])
def test_the_fold_pass_rounds_as_torch_adds(codec, n, c):
    a, params, (x, bf16) = _push(codec, n, n + 1)
    start = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.1
    want = start.clone()
    for o, xs in params.chunks(0, 1000):
        want[o : o + xs.numel()].add_(torch.sub(a[o : o + xs.numel()], xs), alpha=c)
    got = start.clone()
    assert kernels.diff_fold(got, a, x, bf16, c)
    assert _same(got, want)
    # the same pass with its norm
    got2, scratch = start.clone(), np.empty(NC, dtype=np.float32)
    norm, finite = kernels.diff_fold_norm(got2, a, x, bf16, c, CHUNK, scratch)
    assert finite and norm == _ref_norm(a, params) and torch.equal(got2, got)
    # a new buffer: its old values are never read (here NaN), as if it held zeros
    fresh = torch.full((n,), math.nan)
    assert kernels.diff_fold(fresh, a, x, bf16, c, fresh=True)
    zeros = torch.zeros(n)
    zeros.add_(torch.sub(a, params[0]), alpha=c)
    assert _same(fresh, zeros)


@pytest.mark.parametrize("codec", ["bf16", "fp32"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, NC // 2 + 3, 2 * NC, 3 * NC + 12])
def test_nan_and_inf_are_found_anywhere_in_a_chunk(codec, bad, where):
    n = 3 * NC + 13
    a, params, _ = _push(codec, n, 3)
    cd = get_codec(codec)
    x = params[0].reshape(-1).clone()
    x[where] = bad
    params = EncodedParams(cd, bytearray(cd.encode(x)), [(n,)])
    assert not params.finite(0)
    assert not all_finite(params[0])  # the reference decode-then-check agrees
    xs, bf16 = params.elements(0)
    assert not kernels.finite_elements(xs, bf16)
    scratch = np.empty(NC, dtype=np.float32)
    norm, finite = kernels.diff_norm(a, xs, bf16, CHUNK, scratch)
    ref = _ref_norm(a, params)
    assert not finite and (math.isnan(norm) and math.isnan(ref) or norm == ref == math.inf)
    # a finite push next to it is finite
    ok = EncodedParams(cd, bytearray(cd.encode(a)), [(n,)])
    assert ok.finite(0) and kernels.finite_elements(*ok.elements(0))


def test_bf16_finite_check_reads_every_exponent():
    """Every bf16 bit pattern: non-finite exactly where its exponent bits are all ones."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16).float()
    bad = ~torch.isfinite(values)
    raw = bits.numpy()
    for i in range(0, raw.size, 4096):
        part = raw[i : i + 4096].view(np.uint16)
        assert kernels.finite_elements(part, True) == (not bool(bad[i : i + 4096].any()))
    assert int(bad.sum()) == 2 * (1 << 7)  # +-inf and the NaNs: 2^7 mantissas x 2 signs


@pytest.mark.parametrize("codec", ["bf16", "fp32"])
@pytest.mark.parametrize("radial", [True, False])
@pytest.mark.parametrize("factor", [1.0, 0.4, 0.0])
def test_a_fold_read_in_one_pass_equals_the_reference_fold(codec, radial, factor, reference):
    shape = (3, 2 * NC + 7)  # odd, more than one dot product per tensor
    pushes = [_push(codec, math.prod(shape), 10 + i, scale=0.01 * (i + 1)) for i in range(3)]
    anchor = pushes[0][0].view(shape)
    pushes = [(anchor, EncodedParams(p.codec, p.buf, [shape])) for _, p, _ in pushes]

    def fold(one_pass: bool) -> tuple[torch.Tensor, float, float]:
        f = Fold(shape, radial)
        for i, (a, p) in enumerate(pushes):
            norm = _ref_norm(a.reshape(-1), p)
            f_i = factor if i == 1 else 1.0  # the guard clips the second push
            if one_pass:
                assert f.add_elements(a, *p.elements(0), 1.0 + i, norm, f_i)
            else:
                f.add_pieces(a, p.chunks(0), 1.0 + i, norm, f_i)
        return f.weight, f.radius, f.take()

    w1, r1, got = fold(True)
    w0, r0, want = reference(lambda: fold(False))
    assert (w1, r1) == (w0, r0) and _same(got, want)


def test_a_plain_fold_takes_its_norm_in_the_same_pass():
    n = 2 * NC + 3
    a, params, (x, bf16) = _push("bf16", n, 5)
    one, ref = Fold((n,), False), Fold((n,), False)
    scratch = np.empty(NC, dtype=np.float32)
    norm = one.add_elements_measuring(a, x, bf16, 2.0, CHUNK, scratch)
    assert norm == _ref_norm(a, params)
    ref.add_pieces(a, params.chunks(0), 2.0, norm, 1.0)
    assert one.weight == ref.weight and _same(one.take(), ref.take())
    with pytest.raises(ValueError, match="radial"):
        Fold((n,), True).add_elements_measuring(a, x, bf16, 2.0, CHUNK, scratch)


@pytest.mark.parametrize("radial", [True, False])
def test_empty_tensors_fold_to_an_empty_gradient(radial):
    a, params, (x, bf16) = _push("bf16", 0, 0)
    f = Fold((0,), radial)
    assert f.add_elements(a, x, bf16, 1.0, 0.0)
    assert kernels.diff_norm(a, x, bf16, CHUNK, np.empty(NC, np.float32)) == (0.0, True)
    assert f.take().shape == (0,)


def test_the_kernels_decline_what_they_cannot_read():
    a, params, (x, bf16) = _push("bf16", 10, 0)
    scratch = np.empty(NC, dtype=np.float32)
    assert kernels.diff_norm(a.double(), x, bf16, CHUNK, scratch) is None
    assert kernels.diff_norm(a[:9], x, bf16, CHUNK, scratch) is None
    assert not kernels.diff_fold(torch.zeros(10, 1), a, x, bf16, 1.0)
    int8 = get_codec("int8")
    assert EncodedParams(int8, bytearray(int8.encode(a)), [(10,)]).elements(0) is None
    delta = EncodedParams(params.codec, params.buf, [(10,)], delta=True)
    assert delta.elements(0) is None and delta.finite(0)
    with pytest.raises(ValueError, match="scratch"):
        kernels.diff_norm(a, x, bf16, CHUNK, np.empty(16, np.float32))


# -- whole rounds: the state machine with the kernels on and off ---------------------------
SPECS = [("emb", 64 * 9, 4), ("w1", 33 * 31, 4), ("w2", NC + 3, 4), ("b", 1, 4)]
SHAPES = {"emb": (64, 9), "w1": (33, 31), "w2": (NC + 3,), "b": (1,)}


def _rounds(codec: str, rule: str, clip: float, chunk: int | None = None) -> SyncerState:
    """Nine rounds of six pushes of fragment 0, the last with a wild learner (clipped where
    the guard is on and has its eight recent norms)."""
    fr = fragment_parameters(SPECS, 1, "balanced", {"emb"})
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    cfg = SyncerConfig(policy=PolicyConfig(quorum=6, grace=False), merge_rule=rule, norm_clip=clip)
    st = SyncerState(fr, init, cfg)
    for m in range(6):
        st.join(m)
    cd = get_codec(codec)
    names = fr.fragments[0].names
    for r in range(9):
        for m in range(6):
            scale = 0.5 if (m == 2 and r == 8) else 0.01
            g = torch.Generator().manual_seed(100 * r + m)
            ps = [init[n] - scale * torch.randn(SHAPES[n], generator=g) for n in names]
            data = bytearray(b"".join(cd.encode(x) for x in ps))
            c = Contribution(
                learner=m,
                fragment=0,
                params=EncodedParams(cd, data, [x.shape for x in ps]),
                c_steps=10,
                c_tokens=1000 + 7 * m,
                base_version=st.version(0),
                seq=r,
            )
            assert st.submit(c, float(r)).status is Status.ACCEPTED
    return st


@pytest.mark.parametrize("codec", ["bf16", "fp32"])
@pytest.mark.parametrize(("rule", "clip"), [("rda", 2.5), ("rda", 0.0), ("average", 2.5)])
def test_rounds_folded_by_the_kernels_equal_the_reference_rounds(codec, rule, clip, reference):
    """The whole merge: norms, the guard's clips, the new fragment and its momentum, the
    norms it keeps; with the guard off (and in the first eight rounds) a plain tensor's
    norm is taken in its fold's pass."""
    got = _rounds(codec, rule, clip)
    want = reference(lambda: _rounds(codec, rule, clip))
    assert got.merges == want.merges == 9
    if clip:
        assert got.clipped_pushes == want.clipped_pushes == 1
    s1, s0 = got.frags[0], want.frags[0]
    assert list(s1.norms) == list(s0.norms)
    for a, b in zip(s1.theta + s1.momentum, s0.theta + s0.momentum):
        assert _same(a, b)


def test_a_norm_left_to_the_fold_is_taken_if_the_kernels_go_off_before_it(monkeypatch, reference):
    """``measure`` leaves a plain tensor's norm to the fold where the kernels read the push;
    switched off in between, the fold takes the norm itself, and the merge is the same."""
    measure = rm.measure

    def then_off(*args, **kwargs):
        out = measure(*args, **kwargs)
        kernels.set_enabled(False)
        return out

    monkeypatch.setattr(rm, "measure", then_off)
    prev = kernels.set_enabled(True)
    try:
        got = _rounds("bf16", "average", 0.0)
    finally:
        kernels.set_enabled(prev)
    monkeypatch.setattr(rm, "measure", measure)
    want = reference(lambda: _rounds("bf16", "average", 0.0))
    s1, s0 = got.frags[0], want.frags[0]
    for a, b in zip(s1.theta + s1.momentum, s0.theta + s0.momentum):
        assert _same(a, b)
