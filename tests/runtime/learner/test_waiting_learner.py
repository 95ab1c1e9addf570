"""``ddiloco learner`` waiting for a syncer that is not there stops at once when told to:
SIGTERM (a launcher or a scheduler stopping it) exits 143, Ctrl-C exits 130 with one line,
neither with a traceback, instead of waiting out ``connect_timeout``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)


def _waiting_learner() -> subprocess.Popen:
    """A learner process past its start-up, retrying an address nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    code = "import sys; from ddiloco.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "learner", "--syncer", addr, "--learner", "0"]
        + ["--model", "gpt_tiny", "--vocab-size", "64", "--block-size", "32"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "DDILOCO_TOKEN": "tok"},
        # as from a terminal: SIGINT at its default (a shell's background job ignores it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 90
    for line in proc.stderr:  # its first "waiting for the syncer" line (after 2 s)
        if "waiting for the syncer" in line:
            return proc
        assert time.monotonic() < deadline
    raise AssertionError(f"the learner exited ({proc.wait()}) before waiting")


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_waiting_learner_stops_when_told_to(sig, status):
    proc = _waiting_learner()
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 15
    assert proc.returncode == status, err
    assert "Traceback" not in err, err
    if sig == signal.SIGINT:
        assert err.strip().splitlines()[-1] == "ddiloco learner: interrupted", err
