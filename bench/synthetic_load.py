"""A syncer under synthetic load: syncer processes started from a run file, synthetic
learners that speak the real protocol without training, and RSS sampling from /proc.

Used by ``bench/syncer_memory.py`` (its module doc describes the protocol a synthetic
learner follows). Not a bench itself (no ``main``).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.learner.client import RETRYABLE, rpc_code
from ddiloco.runtime.learner.sharded import ShardedClient
from ddiloco.runtime.transport import wire
from ddiloco.runtime.transport.spec import fragmentation_from_spec, spec_fingerprint

__all__ = [
    "GEN_BLOCK",
    "DELTA_STD",
    "PARAM_STD",
    "synthetic_spec",
    "init_frames",
    "push_payloads",
    "status_bytes",
    "cpu_s",
    "mem_available",
    "RssSampler",
    "free_port",
    "Syncers",
    "SyntheticLearner",
    "in_threads",
]

GEN_BLOCK = 1 << 22
"""Elements generated at a time for the initial model (16 MiB of fp32)."""
DELTA_STD, PARAM_STD = 1e-4, 0.02
"""Scale of a delta payload's values and of parameter values (initial model, pushes of a
codec that sends parameters)."""


# -- the synthetic model ---------------------------------------------------------------------
def synthetic_spec(params: int, P: int, tensors_per_fragment: int = 4) -> dict:  # noqa: N803
    """A model spec of ``tensors_per_fragment`` x P equal 2-D fp32 matrices (4096 columns
    where they are that large) and one [1, r] tensor for the remainder, numels summing to
    exactly ``params``; balanced fragmentation over P."""
    T = P * tensors_per_fragment  # noqa: N806
    each = params // T
    if each < 1:
        raise ValueError(f"{params} parameters cannot fill {T} tensors")
    cols = min(4096, each)
    rows = each // cols
    shapes = [[rows, cols] for _ in range(T)]
    rest = params - T * rows * cols
    if rest:
        shapes.append([1, rest])
    return {
        "names": [f"blocks.{i}.weight" for i in range(T)] + (["rest"] if rest else []),
        "shapes": shapes,
        "esizes": [4] * len(shapes),
        "dtypes": ["float32"] * len(shapes),
        "embedding": [],
        "P": int(P),
        "strategy": "balanced",
    }


def init_frames(spec: dict, learner: int, seed: int):
    """The Init call's frames: the initial model in spec order, generated block by block
    (never whole), ``wire.CHUNK_BYTES`` of payload per frame."""
    total = 4 * sum(math.prod(s) for s in spec["shapes"])
    header: dict | None = {"learner": learner, "spec": spec, "nbytes": total}
    i = 0
    for t, shape in enumerate(spec["shapes"]):
        n = math.prod(shape)
        g = torch.Generator().manual_seed(seed * 1_000_003 + t)
        for off in range(0, n, GEN_BLOCK):
            block = (torch.randn(min(GEN_BLOCK, n - off), generator=g) * PARAM_STD).numpy()
            mv = memoryview(block).cast("B")
            for o in range(0, len(mv), wire.CHUNK_BYTES):
                piece = mv[o : o + wire.CHUNK_BYTES]
                if header is not None:
                    yield wire.pack(header, piece)
                    header = None
                else:
                    i += 1
                    yield wire.pack({"cont": i}, piece)


def push_payloads(spec: dict, codec_name: str, seed: int = 0) -> list[bytes]:
    """Per fragment, the push payload every learner sends: the codec's encoding of small
    random updates (a ``delta`` codec) or of parameter-sized values (the others). Tensors
    of one size share their encoding (one random draw per distinct size)."""
    codec = get_codec(codec_name)
    frag = fragmentation_from_spec(spec)
    std = DELTA_STD if codec.delta else PARAM_STD
    enc: dict[int, bytes] = {}
    for n in sorted({k for f in frag.fragments for k in f.numels}):
        g = torch.Generator().manual_seed(seed * 7919 + n)
        enc[n] = bytes(codec.encode(torch.randn(n, generator=g) * std))
    return [b"".join(enc[k] for k in f.numels) for f in frag.fragments]


# -- /proc -----------------------------------------------------------------------------------
def status_bytes(pid: int, key: str) -> int:
    """``VmRSS``/``VmHWM`` of a process in bytes (0 once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class RssSampler:
    """Samples the VmRSS of the syncer processes every ``every_s`` in a thread; calls
    ``on_limit`` once when their sum exceeds ``limit_bytes``."""

    def __init__(self, pids: list[int], every_s: float, limit_bytes: int, on_limit) -> None:
        self.pids, self.every_s, self.limit_bytes = pids, every_s, limit_bytes
        self._on_limit = on_limit
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, list[int]]] = []
        self.over_limit = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def sample(self) -> list[int]:
        rss = [status_bytes(p, "VmRSS") for p in self.pids]
        self.samples.append((self.now(), rss))
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if sum(self.sample()) > self.limit_bytes and not self.over_limit:
                self.over_limit = True
                self._on_limit()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def window(self, t_from: float, t_to: float) -> list[list[int]]:
        return [r for t, r in self.samples if t_from <= t <= t_to]


