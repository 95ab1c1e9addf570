"""The file form of a run's configuration: TOML, one table per section.

```toml
method = "decoupled"
learners = 4
steps = 600

[sync]
H = 24
quorum = 1
```

Every run directory holds its resolved ``config.toml``; ``ddiloco train --config
runs/X/config.toml`` replays the run, its ``[chaos]`` table included. A file may give any
subset of fields: the rest take their defaults. Unset optional fields (``sync.history``,
``chaos.seed``, ``runtime.tls_cert``...) are left out of the file, as TOML has no null.
Files written before chaos was a section name it as ``[world] chaos = "PRESET"`` (or a
JSON file); that still fills ``[chaos]``.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from ddiloco.config.run import TrainConfig
from ddiloco.config.sections import SECTIONS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["load_config", "loads_config", "dump_config", "dumps_config", "CONFIG_FILE"]

CONFIG_FILE = "config.toml"
"""Name of the resolved configuration in a run directory."""


def loads_config(text: str, *, source: str = "<string>") -> TrainConfig:
    """Parse TOML text into a ``TrainConfig``; errors name ``source`` and the field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{source}: not valid TOML: {e}") from None
    try:
        return from_nested(data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from None


def load_config(path: str | os.PathLike) -> TrainConfig:
    """Read a TOML configuration file (a run directory's ``config.toml`` replays that run)."""
    p = Path(path)
    if p.is_dir() and (p / CONFIG_FILE).is_file():
        p = p / CONFIG_FILE
    if not p.is_file():
        raise ValueError(f"configuration file {str(path)!r} does not exist")
    return loads_config(p.read_text(encoding="utf-8"), source=str(path))


def from_nested(data: dict[str, Any]) -> TrainConfig:
    """A ``TrainConfig`` from ``{top-level field: value, section: {field: value}}``; only
    nested section tables are accepted (the file form), unknown names are errors."""
    top = {f for f in TrainConfig.__dataclass_fields__ if f not in SECTIONS}
    world = data.get("world")
    if isinstance(world, dict) and "chaos" in world:  # the file form before [chaos]
        if "chaos" in data:
            raise ValueError("give the chaos in the [chaos] table, not also as world.chaos")
        if not isinstance(world["chaos"], str):
            raise ValueError(f"world.chaos must be a string, got {world['chaos']!r}")
        data = {**data, "world": {k: v for k, v in world.items() if k != "chaos"}}
        data["chaos"] = world["chaos"]
    for k, v in data.items():
        if k in SECTIONS:
            if not isinstance(v, dict) and not (k == "chaos" and isinstance(v, str)):
                raise ValueError(f"{k} must be a table ([{k}]), got {v!r}")
        elif k not in top:
            raise ValueError(
                f"unknown field {k!r}; top-level fields are "
                f"{', '.join(sorted(top))}, sections are {', '.join(SECTIONS)}"
            )
    hints = get_type_hints(TrainConfig)
    for k, v in data.items():
        if k in SECTIONS and not isinstance(v, str):
            sec_hints = get_type_hints(SECTIONS[k])
            for f, fv in v.items():
                if f in sec_hints:
                    _check_type(f"{k}.{f}", fv, sec_hints[f])
        else:
            _check_type(k, v, hints[k])
    if isinstance(data.get("world", {}).get("speeds"), list):
        data = {**data, "world": {**data["world"], "speeds": tuple(data["world"]["speeds"])}}
    return TrainConfig.from_flat(data)


def _check_type(name: str, value: Any, hint: Any) -> None:
    """Raise ValueError naming the field unless ``value`` (as TOML gives it) has the type
    the field declares, as its command-line flag would: ``steps = 7.9`` and
    ``grace = "no"`` are errors, not an int and a string kept as they are."""
    if not _is(value, hint):
        raise ValueError(f"{name} must be {_describe(hint)}, got {value!r}")


def _is(value: Any, hint: Any) -> bool:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (Union, types.UnionType):
        return any(_is(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is(v, args[0]) for v in value)
        return len(args) == len(value) and all(_is(v, a) for v, a in zip(value, args))
    if origin is dict:  # TOML keys are strings: an integer key is written as one
        return isinstance(value, dict) and all(
            (_is(k, args[0]) or (args[0] is int and isinstance(k, str) and _is_int(k)))
            and _is(v, args[1])
            for k, v in value.items()
        )
    return True  # a type the file form does not describe: the section's checks decide


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
        return f"a list of {len(args)} values"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def dumps_config(cfg: TrainConfig) -> str:
    """TOML text of every field of ``cfg`` (unset optional ones left out)."""
    import tomli_w

    nested = cfg.to_nested()

    def value(v: Any) -> Any:  # tuples as arrays, integer keys as strings
        if isinstance(v, (tuple, list)):
            return [value(x) for x in v]
        if isinstance(v, dict):
            return {str(k): value(x) for k, x in v.items()}
        return v

    def clean(d: dict) -> dict:
        return {k: value(v) for k, v in d.items() if v is not None}

    doc = clean({k: v for k, v in nested.items() if k not in SECTIONS})
    for sec in SECTIONS:
        doc[sec] = clean(nested[sec])
    return tomli_w.dumps(doc)


def dump_config(cfg: TrainConfig, path: str | os.PathLike) -> Path:
    """Write ``cfg`` as TOML to ``path`` atomically (a directory gets ``config.toml``)."""
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_FILE
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(dumps_config(cfg), encoding="utf-8")
    os.replace(tmp, p)
    return p
