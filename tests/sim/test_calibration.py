from ddiloco.sim.calibration import PUBLISHED, paper_config
from ddiloco.sim.stats import simulate


def test_every_published_cell_is_reproduced_within_3pp():
    worst = []
    for (system, m, n), published in PUBLISHED.items():
        s = simulate(paper_config(system, n, m), seeds=6)
        worst.append((abs(s.goodput - published), system, m, n, s.goodput))
    worst.sort(reverse=True)
    assert worst[0][0] <= 0.03, worst[:3]


def test_learners_on_n_chips_match_elastic_dp_on_n_over_m_chips():
    for m in (2, 8):
        d = simulate(paper_config("decoupled", 1_200_000, m), seeds=4)
        e = simulate(paper_config("elastic-dp", 1_200_000 // m), seeds=4, first_seed=50)
        assert abs(d.goodput - e.goodput) < 0.02
