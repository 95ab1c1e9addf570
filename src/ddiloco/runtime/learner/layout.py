"""A learner's model as the syncer sees it, whatever wraps it.

The syncer names a parameter tensor by its name in the user's own module, so learners that
wrap the same model differently train one model:

- a plain module: its ``named_parameters()``;
- ``DistributedDataParallel`` and ``DataParallel`` (``module.`` in front of every name) and
  ``torch.compile`` (``_orig_mod.``): the module they wrap;
- FSDP2 (``torch.distributed.fsdp.fully_shard``): names and global shapes are the module's
  own (its parameters become DTensors in place).

``island_group`` finds the island's process group where the user has one: the group a DDP
wrapper reduces over, or the device mesh of an FSDP2 model's parameters.
"""

from __future__ import annotations

import torch

__all__ = ["unwrap_model", "island_group"]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP, DataParallel and ``torch.compile`` wrappers (nested
    in any order); the model itself when it is none of them. FSDP (version 1) is refused:
    its parameters are flattened under other names."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), torch.nn.Module):
            model = inner  # torch.compile's OptimizedModule
        else:
            break
    if type(model).__name__ == "FullyShardedDataParallel":
        raise ValueError(
            "DecoupledLearner does not take FSDP (version 1) models: their parameters are "
            "flattened under other names. Shard the model with "
            "torch.distributed.fsdp.fully_shard (FSDP2) instead"
        )
    return model


def island_group(model: torch.nn.Module):
    """The process group of the island ``model`` is trained by, or None (one process): a
    DDP wrapper's group, when it holds more than one rank."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    m = model
    while not isinstance(m, DistributedDataParallel):
        if isinstance(m, DataParallel):
            m = m.module
        elif isinstance(inner := getattr(m, "_orig_mod", None), torch.nn.Module):
            m = inner
        else:
            return None
    import torch.distributed as dist

    group = m.process_group
    return group if dist.get_world_size(group) > 1 else None
