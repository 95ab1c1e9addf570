"""Training data for learners: per-learner deterministic streams and held-out eval sets.

Every stream has the :class:`~ddiloco.data.stream.BatchStream` interface
(``next_batch``, ``position``, ``state_dict``, ``load_state_dict``). ``build_stream``
builds one from a :class:`DataConfig` or a short spec string:

  ``synthetic``        Markov language with a known entropy floor (``data.synthetic``)
  ``text:PATH``        bytes of a text file or folder of .txt/.md files (``data.text``)
  ``bin:PATH``         nanoGPT-style token file, uint16 by default, or a folder of token
                       shards written by ``ddiloco prepare`` (``data.text``, ``data.prepare``)
  ``hf:PATH``          Hugging Face dataset saved on disk, one text column (``data.hf``)
  ``digits``           sklearn's bundled 8x8 digits (``data.images``)
  ``images:PATH``      class-per-subfolder PNG/JPEG folder (``data.images``)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddiloco.data.stream import BatchStream
from ddiloco.data.synthetic import MarkovConfig, MarkovLanguage, SyntheticStream, eval_batches

__all__ = [
    "BatchStream",
    "MarkovConfig",
    "MarkovLanguage",
    "SyntheticStream",
    "eval_batches",
    "DATA_KINDS",
    "DataConfig",
    "parse_data_spec",
    "build_stream",
    "build_eval_batches",
]

DATA_KINDS = ("synthetic", "text", "bin", "hf", "digits", "images")
"""Valid values of ``DataConfig.kind``."""
_PATH_KINDS = ("text", "bin", "hf", "images")
_DEFAULT_EVAL_FRACTION = {"text": 0.05, "bin": 0.05, "hf": 0.05, "digits": 0.2, "images": 0.2}


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Which data learners train on, and the options of that source."""

    kind: str = "synthetic"
    """One of DATA_KINDS."""
    path: str | None = None
    """File or folder; required for text, bin, hf and images."""
    markov: MarkovConfig = field(default_factory=MarkovConfig)
    """The synthetic language (kind "synthetic")."""
    eval_fraction: float | None = None
    """Held-out share of the data (not used by "synthetic", whose eval set is sampled
    afresh); None means 0.05 for token data, 0.2 for images."""
    dtype: str = "uint16"
    """Token id type of a .bin file (kind "bin")."""
    all_files: bool = False
    """Read every file of a text folder, not just .txt/.md (kind "text")."""
    text_column: str = "text"
    """Column holding the text (kind "hf")."""
    split: str | None = None
    """Split of a saved DatasetDict (kind "hf"); None picks "train"."""
    image_size: int | None = None
    """Resize folder images to this square size (kind "images")."""
    channels: int = 3
    """1 (grayscale) or 3 (RGB) for folder images (kind "images")."""
    split_seed: int = 0
    """Seed of the train/eval/shard split of images; kept apart from the sampling seed so
    that training and evaluation always agree on the split."""

    def __post_init__(self) -> None:
        if self.kind not in DATA_KINDS:
            raise ValueError(
                f"unknown data kind {self.kind!r}; valid kinds: {', '.join(DATA_KINDS)}"
            )
        if self.kind in _PATH_KINDS and not self.path:
            raise ValueError(
                f"data kind {self.kind!r} needs a path, e.g. '{self.kind}:/path/to/data'"
            )
        if self.eval_fraction is not None and not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")

    @property
    def held_out(self) -> float:
        """The eval fraction in effect."""
        if self.eval_fraction is not None:
            return self.eval_fraction
        return _DEFAULT_EVAL_FRACTION.get(self.kind, 0.0)

    @property
    def vocab_size(self) -> int | None:
        """Token vocabulary implied by the source (a ``ddiloco prepare`` folder's from its
        meta.json), or None (token files, images)."""
        if self.kind == "synthetic":
            return self.markov.vocab_size
        if self.kind == "bin" and self.path and Path(self.path).is_dir():
            from ddiloco.data.text import read_meta

            return int(read_meta(self.path)["vocab_size"])
        return 256 if self.kind in ("text", "hf") else None


def parse_data_spec(spec: str | DataConfig) -> DataConfig:
    """``"kind"`` or ``"kind:path"`` to a DataConfig; a DataConfig is returned as is."""
    if isinstance(spec, DataConfig):
        return spec
    kind, sep, path = spec.partition(":")
    return DataConfig(kind=kind.strip(), path=path if sep else None)


def _tokens(cfg: DataConfig) -> Any:
    from ddiloco.data import text

    if cfg.kind == "text":
        return text.load_text_bytes(cfg.path, all_files=cfg.all_files)  # type: ignore[arg-type]
    if cfg.kind == "bin":
        return text.load_token_bin(cfg.path, dtype=cfg.dtype)  # type: ignore[arg-type]
    from ddiloco.data.hf import load_hf_text_bytes

    return load_hf_text_bytes(
        cfg.path,
        text_column=cfg.text_column,  # type: ignore[arg-type]
        split=cfg.split,
    )


def _images(cfg: DataConfig) -> Any:
    from ddiloco.data import images

    if cfg.kind == "digits":
        return images.load_digits()
    return images.load_image_folder(
        cfg.path,
        image_size=cfg.image_size,  # type: ignore[arg-type]
        channels=cfg.channels,
    )


def build_stream(
    spec: str | DataConfig,
    *,
    learner: int,
    n_learners: int,
    batch_size: int,
    block_size: int,
    seed: int = 0,
) -> BatchStream:
    """Learner ``learner``'s training stream (of ``n_learners``) for ``spec``.
    ``block_size`` is ignored by image sources."""
    cfg = parse_data_spec(spec)
    if cfg.kind == "synthetic":
        return SyntheticStream(
            MarkovLanguage(cfg.markov),
            learner=learner,
            n_learners=n_learners,
            batch_size=batch_size,
            block_size=block_size,
            seed=seed,
        )
    if cfg.kind in ("digits", "images"):
        from ddiloco.data.images import ImageStream

        return ImageStream(
            _images(cfg),
            learner=learner,
            n_learners=n_learners,
            batch_size=batch_size,
            seed=seed,
            eval_fraction=cfg.held_out,
            split_seed=cfg.split_seed,
        )
    from ddiloco.data.text import TokenStream

    return TokenStream(
        _tokens(cfg),
        learner=learner,
        n_learners=n_learners,
        batch_size=batch_size,
        block_size=block_size,
        seed=seed,
        eval_fraction=cfg.held_out,
    )


def build_eval_batches(
    spec: str | DataConfig, *, n_batches: int, batch_size: int, block_size: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out eval set for ``spec``, disjoint from every learner's stream. For image
    sources the whole held-out split is returned and ``n_batches`` and ``seed`` are
    ignored."""
    cfg = parse_data_spec(spec)
    if cfg.kind == "synthetic":
        return eval_batches(
            MarkovLanguage(cfg.markov),
            n_batches=n_batches,
            batch_size=batch_size,
            block_size=block_size,
            seed=seed,
        )
    if cfg.kind in ("digits", "images"):
        from ddiloco.data.images import image_eval_batches

        return image_eval_batches(
            _images(cfg),
            batch_size=batch_size,
            split_seed=cfg.split_seed,
            eval_fraction=cfg.held_out,
        )
    from ddiloco.data.text import token_eval_batches

    return token_eval_batches(
        _tokens(cfg),
        n_batches=n_batches,
        batch_size=batch_size,
        block_size=block_size,
        seed=seed,
        eval_fraction=cfg.held_out,
    )
