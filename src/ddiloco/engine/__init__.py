"""The in-process engine: M learners training real models in one process on a virtual
clock, deterministic for a seed. Every method (local, dp, diloco, streaming, decoupled)
runs here for side-by-side comparison at equal tokens.

``run(config) -> summary`` writes ``summary.json`` and ``metrics.jsonl`` into ``config.out``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ddiloco.config import CONFIG_FILE, TrainConfig, dump_config
from ddiloco.data import DataConfig
from ddiloco.engine.common import Recorder
from ddiloco.recipe import eval_setup, evaluate_metrics, new_model
from ddiloco.run_summary import RunSummary
from ddiloco.rundir import FINAL_MODEL, fresh_run_dir

__all__ = ["run", "RunContext"]


@dataclass(slots=True)
class RunContext:
    """What a method needs besides its config: data, eval set, the global model, output."""

    data: DataConfig
    evals: list
    floor: float | None
    global_model: torch.nn.Module
    recorder: Recorder

    def load_global(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.global_model.named_parameters():
                p.copy_(params[n])


def run(cfg: TrainConfig) -> dict:
    """Run ``cfg.method`` on the in-process engine and return the summary."""
    from ddiloco.engine.decoupled import run_decoupled
    from ddiloco.engine.sync import run_diloco, run_dp, run_local, run_streaming

    if cfg.engine == "processes":
        raise ValueError(
            "ddiloco.engine.run drives the inproc engine; use the launcher for engine='processes'"
        )
    cfg = cfg.replace(engine="inproc")
    torch.set_num_threads(1)
    data, lang, floor, evals = eval_setup(cfg)
    fresh_run_dir(cfg.out)  # nothing of an earlier run in OUT
    recorder = Recorder(cfg)
    dump_config(cfg, Path(cfg.out) / CONFIG_FILE)  # `ddiloco train --config` replays the run
    ctx = RunContext(
        data=data, evals=evals, floor=floor, global_model=new_model(cfg), recorder=recorder
    )
    recorder.row("config", **_jsonable(cfg.to_dict()))
    init_loss, _ = evaluate_metrics(ctx.global_model, evals)
    recorder.row("eval", t_s=0.0, step=0, eval_loss=init_loss, gap=_gap(init_loss, floor))
    runner = {
        "local": run_local,
        "dp": run_dp,
        "diloco": run_diloco,
        "streaming": run_streaming,
        "decoupled": run_decoupled,
    }[cfg.method]
    res = runner(cfg, ctx)
    final, accuracy = evaluate_metrics(ctx.global_model, evals)
    learners = res.pop("learners", cfg.learners)
    per_step = (
        cfg.data.batch_size if data.task == "image" else cfg.data.batch_size * cfg.data.block_size
    )
    tokens = learners * cfg.steps * per_step
    summary = RunSummary(
        method=cfg.method,
        engine=cfg.engine,
        learners=learners,
        steps=cfg.steps,
        tokens=tokens,
        final_eval_loss=final,
        initial_eval_loss=init_loss,
        entropy_floor=floor,
        entropy_rate=lang.entropy_rate if lang is not None else None,
        eval_accuracy=accuracy,
        data=cfg.data.source,
        model=cfg.model.name,
        goodput=res.pop("goodput"),
        uptime=res.pop("uptime"),
        bytes_up=res.pop("bytes_up"),
        bytes_down=res.pop("bytes_down"),
        merges=res.pop("merges"),
        learners_per_merge=res.pop("learners_per_merge", None),
        install=res.pop("install", None),
        per_learner=res.pop("per_learner", []),
        config=_jsonable(cfg.to_dict()),
        extra={
            "goodput_available": res.pop("goodput_available"),
            "virtual_time_s": res.pop("end_s"),
            **res,
        },
    )
    recorder.row("final", eval_loss=final, gap=_gap(final, floor), accuracy=accuracy)
    save_final_model(cfg, ctx.global_model, summary.merges or 0)
    return recorder.finish(summary)


def save_final_model(cfg: TrainConfig, model: torch.nn.Module, merges: int) -> Path:
    """The run's global model as ``RUN_DIR/final_model.safetensors`` (what ``ddiloco export
    RUN_DIR`` writes out; the real runtime keeps its syncer's checkpoint instead)."""
    from ddiloco.recipe import model_record
    from ddiloco.runtime.export import save_state_dict
    from ddiloco.runtime.transport.spec import model_spec

    sd = {n: p.detach().to(torch.float32).contiguous() for n, p in model.named_parameters()}
    spec = model_spec(model, cfg.sync.fragments, cfg.sync.fragmentation)
    meta = {"source": f"{cfg.out} (in-process engine)", "versions": [], "merges": merges}
    return save_state_dict(
        sd, Path(cfg.out) / FINAL_MODEL, {**meta, "spec": spec, "model": model_record(cfg)}
    )


def _gap(loss: float, floor: float | None) -> float | None:
    return None if floor is None else loss - floor


def _jsonable(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
