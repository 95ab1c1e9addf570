"""What every in-process method shares besides the recipe (``ddiloco.recipe``): the
learners as workers, the simulated world (step times, failures, links), the event queue
and the run record."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.config import TrainConfig
from ddiloco.data import DataConfig, build_stream
from ddiloco.data.synthetic import SyntheticStream
from ddiloco.metrics.sinks import open_sinks, parse_sinks
from ddiloco.recipe import autocast, new_model, new_optimizer, set_lr, tokens_per_step
from ddiloco.run_summary import RunSummary

__all__ = ["World", "Worker", "Recorder", "TimeBreakdown", "build_workers"]

_WORLD_DOMAIN = 7919  # keeps the world's random streams apart from the data's


@dataclass(slots=True)
class Worker:
    """One learner's model, inner optimizer and data stream."""

    index: int
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    stream: SyntheticStream
    params: dict[str, torch.Tensor]
    tokens_per_step: int
    cfg: TrainConfig
    steps: int = 0

    def train_step(self) -> float:
        x, y = self.stream.next_batch()
        self.opt.zero_grad(set_to_none=True)
        with autocast(self.cfg):
            _, loss = self.model(x, y)
        loss.backward()
        set_lr(self.opt, self.cfg.lr_at(self.steps))
        self.opt.step()
        self.steps += 1
        return float(loss.detach())


def build_workers(
    cfg: TrainConfig, data: DataConfig, init: dict[str, torch.Tensor]
) -> list[Worker]:
    workers = []
    tokens = tokens_per_step(cfg)
    for m in range(cfg.learners):
        model = new_model(cfg)
        model.load_state_dict(init)
        stream = build_stream(
            data,
            learner=m,
            n_learners=cfg.learners,
            batch_size=cfg.data.batch_size,
            block_size=cfg.data.block_size,
            seed=cfg.seed,
        )
        workers.append(
            Worker(
                m,
                model,
                new_optimizer(cfg, model),
                stream,
                dict(model.named_parameters()),
                tokens,
                cfg,
            )
        )
    return workers


class World:
    """Seeded step times, failure schedules and link costs (virtual seconds)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.step_rng = [
            np.random.default_rng([cfg.seed, _WORLD_DOMAIN, 1, m]) for m in range(cfg.learners)
        ]
        self.fail_rng = [
            np.random.default_rng([cfg.seed, _WORLD_DOMAIN, 2, m]) for m in range(cfg.learners)
        ]
        self.up_codec = get_codec(cfg.sync.codec)
        self.down_codec = get_codec(cfg.sync.down_codec)

    def step_s(self, m: int) -> float:
        base = self.cfg.world.step_time_s / self.cfg.speed(m)
        if self.cfg.world.step_noise > 0:
            return base * max(
                0.1, 1.0 + self.cfg.world.step_noise * float(self.step_rng[m].standard_normal())
            )
        return base

    def next_failure_s(self, m: int, now_s: float) -> float:
        """Time of learner m's next failure, given it is up at ``now_s`` (inf: never)."""
        if self.cfg.world.mtbi_s <= 0:
            return math.inf
        return now_s + float(self.fail_rng[m].exponential(self.cfg.world.mtbi_s))

    def transfer_s(self, nbytes: int) -> float:
        bw = self.cfg.world.bandwidth_Bps
        return self.cfg.world.latency_s + (nbytes / bw if bw > 0 else 0.0)


class Recorder:
    """Metrics rows (``metrics.jsonl`` and the sinks of ``cfg.runtime.metrics_sinks``) and the
    final summary.json of a run."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sink = open_sinks(
            ("jsonl", *parse_sinks(cfg.runtime.metrics_sinks)), self.dir, name="engine", mode="w"
        )
        self.t0 = time.perf_counter()

    def row(self, kind: str, **fields) -> None:
        if kind == "eval":  # beside the virtual t_s: this process's own seconds so far
            fields.setdefault("wall_s", round(time.perf_counter() - self.t0, 2))
        self.sink.write({"kind": kind, **fields})

    def finish(self, summary: RunSummary) -> dict:
        """Close the sinks and write ``summary.json`` (with the run's wall time)."""
        summary.wall_s = round(time.perf_counter() - self.t0, 3)
        self.sink.close()
        return summary.write(self.dir)


@dataclass(slots=True)
class TimeBreakdown:
    """Per-learner time accounting (virtual seconds)."""

    compute_s: float = 0.0  # steps whose work reached the model
    lost_s: float = 0.0  # compute thrown away (failure, dropped push)
    wait_s: float = 0.0  # idle, waiting for peers or the network
    down_s: float = 0.0  # failed, restarting

    def as_dict(self) -> dict:
        return {k: round(getattr(self, k), 3) for k in ("compute_s", "lost_s", "wait_s", "down_s")}
