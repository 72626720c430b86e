"""OTLP trace exports turned into `otlp_spans` rows (contract §14): one parser for OTLP/JSON,
and OTLP/protobuf decoded into the same JSON shape and fed through it.

Pure: bytes in, `SpanRow` values out; no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import msgspec
from google.protobuf.json_format import MessageToDict  # type: ignore[import-untyped]
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from nulltickets.domain.model import SpanRow as SpanRow
from nulltickets.errors import InvalidJson

DEFAULT_CONTENT_TYPE = "application/x-protobuf"
RUN_ID_KEY = "nulltickets.run_id"
TASK_ID_KEY = "nulltickets.task_id"

_PROTOBUF_TYPES = frozenset({"application/x-protobuf", "application/protobuf"})
_ANY_VALUE_KINDS = ("stringValue", "intValue", "doubleValue", "boolValue", "bytesValue")
_DECIMAL = re.compile(r"[+-]?[0-9]+", re.ASCII)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

JsonObject = dict[str, Any]


class OtlpDecodeError(ValueError):
    """Body is not a valid OTLP/protobuf ExportTraceServiceRequest."""


# --- content type ------------------------------------------------------------------------------


def normalize_content_type(header: str | None) -> str:
    """The media type of a Content-Type header: cut at the first `;`, spaces and tabs trimmed.

    A missing header means protobuf, the OTLP/HTTP default.
    """
    if header is None:
        return DEFAULT_CONTENT_TYPE
    return header.split(";", 1)[0].strip(" \t")


def is_json(content_type: str) -> bool:
    """True when a normalized content type selects the OTLP/JSON parser."""
    return content_type.lower() == "application/json"


def is_protobuf(content_type: str) -> bool:
    """True for the two media types OTLP/HTTP uses for binary protobuf."""
    return content_type.lower() in _PROTOBUF_TYPES


# --- OTLP/JSON ---------------------------------------------------------------------------------


def spans_from_json(body: bytes) -> list[SpanRow]:
    """Rows for every span of an OTLP/JSON ExportTraceServiceRequest that has both ids.

    Raises InvalidJson when the body is not JSON or a recognized field has the wrong type;
    unknown fields are ignored and `null` counts as absent. Times may be decimal strings (the
    proto3 JSON mapping) or JSON integers, which some exporters send (quirk Q28 lifted).
    """
    try:
        root = msgspec.json.decode(body)
    except msgspec.MsgspecError as exc:
        raise InvalidJson(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise InvalidJson("invalid JSON body: nested too deeply") from None
    return _rows_from_request(root)


def _rows_from_request(root: Any) -> list[SpanRow]:
    # Every recognized field is type-checked before a span is skipped for lacking ids, so one
    # malformed span rejects the whole export, as the contract asks (nothing stored).
    request = _as_object(root, "$")
    rows: list[SpanRow] = []
    for i, resource_spans in enumerate(_array(request, "resourceSpans", "$")):
        rs_path = f"$.resourceSpans[{i}]"
        rs = _as_object(resource_spans, rs_path)
        resource = _object(rs, "resource", rs_path)
        resource_attributes = (
            _key_values(resource, "attributes", f"{rs_path}.resource") if resource else None
        ) or []
        resource_attributes_json = _compact(resource_attributes)
        for group in ("scopeSpans", "instrumentationLibrarySpans"):
            for j, scope_spans in enumerate(_array(rs, group, rs_path)):
                ss_path = f"{rs_path}.{group}[{j}]"
                ss = _as_object(scope_spans, ss_path)
                scope_name, scope_version = _scope(ss, ss_path)
                for k, span in enumerate(_array(ss, "spans", ss_path)):
                    row = _span_row(
                        _as_object(span, f"{ss_path}.spans[{k}]"),
                        f"{ss_path}.spans[{k}]",
                        scope_name,
                        scope_version,
                        resource_attributes,
                        resource_attributes_json,
                    )
                    if row is not None:
                        rows.append(row)
    return rows


def _scope(scope_spans: JsonObject, path: str) -> tuple[str | None, str | None]:
    """(name, version) from `scope` when present, even empty, else `instrumentationLibrary`."""
    scope = _object(scope_spans, "scope", path)
    library = _object(scope_spans, "instrumentationLibrary", path)
    fields: list[tuple[str | None, str | None]] = []
    for key, value in (("scope", scope), ("instrumentationLibrary", library)):
        if value is not None:
            where = f"{path}.{key}"
            fields.append((_string(value, "name", where), _string(value, "version", where)))
    return fields[0] if fields else (None, None)


def _span_row(
    span: JsonObject,
    path: str,
    scope_name: str | None,
    scope_version: str | None,
    resource_attributes: list[JsonObject],
    resource_attributes_json: str,
) -> SpanRow | None:
    trace_id = _string(span, "traceId", path)
    span_id = _string(span, "spanId", path)
    parent_span_id = _string(span, "parentSpanId", path)
    name = _string(span, "name", path)
    kind = span.get("kind")
    start = span.get("startTimeUnixNano")
    end = span.get("endTimeUnixNano")
    attributes = _key_values(span, "attributes", path)
    status = _object(span, "status", path)
    status_code = status.get("code") if status is not None else None
    status_message = _string(status, "message", f"{path}.status") if status is not None else None
    if trace_id is None or span_id is None:
        return None
    raw = {
        "traceId": trace_id,
        "spanId": span_id,
        "parentSpanId": parent_span_id,
        "name": name,
        "kind": kind,
        "startTimeUnixNano": start,
        "endTimeUnixNano": end,
        "attributes": attributes,
        "status": None if status is None else {"code": status_code, "message": status_message},
    }
    span_attributes = attributes or []
    return SpanRow(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id,
        name="unnamed" if name is None else name,
        kind=_code_text(kind),
        start_time_unix_nano=_nanos(start),
        end_time_unix_nano=_nanos(end),
        status_code=_code_text(status_code),
        status_message=status_message,
        scope_name=scope_name,
        scope_version=scope_version,
        run_id=_attribute_text(RUN_ID_KEY, span_attributes, resource_attributes),
        task_id=_attribute_text(TASK_ID_KEY, span_attributes, resource_attributes),
        attributes_json=_compact(span_attributes),
        resource_attributes_json=resource_attributes_json,
        raw_json=_compact(raw),
    )


# --- typed field access (null equals absent) ---------------------------------------------------


def _as_object(value: Any, path: str) -> JsonObject:
    if not isinstance(value, dict):
        raise InvalidJson(f"{path} must be an object")
    return value


def _object(parent: JsonObject, key: str, path: str) -> JsonObject | None:
    value = parent.get(key)
    return None if value is None else _as_object(value, f"{path}.{key}")


def _array(parent: JsonObject, key: str, path: str) -> list[Any]:
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidJson(f"{path}.{key} must be an array")
    return value


def _string(parent: JsonObject, key: str, path: str) -> str | None:
    value = parent.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidJson(f"{path}.{key} must be a string")
    return value


def _key_values(parent: JsonObject, key: str, path: str) -> list[JsonObject] | None:
    """A KeyValue array as `{key, value}` pairs in received order; None when absent."""
    if parent.get(key) is None:
        return None
    pairs = []
    for i, item in enumerate(_array(parent, key, path)):
        where = f"{path}.{key}[{i}]"
        kv = _as_object(item, where)
        name = kv.get("key")
        if not isinstance(name, str):
            raise InvalidJson(f"{where}.key must be a string")
        if "value" not in kv:
            raise InvalidJson(f"{where}.value is required")
        pairs.append({"key": name, "value": kv["value"]})
    return pairs


# --- value rendering ---------------------------------------------------------------------------


def _compact(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _code_text(value: Any) -> str | None:
    """`kind` / `status.code` as stored: integers in decimal, strings as-is, else compact JSON."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _compact(value)


