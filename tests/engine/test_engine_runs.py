"""The in-process engine end to end: it trains, accounts and fails gracefully."""

import json

import pytest

from ddiloco.cli import main
from ddiloco.config import TrainConfig, preset
from ddiloco.engine import run

SMALL = dict(
    learners=3,
    steps=60,
    H=12,
    fragments=4,
    batch_size=8,
    block_size=32,
    eval_every=30,
    progress=False,
    vocab_size=16,
)


@pytest.mark.timeout(120)
def test_decoupled_trains_and_ledger_balances_under_failures(tmp_path):
    cfg = TrainConfig(out=str(tmp_path), mtbi_s=25.0, downtime_s=5.0, step_noise=0.1, **SMALL)
    s = run(cfg)
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.3
    assert s["failures"] > 0
    assert 0.0 < s["goodput"] < 1.0 and 0.0 < s["uptime"] <= 1.0
    for pl in s["per_learner"]:
        led = pl["ledger_steps"]
        assert pl["ledger_balance_error"] < 1e-6
        assert led["pending"] == pytest.approx(0.0, abs=1e-9)
        assert led["unpushed"] == pytest.approx(0.0, abs=1e-9)  # the final flush pushes all
        assert pl["syncer_tokens"]["tokens_pending"] == pytest.approx(0.0, abs=1e-6)
    # a global budget of M*N inner steps; learners stop at their first step boundary after it
    computed = sum(pl["ledger_steps"]["computed"] for pl in s["per_learner"])
    assert 3 * 60 <= computed < 3 * 60 + 3
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in rows}
    assert {"config", "eval", "merge", "failure", "rejoin", "final"} <= kinds
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "method",
        "engine",
        "learners",
        "steps",
        "tokens",
        "final_eval_loss",
        "entropy_floor",
        "goodput",
        "uptime",
        "bytes_up",
        "bytes_down",
        "merges",
        "wall_s",
    ):
        assert key in summary


@pytest.mark.timeout(120)
def test_failures_cost_sync_methods_more_than_decoupled(tmp_path):
    base = TrainConfig(out=str(tmp_path / "x"), mtbi_s=40.0, downtime_s=8.0, **SMALL)
    dec = run(base.replace(out=str(tmp_path / "dec")))
    dil = run(base.replace(method="diloco", out=str(tmp_path / "dil")))
    assert dec["goodput"] > dil["goodput"]
    assert dec["uptime"] > dil["uptime"]


@pytest.mark.timeout(120)
def test_bytes_ordering_dp_vs_decoupled(tmp_path):
    dp = run(TrainConfig(method="dp", out=str(tmp_path / "dp"), **{**SMALL, "steps": 24}))
    dec = run(TrainConfig(out=str(tmp_path / "dec"), codec="int4", **{**SMALL, "steps": 24}))
    assert dec["bytes_up"] * 20 < dp["bytes_up"]


def test_config_validation_messages():
    with pytest.raises(ValueError, match="quorum K=5 cannot exceed learners M=4"):
        TrainConfig(quorum=5)
    with pytest.raises(ValueError, match="fragments P=30 must be <= H=24"):
        TrainConfig(fragments=30)
    with pytest.raises(ValueError, match="method must be one of"):
        TrainConfig(method="sync")
    with pytest.raises(ValueError, match="speeds has 2 entries for 4 learners"):
        TrainConfig(speeds=(1.0, 1.0))
    with pytest.raises(ValueError, match="downtime"):
        TrainConfig(mtbi_s=10.0)
    with pytest.raises(ValueError, match="sync.down_delta .* with fp32 it changes nothing"):
        TrainConfig(down_delta=True)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")
    assert preset("hetero", TrainConfig(learners=4)).world.speeds == (1.0, 1.0, 1 / 1.18, 1 / 1.18)


