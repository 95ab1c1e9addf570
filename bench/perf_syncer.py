"""Target 2: syncer throughput on loopback against raw loopback TCP, same run.

- raw TCP: one process streams 4 MiB buffers over a loopback socket to another process
  that ``recv_into``s a preallocated buffer; bytes/s.
- syncer: ``SyncerServer`` (gRPC) in its own process, quorum K = 1 (every push merged at
  once); M synthetic learners (threads of this process) push precomputed fp32 fragments
  of a gpt_small-shaped model (P = 24) and fetch each merged fragment back. Throughput is
  fragment bytes ingested + sent back per second.
- sharded: S syncer processes, fragment p owned by syncer p mod S; the synthetic learners
  route each push and fetch to its owner. Scaling = throughput(S) / throughput(1).
A py-spy profile of the single syncer is summarised in docs/results/profiles/."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time

from perf_common import (PROFILES, SyncerProc, SyntheticLearner, fragment_payloads, meta_model,
                         pyspy_start, row, spec_of, summarise_collapsed, wait_proc)

CHUNK = 4 << 20


def _tcp_sink(port_conn) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_conn.send(srv.getsockname()[1])
    c, _ = srv.accept()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    n = 0
    while True:
        k = c.recv_into(mv)
        if k == 0:
            break
        n += k
    port_conn.send(n)


def raw_tcp_bytes_per_s(duration_s: float) -> float:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_tcp_sink, args=(b,), daemon=True)
    p.start()
    port = a.recv()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    data = memoryview(bytes(CHUNK))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duration_s:
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    n = a.recv()
    dt = time.perf_counter() - t0
    s.close()
    p.join(10)
    return n / dt


def syncer_bytes_per_s(S: int, M: int, duration_s: float, spec: dict, init: bytes,  # noqa: N803
                       payloads: list[bytes], profile: str | None = None) -> dict:
    P = spec["P"]  # noqa: N806
    syncers = [SyncerProc(threads=1) for _ in range(S)]
    try:
        # one client per (learner, shard): a learner routes fragment p to shard p mod S
        learners = [[SyntheticLearner(sy.address, m, spec) for sy in syncers] for m in range(M)]
        for m in range(M):
            for s in range(S):
                learners[m][s].join(init)
        stop = threading.Event()
        spy = None
        if profile:
            spy = pyspy_start(syncers[0].pid, duration_s, PROFILES / f"{profile}.raw")

        def work(m: int) -> None:
            i = m * (P // M)  # learners start at different fragments
            while not stop.is_set():
                p = i % P
                lr = learners[m][p % S]
                lr.push(p, payloads[p])
                lr.fetch([p])
                i += 1

        threads = [threading.Thread(target=work, args=(m,), daemon=True) for m in range(M)]
        b0 = sum(lr.bytes_pushed + lr.bytes_fetched for ls in learners for lr in ls)
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(duration_s)
        stop.set()
        for t in threads:
            t.join(60)
        dt = time.perf_counter() - t0
        pushed = sum(lr.bytes_pushed for ls in learners for lr in ls)
        fetched = sum(lr.bytes_fetched for ls in learners for lr in ls)
        moved = pushed + fetched - b0
        for ls in learners:
            for lr in ls:
                lr.close()
        wait_proc(spy)
        text = ""
        if profile:
            text = summarise_collapsed(PROFILES / f"{profile}.raw", PROFILES / f"{profile}.txt",
                                       f"syncer process (S={S}, M={M}) during perf_syncer")
        return {"S": S, "M": M, "seconds": dt, "bytes_moved": moved,
                "bytes_per_s": moved / dt, "profile": bool(text)}
    finally:
        for sy in syncers:
            sy.close()


def main(quick: bool = False) -> dict:
    dur = 3.0 if quick else 10.0
    M = 4  # noqa: N806
    model = meta_model("gpt_tiny") if quick else meta_model("gpt_small")
    P = 8 if quick else 24  # noqa: N806
    spec = spec_of(model, P)
    init, payloads = fragment_payloads(spec)
    raw = raw_tcp_bytes_per_s(dur)
    s1 = syncer_bytes_per_s(1, M, dur, spec, init, payloads,
                            profile=None if quick else "syncer_s1")
    s2 = syncer_bytes_per_s(2, M, dur, spec, init, payloads)
    raw_after = raw_tcp_bytes_per_s(dur)
    raw_mean = (raw + raw_after) / 2
    frac = s1["bytes_per_s"] / raw_mean
    scale2 = s2["bytes_per_s"] / s1["bytes_per_s"]
    return {"rows": [
        row("2a. syncer ingest+merge+send-back vs raw loopback TCP (1 process)",
            f"{frac:.1%} ({s1['bytes_per_s'] / 1e6:.0f} MB/s vs {raw_mean / 1e6:.0f} MB/s raw)",
            ">= 50%", frac >= 0.5,
            f"raw TCP before/after: {raw / 1e6:.0f} / {raw_after / 1e6:.0f} MB/s; model "
            f"{'gpt_tiny' if quick else 'gpt_small'}, P={P}, M={M}, fp32 pushes, K=1",
            fraction=frac),
        row("2b. syncer sharded by fragment, S=2 (core count 2)",
            f"{scale2:.2f}x of S=1 ({s2['bytes_per_s'] / 1e6:.0f} MB/s)", ">= 0.8 x S = 1.6x",
            scale2 >= 1.6, "shards are unmodified SyncerServer processes; the synthetic "
            "learners route fragment p to shard p mod S (DecoupledLearner has no shard routing)",
            scaling=scale2)],
        "details": {"raw_tcp_bytes_per_s": [raw, raw_after], "S1": s1, "S2": s2,
                    "model_bytes": len(init), "P": P}}


if __name__ == "__main__":
    import json
    print(json.dumps(main(quick=True), indent=1))
