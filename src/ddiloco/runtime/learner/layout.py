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

A sharded island (FSDP2, HSDP) syncs its shards where they are. ``local_runs`` gives each
parameter's local tensor (``DTensor.to_local()``, written in place by installs) and the run
of the flattened global tensor it holds: FSDP2 shards dim 0, so a rank's shard is one run.
``IslandPlan``, built from every rank's runs, says who pushes and who fetches what:

- every rank fetches its own runs of every fragment (and installs only those);
- of the ranks holding the same run of a tensor (HSDP's replicas, or every rank for a
  tensor left unsharded), the one at index ``p mod (their number)`` pushes it for fragment
  p: each run is pushed once, and the replicas take turns by fragment, so the uplink of
  every rank is used. The runs pushed must tile every tensor exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco.algorithm.fragments import Fragmentation
from ddiloco.algorithm.slices import Piece

__all__ = [
    "IslandPlan",
    "Run",
    "island_group",
    "local_runs",
    "mesh_group",
    "shard_model",
    "unwrap_model",
]


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


@dataclass(frozen=True, slots=True)
class Run:
    """Elements ``[offset, offset + numel)`` of a flattened global tensor, held by a rank."""

    offset: int
    numel: int


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_runs(
    module: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, Run]] | None:
    """An FSDP2-sharded module's parameters as this rank holds them: name -> local tensor
    (a view of the DTensor's local shard: writing it writes the parameter) and name -> its
    run of the global tensor. None when no parameter is a DTensor (a plain or DDP model).
    A parameter that is no DTensor is held whole (replicated). Raises ValueError for a
    shard that is not a run (a tensor sharded on a dim other than 0)."""
    named = list(module.named_parameters())
    if not any(_is_dtensor(t) for _, t in named):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    tensors, runs = {}, {}
    for n, param in named:
        if not _is_dtensor(param):
            tensors[n], runs[n] = param.detach(), Run(0, param.numel())
            continue
        t: Any = param  # a DTensor
        local = t.to_local().detach()
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(shape) != tuple(local.shape) or (
            local.numel() and tuple(shape[1:]) != tuple(t.shape[1:])
        ):
            raise ValueError(
                f"parameter {n} of global shape {tuple(t.shape)} is held as a shard of shape "
                f"{tuple(local.shape)} ({t.placements}): DecoupledLearner takes FSDP2 shards "
                f"of dim 0 (fully_shard's default) and replicated tensors"
            )
        start = offset[0] * math.prod(t.shape[1:]) if t.dim() else 0
        tensors[n], runs[n] = local, Run(int(start) if local.numel() else 0, local.numel())
    return tensors, runs


def mesh_group(module: torch.nn.Module):
    """The process group of every rank of an FSDP2 module's device mesh (the island): the
    default group when the mesh covers the world, else a new group (every rank of the
    default group must call this, as ``torch.distributed.new_group`` requires)."""
    import torch.distributed as dist

    meshes = {
        id(mesh): mesh
        for t in module.parameters()
        if _is_dtensor(t) and (mesh := getattr(t, "device_mesh", None)) is not None
    }
    if len(meshes) != 1:
        raise ValueError(
            f"the model's DTensor parameters live on {len(meshes)} device meshes: "
            f"DecoupledLearner takes one mesh per island (or pass process_group=)"
        )
    ranks = sorted(int(r) for r in next(iter(meshes.values())).mesh.flatten().tolist())
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks)


class IslandPlan:
    """Who pushes and fetches which runs of a sharded island's fragments (the module doc).

    ``runs[r][name]`` is rank r's run of tensor ``name`` (from every rank, in rank order)."""

    def __init__(
        self, fragmentation: Fragmentation, runs: Sequence[dict[str, Run]], rank: int
    ) -> None:
        self.rank, self.world = rank, len(runs)
        self.fragmentation = fragmentation
        P = fragmentation.P  # noqa: N806
        self._own: list[list[Piece]] = [[] for _ in range(P)]
        self._push: list[list[Piece]] = [[] for _ in range(P)]
        self.pushers: list[frozenset[int]] = []
        """Per fragment: the ranks that push some run of it."""
        self.fetchers: list[frozenset[int]] = []
        """Per fragment: the ranks that hold some run of it (and fetch it)."""
        for p, f in enumerate(fragmentation.fragments):
            pushers: set[int] = set()
            fetchers: set[int] = set()
            for j, (name, numel) in enumerate(zip(f.names, f.numels)):
                holders: dict[Run, list[int]] = {}
                for r in range(self.world):
                    run = runs[r][name]
                    if run.numel:
                        holders.setdefault(run, []).append(r)
                        fetchers.add(r)
                tiles = sorted(holders, key=lambda x: x.offset)
                end = 0
                for run in tiles:
                    if run.offset != end:
                        raise ValueError(
                            f"tensor {name}: the island's ranks hold runs "
                            f"{[(x.offset, x.numel) for x in tiles]} of its {numel} elements, "
                            f"which do not tile it: every element must be held, by one "
                            f"shard or by identical replicas"
                        )
                    end = run.offset + run.numel
                if end != numel:
                    raise ValueError(
                        f"tensor {name}: the island's ranks hold {end} of its {numel} elements"
                    )
                for run, ranks in holders.items():
                    who = ranks[p % len(ranks)]
                    pushers.add(who)
                    piece = Piece(j, run.offset, run.numel)
                    if who == rank:
                        self._push[p].append(piece)
                    if rank in ranks:
                        self._own[p].append(piece)
            self.pushers.append(frozenset(pushers))
            self.fetchers.append(frozenset(fetchers))

    def own(self, p: int) -> list[Piece]:
        """This rank's runs of fragment p's tensors (what it fetches and installs)."""
        return self._own[p]

    def pushes(self, p: int) -> list[Piece]:
        """The runs of fragment p this rank pushes (empty: another rank pushes them)."""
        return self._push[p]


def shard_model(
    model: torch.nn.Module, replicas: int = 1, device_type: str = "cpu"
) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 over every rank of the default group, in place: each
    block of its top-level ``ModuleList`` s, then the rest. ``replicas > 1``: HSDP, a
    (replicas, world / replicas) mesh (shards within a replica, replicas of them). Make
    the optimizer after this (its parameters become DTensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if world % replicas:
        raise ValueError(f"{replicas} replicas do not divide an island of {world} ranks")
    if replicas > 1:
        mesh = init_device_mesh(
            device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device_type, (world,))
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
