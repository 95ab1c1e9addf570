"""A real etcd on 127.0.0.1 for the replicated syncer's tests: ``EtcdProcess`` (a temp data
directory, ephemeral ports), and ``etcd_or_skip``, which skips a test, saying why, only where
etcd is not installed (``make test`` installs Debian's ``etcd-server``)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ddiloco.runtime.launch.launcher import free_ports
from ddiloco.runtime.transport.etcd import EtcdClient, EtcdError


def etcd_or_skip() -> str:
    exe = shutil.which("etcd")
    if exe is None:
        pytest.skip(
            "etcd is not installed (`make test` installs Debian's etcd-server as root; "
            "elsewhere: apt-get install etcd-server)"
        )
    return exe


class EtcdProcess:
    """One etcd member on loopback, its data in ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        exe = etcd_or_skip()
        client, peer = free_ports(2)
        self.url = f"http://127.0.0.1:{client}"
        self.endpoint = f"etcd://127.0.0.1:{client}"
        tmp.mkdir(parents=True, exist_ok=True)
        self.log = open(tmp / "etcd.log", "wb")
        self.proc = subprocess.Popen(
            [
                exe,
                "--name",
                "test",
                "--data-dir",
                str(tmp / "data"),
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"test=http://127.0.0.1:{peer}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.client = EtcdClient(self.url, timeout_s=1.0)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.get("/ping")
                break
            except EtcdError:
                assert self.proc.poll() is None, (tmp / "etcd.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "etcd did not start"
                time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
