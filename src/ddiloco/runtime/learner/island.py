"""A torchrun island (``process_group``): rank 0 talks to the syncer and broadcasts to the
other ranks what it installs, the global model it fetches and what it loads at exit, so every
rank holds the same parameters. A mixin of ``DecoupledLearner``: the state it uses is set in
``DecoupledLearner.__init__``."""

from __future__ import annotations

import grpc
import torch

from ddiloco.runtime.learner.client import SyncerError, rpc_code, rpc_details

__all__ = ["IslandMixin"]


class IslandMixin:
    """The island's broadcasts from rank 0."""

    def _broadcast_start(self) -> None:
        """Rank 0's joined model, step budget, stop flag and learner id reach every rank."""
        import torch.distributed as dist

        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in self.params.values():
                dist.broadcast(t.data, src=src, group=self.group)
        budget = torch.tensor(
            [self.step_budget, int(self._stop_seen), self.learner], dtype=torch.int64
        )
        dist.broadcast(budget, src=src, group=self._control_group)
        self.step_budget = int(budget[0])
        self._stop_seen = bool(budget[1])
        self.learner = int(budget[2])  # an id the syncer assigned reaches every rank

    def _broadcast_installs(self, installed: list[int], stop: bool) -> tuple[list[int], bool]:
        import torch.distributed as dist

        src = dist.get_global_rank(self.group, 0)
        P = self.fragmentation.P  # noqa: N806
        mask = torch.zeros(P + 1, dtype=torch.uint8)  # installed fragments, then the stop flag
        mask[installed] = 1
        mask[P] = int(stop)
        dist.broadcast(mask, src=src, group=self._control_group)
        out = [int(p) for p in mask[:P].nonzero().flatten()]
        with torch.no_grad():
            for p in out:
                for n in self.fragmentation.fragments[p].names:
                    dist.broadcast(self.params[n].data, src=src, group=self.group)
        return out, bool(mask[P])

    def _global_everywhere(self, timeout_s: float) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Root fetches the global model; an island's other ranks receive it from root."""
        versions, params = [], {}
        if self._is_root:
            try:
                versions, params = self._fetch_all(timeout_s)
            except grpc.RpcError as e:
                raise SyncerError(
                    f"[learner {self.learner}] could not fetch the global model "
                    f"from {self.client.address}: {rpc_code(e).name}: "
                    f"{rpc_details(e)}"
                ) from None
        if self.group is not None:
            import torch.distributed as dist

            src = dist.get_global_rank(self.group, 0)
            ok = torch.tensor([int(bool(params))], dtype=torch.int64)
            dist.broadcast(ok, src=src, group=self.group)
            if not ok.item():
                raise SyncerError(
                    f"[learner {self.learner}] rank 0 could not fetch the global model"
                )
            if not self._is_root:
                params = {n: torch.empty_like(t) for n, t in self.params.items()}
            for n in self.params:
                dist.broadcast(params[n], src=src, group=self.group)
        return versions, params

    def _install_at_exit(self, params: dict[str, torch.Tensor] | None) -> None:
        if self.group is not None:  # root's fetch (or its failure) reaches every rank
            import torch.distributed as dist

            src = dist.get_global_rank(self.group, 0)
            ok = torch.tensor([int(params is not None)], dtype=torch.int64)
            dist.broadcast(ok, src=src, group=self.group)
            if not ok.item():
                return
            if params is None:
                params = {n: torch.empty_like(t) for n, t in self.params.items()}
            for n in self.params:
                dist.broadcast(params[n], src=src, group=self.group)
        if params is None:
            return
        with torch.no_grad():
            for n, t in self.params.items():
                t.copy_(params[n])
        self.loaded_global_on_exit = True
