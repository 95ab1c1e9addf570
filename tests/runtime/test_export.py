"""``ddiloco export``: the global model out of a run directory or a live syncer, as a
safetensors state_dict that the built-in model class loads."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from runtime_helpers import init_syncer, tiny_config, tiny_model
from safetensors.torch import load_file

from ddiloco.cli import main
from ddiloco.runtime.launch.launcher import Launcher
from ddiloco.runtime.learner.client import SyncerClient


@pytest.mark.timeout(180)
def test_export_of_a_run_evaluates_to_the_runs_final_loss(tmp_path, capsys):
    from ddiloco.recipe import eval_setup, evaluate, new_model

    cfg = tiny_config(tmp_path / "run", learners=2, steps=40)
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"] and s["merges"] > 0, s
    out = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    model = new_model(cfg)  # a fresh built-in model: the run's initial weights
    _, _, _, evals = eval_setup(cfg)
    assert evaluate(model, evals) == pytest.approx(s["initial_eval_loss"], abs=1e-5)
    model.load_state_dict(load_file(str(out)))  # strict: every tensor, nothing else
    assert evaluate(model, evals) == pytest.approx(s["final_eval_loss"], abs=1e-5)
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.3
    # a damaged fragment file of the checkpoint is an error that says so, not a model
    manifest = json.loads((tmp_path / "run" / "checkpoint" / "syncer.json").read_text())
    frag = tmp_path / "run" / "checkpoint" / manifest["data"] / manifest["fragments"][0]["file"]
    data = bytearray(frag.read_bytes())
    data[-1] ^= 0x01
    frag.write_bytes(bytes(data))
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 2
    assert "fails its SHA-256 checksum" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_export_from_a_live_syncer_and_clear_errors(syncer_factory, tmp_path, capsys, monkeypatch):
    s = syncer_factory()
    model = tiny_model()
    client = SyncerClient(s.address, s.token)
    init_syncer(client, model, P=2)
    client.close()
    monkeypatch.setenv("DDILOCO_TOKEN", s.token)
    out = tmp_path / "live.safetensors"
    assert main(["export", s.address, "--out", str(out)]) == 0
    got = load_file(str(out))
    want = dict(model.named_parameters())
    assert sorted(got) == sorted(want)  # safetensors stores names sorted
    for n, t in want.items():
        assert torch.equal(got[n], t.detach()), n
    fresh = tiny_model()
    fresh.load_state_dict(got)

    monkeypatch.setenv("DDILOCO_TOKEN", "wrong")
    assert main(["export", s.address, "--out", str(out)]) == 2
    assert "refused the token" in capsys.readouterr().err

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert main(["export", f"127.0.0.1:{free}", "--out", str(out), "--timeout-s", "2"]) == 2
    assert "cannot reach a syncer at" in capsys.readouterr().err

    assert main(["export", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty_run").mkdir()
    assert main(["export", str(tmp_path / "empty_run"), "--out", str(out)]) == 2
    assert "no syncer checkpoint in" in capsys.readouterr().err
    bad = tmp_path / "bad" / "syncer.json"
    bad.parent.mkdir()
    bad.write_bytes(b"\x80\x02 not a checkpoint")
    assert main(["export", str(bad.parent), "--out", str(out)]) == 2
    assert "not a readable ddiloco syncer checkpoint" in capsys.readouterr().err
