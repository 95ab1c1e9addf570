"""Decoupled DiLoCo in one process on a virtual clock.

M learners train real PyTorch models; a discrete-event loop orders their step boundaries,
pushes, merges, broadcasts, failures and rejoins in virtual time. The syncer is the same
``SyncerState`` the gRPC server drives; the learner side is ``LearnerSync``. Deterministic
for a seed.

The event heap is the package's one kernel (``ddiloco.kernel``). Event priorities at
equal times: arrivals at the syncer (1), broadcasts reaching learners
and departures (2), grace timers (3), step ends (5), step starts (9). A step start therefore
sees every merge that completed at the same instant (needed for tau = 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ddiloco.algorithm.downlink import DeltaChain
from ddiloco.algorithm.learner_state import LearnerSync, Outgoing
from ddiloco.algorithm.payload import EncodedParams, encode_push
from ddiloco.algorithm.policy import WaitUntil
from ddiloco.algorithm.schedule import FragmentSchedule
from ddiloco.algorithm.syncer_state import Contribution, Merged, Status, SyncerConfig, SyncerState
from ddiloco.config import TrainConfig
from ddiloco.engine.common import Recorder, TimeBreakdown, World, build_workers
from ddiloco.kernel import EventKernel
from ddiloco.recipe import evaluate, fragmentation_for

__all__ = ["run_decoupled"]


@dataclass(slots=True)
class _Learner:
    alive: bool = True
    inc: int = 0  # incarnation: events of a dead incarnation are ignored
    steps: int = 0  # completed inner steps (including work later lost)
    finished: bool = False
    step_started_s: float = 0.0
    step_dt: float = 0.0
    next_fail_s: float = math.inf
    down_since_s: float = 0.0
    failures: int = 0
    stepping: bool = False  # a step is in progress


def syncer_config(cfg: TrainConfig) -> SyncerConfig:
    """The syncer state machine's configuration (the same the real syncer gets)."""
    return cfg.sync.syncer_config()


def run_decoupled(cfg: TrainConfig, ctx) -> dict:
    """Run Decoupled DiLoCo; ``ctx`` carries the language, eval set, global model and recorder.

    The run is built (the syncer, the learners and their first events), run (the event loop
    until the heap drains) and closed (the final global model and the run's figures)."""
    run = _DecoupledRun(cfg, ctx)
    run.start()
    run.run()
    return run.close()


