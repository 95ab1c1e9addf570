import dataclasses

import pytest
import torch

from ddiloco.algorithm.fragments import fragment_parameters
from ddiloco.algorithm.policy import PolicyConfig, WaitUntil
from ddiloco.algorithm.syncer_state import Contribution, Status, SyncerConfig, SyncerState


def make(quorum=1, grace=True, M=3, rule="average", lr=1.0, mom=0.0, scale_partial=False, **kw):
    init = {"w": torch.zeros(4), "emb": torch.zeros(2)}
    fr = fragment_parameters([("w", 4, 4), ("emb", 2, 4)], 2, "balanced", {"emb"})
    cfg = SyncerConfig(
        policy=PolicyConfig(quorum=quorum, grace=grace, gamma=0.5, tau=2),
        merge_rule=rule,
        outer_lr=lr,
        outer_momentum=mom,
        scale_partial=scale_partial,
        **kw,
    )
    s = SyncerState(fr, init, cfg)
    for m in range(M):
        s.join(m)
    p_w = fr.fragment_of()["w"]
    return s, p_w


def push(m, p, value, base=0, steps=10, tokens=100, seq=0, n=4):
    return Contribution(
        learner=m,
        fragment=p,
        params=[torch.full((n,), float(value))],
        c_steps=steps,
        c_tokens=tokens,
        base_version=base,
        seq=seq,
    )


def test_quorum_k_is_respected_and_grace_timer_drives_merge():
    s, p = make(quorum=2)
    s.observe_step_s(1.0)  # slack = tau * xi_step - xi_quorum = 2 - 0.5 s; grace = 0.5 * slack
    r = s.submit(push(0, p, 1.0), now_s=10.0)
    assert r.status is Status.ACCEPTED and r.merged is None and r.wake_at_s is None
    r = s.submit(push(1, p, 3.0), now_s=10.5)
    assert r.merged is None and r.wake_at_s == pytest.approx(
        10.5 + 0.5 * (2.0 - 0.5)
    )  # xi_quorum = 0.5 s
    assert s.on_timer(p, 10.6) is None  # too early
    m = s.on_timer(p, r.wake_at_s)
    assert m.learners == (0, 1) and m.version == 1 and m.reason == "grace-expired"
    # Delta = Theta - theta = mean(-1, -3) = -2; lr 1, momentum 0 -> Theta = 2
    assert torch.allclose(m.params[0], torch.full((4,), 2.0))
    assert s.version(p) == 1 and s.quorum_sizes == [2]


def test_all_live_arrivals_merge_immediately_and_dead_learners_do_not_block():
    s, p = make(quorum=3, M=3)
    s.submit(push(0, p, 1.0), 0.0)
    s.submit(push(1, p, 1.0), 0.1)
    assert s.version(p) == 0
    merged = s.leave(2, 0.2)  # K is capped by live learners once learner 2 dies
    assert [mm.learners for mm in merged] == [(0, 1)]
    s2, p2 = make(quorum=1, M=2)
    r = s2.submit(push(0, p2, 1.0), 0.0)
    assert r.merged is not None and r.merged.reason == "no-grace"  # no step time yet: grace is 0
    s3, p3 = make(quorum=1, M=2, grace=False)
    assert s3.submit(push(0, p3, 1.0), 0.0).merged is not None


def test_token_weighted_merge():
    s, p = make(quorum=2, M=2, grace=False)
    s.submit(push(0, p, 1.0, steps=10, tokens=100), 0.0)
    m = s.submit(push(1, p, 4.0, steps=10, tokens=200), 0.0).merged
    w0, w1 = 100 * 10, 200 * 20
    assert m.weights == (w0, w1)
    assert torch.allclose(m.params[0], torch.full((4,), (w0 * 1 + w1 * 4) / (w0 + w1)))
    led = s.ledger
    # a push counts its tokens once per fragment share: "w" holds 16 of the model's 24 bytes
    assert led[0].tokens_merged == pytest.approx(100 * 2 / 3)
    assert led[1].tokens_merged == pytest.approx(200 * 2 / 3)
    assert led[0].tokens_pending == 0


def test_rejections_leave_global_unchanged():
    s, p = make(quorum=1, M=2, grace=False)
    before = {k: v.clone() for k, v in s.global_params().items()}
    bad = [
        (push(0, p, float("nan")), Status.INVALID),
        (push(0, p, 1.0, n=5), Status.INVALID),
        (push(0, 7, 1.0), Status.INVALID),
        (push(0, p, 1.0, steps=0), Status.INVALID),
        (push(0, p, 1.0, base=3), Status.FUTURE),
        (push(0, p, 1.0, base=-1), Status.NO_BASE),
        (push(9, p, 1.0), Status.UNKNOWN_LEARNER),
    ]
    for c, st in bad:
        r = s.submit(c, 0.0)
        assert r.status is st, (r, st)
        assert r.message
    after = s.global_params()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert s.versions() == [0, 0]


