"""Training data for learners: per-learner deterministic streams and held-out eval sets.

Every stream has the :class:`~ddiloco.data.stream.BatchStream` interface
(``next_batch``, ``position``, ``state_dict``, ``load_state_dict``). ``build_stream``
builds one from a :class:`DataConfig` or a short spec string:

  ``synthetic``        Markov language with a known entropy floor (``data.synthetic``)
  ``text:PATH``        bytes of a text file or folder of .txt/.md files (``data.text``)
  ``bin:PATH``         nanoGPT-style token file, uint16 by default, or a folder of token
                       shards written by ``ddiloco prepare`` (``data.text``, ``data.prepare``),
                       whose held-out sources, if any, are its eval set
  ``hf:PATH``          Hugging Face dataset saved on disk, one text column (``data.hf``)
  ``digits``           sklearn's bundled 8x8 digits (``data.images``)
  ``images:PATH``      class-per-subfolder PNG/JPEG folder (``data.images``)

Each kind is a ``DataSource`` in ``DATA_SOURCES`` (its task, whether it needs a path, its
held-out share, its stream and eval builders); a new kind is one ``register_source`` call
here, with its loading code in its own module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ddiloco.data.stream import DEFAULT_SHARD_BLOCK, SHARDINGS, BatchStream
from ddiloco.data.synthetic import MarkovConfig, MarkovLanguage, SyntheticStream, eval_batches

__all__ = [
    "BatchStream",
    "MarkovConfig",
    "MarkovLanguage",
    "SyntheticStream",
    "eval_batches",
    "DATA_KINDS",
    "DATA_SOURCES",
    "DataConfig",
    "DataSource",
    "register_source",
    "parse_data_spec",
    "build_stream",
    "build_eval_batches",
]

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class DataSource:
    """One data kind: what it trains, what it needs and how its streams are built."""

    name: str
    """``DataConfig.kind`` (the part of a spec before ``:``)."""
    task: Literal["text", "image"]
    """What it feeds: token sequences (``text``) or labelled images (``image``); a model
    trains on data of its own task (``ddiloco.models.model_task``)."""
    stream: Callable[..., BatchStream]
    """``(cfg, *, learner, n_learners, batch_size, block_size, seed)``: a learner's stream."""
    eval_batches: Callable[..., Batches]
    """``(cfg, *, n_batches, batch_size, block_size, seed)``: the held-out eval set."""
    needs_path: bool = True
    """Whether ``DataConfig.path`` must be set."""
    eval_fraction: float = 0.0
    """Held-out share when ``DataConfig.eval_fraction`` is unset."""
    vocab_size: Callable[[DataConfig], int | None] = lambda cfg: None
    """The token vocabulary the source implies, or None."""
    eval_tokens: Callable[[DataConfig], int | None] = lambda cfg: None
    """The length of a held-out tail the data itself declares (a ``ddiloco prepare``
    folder's held-out sources), or None: the eval fraction applies."""


DATA_SOURCES: dict[str, DataSource] = {}
"""Every data kind by name."""


