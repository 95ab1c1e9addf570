"""``ddiloco train`` with learners of different layouts (``runtime.islands``): an FSDP2
island and a single process, from the configuration file, through the real launcher."""

from __future__ import annotations

import json

import pytest
from runtime_helpers import read_jsonl, tiny_config

from ddiloco.config import TrainConfig
from ddiloco.config.sections import IslandLayout


def test_layouts_are_parsed_and_checked_against_the_learners():
    assert [str(IslandLayout.parse(x)) for x in ("single", "ddp:2", "FSDP:4", "hsdp:2x3")] == [
        "single",
        "ddp:2",
        "fsdp:4",
        "hsdp:2x3",
    ]
    assert IslandLayout.parse("hsdp:2x3") == IslandLayout(6, "hsdp", 2)
    assert IslandLayout.parse("fsdp:1") == IslandLayout(1, "single")
    for bad in ("fsdp", "ddp:0", "hsdp:2", "zero:2", "hsdp:ax2"):
        with pytest.raises(ValueError, match="no layout"):
            IslandLayout.parse(bad)
    cfg = TrainConfig(learners=3, islands=" fsdp:2, ddp:2 ,single")
    assert cfg.runtime.islands == "fsdp:2,ddp:2,single"
    assert [str(cfg.runtime.island(m)) for m in (0, 1, 2, 3, None)] == [
        "fsdp:2",
        "ddp:2",
        "single",
        "single",  # a learner beyond the list (elastic) takes the uniform layout
        "single",
    ]
    assert cfg.runtime.max_island_size == 2
    with pytest.raises(ValueError, match="3 layouts for 2 learners"):
        TrainConfig(learners=2, islands="fsdp:2,ddp:2,single")
    with pytest.raises(ValueError, match="does not divide"):
        TrainConfig(island_size=3, island_sharding="hsdp")
    uniform = TrainConfig(island_size=4, island_sharding="hsdp")
    assert str(uniform.runtime.island(0)) == "hsdp:2x2"


def test_other_backends_refuse_sharded_and_mixed_layouts():
    from ddiloco.runtime.launch.backends import check_runnable

    for kw in ({"islands": "fsdp:2,single"}, {"island_size": 2, "island_sharding": "fsdp"}):
        cfg = TrainConfig(engine="processes", learners=2, **kw)
        check_runnable(cfg, "local")
        with pytest.raises(ValueError, match="local launcher"):
            check_runnable(cfg, "slurm")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shards", [1, 2])
def test_an_fsdp_island_and_a_single_process_from_the_config_file(tmp_path, shards):
    """With S = 2 syncer shards, each rank's parts of fragment p go to p's owner."""
    from ddiloco.cli import main
    from ddiloco.config.files import dump_config

    run = tmp_path / "run"
    cfg = tiny_config(
        run, learners=2, steps=40, islands="fsdp:2,single", step_budget=0, shards=shards
    )
    path = dump_config(cfg, tmp_path / "run.toml")
    assert 'islands = "fsdp:2,single"' in path.read_text()
    assert main(["train", "--config", str(path)]) == 0
    s = json.loads((run / "summary.json").read_text())
    assert s["ok"] and s["islands"] == ["fsdp:2", "single"], s
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    for pl in s["per_learner"]:
        assert pl["steps"] == 40 and pl["ledger_balance_error"] < 1e-6, pl
        assert pl["ledger_steps"]["merged"] > 0.5 * 40
    final = json.loads((run / "learner_0" / "final.json").read_text())
    assert final["island_layout"] == "fsdp:2" and final["island_size"] == 2
    assert len(final["rank_bytes_sent"]) == 2 and min(final["rank_bytes_sent"]) > 0
    # a step counts the island's tokens: 2 ranks' batches
    assert s["tokens"] == 40 * 8 * 32 * (2 + 1)
    if shards == 2:  # every shard merged the island's pushes of the fragments it owns
        for k in range(2):
            merges = [
                r for r in read_jsonl(run / f"syncer_{k}.metrics.jsonl") if r["kind"] == "merge"
            ]
            assert {r["fragment"] % 2 for r in merges} == {k}
            assert 0 in {m for r in merges for m in r["learners"]}