def test_duplicate_push_merged_once_and_staleness():
    s, p = make(quorum=1, M=2, grace=False, max_staleness=1)
    assert s.submit(push(0, p, 1.0, seq=5), 0.0).status is Status.ACCEPTED
    assert s.submit(push(0, p, 1.0, seq=5), 0.1).status is Status.DUPLICATE
    assert s.version(p) == 1
    s.submit(push(0, p, 1.0, base=1, seq=6), 0.2)
    assert s.version(p) == 2
    r = s.submit(push(1, p, 1.0, base=0, seq=0), 0.3)  # 2 versions behind, max 1
    assert r.status is Status.STALE and s.version(p) == 2
    assert s.ledger[1].tokens_dropped == pytest.approx(100 * 2 / 3)


def test_base_anchor_uses_published_history():
    s, p = make(quorum=1, M=2, grace=False, anchor="base", max_staleness=2)
    s.submit(push(0, p, 1.0), 0.0)  # Theta: 0 -> 1
    # learner 1 trained from version 0 to value 0.5: outer gradient anchored at base 0 is -0.5
    m = s.submit(push(1, p, 0.5, base=0), 0.1).merged
    assert torch.allclose(m.params[0], torch.full((4,), 1.5))
    s_cur, p_cur = make(quorum=1, M=2, grace=False)
    s_cur.submit(push(0, p_cur, 1.0), 0.0)
    m = s_cur.submit(push(1, p_cur, 0.5, base=0), 0.1).merged  # anchored at current (1.0): +0.5
    assert torch.allclose(m.params[0], torch.full((4,), 0.5))


def test_state_dict_roundtrip():
    s, p = make(quorum=1, M=2, grace=False, mom=0.9)
    s.submit(push(0, p, 1.0), 0.0)
    sd = s.state_dict()
    t, _ = make(quorum=1, M=2, grace=False, mom=0.9)
    t.load_state_dict(sd)
    assert t.versions() == s.versions()
    assert all(
        torch.equal(a, b) for a, b in zip(t.global_params().values(), s.global_params().values())
    )
    assert t.submit(push(0, p, 1.0, seq=0, base=1), 0.0).status is Status.DUPLICATE
    # momentum carried over: the next identical merges give identical results
    a = s.submit(push(1, p, 2.0, base=1), 1.0).merged
    b = t.submit(push(1, p, 2.0, base=1), 1.0).merged
    assert torch.equal(a.params[0], b.params[0])


def test_grace_window_with_late_learner_then_timer_sequence():
    """Fake clock: K=1, three learners arrive spread out; one arrives after the window."""
    s, p = make(quorum=1, M=3)
    s.observe_step_s(1.0)
    r0 = s.submit(push(0, p, 1.0), 100.0)
    assert isinstance(r0.wake_at_s, float)
    r1 = s.submit(push(1, p, 1.0), 100.3)
    assert r1.merged is None and r1.wake_at_s is None  # deadline already set, timer pending
    m = s.on_timer(p, r0.wake_at_s)
    assert m.learners == (0, 1)
    r2 = s.submit(push(2, p, 1.0, base=0), r0.wake_at_s + 5)
    assert r2.target_version == 2
    d = s.on_timer(p, r0.wake_at_s + 5)
    assert d is None or isinstance(d, WaitUntil)


def test_partial_rounds_take_their_share_of_an_outer_step():
    s, p = make(quorum=1, M=4, grace=False, scale_partial=True)
    m = s.submit(push(0, p, 1.0), 0.0).merged  # 1 of 4 live learners: a quarter step
    assert torch.allclose(m.params[0], torch.full((4,), 0.25))
    full, pf = make(quorum=2, M=2, grace=False, scale_partial=True)
    full.submit(push(0, pf, 1.0), 0.0)
    m = full.submit(push(1, pf, 1.0), 0.0).merged  # everyone: a whole step
    assert torch.allclose(m.params[0], torch.full((4,), 1.0))


