"""The ``ddiloco`` command's first hour: help without torch, one-line errors, a fresh run
directory and an exportable in-process run. Real processes where the behaviour is a
process's (a closed pipe, what an interpreter imports)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

from ddiloco.cli import COMMANDS, main

pytestmark = pytest.mark.timeout(120)

TINY = ["--model", "gpt_tiny", "--vocab-size", "64", "--block-size", "32", "--batch-size", "8"]
TINY += ["-P", "4", "-H", "8", "--eval-batches", "2", "--eval-every", "1000"]


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from ddiloco.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        timeout=100,
        **kw,
    )


def test_help_imports_no_command_module_and_no_torch():
    code = (
        "import sys, contextlib, io\n"
        "from ddiloco.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'grpc')"
        " or m in ('ddiloco.sim', 'ddiloco.runtime.export'))\n"
        "print(heavy, 'train' in out.getvalue() and 'simulate' in out.getvalue())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] True"


def test_the_command_table_matches_each_commands_own_parser():
    """``ddiloco --help`` lists the help line each command's module declares."""
    for name, (module, adder, help_line) in COMMANDS.items():
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers()
        getattr(importlib.import_module(module), adder)(sub)
        helps = {a.dest: a.help for a in sub._choices_actions}
        assert helps[name] == help_line, name


def test_help_into_a_closed_pipe_ends_quietly():
    for argv in (["train", "--help"], ["--help"], ["simulate", "--help"]):
        p = subprocess.Popen(
            [sys.executable, "-c", "import sys; from ddiloco.cli import main; sys.exit(main())"]
            + argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert p.stdout is not None and p.stderr is not None
        p.stdout.read(10)  # like `head -c 10`: read a little, then close the pipe
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=60) in (0, 141), err
        assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_bare_simulate_is_a_clear_usage_error():
    r = _run("simulate")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == (
        "ddiloco simulate: error: give --system {dp,elastic-dp,decoupled} and --chips N, "
        "e.g. `ddiloco simulate --system decoupled --chips 150000`, or --grid for the whole "
        "table"
    )


def test_status_of_an_absent_syncer_is_one_line():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run("status", f"127.0.0.1:{port}", env={**os.environ, "DDILOCO_TOKEN": "tok"})
    assert r.returncode == 2
    assert r.stderr == (
        f"ddiloco status: error: no syncer answers at 127.0.0.1:{port} (UNAVAILABLE: "
        f"Connection refused); check the address, that it runs, and --tls-ca for a TLS "
        f"syncer\n"
    )


@pytest.mark.parametrize(
    "flags,msg",
    [
        (
            ["--data", "text:/nonexistent"],
            "ddiloco train: error: text path /nonexistent does not exist; check the path",
        ),
        (
            ["-P", "35", "-H", "40"],
            "ddiloco train: error: P=35 fragments but the model has only 29 tensors",
        ),
    ],
)
def test_inproc_setup_errors_are_one_line(tmp_path, flags, msg):
    r = _run("train", "--engine", "inproc", *TINY, *flags, "--steps", "2", "--out", str(tmp_path))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(msg) and r.stderr.count("\n") == 1, r.stderr


def test_a_run_directory_starts_fresh_and_an_inproc_run_exports(tmp_path, capsys):
    from safetensors.torch import load_file

    from ddiloco.cli import train_config_from_args
    from ddiloco.recipe import eval_setup, evaluate, new_model

    out = tmp_path / "latest"
    # what an earlier real-process run of 4 learners left, and a file of the user's
    for stale in ("learner_3/metrics.jsonl", "logs/learner_3.log", "checkpoint/syncer.pt"):
        (out / stale).parent.mkdir(parents=True, exist_ok=True)
        (out / stale).write_text("old")
    (out / "chaos.jsonl").write_text("{}\n")
    (out / "notes.txt").write_text("mine")
    argv = ["train", "--engine", "inproc", *TINY, "-M", "2", "--steps", "16", "--out", str(out)]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.toml",
        "final_model.safetensors",
        "metrics.jsonl",
        "notes.txt",
        "summary.json",
    ]
    model_file = tmp_path / "m.safetensors"
    assert main(["export", str(out), "--out", str(model_file)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {model_file}: 29 tensors")
    cfg, _ = train_config_from_args(argv[1:])
    model = new_model(cfg)
    model.load_state_dict(load_file(str(model_file)))  # strict: every tensor, nothing else
    _, _, _, evals = eval_setup(cfg)
    assert evaluate(model, evals) == pytest.approx(summary["final_eval_loss"], abs=1e-5)
    # an --out whose folder does not exist is an error, not a folder made on the way
    missing = tmp_path / "no" / "dir" / "m.safetensors"
    assert main(["export", str(out), "--out", str(missing)]) == 2
    assert "the folder of --out" in capsys.readouterr().err
    assert not missing.parent.parent.exists()


def test_the_syncers_help_lists_no_setting_it_refuses():
    r = _run("syncer", "--help")
    assert r.returncode == 0, r.stderr
    flags = set(re.findall(r"(?<![\w-])(--?[\w.-]+)", r.stdout))
    refused = {"-P", "-H", "--fragments", "--codec", "--fragmentation"}
    refused |= {"--sync.fragments", "--sync.H", "--sync.codec", "--sync.fragmentation"}
    assert not flags & refused, sorted(flags & refused)
    # what it takes is there: its own options and the syncer's share of [sync] and [runtime]
    assert {"--down-codec", "--tau", "--quorum", "-K", "--checkpoint-dir", "--port"} <= flags


def test_the_syncer_refuses_the_learners_settings(tmp_path):
    r = _run("syncer", "-P", "4", "-H", "12", "--codec", "int4", "--port", "0")
    assert r.returncode == 2
    assert r.stderr.startswith(
        "ddiloco syncer: error: -P 4, -H 12, --codec int4: the learners' settings, which a "
        "syncer does not take"
    )
    # each spelling of them, also with = or attached to a short flag
    for argv, named in (
        (["--sync.H=12"], "--sync.H 12"),
        (["-P4"], "-P 4"),
        (["--fragmentation", "strided"], "--fragmentation strided"),
    ):
        r = _run("syncer", *argv, "--port", "0")
        assert r.returncode == 2
        assert r.stderr.startswith(f"ddiloco syncer: error: {named}: the learners' settings")
    # a run file that both the syncer and the learners read may hold them
    cfg = tmp_path / "run.toml"
    cfg.write_text("[sync]\nfragments = 4\nH = 12\ncodec = 'int4'\n")
    from ddiloco.config.flags import parse_syncer

    assert parse_syncer(["--config", str(cfg)]).sync.fragments == 4
