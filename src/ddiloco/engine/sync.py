"""The synchronous baselines on the virtual clock: local (one learner alone), DP
(gradients averaged every step), DiLoCo (whole model every H steps) and Streaming DiLoCo
(fragments every H steps, tau overlap, alpha mixing). All learners advance in lockstep;
a failure stalls everyone until the failed learner is back."""

from __future__ import annotations

import torch
from tqdm import tqdm

from ddiloco.algorithm.merge import (
    alpha_mix,
    merge_outer_gradients,
    token_weight,
    weighted_average,
)
from ddiloco.algorithm.schedule import FragmentSchedule
from ddiloco.config import TrainConfig
from ddiloco.engine.common import TimeBreakdown, World, build_workers
from ddiloco.models import embedding_param_names
from ddiloco.recipe import autocast, evaluate, fragmentation_for, new_optimizer, set_lr

__all__ = ["run_local", "run_dp", "run_diloco", "run_streaming"]


class _Clock:
    """Lockstep virtual time with per-learner failure clocks."""

    def __init__(self, cfg: TrainConfig, world: World, M: int) -> None:  # noqa: N803
        self.cfg, self.world, self.M = cfg, world, M
        self.t = 0.0
        self.next_fail = [world.next_failure_s(m, 0.0) for m in range(M)]
        self.times = [TimeBreakdown() for _ in range(M)]
        self.stall_s = 0.0
        self.failures = 0

    def phase(self, durations: list[float], comm_s: float = 0.0) -> float:
        """Advance through a phase where learner m computes ``durations[m]`` and then all
        wait for the slowest and for ``comm_s`` of communication. A failure inside the phase
        aborts it: everyone's work in it is lost, all wait for the learner to return, and
        the phase is redone. Returns the phase's start time."""
        while True:
            span = max(durations) + comm_s
            fails = [
                (self.next_fail[m], m) for m in range(self.M) if self.next_fail[m] < self.t + span
            ]
            if not fails:
                for m, d in enumerate(durations):
                    self.times[m].compute_s += d
                    self.times[m].wait_s += span - d
                start = self.t
                self.t += span
                return start
            tf, m = min(fails)
            for k, d in enumerate(durations):
                self.times[k].lost_s += min(d, tf - self.t)
                self.times[k].wait_s += max(0.0, tf - self.t - d)
            back = tf + self.cfg.world.downtime_s + self.world.transfer_s(0)
            for k in range(self.M):
                if k == m:
                    self.times[k].down_s += back - tf
                else:
                    self.times[k].wait_s += back - tf
            self.stall_s += back - tf
            self.failures += 1
            self.t = back
            for k in range(self.M):
                if k == m or self.next_fail[k] < self.t:
                    self.next_fail[k] = self.world.next_failure_s(k, self.t)

    def result(self) -> dict:
        T = self.t  # noqa: N806
        useful = sum(x.compute_s for x in self.times)
        available = self.M * T - sum(x.down_s for x in self.times)
        return {
            "end_s": T,
            "goodput": useful / (self.M * T) if T else 0.0,
            "goodput_available": useful / available if available > 0 else 0.0,
            "uptime": 1.0 - self.stall_s / T if T else 0.0,
            "failures": self.failures,
            "per_learner": [{"learner": m, "time": x.as_dict()} for m, x in enumerate(self.times)],
        }


def _model_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _ring_bytes(M: int, nbytes: int) -> int:  # noqa: N803
    """Bytes each replica sends in a ring all-reduce of ``nbytes``."""
    return 0 if M == 1 else int(2 * (M - 1) / M * nbytes)


def _maybe_eval(ctx, rec_step: int, cfg: TrainConfig, t: float, bar, params=None) -> None:
    if rec_step % cfg.optim.eval_every == 0:
        if params is not None:
            ctx.load_global(params)
        ev = evaluate(ctx.global_model, ctx.evals)
        ctx.recorder.row(
            "eval",
            t_s=round(t, 4),
            step=rec_step,
            eval_loss=ev,
            gap=None if ctx.floor is None else ev - ctx.floor,
        )
        bar.set_postfix(eval=f"{ev:.3f}")


