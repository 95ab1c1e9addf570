"""``ddiloco prepare``: text to nanoGPT-style token shards, with a BPE tokenizer.

    ddiloco prepare corpus/ notes.txt --held-out heldout/ --tokenizer tok.json \
        --vocab-size 8192 --out data/tok
    ddiloco train --data bin:data/tok

Sources are text files, folders (their ``.txt``/``.md`` files, as ``text:`` reads them)
and ``hf:PATH`` datasets saved on disk (one text column). Each document (a file, or a
row of a dataset) is streamed: read, tokenized in batches and written, never joined in
memory. The tokenizer (Hugging Face ``tokenizers``, byte-level BPE with an
``<|endoftext|>`` token between documents) is loaded from ``--tokenizer`` when that file
exists, else trained offline on the training sources (not the held-out ones) and saved
there.

Held-out sources (``--held-out``) are tokenized after the training sources, into the same
shards, and ``meta.json`` records their length as ``eval_tokens``: ``bin:FOLDER`` then holds
out exactly that tail for evaluation, so no learner trains on a held-out document and the
eval set is whole documents (say, whole books) that the tokenizer did not see either.

The output folder holds ``tokens_000.bin``, ``tokens_001.bin``... (flat arrays of token
ids, uint16 when the vocabulary fits, else uint32, as nanoGPT's ``prepare.py`` writes
them; each at most ``shard_tokens`` long) and ``meta.json`` (vocabulary size, dtype, shard
names and sizes, the tokenizer's path, ``eval_tokens`` where there are held-out sources).
``bin:FOLDER`` reads it back
(:func:`ddiloco.data.text.load_token_bin`), memory-mapped.

Needs ``tokenizers`` (``pip install 'ddiloco[text]'``, also part of ``[hf]``); ``hf:``
sources need ``datasets`` (``[hf]``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

__all__ = [
    "EOT",
    "PrepareResult",
    "iter_documents",
    "train_tokenizer",
    "load_or_train",
    "write_shards",
    "prepare",
    "add_prepare_parser",
    "cmd_prepare",
]

EOT = "<|endoftext|>"
"""The special token written after every document."""

_BATCH = 256  # documents tokenized per encode_batch call


def _text_files(path: Path) -> list[Path]:
    from ddiloco.data.text import TEXT_SUFFIXES

    if path.is_file():
        return [path]
    files = sorted(
        f
        for f in path.rglob("*")
        if f.is_file()
        and not any(part.startswith(".") for part in f.relative_to(path).parts)
        and f.suffix.lower() in TEXT_SUFFIXES
    )
    if not files:
        raise ValueError(f"no {'/'.join(TEXT_SUFFIXES)} files under {path}")
    return files


def _check_sources(sources: Sequence[str]) -> None:
    if not sources:
        raise ValueError("no sources: pass text files, folders or hf:PATH datasets")
    for s in sources:
        p = Path(s[3:] if s.startswith("hf:") else s)
        if not p.exists():
            raise FileNotFoundError(
                f"source {s} does not exist (relative paths are resolved from {Path.cwd()})"
            )


def _source_bytes(sources: Sequence[str]) -> int:
    """Bytes the progress bar counts: file sizes, and a dataset's Arrow files."""
    total = 0
    for s in sources:
        if s.startswith("hf:"):
            total += sum(f.stat().st_size for f in Path(s[3:]).rglob("*.arrow"))
        else:
            total += sum(f.stat().st_size for f in _text_files(Path(s)))
    return total


def iter_documents(
    sources: Sequence[str], *, text_column: str = "text", split: str | None = None
) -> Iterator[str]:
    """The documents of ``sources``, one at a time: each text file whole (decoded as UTF-8,
    invalid bytes replaced), each row of an ``hf:`` dataset's ``text_column``."""
    for s in sources:
        if s.startswith("hf:"):
            from ddiloco.data.hf import open_text_dataset

            ds = open_text_dataset(s[3:], text_column=text_column, split=split)
            for batch in ds.iter(batch_size=1000):
                yield from (str(t) for t in batch[text_column])
        else:
            for f in _text_files(Path(s)):
                yield f.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(documents: Iterator[str], *, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) trained on ``documents``, with
    ``EOT`` as its special token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {EOT}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def _import_tokenizers() -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "ddiloco prepare needs the 'tokenizers' package: pip install 'ddiloco[text]'"
        ) from e