# -- the syncer processes ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Syncers:
    """S ``ddiloco syncer`` processes on loopback reading the run file ``config`` (logs and
    port files in ``run_dir``; shard k's checkpoints in ``ckpt_root/shard_k`` when given);
    ``stop()`` sends SIGTERM (each writes its final checkpoint) and waits."""

    def __init__(
        self,
        config: Path,
        S: int,  # noqa: N803 - the paper's symbol
        run_dir: Path,
        env: dict,
        ckpt_root: Path | None,
    ) -> None:
        config, run_dir = config.resolve(), run_dir.resolve()
        ports = [free_port() for _ in range(S)] if S > 1 else [0]
        self.procs: list[subprocess.Popen] = []
        self._logs = []
        for k in range(S):
            port_file = run_dir / f"syncer_{k}.port"
            port_file.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "ddiloco.runtime.cli", "syncer", "--config", str(config)]
            cmd += ["--port", str(ports[k]), "--port-file", str(port_file)]
            if S > 1:
                cmd += ["--shards", ",".join(f"127.0.0.1:{q}" for q in ports), "--shard", str(k)]
            if ckpt_root is not None:
                cmd += ["--checkpoint-dir", str(ckpt_root / f"shard_{k}")]
            log = open(run_dir / f"syncer_{k}.log", "w")  # noqa: SIM115 - closed in stop()
            self._logs.append(log)
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir)
            )
        self.addresses = []
        deadline = time.monotonic() + 120.0
        for k, proc in enumerate(self.procs):
            port_file = run_dir / f"syncer_{k}.port"
            while not port_file.is_file():
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"syncer {k} did not listen (exit {proc.returncode}); see "
                        f"{run_dir / f'syncer_{k}.log'}"
                    )
                time.sleep(0.05)
            self.addresses.append(f"127.0.0.1:{int(port_file.read_text())}")
        self.pids = [p.pid for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def stop(self, timeout_s: float = 600.0) -> list[int | None]:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout_s))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        for log in self._logs:
            log.close()
        return codes


