"""``ddiloco export``: the global model out of a run directory or a live syncer, as a
safetensors state_dict that the built-in model class loads."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import torch
from runtime_helpers import init_syncer, tiny_config, tiny_model
from safetensors.torch import load_file

import ddiloco
from ddiloco.cli import main
from ddiloco.runtime.export import ExportError
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
    # the run directory and the exported file each build the model they hold
    for source in (tmp_path / "run", out):
        loaded = ddiloco.load_model(source)
        assert evaluate(loaded, evals) == pytest.approx(s["final_eval_loss"], abs=1e-5)
    # a damaged fragment file of the checkpoint is an error that says so, not a model
    manifest = json.loads((tmp_path / "run" / "checkpoint" / "syncer.json").read_text())
    frag = tmp_path / "run" / "checkpoint" / manifest["fragments"][0]["file"]
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
    # a live syncer knows the tensors, not the model class: load_model says what to do
    with pytest.raises(ExportError, match="does not record which model it holds"):
        ddiloco.load_model(out)

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


def _token_folder(folder, vocab: int, n: int = 20_000):
    """A ``bin:`` folder as ``ddiloco prepare`` writes it: one shard and meta.json."""
    folder.mkdir(parents=True)
    np.random.default_rng(0).integers(0, vocab, size=n).astype(np.uint16).tofile(
        folder / "tokens_000.bin"
    )
    meta = {
        "vocab_size": vocab,
        "dtype": "uint16",
        "shards": [{"file": "tokens_000.bin", "tokens": n}],
    }
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.timeout(120)
def test_load_model_builds_the_runs_model_from_any_directory(tmp_path, monkeypatch, capsys):
    """A run on a relative ``bin:`` folder of vocabulary 100 (not the configured 64): its
    run directory and its export load from elsewhere, without the data, as the run's model;
    its config.toml read from elsewhere refuses the missing data instead of guessing."""
    from ddiloco.config import TrainConfig, load_config
    from ddiloco.engine import run
    from ddiloco.recipe import eval_setup, evaluate, new_model

    monkeypatch.chdir(tmp_path)
    _token_folder(tmp_path / "data" / "tok", vocab=100)
    cfg = TrainConfig(
        out="runs/r",
        method="diloco",
        learners=2,
        steps=4,
        data="bin:data/tok",
        model="gpt_tiny",
        batch_size=4,
        block_size=16,
        vocab_size=64,
        fragments=1,
        H=2,
        tau=1,
        eval_batches=2,
        progress=False,
    )
    s = run(cfg)
    _, _, _, evals = eval_setup(cfg)
    assert main(["export", "runs/r", "--out", "model.safetensors"]) == 0
    capsys.readouterr()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for source in (tmp_path / "runs" / "r", tmp_path / "model.safetensors"):
        model = ddiloco.load_model(source)
        assert model.tok_emb.weight.shape[0] == 100 and model.pos_emb.weight.shape[0] == 16
        assert not model.training
        assert evaluate(model, evals) == pytest.approx(s["final_eval_loss"], abs=1e-5)
    with pytest.raises(FileNotFoundError, match="token file data/tok does not exist"):
        new_model(load_config(tmp_path / "runs" / "r" / "config.toml"))
