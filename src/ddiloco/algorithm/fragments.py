"""Split a model's parameters into P disjoint fragments.

Every parameter tensor lands in exactly one fragment (tensors are never split, so a
fragment is a list of whole named tensors). Strategies:

- ``balanced``: greedy bin-packing of whole tensors by bytes (largest first into the
  currently lightest fragment). The paper's "balanced tensor fragmentation"; it keeps the
  largest fragment, hence the peak bandwidth per step, close to the ideal bytes/P.
- ``per-layer``: contiguous runs of layers (e.g. blocks 0-1 | 2-3 | ...), as in
  Streaming DiLoCo's sequential pattern.
- ``strided``: layer i goes to fragment i mod P (Streaming DiLoCo's strided pattern).
- ``per-tensor``: one fragment per tensor (P is the number of tensors).

Embedding and unembedding tensors are tagged so the merge can use a plain weighted
average on them instead of radial-directional averaging.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Fragment", "Fragmentation", "STRATEGIES", "fragment_parameters", "layer_key"]

STRATEGIES = ("balanced", "per-layer", "strided", "per-tensor")


@dataclass(frozen=True, slots=True)
class Fragment:
    """One fragment: an index, its tensor names (in model order), and their sizes."""

    index: int
    names: tuple[str, ...]
    numels: tuple[int, ...]
    nbytes: int
    embedding: tuple[bool, ...]
    """Per tensor: True for embedding / unembedding tensors (plain averaging)."""

    @property
    def numel(self) -> int:
        return sum(self.numels)


@dataclass(frozen=True, slots=True)
class Fragmentation:
    """The full partition of a model's parameters into P fragments."""

    strategy: str
    fragments: tuple[Fragment, ...]

    @property
    def P(self) -> int:  # noqa: N802 - paper symbol
        return len(self.fragments)

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.fragments)

    @property
    def max_bytes(self) -> int:
        return max(f.nbytes for f in self.fragments)

    def imbalance(self) -> float:
        """Largest fragment over the ideal ``total/P`` (1.0 is perfect)."""
        return self.max_bytes / (self.total_bytes / self.P)

    def fragment_of(self) -> dict[str, int]:
        return {n: f.index for f in self.fragments for n in f.names}


_LAYER_RE = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def layer_key(name: str) -> str:
    """Group a parameter name into its layer: ``blocks.3.attn.qkv.weight`` -> ``blocks.3``;
    names without a numbered module group by their top-level module (``tok_emb``)."""
    m = _LAYER_RE.match(name)
    if m:
        return m.group(1)
    return name.split(".", 1)[0]


def _layers(names: Sequence[str]) -> list[list[int]]:
    order: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        order.setdefault(layer_key(n), []).append(i)
    return list(order.values())


def fragment_parameters(
    params: Iterable[tuple[str, int, int]],
    P: int,  # noqa: N803 - paper symbol
    strategy: str = "balanced",
    embedding_names: Iterable[str] = (),
) -> Fragmentation:
    """Partition ``(name, numel, element_size)`` triples into P fragments.

    ``params`` is in model order (e.g. ``(n, p.numel(), p.element_size())`` for
    ``model.named_parameters()``). Raises ValueError when the request cannot be met.
    """
    items = list(params)
    if not items:
        raise ValueError("the model has no parameters to fragment")
    names = [n for n, _, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown fragmentation strategy {strategy!r}; choose one of {STRATEGIES}")
    sizes = [numel * esize for _, numel, esize in items]
    emb = set(embedding_names)

    if strategy == "per-tensor":
        groups = [[i] for i in range(len(items))]
    else:
        if P < 1:
            raise ValueError(f"the number of fragments P must be >= 1, got {P}")
        if strategy == "balanced":
            if P > len(items):
                raise ValueError(
                    f"P={P} fragments but the model has only {len(items)} tensors; "
                    f"balanced fragmentation keeps tensors whole: use P <= {len(items)}"
                )
            groups = [[] for _ in range(P)]
            load = [0] * P
            # Largest first into the lightest bin (LPT); ties broken by index for determinism.
            for i in sorted(range(len(items)), key=lambda i: (-sizes[i], i)):
                b = min(range(P), key=lambda b: (load[b], b))
                groups[b].append(i)
                load[b] += sizes[i]
        else:
            layers = _layers(names)
            if P > len(layers):
                raise ValueError(
                    f"P={P} fragments but the model has only {len(layers)} layers; "
                    f"{strategy} fragmentation needs P <= {len(layers)}"
                )
            groups = [[] for _ in range(P)]
            for li, layer in enumerate(layers):
                b = li % P if strategy == "strided" else li * P // len(layers)
                groups[b].extend(layer)
    frags = []
    for k, g in enumerate(groups):
        g = sorted(g)
        frags.append(
            Fragment(
                index=k,
                names=tuple(names[i] for i in g),
                numels=tuple(items[i][1] for i in g),
                nbytes=sum(sizes[i] for i in g),
                embedding=tuple(names[i] in emb for i in g),
            )
        )
    result = Fragmentation(strategy=strategy, fragments=tuple(frags))
    assert sorted(n for f in frags for n in f.names) == sorted(names)
    return result


def fragment_model(
    model,
    P: int,
    strategy: str = "balanced",  # noqa: N803
    embedding_names: Iterable[str] = (),
) -> Fragmentation:
    """Fragment a ``torch.nn.Module``'s parameters. ``embedding_names`` are the parameters
    merged by plain averaging instead of RDA (``ddiloco.models.embedding_param_names`` finds
    them for the built-in models)."""
    return fragment_parameters(
        ((n, p.numel(), p.element_size()) for n, p in model.named_parameters()),
        P,
        strategy,
        embedding_names,
    )


__all__.append("fragment_model")
