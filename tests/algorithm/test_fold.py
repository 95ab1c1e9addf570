"""A round's pushes folded into one fp32 buffer per tensor as they arrive (``SyncerState._fold``):
the same merge as the pushes held until it, at most about one fragment held per round, and a
push whose learner's earlier push is folded carried to the next round."""

import pytest
import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.fragments import fragment_parameters
from ddiloco.algorithm.payload import EncodedParams
from ddiloco.algorithm.policy import PolicyConfig
from ddiloco.algorithm.syncer_state import Contribution, Status, SyncerConfig, SyncerState

SPECS = [("emb", 64 * 8, 4), ("w1", 32 * 32, 4), ("w2", 32 * 16, 4), ("b", 32, 4)]
SHAPES = {"emb": (64, 8), "w1": (32, 32), "w2": (32, 16), "b": (32,)}


def _state_init() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _state(M: int, quorum: int, *, rule: str = "rda", clip: float = 2.5) -> SyncerState:
    fr = fragment_parameters(SPECS, 1, "balanced", {"emb"})
    init = _state_init()
    cfg = SyncerConfig(
        policy=PolicyConfig(quorum=quorum, grace=False),
        merge_rule=rule,
        outer_lr=0.7,
        outer_momentum=0.9,
        norm_clip=clip,
    )
    st = SyncerState(fr, init, cfg)
    for m in range(M):
        st.join(m)
    return st


def _push(st: SyncerState, m: int, seed: int, *, scale: float = 0.01, seq: int = 0, steps=10):
    """Learner m's bf16 push of fragment 0: the initial fragment moved by a random step (the
    same bytes whatever the state's global fragment is, so two states get equal pushes)."""
    g = torch.Generator().manual_seed(seed)
    init = _state_init()
    params = [
        init[n] - scale * torch.randn(SHAPES[n], generator=g)
        for n in st.fragmentation.fragments[0].names
    ]
    bf16 = get_codec("bf16")
    data = b"".join(bf16.encode(x) for x in params)
    return Contribution(
        learner=m,
        fragment=0,
        params=EncodedParams(bf16, bytearray(data), [x.shape for x in params]),
        c_steps=steps,
        c_tokens=100 * steps + 7 * m,
        base_version=st.version(0),
        seq=seq,
    )


def _rounds(st: SyncerState, M: int, rounds: int, wild: int | None = None) -> list:
    merged = []
    for r in range(rounds):
        for m in range(M):
            scale = 0.5 if (wild == m and r == rounds - 1) else 0.01
            res = st.submit(_push(st, m, 100 * r + m, scale=scale, seq=r), float(r))
            assert res.status is Status.ACCEPTED
            if res.merged is not None:
                merged.append(res.merged)
    return merged


