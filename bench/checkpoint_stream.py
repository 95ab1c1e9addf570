"""Syncer checkpoints at scale (issue 22): the memory and the disk throughput of a write and
of a resume of a real ``SyncerServer``'s state of N fp32 parameters.

What runs, each phase in a fresh Python process (so that its peak RSS is its own):

- ``write``: a ``SyncerServer`` with a checkpoint directory gets the state of a model of N
  parameters (``_setup`` with the initial model handed over, as ``Init`` does) and a
  momentum of the same size, both filled with values; then one checkpoint is written as the
  checkpoint thread writes it (``_snapshot`` under the server's lock, ``durability.write``
  outside).
- ``resume``: a ``SyncerServer`` with ``resume=True`` loads it (``durability.load``: the
  newest valid checkpoint, every fragment file's SHA-256 and finite check), and the resumed
  theta and momentum are compared with the written ones (a sum per fragment).

Between the two the page cache of the checkpoint's files is dropped (``posix_fadvise
DONTNEED`` on each file, after its data was synced), so the resume reads from the disk.

What is measured per phase: RSS before, the peak (``VmHWM``, reset to the current RSS with
``/proc/self/clear_refs`` just before the phase's work) and the peak above the live state
(write: above the RSS with the state in memory; resume: above the RSS at start plus the
live state, 2 x 4N bytes), in bytes and in units of 4N (one fp32 copy of the model); the
wall time and the bytes on disk, as MB/s.

The model is ``tensors_per_fragment`` x P equal fp32 vectors whose sizes sum to N (balanced
fragmentation: P equal fragments).

Usage:
  python bench/checkpoint_stream.py --params 2e7 --out /tmp/ck.json   # quick
  python bench/checkpoint_stream.py                                   # N = 1e9 (peak ~10.2 GB)

Writes ``--out`` (JSON, default runs/bench/checkpoint_stream.json) and the same name with
``.md`` (a short summary). The checkpoint goes to ``--dir`` (default: a temp directory
beside ``--out``), removed at the end unless ``--keep-files``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1e6


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _spec(params: int, P: int, per_fragment: int) -> dict:  # noqa: N803
    T = P * per_fragment  # noqa: N806
    sizes = [params // T] * T
    sizes[-1] += params - sum(sizes)
    return {
        "names": [f"w{i}" for i in range(T)],
        "shapes": [[s] for s in sizes],
        "esizes": [4] * T,
        "dtypes": ["float32"] * T,
        "embedding": [],
        "P": P,
        "strategy": "balanced",
    }


def _server(directory: str, resume: bool):
    from ddiloco.runtime.syncer.server import SyncerServer, SyncerServerConfig

    return SyncerServer(
        SyncerServerConfig(token="bench", checkpoint_dir=directory, resume=resume, bulk_port=0)
    )


def _sums(state) -> list[list[float]]:
    return [
        [float(sum(float(t.double().sum()) for t in ts)) for ts in (f.theta, f.momentum)]
        for f in state.frags
    ]


def phase_write(directory: str, params: int, P: int, per_fragment: int) -> dict:  # noqa: N803
    import torch

    spec = _spec(params, P, per_fragment)
    g = torch.Generator().manual_seed(0)
    initial = {
        n: torch.empty(s).uniform_(-1, 1, generator=g)
        for n, s in zip(spec["names"], spec["shapes"])
    }
    srv = _server(directory, resume=False)
    srv._setup(spec, initial)
    del initial
    for f in srv.state.frags:  # a momentum with values, built tensor by tensor
        f.momentum = [torch.empty_like(t).uniform_(-1e-3, 1e-3, generator=g) for t in f.theta]
    before = _status()["VmRSS"]
    reset = _reset_peak()
    t0 = time.perf_counter()
    with srv._lock:
        snap = srv._snapshot()
    srv.durability.write(snap)
    del snap
    wall_s = time.perf_counter() - t0
    peak = _status()["VmHWM"]
    return {
        "rss_before_bytes": before,
        "peak_rss_bytes": peak,
        "peak_above_live_bytes": peak - before,
        "peak_reset": reset,
        "wall_s": wall_s,
        "bytes": int(srv.counters["checkpoint_bytes"]),
        "sums": _sums(srv.state),
    }


def phase_resume(directory: str, params: int) -> dict:
    import torch  # noqa: F401 - imported before the baseline, as a syncer has it

    import ddiloco.runtime.syncer.server  # noqa: F401

    before = _status()["VmRSS"]
    reset = _reset_peak()
    t0 = time.perf_counter()
    srv = _server(directory, resume=True)
    wall_s = time.perf_counter() - t0
    peak = _status()["VmHWM"]
    live = 2 * 4 * params
    return {
        "rss_before_bytes": before,
        "peak_rss_bytes": peak,
        "peak_above_start_bytes": peak - before,
        "peak_above_live_bytes": peak - before - live,
        "peak_reset": reset,
        "wall_s": wall_s,
        "sums": _sums(srv.state),
    }


def _drop_cache(directory: Path) -> None:
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _run_phase(args: list[str]) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        raise RuntimeError(f"phase {args[:2]} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(
    params: float = 1e9,
    fragments: int = 4,
    tensors_per_fragment: int = 8,
    directory: str | None = None,
    keep_files: bool = False,
) -> dict:
    """Write then resume a syncer state of ``params`` parameters; the result as a dict."""
    n = int(params)
    made = directory is None
    d = Path(directory or tempfile.mkdtemp(prefix="ckpt_stream_"))
    d.mkdir(parents=True, exist_ok=True)
    try:
        common = ["--params", str(n), "--dir", str(d)]
        w = _run_phase(["--phase", "write", *common, "--fragments", str(fragments),
                        "--tensors-per-fragment", str(tensors_per_fragment)])  # fmt: skip
        _drop_cache(d)
        r = _run_phase(["--phase", "resume", *common])
    finally:
        if made and not keep_files:
            shutil.rmtree(d, ignore_errors=True)
    model = 4 * n
    return {
        "params": n,
        "model_bytes": model,
        "fragments": fragments,
        "tensors_per_fragment": tensors_per_fragment,
        "checkpoint_bytes": w["bytes"],
        "write": {
            **{k: v for k, v in w.items() if k not in ("sums", "bytes")},
            "peak_above_live_x_model": w["peak_above_live_bytes"] / model,
            "mb_per_s": w["bytes"] / MB / w["wall_s"],
        },
        "resume": {
            **{k: v for k, v in r.items() if k != "sums"},
            "peak_above_start_x_model": r["peak_above_start_bytes"] / model,
            "peak_above_live_x_model": r["peak_above_live_bytes"] / model,
            "mb_per_s": w["bytes"] / MB / r["wall_s"],
        },
        "resumed_equal": w["sums"] == r["sums"],
        "command": " ".join(["python", "bench/checkpoint_stream.py", *sys.argv[1:]]),
    }


def markdown(res: dict) -> str:
    gb, w, r = 1e9, res["write"], res["resume"]
    return "\n".join(
        [
            f"# Checkpoint write and resume, N = {res['params']:.3g} fp32 parameters",
            "",
            f"Model 4N = {res['model_bytes'] / gb:.2f} GB; P = {res['fragments']}, "
            f"{res['tensors_per_fragment']} tensors per fragment; checkpoint "
            f"{res['checkpoint_bytes'] / gb:.2f} GB on disk; resumed state equal to the "
            f"written one: {res['resumed_equal']}.",
            "",
            "| phase | peak RSS above the live state | peak RSS above start | wall | throughput |",
            "|---|---|---|---|---|",
            f"| write | {w['peak_above_live_bytes'] / gb:.3f} GB "
            f"({w['peak_above_live_x_model']:.2f} x 4N) | - | {w['wall_s']:.1f} s | "
            f"{w['mb_per_s']:.0f} MB/s |",
            f"| resume | {r['peak_above_live_bytes'] / gb:.3f} GB "
            f"({r['peak_above_live_x_model']:.2f} x 4N) | {r['peak_above_start_bytes'] / gb:.3f} GB "
            f"({r['peak_above_start_x_model']:.2f} x 4N) | {r['wall_s']:.1f} s | "
            f"{r['mb_per_s']:.0f} MB/s |",
            "",
            f"Command: `{res['command']}`",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e9, help="N, fp32 parameters (1e9)")
    ap.add_argument("--fragments", type=int, default=4, help="P (4)")
    ap.add_argument("--tensors-per-fragment", type=int, default=8)
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--keep-files", action="store_true")
    ap.add_argument("--out", default="runs/bench/checkpoint_stream.json")
    ap.add_argument("--phase", choices=("write", "resume"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.phase == "write":
        print(json.dumps(phase_write(a.dir, int(a.params), a.fragments, a.tensors_per_fragment)))
        return 0
    if a.phase == "resume":
        print(json.dumps(phase_resume(a.dir, int(a.params))))
        return 0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    directory = a.dir or (tempfile.mkdtemp(prefix=".ckpt_stream_", dir=out.parent))
    res = measure(a.params, a.fragments, a.tensors_per_fragment, directory, a.keep_files)
    if a.dir is None and not a.keep_files:
        shutil.rmtree(directory, ignore_errors=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0 if res["resumed_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
