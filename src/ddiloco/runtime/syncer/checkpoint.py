"""Checkpoint files: atomic, checksummed, finite, with the last few kept.

A checkpoint is written to a temp file in the same directory, fsynced, renamed over
``syncer.pt`` and the directory fsynced: a reader sees the previous checkpoint or the new
one, never a torn file, even if the writer is SIGKILLed mid-write. Before the rename the
previous checkpoints move down one place (``syncer.pt.1``, ``syncer.pt.2``...), so the last
``keep`` good ones stay on disk.

File layout: ``MAGIC`` (8 bytes), the SHA-256 of the payload (32 bytes), the payload
(``torch.save`` of the snapshot). ``load_checkpoint`` verifies the digest and that every
floating-point tensor is finite; ``load_newest_valid`` falls back from a damaged newest file
to the newest valid older one and says so loudly. Temp files left by a killed writer are
removed by ``remove_stale_temps`` when a syncer starts.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "save_atomic",
    "load_checkpoint",
    "load_newest_valid",
    "remove_stale_temps",
    "CheckpointError",
    "CHECKPOINT_NAME",
    "MAGIC",
    "DEFAULT_KEEP",
]

log = logging.getLogger("ddiloco.syncer")

CHECKPOINT_NAME = "syncer.pt"
MAGIC = b"DDCKPT1\n"
DEFAULT_KEEP = 3
"""Checkpoints kept: the newest and the two before it."""


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (checksum, format or non-finite values)."""


def _older(path: Path, i: int) -> Path:
    return path.with_name(f"{path.name}.{i}")


def save_atomic(obj: Any, path: str | os.PathLike, keep: int = DEFAULT_KEEP) -> int:
    """Serialise ``obj`` with ``torch.save`` to ``path`` atomically, keeping the previous
    ``keep - 1`` checkpoints as ``path.1``...; returns bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(hashlib.sha256(payload).digest())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (disk full) leaves nothing behind
        raise
    for i in range(keep - 1, 0, -1):
        src = path if i == 1 else _older(path, i - 1)
        if src.exists():
            os.replace(src, _older(path, i))
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return len(MAGIC) + 32 + len(payload)


def _nonfinite(obj: Any, where: str = "") -> str | None:
    """The path of the first non-finite floating-point tensor in ``obj``, or None."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
            return where or "tensor"
        return None
    items = (
        obj.items()
        if isinstance(obj, dict)
        else enumerate(obj)
        if isinstance(obj, (list, tuple))
        else ()
    )
    for k, v in items:
        bad = _nonfinite(v, f"{where}/{k}")
        if bad:
            return bad
    return None


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load a checkpoint after verifying its checksum and that its tensors are finite;
    raises ``FileNotFoundError`` or ``CheckpointError``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {path}; start without --resume or point "
            f"--checkpoint-dir at the directory holding {CHECKPOINT_NAME}"
        )
    data = path.read_bytes()
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 32:
        raise CheckpointError(f"{path} is not a ddiloco checkpoint (no {MAGIC!r} header)")
    digest, payload = data[len(MAGIC) : len(MAGIC) + 32], memoryview(data)[len(MAGIC) + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(
            f"{path} fails its SHA-256 checksum: the file was damaged after it was written"
        )
    try:
        ck = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}") from None
    bad = _nonfinite(ck)
    if bad:
        raise CheckpointError(f"{path} holds NaN/inf values (at {bad})")
    return ck


def load_newest_valid(path: str | os.PathLike, keep: int = DEFAULT_KEEP) -> tuple[dict, Path]:
    """The newest checkpoint among ``path``, ``path.1``... that passes ``load_checkpoint``,
    and its file. A damaged newer file is logged as an error (the run goes back to an older
    model). Raises ``FileNotFoundError`` when none exists and ``CheckpointError`` when none
    is valid."""
    path = Path(path)
    cands = [path] + [_older(path, i) for i in range(1, keep)]
    errors = []
    for cand in cands:
        if not cand.is_file():
            continue
        try:
            ck = load_checkpoint(cand)
        except CheckpointError as e:
            log.error("CHECKPOINT REJECTED: %s", e)
            errors.append(str(e))
            continue
        if errors:
            log.error(
                "RESUMING FROM AN OLDER CHECKPOINT %s: the newer ones are damaged (%s); "
                "merges after it are lost",
                cand,
                "; ".join(errors),
            )
        return ck, cand
    if errors:
        raise CheckpointError(f"no valid checkpoint in {path.parent}: {'; '.join(errors)}")
    raise FileNotFoundError(
        f"no checkpoint at {path}; start without --resume or point "
        f"--checkpoint-dir at the directory holding {CHECKPOINT_NAME}"
    )


def remove_stale_temps(directory: str | os.PathLike, name: str = CHECKPOINT_NAME) -> int:
    """Delete temp files a killed writer left in ``directory``; returns how many."""
    d = Path(directory)
    n = 0
    if d.is_dir():
        for f in d.glob(f".{name}.tmp.*"):
            try:
                f.unlink()
                n += 1
            except OSError as e:
                log.warning("cannot remove stale checkpoint temp file %s: %s", f, e)
    if n:
        log.info("removed %d stale checkpoint temp file(s) from %s", n, d)
    return n
