"""Decoupled DiLoCo inside trainers people already run, each an optional extra:

  ``ddiloco.integrations.hf``         ``DecoupledDiLoCoCallback`` for ``transformers.Trainer``
                                      (``pip install ddiloco[hf]``)
  ``ddiloco.integrations.lightning``  ``DecoupledDiLoCo`` callback for a Lightning
                                      ``Trainer`` (``pip install ddiloco[lightning]``)

Both wrap :class:`~ddiloco.runtime.learner.hook.DecoupledLearner`, the optimizer hook that
any plain training loop can use directly. Import the submodule you need; this package
imports neither framework.
"""

__all__: list[str] = []