# -- a synthetic learner ----------------------------------------------------------------------
class SyntheticLearner:
    """Learner m's protocol without training (``bench/syncer_memory.py`` describes it): Join
    (learner 0 brings the initial model), fetches whose replies are dropped, ``rounds`` x P
    scheduled pushes of the prepared ``payloads`` (one per fragment, of ``codec``), Leave."""

    def __init__(
        self,
        m: int,
        addresses: list[str],
        token: str,
        spec: dict,
        payloads: list[bytes],
        *,
        codec: str,
        H: int,  # noqa: N803
        rounds: int,
        seed: int = 0,
        deadline: float = math.inf,
        abort: threading.Event | None = None,
    ) -> None:
        self.m, self.spec, self.payloads = m, spec, payloads
        self.H, self.rounds, self.seed = H, rounds, seed
        self.deadline = deadline
        """``time.monotonic()`` past which waiting for the syncer is an error."""
        self.abort = abort or threading.Event()
        """Set when another learner failed: this one stops at its next wait."""
        self.frag = fragmentation_from_spec(spec)
        self.codec = get_codec(codec)
        shards = tuple(addresses) if len(addresses) > 1 else ()
        self.sc = ShardedClient(addresses[0], token, shards=shards)
        self.incarnation = -1
        self.versions = [0] * self.frag.P
        self.tokens: dict[int, int] = {}
        """fragment -> token of the copy the syncer keeps for this learner (``down_delta``)."""
        self.history: int | None = None
        """The syncer's history (past versions kept per fragment), from the Join reply."""
        self.stats: Counter = Counter()

    def _rpc_timeout_s(self, nbytes: int) -> float:
        return 120.0 + nbytes / 20e6

    def _check(self, what: str) -> None:
        if self.abort.is_set():
            raise RuntimeError(f"[learner {self.m}] stopped ({what}): another learner failed")
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"[learner {self.m}] {what}: past the case's deadline")

    def _retried(self, what: str, call):
        """``call()``, again after a retryable error (``E_BUSY`` above all: on loopback every
        learner is the same peer for the data port's per-peer limit), with the real
        learner's backoff (0.1 s doubling to 2 s)."""
        backoff = 0.1
        while True:
            try:
                return call()
            except grpc.RpcError as e:
                if rpc_code(e) not in RETRYABLE:
                    raise
                self.stats["retries"] += 1
                self._check(what)
                time.sleep(backoff)
                backoff = min(2 * backoff, 2.0)

    def join(self) -> dict:
        h = {
            "learner": self.m,
            "incarnation": self.incarnation,
            "fingerprint": spec_fingerprint(self.spec),
            "spec": self.spec,
            "host": "bench",
            "pid": os.getpid(),
        }
        r = self.sc.unary("Join", h, timeout_s=60.0, control=True)
        if r.get("need_init"):
            nbytes = 4 * sum(math.prod(s) for s in self.spec["shapes"])
            for c in self.sc.clients:  # every shard takes the whole model
                c.stream(
                    "Init",
                    init_frames(self.spec, self.m, self.seed),
                    self._rpc_timeout_s(nbytes),
                )
                self.stats["bytes_sent"] += nbytes
            r = self.sc.unary("Join", h, timeout_s=60.0, control=True)
        if r.get("need_init"):
            raise RuntimeError(f"[learner {self.m}] the syncer still needs the initial model")
        self.incarnation = int(r["incarnation"])
        self.versions = list(r["versions"])
        self.history = r.get("history")
        for k, c in enumerate(self.sc.clients):
            if c.data_fetch is None:
                raise RuntimeError(f"shard {k} advertised no data port (runtime.bulk_port -1?)")
        return r

    def _owner(self, p: int):
        return self.sc.clients[self.sc.shard_of(p)]

    def fetch(self, p: int) -> None:
        """Fetch fragment p from its owner on the data port and drop it (its version and the
        token of the syncer's copy for this learner are kept)."""
        req: dict = {"op": "fetch", "fragments": [p], "learner": self.m}
        if p in self.tokens:
            req["mirrors"] = [[p, self.tokens[p]]]
        nbytes = self.frag.fragments[p].nbytes
        data = self._owner(p).data_fetch
        assert data is not None  # checked at join
        h, buf = self._retried(
            f"fetch of fragment {p}", lambda: data.request(req, [], self._rpc_timeout_s(nbytes))
        )
        (item,) = h["items"]
        self.versions[p] = int(item["version"])
        if "token" in item:
            self.tokens[p] = int(item["token"])
        self.stats["bytes_fetched"] += int(item["nbytes"])
        self.stats["fetch_delta" if item.get("delta") else "fetch_whole"] += 1
        del buf

    def push(self, p: int, n: int) -> str:
        """Push n (from 1) of this learner: fragment p against the version it fetched last."""
        f, payload = self.frag.fragments[p], self.payloads[p]
        steps = max(1, self.H // self.frag.P)
        header = {
            "learner": self.m,
            "incarnation": self.incarnation,
            "fragment": p,
            "seq": (self.incarnation << 32) + n,
            "base_version": self.versions[p],
            "c_steps": self.H,
            "c_tokens": 1024 * self.H,
            "codec": self.codec.name,
            "delta": self.codec.delta,
            "numels": list(f.numels),
            "nbytes": len(payload),
            "step": n * steps,
        }
        timeout_s = self._rpc_timeout_s(len(payload))
        r = self._retried(
            f"push of fragment {p}", lambda: self.sc.push(header, payload, timeout_s=timeout_s)
        )
        self.stats["bytes_pushed"] += len(payload)
        self.stats[f"push_{r['status']}"] += 1
        return str(r["status"])

    def wait_merged(self, p: int, base: int) -> None:
        """Long-poll fragment p's owner until p is published past version ``base``."""
        c = self._owner(p)
        cursor, seen = None, {}
        while True:
            req = {"learner": self.m, "cursor": cursor, "merged_seq": seen, "timeout_s": 2.0}
            r = self._retried(
                f"wait for fragment {p}", lambda req=req: c.unary("Watch", req, timeout_s=30.0)
            )
            if r["versions"][p] > base:
                return
            self._check(f"fragment {p} not merged past version {base}")
            cursor, seen = r["versions"], r.get("merged_seq") or {}

    def run(self, t0: float, slot_s: float) -> None:
        """``rounds`` x P pushes on the schedule, each followed (when accepted) by the fetch
        of its merge."""
        P = self.frag.P  # noqa: N806
        for j in range(self.rounds * P):
            p = j % P
            wait = t0 + j * slot_s - time.monotonic()
            if wait > 0:
                self.abort.wait(wait)
            else:
                self.stats["late_slots"] += 1
            self._check(f"slot {j}")
            base = self.versions[p]
            if self.push(p, j + 1) in ("accepted", "duplicate"):
                self.wait_merged(p, base)
                self.fetch(p)

    def leave(self) -> None:
        self.sc.unary(
            "Leave",
            {"learner": self.m, "incarnation": self.incarnation},
            timeout_s=60.0,
            control=True,
        )

    def close(self) -> None:
        self.sc.close()


def in_threads(fn, items, abort: threading.Event | None = None) -> None:
    """``fn(item)`` for every item in its own thread; the first error sets ``abort`` and is
    raised once every thread has ended."""
    errors: list[BaseException] = []

    def one(x) -> None:
        try:
            fn(x)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            if abort is not None:
                abort.set()

    threads = [threading.Thread(target=one, args=(x,), daemon=True) for x in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
