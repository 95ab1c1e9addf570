"""The data source registry: every kind states its task, whether it needs a path and its
held-out share; the configuration, the recipe and the engines read those."""

from __future__ import annotations

import pytest

from ddiloco.config import TrainConfig
from ddiloco.data import (
    DATA_KINDS,
    DATA_SOURCES,
    DataSource,
    build_eval_batches,
    parse_data_spec,
    register_source,
)
from ddiloco.recipe import tokens_per_step


def test_every_kind_is_a_registered_source(tmp_path):
    assert DATA_KINDS == ("synthetic", "text", "bin", "hf", "digits", "images")
    assert {k for k, s in DATA_SOURCES.items() if s.task == "image"} == {"digits", "images"}
    assert {k for k, s in DATA_SOURCES.items() if s.needs_path} == {"text", "bin", "hf", "images"}
    assert {k: parse_data_spec(f"{k}:x").held_out for k in DATA_KINDS} == {
        "synthetic": 0.0,
        "text": 0.05,
        "bin": 0.05,
        "hf": 0.05,
        "digits": 0.2,
        "images": 0.2,
    }
    assert parse_data_spec("synthetic").vocab_size == 64
    flat = tmp_path / "tokens.bin"
    flat.write_bytes(b"\x00\x00" * 8)
    assert parse_data_spec("text:x").vocab_size == 256
    assert parse_data_spec(f"bin:{flat}").vocab_size is None  # a flat file names none
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_data_spec("bin:x").vocab_size  # noqa: B018
    with pytest.raises(ValueError, match="unknown data kind 'csv'; valid kinds: synthetic, text"):
        parse_data_spec("csv:x")
    with pytest.raises(ValueError, match="needs a path"):
        parse_data_spec("images")
    s = DATA_SOURCES["digits"]
    with pytest.raises(ValueError, match="already registered"):
        register_source(DataSource("digits", "image", s.stream, s.eval_batches))


def test_a_source_builds_through_its_entry():
    held_out = build_eval_batches("digits", n_batches=1, batch_size=4096, block_size=8)
    assert sum(len(y) for _, y in held_out) == round(0.2 * 1797)
    cfg = TrainConfig(model="vit_digits", data="digits", batch_size=8)
    assert parse_data_spec(cfg.data.source).task == "image" and tokens_per_step(cfg) == 8
