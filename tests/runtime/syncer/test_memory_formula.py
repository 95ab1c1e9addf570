"""The syncer's memory follows its budget (``docs/architecture.md``, "Memory"): a real
syncer process, eight synthetic learners on the real protocol (``bench/syncer_memory.py``),
at 20M parameters. The old syncer held about 9 x 4N in the default setting and 12 x 4N with
an int4 delta-coded downlink; a term that comes back (a copy per learner, a whole-model
history, freed tensors kept resident) fails these bounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from syncer_memory import Case, formula_x4N, measure  # noqa: E402

MARGIN_X4N = 0.75
"""Beyond the formula: the process's small allocations and the rounds' timing (at 20M
parameters one fp32 model is 80 MB)."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "setting",
    [
        {"codec": "bf16", "down_codec": "fp32"},
        {"codec": "int4", "down_codec": "int4", "down_delta": True},
    ],
    ids=["default", "int4-delta-downlink"],
)
def test_steady_memory_follows_the_formula(setting):
    r = measure(params=2e7, learners=8, rounds=4, **setting)
    assert r["error"] is None, r["error"]
    expected = formula_x4N(Case(params=int(2e7), learners=8, **setting))
    steady = r["memory"]["sum"]["x4N"]["steady_above_start"]
    assert steady <= expected + MARGIN_X4N, (steady, expected)
    assert sum(r["merges"]) == 4 * 8
