"""The real distributed runtime: a gRPC syncer service, learner processes (optionally
torchrun islands), the process launcher, chaos injection and status.

Public API: ``DecoupledLearner`` hooks a user's model and optimizer to a syncer;
``SyncerServer`` runs the syncer in-process. Submodules import torch and grpc on demand.
"""

from __future__ import annotations

__all__ = ["DecoupledLearner", "LinkLimits", "SyncerServer", "SyncerServerConfig"]


def __getattr__(name: str):
    if name in ("DecoupledLearner", "LinkLimits"):
        from ddiloco.runtime import learner_client
        return getattr(learner_client, name)
    if name in ("SyncerServer", "SyncerServerConfig"):
        from ddiloco.runtime import syncer_server
        return getattr(syncer_server, name)
    raise AttributeError(name)
