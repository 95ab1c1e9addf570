"""Mixture-of-experts GPT: routing, capacity/dispatch, aux loss, forward/backward."""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.models import build_model, embedding_param_names
from ddiloco.models.moe import MoEConfig, MoEGPT, MoELayer


def naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Reference dispatch: one token and one choice at a time, in priority order."""
    N, k = x.shape[0], layer.top_k
    probs = torch.softmax(layer.router(x), dim=-1)
    choices = [torch.topk(probs[n], k) for n in range(N)]
    cap = layer.capacity(N)
    load = [0] * layer.n_experts
    out = torch.zeros_like(x)
    for rank in range(k):  # all first choices, then all second choices
        for n in range(N):
            p, idx = choices[n]
            e = int(idx[rank])
            if cap is not None and load[e] >= cap:
                continue
            load[e] += 1
            gate = p[rank] / p.sum() if k > 1 else p[rank]
            out[n] += gate * layer.experts[e](x[n : n + 1])[0]
    return out


@pytest.mark.parametrize("top_k, capacity_factor", [(1, None), (2, None), (1, 0.5), (2, 0.75)])
def test_dispatch_matches_naive_loop(top_k: int, capacity_factor: float | None) -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(n_embd=16, n_head=2, n_experts=4, top_k=top_k, capacity_factor=capacity_factor)
    layer = MoELayer(cfg)
    torch.nn.init.normal_(layer.router.weight, std=1.0)  # decisive, uneven routing
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        got = layer(x).reshape(-1, 16)
        want = naive_moe(layer, x.reshape(-1, 16))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    kept = layer.last_routing.kept
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * 12 * top_k / 4)
        counts = torch.bincount(layer.last_routing.experts[kept], minlength=4)
        assert counts.max() <= cap and not kept.all()  # some assignments were dropped
    else:
        assert kept.all()


def test_router_picks_top_k() -> None:
    torch.manual_seed(1)
    layer = MoELayer(MoEConfig(n_embd=8, n_head=2, n_experts=6, top_k=3))
    x = torch.randn(10, 8)
    routing = layer.route(x)
    want = torch.topk(layer.router(x), 3, dim=-1).indices
    torch.testing.assert_close(routing.experts, want)
    torch.testing.assert_close(routing.gates.sum(-1), torch.ones(10))
    assert torch.all(routing.gates[:, :-1] >= routing.gates[:, 1:])


def test_aux_loss_minimal_for_uniform_router_larger_for_collapsed() -> None:
    E = 4
    layer = MoELayer(MoEConfig(n_embd=8, n_head=2, n_experts=E, top_k=1))
    x = torch.randn(32, 8)
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform router: P_e = 1/E
        uniform = layer.route(x).aux_loss.item()
        layer.router.weight.zero_()
        layer.router.weight[0] = 100.0  # collapsed: expert 0 for every token
        collapsed = layer.route(x.abs()).aux_loss.item()
    assert uniform == pytest.approx(1.0)
    assert collapsed == pytest.approx(E, rel=1e-3)


def test_forward_backward_and_aux_in_loss() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(aux_loss_coef=0.1, capacity_factor=1.0)
    model = MoEGPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, cfg.vocab_size)
    torch.testing.assert_close(loss.detach(), model.last_ce_loss + 0.1 * model.last_aux_loss)
    loss.backward()
    router = model.blocks[0].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    _, none = model(idx)
    assert none is None and model.last_aux_loss is not None


def test_parameter_names_and_embeddings() -> None:
    model = build_model("moe_tiny", n_experts=3)
    names = {n for n, _ in model.named_parameters()}
    assert "blocks.0.mlp.router.weight" in names and "blocks.1.mlp.router.weight" in names
    assert "blocks.0.mlp.experts.2.fc.weight" in names
    assert "blocks.0.mlp.experts.3.fc.weight" not in names
    assert embedding_param_names(model) == {"tok_emb.weight", "pos_emb.weight", "lm_head.weight"}
    assert isinstance(model, MoEGPT)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_experts": 0}, "n_experts"),
        ({"n_experts": 2, "top_k": 3}, "top_k"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"aux_loss_coef": -1.0}, "aux_loss_coef"),
        ({"n_embd": 10, "n_head": 4}, "divisible"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kwargs)
