"""Prometheus metrics of a syncer, read from its ``status()`` snapshot at scrape time.

Nothing on the syncer's hot path is instrumented: a custom collector turns the snapshot that
``ddiloco status`` prints (learners, versions, counters, rejections, policy timings) into
metric families when Prometheus scrapes ``/metrics``. Every name starts with ``ddiloco_``;
counters end in ``_total`` as the exposition format requires.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from ddiloco.runtime.observe.accounting import goodput_so_far, learner_totals

__all__ = ["SyncerCollector", "syncer_registry"]

LEARNER_STATES = ("live", "dead", "left")
"""States a learner has in the syncer's status (``_LearnerInfo.state``)."""


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


class SyncerCollector(Collector):
    """Collects ``ddiloco_*`` metric families from ``status_fn()`` on every scrape."""

    def __init__(self, status_fn: Callable[[], dict]) -> None:
        self.status_fn = status_fn

    def collect(self) -> Iterator[Metric]:
        st = self.status_fn()
        yield from syncer_metrics(st)


def syncer_metrics(st: dict) -> list[Metric]:
    """The metric families of one status snapshot (pure: a dict in, families out)."""
    c = st.get("counters") or {}
    out: list[Metric] = []

    def gauge(name: str, doc: str, value) -> None:
        v = _num(value)
        if v is not None:
            out.append(GaugeMetricFamily(name, doc, value=v))

    def counter(name: str, doc: str, value) -> None:
        v = _num(value)
        if v is not None:
            out.append(CounterMetricFamily(name, doc, value=v))

    gauge(
        "ddiloco_syncer_uptime_seconds",
        "Seconds since this syncer process started.",
        st.get("uptime_s"),
    )
    gauge(
        "ddiloco_syncer_initialised",
        "1 once the syncer holds a global model (after Init or a resume).",
        1.0 if st.get("initialised") else 0.0,
    )
    counter("ddiloco_merges", "Fragment merges committed by the syncer.", st.get("merges", 0))
    mean_q, merges = _num(st.get("mean_quorum")), _num(st.get("merges")) or 0.0
    counter(
        "ddiloco_merge_learners",
        "Learners summed over all merges (rate over "
        "rate(ddiloco_merges_total) = learners per merge).",
        round(mean_q * merges) if mean_q is not None else 0.0,
    )
    gauge("ddiloco_mean_learners_per_merge", "Mean quorum size of all merges so far.", mean_q)

    versions = GaugeMetricFamily(
        "ddiloco_fragment_version", "Published version of each fragment.", labels=["fragment"]
    )
    for p, v in enumerate(st.get("versions") or []):
        versions.add_metric([str(p)], float(v))
    out.append(versions)

    learners = st.get("learners") or {}
    by_state = GaugeMetricFamily(
        "ddiloco_learners", "Learners the syncer knows, by state.", labels=["state"]
    )
    for s in sorted({*LEARNER_STATES, *(i.get("state", "") for i in learners.values())}):
        by_state.add_metric([s], float(sum(1 for i in learners.values() if i.get("state") == s)))
    out.append(by_state)
    gauge(
        "ddiloco_live_learners",
        "Learners currently live (joined, heartbeating).",
        len(st.get("live") or []),
    )

    fams = {
        "up": GaugeMetricFamily(
            "ddiloco_learner_up", "1 while the learner is live.", labels=["learner"]
        ),
        "step": GaugeMetricFamily(
            "ddiloco_learner_step",
            "Learner's inner steps, counted over its restarts.",
            labels=["learner"],
        ),
        "loss": GaugeMetricFamily(
            "ddiloco_learner_loss", "Learner's latest training loss.", labels=["learner"]
        ),
        "step_s": GaugeMetricFamily(
            "ddiloco_learner_step_seconds", "Learner's recent inner step time.", labels=["learner"]
        ),
        "hb": GaugeMetricFamily(
            "ddiloco_learner_heartbeat_age_seconds",
            "Seconds since the learner's last heartbeat.",
            labels=["learner"],
        ),
        "inc": GaugeMetricFamily(
            "ddiloco_learner_incarnation",
            "Learner's process incarnation (grows on every restart).",
            labels=["learner"],
        ),
        "merged": GaugeMetricFamily(
            "ddiloco_learner_merged_steps",
            "Inner steps of this learner (all its processes) merged into the model.",
            labels=["learner"],
        ),
    }
    for m, info in learners.items():
        rep = info.get("report") or {}
        led = learner_totals(info)["ledger"]
        for key, value in (
            ("up", 1.0 if info.get("state") == "live" else 0.0),
            ("step", rep.get("global_step", rep.get("step"))),
            ("loss", rep.get("loss")),
            ("step_s", rep.get("step_s")),
            ("hb", info.get("last_heartbeat_age_s")),
            ("inc", info.get("incarnation")),
            ("merged", led.get("merged")),
        ):
            v = _num(value)
            if v is not None:
                fams[key].add_metric([str(m)], v)
    out.extend(fams.values())

    gauge(
        "ddiloco_goodput",
        "Share of the learners' slot time whose work is merged so far.",
        goodput_so_far(st),
    )
    counter(
        "ddiloco_received_bytes", "Fragment bytes received from learners.", c.get("bytes_in", 0)
    )
    counter("ddiloco_sent_bytes", "Fragment bytes sent to learners.", c.get("bytes_out", 0))
    pushes = CounterMetricFamily("ddiloco_pushes", "Pushes by outcome.", labels=["status"])
    for k, v in sorted(c.items()):
        if k.startswith("push_") and k != "push_apply_s" and _num(v) is not None:
            pushes.add_metric([k[len("push_") :]], float(v))
    out.append(pushes)
    rejects = CounterMetricFamily(
        "ddiloco_rejections", "Rejected calls and pushes by error code.", labels=["code"]
    )
    for code, n in sorted((st.get("rejections") or {}).items()):
        rejects.add_metric([code], float(n))
    out.append(rejects)
    counter("ddiloco_checkpoints", "Checkpoints written.", c.get("checkpoints", 0))
    counter(
        "ddiloco_merge_seconds", "Wall seconds spent in merge arithmetic.", c.get("merge_s", 0.0)
    )
    counter(
        "ddiloco_merge_cpu_seconds",
        "CPU seconds spent in merge arithmetic.",
        c.get("merge_cpu_s", 0.0),
    )
    counter(
        "ddiloco_push_apply_seconds",
        "Wall seconds decoding, checking and merging pushes.",
        c.get("push_apply_s", 0.0),
    )
    gauge("ddiloco_steps_done", "Inner steps of all learners together.", st.get("steps_done"))
    gauge("ddiloco_step_budget", "Global step budget (0: none).", st.get("step_budget"))
    gauge("ddiloco_grace_seconds", "Current adaptive grace window.", st.get("grace_s"))
    gauge("ddiloco_xi_step_seconds", "Estimated learner step time (xi_step).", st.get("xi_step_s"))
    return out


def syncer_registry(status_fn: Callable[[], dict]) -> CollectorRegistry:
    """A registry of its own (not the process-global one) holding a ``SyncerCollector``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SyncerCollector(status_fn))
    return reg
