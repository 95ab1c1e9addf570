"""The in-process engine: M learners training real models in one process on a virtual
clock, deterministic for a seed. Every method (local, dp, diloco, streaming, decoupled)
runs here for side-by-side comparison at equal tokens.

``run(config) -> summary`` writes ``summary.json`` and ``metrics.jsonl`` into ``config.out``.
"""

from __future__ import annotations


from dataclasses import dataclass

import torch

from ddiloco.config import TrainConfig
from ddiloco.data.synthetic import eval_batches
from ddiloco.engine.common import Recorder, evaluate, make_language, new_model

__all__ = ["run", "RunContext"]


@dataclass(slots=True)
class RunContext:
    """What a method needs besides its config: data, eval set, the global model, output."""

    lang: object
    evals: list
    floor: float
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

    if cfg.engine != "inproc":
        raise ValueError("ddiloco.engine.run drives the inproc engine; use the launcher for "
                         "engine='processes'")
    torch.set_num_threads(1)
    lang = make_language(cfg)
    floor = lang.sequence_floor(cfg.block_size)
    evals = eval_batches(
        lang, n_batches=cfg.eval_batches, batch_size=cfg.batch_size, block_size=cfg.block_size,
        seed=cfg.seed)
    recorder = Recorder(cfg)
    ctx = RunContext(lang=lang, evals=evals, floor=floor, global_model=new_model(cfg),
                     recorder=recorder)
    recorder.row("config", **_jsonable(cfg.to_dict()))
    init_loss = evaluate(ctx.global_model, evals)
    recorder.row("eval", t_s=0.0, step=0, eval_loss=init_loss, gap=init_loss - floor)
    runner = {"local": run_local, "dp": run_dp, "diloco": run_diloco,
              "streaming": run_streaming, "decoupled": run_decoupled}[cfg.method]
    res = runner(cfg, ctx)
    final = evaluate(ctx.global_model, evals)
    learners = res.pop("learners", cfg.learners)
    tokens = learners * cfg.steps * cfg.batch_size * cfg.block_size
    summary = {
        "method": cfg.method, "engine": cfg.engine, "learners": learners, "steps": cfg.steps,
        "tokens": tokens, "final_eval_loss": final, "entropy_floor": floor,
        "gap_to_floor": final - floor, "entropy_rate": lang.entropy_rate,
        "initial_eval_loss": init_loss,
        "goodput": res.pop("goodput"), "goodput_available": res.pop("goodput_available"),
        "uptime": res.pop("uptime"),
        "bytes_up": res.pop("bytes_up"), "bytes_down": res.pop("bytes_down"),
        "merges": res.pop("merges"), "virtual_time_s": res.pop("end_s"),
        **res, "config": _jsonable(cfg.to_dict()),
    }
    recorder.row("final", eval_loss=final, gap=final - floor)
    return recorder.finish(summary)


def _jsonable(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}



