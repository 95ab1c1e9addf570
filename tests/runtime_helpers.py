"""The harness for tests against real syncers on 127.0.0.1, shared by every test directory
(``tests/conftest.py`` exposes ``syncer_factory``).

- ``syncer_factory`` / ``SyncerProcess``: ``ddiloco syncer`` processes on ephemeral ports,
  logging to ``syncer.log`` and ``syncer.jsonl`` in their directory;
- ``live_syncer``: a ``SyncerServer`` in the test's own process (to reach its internals or
  watch its log records), with learner 0 joined and a tiny model uploaded;
- ``init_syncer``, ``push_header``, ``expect_rejection``: a learner's first calls, a push, a
  typed refusal;
- ``tiny_config`` / ``tiny_model``: runs and models small enough for these tests.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddiloco.metrics.sinks import read_jsonl

TINY = dict(
    model="gpt_tiny",
    batch_size=8,
    block_size=32,
    vocab_size=64,
    fragments=4,
    H=8,
    tau=2,
    eval_batches=4,
    progress=False,
    inner_lr=3e-3,
    lr_schedule="constant",
)


def tiny_config(out: Path, **kw):
    from ddiloco.config import TrainConfig

    return TrainConfig(engine="processes", out=str(out), **{**TINY, **kw})


def step_walls(run: Path, m: int) -> list[float]:
    return [
        r["wall"] for r in read_jsonl(run / f"learner_{m}" / "metrics.jsonl") if r["kind"] == "step"
    ]


def max_gap_ratio(walls: list[float], skip: int = 10) -> tuple[float, float, float]:
    """(longest / median step gap, longest, median) after a process's first ``skip`` steps:
    those are its start-up, while every process of the run starts at once on the shared
    cores (and the chaos slow-down's compute-time average settles)."""
    walls = walls[skip:]
    gaps = sorted(b - a for a, b in zip(walls, walls[1:]))
    med = gaps[len(gaps) // 2]
    return max(gaps) / med, max(gaps), med


class SyncerProcess:
    """``python -m ddiloco.runtime.cli syncer`` on an ephemeral port."""

    def __init__(self, tmp: Path, token: str = "test-token", *args: str) -> None:
        self.tmp, self.token = tmp, token
        self.env = {**os.environ, "DDILOCO_TOKEN": token}
        port_file = tmp / "port"
        self.log = open(tmp / "syncer.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddiloco.runtime.cli",
                "syncer",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--metrics-file",
                str(tmp / "syncer.jsonl"),
                *args,
            ],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not port_file.is_file():
            assert self.proc.poll() is None, (tmp / "syncer.log").read_text()
            assert time.monotonic() < deadline, "syncer did not start"
            time.sleep(0.05)
        self.address = f"127.0.0.1:{port_file.read_text()}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def tiny_model():
    """A one-layer GPT small enough for validation tests (seeded)."""
    import torch

    from ddiloco.models import build_model

    torch.manual_seed(0)
    return build_model("gpt_tiny", n_layer=1, n_embd=32, n_head=2)


def init_syncer(client, model, P: int = 2) -> tuple[dict, int]:
    """Join as learner 0, upload ``model`` as the initial model, join again: (spec,
    incarnation)."""
    from ddiloco.runtime.transport import wire
    from ddiloco.runtime.transport.spec import model_spec, spec_fingerprint

    spec = model_spec(model, P)
    fp = spec_fingerprint(spec)
    r = client.unary("Join", {"learner": 0, "incarnation": -1, "fingerprint": fp})
    assert r["need_init"]
    data = b"".join(t.detach().float().numpy().tobytes() for t in model.parameters())
    assert client.stream(
        "Init", wire.chunks({"learner": 0, "spec": spec, "nbytes": len(data)}, data)
    )["accepted"]
    r = client.unary("Join", {"learner": 0, "incarnation": -1, "fingerprint": fp})
    return spec, r["incarnation"]


def expect_rejection(code, tag: str, fn) -> None:
    """``fn()`` fails with gRPC status ``code`` and a message starting with the typed error
    ``tag`` (the same on both transports: ``BulkError`` is a ``grpc.RpcError``)."""
    import grpc
    import pytest

    with pytest.raises(grpc.RpcError) as ei:
        fn()
    assert ei.value.code() == code, ei.value
    assert ei.value.details().startswith(tag), ei.value.details()


def assert_no_internal_error(status: dict, log_text: str) -> None:
    """No fault a test injected was taken for a syncer bug: no ``E_INTERNAL`` counted in
    ``status()["rejections"]`` and no traceback (or ``E_INTERNAL``) in the syncer's log."""
    assert status["rejections"].get("E_INTERNAL", 0) == 0, status["rejections"]
    assert "Traceback" not in log_text and "E_INTERNAL" not in log_text, log_text[-3000:]


def self_signed_cert(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM) made by openssl in ``tmp``;
    skips the calling test, saying why, where openssl cannot make one."""
    import pytest

    cert, key = tmp / "cert.pem", tmp / "key.pem"
    r = subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        capture_output=True,
    )
    if r.returncode != 0:
        pytest.skip(f"openssl cannot make a test certificate: {r.stderr[-200:]!r}")
    return cert, key


def push_header(frag, p: int, data: bytes, inc: int, seq: int, codec: str = "fp32", **kw) -> dict:
    """A well-formed push header for fragment p of ``frag`` carrying ``data`` (4 steps, 400
    tokens, base version 0); keyword arguments override or add fields."""
    return {
        "learner": 0,
        "incarnation": inc,
        "fragment": p,
        "seq": seq,
        "base_version": 0,
        "c_steps": 4,
        "c_tokens": 400,
        "codec": codec,
        "delta": False,
        "numels": list(frag.fragments[p].numels),
        "nbytes": len(data),
        "step": 4,
        **kw,
    }


@pytest.fixture
def syncer_factory(tmp_path):
    """Start ``ddiloco syncer`` processes on ephemeral ports (in ``tmp_path``, or in ``dir``
    for a second one); stop them after the test."""
    made = []

    def make(*args: str, token: str = "test-token", dir: Path | None = None) -> SyncerProcess:
        if dir is not None:
            dir.mkdir(parents=True, exist_ok=True)
        s = SyncerProcess(dir or tmp_path, token, *args)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@dataclass
class LiveSyncer:
    """A ``SyncerServer`` in this process, and learner 0's client (joined, model uploaded)."""

    server: Any
    """The ``SyncerServer``."""
    client: Any
    """Learner 0's ``SyncerClient``."""
    spec: dict
    """The model spec the syncer was initialised with."""
    inc: int
    """Learner 0's incarnation."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def frag(self):
        """The fragmentation of ``spec``."""
        from ddiloco.runtime.transport.spec import fragmentation_from_spec

        return fragmentation_from_spec(self.spec)


@contextlib.contextmanager
def live_syncer(token: str = "tok", *, model=None, P: int = 2, **config) -> Iterator[LiveSyncer]:
    """A real syncer in this process on an ephemeral port (``SyncerServerConfig(token=token,
    **config)``), initialised with ``model`` (``tiny_model()``) in ``P`` fragments by learner
    0; the client and the server are closed on exit."""
    from ddiloco.runtime.learner.client import SyncerClient
    from ddiloco.runtime.syncer.server import SyncerServer, SyncerServerConfig

    server = SyncerServer(SyncerServerConfig(token=token, **config))
    try:
        port = server.start()
        client = SyncerClient(f"127.0.0.1:{port}", token)
        try:
            spec, inc = init_syncer(client, tiny_model() if model is None else model, P)
            yield LiveSyncer(server, client, spec, inc)
        finally:
            client.close()
    finally:
        server.close()
