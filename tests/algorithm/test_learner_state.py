import pytest
import torch

from ddiloco.algorithm.fragments import fragment_parameters
from ddiloco.algorithm.learner_state import DEFAULT_INSTALL, LearnerSync
from ddiloco.algorithm.schedule import FragmentSchedule


def make(tau=1, alpha=0.0, install="overwrite"):
    params = {"a": torch.zeros(3), "b": torch.zeros(3)}
    fr = fragment_parameters([("a", 3, 4), ("b", 3, 4)], 2, "balanced")
    ls = LearnerSync(params, fr, FragmentSchedule(P=2, H=4, tau=tau), alpha=alpha, install=install)
    ls.load_global({"a": torch.zeros(3), "b": torch.zeros(3)}, [0, 0])
    return ls, params, fr


def test_sends_follow_schedule_with_counters_since_receipt():
    ls, params, fr = make()
    sent = {t: ls.after_step(tokens=10) for t in range(1, 5)}
    assert [o.fragment for o in sent[2]] == [0] and [o.fragment for o in sent[4]] == [1]
    assert sent[2][0].c_steps == 2 and sent[2][0].c_tokens == 20
    assert sent[4][0].c_steps == 4 and sent[4][0].base_version == 0
    assert sent[4][0].seq == 2


def test_install_at_t_plus_tau_resets_counters_and_never_waits():
    ls, params, fr = make(tau=1)
    ls.after_step(10)
    (out,) = ls.after_step(10)  # step 2: fragment 0 leaves
    params[fr.fragments[0].names[0]].add_(1.0)
    ls.on_push_result(0, out.seq, accepted=True, target_version=1)
    ls.receive(0, 1, [torch.full((3,), 5.0)])
    assert ls.install_due() == []  # not before step 3
    ls.after_step(10)
    assert ls.install_due() == [0]
    name = fr.fragments[0].names[0]
    assert torch.equal(params[name], torch.full((3,), 5.0))
    assert ls.frags[0].c_steps == 0 and ls.frags[0].base_version == 1
    ls.mark_merged(0, out.seq)
    assert ls.ledger.merged == pytest.approx(2 * 0.5)
    # step 3, the tau overlap, changed fragment 0 after its snapshot: the install replaced it
    assert ls.ledger.overwritten == pytest.approx(1 * 0.5)
    assert ls.frags[0].unpushed_steps == 0
    assert ls.ledger.balance_error() < 1e-12


def test_late_install_loses_overwritten_progress_and_alpha_mixing():
    ls, params, fr = make(tau=1)
    ls.after_step(10)
    (out,) = ls.after_step(10)
    ls.on_push_result(0, out.seq, True, 1)
    for _ in range(3):  # steps 3..5: result not there yet; the learner keeps training
        ls.after_step(10)
        assert ls.install_due() == []
    ls.receive(0, 1, [torch.full((3,), 5.0)])
    assert ls.install_due() == [0]
    assert ls.ledger.lost == pytest.approx(2 * 0.5)  # steps 4 and 5 were past the install step
    assert ls.ledger.overwritten == pytest.approx(1 * 0.5)  # step 3: the overlap
    assert ls.ledger.balance_error() < 1e-12
    mix, p2, fr2 = make(tau=0, alpha=0.25)
    mix.after_step(10)
    (o,) = mix.after_step(10)
    name = fr2.fragments[0].names[0]
    p2[name].fill_(1.0)
    mix.on_push_result(0, o.seq, True, 1)
    mix.receive(0, 1, [torch.full((3,), 5.0)])
    assert mix.install_due() == [0]
    assert torch.allclose(p2[name], torch.full((3,), 0.25 * 1 + 0.75 * 5))


