import pytest

from ddiloco.algorithm.fragments import STRATEGIES, fragment_parameters, layer_key
from ddiloco.algorithm.schedule import FragmentSchedule


def gpt_like(n_layer=4, d=64, V=64, T=64):
    ps = [("tok_emb.weight", V * d, 4), ("pos_emb.weight", T * d, 4)]
    for i in range(n_layer):
        b = f"blocks.{i}"
        ps += [
            (f"{b}.ln1.weight", d, 4),
            (f"{b}.ln1.bias", d, 4),
            (f"{b}.attn.qkv.weight", 3 * d * d, 4),
            (f"{b}.attn.qkv.bias", 3 * d, 4),
            (f"{b}.attn.proj.weight", d * d, 4),
            (f"{b}.attn.proj.bias", d, 4),
            (f"{b}.ln2.weight", d, 4),
            (f"{b}.ln2.bias", d, 4),
            (f"{b}.mlp.fc.weight", 4 * d * d, 4),
            (f"{b}.mlp.fc.bias", 4 * d, 4),
            (f"{b}.mlp.proj.weight", 4 * d * d, 4),
            (f"{b}.mlp.proj.bias", d, 4),
        ]
    ps += [("ln_f.weight", d, 4), ("ln_f.bias", d, 4), ("lm_head.weight", V * d, 4)]
    return ps


EMB = {"tok_emb.weight", "pos_emb.weight", "lm_head.weight"}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_parameter_in_exactly_one_fragment(strategy):
    ps = gpt_like()
    fr = fragment_parameters(ps, 4, strategy, EMB)
    names = [n for f in fr.fragments for n in f.names]
    assert sorted(names) == sorted(n for n, _, _ in ps)
    assert len(names) == len(set(names))
    assert fr.total_bytes == sum(a * b for _, a, b in ps)
    for f in fr.fragments:
        assert f.names, "no empty fragments"
        assert [n in EMB for n in f.names] == list(f.embedding)


def test_per_tensor_has_one_fragment_per_tensor():
    ps = gpt_like()
    assert fragment_parameters(ps, 1, "per-tensor").P == len(ps)


def test_balanced_within_four_thirds_of_ideal_on_gpt():
    # 12-layer GPT-2-small shape, P = 24 as in the paper
    ps = gpt_like(n_layer=12, d=768, V=50304, T=1024)
    fr = fragment_parameters(ps, 24, "balanced", EMB)
    # balanced greedy LPT: largest fragment <= 4/3 ideal unless one tensor alone exceeds it
    biggest = max(a * b for _, a, b in ps)
    assert fr.max_bytes <= max(4 / 3 * fr.total_bytes / 24, biggest)
    fr_small = fragment_parameters(gpt_like(n_layer=12, d=768, V=768, T=768), 24, "balanced", EMB)
    assert fr_small.imbalance() <= 4 / 3


def test_layer_strategies_layout():
    ps = gpt_like(n_layer=4)
    seq = fragment_parameters(ps, 2, "per-layer")
    strided = fragment_parameters(ps, 2, "strided")
    # layers: tok_emb, pos_emb, blocks.0..3, ln_f, lm_head = 8 layers
    assert {layer_key(n) for n in seq.fragments[0].names} == {
        "tok_emb",
        "pos_emb",
        "blocks.0",
        "blocks.1",
    }
    assert {layer_key(n) for n in strided.fragments[0].names} == {
        "tok_emb",
        "blocks.0",
        "blocks.2",
        "ln_f",
    }


def test_fragmentation_errors():
    with pytest.raises(ValueError, match="unknown fragmentation"):
        fragment_parameters(gpt_like(), 2, "nope")
    with pytest.raises(ValueError, match="P <= "):
        fragment_parameters([("a", 1, 4), ("b", 1, 4)], 3)
    with pytest.raises(ValueError, match="no parameters"):
        fragment_parameters([], 1)
    with pytest.raises(ValueError, match=">= 1"):
        fragment_parameters(gpt_like(), 0)


def test_schedule_one_fragment_per_step_when_P_equals_H():
    s = FragmentSchedule(P=24, H=24, tau=2)
    seen = [s.fragments_to_send(t) for t in range(1, 49)]
    assert all(len(x) == 1 for x in seen)
    assert sorted(x[0] for x in seen[:24]) == list(range(24))
    for p in range(24):
        steps = s.send_steps(p, 100)
        assert all(b - a == 24 for a, b in zip(steps, steps[1:]))
        assert all(p in s.fragments_to_send(t) for t in steps)
    assert s.install_step(10) == 12


def test_schedule_P1_is_diloco_and_staggering():
    s = FragmentSchedule(P=1, H=5, tau=0)
    assert [t for t in range(1, 21) if s.fragments_to_send(t)] == [5, 10, 15, 20]
    s = FragmentSchedule(P=3, H=12, tau=1)
    assert [s.offset(p) for p in range(3)] == [4, 8, 0]
    assert s.send_steps(2, 30) == [12, 24]
    sends = sorted(t for p in range(3) for t in s.send_steps(p, 36))
    assert sends == [4, 8, 12, 16, 20, 24, 28, 32, 36]


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(P=0, H=4), "P"),
        (dict(P=5, H=4), "P <= H"),
        (dict(P=2, H=4, tau=4), "tau"),
        (dict(P=1, H=0), "H"),
        (dict(P=1, H=4, tau=-1), "tau"),
    ],
)
def test_schedule_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        FragmentSchedule(**kw)


def test_time_driven_schedule_sends_each_fragment_once_per_period():
    s = FragmentSchedule(P=3, H=6, tau=1)  # offsets 2, 4, 0 -> slots at 2, 4, 6 (+ 6k)
    assert s.fragments_due(0.0, 1.9) == ()
    assert s.fragments_due(1.9, 2.0) == (0,)
    assert s.fragments_due(2.0, 6.5) == (1, 2)
    assert s.fragments_due(0.0, 100.0) == (0, 1, 2)  # missed slots are sent once
    # a learner 18% slower crosses the same slots at about the same elapsed time
    fast = [p for k in range(1, 13) for p in s.fragments_due((k - 1) * 1.0, k * 1.0)]
    slow = [p for k in range(1, 11) for p in s.fragments_due((k - 1) * 1.18, k * 1.18)]
    assert fast[:4] == slow[:4] == [0, 1, 2, 0]
