"""Atomic checkpoint files: write to a temp file in the same directory, fsync, rename,
fsync the directory. A reader sees either the previous checkpoint or the new one, never a
torn file, even if the writer is SIGKILLed mid-write."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_atomic", "load_checkpoint", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "syncer.pt"


def save_atomic(obj: Any, path: str | os.PathLike) -> int:
    """Serialise ``obj`` with ``torch.save`` to ``path`` atomically; returns bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return len(data)


def load_checkpoint(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; start without --resume or point "
                                f"--checkpoint-dir at the directory holding {CHECKPOINT_NAME}")
    return torch.load(path, map_location="cpu", weights_only=True)