def test_dropped_push_installs_latest_and_failure_loses_unpushed():
    ls, params, fr = make(tau=1)
    ls.after_step(10)
    (out,) = ls.after_step(10)
    ls.on_push_result(0, out.seq, accepted=False)
    assert ls.ledger.dropped == pytest.approx(1.0)
    ls.receive(0, 3, [torch.full((3,), 2.0)])
    ls.after_step(10)
    assert ls.install_due() == [0] and ls.frags[0].base_version == 3
    ls.fail()
    assert ls.ledger.unpushed == 0 and ls.ledger.lost > 0
    assert ls.ledger.balance_error() < 1e-12


def test_a_learner_slower_than_the_fragment_period_still_installs():
    # every step of this learner takes more than a period (H = 4 slots), so each fragment is
    # due again at every step while its previous push still awaits its install
    ls, params, fr = make(tau=1)
    ls.slot_s = 1.0
    now = 0.0
    pushes = []
    for _ in range(2):
        now += 5.0
        pushes += ls.after_step(10, now_s=now)
    first = {o.fragment: o for o in reversed(pushes)}  # the earliest push of each fragment
    for o in pushes:  # verdicts arrive in order, each before its merge
        ls.on_push_result(o.fragment, o.seq, accepted=True, target_version=o.seq)
    for p, o in first.items():
        ls.receive(p, o.seq, [torch.full((3,), 7.0)])
    now += 5.0
    pushes = ls.after_step(10, now_s=now)
    assert sorted(o.fragment for o in pushes) == [0, 1]  # due again: sent again
    assert sorted(ls.install_due()) == [0, 1]  # the first pushes' merges: installed
    assert all(ls.frags[p].base_version == first[p].seq for p in (0, 1))
    assert ls.ledger.balance_error() < 1e-12
    # the awaited push is rejected: the next newer version installs, whatever the verdicts
    # of the pushes sent after it
    now += 5.0
    (o,) = [o for o in ls.after_step(10, now_s=now) if o.fragment == 0]
    ls.on_push_result(0, o.seq, accepted=False)
    now += 5.0
    (later,) = [o for o in ls.after_step(10, now_s=now) if o.fragment == 0]
    ls.on_push_result(0, later.seq, accepted=True, target_version=99)
    ls.receive(0, first[0].seq + 1, [torch.full((3,), 8.0)])
    assert 0 in ls.install_due()
    assert ls.frags[0].base_version == first[0].seq + 1


def test_never_installed_learner_does_not_contribute():
    params = {"a": torch.zeros(3), "b": torch.zeros(3)}
    fr = fragment_parameters([("a", 3, 4), ("b", 3, 4)], 2, "balanced")
    ls = LearnerSync(params, fr, FragmentSchedule(P=2, H=4, tau=1))
    assert ls.install == DEFAULT_INSTALL
    with pytest.raises(ValueError, match="install must be one of"):
        LearnerSync(params, fr, FragmentSchedule(P=2, H=4, tau=1), install="replace")
    assert ls.after_step(1) == [] and ls.after_step(1) == []
    with pytest.raises(ValueError, match="schedule has P=1"):
        LearnerSync(params, fr, FragmentSchedule(P=1, H=4))


def test_time_driven_sends_carry_more_steps_for_faster_learners():
    params = {"a": torch.zeros(3), "b": torch.zeros(3)}
    fr = fragment_parameters([("a", 3, 4), ("b", 3, 4)], 2, "balanced")
    sched = FragmentSchedule(P=2, H=4, tau=1)
    fast = LearnerSync(dict(params), fr, sched, slot_s=1.0)
    slow = LearnerSync({k: v.clone() for k, v in params.items()}, fr, sched, slot_s=1.0)
    for ls in (fast, slow):
        ls.load_global(params, [0, 0], now_s=0.0)
    f = [o for k in range(1, 9) for o in fast.after_step(10, now_s=k * 0.5)]
    s = [o for k in range(1, 5) for o in slow.after_step(10, now_s=k * 1.0)]
    assert [o.fragment for o in f] == [o.fragment for o in s] == [0, 1]
    assert f[0].c_steps == 4 and s[0].c_steps == 2  # same moment, twice the steps
    with pytest.raises(ValueError, match="now_s"):
        fast.after_step(10)


