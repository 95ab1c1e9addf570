"""What every training stream offers, and how streams derive independent random numbers.

A stream is a learner's private, deterministic source of training batches. Its only
state is ``position`` (batches consumed), so a restarted learner that loads its
``state_dict()`` resumes exactly where it stopped: no batch is replayed or skipped.

Randomness is keyed, not sequential: batch ``b`` of learner ``m`` is produced from a
``numpy.random.SeedSequence`` whose key names (seed, purpose, m, chunk of b). Streams of
different learners and the held-out eval set therefore never share random numbers, and
seeking to any position costs one chunk, not a replay.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

__all__ = [
    "BatchStream",
    "TRAIN",
    "EVAL",
    "seed_sequence",
    "rng_for",
    "check_learner",
    "check_state",
    "SHARDINGS",
    "DEFAULT_SHARD_BLOCK",
]

TRAIN = 0
"""Key domain of per-learner training data."""
EVAL = 1
"""Key domain of held-out evaluation data."""

SHARDINGS = ("interleaved", "contiguous")
"""How token data is shared among learners (``data.sharding``; ``data.text``)."""
DEFAULT_SHARD_BLOCK = 4096
"""Tokens per block of the interleaved sharding (``data.shard_block``)."""


@runtime_checkable
class BatchStream(Protocol):
    """Interface shared by all training streams (synthetic, text, tokens, images)."""

    @property
    def position(self) -> int:
        """Number of batches consumed so far."""
        ...

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) batch; advances ``position`` by one."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: the position plus identity checks."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["position"]``."""
        ...


def seed_sequence(seed: int, domain: int, *key: int) -> np.random.SeedSequence:
    """Independent seed sequence for (seed, domain, *key); distinct keys never overlap."""
    return np.random.SeedSequence(entropy=seed, spawn_key=(domain, *key))


def rng_for(seed: int, domain: int, *key: int) -> np.random.Generator:
    """A PCG64 generator seeded by :func:`seed_sequence`."""
    return np.random.Generator(np.random.PCG64(seed_sequence(seed, domain, *key)))


def check_learner(learner: int, n_learners: int) -> None:
    """Validate a learner index m in [0, M)."""
    if n_learners < 1:
        raise ValueError(f"n_learners must be >= 1, got {n_learners}")
    if not 0 <= learner < n_learners:
        raise ValueError(f"learner must be in [0, n_learners={n_learners}), got {learner}")


def check_state(state: dict[str, Any], expected: dict[str, Any]) -> int:
    """Check that ``state`` was saved by a stream with the same identity; return its
    position. A mismatch means the checkpoint belongs to another learner or dataset."""
    if "position" not in state:
        raise ValueError(f"stream state has no 'position' (keys: {sorted(state)})")
    for key, value in expected.items():
        if key in state and state[key] != value:
            raise ValueError(
                f"stream state was saved with {key}={state[key]!r} but this "
                f"stream has {key}={value!r}; load the state of the matching "
                f"learner/dataset"
            )
    position = int(state["position"])
    if position < 0:
        raise ValueError(f"stream position must be >= 0, got {position}")
    return position
