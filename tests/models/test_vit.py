"""ViT: shapes, names, embeddings, validation, and that it learns the digits."""

from __future__ import annotations

import pytest
import torch

from ddiloco.models import ViT, ViTConfig, build_model, embedding_param_names


def test_forward_backward_shapes() -> None:
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, patch_size=4, in_channels=3, n_classes=5))
    images, labels = torch.rand(3, 3, 8, 8), torch.tensor([0, 4, 2])
    logits, loss = model(images, labels)
    assert logits.shape == (3, 5) and loss is not None and loss.ndim == 0
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model(images)[1] is None
    with pytest.raises(ValueError, match="expected images of shape"):
        model(torch.rand(3, 1, 8, 8))


def test_attention_is_bidirectional() -> None:
    torch.manual_seed(0)
    model = ViT(ViTConfig()).eval()
    a = torch.rand(1, 1, 8, 8)
    b = a.clone()
    b[..., -2:, -2:] += 1.0  # only the last patch changes; the cls token must see it
    assert not torch.allclose(model(a)[0], model(b)[0])


def test_parameter_names_and_embeddings() -> None:
    model = build_model("vit_digits")
    names = {n for n, _ in model.named_parameters()}
    assert {
        "patch_emb.weight",
        "cls_token",
        "pos_emb",
        "head.weight",
        "blocks.0.attn.qkv.weight",
        "blocks.1.mlp.fc.weight",
        "ln_f.weight",
    } <= names
    assert embedding_param_names(model) == {
        "patch_emb.weight",
        "patch_emb.bias",
        "cls_token",
        "pos_emb",
        "head.weight",
        "head.bias",
    }
    no_bias = ViT(ViTConfig(bias=False))
    assert embedding_param_names(no_bias) == {
        "patch_emb.weight",
        "cls_token",
        "pos_emb",
        "head.weight",
    }


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"patch_size": 3}, "must divide"),
        ({"n_embd": 30, "n_head": 4}, "divisible"),
        ({"n_classes": 0}, "n_classes"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ViTConfig(**kwargs)


def test_learns_digits() -> None:
    pytest.importorskip("sklearn")
    from ddiloco.data.images import ImageStream, image_eval_batches, load_digits

    data = load_digits()
    torch.manual_seed(0)
    model = ViT(ViTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = ImageStream(data, learner=0, n_learners=1, batch_size=32)
    for _ in range(150):
        x, y = stream.next_batch()
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        ev = image_eval_batches(data, batch_size=256)
        correct = sum((model(x)[0].argmax(-1) == y).sum().item() for x, y in ev)
    accuracy = correct / sum(len(y) for _, y in ev)
    assert accuracy > 0.3  # chance is 0.1
