"""Token data from local files: byte-level text and nanoGPT-style ``.bin`` token arrays.

Sources (both become a 1-D array of token ids):
  - ``load_text_bytes(path)``: the bytes of a file (any file), or of a folder searched
    recursively for ``*.txt`` and ``*.md`` files (every file with ``all_files=True``),
    visited in sorted path order, hidden (dot) files and folders skipped, joined with a
    newline. Token ids are byte values, so the vocabulary is 256.
  - ``load_token_bin(path, dtype="uint16")``: a flat binary array of token ids as written
    by nanoGPT's ``prepare.py`` (``np.array(ids, dtype=np.uint16).tofile(path)``),
    memory-mapped, never read whole; or a folder written by ``ddiloco prepare``
    (``meta.json`` naming its shards, their dtype and the vocabulary), its shards
    memory-mapped and served as one array.

Layout of the N tokens for M learners: the tail of the array is held out for evaluation,
``eval_tokens`` long when given (a ``ddiloco prepare`` folder whose meta.json names held-out
sources: their documents, written last), else the last ``eval_fraction`` of it; the rest is
shared among the M learners in one of two ways (``sharding``):

  - ``interleaved`` (the default): the training tokens are cut into blocks of
    ``shard_block`` tokens, dealt round-robin: block i belongs to learner i mod M. Every
    learner's share is disjoint from the others', the shares together cover the training
    tokens, and each share samples the whole corpus, so a corpus written in document order
    (books, then the next book) gives every learner the same mix of text.
  - ``contiguous``: M contiguous, disjoint shards of equal length (up to one token); for
    studies of learners whose data differs (non-iid).

Learner m's batch b takes ``batch_size`` windows of ``block_size + 1`` tokens at offsets
drawn from the random stream keyed (seed, TRAIN, m, b), each window inside one piece of
its share (a block, or the whole contiguous shard); the eval set takes windows from the
held-out tail with the stream keyed (seed, EVAL).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ddiloco.data.stream import (
    DEFAULT_SHARD_BLOCK,
    EVAL,
    SHARDINGS,
    TRAIN,
    check_learner,
    check_state,
    rng_for,
)

__all__ = [
    "TEXT_SUFFIXES",
    "load_text_bytes",
    "load_token_bin",
    "token_layout",
    "SHARDINGS",
    "DEFAULT_SHARD_BLOCK",
    "share_pieces",
    "TokenStream",
    "token_eval_batches",
    "text_stream",
    "bin_stream",
    "ShardedTokens",
    "read_meta",
]

TEXT_SUFFIXES = (".txt", ".md")
"""Files read from a folder by :func:`load_text_bytes` unless ``all_files=True``."""

MIN_BLOCKS_PER_LEARNER = 4
"""Blocks each learner gets at least, where the data allows: shorter data gets shorter
blocks."""


def _missing(path: Path, what: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{what} {path} does not exist; check the path (relative paths "
        f"are resolved from {Path.cwd()})"
    )


def load_text_bytes(path: str | Path, *, all_files: bool = False) -> np.ndarray:
    """Byte tokens (uint8) of a file, or of the text files under a folder (see the module
    docstring for which files and in what order)."""
    p = Path(path)
    if not p.exists():
        raise _missing(p, "text path")
    if p.is_file():
        files = [p]
    else:
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file()
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
            and (all_files or f.suffix.lower() in TEXT_SUFFIXES)
        )
        if not files:
            raise ValueError(
                f"no {'/'.join(TEXT_SUFFIXES)} files under {p}; add some, or "
                f"pass all_files=True to read every file"
            )
    data = b"\n".join(f.read_bytes() for f in files)
    if not data:
        raise ValueError(f"{p} is empty: no text to train on")
    return np.frombuffer(data, dtype=np.uint8)


class ShardedTokens:
    """Several 1-D token arrays (memory-mapped shards) read as one: ``len``, ``ndim`` and
    indexing with an integer array, which is all :class:`TokenStream` uses."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        if not parts:
            raise ValueError("no token shards")
        self.parts = parts
        self.starts = np.cumsum([0] + [len(q) for q in parts])
        self.ndim = 1
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, idx: Any) -> np.ndarray:
        idx = np.asarray(idx)
        out = np.empty(idx.shape, dtype=self.dtype)
        which = np.searchsorted(self.starts, idx, side="right") - 1
        for k in np.unique(which):
            m = which == k
            out[m] = self.parts[k][idx[m] - self.starts[k]]
        return out


def read_meta(folder: str | Path) -> dict[str, Any]:
    """``meta.json`` of a folder written by ``ddiloco prepare``."""
    p = Path(folder) / "meta.json"
    if not p.is_file():
        raise ValueError(
            f"{folder} is a folder without meta.json; pass a .bin file of token "
            f"ids, or a folder written by `ddiloco prepare`"
        )
    import json

    return json.loads(p.read_text())