def _nanos(value: Any) -> int | None:
    """A 64-bit time from a decimal string or a JSON integer; None for anything else."""
    if isinstance(value, str):
        if not _DECIMAL.fullmatch(value):
            return None
        value = int(value)
    elif isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if _INT64_MIN <= value <= _INT64_MAX else None


def _attribute_text(
    key: str, span_attributes: Iterable[JsonObject], resource_attributes: Iterable[JsonObject]
) -> str | None:
    """The span attribute `key` as text, falling back to the resource attribute."""
    for attributes in (span_attributes, resource_attributes):
        for kv in attributes:
            if kv["key"] == key:
                text = _any_value_text(kv["value"])
                if text is not None:
                    return text
                break
    return None


def _any_value_text(value: Any) -> str | None:
    """AnyValue as text: the first present of its scalar fields, else its compact JSON."""
    if isinstance(value, dict):
        for kind in _ANY_VALUE_KINDS:
            if value.get(kind) is not None:
                return _scalar_text(value[kind])
        return _compact(value)
    return None if value is None else _scalar_text(value)


def _scalar_text(value: Any) -> str:
    return value if isinstance(value, str) else _compact(value)


# --- OTLP/protobuf -----------------------------------------------------------------------------


def spans_from_protobuf(body: bytes) -> list[SpanRow]:
    """Rows for an OTLP/protobuf ExportTraceServiceRequest, equal to those of its JSON form.

    The message is rendered in the OTLP/JSON shape (ids as lowercase hex, int64 as decimal
    strings, enums as integers, bytes values as base64) and parsed by the JSON parser. Empty
    strings and ids count as absent, as in the proto3 JSON mapping; `kind`, the two times and
    a present status's `code` have no absence in proto3, so their value is kept even when 0.
    The legacy `instrumentation_library_spans` field (1000) is reserved in the current schema
    and its spans are dropped. Raises OtlpDecodeError for bytes that do not decode.
    """
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise OtlpDecodeError(f"invalid OTLP protobuf body: {exc}") from None
    return _rows_from_request(_request_as_json(request))


