"""A sharded island (FSDP2 or HSDP in the user's torchrun script): every rank pushes and
fetches its own runs of each fragment (``ddiloco.runtime.learner.layout``), so nothing is
gathered and the bandwidth of every rank is used. A mixin of ``DecoupledLearner``: the
state it uses is set in ``DecoupledLearner.__init__``.

Every rank runs the same ``LearnerSync`` on its local tensors (its counters, snapshots,
rebase anchors and installs are of its shards), and feeds it the same events at the same
step, so every rank sends the same fragments with the same counters and installs the same
versions together:

- rank 0 owns the session (Join, heartbeat, rejoin) and hands the others what they need to
  push and fetch as the learner (session keys, incarnations, data ports);
- at every step boundary the ranks exchange one small message (``all_gather_object`` over
  a Gloo group): the verdicts their pushes got, the newest version of each fragment they
  hold, and from rank 0 the schedule's clock, the stop flag, merged-push notices and a
  restarted syncer. From it every rank derives the same events: a push's verdict once every
  rank that pushes part of it has one (accepted if every part was, into the latest target
  version: the part that completed the push came last), and a fetched version once every
  rank that holds part of the fragment holds that version;
- a push carries the counters once: the syncer counts a contribution when its parts tile
  the fragment (``ddiloco.algorithm.slices``).
"""

from __future__ import annotations

import logging
import time

import grpc
import torch

from ddiloco.runtime.learner.client import SyncerError, rpc_code, rpc_details
from ddiloco.runtime.learner.events import PushResult, Received, SyncerRestarted
from ddiloco.runtime.transport import wire

__all__ = ["ShardIslandMixin"]

log = logging.getLogger("ddiloco.learner")

_SUMMED = ("bytes_sent", "bytes_received", "pushes", "pushes_accepted", "pushes_rejected")
"""Report counters of a sharded island: the sum over its ranks (each rank moves its own)."""


