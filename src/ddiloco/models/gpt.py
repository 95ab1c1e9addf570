"""A nanoGPT-style decoder-only transformer: the default model that learners train.

Pre-LayerNorm blocks, causal self-attention through ``F.scaled_dot_product_attention``
and a GELU MLP. Parameter names are part of the public API, because fragmentation
strategies and the embedding/non-embedding split of the merge (plain average for
embeddings, RDA for the rest) are keyed by them:

  tok_emb.weight, pos_emb.weight,
  blocks.{i}.ln1.{weight,bias}, blocks.{i}.attn.qkv.{weight,bias},
  blocks.{i}.attn.proj.{weight,bias}, blocks.{i}.ln2.{weight,bias},
  blocks.{i}.mlp.fc.{weight,bias}, blocks.{i}.mlp.proj.{weight,bias},
  ln_f.{weight,bias}, lm_head.weight

Biases are absent when ``bias=False``. With ``tie_weights=True``, ``lm_head.weight`` is
the same Parameter as ``tok_emb.weight`` and ``named_parameters()`` lists it once, as
``tok_emb.weight``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "init_gpt_weights",
    "gpt_tiny",
    "gpt_small",
    "gpt_100m",
    "gpt_125m",
]


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int = 64
    """V: number of token ids; inputs must lie in [0, V)."""
    block_size: int = 64
    """Maximum sequence length T (size of the learned position embedding)."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 64
    """Model width d."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches, in [0, 1)."""
    bias: bool = True
    """Use biases in Linear and LayerNorm layers."""
    tie_weights: bool = False
    """Share ``lm_head.weight`` with ``tok_emb.weight`` (GPT-2 style)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head among the divisors of n_embd, e.g. n_head="
                f"{math.gcd(self.n_embd, self.n_head)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


def gpt_tiny() -> GPTConfig:
    """~0.1M parameters: 2 layers, width 64, vocab 64, context 64. Trains in seconds on CPU."""
    return GPTConfig()


def gpt_mini() -> GPTConfig:
    """~0.8M parameters besides the embeddings: 4 layers, width 128, 4 heads, context 128
    (1.3M in all at a vocabulary of 2048)."""
    return GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)


def gpt_3m() -> GPTConfig:
    """~2.7M parameters besides the embeddings: 6 layers, width 192, 6 heads, context 128
    (3.4M in all at a vocabulary of 2048)."""
    return GPTConfig(vocab_size=256, block_size=128, n_layer=6, n_head=6, n_embd=192)


def gpt_small() -> GPTConfig:
    """~10.8M parameters: 6 layers, width 384, byte vocabulary (256), context 256."""
    return GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384)


def gpt_100m() -> GPTConfig:
    """~100M parameters: 14 layers of GPT-2-small width (768), byte vocabulary, context 1024."""
    return GPTConfig(vocab_size=256, block_size=1024, n_layer=14, n_head=12, n_embd=768)


def gpt_125m() -> GPTConfig:
    """GPT-2 small shape (~124M parameters): 12 x 768, 12 heads, vocab 50304, context 1024,
    tied embeddings as in GPT-2."""
    return GPTConfig(
        vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, tie_weights=True
    )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a fused q/k/v projection; causal unless
    ``causal=False`` (the ViT attends both ways). ``cfg`` needs n_embd, n_head, dropout,
    bias."""

    def __init__(self, cfg: GPTConfig, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, width 4d, GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)). ``mlp`` may be
    any module mapping [B, T, d] to [B, T, d] (the MoE layer, for instance)."""

    def __init__(self, cfg: GPTConfig, causal: bool = True, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, causal=causal)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = mlp if mlp is not None else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def init_gpt_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation: N(0, 0.02) for Linear and Embedding weights, zero biases, and
    residual output projections (``*.proj.weight``) scaled by 1/sqrt(2 * n_layer) so the
    residual stream's variance does not grow with depth."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
    for name, p in model.named_parameters():
        if name.endswith("proj.weight"):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``forward(idx, targets)`` returns ``(logits [B, T, V], loss)``, where ``loss`` is the
    mean next-token cross-entropy in nats when ``targets`` is given (entries equal to -1
    are ignored) and None otherwise. Initialisation is deterministic given
    ``torch.manual_seed``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(self._make_block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        init_gpt_weights(self, cfg.n_layer)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    def _make_block(self, cfg: GPTConfig) -> nn.Module:
        """One transformer block; subclasses (the MoE GPT) swap the MLP here."""
        return Block(cfg)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.cfg.block_size}; "
                f"use shorter sequences or a config with a larger block_size"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
        return logits, loss

    def embedding_param_names(self) -> set[str]:
        """Names (as in ``named_parameters()``) of the embedding and unembedding tensors:
        ``tok_emb.weight``, ``pos_emb.weight`` and ``lm_head.weight`` (the last is absent
        when tied, since it is then the same Parameter as ``tok_emb.weight``)."""
        names = {"tok_emb.weight", "pos_emb.weight"}
        if not self.cfg.tie_weights:
            names.add("lm_head.weight")
        return names

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (each shared tensor counted once); with ``non_embedding``,
        excluding the embedding and unembedding tensors."""
        skip = self.embedding_param_names() if non_embedding else set()
        return sum(p.numel() for n, p in self.named_parameters() if n not in skip)
