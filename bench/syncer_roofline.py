"""The syncer's fragment merge against its roofline: a real syncer, synthetic learners, and
the machine's own loopback TCP and memory bandwidth measured beside it.

What runs (per case: a setting and a learner count M)
  - One syncer process started as the launcher starts one (``python -m ddiloco.runtime.cli
    syncer --config run.toml``), with the run file of ``bench/syncer_memory.py`` (P
    fragments, K = M, no grace window; ``default``: bf16 pushes, fp32 downlink, no
    checkpoints; ``int4dd``: int4 delta pushes, int4 delta-coded downlink, a checkpoint
    before every publication, in a temp dir under ``$TMPDIR``). ``OMP_NUM_THREADS=1``.
  - M synthetic learners (threads of this process, ``synthetic_load.SyntheticLearner``)
    that speak the real protocol: join (learner 0 uploads the model), fetch every fragment,
    then ``rounds`` x P pushes with no schedule gap: each learner pushes fragment j mod P,
    waits (Watch) until it is merged, fetches it on the data port, drops it and pushes the
    next. With K = M and one push in flight per learner the merges follow one another, so
    the measured window holds ``rounds`` x P merges and nothing else.

What is measured, per case
  - the syncer's CPU seconds (user + system, ``/proc/PID/stat``) and the wall time of the
    window, per merge; also each merge's span (first push sent to last fetch received);
  - the bytes through sockets: the push payloads received and the fetch replies sent in
    the window (counted by the learners), per merge;
  - the machine, right before and right after the window: raw loopback TCP (one process
    streams 4 MiB buffers to another, ``perf_syncer.raw_tcp_bytes_per_s``, best of 3 runs of
    1 s), and memory bandwidth on one thread (the syncer runs with one torch thread): a
    ``copy_`` of a 256 MiB fp32 tensor (bytes read + written per second) and a ``sum`` of it
    (bytes read per second), each the best of 5; with checkpoints, also a 256 MiB write
    with ``fsync`` where the checkpoints go. The roofline uses the mean of the before and
    after figures (the machine is shared; the windows are adjacent to the merges').

The memory traffic model (bytes one merge of a fragment of n fp32 elements must move
through memory, beyond the socket copies; e_up: bytes per element of a push as received,
e_down of the downlink codec, r = 1.0625 of the downlink chain's int8 residual):
  - fold: each push is read once (its finite check, norm, decode and weighted sum in one
    pass) into one fp32 accumulator: the first push writes it (e_up + 4) n, every other
    reads and writes it (e_up + 8) n. A delta push against the current version needs nothing
    more (in this bench every push names the version current at its merge);
  - outer step: read Theta, the momentum and the fold, write the new Theta and momentum:
    20 n; a delta push codec also records the step for past versions in bf16: + 2 n;
  - downlink: fp32 is sent from the new Theta itself (0); another codec reads Theta and
    writes its encoding (4 + e_down) n; delta-coded, the step against the chain's reference
    reads Theta, the reference Theta and its residual and writes the step and the new
    residual (8 + 2 r + e_down) n;
  - checkpoint (on): the merged fragment's Theta and momentum copied into files (read and
    written once, hashed in the same pass): 16 n. (Each checkpoint writes the fragments
    merged since the one before and names the others' files; the measured checkpoint bytes
    per merge are reported beside.) The disk is a third
    resource: with checkpoints, ``roofline_disk_s`` adds the merged fragment's 8 n bytes at
    the measured disk rate (``fsync`` waits for them, and publication for the checkpoint).
The socket bytes are the payloads measured: M pushes in and M fetch replies out.

Roofline = socket bytes / raw TCP rate + memory bytes / copy rate. The two are added, not
max'ed: loopback TCP is memory copying by the same CPU cores (no network device works
beside them), the syncer runs one merge's decode and outer step on the same core(s) as its
socket reads and writes, and the merge orders them (the last push in, the outer step, then
the fragments out). ``max`` of the two, the bound of a syncer that fully overlapped its
sockets with its arithmetic on separate cores, is in the JSON as ``roofline_overlap_s``.
The figure of merit is each merge's wall time (and the syncer's CPU time) as a multiple of
its roofline, since both sides of the ratio are measured on the same machine minutes apart.

Usage:
  python bench/syncer_roofline.py                                  # N = 1e8, M = 4,8
  python bench/syncer_roofline.py --params 1e8 --learners 4,8,16 --profile
  python bench/syncer_roofline.py --params 1e9 --settings default --learners 8 --rounds 1

Writes ``OUT/roofline.json`` and ``OUT/roofline.md`` (``--out``, runs/bench/syncer_roofline);
``--profile`` samples the syncer with py-spy (if installed) during each case's window and
writes a summary of its on-CPU frames to ``docs/results/profiles/`` (``--profile-dir``).
From ``bench/run_all.py``: ``main(quick=...)`` returns ``{"rows", "details"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from perf_common import PROFILES, have_pyspy, row, summarise_collapsed, wait_proc  # noqa: E402
from perf_syncer import raw_tcp_bytes_per_s  # noqa: E402
from syncer_memory import SETTINGS, Case, _run_file  # noqa: E402
from synthetic_load import (  # noqa: E402
    Syncers,
    SyntheticLearner,
    cpu_s,
    in_threads,
    mem_available,
    push_payloads,
    status_bytes,
    synthetic_spec,
)

from ddiloco.algorithm.codecs import get_codec  # noqa: E402
from ddiloco.algorithm.downlink import RESIDUAL_CODEC  # noqa: E402
from ddiloco.runtime.transport.auth import TOKEN_ENV, new_token  # noqa: E402

__all__ = ["memory_bytes", "machine", "run_case", "markdown", "main"]

MEM_BENCH_NUMEL = 1 << 26
"""Elements of the memory-bandwidth tensors (256 MiB of fp32: far beyond the caches)."""


# -- the machine ------------------------------------------------------------------------------
def memory_bandwidth(numel: int = MEM_BENCH_NUMEL, repeat: int = 5) -> dict:
    """One thread: ``copy_`` (bytes read + written per second) and ``sum`` (bytes read per
    second) of an fp32 tensor of ``numel`` elements, each the best of ``repeat``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.rand(numel)
        dst = torch.empty_like(src)
        nbytes = 4 * numel
        best_copy = best_sum = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            dst.copy_(src)
            best_copy = min(best_copy, time.perf_counter() - t)
            t = time.perf_counter()
            src.sum()
            best_sum = min(best_sum, time.perf_counter() - t)
        return {"copy_bytes_per_s": 2 * nbytes / best_copy, "sum_bytes_per_s": nbytes / best_sum}
    finally:
        torch.set_num_threads(threads)


