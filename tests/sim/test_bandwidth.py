import math

import pytest

from ddiloco.bandwidth import (
    METHODS,
    BandwidthConfig,
    min_bandwidth,
    period,
    step_time_from_flops,
    time_to_train,
    utilisation,
    with_method,
)


@pytest.mark.parametrize("method", METHODS)
def test_min_bandwidth_is_the_inverse_of_utilisation(method):
    cfg = BandwidthConfig(method=method, params=5e9, step_time_s=2.0, datacenters=8, latency_s=0.05)
    for target in (0.5, 0.9, 0.95):
        bw = min_bandwidth(cfg, target)
        assert utilisation(cfg, bw) == pytest.approx(target, rel=1e-9)
        assert utilisation(cfg, bw * 0.99) < target


def test_dp_needs_100_200_300_gbps_at_95pct_for_1b_10b_100b():
    # the eager-updates setting: 2 datacenters, bf16 gradients, step times 3.04 / 15.2 / 101 s
    for params, step_s, expected in ((1e9, 3.04, 100), (10e9, 15.2, 200), (100e9, 101.0, 300)):
        cfg = BandwidthConfig(method="dp", params=params, step_time_s=step_s, datacenters=2)
        assert min_bandwidth(cfg, 0.95) / 1e9 == pytest.approx(expected, rel=0.01)
        dec = min_bandwidth(with_method(cfg, "decoupled"), 0.95) / 1e9
        assert dec < 5


def test_198_vs_084_gbps_for_8_datacenters():
    cfg = BandwidthConfig(method="dp", params=5e9, step_time_s=6.36, datacenters=8)
    dp = min_bandwidth(cfg, 0.90) / 1e9
    dec = min_bandwidth(with_method(cfg, "decoupled"), 0.90) / 1e9
    assert dp == pytest.approx(198, rel=0.01)
    assert dec == pytest.approx(0.84, rel=0.03)


def test_12b_over_4_regions_at_2_to_5_gbps_is_over_20x_faster_than_dp():
    cfg = BandwidthConfig(method="dp", params=12e9, step_time_s=2.0, datacenters=4)
    for gbps in (2, 5):
        t_dp = time_to_train(cfg, gbps * 1e9, 1e12, 4e6)
        t_dec = time_to_train(with_method(cfg, "decoupled"), gbps * 1e9, 1e12, 4e6)
        assert t_dp / t_dec > 20


def test_overlap_and_compression_lower_the_requirement():
    base = BandwidthConfig(method="decoupled", params=5e9, step_time_s=1.0)
    assert min_bandwidth(
        BandwidthConfig(method="decoupled", up_bits=4, params=5e9), 0.95
    ) < min_bandwidth(base, 0.95)
    no_overlap = BandwidthConfig(method="streaming", tau=0, params=5e9)
    overlap = BandwidthConfig(method="streaming", tau=2, params=5e9)
    assert min_bandwidth(overlap, 0.95) < min_bandwidth(no_overlap, 0.95)
    assert utilisation(base, 1e15) == pytest.approx(1.0)


def test_latency_can_make_a_target_unreachable():
    cfg = BandwidthConfig(method="dp", params=1e9, step_time_s=1.0, latency_s=1.0)
    assert math.isinf(min_bandwidth(cfg, 0.95))


def test_step_time_from_flops():
    assert step_time_from_flops(1e9, 1e6, 100, 1e14, 0.5) == pytest.approx(6e15 / 5e15)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="x"), "method"),
        (dict(params=0), "params"),
        (dict(datacenters=1), "datacenters"),
        (dict(method="streaming", inner_steps=25), "divisible"),
        (dict(up_bits=0), "up_bits"),
    ],
)
def test_bandwidth_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BandwidthConfig(**kwargs)


def test_decoupled_sends_one_fragment_every_h_over_p_steps():
    # P = H: one fragment per step; P = H/3: one every 3 steps, the same bits per step
    a = BandwidthConfig(method="decoupled", params=1e6, fragments=24, inner_steps=24)
    b = BandwidthConfig(method="decoupled", params=1e6, fragments=8, inner_steps=24)
    (ka, bits_a, _), (kb, bits_b, _) = period(a), period(b)
    assert (ka, kb) == (1.0, 3.0)
    assert bits_a / ka == pytest.approx(bits_b / kb)


def test_hub_syncer_carries_every_byte_and_fractional_codec_bits():
    n, d = 1e6, 4
    sharded = BandwidthConfig(
        method="decoupled",
        params=n,
        datacenters=d,
        up_bits=4.5,
        down_bits=8.5,
        fragments=8,
        inner_steps=24,
    )
    hub = BandwidthConfig(
        method="decoupled",
        params=n,
        datacenters=d,
        up_bits=4.5,
        down_bits=8.5,
        fragments=8,
        inner_steps=24,
        syncer="hub",
    )
    assert period(hub)[1] == pytest.approx(13 * n / 8)
    assert period(sharded)[1] == pytest.approx(period(hub)[1] * (d - 1) / d)
    dl = BandwidthConfig(
        method="diloco",
        params=n,
        datacenters=d,
        up_bits=4.5,
        down_bits=8.5,
        inner_steps=24,
        syncer="hub",
    )
    assert period(dl) == (24.0, pytest.approx(13 * n), 0.0)
    with pytest.raises(ValueError, match="syncer"):
        BandwidthConfig(syncer="edge")


def test_pulls_and_control_traffic_add_to_decoupled_bits():
    base = BandwidthConfig(
        method="decoupled",
        params=1e6,
        fragments=8,
        inner_steps=24,
        up_bits=4.5,
        down_bits=8.5,
        syncer="hub",
        step_time_s=0.2,
    )
    more = BandwidthConfig(
        method="decoupled",
        params=1e6,
        fragments=8,
        inner_steps=24,
        up_bits=4.5,
        down_bits=8.5,
        syncer="hub",
        step_time_s=0.2,
        pulls_per_push=1.5,
        control_bps=1e5,
    )
    k, bits, _ = period(more)
    assert bits - period(base)[1] == pytest.approx(0.5 * 8.5 * 1e6 / 8 + 1e5 * k * 0.2)
    assert utilisation(more, 1e6) < utilisation(base, 1e6)
    with pytest.raises(ValueError, match="pulls_per_push"):
        BandwidthConfig(pulls_per_push=0.5)
    more = BandwidthConfig(
        method="diloco",
        params=1e6,
        syncer="hub",
        up_bits=4.5,
        down_bits=8.5,
        push_overhead_bits=800.0,
    )
    assert period(more)[1] == pytest.approx(13 * 1e6 + 800.0)
