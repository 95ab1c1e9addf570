"""Goodput from the learners' step ledgers as the syncer keeps them (pure)."""

import pytest

from ddiloco.runtime.observe.accounting import fold, goodput_of, instance_totals, learner_totals


def rep(process, computed, merged, compute_s, pending=0.0, unpushed=0.0, step=None):
    other = computed - merged - pending - unpushed
    return {
        "process": process,
        "step": step if step is not None else int(computed),
        "tokens": int(computed) * 100,
        "compute_s": compute_s,
        "ledger": {
            "computed": computed,
            "merged": merged,
            "overwritten": other,
            "pending": pending,
            "unpushed": unpushed,
        },
    }


def test_a_process_that_ended_loses_what_it_had_not_got_merged():
    r = rep("a", 10.0, 6.0, 5.0, pending=1.0, unpushed=2.0)
    live = instance_totals(r)
    assert live["useful_s"] == pytest.approx(3.0) and live["ledger"]["pending"] == 1.0
    gone = instance_totals(r, ended=True)
    assert gone["ledger"]["lost"] == 3.0 and gone["ledger"]["pending"] == 0.0
    assert gone["useful_s"] == live["useful_s"]


def test_a_restarted_learner_carries_steps_tokens_and_useful_time():
    carried = fold(None, rep("a", 10.0, 8.0, 4.0, unpushed=2.0))
    info = {"state": "live", "carried": carried, "report": rep("b", 5.0, 5.0, 2.0)}
    tot = learner_totals(info)
    assert tot["steps"] == 15 and tot["tokens"] == 1500
    assert tot["useful_s"] == pytest.approx(4.0 * 0.8 + 2.0)
    assert tot["ledger"]["lost"] == 2.0 and tot["ledger"]["computed"] == 15.0


def test_goodput_is_useful_chip_time_over_all_chip_time():
    st = {
        "run_s": 10.0,
        "learners": {
            "0": {"state": "left", "report": rep("a", 10.0, 9.0, 10.0)},
            "1": {
                "state": "left",
                "carried": fold(None, rep("b", 4.0, 2.0, 4.0)),
                "report": rep("c", 4.0, 4.0, 4.0),
            },
        },
    }
    assert goodput_of(st) == pytest.approx((9.0 + 2.0 + 4.0) / (2 * 10.0))
    assert goodput_of({"run_s": None, "learners": {}}) is None