def disk_bytes_per_s(directory: Path, nbytes: int = 1 << 28) -> float:
    """Write ``nbytes`` to a file in ``directory`` in 1 MiB pieces and ``fsync`` it (as a
    checkpoint is written); bytes per second, the file removed."""
    directory.mkdir(parents=True, exist_ok=True)
    piece = bytes(1 << 20)
    path = directory / f".disk-rate.{os.getpid()}"
    try:
        t = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(nbytes >> 20):
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        return nbytes / (time.perf_counter() - t)
    finally:
        path.unlink(missing_ok=True)


def machine(tcp_s: float = 1.0, tcp_repeat: int = 3, disk_dir: Path | None = None) -> dict:
    """Raw loopback TCP (best of ``tcp_repeat`` runs of ``tcp_s``), memory bandwidth and,
    with ``disk_dir``, the rate of a 256 MiB write with ``fsync`` there; with the load
    average when they were measured."""
    tcp = max(raw_tcp_bytes_per_s(tcp_s) for _ in range(tcp_repeat))
    out = {"tcp_bytes_per_s": tcp, **memory_bandwidth(), "loadavg": _loadavg()}
    if disk_dir is not None:
        out["disk_bytes_per_s"] = disk_bytes_per_s(disk_dir)
    return out


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _mean_machine(a: dict, b: dict) -> dict:
    keys = ("tcp_bytes_per_s", "copy_bytes_per_s", "sum_bytes_per_s", "disk_bytes_per_s")
    return {k: (a[k] + b[k]) / 2 for k in keys if k in a and k in b}


