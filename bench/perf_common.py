"""Helpers shared by the performance benches (``bench/perf_*.py``): a syncer in its own
process, synthetic learners that push and fetch raw fragments without training, memory
readings from /proc, py-spy profiles summarised as text, and the result row format.

Not a bench itself (no ``main``)."""

from __future__ import annotations

import collections
import math
import multiprocessing as mp
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from ddiloco.runtime.transport import wire

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "docs" / "results" / "profiles"
TOKEN = "perf-bench-token"


def row(
    target: str, measured: str, threshold: str, met: bool | None, notes: str = "", **values
) -> dict:
    """One line of the summary table (``met=None``: not measured, e.g. skipped)."""
    return {
        "target": target,
        "measured": measured,
        "threshold": threshold,
        "met": met,
        "notes": notes,
        "values": values,
    }


# -- memory ---------------------------------------------------------------------------------
def proc_status_bytes(pid: int, key: str) -> int:
    """``VmRSS`` / ``VmHWM`` (peak RSS) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


# -- a syncer in its own process ------------------------------------------------------------
def _serve(conn, kw: dict) -> None:
    import logging

    logging.disable(logging.WARNING)
    from ddiloco.algorithm.policy import PolicyConfig
    from ddiloco.algorithm.syncer_state import SyncerConfig
    from ddiloco.runtime.syncer.server import SyncerServer, SyncerServerConfig

    torch.set_num_threads(int(kw.pop("threads", 1)))
    cpus = kw.pop("cpus", None)
    if cpus:  # before any thread starts: every thread of the syncer inherits it
        os.sched_setaffinity(0, cpus)
    if not kw.pop("kernels", True):
        from ddiloco.algorithm import kernels

        kernels.set_enabled(False)
    quorum, grace = kw.pop("quorum", 1), kw.pop("grace", False)
    history = kw.pop("history", 0)
    kw.setdefault("heartbeat_timeout_s", 3600.0)  # synthetic learners send no heartbeats
    cfg = SyncerServerConfig(
        token=TOKEN,
        syncer=SyncerConfig(policy=PolicyConfig(quorum=quorum, grace=grace), history=history),
        **kw,
    )
    with SyncerServer(cfg) as srv:
        conn.send(srv.port)
        conn.recv()  # any message (or EOF) stops the syncer
        conn.send(
            {
                "counters": srv.status()["counters"],
                "vm_hwm": proc_status_bytes(os.getpid(), "VmHWM"),
                "vm_rss": proc_status_bytes(os.getpid(), "VmRSS"),
            }
        )


class SyncerProc:
    """``SyncerServer`` in a spawned process on an ephemeral loopback port (``serve``: a
    module-level replacement for ``_serve``, e.g. one that patches the server first;
    ``cpus``: the cores it may run on; ``kernels=False``: the merge in torch operations, not
    the C kernel)."""

    def __init__(self, serve=None, **kw) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve or _serve, args=(child, kw), daemon=True)
        self.proc.start()
        if not self._conn.poll(120):
            raise RuntimeError("syncer process did not start")
        self.port = self._conn.recv()
        self.address = f"127.0.0.1:{self.port}"
        self.pid = self.proc.pid
        self.final: dict = {}

    def close(self) -> dict:
        if self.proc.is_alive():
            try:
                self._conn.send("stop")
                if self._conn.poll(30):
                    self.final = self._conn.recv()
            except (BrokenPipeError, EOFError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        return self.final

    def __enter__(self) -> SyncerProc:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- synthetic learners ---------------------------------------------------------------------
def meta_model(preset: str, **overrides) -> torch.nn.Module:
    """A model of the preset's shapes on the meta device (no memory), for specs."""
    from ddiloco.models import build_model

    with torch.device("meta"):
        return build_model(preset, **overrides)


def spec_of(model: torch.nn.Module, P: int) -> dict:  # noqa: N803
    from ddiloco.runtime.transport.spec import model_spec

    return model_spec(model, P, "balanced")