def load_token_bin(
    path: str | Path, *, dtype: npt.DTypeLike = np.uint16
) -> np.ndarray | ShardedTokens:
    """Memory-mapped 1-D token array from a flat binary file of ``dtype`` ids, or the
    shards of a ``ddiloco prepare`` folder (whose ``meta.json`` gives their dtype)."""
    p = Path(path)
    if not p.exists():
        raise _missing(p, "token file")
    if p.is_dir():
        meta = read_meta(p)
        parts = [load_token_bin(p / s["file"], dtype=meta["dtype"]) for s in meta["shards"]]
        for part, s in zip(parts, meta["shards"], strict=True):
            if len(part) != s["tokens"]:
                raise ValueError(
                    f"{p / s['file']} holds {len(part)} tokens, meta.json says "
                    f"{s['tokens']}; run `ddiloco prepare` again"
                )
        return parts[0] if len(parts) == 1 else ShardedTokens(parts)  # type: ignore[return-value]
    dt = np.dtype(dtype)
    size = p.stat().st_size
    if size == 0:
        raise ValueError(f"token file {p} is empty")
    if size % dt.itemsize != 0:
        raise ValueError(
            f"token file {p} has {size} bytes, not a multiple of the {dt} item "
            f"size ({dt.itemsize}); pass the dtype it was written with "
            f"(e.g. dtype='uint32')"
        )
    return np.memmap(p, dtype=dt, mode="r")