@pytest.mark.timeout(120)
def test_cli_train_smoke(tmp_path, capsys):
    rc = main(
        [
            "train",
            "--engine",
            "inproc",
            "--steps",
            "12",
            "-M",
            "2",
            "-H",
            "6",
            "-P",
            "2",
            "--batch-size",
            "4",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--seed",
            "3",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "final eval loss" in out and "goodput" in out
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 12


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["train", "--steps", "0"], "steps must be >= 1, got 0"),
        (["train", "--method", "sync"], "method"),
        (["train", "--speeds", "a,b"], "comma-separated"),
        (["train", "--codec", "int3"], "sync.codec: unknown codec 'int3'"),
        (["train", "--preset", "nope"], "unknown preset 'nope'"),
        (["train", "--config", "/nonexistent/run.toml"], "does not exist"),
    ],
)
def test_cli_rejects_bad_flags(argv, msg, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # the flag parser's own errors (a choice, a type)
        rc = e.code
    assert rc == 2
    assert msg in " ".join(capsys.readouterr().err.split())


def test_cli_rejects_invalid_combination(capsys):
    assert main(["train", "--engine", "inproc", "-K", "9"]) == 2
    assert "quorum K=9 cannot exceed learners M=4" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("install", ["overwrite", "rebase"])
def test_one_ledger_counts_tokens_once_per_fragment_and_the_overlap_by_the_install_rule(
    tmp_path, install
):
    cfg = TrainConfig(out=str(tmp_path), install=install, **SMALL)  # P = 4, H = 12, tau = 2
    s = run(cfg)
    per_step = cfg.data.batch_size * cfg.data.block_size
    merged = sum(pl["ledger_steps"]["merged"] for pl in s["per_learner"])
    syncer = sum(pl["syncer_tokens"]["tokens_merged"] for pl in s["per_learner"])
    # the syncer's token ledger agrees with the learners' step ledger (not P times it)
    assert syncer == pytest.approx(merged * per_step, rel=0.03)
    assert s["install"] == install
    for pl in s["per_learner"]:
        assert pl["ledger_balance_error"] < 1e-6
        assert pl["install_delay_steps"] >= cfg.sync.tau
        if install == "overwrite":
            assert pl["ledger_steps"]["overwritten"] > 0
        else:
            assert pl["ledger_steps"]["overwritten"] == pl["ledger_steps"]["lost"] == 0
    if install == "overwrite":
        # the tau overlap steps are replaced at install: they do not count as merged
        assert 0.5 < s["goodput"] <= 1 - cfg.sync.tau / cfg.sync.H + 1e-9
    else:
        # rebased installs keep them: they are merged with the next push
        assert s["goodput"] > 1 - cfg.sync.tau / cfg.sync.H + 0.05
    assert 1.0 <= s["learners_per_merge"] <= cfg.learners


@pytest.mark.timeout(120)
def test_a_delta_coded_downlink_keeps_the_quality_a_coarse_one_loses(tmp_path):
    # int2 quantises the merged weights themselves too coarsely; as deltas against each
    # learner's copy (the rounding error carried into the next fetch) it costs little
    loss = {}
    for name, kw in {
        "fp32": dict(down_codec="fp32"),
        "int2": dict(down_codec="int2"),
        "int2-delta": dict(down_codec="int2", down_delta=True),
    }.items():
        cfg = TrainConfig(out=str(tmp_path / name), codec="int8", **{**SMALL, "eval_every": 1000})
        loss[name] = run(cfg.replace(**kw))["final_eval_loss"]
    assert loss["int2-delta"] < loss["int2"] - 0.03, loss
    assert loss["int2-delta"] < loss["fp32"] * 1.01, loss


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["dp", "decoupled"])
def test_bf16_autocast_reaches_the_inprocess_engine(tmp_path, method):
    """runtime.autocast = bf16 runs the inner steps' forward in bf16 in this engine too: the
    run trains, is deterministic per seed, and differs from the fp32 run."""
    small = {**SMALL, "steps": 30, "eval_every": 30}

    def final(autocast, out):
        cfg = TrainConfig(method=method, out=str(tmp_path / out), autocast=autocast, **small)
        return run(cfg)

    bf16, again, fp32 = final("bf16", "a"), final("bf16", "b"), final("none", "c")
    assert bf16["final_eval_loss"] < bf16["initial_eval_loss"] - 0.2
    assert bf16["final_eval_loss"] == again["final_eval_loss"]
    assert bf16["final_eval_loss"] != fp32["final_eval_loss"]
    assert bf16["final_eval_loss"] == pytest.approx(fp32["final_eval_loss"], rel=0.05)


def _eval_rows(out) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in rows if r["kind"] == "eval"}


@pytest.mark.timeout(120)
def test_diloco_eval_rows_are_the_model_at_the_step_they_name(tmp_path):
    """DiLoCo's global model changes at merges only (every H = 12 steps here): the row of
    step 18 is the model of the merge at step 12, the row of step 36 that of the merge at
    36 itself. Evaluating does not change training, so a run that evaluates every 12 steps
    gives the same losses at those merges."""
    small = {**SMALL, "steps": 48}
    runs = {}
    for every in (12, 18):
        out = tmp_path / f"every{every}"
        run(TrainConfig(method="diloco", out=str(out), **{**small, "eval_every": every}))
        runs[every] = _eval_rows(out)
    assert runs[18][18] == runs[12][12]
    assert runs[18][36] == runs[12][36]
    assert runs[18][48] == runs[12][48]  # the final model


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["diloco", "streaming", "decoupled"])
def test_final_merge_reaches_every_method(tmp_path, method):
    """``sync.final_merge`` decides how each method merges its last, partial round (60 steps
    at H = 12 is a whole round for DiLoCo, so it ends at 54 there): the runs share every
    step before it and differ at its end; ``none`` keeps the model of the last regular
    merge."""
    small = {**SMALL, "steps": 54 if method == "diloco" else 60, "eval_every": 24}
    finals = {}
    for how in ("average", "nesterov", "none"):
        out = tmp_path / how
        cfg = TrainConfig(method=method, out=str(out), final_merge=how, **small)
        finals[how] = run(cfg)["final_eval_loss"]
        rows = _eval_rows(out)
        assert rows[24] == _eval_rows(tmp_path / "average")[24]  # the same run until the end
    assert len(set(finals.values())) == 3, finals