class _DecoupledRun:
    """The state of one run of the engine: the syncer, the M learners (their workers, their
    ``LearnerSync`` and their ``_Learner`` record), the event heap and the run's counters.
    One handler per event kind (``_on_<kind>``) changes it."""

    def __init__(self, cfg: TrainConfig, ctx) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.rec: Recorder = ctx.recorder
        self.world = world = World(cfg)
        self.up = world.up_codec
        self.frag = frag = fragmentation_for(cfg, ctx.global_model)
        sched = FragmentSchedule(P=frag.P, H=cfg.sync.H, tau=cfg.sync.tau)
        init = {n: p.detach().clone() for n, p in ctx.global_model.named_parameters()}
        self.syncer = SyncerState(frag, init, syncer_config(cfg))
        self.workers = build_workers(cfg, ctx.data, ctx.global_model.state_dict())
        slot_s = cfg.world.step_time_s if cfg.sync.schedule == "time" else None
        self.syncs = [
            LearnerSync(
                w.params, frag, sched, alpha=cfg.sync.alpha, install=cfg.sync.install, slot_s=slot_s
            )
            for w in self.workers
        ]
        self.learners = [_Learner() for _ in self.workers]
        self.times = [TimeBreakdown() for _ in self.workers]
        n_params = sum(f.numel for f in frag.fragments)
        # a whole-model fetch (a rejoin); delta-coded downlinks send it in fp32
        self.model_bytes_down = (
            4 * n_params if cfg.sync.down_delta else world.down_codec.nbytes(n_params)
        )
        # what each learner received of each fragment, by version: a push of a ``delta`` codec is
        # a delta against the copy the learner installed (through the downlink codec), as in the
        # runtime
        self.held: list[dict[int, dict[int, list[torch.Tensor]]]] = [
            {} for _ in range(cfg.learners)
        ]
        # sync.down_delta: one reference chain per fragment, the copy every learner holds
        # (ddiloco.algorithm.downlink, as the runtime syncer keeps it)
        self.chains = (
            {
                p: DeltaChain(world.down_codec, [init[n] for n in f.names], 0)
                for p, f in enumerate(frag.fragments)
            }
            if cfg.sync.down_delta
            else {}
        )
        self.q = EventKernel()
        self.stats: dict = {
            "bytes_up": 0,
            "bytes_down": 0,
            "pushes": 0,
            "rejected": {},
            "staleness": [],
        }
        self.M, self.N = cfg.learners, cfg.steps
        self.up_since = 0.0  # when the number of live learners last fell to zero
        self.n_up = self.M  # live learners that have not finished
        self.started = 0  # inner steps started and not lost to a failure (the budget is M * N)
        self.zero_up_s = 0.0  # time with no live learner
        self.eval_next = cfg.optim.eval_every
        self.t = 0.0
        self.bar: tqdm | None = None

    # -- build, run, close ----------------------------------------------------------------
    def start(self) -> None:
        """Every learner joins, loads the global model and queues its first step and its
        first failure."""
        for m in range(self.M):
            lrn = self.learners[m]
            self.syncer.join(m)
            self.syncs[m].load_global(self.whole(), self.syncer.versions())
            self.exact(m)
            lrn.next_fail_s = self.world.next_failure_s(m, 0.0)
            self.q.push(0.0, 9, "start", (m, 0))
            if lrn.next_fail_s < math.inf:
                self.q.push(lrn.next_fail_s, 0, "fail", (m, 0))

    def run(self) -> None:
        """Take events in (time, priority) order until the heap drains. An event handled
        with an empty heap behind it makes the syncer flush its open rounds (their
        broadcasts queue more events). A handler returns False where no flush follows: an
        event it ignores, a step start that finishes its learner (whose leave is queued) and
        a rejoin after the step budget is spent."""
        M, N = self.M, self.N  # noqa: N806
        handlers = {
            "start": self._on_start,
            "end": self._on_end,
            "arrive": self._on_arrive,
            "timer": self._on_timer,
            "receive": self._on_receive,
            "leave": self._on_leave,
            "fail": self._on_fail,
            "rejoin": self._on_rejoin,
        }
        self.bar = tqdm(
            total=M * N,
            desc=f"decoupled M={M}",
            disable=not self.cfg.progress,
            unit="step",
            leave=False,
        )
        while self.q:
            t_ev, kind, payload = self.q.pop()
            if self._outdated(kind, payload):
                continue
            self.t = t_ev
            if not handlers[kind](payload):
                continue
            if not self.q:
                for mg in self.syncer.flush(self.t):
                    self.broadcast(mg, self.t)
        self.bar.close()

    def close(self) -> dict:
        """Load the final global model into ``ctx`` and return the run's figures."""
        M = self.M  # noqa: N806
        end_s = self.t
        # the tail after the last learner finished is merge time, not downtime
        self.ctx.load_global(self.syncer.global_params())
        per_learner = []
        useful_s = 0.0
        for m in range(M):
            useful_s += self._settle_times(m, end_s)
            per_learner.append(self._learner_figures(m))
        syncer, stats, times, syncs = self.syncer, self.stats, self.times, self.syncs
        tokens_merged = round(sum(syncer.ledger[m].tokens_merged for m in range(M)))
        return {
            "end_s": end_s,
            "goodput": useful_s / (M * end_s) if end_s > 0 else 0.0,
            "goodput_available": _ratio(useful_s, M * end_s - sum(x.down_s for x in times)),
            "uptime": 1.0 - self.zero_up_s / end_s if end_s > 0 else 0.0,
            "bytes_up": stats["bytes_up"],
            "bytes_down": stats["bytes_down"],
            "merges": syncer.merges,
            "mean_quorum": (
                sum(syncer.quorum_sizes) / len(syncer.quorum_sizes) if syncer.quorum_sizes else 0.0
            ),
            "learners_per_merge": _ratio(sum(syncer.quorum_sizes), len(syncer.quorum_sizes)),
            "pushes": stats["pushes"],
            "rejected": stats["rejected"],
            "mean_staleness": (
                sum(stats["staleness"]) / len(stats["staleness"]) if stats["staleness"] else 0.0
            ),
            "tokens_merged": tokens_merged,
            "install": self.cfg.sync.install,
            "install_delay_steps": round(
                _ratio(sum(x.install_delay_steps for x in syncs), sum(x.installs for x in syncs)),
                3,
            ),
            "failures": sum(x.failures for x in self.learners),
            "clipped_pushes": syncer.clipped_pushes,
            "carried_pushes": syncer.carried_pushes,
            "fragments": self.frag.P,
            "per_learner": per_learner,
        }

    # -- the event handlers ---------------------------------------------------------------
    def _outdated(self, kind: str, payload) -> bool:
        """An event of a dead incarnation, or a failure of a learner already down or done."""
        if (
            kind in ("start", "end", "fail", "rejoin", "leave", "receive")
            and payload[1] != self.learners[payload[0]].inc
        ):
            return True
        return kind == "fail" and (
            not self.learners[payload[0]].alive or self.learners[payload[0]].finished
        )

    def _on_start(self, payload) -> bool:
        """Learner m starts an inner step (or finishes, once the step budget is spent)."""
        m, inc = payload
        lrn, t = self.learners[m], self.t
        if not lrn.alive or inc != lrn.inc:
            return False
        if self.started >= self.M * self.N:  # the global budget of inner steps is spent
            self.finish(m, t)
            return False
        self.started += 1
        lrn.stepping = True
        self.syncs[m].install_due()
        lrn.step_dt = self.world.step_s(m)
        lrn.step_started_s = t
        loss = self.workers[m].train_step()
        self.q.push(t + lrn.step_dt, 5, "end", (m, inc, loss))
        return True

    def _on_end(self, payload) -> bool:
        """Learner m ended an inner step: its pushes go out, its next step is queued, and
        the global model is evaluated each ``eval_every`` steps per learner."""
        m, inc, loss = payload
        lrn, t = self.learners[m], self.t
        if inc != lrn.inc:
            return False
        lrn.steps += 1
        lrn.stepping = False
        self.times[m].compute_s += lrn.step_dt
        self.syncer.observe_step_s(lrn.step_dt)
        self.bar.update(1)
        for out in self.syncs[m].after_step(self.workers[m].tokens_per_step, t):
            self.send(m, out, t)
        done_steps = sum(x.steps for x in self.learners)
        self.q.push(t, 9, "start", (m, inc))
        if done_steps >= self.eval_next * self.M:
            self.eval_next += self.cfg.optim.eval_every
            self.evaluate_global(done_steps)
        return True

    def _on_arrive(self, payload) -> bool:
        """A push reaches the syncer."""
        m, c = payload
        syncer, stats, t = self.syncer, self.stats, self.t
        res = syncer.submit(c, t)
        accepted = res.status is Status.ACCEPTED
        if accepted:
            stats["staleness"].append(syncer.version(c.fragment) - c.base_version)
        elif res.status is not Status.DUPLICATE:
            stats["rejected"][res.status.value] = stats["rejected"].get(res.status.value, 0) + 1
        self.syncs[m].on_push_result(c.fragment, c.seq, accepted, res.target_version)
        if res.merged is not None:
            self.broadcast(res.merged, t)
        elif res.wake_at_s is not None:
            self.q.push(res.wake_at_s, 3, "timer", c.fragment)
        for p, d in syncer.take_followups():  # rounds a finishing learner unblocked
            if isinstance(d, Merged):
                self.broadcast(d, t)
            else:
                self.q.push(d.at_s, 3, "timer", p)
        return True

    def _on_timer(self, payload) -> bool:
        """A fragment's grace window ends."""
        d = self.syncer.on_timer(payload, self.t)
        if isinstance(d, Merged):
            self.broadcast(d, self.t)
        elif isinstance(d, WaitUntil):
            self.q.push(d.at_s, 3, "timer", payload)
        return True

    def _on_receive(self, payload) -> bool:
        """A merged fragment reaches learner m."""
        m, inc, p, version, params = payload
        if self.learners[m].alive and inc == self.learners[m].inc:
            self.syncs[m].receive(p, version, params)
            if self.up.delta and not self.world.down_codec.lossless:
                d = self.held[m].setdefault(p, {})
                d[version] = params
                for v in sorted(d)[:-2]:  # as the runtime learner keeps them
                    del d[v]
        return True

    def _on_leave(self, payload) -> bool:
        """Learner m leaves the syncer (finished, or down): the rounds it held up merge."""
        m, inc = payload
        if inc == self.learners[m].inc:
            for mg in self.syncer.leave(m, self.t):
                self.broadcast(mg, self.t)
        return True

    def _on_fail(self, payload) -> bool:
        """Learner m fails: its step in progress is lost, and it leaves and later rejoins."""
        m, inc = payload
        lrn, t, downtime_s = self.learners[m], self.t, self.cfg.world.downtime_s
        if inc != lrn.inc or not lrn.alive or lrn.finished:
            return False
        lrn.alive = False
        lrn.inc += 1
        lrn.failures += 1
        lrn.down_since_s = t
        if lrn.stepping:  # the interrupted step is lost and returns to the budget
            self.times[m].lost_s += t - lrn.step_started_s
            self.started -= 1
            lrn.stepping = False
        self.syncs[m].fail()
        if self.n_up == 1:
            self.up_since = t
        self.n_up -= 1
        self.q.push(
            t + min(downtime_s, self.world.transfer_s(self.model_bytes_down)),
            2,
            "leave",
            (m, lrn.inc),
        )
        self.q.push(t + downtime_s, 4, "rejoin", (m, lrn.inc))
        self.rec.row("failure", t_s=round(t, 4), learner=m, step=lrn.steps)
        return True

    def _on_rejoin(self, payload) -> bool:
        """Learner m is back: it fetches the whole model and steps again (or, with the step
        budget spent while it was down, is done)."""
        m, inc = payload
        lrn, t, times = self.learners[m], self.t, self.times[m]
        if self.started >= self.M * self.N:  # the budget was spent while it was down
            lrn.finished = True
            times.down_s += t - lrn.down_since_s
            return False
        fetch_s = self.world.transfer_s(self.model_bytes_down)
        self.stats["bytes_down"] += self.model_bytes_down
        self.syncer.join(m)
        self.syncs[m].load_global(self.whole(), self.syncer.versions(), t + fetch_s)
        self.exact(m)
        lrn.alive = True
        times.down_s += t + fetch_s - lrn.down_since_s
        if self.n_up == 0:
            self.zero_up_s += t - self.up_since
        self.n_up += 1
        lrn.next_fail_s = self.world.next_failure_s(m, t + fetch_s)
        self.q.push(t + fetch_s, 9, "start", (m, inc))
        self.q.push(lrn.next_fail_s, 0, "fail", (m, inc))
        self.rec.row(
            "rejoin",
            t_s=round(t + fetch_s, 4),
            learner=m,
            step=lrn.steps,
            versions=sum(self.syncer.versions()),
        )
        return True

    # -- what the handlers share ----------------------------------------------------------
    def whole(self) -> dict[str, torch.Tensor]:
        """What a learner that fetches the whole model receives: the published global model,
        or with a delta-coded downlink the chains' copies (sent in fp32)."""
        if not self.chains:
            return self.syncer.global_params()
        return {
            n: t
            for p, f in enumerate(self.frag.fragments)
            for n, t in zip(f.names, self.chains[p].reference())
        }

    def exact(self, m: int) -> None:
        """Learner m loaded the whole model (a start or a rejoin)."""
        self.held[m].clear()

    def finish(self, m: int, now: float) -> None:
        """Learner m is done: it flushes its last pushes and leaves."""
        lrn = self.learners[m]
        lrn.finished = True
        outs = self.syncs[m].flush()
        finals = tuple(sorted(o.fragment for o in outs))
        for out in outs:
            self.send(m, out, now, finals)
        self.q.push(now + self.world.transfer_s(self.model_bytes_down), 2, "leave", (m, lrn.inc))
        self.n_up -= 1
        if self.n_up == 0:
            self.up_since = now

    def send(
        self, m: int, out: Outgoing, now: float, finals: tuple[int, ...] | None = None
    ) -> None:
        """Learner m pushes a fragment; ``finals``: a finishing learner's last pushes (the
        fragments it sends)."""
        up, syncer = self.up, self.syncer
        # the bytes the runtime learner sends (encode_push): a ``delta`` codec's push is the
        # difference from the copy the learner installed, which the syncer adds to its own
        # version of it (while it holds that version; otherwise the parameters go)
        mine = None
        if up.delta and syncer.holds(out.fragment, out.base_version):
            mine = self.held[m].get(out.fragment, {}).get(out.base_version)
            if mine is None:  # a lossless downlink: the learner holds the published version
                mine = syncer.published(out.fragment, out.base_version)
        data, delta = encode_push(up, out.params, mine)
        params = EncodedParams(up, bytearray(data), [x.shape for x in out.params], delta=delta)
        nbytes = len(data)
        self.stats["bytes_up"] += nbytes
        self.stats["pushes"] += 1
        self.q.push(
            now + self.world.transfer_s(nbytes),
            1,
            "arrive",
            (
                m,
                Contribution(
                    learner=m,
                    fragment=out.fragment,
                    params=params,
                    c_steps=out.c_steps,
                    c_tokens=out.c_tokens,
                    base_version=out.base_version,
                    seq=out.seq,
                    final=finals is not None,
                    final_fragments=finals or (),
                ),
            ),
        )

    def broadcast(self, mg: Merged, now: float) -> None:
        """A merge completed: its learners' pushes are marked merged, and the new version of
        the fragment goes to every live learner (through the downlink codec)."""
        world, chains = self.world, self.chains
        for mm, seq in zip(mg.learners, mg.seqs):
            self.syncs[mm].mark_merged(mg.fragment, seq)
        if chains:  # the encoded step of the fragment's chain: every learner's copy moves
            # to the chain's R (a runtime learner adds the step to its own copy instead: the
            # two differ by the rounding of the chain's int8 residual, see downlink)
            chains[mg.fragment].advance(mg.version, mg.params)
            params = chains[mg.fragment].reference()
        elif world.down_codec.lossless:
            params = mg.params
        else:
            params = [world.down_codec.roundtrip(x) for x in mg.params]
        nbytes = world.down_codec.nbytes(sum(x.numel() for x in params))
        done = now + self.cfg.world.merge_time_s
        self.syncer.observe_sync_s(self.cfg.world.merge_time_s + world.transfer_s(nbytes))
        for m in range(self.M):
            lrn = self.learners[m]
            if lrn.alive and not lrn.finished:
                mine = params
                self.stats["bytes_down"] += nbytes
                self.q.push(
                    done + world.transfer_s(nbytes),
                    2,
                    "receive",
                    (m, lrn.inc, mg.fragment, mg.version, mine),
                )
        self.rec.row(
            "merge",
            t_s=round(now, 4),
            fragment=mg.fragment,
            version=mg.version,
            learners=list(mg.learners),
            reason=mg.reason,
        )

    def evaluate_global(self, done_steps: int) -> None:
        """Evaluate the global model (``done_steps``: the learners' inner steps so far)."""
        ctx, syncer, t = self.ctx, self.syncer, self.t
        ctx.load_global(syncer.global_params())
        ev = evaluate(ctx.global_model, ctx.evals)
        self.rec.row(
            "eval",
            t_s=round(t, 4),
            step=done_steps / self.M,
            eval_loss=ev,
            gap=None if ctx.floor is None else ev - ctx.floor,
            versions=sum(syncer.versions()),
        )
        self.bar.set_postfix(eval=f"{ev:.3f}")

    # -- the figures ----------------------------------------------------------------------
    def _settle_times(self, m: int, end_s: float) -> float:
        """Learner m's time breakdown at the end of the run: only the compute whose work
        was merged counts as useful, the rest as lost; the remainder up to ``end_s`` is
        waiting. Returns the useful seconds."""
        led, times = self.syncs[m].ledger, self.times[m]
        frac = led.merged / led.computed if led.computed else 0.0
        useful = times.compute_s * frac
        times.lost_s += times.compute_s - useful
        times.compute_s = useful
        times.wait_s = max(0.0, end_s - useful - times.lost_s - times.down_s)
        return useful

    def _learner_figures(self, m: int) -> dict:
        """Learner m's row of ``per_learner``: steps, failures, step ledger, install delay,
        the syncer's token ledger and the time breakdown."""
        led = self.syncs[m].ledger
        return {
            "learner": m,
            "steps": self.learners[m].steps,
            "failures": self.learners[m].failures,
            "ledger_steps": {
                k: round(getattr(led, k), 4)
                for k in (
                    "computed",
                    "merged",
                    "dropped",
                    "overwritten",
                    "lost",
                    "pending",
                    "unpushed",
                )
            },
            "ledger_balance_error": led.balance_error(),
            "install_delay_steps": round(self.syncs[m].mean_install_delay_steps, 3),
            "syncer_tokens": {
                k: round(getattr(self.syncer.ledger[m], k), 3)
                for k in ("tokens_merged", "tokens_dropped", "tokens_pending")
            },
            "time": self.times[m].as_dict(),
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0
