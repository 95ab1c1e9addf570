"""The recipe both engines share: the run's model, inner optimizer, data source and
evaluation, built from a ``TrainConfig``. The in-process engine and the real learner
processes call the same builders, so both train the same thing."""

from __future__ import annotations

import dataclasses

import torch

from ddiloco.algorithm.fragments import Fragmentation, fragment_model
from ddiloco.config import TrainConfig
from ddiloco.data import DataConfig, build_eval_batches, parse_data_spec
from ddiloco.data.synthetic import MarkovConfig, MarkovLanguage
from ddiloco.models import build_model, embedding_param_names, model_task

__all__ = [
    "make_language",
    "data_config",
    "eval_setup",
    "is_image_model",
    "model_record",
    "new_model",
    "new_optimizer",
    "set_lr",
    "autocast",
    "evaluate",
    "evaluate_metrics",
    "fragmentation_for",
    "tokens_per_step",
]


def make_language(cfg: TrainConfig) -> MarkovLanguage:
    return MarkovLanguage(MarkovConfig(vocab_size=cfg.data.vocab_size, seed=cfg.seed))


def data_config(cfg: TrainConfig) -> DataConfig:
    """The run's data source; the synthetic language takes its size and seed from ``cfg``."""
    d = parse_data_spec(cfg.data.source)
    if d.kind == "synthetic":
        return DataConfig(
            kind="synthetic", markov=MarkovConfig(vocab_size=cfg.data.vocab_size, seed=cfg.seed)
        )
    return dataclasses.replace(d, sharding=cfg.data.sharding, shard_block=cfg.data.shard_block)


def eval_setup(cfg: TrainConfig) -> tuple[DataConfig, MarkovLanguage | None, float | None, list]:
    """The run's data source, its synthetic language (None for other data), the entropy
    floor of the eval sequences (None without a known floor) and the held-out batches."""
    data = data_config(cfg)
    lang = MarkovLanguage(data.markov) if data.kind == "synthetic" else None
    floor = lang.sequence_floor(cfg.data.block_size) if lang is not None else None
    evals = build_eval_batches(
        data,
        n_batches=cfg.optim.eval_batches,
        batch_size=cfg.data.batch_size,
        block_size=cfg.data.block_size,
        seed=cfg.seed,
    )
    return data, lang, floor, evals


def is_image_model(cfg: TrainConfig) -> bool:
    return model_task(cfg.model.name) == "image"


def model_record(cfg: TrainConfig) -> dict:
    """The run's model as ``{"name": preset, "args": {field: value}}``:
    ``build_model(name, **args)`` builds it (``ddiloco.load_model`` reads this record from
    a run directory or an exported file). A text model's vocabulary is its data's (a
    ``bin:`` folder's ``meta.json``; 256 for bytes) or, for the synthetic language,
    ``data.vocab_size``; a data path that does not exist is an error."""
    if is_image_model(cfg):
        return {"name": cfg.model.name, "args": {}}
    vocab = data_config(cfg).vocab_size or cfg.data.vocab_size
    return {
        "name": cfg.model.name,
        "args": {"vocab_size": int(vocab), "block_size": int(cfg.data.block_size)},
    }


def new_model(cfg: TrainConfig) -> torch.nn.Module:
    rec = model_record(cfg)
    torch.manual_seed(cfg.seed)
    return build_model(rec["name"], **rec["args"])


def new_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.optim.inner_optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.optim.inner_lr)
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.inner_lr,
        betas=(0.9, 0.95),
        weight_decay=cfg.optim.weight_decay,
    )


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def autocast(cfg: TrainConfig, device_type: str = "cpu") -> torch.autocast:
    """The inner step's forward precision (``runtime.autocast``), the same in both engines:
    bf16 autocast on CPU and CUDA alike, or off. Evaluation stays in fp32."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.runtime.autocast == "bf16")


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches) -> float:
    return evaluate_metrics(model, batches)[0]


@torch.no_grad()
def evaluate_metrics(model: torch.nn.Module, batches) -> tuple[float, float | None]:
    """Mean held-out loss, and accuracy: of the class for classifiers, of the next token
    (the argmax of the logits against the target) for language models."""
    was = model.training
    model.eval()
    loss = correct = count = 0.0
    for x, y in batches:
        logits, batch_loss = model(x, y)
        loss += float(batch_loss)
        if logits.shape[:-1] == y.shape:  # [B, classes] or [B, T, V] against [B] or [B, T]
            correct += float((logits.argmax(-1) == y).sum())
            count += y.numel()
    model.train(was)
    return loss / len(batches), (correct / count if count else None)


def fragmentation_for(
    cfg: TrainConfig, model: torch.nn.Module, P: int | None = None
) -> Fragmentation:  # noqa: N803
    return fragment_model(
        model,
        P if P is not None else cfg.sync.fragments,
        cfg.sync.fragmentation,
        embedding_param_names(model),
    )


def tokens_per_step(cfg: TrainConfig) -> int:
    """Tokens (images for image models) one learner consumes per inner step."""
    return cfg.data.batch_size if is_image_model(cfg) else cfg.data.batch_size * cfg.data.block_size
