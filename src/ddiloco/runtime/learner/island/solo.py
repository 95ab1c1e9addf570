"""An island of one process: it talks to the syncer itself (the session and the link
threads), drains its inbox at every step, and sends and installs on its own."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import torch

from ddiloco.runtime.learner.client import SyncerError, rpc_code, rpc_details
from ddiloco.runtime.learner.context import LearnerContext
from ddiloco.runtime.learner.inbox import Inbox
from ddiloco.runtime.learner.island import InstallWatch, copy_params
from ddiloco.runtime.learner.links import DeltaBases, Links
from ddiloco.runtime.learner.session import Session
from ddiloco.runtime.learner.sharded import ShardedClient

__all__ = ["Solo"]

log = logging.getLogger("ddiloco.learner")


class Solo:
    """One process: the ``Island`` that talks to the syncer itself."""

    def __init__(
        self,
        ctx: LearnerContext,
        client: ShardedClient | None,
        inbox: Inbox,
        links: Links,
        bases: DeltaBases,
        report: Callable[[], dict],
    ) -> None:
        self.ctx = ctx
        self.client = client
        self.inbox = inbox
        self.links = links
        self.session = Session(ctx, client, inbox, bases, report)
        self.watch = InstallWatch(ctx)
        self.report: dict = {}

    def _join(self) -> bool:
        """Join and install the global model; returns the stop flag."""
        ctx = self.ctx
        versions, params = self.session.join_and_fetch()
        ctx.sync.load_global(params, versions)
        if self.session.joined_clock:
            self.inbox.hear_clock(self.session.joined_clock)
        self.links.base_versions = list(versions)
        return ctx.stop.is_set()  # later, only `step` changes it

    def _run_threads(self) -> None:
        self.links.start([(self.session.heartbeater, "ddiloco-hb")])

    def start(self) -> bool:
        stop = self._join()
        self._run_threads()
        return stop

    def check(self) -> None:
        error = self.links.thread_error
        if error is not None:
            raise SyncerError(
                f"[learner {self.ctx.learner}] communication thread failed: {error!r}"
            ) from error

    def exchange_after_step(self, tokens: int) -> tuple[list[int], bool]:
        ctx = self.ctx
        self.inbox.drain()
        outs = ctx.sync.after_step(tokens, self.inbox.nominal_now())
        self.links.sent(outs)
        for o in outs:
            self.links.sendq.put(o)
        installed = self.links.install_due()
        if installed:
            self.watch.installed()
        return installed, ctx.stop.is_set()

    def global_model(self, timeout_s: float) -> tuple[list[int], dict[str, torch.Tensor]]:
        try:
            return self.session.fetch_all(timeout_s)
        except grpc.RpcError as e:
            assert self.client is not None
            raise SyncerError(
                f"[learner {self.ctx.learner}] could not fetch the global model "
                f"from {self.client.address}: {rpc_code(e).name}: "
                f"{rpc_details(e)}"
            ) from None

    def install(self, versions: list[int], params: dict[str, torch.Tensor]) -> None:
        sync = self.ctx.sync
        sync.fail()  # steps since each fragment's last push are overwritten
        sync.load_global(params, versions)
        self.links.installed_global(versions)

    def flush(self, fetch_global: bool) -> dict[str, torch.Tensor] | None:
        ctx, links = self.ctx, self.links
        for o in links.final_pushes():
            links.sendq.put(o)
        deadline = time.monotonic() + ctx.flush_timeout_s
        while (
            time.monotonic() < deadline
            and self.session.connected
            and links.thread_error is None
            and (not links.sendq.empty() or ctx.sync.ledger.pending > 1e-9)
        ):
            time.sleep(0.02)
            self.inbox.drain()
        if not fetch_global:
            return None
        try:
            return self.session.fetch_all(ctx.flush_timeout_s)[1]
        except grpc.RpcError as e:
            log.warning(
                "[learner %d step %d] could not fetch the global model at exit "
                "(%s): the model keeps its local parameters",
                ctx.learner,
                ctx.sync.step,
                rpc_details(e),
            )
            return None

    def install_at_exit(self, params: dict[str, torch.Tensor] | None) -> bool:
        return copy_params(self.ctx.params, params)

    def close(self) -> None:
        self.links.stop()
        if self.client is not None:
            self.client.close()
