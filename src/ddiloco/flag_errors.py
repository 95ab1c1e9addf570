"""One-line errors for the commands whose flags tyro generates (``train``, ``syncer``,
``learner``, ``simulate``, ``bandwidth``, ``launch``).

tyro reports a command line it cannot parse in a box of many lines (the flag's whole help
text, a footer). ``parse_flags`` runs ``tyro.cli`` with a hook on tyro's parse-error events
that turns each one into a ``FlagError``, a ``ValueError`` of one line naming the flag::

    --chips: expected an integer, got 'abc'
    --backend: invalid choice 'pbs'; choose one of slurm
    unrecognized arguments: --stepz 10 (did you mean --steps?)

The commands catch ``ValueError`` and print ``ddiloco CMD: error: LINE`` with exit status 2,
as argparse does. An event this module does not know (tyro may add some) keeps tyro's own
message and exit status 2.

``parse_flags`` also gives ``--help`` each option's text as paragraphs (``plain_help``): an
attribute docstring's line breaks are where the source wraps, and tyro would keep them,
breaking the terminal's lines mid-sentence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
import warnings
from typing import Any

import tyro
from tyro.constructors import ConstructorRegistry, StructConstructorSpec
from tyro.constructors._struct_spec_dataclass import dataclass_rule

__all__ = ["FlagError", "parse_flags", "describe", "plain_help"]


class FlagError(ValueError):
    """A command line that cannot be parsed; the message is one line."""


class _Rejected(Exception):
    """Raised from tyro's hook, outside any ``except ValueError`` of tyro's own."""

    def __init__(self, line: str, unknown: list[str] | None = None) -> None:
        super().__init__(line)
        self.unknown = unknown or []
        """The unrecognized tokens, if that is the error."""


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
    from tyro import _errors as e

    line = describe(event)
    if line is not None:
        raise _Rejected(line, event.tokens if isinstance(event, e.UnrecognizedArgs) else None)


def _paragraphs(text: str) -> str:
    """``text`` with the lines of each paragraph joined (a line that starts a list item,
    ``- ``, ``* `` or ``1. ``, keeps its break)."""
    out = []
    for para in re.split(r"\n\s*\n", text.strip()):
        lines = [ln.strip() for ln in para.splitlines() if ln.strip()]
        joined = lines[0] if lines else ""
        for ln in lines[1:]:
            joined += ("\n" if re.match(r"([-*]|\d+[.)])\s", ln) else " ") + ln
        out.append(joined)
    return "\n\n".join(out)


def plain_help(spec: StructConstructorSpec) -> StructConstructorSpec:
    """``spec`` with each field's help text in paragraphs (``_paragraphs``), computed as
    lazily as tyro computes it."""

    def plain(helptext: Any) -> Any:
        if isinstance(helptext, str):
            return _paragraphs(helptext)
        if callable(helptext):
            return lambda: None if (text := helptext()) is None else _paragraphs(text)
        return helptext

    fields = tuple(dataclasses.replace(f, helptext=plain(f.helptext)) for f in spec.fields)
    return dataclasses.replace(spec, fields=fields)


_HELP = ConstructorRegistry()
"""Every dataclass's options with ``plain_help`` (a caller's registry that builds its own
specs applies ``plain_help`` itself: its rules come first)."""


@_HELP.struct_rule
def _dataclass_help(info: Any) -> StructConstructorSpec | None:
    if not dataclasses.is_dataclass(info.type):
        return None
    spec = dataclass_rule(info)
    return None if spec is None else plain_help(spec)


def _did_you_mean(cls: Any, unknown: list[str], kwargs: dict[str, Any]) -> str:
    """`` (did you mean --steps?)`` for the unrecognized flags of ``unknown`` that are close
    to one of ``cls``'s options; empty where none is."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            keep = ("prog", "description", "default", "registry", "config")
            with _HELP:
                parser = tyro.extras.get_parser(cls, **{k: kwargs[k] for k in keep if k in kwargs})
    except Exception:  # noqa: BLE001 - a tyro without get_parser: no suggestion
        return ""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    close = []
    for token in unknown:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in options:
            close += difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
    return f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""


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
        with hook, _HELP:
            return tyro.cli(cls, args=argv, **kwargs)
    except _Rejected as r:
        hint = _did_you_mean(cls, r.unknown, kwargs) if r.unknown else ""
        raise FlagError(f"{r}{hint}") from None
