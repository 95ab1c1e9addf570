"""Models that learners train, and the helpers the algorithm needs about them.

``build_model(name, **overrides)`` builds a preset by name with field overrides;
``embedding_param_names(model)`` tells the merge which tensors are embeddings or
unembeddings (they use the plain weighted average instead of RDA).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from ddiloco.models.gpt import GPT, GPTConfig, gpt_100m, gpt_125m, gpt_small, gpt_tiny
from ddiloco.models.moe import MoEConfig, MoEGPT, moe_small, moe_tiny
from ddiloco.models.vit import ViT, ViTConfig, vit_digits, vit_tiny_rgb

__all__ = [
    "GPT",
    "GPTConfig",
    "gpt_tiny",
    "gpt_small",
    "gpt_100m",
    "gpt_125m",
    "MoEConfig",
    "MoEGPT",
    "moe_tiny",
    "moe_small",
    "ViTConfig",
    "ViT",
    "vit_digits",
    "vit_tiny_rgb",
    "embedding_param_names",
    "build_model",
    "build_config",
    "MODEL_PRESETS",
]

# Unembedding tensors of models that do not declare their embeddings, recognised by name.
_UNEMBED_SUFFIXES = ("lm_head.weight", "unembed.weight")

MODEL_PRESETS: dict[str, tuple[Callable[[], Any], Callable[[Any], nn.Module]]] = {
    "gpt_tiny": (gpt_tiny, GPT),
    "gpt_small": (gpt_small, GPT),
    "gpt_100m": (gpt_100m, GPT),
    "gpt_125m": (gpt_125m, GPT),
    "moe_tiny": (moe_tiny, MoEGPT),
    "moe_small": (moe_small, MoEGPT),
    "vit_digits": (vit_digits, ViT),
    "vit_tiny_rgb": (vit_tiny_rgb, ViT),
}
"""Preset name -> (config preset function, model class)."""


def embedding_param_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of embedding and unembedding tensors.

    Uses ``model.embedding_param_names()`` when the model defines it. Otherwise: the
    weights of every ``nn.Embedding``, any parameter sharing storage with one of them
    (tied unembeddings), and parameters whose name ends in ``lm_head.weight`` or
    ``unembed.weight``.
    """
    declared = getattr(model, "embedding_param_names", None)
    if callable(declared):
        return set(declared())
    # A tensor is an embedding if it is an nn.Embedding weight or named like an
    # unembedding; storage pointers catch ties, whichever name named_parameters() keeps.
    ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    ptrs |= {
        p.data_ptr()
        for n, p in model.named_parameters(remove_duplicate=False)
        if n.endswith(_UNEMBED_SUFFIXES)
    }
    return {n for n, p in model.named_parameters() if p.data_ptr() in ptrs}


def build_config(name: str, **overrides: Any) -> Any:
    """The config of preset ``name`` with fields replaced by ``overrides`` (validated)."""
    if name not in MODEL_PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; valid names: {', '.join(sorted(MODEL_PRESETS))}"
        )
    cfg = MODEL_PRESETS[name][0]()
    fields = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"unknown field(s) {unknown} for model preset {name!r} "
            f"({type(cfg).__name__}); valid fields: {', '.join(sorted(fields))}"
        )
    return dataclasses.replace(cfg, **overrides)


def build_model(name: str, **overrides: Any) -> nn.Module:
    """Build preset ``name`` (see ``MODEL_PRESETS``) with config fields overridden,
    e.g. ``build_model("gpt_tiny", n_layer=4)``."""
    cfg = build_config(name, **overrides)
    return MODEL_PRESETS[name][1](cfg)
