"""Keys beside the --token (POST/GET/DELETE /keys) on a real server: what each access level may
do, claims limited to an agent key's roles, a revoked key refused at once (also by another
server of a PostgreSQL tracker), the key kept only as its hash, the slow-down of wrong keys,
the dashboard's login with a key, the OpenAPI declaration and the `nulltickets keys` command."""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import apsw
import pytest

from nulltickets.client import ApiError
from nulltickets.client import Client as PyClient
from nulltickets.http import slowdown
from nulltickets.http.routes import ROUTES, Route
from nulltickets.service.verbs import Guard as Auth
from tests.cli import one_line, run_cli
from tests.conftest import (
    claimed,
    make_task,
    module_server,
    pipeline_with_roles,
    server_dsn,
    servers_on_one_postgres,
    unique,
)
from tests.pgserver import PostgresServer
from tests.server import Client, Response, Server
from tests.sse import SseClient

pytestmark = pytest.mark.e2e

TOKEN = "keys-root-token-0123456789"
ID = "00000000-0000-4000-8000-000000000000"


@pytest.fixture
def secured(request: pytest.FixtureRequest) -> Server:
    return module_server(request, "keys", token=TOKEN, dsn=server_dsn(request))


@pytest.fixture
def admin(secured: Server) -> Iterator[Client]:
    c = secured.client(TOKEN)
    yield c
    c.close()


def new_key(admin: Client, access: str, roles: list[str] | None = None, **kw: Any) -> Any:
    body: dict[str, Any] = {"name": unique("key"), "access": access}
    if roles is not None:
        body["roles"] = roles
    r = admin.post("/keys", body, **kw)
    assert r.status == 201, r.body
    return r.json


def as_key(server: Server, key: dict[str, Any]) -> Client:
    return server.client(key["key"])


def forbidden(r: Response) -> bool:
    return (r.status, r.error_code) == (403, "forbidden")


def unauthorized(r: Response) -> bool:
    return (r.status, r.error_code) == (401, "unauthorized")


def concrete(route: Route) -> str:
    """The route's path with its parameters filled in (store routes get a namespace and key)."""
    if route.pattern.startswith("/store/") and "{" in route.pattern:
        path = re.sub(r"\{[a-z_]+\+?\}", "ns", route.pattern, count=1)
        return re.sub(r"\{[a-z_]+\+?\}", "key", path)
    return re.sub(r"\{[a-z_]+\+?\}", ID, route.pattern)


# --- making and listing keys -------------------------------------------------------------------


def test_a_new_key_is_shown_once_and_never_listed(admin: Client) -> None:
    made = new_key(admin, "agent", ["coder"])
    assert list(made) == ["id", "key", "name", "access", "roles", "created_at_ms"]
    assert made["key"].startswith("ntk_") and len(made["key"]) == 47
    assert (made["access"], made["roles"]) == ("agent", ["coder"])
    listed = admin.get("/keys")
    assert listed.status == 200
    mine = [k for k in listed.json if k["id"] == made["id"]]
    assert mine == [{k: v for k, v in made.items() if k != "key"}]
    digest = hashlib.sha256(made["key"].encode()).digest()
    for secret in (made["key"].encode(), made["key"][4:].encode(), digest.hex().encode()):
        assert secret not in listed.body


def test_each_post_makes_a_new_key_even_under_one_idempotency_key(admin: Client) -> None:
    headers = {"Idempotency-Key": unique("idem")}
    body = {"name": "ci", "access": "read"}
    first, second = (admin.post("/keys", body, headers=headers) for _ in range(2))
    assert first.status == second.status == 201
    assert first.json["key"] != second.json["key"]  # nothing recorded, nothing replayed


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"name": "a", "access": "agent"}, "invalid_request"),
        ({"name": "a", "access": "agent", "roles": []}, "invalid_request"),
        ({"name": "a", "access": "read", "roles": ["coder"]}, "invalid_request"),
        ({"name": " ", "access": "read"}, "invalid_request"),
        ({"name": "a", "access": "root"}, "invalid_json"),
        ({"access": "read"}, "invalid_json"),
        ({"name": "a", "access": "agent", "roles": "coder"}, "invalid_json"),
    ],
)
def test_a_bad_key_request_is_400(admin: Client, body: dict[str, Any], code: str) -> None:
    r = admin.post("/keys", body)
    assert (r.status, r.error_code) == (400, code), r.body


