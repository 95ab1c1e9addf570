"""``TrainConfig``: one run's whole configuration, nested by concern, read by every entry
point (``ddiloco train``, ``syncer``, ``learner``, the launcher) and both engines.

The run-level fields (method, engine, learners, steps, seed, out) sit at the top; the rest
lives in sections and is read there (``cfg.sync.H``, ``cfg.data.batch_size``...), so a
misspelt field is an error the type checker sees. Where values are typed, flat names are
aliases of section fields: the command line (``--batch-size 8``, ``-H 12``) and, in code,
``TrainConfig(H=12, batch_size=8)`` and ``cfg.replace(H=12)``. Flat names are the section
field names, except ``model`` (for ``model.name``) and ``data`` (for ``data.source``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ddiloco.config.chaos import ChaosConfig, chaos_preset
from ddiloco.config.sections import (
    ENGINES,
    METHODS,
    SECTIONS,
    DataConfig,
    Engine,
    Method,
    ModelConfig,
    OptimConfig,
    RuntimeConfig,
    SyncConfig,
    WorldConfig,
    at_least,
    one_of,
)

__all__ = ["TrainConfig", "FLAT", "NOT_FLAT", "preset", "PRESETS"]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    method: Method = "decoupled"
    """Training method: local (no sync), dp, diloco, streaming or decoupled."""
    engine: Engine = "auto"
    """processes: a real gRPC syncer and learner processes on loopback; inproc: all
    learners in one process on a virtual clock, deterministic; auto: processes for
    decoupled, inproc for the baselines."""
    learners: int = 4
    """M: number of learners (independent data-parallel islands)."""
    steps: int = 2000
    """Inner steps per learner (methods compare at equal tokens)."""
    seed: int = 0
    """Seed of the model init, data streams, speeds, failures and chaos."""
    out: str = "runs/latest"
    """Run directory: summary.json, metrics.jsonl, config.toml, logs."""
    progress: bool = True
    """Show live progress."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data and batch shape."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Inner optimizer, learning-rate schedule and evaluation."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """The synchronisation algorithm (Decoupled / Streaming DiLoCo)."""
    world: WorldConfig = field(default_factory=WorldConfig)
    """The simulated world (in-process engine; with processes its failures, speeds and
    bandwidth become chaos)."""
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    """Seeded faults of a real run (processes): kills, stops, slow-downs, syncer kills,
    link limits and cuts, elastic membership. ``--chaos PRESET`` or ``--chaos FILE.json``
    fills it."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """The real runtime: syncer address, transport, security, checkpoints, islands."""

    def __post_init__(self) -> None:
        one_of("method", self.method, METHODS)
        one_of("engine", self.engine, ENGINES)
        for name in ("learners", "steps"):
            at_least(name, getattr(self, name), 1)
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(
                    f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}"
                )
        if self.engine == "processes" and self.method != "decoupled":
            raise ValueError(
                f"engine processes runs method decoupled; run {self.method} with engine inproc"
            )
        from ddiloco.data import DATA_SOURCES
        from ddiloco.models import model_task

        kind = self.data.source.split(":")[0]
        image_data = kind in DATA_SOURCES and DATA_SOURCES[kind].task == "image"
        if (model_task(self.model.name) == "image") != image_data:
            raise ValueError(
                f"model.name {self.model.name!r} does not fit data.source "
                f"{self.data.source!r}: image models (vit_*) need image data "
                f"(digits, images:PATH) and vice versa"
            )
        if self.sync.quorum > self.learners:
            raise ValueError(
                f"sync.quorum K={self.sync.quorum} cannot exceed learners M={self.learners}"
            )
        if self.world.speeds and len(self.world.speeds) != self.learners:
            raise ValueError(
                f"world.speeds has {len(self.world.speeds)} entries for {self.learners} learners"
            )
        n_islands = len(self.runtime.layouts())
        if n_islands and n_islands != self.learners:
            raise ValueError(
                f"runtime.islands has {n_islands} layouts for {self.learners} learners: give "
                f"one per learner"
            )

    # -- derived values -------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        """Inner learning rate for inner step ``step`` (0-based)."""
        o = self.optim
        if o.lr_schedule == "constant":
            return o.inner_lr
        if step < o.warmup_steps:
            return o.inner_lr * (step + 1) / o.warmup_steps
        span = max(1, self.steps - o.warmup_steps)
        progress = min(1.0, (step - o.warmup_steps) / span)
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return o.inner_lr * (o.min_lr_frac + (1.0 - o.min_lr_frac) * cos)

    def speed(self, m: int) -> float:
        return self.world.speeds[m] if self.world.speeds else 1.0

    def resolved_engine(self) -> str:
        """``engine`` with ``auto`` resolved: processes for decoupled, else inproc."""
        if self.engine != "auto":
            return self.engine
        return "processes" if self.method == "decoupled" else "inproc"

    # -- copies and views ------------------------------------------------------------------
    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied: top-level fields, whole sections, or flat section
        fields (``H=12``, ``model="gpt_small"``)."""
        nested = self.to_nested()
        for k, v in _nest(changes).items():
            if k in SECTIONS:
                nested[k].update(v)
            else:
                nested[k] = v
        return TrainConfig.from_flat(nested)

    def to_dict(self) -> dict:
        """Flat ``{name: value}`` of every field (``model`` and ``data`` are the names of the
        model and data source); what ``summary.json`` records."""
        d = {k: getattr(self, k) for k in _TOP}
        for flat, (sec, name) in FLAT.items():
            d[flat] = getattr(getattr(self, sec), name)
        for sec in NOT_FLAT:
            s = getattr(self, sec)
            d[sec] = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
        return d

    def to_nested(self) -> dict:
        """``{top-level field: value, section: {field: value}}``, the file form."""
        d: dict[str, Any] = {k: getattr(self, k) for k in _TOP}
        for sec in SECTIONS:
            s = getattr(self, sec)
            d[sec] = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
        return d

    @classmethod
    def from_flat(cls, fields: dict[str, Any]) -> TrainConfig:
        """Build from top-level fields plus flat or nested section fields (sections given as
        dicts or section objects). Unknown names are an error naming the known ones."""
        nested = _nest(fields)
        kw: dict[str, Any] = {}
        for k, v in nested.items():
            if k in SECTIONS:
                kw[k] = v if isinstance(v, SECTIONS[k]) else _section(k, v)
            elif k in _TOP:
                kw[k] = v
            else:
                raise ValueError(f"unknown configuration field {k!r}")
        return cls(**kw)


