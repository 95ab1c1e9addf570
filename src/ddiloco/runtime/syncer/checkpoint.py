"""Syncer checkpoints: streamed fragment by fragment, atomic, checksummed, finite-checked,
incremental (a checkpoint writes only the fragments that changed), with the last few kept.

Layout of a checkpoint directory (``--checkpoint-dir``)::

    syncer.json               manifest of the newest checkpoint (``CHECKPOINT_NAME``)
    syncer.json.1, .2         manifests of the ones before it (``keep`` in all)
    syncer-000042/            what one checkpoint wrote
        fragment-0003.safetensors    theta.0 .. theta.k-1, momentum.0 .. momentum.k-1 of
        ...                          each fragment p that changed since the checkpoint
                                     before (all of them in a syncer's first one)
        syncer.json                  a copy of the manifest written with it
    syncer-000017/fragment-0001.safetensors   a fragment that has not changed since
    refused-syncer.json-<SHA>/  a damaged manifest set aside (below)

A fragment file is a plain safetensors file (``safetensors.safe_open`` reads it); a
fragment with no tensors (another shard's) has none. The manifest is JSON: ``format`` and
``version`` (3), ``data`` (the fragment directory this checkpoint wrote), one entry per
fragment (``file``: the path of its fragment file relative to the checkpoint directory,
in this checkpoint's fragment directory or an earlier one's; ``bytes``, ``sha256``, the
number of ``theta`` and ``momentum`` tensors), the snapshot without its tensors
(``snapshot``: spec, versions, ledger, counters... everything but ``state.theta`` and
``state.momentum``) and ``manifest_sha256``, the SHA-256 of the canonical JSON of
everything else. A fragment file is never rewritten: checkpoints share it by naming it.

**Write** (``save_atomic``): a new fragment directory under a temp name
(``.syncer-000042.tmp.PID``) gets one file per fragment that is not reused (``reuse``: the
caller's word that fragment p's tensors are those of an earlier checkpoint's file, which
is then named again if it is still there at its size), each hashed as its bytes go out (the
tensors' own memory, in 64 MiB pieces: nothing model-sized is built) and fsynced, and a
copy of the manifest (what repairs a damaged one: ``recovery_copies``); the
directory fsynced and renamed to ``syncer-000042``; then the manifest to a temp file,
fsynced, the older manifests moved down one place (``syncer.json`` -> ``.1`` ...), the temp
file renamed to ``syncer.json`` and the directory fsynced; last, the manifests past the
last ``keep`` and the fragment files they alone named are removed. A reader sees the
previous complete checkpoint or the new one, never a torn one, even if the writer is
SIGKILLed at any point: fragment files are only reachable through a manifest, the
manifest appears by a rename after its files are on disk, and a file is removed only
after a durable manifest that no longer names it has replaced the ones that did. A failed
write (disk full) removes what it wrote. The ``keep`` checkpoints are fallbacks against a
refused or torn manifest and a damaged newer file; a fragment file they share is one copy.

**What is removed.** Only what is provably a writer's leftover (``_remove_unreferenced``):
a temp-named fragment directory (an incomplete write), one that an intact temp manifest
names (a write killed before its rename), and a fragment file that no manifest names in a
directory older than the newest intact manifest's (a checkpoint rotated out, or a killed
writer's; the directory goes with its last named file). A
manifest is intact when its own SHA-256 checks. While any manifest in the directory is not
intact (truncated, empty, garbage, one byte flipped), no fragment file outside a
temp-named directory is removed: it may hold that manifest's model, recoverable by
repairing the manifest. A directory newer than every intact manifest is kept too (its manifest may have
been lost); the next write, whose manifest is newer, removes it. A damaged manifest that a
write would push out of the last ``keep`` (a run that resumed from an older checkpoint
goes on) is first set aside (``_pin``): ``refused-syncer.json-<SHA>/`` holds it byte for
byte and the list of the fragment files it may name (every one older than the intact
manifests written after it), which clean-up keeps until that directory is removed. So no
refusal ever deletes a checkpoint's data.

**Read** (``load_checkpoint``): the manifest's checksum, format and every fragment file's
size are checked at once; a fragment's file is verified (SHA-256) the first time one of its
tensors is read, then its tensors are read one at a time (``safe_open``, closed after each,
so at most one tensor's pages are mapped) and checked finite. With ``lazy=True`` fragment p
is read when ``state["theta"][p]`` (or ``momentum``) is taken, so a resume holds the live
state plus about one fragment. ``load_newest_valid`` falls back from a damaged newest
checkpoint to the newest valid older one and says so loudly. Temp files, and the fragment
directories above that are a writer's leftovers, are removed by ``remove_stale_temps`` when
a syncer starts; ``fragment_dirs`` lists the fragment directories a checkpoint directory
holds (where a refused checkpoint's data is), ``recovery_copies`` the intact copies of
manifests among them that a refused resume can be repaired with.

**Memory.** A write holds references to the live tensors, no copies: the syncer's state
never writes theta or momentum in place (``SyncerState.state_dict``). It allocates no more
than one non-contiguous tensor's copy (the state's tensors are contiguous).

**Earlier formats.** A manifest of version 2 (every fragment's file in the checkpoint's
own directory, named relative to it) is read as version 3 names it, and the next write
names its files again. A single-file checkpoint (``syncer.pt``: ``LEGACY_MAGIC``, the
SHA-256 of the payload, ``torch.save`` of the snapshot) is still read, whole, when no
manifest is valid. Neither is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from ddiloco.algorithm.merge import all_finite

__all__ = [
    "save_atomic",
    "load_checkpoint",
    "load_newest_valid",
    "remove_stale_temps",
    "fragment_dirs",
    "recovery_copies",
    "has_checkpoint",
    "CheckpointError",
    "CHECKPOINT_NAME",
    "LEGACY_NAME",
    "LEGACY_MAGIC",
    "FORMAT_VERSION",
    "Written",
    "stored_fragments",
    "DEFAULT_KEEP",
    "manifest_files",
    "numbered_dirs",
]

log = logging.getLogger("ddiloco.syncer")

CHECKPOINT_NAME = "syncer.json"
"""The newest checkpoint's manifest in a checkpoint directory."""
LEGACY_NAME = "syncer.pt"
"""The single-file checkpoint of the earlier format (read, never written)."""
LEGACY_MAGIC = b"DDCKPT1\n"
FORMAT = "ddiloco-syncer-checkpoint"
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)
"""Manifest versions read: 2 (each checkpoint's files in its own directory) and 3."""
DEFAULT_KEEP = 3
"""Checkpoints kept: the newest and the two before it."""
TENSOR_FIELDS = ("theta", "momentum")
"""The per-fragment tensor lists of ``snapshot["state"]`` that go to the fragment files."""

