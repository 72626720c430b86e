"""OTLP trace parsing: OTLP/JSON rows, type errors, and protobuf giving the same rows as JSON."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from nulltickets.errors import InvalidJson
from nulltickets.service.otlp import (
    OtlpDecodeError,
    SpanRow,
    is_json,
    is_protobuf,
    normalize_content_type,
    spans_from_json,
    spans_from_protobuf,
)

TRACE_A = bytes(range(1, 17))
TRACE_B = bytes(range(0xF0, 0x100))
SPAN_1 = bytes.fromhex("00000000000000a1")
SPAN_2 = bytes.fromhex("00000000000000b2")
SPAN_3 = bytes.fromhex("00000000000000c3")


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def kv(key: str, value: Any) -> dict[str, Any]:
    return {"key": key, "value": value}


def one_span(span: dict[str, Any], resource_attributes: list[Any] | None = None) -> bytes:
    resource_spans: dict[str, Any] = {"scopeSpans": [{"spans": [span]}]}
    if resource_attributes is not None:
        resource_spans["resource"] = {"attributes": resource_attributes}
    return encode({"resourceSpans": [resource_spans]})


# --- the same export, as OTLP/JSON and as protobuf ---------------------------------------------


def export_as_json() -> dict[str, Any]:
    """Two resources; scopeSpans and legacy instrumentationLibrarySpans; every AnyValue kind.

    Written the way OTLP/JSON encoders write it: ids in hex, int64 values as decimal strings,
    enums as integers, bytes values in base64, default values left out.
    """
    return {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        kv("service.name", {"stringValue": "worker"}),
                        kv("nulltickets.run_id", {"stringValue": "run-from-resource"}),
                        kv("nulltickets.task_id", {"stringValue": "task-from-resource"}),
                    ]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "agent", "version": "1.2.0"},
                        "spans": [
                            {
                                "traceId": TRACE_A.hex(),
                                "spanId": SPAN_1.hex(),
                                "name": "claim",
                                "kind": 2,
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000000500000000",
                                "attributes": [
                                    kv("nulltickets.run_id", {"stringValue": "run-from-span"}),
                                    kv("retries", {"intValue": "3"}),
                                    kv("ratio", {"doubleValue": 0.25}),
                                    kv("ok", {"boolValue": True}),
                                    kv(
                                        "blob",
                                        {"bytesValue": base64.b64encode(b"\x00\xff").decode()},
                                    ),
                                    kv(
                                        "list",
                                        {
                                            "arrayValue": {
                                                "values": [{"stringValue": "a"}, {"intValue": "-1"}]
                                            }
                                        },
                                    ),
                                    kv(
                                        "map",
                                        {
                                            "kvlistValue": {
                                                "values": [kv("inner", {"boolValue": False})]
                                            }
                                        },
                                    ),
                                ],
                                "status": {"code": 2, "message": "lease lost"},
                            },
                            {
                                "traceId": TRACE_A.hex(),
                                "spanId": SPAN_2.hex(),
                                "parentSpanId": SPAN_1.hex(),
                                "name": "heartbeat",
                                "kind": 3,
                                "startTimeUnixNano": "1700000000100000000",
                                "endTimeUnixNano": "1700000000200000000",
                                "attributes": [kv("nulltickets.task_id", {"intValue": "42"})],
                                "status": {"code": 1},
                            },
                            # No spanId: skipped.
                            {"traceId": TRACE_A.hex(), "name": "orphan", "kind": 1},
                        ],
                    }
                ],
            },
            {
                "instrumentationLibrarySpans": [],
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": TRACE_B.hex(),
                                "spanId": SPAN_3.hex(),
                                "kind": 1,
                                "startTimeUnixNano": "5",
                                "endTimeUnixNano": "6",
                            }
                        ]
                    }
                ],
            },
        ]
    }


def any_value(**kwargs: Any) -> AnyValue:
    return AnyValue(**kwargs)


def export_as_protobuf() -> ExportTraceServiceRequest:
    """export_as_json(), built with the official message classes."""
    first = ResourceSpans(
        resource=Resource(
            attributes=[
                KeyValue(key="service.name", value=any_value(string_value="worker")),
                KeyValue(
                    key="nulltickets.run_id", value=any_value(string_value="run-from-resource")
                ),
                KeyValue(
                    key="nulltickets.task_id", value=any_value(string_value="task-from-resource")
                ),
            ]
        ),
        scope_spans=[
            ScopeSpans(
                scope=InstrumentationScope(name="agent", version="1.2.0"),
                spans=[
                    Span(
                        trace_id=TRACE_A,
                        span_id=SPAN_1,
                        name="claim",
                        kind=Span.SPAN_KIND_SERVER,
                        start_time_unix_nano=1700000000000000000,
                        end_time_unix_nano=1700000000500000000,
                        attributes=[
                            KeyValue(
                                key="nulltickets.run_id",
                                value=any_value(string_value="run-from-span"),
                            ),
                            KeyValue(key="retries", value=any_value(int_value=3)),
                            KeyValue(key="ratio", value=any_value(double_value=0.25)),
                            KeyValue(key="ok", value=any_value(bool_value=True)),
                            KeyValue(key="blob", value=any_value(bytes_value=b"\x00\xff")),
                            KeyValue(
                                key="list",
                                value=any_value(
                                    array_value=ArrayValue(
                                        values=[
                                            any_value(string_value="a"),
                                            any_value(int_value=-1),
                                        ]
                                    )
                                ),
                            ),
                            KeyValue(
                                key="map",
                                value=any_value(
                                    kvlist_value=KeyValueList(
                                        values=[
                                            KeyValue(key="inner", value=any_value(bool_value=False))
                                        ]
                                    )
                                ),
                            ),
                        ],
                        status=Status(code=Status.STATUS_CODE_ERROR, message="lease lost"),
                    ),
                    Span(
                        trace_id=TRACE_A,
                        span_id=SPAN_2,
                        parent_span_id=SPAN_1,
                        name="heartbeat",
                        kind=Span.SPAN_KIND_CLIENT,
                        start_time_unix_nano=1700000000100000000,
                        end_time_unix_nano=1700000000200000000,
                        attributes=[
                            KeyValue(key="nulltickets.task_id", value=any_value(int_value=42))
                        ],
                        status=Status(code=Status.STATUS_CODE_OK),
                    ),
                    Span(trace_id=TRACE_A, name="orphan", kind=Span.SPAN_KIND_INTERNAL),
                ],
            )
        ],
    )
    second = ResourceSpans(
        scope_spans=[
            ScopeSpans(
                spans=[
                    Span(
                        trace_id=TRACE_B,
                        span_id=SPAN_3,
                        kind=Span.SPAN_KIND_INTERNAL,
                        start_time_unix_nano=5,
                        end_time_unix_nano=6,
                    )
                ]
            )
        ]
    )
    return ExportTraceServiceRequest(resource_spans=[first, second])


def test_json_export_gives_one_row_per_span_with_both_ids() -> None:
    rows = spans_from_json(encode(export_as_json()))

    assert [(r.trace_id, r.span_id) for r in rows] == [
        (TRACE_A.hex(), SPAN_1.hex()),
        (TRACE_A.hex(), SPAN_2.hex()),
        (TRACE_B.hex(), SPAN_3.hex()),
    ]
    claim, heartbeat, bare = rows
    assert claim.parent_span_id is None
    assert heartbeat.parent_span_id == SPAN_1.hex()
    assert (claim.name, claim.kind, heartbeat.kind) == ("claim", "2", "3")
    assert (claim.start_time_unix_nano, claim.end_time_unix_nano) == (
        1700000000000000000,
        1700000000500000000,
    )
    assert (claim.status_code, claim.status_message) == ("2", "lease lost")
    assert (heartbeat.status_code, heartbeat.status_message) == ("1", None)
    assert (claim.scope_name, claim.scope_version) == ("agent", "1.2.0")
    assert (bare.name, bare.kind, bare.start_time_unix_nano, bare.end_time_unix_nano) == (
        "unnamed",
        "1",
        5,
        6,
    )
    assert (bare.scope_name, bare.status_code, bare.resource_attributes_json) == (None, None, "[]")


def test_run_and_task_ids_come_from_the_span_before_the_resource() -> None:
    claim, heartbeat, bare = spans_from_json(encode(export_as_json()))

    assert (claim.run_id, claim.task_id) == ("run-from-span", "task-from-resource")
    assert (heartbeat.run_id, heartbeat.task_id) == ("run-from-resource", "42")
    assert (bare.run_id, bare.task_id) == (None, None)


def test_absent_fields_get_defaults() -> None:
    (bare,) = spans_from_json(one_span({"traceId": "t", "spanId": "s"}))

    assert bare == SpanRow(
        trace_id="t",
        span_id="s",
        parent_span_id=None,
        name="unnamed",
        kind=None,
        start_time_unix_nano=None,
        end_time_unix_nano=None,
        status_code=None,
        status_message=None,
        scope_name=None,
        scope_version=None,
        run_id=None,
        task_id=None,
        attributes_json="[]",
        resource_attributes_json="[]",
        raw_json=(
            '{"traceId":"t","spanId":"s","parentSpanId":null,"name":null,"kind":null,'
            '"startTimeUnixNano":null,"endTimeUnixNano":null,"attributes":null,"status":null}'
        ),
    )


def test_attributes_are_stored_as_received_in_key_order() -> None:
    attributes = [
        kv("z", {"stringValue": "last letter", "unknown": 1}),
        kv("a", {"kvlistValue": {"values": [kv("y", {"intValue": "1"})]}}),
    ]
    resource = [kv("host", {"stringValue": "h1"})]
    (row,) = spans_from_json(
        one_span({"traceId": "t", "spanId": "s", "attributes": attributes}, resource)
    )

    assert row.attributes_json == compact(attributes)
    assert row.resource_attributes_json == compact(resource)


def test_key_values_keep_only_key_and_value() -> None:
    (row,) = spans_from_json(
        one_span({"traceId": "t", "spanId": "s", "attributes": [{"value": 1, "key": "k", "x": 2}]})
    )

    assert row.attributes_json == '[{"key":"k","value":1}]'


def test_raw_json_keeps_only_recognized_span_fields() -> None:
    span = {
        "traceId": "t",
        "spanId": "s",
        "traceState": "dropped",
        "name": "n",
        "kind": "SPAN_KIND_SERVER",
        "startTimeUnixNano": "1",
        "endTimeUnixNano": 2,
        "attributes": [],
        "events": [{"name": "dropped"}],
        "status": {"code": 0, "extra": True},
    }
    (row,) = spans_from_json(one_span(span))

    assert json.loads(row.raw_json) == {
        "traceId": "t",
        "spanId": "s",
        "parentSpanId": None,
        "name": "n",
        "kind": "SPAN_KIND_SERVER",
        "startTimeUnixNano": "1",
        "endTimeUnixNano": 2,
        "attributes": [],
        "status": {"code": 0, "message": None},
    }
    assert list(json.loads(row.raw_json)) == [
        "traceId",
        "spanId",
        "parentSpanId",
        "name",
        "kind",
        "startTimeUnixNano",
        "endTimeUnixNano",
        "attributes",
        "status",
    ]


def test_spans_without_both_ids_are_skipped() -> None:
    spans = [
        {"spanId": "s"},
        {"traceId": "t"},
        {"traceId": None, "spanId": "s"},
        {"traceId": "t", "spanId": "kept"},
    ]
    body = encode({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]})

    assert [row.span_id for row in spans_from_json(body)] == ["kept"]


def test_scope_spans_and_instrumentation_library_spans_are_both_read() -> None:
    body = encode(
        {
            "resourceSpans": [
                {
                    "instrumentationLibrarySpans": [
                        {
                            "instrumentationLibrary": {"name": "old", "version": "0.1"},
                            "spans": [{"traceId": "t", "spanId": "legacy"}],
                        }
                    ],
                    "scopeSpans": [
                        {"scope": {"name": "new"}, "spans": [{"traceId": "t", "spanId": "scoped"}]}
                    ],
                }
            ]
        }
    )

    rows = spans_from_json(body)

    assert [(r.span_id, r.scope_name, r.scope_version) for r in rows] == [
        ("scoped", "new", None),
        ("legacy", "old", "0.1"),
    ]


def test_scope_wins_over_instrumentation_library_even_when_empty() -> None:
    body = encode(
        {
            "resourceSpans": [
                {
                    "scopeSpans": [
                        {
                            "scope": {},
                            "instrumentationLibrary": {"name": "old", "version": "0.1"},
                            "spans": [{"traceId": "t", "spanId": "s"}],
                        }
                    ]
                }
            ]
        }
    )

    (row,) = spans_from_json(body)

    assert (row.scope_name, row.scope_version) == (None, None)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ({"stringValue": "r1"}, "r1"),
        ({"stringValue": ""}, ""),
        ({"intValue": "7"}, "7"),
        ({"intValue": 7}, "7"),
        ({"doubleValue": 1.5}, "1.5"),
        ({"boolValue": True}, "true"),
        ({"boolValue": False}, "false"),
        ({"bytesValue": "AP8="}, "AP8="),
        ({"boolValue": True, "stringValue": "first"}, "first"),
        ({"stringValue": None, "intValue": "8"}, "8"),
        ({"arrayValue": {"values": []}}, '{"arrayValue":{"values":[]}}'),
        ({}, "{}"),
        ("bare", "bare"),
        (12, "12"),
        (2.5, "2.5"),
        (False, "false"),
        ([1, "a"], '[1,"a"]'),
    ],
)
def test_run_id_attribute_values_become_text(value: Any, text: str) -> None:
    (row,) = spans_from_json(
        one_span({"traceId": "t", "spanId": "s", "attributes": [kv("nulltickets.run_id", value)]})
    )

    assert row.run_id == text


def test_null_span_attribute_falls_back_to_the_resource() -> None:
    (row,) = spans_from_json(
        one_span(
            {"traceId": "t", "spanId": "s", "attributes": [kv("nulltickets.task_id", None)]},
            [kv("nulltickets.task_id", {"stringValue": "from-resource"})],
        )
    )

    assert row.task_id == "from-resource"


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (2, "2"),
        ("STATUS_CODE_ERROR", "STATUS_CODE_ERROR"),
        (None, None),
        (1.5, "1.5"),
        (True, "true"),
        ({"a": 1}, '{"a":1}'),
        ([1], "[1]"),
    ],
)
def test_kind_and_status_code_are_stored_as_text(code: Any, text: str | None) -> None:
    (row,) = spans_from_json(
        one_span({"traceId": "t", "spanId": "s", "kind": code, "status": {"code": code}})
    )

    assert (row.kind, row.status_code) == (text, text)


@pytest.mark.parametrize(
    ("value", "nanos"),
    [
        ("1700000000000000000", 1700000000000000000),
        (1700000000000000000, 1700000000000000000),
        ("0", 0),
        (0, 0),
        ("9223372036854775807", 2**63 - 1),
        ("9223372036854775808", None),
        (2**64, None),
        ("", None),
        (" 1", None),
        ("1_000", None),
        ("12abc", None),
        ("1.5", None),
        (1.5, None),
        (True, None),
        (None, None),
    ],
)
def test_times_accept_decimal_strings_and_json_integers(value: Any, nanos: int | None) -> None:
    (row,) = spans_from_json(one_span({"traceId": "t", "spanId": "s", "startTimeUnixNano": value}))

    assert row.start_time_unix_nano == nanos


def test_numeric_start_time_is_accepted_not_rejected() -> None:
    body = b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"t","spanId":"s",'
    body += (
        b'"startTimeUnixNano":1700000000000000000,"endTimeUnixNano":"1700000000000000001"}]}]}]}'
    )

    (row,) = spans_from_json(body)

    assert (row.start_time_unix_nano, row.end_time_unix_nano) == (
        1700000000000000000,
        1700000000000000001,
    )


def test_unknown_fields_and_nulls_are_ignored() -> None:
    body = encode(
        {
            "extra": {"anything": [1, 2]},
            "resourceSpans": [
                {
                    "resource": None,
                    "schemaUrl": "x",
                    "scopeSpans": [
                        {"scope": None, "spans": [{"traceId": "t", "spanId": "s", "flags": 1}]}
                    ],
                    "instrumentationLibrarySpans": None,
                }
            ],
        }
    )

    assert [row.span_id for row in spans_from_json(body)] == ["s"]


@pytest.mark.parametrize("body", [b"{}", b'{"resourceSpans":null}', b'{"resourceSpans":[]}'])
def test_exports_without_spans_give_no_rows(body: bytes) -> None:
    assert spans_from_json(body) == []


def span_body(**fields: Any) -> bytes:
    return one_span({"traceId": "t", "spanId": "s", **fields})


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"{", id="truncated"),
        pytest.param(b"\xff", id="not-utf8"),
        pytest.param(b"[]", id="root-array"),
        pytest.param(b"1e400", id="number-out-of-range"),
        pytest.param(b'{"resourceSpans":{}}', id="resourceSpans-object"),
        pytest.param(b'{"resourceSpans":[1]}', id="resourceSpans-item"),
        pytest.param(b'{"resourceSpans":[{"resource":[]}]}', id="resource"),
        pytest.param(b'{"resourceSpans":[{"resource":{"attributes":{}}}]}', id="resource-attrs"),
        pytest.param(b'{"resourceSpans":[{"scopeSpans":"x"}]}', id="scopeSpans"),
        pytest.param(b'{"resourceSpans":[{"instrumentationLibrarySpans":{}}]}', id="ils"),
        pytest.param(b'{"resourceSpans":[{"scopeSpans":[{"spans":{}}]}]}', id="spans"),
        pytest.param(b'{"resourceSpans":[{"scopeSpans":[{"spans":["x"]}]}]}', id="span-string"),
        pytest.param(b'{"resourceSpans":[{"scopeSpans":[{"scope":"x"}]}]}', id="scope"),
        pytest.param(b'{"resourceSpans":[{"scopeSpans":[{"scope":{"name":1}}]}]}', id="scope-name"),
        pytest.param(
            b'{"resourceSpans":[{"scopeSpans":[{"instrumentationLibrary":{"version":[]}}]}]}',
            id="library-version",
        ),
        pytest.param(span_body(traceId=1), id="traceId-number"),
        pytest.param(span_body(spanId=True), id="spanId-bool"),
        pytest.param(span_body(parentSpanId={}), id="parentSpanId-object"),
        pytest.param(span_body(name=3), id="name-number"),
        pytest.param(span_body(attributes={}), id="attributes-object"),
        pytest.param(span_body(attributes=["k"]), id="attribute-string"),
        pytest.param(span_body(attributes=[{"value": 1}]), id="attribute-without-key"),
        pytest.param(span_body(attributes=[{"key": 1, "value": 1}]), id="attribute-key-number"),
        pytest.param(span_body(attributes=[{"key": "k"}]), id="attribute-without-value"),
        pytest.param(span_body(status="ok"), id="status-string"),
        pytest.param(span_body(status={"message": 1}), id="status-message-number"),
        pytest.param(one_span({"traceId": 5}), id="skipped-span-still-checked"),
    ],
)
def test_type_mismatches_are_invalid_json(body: bytes) -> None:
    with pytest.raises(InvalidJson):
        spans_from_json(body)


def test_invalid_json_message_names_the_field() -> None:
    with pytest.raises(InvalidJson, match=r"\$\.resourceSpans\[0\]\.scopeSpans\[0\]\.spans\[0\]"):
        spans_from_json(span_body(traceId=1))


def test_deeply_nested_json_is_invalid_json() -> None:
    depth = 100_000
    with pytest.raises(InvalidJson):
        spans_from_json(b"[" * depth + b"]" * depth)


# --- protobuf ----------------------------------------------------------------------------------


def test_protobuf_gives_the_same_rows_as_its_json_form() -> None:
    from_protobuf = spans_from_protobuf(export_as_protobuf().SerializeToString())
    from_json = spans_from_json(encode(export_as_json()))

    assert len(from_protobuf) == 3
    assert from_protobuf == from_json


def test_protobuf_ids_are_lowercase_hex_and_values_take_the_json_shape() -> None:
    claim, heartbeat, _ = spans_from_protobuf(export_as_protobuf().SerializeToString())

    assert claim.trace_id == "0102030405060708090a0b0c0d0e0f10"
    assert heartbeat.parent_span_id == "00000000000000a1"
    attributes = {kv["key"]: kv["value"] for kv in json.loads(claim.attributes_json)}
    assert attributes["retries"] == {"intValue": "3"}
    assert attributes["blob"] == {"bytesValue": "AP8="}
    assert attributes["list"] == {
        "arrayValue": {"values": [{"stringValue": "a"}, {"intValue": "-1"}]}
    }
    assert json.loads(claim.raw_json)["startTimeUnixNano"] == "1700000000000000000"


def test_protobuf_zero_kind_and_times_are_kept_and_empty_strings_are_absent() -> None:
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                scope_spans=[
                    ScopeSpans(
                        scope=InstrumentationScope(),
                        spans=[Span(trace_id=TRACE_A, span_id=SPAN_1, status=Status())],
                    )
                ]
            )
        ]
    )

    (row,) = spans_from_protobuf(request.SerializeToString())

    assert (row.name, row.parent_span_id, row.kind) == ("unnamed", None, "0")
    assert (row.start_time_unix_nano, row.end_time_unix_nano) == (0, 0)
    assert (row.status_code, row.status_message) == ("0", None)
    assert (row.scope_name, row.scope_version) == (None, None)


def test_protobuf_span_without_status_has_no_status_code() -> None:
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(scope_spans=[ScopeSpans(spans=[Span(trace_id=TRACE_A, span_id=SPAN_1)])])
        ]
    )

    (row,) = spans_from_protobuf(request.SerializeToString())

    assert row.status_code is None
    assert json.loads(row.raw_json)["status"] is None


def test_protobuf_spans_with_empty_ids_are_skipped() -> None:
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                scope_spans=[
                    ScopeSpans(spans=[Span(trace_id=TRACE_A), Span(span_id=SPAN_1), Span()])
                ]
            )
        ]
    )

    assert spans_from_protobuf(request.SerializeToString()) == []


def test_empty_protobuf_body_gives_no_rows() -> None:
    assert spans_from_protobuf(b"") == []


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"garbage", id="ascii"),
        pytest.param(b"\xff\xff\xff\xff", id="bad-varint"),
        pytest.param(b"\x0a\x05ab", id="truncated-length"),
        pytest.param(
            ExportTraceServiceRequest(
                resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[Span(name="x")])])]
            )
            .SerializeToString()
            .replace(b"x", b"\xff"),
            id="bad-utf8-string",
        ),
    ],
)
def test_garbage_protobuf_is_a_decode_error(body: bytes) -> None:
    with pytest.raises(OtlpDecodeError):
        spans_from_protobuf(body)


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(OtlpDecodeError, ValueError)


def test_rows_encode_as_msgspec_structs() -> None:
    (row,) = spans_from_json(span_body())

    assert msgspec.json.decode(msgspec.json.encode(row), type=SpanRow) == row


# --- content type ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "normalized"),
    [
        (None, "application/x-protobuf"),
        ("application/json", "application/json"),
        ("application/json; charset=utf-8", "application/json"),
        (" \tApplication/JSON\t ;charset=utf-8", "Application/JSON"),
        ("application/x-protobuf;", "application/x-protobuf"),
        ("", ""),
        ("text/plain\n", "text/plain\n"),
    ],
)
def test_content_type_is_cut_at_semicolon_and_trimmed(header: str | None, normalized: str) -> None:
    assert normalize_content_type(header) == normalized


def test_json_content_type_is_case_insensitive__yes() -> None:
    assert is_json("application/json")
    assert is_json("APPLICATION/Json")


def test_json_content_type_is_case_insensitive__no() -> None:
    assert not is_json("application/json; charset=utf-8")
    assert not is_json("text/json")
    assert not is_json("application/x-protobuf")


def test_protobuf_content_types__yes() -> None:
    assert is_protobuf("application/x-protobuf")
    assert is_protobuf("application/protobuf")
    assert is_protobuf("Application/X-Protobuf")
    assert is_protobuf(normalize_content_type(None))


def test_protobuf_content_types__no() -> None:
    assert not is_protobuf("application/json")
    assert not is_protobuf("application/grpc")
    assert not is_protobuf("")
