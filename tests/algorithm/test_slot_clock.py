"""The shared slot clock of the time-driven schedule: pure computation of slots from times."""

import pytest

from ddiloco.algorithm.schedule import (
    ClockTrack,
    FragmentSchedule,
    SlotClock,
    StepTimer,
    measured_slot_s,
    next_clock,
)


def test_clock_maps_wall_time_to_nominal_steps():
    c = SlotClock(epoch_s=100.0, t0_s=110.0, x0=20.0, slot_s=0.5)
    assert c.nominal(110.0) == 20.0
    assert c.nominal(111.0) == 22.0
    assert c.nominal(109.0) == 18.0
    assert SlotClock.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="slot_s"):
        SlotClock(epoch_s=0.0, t0_s=0.0, x0=0.0, slot_s=0.0)
    with pytest.raises(ValueError, match="malformed slot clock"):
        SlotClock.from_dict({"epoch_s": 1.0})


def test_step_timer_leaves_out_the_start_up_and_averages_a_window():
    t = StepTimer(min_steps=4, min_s=0.1)
    t.add(2.0)  # start-up: from the learner's start to its first step
    for _ in range(3):
        t.add(0.01)
    assert t.step_s is None  # 3 steps: not a measurement yet
    t.add(0.02)
    assert t.step_s == pytest.approx(0.0125)  # 4 steps; the 2 s start-up left out
    for _ in range(4):
        t.add(0.01)
    assert t.step_s == pytest.approx(0.09 / 8)  # all 8 steps while they span under 0.1 s
    for _ in range(100):
        t.add(0.03)
    assert t.step_s == pytest.approx(0.03)  # the window slides: 0.1 s, at least 4 steps
    t.add(1.0)  # one hiccup moves a window of 4 slow steps by a quarter, not all of it
    assert t.step_s == pytest.approx((3 * 0.03 + 1.0) / 4)
    slow = StepTimer(min_steps=4, min_s=0.1)
    for _ in range(6):
        slow.add(2.0)
    assert slow.step_s == pytest.approx(2.0)  # slow steps: 4 of them, not 0.1 s
    with pytest.raises(ValueError, match="min_steps"):
        StepTimer(min_steps=0)


def test_measured_slot_is_the_mean_step_time_of_the_learners():
    assert measured_slot_s([]) is None
    assert measured_slot_s([0.1, 0.3]) == pytest.approx(0.2)
    assert measured_slot_s([0.2, float("nan"), -1.0]) == pytest.approx(0.2)


def test_first_clock_counts_from_the_epoch_and_applies_after_the_lead():
    assert next_clock(None, epoch_s=0.0, slot_s=None, now_s=5.0, lead_s=1.0) is None
    c = next_clock(None, epoch_s=0.0, slot_s=0.5, now_s=5.0, lead_s=1.0)
    assert (c.t0_s, c.slot_s) == (6.0, 0.5)
    assert c.nominal(6.0) == pytest.approx(12.0)  # as if 0.5 s slots since the epoch


def test_retiming_continues_the_nominal_steps_without_a_jump():
    c = SlotClock(epoch_s=0.0, t0_s=6.0, x0=12.0, slot_s=0.5)
    # within the tolerance, or too soon after the last re-timing: keep the clock
    assert next_clock(c, epoch_s=0.0, slot_s=0.54, now_s=10.0, lead_s=1.0) is None
    assert next_clock(c, epoch_s=0.0, slot_s=1.0, now_s=6.5, lead_s=1.0, min_interval_s=2.0) is None
    d = next_clock(c, epoch_s=0.0, slot_s=1.0, now_s=10.0, lead_s=1.0, min_interval_s=2.0)
    assert d.t0_s == 11.0 and d.epoch_s == 0.0
    assert d.nominal(11.0) == pytest.approx(c.nominal(11.0))  # continuous
    assert d.nominal(13.0) - d.nominal(11.0) == pytest.approx(2.0)  # the new slot length


def test_a_learner_uses_the_clock_in_effect_and_detects_a_new_run():
    tr = ClockTrack()
    assert tr.nominal(1.0) is None
    a = SlotClock(epoch_s=0.0, t0_s=6.0, x0=12.0, slot_s=0.5)
    assert tr.hear(a) is True  # the first clock starts the count
    assert tr.nominal(5.0) == pytest.approx(10.0)  # extended backwards before its t0
    b = next_clock(a, epoch_s=0.0, slot_s=1.0, now_s=10.0, lead_s=1.0)
    assert tr.hear(b) is False and tr.hear(b) is False  # a re-timing, heard twice
    assert tr.nominal(10.5) == pytest.approx(a.nominal(10.5))  # announced, not yet in effect
    assert tr.nominal(12.0) == pytest.approx(b.nominal(12.0))
    fresh = SlotClock(epoch_s=50.0, t0_s=51.0, x0=2.0, slot_s=0.5)
    assert tr.hear(fresh) is True  # a syncer that started afresh: another run clock
    assert tr.nominal(52.0) == pytest.approx(4.0)


def test_learners_of_different_speeds_send_each_fragment_in_the_same_slot():
    """Fast (0.10 s) and 18% slower (0.118 s) learners starting at different phases: each
    sends fragment p in every slot of the shared clock, within one of its own steps of the
    slot time, whatever its step count."""
    sched = FragmentSchedule(P=4, H=8, tau=2)
    clock = SlotClock(epoch_s=0.0, t0_s=0.0, x0=0.0, slot_s=0.109)

    def sends(step_s: float, phase_s: float) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        t, last = phase_s, clock.nominal(phase_s)
        while t < 20.0:
            t += step_s
            x = clock.nominal(t)
            for p in sched.fragments_due(last, x):
                out.setdefault(p, []).append(t)
            last = x
        return out

    fast, slow = sends(0.10, 0.0), sends(0.118, 0.037)
    for p in range(sched.P):
        n = min(len(fast[p]), len(slow[p]))
        assert n >= 20 and abs(len(fast[p]) - len(slow[p])) <= 1
        assert max(abs(a - b) for a, b in zip(fast[p][:n], slow[p][:n])) < 0.118