def load_or_train(
    path: str | Path,
    sources: Sequence[str],
    *,
    vocab_size: int,
    text_column: str = "text",
    split: str | None = None,
) -> tuple[Any, bool]:
    """(tokenizer, trained): the tokenizer saved at ``path``, or one trained on ``sources``
    and saved there."""
    _import_tokenizers()
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_file():
        tok = Tokenizer.from_file(str(p))
        if tok.token_to_id(EOT) is None:
            raise ValueError(
                f"tokenizer {p} has no {EOT} token; add it as a special token "
                f"or let ddiloco prepare train one (pass a new --tokenizer path)"
            )
        return tok, False
    tok = train_tokenizer(
        iter_documents(sources, text_column=text_column, split=split), vocab_size=vocab_size
    )
    p.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(p))
    return tok, True


@dataclass(slots=True)
class PrepareResult:
    """What ``prepare`` wrote."""

    out: Path
    """The output folder (``bin:`` reads it)."""
    n_tokens: int
    n_documents: int
    vocab_size: int
    dtype: str
    shards: list[str]
    tokenizer_trained: bool
    eval_tokens: int = 0
    """Tokens of the held-out sources: the last of ``n_tokens``, held out by ``bin:``."""


class _ShardWriter:
    """Appends token ids to ``tokens_NNN.bin`` files of at most ``shard_tokens`` each."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
        self.shards: list[tuple[str, int]] = []
        self._f: Any = None
        self._n = 0

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._f is None or self._n == self.shard_tokens:
                self._open()
            take = ids[: self.shard_tokens - self._n]
            take.astype(self.dtype).tofile(self._f)
            self._n += len(take)
            self.shards[-1] = (self.shards[-1][0], self._n)
            ids = ids[len(take) :]

    def _open(self) -> None:
        self.close()
        name = f"tokens_{len(self.shards):03d}.bin"
        self._f = open(self.out / name, "wb")
        self._n = 0
        self.shards.append((name, 0))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def write_shards(
    documents: Iterable[str],
    tokenizer: Any,
    out: str | Path,
    *,
    shard_tokens: int = 1 << 28,
    total_bytes: int | None = None,
    progress: bool = True,
    held_out: Iterable[str] = (),
) -> tuple[int, int, str, list[tuple[str, int]], int, int]:
    """Tokenize ``documents``, then ``held_out``, in batches (``EOT`` after each) into shards
    under ``out``; returns (tokens, documents, dtype, [(shard, tokens)], held-out tokens,
    held-out documents), the held-out ones being the last of those counted."""
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("tokens_*.bin"):
        old.unlink()
    vocab = tokenizer.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    eot = tokenizer.token_to_id(EOT)
    writer = _ShardWriter(folder, dtype, shard_tokens)
    counts = []  # (tokens, documents) of the training, then the held-out documents
    bar = tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress
    )
    try:
        for docs in (documents, held_out):
            n_tokens = n_docs = 0
            batch: list[str] = []
            for doc in docs:
                batch.append(doc)
                if len(batch) == _BATCH:
                    n_tokens += _encode(batch, tokenizer, eot, writer, bar)
                    n_docs += len(batch)
                    batch = []
            if batch:
                n_tokens += _encode(batch, tokenizer, eot, writer, bar)
                n_docs += len(batch)
            counts.append((n_tokens, n_docs))
    finally:
        writer.close()
        bar.close()
    (train_tokens, train_docs), (eval_tokens, eval_docs) = counts
    return (
        train_tokens + eval_tokens,
        train_docs + eval_docs,
        dtype.name,
        writer.shards,
        eval_tokens,
        eval_docs,
    )


def _encode(batch: list[str], tokenizer: Any, eot: int, writer: _ShardWriter, bar: Any) -> int:
    n = 0
    for enc in tokenizer.encode_batch(batch):
        ids = np.asarray(enc.ids + [eot], dtype=np.int64)
        writer.write(ids)
        n += len(ids)
    bar.update(sum(len(d.encode("utf-8", errors="replace")) for d in batch))
    return n


def prepare(
    sources: Sequence[str],
    *,
    tokenizer: str | Path,
    out: str | Path,
    vocab_size: int = 8192,
    shard_tokens: int = 1 << 28,
    text_column: str = "text",
    split: str | None = None,
    progress: bool = True,
    held_out: Sequence[str] = (),
) -> PrepareResult:
    """Load or train the tokenizer (on ``sources``), then write the token shards of
    ``sources`` followed by those of ``held_out``, and ``meta.json``, into ``out`` (see the
    module docstring)."""
    _check_sources(sources)
    if held_out:
        _check_sources(held_out)
    tok, trained = load_or_train(
        tokenizer, sources, vocab_size=vocab_size, text_column=text_column, split=split
    )
    n_tokens, n_docs, dtype, shards, eval_tokens, eval_docs = write_shards(
        iter_documents(sources, text_column=text_column, split=split),
        tok,
        out,
        shard_tokens=shard_tokens,
        total_bytes=_source_bytes([*sources, *held_out]),
        progress=progress,
        held_out=iter_documents(held_out, text_column=text_column, split=split),
    )
    # Every document adds one EOT: as many tokens as documents means no text.
    if n_tokens - eval_tokens == n_docs - eval_docs:
        raise ValueError(f"sources {list(sources)} hold no text")
    if held_out and eval_tokens == eval_docs:
        raise ValueError(f"held-out sources {list(held_out)} hold no text")
    folder = Path(out)
    meta = {
        "vocab_size": tok.get_vocab_size(),
        "dtype": dtype,
        "n_tokens": n_tokens,
        "n_documents": n_docs,
        "eot_id": tok.token_to_id(EOT),
        "shards": [{"file": f, "tokens": n} for f, n in shards],
        "tokenizer": str(Path(tokenizer).resolve()),
        "sources": list(sources),
    }
    if held_out:
        meta["held_out_sources"] = list(held_out)
        meta["eval_tokens"] = eval_tokens
    tmp = folder / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, folder / "meta.json")
    return PrepareResult(
        out=folder,
        n_tokens=n_tokens,
        n_documents=n_docs,
        vocab_size=meta["vocab_size"],
        dtype=dtype,
        shards=[f for f, _ in shards],
        tokenizer_trained=trained,
        eval_tokens=eval_tokens,
    )


def add_prepare_parser(subparsers: Any) -> Any:
    """``ddiloco prepare``: mounted by the main CLI."""
    import argparse

    p = subparsers.add_parser(
        "prepare",
        help="tokenize text into token shards for --data bin:DIR",
        description="Tokenize text files, folders (.txt/.md) and hf:PATH datasets saved on "
        "disk with a byte-level BPE tokenizer (loaded from --tokenizer, or trained offline "
        "and saved there), into nanoGPT-style .bin shards and meta.json in --out. Train on "
        "them with `ddiloco train --data bin:OUT`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="text file, folder of .txt/.md files, or hf:PATH",
    )
    p.add_argument(
        "--held-out",
        nargs="+",
        default=[],
        metavar="SOURCE",
        help="sources held out for evaluation: written after the training sources, not "
        "used to train the tokenizer, and the eval set of --data bin:OUT (no learner "
        "trains on them)",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer.json to load; trained on the sources and saved here when "
        "the file does not exist",
    )
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary when training")
    p.add_argument("--out", required=True, help="output folder for the shards and meta.json")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per .bin shard")
    p.add_argument("--text-column", default="text", help="text column of hf: datasets")
    p.add_argument("--split", default=None, help="split of an hf: DatasetDict (default train)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=cmd_prepare)
    return p


def cmd_prepare(args: Any) -> int:
    import sys

    try:
        r = prepare(
            args.sources,
            tokenizer=args.tokenizer,
            out=args.out,
            vocab_size=args.vocab_size,
            shard_tokens=args.shard_tokens,
            text_column=args.text_column,
            split=args.split,
            progress=not args.no_progress,
            held_out=args.held_out,
        )
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"ddiloco prepare: error: {e}", file=sys.stderr)
        return 2
    how = "trained and saved to" if r.tokenizer_trained else "loaded from"
    held = f", the last {r.eval_tokens:,} held out" if r.eval_tokens else ""
    print(
        f"ddiloco prepare: {r.n_tokens:,} tokens from {r.n_documents:,} documents{held} "
        f"(vocabulary {r.vocab_size}, {r.dtype}, tokenizer {how} {args.tokenizer}) in "
        f"{len(r.shards)} shard(s) under {r.out}; train with --data bin:{r.out}"
    )
    return 0
