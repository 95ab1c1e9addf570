"""The syncer's memory at scale (issue 22): a real syncer, synthetic learners, RSS sampled.

What runs
  - S syncer processes, each started as the launcher starts one (``python -m
    ddiloco.runtime.cli syncer --config run.toml``, with ``--shards``/``--shard`` for S > 1),
    so that each one's RSS is its own. The run file sets the push codec, the downlink codec
    and ``down_delta``, P, H, quorum K (default M, no grace window: every merge holds every
    learner), the history (unset: ``SyncConfig.resolved_history``) and a heartbeat timeout
    longer than the run (synthetic learners send no heartbeats). ``--checkpoint on`` gives
    each shard a checkpoint directory in a temp dir under ``$TMPDIR`` (``checkpoint_every =
    1``: every merge is on disk before it is published; the syncer keeps the last 3).
  - M synthetic learners, threads of this process, speak the real protocol through
    ``ShardedClient`` and its per-shard ``SyncerClient`` s. They do no training:
      * Join with the model spec; learner 0 gets ``need_init`` and uploads the initial
        model to every shard (the Init call takes the whole model in spec order): values
        are generated tensor by tensor in 16 MiB blocks from a seeded generator and sent
        in 1 MiB frames, so no model-sized buffer exists here;
      * fetch every fragment, one request per fragment on the data port (a real learner
        asks for all of them in one request), and drop the reply: only its version and,
        with ``down_delta``, the token of the copy the syncer keeps for this learner are
        kept (``SyncerClient.fetch`` would keep a model-sized clone of what it received);
      * ``rounds`` x P pushes on the time-driven schedule: push j at t0 + j x (H / P) x
        ``step_s``, of fragment j mod P (a late push goes at once). Payloads are prepared
        once and shared by all learners: for a codec whose ``delta`` is set, an encoded
        small random update sent as a delta against the version the learner last fetched;
        otherwise encoded parameters. After an accepted push the learner waits (Watch on
        the owner shard) until the fragment is merged, fetches it, drops it and goes on:
        one push in flight per learner, as a real learner with tau < H / P has;
      * retry a call refused with a retryable code, with the real learner's backoff (the
        data port counts each learner's requests as its own session's,
        ``BulkLimits.max_requests_per_session``, 8; ``E_BUSY`` beyond).
  - The model is ``tensors_per_fragment`` x P equal 2-D fp32 matrices (plus one small
    tensor for the remainder) whose sizes sum to N; balanced fragmentation makes P equal
    fragments. No tensor is an embedding.

This process holds one encoded model (the payloads) and up to M fetched fragments at a
time (``bench_peak_rss_bytes`` in the result).

What is measured, per shard (its VmRSS from /proc every ``sample_s``) and summed over the
shards: RSS at start (listening, before the model arrives), after the model arrived and
every learner fetched it, the steady state (median over the second half of the rounds),
the peak (VmHWM, read before the learners leave) and the peak above start; each in bytes
and in units of 4N bytes (one fp32 copy of the model). Also the merges, the pushes accepted,
the wall time of each phase and the syncer's CPU time (user + system). A run whose syncers
together exceed ``rss_limit_bytes`` (default 80% of the memory available at its start) is
stopped and reported as aborted.

Usage:
  python bench/syncer_memory.py --params 2e7 --learners 4 --rounds 3
  python bench/syncer_memory.py --params 6.4e7 --settings default,int4dd   # S = 1 and 2 each
  python bench/syncer_memory.py --codec int4 --down-codec int4 --down-delta --checkpoint on

Settings (``--settings``): ``default`` = bf16 pushes, fp32 downlink, no checkpoints;
``int4dd`` = int4 pushes, int4 delta-coded downlink, checkpoints on. Each runs with every
shard count of ``--shard-counts`` (1,2). Writes ``OUT/<setting>_S<S>.json``,
``OUT/summary.json`` and ``OUT/summary.md`` (OUT: ``--out``, runs/bench/syncer_memory).

From code (with ``bench/`` on ``sys.path``, for ``synthetic_load``): ``measure(params=2e7,
learners=4, ...)`` runs one case in a temp dir and returns its result (the JSON's dict);
``result["memory"]["sum"]["x4N"]["peak_above_start"]`` is the figure the issue bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from synthetic_load import (
    RssSampler,
    Syncers,
    SyntheticLearner,
    cpu_s,
    in_threads,
    mem_available,
    push_payloads,
    status_bytes,
    synthetic_spec,
)

import ddiloco
from ddiloco.algorithm.codecs import get_codec
from ddiloco.runtime.transport.auth import TOKEN_ENV, new_token
from ddiloco.runtime.transport.spec import fragmentation_from_spec

__all__ = ["Case", "SETTINGS", "measure", "run_case", "markdown", "main"]


@dataclass(kw_only=True, slots=True)
class Case:
    """One measurement: the model, the learners, the syncer's settings and the schedule."""

    name: str = "custom"
    """Label of the case in the output (a setting's name)."""
    params: int = 10**9
    """N: fp32 parameters of the synthetic model."""
    learners: int = 8
    """M: synthetic learners."""
    fragments: int = 8
    """P: fragments."""
    codec: str = "bf16"
    """Push codec (``sync.codec``)."""
    down_codec: str = "fp32"
    """Downlink codec (``sync.down_codec``)."""
    down_delta: bool = False
    """Delta-coded downlink (``sync.down_delta``)."""
    shards: int = 1
    """S: syncer processes, fragment p on shard p % S."""
    checkpoint: bool = False
    """Checkpoints on (a temp dir per shard, removed at the end)."""
    rounds: int = 6
    """Pushes of every fragment by every learner (merges per fragment, with K = M)."""
    quorum: int | None = None
    """K; None: M (every merge holds every learner, no grace window)."""
    grace: bool = False
    """The adaptive grace window (off: with K = M it has nothing to wait for)."""
    history: int | None = None
    """``sync.history``; None: ``SyncConfig.resolved_history`` (the codec decides)."""
    H: int = 24
    """Inner steps between two pushes of the same fragment: a push every H / P steps."""
    step_s: float = 0.05
    """Fake inner-step time: push slots are (H / P) x step_s apart."""
    tensors_per_fragment: int = 4
    """Large matrices per fragment."""
    seed: int = 0
    sample_s: float = 0.05
    """RSS sampling interval."""
    timeout_s: float = 3600.0
    """Deadline of the whole case (the syncers are stopped when it passes)."""
    rss_limit_bytes: int | None = None
    """Stop the run when the syncers' RSS together exceed this; None: 80% of MemAvailable
    at the start of the case."""

    def __post_init__(self) -> None:
        self.params = int(self.params)
        if self.params < 1024:
            raise ValueError(f"params must be >= 1024, got {self.params}")
        for f in ("learners", "fragments", "shards", "rounds", "H", "tensors_per_fragment"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.shards > self.fragments:
            raise ValueError(f"shards S={self.shards} cannot exceed fragments P={self.fragments}")
        if self.quorum is not None and not 1 <= self.quorum <= self.learners:
            raise ValueError(f"quorum must be in [1, learners={self.learners}], got {self.quorum}")
        for f in ("codec", "down_codec"):
            get_codec(getattr(self, f))  # an unknown name lists the codecs
        if self.step_s < 0 or self.sample_s <= 0 or self.timeout_s <= 0:
            raise ValueError("step_s must be >= 0, sample_s and timeout_s > 0")

    @property
    def label(self) -> str:
        return f"{self.name}_S{self.shards}"

    @property
    def K(self) -> int:  # noqa: N802 - the paper's symbol
        return self.quorum if self.quorum is not None else self.learners


def _default() -> dict:
    """bf16 pushes (parameters), fp32 downlink, no checkpoints: the run defaults."""
    return {"codec": "bf16", "down_codec": "fp32", "down_delta": False, "checkpoint": False}


def _int4dd() -> dict:
    """int4 pushes (deltas), int4 delta-coded downlink, checkpoints on."""
    return {"codec": "int4", "down_codec": "int4", "down_delta": True, "checkpoint": True}


SETTINGS = {"default": _default, "int4dd": _int4dd}
"""The issue's cases by name (``--settings``)."""


def _run_file(case: Case, path: Path) -> Path:
    """The run configuration the syncers read (their [sync] and [runtime] tables)."""
    from ddiloco.config import TrainConfig, dump_config

    cfg = TrainConfig(
        learners=case.learners,
        steps=1,
        fragments=case.fragments,
        H=case.H,
        codec=case.codec,
        down_codec=case.down_codec,
        down_delta=case.down_delta,
        quorum=case.K,
        grace=case.grace,
        history=case.history,
        heartbeat_timeout_s=case.timeout_s + 600.0,
        step_budget=0,
        max_connections_per_peer=max(32, 4 * case.learners + 8),
    )
    return dump_config(cfg, path)


# -- one case ---------------------------------------------------------------------------------
def _summary(
    rss: dict[str, list[int]], hwm: list[int], four_n: int, steady: list[list[int]]
) -> dict:
    """Per shard and summed: RSS at the phase marks, steady state, peak, in bytes and x 4N."""
    S = len(hwm)  # noqa: N806

    def units(x: float) -> float:
        return round(x / four_n, 3)

    shards = []
    for k in range(S):
        st = statistics.median(r[k] for r in steady) if steady else float("nan")
        d = {
            "start_bytes": rss["start"][k],
            "after_model_bytes": rss["model"][k],
            "after_fetch_bytes": rss["fetched"][k],
            "steady_bytes": int(st) if steady else None,
            "steady_max_bytes": max(r[k] for r in steady) if steady else None,
            "peak_bytes": hwm[k],
            "peak_above_start_bytes": hwm[k] - rss["start"][k],
        }
        d["steady_above_start_bytes"] = int(st) - rss["start"][k] if steady else None
        d["x4N"] = {
            "after_model_above_start": units(d["after_model_bytes"] - d["start_bytes"]),
            "after_fetch_above_start": units(d["after_fetch_bytes"] - d["start_bytes"]),
            "steady_above_start": units(d["steady_above_start_bytes"]) if steady else None,
            "peak_above_start": units(d["peak_above_start_bytes"]),
        }
        shards.append(d)
    start = sum(rss["start"])
    st_sum = statistics.median(sum(r) for r in steady) if steady else None
    total = {
        "start_bytes": start,
        "after_fetch_bytes": sum(rss["fetched"]),
        "steady_bytes": int(st_sum) if st_sum is not None else None,
        "peak_bytes": sum(hwm),
        "peak_above_start_bytes": sum(hwm) - start,
        "x4N": {
            "after_fetch_above_start": units(sum(rss["fetched"]) - start),
            "steady_above_start": units(st_sum - start) if st_sum is not None else None,
            "peak_above_start": units(sum(hwm) - start),
        },
    }
    return {"shards": shards, "sum": total}


def run_case(case: Case, out_dir: str | os.PathLike | None = None) -> dict:
    """Run one case (see the module doc); returns its result. ``out_dir``: where the run
    file and the syncers' logs go (a temp dir, removed, when None)."""
    tmp_out = out_dir is None
    base = Path(tempfile.mkdtemp(prefix="syncer-memory-")) if tmp_out else Path(out_dir).resolve()
    run_dir = base / case.label
    run_dir.mkdir(parents=True, exist_ok=True)
    N, P, M, S = case.params, case.fragments, case.learners, case.shards  # noqa: N806
    four_n = 4 * N
    t_all = time.monotonic()
    spec = synthetic_spec(N, P, case.tensors_per_fragment)
    payloads = push_payloads(spec, case.codec, case.seed)
    prep_s = time.monotonic() - t_all
    token = new_token()
    env = {**os.environ, TOKEN_ENV: token, "OMP_NUM_THREADS": "1"}
    ckpt_root = Path(tempfile.mkdtemp(prefix="syncer-memory-ckpt-")) if case.checkpoint else None
    limit = case.rss_limit_bytes or int(0.8 * mem_available())
    config = _run_file(case, run_dir / "config.toml")
    syncers = Syncers(config, S, run_dir, env, ckpt_root)
    sampler = RssSampler(syncers.pids, case.sample_s, limit, syncers.kill)
    marks: dict[str, float] = {}
    rss: dict[str, list[int]] = {}
    learners: list[SyntheticLearner] = []
    abort = threading.Event()
    error = None
    hwm, cpu = [0] * S, [0.0] * S
    status: list[dict] = []
    codes: list[int | None] = []
    try:
        time.sleep(0.5)  # imports done, listening: the start is quiet
        marks["start"] = sampler.now()
        rss["start"] = sampler.sample()
        learners = [
            SyntheticLearner(
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
                abort=abort,
            )
            for m in range(M)
        ]
        learners[0].join()  # the initial model
        marks["model"] = sampler.now()
        rss["model"] = sampler.sample()
        in_threads(lambda lr: lr.join(), learners[1:], abort)
        in_threads(lambda lr: [lr.fetch(p) for p in range(P)], learners, abort)
        marks["fetched"] = sampler.now()
        rss["fetched"] = sampler.sample()
        slot_s = case.H / P * case.step_s
        t0 = time.monotonic() + 0.1
        in_threads(lambda lr: lr.run(t0, slot_s), learners, abort)
        marks["rounds_end"] = sampler.now()
        rss["rounds_end"] = sampler.sample()
        hwm = [status_bytes(p, "VmHWM") for p in syncers.pids]
        cpu = [cpu_s(p) for p in syncers.pids]
        status = [c.status(timeout_s=60.0) for c in learners[0].sc.clients]
        for lr in learners:
            lr.leave()
    except Exception as e:  # noqa: BLE001 - reported in the result
        error = f"{type(e).__name__}: {e}"
        if sampler.over_limit:
            error = f"aborted: the syncers' RSS exceeded {limit / 2**30:.1f} GiB ({error})"
    finally:
        sampler.close()
        for lr in learners:
            lr.close()
        t_stop = time.monotonic()
        codes = syncers.stop()
        stop_s = time.monotonic() - t_stop
        if ckpt_root is not None:
            shutil.rmtree(ckpt_root, ignore_errors=True)
    wall_s = time.monotonic() - t_all
    frag = fragmentation_from_spec(spec)
    result: dict = {
        "case": asdict(case),
        "label": case.label,
        "error": error,
        "N": N,
        "four_n_bytes": four_n,
        "fragment_bytes": [f.nbytes for f in frag.fragments],
        "push_bytes": [len(b) for b in payloads],
        "tensors": len(spec["names"]),
        "K": case.K,
        "history": learners[0].history if learners and error is None else None,
        "exit_codes": codes,
        "rss_limit_bytes": limit,
        "bench_peak_rss_bytes": status_bytes(os.getpid(), "VmHWM"),
        "ddiloco_src": str(Path(ddiloco.__file__).parent),
    }
    if error is None:
        result["memory"] = _summary(
            rss,
            hwm,
            four_n,
            sampler.window((marks["fetched"] + marks["rounds_end"]) / 2, marks["rounds_end"]),
        )
        result["merges"] = [int(s.get("merges") or 0) for s in status]
        result["pushes_accepted"] = [int(s["counters"].get("push_accepted", 0)) for s in status]
        result["counters"] = [s["counters"] for s in status]
        result["rejections"] = [s.get("rejections") for s in status]
        result["cpu_s"] = [round(c, 2) for c in cpu]
        result["learner_stats"] = dict(sum((lr.stats for lr in learners), Counter()))
    result["times_s"] = {
        "prepare": round(prep_s, 2),
        "init": round(marks["model"] - marks["start"], 2) if "model" in marks else None,
        "join_fetch": round(marks["fetched"] - marks["model"], 2) if "fetched" in marks else None,
        "rounds": (
            round(marks["rounds_end"] - marks["fetched"], 2) if "rounds_end" in marks else None
        ),
        "stop": round(stop_s, 2),
        "wall": round(wall_s, 2),
    }
    step = max(1, len(sampler.samples) // 1000)  # at most ~1000 points of the series
    result["series"] = {
        "t_s": [round(t, 3) for t, _ in sampler.samples[::step]],
        "rss_bytes": [r for _, r in sampler.samples[::step]],
        "marks_s": {k: round(v, 3) for k, v in marks.items()},
    }
    if tmp_out:
        shutil.rmtree(base, ignore_errors=True)
    return result


def measure(params: float = 2e7, learners: int = 4, **kw) -> dict:
    """One case with these fields of ``Case`` (e.g. ``codec="int4", down_delta=True``),
    in a temp dir; returns what ``run_case`` does. For tests of the memory formula."""
    return run_case(Case(params=int(params), learners=learners, **kw))


def formula_x4N(case: Case) -> float:  # noqa: N802 - 4N, the unit
    """The syncer's steady memory (all shards) in units of 4N by the budget of
    ``docs/architecture.md`` ("Memory"): Theta and the outer momentum; with a delta-coded
    downlink the chains' encoded residuals (they reference Theta); the published downlink
    bytes; one round's pending pushes (each learner keeps one in flight), encoded or folded,
    whichever is smaller; a merge's new tensors of one fragment; for a delta push codec one
    past version of every fragment, as bf16 steps."""
    from ddiloco.algorithm.codecs import get_codec
    from ddiloco.algorithm.downlink import RESIDUAL_CODEC

    up, down = get_codec(case.codec), get_codec(case.down_codec)
    x = 2.0
    if case.down_delta:
        x += get_codec(RESIDUAL_CODEC).bits_per_element / 32
    if not down.lossless:
        x += down.bits_per_element / 32
    # a round's pushes, encoded until they exceed one fp32 fragment, then folded into one
    # fp32 buffer per tensor; a merge of a folded round adds the new Theta of the fragment
    # (its momentum is built in the fold's buffer), of a round held whole Theta and momentum
    held = case.learners * up.bits_per_element / 32
    x += min(held, 1.0) / case.fragments
    x += (1 if held > 1.0 else 2) / case.fragments
    if up.delta:
        x += 0.5
    return x


# -- the report -------------------------------------------------------------------------------
def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(results: list[dict]) -> str:
    """A short table of the results: per case, the sum over shards and each shard."""
    head = (
        "| case | N | M | P | push | down | ckpt | history | start GB | formula x4N | steady x4N | "
        "peak x4N | per shard peak x4N | merges | pushes | wall s | CPU s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in results:
        c = r["case"]
        down = c["down_codec"] + (" delta" if c["down_delta"] else "")
        if r["error"]:
            rows.append(
                f"| {r['label']} | {r['N']:.3g} | {c['learners']} | {c['fragments']} | "
                f"{c['codec']} | {down} | {'on' if c['checkpoint'] else 'off'} | "
                f"- | {r['error']} |  |  |  |  |  |  | {r['times_s']['wall']} |  |"
            )
            continue
        mem = r["memory"]
        per = ", ".join(_x(s["x4N"]["peak_above_start"]) for s in mem["shards"])
        rows.append(
            f"| {r['label']} | {r['N']:.3g} | {c['learners']} | {c['fragments']} | {c['codec']} | "
            f"{down} | {'on' if c['checkpoint'] else 'off'} | {r['history']} | "
            f"{_gb(mem['sum']['start_bytes'])} | {_x(formula_x4N(Case(**c)))} | "
            f"{_x(mem['sum']['x4N']['steady_above_start'])} | "
            f"{_x(mem['sum']['x4N']['peak_above_start'])} | {per} | {sum(r['merges'])} | "
            f"{sum(r['pushes_accepted'])} | {r['times_s']['wall']} | {sum(r['cpu_s']):.1f} |"
        )
    note = (
        "\nx4N: bytes above the syncer's RSS at start (listening, no model) in units of one "
        "fp32 model (4N bytes), summed over the shards; steady: median over the second half "
        "of the rounds; peak: VmHWM before the learners leave.\n"
    )
    return head + "\n".join(rows) + "\n" + note


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e9, help="N, fp32 parameters")
    ap.add_argument("--learners", "-M", type=int, default=8)
    ap.add_argument("--fragments", "-P", type=int, default=8)
    ap.add_argument("--codec", default="bf16", help="push codec")
    ap.add_argument("--down-codec", default="fp32")
    ap.add_argument("--down-delta", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--checkpoint", choices=("on", "off"), default="off")
    ap.add_argument("--rounds", type=int, default=6, help="merges per fragment")
    ap.add_argument("--quorum", "-K", type=int, default=None, help="default: M")
    ap.add_argument("--history", type=int, default=None, help="default: the codec decides")
    ap.add_argument("-H", type=int, default=24, dest="H")
    ap.add_argument("--step-s", type=float, default=0.05, help="fake inner-step time")
    ap.add_argument("--tensors-per-fragment", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=0.05)
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--rss-limit-gb", type=float, default=None, help="default: 80%% available")
    ap.add_argument(
        "--settings",
        default=None,
        help=f"comma-separated presets ({', '.join(SETTINGS)}), each at every --shard-counts; "
        "they set the codecs and checkpoints (the other flags apply to all)",
    )
    ap.add_argument("--shard-counts", default="1,2", help="with --settings")
    ap.add_argument("--out", default="runs/bench/syncer_memory")
    a = ap.parse_args(argv)
    common = {
        "params": int(a.params),
        "learners": a.learners,
        "fragments": a.fragments,
        "rounds": a.rounds,
        "quorum": a.quorum,
        "history": a.history,
        "H": a.H,
        "step_s": a.step_s,
        "tensors_per_fragment": a.tensors_per_fragment,
        "seed": a.seed,
        "sample_s": a.sample_s,
        "timeout_s": a.timeout_s,
        "rss_limit_bytes": int(a.rss_limit_gb * 2**30) if a.rss_limit_gb else None,
    }
    cases = []
    if a.settings:
        for name in a.settings.split(","):
            if name not in SETTINGS:
                ap.error(f"unknown setting {name!r}; choose from {', '.join(SETTINGS)}")
            for s in (int(x) for x in a.shard_counts.split(",")):
                cases.append(Case(name=name, shards=s, **SETTINGS[name](), **common))
    else:
        cases.append(
            Case(
                codec=a.codec,
                down_codec=a.down_codec,
                down_delta=a.down_delta,
                shards=a.shards,
                checkpoint=a.checkpoint == "on",
                **common,
            )
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(
        ["python", "bench/syncer_memory.py", *(argv if argv is not None else sys.argv[1:])]
    )
    results = []
    for case in cases:
        print(
            f"[syncer_memory] {case.label}: N={case.params:.3g} M={case.learners} ...", flush=True
        )
        r = run_case(case, out)
        r["command"] = command
        results.append(r)
        (out / f"{case.label}.json").write_text(json.dumps(r, indent=1))
        print(markdown([r]).splitlines()[2], flush=True)
    (out / "summary.json").write_text(json.dumps({"command": command, "runs": results}, indent=1))
    md = f"`{command}`\n\n" + markdown(results)
    (out / "summary.md").write_text(md)
    print(md)
    return results


if __name__ == "__main__":
    main()
