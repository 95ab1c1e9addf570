"""The real distributed runtime: a gRPC syncer service, learner processes (optionally
torchrun islands), the process launcher, chaos injection and status.

Public API: ``DecoupledLearner`` hooks a user's model and optimizer to a syncer;
``SyncerServer`` runs the syncer in-process. Submodules import torch and grpc on demand.
"""

from __future__ import annotations

__all__ = ["DecoupledLearner", "LinkLimits", "SyncerServer", "SyncerServerConfig"]


def __getattr__(name: str):
    if name in ("DecoupledLearner", "LinkLimits"):
        from ddiloco.runtime.learner import client, hook

        return getattr(hook if name == "DecoupledLearner" else client, name)
    if name in ("SyncerServer", "SyncerServerConfig"):
        from ddiloco.runtime.syncer import server

        return getattr(server, name)
    raise AttributeError(name)
