"""GPT: config validation, parameter names, determinism, forward/backward, registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ddiloco.models import (
    GPT,
    MODEL_PRESETS,
    GPTConfig,
    build_config,
    build_model,
    embedding_param_names,
    gpt_tiny,
)


def test_parameter_names_follow_the_public_convention() -> None:
    model = GPT(GPTConfig(n_layer=2))
    names = {n for n, _ in model.named_parameters()}
    expected = {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"}
    for i in range(2):
        for sub in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc", "mlp.proj"):
            expected |= {f"blocks.{i}.{sub}.weight", f"blocks.{i}.{sub}.bias"}
    assert names == expected


def test_no_bias_drops_bias_parameters() -> None:
    model = GPT(GPTConfig(bias=False))
    assert not any(n.endswith(".bias") for n, _ in model.named_parameters())


def test_forward_shapes_loss_and_backward() -> None:
    torch.manual_seed(0)
    cfg = gpt_tiny()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, cfg.vocab_size) and loss is None
    logits, loss = model(idx, idx)
    assert loss is not None and loss.ndim == 0
    # Small init: the initial loss is close to ln V (uniform prediction).
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.3
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny()).eval()
    idx = torch.randint(0, 64, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 64
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_init_is_deterministic_given_the_seed() -> None:
    torch.manual_seed(123)
    a = GPT(gpt_tiny()).state_dict()
    torch.manual_seed(123)
    b = GPT(gpt_tiny()).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sequence_longer_than_block_size_is_rejected() -> None:
    model = GPT(GPTConfig(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_embd": 64, "n_head": 6}, "divisible by n_head"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"n_layer": -1}, "n_layer"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_embedding_names_untied_and_tied() -> None:
    model = GPT(gpt_tiny())
    assert model.embedding_param_names() == {"tok_emb.weight", "pos_emb.weight", "lm_head.weight"}
    assert embedding_param_names(model) == model.embedding_param_names()
    tied = GPT(GPTConfig(tie_weights=True))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert embedding_param_names(tied) == {"tok_emb.weight", "pos_emb.weight"}
    assert embedding_param_names(tied) <= {n for n, _ in tied.named_parameters()}


def test_embedding_names_fallback_for_foreign_models() -> None:
    class Foreign(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(10, 4)
            self.body = nn.Linear(4, 4)
            self.unembed = nn.Linear(4, 10, bias=False)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.emb = nn.Embedding(10, 4)
            self.out.weight = self.emb.weight  # registered first under "out.weight"

    assert embedding_param_names(Foreign()) == {"wte.weight", "unembed.weight"}
    assert embedding_param_names(Tied()) == {"out.weight"}


def test_registry_builds_presets_with_overrides() -> None:
    model = build_model("gpt_tiny", n_layer=3)
    assert isinstance(model, GPT) and len(model.blocks) == 3
    assert build_config("gpt_125m").n_embd == 768
    with pytest.raises(ValueError, match="valid names: .*gpt_tiny"):
        build_model("gpt_huge")
    with pytest.raises(ValueError, match="unknown field"):
        build_model("gpt_tiny", n_layers=3)
    assert {"gpt_tiny", "gpt_small", "gpt_125m"} <= set(MODEL_PRESETS)


def test_preset_sizes() -> None:
    # Count parameters from shapes only (building gpt_125m takes a while on CPU).
    def count(cfg: GPTConfig) -> int:
        d, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
        block = 12 * d * d + 13 * d  # qkv, proj, fc, proj weights + biases, two LayerNorms
        return V * d + T * d + L * block + 2 * d + (0 if cfg.tie_weights else V * d)

    assert count(build_config("gpt_tiny")) == GPT(gpt_tiny()).num_params()
    assert 9e6 < count(build_config("gpt_small")) < 12e6
    assert 95e6 < count(build_config("gpt_100m")) < 105e6
    assert 120e6 < count(build_config("gpt_125m")) < 130e6
