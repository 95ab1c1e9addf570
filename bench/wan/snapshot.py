"""Save the syncer's global model every few seconds (run by ``bench/wan/run.py`` in the
syncer's own namespace, so that its fetches cross no shaped link), for evaluation against
wall-clock time after the run."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from ddiloco.runtime.learner.client import SyncerClient


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--every-s", type=float, default=3.0)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    client = SyncerClient(a.syncer, os.environ["DDILOCO_TOKEN"])
    log = open(out / "snapshots.jsonl", "w")
    k = 0
    while True:
        t = time.time()
        try:
            got = client.fetch(None, timeout_s=30.0, exact=True)
        except Exception:  # noqa: BLE001 - no model yet, or the syncer is stopping
            time.sleep(0.5)
            continue
        path = out / f"snap_{k:05d}.pt"
        torch.save({p: [x.clone() for x in v[1]] for p, v in got.items()}, path)
        log.write(
            json.dumps(
                {"wall": t, "versions": {p: v[0] for p, v in got.items()}, "path": path.name}
            )
            + "\n"
        )
        log.flush()
        k += 1
        time.sleep(max(0.0, a.every_s - (time.time() - t)))


if __name__ == "__main__":
    main()
