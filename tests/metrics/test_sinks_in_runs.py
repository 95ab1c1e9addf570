"""The in-process engine, the syncer and the learners all report through the sinks a run's
``metrics_sinks`` names: each sink is read back after a real run."""

from __future__ import annotations

import pytest
from runtime_helpers import read_jsonl, tiny_config


def _tb_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_inproc_engine_reports_through_every_sink(tmp_path):
    for pkg in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(pkg, reason=f"the {pkg} extra is not installed")
    import mlflow

    from ddiloco.config import TrainConfig
    from ddiloco.engine import run

    out = tmp_path / "run"
    cfg = TrainConfig(
        out=str(out),
        learners=2,
        steps=40,
        eval_every=20,
        model="gpt_tiny",
        batch_size=4,
        block_size=16,
        fragments=2,
        H=8,
        eval_batches=2,
        progress=False,
        metrics_sinks="jsonl,tensorboard,wandb,mlflow",
    )
    summary = run(cfg)
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [(round(r["step"]), r["eval_loss"]) for r in rows if r["kind"] == "eval"]
    assert len(evals) >= 3 and evals[0][0] == 0
    n_merges = sum(1 for r in rows if r["kind"] == "merge")
    assert n_merges > 0
    tb = _tb_scalars(out / "tensorboard" / "engine")
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in tb["eval/eval_loss"]] == evals
    assert len(tb["merge/version"]) == n_merges
    assert tb["final/eval_loss"][0][1] == pytest.approx(summary["final_eval_loss"], rel=1e-6)
    assert len(list((out / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    client = mlflow.MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (r,) = client.search_runs([client.get_experiment_by_name("ddiloco").experiment_id])
    assert r.info.run_name == "engine" and r.data.params["method"] == "decoupled"
    hist = sorted(
        (m.step, m.value) for m in client.get_metric_history(r.info.run_id, "eval/eval_loss")
    )
    assert hist == [(s, pytest.approx(v, rel=1e-6)) for s, v in evals]


@pytest.mark.timeout(120)
def test_syncer_and_learner_processes_report_through_the_sinks(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    import mlflow

    from ddiloco.runtime.launch.launcher import Launcher

    out = tmp_path / "run"
    cfg = tiny_config(out, learners=2, steps=30, metrics_sinks="tensorboard,mlflow")
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    from ddiloco.config import load_config

    assert load_config(out / "config.toml").runtime.metrics_sinks == "tensorboard,mlflow"
    for m in range(2):
        steps = [
            (r["step"], r["loss"])
            for r in read_jsonl(out / f"learner_{m}" / "metrics.jsonl")
            if r["kind"] == "step"
        ]
        tb = _tb_scalars(out / "tensorboard" / f"learner_{m}")
        assert [(st, pytest.approx(v, rel=1e-6)) for st, v in tb["step/loss"]] == steps
    merges = [r for r in read_jsonl(out / "syncer.metrics.jsonl") if r["kind"] == "merge"]
    assert len(merges) == s["merges"] > 0
    tb = _tb_scalars(out / "tensorboard" / "syncer")
    assert [v for _, v in tb["merge/n_learners"]] == [len(r["learners"]) for r in merges]
    assert _tb_scalars(out / "tensorboard" / "run")["final/eval_loss"][0][1] == pytest.approx(
        s["final_eval_loss"], rel=1e-6
    )
    client = mlflow.MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    runs = {
        r.info.run_name: r
        for r in client.search_runs([client.get_experiment_by_name("ddiloco").experiment_id])
    }
    assert sorted(runs) == ["learner_0", "learner_1", "run", "syncer"]
    assert len(client.get_metric_history(runs["syncer"].info.run_id, "merge/version")) == len(
        merges
    )


def test_cli_names_the_missing_extra(tmp_path, capsys, monkeypatch):
    import importlib.util

    from ddiloco.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    rc = main(
        [
            "train",
            "--engine",
            "inproc",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
            "--metrics-sink",
            "jsonl,wandb",
        ]
    )
    assert rc == 2
    assert "pip install ddiloco[wandb]" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "--engine",
                "inproc",
                "--steps",
                "2",
                "--out",
                str(tmp_path),
                "--metrics-sink",
                "csv",
            ]
        )
        == 2
    )
    assert "unknown metrics sink 'csv'" in capsys.readouterr().err


def test_syncer_config_checks_its_sinks():
    from ddiloco.runtime.syncer.server import SyncerServerConfig

    with pytest.raises(ValueError, match="need a folder.*--metrics-dir"):
        SyncerServerConfig(token="t", metrics_sinks=("tensorboard",))
    with pytest.raises(ValueError, match="unknown metrics sink 'statsd'"):
        SyncerServerConfig(token="t", metrics_dir="/tmp", metrics_sinks=("statsd",))
    cfg = SyncerServerConfig(
        token="t", metrics_path="/tmp/x.jsonl", metrics_sinks=("jsonl", "mlflow")
    )
    assert cfg.metrics_sinks == ("mlflow",)  # the JSONL is metrics_path
