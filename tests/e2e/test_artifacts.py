"""Artifacts: create, unknown references, list with filters and lossless pagination (§12.9-10)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import ID_SHAPE, create_pipeline, pipeline_with_roles
from tests.server import Client

MISSING = "00000000-0000-4000-8000-000000000000"
FIELDS = ["id", "task_id", "run_id", "created_at_ms", "kind", "uri", "sha256", "size_bytes", "meta"]


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def new_task(client: Client, pipeline_id: str | None = None) -> str:
    r = client.post(
        "/tasks",
        {"pipeline_id": pipeline_id or create_pipeline(client), "title": "t", "description": "d"},
    )
    assert r.status == 201, r.body
    return str(r.json["id"])


def new_run(client: Client) -> tuple[str, str]:
    """A task with a running run; returns (task_id, run_id)."""
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = new_task(client, pipeline_id)
    r = client.post("/leases/claim", {"agent_id": "a", "agent_role": coder})
    assert r.status == 200, r.body
    return task_id, str(r.json["run"]["id"])


def new_artifact(client: Client, **fields: Any) -> str:
    r = client.post("/artifacts", {"kind": "log", "uri": "file:///tmp/x", **fields})
    assert r.status == 201, r.body
    return str(r.json["id"])


def listed(client: Client, query: str) -> list[dict[str, Any]]:
    r = client.get(f"/artifacts?{query}")
    assert r.status == 200, r.body
    return list(r.json["items"])


def test_create_returns_201_with_an_id_and_lists_defaults(client: Client) -> None:
    task_id = new_task(client)
    r = client.post("/artifacts", {"task_id": task_id, "kind": "diff", "uri": "s3://b/k"})
    assert r.status == 201
    assert list(r.json) == ["id"] and ID_SHAPE.match(r.json["id"])
    (item,) = listed(client, f"task_id={task_id}")
    assert list(item) == FIELDS
    assert item["id"] == r.json["id"]
    assert (item["task_id"], item["run_id"]) == (task_id, None)
    assert (item["kind"], item["uri"]) == ("diff", "s3://b/k")
    assert (item["sha256"], item["size_bytes"], item["meta"]) == (None, None, {})
    assert item["created_at_ms"] > 1_600_000_000_000


def test_every_field_is_stored_as_given(client: Client) -> None:
    task_id, run_id = new_run(client)
    artifact_id = new_artifact(
        client,
        task_id=task_id,
        run_id=run_id,
        kind="",
        uri="not a uri",
        sha256="not-hex",
        size_bytes=12345,
    )
    (item,) = listed(client, f"run_id={run_id}")
    assert item["id"] == artifact_id
    assert (item["task_id"], item["run_id"]) == (task_id, run_id)
    assert (item["kind"], item["uri"]) == ("", "not a uri")
    assert (item["sha256"], item["size_bytes"]) == ("not-hex", 12345)


def test_an_artifact_without_task_or_run_is_accepted(client: Client) -> None:
    r = client.post(
        "/artifacts", {"kind": "note", "uri": "mem://x", "task_id": None, "run_id": None}
    )
    assert r.status == 201, r.body


def test_the_run_need_not_belong_to_the_task(client: Client) -> None:
    other_task = new_task(client)
    _, run_id = new_run(client)
    new_artifact(client, task_id=other_task, run_id=run_id)
    assert [a["task_id"] for a in listed(client, f"run_id={run_id}")] == [other_task]


@pytest.mark.parametrize(
    "meta",
    [{"z": 1, "a": {"nested": [True, None]}}, [1, 2], "text", 3.25, False],
    ids=["object", "array", "string", "number", "bool"],
)
def test_meta_of_any_json_type_is_echoed_compactly(client: Client, meta: Any) -> None:
    task_id = new_task(client)
    pretty = json.dumps(meta, indent=3)
    raw = f'{{"task_id": "{task_id}", "kind": "k", "uri": "u",\n "meta": {pretty}}}'
    r = client.post("/artifacts", body=raw, headers={"Content-Type": "application/json"})
    assert r.status == 201, r.body
    got = client.get(f"/artifacts?task_id={task_id}")
    assert got.json["items"][0]["meta"] == meta
    assert f'"meta":{compact(meta)}'.encode() in got.body


def test_null_meta_is_an_empty_object(client: Client) -> None:
    task_id = new_task(client)
    new_artifact(client, task_id=task_id, meta=None)
    assert listed(client, f"task_id={task_id}")[0]["meta"] == {}


def test_unknown_task_id_is_404_task_not_found_and_stores_nothing(client: Client) -> None:
    r = client.post("/artifacts", {"task_id": MISSING, "kind": "log", "uri": "u"})
    assert r.status == 404
    assert r.error_code == "task_not_found"
    assert listed(client, f"task_id={MISSING}") == []


def test_unknown_run_id_is_404_not_found_and_stores_nothing(client: Client) -> None:
    task_id = new_task(client)
    r = client.post(
        "/artifacts", {"task_id": task_id, "run_id": MISSING, "kind": "log", "uri": "u"}
    )
    assert r.status == 404
    assert r.error_code == "not_found"
    assert listed(client, f"task_id={task_id}") == []


@pytest.mark.parametrize(
    "body",
    [
        {"uri": "u"},
        {"kind": "k"},
        {"kind": 1, "uri": "u"},
        {"kind": "k", "uri": "u", "size_bytes": "big"},
        {"kind": "k", "uri": "u", "task_id": 5},
    ],
    ids=["no-kind", "no-uri", "kind-number", "size-string", "task-number"],
)
def test_malformed_bodies_are_400_invalid_json(client: Client, body: Any) -> None:
    r = client.post("/artifacts", body)
    assert r.status == 400
    assert r.error_code == "invalid_json"


def test_list_filters_by_task_and_run_combined(client: Client) -> None:
    task_id, run_id = new_run(client)
    with_run = new_artifact(client, task_id=task_id, run_id=run_id)
    task_only = new_artifact(client, task_id=task_id)
    other = new_artifact(client, run_id=run_id)
    by_task, by_run = listed(client, f"task_id={task_id}"), listed(client, f"run_id={run_id}")
    assert sorted(a["id"] for a in by_task) == sorted([with_run, task_only])
    assert sorted(a["id"] for a in by_run) == sorted([with_run, other])
    for items in (by_task, by_run):
        assert items == sorted(items, key=lambda a: (a["created_at_ms"], a["id"]))
    both = listed(client, f"task_id={task_id}&run_id={run_id}")
    assert [a["id"] for a in both] == [with_run]
    assert listed(client, f"task_id={MISSING}&run_id={run_id}") == []


def test_paging_returns_every_artifact_exactly_once_in_creation_order(client: Client) -> None:
    task_id = new_task(client)
    ids = [new_artifact(client, task_id=task_id, kind=f"k{i}") for i in range(11)]
    seen: list[dict[str, Any]] = []
    cursor, pages = None, 0
    while True:
        url = f"/artifacts?task_id={task_id}&limit=3" + (f"&cursor={cursor}" if cursor else "")
        page = client.get(url).json
        pages += 1
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
        last = page["items"][-1]
        assert cursor == f"{last['created_at_ms']}:{last['id']}"
    assert pages == 4
    assert sorted(a["id"] for a in seen) == sorted(ids)
    assert len(seen) == 11
    assert [a["id"] for a in seen] == [
        a["id"] for a in sorted(seen, key=lambda a: (a["created_at_ms"], a["id"]))
    ]


def test_the_default_page_size_is_100(client: Client) -> None:
    task_id = new_task(client)
    for _ in range(101):
        new_artifact(client, task_id=task_id)
    first = client.get(f"/artifacts?task_id={task_id}&limit=zz").json
    assert len(first["items"]) == 100
    rest = client.get(f"/artifacts?task_id={task_id}&cursor={first['next_cursor']}").json
    assert len(rest["items"]) == 1 and rest["next_cursor"] is None


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("cursor=nocolon", "invalid_cursor"),
        ("cursor=x:y", "invalid_cursor"),
        ("limit=0&cursor=bad", "invalid_limit"),
    ],
)
def test_bad_limits_and_cursors_are_rejected(client: Client, query: str, code: str) -> None:
    r = client.get(f"/artifacts?{query}")
    assert r.status == 400
    assert r.error_code == code


def test_a_percent_encoded_artifact_cursor_works(client: Client) -> None:
    task_id = new_task(client)
    for _ in range(3):
        new_artifact(client, task_id=task_id)
    cursor = client.get(f"/artifacts?task_id={task_id}&limit=1").json["next_cursor"]
    plain = client.get(f"/artifacts?task_id={task_id}&cursor={cursor}")
    encoded = client.get(f"/artifacts?task_id={task_id}&cursor={cursor.replace(':', '%3A')}")
    assert encoded.status == 200, encoded.body
    assert encoded.json == plain.json
    assert len(encoded.json["items"]) == 2
