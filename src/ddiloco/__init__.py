"""ddiloco: Decoupled DiLoCo for PyTorch.

Learners train independently and push parameter fragments to a syncer that merges them
asynchronously (minimum quorum, adaptive grace window, token-weighted radial-directional
averaging, Nesterov outer step). Importing ``ddiloco`` does not import torch; the
simulator (``ddiloco.sim``) and the bandwidth planner stay torch-free.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
