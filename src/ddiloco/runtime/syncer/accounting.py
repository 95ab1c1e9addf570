"""Goodput and per-learner totals under the syncer's name: ``ddiloco.runtime.observe.accounting``
holds them."""

from ddiloco.runtime.observe.accounting import (
    LEDGER_KEYS,
    add_totals,
    fold,
    goodput_of,
    goodput_so_far,
    instance_totals,
    learner_totals,
)

__all__ = [
    "LEDGER_KEYS",
    "instance_totals",
    "add_totals",
    "fold",
    "learner_totals",
    "goodput_of",
    "goodput_so_far",
]
