"""What a hot standby's replication costs per merge, against the checkpoint of today.

A syncer state of ``--params`` parameters in ``--fragments`` fragments (theta and outer
momentum, fp32) and the rest of a checkpoint's snapshot (versions, per-learner merge
sequence numbers and ledgers of ``--learners`` learners). Each merge replaces one
fragment's tensors, as the syncer's merge does; after it, as the leader of
``ddiloco syncer --ha --ha-replicate`` does:

- **checkpoint**: ``save_atomic`` of the snapshot, incremental (the fragments not merged
  named from the checkpoint before), fsynced: what publication waits for today;
- **replication**: one ``Replicator.round`` to a standby over gRPC on loopback, which
  applies it and writes its own incremental checkpoint before it acknowledges: what
  publication waits for in addition with a hot standby.

Both write to the same disk and run on the same machine (the standby in this process).
The first round sends every fragment (a new standby) and is reported apart. Writes
``replication.json`` and ``replication.md`` under ``--out``.

    PYTHONPATH=src python bench/syncer_replication.py --params 1e8 --fragments 8 --merges 6
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

from ddiloco.runtime.syncer.checkpoint import CHECKPOINT_NAME, save_atomic
from ddiloco.runtime.syncer.replica import REPLICATE, ReplicaStore, Replicator
from ddiloco.runtime.transport import wire


class _Valid:
    def valid(self) -> bool:
        return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e7)
    ap.add_argument("--fragments", type=int, default=8)
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--merges", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where both write (default: a temp dir)")
    ap.add_argument("--out", default="/tmp/replication")
    a = ap.parse_args()
    torch.set_num_threads(1)
    P, n = a.fragments, int(a.params) // a.fragments  # noqa: N806 - the paper's symbol
    work = Path(a.dir or tempfile.mkdtemp(prefix="ddiloco-repl-"))
    theta = [[torch.randn(n)] for _ in range(P)]
    momentum = [[torch.zeros(n)] for _ in range(P)]
    versions = [0] * P
    M = a.learners  # noqa: N806
    merged_seq = {str(m): {str(p): 0 for p in range(P)} for m in range(M)}

    def snapshot() -> dict:
        return {
            "state": {"theta": list(theta), "momentum": list(momentum), "merges": sum(versions)},
            "versions": list(versions),
            "merged_seq": merged_seq,
            "incarnations": {str(m): 1 for m in range(M)},
            "accounting": {
                "learners": {str(m): {"report": {"tokens": 1000 * m}} for m in range(M)}
            },
        }

    store = ReplicaStore(work / "standby")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), options=wire.GRPC_SERVER_OPTIONS
    )
    handlers = {REPLICATE: grpc.stream_unary_rpc_method_handler(store.handler(lambda ctx: True))}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    rep = Replicator(1, _Valid(), "tok", lambda: {f"127.0.0.1:{port}": (1, True)}, timeout_s=600)
    rows = []
    entries: list = []
    try:
        for k in range(a.merges + 1):
            if k:  # a merge: fragment p's tensors replaced, its version and seqs advanced
                p = (k - 1) % P
                theta[p] = [theta[p][0] + 0.001]
                momentum[p] = [momentum[p][0] + 0.001]
                versions[p] += 1
                for m in range(M):
                    merged_seq[str(m)][str(p)] += 1
            t0 = time.monotonic()
            reuse = {q: e for q, e in enumerate(entries) if e is not None and not (k and q == p)}
            w = save_atomic(snapshot(), work / "leader" / CHECKPOINT_NAME, reuse=reuse)
            ck_s = time.monotonic() - t0
            entries = w.fragments
            st = rep.round(snapshot())
            assert st is not None
            # as the leader does it: both at once, publication waits for the later one
            if k:
                theta[p] = [theta[p][0] + 0.001]
                momentum[p] = [momentum[p][0] + 0.001]
                versions[p] += 1
            t1 = time.monotonic()
            reuse = {q: e for q, e in enumerate(entries) if e is not None and not (k and q == p)}
            th = threading.Thread(target=lambda: rep.round(snapshot()))
            th.start()
            w2 = save_atomic(snapshot(), work / "leader" / CHECKPOINT_NAME, reuse=reuse)
            th.join()
            both_s = time.monotonic() - t1
            entries = w2.fragments
            rows.append(
                {
                    "merge": k,
                    "checkpoint_bytes": w.bytes,
                    "checkpoint_s": round(ck_s, 4),
                    "replication_bytes": st.bytes,
                    "replication_s": round(st.seconds, 4),
                    "full": bool(st.full),
                    "both_overlapped_s": round(both_s, 4),
                }
            )
            print(rows[-1], flush=True)
    finally:
        rep.close()
        server.stop(None)
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    steady = [r for r in rows if not r["full"]]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    doc = {
        "params": int(a.params),
        "fragments": P,
        "learners": M,
        "fragment_bytes": 2 * 4 * n,
        "rows": rows,
        "median_per_merge": {
            k: med(k)
            for k in (
                "checkpoint_bytes",
                "checkpoint_s",
                "replication_bytes",
                "replication_s",
                "both_overlapped_s",
            )
        },
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replication.json").write_text(json.dumps(doc, indent=2))
    m = doc["median_per_merge"]
    md = [
        f"Per merge, {int(a.params):.0e} parameters in {P} fragments, {M} learners "
        f"(median of {len(steady)} merges; the first, full round apart):",
        "",
        "| | bytes | seconds |",
        "|---|---:|---:|",
        f"| checkpoint (incremental, fsynced) | {m['checkpoint_bytes']:,.0f} | "
        f"{m['checkpoint_s']:.3f} |",
        f"| replication to one standby (sent; acknowledged once on its disk) | "
        f"{m['replication_bytes']:,.0f} | {m['replication_s']:.3f} |",
        f"| both, overlapped as the leader runs them (publication waits this long) | | "
        f"{m['both_overlapped_s']:.3f} |",
        f"| first round (every fragment) | {rows[0]['replication_bytes']:,} | "
        f"{rows[0]['replication_s']:.3f} |",
    ]
    (out / "replication.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
