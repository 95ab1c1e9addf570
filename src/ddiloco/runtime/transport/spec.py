"""The model spec that learners and the syncer must agree on: tensor names, shapes,
dtypes, element sizes, embedding names and the fragmentation (P, strategy). Both sides build the
``Fragmentation`` from the spec with the same function, so they always agree on which
tensor belongs to which fragment."""

from __future__ import annotations

import hashlib
import json
import math

import torch

from ddiloco.algorithm.fragments import Fragmentation, fragment_parameters

__all__ = ["model_spec", "fragmentation_from_spec", "spec_fingerprint", "check_spec", "spec_diff"]


def model_spec(
    model: torch.nn.Module,
    P: int,
    strategy: str = "balanced",  # noqa: N803
    embedding_names: set[str] | None = None,
) -> dict:
    if embedding_names is None:
        from ddiloco.models import embedding_param_names

        embedding_names = embedding_param_names(model)
    named = list(model.named_parameters())
    return {
        "names": [n for n, _ in named],
        "shapes": [list(p.shape) for _, p in named],
        "esizes": [p.element_size() for _, p in named],
        "dtypes": [str(p.dtype).removeprefix("torch.") for _, p in named],
        "embedding": sorted(embedding_names),
        "P": int(P),
        "strategy": strategy,
    }


def check_spec(spec: dict) -> None:
    """Raise ValueError if ``spec`` is malformed (it arrives over the network)."""
    try:
        names, shapes, esizes = spec["names"], spec["shapes"], spec["esizes"]
        ok = (
            isinstance(names, list)
            and len(names) == len(shapes) == len(esizes) > 0
            and all(isinstance(n, str) for n in names)
            and all(
                isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s)
                for s in shapes
            )
            and all(isinstance(e, int) and e > 0 for e in esizes)
            and isinstance(spec["P"], int)
            and isinstance(spec["strategy"], str)
            and isinstance(spec["embedding"], list)
            and (
                spec.get("dtypes") is None
                or (
                    isinstance(spec["dtypes"], list)
                    and len(spec["dtypes"]) == len(names)
                    and all(isinstance(d, str) for d in spec["dtypes"])
                )
            )
        )
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError("model spec must have names, shapes, esizes, embedding, P, strategy")


def fragmentation_from_spec(spec: dict) -> Fragmentation:
    return fragment_parameters(
        ((n, math.prod(s), e) for n, s, e in zip(spec["names"], spec["shapes"], spec["esizes"])),
        spec["P"],
        spec["strategy"],
        spec["embedding"],
    )


def spec_fingerprint(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def spec_diff(
    ours: dict,
    theirs: dict,
    *,
    ours_name: str = "syncer",
    theirs_name: str = "learner",
    limit: int = 4,
) -> str:
    """What differs between two specs, field by field, in words (empty when they agree):
    P, fragmentation strategy, tensor count and names, then each tensor's shape, dtype and
    element size, then the embedding names."""
    a, b, out = ours, theirs, []

    def both(field: str, what: str) -> None:
        if a.get(field) != b.get(field):
            out.append(f"{what}: {ours_name} {a.get(field)!r}, {theirs_name} {b.get(field)!r}")

    both("P", "P (fragments)")
    both("strategy", "fragmentation strategy")
    names_a, names_b = list(a.get("names") or []), list(b.get("names") or [])
    if len(names_a) != len(names_b):
        out.append(f"number of tensors: {ours_name} {len(names_a)}, {theirs_name} {len(names_b)}")
    missing = [n for n in names_a if n not in set(names_b)]
    extra = [n for n in names_b if n not in set(names_a)]
    if missing:
        out.append(
            f"tensors only the {ours_name} has: {missing[:limit]}"
            f"{' ...' if len(missing) > limit else ''}"
        )
    if extra:
        out.append(
            f"tensors only the {theirs_name} has: {extra[:limit]}"
            f"{' ...' if len(extra) > limit else ''}"
        )
    if not missing and not extra and names_a != names_b:
        out.append("tensor order differs (named_parameters() must list them in the same order)")
    for field, what in (("shapes", "shape"), ("dtypes", "dtype"), ("esizes", "element size")):
        if a.get(field) is None or b.get(field) is None:
            continue
        va, vb = dict(zip(names_a, a[field])), dict(zip(names_b, b[field]))
        diffs = [
            f"{n}: {ours_name} {va[n]}, {theirs_name} {vb[n]}"
            for n in names_a
            if n in vb and va[n] != vb[n]
        ]
        if diffs:
            out.append(
                f"tensor {what}s differ ({len(diffs)}): {'; '.join(diffs[:limit])}"
                f"{' ...' if len(diffs) > limit else ''}"
            )
    if sorted(a.get("embedding") or []) != sorted(b.get("embedding") or []):
        out.append(
            f"embedding tensors: {ours_name} {a.get('embedding')}, "
            f"{theirs_name} {b.get('embedding')}"
        )
    return "; ".join(out)
