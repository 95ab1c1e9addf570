"""``ddiloco report RUN_DIR [RUN_DIR ...]``: plots and an HTML page for one or more runs.

Reads what a run directory holds (``summary.json``, ``metrics.jsonl``, and for runs of the
process runtime ``chaos.jsonl``) and writes ``loss.png``, ``goodput.png``, ``learners.png``,
``bytes.png`` and ``index.html`` (see ``docs/report.md``). Works for both engines: the
in-process engine logs ``failure``/``rejoin`` rows on a virtual clock, the process runtime
logs ``learner_start``/``learner_end``/``chaos-*`` rows on the wall clock. Unknown row kinds
and missing fields are ignored; corrupt lines are skipped with a warning.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ReportError",
    "RunData",
    "load_run",
    "time_span",
    "learner_states",
    "goodput_timeline",
    "make_report",
    "add_report_parser",
]

log = logging.getLogger("ddiloco.report")

UP, DOWN, STOPPED, OFF = "up", "down", "stopped", "off"
"""Learner states on the timeline: stepping, failed or restarting, SIGSTOPped, not running."""

_STATE_COLOURS = {UP: "#59a14f", DOWN: "#e15759", STOPPED: "#f28e2b"}
_FILES = ("loss.png", "goodput.png", "learners.png", "bytes.png")


class ReportError(ValueError):
    """A user error: a path that is not a readable run directory, or an unusable out dir."""


@dataclass(slots=True)
class RunData:
    """One run directory, loaded."""

    path: Path
    summary: dict
    rows: list[dict] = field(default_factory=list)
    """metrics.jsonl rows (plus chaos.jsonl rows as ``chaos-*`` when metrics.jsonl has none)."""
    skipped_lines: int = 0
    """Corrupt lines skipped in metrics.jsonl and chaos.jsonl."""
    label: str = ""
    """Legend label: the directory name (made unique across runs) and the method."""

    @property
    def method(self) -> str:
        return str(self.summary.get("method", "?"))

    @property
    def learners(self) -> int:
        ids = {r["learner"] for r in self.rows if isinstance(r.get("learner"), int)}
        return max([int(_num(self.summary.get("learners"), 0)), *(m + 1 for m in ids)])

    def of(self, *kinds: str) -> list[dict]:
        return [r for r in self.rows if r.get("kind") in kinds]


# -- loading ------------------------------------------------------------------------------
def _read_jsonl(path: Path) -> tuple[list[dict], int]:
    rows, bad, first_bad = [], 0, None
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                r = None
            if not isinstance(r, dict):
                bad += 1
                first_bad = first_bad or i
                continue
            rows.append(r)
    if bad:
        log.warning(
            "warning: %s: skipped %d corrupt line%s (first at line %d)",
            path,
            bad,
            "" if bad == 1 else "s",
            first_bad,
        )
    return rows, bad


def load_run(path: Path) -> RunData:
    """Load a run directory; raises ``ReportError`` if it is not one."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"no such run directory: {path}")
    if not path.is_dir():
        raise ReportError(f"not a directory: {path} (pass the run directory, not a file in it)")
    sp = path / "summary.json"
    if not sp.is_file():
        raise ReportError(f"not a ddiloco run directory: {path} (expected summary.json)")
    try:
        summary = json.loads(sp.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"{sp} is not valid JSON ({e}); is the run still writing it?") from None
    if not isinstance(summary, dict):
        raise ReportError(f"{sp} does not hold a JSON object")
    run = RunData(path=path, summary=summary)
    mp = path / "metrics.jsonl"
    if mp.is_file():
        run.rows, run.skipped_lines = _read_jsonl(mp)
    else:
        log.warning("warning: %s has no metrics.jsonl; plots use summary.json only", path)
    cp = path / "chaos.jsonl"
    if cp.is_file() and not any(str(r.get("kind", "")).startswith("chaos-") for r in run.rows):
        chaos, bad = _read_jsonl(cp)
        run.skipped_lines += bad
        run.rows += [{**r, "kind": f"chaos-{r.get('kind')}"} for r in chaos]
    run.rows = [r for r in run.rows if isinstance(r.get("kind"), str)]
    return run


