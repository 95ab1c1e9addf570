"""Hugging Face datasets on disk (skipped unless the optional 'datasets' is installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from ddiloco.data.hf import hf_stream, load_hf_text_bytes  # noqa: E402


def test_saved_dataset_and_dataset_dict(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_dict({"text": ["héllo", "world"] * 50, "n": list(range(100))})
    ds.save_to_disk(str(tmp_path / "ds"))
    data = load_hf_text_bytes(tmp_path / "ds")
    assert data.tobytes().startswith("héllo\nworld".encode())
    stream = hf_stream(tmp_path / "ds", learner=0, n_learners=2, batch_size=2, block_size=8)
    assert stream.next_batch()[0].shape == (2, 8)
    with pytest.raises(ValueError, match="no column 'body'"):
        load_hf_text_bytes(tmp_path / "ds", text_column="body")
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_hf_text_bytes(tmp_path / "dd")) == len(data)
    with pytest.raises(ValueError, match="pass split="):
        load_hf_text_bytes(tmp_path / "dd", split="validation")


def test_rows_are_streamed_in_batches_and_joined_by_newlines(tmp_path: Path) -> None:
    rows = [f"row {i} ü" if i % 7 else "" for i in range(2500)]  # three batches of rows
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "ds"))
    assert load_hf_text_bytes(tmp_path / "ds").tobytes() == "\n".join(rows).encode()
    datasets.Dataset.from_dict({"text": [""]}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="is empty"):
        load_hf_text_bytes(tmp_path / "empty")