def run_local(cfg: TrainConfig, ctx) -> dict:
    """One learner alone (learner 0's data), no synchronisation: the reference."""
    one = cfg.replace(learners=1, speeds=cfg.world.speeds[:1], quorum=1)
    world = World(one)
    w = build_workers(one, ctx.data, ctx.global_model.state_dict())[0]
    clock = _Clock(one, world, 1)
    bar = tqdm(total=cfg.steps, desc="local", disable=not cfg.progress, leave=False)
    for k in range(1, cfg.steps + 1):
        clock.phase([world.step_s(0)])
        w.train_step()
        bar.update(1)
        _maybe_eval(ctx, k, cfg, clock.t, bar, dict(w.params))
    bar.close()
    ctx.load_global(dict(w.params))
    return {**clock.result(), "bytes_up": 0, "bytes_down": 0, "merges": 0, "learners": 1}


def run_dp(cfg: TrainConfig, ctx) -> dict:
    """Data-parallel: every step, each learner's gradient on its own batch, averaged."""
    M = cfg.learners  # noqa: N806
    world = World(cfg)
    model = ctx.global_model
    opt = new_optimizer(cfg, model)
    streams = [w.stream for w in build_workers(cfg, ctx.data, model.state_dict())]
    grad_bytes = _ring_bytes(M, world.up_codec.nbytes(_model_numel(model)))
    clock = _Clock(cfg, world, M)
    bar = tqdm(total=cfg.steps, desc=f"dp M={M}", disable=not cfg.progress, leave=False)
    for k in range(1, cfg.steps + 1):
        clock.phase([world.step_s(m) for m in range(M)], world.transfer_s(grad_bytes))
        opt.zero_grad(set_to_none=True)
        for s in streams:
            x, y = s.next_batch()
            with autocast(cfg):
                _, loss = model(x, y)
            (loss / M).backward()
        set_lr(opt, cfg.lr_at(k - 1))
        opt.step()
        bar.update(1)
        _maybe_eval(ctx, k, cfg, clock.t, bar)
    bar.close()
    total = grad_bytes * M * cfg.steps
    return {**clock.result(), "bytes_up": total, "bytes_down": total, "merges": cfg.steps}


def _outer_step(global_params, names, embedding, workers, sync, momentum, rule, tokens, final=None):
    """Merge every learner's fragment ``names`` into the global parameters (equal steps),
    with the outer optimizer of ``sync`` (the run's ``SyncerConfig``, as the decoupled
    syncer's). ``final``: the run's last, partial round, merged as ``sync.final_merge``
    says (the learners' average, a regular or a momentum-free outer step, or left out), as
    the decoupled syncer merges its learners' final pushes."""
    if final == "none":
        return
    if final == "average":
        with torch.no_grad():
            for n in names:
                global_params[n].copy_(
                    weighted_average([w.params[n].detach() for w in workers], [1.0] * len(workers))
                )
        return
    deltas = [[global_params[n] - w.params[n].detach() for n in names] for w in workers]
    weights = [token_weight(tokens, 1)] * len(workers)
    update = merge_outer_gradients(deltas, weights, embedding, rule)
    outer = sync.outer_optimizer(final)
    outer.step([global_params[n] for n in names], update, [momentum[n] for n in names])


def run_diloco(cfg: TrainConfig, ctx) -> dict:
    """DiLoCo: every H inner steps all learners merge the whole model (synchronous)."""
    M = cfg.learners  # noqa: N806
    world = World(cfg)
    workers = build_workers(cfg, ctx.data, ctx.global_model.state_dict())
    names = [n for n, _ in ctx.global_model.named_parameters()]
    emb = embedding_param_names(ctx.global_model)
    embedding = [n in emb for n in names]
    glob = {n: p.detach().clone().float() for n, p in ctx.global_model.named_parameters()}
    momentum = {n: torch.zeros_like(t) for n, t in glob.items()}
    sync = cfg.sync.syncer_config()
    numel = _model_numel(ctx.global_model)
    sync_bytes = _ring_bytes(M, world.up_codec.nbytes(numel))
    clock = _Clock(cfg, world, M)
    bar = tqdm(total=cfg.steps, desc=f"diloco M={M}", disable=not cfg.progress, leave=False)
    done = merges = 0
    while done < cfg.steps:
        h = min(cfg.sync.H, cfg.steps - done)
        clock.phase(
            [sum(world.step_s(m) for _ in range(h)) for m in range(M)], world.transfer_s(sync_bytes)
        )
        for _ in range(h):
            for w in workers:
                w.train_step()
            bar.update(1)
        # an eval step inside this round sees the global model of the last merge; one at
        # the round's end sees this merge (the row is the model at the step it names)
        e = (done + h) // cfg.optim.eval_every * cfg.optim.eval_every
        eval_at = e if done < e < cfg.steps else None
        if eval_at is not None and eval_at < done + h:
            _maybe_eval(ctx, eval_at, cfg, clock.t, bar, glob)
        _outer_step(
            glob,
            names,
            embedding,
            workers,
            sync,
            momentum,
            cfg.sync.merge_rule,
            workers[0].tokens_per_step,
            # the last round is final only when it is partial (fewer than H steps): a whole
            # round is a regular one, as for a decoupled learner, which then has no
            # progress left to flush
            final=cfg.sync.final_merge if h < cfg.sync.H else None,
        )
        merges += 1
        if eval_at is not None and eval_at == done + h:
            _maybe_eval(ctx, eval_at, cfg, clock.t, bar, glob)
        done += h
        with torch.no_grad():
            for w in workers:
                for n in names:
                    w.params[n].copy_(glob[n])
    bar.close()
    ctx.load_global(glob)
    _final_eval_row(ctx, cfg, clock.t)
    total = sync_bytes * M * merges
    return {**clock.result(), "bytes_up": total, "bytes_down": total, "merges": merges}


