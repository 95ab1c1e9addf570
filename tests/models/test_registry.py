"""The model registry: every preset says what it learns from, and the configuration and
the recipe read that instead of the preset's name."""

from __future__ import annotations

import pytest

from ddiloco.config import TrainConfig
from ddiloco.models import MODEL_PRESETS, TASKS, model_task, register_model
from ddiloco.models.gpt import GPT, gpt_tiny
from ddiloco.recipe import is_image_model, tokens_per_step


def test_every_preset_has_a_task():
    tasks = {name: p.task for name, p in MODEL_PRESETS.items()}
    assert set(tasks.values()) == set(TASKS)
    assert {n for n, t in tasks.items() if t == "image"} == {"vit_digits", "vit_tiny_rgb"}
    with pytest.raises(ValueError, match="unknown model preset 'gpt_huge'; valid names: gpt_100m"):
        model_task("gpt_huge")
    with pytest.raises(ValueError, match="already registered"):
        register_model("gpt_tiny", gpt_tiny, GPT, "text")
    with pytest.raises(ValueError, match="task must be one of"):
        register_model("gpt_audio", gpt_tiny, GPT, "audio")  # type: ignore[arg-type]
    assert "gpt_audio" not in MODEL_PRESETS


def test_the_task_decides_the_data_and_the_tokens_per_step():
    text = TrainConfig(batch_size=4, block_size=16)
    image = TrainConfig(model="vit_digits", data="digits", batch_size=4)
    assert not is_image_model(text) and is_image_model(image)
    assert tokens_per_step(text) == 64 and tokens_per_step(image) == 4
    with pytest.raises(ValueError, match="image models .* need image data"):
        TrainConfig(model="vit_digits")
    with pytest.raises(ValueError, match="does not fit data.source 'digits'"):
        TrainConfig(data="digits")