@pytest.mark.parametrize("rule", ["rda", "average"])
def test_a_folded_round_merges_as_the_held_pushes_do(monkeypatch, rule):
    """Ten rounds of six bf16 pushes, the last with one wild learner the merge guard clips:
    folded as they arrive, and held whole until the merge (folding switched off)."""
    folded = _state(6, 6, rule=rule)
    got = _rounds(folded, 6, 10, wild=2)
    assert folded.clipped_pushes == 1 and got[-1].clipped == (2,)
    monkeypatch.setattr(SyncerState, "_fold", lambda self, p, now_s: None)
    held = _state(6, 6, rule=rule)
    want = _rounds(held, 6, 10, wild=2)
    assert [m.learners for m in got] == [m.learners for m in want]
    assert [m.weights for m in got] == [m.weights for m in want]
    for a, b in zip(
        folded.frags[0].theta + folded.frags[0].momentum,
        held.frags[0].theta + held.frags[0].momentum,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # fp32 rounding
    assert list(folded.frags[0].norms) == pytest.approx(list(held.frags[0].norms), rel=1e-5)


def test_a_round_holds_about_one_fragment_whatever_the_number_of_learners():
    st = _state(8, 8)
    frag_f32 = 4 * sum(t.numel() for t in st.frags[0].theta)
    sizes, pushed = [], 0
    for m in range(7):  # the eighth would merge
        c = _push(st, m, m)
        pushed += c.params.nbytes
        st.submit(c, 0.0)
        sizes.append(st.pending_bytes())
    assert pushed == pytest.approx(3.5 * frag_f32, rel=0.01)  # seven bf16 pushes
    assert sizes[:2] == [frag_f32 // 2, frag_f32]  # one and two pushes: held as they came
    assert max(sizes) == frag_f32  # folded from the third on: one fp32 buffer per tensor
    assert st.submit(_push(st, 7, 7), 0.0).merged is not None
    assert st.pending_bytes() == 0


def test_a_push_after_a_folded_one_of_its_learner_goes_to_the_next_round():
    st = _state(4, 4, clip=0)
    tokens = st.books.tokens(_push(st, 0, 0))
    r0 = st.submit(_push(st, 0, 0, seq=0), 0.0)
    st.submit(_push(st, 1, 1, seq=0), 0.0)
    r1 = st.submit(_push(st, 0, 2, seq=1), 0.0)  # two pushes held: this one supersedes
    assert (r0.target_version, r1.target_version) == (1, 1)
    assert st.frags[0].round.folded == {} and st.ledger[0].tokens_pending == pytest.approx(tokens)
    st.submit(_push(st, 2, 3, seq=0), 0.0)  # three held (1.5 fragments): folded
    assert set(st.frags[0].round.folded) == {0, 1, 2}
    r2 = st.submit(_push(st, 0, 4, seq=2), 0.0)  # its seq 1 is folded: this one is carried
    assert r2.status is Status.ACCEPTED and r2.target_version == 2
    assert list(st.frags[0].carry) == [0]
    assert st.ledger[0].tokens_pending == pytest.approx(2 * tokens)
    mg = st.submit(_push(st, 3, 5, seq=0), 0.0).merged
    assert mg.learners == (0, 1, 2, 3) and mg.seqs == (1, 0, 0, 0) and mg.version == 1
    assert list(st.frags[0].round.pending) == [0] and st.frags[0].carry == {}
    assert st.ledger[0].tokens_pending == pytest.approx(tokens)
    (last,) = st.flush(1.0)
    assert last.learners == (0,) and last.seqs == (2,) and last.version == 2
    assert all(st.ledger[m].tokens_pending == pytest.approx(0) for m in range(4))
    assert st.ledger[0].pushes_merged == 2


def test_a_fold_outside_the_lock_lets_pushes_in_and_merges_when_it_ends():
    """The runtime releases its lock for a fold's arithmetic: a newer push of the learner
    being folded goes to the next round, another learner's push is staged and folded by the
    same loop, and the merge its quorum decides waits for the fold (a follow-up)."""
    import contextlib

    st = _state(4, 4, clip=0)
    during = []

    @contextlib.contextmanager
    def interleave():
        if not during:  # the first fold's arithmetic (learner 0's push): others arrive
            during.append(st.submit(_push(st, 0, 10, seq=1), 0.1))
            during.append(st.submit(_push(st, 3, 13, seq=0), 0.1))
            assert st.frags[0].round.folding and st.frags[0].round.wanted == "all-live"
        yield

    st.unlocked = interleave
    st.submit(_push(st, 0, 0, seq=0), 0.0)
    st.submit(_push(st, 1, 1, seq=0), 0.0)
    third = st.submit(_push(st, 2, 2, seq=0), 0.0)  # three bf16 pushes: the round folds
    carried, staged = during
    assert carried.status is Status.ACCEPTED and carried.target_version == 2
    assert staged.status is Status.ACCEPTED and staged.merged is None
    assert third.merged is None
    ((p, mg),) = st.take_followups()
    assert p == 0 and mg.version == 1 and mg.learners == (0, 1, 2, 3) and mg.seqs == (0,) * 4
    assert list(st.frags[0].round.pending) == [0] and st.pending_bytes() == 0 + (
        st.frags[0].round.pending[0].params.nbytes
    )
    (last,) = st.flush(1.0)
    assert last.learners == (0,) and last.seqs == (1,)


@pytest.mark.parametrize("radial", [True, False])
@pytest.mark.parametrize("factor", [1.0, 0.4, 0.0])
def test_a_push_added_a_piece_at_a_time_equals_it_added_whole(radial, factor):
    from ddiloco.algorithm.merge import Fold

    g = torch.Generator().manual_seed(1)
    anchor = torch.randn(10, 13, generator=g)
    xs = [anchor - 0.1 * torch.randn(10, 13, generator=g) for _ in range(3)]
    whole, pieces = Fold((10, 13), radial), Fold((10, 13), radial)
    for i, x in enumerate(xs):
        w = 1.0 + i
        f = factor if i == 1 else 1.0  # the merge guard clips the second push
        whole.add(f * (anchor - x), w)
        flat = x.reshape(-1)
        parts = [(o, flat[o : o + 7]) for o in range(0, flat.numel(), 7)]  # 19 pieces
        pieces.add_pieces(anchor, parts, w, float(torch.linalg.vector_norm(anchor - x)), f)
    assert pieces.weight == whole.weight and pieces.radius == pytest.approx(whole.radius)
    torch.testing.assert_close(pieces.take(), whole.take(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int4"])
def test_an_encoded_push_reads_a_piece_at_a_time_where_its_codec_allows(codec):
    cd = get_codec(codec)
    ts = [torch.randn(50), torch.randn(6, 5)]
    params = EncodedParams(cd, bytearray(b"".join(cd.encode(t) for t in ts)), [(50,), (6, 5)])
    got = list(params.chunks(0, size=16))
    if cd.element_bytes is None:  # block scales: the whole tensor, once
        assert [o for o, _ in got] == [0]
    else:
        assert [o for o, _ in got] == [0, 16, 32, 48] and got[-1][1].numel() == 2
    torch.testing.assert_close(torch.cat([x for _, x in got]), params[0].reshape(-1))
    want = [0] if cd.element_bytes is None else [0, 16]
    assert [o for o, _ in params.chunks(1, size=16)] == want
