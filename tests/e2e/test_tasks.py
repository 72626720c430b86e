"""Tasks: create, bulk, list and pagination, details, run-state, dependencies and assignments
(contract §4, §5, §12)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.conftest import ID_SHAPE, create_pipeline, pipeline_with_roles, unique
from tests.server import TASK_FIELDS, Client, Response

CURSOR = re.compile(r"^-?\d+:.+$")
MISSING = "00000000-0000-4000-8000-000000000000"
# A pipeline whose initial stage is terminal: its tasks count as resolved dependencies at once.
FINISHED = {
    "initial": "done",
    "states": {"done": {"terminal": True}, "open": {}},
    "transitions": [{"from": "open", "to": "done", "trigger": "close"}],
}


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def task_body(pipeline_id: str, **extra: Any) -> dict[str, Any]:
    return {"pipeline_id": pipeline_id, "title": "title", "description": "description", **extra}


def new_task(client: Client, pipeline_id: str, **extra: Any) -> str:
    r = client.post("/tasks", task_body(pipeline_id, **extra))
    assert r.status == 201, r.body
    return str(r.json["id"])


def task_ids(client: Client, pipeline_id: str) -> list[str]:
    r = client.get(f"/tasks?pipeline_id={pipeline_id}&limit=1000")
    assert r.status == 200, r.body
    return [t["id"] for t in r.json["items"]]


def all_pages(client: Client, query: str, limit: int) -> tuple[list[dict[str, Any]], int]:
    """Follow next_cursor to the end; returns the items and the number of pages fetched."""
    items: list[dict[str, Any]] = []
    cursor, pages = None, 0
    while True:
        url = f"/tasks?{query}&limit={limit}" + (f"&cursor={cursor}" if cursor else "")
        r = client.get(url)
        assert r.status == 200, r.body
        pages += 1
        assert len(r.json["items"]) <= limit
        items += r.json["items"]
        cursor = r.json["next_cursor"]
        if cursor is None:
            return items, pages
        assert CURSOR.match(cursor), cursor
        assert pages < 100


def claim(client: Client, role: str, agent: str = "agent-1") -> Response:
    r = client.post("/leases/claim", {"agent_id": agent, "agent_role": role})
    assert r.status == 200, r.body
    return r


# --- create ------------------------------------------------------------------------------------


def test_create_returns_an_id_and_the_task_starts_with_defaults(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    r = client.post("/tasks", task_body(pipeline_id))
    assert r.status == 201
    assert list(r.json) == ["id"] and ID_SHAPE.match(r.json["id"])
    task = client.get(f"/tasks/{r.json['id']}").json
    assert list(task)[: len(TASK_FIELDS)] == TASK_FIELDS
    assert task["pipeline_id"] == pipeline_id
    assert task["stage"] == "todo"
    assert (task["title"], task["description"]) == ("title", "description")
    assert task["priority"] == 0
    assert task["metadata"] == {}
    assert task["task_version"] == 1
    assert task["next_eligible_at_ms"] == 0
    assert task["retry_delay_ms"] == 0
    assert task["max_attempts"] is None
    assert task["dead_letter_stage"] is None
    assert task["dead_letter_reason"] is None
    assert task["created_at_ms"] == task["updated_at_ms"] > 1_600_000_000_000


def test_explicit_nulls_mean_defaults(client: Client) -> None:
    task_id = new_task(
        client,
        create_pipeline(client),
        priority=None,
        metadata=None,
        retry_policy=None,
        dependencies=None,
        assigned_agent_id=None,
    )
    task = client.get(f"/tasks/{task_id}").json
    assert task["priority"] == 0
    assert task["metadata"] == {}
    assert task["assignments"] == [] and task["dependencies"] == []


@pytest.mark.parametrize("priority", [7, -3, 0, 9223372036854775807, -9223372036854775808])
def test_priority_is_stored_as_given(client: Client, priority: int) -> None:
    task_id = new_task(client, create_pipeline(client), priority=priority)
    assert client.get(f"/tasks/{task_id}").json["priority"] == priority


def test_empty_strings_are_accepted_for_title_and_description(client: Client) -> None:
    r = client.post(
        "/tasks", {"pipeline_id": create_pipeline(client), "title": "", "description": ""}
    )
    assert r.status == 201, r.body
    task = client.get(f"/tasks/{r.json['id']}").json
    assert (task["title"], task["description"]) == ("", "")


@pytest.mark.parametrize(
    "metadata",
    [{"b": 1, "a": [1, 2, {"c": None}]}, [1, "two", 3.5], "just text", 42, True, {}],
    ids=["object", "array", "string", "number", "bool", "empty"],
)
def test_metadata_of_any_json_type_is_echoed_compactly(client: Client, metadata: Any) -> None:
    pipeline_id = create_pipeline(client)
    pretty = json.dumps(metadata, indent=2)
    raw = f'{{"pipeline_id": "{pipeline_id}", "title": "t", "description": "d",\n'
    raw += f'  "metadata":  {pretty} }}'
    r = client.post("/tasks", body=raw, headers={"Content-Type": "application/json"})
    assert r.status == 201, r.body
    got = client.get(f"/tasks/{r.json['id']}")
    assert got.json["metadata"] == metadata
    assert f'"metadata":{compact(metadata)}'.encode() in got.body


def test_retry_policy_fields_are_stored(client: Client) -> None:
    policy = {"max_attempts": 3, "retry_delay_ms": 1500, "dead_letter_stage": "dead"}
    task = client.get(f"/tasks/{new_task(client, create_pipeline(client), retry_policy=policy)}")
    assert task.json["max_attempts"] == 3
    assert task.json["retry_delay_ms"] == 1500
    assert task.json["dead_letter_stage"] == "dead"


@pytest.mark.parametrize(
    ("policy", "named"),
    [
        ({"max_attempt": 3}, "max_attempt"),
        ({"max_attempts": 3, "retry_delay": 1000}, "retry_delay"),
        ({"retry_delay_ms": 10, "backoff": 2}, "backoff"),
        ({"dead_letter": "dead"}, "dead_letter"),
        ({"max_attempts": -1}, "max_attempts"),
        ({"max_attempts": -9223372036854775808}, "max_attempts"),
        ({"retry_delay_ms": -5}, "retry_delay_ms"),
        ({"retry_delay_ms": 31_536_000_001}, "retry_delay_ms"),
        ({"retry_delay_ms": 9223372036854775807}, "retry_delay_ms"),
        ({"dead_letter_stage": "no-such-stage"}, "no-such-stage"),
        ({"max_attempts": 1, "dead_letter_stage": ""}, "dead_letter_stage"),
    ],
    ids=str,
)
def test_a_bad_retry_policy_is_400_naming_the_key_and_creates_nothing(
    client: Client, policy: dict[str, Any], named: str
) -> None:
    pipeline_id = create_pipeline(client)
    r = client.post("/tasks", task_body(pipeline_id, retry_policy=policy))
    assert r.status == 400, (policy, r.body)
    assert r.error_code == "invalid_retry_policy"
    message = r.json["error"]["message"]
    assert named in message and "retry_policy" in message, message
    assert task_ids(client, pipeline_id) == []


def test_a_bad_retry_policy_in_bulk_names_the_element_and_creates_nothing(
    client: Client,
) -> None:
    pipeline_id = create_pipeline(client)
    for policy, named in (({"max_attempt": 2}, "max_attempt"), ({"dead_letter_stage": "x"}, "x")):
        tasks = [task_body(pipeline_id), task_body(pipeline_id, retry_policy=policy)]
        r = client.post("/tasks/bulk", {"tasks": tasks})
        assert r.status == 400, r.body
        assert r.error_code == "invalid_retry_policy"
        assert "$.tasks[1].retry_policy" in r.json["error"]["message"], r.json
        assert named in r.json["error"]["message"]
    assert task_ids(client, pipeline_id) == []


@pytest.mark.parametrize(
    "policy",
    [
        {},
        {"max_attempts": 0},
        {"max_attempts": 1, "retry_delay_ms": 0, "dead_letter_stage": "dead"},
        {"max_attempts": 9223372036854775807},
        {"retry_delay_ms": 31_536_000_000},
        {"dead_letter_stage": "todo"},
        {"max_attempts": None, "retry_delay_ms": None, "dead_letter_stage": None},
        {"max_attempts": "3", "retry_delay_ms": 1000.0},
    ],
    ids=str,
)
def test_a_valid_retry_policy_is_accepted(client: Client, policy: dict[str, Any]) -> None:
    new_task(client, create_pipeline(client), retry_policy=policy)


def test_partial_retry_policy_keeps_other_defaults(client: Client) -> None:
    task_id = new_task(
        client, create_pipeline(client), retry_policy={"max_attempts": None, "retry_delay_ms": 10}
    )
    task = client.get(f"/tasks/{task_id}").json
    assert (task["max_attempts"], task["retry_delay_ms"], task["dead_letter_stage"]) == (
        None,
        10,
        None,
    )


def test_assigned_agent_id_creates_an_active_assignment(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client), assigned_agent_id="ann", assigned_by="boss")
    (assignment,) = client.get(f"/tasks/{task_id}").json["assignments"]
    assert list(assignment) == [
        "agent_id",
        "assigned_by",
        "active",
        "created_at_ms",
        "updated_at_ms",
    ]
    assert (assignment["agent_id"], assignment["assigned_by"], assignment["active"]) == (
        "ann",
        "boss",
        True,
    )


def test_assigned_by_without_an_agent_assigns_nobody(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client), assigned_by="boss")
    assert client.get(f"/tasks/{task_id}").json["assignments"] == []


def test_unknown_pipeline_is_404_pipeline_not_found(client: Client) -> None:
    r = client.post("/tasks", task_body(MISSING))
    assert r.status == 404
    assert r.error_code == "pipeline_not_found"


# --- dependencies on create --------------------------------------------------------------------


def test_dependencies_given_on_create_are_listed_in_order(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    done_id = new_task(client, create_pipeline(client, FINISHED))
    open_id = new_task(client, pipeline_id)
    task_id = new_task(client, pipeline_id, dependencies=[open_id, done_id])
    assert client.get(f"/tasks/{task_id}").json["dependencies"] == [
        {"depends_on_task_id": open_id, "resolved": False},
        {"depends_on_task_id": done_id, "resolved": True},
    ]


def test_unknown_dependency_on_create_is_404_task_not_found_and_creates_nothing(
    client: Client,
) -> None:
    pipeline_id = create_pipeline(client)
    upstream = new_task(client, pipeline_id)
    r = client.post("/tasks", task_body(pipeline_id, dependencies=[upstream, MISSING]))
    assert r.status == 404
    assert r.error_code == "task_not_found"
    assert task_ids(client, pipeline_id) == [upstream]


def test_dependency_listed_twice_is_409_duplicate_dependency_and_creates_nothing(
    client: Client,
) -> None:
    pipeline_id = create_pipeline(client)
    upstream = new_task(client, pipeline_id)
    r = client.post(
        "/tasks", task_body(pipeline_id, dependencies=[upstream, upstream], assigned_agent_id="ann")
    )
    assert r.status == 409
    assert r.error_code == "duplicate_dependency"
    assert task_ids(client, pipeline_id) == [upstream]


def test_dependencies_may_cross_pipelines(client: Client) -> None:
    other = new_task(client, create_pipeline(client))
    task_id = new_task(client, create_pipeline(client), dependencies=[other])
    deps = client.get(f"/tasks/{task_id}/dependencies").json
    assert deps == [{"depends_on_task_id": other, "resolved": False}]


# --- bulk --------------------------------------------------------------------------------------


def test_bulk_returns_ids_in_input_order(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    titles = [f"t{i}" for i in range(5)]
    r = client.post(
        "/tasks/bulk",
        {
            "tasks": [
                {"pipeline_id": pipeline_id, "title": t, "description": "d", "priority": i}
                for i, t in enumerate(titles)
            ]
        },
    )
    assert r.status == 201, r.body
    assert list(r.json) == ["ids"]
    ids = r.json["ids"]
    assert len(ids) == len(set(ids)) == 5
    assert [client.get(f"/tasks/{i}").json["title"] for i in ids] == titles
    assert sorted(task_ids(client, pipeline_id)) == sorted(ids)


def test_bulk_elements_follow_single_create_rules(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    upstream = new_task(client, pipeline_id)
    r = client.post(
        "/tasks/bulk",
        {
            "tasks": [
                task_body(
                    pipeline_id, metadata=[1], dependencies=[upstream], assigned_agent_id="bo"
                ),
                task_body(pipeline_id, retry_policy={"max_attempts": 2}),
            ]
        },
    )
    assert r.status == 201, r.body
    first, second = (client.get(f"/tasks/{i}").json for i in r.json["ids"])
    assert first["metadata"] == [1]
    assert first["dependencies"] == [{"depends_on_task_id": upstream, "resolved": False}]
    assert first["assignments"][0]["agent_id"] == "bo"
    assert second["max_attempts"] == 2


@pytest.mark.parametrize("bad", ["pipeline", "dependency", "duplicate"])
def test_bulk_is_one_transaction_so_a_bad_element_creates_nothing(client: Client, bad: str) -> None:
    pipeline_id = create_pipeline(client)
    upstream = new_task(client, pipeline_id)
    element = {
        "pipeline": task_body(MISSING),
        "dependency": task_body(pipeline_id, dependencies=[MISSING]),
        "duplicate": task_body(pipeline_id, dependencies=[upstream, upstream]),
    }[bad]
    r = client.post(
        "/tasks/bulk",
        {
            "tasks": [
                task_body(pipeline_id),
                task_body(pipeline_id),
                element,
                task_body(pipeline_id),
            ]
        },
    )
    expected = {
        "pipeline": (404, "pipeline_not_found"),
        "dependency": (404, "task_not_found"),
        "duplicate": (409, "duplicate_dependency"),
    }[bad]
    assert (r.status, r.error_code) == expected
    assert task_ids(client, pipeline_id) == [upstream]


def test_bulk_with_an_empty_list_is_400_invalid_request(client: Client) -> None:
    r = client.post("/tasks/bulk", {"tasks": []})
    assert r.status == 400
    assert r.error_code == "invalid_request"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"tasks": None},
        {"tasks": {}},
        {"tasks": ["x"]},
        {"tasks": [{"title": "t", "description": "d"}]},
    ],
    ids=["no-tasks", "null", "object", "string-element", "element-without-pipeline"],
)
def test_bulk_with_a_malformed_body_or_element_is_400_invalid_json(
    client: Client, body: Any
) -> None:
    r = client.post("/tasks/bulk", body)
    assert r.status == 400
    assert r.error_code == "invalid_json"


def test_bulk_with_a_malformed_element_among_good_ones_creates_nothing(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    r = client.post(
        "/tasks/bulk", {"tasks": [task_body(pipeline_id), task_body(pipeline_id, priority="high")]}
    )
    assert r.status == 400
    assert r.error_code == "invalid_json"
    assert task_ids(client, pipeline_id) == []


# --- list and filters --------------------------------------------------------------------------


def test_list_filters_by_pipeline_and_stage(client: Client) -> None:
    stage = unique("stage")
    definition = {
        "initial": stage,
        "states": {stage: {}, "done": {"terminal": True}},
        "transitions": [{"from": stage, "to": "done", "trigger": "finish"}],
    }
    first, second = create_pipeline(client, definition), create_pipeline(client, definition)
    a, b = new_task(client, first), new_task(client, first)
    c = new_task(client, second)

    r = client.get(f"/tasks?pipeline_id={first}")
    assert r.status == 200
    assert list(r.json) == ["items", "next_cursor"]
    items = r.json["items"]
    assert sorted(t["id"] for t in items) == sorted([a, b])
    assert items == sorted(items, key=lambda t: (t["created_at_ms"], t["id"]))
    assert r.json["next_cursor"] is None
    assert list(r.json["items"][0]) == TASK_FIELDS

    assert {t["id"] for t in client.get(f"/tasks?stage={stage}").json["items"]} == {a, b, c}
    assert [
        t["id"] for t in client.get(f"/tasks?stage={stage}&pipeline_id={second}").json["items"]
    ] == [c]
    assert client.get(f"/tasks?stage=done&pipeline_id={first}").json["items"] == []
    assert client.get(f"/tasks?stage=&pipeline_id={first}").json["items"] == []


def test_list_decodes_percent_encoded_filter_values(client: Client) -> None:
    stage = unique("in review")
    definition = {
        "initial": stage,
        "states": {stage: {}, "done": {"terminal": True}},
        "transitions": [{"from": stage, "to": "done", "trigger": "finish"}],
    }
    task_id = new_task(client, create_pipeline(client, definition))
    for encoded in (stage.replace(" ", "%20"), stage.replace(" ", "+")):
        items = client.get(f"/tasks?stage={encoded}").json["items"]
        assert [t["id"] for t in items] == [task_id], encoded


def test_unknown_query_parameters_and_pairs_without_a_value_are_ignored(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    task_id = new_task(client, pipeline_id)
    r = client.get(f"/tasks?foo=bar&stage&pipeline_id={pipeline_id}&pipeline_id={MISSING}")
    assert r.status == 200
    assert [t["id"] for t in r.json["items"]] == [task_id]


# --- pagination --------------------------------------------------------------------------------


def bulk(client: Client, pipeline_id: str, n: int) -> list[str]:
    r = client.post(
        "/tasks/bulk", {"tasks": [task_body(pipeline_id, title=f"t{i}") for i in range(n)]}
    )
    assert r.status == 201, r.body
    return list(r.json["ids"])


def test_default_limit_is_50(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    bulk(client, pipeline_id, 51)
    first = client.get(f"/tasks?pipeline_id={pipeline_id}")
    assert len(first.json["items"]) == 50
    assert first.json["next_cursor"] is not None
    rest = client.get(f"/tasks?pipeline_id={pipeline_id}&cursor={first.json['next_cursor']}")
    assert len(rest.json["items"]) == 1
    assert rest.json["next_cursor"] is None


@pytest.mark.parametrize("limit", ["abc", "", "1.5", "ten"])
def test_a_non_integer_limit_falls_back_to_the_default(client: Client, limit: str) -> None:
    pipeline_id = create_pipeline(client)
    bulk(client, pipeline_id, 51)
    r = client.get(f"/tasks?pipeline_id={pipeline_id}&limit={limit}")
    assert r.status == 200, r.body
    assert len(r.json["items"]) == 50


@pytest.mark.parametrize("limit", ["0", "-1", "1001", "99999999999999999999"])
def test_a_limit_outside_1_to_1000_is_400_invalid_limit(client: Client, limit: str) -> None:
    r = client.get(f"/tasks?limit={limit}")
    assert r.status == 400
    assert r.error_code == "invalid_limit"


@pytest.mark.parametrize("limit", ["1", "1000"])
def test_limits_1_and_1000_are_accepted(client: Client, limit: str) -> None:
    pipeline_id = create_pipeline(client)
    bulk(client, pipeline_id, 2)
    r = client.get(f"/tasks?pipeline_id={pipeline_id}&limit={limit}")
    assert r.status == 200
    assert len(r.json["items"]) == min(int(limit), 2)


@pytest.mark.parametrize("cursor", ["abc", ":x", "1:", "x:abc", "", "1.5:abc", ":"])
def test_a_malformed_cursor_is_400_invalid_cursor(client: Client, cursor: str) -> None:
    r = client.get(f"/tasks?cursor={cursor}")
    assert r.status == 400
    assert r.error_code == "invalid_cursor"


def test_the_limit_is_checked_before_the_cursor(client: Client) -> None:
    r = client.get("/tasks?limit=0&cursor=garbage")
    assert r.error_code == "invalid_limit"


@pytest.mark.parametrize("how", ["bulk", "one-by-one"])
def test_paging_returns_every_row_exactly_once_in_creation_order(client: Client, how: str) -> None:
    pipeline_id = create_pipeline(client)
    if how == "bulk":  # one timestamp for all: page boundaries fall between equal created_at_ms
        ids = bulk(client, pipeline_id, 25)
    else:
        ids = [new_task(client, pipeline_id) for _ in range(25)]
    items, pages = all_pages(client, f"pipeline_id={pipeline_id}", 4)
    seen = [t["id"] for t in items]
    assert len(seen) == 25
    assert sorted(seen) == sorted(ids)
    assert seen == [t["id"] for t in sorted(items, key=lambda t: (t["created_at_ms"], t["id"]))]
    assert pages == 7


def test_an_exactly_full_last_page_has_no_next_cursor(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    bulk(client, pipeline_id, 8)
    items, pages = all_pages(client, f"pipeline_id={pipeline_id}", 4)
    assert (len(items), pages) == (8, 2)


def test_the_cursor_names_the_last_returned_row(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    bulk(client, pipeline_id, 3)
    page = client.get(f"/tasks?pipeline_id={pipeline_id}&limit=2").json
    last = page["items"][-1]
    assert page["next_cursor"] == f"{last['created_at_ms']}:{last['id']}"


def test_a_percent_encoded_cursor_works(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    ids = bulk(client, pipeline_id, 5)
    page = client.get(f"/tasks?pipeline_id={pipeline_id}&limit=2").json
    cursor = page["next_cursor"]
    plain = client.get(f"/tasks?pipeline_id={pipeline_id}&limit=2&cursor={cursor}")
    encoded = client.get(
        f"/tasks?pipeline_id={pipeline_id}&limit=2&cursor={cursor.replace(':', '%3A')}"
    )
    assert encoded.status == 200, encoded.body
    assert encoded.json == plain.json
    seen = [t["id"] for t in page["items"] + encoded.json["items"]]
    assert len(set(seen)) == 4 and set(seen) <= set(ids)


def test_paging_combined_with_a_stage_filter_loses_nothing(client: Client) -> None:
    stage = unique("stage")
    definition = {
        "initial": stage,
        "states": {stage: {}, "done": {"terminal": True}},
        "transitions": [{"from": stage, "to": "done", "trigger": "finish"}],
    }
    ids = bulk(client, create_pipeline(client, definition), 6)
    ids += bulk(client, create_pipeline(client, definition), 5)
    items, _ = all_pages(client, f"stage={stage}", 3)
    assert sorted(t["id"] for t in items) == sorted(ids)


# --- details -----------------------------------------------------------------------------------


def test_details_of_a_task_that_never_ran_omit_latest_run(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client))
    r = client.get(f"/tasks/{task_id}")
    assert r.status == 200
    assert "latest_run" not in r.json
    assert list(r.json)[len(TASK_FIELDS) :] == [
        "dependencies",
        "assignments",
        "available_transitions",
        # Additions of ours, after the original's keys: what an agent needs to resume.
        "checkpoint",
        "fence",
        "previous_failures",
    ]
    assert (r.json["checkpoint"], r.json["fence"], r.json["previous_failures"]) == (None, 0, [])


def test_details_list_available_transitions_of_the_current_stage(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = new_task(client, pipeline_id)
    assert client.get(f"/tasks/{task_id}").json["available_transitions"] == [
        {"trigger": "submit", "to": "review", "required_gates": ["tests"]}
    ]
    lease = claim(client, coder).json
    moved = client.post(
        f"/runs/{lease['run']['id']}/transition", {"trigger": "submit"}, token=lease["lease_token"]
    )
    assert moved.status == 200, moved.body
    assert client.get(f"/tasks/{task_id}").json["available_transitions"] == [
        {"trigger": "approve", "to": "done", "required_gates": []},
        {"trigger": "reject", "to": "todo", "required_gates": []},
    ]


def test_details_of_a_claimed_task_include_the_latest_run(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = new_task(client, pipeline_id)
    lease = claim(client, coder, "agent-7").json
    details = client.get(f"/tasks/{task_id}").json
    run = details["latest_run"]
    assert run == lease["run"]
    assert list(run) == [
        "id",
        "task_id",
        "attempt",
        "status",
        "agent_id",
        "agent_role",
        "started_at_ms",
        "ended_at_ms",
    ]
    assert (run["task_id"], run["attempt"], run["status"]) == (task_id, 1, "running")
    assert (run["agent_id"], run["agent_role"], run["ended_at_ms"]) == ("agent-7", coder, None)


def test_details_show_dependencies_with_their_resolved_flag(client: Client) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    upstream = new_task(client, pipeline_id)
    task_id = new_task(client, pipeline_id, dependencies=[upstream])
    assert client.get(f"/tasks/{task_id}").json["dependencies"] == [
        {"depends_on_task_id": upstream, "resolved": False}
    ]
    for role, trigger in ((coder, "submit"), (reviewer, "approve")):
        lease = claim(client, role).json
        assert lease["task"]["id"] == upstream
        r = client.post(
            f"/runs/{lease['run']['id']}/transition",
            {"trigger": trigger},
            token=lease["lease_token"],
        )
        assert r.status == 200, r.body
    assert client.get(f"/tasks/{task_id}").json["dependencies"] == [
        {"depends_on_task_id": upstream, "resolved": True}
    ]


def test_details_show_the_assignment_history_without_task_id(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client), assigned_agent_id="ann")
    assert client.post(f"/tasks/{task_id}/assignments", {"agent_id": "bob"}).status == 201
    assignments = client.get(f"/tasks/{task_id}").json["assignments"]
    assert [(a["agent_id"], a["active"]) for a in assignments] == [("ann", False), ("bob", True)]
    assert all("task_id" not in a for a in assignments)


def test_get_unknown_task_is_404_task_not_found(client: Client) -> None:
    r = client.get(f"/tasks/{MISSING}")
    assert r.status == 404
    assert r.error_code == "task_not_found"


@pytest.mark.parametrize(
    ("task", "code"), [("never-ran", "not_found"), ("unknown", "task_not_found")]
)
def test_run_state_is_404_for_a_task_that_never_ran(client: Client, task: str, code: str) -> None:
    task_id = new_task(client, create_pipeline(client)) if task == "never-ran" else MISSING
    r = client.get(f"/tasks/{task_id}/run-state")
    assert r.status == 404
    assert r.error_code == code


# Every route that names a task in its path, with a body it accepts.
TASK_ROUTES = [
    ("GET", "/tasks/{id}", None),
    ("GET", "/tasks/{id}/run-state", None),
    ("GET", "/tasks/{id}/checkpoint", None),
    ("GET", "/tasks/{id}/runs", None),
    ("GET", "/tasks/{id}/events", None),
    ("POST", "/tasks/{id}/requeue", {}),
    ("POST", "/tasks/{id}/cancel", {}),
    ("POST", "/tasks/{id}/dependencies", {"depends_on_task_id": "other"}),
    ("POST", "/tasks/{id}/assignments", {"agent_id": "ann"}),
    ("DELETE", "/tasks/{id}/assignments/ann", None),
]


@pytest.mark.parametrize(("method", "path", "body"), TASK_ROUTES)
def test_a_missing_task_is_404_task_not_found_on_every_route(
    client: Client, method: str, path: str, body: dict[str, str] | None
) -> None:
    r = client.request(method, path.format(id=unique("missing")), body)
    assert (r.status, r.error_code) == (404, "task_not_found"), r.body


def test_every_route_naming_a_task_is_covered() -> None:
    from nulltickets.http.routes import ROUTES

    named = {(r.method, r.pattern) for r in ROUTES if r.pattern.startswith("/tasks/{id}")}
    lists = {("GET", "/tasks/{id}/dependencies"), ("GET", "/tasks/{id}/assignments")}
    covered = {(m, p.replace("/ann", "/{agent_id+}")) for m, p, _ in TASK_ROUTES}
    # The two lists answer [] for an unknown task, as the original's do (contract 12.5, 12.7).
    assert named - lists == covered


# --- dependencies route ------------------------------------------------------------------------


def add_dependency(client: Client, task_id: str, depends_on: str) -> Response:
    return client.post(f"/tasks/{task_id}/dependencies", {"depends_on_task_id": depends_on})


def test_adding_a_dependency_returns_created_and_lists_it(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    a, b, c = (new_task(client, pipeline_id) for _ in range(3))
    done = new_task(client, create_pipeline(client, FINISHED))
    assert client.get(f"/tasks/{a}/dependencies").json == []
    for upstream in (c, done, b):
        r = add_dependency(client, a, upstream)
        assert r.status == 201
        assert r.json == {"status": "created"}
    assert client.get(f"/tasks/{a}/dependencies").json == [
        {"depends_on_task_id": c, "resolved": False},
        {"depends_on_task_id": done, "resolved": True},
        {"depends_on_task_id": b, "resolved": False},
    ]


def test_a_task_cannot_depend_on_itself(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client))
    r = add_dependency(client, task_id, task_id)
    assert r.status == 400
    assert r.error_code == "invalid_dependency"


def test_the_self_dependency_check_comes_before_existence(client: Client) -> None:
    r = add_dependency(client, MISSING, MISSING)
    assert r.status == 400
    assert r.error_code == "invalid_dependency"


def test_dependency_on_an_unknown_task_is_404_task_not_found(client: Client) -> None:
    upstream = new_task(client, create_pipeline(client))
    r = add_dependency(client, MISSING, upstream)
    assert r.status == 404
    assert r.error_code == "task_not_found"


def test_dependency_on_an_unknown_upstream_is_404_dependency_task_not_found(
    client: Client,
) -> None:
    task_id = new_task(client, create_pipeline(client))
    r = add_dependency(client, task_id, MISSING)
    assert r.status == 404
    assert r.error_code == "dependency_task_not_found"
    assert client.get(f"/tasks/{task_id}/dependencies").json == []


def test_adding_the_same_dependency_twice_is_409_duplicate_dependency(client: Client) -> None:
    pipeline_id = create_pipeline(client)
    a, b = new_task(client, pipeline_id), new_task(client, pipeline_id)
    assert add_dependency(client, a, b).status == 201
    r = add_dependency(client, a, b)
    assert r.status == 409
    assert r.error_code == "duplicate_dependency"
    assert len(client.get(f"/tasks/{a}/dependencies").json) == 1


def test_dependencies_of_an_unknown_task_are_an_empty_list(client: Client) -> None:
    r = client.get(f"/tasks/{MISSING}/dependencies")
    assert r.status == 200
    assert r.json == []


@pytest.mark.parametrize("body", [{}, {"depends_on_task_id": 5}, {"depends_on_task_id": None}])
def test_a_malformed_dependency_body_is_400_invalid_json(client: Client, body: Any) -> None:
    task_id = new_task(client, create_pipeline(client))
    r = client.post(f"/tasks/{task_id}/dependencies", body)
    assert r.status == 400
    assert r.error_code == "invalid_json"


# --- assignments -------------------------------------------------------------------------------


def assign(client: Client, task_id: str, agent: str, by: str | None = None) -> Response:
    body: dict[str, Any] = {"agent_id": agent}
    if by is not None:
        body["assigned_by"] = by
    return client.post(f"/tasks/{task_id}/assignments", body)


def test_assigning_returns_assigned_and_lists_it_with_task_id(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client))
    r = assign(client, task_id, "ann", "boss")
    assert r.status == 201
    assert r.json == {"status": "assigned"}
    (row,) = client.get(f"/tasks/{task_id}/assignments").json
    assert list(row) == [
        "task_id",
        "agent_id",
        "assigned_by",
        "active",
        "created_at_ms",
        "updated_at_ms",
    ]
    assert (row["task_id"], row["agent_id"], row["assigned_by"], row["active"]) == (
        task_id,
        "ann",
        "boss",
        True,
    )


def test_assigning_an_unknown_task_is_404_task_not_found(client: Client) -> None:
    r = assign(client, MISSING, "ann")
    assert r.status == 404
    assert r.error_code == "task_not_found"
    assert client.get(f"/tasks/{MISSING}/assignments").json == []


def test_reassigning_deactivates_the_previous_assignment(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client))
    assert assign(client, task_id, "ann").status == 201
    assert assign(client, task_id, "bob", "boss").status == 201
    rows = client.get(f"/tasks/{task_id}/assignments").json
    assert [(r["agent_id"], r["active"]) for r in rows] == [("ann", False), ("bob", True)]
    assert rows[0]["updated_at_ms"] >= rows[0]["created_at_ms"]


def test_reassigning_the_same_agent_keeps_created_and_overwrites_assigned_by(
    client: Client,
) -> None:
    task_id = new_task(client, create_pipeline(client))
    assert assign(client, task_id, "ann", "boss").status == 201
    (before,) = client.get(f"/tasks/{task_id}/assignments").json
    assert assign(client, task_id, "bob").status == 201
    assert assign(client, task_id, "ann").status == 201
    rows = client.get(f"/tasks/{task_id}/assignments").json
    assert [(r["agent_id"], r["active"]) for r in rows] == [("ann", True), ("bob", False)]
    assert rows[0]["created_at_ms"] == before["created_at_ms"]
    assert rows[0]["assigned_by"] is None


def test_unassigning_deactivates_and_a_second_unassign_is_404(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client), assigned_agent_id="ann")
    r = client.delete(f"/tasks/{task_id}/assignments/ann")
    assert r.status == 200
    assert r.json == {"status": "unassigned"}
    (row,) = client.get(f"/tasks/{task_id}/assignments").json
    assert row["active"] is False
    again = client.delete(f"/tasks/{task_id}/assignments/ann")
    assert again.status == 404
    assert again.error_code == "not_found"


@pytest.mark.parametrize(
    ("target", "code"),
    [
        ("unknown-task", "task_not_found"),
        ("unknown-agent", "not_found"),
        ("inactive-agent", "not_found"),
    ],
)
def test_unassigning_without_an_active_row_is_404(client: Client, target: str, code: str) -> None:
    task_id = new_task(client, create_pipeline(client), assigned_agent_id="ann")
    assert assign(client, task_id, "bob").status == 201
    path = {
        "unknown-task": f"/tasks/{MISSING}/assignments/bob",
        "unknown-agent": f"/tasks/{task_id}/assignments/carl",
        "inactive-agent": f"/tasks/{task_id}/assignments/ann",
    }[target]
    r = client.delete(path)
    assert r.status == 404
    assert r.error_code == code
    assert [a["active"] for a in client.get(f"/tasks/{task_id}/assignments").json] == [False, True]


def test_an_agent_id_with_a_percent_encoded_slash_is_unassigned(client: Client) -> None:
    task_id = new_task(client, create_pipeline(client), assigned_agent_id="team/ann")
    r = client.delete(f"/tasks/{task_id}/assignments/team%2Fann")
    assert r.status == 200, r.body
    assert client.get(f"/tasks/{task_id}/assignments").json[0]["active"] is False


@pytest.mark.parametrize("body", [{}, {"agent_id": 1}, {"agent_id": "a", "assigned_by": 2}])
def test_a_malformed_assignment_body_is_400_invalid_json(client: Client, body: Any) -> None:
    task_id = new_task(client, create_pipeline(client))
    r = client.post(f"/tasks/{task_id}/assignments", body)
    assert r.status == 400
    assert r.error_code == "invalid_json"
