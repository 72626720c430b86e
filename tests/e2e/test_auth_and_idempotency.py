"""The admin-token gate (§2) and Idempotency-Key replay (§3, with the Q9 improvements)."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import create_pipeline, module_server, pipeline_with_roles, unique
from tests.server import PIPELINE, Client, Response, Server

TOKEN = "secret"
ID = "00000000-0000-4000-8000-000000000000"

# Every admin route of contract §6 (all rows but the exempt 1-3 and the lease rows 20-24).
ADMIN_ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/traces", {}),
    ("POST", "/otlp/v1/traces", {}),
    ("POST", "/pipelines", {"name": "n", "definition": PIPELINE}),
    ("GET", "/pipelines", None),
    ("GET", f"/pipelines/{ID}", None),
    ("POST", "/tasks", {"pipeline_id": ID, "title": "t", "description": "d"}),
    ("POST", "/tasks/bulk", {"tasks": []}),
    ("GET", "/tasks", None),
    ("GET", f"/tasks/{ID}", None),
    ("GET", f"/tasks/{ID}/run-state", None),
    ("POST", f"/tasks/{ID}/dependencies", {"depends_on_task_id": ID}),
    ("GET", f"/tasks/{ID}/dependencies", None),
    ("POST", f"/tasks/{ID}/assignments", {"agent_id": "a"}),
    ("GET", f"/tasks/{ID}/assignments", None),
    ("DELETE", f"/tasks/{ID}/assignments/a", None),
    ("POST", "/leases/claim", {"agent_id": "a", "agent_role": "r"}),
    ("POST", "/artifacts", {"kind": "k", "uri": "u"}),
    ("GET", "/artifacts", None),
    ("GET", "/ops/queue", None),
    ("GET", "/ops/stages", None),
    ("GET", "/ops/retrying", None),
    ("GET", f"/tasks/{ID}/runs", None),
    ("GET", "/namespaces", None),
    ("GET", "/metrics", None),
    ("PUT", "/store/ns/key", {"value": 1}),
    ("GET", "/store/ns/key", None),
    ("DELETE", "/store/ns/key", None),
    ("GET", "/store/ns", None),
    ("DELETE", "/store/ns", None),
    ("GET", "/store/search?q=x", None),
]
EXEMPT = ["/health", "/openapi.json", "/.well-known/openapi.json"]
LEASE_ROUTES = [
    f"/leases/{ID}/heartbeat",
    f"/runs/{ID}/events",
    f"/runs/{ID}/transition",
    f"/runs/{ID}/fail",
]
BAD_AUTH: dict[str, dict[str, str]] = {
    "none": {},
    "wrong-token": {"Authorization": "Bearer wrong"},
    "empty-token": {"Authorization": "Bearer "},
    "prefix-of-token": {"Authorization": "Bearer secre"},
    "bearer-without-token": {"Authorization": "bearer"},
    "lowercase-bearer-wrong-token": {"Authorization": "bearer secre"},
    "basic": {"Authorization": "Basic secret"},
    "no-scheme": {"Authorization": "secret"},
}


@pytest.fixture
def secured_server(request: pytest.FixtureRequest) -> Server:
    """One server started with --token secret for the module (what `make_server(token=...)`
    builds, shared so the gate tests stay fast)."""
    return module_server(request, "secured", token=TOKEN)


@pytest.fixture
def secured(secured_server: Server) -> Iterator[Client]:
    """A client without credentials to the server started with --token secret."""
    c = secured_server.client()
    yield c
    c.close()


def test_make_server_with_a_token_closes_the_gate(make_server: Any) -> None:
    c = make_server(token="another").client()
    try:
        assert c.get("/tasks").error_code == "unauthorized"
        assert c.get("/tasks", token=TOKEN).error_code == "unauthorized"
        assert c.get("/tasks", token="another").status == 200
    finally:
        c.close()


def admin(headers: dict[str, str] | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}", **(headers or {})}


def new_task(client: Client, pipeline_id: str, **kw: Any) -> Response:
    return client.post(
        "/tasks", {"pipeline_id": pipeline_id, "title": "t", "description": "d"}, **kw
    )


def task_count(client: Client, pipeline_id: str, **kw: Any) -> int:
    r = client.get(f"/tasks?pipeline_id={pipeline_id}&limit=1000", **kw)
    assert r.status == 200, r.body
    return len(r.json["items"])


def random_token() -> str:
    return secrets.token_hex(32)


# --- the admin gate ----------------------------------------------------------------------------


def test_every_admin_route_refuses_missing_or_wrong_tokens(secured: Client) -> None:
    failures = []
    for method, path, body in ADMIN_ROUTES:
        for name, headers in BAD_AUTH.items():
            r = secured.request(method, path, body, headers=headers)
            if r.status != 401 or r.error_code != "unauthorized":
                failures.append((method, path, name, r.status, r.body))
    assert failures == []


def test_the_admin_token_opens_every_admin_route(secured: Client) -> None:
    for method, path, body in ADMIN_ROUTES:
        r = secured.request(method, path, body, headers=admin())
        assert r.status != 401, (method, path, r.body)


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR"])
def test_the_scheme_word_bearer_is_taken_in_any_case(secured: Client, scheme: str) -> None:
    r = secured.get("/tasks", headers={"Authorization": f"{scheme} {TOKEN}"})
    assert r.status == 200, r.body
    r = secured.get("/tasks", headers={"Authorization": f"{scheme} {TOKEN}x"})
    assert (r.status, r.error_code) == (401, "unauthorized")


@pytest.mark.parametrize("path", EXEMPT)
@pytest.mark.parametrize("auth", ["none", "wrong-token"])
def test_health_and_openapi_need_no_token(secured: Client, path: str, auth: str) -> None:
    r = secured.get(path, headers=BAD_AUTH[auth])
    assert r.status == 200
    assert r.json


def test_unknown_paths_and_wrong_methods_are_401_before_routing(secured: Client) -> None:
    for method, path, status, code in [
        ("GET", "/nope", 404, "not_found"),
        ("PATCH", "/tasks", 405, "method_not_allowed"),
        ("GET", "/leases/claim", 405, "method_not_allowed"),
        ("POST", "/health/x", 404, "not_found"),
        ("GET", "/nope/ui", 404, "not_found"),
    ]:
        r = secured.request(method, path)
        assert (r.status, r.error_code) == (401, "unauthorized"), (method, path)
        assert "allow" not in r.headers  # the gate says nothing about the routes behind it
        r = secured.request(method, path, headers=admin())
        assert (r.status, r.error_code) == (status, code), (method, path)


def test_lease_paths_need_a_bearer_at_the_gate(secured: Client) -> None:
    for path in LEASE_ROUTES:
        r = secured.post(path, {"trigger": "t", "kind": "k", "error": "e"})
        assert (r.status, r.error_code) == (401, "unauthorized"), path


def test_any_bearer_passes_the_gate_on_lease_paths(secured: Client) -> None:
    # A well-formed but unknown lease token gets through the gate to the handler's lookup.
    for path in LEASE_ROUTES:
        body = {"trigger": "t", "kind": "k", "error": "e"}
        r = secured.post(path, body, token=random_token())
        assert (r.status, r.error_code) == (404, "not_found"), (path, r.body)


def test_the_admin_token_is_no_lease_token(secured: Client, secured_server: Server) -> None:
    admin_client = secured_server.client(TOKEN)
    try:
        pipeline_id, coder, _ = pipeline_with_roles(admin_client)
    finally:
        admin_client.close()
    assert new_task(secured, pipeline_id, token=TOKEN).status == 201
    lease = secured.post("/leases/claim", {"agent_id": "a", "agent_role": coder}, token=TOKEN)
    assert lease.status == 200, lease.body
    run_id, lease_id = lease.json["run"]["id"], lease.json["lease_id"]
    for path, body in [
        (f"/leases/{lease_id}/heartbeat", None),
        (f"/runs/{run_id}/events", {"kind": "k"}),
        (f"/runs/{run_id}/transition", {"trigger": "submit"}),
        (f"/runs/{run_id}/fail", {"error": "e"}),
    ]:
        r = secured.post(path, body, token=TOKEN)
        assert (r.status, r.error_code) == (401, "unauthorized"), path
    ok = secured.post(
        f"/runs/{run_id}/transition", {"trigger": "submit"}, token=lease.json["lease_token"]
    )
    assert ok.status == 200, ok.body


def test_reading_events_needs_a_bearer_and_the_admin_token_works(secured: Client) -> None:
    r = secured.get(f"/runs/{ID}/events")
    assert (r.status, r.error_code) == (401, "unauthorized")
    r = secured.get(f"/runs/{ID}/events", token=TOKEN)
    assert r.status == 200
    assert r.json == {"items": [], "next_cursor": None}


def test_an_idempotent_replay_still_needs_the_admin_token(secured: Client) -> None:
    body = {"name": unique("pipe"), "definition": PIPELINE}
    key = {"Idempotency-Key": unique("key")}
    first = secured.post("/pipelines", body, headers=admin(key))
    assert first.status == 201
    replay = secured.post("/pipelines", body, headers=key)
    assert (replay.status, replay.error_code) == (401, "unauthorized")
    assert secured.post("/pipelines", body, headers=admin(key)).json == first.json


# --- idempotency -------------------------------------------------------------------------------


def key_header() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


def test_the_same_key_and_body_replays_without_executing_again(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    key = key_header()
    first = new_task(client, pipeline_id, headers=key)
    second = new_task(client, pipeline_id, headers=key)
    assert first.status == second.status == 201
    assert first.body == second.body
    assert task_count(client, pipeline_id) == 1


def test_a_request_without_a_key_executes_every_time(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    assert new_task(client, pipeline_id).json != new_task(client, pipeline_id).json
    assert task_count(client, pipeline_id) == 2


def test_an_empty_key_is_still_a_key(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    body = {"pipeline_id": pipeline_id, "title": unique("t"), "description": "d"}
    first = client.post("/tasks", body, headers={"Idempotency-Key": ""})
    second = client.post("/tasks", body, headers={"Idempotency-Key": ""})
    assert first.status == 201
    assert second.json == first.json
    assert task_count(client, pipeline_id) == 1


def test_the_same_key_with_a_different_body_is_409_idempotency_conflict(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    key = key_header()
    assert new_task(client, pipeline_id, headers=key).status == 201
    other = client.post(
        "/tasks", {"pipeline_id": pipeline_id, "title": "other", "description": "d"}, headers=key
    )
    assert (other.status, other.error_code) == (409, "idempotency_conflict")
    assert task_count(client, pipeline_id) == 1


def test_whitespace_changes_make_a_different_body(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    key = {"Idempotency-Key": unique("key"), "Content-Type": "application/json"}
    body = f'{{"pipeline_id":"{pipeline_id}","title":"t","description":"d"}}'
    assert client.post("/tasks", body=body, headers=key).status == 201
    r = client.post("/tasks", body=body.replace(",", ", "), headers=key)
    assert (r.status, r.error_code) == (409, "idempotency_conflict")
    assert task_count(client, pipeline_id) == 1


def test_the_same_key_on_another_path_or_method_is_independent(client: Client) -> None:
    key = key_header()
    pipeline = client.post("/pipelines", {"name": unique("p"), "definition": PIPELINE}, headers=key)
    assert pipeline.status == 201
    task = new_task(client, pipeline.json["id"], headers=key)
    assert task.status == 201
    task_id = task.json["id"]
    assign = client.post(f"/tasks/{task_id}/assignments", {"agent_id": "ann"}, headers=key)
    assert assign.status == 201
    unassign = client.delete(f"/tasks/{task_id}/assignments/ann", headers=key)
    assert unassign.json == {"status": "unassigned"}
    assert client.get(f"/tasks/{task_id}").json["assignments"][0]["active"] is False


def test_the_query_string_is_not_part_of_the_key(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    key = key_header()
    body = {"pipeline_id": pipeline_id, "title": "t", "description": "d"}
    first = client.post("/tasks", body, headers=key)
    second = client.post("/tasks?retry=1", body, headers=key)
    assert second.json == first.json
    assert task_count(client, pipeline_id) == 1


def test_a_replayed_delete_returns_the_stored_success(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    task_id = new_task(client, pipeline_id).json["id"]
    assert client.post(f"/tasks/{task_id}/assignments", {"agent_id": "ann"}).status == 201
    key = key_header()
    first = client.delete(f"/tasks/{task_id}/assignments/ann", headers=key)
    assert first.status == 200
    replay = client.delete(f"/tasks/{task_id}/assignments/ann", headers=key)
    assert (replay.status, replay.json) == (200, {"status": "unassigned"})
    assert client.delete(f"/tasks/{task_id}/assignments/ann").status == 404


def test_failures_are_not_stored_so_a_retry_executes_again(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client)).json["id"]
    key = key_header()
    path = f"/tasks/{task_id}/assignments/ann"
    failed = client.delete(path, headers=key)
    assert (failed.status, failed.error_code) == (404, "not_found")
    assert client.post(f"/tasks/{task_id}/assignments", {"agent_id": "ann"}).status == 201
    retried = client.delete(path, headers=key)
    assert (retried.status, retried.json) == (200, {"status": "unassigned"})
    assert client.get(f"/tasks/{task_id}").json["assignments"][0]["active"] is False


def test_after_a_failure_the_same_key_accepts_a_different_body(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    key = key_header()
    bad = client.post(
        "/tasks", {"pipeline_id": str(uuid.uuid4()), "title": "t", "description": "d"}, headers=key
    )
    assert (bad.status, bad.error_code) == (404, "pipeline_not_found")
    again = client.post(
        "/tasks", {"pipeline_id": str(uuid.uuid4()), "title": "t", "description": "d"}, headers=key
    )
    assert again.error_code == "pipeline_not_found"
    good = new_task(client, pipeline_id, headers=key)
    assert good.status == 201, good.body
    assert new_task(client, pipeline_id, headers=key).json == good.json
    assert task_count(client, pipeline_id) == 1


def test_a_400_is_not_stored_either(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    key = key_header()
    assert client.post("/tasks/bulk", {"tasks": []}, headers=key).error_code == "invalid_request"
    r = client.post(
        "/tasks/bulk",
        {"tasks": [{"pipeline_id": pipeline_id, "title": "t", "description": "d"}]},
        headers=key,
    )
    assert r.status == 201, r.body


def test_get_requests_ignore_the_key(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    key = key_header()
    before = client.get(f"/tasks?pipeline_id={pipeline_id}", headers=key)
    assert new_task(client, pipeline_id).status == 201
    after = client.get(f"/tasks?pipeline_id={pipeline_id}", headers=key)
    assert len(before.json["items"]) == 0
    assert len(after.json["items"]) == 1


# --- idempotent claims and lease routes --------------------------------------------------------


def claim(client: Client, role: str, headers: dict[str, str] | None = None) -> Response:
    return client.post("/leases/claim", {"agent_id": "agent", "agent_role": role}, headers=headers)


def test_a_replayed_claim_returns_the_same_lease_with_a_rotated_token(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_ids = [new_task(client, pipeline_id).json["id"] for _ in range(2)]
    key = key_header()
    first = claim(client, coder, key)
    assert first.status == 200, first.body
    replay = claim(client, coder, key)
    assert replay.status == 200, replay.body
    a, b = first.json, replay.json
    assert (b["lease_id"], b["run"], b["task"], b["expires_at_ms"]) == (
        a["lease_id"],
        a["run"],
        a["task"],
        a["expires_at_ms"],
    )
    assert b["lease_token"] != a["lease_token"]
    assert len(b["lease_token"]) == 64 and int(b["lease_token"], 16) >= 0

    old = client.post(f"/leases/{a['lease_id']}/heartbeat", token=a["lease_token"])
    assert (old.status, old.error_code) == (401, "unauthorized")
    new = client.post(f"/leases/{a['lease_id']}/heartbeat", token=b["lease_token"])
    assert new.status == 200, new.body
    assert new.json["expires_at_ms"] >= a["expires_at_ms"] - 1000

    # The claim ran once: the other task is still free, and the first one has one run.
    other = claim(client, coder)
    assert other.status == 200
    assert {a["task"]["id"], other.json["task"]["id"]} == set(task_ids)
    assert client.get(f"/tasks/{a['task']['id']}").json["latest_run"]["attempt"] == 1


def test_a_replayed_transition_needs_the_same_lease_token(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = new_task(client, pipeline_id).json["id"]
    lease = claim(client, coder).json
    run_id, token = lease["run"]["id"], lease["lease_token"]
    key = key_header()
    body = {"trigger": "submit"}
    first = client.post(f"/runs/{run_id}/transition", body, headers=key, token=token)
    assert first.status == 200, first.body
    assert first.json == {"previous_stage": "todo", "new_stage": "review", "trigger": "submit"}

    stranger = client.post(f"/runs/{run_id}/transition", body, headers=key, token=random_token())
    assert (stranger.status, stranger.error_code) == (401, "unauthorized")
    anonymous = client.post(f"/runs/{run_id}/transition", body, headers=key)
    assert (anonymous.status, anonymous.error_code) == (401, "unauthorized")

    replay = client.post(f"/runs/{run_id}/transition", body, headers=key, token=token)
    assert (replay.status, replay.body) == (first.status, first.body)
    details = client.get(f"/tasks/{task_id}").json
    assert (details["stage"], details["task_version"]) == ("review", 2)

    # Without the key the lease is gone: the same request is now a plain 404.
    plain = client.post(f"/runs/{run_id}/transition", body, token=token)
    assert (plain.status, plain.error_code) == (404, "not_found")


def test_a_replayed_event_append_returns_the_same_event_id(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    new_task(client, pipeline_id)
    lease = claim(client, coder).json
    run_id, token = lease["run"]["id"], lease["lease_token"]
    key = key_header()
    first = client.post(f"/runs/{run_id}/events", {"kind": "note"}, headers=key, token=token)
    assert first.status == 201, first.body
    replay = client.post(f"/runs/{run_id}/events", {"kind": "note"}, headers=key, token=token)
    assert replay.json == first.json
    events = client.get(f"/runs/{run_id}/events").json["items"]
    assert [e["kind"] for e in events] == ["note"]
    conflict = client.post(f"/runs/{run_id}/events", {"kind": "other"}, headers=key, token=token)
    assert (conflict.status, conflict.error_code) == (409, "idempotency_conflict")
