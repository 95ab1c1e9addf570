"""The launcher's live display: a rich table on a terminal, plain lines otherwise."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time

import pytest
from rich.console import Console
from runtime_helpers import TINY

from ddiloco.runtime.launch.progress import LiveProgress, learner_rows


def _status(steps: list[int], merges: int) -> dict:
    return {
        "uptime_s": 10.0,
        "run_s": 10.0,
        "merges": merges,
        "steps_done": sum(steps),
        "step_budget": 300,
        "learners": {
            str(m): {
                "state": "live",
                "report": {
                    "global_step": s,
                    "loss": 4.0 - s / 100,
                    "compute_s": s * 0.05,
                    "ledger": {"computed": s, "merged": s / 2},
                },
            }
            for m, s in enumerate(steps)
        },
    }


def test_rows_from_status_and_process_states():
    rows = learner_rows(_status([100, 40], 9), {0: "running", 1: "down"}, 3)
    assert [(r.learner, r.process, r.syncer, r.step) for r in rows] == [
        (0, "running", "live", 100),
        (1, "down", "live", 40),
        (2, "-", "-", 0),
    ]
    assert rows[0].merged_steps == 50 and rows[0].goodput == pytest.approx(5.0 * 0.5 / 10)
    assert rows[2].goodput is None and rows[2].loss is None


def test_terminal_gets_a_table_redrawn_in_place():
    out = io.StringIO()
    with LiveProgress(2, console=Console(file=out, force_terminal=True, width=100)) as p:
        assert p.terminal
        p.update(1.0, _status([10, 12], 3), {0: "running", 1: "running"})
        p.update(1.5, _status([20, 22], 7), {0: "running", 1: "stopped"})
    text = out.getvalue()
    assert "merged steps" in text and "goodput" in text and "stopped" in text
    assert "\x1b[2K" in text or "\x1b[1A" in text  # the cursor goes back over the last table
    assert "merges 7" in text and "steps 42 / 300" in text


def test_a_pipe_gets_plain_lines_at_the_interval():
    r, w = os.pipe()
    with os.fdopen(w, "w") as wf, os.fdopen(r) as rf:
        console = Console(file=wf)
        assert not console.is_terminal
        with LiveProgress(2, console=console, interval_s=2.0) as p:
            assert not p.terminal
            for t, steps in ((0.0, [1, 1]), (0.5, [5, 4]), (1.9, [9, 8]), (2.1, [11, 9])):
                p.update(t, _status(steps, 2), {0: "running", 1: "down"})
        wf.close()
        lines = rf.read().splitlines()
    assert lines == [
        "[   0.0s] steps 1 1x (2/300)  merges 2  loss 3.990  goodput~0.003",
        "[   2.1s] steps 11 9x (20/300)  merges 2  loss 3.900  goodput~0.025",
    ]


def _train_cmd(tmp_path, name: str) -> list[str]:
    from ddiloco.config import TrainConfig, dump_config

    cfg = TrainConfig(
        **{
            **TINY,
            "progress": True,
            "learners": 2,
            "steps": 60,
            "out": str(tmp_path / name),
            "engine": "processes",
        }
    )
    dump_config(cfg, tmp_path / f"{name}.toml")
    return [
        sys.executable,
        "-m",
        "ddiloco.cli",
        "train",
        "--config",
        str(tmp_path / f"{name}.toml"),
        "--http-port",
        "0",
    ]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_real_run_on_a_pseudo_terminal_and_on_a_pipe(tmp_path):
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm-256color"}
    for k in ("NO_COLOR", "TTY_COMPATIBLE", "FORCE_COLOR"):
        env.pop(k, None)
    # the same run twice at once: its standard error on a pseudo-terminal, and on a pipe
    piped = subprocess.Popen(
        _train_cmd(tmp_path, "pipe"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        _train_cmd(tmp_path, "tty"),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(30) == 0
    tty = b"".join(chunks).decode(errors="replace")
    assert "merged steps" in tty and "goodput" in tty  # the table's header
    assert "\x1b[" in tty  # drawn with terminal codes
    assert tty.count("merges") >= 2 and "finished" in tty and "ddiloco: done" in tty
    assert "live dashboard on http://127.0.0.1:" in tty and "/?token=" in tty
    _, err = piped.communicate(timeout=120)
    assert piped.returncode == 0, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("[")]
    assert lines and all(" steps " in ln and " merges " in ln for ln in lines)
    assert "\x1b[" not in err and "merged steps" not in err and "ddiloco: done" in err