def run_streaming(cfg: TrainConfig, ctx) -> dict:
    """Streaming DiLoCo: fragment p merged every H steps on its staggered schedule by all
    learners; the result is installed tau steps later with alpha mixing."""
    M = cfg.learners  # noqa: N806
    world = World(cfg)
    workers = build_workers(cfg, ctx.data, ctx.global_model.state_dict())
    frag = fragmentation_for(cfg, ctx.global_model)
    sched = FragmentSchedule(P=frag.P, H=cfg.sync.H, tau=cfg.sync.tau)
    glob = {n: p.detach().clone().float() for n, p in ctx.global_model.named_parameters()}
    momentum = {n: torch.zeros_like(t) for n, t in glob.items()}
    sync = cfg.sync.syncer_config()
    clock = _Clock(cfg, world, M)
    installs: dict[int, list[tuple[int, dict]]] = {}
    since = [0] * frag.P  # steps since fragment p was last merged
    bytes_total = merges = 0
    bar = tqdm(total=cfg.steps, desc=f"streaming M={M}", disable=not cfg.progress, leave=False)

    def merge(p: int, k: int) -> None:
        nonlocal bytes_total, merges
        f = frag.fragments[p]
        _outer_step(
            glob,
            f.names,
            f.embedding,
            workers,
            sync,
            momentum,
            cfg.sync.merge_rule,
            workers[0].tokens_per_step * max(1, since[p]),
            final=cfg.sync.final_merge if p in flushed else None,
        )
        since[p] = 0
        installs.setdefault(k + cfg.sync.tau, []).append((p, {n: glob[n].clone() for n in f.names}))
        bytes_total += _ring_bytes(M, world.up_codec.nbytes(f.numel)) * M
        merges += 1

    for k in range(1, cfg.steps + 1):
        sends = sched.fragments_to_send(k) if k < cfg.steps else tuple(range(frag.P))
        # at the last step, the fragments off their schedule are flushed: a final round
        flushed = set(sends) - set(sched.fragments_to_send(k)) if k == cfg.steps else set()
        comm = max(
            (
                world.transfer_s(_ring_bytes(M, world.up_codec.nbytes(frag.fragments[p].numel)))
                for p in sends
            ),
            default=0.0,
        )
        step = max(world.step_s(m) for m in range(M))
        # the fragment's all-reduce is hidden behind tau steps; only the excess stalls
        clock.phase([step] * M, max(0.0, comm - cfg.sync.tau * step) if cfg.sync.tau else comm)
        for w in workers:
            w.train_step()
        since = [s + 1 for s in since]
        bar.update(1)
        for p in sends:
            merge(p, k)
        due = installs.pop(k, []) if k < cfg.steps else [x for v in installs.values() for x in v]
        with torch.no_grad():
            for _p, values in due:
                for w in workers:
                    for n, v in values.items():
                        alpha_mix(w.params[n], v, cfg.sync.alpha)
        if k % cfg.optim.eval_every == 0 and k < cfg.steps:
            _maybe_eval(ctx, k, cfg, clock.t, bar, glob)
    bar.close()
    ctx.load_global(glob)
    _final_eval_row(ctx, cfg, clock.t)
    return {
        **clock.result(),
        "bytes_up": bytes_total,
        "bytes_down": bytes_total,
        "merges": merges,
        "fragments": frag.P,
    }


def _final_eval_row(ctx, cfg: TrainConfig, t: float) -> None:
    ev = evaluate(ctx.global_model, ctx.evals)
    ctx.recorder.row(
        "eval",
        t_s=round(t, 4),
        step=cfg.steps,
        eval_loss=ev,
        gap=None if ctx.floor is None else ev - ctx.floor,
    )
