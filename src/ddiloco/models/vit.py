"""A small Vision Transformer (ViT) classifier for the image workloads.

Images [B, C, H, W] are cut into non-overlapping P x P patches, each linearly embedded
(``patch_emb``, a stride-P convolution); a learned ``cls_token`` is prepended and a
learned ``pos_emb`` added; pre-LN blocks attend in both directions (the GPT blocks with
``causal=False``); the class logits come from ``head`` applied to the final cls state.

Parameter names: ``patch_emb.{weight,bias}``, ``cls_token``, ``pos_emb``, ``blocks.{i}...``
as in GPT, ``ln_f.{weight,bias}``, ``head.{weight,bias}``. The first three are the
embeddings and ``head`` the unembedding (see ``embedding_param_names``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddiloco.models.gpt import Block, init_gpt_weights

__all__ = ["ViTConfig", "ViT", "vit_digits", "vit_tiny_rgb"]


@dataclass(kw_only=True, slots=True)
class ViTConfig:
    """Shape of a :class:`ViT`."""

    image_size: int = 8
    """Height and width of the (square) input images, pixels."""
    patch_size: int = 2
    """P: side of a square patch; must divide ``image_size``."""
    in_channels: int = 1
    """Colour channels (1 grayscale, 3 RGB)."""
    n_classes: int = 10
    """Number of labels."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 64
    """Model width d."""
    dropout: float = 0.0
    """Dropout probability, in [0, 1)."""
    bias: bool = True
    """Use biases in Linear and LayerNorm layers."""

    def __post_init__(self) -> None:
        for name in (
            "image_size",
            "patch_size",
            "in_channels",
            "n_classes",
            "n_layer",
            "n_head",
            "n_embd",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ViTConfig.{name} must be a positive int, got {value!r}")
        if self.image_size % self.patch_size != 0:
            raise ValueError(
                f"ViTConfig.patch_size ({self.patch_size}) must divide "
                f"image_size ({self.image_size})"
            )
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"ViTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ViTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def vit_digits() -> ViTConfig:
    """For the 8x8 grayscale sklearn digits: 2x2 patches, 2 layers, width 64, 10 classes."""
    return ViTConfig()


def vit_tiny_rgb() -> ViTConfig:
    """For small 32x32 RGB image folders: 4x4 patches, 4 layers, width 128."""
    return ViTConfig(image_size=32, patch_size=4, in_channels=3, n_layer=4, n_head=4, n_embd=128)


class ViT(nn.Module):
    """Vision Transformer classifier.

    ``forward(images [B, C, H, W], labels [B] | None)`` returns ``(logits [B, n_classes],
    loss)`` with ``loss`` the mean cross-entropy when labels are given, else None.
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_emb = nn.Conv2d(
            cfg.in_channels,
            cfg.n_embd,
            kernel_size=cfg.patch_size,
            stride=cfg.patch_size,
            bias=cfg.bias,
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.n_embd))
        self.pos_emb = nn.Parameter(torch.zeros(1, 1 + cfg.n_patches, cfg.n_embd))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg, causal=False)  # type: ignore[arg-type]
            for _ in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.n_classes, bias=cfg.bias)
        init_gpt_weights(self, cfg.n_layer)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_emb, std=0.02)

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.cfg
        if images.ndim != 4 or images.shape[1:] != (
            cfg.in_channels,
            cfg.image_size,
            cfg.image_size,
        ):
            raise ValueError(
                f"expected images of shape [B, {cfg.in_channels}, {cfg.image_size}, "
                f"{cfg.image_size}], got {list(images.shape)}; resize the images "
                f"or set ViTConfig.image_size/in_channels"
            )
        x = self.patch_emb(images).flatten(2).transpose(1, 2)  # [B, n_patches, d]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.drop(x + self.pos_emb)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x[:, 0]))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return logits, loss

    def embedding_param_names(self) -> set[str]:
        """Patch embedding, cls token and position embedding (embeddings) and the
        classification head (unembedding)."""
        return {
            n
            for n, _ in self.named_parameters()
            if n.startswith(("patch_emb.", "head.")) or n in ("cls_token", "pos_emb")
        }
