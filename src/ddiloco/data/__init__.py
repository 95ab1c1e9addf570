"""Training data for learners: per-learner deterministic streams and held-out eval sets.

Every stream has the :class:`~ddiloco.data.stream.BatchStream` interface
(``next_batch``, ``position``, ``state_dict``, ``load_state_dict``).
"""

from __future__ import annotations

from ddiloco.data.stream import BatchStream
from ddiloco.data.synthetic import MarkovConfig, MarkovLanguage, SyntheticStream, eval_batches

__all__ = ["BatchStream", "MarkovConfig", "MarkovLanguage", "SyntheticStream", "eval_batches"]
