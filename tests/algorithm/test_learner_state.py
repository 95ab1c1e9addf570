import pytest
import torch

from ddiloco.algorithm.fragments import fragment_parameters
from ddiloco.algorithm.learner_state import LearnerSync
from ddiloco.algorithm.schedule import FragmentSchedule


def make(tau=1, alpha=0.0):
    params = {"a": torch.zeros(3), "b": torch.zeros(3)}
    fr = fragment_parameters([("a", 3, 4), ("b", 3, 4)], 2, "balanced")
    ls = LearnerSync(params, fr, FragmentSchedule(P=2, H=4, tau=tau), alpha=alpha)
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
    ls, params, fr = make()
    name = fr.fragments[0].names[0]
    ls.after_step(10)
    params[name].fill_(1.0)
    (o1,) = ls.after_step(10)  # step 2: fragment 0 leaves
    assert o1.params[0].tolist() == [1.0, 1.0, 1.0]
    params[name].fill_(2.0)
    assert o1.params[0].tolist() == [1.0, 1.0, 1.0]  # a snapshot, not a view
    ls.release(0, o1.params)
    sent = [ls.after_step(10) for _ in range(4)]  # steps 3-6: fragment 0 leaves again at 6
    (o2,) = sent[-1]
    assert o2.fragment == 0
    assert o2.params[0].data_ptr() == o1.params[0].data_ptr()  # the released buffer, reused
    assert o2.params[0].tolist() == [2.0, 2.0, 2.0]
    (o3,) = [o for o in sent[1]]  # step 4, fragment 1: never released, a buffer of its own
    assert o3.fragment == 1 and o3.params[0].data_ptr() != o2.params[0].data_ptr()
