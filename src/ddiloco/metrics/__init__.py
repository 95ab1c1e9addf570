"""Where metrics go: one sink interface that the in-process engine, the syncer and the
learners all report through (``ddiloco.metrics.sinks``)."""

from ddiloco.metrics.sinks import (
    SINKS,
    JsonlSink,
    MetricsSink,
    MlflowSink,
    MultiSink,
    TensorBoardSink,
    WandbSink,
    check_available,
    open_sinks,
    parse_jsonl,
    parse_sinks,
    read_jsonl,
)

__all__ = [
    "SINKS",
    "MetricsSink",
    "JsonlSink",
    "TensorBoardSink",
    "WandbSink",
    "MlflowSink",
    "MultiSink",
    "open_sinks",
    "parse_sinks",
    "check_available",
    "read_jsonl",
    "parse_jsonl",
]
