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
    """Run Decoupled DiLoCo; ``ctx`` carries the language, eval set, global model and recorder."""
    rec: Recorder = ctx.recorder
    world = World(cfg)
    up = world.up_codec
    frag = fragmentation_for(cfg, ctx.global_model)
    sched = FragmentSchedule(P=frag.P, H=cfg.sync.H, tau=cfg.sync.tau)
    init = {n: p.detach().clone() for n, p in ctx.global_model.named_parameters()}
    syncer = SyncerState(frag, init, syncer_config(cfg))
    workers = build_workers(cfg, ctx.data, ctx.global_model.state_dict())
    slot_s = cfg.world.step_time_s if cfg.sync.schedule == "time" else None
    syncs = [
        LearnerSync(
            w.params, frag, sched, alpha=cfg.sync.alpha, install=cfg.sync.install, slot_s=slot_s
        )
        for w in workers
    ]
    L = [_Learner() for _ in workers]
    times = [TimeBreakdown() for _ in workers]
    n_params = sum(f.numel for f in frag.fragments)
    # a whole-model fetch (a rejoin); delta-coded downlinks send it in fp32
    model_bytes_down = 4 * n_params if cfg.sync.down_delta else world.down_codec.nbytes(n_params)
    # what each learner received of each fragment, by version: a push of a ``delta`` codec is
    # a delta against the copy the learner installed (through the downlink codec), as in the
    # runtime
    held: list[dict[int, dict[int, list[torch.Tensor]]]] = [{} for _ in range(cfg.learners)]
    # sync.down_delta: one reference chain per fragment, the copy every learner holds
    # (ddiloco.algorithm.downlink, as the runtime syncer keeps it)
    chains = (
        {
            p: DeltaChain(world.down_codec, [init[n] for n in f.names], 0)
            for p, f in enumerate(frag.fragments)
        }
        if cfg.sync.down_delta
        else {}
    )

    def whole() -> dict[str, torch.Tensor]:
        """What a learner that fetches the whole model receives: the published global model,
        or with a delta-coded downlink the chains' copies (sent in fp32)."""
        if not chains:
            return syncer.global_params()
        return {
            n: t
            for p, f in enumerate(frag.fragments)
            for n, t in zip(f.names, chains[p].reference())
        }

    def exact(m: int) -> None:
        """Learner m loaded the whole model (a start or a rejoin)."""
        held[m].clear()

    q = EventKernel()
    stats = {"bytes_up": 0, "bytes_down": 0, "pushes": 0, "rejected": {}, "staleness": []}
    M, N = cfg.learners, cfg.steps

    for m in range(M):
        syncer.join(m)
        syncs[m].load_global(whole(), syncer.versions())
        exact(m)
        L[m].next_fail_s = world.next_failure_s(m, 0.0)
        q.push(0.0, 9, "start", (m, 0))
        if L[m].next_fail_s < math.inf:
            q.push(L[m].next_fail_s, 0, "fail", (m, 0))

    up_since = 0.0
    n_up = M
    started = 0  # inner steps started and not lost to a failure (the global budget is M * N)
    zero_up_s = 0.0
    eval_next = cfg.optim.eval_every
    t = 0.0
    bar = tqdm(
        total=M * N, desc=f"decoupled M={M}", disable=not cfg.progress, unit="step", leave=False
    )

    def finish(m: int, now: float) -> None:
        nonlocal n_up, up_since
        L[m].finished = True
        outs = syncs[m].flush()
        finals = tuple(sorted(o.fragment for o in outs))
        for out in outs:
            send(m, out, now, finals)
        q.push(now + world.transfer_s(model_bytes_down), 2, "leave", (m, L[m].inc))
        n_up -= 1
        if n_up == 0:
            up_since = now

    def send(m: int, out: Outgoing, now: float, finals: tuple[int, ...] | None = None) -> None:
        """``finals``: a finishing learner's last pushes (the fragments it sends)."""
        # the bytes the runtime learner sends (encode_push): a ``delta`` codec's push is the
        # difference from the copy the learner installed, which the syncer adds to its own
        # version of it (while it holds that version; otherwise the parameters go)
        mine = None
        if up.delta and syncer.holds(out.fragment, out.base_version):
            mine = held[m].get(out.fragment, {}).get(out.base_version)
            if mine is None:  # a lossless downlink: the learner holds the published version
                mine = syncer.published(out.fragment, out.base_version)
        data, delta = encode_push(up, out.params, mine)
        params = EncodedParams(up, bytearray(data), [x.shape for x in out.params], delta=delta)
        nbytes = len(data)
        stats["bytes_up"] += nbytes
        stats["pushes"] += 1
        q.push(
            now + world.transfer_s(nbytes),
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

    def broadcast(mg: Merged, now: float) -> None:
        for mm, seq in zip(mg.learners, mg.seqs):
            syncs[mm].mark_merged(mg.fragment, seq)
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
        done = now + cfg.world.merge_time_s
        syncer.observe_sync_s(cfg.world.merge_time_s + world.transfer_s(nbytes))
        for m in range(M):
            if L[m].alive and not L[m].finished:
                mine = params
                stats["bytes_down"] += nbytes
                q.push(
                    done + world.transfer_s(nbytes),
                    2,
                    "receive",
                    (m, L[m].inc, mg.fragment, mg.version, mine),
                )
        rec.row(
            "merge",
            t_s=round(now, 4),
            fragment=mg.fragment,
            version=mg.version,
            learners=list(mg.learners),
            reason=mg.reason,
        )

    while q:
        t_ev, kind, payload = q.pop()
        if (
            kind in ("start", "end", "fail", "rejoin", "leave", "receive")
            and payload[1] != L[payload[0]].inc
        ):
            continue  # an event of a dead incarnation
        if kind == "fail" and (not L[payload[0]].alive or L[payload[0]].finished):
            continue
        t = t_ev
        if kind == "start":
            m, inc = payload
            if not L[m].alive or inc != L[m].inc:
                continue
            if started >= M * N:  # the global budget of inner steps is spent
                finish(m, t)
                continue
            started += 1
            L[m].stepping = True
            syncs[m].install_due()
            L[m].step_dt = world.step_s(m)
            L[m].step_started_s = t
            loss = workers[m].train_step()
            q.push(t + L[m].step_dt, 5, "end", (m, inc, loss))
        elif kind == "end":
            m, inc, loss = payload
            if inc != L[m].inc:
                continue
            L[m].steps += 1
            L[m].stepping = False
            times[m].compute_s += L[m].step_dt
            syncer.observe_step_s(L[m].step_dt)
            bar.update(1)
            for out in syncs[m].after_step(workers[m].tokens_per_step, t):
                send(m, out, t)
            done_steps = sum(x.steps for x in L)
            q.push(t, 9, "start", (m, inc))
            if done_steps >= eval_next * M:
                eval_next += cfg.optim.eval_every
                ctx.load_global(syncer.global_params())
                ev = evaluate(ctx.global_model, ctx.evals)
                rec.row(
                    "eval",
                    t_s=round(t, 4),
                    step=done_steps / M,
                    eval_loss=ev,
                    gap=None if ctx.floor is None else ev - ctx.floor,
                    versions=sum(syncer.versions()),
                )
                bar.set_postfix(eval=f"{ev:.3f}")
        elif kind == "arrive":
            m, c = payload
            res = syncer.submit(c, t)
            accepted = res.status is Status.ACCEPTED
            if accepted:
                stats["staleness"].append(syncer.version(c.fragment) - c.base_version)
            elif res.status is not Status.DUPLICATE:
                stats["rejected"][res.status.value] = stats["rejected"].get(res.status.value, 0) + 1
            syncs[m].on_push_result(c.fragment, c.seq, accepted, res.target_version)
            if res.merged is not None:
                broadcast(res.merged, t)
            elif res.wake_at_s is not None:
                q.push(res.wake_at_s, 3, "timer", c.fragment)
            for p, d in syncer.take_followups():  # rounds a finishing learner unblocked
                if isinstance(d, Merged):
                    broadcast(d, t)
                else:
                    q.push(d.at_s, 3, "timer", p)
        elif kind == "timer":
            d = syncer.on_timer(payload, t)
            if isinstance(d, Merged):
                broadcast(d, t)
            elif isinstance(d, WaitUntil):
                q.push(d.at_s, 3, "timer", payload)
        elif kind == "receive":
            m, inc, p, version, params = payload
            if L[m].alive and inc == L[m].inc:
                syncs[m].receive(p, version, params)
                if up.delta and not world.down_codec.lossless:
                    d = held[m].setdefault(p, {})
                    d[version] = params
                    for v in sorted(d)[:-2]:  # as the runtime learner keeps them
                        del d[v]
        elif kind == "leave":
            m, inc = payload
            if inc == L[m].inc:
                for mg in syncer.leave(m, t):
                    broadcast(mg, t)
        elif kind == "fail":
            m, inc = payload
            if inc != L[m].inc or not L[m].alive or L[m].finished:
                continue
            L[m].alive = False
            L[m].inc += 1
            L[m].failures += 1
            L[m].down_since_s = t
            if L[m].stepping:  # the interrupted step is lost and returns to the budget
                times[m].lost_s += t - L[m].step_started_s
                started -= 1
                L[m].stepping = False
            syncs[m].fail()
            if n_up == 1:
                up_since = t
            n_up -= 1
            q.push(
                t + min(cfg.world.downtime_s, world.transfer_s(model_bytes_down)),
                2,
                "leave",
                (m, L[m].inc),
            )
            q.push(t + cfg.world.downtime_s, 4, "rejoin", (m, L[m].inc))
            rec.row("failure", t_s=round(t, 4), learner=m, step=L[m].steps)
        elif kind == "rejoin":
            m, inc = payload
            if started >= M * N:  # the budget was spent while it was down
                L[m].finished = True
                times[m].down_s += t - L[m].down_since_s
                continue
            fetch_s = world.transfer_s(model_bytes_down)
            stats["bytes_down"] += model_bytes_down
            syncer.join(m)
            syncs[m].load_global(whole(), syncer.versions(), t + fetch_s)
            exact(m)
            L[m].alive = True
            times[m].down_s += t + fetch_s - L[m].down_since_s
            if n_up == 0:
                zero_up_s += t - up_since
            n_up += 1
            L[m].next_fail_s = world.next_failure_s(m, t + fetch_s)
            q.push(t + fetch_s, 9, "start", (m, inc))
            q.push(L[m].next_fail_s, 0, "fail", (m, inc))
            rec.row(
                "rejoin",
                t_s=round(t + fetch_s, 4),
                learner=m,
                step=L[m].steps,
                versions=sum(syncer.versions()),
            )
        if not q:
            for mg in syncer.flush(t):
                broadcast(mg, t)
    bar.close()
    end_s = t
    # the tail after the last learner finished is merge time, not downtime
    ctx.load_global(syncer.global_params())
    per_learner = []
    useful_s = 0.0
    for m in range(M):
        led = syncs[m].ledger
        frac = led.merged / led.computed if led.computed else 0.0
        useful = times[m].compute_s * frac
        times[m].lost_s += times[m].compute_s - useful
        times[m].compute_s = useful
        times[m].wait_s = max(0.0, end_s - useful - times[m].lost_s - times[m].down_s)
        useful_s += useful
        per_learner.append(
            {
                "learner": m,
                "steps": L[m].steps,
                "failures": L[m].failures,
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
                "install_delay_steps": round(syncs[m].mean_install_delay_steps, 3),
                "syncer_tokens": {
                    k: round(getattr(syncer.ledger[m], k), 3)
                    for k in ("tokens_merged", "tokens_dropped", "tokens_pending")
                },
                "time": times[m].as_dict(),
            }
        )
    tokens_merged = round(sum(syncer.ledger[m].tokens_merged for m in range(M)))
    return {
        "end_s": end_s,
        "goodput": useful_s / (M * end_s) if end_s > 0 else 0.0,
        "goodput_available": _ratio(useful_s, M * end_s - sum(x.down_s for x in times)),
        "uptime": 1.0 - zero_up_s / end_s if end_s > 0 else 0.0,
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
        "install": cfg.sync.install,
        "install_delay_steps": round(
            _ratio(sum(x.install_delay_steps for x in syncs), sum(x.installs for x in syncs)), 3
        ),
        "failures": sum(x.failures for x in L),
        "clipped_pushes": syncer.clipped_pushes,
        "carried_pushes": syncer.carried_pushes,
        "fragments": frag.P,
        "per_learner": per_learner,
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0
