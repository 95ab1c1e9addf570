"""Decoupled DiLoCo for a PyTorch Lightning ``Trainer``, as a ``Callback``.

    from ddiloco.integrations.lightning import DecoupledDiLoCo

    trainer = L.Trainer(max_steps=10_000, callbacks=[
        DecoupledDiLoCo(syncer="10.0.0.1:50051", learner=0, H=24, tau=2)])
    trainer.fit(module, datamodule)

The callback wraps :class:`~ddiloco.runtime.learner.hook.DecoupledLearner` around the
LightningModule and its (single) optimizer: when training starts it joins the syncer and
installs the current global parameters; the optimizer's post-step hook reports every real
optimizer step (steps skipped by gradient accumulation are not steps), so a step never
waits on the network; the Trainer stops once the syncer's global step budget is spent; at
the end of training (or on an exception) it flushes and leaves. The token comes from
``token``, ``token_file`` or ``$DDILOCO_TOKEN``.

Under ``torch.distributed`` with more than one rank (the DDP strategy), the ranks form one
island: rank 0 talks to the syncer and broadcasts to the others.

Needs ``lightning`` (``pip install ddiloco[lightning]``).
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ddiloco.integrations.lightning needs the 'lightning' package: "
        "pip install ddiloco[lightning]"
    ) from e

from ddiloco.integrations.common import batch_samples, island_group, learner_kwargs
from ddiloco.runtime.learner.hook import DecoupledLearner

__all__ = ["DecoupledDiLoCo"]


class DecoupledDiLoCo(pl.Callback):  # type: ignore[misc]
    """A Lightning ``Callback`` that makes the Trainer one Decoupled DiLoCo learner.

    ``syncer`` (HOST:PORT) and ``learner`` (its index m) are required; the other keyword
    arguments are those of ``DecoupledLearner`` (P, H, tau, codec, alpha, token,
    token_file, tls_ca...). ``tokens_per_step`` weights this learner's contributions in
    merges; None counts the samples of the batches of each optimizer step (the first
    dimension of each batch's first tensor) times the number of ranks.
    """

    def __init__(
        self, *, syncer: str, learner: int, tokens_per_step: int | None = None, **learner_kw: Any
    ) -> None:
        super().__init__()
        self.syncer, self.learner_index = syncer, learner
        self.tokens_per_step = tokens_per_step
        self.learner_kw = learner_kwargs(learner_kw)
        self.learner: DecoupledLearner | None = None
        """The hook, from ``on_train_start`` to ``on_train_end``."""
        self.installed = 0
        """Merged fragments installed so far."""
        self.tokens = 0
        """Tokens (or samples) reported to the hook so far."""
        self._samples = 0
        self._hook: Any = None
        self._trainer: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"DecoupledDiLoCo hooks one optimizer; configure_optimizers "
                f"returned {len(trainer.optimizers)}"
            )
        self._trainer = trainer
        self.learner = DecoupledLearner(
            pl_module,
            syncer=self.syncer,
            learner=self.learner_index,
            process_group=island_group(),
            **self.learner_kw,
        )
        self.learner.start()
        optimizer = trainer.optimizers[0]
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's own
        self._hook = optimizer.register_step_post_hook(lambda *_: self._after_step())

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._samples += batch_samples(batch)

    def _after_step(self) -> None:
        assert self.learner is not None
        tokens = self.tokens_per_step
        if tokens is None:
            tokens = self._samples * max(1, self._trainer.world_size)
        self._samples = 0
        self.tokens += tokens
        self.installed += len(self.learner.step(tokens))
        if self.learner.should_stop:
            self._trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hook, flush what is in flight and leave the syncer (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.learner is not None:
            self.learner.close()
