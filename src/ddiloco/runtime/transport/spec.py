"""The model spec that learners and the syncer must agree on: tensor names, shapes,
element sizes, embedding names and the fragmentation (P, strategy). Both sides build the
``Fragmentation`` from the spec with the same function, so they always agree on which
tensor belongs to which fragment."""

from __future__ import annotations

import hashlib
import json
import math

import torch

from ddiloco.algorithm.fragments import Fragmentation, fragment_parameters

__all__ = ["model_spec", "fragmentation_from_spec", "spec_fingerprint", "check_spec"]


def model_spec(model: torch.nn.Module, P: int, strategy: str = "balanced",  # noqa: N803
               embedding_names: set[str] | None = None) -> dict:
    if embedding_names is None:
        from ddiloco.models import embedding_param_names
        embedding_names = embedding_param_names(model)
    named = list(model.named_parameters())
    return {
        "names": [n for n, _ in named],
        "shapes": [list(p.shape) for _, p in named],
        "esizes": [p.element_size() for _, p in named],
        "embedding": sorted(embedding_names),
        "P": int(P),
        "strategy": strategy,
    }


def check_spec(spec: dict) -> None:
    """Raise ValueError if ``spec`` is malformed (it arrives over the network)."""
    try:
        names, shapes, esizes = spec["names"], spec["shapes"], spec["esizes"]
        ok = (isinstance(names, list) and len(names) == len(shapes) == len(esizes) > 0
              and all(isinstance(n, str) for n in names)
              and all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s)
                      for s in shapes)
              and all(isinstance(e, int) and e > 0 for e in esizes)
              and isinstance(spec["P"], int) and isinstance(spec["strategy"], str)
              and isinstance(spec["embedding"], list))
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError("model spec must have names, shapes, esizes, embedding, P, strategy")


def fragmentation_from_spec(spec: dict) -> Fragmentation:
    return fragment_parameters(
        ((n, math.prod(s), e) for n, s, e in zip(spec["names"], spec["shapes"], spec["esizes"])),
        spec["P"], spec["strategy"], spec["embedding"])


def spec_fingerprint(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
