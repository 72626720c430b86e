"""Bad input of every kind gets a JSON 4xx, never a 500 or a dropped connection
(contract §1.3, §1.5, §1.6)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import TEST_BACKEND, create_pipeline, unique
from tests.server import PIPELINE, Client, Response

MISSING = "00000000-0000-4000-8000-000000000000"
JSON_HEADERS = {"Content-Type": "application/json"}
LIMIT = 64 * 1024


def raw_post(client: Client, path: str, body: bytes | str) -> Response:
    return client.post(path, body=body, headers=JSON_HEADERS)


def assert_envelope(r: Response) -> str:
    """The body is valid JSON of exactly {"error": {"code": str, "message": str}}."""
    assert r.headers["content-type"] == "application/json"
    doc = json.loads(r.body)
    assert list(doc) == ["error"], doc
    assert set(doc["error"]) == {"code", "message"}, doc
    assert isinstance(doc["error"]["code"], str) and doc["error"]["code"]
    assert isinstance(doc["error"]["message"], str)
    return str(doc["error"]["code"])


@pytest.fixture
def task_id(shared_server: Any) -> Iterator[str]:
    """One task (in a fresh pipeline) for the routes that need a task in the path."""
    c = shared_server.client()
    r = c.post("/tasks", {"pipeline_id": create_pipeline(c), "title": "t", "description": "d"})
    assert r.status == 201, r.body
    yield str(r.json["id"])
    c.close()


def task_json(pipeline_id: str, extra: str = "") -> str:
    return f'{{"pipeline_id": "{pipeline_id}", "title": "t", "description": "d"{extra}}}'


# --- malformed bodies --------------------------------------------------------------------------

WRITE_ROUTES = [
    "/pipelines",
    "/tasks",
    "/tasks/bulk",
    "/tasks/{task}/dependencies",
    "/tasks/{task}/assignments",
    "/leases/claim",
    "/artifacts",
]
MALFORMED = {
    "empty": b"",
    "whitespace": b"  \n ",
    "truncated": b'{"name": "x", ',
    "trailing-garbage": b'{"name": "x"} x',
    "single-quotes": b"{'name': 'x'}",
    "trailing-comma": b'{"name": "x",}',
    "bare-word": b"hello",
    "null": b"null",
    "number": b"42",
    "array": b"[]",
    "empty-object": b"{}",
}


@pytest.mark.parametrize("route", WRITE_ROUTES)
@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_bodies_are_400_invalid_json(
    client: Client, task_id: str, route: str, body: bytes
) -> None:
    r = raw_post(client, route.replace("{task}", task_id), body)
    assert r.status == 400, r.body
    assert assert_envelope(r) == "invalid_json"


WRONG_TYPES = [
    ("/pipelines", {"name": ["x"], "definition": PIPELINE}),
    ("/tasks", {"pipeline_id": 1, "title": "t", "description": "d"}),
    ("/tasks", {"pipeline_id": "p", "title": None, "description": "d"}),
    ("/tasks", {"pipeline_id": "p", "title": "t", "description": "d", "priority": "high"}),
    ("/tasks", {"pipeline_id": "p", "title": "t", "description": "d", "priority": True}),
    ("/tasks", {"pipeline_id": "p", "title": "t", "description": "d", "dependencies": "x"}),
    ("/tasks", {"pipeline_id": "p", "title": "t", "description": "d", "dependencies": [1]}),
    ("/tasks", {"pipeline_id": "p", "title": "t", "description": "d", "retry_policy": 3}),
    (
        "/tasks",
        {
            "pipeline_id": "p",
            "title": "t",
            "description": "d",
            "retry_policy": {"max_attempts": "many"},
        },
    ),
    ("/tasks", {"pipeline_id": "p", "title": "t", "description": "d", "assigned_agent_id": 7}),
    ("/tasks", {"pipeline_id": "p", "title": "t"}),
    ("/tasks", {"title": "t", "description": "d"}),
    ("/leases/claim", {"agent_id": "a"}),
    ("/leases/claim", {"agent_id": "a", "agent_role": "r", "lease_ttl_ms": "soon"}),
    ("/leases/claim", {"agent_id": "a", "agent_role": "r", "concurrency": 5}),
    ("/artifacts", {"kind": "k", "uri": "u", "sha256": 5}),
]


@pytest.mark.parametrize(
    ("path", "body"), WRONG_TYPES, ids=[str(i) for i in range(len(WRONG_TYPES))]
)
def test_wrong_types_and_missing_fields_are_400_invalid_json(
    client: Client, path: str, body: Any
) -> None:
    r = client.post(path, body)
    assert r.status == 400, r.body
    assert assert_envelope(r) == "invalid_json"


def test_a_duplicated_top_level_key_takes_the_last_value(client: Client) -> None:
    """The original refused duplicated top-level keys; we accept them like every JSON parser
    we know (a documented difference, see CHANGELOG): the last value wins."""
    pipeline_id = create_pipeline(client)
    r = raw_post(client, "/tasks", task_json(pipeline_id, ', "title": "again"'))
    assert r.status == 201, r.body
    assert client.get(f"/tasks/{r.json['id']}").json["title"] == "again"


def test_unknown_keys_are_ignored_except_in_a_retry_policy(client: Client) -> None:
    """A retry policy's misspelled key would leave the task without the policy it asked for,
    silently: that one is refused (400 invalid_retry_policy, test_tasks.py)."""
    pipeline_id = create_pipeline(client)
    body = {
        "pipeline_id": pipeline_id,
        "title": "t",
        "description": "d",
        "color": "red",
        "retry_policy": {"max_attempts": 2},
    }
    r = client.post("/tasks", body)
    assert r.status == 201, r.body
    assert client.get(f"/tasks/{r.json['id']}").json["max_attempts"] == 2
    r = client.post("/tasks", {**body, "retry_policy": {"max_attempts": 2, "x": [1]}})
    assert r.status == 400, r.body
    assert assert_envelope(r) == "invalid_retry_policy"


# --- integers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("literal", ["5", '"5"', "5.0", "5e0", "50e-1"])
def test_integral_numbers_and_numeric_strings_are_accepted_as_integers(
    client: Client, literal: str
) -> None:
    r = raw_post(client, "/tasks", task_json(create_pipeline(client), f', "priority": {literal}'))
    assert r.status == 201, r.body
    got = client.get(f"/tasks/{r.json['id']}")
    assert got.json["priority"] == 5
    assert b'"priority":5,' in got.body


@pytest.mark.parametrize("literal", ["5.5", '"5.5"', "1e-3", '"five"', '""', "[5]", "{}"])
def test_non_integral_values_for_integers_are_400_invalid_json(
    client: Client, literal: str
) -> None:
    pipeline_id = create_pipeline(client)
    r = raw_post(client, "/tasks", task_json(pipeline_id, f', "priority": {literal}'))
    assert r.status == 400, r.body
    assert assert_envelope(r) == "invalid_json"


@pytest.mark.parametrize(
    "literal",
    [
        "9223372036854775808",
        "-9223372036854775809",
        "18446744073709551616",
        "1" + "0" * 400,
        "1e300",
        '"9223372036854775808"',
    ],
)
@pytest.mark.parametrize("field", ["priority", "retry_delay_ms", "size_bytes", "lease_ttl_ms"])
def test_integers_beyond_int64_are_400_not_500(client: Client, field: str, literal: str) -> None:
    pipeline_id = create_pipeline(client)
    path, body = {
        "priority": ("/tasks", task_json(pipeline_id, f', "priority": {literal}')),
        "retry_delay_ms": (
            "/tasks",
            task_json(pipeline_id, f', "retry_policy": {{"retry_delay_ms": {literal}}}'),
        ),
        "size_bytes": ("/artifacts", f'{{"kind": "k", "uri": "u", "size_bytes": {literal}}}'),
        "lease_ttl_ms": (
            "/leases/claim",
            f'{{"agent_id": "a", "agent_role": "{unique("role")}", "lease_ttl_ms": {literal}}}',
        ),
    }[field]
    r = raw_post(client, path, body)
    assert r.status == 400, r.body
    assert_envelope(r)


def test_int64_extremes_round_trip(client: Client) -> None:
    big, small = 2**63 - 1, -(2**63)
    pipeline_id = create_pipeline(client)
    for priority in (big, small):
        r = client.post(
            "/tasks",
            {
                "pipeline_id": pipeline_id,
                "title": "t",
                "description": "d",
                "priority": priority,
                "retry_policy": {"max_attempts": big},
            },
        )
        assert r.status == 201, r.body
        task = client.get(f"/tasks/{r.json['id']}").json
        assert (task["priority"], task["max_attempts"]) == (priority, big)


# --- size limit --------------------------------------------------------------------------------


def padded_pipeline(size: int) -> bytes:
    """A pipeline body of exactly `size` bytes."""
    head = json.dumps({"name": unique("big"), "definition": {**PIPELINE, "pad": ""}})
    assert head.endswith('"pad": ""}}')
    pad = size - len(head)
    return (head[:-3] + "x" * pad + '"}}').encode()


def test_a_body_just_under_64_kib_is_accepted(client: Client) -> None:
    body = padded_pipeline(LIMIT - 1000)
    assert len(body) == LIMIT - 1000
    r = raw_post(client, "/pipelines", body)
    assert r.status == 201, r.body[:200]


@pytest.mark.parametrize("size", [LIMIT + 1, 4 * LIMIT])
def test_a_body_over_64_kib_is_413_payload_too_large(client: Client, size: int) -> None:
    r = raw_post(client, "/pipelines", padded_pipeline(size))
    assert r.status == 413
    assert assert_envelope(r) == "payload_too_large"


def test_after_a_413_the_same_client_keeps_working(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    r = raw_post(client, "/tasks", task_json(pipeline_id, ', "metadata": "%s"' % ("x" * LIMIT)))
    assert r.status == 413
    assert assert_envelope(r) == "payload_too_large"
    after = client.post("/tasks", {"pipeline_id": pipeline_id, "title": "t", "description": "d"})
    assert after.status == 201
    assert client.get("/health").status == 200


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body; (0, {}, b"") when the peer closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, b""
        body += chunk
    return int(lines[0].split()[1]), headers, body


@pytest.mark.process
def test_a_413_never_drops_a_keep_alive_connection_unannounced(shared_server: Any) -> None:
    """An oversize request is refused on its Content-Length with a whole JSON response. The
    connection is then either kept usable or closed after announcing `Connection: close`,
    never closed silently under a client that was told it could reuse it. Repeated because
    which of the two happens may depend on timing."""
    body = padded_pipeline(LIMIT + 10)
    head = (
        b"POST /pipelines HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", shared_server.port), timeout=10) as sock:
            sock.sendall(head)  # the body follows only after the refusal has arrived
            status, headers, payload = read_response(sock)
            assert status == 413
            assert json.loads(payload)["error"]["code"] == "payload_too_large"
            if headers.get("connection", "").lower() == "close":
                continue
            with contextlib.suppress(OSError):
                sock.sendall(body + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, _, _ = read_response(sock)
            assert status == 200, "connection closed although the 413 did not announce it"


@pytest.mark.process
def test_an_oversize_chunked_body_without_content_length_is_413(shared_server: Any) -> None:
    """The refusal comes as soon as the chunks pass the limit, and the server may close the
    connection then, while a client sending chunk by chunk is still sending (its next send
    fails with a broken pipe). So the whole request goes at once, into the socket's buffer,
    and the refusal is read after it."""
    chunks = [b'{"name": "chunked", "definition": {"pad": "', *[b"x" * 5000] * 20, b'"}}']
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    head = (
        b"POST /pipelines HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", shared_server.port), timeout=10) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head + body)
        status, _, payload = read_response(sock)
    assert status == 413
    assert json.loads(payload)["error"]["code"] == "payload_too_large"


@pytest.mark.process
def test_a_small_chunked_body_is_read_completely(shared_server: Any) -> None:
    doc = json.dumps({"name": unique("chunked"), "definition": PIPELINE}).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(doc), 7):
            yield doc[i : i + 7]

    conn = http.client.HTTPConnection("127.0.0.1", shared_server.port, timeout=10)
    try:
        conn.request("POST", "/pipelines", body=chunks(), headers=JSON_HEADERS)
        r = conn.getresponse()
        assert r.status == 201, r.read()
        assert "id" in json.loads(r.read())
    finally:
        conn.close()


# --- nesting, encoding, NUL --------------------------------------------------------------------


@pytest.mark.parametrize("where", ["whole-body", "metadata", "definition", "unclosed"])
def test_deeply_nested_json_is_400(client: Client, where: str) -> None:
    depth = 10_000
    pipeline_id = create_pipeline(client)
    path, body = {
        "whole-body": ("/tasks", "[" * depth + "]" * depth),
        "metadata": (
            "/tasks",
            task_json(pipeline_id, ', "metadata": ' + "[" * depth + "]" * depth),
        ),
        "definition": (
            "/pipelines",
            f'{{"name": "{unique("deep")}", "definition": '
            + '{"a":' * depth
            + "1"
            + "}" * depth
            + "}",
        ),
        "unclosed": ("/tasks", task_json(pipeline_id, ', "metadata": ' + "[" * depth)[:-1]),
    }[where]
    r = raw_post(client, path, body)
    assert r.status == 400, r.body
    assert assert_envelope(r) == "invalid_json"
    assert client.get("/health").status == 200


@pytest.mark.parametrize(
    "where", ["title", "metadata-string", "metadata-key", "definition", "truncated-sequence"]
)
def test_invalid_utf8_is_400(client: Client, where: str) -> None:
    pipeline_id = create_pipeline(client)
    start = f'{{"pipeline_id": "{pipeline_id}", '.encode()
    path, body = {
        "title": ("/tasks", start + b'"title": "\xff\xfe", "description": "d"}'),
        "metadata-string": (
            "/tasks",
            start + b'"title": "t", "description": "d", "metadata": "\xc3\x28"}',
        ),
        "metadata-key": (
            "/tasks",
            start + b'"title": "t", "description": "d", "metadata": {"\xed\xa0\x80": 1}}',
        ),
        "definition": ("/pipelines", b'{"name": "n", "definition": {"x": "\x80"}}'),
        "truncated-sequence": ("/tasks", start + b'"title": "t\xe2\x82", "description": "d"}'),
    }[where]
    r = raw_post(client, path, body)
    assert r.status == 400, r.body
    assert assert_envelope(r) == "invalid_json"


def test_nul_bytes_in_strings_are_stored_and_echoed(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    metadata = {"k\u0000ey": "v\u0000al", "list": ["\u0000"]}
    r = client.post(
        "/tasks",
        {
            "pipeline_id": pipeline_id,
            "title": "a\u0000b",
            "description": "\u0000",
            "metadata": metadata,
        },
    )
    if TEST_BACKEND == "postgres":
        # PostgreSQL text cannot hold NUL (README, "On PostgreSQL"): a clear 400, no 500.
        assert r.status == 400 and r.error_code == "invalid_request", r.body
        assert "NUL" in r.json["error"]["message"]
        return
    assert r.status == 201, r.body
    task = client.get(f"/tasks/{r.json['id']}").json
    assert task["title"] == "a\u0000b"
    assert task["description"] == "\u0000"
    assert task["metadata"] == metadata
    listed = client.get(f"/tasks?pipeline_id={pipeline_id}").json["items"]
    assert listed[0]["title"] == "a\u0000b"


def test_unicode_text_round_trips(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    title = 'naïve ☃ \U0001f600 \u2028 "quoted" \\ back'
    r = client.post("/tasks", {"pipeline_id": pipeline_id, "title": title, "description": "é"})
    assert r.status == 201, r.body
    assert client.get(f"/tasks/{r.json['id']}").json["title"] == title


def test_a_lone_surrogate_escape_is_rejected_not_stored(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    r = raw_post(client, "/tasks", task_json(pipeline_id).replace('"t"', '"\\ud800"'))
    assert r.status == 400
    assert assert_envelope(r) == "invalid_json"


# --- every error is the JSON envelope ----------------------------------------------------------

ERRORS: list[tuple[str, str, Any]] = [
    ("GET", "/nope", None),
    ("PATCH", "/tasks", None),
    ("GET", f"/pipelines/{MISSING}", None),
    ("GET", f"/tasks/{MISSING}", None),
    ("GET", f"/tasks/{MISSING}/run-state", None),
    ("GET", "/tasks?limit=0", None),
    ("GET", "/tasks?cursor=zz", None),
    ("GET", "/artifacts?limit=5000", None),
    ("POST", "/pipelines", b"{"),
    ("POST", "/pipelines", {"name": "n", "definition": {"initial": ""}}),
    ("POST", "/tasks", {"pipeline_id": MISSING, "title": "t", "description": "d"}),
    ("POST", "/tasks/bulk", {"tasks": []}),
    ("POST", f"/tasks/{MISSING}/dependencies", {"depends_on_task_id": MISSING}),
    ("POST", f"/tasks/{MISSING}/assignments", {"agent_id": "a"}),
    ("DELETE", f"/tasks/{MISSING}/assignments/a", None),
    ("POST", f"/leases/{MISSING}/heartbeat", None),
    ("POST", f"/runs/{MISSING}/transition", {"trigger": "x"}),
    ("POST", f"/runs/{MISSING}/fail", {"error": "x"}),
    ("POST", f"/runs/{MISSING}/events", {"kind": "x"}),
    ("POST", "/artifacts", {"task_id": MISSING, "kind": "k", "uri": "u"}),
    ("POST", "/artifacts", {"run_id": MISSING, "kind": "k", "uri": "u"}),
    ("POST", "/pipelines", b'{"name": "\x00\xff"}'),
]


@pytest.mark.parametrize(
    ("method", "path", "body"), ERRORS, ids=[f"{m} {p} {i}" for i, (m, p, _) in enumerate(ERRORS)]
)
def test_every_error_body_is_the_json_envelope(
    client: Client, method: str, path: str, body: Any
) -> None:
    if isinstance(body, bytes):
        r = client.request(method, path, body=body, headers=JSON_HEADERS)
    else:
        r = client.request(method, path, body)
    assert 400 <= r.status < 500, (r.status, r.body)
    assert_envelope(r)


def test_a_request_without_content_type_is_still_parsed(client: Client) -> None:
    body = json.dumps({"name": unique("plain"), "definition": PIPELINE})
    r = client.post("/pipelines", body=body)
    assert r.status == 201, r.body


@pytest.mark.process
def test_a_garbage_request_line_does_not_take_the_server_down(shared_server: Any) -> None:
    with socket.create_connection(("127.0.0.1", shared_server.port), timeout=5) as s:
        s.sendall(b"\x00\x01garbage\r\n\r\n")
        with contextlib.suppress(OSError):
            s.recv(1024)
    c = shared_server.client()
    try:
        assert c.get("/health").status == 200
    finally:
        c.close()


@pytest.mark.process
def test_a_body_that_stops_arriving_gets_408_after_the_read_timeout(make_server: Any) -> None:
    server = make_server(args=["--read-timeout", "1"])
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /pipelines HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"name": '
        )
        started = time.monotonic()
        status, headers, payload = read_response(sock)
        waited = time.monotonic() - started
    assert status == 408
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    assert headers.get("connection", "").lower() == "close"
    assert 0.5 <= waited < 5
    client = server.client()
    try:
        assert client.get("/health").status == 200  # the server carries on
    finally:
        client.close()
