"""What the trainer integrations share: the island's process group and the hook's options."""

from __future__ import annotations

import inspect
from typing import Any

from ddiloco.runtime.learner.hook import DecoupledLearner

__all__ = ["island_group", "learner_kwargs", "batch_samples"]

_OWN = ("model", "optimizer", "syncer", "learner", "tokens_per_step", "process_group")


def island_group() -> Any:
    """The default process group when ``torch.distributed`` runs more than one rank (the
    ranks of one trainer then form one island), else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def learner_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` checked against ``DecoupledLearner``'s keyword arguments, so that a typo fails
    when the callback is made rather than when training starts."""
    allowed = set(inspect.signature(DecoupledLearner.__init__).parameters) - {"self", *_OWN}
    bad = sorted(set(kw) - allowed)
    if bad:
        raise TypeError(
            f"unknown DecoupledLearner option(s) {', '.join(bad)}; valid: "
            f"{', '.join(sorted(allowed))}"
        )
    return dict(kw)


def batch_samples(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (a tensor, or one inside
    a tuple, list or dict); 1 when it holds none."""
    return _samples(batch) or 1


def _samples(batch: Any) -> int | None:
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim > 0 else 1
    items = (
        batch.values()
        if isinstance(batch, dict)
        else (batch if isinstance(batch, (list, tuple)) else ())
    )
    for x in items:
        n = _samples(x)
        if n is not None:
            return n
    return None