def _num(x, default=None):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else default


def _t(r: dict):
    return _num(r.get("t_s"))


def _learner_of(r: dict):
    """Learner id of a row: ``learner`` (engine, syncer) or ``target: learner_m`` (chaos)."""
    m = r.get("learner")
    if isinstance(m, int) and not isinstance(m, bool):
        return m
    tgt = r.get("target")
    if isinstance(tgt, str) and tgt.startswith("learner_") and tgt[8:].isdigit():
        return int(tgt[8:])
    return None


# -- derived timelines ----------------------------------------------------------------------
def time_span(run: RunData) -> tuple[float, float]:
    """(t_start, t_end) of the run's clock: virtual seconds (inproc) or wall seconds since
    launch (processes; the start is the first learner ready to step)."""
    starts = [_t(r) for r in run.of("learner_start") if _t(r) is not None]
    t0 = min(starts) if starts else 0.0
    end = _num(run.summary.get("virtual_time_s"))
    if end is None:
        ts = [_t(r) for r in run.rows if _t(r) is not None]
        end = max(ts) if ts else _num(run.summary.get("train_wall_s"), 0.0)
    return t0, max(end, t0)


# row kind -> new state of the row's learner
_TRANSITIONS = {
    "failure": DOWN,
    "rejoin": UP,  # inproc engine
    "learner_start": UP,
    "learner_end": OFF,  # process runtime
    "chaos-kill-learner": DOWN,
    "chaos-learner-crashed": DOWN,
    "chaos-stop-learner": STOPPED,
    "chaos-cont-learner": UP,
    "chaos-learner-finished": OFF,
}


def learner_states(run: RunData) -> dict[int, list[tuple[float, float, str]]]:
    """Per learner, the (start_s, end_s, state) intervals covering the run's span.

    Learners start ``up`` unless the run logs ``learner_start`` rows (process runtime), in
    which case they are ``off`` until their first one. A restarted process is ``down`` until
    its ``learner_start``.
    """
    t0, t1 = time_span(run)
    has_start = bool(run.of("learner_start"))
    out = {}
    for m in range(run.learners):
        events = sorted(
            (_t(r), _TRANSITIONS[r["kind"]])
            for r in run.rows
            if r["kind"] in _TRANSITIONS and _learner_of(r) == m and _t(r) is not None
        )
        state, since, spans = (OFF if has_start else UP), (0.0 if has_start else t0), []
        for t, new in events:
            if new == state or (state == OFF and new == DOWN):
                continue
            if t > since:
                spans.append((since, t, state))
            state, since = new, t
        if t1 > since:
            spans.append((since, t1, state))
        out[m] = [s for s in spans if s[2] != OFF]
    return out


def _up_between(spans: list[tuple[float, float, str]], a: float, b: float) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e, st in spans if st == UP)


