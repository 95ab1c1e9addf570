"""Metrics sinks: where the rows of a run go.

Every metrics row is a flat JSON-able dict with a ``kind`` ("step", "merge", "eval",
"config", ...). The in-process engine, the syncer, the learners and the chaos log all write
rows through a :class:`MetricsSink`; :func:`open_sinks` builds the set a flag names:

  ``jsonl``        one JSON line per row (the file every tool of ddiloco reads back)
  ``tensorboard``  event files under ``RUN_DIR/tensorboard/NAME`` (``pip install
                   ddiloco[tensorboard]``); ``tensorboard --logdir RUN_DIR/tensorboard``
  ``wandb``        a Weights & Biases run in offline mode under ``RUN_DIR/wandb``
                   (``ddiloco[wandb]``); upload later with ``wandb sync``
  ``mlflow``       an MLflow run in the local file store ``RUN_DIR/mlruns``
                   (``ddiloco[mlflow]``); ``mlflow ui --backend-store-uri RUN_DIR/mlruns``

``NAME`` tells the writers of one run apart (``engine``, ``syncer``, ``learner_0``...).
Each name is a ``SinkKind`` (how to open it, the package it needs) registered with
``register_sink`` at the end of this module; a new sink is its class and one such line.
The scalar sinks (all but JSONL) log each numeric field ``f`` of a row of kind ``k`` as
``k/f`` at the row's ``step`` (a per-kind counter for rows without one), at the row's
``wall`` time when it has one; a ``config`` row becomes the run's parameters. Nested values
(lists, dicts) stay in the JSONL only.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "SINKS",
    "SINK_KINDS",
    "SinkKind",
    "SinkPlace",
    "register_sink",
    "MetricsSink",
    "JsonlSink",
    "TensorBoardSink",
    "WandbSink",
    "MlflowSink",
    "MultiSink",
    "open_sinks",
    "parse_sinks",
    "scalars",
    "check_available",
    "read_jsonl",
    "parse_jsonl",
]

_NOT_SCALARS = frozenset({"kind", "step", "wall", "pid"})


@runtime_checkable
class MetricsSink(Protocol):
    """Takes metrics rows; ``flush`` makes what was written readable; ``close`` ends it."""

    def write(self, row: Mapping[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SinkPlace:
    """Where one writer's sinks go (``open_sinks``'s arguments)."""

    root: Path
    """The run directory."""
    name: str
    """The writer (``engine``, ``syncer``, ``learner_0``...)."""
    jsonl_path: Path
    """The JSONL file."""
    mode: str
    """The JSONL file's open mode."""
    flush_rows: bool
    """Flush the JSONL file after every row."""


@dataclass(frozen=True, slots=True)
class SinkKind:
    """One sink name: how to open it for a writer, and the package it needs."""

    name: str
    make: Callable[[SinkPlace], MetricsSink]
    """Opens the sink for one writer."""
    package: str | None = None
    """Module it imports, installed by the extra ``ddiloco[NAME]``; None: none."""


SINK_KINDS: dict[str, SinkKind] = {}
"""Every sink name's kind, in registration order."""


def register_sink(
    name: str, make: Callable[[SinkPlace], MetricsSink], package: str | None = None
) -> None:
    """Add the sink ``name`` (``--metrics-sinks``): ``make(place)`` opens it."""
    if name in SINK_KINDS:
        raise ValueError(f"metrics sink {name!r} is already registered")
    SINK_KINDS[name] = SinkKind(name, make, package)


