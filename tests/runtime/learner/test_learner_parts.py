"""The learner's parts alone: the stats keep the form the reports serialise."""

from __future__ import annotations

import pytest

from ddiloco.runtime.learner.context import LearnerStats

pytestmark = pytest.mark.timeout(30)


def test_the_stats_read_as_the_mapping_the_reports_carry():
    stats = LearnerStats()
    assert list(dict(stats)) == [
        "bytes_sent",
        "bytes_received",
        "pushes",
        "pushes_accepted",
        "pushes_rejected",
        "installs",
        "install_delay_steps",
        "reconnects",
        "fetch_s",
        "push_errors",
    ]
    stats.pushed(100, True)
    stats.pushed(50, False)
    stats.fetched(10, 2.0)
    stats.fetched(10, 1.0)
    assert stats["bytes_sent"] == 150 and stats["pushes"] == 2
    assert stats["pushes_accepted"] == 1 and stats["pushes_rejected"] == 1
    assert stats["bytes_received"] == 20 and stats["fetch_s"] == pytest.approx(1.8)
    assert {**stats}["pushes"] == 2
    with pytest.raises(KeyError):
        stats["nope"]
