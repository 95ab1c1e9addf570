"""What the dashboard shows, built from either of its two sources.

- ``StatusHistory``: samples a syncer's ``status()`` snapshot (in the syncer process, or over
  gRPC from ``ddiloco dashboard HOST:PORT``) about once a second and keeps time series
  (live learners, merges, learners per merge, goodput, each learner's loss) and the events
  that the differences between snapshots reveal (a learner joined, died, came back as a new
  incarnation; the syncer restarted; a call was rejected).
- ``RunDirReader``: follows the files of a run directory as the launcher writes them
  (``learner_*/metrics.jsonl``, ``syncer.metrics.jsonl``, ``chaos.jsonl``, and at the end
  ``summary.json``), reading only what was appended since the last poll.

Both answer ``view()``: one JSON-able dict, the document behind ``/api/state``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ddiloco.metrics.sinks import parse_jsonl
from ddiloco.runtime.observe.accounting import goodput_so_far, learner_totals

__all__ = ["StatusHistory", "RunDirReader", "MAX_POINTS", "MAX_EVENTS"]

MAX_POINTS = 2000
"""Points kept per time series (older ones are thinned out, not dropped)."""
MAX_EVENTS = 200


class _Series:
    """A bounded list of (t_s, value): when full, every other point is dropped, so the
    whole run stays visible at a coarser resolution."""

    def __init__(self) -> None:
        self.points: list[tuple[float, float]] = []

    def add(self, t_s: float, v: float | None) -> None:
        if v is None:
            return
        self.points.append((round(t_s, 3), float(v)))
        if len(self.points) > MAX_POINTS:
            self.points = self.points[::2]


def _empty_view(source: str) -> dict:
    return {
        "source": source,
        "t_s": 0.0,
        "done": False,
        "summary": {
            "merges": 0,
            "live": 0,
            "learners": 0,
            "goodput": None,
            "bytes_in": 0,
            "bytes_out": 0,
            "rejections": 0,
            "mean_quorum": None,
            "steps_done": 0,
            "step_budget": 0,
            "initialised": False,
        },
        "learners": [],
        "versions": [],
        "series": {},
        "loss": {},
        "events": [],
    }


class StatusHistory:
    """Time series and events from successive syncer status snapshots.

    ``status_fn`` returns the snapshot (``SyncerServer.status`` or a gRPC ``Status`` call);
    ``start()`` samples it every ``interval_s`` in a daemon thread (``sample()`` does one by
    hand). A failing ``status_fn`` (a syncer being restarted) records an event once and the
    sampling goes on."""

    def __init__(self, status_fn: Callable[[], dict], source: str, interval_s: float = 1.0) -> None:
        self.status_fn, self.source, self.interval_s = status_fn, source, interval_s
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._last: dict | None = None
        self._series = {
            k: _Series() for k in ("live", "merges", "goodput", "learners_per_merge", "steps_done")
        }
        self._loss: dict[str, _Series] = {}
        self._events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._unreachable = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StatusHistory:
        self._thread = threading.Thread(target=self._loop, name="observe-history", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def _event(self, t_s: float, kind: str, detail: str) -> None:
        self._events.append({"t_s": round(t_s, 3), "kind": kind, "detail": detail})

    def sample(self) -> None:
        t = time.monotonic() - self._t0
        try:
            st = self.status_fn()
        except Exception as e:  # noqa: BLE001 - a syncer down is an event, not a crash
            with self._lock:
                if not self._unreachable:
                    self._event(t, "syncer-unreachable", str(e).splitlines()[0][:200])
                self._unreachable = True
            return
        with self._lock:
            if self._unreachable:
                self._event(t, "syncer-reachable", f"boot {st.get('boot_id')}")
            self._unreachable = False
            self._diff(t, self._last, st)
            s = self._series
            s["live"].add(t, len(st.get("live") or []))
            s["merges"].add(t, st.get("merges", 0))
            s["goodput"].add(t, goodput_so_far(st))
            s["steps_done"].add(t, st.get("steps_done"))
            prev = self._last or {}
            q0 = (prev.get("mean_quorum") or 0.0) * prev.get("merges", 0)
            q1 = (st.get("mean_quorum") or 0.0) * st.get("merges", 0)
            dm = st.get("merges", 0) - prev.get("merges", 0)
            if dm > 0 and prev.get("boot_id") == st.get("boot_id"):
                s["learners_per_merge"].add(t, (q1 - q0) / dm)
            for m, info in (st.get("learners") or {}).items():
                rep = info.get("report") or {}
                old = ((prev.get("learners") or {}).get(m) or {}).get("report") or {}
                if rep.get("loss") is not None and rep.get("global_step") != old.get("global_step"):
                    self._loss.setdefault(m, _Series()).add(t, rep["loss"])
            self._last = st

    def _diff(self, t: float, old: dict | None, new: dict) -> None:
        if old is None:
            self._event(
                t,
                "syncer",
                f"boot {new.get('boot_id')}, {len(new.get('live') or [])} live learners",
            )
            old = {"learners": {}, "rejections": {}, "boot_id": new.get("boot_id")}
        if old.get("boot_id") != new.get("boot_id"):
            self._event(t, "syncer-restart", f"new boot {new.get('boot_id')}")
        for m, info in (new.get("learners") or {}).items():
            was = (old.get("learners") or {}).get(m)
            if was is None:
                self._event(
                    t, "learner-join", f"learner {m} (incarnation {info.get('incarnation')})"
                )
            elif was.get("incarnation") != info.get("incarnation"):
                self._event(
                    t,
                    "learner-restart",
                    f"learner {m} came back as incarnation {info.get('incarnation')}",
                )
            elif was.get("state") != info.get("state"):
                self._event(
                    t,
                    f"learner-{info.get('state')}",
                    f"learner {m}: {was.get('state')} -> {info.get('state')}",
                )
        for code, n in (new.get("rejections") or {}).items():
            k = n - (old.get("rejections") or {}).get(code, 0)
            if k > 0:
                self._event(t, "reject", f"{k} x {code}")
        if new.get("budget_spent") and not old.get("budget_spent"):
            self._event(t, "budget-spent", f"{new.get('steps_done')} steps")

    def view(self) -> dict:
        with self._lock:
            st = self._last
            v = _empty_view(self.source)
            v["t_s"] = round(time.monotonic() - self._t0, 3)
            v["series"] = {k: s.points for k, s in self._series.items()}
            v["loss"] = {m: s.points for m, s in self._loss.items()}
            v["events"] = list(self._events)
            v["reachable"] = not self._unreachable
            if st is None:
                return v
            c = st.get("counters") or {}
            v["done"] = bool(st.get("budget_spent")) and not st.get("live")
            v["summary"] = {
                "merges": st.get("merges", 0),
                "live": len(st.get("live") or []),
                "learners": len(st.get("learners") or {}),
                "goodput": goodput_so_far(st),
                "bytes_in": c.get("bytes_in", 0),
                "bytes_out": c.get("bytes_out", 0),
                "rejections": sum((st.get("rejections") or {}).values()),
                "mean_quorum": st.get("mean_quorum"),
                "steps_done": st.get("steps_done", 0),
                "step_budget": st.get("step_budget", 0),
                "initialised": st.get("initialised"),
                "uptime_s": st.get("uptime_s"),
                "boot_id": st.get("boot_id"),
            }
            v["versions"] = list(st.get("versions") or [])
            for m, info in sorted((st.get("learners") or {}).items(), key=lambda kv: int(kv[0])):
                rep = info.get("report") or {}
                v["learners"].append(
                    {
                        "learner": m,
                        "state": info.get("state"),
                        "incarnation": info.get("incarnation"),
                        "step": rep.get("global_step", rep.get("step", 0)),
                        "loss": rep.get("loss"),
                        "step_s": rep.get("step_s"),
                        "merged": learner_totals(info)["ledger"]["merged"],
                        "heartbeat_age_s": info.get("last_heartbeat_age_s"),
                    }
                )
            return v


class RunDirReader:
    """Follows a run directory written by ``ddiloco train --engine processes``.

    Participation over time counts, for each second of the run, the learners that took a
    step in it."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        if not self.dir.is_dir():
            raise ValueError(f"run directory {self.dir} does not exist")
        self._lock = threading.Lock()
        self._offsets: dict[Path, int] = {}
        self._wall0: float | None = None
        self._learners: dict[str, dict] = {}
        self._loss: dict[str, _Series] = {}
        self._merges: list[tuple[float, int]] = []
        self._versions: dict[int, int] = {}
        self._events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._rejects = 0
        self._active: dict[int, set[str]] = {}  # second of the run -> learners that stepped

    def _new_rows(self, path: Path) -> list[dict]:
        """Complete lines appended to ``path`` since the last call."""
        if not path.is_file():
            return []
        off = self._offsets.get(path, 0)
        if path.stat().st_size < off:  # rewritten by a new run
            off = 0
        with open(path, "rb") as f:
            f.seek(off)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offsets[path] = off + end
        return parse_jsonl(data[:end])

    def _t(self, r: dict) -> float:
        w = r.get("wall")
        if not isinstance(w, (int, float)):
            return 0.0
        if self._wall0 is None:
            cfg = self.dir / "config.json"
            self._wall0 = cfg.stat().st_mtime if cfg.is_file() else w
        return round(w - self._wall0, 3)

    def _learner(self, m: str) -> dict:
        return self._learners.setdefault(
            m, {"learner": m, "state": "starting", "incarnation": 0, "step": 0, "loss": None}
        )

    def _poll(self) -> None:
        for path in sorted(self.dir.glob("learner_*/metrics.jsonl")):
            m = path.parent.name.split("_", 1)[1]
            for r in self._new_rows(path):
                t, L = self._t(r), self._learner(m)
                if r.get("kind") == "learner_start":
                    L["state"], L["incarnation"] = "live", r.get("incarnation", L["incarnation"])
                elif r.get("kind") == "step":
                    L["step"], L["loss"] = r.get("step", L["step"]), r.get("loss")
                    L["state"] = "live" if L["state"] in ("starting", "restarting") else L["state"]
                    self._active.setdefault(int(t), set()).add(m)
                    if r.get("loss") is not None:
                        self._loss.setdefault(m, _Series()).add(t, r["loss"])
                elif r.get("kind") == "learner_end":
                    L["state"] = "finished"
        for r in self._new_rows(self.dir / "syncer.metrics.jsonl"):
            t, kind = self._t(r), r.get("kind", "")
            if kind == "merge":
                self._merges.append((t, len(r.get("learners") or [])))
                self._versions[int(r.get("fragment", 0))] = int(r.get("version", 0))
            elif kind == "reject":
                self._rejects += 1
                self._events.append(
                    {"t_s": t, "kind": "reject", "detail": f"{r.get('code')} from {r.get('who')}"}
                )
            elif kind in ("leave", "dead", "join", "init", "resume", "budget-spent"):
                self._events.append(
                    {
                        "t_s": t,
                        "kind": kind,
                        "detail": " ".join(
                            f"{k} {v}" for k, v in r.items() if k not in ("t_s", "wall", "kind")
                        ),
                    }
                )
        for r in self._new_rows(self.dir / "chaos.jsonl"):
            t, kind, target = self._t(r), r.get("kind", ""), r.get("target", "")
            detail = " ".join(f"{k} {v}" for k, v in r.items() if k not in ("t_s", "wall", "kind"))
            self._events.append({"t_s": t, "kind": kind, "detail": detail})
            if target.startswith("learner_"):
                L = self._learner(target.split("_", 1)[1])
                L["state"] = {
                    "kill-learner": "killed",
                    "learner-crashed": "crashed",
                    "stop-learner": "stopped",
                    "cont-learner": "live",
                    "restart-learner": "restarting",
                    "learner-finished": "finished",
                }.get(kind, L["state"])

    def view(self) -> dict:
        with self._lock:
            self._poll()
            v = _empty_view(f"run {self.dir}")
            summary_path = self.dir / "summary.json"
            summary = None
            if summary_path.is_file():
                try:
                    summary = json.loads(summary_path.read_text())
                except json.JSONDecodeError:
                    summary = None  # being replaced
            learners = [
                dict(L) for _, L in sorted(self._learners.items(), key=lambda kv: int(kv[0]))
            ]
            merges = [[t, 1 + i] for i, (t, _) in enumerate(self._merges)]
            v.update(
                done=summary is not None,
                learners=learners,
                versions=[
                    self._versions.get(p, 0) for p in range(max(self._versions, default=-1) + 1)
                ],
                loss={m: s.points for m, s in self._loss.items()},
                events=sorted(self._events, key=lambda e: e["t_s"]),
                t_s=max(
                    [p[0] for p in merges[-1:]]
                    + [p[0] for s in self._loss.values() for p in s.points[-1:]]
                    + [0.0]
                ),
                series={
                    "live": [[float(t), len(ms)] for t, ms in sorted(self._active.items())],
                    "merges": merges,
                    "learners_per_merge": [[t, n] for t, n in self._merges[-MAX_POINTS:]],
                    "goodput": [],
                    "steps_done": [],
                },
            )
            n = len(self._merges)
            v["summary"].update(
                merges=n,
                live=sum(1 for L in learners if L["state"] == "live"),
                learners=len(learners),
                rejections=self._rejects,
                mean_quorum=sum(q for _, q in self._merges) / n if n else None,
                steps_done=sum(L["step"] or 0 for L in learners),
                initialised=n > 0,
            )
            if summary is not None:
                v["summary"].update(
                    goodput=summary.get("goodput"),
                    bytes_in=summary.get("bytes_up", 0),
                    bytes_out=summary.get("bytes_down", 0),
                    final_eval_loss=summary.get("final_eval_loss"),
                )
            return v