def _request_as_json(request: Any) -> JsonObject:
    resource_spans = []
    for rs in request.resource_spans:
        out: JsonObject = {}
        if rs.HasField("resource"):
            out["resource"] = {"attributes": _pb_key_values(rs.resource.attributes)}
        scope_spans = []
        for ss in rs.scope_spans:
            group: JsonObject = {}
            if ss.HasField("scope"):
                group["scope"] = _non_empty({"name": ss.scope.name, "version": ss.scope.version})
            group["spans"] = [_pb_span(span) for span in ss.spans]
            scope_spans.append(group)
        out["scopeSpans"] = scope_spans
        resource_spans.append(out)
    return {"resourceSpans": resource_spans}


def _pb_span(span: Any) -> JsonObject:
    out = _non_empty(
        {
            "traceId": span.trace_id.hex(),
            "spanId": span.span_id.hex(),
            "parentSpanId": span.parent_span_id.hex(),
            "name": span.name,
        }
    )
    out["kind"] = int(span.kind)
    out["startTimeUnixNano"] = str(span.start_time_unix_nano)
    out["endTimeUnixNano"] = str(span.end_time_unix_nano)
    if span.attributes:
        out["attributes"] = _pb_key_values(span.attributes)
    if span.HasField("status"):
        status: JsonObject = {"code": int(span.status.code)}
        if span.status.message:
            status["message"] = span.status.message
        out["status"] = status
    return out


def _pb_key_values(key_values: Iterable[Any]) -> list[JsonObject]:
    # MessageToDict gives the proto3 JSON mapping OTLP/JSON uses for AnyValue: int64 as a
    # decimal string, bytes as base64, arrays and kvlists as {"values": [...]}.
    return [{"key": kv.key, "value": MessageToDict(kv.value)} for kv in key_values]


def _non_empty(fields: dict[str, str]) -> JsonObject:
    return {key: value for key, value in fields.items() if value}