def register_source(source: DataSource) -> DataSource:
    """Add ``source`` under its name; returns it."""
    if source.name in DATA_SOURCES:
        raise ValueError(f"data kind {source.name!r} is already registered")
    DATA_SOURCES[source.name] = source
    return source


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
    afresh); None means the held-out sources of a ``ddiloco prepare`` folder that has
    them (``--held-out``), else 0.05 for token data, 0.2 for images."""
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
    sharding: str = "interleaved"
    """How token data is shared among learners: "interleaved" (blocks of ``shard_block``
    tokens dealt round-robin, so every learner samples the whole corpus) or "contiguous"
    (one run of the corpus each); see ``data.text``."""
    shard_block: int = DEFAULT_SHARD_BLOCK
    """Tokens per block of the interleaved sharding."""

    def __post_init__(self) -> None:
        if self.kind not in DATA_SOURCES:
            raise ValueError(
                f"unknown data kind {self.kind!r}; valid kinds: {', '.join(DATA_SOURCES)}"
            )
        if self.source.needs_path and not self.path:
            raise ValueError(
                f"data kind {self.kind!r} needs a path, e.g. '{self.kind}:/path/to/data'"
            )
        if self.eval_fraction is not None and not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.shard_block < 2:
            raise ValueError(f"shard_block must be >= 2 tokens, got {self.shard_block}")

    @property
    def source(self) -> DataSource:
        """The registered source of this kind."""
        return DATA_SOURCES[self.kind]

    @property
    def task(self) -> Literal["text", "image"]:
        """What the source feeds: ``text`` or ``image``."""
        return self.source.task

    @property
    def held_out(self) -> float:
        """The eval fraction in effect."""
        if self.eval_fraction is not None:
            return self.eval_fraction
        return self.source.eval_fraction

    @property
    def held_out_tokens(self) -> int | None:
        """Length of the held-out tail the data declares (a ``ddiloco prepare`` folder
        written with ``--held-out``), used when ``eval_fraction`` is unset; else None."""
        if self.eval_fraction is not None:
            return None
        return self.source.eval_tokens(self)

    @property
    def vocab_size(self) -> int | None:
        """Token vocabulary implied by the source (a ``ddiloco prepare`` folder's from its
        meta.json), or None (token files, images)."""
        return self.source.vocab_size(self)


def parse_data_spec(spec: str | DataConfig) -> DataConfig:
    """``"kind"`` or ``"kind:path"`` to a DataConfig; a DataConfig is returned as is."""
    if isinstance(spec, DataConfig):
        return spec
    kind, sep, path = spec.partition(":")
    return DataConfig(kind=kind.strip(), path=path if sep else None)


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
    return cfg.source.stream(
        cfg,
        learner=learner,
        n_learners=n_learners,
        batch_size=batch_size,
        block_size=block_size,
        seed=seed,
    )


def build_eval_batches(
    spec: str | DataConfig, *, n_batches: int, batch_size: int, block_size: int, seed: int = 0
) -> Batches:
    """The held-out eval set for ``spec``, disjoint from every learner's stream. For image
    sources the whole held-out split is returned and ``n_batches`` and ``seed`` are
    ignored."""
    cfg = parse_data_spec(spec)
    return cfg.source.eval_batches(
        cfg, n_batches=n_batches, batch_size=batch_size, block_size=block_size, seed=seed
    )


# -- the built-in sources ----------------------------------------------------------------------
def _synthetic_stream(cfg: DataConfig, **kw: Any) -> BatchStream:
    return SyntheticStream(MarkovLanguage(cfg.markov), **kw)


def _synthetic_eval(cfg: DataConfig, **kw: Any) -> Batches:
    return eval_batches(MarkovLanguage(cfg.markov), **kw)


def _token_source(name: str, load: Callable[[DataConfig], Any], **kw: Any) -> DataSource:
    """A source of token sequences: ``load(cfg)`` gives the tokens (``data.text``)."""

    def stream(cfg: DataConfig, **args: Any) -> BatchStream:
        from ddiloco.data.text import TokenStream

        return TokenStream(
            load(cfg),
            eval_fraction=cfg.held_out,
            eval_tokens=cfg.held_out_tokens,
            sharding=cfg.sharding,
            shard_block=cfg.shard_block,
            **args,
        )

    def held_out(cfg: DataConfig, **args: Any) -> Batches:
        from ddiloco.data.text import token_eval_batches

        return token_eval_batches(
            load(cfg), eval_fraction=cfg.held_out, eval_tokens=cfg.held_out_tokens, **args
        )

    return DataSource(name, "text", stream, held_out, eval_fraction=0.05, **kw)


def _image_source(name: str, load: Callable[[DataConfig], Any], **kw: Any) -> DataSource:
    """A source of labelled images: ``load(cfg)`` gives them (``data.images``)."""

    def stream(cfg: DataConfig, *, block_size: int, **args: Any) -> BatchStream:
        from ddiloco.data.images import ImageStream

        return ImageStream(load(cfg), eval_fraction=cfg.held_out, split_seed=cfg.split_seed, **args)

    def held_out(cfg: DataConfig, *, batch_size: int, **_: Any) -> Batches:
        from ddiloco.data.images import image_eval_batches

        return image_eval_batches(
            load(cfg), batch_size=batch_size, split_seed=cfg.split_seed, eval_fraction=cfg.held_out
        )

    return DataSource(name, "image", stream, held_out, eval_fraction=0.2, **kw)


def _text_bytes(cfg: DataConfig) -> Any:
    from ddiloco.data.text import load_text_bytes

    return load_text_bytes(cfg.path, all_files=cfg.all_files)  # type: ignore[arg-type]


def _token_bin(cfg: DataConfig) -> Any:
    from ddiloco.data.text import load_token_bin

    return load_token_bin(cfg.path, dtype=cfg.dtype)  # type: ignore[arg-type]


def _bin_vocab(cfg: DataConfig) -> int | None:
    """A ``ddiloco prepare`` folder's vocabulary (None for a flat file of token ids: the
    configured ``data.vocab_size``); a path that does not exist is an error."""
    from ddiloco.data.text import _missing, read_meta

    if cfg.path and not Path(cfg.path).exists():
        raise _missing(Path(cfg.path), "token file")
    if cfg.path and Path(cfg.path).is_dir():
        return int(read_meta(cfg.path)["vocab_size"])
    return None


def _bin_eval_tokens(cfg: DataConfig) -> int | None:
    if cfg.path and Path(cfg.path).is_dir():
        from ddiloco.data.text import read_meta

        n = read_meta(cfg.path).get("eval_tokens")
        return int(n) if n else None
    return None


def _hf_bytes(cfg: DataConfig) -> Any:
    from ddiloco.data.hf import load_hf_text_bytes

    return load_hf_text_bytes(
        cfg.path,
        text_column=cfg.text_column,  # type: ignore[arg-type]
        split=cfg.split,
    )


def _digits(cfg: DataConfig) -> Any:
    from ddiloco.data.images import load_digits

    return load_digits()


def _image_folder(cfg: DataConfig) -> Any:
    from ddiloco.data.images import load_image_folder

    return load_image_folder(
        cfg.path,
        image_size=cfg.image_size,  # type: ignore[arg-type]
        channels=cfg.channels,
    )


register_source(
    DataSource(
        "synthetic",
        "text",
        _synthetic_stream,
        _synthetic_eval,
        needs_path=False,
        vocab_size=lambda cfg: cfg.markov.vocab_size,
    )
)
register_source(_token_source("text", _text_bytes, vocab_size=lambda cfg: 256))
register_source(
    _token_source("bin", _token_bin, vocab_size=_bin_vocab, eval_tokens=_bin_eval_tokens)
)
register_source(_token_source("hf", _hf_bytes, vocab_size=lambda cfg: 256))
register_source(_image_source("digits", _digits, needs_path=False))
register_source(_image_source("images", _image_folder))

DATA_KINDS: tuple[str, ...] = tuple(DATA_SOURCES)
"""Valid values of ``DataConfig.kind``."""