@pytest.mark.sqlite_file
def test_the_database_holds_only_the_hash_of_a_key(make_server: Any) -> None:
    server = make_server(token=TOKEN)
    admin = server.client(TOKEN)
    try:
        made = new_key(admin, "agent", ["coder"], headers={"Idempotency-Key": "k1"})
    finally:
        admin.close()
    server.stop()
    files = b"".join(p.read_bytes() for p in server.db.parent.glob(server.db.name + "*"))
    assert made["key"].encode() not in files
    conn = apsw.Connection(str(server.db))
    try:
        rows = list(conn.execute("SELECT id, key_hash FROM api_keys"))
    finally:
        conn.close()
    assert rows == [(made["id"], hashlib.sha256(made["key"].encode()).digest())]


def test_keys_need_a_server_with_a_token(fresh_client: Client) -> None:
    r = fresh_client.post("/keys", {"name": "a", "access": "read"})
    assert (r.status, r.error_code) == (409, "keys_need_token")
    assert "--token" in r.json["error"]["message"]
    assert fresh_client.get("/keys").json == []


# --- what an agent key may do ------------------------------------------------------------------


def test_an_agent_key_claims_for_its_roles_only(secured: Server, admin: Client) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(admin)
    task_id = make_task(admin, pipeline_id)
    agent = as_key(secured, new_key(admin, "agent", [coder]))
    try:
        r = agent.post("/leases/claim", {"agent_id": "a", "agent_role": reviewer})
        assert forbidden(r), r.body
        assert coder in r.json["error"]["message"]
        lease = claimed(agent, coder)
        assert lease["task"]["id"] == task_id
        # The lease routes take the lease token, as before keys; never the key.
        run, token = lease["run"]["id"], lease["lease_token"]
        r = agent.post(f"/runs/{run}/events", {"kind": "progress"})
        assert unauthorized(r)
        assert agent.post(f"/leases/{lease['lease_id']}/heartbeat", token=token).status == 200
        assert agent.post(f"/runs/{run}/events", {"kind": "progress"}, token=token).status == 201
        assert agent.get(f"/runs/{run}/events").status == 200  # reading takes any key
        r = agent.post(f"/runs/{run}/transition", {"trigger": "submit"}, token=token)
        assert r.status == 200, r.body
        assert forbidden(agent.post("/leases/claim", {"agent_id": "a", "agent_role": reviewer}))
    finally:
        agent.close()