def goodput_timeline(run: RunData, n: int = 300) -> dict:
    """Cumulative goodput and availability over the run's clock.

    Returns ``{"t": [...], "goodput": [...], "available": [...], "derived": bool}``.

    - ``available(t)``: up learner-seconds in [t_start, t] / (M x (t - t_start)), from the
      learner states (failure/rejoin, or learner_start/chaos rows).
    - ``goodput(t)``: useful learner-seconds credited by merges up to t / (M x (t - t_start)).
      Each fragment is 1/P of a learner's work: when a ``merge`` row of fragment p lists
      learner m, m is credited 1/P of its up-time since the later of its previous credit for p
      and its latest return from a failure (work done before a failure is lost and never
      credited; time stopped or down is never up-time). ``derived`` is True.
    - Runs without merge rows that list learners (dp, diloco, streaming, local): all up-time
      is taken as useful at the rate the summary reports, goodput(t) = available(t) x
      summary goodput / available(t_end); ``derived`` is False.
    """
    t0, t1 = time_span(run)
    M = max(1, run.learners)
    states = learner_states(run)
    cfg = run.summary.get("config") if isinstance(run.summary.get("config"), dict) else {}
    P = _num(run.summary.get("fragments")) or _num(cfg.get("fragments")) or 1
    merges = sorted(
        (
            (_t(r), r)
            for r in run.of("merge")
            if _t(r) is not None and isinstance(r.get("learners"), list)
        ),
        key=lambda x: x[0],
    )
    credits: list[tuple[float, float]] = []
    last: dict[tuple[int, object], float] = {}
    for t, r in merges:
        for m in r["learners"]:
            if not isinstance(m, int) or m not in states:
                continue
            rejoins = [e for _, e, st in states[m] if st == DOWN and e <= t]
            start = max(last.get((m, r.get("fragment")), t0), max(rejoins, default=t0))
            credits.append((t, _up_between(states[m], start, t) / P))
            last[(m, r.get("fragment"))] = t
    ts = [t0 + (t1 - t0) * (i + 1) / n for i in range(n)] if t1 > t0 else []
    avail = [sum(_up_between(s, t0, t) for s in states.values()) / (M * (t - t0)) for t in ts]
    derived = bool(credits)
    if derived:
        good, acc, j = [], 0.0, 0
        for t in ts:
            while j < len(credits) and credits[j][0] <= t:
                acc += credits[j][1]
                j += 1
            good.append(acc / (M * (t - t0)))
    else:
        g = _num(run.summary.get("goodput"), 0.0)
        scale = g / avail[-1] if avail and avail[-1] > 0 else 0.0
        good = [a * scale for a in avail]
    return {"t": ts, "goodput": good, "available": avail, "derived": derived}


X_AXES = ("tokens", "step", "time")


def trained_steps(run: RunData) -> float | None:
    """Inner steps per learner the run trained, on average: the summary's ``steps_trained``
    (all learners) over its learners where it has them (the real runtime, whose learners
    share a step budget and so differ from ``steps``), else its ``steps``."""
    total, n = _num(run.summary.get("steps_trained")), _num(run.summary.get("learners"))
    if total and n:
        return total / n
    return _num(run.summary.get("steps"))


def _x_of(run: RunData, x_axis: str):
    """Step (mean per learner) -> x value: tokens (the summary's tokens over the steps
    trained) or the step itself."""
    steps, tokens = trained_steps(run), _num(run.summary.get("tokens"))
    if x_axis == "tokens" and steps and tokens:
        return lambda s: s * tokens / steps
    return lambda s: s


# -- plots --------------------------------------------------------------------------------
def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _colour(i: int) -> str:
    return f"C{i % 10}"


def loss_curve(
    run: RunData, x_axis: str
) -> tuple[list[tuple[float, float]], tuple[float, float] | None]:
    """The eval rows of ``run`` as (x, eval loss), sorted, and the final (x, loss) where the
    summary has one. x: tokens or inner steps (``step`` rows), or the run's clock (``time``:
    the rows' ``t_s``, virtual seconds in process, and the final loss at the clock's end)."""
    key = "t_s" if x_axis == "time" else "step"
    pts = sorted(
        (_num(r.get(key)), _num(r.get("eval_loss")))
        for r in run.of("eval")
        if _num(r.get(key)) is not None and _num(r.get("eval_loss")) is not None
    )
    final = _num(run.summary.get("final_eval_loss"))
    end = time_span(run)[1] if x_axis == "time" else trained_steps(run)
    x = _x_of(run, x_axis)  # time: the clock's seconds as they are
    return [(x(s), v) for s, v in pts], (x(end), final) if final is not None and end else None


