"""Durability: merged fragments are published (``publication``) once a checkpoint holding
them is on disk; checkpoints written by a background thread, coalescing the merges made
during a write; resume from a checkpoint.

``Durability`` owns the checkpoint thread, its condition, the merges waiting for a
checkpoint and the count of merges since the last one. What a checkpoint holds is
``snapshot`` of the server's parts; ``Durability.load`` restores the state (through the
server's ``setup``) and the publication, and returns the rest (``Resumed``).

A checkpoint writes only the fragments merged since the one before (the merged fragment's
Theta and momentum, about 8N / P bytes, and the manifest with the small shared state) and
names the others' files from earlier checkpoints. Which fragments those are needs no
bookkeeping of merges: the state never writes a tensor in place (a merge swaps new ones
in), so a fragment whose state still holds the very tensors the newest checkpoint wrote
or resumed from (held by weak references) has not changed."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddiloco.algorithm.schedule import SlotClock
from ddiloco.algorithm.syncer_state import Merged, SyncerConfig, SyncerState
from ddiloco.runtime.syncer.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    fragment_dirs,
    load_newest_valid,
    recovery_copies,
    save_atomic,
    stored_fragments,
)
from ddiloco.runtime.syncer.common import LearnerInfo
from ddiloco.runtime.syncer.publication import Publication

__all__ = ["Durability", "Resumed", "snapshot"]

log = logging.getLogger("ddiloco.syncer")


@dataclass(slots=True)
class Resumed:
    """What a resumed checkpoint gives back besides the state and the publication (which
    ``Durability.load`` restores itself): the learners' side of the server."""

    path: Path
    """The checkpoint resumed from (the newest valid one)."""
    incarnations: dict[int, int]
    steps_done: dict[int, int]
    epoch_s: float | None
    clock: SlotClock | None
    run_started_wall: float | None
    learners: dict[int, LearnerInfo]
    """Known learners, not live until they join again."""


def snapshot(
    state: SyncerState,
    spec: dict | None,
    publication: Publication,
    *,
    syncer_config: SyncerConfig,
    counters: Counter,
    learners: dict[int, LearnerInfo],
    incarnations: dict[int, int],
    steps_done: dict[int, int],
    epoch_s: float | None,
    clock: SlotClock | None,
    run_started_wall: float | None,
) -> dict:
    """What a checkpoint holds (the caller holds the server's lock; the write happens
    outside it). Theta and momentum are the state's current tensors, not copies: the state
    never writes them in place (every merge builds new tensors and swaps them in, see
    ``SyncerState.state_dict``), so merges that commit during the write leave the
    snapshot's tensors as they were, and a write costs no model-sized copy."""
    return {
        "format": 1,
        "spec": spec,
        "state": state.state_dict(),
        "pub_versions": publication.versions(),
        "merged_seq": publication.merged_seq_copy(),
        "incarnations": dict(incarnations),
        "steps_done": dict(steps_done),
        "counters": dict(counters),
        "syncer_config": asdict(syncer_config),
        "saved_wall": time.time(),
        "epoch_s": epoch_s,
        "clock": clock.to_dict() if clock else None,
        "accounting": {  # goodput's ledger survives a restart of the syncer
            "run_started_wall": run_started_wall,
            "learners": {
                m: {"process": i.process, "carried": i.carried, "report": dict(i.report)}
                for m, i in learners.items()
            },
        },
    }


