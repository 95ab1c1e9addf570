"""A port is one syncer's: a second ``ddiloco syncer`` on a port in use fails with a clear
error instead of also "listening" (gRPC's SO_REUSEPORT would let the kernel split learners
between the two)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from runtime_helpers import SyncerProcess


@pytest.mark.timeout(240)
def test_a_second_syncer_on_a_port_in_use_is_an_error(tmp_path):
    first = SyncerProcess(tmp_path, "tok")
    try:
        port = first.address.rsplit(":", 1)[1]
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddiloco.runtime.cli",
                "syncer",
                "--port",
                port,
                "--bulk-port",
                "-1",
            ],
            env={**os.environ, "DDILOCO_TOKEN": "tok"},
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"could not bind 127.0.0.1:{port}: the port is in use" in second.stderr
        assert "listening" not in second.stdout
        assert first.proc.poll() is None  # the first one serves on
    finally:
        first.close()