def train_loss_curve(run: RunData, x_axis: str, points: int = 300) -> list[tuple[float, float]]:
    """The learners' training loss (``step`` rows, the process runtime) as (x, mean loss),
    on the eval curve's axis: each row, in time order, at the run's mean inner step per
    learner at that moment (the sum of every learner's latest step over M; a step redone
    after a restart is counted once), in bins of at least M rows, so that the curve ends
    where the learners stopped, at the final eval loss."""
    rows = sorted(
        (r for r in run.of("step") if _t(r) is not None and _num(r.get("step")) is not None),
        key=_t,
    )
    rows = [r for r in rows if _num(r.get("loss")) is not None and _learner_of(r) is not None]
    if not rows:
        return []
    M = max(1, run.learners)  # noqa: N806
    size = max(M, -(-len(rows) // points))
    x = _x_of(run, x_axis)
    latest: dict[int, float] = {}
    out = []
    for i in range(0, len(rows), size):
        group = rows[i : i + size]
        for r in group:
            latest[_learner_of(r)] = r["step"]
        at = _t(group[-1]) if x_axis == "time" else x(sum(latest.values()) / M)
        out.append((at, sum(r["loss"] for r in group) / len(group)))
    return out


def plot_loss(runs: list[RunData], path: Path, x_axis: str):
    """Write ``loss.png``; returns its figure. Per run: the eval rows as markers, joined
    by a line where there are at least three (a curve, not a chord between two far
    points), the final eval loss as a star, the entropy floor dashed (where the run knows
    one; the legend names it only then) and, for runs with fewer than three eval rows, the
    learners' training loss dotted."""
    from matplotlib.lines import Line2D

    use_tokens = x_axis == "tokens" and all(_num(r.summary.get("tokens")) for r in runs)
    use_time = x_axis == "time"
    axis = "time" if use_time else "tokens" if use_tokens else "step"
    fig = _figure(8, 5.0 + 0.2 * len(runs))
    ax = fig.add_subplot()
    floors = False
    for i, run in enumerate(runs):
        c = _colour(i)
        pts, final = loss_curve(run, axis)
        if len(pts) >= 3:
            line = pts + ([final] if final is not None and pts[-1][0] < final[0] else [])
            ax.plot(
                [s for s, _ in line], [v for _, v in line], "-", color=c, lw=1.6, gid=f"line:{i}"
            )
        ax.plot(
            [s for s, _ in pts],
            [v for _, v in pts],
            "o",
            color=c,
            ms=4,
            label=f"{run.label}: eval loss",
            gid=f"eval:{i}",
        )
        if final is not None:
            ax.plot(
                [final[0]], [final[1]], "*", color=c, ms=11, mec="black", mew=0.5, gid=f"final:{i}"
            )
        train = train_loss_curve(run, axis) if len(pts) < 3 else []
        if train:  # few evaluations: the learners' training loss shows the way between them
            ax.plot(
                [s for s, _ in train],
                [v for _, v in train],
                ":",
                color=c,
                lw=1.0,
                alpha=0.8,
                label=f"{run.label}: train loss (mean)",
                gid=f"train:{i}",
            )
        floor = _num(run.summary.get("entropy_floor"))
        if floor is not None:
            ax.axhline(floor, color=c, ls="--", lw=1.1, alpha=0.8)
            floors = True
    handles, labels = ax.get_legend_handles_labels()
    if floors:  # only runs on a language with a known floor (the synthetic one) draw it
        handles.append(Line2D([], [], color="grey", ls="--"))
        labels.append("entropy floor (per run)")
    handles.append(Line2D([], [], color="grey", marker="*", ls="", ms=10, mec="black", mew=0.5))
    labels.append("final eval loss")
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=3)
    ax.set_xlabel(
        "time (s: virtual for inproc runs, wall for process runs)"
        if use_time
        else "tokens (all learners)"
        if use_tokens
        else "inner step (mean per learner)"
    )
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title("Eval loss of the global model")
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return fig


def plot_goodput(runs: list[RunData], path: Path):
    from matplotlib.lines import Line2D

    fig = _figure(8, 5.0 + 0.2 * len(runs))
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        c, tl = _colour(i), goodput_timeline(run)
        if not tl["t"]:
            continue
        note = "" if tl["derived"] else " [summary rate]"
        ax.plot(tl["t"], tl["goodput"], "-", color=c, lw=1.8, label=f"{run.label}{note}")
        ax.plot(tl["t"], tl["available"], ":", color=c, lw=1.2)
        g = _num(run.summary.get("goodput"))
        if g is not None:
            ax.plot([tl["t"][-1]], [g], "D", color=c, ms=7, mec="black", mew=0.5)
    handles, labels = ax.get_legend_handles_labels()
    handles += [
        Line2D([], [], color="grey", ls="-"),
        Line2D([], [], color="grey", ls=":"),
        Line2D([], [], color="grey", marker="D", ls="", mec="black", mew=0.5),
    ]
    labels += ["goodput so far (from merges)", "learners up (fraction)", "summary goodput"]
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=3)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("time (s: virtual for inproc runs, wall for process runs)")
    ax.set_ylabel("cumulative fraction of M x time")
    ax.set_title("Goodput timeline")
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return fig


