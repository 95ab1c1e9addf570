"""Synthetic Markov language: exact entropy figures, sampling, streams, learnability."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddiloco.data.stream import BatchStream
from ddiloco.data.synthetic import MarkovConfig, MarkovLanguage, SyntheticStream, eval_batches


@pytest.fixture(scope="module")
def lang() -> MarkovLanguage:
    return MarkovLanguage(MarkovConfig())


def test_structure_and_stationary_distribution(lang: MarkovLanguage) -> None:
    C, S = 64**2, 4
    assert lang.next_tokens.shape == (C, S) and lang.next_probs.shape == (C, S)
    # Supports are distinct tokens and always contain the successor of the last token.
    assert all(len(set(row)) == S for row in lang.next_tokens[:50])
    np.testing.assert_array_equal(lang.next_tokens[:, 0], (np.arange(C) % 64 + 1) % 64)
    np.testing.assert_allclose(lang.next_probs.sum(axis=1), 1.0)
    pi = lang.stationary
    assert pi.min() >= 0 and abs(pi.sum() - 1) < 1e-12
    np.testing.assert_allclose(lang.step_distribution(pi), pi, atol=1e-12)


def test_language_is_deterministic_given_its_seed() -> None:
    a, b = MarkovLanguage(MarkovConfig(seed=3)), MarkovLanguage(MarkovConfig(seed=3))
    np.testing.assert_array_equal(a.next_tokens, b.next_tokens)
    assert a.entropy_rate == b.entropy_rate
    assert MarkovLanguage(MarkovConfig(seed=4)).entropy_rate != a.entropy_rate


def test_entropy_rate_matches_monte_carlo(lang: MarkovLanguage) -> None:
    seqs = lang.sample(2000, 64, np.random.default_rng(0))
    nll = -lang.log_prob(seqs)
    k = lang.cfg.order
    mc_rate = nll[:, k - 1 :].mean()  # targets with full context
    assert abs(mc_rate - lang.entropy_rate) / lang.entropy_rate < 0.01
    mc_floor = nll.mean()
    assert abs(mc_floor - lang.sequence_floor(64)) / lang.sequence_floor(64) < 0.01


def test_sequence_floor_is_above_rate_and_converges(lang: MarkovLanguage) -> None:
    H = lang.entropy_rate
    floors = [lang.sequence_floor(T) for T in (1, 2, 8, 64, 4096)]
    assert all(f > H for f in floors)
    assert all(a > b for a, b in zip(floors, floors[1:]))
    assert floors[-1] - H < 1e-3
    # T = 1: the only target is s_1 given s_0.
    assert floors[0] == pytest.approx(lang.prefix_conditional_entropies()[1])
    order1 = MarkovLanguage(MarkovConfig(order=1))
    assert order1.sequence_floor(5) == pytest.approx(order1.entropy_rate)
    with pytest.raises(ValueError):
        lang.sequence_floor(0)


def test_entropy_rate_of_uniform_support() -> None:
    # Large concentration: next-token law close to uniform over S tokens, H -> ln S.
    lang = MarkovLanguage(MarkovConfig(vocab_size=16, support=4, concentration=1e4))
    assert lang.entropy_rate == pytest.approx(np.log(4), abs=1e-3)
    assert MarkovLanguage(MarkovConfig(vocab_size=8, support=1)).entropy_rate == pytest.approx(
        0.0, abs=1e-6
    )


def test_sample_shape_dtype_and_determinism(lang: MarkovLanguage) -> None:
    a = lang.sample(5, 10, np.random.default_rng(1))
    b = lang.sample(5, 10, np.random.default_rng(1))
    assert a.shape == (5, 11) and a.dtype == np.int64
    np.testing.assert_array_equal(a, b)
    assert a.min() >= 0 and a.max() < 64
    assert lang.sample(3, 0, np.random.default_rng(0)).shape == (3, 1)
    assert np.isfinite(lang.log_prob(a)).all()  # every transition is in the support


def test_stream_batches_are_shifted_deterministic_and_learner_specific(
    lang: MarkovLanguage,
) -> None:
    def stream(m: int, seed: int = 0) -> SyntheticStream:
        return SyntheticStream(
            lang, learner=m, n_learners=4, batch_size=3, block_size=8, seed=seed, chunk_batches=2
        )

    s = stream(0)
    assert isinstance(s, BatchStream)
    x, y = s.next_batch()
    assert x.shape == y.shape == (3, 8) and x.dtype == torch.long
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    a = [stream(0).next_batch()[0] for _ in range(2)]
    torch.testing.assert_close(a[0], a[1])
    assert not torch.equal(stream(0).next_batch()[0], stream(1).next_batch()[0])
    assert not torch.equal(stream(0).next_batch()[0], stream(0, seed=1).next_batch()[0])
    # Batches of one learner differ from each other across chunk boundaries too.
    batches = [s.next_batch()[0] for _ in range(4)]
    assert len({tuple(b.flatten().tolist()) for b in batches}) == 4


def test_stream_resumes_exactly(lang: MarkovLanguage) -> None:
    kw = dict(learner=1, n_learners=2, batch_size=4, block_size=16, chunk_batches=3)
    ref = SyntheticStream(lang, **kw)
    expected = [ref.next_batch() for _ in range(8)]
    first = SyntheticStream(lang, **kw)
    for _ in range(5):
        first.next_batch()
    state = first.state_dict()
    assert state["position"] == 5 == first.position
    resumed = SyntheticStream(lang, **kw)
    resumed.load_state_dict(state)
    for x, y in expected[5:]:
        rx, ry = resumed.next_batch()
        torch.testing.assert_close(rx, x)
        torch.testing.assert_close(ry, y)
    other = SyntheticStream(lang, **{**kw, "learner": 0})
    with pytest.raises(ValueError, match="learner"):
        other.load_state_dict(state)


def test_eval_set_is_fixed_and_differs_from_training(lang: MarkovLanguage) -> None:
    ev = eval_batches(lang, n_batches=3, batch_size=4, block_size=8, seed=0)
    assert len(ev) == 3 and ev[0][0].shape == (4, 8)
    again = eval_batches(lang, n_batches=3, batch_size=4, block_size=8, seed=0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ev, again))
    train = SyntheticStream(lang, learner=0, n_learners=1, batch_size=4, block_size=8)
    assert not torch.equal(train.next_batch()[0], ev[0][0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vocab_size": 1}, "vocab_size"),
        ({"order": 0}, "order"),
        ({"support": 0}, "support"),
        ({"vocab_size": 4, "support": 5}, "support"),
        ({"concentration": 0.0}, "concentration"),
        ({"vocab_size": 256, "order": 3}, "lower vocab_size or order"),
        ({"seed": -1}, "seed"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MarkovConfig(**kwargs)


def test_stream_validation(lang: MarkovLanguage) -> None:
    with pytest.raises(ValueError, match="learner"):
        SyntheticStream(lang, learner=2, n_learners=2, batch_size=1, block_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        SyntheticStream(lang, learner=0, n_learners=1, batch_size=0, block_size=1)
    with pytest.raises(ValueError, match="n_batches"):
        eval_batches(lang, n_batches=0, batch_size=1, block_size=1, seed=0)


def test_tiny_gpt_approaches_the_floor() -> None:
    from ddiloco.models import GPT, GPTConfig

    lang = MarkovLanguage(MarkovConfig(vocab_size=8, order=2))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8, block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    stream = SyntheticStream(lang, learner=0, n_learners=1, batch_size=16, block_size=32)
    for _ in range(300):
        x, y = stream.next_batch()
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        ev = eval_batches(lang, n_batches=4, batch_size=64, block_size=32, seed=0)
        eval_loss = float(np.mean([model(x, y)[1].item() for x, y in ev]))
    floor = lang.sequence_floor(32)
    assert eval_loss > floor - 0.02  # nobody beats the floor (up to sampling noise)
    assert (eval_loss - floor) / floor < 0.25
