"""The TOML form of the run configuration: round trip, errors, and replay of a run from
its directory's ``config.toml``."""

from __future__ import annotations

import json

import pytest

from ddiloco.cli import main
from ddiloco.config import ChaosConfig, TrainConfig, dumps_config, load_config, loads_config
from ddiloco.config.flags import ConfigError, parse_syncer, parse_train


def test_every_field_round_trips_through_toml():
    cfg = TrainConfig(
        method="streaming",
        engine="inproc",
        learners=3,
        steps=77,
        seed=5,
        model="moe_tiny",
        batch_size=4,
        block_size=16,
        vocab_size=40,
        inner_optimizer="sgd",
        lr_schedule="constant",
        fragments=3,
        H=9,
        tau=1,
        quorum=2,
        grace=False,
        codec="int4/256",
        down_codec="bf16",
        fragmentation="strided",
        schedule="steps",
        scale_partial=False,
        anchor="base",
        history=20,
        speeds=(1.0, 0.5, 0.75),
        mtbi_s=30.0,
        downtime_s=4.0,
        chaos="kill30",
        port=5000,
        bulk_port=-1,
        tls_cert="c.pem",
        tls_key="k.pem",
        step_budget=0,
        island_size=2,
        log_level="debug",
        device="cpu",
        autocast="bf16",
    )
    assert loads_config(dumps_config(cfg)) == cfg
    assert loads_config(dumps_config(TrainConfig())) == TrainConfig()
    chaos = ChaosConfig(
        seed=9,
        slowdown={1: 1.5},
        kill_at_step=((0, 10), (1, 20)),
        stop_at_step=((1, 5, 0.5),),
        syncer_kill_at_s=(15.0,),
        add_learner_at_step=(40,),
        link_cut=((0, 7, 1.5),),
    )
    assert loads_config(dumps_config(cfg.replace(chaos=chaos))).chaos == chaos


def test_a_file_of_the_older_form_names_the_chaos_in_world(tmp_path):
    old = loads_config('[world]\nchaos = "kill30"\n')
    assert old.chaos == TrainConfig(chaos="kill30").chaos
    assert old.chaos.kill_mean_interval_s == 30.0 and old.chaos.seed is None
    with pytest.raises(ValueError, match="not also as world.chaos"):
        loads_config('[world]\nchaos = "kill30"\n[chaos]\nseed = 1\n')


@pytest.mark.parametrize(
    "text,msg",
    [
        ("[sync]\nHH = 3\n", "unknown field sync.HH; sync has"),
        ("nope = 1\n", "unknown field 'nope'; top-level fields are"),
        ("[sync]\nquorum = 0\n", "sync.quorum must be >= 1, got 0"),
        ("sync = 3\n", "sync must be a table ([sync])"),
        ("[world]\nspeeds = [1.0, 0.0, 1.0, 1.0]\n", "world.speeds must all be > 0"),
        ("[sync\n", "not valid TOML"),
        # typed like the flags: no int from a float, no bool or number from a string
        ("steps = 7.9\n", "run.toml: steps must be an integer, got 7.9"),
        ('steps = "many"\n', "run.toml: steps must be an integer, got 'many'"),
        ('[sync]\ngrace = "no"\n', "sync.grace must be true or false, got 'no'"),
        ('[sync]\ngamma = "0.5"\n', "sync.gamma must be a number, got '0.5'"),
        ('[sync]\nmerge_rule = "best"\n', "sync.merge_rule must be one of 'rda', 'average'"),
        ('[world]\nspeeds = [1, "x"]\n', "world.speeds must be a list of numbers"),
    ],
)
def test_bad_files_say_which_field(text, msg):
    with pytest.raises(
        ValueError,
        match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)").replace("]", r"\]"),
    ):
        loads_config(text, source="run.toml")


def test_typed_values_pass_and_a_bad_one_is_one_line_on_train(tmp_path, capsys):
    from ddiloco.cli import main

    cfg = loads_config(
        "steps = 7\n[sync]\nalpha = 0\ngrace = false\n[world]\nspeeds = [1, 2, 1, 1]\n"
    )
    assert cfg.steps == 7 and cfg.sync.grace is False and cfg.world.speeds == (1, 2, 1, 1)
    bad = tmp_path / "run.toml"
    bad.write_text("steps = 7.9\n")
    assert main(["train", "--config", str(bad), "--engine", "inproc"]) == 2
    err = capsys.readouterr().err
    assert err == f"ddiloco train: error: {bad}: steps must be an integer, got 7.9\n"


def test_file_then_preset_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("learners = 6\nsteps = 50\n[sync]\nH = 12\nquorum = 2\n")
    cfg = parse_train(["--config", str(path), "--preset", "hetero", "-K", "3"]).run
    assert (cfg.learners, cfg.steps, cfg.sync.H, cfg.sync.quorum) == (6, 50, 12, 3)
    assert (
        len(cfg.world.speeds) == 6 and cfg.world.step_noise == 0.1
    )  # the preset, sized by the file's M
    assert parse_train(["--preset", "hetero", "-M", "2"]).run.world.speeds == (1.0, 1 / 1.18)
    with pytest.raises(ConfigError, match="does not exist"):
        parse_train(["--config", str(tmp_path / "missing.toml")])


def test_the_syncer_reads_its_sections_and_the_budget_from_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "learners = 3\nsteps = 40\n[sync]\nquorum = 2\nscale_partial = false\n"
        "[runtime]\nheartbeat_timeout_s = 7.5\n"
    )
    from ddiloco.runtime.cli import syncer_from_args

    args = parse_syncer(["--config", str(path), "--gamma", "0.25"])
    monkey = pytest.MonkeyPatch()
    monkey.setenv("DDILOCO_TOKEN", "t")
    try:
        server = syncer_from_args(args)
        bare = syncer_from_args(parse_syncer(["-K", "6"]))
    finally:
        monkey.undo()
    assert server.syncer.policy.quorum == 2 and server.syncer.policy.gamma == 0.25
    assert server.syncer.scale_partial is False and server.heartbeat_timeout_s == 7.5
    assert server.step_budget == 3 * 40
    assert bare.step_budget == 0 and bare.syncer.policy.quorum == 6  # a bare syncer: no M


@pytest.mark.timeout(240)
def test_a_run_replays_from_its_config_toml(tmp_path, capsys):
    first, again = tmp_path / "first", tmp_path / "again"
    argv = [
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
        "--block-size",
        "32",
        "--codec",
        "int4",
        "--mtbi-s",
        "8",
        "--downtime-s",
        "2",
        "--seed",
        "3",
        "--chaos",
        "kill30",
        "--chaos.kill-downtime-s",
        "4",
        "--no-progress",
        "--out",
        str(first),
    ]
    assert main(argv) == 0
    saved = load_config(first / "config.toml")
    assert saved.engine == "inproc" and saved.sync.codec == "int4" and saved.world.mtbi_s == 8.0
    # the chaos section is saved with the rest (the in-process engine injects none of it)
    assert saved.chaos == ChaosConfig(kill_mean_interval_s=30.0, kill_downtime_s=4.0)
    assert main(["train", "--config", str(first / "config.toml"), "--out", str(again)]) == 0
    a, b = (json.loads((d / "summary.json").read_text()) for d in (first, again))
    for s in (a, b):
        s.pop("wall_s")
        s["config"].pop("out")
    assert a == b
    assert (again / "config.toml").read_text() == (first / "config.toml").read_text().replace(
        str(first), str(again)
    )
