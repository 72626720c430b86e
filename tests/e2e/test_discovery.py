"""Discovery and routing: /health, the OpenAPI document, unknown paths and wrong methods."""

from __future__ import annotations

import re

import pytest
from openapi_spec_validator import validate

from tests.conftest import create_pipeline, pipeline_with_roles, unique
from tests.server import PIPELINE, Client

# Contract §6 rows 1-27 without the OTLP rows 4-5 (the store rows 28-33 land later).
ROUTES = [
    ("GET", "/health"),
    ("GET", "/openapi.json"),
    ("GET", "/.well-known/openapi.json"),
    ("POST", "/pipelines"),
    ("GET", "/pipelines"),
    ("GET", "/pipelines/{id}"),
    ("POST", "/tasks"),
    ("POST", "/tasks/bulk"),
    ("GET", "/tasks"),
    ("GET", "/tasks/{id}"),
    ("GET", "/tasks/{id}/run-state"),
    ("POST", "/tasks/{id}/dependencies"),
    ("GET", "/tasks/{id}/dependencies"),
    ("POST", "/tasks/{id}/assignments"),
    ("GET", "/tasks/{id}/assignments"),
    ("DELETE", "/tasks/{id}/assignments/{agent_id}"),
    ("POST", "/leases/claim"),
    ("POST", "/leases/{id}/heartbeat"),
    ("POST", "/runs/{id}/events"),
    ("GET", "/runs/{id}/events"),
    ("POST", "/runs/{id}/transition"),
    ("POST", "/runs/{id}/fail"),
    ("POST", "/artifacts"),
    ("GET", "/artifacts"),
    ("GET", "/ops/queue"),
]