class SyntheticLearner:
    """Joins a syncer and pushes precomputed fp32 fragment payloads (no training, no
    encoding on the hot path): what a syncer sees from a learner, at the rate the wire
    allows."""

    def __init__(self, address: str, learner: int, spec: dict) -> None:
        from ddiloco.runtime.learner.client import SyncerClient
        from ddiloco.runtime.transport.spec import fragmentation_from_spec, spec_fingerprint

        self.client = SyncerClient(address, TOKEN)
        self.learner, self.spec = learner, spec
        self.frag = fragmentation_from_spec(spec)
        self.fp = spec_fingerprint(spec)
        self.seq = 0
        self.versions = [0] * self.frag.P
        self.bytes_pushed = self.bytes_fetched = 0

    def join(self, init_payload: bytes | None = None) -> dict:
        h = {
            "learner": self.learner,
            "incarnation": -1,
            "fingerprint": self.fp,
            "host": "bench",
            "pid": os.getpid(),
        }
        r = self.client.unary("Join", h, control=True)
        if r.get("need_init"):
            assert init_payload is not None, "the first learner must bring the initial model"
            self.client.stream(
                "Init",
                wire.chunks(
                    {"learner": self.learner, "spec": self.spec, "nbytes": len(init_payload)},
                    init_payload,
                ),
                timeout_s=600,
            )
            r = self.client.unary("Join", h, control=True)
        self.incarnation = r["incarnation"]
        self.versions = list(r["versions"])
        return r

    def push(self, p: int, payload: bytes, c_steps: int = 1) -> dict:
        self.seq += 1
        f = self.frag.fragments[p]
        header = {
            "learner": self.learner,
            "incarnation": self.incarnation,
            "fragment": p,
            "seq": (self.incarnation << 32) + self.seq,
            "base_version": self.versions[p],
            "c_steps": c_steps,
            "c_tokens": 1024 * c_steps,
            "codec": "fp32",
            "delta": False,
            "numels": list(f.numels),
            "nbytes": len(payload),
            "step": self.seq,
        }
        r = self.client.push(header, payload, timeout_s=600)
        self.bytes_pushed += len(payload)
        return r

    def fetch(self, fragments: list[int]) -> None:
        for p, (v, _, nbytes) in self.client.fetch(fragments, timeout_s=600).items():
            self.versions[p] = v
            self.bytes_fetched += nbytes

    def close(self) -> None:
        try:
            self.client.unary(
                "Leave", {"learner": self.learner, "incarnation": self.incarnation}, control=True
            )
        except Exception:  # noqa: BLE001 - best effort at the end of a bench
            pass
        self.client.close()


def fragment_payloads(spec: dict, seed: int = 0) -> tuple[bytes, list[bytes]]:
    """(initial model, per-fragment fp32 payloads) with small random values."""
    from ddiloco.runtime.transport.spec import fragmentation_from_spec

    frag = fragmentation_from_spec(spec)
    g = torch.Generator().manual_seed(seed)
    numel = dict(zip(spec["names"], (math.prod(s) for s in spec["shapes"])))
    tensors = {n: torch.randn(numel[n], generator=g) * 0.02 for n in spec["names"]}
    init = b"".join(tensors[n].numpy().tobytes() for n in spec["names"])
    per = [b"".join((tensors[n] + 1e-3).numpy().tobytes() for n in f.names) for f in frag.fragments]
    return init, per


# -- profiles -------------------------------------------------------------------------------
def have_pyspy() -> bool:
    return shutil.which("py-spy") is not None


def pyspy_start(pid: int, duration_s: float, raw_path: Path) -> subprocess.Popen | None:
    """Start ``py-spy record`` on ``pid`` (collapsed stacks, native frames off)."""
    if not have_pyspy():
        return None
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            "py-spy",
            "record",
            "-p",
            str(pid),
            "-d",
            str(max(1, int(duration_s))),
            "-r",
            "50",
            "-f",
            "raw",
            "-o",
            str(raw_path),
            "--threads",
            "--idle",
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def summarise_collapsed(
    raw_path: Path,
    out_txt: Path,
    title: str,
    top: int = 25,
    sampled: str = "50 Hz, --idle: waiting threads included",
) -> str:
    """Turn py-spy collapsed stacks into a small text summary: samples per thread, and the
    functions with the most self and inclusive samples (idle frames listed separately);
    ``sampled`` says how the samples were taken (the rate, which threads)."""
    if not raw_path.is_file():
        return ""
    self_c, incl_c, thread_c = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        n = int(n)
        frames = stack.split(";")
        total += n
        thread_c[frames[0]] += n
        fn = [f.split(" (")[0] + " (" + f.split(" (")[-1] if " (" in f else f for f in frames[1:]]
        if fn:
            self_c[fn[-1]] += n
            for f in set(fn):
                incl_c[f] += n
    lines = [
        f"# {title}",
        f"py-spy samples: {total} ({sampled})",
        "",
        "## samples per thread",
    ]
    lines += [f"{n:7d} {100 * n / total:5.1f}%  {t}" for t, n in thread_c.most_common(12)]
    lines += ["", f"## top {top} self (leaf) frames"]
    lines += [f"{n:7d} {100 * n / total:5.1f}%  {f}" for f, n in self_c.most_common(top)]
    lines += ["", f"## top {top} inclusive frames"]
    lines += [f"{n:7d} {100 * n / total:5.1f}%  {f}" for f, n in incl_c.most_common(top)]
    text = "\n".join(lines) + "\n"
    out_txt.parent.mkdir(parents=True, exist_ok=True)
    out_txt.write_text(text)
    raw_path.unlink(missing_ok=True)
    return text


def wait_proc(p: subprocess.Popen | None, timeout_s: float = 60) -> None:
    if p is None:
        return
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()


def best_time(fn, repeat: int) -> float:
    """Minimum wall time of ``fn()`` over ``repeat`` runs (the least disturbed run on a
    shared machine)."""
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