def test_an_agent_key_cannot_operate_the_tracker(secured: Server, admin: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(admin)
    task_id = make_task(admin, pipeline_id)
    other = make_task(admin, pipeline_id)
    agent = as_key(secured, new_key(admin, "agent", [coder]))
    try:
        refused = [
            ("POST", f"/tasks/{task_id}/requeue", {}),
            ("POST", f"/tasks/{task_id}/cancel", {}),
            ("POST", "/agents/release", {"agent_id": "someone-else"}),
            ("DELETE", "/store/shared-notes", None),
            ("POST", "/keys", {"name": "mine", "access": "admin"}),
            ("GET", "/keys", None),
            ("DELETE", f"/keys/{ID}", None),
            ("POST", "/pipelines", {"name": unique("p"), "definition": {}}),
            ("POST", f"/tasks/{task_id}/assignments", {"agent_id": "me"}),
            ("DELETE", f"/tasks/{task_id}/assignments/me", None),
            ("POST", f"/tasks/{task_id}/dependencies", {"depends_on_task_id": other}),
        ]
        for method, path, body in refused:
            r = agent.request(method, path, body)
            assert forbidden(r), (method, path, r.status, r.body)
        details = admin.get(f"/tasks/{task_id}").json
        assert details.get("cancelled_at_ms") is None and details["dependencies"] == []
    finally:
        agent.close()


def test_an_agent_key_makes_the_writes_agents_make(secured: Server, admin: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(admin)
    agent = as_key(secured, new_key(admin, "agent", [coder]))
    ns = unique("ns")
    try:
        task = agent.post("/tasks", {"pipeline_id": pipeline_id, "title": "t", "description": ""})
        assert task.status == 201, task.body
        bulk = agent.post(
            "/tasks/bulk",
            {"tasks": [{"pipeline_id": pipeline_id, "title": "u", "description": ""}]},
        )
        assert bulk.status == 201, bulk.body
        artifact = agent.post("/artifacts", {"kind": "log", "uri": "file:///x"})
        assert artifact.status == 201, artifact.body
        assert agent.put(f"/store/{ns}/notes", {"value": {"a": 1}}).status == 204
        assert agent.get(f"/store/{ns}/notes").json["value"] == {"a": 1}
        assert agent.delete(f"/store/{ns}/notes").status == 204
        trace = agent.post("/v1/traces", {"resourceSpans": []})
        assert trace.status == 200, trace.body
        assert agent.get(f"/tasks?pipeline_id={pipeline_id}").status == 200
    finally:
        agent.close()


# --- what a read key may do --------------------------------------------------------------------


@pytest.mark.process
def test_a_read_key_reads_every_route_and_writes_none(secured: Server, admin: Client) -> None:
    reader = as_key(secured, new_key(admin, "read"))
    try:
        wrong = []
        for route in ROUTES:
            if route.auth is Auth.NONE or route.media == "text/event-stream":
                continue
            if route.auth is Auth.LEASE and route.method != "GET":
                continue  # the lease token's, not a key's
            body = {} if route.method in ("POST", "PUT") else None
            r = reader.request(route.method, concrete(route), body)
            if route.pattern == "/keys":
                ok = forbidden(r)
            elif route.method == "GET":
                ok = r.status not in (401, 403)
            else:
                ok = forbidden(r)
            if not ok:
                wrong.append((route.method, route.pattern, r.status, r.body[:120]))
        assert wrong == []
        assert reader.get("/metrics").status == 200
    finally:
        reader.close()
    stream = SseClient(
        secured.port, "/events/stream", {"Authorization": f"Bearer {reader.token}"}
    ).open()
    try:
        assert stream.status == 200
        assert stream.response_headers["content-type"].startswith("text/event-stream")
        assert stream.next().comment == "connected"
    finally:
        stream.close()


# --- refused keys ------------------------------------------------------------------------------


def test_unknown_and_revoked_keys_are_refused_at_once(secured: Server, admin: Client) -> None:
    made = new_key(admin, "admin")
    holder = as_key(secured, made)
    try:
        assert holder.get("/tasks").status == 200  # known to the server now
        assert holder.get("/keys").status == 200  # an admin key is like the token
        unknown = "ntk_" + "A" * 43
        assert unauthorized(holder.get("/tasks", token=unknown))
        r = admin.delete(f"/keys/{made['id']}")
        assert r.status == 200 and r.json["id"] == made["id"] and "key" not in r.json
        assert unauthorized(holder.get("/tasks"))
        assert unauthorized(holder.post("/leases/claim", {"agent_id": "a", "agent_role": "r"}))
        assert unauthorized(holder.get(f"/runs/{ID}/events"))
        assert made["id"] not in admin.get("/keys").body.decode()
        assert (admin.delete(f"/keys/{made['id']}").status, 404) == (404, 404)
    finally:
        holder.close()


@pytest.mark.process
def test_a_revoked_keys_event_stream_ends(make_server: Any) -> None:
    server = make_server(token=TOKEN, env={"NULLTICKETS_SSE_HEARTBEAT_S": "0.2"})
    admin = server.client(TOKEN)
    try:
        made = new_key(admin, "read")
        stream = SseClient(
            server.port, "/events/stream", {"Authorization": f"Bearer {made['key']}"}
        ).open()
        try:
            assert stream.status == 200
            assert stream.next().comment == "connected"
            assert admin.delete(f"/keys/{made['id']}").status == 200
            with pytest.raises(EOFError):
                for _ in range(100):  # heartbeats until the stream sees its key is gone
                    stream.next(timeout=10)
        finally:
            stream.close()
    finally:
        admin.close()


@pytest.fixture
def two_servers(postgres: PostgresServer, tmp_path: Path) -> Iterator[list[Server]]:
    with servers_on_one_postgres(postgres, tmp_path, 2, token=TOKEN) as servers:
        yield servers


def test_a_key_revoked_on_one_server_is_refused_by_another_at_once(
    two_servers: list[Server],
) -> None:
    one, two = two_servers
    admin = one.client(TOKEN)
    try:
        pipeline_id, coder, _ = pipeline_with_roles(admin)
        for _ in range(3):
            made = new_key(admin, "agent", [coder])
            agent = as_key(two, made)
            try:
                make_task(admin, pipeline_id)
                assert claimed(agent, coder)  # the second server knows the key now
                assert agent.get("/tasks?limit=1").status == 200
                assert admin.delete(f"/keys/{made['id']}").status == 200  # on the first server
                assert unauthorized(agent.get("/tasks?limit=1"))
                assert unauthorized(
                    agent.post("/leases/claim", {"agent_id": "a", "agent_role": coder})
                )
            finally:
                agent.close()
    finally:
        admin.close()


# --- wrong keys slow their sender down ---------------------------------------------------------


def test_wrong_keys_slow_their_sender_down_but_not_a_valid_agent_beside_it(
    make_server: Any,
) -> None:
    server = make_server(token=TOKEN)
    admin = server.client(TOKEN)
    guesser = server.client()
    try:
        pipeline_id, coder, _ = pipeline_with_roles(admin)
        agent = as_key(server, new_key(admin, "agent", [coder]))
        make_task(admin, pipeline_id)
        for n in range(slowdown.FREE):
            assert unauthorized(guesser.get("/tasks", token=f"ntk_{n:043d}"))
        # From here on each wrong key waits before its 401, longer and longer.
        waits = []
        for n in range(6):
            started = time.monotonic()
            assert unauthorized(guesser.get("/tasks", token=f"wrong-{n}"))
            waits.append(time.monotonic() - started)
        assert waits[-1] >= 0.5, waits
        # While one more wrong key waits for its answer, an agent on the same 127.0.0.1 with
        # a valid key claims, reads and is answered first, each time.
        answered = threading.Event()

        def guess() -> None:
            assert unauthorized(guesser.get("/tasks", token="wrong-again"))
            answered.set()

        thread = threading.Thread(target=guess)
        thread.start()
        try:
            time.sleep(0.05)
            assert claimed(agent, coder)
            assert agent.get("/tasks?limit=1").status == 200
            assert admin.get("/keys").status == 200
            assert not answered.is_set(), "the valid requests waited behind the wrong one"
        finally:
            thread.join(30)
        agent.close()
    finally:
        admin.close()
        guesser.close()


# --- the dashboard with a key ------------------------------------------------------------------


def login(server: Server, token: str) -> tuple[int, str, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(
            "POST",
            "/ui/login",
            body=urlencode({"token": token, "next": "/ui/"}),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        r = conn.getresponse()
        r.read()
        jar = {
            line.split(";", 1)[0].split("=", 1)[0]: line.split(";", 1)[0].split("=", 1)[1]
            for line in r.headers.get_all("set-cookie") or []
        }
        return r.status, "; ".join(f"{k}={v}" for k, v in jar.items()), jar
    finally:
        conn.close()


@pytest.mark.process
def test_the_dashboard_takes_any_key_and_a_read_session_changes_nothing(
    secured: Server, admin: Client
) -> None:
    pipeline_id, _, _ = pipeline_with_roles(admin)
    task_id = make_task(admin, pipeline_id)
    made = new_key(admin, "read")
    status, cookie, jar = login(secured, made["key"])
    assert status == 303
    assert made["key"] not in cookie
    browser = secured.client()
    host = f"127.0.0.1:{secured.port}"
    try:
        page = browser.get("/ui/", headers={"Cookie": cookie})
        assert b'<body data-login="on" data-access="read">' in page.body
        assert browser.get("/ops/stages", headers={"Cookie": cookie}).status == 200
        write = {"Cookie": cookie, "X-CSRF-Token": jar["nt_csrf"], "Host": host}
        r = browser.post(f"/tasks/{task_id}/cancel", {}, headers=write)
        assert forbidden(r), r.body
        assert admin.get(f"/tasks/{task_id}").json.get("cancelled_at_ms") is None
        # The admin token's session may; a revoked key's session ends with the key.
        status, root_cookie, _ = login(secured, TOKEN)
        page = browser.get("/ui/", headers={"Cookie": root_cookie})
        assert b'data-access="admin"' in page.body
        assert admin.delete(f"/keys/{made['id']}").status == 200
        assert unauthorized(browser.get("/ops/stages", headers={"Cookie": cookie}))
        assert b'data-access=""' in browser.get("/ui/", headers={"Cookie": cookie}).body
        assert login(secured, "ntk_" + "B" * 43)[0] == 401
    finally:
        browser.close()


def test_a_dashboard_without_a_token_has_no_login(fresh_client: Client) -> None:
    page = fresh_client.get("/ui/")
    assert b'<body data-login="off" data-access="admin">' in page.body


# --- declared in the OpenAPI document ----------------------------------------------------------


def test_the_openapi_document_declares_who_may_call_each_route(client: Client) -> None:
    doc = client.get("/openapi.json").json
    paths = doc["paths"]
    assert paths["/tasks"]["get"]["x-access"] == ["read", "agent", "admin"]
    assert paths["/leases/claim"]["post"]["x-access"] == ["agent", "admin"]
    assert "403" in paths["/leases/claim"]["post"]["responses"]
    assert paths["/tasks/{id}/cancel"]["post"]["x-access"] == ["admin"]
    assert paths["/store/{namespace}/{key}"]["put"]["x-access"] == ["agent", "admin"]
    assert paths["/store/{namespace}"]["delete"]["x-access"] == ["admin"]
    assert paths["/runs/{id}/transition"]["post"]["x-access"] == ["lease"]
    assert paths["/runs/{id}/events"]["get"]["x-access"] == ["read", "agent", "admin", "lease"]
    assert "x-access" not in paths["/health"]["get"]
    keys = paths["/keys"]
    assert keys["get"]["x-access"] == keys["post"]["x-access"] == ["admin"]
    assert paths["/keys/{id}"]["delete"]["x-access"] == ["admin"]
    post = keys["post"]
    assert not [p for p in post.get("parameters", []) if p["name"] == "Idempotency-Key"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CreateKey"
    }
    created = doc["components"]["schemas"]["CreatedKey"]
    assert created["required"] == ["id", "key", "name", "access", "roles", "created_at_ms"]
    assert "key" not in doc["components"]["schemas"]["KeyInfo"]["properties"]
    assert "POST /keys" in doc["components"]["securitySchemes"]["bearerAuth"]["description"]
    assert "409" in post["responses"] and "keys_need_token" in json.dumps(post["responses"])


# --- the command and the Python clients --------------------------------------------------------


@pytest.mark.process
def test_the_keys_command_makes_lists_and_revokes(secured: Server, tmp_path: Path) -> None:
    def keys(*args: str, token: str | None = TOKEN) -> Any:
        extra = ["--token", token] if token is not None else []
        return run_cli("keys", *args, "--base", secured.base, *extra, home=tmp_path)

    made = keys("create", "--name", "laptop", "--access", "agent", "--role", "a", "--role", "b")
    assert made.returncode == 0, made
    key = made.stdout.strip()
    assert re.fullmatch(r"ntk_[A-Za-z0-9_-]{43}", key)
    assert "only time the key is shown" in made.stderr and key not in made.stderr
    listed = keys("list", "--json")
    assert listed.returncode == 0, listed
    mine = [k for k in json.loads(listed.stdout) if k["name"] == "laptop"]
    assert len(mine) == 1 and mine[0]["roles"] == ["a", "b"] and "key" not in mine[0]
    table = keys("list")
    assert table.stdout.split()[:5] == ["ID", "ACCESS", "CREATED", "ROLES", "NAME"]
    assert key not in listed.stdout + table.stdout
    assert secured.client(key).get("/tasks?limit=1").status == 200
    gone = keys("revoke", mine[0]["id"])
    assert gone.returncode == 0 and gone.stdout.startswith(f"revoked key {mine[0]['id']}")
    assert secured.client(key).get("/tasks?limit=1").status == 401
    again = keys("revoke", mine[0]["id"])
    assert again.returncode == 1 and "404 not_found" in one_line(again)
    denied = keys("create", "--name", "x", "--access", "read", token=None)
    assert denied.returncode == 1 and "401 unauthorized" in one_line(denied)
    bad = keys("create", "--name", "x", "--access", "root")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


@pytest.mark.process
def test_the_keys_command_says_keys_need_a_token(fresh_server: Server, tmp_path: Path) -> None:
    made = run_cli(
        "keys", "create", "--name", "x", "--access", "read", "--base", fresh_server.base,
        home=tmp_path,
    )  # fmt: skip
    assert made.returncode == 1 and "409 keys_need_token" in one_line(made)


@pytest.mark.process
def test_the_python_client_makes_lists_and_revokes_keys(secured: Server) -> None:
    with PyClient(secured.base, TOKEN) as api:
        made = api.create_key("py", "agent", ["coder"])
        assert made.key.startswith("ntk_") and made.roles == ["coder"]
        assert made.id in [k.id for k in api.list_keys()]
        with PyClient(secured.base, made.key) as agent:
            assert agent.list_tasks(limit=1).items is not None
            with pytest.raises(ApiError) as refused:
                agent.list_keys()
            assert (refused.value.status, refused.value.code) == (403, "forbidden")
        assert api.revoke_key(made.id).id == made.id
        assert made.id not in [k.id for k in api.list_keys()]