def test_overflowing_merge_is_never_published():
    s, p = make(quorum=1, M=1, grace=False, lr=0.7, mom=0.9)
    before = s.global_params()["w"].clone()
    r = s.submit(push(0, p, 3e38), 0.0)
    assert r.status is Status.ACCEPTED and r.merged is None
    assert s.version(p) == 0 and s.nonfinite_merges == 1
    assert torch.equal(s.global_params()["w"], before)
    assert s.ledger[0].tokens_dropped == pytest.approx(100 * 2 / 3)
    assert s.ledger[0].tokens_pending == 0


def test_pushes_during_an_unlocked_merge_wait_for_it_and_follow_up():
    """The runtime releases its lock for the merge arithmetic: a push of the same fragment
    arriving meanwhile starts no second merge on the old version (it would lose an update);
    it is merged when the first commits, as a follow-up. Other fragments merge at once."""
    import contextlib

    s, p = make(quorum=1, M=2, grace=False)
    q = 1 - p
    during = []

    @contextlib.contextmanager
    def interleave():
        if not during:  # the first merge's arithmetic: other events happen meanwhile
            during.append(s.submit(push(1, p, 4.0, seq=1), 0.1))
            during.append(s.submit(push(1, q, 2.0, seq=2, n=2), 0.1))
        yield

    s.unlocked = interleave
    first = s.submit(push(0, p, 1.0, seq=1), 0.0)
    same, other = during
    assert same.status is Status.ACCEPTED and same.merged is None
    assert same.target_version == 2  # after the merge that was running
    assert other.merged is not None and other.merged.fragment == q  # not blocked
    assert first.merged.version == 1 and first.merged.learners == (0,)
    assert torch.allclose(first.merged.params[0], torch.full((4,), 1.0))
    ((fp, follow),) = s.take_followups()
    assert fp == p and follow.version == 2 and follow.learners == (1,) and follow.seqs == (1,)
    assert torch.allclose(follow.params[0], torch.full((4,), 4.0))  # merged onto version 1
    assert s.take_followups() == [] and s.version(p) == 2
    led = s.ledger[1]
    assert led.tokens_pending == 0 and led.pushes_merged == 2


def test_final_pushes_gather_every_live_learner_and_average():
    """A finishing learner's last pushes wait for the other live learners' last pushes of
    that fragment (not for learners that send none), then the fragment becomes their
    token-weighted average: no outer step, momentum untouched."""
    s, p = make(quorum=1, M=3, grace=False, lr=0.5, mom=0.9)
    q = 1 - p

    def final(m, frag, value, frags, tokens=100):
        c = push(m, frag, value, tokens=tokens, n=4 if frag == p else 2)
        return dataclasses.replace(c, final=True, final_fragments=frags)

    r = s.submit(final(0, p, 1.0, (p,)), 0.0)
    assert r.merged is None and s.version(p) == 0  # K = 1, but a final round waits
    r = s.submit(final(1, p, 4.0, (p,), tokens=200), 0.1)
    assert r.merged is None and s.take_followups() == []
    # learner 2 finishes sending only q: p's final round has every learner that will push p
    r = s.submit(final(2, q, 5.0, (q,)), 0.2)
    ((fp, mp),) = s.take_followups()
    w0, w1 = 100 * 10, 200 * 20  # token weights, as in test_token_weighted_merge
    assert fp == p and mp.reason == "final" and mp.learners == (0, 1)
    assert torch.allclose(mp.params[0], torch.full((4,), (w0 * 1.0 + w1 * 4.0) / (w0 + w1)))
    assert all(float(t.abs().sum()) == 0 for t in s.frags[p].momentum)
    # q: learners 0 and 1 send no final push of q, so learner 2's is the round
    assert r.merged is not None and r.merged.reason == "final" and r.merged.learners == (2,)
    assert torch.allclose(r.merged.params[0], torch.full_like(r.merged.params[0], 5.0))
    # a learner that joins again (a restart) is no longer finishing: it is waited for


