"""What a web page can make the server do: requests with the headers browsers send (Origin,
Sec-Fetch-Site, the Host a DNS-rebound name carries), written by hand over real sockets."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import claimed, make_task, pipeline_with_roles, server_dsn, unique
from tests.server import Client, Response, Server

pytestmark = pytest.mark.process

TOKEN = "origins-secret"
EVIL = "http://evil.example"


def send(
    server: Server,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: Any = None,
    conn: http.client.HTTPConnection | None = None,
) -> Response:
    """One request with exactly these headers (Host too, when given)."""
    own = conn is None
    c = conn or http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    hdrs = dict(headers or {})
    try:
        c.putrequest(method, path, skip_host="Host" in hdrs, skip_accept_encoding=True)
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body))
        if isinstance(data, str):
            data = data.encode()
        if data is not None:
            hdrs.setdefault("Content-Type", "text/plain")  # what a no-cors fetch may send
            hdrs["Content-Length"] = str(len(data))
        for name, value in hdrs.items():
            c.putheader(name, value)
        c.endheaders(data)
        r = c.getresponse()
        payload = r.read()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, payload)
    finally:
        if own:
            c.close()


def forbidden(r: Response, *words: str) -> None:
    assert (r.status, r.error_code) == (403, "forbidden"), r.body
    message = r.json["error"]["message"]
    for word in words:
        assert word in message, message


@pytest.fixture(scope="module")
def open_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Server]:
    """A default server: loopback, no token."""
    server = Server(tmp_path_factory.mktemp("origins") / "open.db", dsn=server_dsn(request)).start()
    yield server
    server.stop()


@pytest.fixture
def api(open_server: Server) -> Iterator[Client]:
    c = open_server.client()
    yield c
    c.close()


def own_host(server: Server) -> str:
    return f"127.0.0.1:{server.port}"


# --- Host: DNS rebinding ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/health", "/tasks", "/pipelines", "/metrics", "/ops/queue", "/events/stream", "/ui/"]
)
def test_a_foreign_host_gets_nothing_from_a_server_without_a_token(
    open_server: Server, api: Client, path: str
) -> None:
    pipeline_id, _, _ = pipeline_with_roles(api)
    title = unique("secret-title")
    make_task(api, pipeline_id, title=title)
    r = send(open_server, "GET", path, {"Host": f"evil.example:{open_server.port}"})
    forbidden(r, "evil.example", "--allowed-hosts")
    assert title.encode() not in r.body and pipeline_id.encode() not in r.body
    assert b"version" not in r.body and b"nulltickets_" not in r.body


def test_a_rebound_page_cannot_write_either(open_server: Server, api: Client) -> None:
    pipeline_id, _, _ = pipeline_with_roles(api)
    body = {"pipeline_id": pipeline_id, "title": "rebound", "description": ""}
    host = f"evil.example:{open_server.port}"
    r = send(open_server, "POST", "/tasks", {"Host": host, "Origin": f"http://{host}"}, body)
    forbidden(r, "--allowed-hosts")
    assert api.get(f"/tasks?pipeline_id={pipeline_id}").json["items"] == []


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "localhost", "LOCALHOST", "app.localhost", "127.0.0.2", "[::1]"]
)
def test_loopback_names_are_answered(open_server: Server, host: str) -> None:
    r = send(open_server, "GET", "/tasks", {"Host": f"{host}:{open_server.port}"})
    assert r.status == 200, r.body


def test_a_request_without_host_is_answered(open_server: Server) -> None:
    # HTTP/1.0 clients may leave Host out; a browser never does.
    r = send(open_server, "GET", "/health", {})
    assert r.status == 200


def test_allowed_hosts_admits_a_name(make_server: Any) -> None:
    server = make_server(args=["--allowed-hosts", "evil.example, tracker.internal"])
    for name in ("evil.example", "tracker.internal"):
        r = send(server, "GET", "/tasks", {"Host": f"{name}:{server.port}"})
        assert r.status == 200, r.body
    forbidden(send(server, "GET", "/tasks", {"Host": "other.example"}))


def test_allowed_hosts_from_the_environment(make_server: Any) -> None:
    server = make_server(env={"NULLTICKETS_ALLOWED_HOSTS": "evil.example"})
    assert send(server, "GET", "/tasks", {"Host": "evil.example"}).status == 200


def test_with_a_token_the_host_is_not_checked_but_the_token_is(make_server: Any) -> None:
    server = make_server(token=TOKEN)
    host = {"Host": "evil.example"}
    assert send(server, "GET", "/tasks", host).error_code == "unauthorized"
    r = send(server, "GET", "/tasks", {**host, "Authorization": f"Bearer {TOKEN}"})
    assert r.status == 200


# --- Origin and Sec-Fetch-Site ------------------------------------------------------------------


@pytest.mark.parametrize(
    "origin", [EVIL, "null", "http://127.0.0.1:1", "http://localhost:1", "https://127.0.0.1"]
)
def test_a_foreign_origin_cannot_create_or_cancel_a_task(
    open_server: Server, api: Client, origin: str
) -> None:
    pipeline_id, _, _ = pipeline_with_roles(api)
    victim = make_task(api, pipeline_id)
    headers = {"Origin": origin, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
    body = {"pipeline_id": pipeline_id, "title": "from a web page", "description": ""}
    forbidden(send(open_server, "POST", "/tasks", headers, body), "--allowed-origins")
    forbidden(send(open_server, "POST", f"/tasks/{victim}/cancel", headers, {}))
    # The Origin alone is enough (Sec-Fetch-Site is only sent to trustworthy origins).
    forbidden(send(open_server, "POST", "/tasks", {"Origin": origin}, body))
    items = api.get(f"/tasks?pipeline_id={pipeline_id}").json["items"]
    assert [t["id"] for t in items] == [victim]
    assert api.get(f"/tasks/{victim}").json.get("cancelled_at_ms") is None


def test_a_foreign_origin_cannot_touch_a_lease_or_the_store(
    open_server: Server, api: Client
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(api)
    task_id = make_task(api, pipeline_id)
    lease = claimed(api, coder)
    auth = {"Authorization": f"Bearer {lease['lease_token']}", "Origin": EVIL}
    forbidden(send(open_server, "POST", f"/runs/{lease['run']['id']}/fail", auth, {"error": "x"}))
    ns = unique("ns")
    forbidden(send(open_server, "PUT", f"/store/{ns}/k", {"Origin": EVIL}, {"value": 1}))
    assert api.get(f"/store/{ns}/k").status == 404
    assert api.get(f"/tasks/{task_id}").json["stage"] == "todo"
    assert api.get(f"/tasks/{task_id}/run-state").json["run_id"] == lease["run"]["id"]


def test_a_cross_site_fetch_without_origin_is_refused(open_server: Server) -> None:
    r = send(
        open_server, "GET", "/tasks", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}
    )
    forbidden(r, "Sec-Fetch-Site")
    stream = {"Sec-Fetch-Site": "cross-site", "Accept": "text/event-stream"}
    forbidden(send(open_server, "GET", "/events/stream", stream))


def test_following_a_link_to_the_dashboard_from_another_site_opens_it(open_server: Server) -> None:
    visit = {
        "Sec-Fetch-Site": "cross-site",
        "Sec-Fetch-Mode": "navigate",
        "Sec-Fetch-Dest": "document",
    }
    r = send(open_server, "GET", "/ui/", visit)
    assert r.status == 200 and r.headers["content-type"].startswith("text/html")
    forbidden(send(open_server, "GET", "/tasks", visit))  # the API is no page


def test_the_same_origin_and_no_origin_are_admitted(open_server: Server, api: Client) -> None:
    pipeline_id, _, _ = pipeline_with_roles(api)
    body = {"pipeline_id": pipeline_id, "title": "t", "description": ""}
    own = {"Host": own_host(open_server), "Origin": f"http://{own_host(open_server)}"}
    same = {**own, "Sec-Fetch-Site": "same-origin", "Content-Type": "application/json"}
    assert send(open_server, "POST", "/tasks", same, body).status == 201
    named = f"localhost:{open_server.port}"  # the dashboard opened as localhost
    as_named = {"Host": named, "Origin": f"http://{named}", "Content-Type": "application/json"}
    assert send(open_server, "POST", "/tasks", as_named, body).status == 201
    assert (
        send(open_server, "POST", "/tasks", {"Content-Type": "application/json"}, body).status
        == 201
    )
    typed = {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate"}  # a URL typed by hand
    assert send(open_server, "GET", f"/tasks?pipeline_id={pipeline_id}", typed).status == 200
    assert len(api.get(f"/tasks?pipeline_id={pipeline_id}").json["items"]) == 3


def test_a_preflight_from_a_foreign_origin_is_refused_without_cors_headers(
    open_server: Server,
) -> None:
    preflight = {
        "Origin": EVIL,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
        "Sec-Fetch-Mode": "cors",
    }
    r = send(open_server, "OPTIONS", "/tasks", preflight)
    forbidden(r)
    assert not [h for h in r.headers if h.startswith("access-control-")]
    r = send(open_server, "GET", "/tasks", {"Origin": EVIL, "Sec-Fetch-Mode": "cors"})
    forbidden(r)
    assert not [h for h in r.headers if h.startswith("access-control-")]


def test_a_refused_write_leaves_the_connection_usable(open_server: Server, api: Client) -> None:
    pipeline_id, _, _ = pipeline_with_roles(api)
    conn = http.client.HTTPConnection("127.0.0.1", open_server.port, timeout=30)
    try:
        body = {"pipeline_id": pipeline_id, "title": "t", "description": "x" * 5000}
        forbidden(send(open_server, "POST", "/tasks", {"Origin": EVIL}, body, conn=conn))
        r = send(open_server, "GET", f"/tasks?pipeline_id={pipeline_id}", {}, conn=conn)
        assert (r.status, r.json["items"]) == (200, [])
    finally:
        conn.close()


def test_allowed_origins_admits_a_listed_origin(make_server: Any) -> None:
    server = make_server(
        args=["--allowed-origins", "https://tracker.example.com,http://ops.example:8080"]
    )
    c = server.client()
    try:
        pipeline_id, _, _ = pipeline_with_roles(c)
    finally:
        c.close()
    body = {"pipeline_id": pipeline_id, "title": "t", "description": ""}
    for origin in ("https://tracker.example.com", "http://ops.example:8080"):
        r = send(server, "POST", "/tasks", {"Origin": origin, "Sec-Fetch-Site": "cross-site"}, body)
        assert r.status == 201, r.body
    forbidden(send(server, "POST", "/tasks", {"Origin": "http://ops.example:8081"}, body))
    forbidden(send(server, "POST", "/tasks", {"Origin": EVIL}, body))


def test_allowed_origins_from_the_config_file(make_server: Any, tmp_path: Any) -> None:
    config = tmp_path / "allowed.json"
    config.write_text(json.dumps({"allowed_origins": ["https://tracker.example.com"]}))
    server = make_server(args=["--config", str(config)])
    r = send(server, "GET", "/tasks", {"Origin": "https://tracker.example.com"})
    assert r.status == 200, r.body


def test_the_dashboard_login_from_another_origin_is_refused(make_server: Any) -> None:
    server = make_server(token=TOKEN)
    form = f"token={TOKEN}&next=/ui/"
    headers = {"Origin": EVIL, "Content-Type": "application/x-www-form-urlencoded"}
    r = send(server, "POST", "/ui/login", headers, form.encode())
    forbidden(r)
    assert "set-cookie" not in r.headers
    own = {"Origin": f"http://127.0.0.1:{server.port}", "Host": f"127.0.0.1:{server.port}"}
    r = send(server, "POST", "/ui/login", {**headers, **own}, form.encode())
    assert r.status == 303 and "set-cookie" in r.headers


# --- the other HTTP edges, as a client that controls its headers sees them -------------------


def test_a_lower_case_bearer_works_for_admin_and_lease_routes(make_server: Any) -> None:
    server = make_server(token=TOKEN)
    c = server.client(TOKEN)
    try:
        pipeline_id, coder, _ = pipeline_with_roles(c)
        make_task(c, pipeline_id)
        lease = claimed(c, coder)
    finally:
        c.close()
    assert send(server, "GET", "/tasks", {"Authorization": f"bearer {TOKEN}"}).status == 200
    r = send(
        server,
        "POST",
        f"/leases/{lease['lease_id']}/heartbeat",
        {"Authorization": f"BEARER {lease['lease_token']}", "Content-Type": "application/json"},
        {},
    )
    assert r.status == 200, r.body


def test_405_names_the_methods_and_head_has_no_body(open_server: Server) -> None:
    r = send(open_server, "DELETE", "/tasks")
    assert (r.status, r.error_code, r.headers["allow"]) == (
        405,
        "method_not_allowed",
        "GET, HEAD, POST",
    )
    get = send(open_server, "GET", "/pipelines")
    head = send(open_server, "HEAD", "/pipelines")
    assert (head.status, head.body) == (200, b"")
    assert head.headers["content-length"] == get.headers["content-length"]


def test_otlp_garbage_is_400(open_server: Server) -> None:
    for path in ("/v1/traces", "/otlp/v1/traces"):
        r = send(open_server, "POST", path, {"Content-Type": "application/x-protobuf"}, b"\xff\xfe")
        assert (r.status, r.error_code) == (400, "invalid_json"), r.body