def test_snapshots_reuse_released_buffers_and_copy_the_current_values():
    ls, params, fr = make()  # two fragments of one tensor of 3 each: the same shapes
    name = fr.fragments[0].names[0]
    ls.after_step(10)
    params[name].fill_(1.0)
    (o1,) = ls.after_step(10)  # step 2: fragment 0 leaves
    assert o1.params[0].tolist() == [1.0, 1.0, 1.0]
    params[name].fill_(2.0)
    assert o1.params[0].tolist() == [1.0, 1.0, 1.0]  # a snapshot, not a view
    ls.release(0, o1.params)
    sent = [ls.after_step(10) for _ in range(4)]  # steps 3-6: fragment 1 at 4, 0 at 6
    (o3,) = sent[1]  # fragment 1 has the released buffer's shapes: it takes it
    assert o3.fragment == 1 and o3.params[0].data_ptr() == o1.params[0].data_ptr()
    assert o3.params[0].tolist() == [0.0, 0.0, 0.0]  # fragment 1's values
    (o2,) = sent[-1]  # fragment 0 again: nothing released since, a buffer of its own
    assert o2.fragment == 0 and o2.params[0].data_ptr() != o3.params[0].data_ptr()
    assert o2.params[0].tolist() == [2.0, 2.0, 2.0]


def test_the_snapshot_pool_holds_a_few_buffers_whatever_the_number_of_fragments():
    """Released buffers are kept over all fragments, at most ``POOLED_SNAPSHOTS``: a
    learner with P fragments does not keep a model's worth of them."""
    from ddiloco.algorithm.learner_state import POOLED_SNAPSHOTS

    P = 8  # noqa: N806
    names = [(f"t{i}", i + 1, 4 * (i + 1)) for i in range(P)]  # every fragment its own shape
    params = {n: torch.zeros(k) for n, k, _ in names}
    fr = fragment_parameters(names, P, "balanced")
    ls = LearnerSync(params, fr, FragmentSchedule(P=P, H=P, tau=1), install="overwrite")
    ls.load_global({n: t.clone() for n, t in params.items()}, [0] * P)
    out = [o for _ in range(P) for o in ls.after_step(10)]
    assert sorted(o.fragment for o in out) == list(range(P))
    for o in out:
        ls.release(o.fragment, o.params)
    assert len(ls._free) == POOLED_SNAPSHOTS == 2
    kept = {tuple(b[0].shape) for _, b in ls._free}
    assert kept == {tuple(out[-2].params[0].shape), tuple(out[-1].params[0].shape)}  # newest


# -- install = rebase ---------------------------------------------------------------------
def _step(ls, params, name, delta):
    """One inner step that moves tensor ``name`` by ``delta``."""
    params[name].add_(delta)
    return ls.after_step(10)


