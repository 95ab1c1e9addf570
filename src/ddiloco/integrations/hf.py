"""Decoupled DiLoCo for a Hugging Face ``transformers.Trainer``, as a ``TrainerCallback``.

    from ddiloco.integrations.hf import DecoupledDiLoCoCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[DecoupledDiLoCoCallback(syncer="10.0.0.1:50051", learner=0,
                                                         H=24, tau=2)])
    trainer.train()

The callback wraps :class:`~ddiloco.runtime.learner.hook.DecoupledLearner`: it joins the
syncer when training begins (and installs the current global parameters before the first
step), reports every optimizer step (``on_step_end``, after the Trainer's optimizer step),
stops the Trainer once the syncer's global step budget is spent, and flushes and leaves
when training ends. The shared-secret token comes from ``token``, ``token_file`` or
``$DDILOCO_TOKEN``.

Under ``torch.distributed`` with more than one rank (``torchrun``), the ranks form one
island: rank 0 talks to the syncer and broadcasts to the others.

Needs ``transformers`` (``pip install ddiloco[hf]``).
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ddiloco.integrations.hf needs the 'transformers' package: pip install ddiloco[hf]"
    ) from e

from ddiloco.integrations.common import island_group, learner_kwargs
from ddiloco.runtime.learner.hook import DecoupledLearner

__all__ = ["DecoupledDiLoCoCallback"]


class DecoupledDiLoCoCallback(TrainerCallback):  # type: ignore[misc]
    """A ``TrainerCallback`` that makes the Trainer one Decoupled DiLoCo learner.

    ``syncer`` (HOST:PORT) and ``learner`` (its index m) are required; the other keyword
    arguments are those of ``DecoupledLearner`` (P, H, tau, codec, alpha, token,
    token_file, tls_ca...). ``tokens_per_step`` weights this learner's contributions in
    merges; None counts the samples of one optimizer step (per-device batch size x
    gradient accumulation x world size), or, when the Trainer counts them
    (``include_num_input_tokens_seen``), the input tokens it saw.
    """

    def __init__(
        self, *, syncer: str, learner: int, tokens_per_step: int | None = None, **learner_kw: Any
    ) -> None:
        self.syncer, self.learner_index = syncer, learner
        self.tokens_per_step = tokens_per_step
        self.learner_kw = learner_kwargs(learner_kw)
        self.learner: DecoupledLearner | None = None
        """The hook, from ``on_train_begin`` to ``on_train_end``."""
        self.installed = 0
        """Merged fragments installed so far."""
        self.tokens = 0
        """Tokens (or samples) reported to the hook so far."""
        self._tokens_seen = 0

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        if model is None:
            raise ValueError("the Trainer passed no model to the callback")
        self.learner = DecoupledLearner(
            model,
            syncer=self.syncer,
            learner=self.learner_index,
            process_group=island_group(),
            **self.learner_kw,
        )
        self.learner.start()
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def _tokens(self, args: Any, state: Any) -> int:
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if seen > self._tokens_seen:
            n, self._tokens_seen = seen - self._tokens_seen, seen
            return n
        return int(
            args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * max(1, args.world_size)
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.learner is None:
            raise RuntimeError(
                "on_step_end before on_train_begin: add the callback to the "
                "Trainer before calling train()"
            )
        tokens = self._tokens(args, state)
        self.tokens += tokens
        self.installed += len(self.learner.step(tokens))
        if self.learner.should_stop:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Flush what is in flight and leave the syncer (idempotent)."""
        if self.learner is not None:
            self.learner.close()
