"""Hugging Face datasets saved on disk (``Dataset.save_to_disk``), as byte tokens.

Needs the optional ``datasets`` package (``pip install ddiloco[hf]``), imported only when
a dataset is loaded. The dataset stays memory-mapped (Arrow); one text column is streamed
in batches, each row's UTF-8 bytes appended (rows separated by a newline) to one growing
uint8 buffer (vocabulary 256) that :class:`~ddiloco.data.text.TokenStream` shards and
serves like any other token array: no Python string of the whole column is ever built.
For a BPE vocabulary, or a dataset larger than memory, tokenize it to shards on disk
first: ``ddiloco prepare hf:PATH --tokenizer tok.json --out DIR``, then ``bin:DIR``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.data.text import TokenStream

__all__ = ["open_text_dataset", "load_hf_text_bytes", "hf_stream"]

_ROWS_PER_BATCH = 1000


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "loading Hugging Face datasets needs the 'datasets' package: pip install ddiloco[hf]"
        ) from e
    return datasets


def open_text_dataset(
    path: str | Path, *, text_column: str = "text", split: str | None = None
) -> Any:
    """The ``datasets.Dataset`` saved at ``path`` (for a ``DatasetDict``, its ``split``,
    default ``"train"`` when present), checked to have ``text_column``."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"dataset folder {p} does not exist; save one with Dataset.save_to_disk({str(p)!r})"
        )
    datasets = _import_datasets()
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        names = sorted(ds.keys())
        chosen = split if split is not None else ("train" if "train" in ds else None)
        if chosen is None or chosen not in ds:
            raise ValueError(f"{p} holds splits {names}; pass split= one of them")
        ds = ds[chosen]
    if text_column not in ds.column_names:
        raise ValueError(
            f"{p} has no column {text_column!r}; columns: {ds.column_names}; pass text_column="
        )
    return ds


def load_hf_text_bytes(
    path: str | Path, *, text_column: str = "text", split: str | None = None
) -> np.ndarray:
    """UTF-8 bytes (uint8) of ``text_column`` of the dataset saved at ``path``, rows
    separated by a newline, read in batches of rows."""
    ds = open_text_dataset(path, text_column=text_column, split=split)
    buf, sep = bytearray(), b""
    for batch in ds.iter(batch_size=_ROWS_PER_BATCH):
        for t in batch[text_column]:
            buf += sep
            buf += str(t).encode("utf-8")
            sep = b"\n"
    if not buf:
        raise ValueError(f"column {text_column!r} of {path} is empty: no text to train on")
    return np.frombuffer(buf, dtype=np.uint8)


def hf_stream(
    path: str | Path, *, text_column: str = "text", split: str | None = None, **stream_kw: Any
) -> TokenStream:
    """:class:`TokenStream` over :func:`load_hf_text_bytes`."""
    return TokenStream(load_hf_text_bytes(path, text_column=text_column, split=split), **stream_kw)