@pytest.mark.parametrize("how", ["average", "nesterov", "sgd", "none"])
def test_final_merge_chooses_how_the_last_partial_round_is_merged(how):
    """``final_merge``: a round of final pushes becomes the pushes' average (no outer step),
    takes a regular Nesterov step, a step without momentum, or is left out (its tokens
    dropped, the fragment unchanged)."""
    s, p = make(quorum=1, M=2, grace=False, lr=0.5, mom=0.9, final_merge=how)
    s.frags[p].momentum[0].fill_(1.0)  # as after earlier rounds: b = 1
    for m, v in ((0, 1.0), (1, 3.0)):
        c = dataclasses.replace(push(m, p, v), final=True, final_fragments=(p,))
        s.submit(c, 0.0)
    theta, b = s.frags[p].theta[0], s.frags[p].momentum[0]
    # Delta = Theta - mean(theta) = 0 - 2 = -2 (equal token weights)
    expected = {
        "average": (2.0, 1.0, 1),
        "nesterov": (0.5 * (2.0 - 0.9 * (0.9 * 1.0 - 2.0)), 0.9 * 1.0 - 2.0, 1),
        "sgd": (0.5 * 2.0, 1.0, 1),
        "none": (0.0, 1.0, 0),
    }[how]
    assert torch.allclose(theta, torch.full((4,), expected[0])), theta
    assert torch.allclose(b, torch.full((4,), expected[1])), b
    assert s.version(p) == expected[2]
    led = s.ledger
    assert all(led[m].tokens_pending == 0 for m in (0, 1))
    counts = (sum(led[m].pushes_dropped for m in (0, 1)), sum(led[m].pushes_merged for m in (0, 1)))
    assert counts == ((2, 0) if how == "none" else (0, 2))
    with pytest.raises(ValueError, match="final_merge"):
        SyncerConfig(final_merge="mean")


def _guarded(k: float, M: int = 1):
    """Fragment w, K = 1, outer lr 1, no momentum: Theta' = Theta - Delta, exactly."""
    return make(quorum=1, grace=False, M=M, norm_clip=k)


def _walk(s, p, m, steps: list[float], seq0: int = 0) -> None:
    """Learner m pushes Theta + d for each d (Delta = -d, norm 2|d| over 4 elements)."""
    for i, d in enumerate(steps):
        theta = float(s.frags[p].theta[0][0])
        r = s.submit(push(m, p, theta + d, base=s.version(p), seq=seq0 + i), 0.0)
        assert r.merged is not None


def test_the_merge_guard_clips_an_outer_gradient_far_above_the_recent_ones():
    from ddiloco.algorithm.merge import NORM_MIN_HISTORY

    s, p = _guarded(3.0)
    _walk(s, p, 0, [0.1, 0.12, 0.08, 0.1, 0.11, 0.09, 0.1, 0.1])  # median norm 0.2
    assert len(s.frags[p].norms) == NORM_MIN_HISTORY and s.clipped_pushes == 0
    theta = s.frags[p].theta[0].clone()
    r = s.submit(push(0, p, float(theta[0]) + 50.0, base=s.version(p), seq=100), 0.0)
    # the wild push (norm 100) moves the fragment by 3 x the median norm, not by 100
    moved = s.frags[p].theta[0] - theta
    assert float(torch.linalg.vector_norm(moved)) == pytest.approx(3 * 0.2, rel=1e-5)
    assert r.merged.clipped == (0,) and s.clipped_pushes == 1
    # its direction is kept, and it enters the statistic at the bound
    assert torch.allclose(moved, torch.full((4,), 0.3), atol=1e-6)
    assert s.frags[p].norms[-1] == pytest.approx(0.6, rel=1e-5)


def test_the_merge_guard_leaves_ordinary_pushes_and_an_early_run_alone():
    on, p = _guarded(3.0)
    off, _ = _guarded(0.0)
    steps = [1.0, 0.5, 2.0, 0.2, 0.1, 0.1, 0.3, 0.2, 0.25]  # a large first outer gradient
    _walk(on, p, 0, steps)
    _walk(off, p, 0, steps)
    assert on.clipped_pushes == 0
    assert torch.allclose(on.frags[p].theta[0], off.frags[p].theta[0], atol=1e-6)
    assert len(off.frags[p].norms) == 0  # off: no statistic is kept


def test_the_merge_guard_clips_each_push_of_a_multi_learner_round_and_final_rounds():
    s, p = make(quorum=2, grace=False, M=2, norm_clip=2.0)
    for i in range(8):  # rounds of two honest pushes (Delta = -0.1 each, norm 0.2)
        theta = float(s.frags[p].theta[0][0])
        s.submit(push(0, p, theta + 0.1, base=s.version(p), seq=i), 0.0)
        r = s.submit(push(1, p, theta + 0.1, base=s.version(p), seq=i), 0.0)
        assert r.merged is not None
    theta = s.frags[p].theta[0].clone()
    s.submit(push(0, p, float(theta[0]) + 0.1, base=s.version(p), seq=50), 0.0)
    r = s.submit(push(1, p, float(theta[0]) + 10.0, base=s.version(p), seq=50), 0.0)
    assert r.merged.clipped == (1,) and s.clipped_pushes == 1
    # average of Delta = -0.1 and the wild one clipped to norm 0.4 (-0.2 per element)
    assert torch.allclose(s.frags[p].theta[0] - theta, torch.full((4,), 0.15), atol=1e-6)
    # a final round (the learners' average, no outer step) clips too
    theta = s.frags[p].theta[0].clone()
    fin = [
        push(m, p, float(theta[0]) + d, base=s.version(p), seq=60) for m, d in ((0, 0.1), (1, 9.0))
    ]
    for c in fin:
        c.final, c.final_fragments = True, (p,)
        r = s.submit(c, 0.0)
    assert r.merged is not None and r.merged.reason == "final" and r.merged.clipped == (1,)
    assert float((s.frags[p].theta[0] - theta).max()) < 0.3  # not (0.1 + 9) / 2


