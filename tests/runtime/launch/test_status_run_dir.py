"""``ddiloco status RUN_DIR``: a run directory's syncer, found from the directory (address
from its config.toml and syncer.port, token from its token file), and a run that is over
summarised from its summary.json; every other case one line that says what it wants."""

from __future__ import annotations

import json
import socket
import stat
import threading
import time
from pathlib import Path

import grpc
import pytest
from runtime_helpers import tiny_config

from ddiloco.cli import main
from ddiloco.config import TrainConfig, dump_config
from ddiloco.runtime.launch.launcher import Launcher


@pytest.fixture(autouse=True)
def _no_token_in_the_environment(monkeypatch):
    monkeypatch.delenv("DDILOCO_TOKEN", raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_dir(path: Path, *, port: int | None = None, token: str | None = None) -> Path:
    """A run directory as the launcher leaves it while its run goes on."""
    path.mkdir(parents=True)
    dump_config(TrainConfig(engine="processes", out=str(path)), path / "config.toml")
    if port is not None:
        (path / "syncer.port").write_text(str(port))
    if token is not None:
        (path / "token").write_text(token + "\n")
    return path


@pytest.mark.timeout(180)
def test_status_of_a_live_run_directory_then_of_the_finished_run(tmp_path, capsys):
    run = tmp_path / "run"
    la = Launcher(tiny_config(run, learners=2, steps=600))
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault("s", la.run()), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        out = ""
        while time.monotonic() < deadline:
            if (run / "syncer.port").is_file() and main(["status", str(run)]) == 0:
                out = capsys.readouterr().out
                if "live 2" in out:
                    break
            capsys.readouterr()
            time.sleep(0.3)
        assert "syncer boot" in out and "live 2" in out, out
        # the token that let it in is the run's, readable by its owner only
        assert stat.S_IMODE((run / "token").stat().st_mode) == 0o600
    finally:
        t.join(100)
        la.close()
    assert not t.is_alive() and "s" in done
    assert main(["status", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"the run in {run} is over: no syncer runs for it; its summary.json records:"
    assert lines[1].split() == ["method", "decoupled", "(processes,", "M=2),", "finished"]
    s = done["s"]
    assert f"{s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}" in lines[3]
    assert main(["status", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["merges"] == s["merges"]


@pytest.mark.timeout(60)
def test_status_of_a_finished_run_shows_what_its_directory_records(tmp_path, capsys):
    run = _run_dir(tmp_path / "run", port=_free_port(), token="tok")
    summary = {"method": "dp", "engine": "inproc", "learners": 4, "steps": 600, "ok": True}
    summary |= {"initial_eval_loss": 4.159, "final_eval_loss": 3.21, "goodput": 1.0}
    summary |= {"merges": 0, "wall_s": 93.14}
    (run / "summary.json").write_text(json.dumps(summary))
    assert main(["status", str(run)]) == 0
    assert capsys.readouterr().out == (
        f"the run in {run} is over: no syncer runs for it; its summary.json records:\n"
        "  method                 dp (inproc, M=4), finished\n"
        "  inner steps / learner  600\n"
        "  eval loss              4.1590 -> 3.2100\n"
        "  goodput                1.000\n"
        "  merges                 0\n"
        "  wall time              93.1 s\n"
        f"(ddiloco report {run} for more)\n"
    )


@pytest.mark.timeout(60)
def test_status_errors_are_one_line_that_say_what_it_wants(tmp_path, capsys):
    def err(*argv: str) -> str:
        assert main(["status", *argv]) == 2
        got = capsys.readouterr().err
        assert got.count("\n") == 1, got
        return got

    assert err(str(tmp_path / "runs" / "latest")) == (
        f"ddiloco status: error: {tmp_path / 'runs' / 'latest'} is neither a run directory "
        f"nor a syncer's HOST:PORT (e.g. `ddiloco status runs/latest` or `ddiloco status "
        f"127.0.0.1:50051`)\n"
    )
    (tmp_path / "other").mkdir()
    assert err(str(tmp_path / "other")) == (
        f"ddiloco status: error: {tmp_path / 'other'} is not a run directory (no "
        f"config.toml): give the --out of a `ddiloco train` run or a syncer's HOST:PORT\n"
    )
    early = _run_dir(tmp_path / "early")
    assert "records no syncer address (no syncer.port)" in err(str(early))
    port = _free_port()
    tokenless = _run_dir(tmp_path / "tokenless", port=port)
    assert err(str(tokenless)) == (
        f"ddiloco status: error: {tokenless} holds no token for its syncer at "
        f"127.0.0.1:{port}: set $DDILOCO_TOKEN to the run's token or pass --token-file\n"
    )
    killed = _run_dir(tmp_path / "killed", port=port, token="tok")
    assert err(str(killed)) == (
        f"ddiloco status: error: no syncer answers at 127.0.0.1:{port}, the address "
        f"{killed} records (UNAVAILABLE: Connection refused): the run is not running, and "
        f"it ended without a summary.json (stopped by a signal or a crash; its logs/ tell)\n"
    )


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return (
            "DNS resolution failed for nosuch.invalid:50051: C-ares status is not ARES_SUCCESS "
            "qtype=A name=nosuch.invalid is_balancer=0: Domain name not found]"
        )


@pytest.mark.timeout(30)
def test_an_unreachable_address_is_named_without_the_cores_bracket(monkeypatch, capsys):
    import ddiloco.runtime.launch.status as status

    def fail(*_, **__):
        raise _Unavailable()

    monkeypatch.setattr(status, "fetch_status", fail)
    monkeypatch.setenv("DDILOCO_TOKEN", "tok")
    assert main(["status", "nosuch.invalid:50051"]) == 2
    assert capsys.readouterr().err == (
        "ddiloco status: error: no syncer answers at nosuch.invalid:50051 (UNAVAILABLE: "
        "Domain name not found); check the address, that it runs, and --tls-ca for a TLS "
        "syncer\n"
    )
