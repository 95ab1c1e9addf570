"""The syncer's compact state, unit by unit: the history of past versions (bf16 merge steps,
kept while a push can name them), pushes kept encoded, the delta-coded downlink's shared
chain, and one push encoding for both engines."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.downlink import DeltaChain
from ddiloco.algorithm.fragments import fragment_parameters
from ddiloco.algorithm.history import FragmentHistory
from ddiloco.algorithm.learner_state import Outgoing
from ddiloco.algorithm.payload import EncodedParams, encode_push
from ddiloco.algorithm.policy import PolicyConfig
from ddiloco.algorithm.syncer_state import Contribution, Status, SyncerConfig, SyncerState
from ddiloco.runtime.learner.links import DeltaBases, Links

SHAPES = [(64, 32), (32,)]


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}


def test_history_rebuilds_past_versions_from_bf16_steps():
    g = torch.Generator().manual_seed(1)
    versions = [[torch.randn(s, generator=g) for s in SHAPES]]
    h = FragmentHistory(SHAPES)
    for v in range(4):  # small outer steps
        versions.append([t + 0.01 * torch.randn(t.shape, generator=g) for t in versions[-1]])
        h.record(v, versions[v], versions[v + 1])
    cur = versions[-1]
    assert len(h) == 4 and h.oldest == 0 and h.holds(0, 4) and h.holds(4, 4)
    assert not h.holds(5, 4) and not h.holds(-1, 4)
    for v in range(4):
        for a, b in zip(h.version(cur, v), versions[v]):
            step = (versions[v + 1][0] - versions[v][0]).abs().max()
            # each recorded step is within 2^-8 of itself: k steps back, within k of those
            assert (a - b).abs().max() <= (4 - v) * step * 2**-8 + 1e-6
    assert h.nbytes == 4 * sum(2 * torch.Size(s).numel() for s in SHAPES)  # half of fp32
    h.trim(2, keep=16)
    assert h.oldest == 2 and not h.holds(1, 4)
    h.trim(0, keep=1)
    assert h.oldest == 3
    h.record(7, cur, cur)  # not consecutive (a resume): the older steps cannot be used
    assert len(h) == 1 and h.oldest == 7


def _state(history: int = 16, learners: int = 2) -> SyncerState:
    frag = fragment_parameters([(n, t.numel(), 4) for n, t in _model().items()], P=1)
    cfg = SyncerConfig(
        policy=PolicyConfig(quorum=1, grace=False), history=history, max_staleness=history
    )
    st = SyncerState(frag, _model(), cfg)
    for m in range(learners):
        st.join(m)
    return st


def _delta_push(st: SyncerState, m: int, seq: int, base: int, scale: float = 0.01):
    d = [scale * torch.randn(s) for s in SHAPES]
    codec = get_codec("bf16")
    buf = bytearray(b"".join(codec.encode(x) for x in d))
    c = Contribution(
        learner=m,
        fragment=0,
        params=EncodedParams(codec, buf, SHAPES, delta=True),
        c_steps=4,
        c_tokens=400,
        base_version=base,
        seq=seq,
    )
    return st.submit(c, 0.0, finite_checked=True)


def test_versions_are_kept_only_while_a_learner_can_push_against_them():
    st = _state()
    assert _delta_push(st, 0, 1, 0).status is Status.ACCEPTED  # K = 1: merged, version 1
    assert st.version(0) == 1
    # learner 1 joined at version 0 and has not pushed: version 0 stays
    assert st.holds(0, 0) and st.frags[0].history.oldest == 0
    assert _delta_push(st, 0, 2, 1).status is Status.ACCEPTED  # version 2
    assert st.holds(0, 0)  # still learner 1's
    assert _delta_push(st, 1, 1, 2).status is Status.ACCEPTED  # version 3
    # learner 1 moved to 2, learner 0 last pushed against 1: version 0 is gone
    assert not st.holds(0, 0) and st.holds(0, 1)
    assert _delta_push(st, 0, 3, 3).status is Status.ACCEPTED  # version 4
    assert not st.holds(0, 1) and st.holds(0, 2) and len(st.frags[0].history) == 2
    assert _delta_push(st, 0, 4, 0).status is Status.STALE  # names a version gone
    # a learner that leaves releases its pin
    st2 = _state()
    _delta_push(st2, 0, 1, 0)
    _delta_push(st2, 0, 2, 1)
    assert st2.holds(0, 0)
    st2.leave(1, 0.0)
    _delta_push(st2, 0, 3, 2)
    assert not st2.holds(0, 0) and st2.history_bytes() <= st2.frags[0].history.nbytes


def test_history_is_capped_and_off_when_no_codec_needs_it():
    st = _state(history=2, learners=2)
    for v in range(5):
        _delta_push(st, 0, v + 1, v)
    assert len(st.frags[0].history) <= 2  # learner 1's pin at 0 is beyond the cap
    st0 = _state(history=0)
    assert st0.config.history == 0
    _delta_push(st0, 0, 1, 0)
    assert len(st0.frags[0].history) == 0


def test_an_encoded_push_merges_as_its_decoded_tensors_do():
    """A push kept encoded until its round merges gives the merge a decoded list gives."""
    codec = get_codec("int4")
    pushed = [t + 0.05 * torch.randn(t.shape) for t in _model().values()]
    buf = bytearray(b"".join(codec.encode(x) for x in pushed))
    decoded = [codec.roundtrip(x) for x in pushed]
    outs = []
    for params in (EncodedParams(codec, buf, SHAPES), decoded):
        st = _state(history=0, learners=1)
        c = Contribution(0, 0, params, c_steps=4, c_tokens=400, base_version=0, seq=1)
        r = st.submit(c, 0.0, finite_checked=params is not decoded)
        outs.append(r.merged.params)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="payload must be"):
        EncodedParams(codec, buf[:-1], SHAPES)


def test_every_learner_on_the_chain_holds_the_same_copy():
    codec = get_codec("int4")
    g = torch.Generator().manual_seed(2)
    theta = [torch.randn(s, generator=g) for s in SHAPES]
    chain = DeltaChain(codec, theta, 0)
    tok0, copy0 = chain.token, chain.reference()
    assert chain.version_of(tok0) == 0 and chain.version_of(123) is None
    assert chain.steps_since(0) == []
    assert all(torch.equal(a, t) for a, t in zip(copy0, theta))
    for v in (1, 2, 3):
        theta = [t + 0.02 * torch.randn(t.shape, generator=g) for t in theta]
        chain.advance(v, theta)
    # every copy of version 0 brought up by the kept steps is the same copy, and the
    # chain's R within the int8 rounding of its residual per step (ddiloco.algorithm.downlink)
    steps = chain.steps_since(0)
    assert len(steps) == 3
    copies = []
    for _ in range(2):
        mine = [t.clone() for t in copy0]
        for step in steps:
            mine = [m + codec.decode(b, m.numel()).view(m.shape) for m, b in zip(mine, step)]
        copies.append(mine)
    ref = chain.reference()
    for a, b, r in zip(*copies, ref):
        assert torch.equal(a, b)
        assert (a - r).abs().max() <= 3 * 0.02 * 4 / 7 / 127
    # the rounding error is carried forward: within one step's rounding of the version
    for a, t in zip(ref, theta):
        assert (a - t).abs().max() < 0.02 * 4 / 7
    chain.trim(2)
    assert chain.steps_since(0) is None and chain.version_of(tok0) is None
    assert len(chain.steps_since(2)) == 1 and chain.step_bytes > 0


def test_both_engines_put_the_same_bytes_on_the_wire():
    """The runtime learner encodes a push with ``encode_push``, which the in-process engine
    calls too: the same push and base give the same bytes (deltas for a delta codec)."""
    params = list(_model().values())
    base = [p - 0.01 for p in params]
    for name in ("fp32", "bf16", "int8", "int4", "fp8"):
        codec = get_codec(name)
        bases = DeltaBases(codec, threading.Lock())
        bases.remember(0, 3, base)
        links = Links(
            SimpleNamespace(codec=codec, plan=None, fragmentation=SimpleNamespace(P=1)),
            None,
            None,
            bases,
        )  # type: ignore[arg-type]
        o = Outgoing(
            fragment=0,
            params=params,
            c_steps=1,
            c_tokens=1,
            base_version=3,
            seq=1,
            send_step=1,
            covered_steps=1,
        )
        runtime = links._encode(o)
        engine = encode_push(codec, params, base if codec.delta else None)
        assert runtime == engine and runtime[1] == codec.delta, name
