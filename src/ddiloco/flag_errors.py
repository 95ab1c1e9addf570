"""One-line errors for the commands whose flags tyro generates (``train``, ``syncer``,
``learner``, ``simulate``, ``bandwidth``, ``launch``).

tyro reports a command line it cannot parse in a box of many lines (the flag's whole help
text, a footer). ``parse_flags`` runs ``tyro.cli`` with a hook on tyro's parse-error events
that turns each one into a ``FlagError``, a ``ValueError`` of one line naming the flag::

    --chips: expected an integer, got 'abc'
    --backend: invalid choice 'pbs'; choose one of slurm
    unrecognized arguments: --bogus 1

The commands catch ``ValueError`` and print ``ddiloco CMD: error: LINE`` with exit status 2,
as argparse does. An event this module does not know (tyro may add some) keeps tyro's own
message and exit status 2.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import tyro

__all__ = ["FlagError", "parse_flags", "describe"]


class FlagError(ValueError):
    """A command line that cannot be parsed; the message is one line."""


class _Rejected(Exception):
    """Raised from tyro's hook, outside any ``except ValueError`` of tyro's own."""


_MESSAGES = (
    (re.compile(r"invalid literal for int\(\) with base 10: (.*)"), "expected an integer, got {}"),
    (re.compile(r"could not convert string to float: (.*)"), "expected a number, got {}"),
)


def _reason(message: str) -> str:
    """The reason of an instantiation failure, in one line: tyro's "no type matching ...
    Got errors:" list is narrowed to the errors of the types other than None."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if "Got errors:" in lines:
        errs = [ln.removeprefix("- ") for ln in lines[lines.index("Got errors:") + 1 :]]
        errs = [e.split(": ", 1)[-1] for e in errs if not e.startswith("<class 'NoneType'>")]
        lines = errs or lines[:1]
    reasons = []
    for ln in lines:
        for pattern, text in _MESSAGES:
            m = pattern.fullmatch(ln)
            if m:
                ln = text.format(m.group(1))
                break
        reasons.append(ln)
    return "; ".join(reasons)


def _flag(argument: Any) -> str:
    flags = getattr(getattr(argument, "lowered", None), "name_or_flags", None)
    return "/".join(flags) if flags else argument.display_name()


def describe(event: Any) -> str | None:
    """One line for one of tyro's parse-error events; None for an event it does not know."""
    from tyro import _errors as e

    if isinstance(event, e.InstantiationFailure):
        reason = _reason(event.message)
        return f"{_flag(event.argument)}: {reason}" if event.argument is not None else reason
    if isinstance(event, e.InvalidChoice):
        choices = ", ".join(c for c in event.choices if c != "None")
        return f"{_flag(event.argument)}: invalid choice {event.value!r}; choose one of {choices}"
    if isinstance(event, e.UnrecognizedArgs):
        return f"unrecognized arguments: {' '.join(event.tokens)}"
    if isinstance(event, e.BadValue):
        if event.reason == "too_few_values":
            return f"{_flag(event.argument)}: expected a value"
        return f"{_flag(event.argument)} takes no value, got {event.offending_value!r}"
    if isinstance(event, e.MissingArgs):
        names = ", ".join(_flag(a.arg) for a in event.missing_arguments)
        return f"the following arguments are required: {names}"
    return None


def _hook(event: Any) -> None:
    line = describe(event)
    if line is not None:
        raise _Rejected(line)


def parse_flags(cls: Any, argv: list[str], **kwargs: Any) -> Any:
    """``tyro.cli(cls, args=argv, **kwargs)``, with every command line it rejects raised
    as a ``FlagError`` of one line."""
    try:
        from tyro._errors import on_parse_error
    except ImportError:  # a tyro without the hook: its own messages
        hook: Any = contextlib.nullcontext()
    else:
        hook = on_parse_error(_hook)
    try:
        with hook:
            return tyro.cli(cls, args=argv, **kwargs)
    except _Rejected as r:
        raise FlagError(str(r)) from None
