"""The end of a real run, whoever launched its processes (the built-in launcher or Ray):
the evaluations of the global model during the run (``GlobalEval``), the final global
model, its evaluation, ``summary.json`` and the run's ``metrics.jsonl``.

Everything here reads the run directory and the syncer: the learners' rows
(``learner_m/metrics.jsonl``, ``final.json``), the syncers' event files, ``chaos.jsonl``, and
the syncer's status snapshot, which holds goodput and every learner's step ledger
(``runtime.observe.accounting``). What the launcher adds is how often each learner was started.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "GlobalEval",
    "Member",
    "checkpoint_model",
    "collect_rows",
    "fetch_global",
    "final_model",
    "poll_status",
    "write_summary",
]


@dataclass(slots=True)
class Member:
    """How a launcher saw one learner id: process starts, failures (kills, crashes, dead
    workers) and SIGSTOPs."""

    starts: int = 0
    failures: int = 0
    stops: int = 0


def poll_status(client, reports: dict[tuple[int, int], dict]) -> dict | None:
    """The syncer's status snapshot (None while it is unreachable); every learner process's
    latest report is kept in ``reports``, keyed by (learner, incarnation)."""
    try:
        st = client.status(timeout_s=2.0)
    except Exception:  # noqa: BLE001 - the syncer may be down (chaos, restart)
        return None
    for m, info in st.get("learners", {}).items():
        if info.get("report"):
            reports[(int(m), info["incarnation"])] = info["report"]
    return st


def fetch_global(client):
    """Every fragment of the global model from the syncer (None if it cannot be fetched)."""
    try:
        return client.fetch(None, timeout_s=30.0, exact=True)
    except Exception as e:  # noqa: BLE001
        print(f"ddiloco: could not fetch the final global model: {e}", file=sys.stderr)
        return None


def _fetched_params(cfg, model, fetched) -> dict:
    """Name -> tensor of ``model``'s parameters from fetched fragments (p -> (version,
    flat tensors, ...))."""
    from ddiloco.runtime.transport.spec import fragmentation_from_spec, model_spec

    frag = fragmentation_from_spec(model_spec(model, cfg.sync.fragments, cfg.sync.fragmentation))
    shapes = {n: t.shape for n, t in model.named_parameters()}
    return {
        n: t.view(shapes[n])
        for p, f in enumerate(frag.fragments)
        for n, t in zip(f.names, fetched[p][1])
    }


def checkpoint_model(cfg, out: Path) -> tuple[dict, dict]:
    """(name -> tensor, {"merges", "versions"}) of the global model in the run's syncer
    checkpoints (``out/checkpoint``; a sharded syncer's ``shard_k`` directories, fragment p
    from shard p % S): the fp32 values ``ddiloco export OUT`` writes. Raises
    ``ExportError`` where a checkpoint is missing or unreadable."""
    from ddiloco.runtime.export import ExportError, assemble_state_dict, state_dict_from_checkpoint

    S = cfg.runtime.shards  # noqa: N806
    if S == 1:
        sd, meta = state_dict_from_checkpoint(out / "checkpoint")
        return sd, {"merges": meta["merges"], "versions": meta["versions"]}
    from ddiloco.runtime.syncer.checkpoint import CHECKPOINT_NAME, load_checkpoint
    from ddiloco.runtime.transport.spec import check_spec

    dirs = [out / "checkpoint" / f"shard_{k}" for k in range(S)]
    try:
        # lazily: only theta is read, fragment by fragment (each file verified)
        cks = [load_checkpoint(d / CHECKPOINT_NAME, lazy=True) for d in dirs]
        spec = cks[0]["spec"]
        check_spec(spec)
        states = [ck["state"] for ck in cks]
        P = len(states[0]["theta"])  # noqa: N806
        sd = assemble_state_dict(spec, [states[p % S]["theta"][p] for p in range(P)])
        versions = [int(states[p % S]["versions"][p]) for p in range(P)]
        merges = sum(int(st.get("merges", 0)) for st in states)
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ExportError(f"no global model in {dirs}: {e}") from None
    return sd, {"merges": merges, "versions": versions}


def final_model(
    cfg, out: Path, fetched, *, interrupted: bool = False
) -> tuple[dict | None, dict | None]:
    """The global model the run ends with, (name -> tensor, where it comes from): the
    syncer's final checkpoint (its fp32 values, written as it stops; what ``ddiloco export
    OUT`` writes), also for an interrupted run (``interrupted``: nothing was fetched, the
    syncers stopped with a checkpoint), else the fragments fetched before the stop.
    ``(None, None)``: neither. The source is ``{"source": "checkpoint" | "fetched",
    "merges", "versions"}``."""
    if fetched is None and not interrupted:
        return None, None
    from ddiloco.runtime.export import ExportError

    if cfg.runtime.shards == 1 or fetched is None:  # shards checkpoint their own fragments
        try:
            sd, meta = checkpoint_model(cfg, out)
            return sd, {"source": "checkpoint", **meta}
        except ExportError as e:
            what = "evaluating the fetched global model" if fetched is not None else "no model"
            print(f"ddiloco: {what}: {e}", file=sys.stderr)
    if fetched is None:
        return None, None
    from ddiloco.recipe import new_model

    versions = [int(fetched[p][0]) for p in sorted(fetched)]
    return _fetched_params(cfg, new_model(cfg), fetched), {
        "source": "fetched",
        "merges": None,
        "versions": versions,
    }


class GlobalEval:
    """The evaluations of the global model during a real run, on the in-process engine's
    schedule: the initial model, then each time the learners' inner steps reach a multiple
    of ``optim.eval_every`` per learner (the syncer's ``steps_done`` against k x eval_every
    x M), the global model the syncer publishes (its exact fp32 values), evaluated on the
    held-out batches. A launcher calls ``poll`` with every status snapshot; the fetch and
    the evaluation run on a thread of their own, one at a time, so that supervision never
    waits for them. Once the step budget is spent the final evaluation takes over; a
    multiple reached while the syncer is unreachable (chaos) is skipped.

    Building it builds the run's eval set and model, so a missing optional dependency of
    the data source or the model (scikit-learn for ``digits``, ...) raises ImportError
    here, before any process is started."""

    def __init__(self, cfg, wall0: float) -> None:
        import torch

        from ddiloco.recipe import eval_setup, new_model

        torch.set_num_threads(1)
        self.cfg = cfg
        self.wall0 = wall0
        self.data, self.lang, self.floor, self.evals = eval_setup(cfg)
        self.model = new_model(cfg)
        self._init = {n: t.detach().clone() for n, t in self.model.state_dict().items()}
        self._init_loss: float | None = None
        self.rows: list[dict] = []
        """``eval`` rows (``t_s`` since the launch, ``step``: mean inner steps per learner)."""
        self._next = cfg.optim.eval_every
        self._thread: threading.Thread | None = None

    @property
    def init_loss(self) -> float:
        """Eval loss of the initial model (the same seed as every learner's)."""
        if self._init_loss is None:
            self._init_loss = self.loss(self._init)
        return self._init_loss

    def loss(self, params: dict) -> float:
        from ddiloco.recipe import evaluate

        self.model.load_state_dict(params)
        return evaluate(self.model, self.evals)

    def poll(self, client, status: dict | None) -> None:
        """Start an evaluation if the learners' steps reached the next multiple of
        ``eval_every`` per learner and none is running."""
        st = status or {}
        if client is None or st.get("budget_spent") or self.busy:
            return
        M = max(1, self.cfg.learners)  # noqa: N806
        every = self.cfg.optim.eval_every
        done = float(st.get("steps_done") or 0)
        if done < self._next * M:
            return
        self._next = (int(done / M) // every + 1) * every
        t_s = time.time() - self.wall0
        self._thread = threading.Thread(
            target=self._evaluate, args=(client, done / M, t_s), name="ddiloco-eval", daemon=True
        )
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _evaluate(self, client, step: float, t_s: float) -> None:
        try:
            fetched = client.fetch(None, timeout_s=10.0, exact=True)
        except Exception:  # noqa: BLE001 - the syncer may be down (chaos, restart)
            return
        loss = self.loss(_fetched_params(self.cfg, self.model, fetched))
        self.rows.append(
            {
                "kind": "eval",
                "t_s": round(t_s, 4),
                "step": round(step, 3),
                "eval_loss": loss,
                "gap": None if self.floor is None else loss - self.floor,
                "versions": sum(int(v[0]) for v in fetched.values()),
            }
        )

    def wait(self, timeout_s: float = 30.0) -> None:
        """Wait for a running evaluation (before the final one, or the summary)."""
        if self._thread is not None:
            self._thread.join(timeout_s)


def _learner_dirs(out: Path) -> list[int]:
    return sorted(
        int(d.name[len("learner_") :])
        for d in out.glob("learner_*")
        if d.name[len("learner_") :].isdigit()
    )


def collect_rows(out: Path, wall0: float) -> dict:
    """Merge learner step rows, syncer events and chaos events into one time-ordered list
    (``t_s`` relative to ``wall0``, the launch), and compute the uptime."""
    from ddiloco.metrics.sinks import read_jsonl

    rows, walls = [], []
    for m in _learner_dirs(out):
        path = out / f"learner_{m}" / "metrics.jsonl"
        if not path.is_file():
            continue
        for r in read_jsonl(path):  # a line torn by SIGKILL is skipped
            if r.get("kind") == "step":
                walls.append(r["wall"])
            r["t_s"] = round(r.pop("wall") - wall0, 4)
            r.pop("report", None) if r.get("kind") == "learner_end" else None
            rows.append(r)
    for path in [*sorted(out.glob("syncer*.metrics.jsonl")), out / "chaos.jsonl"]:
        name = path.name
        if path.is_file():
            for r in read_jsonl(path):
                r["t_s"] = round(r.pop("wall") - wall0, 4)
                if name == "chaos.jsonl":
                    r["kind"] = "chaos-" + r["kind"]
                elif name.startswith("syncer_"):
                    r["shard"] = int(name.split(".")[0].split("_")[1])
                rows.append(r)
    rows.sort(key=lambda r: r["t_s"])
    n_chaos = sum(
        1 for r in rows if r["kind"].startswith("chaos-kill") or r["kind"].startswith("chaos-stop")
    )
    walls.sort()

    def uptime(T: float) -> float:
        if len(walls) < 2:
            return 0.0
        gaps = sorted(b - a for a, b in zip(walls, walls[1:]))
        med = gaps[len(gaps) // 2]
        idle = sum(g for g in gaps if g > max(1.0, 10 * med))
        return max(0.0, 1.0 - idle / T)

    return {"rows": rows, "uptime": uptime, "n_chaos": n_chaos}


def write_summary(
    cfg,
    out: Path,
    *,
    status: dict | None,
    reports: dict[tuple[int, int], dict],
    members: dict[int, Member],
    processes_ok: bool,
    interrupted: bool,
    final_params: dict | None,
    final_source: dict | None = None,
    evals: GlobalEval | None = None,
    wall0: float,
    t_learners: float,
    t_end: float,
    wall_s: float,
    chaos: dict,
    extra: dict[str, Any] | None = None,
) -> dict:
    """Evaluate the final model, write ``out/summary.json`` and ``out/metrics.jsonl`` (every
    process's rows in time order) and return the summary.

    Times are seconds since the launch (``wall0``, Unix time): ``t_learners`` when the
    learners were started, ``t_end`` when the last one ended, ``wall_s`` now. ``members``
    maps learner ids to what the launcher saw of them; ``processes_ok`` says every learner
    finished; ``final_source`` where the final model comes from (``final_model``);
    ``evals`` the run's evaluations so far (a fresh ``GlobalEval`` where None); ``extra``
    adds the launcher's own fields."""
    from ddiloco.run_summary import RunSummary
    from ddiloco.runtime.observe.accounting import goodput_so_far

    c = cfg
    if evals is None:
        evals = GlobalEval(c, wall0)
    evals.wait()
    lang, floor = evals.lang, evals.floor
    init_loss = evals.init_loss
    n_params = sum(p.numel() for p in evals.model.parameters())
    final_loss = None if final_params is None else evals.loss(final_params)
    per_step = _tokens_per_step(c, evals.data)
    rows = collect_rows(out, wall0)
    t_first = _first_step_s(rows["rows"], t_learners)
    T = max(1e-9, t_end - t_first)
    st = status or {}
    run_s = st.get("run_s") or T
    per_learner, bytes_up, bytes_down = _learner_rows(
        c, out, st, reports, members, per_step=per_step, run_s=run_s
    )
    ids = [pl["learner"] for pl in per_learner]
    model_bytes = 4 * n_params
    total_steps, steps_trained, tokens = _trained(c, per_learner, per_step)
    budget = c.runtime.step_budget if c.runtime.step_budget is not None else c.learners * c.steps
    summary = {
        "ok": not interrupted and final_loss is not None and processes_ok,
        "method": "decoupled",
        "engine": "processes",
        "learners": len(ids),
        "membership": {
            k: (st.get("membership") or {}).get(k, 0) for k in ("join", "leave", "dead")
        },
        "island_size": c.runtime.island_size,
        "islands": [str(c.runtime.island(m)) for m in range(c.learners)],
        "steps": c.steps,
        "step_budget": budget,
        "steps_trained": steps_trained,
        "shards": c.runtime.shards,
        "tokens": tokens,
        "final_eval_loss": final_loss,
        "final_model": final_source if final_loss is not None else None,
        "entropy_floor": floor,
        "gap_to_floor": None if final_loss is None or floor is None else final_loss - floor,
        "entropy_rate": lang.entropy_rate if lang is not None else None,
        "initial_eval_loss": init_loss,
        "data": c.data.source,
        "model": c.model.name,
        # the syncer's, as in `ddiloco status` (``runtime.observe.accounting``)
        "goodput": goodput_so_far(st) or 0.0,
        "run_s": run_s,
        "uptime": rows["uptime"](T),
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "dp_bytes_same_steps": int(total_steps * 2 * model_bytes),
        "merges": st.get("merges"),
        "wall_s": round(wall_s, 3),
        "train_wall_s": round(T, 3),
        "startup_s": round(t_first - t_learners, 3),
        "versions": st.get("versions"),
        "mean_quorum": st.get("mean_quorum"),
        "learners_per_merge": st.get("mean_quorum"),
        "install": c.sync.install,
        "rejections": st.get("rejections", {}),
        "syncer_counters": st.get("counters", {}),
        "chaos_events": rows["n_chaos"],
        "interrupted": interrupted,
        "per_learner": per_learner,
        "n_params": n_params,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in c.to_dict().items()},
        "chaos": chaos,
        **(extra or {}),
    }
    _write_run_metrics(
        c,
        out,
        summary["config"],
        rows["rows"],
        evals,
        init_loss=init_loss,
        final_loss=final_loss,
        final_step=round(steps_trained / max(1, len(ids)), 3),
    )
    summary = RunSummary.from_dict(summary).write(out)
    if c.progress:
        _print_end(
            summary, out, interrupted=interrupted, init_loss=init_loss, final_loss=final_loss
        )
    return summary


def _tokens_per_step(cfg, data) -> int:
    """Tokens (images for an image task) one rank trains on per inner step."""
    batch = cfg.data.batch_size
    return batch if data.task == "image" else batch * cfg.data.block_size


def _first_step_s(rows: list[dict], t_learners: float) -> float:
    """When the run's clock starts: the first learner ready to step (``learner_start``),
    not before the learners were started. Process start-up of the first launch is reported
    apart; restarts after failures count against goodput."""
    starts = [r["t_s"] for r in rows if r["kind"] == "learner_start"]
    return max(t_learners, min(starts)) if starts else t_learners


def _learner_rows(
    cfg,
    out: Path,
    st: dict,
    reports: dict[tuple[int, int], dict],
    members: dict[int, Member],
    *,
    per_step: int,
    run_s: float,
) -> tuple[list[dict], int, int]:
    """(``per_learner`` rows, bytes up, bytes down) of every learner id of the config or the
    launcher. Each learner process's last report (its ``final.json`` where it wrote one) gives
    its bytes and steps; the step ledger and the times are the syncer's
    (``runtime.observe.accounting``): every learner process's last report, restarts folded
    in; the same as `ddiloco status`."""
    from ddiloco.runtime.observe.accounting import learner_totals

    per_learner = []
    bytes_up = bytes_down = 0
    reports = dict(reports)
    for m in sorted(set(range(cfg.learners)) | set(members)):
        final_path = out / f"learner_{m}" / "final.json"
        final = json.loads(final_path.read_text()) if final_path.is_file() else None
        if final is not None:
            reports[(m, final["incarnation"])] = final
        for (mm, _), rep in reports.items():
            if mm == m:
                bytes_up += rep.get("bytes_sent", 0)
                bytes_down += rep.get("bytes_received", 0)
        info = st.get("learners", {}).get(str(m), {})
        per_learner.append(
            _learner_row(
                cfg,
                m,
                members.get(m),
                final,
                info,
                learner_totals(info),
                per_step=per_step,
                run_s=run_s,
            )
        )
    return per_learner, bytes_up, bytes_down


def _trained(cfg, per_learner: list[dict], per_step: int) -> tuple[float, int, int]:
    """(steps computed, steps trained, tokens trained) of the learners' rows. What the
    learners trained: their global steps (those the step budget counts; steps redone after a
    restart count once), x tokens per step x ranks."""
    total_steps = sum(pl["ledger_steps"]["computed"] for pl in per_learner)
    steps_trained = sum(int(pl["steps"] or 0) for pl in per_learner)
    tokens = sum(
        int(pl["steps"] or 0) * per_step * cfg.runtime.island(pl["learner"]).size
        for pl in per_learner
    )
    return total_steps, steps_trained, tokens


def _learner_row(
    cfg,
    m: int,
    member: Member | None,
    final: dict | None,
    info: dict,
    tot: dict,
    *,
    per_step: int,
    run_s: float,
) -> dict:
    """Learner m's row of ``per_learner``: ``member`` what the launcher saw of it, ``final``
    its ``final.json``, ``info`` the syncer's status of it and ``tot`` its totals."""
    ledger, useful, compute = tot["ledger"], tot["useful_s"], tot["compute_s"]
    bal = abs(ledger["computed"] - sum(ledger[k] for k in ledger if k != "computed"))
    return {
        "learner": m,
        "steps": (final or {}).get("global_step", info.get("report", {}).get("global_step")),
        "failures": member.failures if member else 0,
        "starts": member.starts if member else 0,
        "stops": member.stops if member else 0,
        "ledger_steps": {k: round(v, 4) + 0.0 for k, v in ledger.items()},
        "ledger_tokens": {
            k: round(v * per_step * cfg.runtime.island(m).size) for k, v in ledger.items()
        },
        "ledger_balance_error": bal,
        "install_delay_steps": (final or info.get("report", {})).get("install_delay_steps"),
        "tokens_computed": tot["tokens"],
        "syncer_tokens": info.get("syncer_ledger", {}),
        "time": {
            "useful_s": round(useful, 3),
            "stepping_s": round(compute, 3),
            "other_s": round(run_s - compute, 3),
        },
    }


def _write_run_metrics(
    cfg,
    out: Path,
    config: dict,
    rows: list[dict],
    evals: GlobalEval,
    *,
    init_loss: float,
    final_loss: float | None,
    final_step: float,
) -> None:
    """The run's metrics.jsonl: the config, the initial evaluation, then every process's rows
    and the evaluations during the run in time order, then the final evaluation
    (``final_step``: mean steps per learner). The run-level rows (config, evaluations) also
    go to the other sinks, as writer "run"."""
    from ddiloco.metrics.sinks import JsonlSink, open_sinks, parse_sinks

    floor = evals.floor
    head = [
        {"kind": "config", **config},
        {
            "kind": "eval",
            "t_s": 0.0,
            "step": 0,
            "eval_loss": init_loss,
            "gap": None if floor is None else init_loss - floor,
        },
    ]
    evaluated = sorted(evals.rows, key=lambda r: r["t_s"])
    body = sorted(rows + evaluated, key=lambda r: r["t_s"])
    tail = (
        []
        if final_loss is None
        else [
            {
                "kind": "final",
                "step": final_step,
                "eval_loss": final_loss,
                "gap": None if floor is None else final_loss - floor,
            }
        ]
    )
    with JsonlSink(out / "metrics.jsonl", mode="w") as jsonl:
        for r in head + body + tail:
            jsonl.write(r)
    with open_sinks(
        [s for s in parse_sinks(cfg.runtime.metrics_sinks) if s != "jsonl"], out, name="run"
    ) as extra_sinks:
        for r in head + evaluated + tail:
            extra_sinks.write(r)


def _print_end(
    summary: dict, out: Path, *, interrupted: bool, init_loss: float, final_loss: float | None
) -> None:
    """The run's last line on the console: how it ended, the eval loss from the initial to
    the final model, goodput, merges and where the summary is."""
    ended = "done" if summary["ok"] else "interrupted" if interrupted else "FAILED"
    print(
        f"ddiloco: {ended} in {summary['wall_s']:.1f} s: "
        f"eval loss {init_loss:.4f} -> {_loss(final_loss)}, goodput {summary['goodput']:.3f}, "
        f"merges {summary['merges']}, summary in {out / 'summary.json'}",
        file=sys.stderr,
    )


def _loss(x: float | None) -> str:
    """An eval loss for the console: 4 decimals, or n/a where there is none."""
    return "n/a" if x is None else f"{x:.4f}"