def parse_sinks(spec: str | Iterable[str]) -> tuple[str, ...]:
    """``"jsonl,tensorboard"`` (or a sequence of names) to a checked tuple of sink names."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    names = [s for s in names if s]
    bad = [s for s in names if s not in SINK_KINDS]
    if bad:
        raise ValueError(
            f"unknown metrics sink {bad[0]!r}; valid sinks: {', '.join(SINK_KINDS)} "
            f"(comma-separated, e.g. jsonl,tensorboard)"
        )
    return tuple(dict.fromkeys(names))


def check_available(names: str | Iterable[str]) -> None:
    """Raise ImportError, naming the extra to install, if a sink's package is missing."""
    import importlib.util

    for s in parse_sinks(names):
        pkg = SINK_KINDS[s].package
        if pkg is not None and importlib.util.find_spec(pkg) is None:
            raise ImportError(
                f"the {s} metrics sink needs the '{pkg}' package: pip install ddiloco[{s}]"
            )


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric fields of ``row`` as ``kind/field`` -> value."""
    kind = str(row.get("kind", "row"))
    out = {}
    for k, v in row.items():
        if k in _NOT_SCALARS or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[f"{kind}/{k}"] = float(v)
    return out


def _params(row: Mapping[str, Any]) -> dict[str, str]:
    return {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in row.items() if k != "kind"}


class _Closing:
    """``with sink: ...`` closes the sink."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):  # noqa: ANN204 - returns the sink's own type
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JsonlSink(_Closing):
    """One JSON line per row, appended (``mode="a"``) or from an empty file (``"w"``).
    ``flush_rows``: flush after every row (for logs read while the run goes on)."""

    def __init__(self, path: str | Path, *, mode: str = "a", flush_rows: bool = False) -> None:
        if mode not in ("a", "w"):
            raise ValueError(f"mode must be 'a' or 'w', got {mode!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, mode, encoding="utf-8")
        self.flush_rows = flush_rows

    def write(self, row: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(row) + "\n")
        if self.flush_rows:
            self._f.flush()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def parse_jsonl(data: str | bytes, *, containing: str | None = None) -> list[dict]:
    """The rows (JSON objects) of JSONL text, in order. A line that is no JSON object is
    skipped: a writer killed in the middle of a row (SIGKILL) leaves a torn line, at the end
    of the file or, once its restarted process appends to the file, in the middle.
    ``containing``: parse only the lines that hold this text (a cheap filter for a large
    file)."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    rows = []
    for line in text.split("\n"):
        if containing is not None and containing not in line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn, or blank
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_jsonl(path: str | Path, *, containing: str | None = None) -> list[dict]:
    """The rows of the JSONL file ``path`` (a ``JsonlSink``'s file, say), torn lines skipped
    (``parse_jsonl``). The file must exist."""
    return parse_jsonl(Path(path).read_bytes(), containing=containing)


class _ScalarSink(_Closing):
    """Shared part of the scalar sinks: the step axis and the config row."""

    def __init__(self) -> None:
        self._counts: Counter = Counter()

    def _step(self, row: Mapping[str, Any]) -> int:
        kind = row.get("kind", "row")
        self._counts[kind] += 1
        s = row.get("step")
        if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s):
            return int(round(s))
        return self._counts[kind] - 1

    def write(self, row: Mapping[str, Any]) -> None:
        if row.get("kind") == "config":
            self._log_params(_params(row))
            return
        values = scalars(row)
        if values:
            wall = row.get("wall")
            self._log(
                values,
                self._step(row),
                float(wall) if isinstance(wall, (int, float)) else time.time(),
            )

    def _log(self, values: dict[str, float], step: int, wall: float) -> None:
        raise NotImplementedError

    def _log_params(self, params: dict[str, str]) -> None:
        raise NotImplementedError


def _need(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the {extra} metrics sink needs the '{module.split('.')[0]}' "
            f"package: pip install ddiloco[{extra}]"
        ) from e


class TensorBoardSink(_ScalarSink):
    """TensorBoard event files in ``log_dir``."""

    def __init__(self, log_dir: str | Path) -> None:
        super().__init__()
        _need("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._w = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def _log(self, values: dict[str, float], step: int, wall: float) -> None:
        for tag, v in values.items():
            self._w.add_scalar(tag, v, global_step=step, walltime=wall)

    def _log_params(self, params: dict[str, str]) -> None:
        self._w.add_text("config", "\n".join(f"    {k} = {v}" for k, v in params.items()))

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink(_ScalarSink):
    """A Weights & Biases run in offline mode, its files under ``root/wandb``. Each row's
    step is logged beside its values as ``kind/step`` (wandb's own step counts rows)."""

    def __init__(
        self, root: str | Path, *, name: str, group: str | None = None, project: str = "ddiloco"
    ) -> None:
        super().__init__()
        wandb = _need("wandb", "wandb")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            console="off",
            silent=True,
            x_disable_stats=True,
            disable_git=True,
            save_code=False,
            x_disable_machine_info=True,
        )
        self._run = wandb.init(
            mode="offline",
            dir=str(self.root),
            project=project,
            name=name,
            group=group,
            reinit="create_new",
            settings=settings,
        )
        self.run_dir = Path(self._run.dir).parent
        """The run's offline folder (``root/wandb/offline-run-*``)."""

    def _log(self, values: dict[str, float], step: int, wall: float) -> None:
        kind = next(iter(values)).split("/", 1)[0]
        self._run.log({**values, f"{kind}/step": step})

    def _log_params(self, params: dict[str, str]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def flush(self) -> None:
        pass  # the wandb service process writes the run file as rows arrive

    def close(self) -> None:
        """Finish the run and stop this process's wandb service: ``finish`` alone may leave
        the run file incomplete on disk until the service exits."""
        import wandb

        self._run.finish()
        wandb.teardown()


class MlflowSink(_ScalarSink):
    """An MLflow run named ``name`` in experiment ``experiment`` of the local file store
    ``store`` (a folder). Rows are buffered and written in batches on ``flush``.

    MLflow 3 keeps its file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``;
    this sink sets that variable (unless already set) since a run directory is a folder
    of files and needs no database."""

    def __init__(
        self, store: str | Path, *, name: str, experiment: str = "ddiloco", flush_every: int = 200
    ) -> None:
        super().__init__()
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow = _need("mlflow", "mlflow")
        self.store = Path(store).resolve()
        self.store.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = self.store.as_uri()
        self._client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        exp = self._client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self._create(experiment)
        self.run_id: str = self._client.create_run(exp_id, run_name=name).info.run_id
        self._metric = mlflow.entities.Metric
        self._pending: list[Any] = []
        self.flush_every = flush_every

    def _create(self, experiment: str) -> str:
        try:
            return self._client.create_experiment(experiment)
        except Exception:  # noqa: BLE001 - another process of the run created it first
            exp = self._client.get_experiment_by_name(experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def _log(self, values: dict[str, float], step: int, wall: float) -> None:
        ms = int(wall * 1000)
        self._pending += [self._metric(k, v, ms, step) for k, v in values.items()]
        if len(self._pending) >= self.flush_every:
            self.flush()

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        self._client.log_batch(self.run_id, params=[Param(k, v[:6000]) for k, v in params.items()])

    def flush(self) -> None:
        for i in range(0, len(self._pending), 1000):  # log_batch takes up to 1000 metrics
            self._client.log_batch(self.run_id, metrics=self._pending[i : i + 1000])
        self._pending = []

    def close(self) -> None:
        self.flush()
        self._client.set_terminated(self.run_id)


class MultiSink(_Closing):
    """Several sinks behind one; safe to write from several threads."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = list(sinks)
        self._lock = threading.Lock()
        self._closed = False

    def write(self, row: Mapping[str, Any]) -> None:
        with self._lock:
            if not self._closed:
                for s in self.sinks:
                    s.write(row)

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                for s in self.sinks:
                    s.flush()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for s in self.sinks:
                s.close()

    def __bool__(self) -> bool:
        return bool(self.sinks)


def open_sinks(
    names: str | Iterable[str],
    run_dir: str | Path,
    *,
    name: str,
    jsonl_path: str | Path | None = None,
    mode: str = "a",
    flush_rows: bool = False,
) -> MultiSink:
    """The sinks ``names`` for writer ``name`` of the run in ``run_dir``. The JSONL sink
    writes ``jsonl_path`` (default ``run_dir/metrics.jsonl``) with ``mode`` and
    ``flush_rows``; the others write under ``run_dir`` as the module docstring says."""
    root = Path(run_dir)
    place = SinkPlace(
        root=root,
        name=name,
        jsonl_path=Path(jsonl_path) if jsonl_path else root / "metrics.jsonl",
        mode=mode,
        flush_rows=flush_rows,
    )
    sinks: list[MetricsSink] = []
    try:
        for s in parse_sinks(names):
            sinks.append(SINK_KINDS[s].make(place))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return MultiSink(sinks)


register_sink("jsonl", lambda p: JsonlSink(p.jsonl_path, mode=p.mode, flush_rows=p.flush_rows))
register_sink(
    "tensorboard", lambda p: TensorBoardSink(p.root / "tensorboard" / p.name), "tensorboard"
)
register_sink(
    "wandb",
    lambda p: WandbSink(p.root, name=p.name, group=os.path.basename(p.root.resolve())),
    "wandb",
)
register_sink("mlflow", lambda p: MlflowSink(p.root / "mlruns", name=p.name), "mlflow")

SINKS: tuple[str, ...] = tuple(SINK_KINDS)
"""Valid sink names."""
