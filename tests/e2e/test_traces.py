"""OTLP trace ingest (contract §14) and reading a run's spans back."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from tests.conftest import pipeline_with_roles, unique
from tests.server import Client

TRACE = "5b8efff798038103d269b633813fc60c"


def claimed_run(client: Client) -> dict[str, Any]:
    pid, coder, _ = pipeline_with_roles(client)
    assert (
        client.post("/tasks", {"pipeline_id": pid, "title": "t", "description": ""}).status == 201
    )
    r = client.post("/leases/claim", {"agent_id": "tracer", "agent_role": coder})
    assert r.status == 200
    return dict(r.json)


def json_export(run_id: str, task_id: str, span_ids: list[str]) -> dict[str, Any]:
    return {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        {"key": "service.name", "value": {"stringValue": "agent"}},
                        {"key": "nulltickets.task_id", "value": {"stringValue": task_id}},
                    ]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "llm", "version": "1.0"},
                        "spans": [
                            {
                                "traceId": TRACE,
                                "spanId": sid,
                                "name": f"call-{sid}",
                                "kind": 3,
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000000500000000",
                                "attributes": [
                                    {"key": "nulltickets.run_id", "value": {"stringValue": run_id}},
                                    {"key": "tokens", "value": {"intValue": "42"}},
                                ],
                                "status": {"code": 1, "message": "fine"},
                            }
                            for sid in span_ids
                        ],
                    }
                ],
            }
        ]
    }


def protobuf_export(run_id: str, task_id: str, span_ids: list[str]) -> bytes:
    def kv(key: str, **value: Any) -> KeyValue:
        return KeyValue(key=key, value=AnyValue(**value))

    spans = [
        Span(
            trace_id=bytes.fromhex(TRACE),
            span_id=bytes.fromhex(sid),
            name=f"call-{sid}",
            kind=Span.SpanKind.SPAN_KIND_CLIENT,
            start_time_unix_nano=1700000000000000000,
            end_time_unix_nano=1700000000500000000,
            attributes=[kv("nulltickets.run_id", string_value=run_id), kv("tokens", int_value=42)],
        )
        for sid in span_ids
    ]
    for span in spans:
        span.status.code = 1
        span.status.message = "fine"
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource={
                    "attributes": [
                        kv("service.name", string_value="agent"),
                        kv("nulltickets.task_id", string_value=task_id),
                    ]
                },
                scope_spans=[ScopeSpans(scope={"name": "llm", "version": "1.0"}, spans=spans)],
            )
        ]
    )
    return bytes(request.SerializeToString())


def spans_of(client: Client, run_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/runs/{run_id}/spans")
    assert r.status == 200, r.body
    return list(r.json["items"])


def comparable(span: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in span.items() if k not in ("id", "batch_id")}


def test_json_and_protobuf_exports_of_the_same_spans_land_as_the_same_rows(
    client: Client,
) -> None:
    a, b = claimed_run(client), claimed_run(client)
    run_a, task_a, run_b, task_b = a["run"]["id"], a["task"]["id"], b["run"]["id"], b["task"]["id"]
    ids = ["00f067aa0ba902b7", "00f067aa0ba902b8"]
    r = client.post("/v1/traces", json_export(run_a, task_a, ids))
    assert r.status == 200 and r.json["accepted_spans"] == 2 and r.json["stored"] == "json"
    r = client.post(
        "/otlp/v1/traces",
        body=protobuf_export(run_b, task_b, ids),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert r.status == 200 and r.json["accepted_spans"] == 2, r.body
    from_json, from_proto = spans_of(client, run_a), spans_of(client, run_b)
    assert len(from_json) == 2
    first = from_json[0]
    assert (first["trace_id"], first["span_id"], first["name"]) == (TRACE, ids[0], "call-" + ids[0])
    assert (first["run_id"], first["task_id"]) == (run_a, task_a)
    assert first["start_time_unix_nano"] == 1700000000000000000
    assert (first["status_code"], first["status_message"], first["kind"]) == ("1", "fine", "3")
    assert (first["scope_name"], first["scope_version"]) == ("llm", "1.0")
    # The same spans in protobuf give the same rows, apart from the run and task they name.
    for j, p in zip(from_json, from_proto, strict=True):
        assert p["run_id"] == run_b and p["task_id"] == task_b
        j, p = comparable(j), comparable(p)
        for key in ("run_id", "task_id", "attributes", "resource_attributes"):
            j.pop(key), p.pop(key)
        assert j == p


def test_spans_page_without_losing_rows(client: Client) -> None:
    run = claimed_run(client)
    ids = [f"{i:016x}" for i in range(1, 8)]
    client.post("/v1/traces", json_export(run["run"]["id"], run["task"]["id"], ids))
    seen, cursor = [], None
    while True:
        q = f"?limit=3&cursor={cursor}" if cursor else "?limit=3"
        page = client.get(f"/runs/{run['run']['id']}/spans{q}").json
        seen += [s["span_id"] for s in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids


@pytest.mark.parametrize("path", ["/v1/traces", "/otlp/v1/traces"])
@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-protobuf", b"\xff\x00garbage"),
        ("application/protobuf", b"anything"),
        (None, b"not protobuf"),  # no Content-Type means protobuf
        ("text/plain", b"anything"),
        ("application/x-www-form-urlencoded", b"a=1"),
    ],
)
def test_a_body_that_is_not_otlp_is_refused_and_nothing_stored(
    client: Client, path: str, content_type: str | None, body: bytes
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    before = client.post(path, {"resourceSpans": []}).json["batch_id"]
    r = client.post(path, body=body, headers=headers)
    assert (r.status, r.error_code) == (400, "invalid_json"), r.body
    after = client.post(path, {"resourceSpans": []}).json["batch_id"]
    assert after == before + 1  # the refused body made no batch


def test_an_empty_protobuf_export_is_still_accepted(client: Client) -> None:
    r = client.post("/v1/traces", body=b"", headers={"Content-Type": "application/x-protobuf"})
    assert r.status == 200 and r.json["accepted_spans"] == 0


def test_bad_json_is_refused(client: Client) -> None:
    for bad in (
        b"{nope",
        b'{"resourceSpans": 5}',
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 1}]}]}]}',
    ):
        r = client.post("/v1/traces", body=bad, headers={"Content-Type": "application/json"})
        assert r.status == 400 and r.error_code == "invalid_json"


def test_spans_without_ids_are_skipped(client: Client) -> None:
    run_id = unique("run")
    export = {
        "resourceSpans": [
            {
                "scopeSpans": [
                    {
                        "spans": [
                            {"spanId": "01", "name": "no trace"},
                            {
                                "traceId": TRACE,
                                "spanId": "02",
                                "attributes": [
                                    {"key": "nulltickets.run_id", "value": {"stringValue": run_id}}
                                ],
                            },
                        ]
                    }
                ]
            }
        ]
    }
    r = client.post("/v1/traces", export)
    assert r.json["accepted_spans"] == 1
    [span] = spans_of(client, run_id)
    assert span["name"] == "unnamed"