class ShardIslandMixin:
    """The ranks of a sharded island: start, the step-boundary exchange, the end."""

    # -- collectives ----------------------------------------------------------------------
    def _gather(self, obj) -> list:
        import torch.distributed as dist

        out: list = [None] * self.plan.world
        dist.all_gather_object(out, obj, group=self._control_group)
        return out

    def _from_root(self, obj):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._root_rank, group=self._control_group)
        return box[0]

    # -- start ----------------------------------------------------------------------------
    def _start_sharded(self) -> None:
        """Join (rank 0), the syncer's initial model from every rank's runs when it has
        none, then every rank fetches its runs of the global model and installs them."""
        self._upload_id = self._from_root(self.process_id)
        error = None
        if self._is_root:
            try:
                self._join_and_fetch(initial=True)
            except SyncerError as e:
                error = str(e)
        else:
            try:
                self._init_if_needed()
            except SyncerError as e:
                error = str(e)
        errors = [e for e in self._gather(error) if e]
        if errors:  # every rank stops (a lone one would leave the others waiting)
            raise SyncerError(errors[0])
        start = self._from_root(
            {
                "creds": self.client.credentials() if self._is_root else None,
                "learner": self.learner,
                "incarnation": self.incarnation,
                "boot_id": self.boot_id,
                "budget": self.step_budget,
                "stop": self._stop.is_set(),
                "offset": self.step_offset,
            }
        )
        if not self._is_root:
            self._take_session(start)
            self.step_budget, self.step_offset = start["budget"], start["offset"]
            if start["stop"]:
                self._stop.set()
        versions, params = self._agreed_global(self.connect_timeout_s)
        self.sync.load_global(params, versions)
        self._fed = list(versions)
        if self._is_root and self._joined_clock:
            self._hear_clock(self._joined_clock)
        self._base_versions = list(versions)
        self._stop_seen = self._stop.is_set() if self._is_root else bool(start["stop"])

    def _take_session(self, d: dict) -> None:
        """Act as the learner rank 0 joined as (a rank other than 0)."""
        self.client.adopt(d["creds"])
        self.learner, self.incarnation, self.boot_id = d["learner"], d["incarnation"], d["boot_id"]
        self._joined.set()

    def _init_if_needed(self) -> None:
        """A rank other than 0: while the syncer has no model, upload this rank's runs of the
        initial model (rank 0 uploads its own and joins once the uploads tile the model)."""
        deadline = time.monotonic() + self.connect_timeout_s
        backoff = 0.1
        while True:
            try:
                st = self.client.status()
                if not st.get("initialised"):
                    self._upload_runs()
                return
            except grpc.RpcError as e:
                if time.monotonic() > deadline:
                    raise SyncerError(
                        f"[learner {self.learner} rank {self.rank}] syncer "
                        f"{self.client.address} unreachable for {self.connect_timeout_s:.0f} s: "
                        f"{rpc_details(e)}"
                    ) from None
                time.sleep(backoff)
                backoff = min(2 * backoff, 2.0)

    def _upload_runs(self) -> None:
        """This rank's part of the initial model: the runs it pushes, as fp32, in the
        ``Init`` call's ``pieces`` form (tensor index in the spec, offset, numel)."""
        index = {n: i for i, n in enumerate(self.spec["names"])}
        pieces, data = [], []
        with torch.no_grad():
            for p, f in enumerate(self.fragmentation.fragments):
                for pc in self.plan.pushes(p):
                    t = self.params[f.names[pc.j]]
                    pieces.append([index[f.names[pc.j]], pc.offset, pc.numel])
                    data.append(t.detach().float().cpu().contiguous().numpy().tobytes())
        if not pieces:
            return
        payload = b"".join(data)
        head = {
            "learner": self.learner if self.learner >= 0 else None,
            "spec": self.spec,
            "nbytes": len(payload),
            "pieces": pieces,
            "upload": self._upload_id,
        }
        r = self.client.stream("Init", wire.chunks(head, payload))
        self.stats.bytes_sent += len(payload)
        log.info(
            "[learner %d rank %d] initial model upload of %d runs: %s",
            self.learner,
            self.rank,
            len(pieces),
            "partial" if r.get("partial") else ("accepted" if r.get("accepted") else "not used"),
        )

    # -- fetching runs --------------------------------------------------------------------
    def _fetch_runs(
        self, fragments: list[int], timeout_s: float = 60.0
    ) -> dict[int, tuple[int, list[torch.Tensor], int]]:
        """This rank's runs of ``fragments`` (those it holds some of): p -> (version, one
        tensor per fragment tensor shaped as the local tensor, wire bytes)."""
        mine = [p for p in fragments if self.plan.own(p)]
        if not mine:
            return {}
        slices = [[p, pc.j, pc.offset, pc.numel] for p in mine for pc in self.plan.own(p)]
        got = self.client.fetch(mine, timeout_s=timeout_s, learner=self.learner, slices=slices)
        return {p: (v, self._local_tensors(p, ts), nb) for p, (v, ts, nb) in got.items()}

    def _local_tensors(self, p: int, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fetched runs of fragment p as its tensors' local shapes (an empty tensor where
        this rank holds none of one)."""
        f = self.fragmentation.fragments[p]
        out = [torch.empty(self.params[n].shape) for n in f.names]
        for pc, t in zip(self.plan.own(p), flat):
            out[pc.j] = t.view(self.params[f.names[pc.j]].shape)
        return out

    def _agreed_global(self, timeout_s: float) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Every rank's runs of the global model at one version per fragment (collective):
        each rank fetches, the ranks compare versions, and those behind fetch again."""
        P = self.fragmentation.P  # noqa: N806
        deadline = time.monotonic() + timeout_s
        got: dict[int, tuple[int, list[torch.Tensor]]] = {}
        want = list(range(P))
        while True:
            error = ""
            try:
                for p, (v, ts, nb) in self._fetch_runs(want, timeout_s).items():
                    got[p] = (v, ts)
                    self._remember_base(p, v, ts)
                    self.stats.bytes_received += nb
            except grpc.RpcError as e:
                error = f"{rpc_code(e).name}: {rpc_details(e)}"
            late = time.monotonic() > deadline
            mine = [got[p][0] if p in got else -1 for p in range(P)]
            every = self._gather({"v": mine, "error": error, "late": late})
            target = [max(m["v"][p] for m in every) for p in range(P)]
            behind = [
                p
                for p in range(P)
                if any(every[r]["v"][p] != target[p] for r in self.plan.fetchers[p])
            ]
            if not behind:
                break
            if any(m["late"] for m in every):
                errors = [m["error"] for m in every if m["error"]]
                raise SyncerError(
                    f"[learner {self.learner}] the island's ranks could not fetch one version "
                    f"of fragments {behind} within {timeout_s:.0f} s"
                    f"{': ' + errors[0] if errors else ''}"
                )
            if error:
                time.sleep(0.2)
            want = [p for p in behind if mine[p] < target[p]]
        params = {}
        for p, f in enumerate(self.fragmentation.fragments):
            ts = got[p][1] if p in got else self._local_tensors(p, [])
            params.update(zip(f.names, ts))
        return target, params

    # -- the step boundary ----------------------------------------------------------------
    def _round_message(self) -> dict:
        """This rank's part of the step-boundary exchange (drains its inbox)."""
        results, restarts = [], []
        while True:
            try:
                ev = self._inbox.get_nowait()
            except Exception:  # noqa: BLE001 - queue.Empty
                break
            if isinstance(ev, PushResult):
                boot = self._accepted_by_boot.pop(ev.seq, "")
                results.append((ev.fragment, ev.seq, ev.accepted, ev.target_version, boot))
            elif isinstance(ev, Received):
                held = self._held_recv.get(ev.fragment)
                if held is None or ev.version > held.version:
                    self._held_recv[ev.fragment] = ev
            elif isinstance(ev, SyncerRestarted):
                restarts.append((ev.merged_seq, ev.old_boot))
            else:  # ClockHeard: the schedule's clock is rank 0's
                self._hear_clock(ev.clock)
        msg: dict = {
            "r": results,
            "have": {p: rv.version for p, rv in self._held_recv.items()},
            "stats": [self.stats[k] for k in _SUMMED],
            "busy": not self._sendq.empty(),
            "error": "" if self._thread_error is None else repr(self._thread_error),
        }
        if self._is_root:
            creds = None
            if self._creds_sent != (self.incarnation, self.boot_id):
                creds = {
                    "creds": self.client.credentials(),
                    "learner": self.learner,
                    "incarnation": self.incarnation,
                    "boot_id": self.boot_id,
                }
                self._creds_sent = (self.incarnation, self.boot_id)
            with self._lock:
                merged = dict(self._merged_seq)
            msg.update(
                now=self._nominal_now(),
                last_s=self.sync.last_s,
                stop=self._stop.is_set(),
                restarts=restarts,
                merged=merged,
                session=creds,
                budget=self.step_budget,
                pending=self.sync.ledger.pending,
            )
        return msg

    def _apply_round(self, msgs: list[dict]) -> dict:
        """Apply the exchange's events in one order on every rank; returns rank 0's part."""
        root = msgs[0]
        if root["session"] is not None and not self._is_root:
            self._take_session(root["session"])
        self.step_budget = root["budget"]
        for ms, old_boot in root["restarts"]:
            # pushes the old syncer accepted but never published are gone with it
            for p in range(self.fragmentation.P):
                m = {int(k): v for k, v in ms.items()}.get(p, -1)
                for seq in list(self.sync.frags[p].in_flight):
                    if seq > m and self._island_boot.get(seq) == self.client.boot_part(old_boot, p):
                        self.sync.on_push_result(p, seq, accepted=False)
        for r, msg in enumerate(msgs):
            for p, seq, ok, target, boot in msg["r"]:
                self._verdicts.setdefault((p, seq), {})[r] = (ok, target, boot)
        for (p, seq), parts in sorted(self._verdicts.items()):
            if not self.plan.pushers[p] <= set(parts):
                continue
            oks = [v[0] for v in parts.values()]
            boots = {v[2] for v in parts.values() if v[0]}
            ok = all(oks) and len(boots) <= 1
            target = max(v[1] for v in parts.values()) if ok else -1
            self.sync.on_push_result(p, seq, ok, target)
            if ok and boots:
                self._island_boot[seq] = boots.pop()
            self._results_known[p].append(seq)
            for key in [k for k in self._verdicts if k[0] == p and k[1] <= seq]:
                del self._verdicts[key]
        for p in range(self.fragmentation.P):
            vs = {msgs[r]["have"].get(p, -1) for r in self.plan.fetchers[p]}
            if len(vs) != 1:
                continue
            v = vs.pop()
            if v <= self._fed[p]:
                continue
            rv = self._held_recv.get(p)
            if self.plan.own(p):
                assert rv is not None and rv.version == v
                self.sync.receive(p, v, rv.tensors, rv.ready)
                # the version stays (the next exchanges report it), the tensors go with the
                # install: held here too, every fragment's would make a copy of the shard
                self._held_recv[p] = Received(p, v, [], None)
            else:
                self.sync.receive(p, v, self._local_tensors(p, []))
            self._fed[p] = v
        merged = {int(k): v for k, v in root["merged"].items()}
        for p, ms in merged.items():
            known = [s for s in self._results_known.get(p, []) if s <= ms]
            if known:
                s = max(known)
                if s > self._merged_applied.get(p, -1):
                    self.sync.mark_merged(p, s)
                    self._merged_applied[p] = s
                self._results_known[p] = [x for x in self._results_known[p] if x > s]
        if self._is_root:
            sums = [sum(m["stats"][i] for m in msgs) for i in range(len(_SUMMED))]
            self._island_report = {
                **dict(zip(_SUMMED, sums)),
                "rank_bytes_sent": [m["stats"][0] for m in msgs],
                "rank_bytes_received": [m["stats"][1] for m in msgs],
            }
        return root

    def _sharded_step(self, tokens: int) -> tuple[list[int], bool]:
        """``step`` on every rank of a sharded island: the exchange, then the same sends and
        installs on every rank (each of its own runs). Returns (installed, stop)."""
        msgs = self._gather(self._round_message())
        errors = [(r, m["error"]) for r, m in enumerate(msgs) if m["error"]]
        if errors:  # every rank stops together (a lone one would leave the others waiting)
            raise SyncerError(
                f"[learner {self.learner}] communication thread of rank {errors[0][0]} "
                f"failed: {errors[0][1]}"
            )
        root = self._apply_round(msgs)
        if not self._is_root:
            self.sync.last_s = root["last_s"]
        outs = self.sync.after_step(tokens, root["now"])
        with self._lock:
            for o in outs:
                self._wanted.add(o.fragment)
                self._latest_seq[o.fragment] = o.seq
        for o in outs:
            self._send_or_release(o)
        installed = self.sync.install_due()
        with self._lock:
            for p in installed:
                self._base_versions[p] = self.sync.frags[p].base_version
            self._wanted = set(self.sync.waiting_fragments)
        self.stats.installs += len(installed)
        if installed and self._is_root:
            self._watch_install_delay()
        return installed, bool(root["stop"])

    def _send_or_release(self, o) -> None:
        """Queue a push of this rank's runs of ``o``'s fragment, or give its snapshot back
        when another rank pushes them all."""
        if self.plan.pushes(o.fragment):
            self._sendq.put(o)
        else:
            self.sync.release(o.fragment, o.params)

    # -- the end --------------------------------------------------------------------------
    def _close_sharded(self) -> dict[str, torch.Tensor] | None:
        """Every rank's final pushes, exchanges until rank 0 sees them merged (or
        ``flush_timeout``), then (``load_global_on_exit``) every rank's runs of the global
        model, fetched before rank 0 leaves. Returns those runs, or None."""
        finals = []
        for o in self.sync.flush():
            if o.c_steps < 1:  # installed since its last push: nothing left to contribute
                self.sync.on_push_result(o.fragment, o.seq, accepted=False)
                continue
            finals.append(o)
        with self._lock:
            self._final_fragments = sorted(o.fragment for o in finals)
            for o in finals:
                self._latest_seq[o.fragment] = o.seq
                self._final_seqs.add(o.seq)
        for o in finals:
            self._send_or_release(o)
        deadline = time.monotonic() + self.flush_timeout_s
        while True:
            msg = self._round_message()
            if self._is_root:
                msg["go"] = (
                    time.monotonic() < deadline and self._connected and self._thread_error is None
                )
            msgs = self._gather(msg)
            root = self._apply_round(msgs)
            busy = any(m["busy"] for m in msgs)
            if not root["go"] or not (busy or root["pending"] > 1e-9):
                break
            time.sleep(0.02)
        if not self.load_global_on_exit:
            return None
        try:
            return self._agreed_global(self.flush_timeout_s)[1]
        except SyncerError as e:
            log.warning(
                "[learner %d rank %d] could not fetch the global model at exit (%s): the "
                "model keeps its local parameters",
                self.learner,
                self.rank,
                e,
            )
            return None