def plot_learners(runs: list[RunData], path: Path):
    """Write ``learners.png``; returns its figure."""
    from matplotlib.patches import Patch

    lanes = [max(1, r.learners) for r in runs]
    fig = _figure(11, 1.2 + sum(0.45 * n + 0.9 for n in lanes))
    gs = fig.add_gridspec(len(runs), 2, width_ratios=(3, 1.3), height_ratios=lanes)
    for i, run in enumerate(runs):
        ax, bx = fig.add_subplot(gs[i, 0]), fig.add_subplot(gs[i, 1])
        states = learner_states(run)
        for m, spans in states.items():
            for st in (UP, DOWN, STOPPED):
                bars = [(s, e - s) for s, e, k in spans if k == st]
                if bars:
                    ax.broken_barh(bars, (m - 0.35, 0.7), color=_STATE_COLOURS[st], alpha=0.75)
        mx, my = [], []
        for r in run.of("merge"):
            if _t(r) is not None and isinstance(r.get("learners"), list):
                for m in r["learners"]:
                    if isinstance(m, int):
                        mx.append(_t(r))
                        my.append(m)
        if mx:
            ax.plot(mx, my, "|", color="black", ms=9, mew=1.0)
        M = max(1, run.learners)
        ax.set_yticks(range(M), [f"L{m}" for m in range(M)])
        ax.set_ylim(M - 0.5, -0.5)
        t0, t1 = time_span(run)
        if t1 > t0:
            ax.set_xlim(min(0.0, t0), t1 * 1.01)
        ax.set_title(f"{run.label}: learner activity", fontsize=10, loc="left")
        ax.set_xlabel("time (s)")
        ax.grid(axis="x", alpha=0.3)
        _ledger_bars(bx, run)
    handles = [Patch(color=_STATE_COLOURS[s], alpha=0.75, label=s) for s in (UP, DOWN, STOPPED)]
    handles.append(_merge_handle())
    handles += [Patch(color=c, label=f"ledger: {k}") for k, c in _LEDGER[:3]]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8)
    fig.savefig(path)
    return fig


def _merge_handle():
    from matplotlib.lines import Line2D

    return Line2D([], [], color="black", marker="|", ls="", ms=9, label="in a merge")


_LEDGER = (
    ("merged", "#59a14f"),
    ("dropped", "#f28e2b"),
    ("lost", "#e15759"),
    ("overwritten", "#edc948"),
    ("pending", "#bab0ac"),
    ("unpushed", "#d4d4d4"),
)


