"""Mixture-of-experts GPT: the GPT of ``gpt.py`` with each block's MLP replaced by E
expert MLPs and a top-k router.

Routing, per token x with router probabilities p = softmax(W_r x) over E experts:
  - the token goes to the k experts with the largest p (``torch.topk`` order);
  - its gates are those k probabilities, renormalised to sum to 1 when k > 1 (Mixtral
    style); with k = 1 the gate is the raw probability (Switch style), which keeps a
    gradient path to the router;
  - with a ``capacity_factor`` c, each expert takes at most ceil(c * N * k / E) of the
    N * k assignments of a forward pass; assignments are served in priority order (all
    first choices in token order, then all second choices, ...) and the rest are dropped
    (that expert contributes nothing; the residual stream still carries the token).

Load-balancing auxiliary loss (Switch Transformer), per MoE layer and forward pass:
  aux = E * sum_e f_e * P_e,
with f_e the fraction of the N * k assignments routed to expert e (before capacity drops)
and P_e the mean router probability of e. It equals 1 whenever the router is uniform and
grows to E / k when the router collapses onto k experts. It is the *local* load balance of
the learner that runs the forward pass; ``MoEGPT.forward`` adds ``aux_loss_coef`` times its
mean over layers to the cross-entropy.

Parameter names follow GPT; block i's MoE layer is ``blocks.{i}.mlp`` with
``blocks.{i}.mlp.router.weight`` and ``blocks.{i}.mlp.experts.{e}.{fc,proj}.{weight,bias}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddiloco.models.gpt import GPT, MLP, Block, GPTConfig

__all__ = ["MoEConfig", "MoELayer", "MoEGPT", "Routing", "moe_tiny", "moe_small"]


@dataclass(kw_only=True, slots=True)
class MoEConfig(GPTConfig):
    """Shape of a :class:`MoEGPT`: the GPT fields plus the expert layout."""

    n_experts: int = 4
    """E: experts per MoE layer."""
    top_k: int = 2
    """k: experts each token is routed to, in [1, E]."""
    capacity_factor: float | None = None
    """c: each expert serves at most ceil(c * N * k / E) assignments per forward pass; None
    means unlimited (no token is dropped)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss added to the cross-entropy (0 disables it)."""

    def __post_init__(self) -> None:
        GPTConfig.__post_init__(self)  # explicit: zero-arg super() breaks with slots=True
        if self.n_experts < 1:
            raise ValueError(f"MoEConfig.n_experts must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"MoEConfig.top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"MoEConfig.capacity_factor must be > 0 or None (unlimited), "
                f"got {self.capacity_factor}"
            )
        if self.aux_loss_coef < 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


def moe_tiny() -> MoEConfig:
    """gpt_tiny's shape with 4 experts, top-2."""
    return MoEConfig()


def moe_small() -> MoEConfig:
    """gpt_small's shape (6 x 384, byte vocabulary) with 8 experts, top-2, capacity 1.25."""
    return MoEConfig(
        vocab_size=256,
        block_size=256,
        n_layer=6,
        n_head=6,
        n_embd=384,
        n_experts=8,
        top_k=2,
        capacity_factor=1.25,
    )


@dataclass(slots=True)
class Routing:
    """Routing decisions of one MoE layer for N tokens."""

    probs: torch.Tensor
    """(N, E) router probabilities."""
    experts: torch.Tensor
    """(N, k) chosen experts, most probable first."""
    gates: torch.Tensor
    """(N, k) weights applied to the chosen experts' outputs."""
    kept: torch.Tensor
    """(N, k) bool: the assignment fit within its expert's capacity."""
    aux_loss: torch.Tensor
    """Scalar Switch load-balancing loss E * sum_e f_e P_e."""


class MoELayer(nn.Module):
    """E expert MLPs behind a top-k router; maps [B, T, d] to [B, T, d]."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))
        self.last_routing: Routing | None = None
        """Routing of the latest forward pass, for the aux loss and for load statistics."""

    def capacity(self, n_tokens: int) -> int | None:
        """Assignments one expert may serve in a forward pass of ``n_tokens`` tokens."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def route(self, x: torch.Tensor) -> Routing:
        """Routing for tokens ``x`` of shape (N, d)."""
        N, E, k = x.shape[0], self.n_experts, self.top_k
        probs = F.softmax(self.router(x).float(), dim=-1)
        top_p, experts = probs.topk(k, dim=-1)
        gates = top_p / top_p.sum(dim=-1, keepdim=True) if k > 1 else top_p
        # Priority order: rank-major (all first choices, then second, ...), token order
        # within a rank; an assignment's slot is how many earlier ones chose its expert.
        onehot = F.one_hot(experts.t().reshape(-1), E)  # (k*N, E)
        slot = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=-1).reshape(k, N).t()
        cap = self.capacity(N)
        kept = slot < cap if cap is not None else torch.ones_like(slot, dtype=torch.bool)
        f = onehot.float().mean(dim=0)  # fraction of assignments per expert, before drops
        aux = E * (f * probs.mean(dim=0)).sum()
        return Routing(probs=probs, experts=experts, gates=gates, kept=kept, aux_loss=aux)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.route(x)
        self.last_routing = routing
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, rank = ((routing.experts == e) & routing.kept).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = expert(x[token]) * routing.gates[token, rank, None].to(x.dtype)
            out.index_add_(0, token, y.to(out.dtype))  # autocast may run experts in bf16
        return out.reshape(shape)


class MoEGPT(GPT):
    """GPT whose blocks use a :class:`MoELayer` as their MLP.

    ``forward(idx, targets)`` returns ``(logits, loss)`` with
    loss = cross-entropy + aux_loss_coef * mean over layers of the aux loss. The parts are
    kept in ``last_ce_loss`` and ``last_aux_loss`` for logging.
    """

    cfg: MoEConfig

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.last_ce_loss: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None

    def _make_block(self, cfg: GPTConfig) -> nn.Module:
        assert isinstance(cfg, MoEConfig)
        return Block(cfg, mlp=MoELayer(cfg))

    def moe_layers(self) -> list[MoELayer]:
        return [block.mlp for block in self.blocks]  # type: ignore[misc]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, ce = super().forward(idx, targets)
        aux = torch.stack(
            [
                layer.last_routing.aux_loss
                for layer in self.moe_layers()
                if layer.last_routing is not None
            ]
        ).mean()
        self.last_aux_loss = aux.detach()
        if ce is None:
            return logits, None
        self.last_ce_loss = ce.detach()
        return logits, ce + self.cfg.aux_loss_coef * aux
