"""Goodput and per-learner totals from the learners' step ledgers, as the syncer keeps them.

Goodput (``docs/ALGORITHM.md``): the chip-time of merged steps over all chip-time,
``sum_m useful_s(m) / (M * run_s)``. A learner process reports, in every heartbeat and in
its Leave, its step ledger (fragment-weighted steps: merged, dropped, overwritten, lost,
pending, unpushed), its stepping time ``compute_s`` and the tokens it computed; its useful
time is ``compute_s * merged / computed``. A learner restarted after a kill is a new process
whose ledger starts from zero: the syncer folds the previous process's last report into the
learner's carried totals (what it had not got merged is lost), so steps, tokens and useful
time carry across restarts without the user's help. ``run_s`` runs from the first Join to
now, or to the moment the last learner left. Start-up before the first Join is not chip-time
of the run; a restart's start-up is (the learner is down).

``summary.json``, ``ddiloco status``, the launcher's live line and the dashboard all read
these totals through ``goodput_of``: one ledger, one number. Pure functions of the syncer's
status snapshot: the syncer builds its status with them, and every reader of a status reads
it with them.
"""

from __future__ import annotations

__all__ = [
    "LEDGER_KEYS",
    "instance_totals",
    "add_totals",
    "fold",
    "learner_totals",
    "goodput_of",
    "goodput_so_far",
]

LEDGER_KEYS = ("computed", "merged", "dropped", "overwritten", "lost", "pending", "unpushed")


def _num(x, default: float = 0.0) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else default


def instance_totals(rep: dict | None, *, ended: bool = False) -> dict:
    """Totals of one learner process from its latest report. ``ended``: the process is gone
    (killed or restarted): its pending and unpushed steps will never be merged, they are
    lost."""
    rep = rep or {}
    led = {k: _num((rep.get("ledger") or {}).get(k)) for k in LEDGER_KEYS}
    compute_s = _num(rep.get("compute_s"))
    useful_s = compute_s * led["merged"] / led["computed"] if led["computed"] > 0 else 0.0
    if ended:
        led["lost"] += led["pending"] + led["unpushed"]
        led["pending"] = led["unpushed"] = 0.0
    return {
        "steps": int(_num(rep.get("step"))),
        "tokens": int(_num(rep.get("tokens"))),
        "compute_s": compute_s,
        "useful_s": useful_s,
        "ledger": led,
    }


def add_totals(a: dict | None, b: dict) -> dict:
    """The sum of two totals (``a`` None: nothing yet)."""
    if not a:
        return {**b, "ledger": dict(b["ledger"])}
    return {
        "steps": a["steps"] + b["steps"],
        "tokens": a["tokens"] + b["tokens"],
        "compute_s": a["compute_s"] + b["compute_s"],
        "useful_s": a["useful_s"] + b["useful_s"],
        "ledger": {k: a["ledger"].get(k, 0.0) + b["ledger"].get(k, 0.0) for k in LEDGER_KEYS},
    }


def fold(carried: dict | None, ended_report: dict | None) -> dict | None:
    """The carried totals once the process behind ``ended_report`` is gone."""
    if not ended_report:
        return carried
    return add_totals(carried, instance_totals(ended_report, ended=True))


def learner_totals(info: dict) -> dict:
    """A learner's totals over all its processes, from its entry in the syncer's status
    (``carried``: processes that ended; ``report``: the current or last one)."""
    ended = info.get("state") != "live" and info.get("state") != "left"
    return add_totals(info.get("carried"), instance_totals(info.get("report"), ended=ended))


def goodput_of(st: dict) -> float | None:
    """Goodput of the run so far (or of the whole run, once every learner left) from the
    syncer's status; None before any learner joined."""
    learners = st.get("learners") or {}
    run_s = _num(st.get("run_s"))
    if not learners or run_s <= 0:
        return None
    useful = sum(learner_totals(info)["useful_s"] for info in learners.values())
    return useful / (len(learners) * run_s)


def goodput_so_far(st: dict) -> float | None:
    """Goodput of the run so far, as the syncer computes it: the chip-time of merged steps,
    over every learner's processes, over M x the time since the first Join (the status's own
    ``goodput`` where it has one, else ``goodput_of``). The same number as ``summary.json``
    and the launcher's live line."""
    return st["goodput"] if "goodput" in st else goodput_of(st)