def _ledger_bars(ax, run: RunData) -> None:
    per = [p for p in run.summary.get("per_learner") or [] if isinstance(p, dict)]
    ledgers = {
        p.get("learner", i): p.get("ledger_steps")
        for i, p in enumerate(per)
        if isinstance(p.get("ledger_steps"), dict)
    }
    ax.set_title("step ledger", fontsize=10, loc="left")
    if not ledgers:
        ax.text(
            0.5,
            0.5,
            f"no per-learner ledger\n(method {run.method})",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=9,
            color="grey",
        )
        ax.set_xticks([])
        ax.set_yticks([])
        return
    ms = sorted(ledgers)
    left = [0.0] * len(ms)
    for key, colour in _LEDGER:
        vals = [max(0.0, _num(ledgers[m].get(key), 0.0)) for m in ms]
        if key in ("merged", "dropped", "lost") or any(vals):  # always three containers first
            ax.barh(ms, vals, left=left, color=colour, label=key, height=0.7)
            left = [a + b for a, b in zip(left, vals)]
    for m, total in zip(ms, left):  # each bar's total at its end, inside the axes
        ax.text(total, m, f" {total:,.0f}", va="center", ha="left", fontsize=8)
    ax.set_xlim(0, max(left, default=0.0) * 1.18 or 1.0)
    ax.set_yticks(ms, [f"L{m}" for m in ms])
    ax.set_ylim(max(ms) + 0.5, -0.5)
    ax.set_xlabel("inner steps (fragment-weighted)")
    if any(
        _num(ledgers[m].get(k), 0.0) > 0 for m in ms for k in ("overwritten", "pending", "unpushed")
    ):
        ax.legend(handles=ax.containers[3:], fontsize=7, loc="lower right", framealpha=0.8)
    ax.grid(axis="x", alpha=0.3)


def plot_bytes(runs: list[RunData], path: Path):
    fig = _figure(max(6.0, 1.6 * len(runs) + 3), 4.6)
    ax = fig.add_subplot()
    mib = float(1 << 20)
    xs = range(len(runs))
    for off, key, colour in ((-0.2, "bytes_up", "#4e79a7"), (0.2, "bytes_down", "#a0cbe8")):
        vals = [_num(r.summary.get(key), 0.0) / mib for r in runs]
        bars = ax.bar(
            [x + off for x in xs],
            vals,
            width=0.4,
            color=colour,
            label=key.replace("bytes_", "") + " (learners to syncer)"
            if key == "bytes_up"
            else "down (syncer to learners)",
        )
        ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
    ax.set_xticks(list(xs), [r.label.replace(" (", "\n(") for r in runs], fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title("Bytes moved per run")
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path)
    return fig


# -- html ---------------------------------------------------------------------------------
def _fmt(v, spec: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, (int, float)) and not isinstance(v, bool) and spec:
        return format(v, spec)
    return str(v)


def _summary_rows(run: RunData) -> list[str]:
    s = run.summary
    loss, floor = _num(s.get("final_eval_loss")), _num(s.get("entropy_floor"))
    mib = float(1 << 20)
    bu, bd = _num(s.get("bytes_up")), _num(s.get("bytes_down"))
    return [
        run.label,
        _fmt(s.get("engine")),
        _fmt(s.get("learners")),
        _fmt(s.get("steps")),
        _fmt(s.get("tokens"), ","),
        _fmt(loss, ".4f"),
        _fmt(floor, ".4f"),
        _fmt(None if loss is None or floor is None else loss - floor, ".4f"),
        _fmt(_num(s.get("goodput")), ".3f"),
        _fmt(_num(s.get("uptime")), ".3f"),
        _fmt(s.get("merges")),
        _fmt(None if bu is None else bu / mib, ".1f"),
        _fmt(None if bd is None else bd / mib, ".1f"),
        _fmt(_num(s.get("wall_s")), ".1f"),
    ]


_HEAD = (
    "run (method)",
    "engine",
    "M",
    "steps / learner",
    "tokens",
    "final eval loss",
    "entropy floor",
    "gap",
    "goodput",
    "uptime",
    "merges",
    "MiB up",
    "MiB down",
    "wall s",
)

_CAPTIONS = {
    "loss.png": "Eval loss of the global model against the tokens trained (markers, joined "
    "where a run has three or more evaluations); dotted: the learners' training loss where "
    "a run has fewer; dashed: each run's entropy floor; star: final eval loss.",
    "goodput.png": "Cumulative goodput: learner time credited by merges (1/P of a learner's "
    "up-time since its last credit for that fragment or its last failure) over "
    "M x elapsed time; "
    "dotted: fraction of learners up; diamond: the summary's goodput.",
    "learners.png": "Per-learner up / down / stopped intervals and merge participation; "
    "right: step ledger (merged, dropped, lost).",
    "bytes.png": "Bytes sent up (learners to syncer) and down (syncer to learners).",
}


