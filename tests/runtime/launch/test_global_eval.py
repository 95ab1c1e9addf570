"""The launcher's evaluations of the global model during a real run (``GlobalEval``): the
in-process engine's schedule, from the syncer's published fragments."""

from __future__ import annotations

import time

import pytest
from runtime_helpers import tiny_config

from ddiloco.runtime.launch.summary import GlobalEval


class _Syncer:
    """Answers ``fetch(None, exact=True)`` with every fragment of ``model`` at ``version``,
    or raises while ``down``."""

    def __init__(self, cfg, model) -> None:
        from ddiloco.runtime.transport.spec import fragmentation_from_spec, model_spec

        frag = fragmentation_from_spec(
            model_spec(model, cfg.sync.fragments, cfg.sync.fragmentation)
        )
        params = dict(model.named_parameters())
        self.fragments = [
            [params[n].detach().flatten().clone() for n in f.names] for f in frag.fragments
        ]
        self.version, self.down, self.fetches = 0, False, 0

    def fetch(self, fragments, timeout_s=60.0, learner=None, exact=False):
        assert fragments is None and exact
        self.fetches += 1
        if self.down:
            raise ConnectionError("syncer down")
        self.version += 1
        return {p: (self.version, ts, 0) for p, ts in enumerate(self.fragments)}


@pytest.mark.timeout(60)
def test_the_global_model_is_evaluated_every_eval_every_steps_per_learner(tmp_path):
    import torch

    from ddiloco.recipe import evaluate, new_model

    cfg = tiny_config(tmp_path, learners=2, steps=50, eval_every=10)
    ev = GlobalEval(cfg, wall0=time.time())
    trained = new_model(cfg)
    with torch.no_grad():
        for t in trained.parameters():
            t.mul_(0.5)
    syncer = _Syncer(cfg, trained)
    # steps_done is every learner's steps together: 10 per learner is 20 in all
    for done in (0, 8, 19, 20, 25, 39, 47):
        ev.poll(syncer, {"steps_done": done})
        ev.wait()
    syncer.down = True  # a multiple reached while the syncer is unreachable: skipped
    ev.poll(syncer, {"steps_done": 61})
    ev.wait()
    syncer.down = False
    ev.poll(syncer, {"steps_done": 79})
    ev.poll(syncer, {"steps_done": 81})
    ev.wait()
    ev.poll(syncer, {"steps_done": 100, "budget_spent": True})  # the final evaluation's
    ev.wait()
    assert [r["step"] for r in ev.rows] == [10.0, 23.5, 40.5]
    assert syncer.fetches == 4
    loss = evaluate(trained, ev.evals)
    for r in ev.rows:
        assert r["kind"] == "eval" and r["eval_loss"] == pytest.approx(loss)
        assert r["gap"] == pytest.approx(loss - ev.floor)
        assert r["t_s"] >= 0
    assert [r["versions"] for r in ev.rows] == [1 * 4, 2 * 4, 3 * 4]  # summed over P = 4
    assert ev.init_loss == pytest.approx(evaluate(new_model(cfg), ev.evals))
    assert ev.init_loss != pytest.approx(loss)