class Durability:
    """The checkpoint thread of ``SyncerServer``: with ``checkpoint_every == 1`` merged
    versions wait here until a checkpoint holding them is on disk, then go to the
    publication; otherwise they are published at once and a checkpoint is written every
    ``checkpoint_every`` merges. Every call holds the server's lock (``write`` and
    ``load`` excepted: they run without it)."""

    def __init__(
        self,
        lock: threading.Lock,
        counters: MutableMapping[str, Any],
        publication: Publication,
        *,
        checkpoint_dir: str | None,
        checkpoint_every: int,
        checkpoint_keep: int,
        closed: Callable[[], bool],
        snapshot: Callable[[], dict],
    ) -> None:
        """``counters``: the server's (checkpoints, their bytes and time, write errors,
        resumes). ``publication``: where merged versions go once durable. ``closed()``:
        whether the server is shutting down. ``snapshot()``: the server's checkpoint
        (``snapshot``), taken with the lock held."""
        self.counters = counters
        self.publication = publication
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.checkpoint_keep = checkpoint_keep
        self._closed, self._snapshot = closed, snapshot
        self.cv = threading.Condition(lock)
        """Wakes the checkpoint thread (a checkpoint is due, or the server closes)."""
        self.requested = False
        """A checkpoint is due."""
        self.dirty_merges = 0
        """Merges since the last checkpoint was taken."""
        self.unpublished: dict[int, Merged] = {}
        """p -> merged version waiting for a checkpoint holding it (``durable``)."""
        self.thread: threading.Thread | None = None
        self.replicate: Callable[[dict], Any] | None = None
        """A replicated syncer's leader with hot standbys (``replica.Replicator.round``):
        each checkpoint is sent to them before it is written, and its versions are
        published once both are done; None (the standbys' leader lost its lease): nothing
        of it is published."""
        self._stored: dict[int, tuple[tuple[weakref.ref, ...], dict]] = {}
        """p -> the tensors (weak references) that the newest checkpoint holds for fragment
        p, and its manifest entry: while the state still holds those very tensors, p has
        not merged since (the state never writes a tensor in place: a merge swaps new ones
        in), and the next checkpoint names that file again instead of writing it."""

    @property
    def durable(self) -> bool:
        """Every merge is on disk before it is published."""
        return bool(self.checkpoint_dir) and self.checkpoint_every == 1

    def merged(self, mg: Merged) -> None:
        """A merge the state machine committed: published once durable, or at once."""
        self.dirty_merges += 1
        if self.durable:
            self.unpublished[mg.fragment] = mg
            self.requested = True
            self.cv.notify_all()
        else:
            self.publication.publish_merged(mg)
            if self.checkpoint_dir and self.dirty_merges >= self.checkpoint_every:
                self.requested = True
                self.cv.notify_all()

    def start(self) -> threading.Thread:
        self.thread = threading.Thread(target=self._loop, name="syncer-ckpt", daemon=True)
        self.thread.start()
        return self.thread

    def wake(self) -> None:
        """Wake the thread (the server is closing)."""
        self.cv.notify_all()

    def write(self, snap: dict) -> None:
        """Write ``snap`` (``snapshot``) as the newest checkpoint: the files of the fragments
        whose tensors changed since the newest checkpoint, and a manifest that names the
        others' files from earlier checkpoints (``save_atomic(reuse=...)``)."""
        t0 = time.monotonic()
        state = snap["state"]
        tensors = [[*th, *mo] for th, mo in zip(state["theta"], state["momentum"])]
        reuse = {
            p: entry
            for p, (refs, entry) in self._stored.items()
            if p < len(tensors) and _same(refs, tensors[p])
        }
        refs = [tuple(weakref.ref(t) for t in ts) for ts in tensors]
        del tensors
        w = save_atomic(  # releases each fragment's tensors once they are on disk
            snap,
            Path(self.checkpoint_dir or ".") / CHECKPOINT_NAME,
            keep=self.checkpoint_keep,
            release=True,
            reuse=reuse,
        )
        self._stored = {p: (refs[p], e) for p, e in enumerate(w.fragments) if e is not None}
        c = self.counters
        c["checkpoints"] += 1
        c["checkpoint_bytes"] = w.bytes
        c["checkpoint_bytes_total"] = c.get("checkpoint_bytes_total", 0) + w.bytes
        c["checkpoint_fragment_files"] = c.get("checkpoint_fragment_files", 0) + len(w.written)
        c["checkpoint_s_total"] = c.get("checkpoint_s_total", 0) + (time.monotonic() - t0)

    def _loop(self) -> None:
        if not self.checkpoint_dir:
            return
        while True:
            with self.cv:
                while not self.requested and not self._closed():
                    self.cv.wait(1.0)
                if self._closed():
                    return
                self.requested = False
                self.dirty_merges = 0
                snap = self._snapshot()
                to_publish = dict(self.unpublished)
                self.unpublished.clear()
                merged_seq = self.publication.merged_seq_copy()
            replicated = self._replicate(snap)
            try:
                self.write(snap)
            except OSError as e:  # disk trouble is an event, not a crash; retry next merge
                log.error("checkpoint write failed: %s", e)
                replicated()
                with self.cv:
                    self.unpublished = {**to_publish, **self.unpublished}
                    self.counters["checkpoint_errors"] += 1
                continue
            if not replicated():
                log.error("checkpoint not replicated (this leader's lease ended): unpublished")
                with self.cv:
                    self.unpublished = {**to_publish, **self.unpublished}
                continue
            with self.cv:
                for _p, mg in to_publish.items():
                    self.publication.publish_merged(mg, merged_seq)

    def _replicate(self, snap: dict) -> Callable[[], bool]:
        """Send ``snap`` to the standbys (``replicate``) in a thread of its own, beside the
        checkpoint's write (which empties the snapshot's tensor lists as it goes: the
        thread holds its own lists of the same tensors, which are never written in place);
        returns the wait for it: whether the standbys hold it."""
        if self.replicate is None:
            return lambda: True
        replicate = self.replicate
        state = snap["state"]
        mine = {
            **snap,
            "state": {
                **state,
                "theta": [list(ts) for ts in state["theta"]],
                "momentum": [list(ts) for ts in state["momentum"]],
            },
        }
        done: list[bool] = []

        def run() -> None:
            try:
                done.append(replicate(mine) is not None)
            except Exception:  # noqa: BLE001 - a bug there must not publish; it is logged
                log.exception("replication failed")
                done.append(False)

        t = threading.Thread(target=run, name="syncer-replicate", daemon=True)
        t.start()

        def wait() -> bool:
            t.join()
            return bool(done and done[0])

        return wait

    def load(self, path: Path, setup: Callable[[dict], SyncerState]) -> Resumed:
        """Resume from ``path`` (or, if it is damaged or holds NaN, the newest valid one of
        those kept). ``setup(spec)``: the server's state for ``spec``, zeros that the
        checkpoint's tensors replace fragment by fragment as they are read and verified,
        so a resume peaks at the live state plus about one fragment (a damaged fragment
        raises ``CheckpointError`` and ``load_newest_valid`` tries an older checkpoint).
        The publication is restored here; the rest is returned."""
        got: list[SyncerState] = []

        def use(ck: dict) -> dict:
            got.clear()  # let an earlier attempt's state go before the next is built
            state = setup(ck["spec"])
            state.load_state_dict(ck["state"])
            got.append(state)
            stored = stored_fragments(ck) or []
            self._stored = {  # the resumed tensors are on disk: the next write names them
                p: (tuple(weakref.ref(t) for t in [*f.theta, *f.momentum]), e)
                for p, (f, e) in enumerate(zip(state.frags, stored))
                if e is not None
            }
            return ck

        try:
            ck, path = load_newest_valid(path, self.checkpoint_keep, use=use)
        except CheckpointError as e:
            raise CheckpointError(f"{e}. {_where_the_data_is(path)}") from None
        except FileNotFoundError as e:
            if not fragment_dirs(path.parent, path.name):
                raise
            raise FileNotFoundError(f"{e}. {_where_the_data_is(path)}") from None
        state = got[0]
        pub = self.publication
        for p in range(len(pub.pub)):
            pub.publish(p, state.version(p), state.frags[p].theta)
        pub.restore(
            {int(m): {int(p): int(s) for p, s in d.items()} for m, d in ck["merged_seq"].items()}
        )
        incarnations = {int(m): int(v) for m, v in ck["incarnations"].items()}
        self.counters.update(ck.get("counters", {}))
        acc = ck.get("accounting") or {}
        learners = {
            # known learners, not live until they join again (the same process continues
            # its ledger; a restarted one is folded into the carried totals)
            int(m): LearnerInfo(
                incarnation=incarnations.get(int(m), 0),
                state="dead",
                report=d.get("report") or {},
                process=d.get("process") or "",
                carried=d.get("carried"),
            )
            for m, d in (acc.get("learners") or {}).items()
        }
        self.counters["resumes"] += 1
        log.info("resumed from %s: versions %s, %d merges", path, state.versions(), state.merges)
        return Resumed(
            path=path,
            incarnations=incarnations,
            steps_done={int(m): int(v) for m, v in ck.get("steps_done", {}).items()},
            epoch_s=ck.get("epoch_s"),
            clock=SlotClock.from_dict(ck["clock"]) if ck.get("clock") else None,
            run_started_wall=acc.get("run_started_wall"),
            learners=learners,
        )


def _same(refs: tuple[weakref.ref, ...], tensors: list[Any]) -> bool:
    """Whether ``tensors`` are the very tensors ``refs`` refer to (a freed one's reference
    is dead, so a tensor allocated in its place never matches)."""
    return len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors))


def _where_the_data_is(manifest: Path) -> str:
    """What a refused resume says about the fragment directories left beside ``manifest``
    (a refusal deletes none of them) and what to do."""
    dirs = fragment_dirs(manifest.parent, manifest.name)
    if not dirs:
        return f"No fragment directory is left in {manifest.parent}"
    listed = ", ".join(str(d) for d in dirs)
    copies = recovery_copies(manifest.parent, manifest.name)
    how = (
        f"{copies[0]} is the newest intact copy of a manifest (each checkpoint writes one "
        f"into its fragment directory) and its fragment files are all there: to resume from "
        f"it, copy it to {manifest} and start again with --resume"
        if copies
        else f"To resume from one, put its intact manifest back as {manifest} (repaired, or "
        f"from a backup) and start again with --resume"
    )
    return (
        f"The fragment directories are kept, newest first: {listed} (one safetensors file "
        f"per fragment). {how}; to start a new run instead, move {manifest.parent} aside and "
        f"start without --resume"
    )
