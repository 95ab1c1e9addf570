import math

import pytest
import torch

from ddiloco.algorithm.codecs import CODECS, get_codec
from ddiloco.algorithm.merge import (
    OuterNesterov,
    all_finite,
    all_finite_list,
    alpha_mix,
    merge_outer_gradients,
    rda,
    token_weight,
    weighted_average,
)
from ddiloco.algorithm.policy import (
    Ema,
    MergeNow,
    PolicyConfig,
    QuorumGracePolicy,
    WaitForMore,
    WaitUntil,
    grace_window_s,
)


def test_token_weight_formula():
    assert token_weight(1000, 10) == 1000 * 100
    assert token_weight(500, 10) == 500 * 50
    # a learner that lost half its slices (half the batch per step) counts 4x less for equal steps
    assert token_weight(500, 10) / token_weight(1000, 10) == 0.25
    assert token_weight(0, 5) == 0.0 and token_weight(5, 0) == 0.0


@pytest.mark.parametrize("M", [2, 4, 8, 16])
def test_rda_keeps_norm_of_equal_norm_inputs(M):
    g = torch.Generator().manual_seed(M)
    vs = [torch.randn(4096, generator=g) for _ in range(M)]
    vs = [3.0 * v / v.norm() for v in vs]
    out = rda(vs, [1.0] * M)
    assert out.norm().item() == pytest.approx(3.0, rel=1e-5)
    plain = weighted_average(vs, [1.0] * M)
    assert plain.norm().item() < 3.0 * 1.5 / math.sqrt(M)  # plain average shrinks ~1/sqrt(M)


def test_rda_weighted_radius_and_direction():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 4.0])
    out = rda([a, b], [3.0, 1.0])
    assert out.norm().item() == pytest.approx(0.75 * 2 + 0.25 * 4)
    d = torch.tensor([0.75, 0.25])
    assert torch.allclose(out / out.norm(), d / d.norm())
    assert torch.equal(rda([torch.zeros(3)], [1.0]), torch.zeros(3))


def test_merge_uses_average_for_embeddings():
    a = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])]
    b = [torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])]
    out = merge_outer_gradients([a, b], [1.0, 1.0], embedding=[False, True], rule="rda")
    assert out[0].norm().item() == pytest.approx(1.0)
    assert torch.allclose(out[1], torch.tensor([0.5, 0.5]))
    avg = merge_outer_gradients([a, b], [1.0, 1.0], embedding=[False, True], rule="average")
    assert torch.allclose(avg[0], torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="merge rule"):
        merge_outer_gradients([a], [1.0], [False, False], rule="median")


