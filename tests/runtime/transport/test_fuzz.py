"""Bounded fuzzing of both transports: decoders and handlers answer any input with a typed
error or a reply, never an unhandled exception; afterwards the syncer still serves and has
logged no internal error."""

from __future__ import annotations

import json
import socket

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_helpers import live_syncer

from ddiloco.runtime.transport import schema, wire
from ddiloco.runtime.transport.bulk import BulkClient, BulkError

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "learner",
    "incarnation",
    "fragment",
    "seq",
    "base_version",
    "c_steps",
    "c_tokens",
    "codec",
    "delta",
    "numels",
    "nbytes",
    "step",
    "fragments",
    "cursor",
    "merged_seq",
    "timeout_s",
    "report",
    "hb",
    "mac",
    "token",
    "op",
    "spec",
    "fingerprint",
]
headers = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=10)


@FUZZ
@given(st.binary(max_size=300))
def test_frame_and_json_decoders_raise_only_value_errors(raw):
    for fn in (wire.unpack, schema.loads):
        try:
            fn(raw)
        except ValueError:
            pass


@FUZZ
@given(headers)
def test_every_schema_accepts_or_raises_schema_error(h):
    for model in (
        schema.JoinRequest,
        schema.InitHeader,
        schema.PushHeader,
        schema.FetchRequest,
        schema.WatchRequest,
        schema.HeartbeatRequest,
        schema.LeaveRequest,
        schema.Hello,
    ):
        try:
            schema.parse(model, h)
        except schema.SchemaError:
            pass


@pytest.fixture(scope="module")
def live():
    with live_syncer(heartbeat_timeout_s=600.0) as live:
        bulk = BulkClient("127.0.0.1", live.server.bulk_port, "tok")
        yield live.server, live.client, bulk, live.inc
        bulk.close()


CALLS = ["Join", "Watch", "Heartbeat", "Leave", "Status"]


@FUZZ
@given(st.sampled_from(CALLS + ["Push", "Fetch"]), headers, st.binary(max_size=64))
def test_grpc_handlers_answer_any_header_with_a_typed_error(live, call, h, payload):
    server, client, _, _ = live
    frame = wire.pack(json.loads(json.dumps(h)), payload)
    try:
        if call == "Push":
            client.bulk.stream_unary(wire.method(call))(
                iter([frame]), timeout=10, metadata=client._md
            )
        elif call == "Fetch":
            list(
                client.bulk.unary_stream(wire.method(call))(frame, timeout=10, metadata=client._md)
            )
        else:
            client.bulk.unary_unary(wire.method(call))(frame, timeout=10, metadata=client._md)
    except grpc.RpcError as e:
        assert e.code() != grpc.StatusCode.UNKNOWN, e.details()
        assert (e.details() or "").startswith("E_"), e.details()
        assert not e.details().startswith("E_INTERNAL"), e.details()


@FUZZ
@given(st.sampled_from(["push", "fetch", "hello", "x"]), headers, st.binary(max_size=64))
def test_data_port_answers_any_request_with_a_typed_error(live, op, h, payload):
    _, _, bulk, _ = live
    try:
        bulk.request({**json.loads(json.dumps(h)), "op": op}, [payload] if payload else [])
    except BulkError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:  # a closed connection is reopened
            assert e.details().startswith("E_"), e.details()
            assert not e.details().startswith("E_INTERNAL"), e.details()


@FUZZ
@given(st.binary(max_size=200))
def test_data_port_handshake_survives_any_bytes(live, raw):
    server = live[0]
    with socket.create_connection(("127.0.0.1", server.bulk_port), timeout=5) as c:
        try:
            c.sendall(raw)
            c.shutdown(socket.SHUT_WR)
            c.settimeout(5)
            c.recv(1 << 16)
        except OSError:
            pass


def test_after_the_fuzzing_the_syncer_serves_and_logged_no_internal_error(live):
    server, client, bulk, inc = live
    st_ = client.status()
    assert st_["rejections"].get("E_INTERNAL", 0) == 0, st_["rejections"]
    assert sum(st_["rejections"].values()) > 100
    assert bulk.request({"op": "fetch", "fragments": [0]})[0]["items"][0]["fragment"] == 0
    assert client.unary("Heartbeat", {"learner": 0, "incarnation": inc})["rejoin"] is False
