"""build_stream / build_eval_batches: every kind through the factory, and spec errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco.data import (
    BatchStream,
    DataConfig,
    MarkovConfig,
    build_eval_batches,
    build_stream,
    parse_data_spec,
)


def test_parse_spec() -> None:
    assert parse_data_spec("synthetic") == DataConfig()
    cfg = parse_data_spec("bin:/data/train.bin")
    assert cfg.kind == "bin" and cfg.path == "/data/train.bin" and cfg.held_out == 0.05
    assert parse_data_spec("digits").held_out == 0.2
    assert parse_data_spec("text:C:/x.txt").path == "C:/x.txt"  # only the first ':' splits
    with pytest.raises(ValueError, match="valid kinds: synthetic, text, bin, hf, digits"):
        parse_data_spec("parquet:/x")
    with pytest.raises(ValueError, match="needs a path"):
        parse_data_spec("text")
    with pytest.raises(ValueError, match="eval_fraction"):
        DataConfig(eval_fraction=1.5)
    with pytest.raises(ValueError, match="channels"):
        DataConfig(kind="images", path="x", channels=4)


def test_vocab_size_hint(tmp_path: Path) -> None:
    assert DataConfig(markov=MarkovConfig(vocab_size=16)).vocab_size == 16
    assert parse_data_spec("text:x").vocab_size == 256
    flat = tmp_path / "tokens.bin"
    flat.write_bytes(b"\x00\x00" * 8)
    assert parse_data_spec(f"bin:{flat}").vocab_size is None


def check(stream: BatchStream, x_shape: tuple[int, ...]) -> None:
    assert isinstance(stream, BatchStream)
    x, y = stream.next_batch()
    assert tuple(x.shape) == x_shape and stream.position == 1
    assert stream.state_dict()["position"] == 1


def test_every_kind(tmp_path: Path) -> None:
    kw = dict(learner=1, n_learners=2, batch_size=3, block_size=8, seed=0)
    ev = dict(n_batches=2, batch_size=3, block_size=8)
    check(build_stream("synthetic", **kw), (3, 8))
    assert len(build_eval_batches("synthetic", **ev)) == 2

    (tmp_path / "t.txt").write_text("abcdefgh" * 100)
    check(build_stream(f"text:{tmp_path}", **kw), (3, 8))
    assert len(build_eval_batches(f"text:{tmp_path / 't.txt'}", **ev)) == 2

    np.arange(500, dtype=np.uint32).tofile(tmp_path / "tok.bin")
    cfg = DataConfig(kind="bin", path=str(tmp_path / "tok.bin"), dtype="uint32")
    check(build_stream(cfg, **kw), (3, 8))
    x, _ = build_eval_batches(cfg, **ev)[0]
    assert x.min() >= 475  # windows from the held-out tail (last 5%)
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 1001)
    with pytest.raises(ValueError, match="not a multiple"):
        build_stream(DataConfig(kind="bin", path=str(tmp_path / "odd.bin"), dtype="uint32"), **kw)
    with pytest.raises(FileNotFoundError):
        build_stream(f"bin:{tmp_path / 'missing.bin'}", **kw)


def test_image_kinds(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    kw = dict(learner=0, n_learners=2, batch_size=4, block_size=8, seed=5)
    check(build_stream("digits", **kw), (4, 1, 8, 8))
    held_out = build_eval_batches("digits", n_batches=1, batch_size=1000, block_size=8, seed=9)
    assert sum(len(y) for _, y in held_out) == round(0.2 * 1797)
    # The held-out set never appears in a learner's batches, whatever the sampling seed.
    eval_images = torch.cat([x for x, _ in held_out]).flatten(1)
    stream = build_stream("digits", **kw)
    train = torch.cat([stream.next_batch()[0] for _ in range(20)]).flatten(1)
    overlap = (torch.cdist(train, eval_images) == 0).any(dim=1)
    # Digits has a few exact duplicate images; allow those but no systematic leak.
    assert overlap.float().mean() < 0.05


def test_hf_kind_reports_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match=r"pip install ddiloco\[hf\]"):
        build_stream(f"hf:{tmp_path}", learner=0, n_learners=1, batch_size=1, block_size=4)
    with pytest.raises(FileNotFoundError, match="save_to_disk"):
        build_stream(f"hf:{tmp_path / 'nope'}", learner=0, n_learners=1, batch_size=1, block_size=4)