def test_outer_nesterov_matches_torch_sgd():
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(10, generator=g)
    grads = [torch.randn(10, generator=g) for _ in range(5)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    ours, buf = p0.clone(), torch.zeros(10)
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    for gr in grads:
        ref.grad = gr.clone()
        opt.step()
        outer.step([ours], [gr], [buf])
        assert torch.allclose(ours, ref.detach(), atol=1e-6)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_outer_stepped_equals_step_on_scaled_grads_and_leaves_inputs(momentum, scale):
    g = torch.Generator().manual_seed(1)
    outer = OuterNesterov(lr=0.7, momentum=momentum)
    params = [torch.randn(7, generator=g), torch.randn(3, 2, generator=g)]
    bufs = [torch.randn(7, generator=g), torch.randn(3, 2, generator=g)]
    grads = [torch.randn(7, generator=g), torch.randn(3, 2, generator=g)]
    p_in, b_in = [t.clone() for t in params], [t.clone() for t in bufs]
    ref_p, ref_b = [t.clone() for t in params], [t.clone() for t in bufs]
    outer.step(ref_p, [scale * t for t in grads], ref_b)
    new_p, new_b = outer.stepped(params, [t.clone() for t in grads], bufs, scale)
    for a, b, x, y in zip(new_p, ref_p, new_b, ref_b):
        if scale == 1.0:  # the same operations: bit for bit
            assert torch.equal(a, b) and torch.equal(x, y)
        else:
            assert torch.allclose(a, b, atol=1e-6) and torch.allclose(x, y, atol=1e-6)
    for a, b in zip(params + bufs, p_in + b_in):  # inputs untouched
        assert torch.equal(a, b)


def test_all_finite():
    x = torch.randn(1000)
    assert all_finite(x) and all_finite(torch.zeros(0)) and all_finite(torch.arange(3))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[517] = bad
        assert not all_finite(y) and not all_finite_list([x, y])
    huge = torch.full((10,), 3e38)  # the sum overflows, every value is finite
    assert all_finite(huge) and all_finite_list([x, huge])
    assert all_finite_list([x, x.to(torch.bfloat16)]) and all_finite_list([])


def test_alpha_mix():
    loc, glob = torch.tensor([1.0]), torch.tensor([3.0])
    alpha_mix(loc, glob, 0.25)
    assert loc.item() == pytest.approx(0.25 * 1 + 0.75 * 3)
    alpha_mix(loc, glob, 0.0)
    assert loc.item() == 3.0
    with pytest.raises(ValueError):
        alpha_mix(loc, glob, 1.0)


def test_grace_window_bounds():
    assert grace_window_s(2, 1.0, 0.2, 0.3, 0.5) == pytest.approx(0.5 * (2 - 0.5))
    assert grace_window_s(2, 1.0, 1.5, 1.0, 0.5) == 0.0  # never negative
    # with tau = 2 and gamma < 1 the window is below tau steps, and at most ~1 step for gamma=0.5
    for q in [0.0, 0.1, 0.5]:
        assert grace_window_s(2, 1.0, q, 0.0, 0.5) <= 1.0
    with pytest.raises(ValueError):
        PolicyConfig(gamma=1.0)
    with pytest.raises(ValueError):
        PolicyConfig(quorum=0)


def test_ema():
    e = Ema(alpha=0.5)
    assert e.get(7.0) == 7.0
    e.update(2.0)
    e.update(4.0)
    assert e.get() == 3.0
    e.update(float("nan"))
    assert e.get() == 3.0


def test_quorum_and_grace_decisions():
    pol = QuorumGracePolicy(PolicyConfig(quorum=2, gamma=0.5, tau=2))
    pol.xi_step.update(1.0)
    assert isinstance(pol.decide(now_s=0, n_arrived=1, n_live=4, quorum_at_s=None), WaitForMore)
    d = pol.decide(now_s=5.0, n_arrived=2, n_live=4, quorum_at_s=None)
    assert isinstance(d, WaitUntil) and d.at_s == pytest.approx(6.0)
    assert pol.decide(now_s=6.0, n_arrived=2, n_live=4, quorum_at_s=5.0) == MergeNow(
        "grace-expired"
    )
    assert pol.decide(now_s=5.5, n_arrived=4, n_live=4, quorum_at_s=5.0) == MergeNow("all-live")
    # K is capped by live learners: K = M never blocks on a dead learner
    assert pol.decide(now_s=0, n_arrived=1, n_live=1, quorum_at_s=None) == MergeNow("all-live")
    nograce = QuorumGracePolicy(PolicyConfig(quorum=1, grace=False))
    assert nograce.decide(now_s=0, n_arrived=1, n_live=4, quorum_at_s=None) == MergeNow("no-grace")


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 4097])
def test_codec_roundtrip_bounds_and_bytes(name, numel):
    c = get_codec(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 0.1
    buf = c.encode(x)
    assert len(buf) == c.nbytes(numel)
    y = c.decode(buf, numel)
    assert y.shape == (numel,) and y.dtype == torch.float32
    err = (x - y).abs()
    if name == "fp32":
        assert torch.equal(x, y)
    elif name == "bf16":
        assert bool((err <= x.abs() * 2**-8 + 1e-30).all())
    elif name == "fp8":  # e4m3 of x / (absmax / 448): 2^-4 relative, 2^-10 of the scale
        blocks = torch.nn.functional.pad(x, (0, (-numel) % 64)).view(-1, 64).abs().amax(1)
        scale = (blocks / 448).repeat_interleave(64)[:numel]
        assert bool((err <= (x.abs() * 2**-4 + scale * 2**-10) * (1 + 1e-5)).all())
    elif name != "1bit":
        blocks = torch.nn.functional.pad(x, (0, (-numel) % 64)).view(-1, 64).abs().amax(1)
        bound = (blocks / ((1 << c.bits) - 1)).repeat_interleave(64)[:numel]
        assert bool((err <= bound * (1 + 1e-5) + 1e-9).all())
    else:
        assert torch.equal(torch.sign(y), torch.where(x >= 0, 1.0, -1.0))


def test_codec_byte_counts_and_errors():
    assert get_codec("int4").nbytes(128) == 2 * 4 + 64
    assert get_codec("bf16").nbytes(10) == 20
    assert get_codec("1bit").nbytes(64) == 4 + 8
    with pytest.raises(ValueError, match="must be"):
        get_codec("int8").decode(b"\x00" * 3, 10)
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("int3")
    x = torch.zeros(100)
    assert torch.equal(get_codec("int4").roundtrip(x), x)


def test_codec_quality_ordering():
    x = torch.randn(10000, generator=torch.Generator().manual_seed(1))
    errs = {n: float((CODECS[n].roundtrip(x) - x).norm() / x.norm()) for n in CODECS}
    assert errs["fp32"] == 0 < errs["bf16"] < errs["int8"] < errs["int4"] < errs["int2"]
    assert errs["int4"] < 0.15 and errs["int2"] > 0.3
    assert errs["int8"] < errs["fp8"] < 0.03 < errs["int4"]  # 3 mantissa bits: ~2.5%


def test_a_quantised_codec_with_another_block_size():
    from ddiloco.algorithm.codecs import get_codec

    c = get_codec("int2/4096")
    assert c.bits == 2 and c.block == 4096 and c.name == "int2/4096"
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    buf = c.encode(x)
    assert len(buf) == c.nbytes(x.numel()) == 3 * 4 + 2500
    y = c.decode(buf, x.numel())
    # error bound per element: absmax of its block / (2^b - 1)
    assert float((y - x).abs().max()) <= float(x.abs().max()) / 3 + 1e-6
    # coarser blocks than the default lose more
    fine = get_codec("int2").roundtrip(x)
    assert float((fine - x).norm()) < float((y - x).norm())
    for bad in ("int2/100", "int2/4", "bf16/64", "int9", "int2/x", "fp8/100"):
        with pytest.raises(ValueError):
            get_codec(bad)
    f = get_codec("fp8/4096")
    assert f.block == 4096 and f.name == "fp8/4096" and f.delta
    assert f.nbytes(x.numel()) == len(f.encode(x)) == 3 * 4 + 10_000
    assert float((f.roundtrip(x) - x).abs().max()) <= float(x.abs().max()) * 2**-4


def test_fp8_is_e4m3_with_a_scale_per_block():
    c = get_codec("fp8")
    assert c.delta and not c.lossless and c.downlink and c.block == 64
    assert c.nbytes(64) == 4 + 64 and c.nbytes(65) == 8 + 65
    # absmax 1.75 = 448 x 2^-8: the scale 2^-8 is exact, the codes are x * 2^8 in e4m3
    # (nearest, ties to even at 3 mantissa bits; below 2^-9 of the scale: zero)
    x = torch.tensor([1.75, 1 + 1 / 16, 1 + 3 / 16, -(1 + 1 / 32), 2.0**-20, 0.0, 0.3, -0.3])
    x = x.repeat(8)  # one whole block of 64
    buf = c.encode(x)
    assert torch.frombuffer(bytearray(buf[:4]), dtype=torch.float32).item() == 1.75 / 448
    codes = torch.frombuffer(bytearray(buf[4:]), dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert codes[:8].float().tolist() == [448.0, 256.0, 320.0, -256.0, 0.0, 0.0, 80.0, -80.0]
    y = c.decode(buf, x.numel())
    assert y[:8].tolist() == [1.75, 1.0, 1.25, -1.0, 0.0, 0.0, 0.3125, -0.3125]
    # a non-finite value spoils its whole block (the syncer refuses the push)
    for bad in (float("nan"), float("inf")):
        z = torch.ones(128)
        z[5] = bad
        r = c.roundtrip(z)
        assert not bool(r[:64].isfinite().any()) and torch.equal(r[64:], z[64:])


@pytest.mark.parametrize("name", list(CODECS))
def test_every_codec_says_whether_pushes_are_deltas_and_the_history_follows(name):
    """``Codec.delta`` is the one decision the learner, the in-process engine and the
    syncer's history read: parameters for fp32 and bf16, deltas for the coarser codecs."""
    from ddiloco.config.sections import SyncConfig

    c = get_codec(name)
    assert c.delta == (name not in ("fp32", "bf16"))
    assert c.lossless == (name == "fp32")
    assert c.downlink == (name != "1bit")
    sync = SyncConfig(codec=name, max_staleness=7)
    assert sync.resolved_history() == (7 if c.delta else 0)
    assert SyncConfig(codec=name, max_staleness=7, anchor="base").resolved_history() == 7
    assert SyncConfig(codec=name, history=3).resolved_history() == 3


def test_default_grace_window_covers_one_step_of_arrival_spread():
    """With the time-driven schedule learners push fragment p at their first step end after
    its slot, up to one step apart; at the default tau the default window must cover that
    step (plus a merge-and-return time of a sixth of a step), and must stay inside the
    overlap that hides it."""
    cfg = PolicyConfig()
    step, sync = 0.030, 0.005
    grace = grace_window_s(cfg.tau, step, 0.0, sync, cfg.gamma)
    assert step < grace < cfg.tau * step - sync


def test_merge_rules_are_a_registry_of_functions():
    from ddiloco.algorithm.merge import MERGE_RULES, merge_rule

    assert MERGE_RULES == ("rda", "average")
    with pytest.raises(ValueError, match="already registered"):
        merge_rule("rda")(lambda vs, weights, embedding: vs[0])
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 1.0])
    with pytest.raises(ValueError, match=r"unknown merge rule 'median'; choose one of \('rda'"):
        merge_outer_gradients([[a], [b]], [1.0, 1.0], [False], rule="median")
    # the embedding flag reaches the rule: rda averages embeddings plainly
    rda_t, emb = merge_outer_gradients([[a, a], [b, b]], [1.0, 1.0], [False, True], rule="rda")
    assert torch.allclose(rda_t, rda([a, b], [1.0, 1.0])) and torch.equal(emb, (a + b) / 2)
    (avg,) = merge_outer_gradients([[a], [b]], [1.0, 1.0], [False], rule="average")
    assert torch.equal(avg, (a + b) / 2)


def test_bits_per_element_count_the_block_scales():
    bits = {n: c.bits_per_element for n, c in CODECS.items()}
    assert bits == {
        "fp32": 32.0,
        "bf16": 16.0,
        "fp8": 8.5,
        "int8": 8.5,
        "int4": 4.5,
        "int2": 2.5,
        "1bit": 1.5,
    }
    assert get_codec("int2/4096").bits_per_element == 2 + 32 / 4096
