"""Image data: digits, image folders, split, streams, resume, and every error case."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco.data.images import (
    ImageData,
    ImageStream,
    image_eval_batches,
    load_digits,
    load_image_folder,
    split_indices,
)


def small_data(n: int = 40) -> ImageData:
    images = torch.arange(n, dtype=torch.float32).reshape(n, 1, 1, 1).expand(n, 1, 2, 2)
    return ImageData(
        images=images.contiguous(), labels=torch.arange(n) % 3, class_names=["a", "b", "c"]
    )


def test_digits() -> None:
    pytest.importorskip("sklearn")
    data = load_digits()
    assert data.images.shape == (1797, 1, 8, 8) and data.images.dtype == torch.float32
    assert 0.0 <= data.images.min() and data.images.max() <= 1.0
    assert set(data.labels.tolist()) == set(range(10))


def test_split_is_disjoint_and_covers_everything() -> None:
    held_out, shards = split_indices(103, n_learners=4, eval_fraction=0.2, seed=0)
    assert len(held_out) == 21
    everything = np.concatenate([held_out, *shards])
    assert sorted(everything.tolist()) == list(range(103))
    again, _ = split_indices(103, n_learners=4, eval_fraction=0.2, seed=0)
    np.testing.assert_array_equal(held_out, again)
    with pytest.raises(ValueError, match="fewer learners"):
        split_indices(5, n_learners=8, eval_fraction=0.2, seed=0)
    with pytest.raises(ValueError, match="eval_fraction"):
        split_indices(5, n_learners=1, eval_fraction=1.0, seed=0)


def test_stream_draws_only_from_its_shard_and_resumes() -> None:
    data = small_data()
    streams = [ImageStream(data, learner=m, n_learners=2, batch_size=4) for m in range(2)]
    held_out = {int(v) for v in image_eval_batches(data, batch_size=100)[0][0][:, 0, 0, 0]}
    seen = []
    for s in streams:
        ids = {int(v) for _ in range(20) for v in s.next_batch()[0][:, 0, 0, 0]}
        assert ids <= set(s.shard.tolist())
        seen.append(ids)
    assert not seen[0] & seen[1] and not (seen[0] | seen[1]) & held_out
    ref = ImageStream(data, learner=1, n_learners=2, batch_size=4)
    batches = [ref.next_batch() for _ in range(6)]
    resumed = ImageStream(data, learner=1, n_learners=2, batch_size=4)
    resumed.load_state_dict({**ref.state_dict(), "position": 3})
    assert resumed.position == 3
    for x, y in batches[3:]:
        rx, ry = resumed.next_batch()
        assert torch.equal(rx, x) and torch.equal(ry, y)
    with pytest.raises(ValueError, match="learner"):
        streams[0].load_state_dict(ref.state_dict())


def test_stream_validation() -> None:
    with pytest.raises(ValueError, match="learner"):
        ImageStream(small_data(), learner=3, n_learners=2, batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        ImageStream(small_data(), learner=0, n_learners=1, batch_size=0)
    with pytest.raises(ValueError, match="no held-out"):
        image_eval_batches(small_data(), batch_size=4, eval_fraction=0.0)
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        ImageData(images=torch.zeros(3, 4), labels=torch.zeros(3), class_names=[])


def write_folder(root: Path, size: tuple[int, int] = (6, 6)) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls, n in (("cat", 3), ("dog", 2)):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            arr = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / cls / f"{i}.{'png' if i % 2 else 'jpg'}")
    (root / "cat" / "notes.txt").write_text("not an image")


def test_image_folder(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    write_folder(tmp_path)
    data = load_image_folder(tmp_path)
    assert data.images.shape == (5, 3, 6, 6) and data.class_names == ["cat", "dog"]
    assert data.labels.tolist() == [0, 0, 0, 1, 1]
    gray = load_image_folder(tmp_path, image_size=4, channels=1)
    assert gray.images.shape == (5, 1, 4, 4)
    stream = ImageStream(data, learner=0, n_learners=2, batch_size=2, eval_fraction=0.2)
    assert stream.next_batch()[0].shape == (2, 3, 6, 6)


def test_image_folder_errors(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_image_folder(tmp_path / "missing")
    (tmp_path / "file.png").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        load_image_folder(tmp_path / "file.png")
    with pytest.raises(ValueError, match="no class subfolders"):
        load_image_folder(tmp_path)
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(ValueError, match="no .* images"):
        load_image_folder(tmp_path)
    with pytest.raises(ValueError, match="channels"):
        load_image_folder(tmp_path, channels=2)
    mixed = tmp_path / "mixed"
    write_folder(mixed)
    from PIL import Image

    Image.new("RGB", (5, 5)).save(mixed / "dog" / "odd.png")
    with pytest.raises(ValueError, match="image_size"):
        load_image_folder(mixed)
    assert load_image_folder(mixed, image_size=5).images.shape == (6, 3, 5, 5)
