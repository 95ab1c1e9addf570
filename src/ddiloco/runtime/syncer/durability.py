"""Durable publication: merged fragments are published (visible to ``Fetch``/``Watch``)
once a checkpoint holding them is on disk; checkpoints written by a background thread,
coalescing the merges made during a write; resume from a checkpoint."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ddiloco.algorithm.codecs import get_codec
from ddiloco.algorithm.downlink import DeltaChain
from ddiloco.algorithm.schedule import SlotClock
from ddiloco.algorithm.syncer_state import Merged, SyncerState
from ddiloco.runtime.syncer.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    fragment_dirs,
    load_newest_valid,
    save_atomic,
)
from ddiloco.runtime.syncer.common import LearnerInfo
from ddiloco.runtime.transport.spec import check_spec, fragmentation_from_spec, spec_fingerprint

__all__ = ["Durability"]

log = logging.getLogger("ddiloco.syncer")


class Durability:
    """Publication, merge bookkeeping and checkpoints of ``SyncerServer`` (a mixin: the
    server's lock is held where a method says so)."""

    def _encode_down(self, params: list[torch.Tensor]) -> list[memoryview]:
        """The downlink bytes of a fragment, as pieces to send one after the other (fp32:
        views of the published tensors themselves, which are never written again)."""
        return get_codec(self.config.downlink_codec).encode_many(params)

    def _publish(self, p: int, version: int, params: list[torch.Tensor]) -> None:
        if not self._owns(p):
            return  # another shard's fragment
        self._pub[p] = (version, self._encode_down(params))
        self._pub_theta[p] = params  # the published tensors: never written again
        if self.config.downlink_delta:
            chain = self._chains.get(p)
            if chain is None:  # the first version published here (an init or a resume)
                codec = get_codec(self.config.downlink_codec)
                self._chains[p] = DeltaChain(codec, params, version)
            else:
                chain.advance(version, params)
                self._trim_chain(p)

    def _on_merged(self, mg: Merged, merge_s: float) -> None:
        """Called under the lock for every Merged the state machine returns."""
        for m, seq in zip(mg.learners, mg.seqs):
            self._merged_seq.setdefault(m, {})[mg.fragment] = seq
        self.counters["merges"] += 1
        try:  # timing and metrics: never in the way of publishing what was merged
            fetch_s = [
                i.report.get("fetch_s", 0.0)
                for i in self._learners.values()
                if i.state == "live" and i.report.get("fetch_s") is not None
            ]
            self.state.observe_sync_s(merge_s + (sum(fetch_s) / len(fetch_s) if fetch_s else 0.0))
            if self._metrics:
                self._event(
                    "merge",
                    fragment=mg.fragment,
                    version=mg.version,
                    learners=list(mg.learners),
                    n_learners=len(mg.learners),
                    weights=[round(w, 3) for w in mg.weights],
                    reason=mg.reason,
                    merge_s=round(merge_s, 6),
                )
        except Exception:  # noqa: BLE001 - counted and logged
            self.counters["merge_bookkeeping_errors"] += 1
            log.exception(
                "merge of fragment %d: bookkeeping failed (the merge stands)", mg.fragment
            )
        self._dirty_merges += 1
        if self._durable:
            self._unpublished[mg.fragment] = mg
            self._ckpt_requested = True
            self._ckpt_cv.notify_all()
        else:
            self._publish_merged(mg)
            if self.config.checkpoint_dir and self._dirty_merges >= self.config.checkpoint_every:
                self._ckpt_requested = True
                self._ckpt_cv.notify_all()

    def _publish_merged(self, mg: Merged, merged_seq: dict | None = None) -> bool:
        """Publish a merged version (caller holds the lock). A failure (out of memory while
        encoding) is counted and the version kept for a retry by the timer thread: the
        state machine has committed the merge, so it is published late, never lost."""
        try:
            if mg.version > self._pub[mg.fragment][0]:
                self._publish(mg.fragment, mg.version, mg.params)
        except Exception as e:  # noqa: BLE001 - counted, logged and retried
            self.counters["publish_errors"] += 1
            self._publish_retry[mg.fragment] = mg
            log.error(
                "publishing version %d of fragment %d failed (%s: %s): retrying",
                mg.version,
                mg.fragment,
                type(e).__name__,
                e,
            )
            return False
        self._publish_retry.pop(mg.fragment, None)
        # copy on write: watchers hold the old mapping; only these learners' entries moved
        self._merged_seq_pub = (
            {m: dict(d) for m, d in merged_seq.items()}
            if merged_seq is not None
            else {**self._merged_seq_pub, **{m: dict(self._merged_seq[m]) for m in mg.learners}}
        )
        self._published_cv.notify_all()
        return True

    def _retry_publish(self) -> None:
        """Publish versions whose publication failed (timer thread, lock held)."""
        for mg in list(self._publish_retry.values()):
            self._publish_merged(mg)

    def _handle_merges(self, merged: list[Merged], t0: float) -> None:
        for mg in merged:
            self._on_merged(mg, time.monotonic() - t0)
        self._followups(t0)

    def _followups(self, t0: float) -> None:
        """Decisions on rounds that filled while their fragment's merge ran unlocked."""
        for p, out in self.state.take_followups():
            if isinstance(out, Merged):
                self._on_merged(out, time.monotonic() - t0)
            else:
                self.liveness.add_timer(out.at_s, p)

    def _retry_due(self) -> None:
        """Each tick of the timer thread (``Liveness``; lock held)."""
        if self._publish_retry:
            self._retry_publish()

    def _fire_timer(self, p: int, now: float) -> None:
        """Fragment p's grace deadline is due (the timer thread; lock held)."""
        t0 = time.monotonic()
        out = self.state.on_timer(p, now)
        if isinstance(out, Merged):
            self._on_merged(out, time.monotonic() - t0)
        elif out is not None:
            self.liveness.add_timer(out.at_s, p)
        self._followups(t0)

    @contextlib.contextmanager
    def _unlocked(self):
        """The state machine's merge arithmetic runs with the lock released, so merges of
        different fragments (and every other call) proceed meanwhile. Its wall and CPU time
        (of the merging thread) are counted here."""
        self._lock.release()
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall, cpu = time.perf_counter() - t_wall, time.thread_time() - t_cpu
            self._lock.acquire()
            self.merge_s += wall
            self.merge_cpu_s += cpu

    def _snapshot(self) -> dict:
        """What a checkpoint holds (caller holds the lock; the write happens outside it).
        Theta and momentum are the state's current tensors, not copies: the state never
        writes them in place (every merge builds new tensors and swaps them in, see
        ``SyncerState.state_dict``), so merges that commit during the write leave the
        snapshot's tensors as they were, and a write costs no model-sized copy."""
        return {
            "format": 1,
            "spec": self.spec,
            "state": self.state.state_dict(),
            "pub_versions": [v for v, _ in self._pub],
            "merged_seq": {m: dict(d) for m, d in self._merged_seq.items()},
            "incarnations": dict(self._incarnations),
            "steps_done": dict(self._steps_done),
            "counters": dict(self.counters),
            "syncer_config": asdict(self.config.syncer),
            "saved_wall": time.time(),
            "epoch_s": self.epoch_s,
            "clock": self.clock.to_dict() if self.clock else None,
            "accounting": {  # goodput's ledger survives a restart of the syncer
                "run_started_wall": self.run_started_wall,
                "learners": {
                    m: {"process": i.process, "carried": i.carried, "report": dict(i.report)}
                    for m, i in self._learners.items()
                },
            },
        }

    def _write(self, snap: dict) -> None:
        t0 = time.monotonic()
        n = save_atomic(  # releases each fragment's tensors once they are on disk
            snap,
            Path(self.config.checkpoint_dir) / CHECKPOINT_NAME,
            keep=self.config.checkpoint_keep,
            release=True,
        )
        self.counters["checkpoints"] += 1
        self.counters["checkpoint_bytes"] = n
        self.counters["checkpoint_s_total"] = self.counters.get("checkpoint_s_total", 0) + (
            time.monotonic() - t0
        )

    def _ckpt_loop(self) -> None:
        if not self.config.checkpoint_dir:
            return
        while True:
            with self._lock:
                while not self._ckpt_requested and not self._closed:
                    self._ckpt_cv.wait(1.0)
                if self._closed:
                    return
                self._ckpt_requested = False
                self._dirty_merges = 0
                snap = self._snapshot()
                to_publish = dict(self._unpublished)
                self._unpublished.clear()
                merged_seq = {m: dict(d) for m, d in self._merged_seq.items()}
            try:
                self._write(snap)
            except OSError as e:  # disk trouble is an event, not a crash; retry next merge
                log.error("checkpoint write failed: %s", e)
                with self._lock:
                    self._unpublished = {**to_publish, **self._unpublished}
                    self.counters["checkpoint_errors"] += 1
                continue
            with self._lock:
                for _p, mg in to_publish.items():
                    self._publish_merged(mg, merged_seq)

    def _load(self, path: Path) -> None:
        try:
            ck, path = load_newest_valid(path, self.config.checkpoint_keep, use=self._load_state)
        except CheckpointError as e:
            raise CheckpointError(f"{e}. {_where_the_data_is(path)}") from None
        except FileNotFoundError as e:
            if not fragment_dirs(path.parent, path.name):
                raise
            raise FileNotFoundError(f"{e}. {_where_the_data_is(path)}") from None
        for p in range(len(self._pub)):
            self._publish(p, self.state.version(p), self.state.frags[p].theta)
        self._merged_seq = {
            int(m): {int(p): int(s) for p, s in d.items()} for m, d in ck["merged_seq"].items()
        }
        self._merged_seq_pub = {m: dict(d) for m, d in self._merged_seq.items()}
        self._incarnations = {int(m): int(v) for m, v in ck["incarnations"].items()}
        self._steps_done = {int(m): int(v) for m, v in ck.get("steps_done", {}).items()}
        self.counters.update(ck.get("counters", {}))
        self.epoch_s = ck.get("epoch_s") or self.epoch_s
        if ck.get("clock"):  # the learners' slots continue where they were
            self.clock = SlotClock.from_dict(ck["clock"])
        acc = ck.get("accounting") or {}
        self.run_started_wall = acc.get("run_started_wall")
        for m, d in (acc.get("learners") or {}).items():
            # known learners, not live until they join again (the same process continues
            # its ledger; a restarted one is folded into the carried totals)
            self._learners[int(m)] = LearnerInfo(
                incarnation=self._incarnations.get(int(m), 0),
                state="dead",
                report=d.get("report") or {},
                process=d.get("process") or "",
                carried=d.get("carried"),
            )
        self.counters["resumes"] += 1
        self._event("resume", versions=self.state.versions(), merges=self.state.merges)
        log.info(
            "resumed from %s: versions %s, %d merges",
            path,
            self.state.versions(),
            self.state.merges,
        )

    def _load_state(self, ck: dict) -> dict:
        """The state of checkpoint ``ck`` (read lazily), built fragment by fragment: zeros
        for its spec, then each fragment's tensors, read and verified as they are taken, in
        place of the zeros, so a resume peaks at the live state plus about one fragment. A
        damaged fragment raises ``CheckpointError`` and ``load_newest_valid`` calls this
        again with an older checkpoint."""
        self.state = None  # let an earlier attempt's state go before the next is built
        self._setup(ck["spec"])
        self.state.load_state_dict(ck["state"])
        return ck

    def _setup(
        self, spec: dict, initial: dict[str, torch.Tensor] | None = None, copy: bool = True
    ) -> None:
        """The state for ``spec``: from ``initial``, or zeros that a resume replaces. With
        ``copy`` (views of one received buffer) each tensor is copied into its own memory,
        one at a time, so that a merge frees the one it replaces; the buffer goes when the
        caller returns. Without, the state takes the tensors themselves (each already in its
        own memory). A shard holds only the fragments it owns."""
        check_spec(spec)
        frag = fragmentation_from_spec(spec)
        owned = {p for p in range(frag.P) if self._owns(p)}
        if initial is None:
            shapes = dict(zip(spec["names"], spec["shapes"]))
            initial = {n: torch.zeros(shapes[n]) for p in owned for n in frag.fragments[p].names}
            copy = False
        else:
            initial = {n: initial[n] for p in owned for n in frag.fragments[p].names}
        self.state = SyncerState(frag, initial, self.config.syncer, owned=owned, copy=copy)
        self.state.unlocked = self._unlocked
        self.spec = spec
        self._fp = spec_fingerprint(spec)
        self.epoch_s = time.time()
        self._pub = [(0, []) for _ in range(frag.P)]
        self._pub_theta, self._chains, self._held = {}, {}, {}
        shape = dict(zip(spec["names"], (tuple(s) for s in spec["shapes"])))
        self._shapes = [[shape[n] for n in f.names] for f in frag.fragments]  # per fragment


def _where_the_data_is(manifest: Path) -> str:
    """What a refused resume says about the fragment directories left beside ``manifest``
    (a refusal deletes none of them) and what to do."""
    dirs = fragment_dirs(manifest.parent, manifest.name)
    if not dirs:
        return f"No fragment directory is left in {manifest.parent}"
    listed = ", ".join(str(d) for d in dirs)
    return (
        f"The fragment directories are kept, newest first: {listed} (one safetensors file "
        f"per fragment). To resume from one, put its intact manifest back as {manifest} "
        f"(repaired, or from a backup) and start again with --resume; to start a new run "
        f"instead, move {manifest.parent} aside and start without --resume"
    )