def test_the_merge_guard_leaves_a_round_whose_pushes_all_grew_together_alone():
    """The learning rate's warm-up: every learner's outer gradient grows far above the
    recent ones at once. That is shared progress, not a wild learner: nothing is clipped,
    and the merge is the unguarded one exactly."""
    on, p = make(quorum=3, grace=False, M=3, norm_clip=2.5)
    off, _ = make(quorum=3, grace=False, M=3, norm_clip=0.0)
    for s in (on, off):
        for i, d in enumerate([0.01, 0.01, 0.01, 0.02, 0.3, 0.4]):  # the last two: 15x and 20x
            theta = float(s.frags[p].theta[0][0])
            for m, e in enumerate((d, 1.1 * d, 0.9 * d)):
                r = s.submit(push(m, p, theta + e, base=s.version(p), seq=i), 0.0)
            assert r.merged is not None
    assert on.clipped_pushes == 0
    assert torch.equal(on.frags[p].theta[0], off.frags[p].theta[0])


def test_the_merge_guard_still_clips_a_wild_learner_among_grown_peers():
    s, p = make(quorum=3, grace=False, M=3, norm_clip=2.5)
    for i in range(3):  # nine pushes of norm 0.02
        theta = float(s.frags[p].theta[0][0])
        for m in range(3):
            s.submit(push(m, p, theta + 0.01, base=s.version(p), seq=i), 0.0)
    theta = float(s.frags[p].theta[0][0])
    # the peers grew 10x together (not clipped); learner 2 is 10x above them (clipped)
    for m, d in ((0, 0.1), (1, 0.1), (2, 1.0)):
        r = s.submit(push(m, p, theta + d, base=s.version(p), seq=10), 0.0)
    assert r.merged is not None and r.merged.clipped == (2,) and s.clipped_pushes == 1


def test_clip_factor_compares_with_the_recent_norms_and_the_round():
    from ddiloco.algorithm.merge import NORM_MIN_HISTORY, clip_factor

    recent = [1.0] * NORM_MIN_HISTORY
    assert clip_factor(10.0, recent, 2.0) == pytest.approx(0.2)  # a lone push: history only
    assert clip_factor(10.0, recent, 2.0, [9.0, 11.0]) == 1.0  # its peers grew with it
    assert clip_factor(10.0, recent, 2.0, [1.0, 1.2]) == pytest.approx(0.2)  # a wild one
    assert clip_factor(10.0, recent, 2.0, [1.0, 9.0]) == pytest.approx(0.2)  # lower median
    assert clip_factor(1.5, recent, 2.0, [0.1]) == 1.0  # under the recent bound: never
    assert clip_factor(float("inf"), recent, 2.0, [1.0, float("nan")]) == 0.0
    assert clip_factor(10.0, recent[:-1], 2.0) == 1.0  # too little history
    assert clip_factor(10.0, recent, 0.0) == 1.0  # off


def test_norm_clip_is_validated():
    with pytest.raises(ValueError, match="norm_clip"):
        SyncerConfig(norm_clip=0.5)
    from ddiloco.config.sections import SyncConfig

    with pytest.raises(ValueError, match="sync.norm_clip"):
        SyncConfig(norm_clip=-1.0)
    assert SyncConfig(norm_clip=4.0).syncer_config().norm_clip == 4.0


def test_the_merge_guard_takes_an_overflowing_norm_for_no_step():
    s, p = _guarded(2.0)
    _walk(s, p, 0, [0.1] * 8)
    theta = s.frags[p].theta[0].clone()
    r = s.submit(push(0, p, 3e38, base=s.version(p), seq=50), 0.0)  # ||Delta||^2 overflows
    assert r.merged is not None and r.merged.clipped == (0,)
    assert torch.equal(s.frags[p].theta[0], theta)  # lr 1, no momentum: no step at all
