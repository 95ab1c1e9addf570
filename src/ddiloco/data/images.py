"""Image classification data: sklearn's bundled digits and class-per-subfolder folders.

Sources:
  - ``load_digits()``: the 1,797 8x8 grayscale digits shipped inside scikit-learn (no
    download), scaled to [0, 1].
  - ``load_image_folder(path)``: ``path/<class>/<image>`` with PNG or JPEG files (read with
    Pillow); class names are the sorted subfolder names, label = index in that order.

Split: a permutation keyed by ``split_seed`` puts the first ``eval_fraction`` of the
examples in the held-out set and deals the rest into ``n_learners`` contiguous, disjoint
shards. The split depends only on (N, split_seed, eval_fraction, n_learners), not on the
sampling ``seed``, so every learner and the evaluator agree on it without talking to each
other, whatever seeds they sample with. The held-out set does not depend on n_learners.

Batches: batch ``b`` of learner ``m`` draws ``batch_size`` examples of its shard (without
replacement within the batch when the shard is large enough) from the random stream keyed
(seed, TRAIN, m, b), so resuming at any position needs no replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddiloco.data.stream import TRAIN, check_learner, check_state, rng_for

__all__ = [
    "ImageData",
    "load_digits",
    "load_image_folder",
    "split_indices",
    "ImageStream",
    "image_eval_batches",
    "IMAGE_SUFFIXES",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
"""File suffixes read by :func:`load_image_folder` (case-insensitive)."""
_SPLIT = 4  # key domain of the train/eval/shard permutation (TRAIN = 0, EVAL = 1)


@dataclass(slots=True)
class ImageData:
    """A labelled image set held in memory."""

    images: torch.Tensor
    """float32 [N, C, H, W], values in [0, 1]."""
    labels: torch.Tensor
    """int64 [N], in [0, len(class_names))."""
    class_names: list[str]
    """Name of each label."""

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"images must be [N, C, H, W] and labels [N]; got "
                f"{list(self.images.shape)} and {list(self.labels.shape)}"
            )


def load_digits() -> ImageData:
    """sklearn's bundled 8x8 digits: images [1797, 1, 8, 8] in [0, 1], labels 0-9."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        raise ImportError("the digits dataset needs scikit-learn: pip install scikit-learn") from e
    digits = sk_load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    return ImageData(images=images, labels=labels, class_names=[str(i) for i in range(10)])


def load_image_folder(
    path: str | Path, *, image_size: int | None = None, channels: int = 3
) -> ImageData:
    """Images under ``path/<class>/`` (files ending in .png/.jpg/.jpeg, searched
    recursively inside each class folder), converted to ``channels`` (1 or 3) and, when
    ``image_size`` is given, resized to image_size x image_size. Without ``image_size``
    all images must have the same size."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(
            f"image folder {root} does not exist; pass a folder laid out "
            f"as <folder>/<class name>/<image>.png"
        )
    if not root.is_dir():
        raise ValueError(
            f"{root} is a file; pass a folder laid out as <folder>/<class name>/<image>.png"
        )
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError("reading image folders needs Pillow: pip install pillow") from e
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir())
    if not class_dirs:
        raise ValueError(
            f"{root} has no class subfolders; lay it out as {root}/<class name>/<image>.png"
        )
    arrays: list[np.ndarray] = []
    labels: list[int] = []
    for label, class_dir in enumerate(class_dirs):
        files = sorted(
            f for f in class_dir.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
        )
        for f in files:
            with Image.open(f) as img:
                img = img.convert("L" if channels == 1 else "RGB")
                if image_size is not None:
                    img = img.resize((image_size, image_size))
                arr = np.asarray(img, dtype=np.float32) / 255.0
            arrays.append(arr[None] if channels == 1 else arr.transpose(2, 0, 1))
            labels.append(label)
    if not arrays:
        raise ValueError(
            f"no {'/'.join(IMAGE_SUFFIXES)} images under {root}/<class>/; "
            f"check the folder layout and file types"
        )
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(
            f"images under {root} have different sizes {sorted(shapes)[:3]}...; "
            f"pass image_size=... to resize them all"
        )
    return ImageData(
        images=torch.from_numpy(np.stack(arrays)),
        labels=torch.tensor(labels, dtype=torch.int64),
        class_names=[d.name for d in class_dirs],
    )


def split_indices(
    n: int, *, n_learners: int, eval_fraction: float, seed: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """(held-out indices, one index array per learner) of a random split of ``n``
    examples; the learners' shards are disjoint and exclude the held-out set."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    perm = rng_for(seed, _SPLIT).permutation(n)
    n_eval = int(round(eval_fraction * n))
    if eval_fraction > 0:
        n_eval = max(n_eval, 1)
    shards = np.array_split(perm[n_eval:], n_learners)
    if min(len(s) for s in shards) == 0:
        raise ValueError(
            f"{n - n_eval} training examples cannot fill {n_learners} learner "
            f"shards; use fewer learners, more data or a smaller eval_fraction"
        )
    return perm[:n_eval], shards


class ImageStream:
    """Learner ``m``'s deterministic stream of (images [B, C, H, W], labels [B]) batches
    from its shard of ``data`` (see the module docstring for split and sampling)."""

    def __init__(
        self,
        data: ImageData,
        *,
        learner: int,
        n_learners: int,
        batch_size: int,
        seed: int = 0,
        eval_fraction: float = 0.2,
        split_seed: int = 0,
    ) -> None:
        check_learner(learner, n_learners)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.data = data
        self.learner, self.n_learners = learner, n_learners
        self.batch_size, self.seed, self.eval_fraction = batch_size, seed, eval_fraction
        self.split_seed = split_seed
        _, shards = split_indices(
            len(data.labels), n_learners=n_learners, eval_fraction=eval_fraction, seed=split_seed
        )
        self.shard = torch.from_numpy(shards[learner])
        """Indices into ``data`` of this learner's examples."""
        self._position = 0

    @property
    def position(self) -> int:
        return self._position

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rng = rng_for(self.seed, TRAIN, self.learner, self._position)
        n = len(self.shard)
        pick = rng.choice(n, size=self.batch_size, replace=n < self.batch_size)
        idx = self.shard[torch.from_numpy(pick)]
        self._position += 1
        return self.data.images[idx], self.data.labels[idx]

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "images",
            "position": self._position,
            "learner": self.learner,
            "n_learners": self.n_learners,
            "seed": self.seed,
            "split_seed": self.split_seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._position = check_state(
            state,
            {
                "kind": "images",
                "learner": self.learner,
                "n_learners": self.n_learners,
                "seed": self.seed,
                "split_seed": self.split_seed,
            },
        )


def image_eval_batches(
    data: ImageData, *, batch_size: int, split_seed: int = 0, eval_fraction: float = 0.2
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out examples of the split keyed by ``split_seed`` (the same split
    :class:`ImageStream` uses), in fixed order, as batches (the last may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    held_out, _ = split_indices(
        len(data.labels), n_learners=1, eval_fraction=eval_fraction, seed=split_seed
    )
    if len(held_out) == 0:
        raise ValueError("eval_fraction is 0: there is no held-out set; use eval_fraction > 0")
    idx = torch.from_numpy(held_out)
    return [(data.images[i], data.labels[i]) for i in idx.split(batch_size)]
