"""A sharded island (FSDP2 or HSDP in the user's torchrun script): every rank pushes and
fetches its own runs of each fragment (``ddiloco.runtime.learner.layout``), so nothing is
gathered and the bandwidth of every rank is used.

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
from collections.abc import Callable

import grpc
import torch

from ddiloco.runtime.learner.client import SyncerError, rpc_code, rpc_details
from ddiloco.runtime.learner.context import LearnerContext
from ddiloco.runtime.learner.inbox import ClockHeard, Inbox, PushResult, Received, SyncerRestarted
from ddiloco.runtime.learner.island import InstallWatch, copy_params
from ddiloco.runtime.learner.layout import IslandPlan
from ddiloco.runtime.learner.links import DeltaBases, Links
from ddiloco.runtime.learner.session import Session
from ddiloco.runtime.learner.sharded import ShardedClient
from ddiloco.runtime.transport import wire

__all__ = ["Sharded"]

log = logging.getLogger("ddiloco.learner")

_SUMMED = ("bytes_sent", "bytes_received", "pushes", "pushes_accepted", "pushes_rejected")
"""Report counters of a sharded island: the sum over its ranks (each rank moves its own)."""


class Sharded:
    """The ranks of a sharded island: start, the step-boundary exchange, the end."""

    def __init__(
        self,
        ctx: LearnerContext,
        client: ShardedClient,
        inbox: Inbox,
        links: Links,
        bases: DeltaBases,
        report: Callable[[], dict],
    ) -> None:
        assert ctx.plan is not None
        self.ctx = ctx
        self.plan: IslandPlan = ctx.plan
        self.client = client
        self.inbox = inbox
        self.links = links
        self.bases = bases
        self.session = Session(ctx, client, inbox, bases, report, upload_part=self._upload_runs)
        self.watch = InstallWatch(ctx)
        self.report: dict = {}
        """The ranks' traffic summed, and each rank's bytes (rank 0, as of the last step)."""
        self._held_recv: dict[int, Received] = {}  # the newest version of p fetched
        self._verdicts: dict[tuple[int, int], dict[int, tuple]] = {}  # (p, seq) -> rank's
        self._island_boot: dict[int, str] = {}  # seq -> the boot that accepted every part
        self._fed: list[int] = [-1] * ctx.fragmentation.P  # the newest version every rank holds
        self._creds_sent: tuple[int, str] | None = None
        self._upload_id = ""

    # -- collectives ----------------------------------------------------------------------
    def _gather(self, obj) -> list:
        import torch.distributed as dist

        out: list = [None] * self.plan.world
        dist.all_gather_object(out, obj, group=self.ctx.control_group)
        return out

    def _from_root(self, obj):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.ctx.root_rank, group=self.ctx.control_group)
        return box[0]

    # -- start ----------------------------------------------------------------------------
    def start(self) -> bool:
        """Join (rank 0), the syncer's initial model from every rank's runs when it has
        none, then every rank fetches its runs of the global model and installs them and
        starts its threads (the heartbeat is rank 0's)."""
        ctx, session = self.ctx, self.session
        self._upload_id = self._from_root(ctx.process_id)
        error = None
        if ctx.is_root:
            try:
                session.join_and_fetch()
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
                "creds": self.client.credentials() if ctx.is_root else None,
                "learner": ctx.learner,
                "incarnation": ctx.incarnation,
                "boot_id": ctx.boot_id,
                "budget": session.step_budget,
                "stop": ctx.stop.is_set(),
                "offset": session.step_offset,
            }
        )
        if not ctx.is_root:
            session.adopt(start)
            session.step_budget, session.step_offset = start["budget"], start["offset"]
            if start["stop"]:
                ctx.stop.set()
        versions, params = self._agreed_global(ctx.connect_timeout_s)
        ctx.sync.load_global(params, versions)
        self._fed = list(versions)
        if ctx.is_root and session.joined_clock:
            self.inbox.hear_clock(session.joined_clock)
        self.links.base_versions = list(versions)
        stop = ctx.stop.is_set() if ctx.is_root else bool(start["stop"])
        self._creds_sent = (ctx.incarnation, ctx.boot_id)
        self.links.start([(session.heartbeater, "ddiloco-hb")] if ctx.is_root else [])
        return stop

    def _init_if_needed(self) -> None:
        """A rank other than 0: while the syncer has no model, upload this rank's runs of the
        initial model (rank 0 uploads its own and joins once the uploads tile the model)."""
        ctx = self.ctx
        deadline = time.monotonic() + ctx.connect_timeout_s
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
                        f"[learner {ctx.learner} rank {ctx.rank}] syncer "
                        f"{self.client.address} unreachable for {ctx.connect_timeout_s:.0f} s: "
                        f"{rpc_details(e)}"
                    ) from None
                time.sleep(backoff)
                backoff = min(2 * backoff, 2.0)

    def _upload_runs(self) -> None:
        """This rank's part of the initial model: the runs it pushes, as fp32, in the
        ``Init`` call's ``pieces`` form (tensor index in the spec, offset, numel)."""
        ctx = self.ctx
        index = {n: i for i, n in enumerate(ctx.spec["names"])}
        pieces, data = [], []
        with torch.no_grad():
            for p, f in enumerate(ctx.fragmentation.fragments):
                for pc in self.plan.pushes(p):
                    t = ctx.params[f.names[pc.j]]
                    pieces.append([index[f.names[pc.j]], pc.offset, pc.numel])
                    data.append(t.detach().float().cpu().contiguous().numpy().tobytes())
        if not pieces:
            return
        payload = b"".join(data)
        head = {
            "learner": ctx.learner if ctx.learner >= 0 else None,
            "spec": ctx.spec,
            "nbytes": len(payload),
            "pieces": pieces,
            "upload": self._upload_id,
        }
        r = self.client.stream("Init", wire.chunks(head, payload))
        ctx.stats.bytes_sent += len(payload)
        log.info(
            "[learner %d rank %d] initial model upload of %d runs: %s",
            ctx.learner,
            ctx.rank,
            len(pieces),
            "partial" if r.get("partial") else ("accepted" if r.get("accepted") else "not used"),
        )

    # -- the global model -----------------------------------------------------------------
    def _agreed_global(self, timeout_s: float) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Every rank's runs of the global model at one version per fragment (collective):
        each rank fetches, the ranks compare versions, and those behind fetch again."""
        ctx, links = self.ctx, self.links
        P = ctx.fragmentation.P  # noqa: N806
        deadline = time.monotonic() + timeout_s
        got: dict[int, tuple[int, list[torch.Tensor]]] = {}
        want = list(range(P))
        while True:
            error = ""
            try:
                for p, (v, ts, nb) in links.fetch_runs(want, timeout_s).items():
                    got[p] = (v, ts)
                    self.bases.remember(p, v, ts)
                    ctx.stats.bytes_received += nb
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
                    f"[learner {ctx.learner}] the island's ranks could not fetch one version "
                    f"of fragments {behind} within {timeout_s:.0f} s"
                    f"{': ' + errors[0] if errors else ''}"
                )
            if error:
                time.sleep(0.2)
            want = [p for p in behind if mine[p] < target[p]]
        params: dict[str, torch.Tensor] = {}
        for p, f in enumerate(ctx.fragmentation.fragments):
            ts = got[p][1] if p in got else links.local_tensors(p, [])
            params.update(zip(f.names, ts))
        return target, params

    def global_model(self, timeout_s: float) -> tuple[list[int], dict[str, torch.Tensor]]:
        return self._agreed_global(timeout_s)

    def install(self, versions: list[int], params: dict[str, torch.Tensor]) -> None:
        sync = self.ctx.sync
        sync.fail()
        sync.load_global(params, versions)
        self._fed = list(versions)
        self.links.installed_global(versions)

    # -- the step boundary ----------------------------------------------------------------
    def _round_message(self) -> dict:
        """This rank's part of the step-boundary exchange (drains its inbox)."""
        ctx, inbox = self.ctx, self.inbox
        results, restarts = [], []
        for ev in inbox.take():
            if isinstance(ev, PushResult):
                boot = inbox.accepted_by_boot.pop(ev.seq, "")
                results.append((ev.fragment, ev.seq, ev.accepted, ev.target_version, boot))
            elif isinstance(ev, Received):
                held = self._held_recv.get(ev.fragment)
                if held is None or ev.version > held.version:
                    self._held_recv[ev.fragment] = ev
            elif isinstance(ev, SyncerRestarted):
                restarts.append((ev.merged_seq, ev.old_boot))
            elif isinstance(ev, ClockHeard):  # the schedule's clock is rank 0's
                inbox.hear_clock(ev.clock)
        msg: dict = {
            "r": results,
            "have": {p: rv.version for p, rv in self._held_recv.items()},
            "stats": [ctx.stats[k] for k in _SUMMED],
            "busy": not self.links.sendq.empty(),
            "error": "" if self.links.thread_error is None else repr(self.links.thread_error),
        }
        if ctx.is_root:
            creds = None
            if self._creds_sent != (ctx.incarnation, ctx.boot_id):
                creds = self.session.credentials()
                self._creds_sent = (ctx.incarnation, ctx.boot_id)
            msg.update(
                now=inbox.nominal_now(),
                last_s=ctx.sync.last_s,
                stop=ctx.stop.is_set(),
                restarts=restarts,
                merged=inbox.merged(),
                session=creds,
                budget=self.session.step_budget,
                pending=ctx.sync.ledger.pending,
            )
        return msg

    def _apply_round(self, msgs: list[dict]) -> dict:
        """Apply the exchange's events in one order on every rank; returns rank 0's part."""
        ctx, inbox, sync = self.ctx, self.inbox, self.ctx.sync
        root = msgs[0]
        if root["session"] is not None and not ctx.is_root:
            self.session.adopt(root["session"])
        self.session.step_budget = root["budget"]
        for ms, old_boot in root["restarts"]:
            inbox.forget_lost({int(k): v for k, v in ms.items()}, old_boot, self._island_boot)
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
            sync.on_push_result(p, seq, ok, target)
            if ok and boots:
                self._island_boot[seq] = boots.pop()
            inbox.results_known[p].append(seq)
            for key in [k for k in self._verdicts if k[0] == p and k[1] <= seq]:
                del self._verdicts[key]
        for p in range(ctx.fragmentation.P):
            vs = {msgs[r]["have"].get(p, -1) for r in self.plan.fetchers[p]}
            if len(vs) != 1:
                continue
            v = vs.pop()
            if v <= self._fed[p]:
                continue
            rv = self._held_recv.get(p)
            if self.plan.own(p):
                assert rv is not None and rv.version == v
                sync.receive(p, v, rv.tensors, rv.ready)
                # the version stays (the next exchanges report it), the tensors go with the
                # install: held here too, every fragment's would make a copy of the shard
                self._held_recv[p] = Received(p, v, [], None)
            else:
                sync.receive(p, v, self.links.local_tensors(p, []))
            self._fed[p] = v
        inbox.apply_merged({int(k): v for k, v in root["merged"].items()})
        if ctx.is_root:
            sums = [sum(m["stats"][i] for m in msgs) for i in range(len(_SUMMED))]
            self.report = {
                **dict(zip(_SUMMED, sums)),
                "rank_bytes_sent": [m["stats"][0] for m in msgs],
                "rank_bytes_received": [m["stats"][1] for m in msgs],
            }
        return root

    def check(self) -> None:
        """A rank's failed thread surfaces in the exchange, on every rank together."""

    def exchange_after_step(self, tokens: int) -> tuple[list[int], bool]:
        """``step`` on every rank of a sharded island: the exchange, then the same sends and
        installs on every rank (each of its own runs). Returns (installed, stop)."""
        ctx, sync = self.ctx, self.ctx.sync
        msgs = self._gather(self._round_message())
        errors = [(r, m["error"]) for r, m in enumerate(msgs) if m["error"]]
        if errors:  # every rank stops together (a lone one would leave the others waiting)
            raise SyncerError(
                f"[learner {ctx.learner}] communication thread of rank {errors[0][0]} "
                f"failed: {errors[0][1]}"
            )
        root = self._apply_round(msgs)
        if not ctx.is_root:
            sync.last_s = root["last_s"]
        outs = sync.after_step(tokens, root["now"])
        self.links.sent(outs)
        for o in outs:
            self._send_or_release(o)
        installed = self.links.install_due()
        if installed and ctx.is_root:
            self.watch.installed()
        return installed, bool(root["stop"])

    def _send_or_release(self, o) -> None:
        """Queue a push of this rank's runs of ``o``'s fragment, or give its snapshot back
        when another rank pushes them all."""
        if self.plan.pushes(o.fragment):
            self.links.sendq.put(o)
        else:
            self.ctx.sync.release(o.fragment, o.params)

    # -- the end --------------------------------------------------------------------------
    def flush(self, fetch_global: bool) -> dict[str, torch.Tensor] | None:
        """Every rank's final pushes, exchanges until rank 0 sees them merged (or
        ``flush_timeout``), then (``fetch_global``) every rank's runs of the global model,
        fetched before rank 0 leaves. Returns those runs, or None."""
        ctx = self.ctx
        for o in self.links.final_pushes():
            self._send_or_release(o)
        deadline = time.monotonic() + ctx.flush_timeout_s
        while True:
            msg = self._round_message()
            if ctx.is_root:
                msg["go"] = (
                    time.monotonic() < deadline
                    and self.session.connected
                    and self.links.thread_error is None
                )
            msgs = self._gather(msg)
            root = self._apply_round(msgs)
            busy = any(m["busy"] for m in msgs)
            if not root["go"] or not (busy or root["pending"] > 1e-9):
                break
            time.sleep(0.02)
        if not fetch_global:
            return None
        try:
            return self._agreed_global(ctx.flush_timeout_s)[1]
        except SyncerError as e:
            log.warning(
                "[learner %d rank %d] could not fetch the global model at exit (%s): the "
                "model keeps its local parameters",
                ctx.learner,
                ctx.rank,
                e,
            )
            return None

    def install_at_exit(self, params: dict[str, torch.Tensor] | None) -> bool:
        return copy_params(self.ctx.params, params)

    def close(self) -> None:
        self.links.stop()
        self.client.close()