def test_rebase_adds_the_progress_since_the_push_and_overwrites_nothing():
    ls, params, fr = make(tau=1, install="rebase")
    name = fr.fragments[0].names[0]
    _step(ls, params, name, 1.0)
    (out,) = _step(ls, params, name, 1.0)  # step 2: fragment 0 leaves at theta = 2
    assert out.params[0].tolist() == [2.0] * 3
    ls.release(0, out.params)  # the sender is done: the kept snapshot must survive it
    ls.on_push_result(0, out.seq, accepted=True, target_version=1)
    ls.receive(0, 1, [torch.full((3,), 5.0)])
    _step(ls, params, name, 0.5)  # step 3, the overlap: theta = 2.5
    assert ls.install_due() == [0]
    assert params[name].tolist() == [5.5] * 3  # Theta + (2.5 - 2)
    fr0 = ls.frags[0]
    assert fr0.c_steps == 1 and fr0.c_tokens == 10  # the overlap step stays in the counters
    assert fr0.unpushed_steps == 1 and fr0.base_version == 1
    ls.mark_merged(0, out.seq)
    assert ls.ledger.overwritten == 0 and ls.ledger.lost == 0
    assert ls.ledger.unpushed == pytest.approx(1 * 0.5 + 3 * 0.5)  # fragment 1: 3 steps
    assert ls.ledger.balance_error() < 1e-12
    # the overlap step goes out with the next push of fragment 0, counted once
    sent = [_step(ls, params, name, 0.0) for _ in range(3)]  # steps 4-6: 0 leaves at 6
    (nxt,) = sent[-1]
    assert nxt.fragment == 0 and nxt.c_steps == 4 and nxt.covered_steps == 4
    assert nxt.params[0].tolist() == [5.5] * 3 and nxt.base_version == 1
    # the snapshot buffer came back to the pool after the install: the next send of its
    # shapes reused it (fragment 1's, at step 4)
    (one,) = sent[0]
    assert one.fragment == 1 and one.params[0].data_ptr() == out.params[0].data_ptr()


def test_rebase_of_a_late_install_loses_nothing():
    ls, params, fr = make(tau=1, install="rebase")
    name = fr.fragments[0].names[0]
    _step(ls, params, name, 1.0)
    (out,) = _step(ls, params, name, 1.0)
    ls.on_push_result(0, out.seq, True, 1)
    for _ in range(3):  # steps 3..5 (one in fragment 1's slot): the merged value is late
        for o in _step(ls, params, name, 1.0):
            ls.release(o.fragment, o.params)
        assert ls.install_due() == []
    ls.receive(0, 1, [torch.full((3,), 10.0)])
    assert ls.install_due() == [0]
    assert params[name].tolist() == [13.0] * 3  # 10 + (5 - 2)
    assert ls.ledger.lost == 0 and ls.ledger.overwritten == 0
    assert ls.frags[0].unpushed_steps == 3 and ls.frags[0].c_steps == 3
    assert ls.ledger.balance_error() < 1e-12
    assert ls.mean_install_delay_steps == 3  # pushed at step 2, installed at step 5


def test_rebase_composes_with_alpha_mixing_and_tau_zero_is_exactly_the_overwrite():
    ls, params, fr = make(tau=1, alpha=0.25, install="rebase")
    name = fr.fragments[0].names[0]
    _step(ls, params, name, 1.0)
    (out,) = _step(ls, params, name, 1.0)  # theta(t) = 2
    ls.on_push_result(0, out.seq, True, 1)
    ls.receive(0, 1, [torch.full((3,), 6.0)])
    _step(ls, params, name, 1.0)  # theta = 3
    assert ls.install_due() == [0]
    # alpha-mixed value with the snapshot, plus the progress since: 3 + 0.75 (6 - 2)
    assert torch.allclose(params[name], torch.full((3,), 6.0))
    # tau = 0: nothing happens between the push and the install; bit-identical to overwrite
    a, pa, fa = make(tau=0, install="rebase")
    b, pb, fb = make(tau=0, install="overwrite")
    for ls_, p_ in ((a, pa), (b, pb)):
        nm = fa.fragments[0].names[0]
        p_[nm].fill_(0.1)
        ls_.after_step(10)
        (o,) = ls_.after_step(10)
        ls_.on_push_result(0, o.seq, True, 1)
        ls_.receive(0, 1, [torch.full((3,), 1.0 / 3.0)])
        assert ls_.install_due() == [0]
    assert torch.equal(pa[fa.fragments[0].names[0]], pb[fb.fragments[0].names[0]])


