"""A sharded island's resumable state: every rank's shards of the model and of the inner
optimizer's state, saved with ``torch.distributed.checkpoint`` (DCP) in the learner's run
directory, and loaded by a restarted island, also one of another number of ranks (DCP
reshards: an island of 2 ranks resumes as 1, or as 4).

Layout in the run directory::

    learner_dcp/            the latest checkpoint (DCP's files and step.json)
    .learner_dcp.new/       one being written (every rank writes its shards)
    .learner_dcp.old/       the previous one, while the new one is swapped in

Rank 0 swaps a complete checkpoint in with two renames once every rank has written its
shards, so a SIGKILL at any point leaves a whole checkpoint: ``learner_dcp``, or (killed
between the renames) ``.learner_dcp.old``. ``step.json`` is written last, inside the
checkpoint: a directory without it is never read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

__all__ = ["DCP_NAME", "dcp_step", "load_dcp", "save_dcp"]

DCP_NAME = "learner_dcp"


def _complete(path: Path) -> int | None:
    try:
        return int(json.loads((path / "step.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _latest(out: Path) -> Path | None:
    for path in (out / DCP_NAME, out / f".{DCP_NAME}.old"):
        if _complete(path) is not None:
            return path
    return None


def dcp_step(out: Path | None) -> int | None:
    """The step of the latest whole checkpoint in run directory ``out``, or None."""
    if out is None:
        return None
    path = _latest(out)
    return None if path is None else _complete(path)


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (zero moments) without moving the parameters: a step on
    zero gradients at learning rate 0. DCP loads into the state a template holds."""
    if opt.state:
        return
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save_dcp(out: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Every rank of the island (a collective): its shards of ``model`` and ``opt`` at
    ``step``, swapped in as the latest checkpoint once all are written."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank() if dist.is_initialized() else 0
    new, old, final = out / f".{DCP_NAME}.new", out / f".{DCP_NAME}.old", out / DCP_NAME
    if rank == 0:
        shutil.rmtree(new, ignore_errors=True)  # a write a kill cut short
    if dist.is_initialized():
        dist.barrier()
    dcp.save(_state(model, opt), checkpoint_id=str(new))
    if rank == 0:
        (new / "step.json").write_text(json.dumps({"step": step}))
        if _complete(final) is not None:
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        else:
            shutil.rmtree(final, ignore_errors=True)
        new.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def load_dcp(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int | None:
    """Every rank (a collective): load the latest checkpoint's model and optimizer state into
    this island's shards, whatever number of ranks wrote it. Returns its step, or None when
    there is none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = _latest(out)
    if path is None:
        return None
    _init_optimizer_state(opt)
    sd = _state(model, opt)
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return _complete(path)