PIN_PREFIX = "refused-"
"""Damaged manifests set aside, with the fragment files they may name: ``refused-NAME-<SHA>``."""
PINNED = "pinned.json"
_FRAGMENT_FILE = re.compile(r"^fragment-\d+\.safetensors$")
_FILE_PATH = re.compile(r"^(?!\.)[^/\\]+/fragment-\d+\.safetensors$")
"""A fragment file as a manifest names it: ``syncer-000042/fragment-0003.safetensors``."""
_PIECE = 64 << 20  # bytes hashed and written at a time
_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted (checksum, format, missing file or non-finite
    values)."""


def _older(path: Path, i: int) -> Path:
    return path.with_name(f"{path.name}.{i}")


def _stem(name: str) -> str:
    return name.split(".", 1)[0]


def _data_dirs(directory: Path, name: str, *, temp: bool = False) -> list[tuple[int, Path]]:
    """The fragment directories in ``directory`` (``syncer-000042``), oldest first; with
    ``temp`` the temp-named ones of unfinished writes (``.syncer-000042.tmp.PID``)."""
    stem = re.escape(_stem(name))
    pat = re.compile(rf"^\.{stem}-(\d+)\.tmp\.\d+$" if temp else rf"^{stem}-(\d+)$")
    return numbered_dirs(directory, pat)


def numbered_dirs(directory: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    """The directories in ``directory`` whose names ``pattern`` matches, with the number its
    first group holds, in increasing order (none if ``directory`` is not one)."""
    out = []
    if directory.is_dir():
        for d in directory.iterdir():
            m = pattern.match(d.name)
            if m and d.is_dir():
                out.append((int(m.group(1)), d))
    return sorted(out)


def fragment_dirs(directory: str | os.PathLike, name: str = CHECKPOINT_NAME) -> list[Path]:
    """The fragment directories of the checkpoints in ``directory``, newest first."""
    return [d for _, d in reversed(_data_dirs(Path(directory), name))]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=_not_json).encode()


def _not_json(obj: Any) -> Any:
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        return obj.item()  # a 0-d tensor or numpy scalar
    raise TypeError(
        f"a checkpoint snapshot holds a {type(obj).__name__}: only JSON values go in the "
        f"manifest, and tensors only in state.{' and state.'.join(TENSOR_FIELDS)}"
    )


# -- write --------------------------------------------------------------------------------
def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_fragment(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write ``tensors`` as a safetensors file, hashing the bytes as they go out; returns
    (bytes, SHA-256 hex). The data is written from the tensors' own memory (safetensors'
    ``save_file`` cannot hash in the same pass)."""
    assert sys.byteorder == "little", "safetensors files are little-endian"
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    flat, off = [], 0
    for name, t in tensors.items():
        t = t.detach()
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name} has dtype {t.dtype}, which a checkpoint cannot hold")
        t = t.cpu().contiguous()
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [off, off + n],
        }
        flat.append(t.reshape(-1).view(torch.uint8))
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for prefix in (struct.pack("<Q", len(head)), head):
            f.write(prefix)
            h.update(prefix)
        for b in flat:
            mv = memoryview(b.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
            for i in range(0, len(mv), _PIECE):
                piece = mv[i : i + _PIECE]
                f.write(piece)
                h.update(piece)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(head) + off, h.hexdigest()


@dataclass(frozen=True, slots=True)
class Written:
    """What ``save_atomic`` wrote."""

    bytes: int
    """Bytes written: the new fragment files and the manifest (twice: its copy)."""
    fragments: list[dict | None]
    """The manifest's entry of each fragment (None: no tensors), for ``reuse`` by the next
    write: ``file`` (relative to the checkpoint directory), ``bytes``, ``sha256`` and the
    number of ``theta`` and ``momentum`` tensors."""
    written: list[int]
    """The fragments whose files this write wrote (the others' entries were reused)."""


def save_atomic(
    snapshot: dict,
    path: str | os.PathLike,
    keep: int = DEFAULT_KEEP,
    *,
    release: bool = False,
    reuse: Mapping[int, dict] | None = None,
) -> Written:
    """Write ``snapshot`` as a checkpoint whose manifest is ``path`` (``dir/syncer.json``),
    keeping the previous ``keep - 1`` as ``path.1``...

    ``snapshot["state"]["theta"]`` and ``["momentum"]`` are lists (one per fragment) of
    tensors; everything else in ``snapshot`` must be JSON (dict keys become strings).
    ``reuse`` maps a fragment p to the entry (``Written.fragments[p]``) of an earlier
    checkpoint in this directory whose file holds exactly p's tensors of this snapshot (the
    caller vouches for that): the new manifest names that file instead of writing p again,
    if it is still there at its size (otherwise p is written). With ``release`` the tensor
    lists are emptied fragment by fragment as each file is written (or reused), so that a
    fragment merged meanwhile does not keep its old tensors alive until the end."""
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    state = snapshot.get("state")
    if not isinstance(state, dict) or not all(
        isinstance(state.get(k), list) for k in TENSOR_FIELDS
    ):
        raise ValueError(
            f"a checkpoint snapshot needs state.{' and state.'.join(TENSOR_FIELDS)}: "
            "lists of tensors, one per fragment"
        )
    columns = [state[k] for k in TENSOR_FIELDS]
    P = len(columns[0])  # noqa: N806 - the paper's symbol
    if any(len(c) != P for c in columns):
        raise ValueError(f"state.{' and state.'.join(TENSOR_FIELDS)} differ in fragment count")
    body = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "snapshot": {
            **snapshot,
            "state": {k: v for k, v in state.items() if k not in TENSOR_FIELDS},
        },
    }
    # a snapshot that is not JSON fails before anything is written; its keys become strings
    clean = json.loads(_canonical(body))
    dirs = _data_dirs(directory, path.name)
    data = directory / f"{_stem(path.name)}-{(dirs[-1][0] + 1 if dirs else 1):06d}"
    writing = directory / f".{data.name}.tmp.{os.getpid()}"  # renamed to ``data`` once written
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    total = 0
    written = []
    try:
        writing.mkdir()
        entries: list[dict | None] = []
        for p in range(P):
            counts = {k: len(c[p]) for k, c in zip(TENSOR_FIELDS, columns)}
            old = (reuse or {}).get(p)
            if old is not None and _reusable(directory, old, counts):
                entries.append(dict(old))
            elif not any(counts.values()):
                entries.append(None)
            else:
                ts = {
                    f"{k}.{j}": t
                    for k, c in zip(TENSOR_FIELDS, columns)
                    for j, t in enumerate(c[p])
                }
                name = f"fragment-{p:04d}.safetensors"
                nbytes, digest = _write_fragment(writing / name, ts)
                del ts
                total += nbytes
                written.append(p)
                entries.append(
                    {"file": f"{data.name}/{name}", "bytes": nbytes, "sha256": digest, **counts}
                )
            if release:
                for c in columns:
                    c[p] = []
        clean["data"] = data.name
        clean["fragments"] = entries
        digest = hashlib.sha256(_canonical(clean)).hexdigest()
        manifest = json.dumps({**clean, "manifest_sha256": digest}, indent=1).encode()
        _write_synced(writing / path.name, manifest)  # the copy that recovers a damaged one
        _fsync_dir(writing)
        os.rename(writing, data)
        _fsync_dir(directory)
        _write_synced(tmp, manifest)
        total += 2 * len(manifest)
    except BaseException:
        # a failed write (disk full) leaves nothing behind
        tmp.unlink(missing_ok=True)
        shutil.rmtree(writing, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
        raise
    _pin_leaving(directory, path.name, keep)
    for i in range(keep - 1, 0, -1):
        src = path if i == 1 else _older(path, i - 1)
        if src.exists():
            os.replace(src, _older(path, i))
    os.replace(tmp, path)
    _fsync_dir(directory)
    _remove_unreferenced(directory, path.name, keep=keep)
    return Written(total, entries, written)


def _reusable(directory: Path, entry: dict, counts: dict[str, int]) -> bool:
    """Whether ``entry`` of an earlier checkpoint can be named again: a fragment file in a
    fragment directory, there at its size, with the snapshot's tensor counts."""
    file = entry.get("file")
    if not isinstance(file, str) or not _FILE_PATH.match(file):
        return False
    if any(entry.get(k) != n for k, n in counts.items()):
        return False
    f = directory / file
    return f.is_file() and f.stat().st_size == entry.get("bytes")


def _manifests(directory: Path, name: str) -> list[tuple[int, Path]]:
    """The manifests in ``directory``: (0, ``name``), (1, ``name.1``)..., oldest last."""
    pat = re.compile(rf"^{re.escape(name)}(?:\.(\d+))?$")
    out = []
    if directory.is_dir():
        for f in directory.iterdir():
            m = pat.match(f.name)
            if m and f.is_file():
                out.append((int(m.group(1) or 0), f))
    return sorted(out)


def _intact(manifest: Path) -> dict | None:
    """The body of ``manifest`` (or of a pin record) if it is intact: JSON whose own SHA-256
    checks; None when it cannot be read or is damaged."""
    try:
        doc = json.loads(manifest.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    digest = doc.pop("manifest_sha256", None)
    if not isinstance(digest, str) or hashlib.sha256(_canonical(doc)).hexdigest() != digest:
        return None
    return doc


def _entries(doc: dict) -> list[tuple[str, int]]:
    """The fragment files an intact manifest names: (path relative to the checkpoint
    directory, bytes)."""
    data, out = doc.get("data"), []
    for e in doc.get("fragments") or []:
        if not isinstance(e, dict) or not isinstance(e.get("file"), str):
            continue
        if doc.get("version") == 2:  # the file in the checkpoint's own directory
            if isinstance(data, str):
                out.append((f"{data}/{e['file']}", int(e.get("bytes", -1))))
        else:
            out.append((e["file"], int(e.get("bytes", -1))))
    return out


def manifest_files(raw: bytes) -> tuple[str, list[tuple[str, int]]] | None:
    """What the manifest ``raw`` (its bytes) needs beside it in its checkpoint directory:
    (the fragment directory its checkpoint wrote, the fragment files it names as paths
    relative to that checkpoint directory with their sizes), those of a version 3 manifest
    in that directory or earlier ones'; None when it is not intact. A checkpoint is whole
    where it stands once each of these files is there at its size (their SHA-256 is
    verified as they are read)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    digest = doc.pop("manifest_sha256", None)
    if not isinstance(digest, str) or hashlib.sha256(_canonical(doc)).hexdigest() != digest:
        return None
    data = doc.get("data")
    files = _entries(doc)
    if not isinstance(data, str) or not all(_FILE_PATH.match(f) for f, _ in files):
        return None
    return data, files


def _fragment_files(directory: Path, name: str, below: int | None = None) -> list[str]:
    """Every fragment file in the fragment directories of ``directory`` (relative paths);
    with ``below``, in those numbered below it only."""
    return sorted(
        f"{d.name}/{f.name}"
        for i, d in _data_dirs(directory, name)
        if below is None or i < below
        for f in d.iterdir()
        if _FRAGMENT_FILE.match(f.name)
    )


def _pins(directory: Path, name: str) -> tuple[set[str], list[Path]]:
    """The fragment files that set-aside damaged manifests may name (``refused-NAME-*/``),
    and the records among them that cannot be read."""
    files: set[str] = set()
    bad = []
    for d in sorted(directory.glob(f"{PIN_PREFIX}{name}-*")):
        if not d.is_dir():
            continue
        doc = _intact(d / PINNED)
        if doc is None or not isinstance(doc.get("files"), list):
            bad.append(d)
            continue
        files |= {f for f in doc["files"] if isinstance(f, str)}
    return files, bad


def _pin(directory: Path, name: str, manifest: Path) -> Path:
    """Set ``manifest`` (damaged) aside before it leaves the last ``keep``: a directory
    ``refused-NAME-<its SHA-256>`` with the manifest byte for byte and the list of the
    fragment files it may name (``pinned.json``, checksummed), which clean-up keeps while
    that directory is there: every fragment file older than the newer intact manifests
    (it was written before them). Written to a temp name, fsynced and renamed."""
    raw = manifest.read_bytes()
    pin = directory / f"{PIN_PREFIX}{name}-{hashlib.sha256(raw).hexdigest()[:12]}"
    if pin.is_dir():
        return pin
    number = {d.name: i for i, d in _data_dirs(directory, name)}
    where = {m: i for i, m in _manifests(directory, name)}.get(manifest)
    newer = [
        number[doc["data"]]
        for i, m in _manifests(directory, name)
        if where is not None and i < where
        for doc in [_intact(m)]
        if doc is not None and doc.get("data") in number
    ]
    files = _fragment_files(directory, name, min(newer) if newer else None)
    body = {"format": f"{FORMAT}-pin", "manifest": manifest.name, "files": files}
    record = json.dumps(
        {**body, "manifest_sha256": hashlib.sha256(_canonical(body)).hexdigest()}, indent=1
    ).encode()
    tmp = directory / f".{pin.name}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _write_synced(tmp / name, raw)
    _write_synced(tmp / PINNED, record)
    _fsync_dir(tmp)
    os.rename(tmp, pin)
    _fsync_dir(directory)
    log.error(
        "%s cannot be read or fails its checksum and leaves the last checkpoints kept: it is "
        "set aside, byte for byte, as %s, and the %d fragment files it may name are kept "
        "while that directory is there (repair it and put it back as %s to resume from it; "
        "remove the directory to let them go)",
        manifest,
        pin / name,
        len(files),
        directory / name,
    )
    return pin


def _pin_leaving(directory: Path, name: str, keep: int) -> None:
    """Before the manifests move down one place: every damaged one that the move pushes
    out of the last ``keep`` (or that the new one replaces, with ``keep`` 1) is set aside
    (``_pin``), so that no refused checkpoint's fragment files are ever removed."""
    for i, m in _manifests(directory, name):
        if i >= keep - 1 and _intact(m) is None:
            _pin(directory, name, m)


def _remove_unreferenced(
    directory: Path, name: str, keep: int | None = None, *, temps: bool = False
) -> int:
    """Remove what is provably a writer's leftover (with ``keep``, the manifests past the
    last ``keep`` first; with ``temps``, the temp-named fragment directories and those an
    intact temp manifest names: writes that never finished, as a syncer finds them at
    start); returns how many things were removed.

    A fragment file no manifest names is removed only if its directory is older than the
    newest intact manifest's, and only while every manifest left is intact: a manifest
    that cannot be read may be the one naming it, and its model is recoverable by repairing
    it. Files that a set-aside damaged manifest may name (``_pin``) are kept. A directory
    newer than every intact manifest's is kept (its manifest may have been lost)."""
    n = 0
    manifests = _manifests(directory, name)
    if keep is not None:
        for i, m in manifests:
            if i >= keep:
                if _intact(m) is None:
                    _pin(directory, name, m)
                m.unlink(missing_ok=True)
                n += 1
        manifests = [(i, m) for i, m in manifests if i < keep]
    docs = [_intact(m) for _, m in manifests]
    named = {f for d in docs if d is not None for f, _ in _entries(d)}
    own = {d.get("data") for d in docs if d is not None}
    dirs = _data_dirs(directory, name)
    if temps:
        for _, d in _data_dirs(directory, name, temp=True):
            shutil.rmtree(d, ignore_errors=True)
            n += 1
        for f in directory.glob(f".{name}.tmp.*"):
            doc = _intact(f)
            data = doc.get("data") if doc is not None else None
            for _, d in dirs:  # a write killed between its directory's rename and its own
                if d.name == data and data not in own:
                    if not any(x.startswith(f"{data}/") for x in named):
                        shutil.rmtree(d, ignore_errors=True)
                        n += 1
        for d in directory.glob(f".{PIN_PREFIX}{name}-*.tmp.*"):
            shutil.rmtree(d, ignore_errors=True)
            n += 1
        dirs = _data_dirs(directory, name)
    damaged = [m for (_, m), d in zip(manifests, docs) if d is None]
    pinned, bad = _pins(directory, name)
    if damaged or bad:
        if dirs:
            log.warning(
                "%s cannot be read or fails its checksum: no fragment file is removed from "
                "%s (kept: %s)",
                ", ".join(m.name for m in [*damaged, *bad]),
                directory,
                ", ".join(d.name for _, d in dirs),
            )
        return n
    number = {d.name: i for i, d in dirs}
    newest = max(
        (number[x] for x in {*own, *(f.split("/", 1)[0] for f in named)} if x in number),
        default=None,
    )
    named |= pinned
    for i, d in dirs:
        keep_here = {f.split("/", 1)[1] for f in named if f.split("/", 1)[0] == d.name}
        if newest is None or i > newest:
            if not keep_here:
                log.info("%s: no manifest names it, and none is newer: kept", d)
            continue
        if not keep_here and d.name not in own:
            shutil.rmtree(d, ignore_errors=True)
            n += 1
            continue
        for f in d.iterdir():
            if _FRAGMENT_FILE.match(f.name) and f.name not in keep_here:
                f.unlink(missing_ok=True)
                n += 1
    return n


def recovery_copies(directory: str | os.PathLike, name: str = CHECKPOINT_NAME) -> list[Path]:
    """The copies of manifests that the fragment directories hold (each checkpoint writes
    one into its own), newest first, that are intact and whose fragment files are all
    there at the sizes they name, and that differ from every manifest a resume tries
    (``name``, ``name.1``...): each can be put back as ``directory/name`` to resume from it
    (its fragment files are verified then)."""
    d = Path(directory)
    tried = set()
    for _, m in _manifests(d, name):
        with contextlib.suppress(OSError):
            tried.add(m.read_bytes())
    out = []
    for data in fragment_dirs(d, name):
        doc = _intact(data / name)
        if doc is None or doc.get("data") != data.name or (data / name).read_bytes() in tried:
            continue
        entries = _entries(doc)
        if entries and all(
            (d / f).is_file() and (d / f).stat().st_size == size for f, size in entries
        ):
            out.append(data / name)
    return out


# -- read ---------------------------------------------------------------------------------
class _Fragments:
    """The fragment files of one checkpoint: each verified (SHA-256) the first time one of
    its tensors is read; tensors read one at a time and checked finite."""

    def __init__(self, manifest: Path, entries: list[dict | None]) -> None:
        self.manifest, self.entries = manifest, entries
        self._verified: set[int] = set()

    def tensors(self, p: int, kind: str) -> list[torch.Tensor]:
        from safetensors import safe_open

        e = self.entries[p]
        if e is None:
            return []
        file = self.manifest.parent / e["file"]
        if p not in self._verified:
            try:
                with open(file, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as ex:
                raise CheckpointError(f"{file} cannot be read: {ex}") from None
            if digest != e["sha256"]:
                raise CheckpointError(
                    f"{file} fails its SHA-256 checksum: the file was damaged after it was written"
                )
            self._verified.add(p)
        out = []
        for j in range(int(e[kind])):
            key = f"{kind}.{j}"
            try:  # opened per tensor: at most one tensor's pages are mapped at a time
                with safe_open(str(file), framework="pt") as f:
                    t = f.get_tensor(key).clone()
            except Exception as ex:  # noqa: BLE001 - any unreadable tensor is a bad file
                raise CheckpointError(
                    f"{file}: tensor {key} cannot be read: {type(ex).__name__}: {ex}"
                ) from None
            if not all_finite(t):
                raise CheckpointError(f"{file} holds NaN/inf values (at {kind}[{p}][{j}])")
            out.append(t)
        return out


class _Column(Sequence[list[torch.Tensor]]):
    """``state["theta"]`` (or ``momentum``) of a lazily read checkpoint: item p reads
    fragment p's tensors of that kind from its file."""

    def __init__(self, fragments: _Fragments, kind: str) -> None:
        self.fragments, self._kind = fragments, kind

    def __len__(self) -> int:
        return len(self.fragments.entries)

    def __getitem__(self, p):  # type: ignore[override]
        if isinstance(p, slice):
            return [self[i] for i in range(*p.indices(len(self)))]
        if not -len(self) <= p < len(self):
            raise IndexError(p)
        return self.fragments.tensors(p % len(self), self._kind)

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        return (self[p] for p in range(len(self)))


def _not_found(path: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"no checkpoint at {path}; start without --resume or point --checkpoint-dir at the "
        f"directory holding {CHECKPOINT_NAME}"
    )


def load_checkpoint(path: str | os.PathLike, *, lazy: bool = False) -> dict:
    """The snapshot in the checkpoint whose manifest is ``path`` (or a single-file
    ``syncer.pt`` of the earlier format), its fragment files verified (SHA-256) and its
    tensors checked finite; raises ``FileNotFoundError`` or ``CheckpointError``.

    With ``lazy`` the manifest and the fragment files' sizes are checked now, and
    ``state["theta"]`` and ``state["momentum"]`` are sequences that read (and verify)
    fragment p when item p is taken, so a caller can hold one fragment at a time; a
    damaged fragment file then raises ``CheckpointError`` there."""
    path = Path(path)
    if not path.is_file():
        raise _not_found(path)
    raw = path.read_bytes()
    if raw.startswith(LEGACY_MAGIC):
        return _load_legacy(path, raw)
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a ddiloco checkpoint manifest (not JSON of format {FORMAT!r}, "
            f"nor a {LEGACY_NAME} file): the file is damaged or from another program"
        )
    digest = doc.pop("manifest_sha256", None)
    if hashlib.sha256(_canonical(doc)).hexdigest() != digest:
        raise CheckpointError(
            f"{path} fails its SHA-256 checksum: the manifest was damaged after it was written"
        )
    if doc.get("version") not in READ_VERSIONS:
        raise CheckpointError(
            f"{path} is a checkpoint of format version {doc.get('version')}; this ddiloco "
            f"reads versions {', '.join(map(str, READ_VERSIONS))} (and the single-file "
            f"{LEGACY_NAME}): resume it with the ddiloco that wrote it"
        )
    try:
        entries, snap = doc["fragments"], doc["snapshot"]
        state = snap["state"]
        for e in entries:
            if e is None:
                continue
            if doc["version"] == 2:  # its files in its own directory: named as version 3 does
                e["file"] = f"{doc['data']}/{e['file']}"
            if not isinstance(e["file"], str) or not _FILE_PATH.match(e["file"]):
                raise CheckpointError(f"{path} names a fragment file {e['file']!r} out of place")
            file = path.parent / e["file"]
            size = file.stat().st_size if file.is_file() else None
            if size is None:
                raise CheckpointError(f"{path}: its fragment file {file} is missing")
            if size != int(e["bytes"]):
                raise CheckpointError(
                    f"{path}: its fragment file {file} has {size} bytes, the manifest "
                    f"says {e['bytes']} (truncated or replaced)"
                )
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path} lacks a field of the manifest format: {e}") from None
    fragments = _Fragments(path, entries)
    for k in TENSOR_FIELDS:
        state[k] = _Column(fragments, k)
    if not lazy:
        for k in TENSOR_FIELDS:
            state[k] = list(state[k])
    return snap


def stored_fragments(ck: dict) -> list[dict | None] | None:
    """Where a checkpoint read by ``load_checkpoint`` holds each fragment: its manifest
    entries (as ``Written.fragments``, for ``save_atomic(reuse=...)``), or None for a
    checkpoint of the earlier single-file format."""
    column = ck.get("state", {}).get("theta")
    if isinstance(column, _Column):
        return [None if e is None else dict(e) for e in column.fragments.entries]
    return None


def _nonfinite(obj: Any, where: str = "") -> str | None:
    """The path of the first non-finite floating-point tensor in ``obj``, or None."""
    if isinstance(obj, torch.Tensor):
        return None if all_finite(obj) else where or "tensor"
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


def _load_legacy(path: Path, data: bytes) -> dict:
    """A single-file checkpoint of the earlier format, read whole."""
    head = len(LEGACY_MAGIC) + 32
    if len(data) < head:
        raise CheckpointError(f"{path} is truncated (a {LEGACY_NAME} file of {len(data)} bytes)")
    digest, payload = data[len(LEGACY_MAGIC) : head], memoryview(data)[head:]
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


def _candidates(path: Path, keep: int) -> list[Path]:
    legacy = path.with_name(LEGACY_NAME)
    return (
        [path]
        + [_older(path, i) for i in range(1, keep)]
        + [legacy]
        + [_older(legacy, i) for i in range(1, keep)]
    )


def has_checkpoint(directory: str | os.PathLike, keep: int = DEFAULT_KEEP) -> bool:
    """Whether ``directory`` holds a checkpoint manifest (or an earlier-format file) to
    resume from; says nothing about its validity."""
    return any(c.is_file() for c in _candidates(Path(directory) / CHECKPOINT_NAME, keep))


def load_newest_valid(
    path: str | os.PathLike,
    keep: int = DEFAULT_KEEP,
    use: Callable[[dict], T] | None = None,
) -> tuple[Any, Path]:
    """The newest checkpoint among ``path``, ``path.1``... (then ``syncer.pt``,
    ``syncer.pt.1``... of the earlier format) that loads, and its manifest.

    Without ``use``: (``load_checkpoint(cand)``, cand). With ``use``: the checkpoint is
    loaded lazily and handed to ``use``, and (its result, cand) returned; a
    ``CheckpointError`` raised inside ``use`` (a damaged fragment met while reading) moves
    on to the next older checkpoint, so ``use`` must start afresh each time. A rejected
    newer checkpoint is logged as an error (the run goes back to an older model). Raises
    ``FileNotFoundError`` when none exists and ``CheckpointError`` when none is valid."""
    path = Path(path)
    errors = []
    for cand in _candidates(path, keep):
        if not cand.is_file():
            continue
        try:
            ck = load_checkpoint(cand, lazy=use is not None)
            if cand.name.startswith(LEGACY_NAME):
                log.warning("%s is a checkpoint of the earlier single-file format", cand)
            out = use(ck) if use is not None else ck
        except CheckpointError as e:
            log.error("CHECKPOINT REJECTED: %s", e)
            errors.append(str(e))
            continue
        if errors:
            log.error(
                "RESUMING FROM AN OLDER CHECKPOINT %s: the newer ones are damaged (%s); "
                "merges after it are lost. Their fragment files are kept in %s: a damaged "
                "manifest is set aside as %s when it leaves the last %d",
                cand,
                "; ".join(errors),
                path.parent,
                path.parent / f"{PIN_PREFIX}{path.name}-<SHA-256>",
                keep,
            )
        return out, cand
    if errors:
        raise CheckpointError(f"no valid checkpoint in {path.parent}: {'; '.join(errors)}")
    raise _not_found(path)


def remove_stale_temps(directory: str | os.PathLike, name: str = CHECKPOINT_NAME) -> int:
    """Delete what a killed writer left in ``directory``: temp-named fragment directories
    and those its temp manifests name, the temp manifests (and temp files of the earlier
    format), and fragment directories no manifest names that are older than the newest
    intact manifest's (none while a manifest is damaged: ``_remove_unreferenced``); returns
    how many."""
    d = Path(directory)
    n = 0
    if d.is_dir():
        n += _remove_unreferenced(d, name, temps=True)
        for f in [*d.glob(f".{name}.tmp.*"), *d.glob(f".{LEGACY_NAME}.tmp.*")]:
            try:
                f.unlink()
                n += 1
            except OSError as e:
                log.warning("cannot remove stale checkpoint temp file %s: %s", f, e)
    if n:
        log.info("removed %d stale checkpoint temp file(s) or directories from %s", n, d)
    return n
