"""Hugging Face datasets saved on disk (``Dataset.save_to_disk``), as byte tokens.

Needs the optional ``datasets`` package (``pip install ddiloco[hf]``), imported only when
a dataset is loaded. The UTF-8 bytes of one text column are joined with a newline into a
1-D uint8 array (vocabulary 256) that :class:`~ddiloco.data.text.TokenStream` shards and
serves like any other token array.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.data.text import TokenStream

__all__ = ["load_hf_text_bytes", "hf_stream"]


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError("loading Hugging Face datasets needs the 'datasets' package: "
                          "pip install ddiloco[hf]") from e
    return datasets


def load_hf_text_bytes(path: str | Path, *, text_column: str = "text",
                       split: str | None = None) -> np.ndarray:
    """UTF-8 bytes (uint8) of ``text_column`` of the dataset saved at ``path``.

    For a ``DatasetDict``, ``split`` picks the split (default ``"train"`` when present).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"dataset folder {p} does not exist; save one with "
                                f"Dataset.save_to_disk({str(p)!r})")
    datasets = _import_datasets()
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        names = sorted(ds.keys())
        chosen = split if split is not None else ("train" if "train" in ds else None)
        if chosen is None or chosen not in ds:
            raise ValueError(f"{p} holds splits {names}; pass split= one of them")
        ds = ds[chosen]
    if text_column not in ds.column_names:
        raise ValueError(f"{p} has no column {text_column!r}; columns: {ds.column_names}; "
                         f"pass text_column=")
    data = "\n".join(str(t) for t in ds[text_column]).encode("utf-8")
    if not data:
        raise ValueError(f"column {text_column!r} of {p} is empty: no text to train on")
    return np.frombuffer(data, dtype=np.uint8)


def hf_stream(path: str | Path, *, text_column: str = "text", split: str | None = None,
              **stream_kw: Any) -> TokenStream:
    """:class:`TokenStream` over :func:`load_hf_text_bytes`."""
    return TokenStream(load_hf_text_bytes(path, text_column=text_column, split=split),
                       **stream_kw)
