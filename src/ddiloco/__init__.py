"""ddiloco: Decoupled DiLoCo for PyTorch.

Learners train independently and push parameter fragments to a syncer that merges them
asynchronously (minimum quorum, adaptive grace window, token-weighted radial-directional
averaging, Nesterov outer step). Importing ``ddiloco`` does not import torch; the
simulator (``ddiloco.sim``) and the bandwidth planner stay torch-free.

``ddiloco.DecoupledLearner`` (the hook for your own model, optimizer and loop),
``ddiloco.TrainConfig`` and ``ddiloco.load_model`` (a run's global model, built and loaded
from its run directory or exported file) are loaded on first use, as is
``ddiloco.exit_island_rank`` (the last line of a torchrun rank's script: it leaves
without the interpreter's finalization, where Gloo's workers can abort the process).
"""

__version__ = "0.1.0"
__all__ = ["__version__", "DecoupledLearner", "TrainConfig", "exit_island_rank", "load_model"]


def __getattr__(name: str):
    if name == "DecoupledLearner":
        from ddiloco.runtime.learner.hook import DecoupledLearner

        return DecoupledLearner
    if name == "exit_island_rank":
        from ddiloco.runtime.learner.island import exit_island_rank

        return exit_island_rank
    if name == "TrainConfig":
        from ddiloco.config import TrainConfig

        return TrainConfig
    if name == "load_model":
        from ddiloco.runtime.export import load_model

        return load_model
    raise AttributeError(f"module 'ddiloco' has no attribute {name!r}")