def token_layout(
    n_tokens: int,
    *,
    n_learners: int,
    block_size: int,
    eval_fraction: float,
    eval_tokens: int | None = None,
) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """([start, end) of each learner's shard, [start, end) of the held-out tail), checking
    that every piece holds at least one window of block_size + 1 tokens. The tail is
    ``eval_tokens`` long when given (``eval_fraction`` is then not read), else
    ``int(n_tokens * eval_fraction)``."""
    if block_size < 1 or n_learners < 1:
        raise ValueError(f"block_size and n_learners must be >= 1, got {block_size}, {n_learners}")
    if eval_tokens is not None:
        if not 0 < eval_tokens < n_tokens:
            raise ValueError(
                f"eval_tokens must be in (0, {n_tokens}) (the held-out tail of {n_tokens} "
                f"tokens), got {eval_tokens}; run `ddiloco prepare` again"
            )
        n_eval, what = eval_tokens, "the held-out sources of meta.json"
    else:
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        n_eval, what = int(n_tokens * eval_fraction), f"eval_fraction={eval_fraction}"
    n_train = n_tokens - n_eval
    if n_eval > 0 and n_eval < block_size + 1:
        raise ValueError(
            f"held-out tail of {n_eval} tokens ({what} of {n_tokens}) is shorter than "
            f"block_size + 1 = {block_size + 1}; use more data, a larger eval_fraction "
            f"(or more held-out text) or a smaller block_size"
        )
    bounds = [
        (m * n_train // n_learners, (m + 1) * n_train // n_learners) for m in range(n_learners)
    ]
    shortest = min(end - start for start, end in bounds)
    if shortest < block_size + 1:
        raise ValueError(
            f"a learner shard has {shortest} tokens ({n_train} training tokens "
            f"/ {n_learners} learners), fewer than block_size + 1 = "
            f"{block_size + 1}; use more data, fewer learners or a smaller "
            f"block_size"
        )
    return bounds, (n_train, n_tokens)


def share_pieces(
    n_train: int,
    *,
    learner: int,
    n_learners: int,
    block_size: int,
    sharding: str = "interleaved",
    shard_block: int = DEFAULT_SHARD_BLOCK,
) -> np.ndarray:
    """Learner ``learner``'s share of the training tokens ``[0, n_train)``, as an int64
    array of ``[start, end)`` rows in increasing order: its contiguous shard (one row), or
    its interleaved blocks (block i of ``shard_block`` tokens goes to learner i mod M; the
    last block may be shorter). On data too short to deal every learner
    ``MIN_BLOCKS_PER_LEARNER`` blocks, the blocks are shrunk to fit, down to one window.
    Pieces too short for one window of ``block_size + 1`` tokens are left out; a share left
    with none is an error that says what to change."""
    if sharding not in SHARDINGS:
        raise ValueError(f"data.sharding must be one of {SHARDINGS}, got {sharding!r}")
    if sharding == "contiguous":
        lo = learner * n_train // n_learners
        pieces = np.array([[lo, (learner + 1) * n_train // n_learners]], dtype=np.int64)
    else:
        if shard_block < block_size + 1:
            raise ValueError(
                f"data.shard_block ({shard_block} tokens) must hold a window of block_size + 1 "
                f"= {block_size + 1} tokens; use a larger data.shard_block"
            )
        fit = n_train // (n_learners * MIN_BLOCKS_PER_LEARNER)
        shard_block = max(block_size + 1, min(shard_block, fit))
        starts = np.arange(learner * shard_block, n_train, n_learners * shard_block)
        pieces = np.stack([starts, np.minimum(starts + shard_block, n_train)], axis=1)
    pieces = pieces[pieces[:, 1] - pieces[:, 0] >= block_size + 1]
    if not len(pieces):
        raise ValueError(
            f"learner {learner}'s {sharding} share of {n_train} training tokens ({n_learners} "
            f"learners) holds no window of block_size + 1 = {block_size + 1} tokens; use more "
            f"data, fewer learners, a smaller block_size or data.sharding = 'contiguous'"
        )
    return pieces.astype(np.int64)


def _windows(
    tokens: np.ndarray, start: int, offsets: np.ndarray, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) from windows of block_size + 1 tokens at ``start + offsets``."""
    idx = start + offsets[:, None] + np.arange(block_size + 1)
    seq = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class TokenStream:
    """Learner ``m``'s deterministic stream of (x, y) LongTensor [batch_size, block_size]
    batches from its share of a 1-D token array (y is x shifted by one): its interleaved
    blocks by default, or its contiguous shard (``sharding``, see the module docstring)."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        learner: int,
        n_learners: int,
        batch_size: int,
        block_size: int,
        seed: int = 0,
        eval_fraction: float = 0.05,
        eval_tokens: int | None = None,
        sharding: str = "interleaved",
        shard_block: int = DEFAULT_SHARD_BLOCK,
    ) -> None:
        check_learner(learner, n_learners)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        self.tokens = tokens
        self.learner, self.n_learners = learner, n_learners
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        self.sharding, self.shard_block = sharding, shard_block
        _, (n_train, _) = token_layout(
            len(tokens),
            n_learners=n_learners,
            block_size=block_size,
            eval_fraction=eval_fraction,
            eval_tokens=eval_tokens,
        )
        self.pieces = share_pieces(
            n_train,
            learner=learner,
            n_learners=n_learners,
            block_size=block_size,
            sharding=sharding,
            shard_block=shard_block,
        )
        """[start, end) rows of this learner's tokens (one row when contiguous)."""
        self.shard = (int(self.pieces[0, 0]), int(self.pieces[-1, 1]))
        """The span from the first to the last of this learner's tokens (its shard when
        contiguous)."""
        starts = self.pieces[:, 1] - self.pieces[:, 0] - block_size  # window starts per piece
        self._ends = np.cumsum(starts)
        self._before = self._ends - starts  # window starts in the pieces before each one
        self._position = 0

    @property
    def position(self) -> int:
        return self._position

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rng = rng_for(self.seed, TRAIN, self.learner, self._position)
        # one draw over every window start of the share, then the piece that holds it: a
        # contiguous share is one piece, whose draw is the plain offset in the shard
        u = rng.integers(0, int(self._ends[-1]), size=self.batch_size)
        piece = np.searchsorted(self._ends, u, side="right")
        offsets = self.pieces[piece, 0] + (u - self._before[piece])
        self._position += 1
        return _windows(self.tokens, 0, offsets, self.block_size)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "tokens",
            "position": self._position,
            "learner": self.learner,
            "n_learners": self.n_learners,
            "seed": self.seed,
            "n_tokens": len(self.tokens),
            "sharding": self.sharding,
            "shard_block": self.shard_block,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._position = check_state(
            state,
            {
                "kind": "tokens",
                "learner": self.learner,
                "n_learners": self.n_learners,
                "seed": self.seed,
                "n_tokens": len(self.tokens),
                "sharding": self.sharding,
                "shard_block": self.shard_block,
            },
        )


def token_eval_batches(
    tokens: np.ndarray,
    *,
    n_batches: int,
    batch_size: int,
    block_size: int,
    seed: int = 0,
    eval_fraction: float = 0.05,
    eval_tokens: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed held-out set: ``n_batches`` batches of windows from the tail of ``tokens``
    that no learner's shard contains (``eval_tokens`` long when given, see
    :func:`token_layout`)."""
    if n_batches < 1 or batch_size < 1:
        raise ValueError(f"n_batches and batch_size must be >= 1, got {n_batches}, {batch_size}")
    if eval_tokens is None and eval_fraction <= 0:
        raise ValueError("eval_fraction is 0: there is no held-out set; use eval_fraction > 0")
    _, (start, end) = token_layout(
        len(tokens),
        n_learners=1,
        block_size=block_size,
        eval_fraction=eval_fraction,
        eval_tokens=eval_tokens,
    )
    rng = rng_for(seed, EVAL)
    return [
        _windows(
            tokens, start, rng.integers(0, end - start - block_size, size=batch_size), block_size
        )
        for _ in range(n_batches)
    ]


def text_stream(path: str | Path, *, all_files: bool = False, **stream_kw: Any) -> TokenStream:
    """:class:`TokenStream` over the bytes of :func:`load_text_bytes` (vocabulary 256)."""
    return TokenStream(load_text_bytes(path, all_files=all_files), **stream_kw)


def bin_stream(
    path: str | Path, *, dtype: npt.DTypeLike = np.uint16, **stream_kw: Any
) -> TokenStream:
    """:class:`TokenStream` over the memory-mapped tokens of :func:`load_token_bin`."""
    return TokenStream(load_token_bin(path, dtype=dtype), **stream_kw)