def template(path: str) -> str:
    """A path with its parameter names erased, so `{task_id}` and `{id}` compare equal."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def stage_pipeline(client: Client, initial: str) -> str:
    """A pipeline whose initial stage has a name no other test uses."""
    definition = {
        "initial": initial,
        "states": {initial: {}, "done": {"terminal": True}},
        "transitions": [{"from": initial, "to": "done", "trigger": "finish"}],
    }
    return create_pipeline(client, definition)


def new_task(client: Client, pipeline_id: str) -> str:
    r = client.post("/tasks", {"pipeline_id": pipeline_id, "title": "t", "description": "d"})
    assert r.status == 201, r.body
    return str(r.json["id"])


# --- /health -----------------------------------------------------------------------------------


def test_health_reports_status_version_counts_leases_and_core(client: Client) -> None:
    r = client.get("/health")
    assert r.status == 200
    assert r.headers["content-type"] == "application/json"
    doc = r.json
    assert list(doc)[:4] == ["status", "version", "tasks_by_stage", "active_leases"]
    assert doc["status"] == "ok"
    assert isinstance(doc["version"], str) and doc["version"]
    assert isinstance(doc["active_leases"], int) and doc["active_leases"] >= 0
    assert isinstance(doc["core"], str) and doc["core"]
    for entry in doc["tasks_by_stage"]:
        assert set(entry) == {"stage", "count"}
        assert entry["count"] > 0


def test_health_counts_tasks_per_stage_name_merged_across_pipelines(client: Client) -> None:
    stage = unique("stage")
    first, second = stage_pipeline(client, stage), stage_pipeline(client, stage)
    for pipeline_id in (first, first, second):
        new_task(client, pipeline_id)
    counts = {e["stage"]: e["count"] for e in client.get("/health").json["tasks_by_stage"]}
    assert counts[stage] == 3


def test_health_lists_stages_sorted_by_name(client: Client) -> None:
    for name in ("zz", "AA", "mm"):
        new_task(client, stage_pipeline(client, unique(name)))
    stages = [e["stage"] for e in client.get("/health").json["tasks_by_stage"]]
    assert len(stages) >= 3
    assert stages == sorted(stages, key=lambda s: s.encode())
    assert len(set(stages)) == len(stages)


def test_health_on_an_empty_database_has_no_stages_and_no_leases(fresh_client: Client) -> None:
    doc = fresh_client.get("/health").json
    assert doc["tasks_by_stage"] == []
    assert doc["active_leases"] == 0


def test_health_counts_live_leases_and_moves_tasks_between_stages(fresh_client: Client) -> None:
    client = fresh_client
    pipeline_id, coder, _ = pipeline_with_roles(client)
    for _ in range(3):
        new_task(client, pipeline_id)
    claim = client.post("/leases/claim", {"agent_id": "a1", "agent_role": coder})
    assert claim.status == 200, claim.body
    doc = client.get("/health").json
    assert doc["active_leases"] == 1
    assert doc["tasks_by_stage"] == [{"stage": "todo", "count": 3}]

    moved = client.post(
        f"/runs/{claim.json['run']['id']}/transition",
        {"trigger": "submit"},
        token=claim.json["lease_token"],
    )
    assert moved.status == 200, moved.body
    doc = client.get("/health").json
    assert doc["active_leases"] == 0
    assert doc["tasks_by_stage"] == [{"stage": "review", "count": 1}, {"stage": "todo", "count": 2}]


# --- OpenAPI -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/openapi.json", "/.well-known/openapi.json"])
def test_openapi_document_is_version_3_1_0_with_info(client: Client, path: str) -> None:
    r = client.get(path)
    assert r.status == 200
    assert r.headers["content-type"] == "application/json"
    doc = r.json
    assert doc["openapi"] == "3.1.0"
    assert doc["info"]["version"] == client.get("/health").json["version"]
    assert isinstance(doc["paths"], dict)


def test_openapi_document_is_a_valid_openapi_3_1_document(client: Client) -> None:
    validate(client.get("/openapi.json").json)


def test_both_openapi_paths_serve_the_same_document(client: Client) -> None:
    assert client.get("/openapi.json").json == client.get("/.well-known/openapi.json").json


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_openapi_describes_every_route(client: Client, method: str, path: str) -> None:
    paths = {template(p): ops for p, ops in client.get("/openapi.json").json["paths"].items()}
    assert template(path) in paths, sorted(paths)
    assert method.lower() in paths[template(path)]


def test_openapi_applies_bearer_security_to_lease_routes(client: Client) -> None:
    doc = client.get("/openapi.json").json
    schemes = doc["components"]["securitySchemes"]
    bearer = [name for name, s in schemes.items() if s.get("type") == "http"]
    assert bearer, schemes
    paths = {template(p): ops for p, ops in doc["paths"].items()}
    for path in ("/leases/{}/heartbeat", "/runs/{}/events", "/runs/{}/transition"):
        security = paths[path]["post"].get("security") or doc.get("security")
        assert security, path
        assert any(set(req) & set(bearer) for req in security), (path, security)


def test_openapi_security_lets_admin_routes_go_without_a_token_and_lease_routes_not(
    client: Client,
) -> None:
    doc = client.get("/openapi.json").json
    assert doc["components"]["securitySchemes"] == {
        "bearerAuth": {
            "type": "http",
            "scheme": "bearer",
            "description": doc["components"]["securitySchemes"]["bearerAuth"]["description"],
        }
    }
    # The admin routes' security is the document's: a token, or none ({}).
    assert doc["security"] == [{"bearerAuth": []}, {}]
    lease_paths = ("/leases/{}/heartbeat", "/runs/{}/")
    seen = set()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            security = op.get("security", doc["security"])
            if path in ("/health", "/openapi.json", "/.well-known/openapi.json"):
                kind, expected = "none", []
            elif template(path).startswith(lease_paths) and method != "get":
                kind, expected = "lease", [{"bearerAuth": []}]
            else:
                kind, expected = "admin", [{"bearerAuth": []}, {}]
            assert security == expected, (method, path, security)
            seen.add(kind)
    assert seen == {"none", "lease", "admin"}


def test_openapi_types_the_pipeline_definition(client: Client) -> None:
    schemas = client.get("/openapi.json").json["components"]["schemas"]
    ref = {"$ref": "#/components/schemas/PipelineDefinition"}
    assert schemas["CreatePipeline"]["properties"]["definition"] == ref
    assert schemas["Pipeline"]["properties"]["definition"] == ref
    definition = schemas["PipelineDefinition"]
    assert set(definition["required"]) == {"initial", "states", "transitions"}
    states = definition["properties"]["states"]
    assert states["type"] == "object"
    assert states["additionalProperties"] == {"$ref": "#/components/schemas/StateDefinition"}
    state = schemas["StateDefinition"]["properties"]
    assert {"agent_role", "terminal", "lease_ttl_ms", "retry_delay_ms", "retry_backoff"} <= set(
        state
    )
    assert {"retry_max_delay_ms", "retry_jitter", "max_concurrency"} <= set(state)
    transition = schemas["TransitionDefinition"]
    assert set(transition["required"]) == {"from", "to", "trigger"}
    assert {"instructions", "required_gates"} <= set(transition["properties"])


def test_the_dashboard_is_not_part_of_the_documented_api(client: Client) -> None:
    paths = client.get("/openapi.json").json["paths"]
    assert client.get("/ui/").status == 200  # served, but not documented
    assert [p for p in paths if p == "/" or p == "/ui" or p.startswith("/ui/")] == []
    assert {"/events/stream", "/metrics", "/ops/stages", "/ops/retrying"} <= set(paths)
    assert {"/tasks/{id}/runs", "/namespaces"} <= set(paths)


# --- unknown paths and methods -----------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/nope", "/tasks/x/y/z/w", "/pipelines/x/extra", "/health/extra", "/store"]
)
def test_unknown_paths_are_404_not_found(client: Client, path: str) -> None:
    r = client.get(path)
    assert r.status == 404
    assert r.error_code == "not_found"


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PATCH", "/tasks", "GET, HEAD, POST"),
        ("PUT", "/tasks", "GET, HEAD, POST"),
        ("DELETE", "/pipelines", "GET, HEAD, POST"),
        ("POST", "/health", "GET, HEAD"),
        ("GET", "/leases/claim", "POST"),
        ("OPTIONS", "/tasks", "GET, HEAD, POST"),
        ("DELETE", "/tasks/x", "GET, HEAD"),
        ("POST", "/store/ns/key", "DELETE, GET, HEAD, PUT"),
        ("get", "/health", "GET, HEAD"),
        ("post", "/pipelines", "GET, HEAD, POST"),
        ("Get", "/tasks", "GET, HEAD, POST"),
    ],
)
def test_a_wrong_method_on_a_known_path_is_405_with_allow(
    client: Client, method: str, path: str, allow: str
) -> None:
    r = client.request(method, path)
    assert r.status == 405
    assert r.error_code == "method_not_allowed"
    assert r.headers["allow"] == allow
    assert method in r.json["error"]["message"]


def test_a_wrong_method_on_an_unknown_path_stays_404(client: Client) -> None:
    r = client.request("PATCH", "/nope")
    assert (r.status, r.error_code) == (404, "not_found")
    assert "allow" not in r.headers


@pytest.mark.parametrize("path", ["/health", "/tasks", "/pipelines", "/openapi.json", "/ui/"])
@pytest.mark.process
def test_head_answers_like_get_without_a_body(client: Client, path: str) -> None:
    get = client.get(path)
    head = client.request("HEAD", path)
    assert (head.status, head.body) == (get.status, b"")
    assert head.headers["content-type"] == get.headers["content-type"]
    if path != "/health":  # /health's body carries counts that may move between the two
        assert head.headers["content-length"] == get.headers["content-length"]
    assert client.get("/health").status == 200  # and the connection is still usable


def test_head_of_a_missing_task_is_the_same_404_without_a_body(client: Client) -> None:
    r = client.request("HEAD", f"/tasks/{unique('missing')}")
    assert (r.status, r.body) == (404, b"")


def test_get_tasks_bulk_is_a_lookup_of_a_task_named_bulk(client: Client) -> None:
    r = client.get("/tasks/bulk")
    assert r.status == 404
    assert r.error_code == "task_not_found"


# --- empty path segments -----------------------------------------------------------------------


def test_doubled_and_trailing_slashes_route_like_the_plain_path(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    task_id = new_task(client, pipeline_id)

    plain = client.get(f"/tasks?pipeline_id={pipeline_id}")
    doubled = client.get(f"//tasks/?pipeline_id={pipeline_id}")
    assert doubled.status == 200
    assert doubled.json == plain.json
    assert [t["id"] for t in doubled.json["items"]] == [task_id]

    assert client.get(f"//pipelines//{pipeline_id}/").json["definition"] == PIPELINE
    assert client.get(f"/tasks///{task_id}//").json["id"] == task_id


def test_posting_to_a_doubled_slash_path_creates(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    r = client.post("//tasks//", {"pipeline_id": pipeline_id, "title": "t", "description": "d"})
    assert r.status == 201, r.body
    assert client.get(f"/tasks/{r.json['id']}").json["pipeline_id"] == pipeline_id
