"""Models that learners train, and the helpers the algorithm needs about them.

``build_model(name, **overrides)`` builds a preset by name with field overrides;
``model_task(name)`` says what it learns from (``text`` or ``image``);
``embedding_param_names(model)`` tells the merge which tensors are embeddings or
unembeddings (they use the plain weighted average instead of RDA). A new model is a module
with its config dataclass, preset functions and ``nn.Module`` class (``forward(x, y)``
returns ``(output, loss)``), and one ``register_model`` line per preset below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch.nn as nn

from ddiloco.models.gpt import (
    GPT,
    GPTConfig,
    gpt_3m,
    gpt_100m,
    gpt_125m,
    gpt_mini,
    gpt_small,
    gpt_tiny,
)
from ddiloco.models.moe import MoEConfig, MoEGPT, moe_small, moe_tiny
from ddiloco.models.vit import ViT, ViTConfig, vit_digits, vit_tiny_rgb

__all__ = [
    "GPT",
    "GPTConfig",
    "gpt_tiny",
    "gpt_mini",
    "gpt_3m",
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
    "model_task",
    "register_model",
    "ModelPreset",
    "MODEL_PRESETS",
    "TASKS",
]

# Unembedding tensors of models that do not declare their embeddings, recognised by name.
_UNEMBED_SUFFIXES = ("lm_head.weight", "unembed.weight")

TASKS = ("text", "image")
"""What a model learns from: ``text`` (token sequences, next-token loss; the text data
sources) or ``image`` (images and labels, classification loss; digits and image folders)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelPreset:
    config: Callable[[], Any]
    """The preset's config function (``gpt_tiny``)."""
    model: Callable[[Any], nn.Module]
    """The model class, built from that config."""
    task: Literal["text", "image"]
    """What it learns from (``TASKS``)."""


MODEL_PRESETS: dict[str, ModelPreset] = {}
"""Preset name -> its config function, model class and task."""


def register_model(
    name: str,
    config: Callable[[], Any],
    model: Callable[[Any], nn.Module],
    task: Literal["text", "image"],
) -> None:
    """Add the preset ``name`` (``model.name``): ``model(config())`` builds it."""
    if task not in TASKS:
        raise ValueError(f"model preset {name!r}: task must be one of {TASKS}, got {task!r}")
    if name in MODEL_PRESETS:
        raise ValueError(f"model preset {name!r} is already registered")
    MODEL_PRESETS[name] = ModelPreset(config, model, task)


register_model("gpt_tiny", gpt_tiny, GPT, "text")
register_model("gpt_mini", gpt_mini, GPT, "text")
register_model("gpt_3m", gpt_3m, GPT, "text")
register_model("gpt_small", gpt_small, GPT, "text")
register_model("gpt_100m", gpt_100m, GPT, "text")
register_model("gpt_125m", gpt_125m, GPT, "text")
register_model("moe_tiny", moe_tiny, MoEGPT, "text")
register_model("moe_small", moe_small, MoEGPT, "text")
register_model("vit_digits", vit_digits, ViT, "image")
register_model("vit_tiny_rgb", vit_tiny_rgb, ViT, "image")


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


def _preset(name: str) -> ModelPreset:
    if name not in MODEL_PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; valid names: {', '.join(sorted(MODEL_PRESETS))}"
        )
    return MODEL_PRESETS[name]


def model_task(name: str) -> Literal["text", "image"]:
    """What preset ``name`` learns from: ``text`` or ``image``."""
    return _preset(name).task


def build_config(name: str, **overrides: Any) -> Any:
    """The config of preset ``name`` with fields replaced by ``overrides`` (validated)."""
    cfg = _preset(name).config()
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
    return MODEL_PRESETS[name].model(cfg)