_TOP = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS)

_RENAMED = {("model", "name"): "model", ("data", "source"): "data"}
NOT_FLAT = ("chaos",)
"""Sections whose fields have no flat names (``chaos.seed`` is not the run's ``seed``)."""
FLAT: dict[str, tuple[str, str]] = {}
"""Flat name -> (section, field) for every section field (but those of ``NOT_FLAT``)."""
for _sec, _cls in SECTIONS.items():
    if _sec in NOT_FLAT:
        continue
    for _f in dataclasses.fields(_cls):
        _flat = _RENAMED.get((_sec, _f.name), _f.name)
        assert _flat not in FLAT and _flat not in _TOP, f"flat name {_flat} is ambiguous"
        FLAT[_flat] = (_sec, _f.name)


def _section(sec: str, values: Any) -> Any:
    cls = SECTIONS[sec]
    if not isinstance(values, dict):
        raise ValueError(f"{sec} must be a table of fields, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown field{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(f'{sec}.{u}' for u in unknown)}; {sec} has "
            f"{', '.join(sorted(known))}"
        )
    return cls(**values)


def _nest(fields: dict[str, Any]) -> dict[str, Any]:
    """Route flat section fields into their section dicts (sections given as objects are
    turned into dicts so flat fields can be merged into them)."""
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if k == "chaos" and isinstance(v, str):  # a preset or a JSON file fills the section
            v = chaos_preset(v)
        if k in SECTIONS and not isinstance(v, (str, SECTIONS[k])):
            out.setdefault(k, {}).update(v)
        elif k in SECTIONS and isinstance(v, SECTIONS[k]):
            out.setdefault(k, {}).update(
                {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
            )
        elif k in FLAT and k not in _TOP:
            sec, name = FLAT[k]
            out.setdefault(sec, {})[name] = v
        else:
            out[k] = v
    return out


# ``TrainConfig(**fields)`` accepts flat section fields as well as sections.
_dataclass_init = TrainConfig.__init__


def _init(self: TrainConfig, **fields: Any) -> None:
    if all(k in _TOP or (k in SECTIONS and isinstance(v, SECTIONS[k])) for k, v in fields.items()):
        _dataclass_init(self, **fields)
        return
    kw: dict[str, Any] = {}
    for k, v in _nest(fields).items():
        if k in SECTIONS:
            kw[k] = _section(k, v)
        elif k in _TOP:
            kw[k] = v
        else:
            raise TypeError(f"TrainConfig got an unknown field {k!r}")
    _dataclass_init(self, **kw)


_init.__doc__ = _dataclass_init.__doc__
TrainConfig.__init__ = _init  # type: ignore[method-assign]


def _hetero(m: int) -> tuple[float, ...]:
    """Half the learners 18% slower (the paper's two chip generations)."""
    return tuple(1.0 if i < (m + 1) // 2 else 1 / 1.18 for i in range(m))


PRESETS = {
    "default": lambda c: c,
    # each learner down ~15% of the time: mean up 170 s, down 30 s (step = 1 s)
    "failures": lambda c: c.replace(mtbi_s=170.0, downtime_s=30.0),
    # half the learners 18% slower, 10% step noise
    "hetero": lambda c: c.replace(speeds=_hetero(c.learners), step_noise=0.1),
}


def preset(name: str, base: TrainConfig | None = None) -> TrainConfig:
    """A named preset applied on top of ``base`` (defaults if None)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name](base or TrainConfig())