def write_html(runs: list[RunData], path: Path) -> None:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in _HEAD)
    body = "".join(
        "<tr>" + "".join(f"<td>{e(c)}</td>" for c in _summary_rows(r)) + "</tr>" for r in runs
    )
    notes = "".join(
        f"<li>{e(str(r.path))}: skipped {r.skipped_lines} corrupt line(s)</li>"
        for r in runs
        if r.skipped_lines
    )
    figs = "".join(
        f'<figure><img src="{f}" alt="{e(f)}"><figcaption>{e(_CAPTIONS[f])}</figcaption></figure>'
        for f in _FILES
    )
    dirs = "".join(f"<li>{e(str(r.path.resolve()))}</li>" for r in runs)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ddiloco report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #eee; }}
figcaption {{ color: #555; font-size: 0.9em; }}
</style></head><body>
<h1>ddiloco report</h1>
<ul>{dirs}</ul>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
{f"<ul class='warnings'>{notes}</ul>" if notes else ""}
{figs}
</body></html>
"""
    path.write_text(page, encoding="utf-8")


# -- entry points -------------------------------------------------------------------------
def _label_runs(runs: list[RunData]) -> None:
    names = [r.path.resolve().name or str(r.path) for r in runs]
    for i, r in enumerate(runs):
        name = names[i]
        if names.count(name) > 1:  # disambiguate with the parent directory
            name = f"{r.path.resolve().parent.name}/{name}"
            if [f"{x.path.resolve().parent.name}/{n}" for x, n in zip(runs, names)].count(name) > 1:
                name = f"{name}#{i}"
        r.label = f"{name} ({r.method})"


def make_report(run_dirs: list[Path], out_dir: Path, *, x_axis: str = "tokens") -> list[Path]:
    """Write the four PNGs and ``index.html`` for ``run_dirs`` into ``out_dir``.

    Returns the written paths. Raises ``ReportError`` for a path that is not a run directory
    or an out dir that cannot be created.
    """
    if not run_dirs:
        raise ReportError("no run directories given")
    if x_axis not in X_AXES:
        raise ReportError(f"x_axis must be one of {', '.join(X_AXES)}, got {x_axis!r}")
    runs = [load_run(Path(d)) for d in run_dirs]
    _label_runs(runs)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ReportError(f"--out {out_dir} exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create {out_dir}: {e.strerror}") from None
    paths = [out_dir / f for f in (*_FILES, "index.html")]
    plot_loss(runs, paths[0], x_axis)
    plot_goodput(runs, paths[1])
    plot_learners(runs, paths[2])
    plot_bytes(runs, paths[3])
    write_html(runs, paths[4])
    return paths


def add_report_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "report",
        help="plots and an HTML page for one or more run directories",
        description="Write loss.png, goodput.png, learners.png, bytes.png and "
        "index.html for one or more run directories (of either engine).",
    )
    p.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        type=Path,
        help="a directory written by `ddiloco train` (holds summary.json)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: RUN_DIR/report for one run, ./report for several)",
    )
    p.add_argument(
        "--x-axis",
        choices=X_AXES,
        default="tokens",
        help="x axis of loss.png: tokens, inner steps, or the run's clock (virtual seconds "
        "for inproc runs, wall seconds for process runs)",
    )
    p.set_defaults(func=_cmd_report)
    return p


def _cmd_report(args: argparse.Namespace) -> int:
    out = args.out or (args.run_dirs[0] / "report" if len(args.run_dirs) == 1 else Path("report"))
    try:
        paths = make_report(args.run_dirs, out, x_axis=args.x_axis)
    except ReportError as e:
        print(f"ddiloco report: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0
