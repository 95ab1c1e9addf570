"""Each metrics sink, read back with its own tool: JSONL lines, TensorBoard's
EventAccumulator, the wandb offline run file, MLflow's client on the file store."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ddiloco.metrics.sinks import (
    SINKS,
    JsonlSink,
    MultiSink,
    open_sinks,
    parse_jsonl,
    parse_sinks,
    read_jsonl,
    scalars,
)

ROWS = [
    {"kind": "config", "model": "gpt_tiny", "H": 24, "speeds": [1.0, 0.85]},
    {
        "kind": "step",
        "learner": 0,
        "step": 1,
        "wall": 1_700_000_000.0,
        "loss": 2.5,
        "installed": {"0": 3},
    },
    {"kind": "step", "learner": 0, "step": 2, "wall": 1_700_000_001.0, "loss": 2.25},
    {"kind": "merge", "fragment": 1, "version": 4, "merge_s": 0.002, "reason": "quorum"},
    {"kind": "merge", "fragment": 0, "version": 5, "merge_s": 0.001, "ok": True},
]


def test_parse_sinks_checks_names():
    assert parse_sinks("jsonl, tensorboard,jsonl") == ("jsonl", "tensorboard")
    assert parse_sinks(["mlflow"]) == ("mlflow",)
    assert parse_sinks("") == ()
    with pytest.raises(ValueError, match="unknown metrics sink 'csv'.*jsonl, tensorboard"):
        parse_sinks("jsonl,csv")


def test_scalars_keep_finite_numbers_only():
    assert scalars(
        {
            "kind": "step",
            "step": 3,
            "wall": 1.0,
            "loss": 2.0,
            "ok": True,
            "nan": float("nan"),
            "name": "x",
            "v": [1],
        }
    ) == {"step/loss": 2.0}


def test_jsonl_sink_round_trip_and_modes(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    with MultiSink([JsonlSink(path, mode="w")]) as s:
        for r in ROWS:
            s.write(r)
    assert [json.loads(x) for x in path.read_text().splitlines()] == ROWS
    with MultiSink([JsonlSink(path, mode="a", flush_rows=True)]) as s:
        s.write(ROWS[1])
        assert len(path.read_text().splitlines()) == len(ROWS) + 1  # flushed at once
    with MultiSink([JsonlSink(path, mode="w")]):
        pass
    assert path.read_text() == ""
    with pytest.raises(ValueError, match="mode"):
        JsonlSink(path, mode="x")


def test_read_jsonl_skips_torn_lines(tmp_path):
    """A writer killed mid-row tears the last line; its restarted process appends after it
    (its first row on the torn line), so a torn line can stand in the middle too. Torn lines
    are skipped and every whole row is kept."""
    path = tmp_path / "m.jsonl"
    with JsonlSink(path, mode="w") as s:
        s.write(ROWS[0])
    path.write_bytes(path.read_bytes() + json.dumps(ROWS[1]).encode()[:-3])  # the kill
    assert read_jsonl(path) == [ROWS[0]]
    with JsonlSink(path, mode="a") as s:  # the restart
        for r in ROWS[2:]:
            s.write(r)
    assert read_jsonl(path) == [ROWS[0], *ROWS[3:]]
    assert read_jsonl(path, containing='"merge"') == ROWS[3:]
    # blank lines, values that are no row, and a two-byte character cut in two
    text = b'\n[1, 2]\n"step"\n{"kind": "step", "note": "\xc3\xa9"}\n{"kind": "st\xc3'
    assert parse_jsonl(text) == [{"kind": "step", "note": "\u00e9"}]
    assert parse_jsonl("") == []
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")


def _write_all(tmp_path: Path, sink: str, name: str = "learner_0") -> None:
    with open_sinks(sink, tmp_path, name=name) as s:
        for r in ROWS:
            s.write(r)
        s.flush()


def test_tensorboard_sink_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_all(tmp_path, "tensorboard")
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "learner_0"))
    acc.Reload()
    loss = acc.Scalars("step/loss")
    assert [(e.step, e.value, e.wall_time) for e in loss] == [
        (1, 2.5, 1_700_000_000.0),
        (2, 2.25, 1_700_000_001.0),
    ]
    assert [(e.step, e.value) for e in acc.Scalars("merge/version")] == [(0, 4.0), (1, 5.0)]
    assert "step/installed" not in acc.Tags()["scalars"]
    assert "config/text_summary" in acc.Tags()["tensors"]


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of a wandb run file (a LevelDB-style log: a 7-byte file header,
    then 32 KiB blocks of records, each with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def test_wandb_sink_read_back_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    _write_all(tmp_path, "wandb")
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    recs = _wandb_records(runs[0])
    history = []
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            row = {
                (i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item
            }
            history.append({k: v for k, v in row.items() if not k.startswith("_")})
    assert history == [
        {"step/loss": 2.5, "step/learner": 0, "step/step": 1},
        {"step/loss": 2.25, "step/learner": 0, "step/step": 2},
        {"merge/fragment": 1, "merge/version": 4, "merge/merge_s": 0.002, "merge/step": 0},
        {"merge/fragment": 0, "merge/version": 5, "merge/merge_s": 0.001, "merge/step": 1},
    ]
    run = next(r.run for r in recs if r.WhichOneof("record_type") == "run")
    assert run.display_name == "learner_0" and run.run_group == tmp_path.name
    config = {
        i.key: json.loads(i.value_json)
        for r in recs
        if r.WhichOneof("record_type") == "config"
        for i in r.config.update
    }
    assert config["model"] == "gpt_tiny" and config["H"] == "24"


def test_mlflow_sink_read_back_file_store(tmp_path):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    import mlflow

    _write_all(tmp_path, "mlflow", name="syncer")
    _write_all(tmp_path, "mlflow", name="learner_0")  # a second writer of the same run dir
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("ddiloco")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert sorted(runs) == ["learner_0", "syncer"]
    run = runs["learner_0"]
    assert run.info.status == "FINISHED"
    assert run.data.params["model"] == "gpt_tiny" and run.data.params["speeds"] == "[1.0, 0.85]"
    hist = client.get_metric_history(run.info.run_id, "step/loss")
    assert sorted((m.step, m.value, m.timestamp) for m in hist) == [
        (1, 2.5, 1_700_000_000_000),
        (2, 2.25, 1_700_000_001_000),
    ]
    assert sorted(
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "merge/version")
    ) == [(0, 4.0), (1, 5.0)]


def test_open_sinks_all_at_once_and_bad_names(tmp_path):
    names = [s for s in SINKS if s == "jsonl" or _installed(s)]
    with open_sinks(",".join(names), tmp_path, name="engine") as s:
        assert len(s.sinks) == len(names)
        s.write(ROWS[1])
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == ROWS[1]
    with pytest.raises(ValueError, match="unknown metrics sink"):
        open_sinks("jsonl,prometheus", tmp_path, name="engine")


def _installed(sink: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(sink) is not None


def test_sinks_are_a_registry():
    from ddiloco.metrics.sinks import SINK_KINDS, register_sink

    assert SINKS == ("jsonl", "tensorboard", "wandb", "mlflow")
    assert {n: k.package for n, k in SINK_KINDS.items()} == {
        "jsonl": None,
        "tensorboard": "tensorboard",
        "wandb": "wandb",
        "mlflow": "mlflow",
    }
    with pytest.raises(ValueError, match="already registered"):
        register_sink("jsonl", SINK_KINDS["jsonl"].make)
    with pytest.raises(ValueError, match="unknown metrics sink 'csv'; valid sinks: jsonl, tensor"):
        parse_sinks("jsonl,csv")