def test_rebase_when_the_learner_pushed_again_before_the_merged_value_arrived():
    """A learner slower than the fragment's period pushes p again (seq 2) while seq 1 awaits
    its install. The merged value of seq 1 is rebased on seq 1's snapshot (steps since it
    are kept; seq 2 stays in flight and is merged later); a version that merged seq 2 as
    well is rebased on seq 2's snapshot, so no progress is counted twice."""
    for version_merges_second, expect in ((False, 10.0 + (4 - 2)), (True, 10.0 + (4 - 3))):
        ls, params, fr = make(tau=1, install="rebase")
        ls.slot_s = 1.0
        name = fr.fragments[0].names[0]
        now, sends = 0.0, []
        for delta in (2.0, 1.0):  # two slow steps; each sends both fragments
            params[name].add_(delta)
            now += 5.0
            sends += [o for o in ls.after_step(10, now_s=now) if o.fragment == 0]
        first, second = sends
        assert first.params[0][0] == 2.0 and second.params[0][0] == 3.0
        ls.on_push_result(0, first.seq, True, 1)
        ls.on_push_result(0, second.seq, True, 2)
        params[name].add_(1.0)  # one more (short) step: theta = 4 at the install
        assert ls.after_step(10, now_s=now + 0.1) == []
        version = 2 if version_merges_second else 1
        ls.receive(0, version, [torch.full((3,), 10.0)])
        assert 0 in ls.install_due()
        assert params[name].tolist() == [expect] * 3, version_merges_second
        assert ls.frags[0].base_version == version
        assert ls.ledger.lost == 0 and ls.ledger.overwritten == 0
        # the second push is still accounted for: pending until its merge, then merged
        ls.mark_merged(0, second.seq)
        assert ls.ledger.pending == pytest.approx(
            sum(0.5 * c for p, f in enumerate(ls.frags) if p == 1 for c in f.in_flight.values())
        )
        assert ls.ledger.balance_error() < 1e-12
        kept = set(ls.frags[0].anchors)
        assert kept == (set() if version_merges_second else {second.seq})
        if not version_merges_second:
            # the counters of the kept later push are moved to the new origin (counts since
            # the first push), so the next rebased install never makes them negative
            assert ls.frags[0].anchors[second.seq].c_steps == second.c_steps - first.c_steps
            params[name].add_(1.0)  # theta = 13
            now += 5.0
            (third,) = [o for o in ls.after_step(10, now_s=now) if o.fragment == 0]
            assert third.c_steps == 3 and third.params[0][0] == 13.0
            ls.on_push_result(0, third.seq, True, 3)
            ls.receive(0, 3, [torch.full((3,), 20.0)])  # merged the second and third pushes
            params[name].add_(1.0)  # theta = 14
            assert ls.after_step(10, now_s=now + 0.1) == []
            assert 0 in ls.install_due()
            assert params[name].tolist() == [20.0 + (14 - 13)] * 3  # the third's snapshot
            assert ls.frags[0].c_steps == 1 and ls.frags[0].c_tokens == 10
            assert not ls.frags[0].anchors


def test_rebase_of_a_refused_push_keeps_the_later_steps_and_counts_the_refused_dropped():
    ls, params, fr = make(tau=1, install="rebase")
    name = fr.fragments[0].names[0]
    _step(ls, params, name, 1.0)
    (out,) = _step(ls, params, name, 1.0)  # theta(t) = 2
    ls.on_push_result(0, out.seq, accepted=False)
    assert ls.ledger.dropped == pytest.approx(2 * 0.5)
    ls.receive(0, 3, [torch.full((3,), 7.0)])  # someone else's merge
    _step(ls, params, name, 1.0)
    assert ls.install_due() == [0]
    assert params[name].tolist() == [8.0] * 3  # 7 + (3 - 2): the step after the push is kept
    assert ls.ledger.balance_error() < 1e-12
    ls.load_global({"a": torch.zeros(3), "b": torch.zeros(3)}, [3, 3])  # a rejoin forgets all
    assert all(not f.anchors and not f.targets for f in ls.frags)
