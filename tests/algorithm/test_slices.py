"""Pushes made of slices (``ddiloco.algorithm.slices``): a sharded island's ranks each push
their runs of a fragment's tensors, and the syncer merges the fragment once the runs tile
it, exactly as it merges the same values pushed whole."""

from __future__ import annotations

import pytest
import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.fragments import fragment_parameters
from ddiloco.algorithm.payload import EncodedParams
from ddiloco.algorithm.policy import PolicyConfig
from ddiloco.algorithm.slices import (
    InitUpload,
    Piece,
    PieceError,
    SliceAssembler,
    SlicedParams,
    check_pieces,
)
from ddiloco.algorithm.syncer_state import Contribution, SyncerConfig, SyncerState

SHAPES = [(6, 4), (5,), (3, 2)]
NUMELS = [24, 5, 6]


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}


def _ranks(R: int) -> list[list[Piece]]:  # noqa: N803
    """Each rank's dim-0 shard of every tensor, as FSDP2 cuts them (ceil(rows / R) each;
    the last ranks may get fewer rows, or none)."""
    out: list[list[Piece]] = [[] for _ in range(R)]
    for j, s in enumerate(SHAPES):
        rows, per_row = s[0], (s[1] if len(s) > 1 else 1)
        step = -(-rows // R)
        for r in range(R):
            a, b = min(rows, r * step), min(rows, (r + 1) * step)
            if b > a:
                out[r].append(Piece(j, a * per_row, (b - a) * per_row))
    return out


def _pieces(values: list[torch.Tensor], pieces: list[Piece], codec, delta: bool = False):
    return [
        (
            pc,
            codec,
            memoryview(codec.encode(values[pc.j].reshape(-1)[pc.offset : pc.offset + pc.numel])),
            delta,
        )
        for pc in pieces
    ]


def test_runs_are_checked_against_their_tensors():
    check_pieces([Piece(0, 0, 12), Piece(0, 12, 12), Piece(1, 0, 5)], NUMELS)
    for bad, what in [
        ([Piece(3, 0, 1)], "has 3 tensors"),
        ([Piece(1, 3, 3)], "outside"),
        ([Piece(0, 0, 0)], "outside"),
        ([Piece(0, 0, 13), Piece(0, 12, 12)], "overlap"),
    ]:
        with pytest.raises(PieceError, match=what):
            check_pieces(bad, NUMELS)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_the_pieces_of_every_rank_make_the_push(R):  # noqa: N803
    codec = get_codec("fp32")
    values = list(_model(1).values())
    asm = SliceAssembler()
    ranks = [pieces for pieces in _ranks(R) if pieces]  # at R = 4 the last rank holds none
    for r, pieces in enumerate(ranks):
        got = asm.add(0, 0, 7, SHAPES, (4, 400, 0, False, ()), _pieces(values, pieces, codec))
        assert (got is None) == (r < len(ranks) - 1)
    assert len(asm) == 0 and isinstance(got, SlicedParams) and not got.delta
    for j, v in enumerate(values):
        assert torch.equal(got[j], v)


def test_pushes_of_one_contribution_must_agree_and_a_later_one_replaces_it():
    codec = get_codec("bf16")
    values = list(_model(1).values())
    first, second = _ranks(2)
    asm = SliceAssembler()
    assert asm.add(0, 0, 7, SHAPES, (4, 400, 0, False, ()), _pieces(values, first, codec)) is None
    with pytest.raises(PieceError, match="disagree"):
        asm.add(0, 0, 7, SHAPES, (5, 400, 0, False, ()), _pieces(values, second, codec))
    with pytest.raises(PieceError, match="overlap"):
        asm.add(0, 0, 7, SHAPES, (4, 400, 0, False, ()), _pieces(values, first, codec))
    assert asm.nbytes == sum(codec.nbytes(pc.numel) for pc in first)
    # push 8 supersedes the incomplete push 7 (its pieces are dropped), and 7 is then late
    assert asm.add(0, 0, 8, SHAPES, (8, 800, 0, False, ()), _pieces(values, second, codec)) is None
    assert asm.newer(0, 0, 7) and not asm.newer(0, 0, 8) and not asm.newer(1, 0, 7)
    with pytest.raises(PieceError, match="older"):
        asm.add(0, 0, 7, SHAPES, (4, 400, 0, False, ()), _pieces(values, second, codec))
    asm.forget(0)
    assert len(asm) == 0 and asm.nbytes == 0


def test_a_sliced_push_merges_as_the_whole_push_does():
    """Learner 1 is an island of 3 ranks, learner 0 one process; with the merge guard on
    and the RDA rule, the merged fragment, its momentum and the guard's norms are those of
    the same values pushed whole: the norms are the whole fragment's."""
    frag = fragment_parameters([(n, t.numel(), 4) for n, t in _model().items()], P=1)
    cfg = SyncerConfig(policy=PolicyConfig(quorum=2, grace=False), norm_clip=2.5)
    codec = get_codec("bf16")
    g = torch.Generator().manual_seed(3)
    pushed = {
        m: [t + 0.1 * torch.randn(t.shape, generator=g) for t in _model().values()] for m in (0, 1)
    }
    outs = []
    for sliced in (False, True):
        st = SyncerState(frag, _model(), cfg)
        st.join(0)
        st.join(1)
        for rnd in range(10):  # enough merges for the guard to act
            for m in (0, 1):
                vals = [x + 0.01 * rnd for x in pushed[m]]
                if sliced and m == 1:
                    asm, params = SliceAssembler(), None
                    for pieces in _ranks(3):
                        params = asm.add(
                            1, 0, rnd + 1, SHAPES, (4, 400, rnd, False, ()),
                            _pieces(vals, pieces, codec),
                        )  # fmt: skip
                else:
                    buf = bytearray(b"".join(codec.encode(x) for x in vals))
                    params = EncodedParams(codec, buf, SHAPES)
                c = Contribution(m, 0, params, c_steps=4, c_tokens=400, base_version=rnd)
                c.seq = rnd + 1
                r = st.submit(c, float(rnd), finite_checked=True)
            assert r.merged is not None
        outs.append((st.frags[0].theta, st.frags[0].momentum, list(st.frags[0].norms)))
    (a_theta, a_mom, a_norms), (b_theta, b_mom, b_norms) = outs
    assert all(torch.equal(a, b) for a, b in zip(a_theta, b_theta))
    assert all(torch.equal(a, b) for a, b in zip(a_mom, b_mom))
    assert a_norms == b_norms and len(a_norms) == 20


def test_delta_pieces_are_added_to_the_named_version_and_may_mix_with_parameters():
    codec = get_codec("int8")
    ref = list(_model(0).values())
    new = [t + 0.05 * torch.randn(t.shape) for t in ref]
    first, second = _ranks(2)
    asm = SliceAssembler()
    delta = [a - b for a, b in zip(new, ref)]
    asm.add(0, 0, 1, SHAPES, (1, 1, 0, False, ()), _pieces(delta, first, codec, delta=True))
    got = asm.add(0, 0, 1, SHAPES, (1, 1, 0, False, ()), _pieces(new, second, codec))
    assert got is not None and got.delta
    with pytest.raises(ValueError, match="pushed"):
        got[0]
    for j in range(len(SHAPES)):
        x = got.pushed(j, lambda j=j: ref[j])
        assert (x - new[j]).abs().max() < 0.01  # int8's rounding of each run


def test_an_initial_model_from_the_ranks_uploads():
    values = list(_model(2).values())
    up = InitUpload(NUMELS)
    for pieces in _ranks(2):
        data = b"".join(
            values[pc.j].reshape(-1)[pc.offset : pc.offset + pc.numel].numpy().tobytes()
            for pc in pieces
        )
        assert not up.complete
        up.add(pieces, memoryview(data))
    assert up.complete
    flat = torch.frombuffer(up.buf, dtype=torch.float32)
    assert torch.equal(flat, torch.cat([v.reshape(-1) for v in values]))
    with pytest.raises(PieceError, match="overlap"):
        up.add([Piece(0, 0, 1)], memoryview(b"\0" * 4))
