"""A torchrun island that replicates the model (DDP, ``process_group``): rank 0 talks to the
syncer as a ``Solo`` island does and broadcasts to the other ranks what it installs, the
global model it fetches and what it loads at exit, so every rank holds the same parameters.
The other ranks have no connection and no threads."""

from __future__ import annotations

import torch

from ddiloco.runtime.learner.client import SyncerError
from ddiloco.runtime.learner.island import copy_params
from ddiloco.runtime.learner.island.solo import Solo

__all__ = ["Replicated"]


class Replicated(Solo):
    """The island's broadcasts from rank 0; rank 0 is a ``Solo`` island besides."""

    def _src(self) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.ctx.group, 0)

    def start(self) -> bool:
        """Rank 0 joins; its joined model, step budget, stop flag and learner id reach every
        rank; then rank 0 starts its threads."""
        import torch.distributed as dist

        ctx = self.ctx
        stop = self._join() if ctx.is_root else False
        src = self._src()
        with torch.no_grad():
            for t in ctx.params.values():
                dist.broadcast(t.data, src=src, group=ctx.group)
        budget = torch.tensor([self.session.step_budget, int(stop), ctx.learner], dtype=torch.int64)
        dist.broadcast(budget, src=src, group=ctx.control_group)
        self.session.step_budget = int(budget[0])
        stop = bool(budget[1])
        ctx.learner = int(budget[2])  # an id the syncer assigned reaches every rank
        if ctx.is_root:
            self._run_threads()
        return stop

    def exchange_after_step(self, tokens: int) -> tuple[list[int], bool]:
        import torch.distributed as dist

        ctx = self.ctx
        installed, stop = super().exchange_after_step(tokens) if ctx.is_root else ([], False)
        src = self._src()
        P = ctx.fragmentation.P  # noqa: N806
        mask = torch.zeros(P + 1, dtype=torch.uint8)  # installed fragments, then the stop flag
        mask[installed] = 1
        mask[P] = int(stop)
        dist.broadcast(mask, src=src, group=ctx.control_group)
        out = [int(p) for p in mask[:P].nonzero().flatten()]
        with torch.no_grad():
            for p in out:
                for n in ctx.fragmentation.fragments[p].names:
                    dist.broadcast(ctx.params[n].data, src=src, group=ctx.group)
        return out, bool(mask[P])

    def global_model(self, timeout_s: float) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Rank 0 fetches the global model; the other ranks receive it from rank 0."""
        import torch.distributed as dist

        ctx = self.ctx
        versions: list[int] = []
        params: dict[str, torch.Tensor] = {}
        if ctx.is_root:
            versions, params = super().global_model(timeout_s)
        src = self._src()
        ok = torch.tensor([int(bool(params))], dtype=torch.int64)
        dist.broadcast(ok, src=src, group=ctx.group)
        if not ok.item():
            raise SyncerError(f"[learner {ctx.learner}] rank 0 could not fetch the global model")
        if not ctx.is_root:
            params = {n: torch.empty_like(t) for n, t in ctx.params.items()}
        for n in ctx.params:
            dist.broadcast(params[n], src=src, group=ctx.group)
        return versions, params

    def install(self, versions: list[int], params: dict[str, torch.Tensor]) -> None:
        if self.ctx.is_root:
            super().install(versions, params)
        else:
            copy_params(self.ctx.params, params)

    def flush(self, fetch_global: bool) -> dict[str, torch.Tensor] | None:
        return super().flush(fetch_global) if self.ctx.is_root else None

    def install_at_exit(self, params: dict[str, torch.Tensor] | None) -> bool:
        """Rank 0's fetch (or its failure) reaches every rank."""
        import torch.distributed as dist

        ctx = self.ctx
        src = self._src()
        ok = torch.tensor([int(params is not None)], dtype=torch.int64)
        dist.broadcast(ok, src=src, group=ctx.group)
        if not ok.item():
            return False
        if params is None:
            params = {n: torch.empty_like(t) for n, t in ctx.params.items()}
        for n in ctx.params:
            dist.broadcast(params[n], src=src, group=ctx.group)
        return super().install_at_exit(params)