# -- the model --------------------------------------------------------------------------------
def memory_bytes(case: Case, n: int, push_bytes: float) -> dict:
    """Bytes one merge of a fragment of ``n`` elements must move through memory (the module
    doc's model), by term; ``push_bytes``: one push's payload as received."""
    M = case.learners  # noqa: N806 - the paper's symbol
    up, down = get_codec(case.codec), get_codec(case.down_codec)
    e_up, e_down = push_bytes / n, down.bits_per_element / 8
    r = get_codec(RESIDUAL_CODEC).bits_per_element / 8
    terms = {"fold": (M * e_up + 4 + 8 * (M - 1)) * n, "outer_step": 20 * n}
    if up.delta:
        terms["history"] = 2 * n
    if case.down_delta:
        terms["downlink"] = (8 + 2 * r + e_down) * n
    elif down.name != "fp32":
        terms["downlink"] = (4 + e_down) * n
    if case.checkpoint:
        terms["checkpoint"] = 16 * n
    terms["total"] = sum(terms.values())
    return terms


# -- one case ---------------------------------------------------------------------------------
class TimedLearner(SyntheticLearner):
    """``SyntheticLearner`` that records, for each push, when it was sent and when the fetch
    of its merge ended (``marks[j] = (t_push, t_fetched)``)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.marks: dict[int, tuple[float, float]] = {}

    def run(self, t0: float, slot_s: float) -> None:
        P = self.frag.P  # noqa: N806
        for j in range(self.rounds * P):
            p = j % P
            self._check(f"push {j}")
            base = self.versions[p]
            t = time.monotonic()
            if self.push(p, j + 1) in ("accepted", "duplicate"):
                self.wait_merged(p, base)
                self.fetch(p)
            self.marks[j] = (t, time.monotonic())


def _pyspy(pid: int, raw: Path) -> subprocess.Popen:
    """``py-spy record`` of ``pid`` until stopped (SIGINT), on-CPU samples only (no
    ``--idle``), collapsed stacks."""
    raw.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["py-spy", "record", "-p", str(pid), "-r", "50", "-f", "raw", "-o", str(raw)]
    cmd += ["--threads", "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_case(
    case: Case, *, profile: Path | None = None, measure_machine: bool = True, tcp_s: float = 1.0
) -> dict:
    """Run one case (module doc); ``profile``: a text file for the py-spy summary of the
    syncer during the window (None: no profile); ``tcp_s``: length of each raw TCP run."""
    N, P, M = case.params, case.fragments, case.learners  # noqa: N806
    t_all = time.monotonic()
    spec = synthetic_spec(N, P, case.tensors_per_fragment)
    payloads = push_payloads(spec, case.codec, case.seed)
    token = new_token()
    env = {**os.environ, TOKEN_ENV: token, "OMP_NUM_THREADS": "1"}
    base = Path(tempfile.mkdtemp(prefix="syncer-roofline-"))
    ckpt_root = base / "ckpt" if case.checkpoint else None
    run_dir = base / case.label
    run_dir.mkdir(parents=True)
    config = _run_file(case, run_dir / "config.toml")
    result: dict = {"case": {"setting": case.name, "N": N, "P": P, "M": M}, "error": None}
    result["settings"] = {
        "codec": case.codec,
        "down_codec": case.down_codec,
        "down_delta": case.down_delta,
        "checkpoint": case.checkpoint,
        "rounds": case.rounds,
        "K": case.K,
    }
    learners: list[TimedLearner] = []
    syncers = None
    spy = None
    try:
        syncers = Syncers(config, 1, run_dir, env, ckpt_root)
        pid = syncers.pids[0]
        learners = [
            TimedLearner(
                m,
                syncers.addresses,
                token,
                spec,
                payloads,
                codec=case.codec,
                H=case.H,
                rounds=case.rounds,
                seed=case.seed,
                deadline=t_all + case.timeout_s,
            )
            for m in range(M)
        ]
        learners[0].join()
        in_threads(lambda lr: lr.join(), learners[1:])
        in_threads(lambda lr: [lr.fetch(p) for p in range(P)], learners)
        before = machine(tcp_s, disk_dir=ckpt_root) if measure_machine else None
        status0 = learners[0].sc.clients[0].status(timeout_s=60.0)
        stats0 = sum((Counter(lr.stats) for lr in learners), Counter())
        if profile is not None and have_pyspy():
            raw = profile.with_suffix(".raw")
            spy = _pyspy(pid, raw)
            time.sleep(1.0)  # py-spy attached
        load0 = _loadavg()
        c0, t0 = cpu_s(pid), time.monotonic()
        in_threads(lambda lr: lr.run(t0, 0.0), learners)
        t1, c1 = time.monotonic(), cpu_s(pid)
        load1 = _loadavg()
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes what it sampled
            wait_proc(spy, 60)
        status1 = learners[0].sc.clients[0].status(timeout_s=60.0)
        hwm = status_bytes(pid, "VmHWM")
        stats1 = sum((Counter(lr.stats) for lr in learners), Counter())
        after = machine(tcp_s, disk_dir=ckpt_root) if measure_machine else None
        for lr in learners:
            lr.leave()
    except Exception as e:  # noqa: BLE001 - reported in the result
        result["error"] = f"{type(e).__name__}: {e}"
        return result
    finally:
        for lr in learners:
            lr.close()
        if spy is not None and spy.poll() is None:
            spy.kill()
        codes = syncers.stop() if syncers is not None else []
        shutil.rmtree(base, ignore_errors=True)
    result["exit_codes"] = codes
    cnt0, cnt1 = status0["counters"], status1["counters"]
    merges = int(cnt1.get("merges", 0)) - int(cnt0.get("merges", 0))
    if merges < 1:
        result["error"] = "no merge in the window"
        return result
    wall, cpu = t1 - t0, c1 - c0
    pushed = stats1["bytes_pushed"] - stats0["bytes_pushed"]
    fetched = stats1["bytes_fetched"] - stats0["bytes_fetched"]
    n = N / P  # elements of a fragment (balanced: the P fragments are equal but for the rest)
    push_each = pushed / (merges * M)
    mem = memory_bytes(case, n, push_each)
    sock = (pushed + fetched) / merges
    spans = [
        max(lr.marks[j][1] for lr in learners) - min(lr.marks[j][0] for lr in learners)
        for j in range(case.rounds * P)
    ]
    result.update(
        {
            "merges": merges,
            "fragment_elements": n,
            "window_s": wall,
            "syncer_cpu_s": cpu,
            "per_merge": {
                "wall_s": wall / merges,
                "cpu_s": cpu / merges,
                "span_median_s": statistics.median(spans),
                "socket_bytes": sock,
                "push_bytes_in": pushed / merges,
                "fetch_bytes_out": fetched / merges,
                "memory_bytes": mem,
            },
            "checkpoints": int(cnt1.get("checkpoints", 0)) - int(cnt0.get("checkpoints", 0)),
            "checkpoint_bytes_each": int(cnt1.get("checkpoint_bytes", 0)),
            "checkpoint_bytes_per_merge": (
                int(cnt1.get("checkpoint_bytes_total", 0))
                - int(cnt0.get("checkpoint_bytes_total", 0))
            )
            / merges,
            "checkpoint_s": float(cnt1.get("checkpoint_s_total", 0))
            - float(cnt0.get("checkpoint_s_total", 0)),
            "learner_stats": {k: stats1[k] - stats0[k] for k in stats1},
            "loadavg": {"before": load0, "after": load1},
            "syncer_peak_rss_bytes": hwm,
            "bench_peak_rss_bytes": status_bytes(os.getpid(), "VmHWM"),
            "times_s": {"case": round(time.monotonic() - t_all, 2)},
        }
    )
    if measure_machine:
        mach = _mean_machine(before, after)
        result["machine"] = {"before": before, "after": after, "mean": mach}
        tcp_s = sock / mach["tcp_bytes_per_s"]
        mem_s = mem["total"] / mach["copy_bytes_per_s"]
        pm = result["per_merge"]
        pm.update(
            {
                "socket_s": tcp_s,
                "memory_s": mem_s,
                "roofline_s": tcp_s + mem_s,
                "roofline_overlap_s": max(tcp_s, mem_s),
                "wall_x_roofline": pm["wall_s"] / (tcp_s + mem_s),
                "cpu_x_roofline": pm["cpu_s"] / (tcp_s + mem_s),
                "span_x_roofline": pm["span_median_s"] / (tcp_s + mem_s),
                "data_rate_vs_tcp": sock / pm["wall_s"] / mach["tcp_bytes_per_s"],
            }
        )
        if "disk_bytes_per_s" in mach:  # the merged fragment's Theta and momentum on disk
            pm["disk_bytes"] = 8 * n
            pm["disk_s"] = 8 * n / mach["disk_bytes_per_s"]
            pm["roofline_disk_s"] = tcp_s + mem_s + pm["disk_s"]
            pm["wall_x_roofline_disk"] = pm["wall_s"] / pm["roofline_disk_s"]
    if spy is not None and profile is not None:
        title = (
            f"syncer during {merges} fragment merges ({case.name}, N={N:.3g}, P={P}, M={M}; "
            f"{cpu / merges:.2f} s of syncer CPU and {wall / merges:.2f} s wall per merge)"
        )
        text = summarise_collapsed(
            profile.with_suffix(".raw"),
            profile,
            title,
            sampled="50 Hz, threads not idle: on a core or waiting for one or for the GIL",
        )
        if text:
            result["profile"] = str(profile)
            result["profile_samples_per_merge"] = _samples(text) / merges
    return result


def _samples(summary: str) -> int:
    for line in summary.splitlines():
        if line.startswith("py-spy samples:"):
            return int(line.split()[2])
    return 0


# -- the report -------------------------------------------------------------------------------
def markdown(results: list[dict]) -> str:
    head = (
        "| setting | N | M | merges | CPU s / merge | wall s / merge | socket MB / merge | "
        "memory MB / merge | raw TCP MB/s | copy MB/s | roofline s | wall x roofline | "
        "CPU x roofline | data rate / raw TCP | load |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in results:
        c = r["case"]
        if r["error"]:
            rows.append(f"| {c['setting']} | {c['N']:.3g} | {c['M']} | {r['error']} |" + " |" * 11)
            continue
        pm, m = r["per_merge"], r.get("machine", {}).get("mean")
        load = max(r["loadavg"]["before"][0], r["loadavg"]["after"][0])
        if m is None:
            rows.append(
                f"| {c['setting']} | {c['N']:.3g} | {c['M']} | {r['merges']} | "
                f"{pm['cpu_s']:.2f} | {pm['wall_s']:.2f} | {pm['socket_bytes'] / 1e6:.0f} | "
                f"{pm['memory_bytes']['total'] / 1e6:.0f} | - | - | - | - | - | - | {load:.1f} |"
            )
            continue
        rows.append(
            f"| {c['setting']} | {c['N']:.3g} | {c['M']} | {r['merges']} | {pm['cpu_s']:.2f} | "
            f"{pm['wall_s']:.2f} | {pm['socket_bytes'] / 1e6:.0f} | "
            f"{pm['memory_bytes']['total'] / 1e6:.0f} | {m['tcp_bytes_per_s'] / 1e6:.0f} | "
            f"{m['copy_bytes_per_s'] / 1e6:.0f} | {pm['roofline_s']:.3f} | "
            f"**{pm['wall_x_roofline']:.1f}** | {pm['cpu_x_roofline']:.1f} | "
            f"{pm['data_rate_vs_tcp']:.1%} | {load:.1f} |"
        )
    return head + "\n".join(rows) + "\n"


def _cases(a) -> list[Case]:
    cases = []
    for name in a.settings.split(","):
        if name not in SETTINGS:
            raise SystemExit(f"unknown setting {name!r}; choose from {', '.join(SETTINGS)}")
        for M in (int(x) for x in a.learners.split(",")):  # noqa: N806
            cases.append(
                Case(
                    name=name,
                    params=int(a.params),
                    learners=M,
                    fragments=a.fragments,
                    rounds=a.rounds,
                    **SETTINGS[name](),
                )
            )
    return cases


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e8, help="N, fp32 parameters")
    ap.add_argument("--settings", default="default,int4dd", help=f"of {', '.join(SETTINGS)}")
    ap.add_argument("--learners", "-M", default="4,8", help="comma-separated learner counts")
    ap.add_argument("--fragments", "-P", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="merges per fragment")
    ap.add_argument("--tcp-s", type=float, default=1.0, help="length of each raw TCP run")
    ap.add_argument("--profile", action="store_true", help="py-spy the syncer (if installed)")
    ap.add_argument("--profile-dir", default=str(PROFILES))
    ap.add_argument("--out", default="runs/bench/syncer_roofline")
    return ap


def _check_memory(case: Case) -> str | None:
    """Why a case cannot run here, or None: the syncer holds about 2.5 fp32 models (3.5
    with int4dd), this process one encoded model and the M fetched fragments."""
    need = 4 * case.params * (3.5 if case.down_delta else 2.5)
    need += 4 * case.params * (0.5 + case.learners / case.fragments)
    avail = mem_available()
    if need > 0.9 * avail:
        return f"skipped: needs about {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
    return None


def main(argv: list[str] | None = None, quick: bool | None = None) -> dict:
    """The CLI (``argv``), or the ``bench/run_all.py`` entry (``quick`` given: N = 1e7, M =
    4, default only when quick; N = 1e8, M = 8, default and int4dd otherwise)."""
    from_run_all = quick is not None
    if from_run_all:
        argv = (
            ["--params", "1e7", "--settings", "default", "--learners", "4"]
            if quick
            else ["--params", "1e8", "--learners", "8"]
        )
    a = _parser().parse_args(argv)
    command = " ".join(["python", "bench/syncer_roofline.py", *(argv or [])])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in _cases(a):
        tag = f"{case.name}_N{case.params:.0e}_M{case.learners}".replace("+", "")
        print(f"[syncer_roofline] {tag} ...", file=sys.stderr, flush=True)
        skip = _check_memory(case)
        if skip:
            results.append(
                {
                    "case": {
                        "setting": case.name,
                        "N": case.params,
                        "P": case.fragments,
                        "M": case.learners,
                    },
                    "error": skip,
                }
            )
            continue
        prof = Path(a.profile_dir) / f"syncer_merge_{tag}.txt" if a.profile else None
        r = run_case(case, profile=prof, tcp_s=a.tcp_s)
        r["command"] = command
        results.append(r)
        print(markdown([r]).splitlines()[2], file=sys.stderr, flush=True)
    res = {
        "command": command,
        "machine": f"{os.cpu_count()} cores (shared), Python {sys.version.split()[0]}",
        "runs": results,
    }
    (out / "roofline.json").write_text(json.dumps(res, indent=1))
    md = f"`{command}`\n\n" + markdown(results)
    (out / "roofline.md").write_text(md)
    print(md)
    return {"rows": _rows(results), "details": res}


def _rows(results: list[dict]) -> list[dict]:
    """Lines of ``bench/run_all.py``'s table: one per case (no target: a reference)."""
    rows = []
    for r in results:
        c = r["case"]
        target = (
            f"7. syncer fragment merge vs its roofline ({c['setting']}, N={c['N']:.0e}, M={c['M']})"
        )
        if r["error"] or "roofline_s" not in r.get("per_merge", {}):
            rows.append(row(target, r["error"] or "not measured", "-", None))
            continue
        pm, m = r["per_merge"], r["machine"]["mean"]
        rows.append(
            row(
                target,
                f"{pm['wall_x_roofline']:.1f}x roofline ({pm['wall_s']:.2f} s wall, "
                f"{pm['cpu_s']:.2f} s syncer CPU per merge; roofline {pm['roofline_s']:.3f} s)",
                "- (reference)",
                None,
                f"{r['merges']} merges, P={c['P']}; per merge {pm['socket_bytes'] / 1e6:.0f} MB "
                f"through sockets at raw TCP {m['tcp_bytes_per_s'] / 1e6:.0f} MB/s and "
                f"{pm['memory_bytes']['total'] / 1e6:.0f} MB through memory at copy "
                f"{m['copy_bytes_per_s'] / 1e6:.0f} MB/s (both measured beside the window); "
                f"data rate {pm['data_rate_vs_tcp']:.1%} of raw TCP",
                **pm,
            )
        )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
