"""Pipelines: create, list, get, duplicate names and definition validation (contract §10, §11)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.conftest import ID_SHAPE, create_pipeline, unique
from tests.server import PIPELINE, Client


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def post_pipeline(client: Client, definition: Any, name: str | None = None) -> Any:
    return client.post("/pipelines", {"name": name or unique("pipe"), "definition": definition})


def with_changes(**changes: Any) -> dict[str, Any]:
    definition = copy.deepcopy(PIPELINE)
    definition.update(changes)
    return definition


# --- create, get, list -------------------------------------------------------------------------


def test_create_returns_201_with_a_uuid_and_get_returns_the_pipeline(client: Client) -> None:
    name = unique("pipe")
    r = post_pipeline(client, PIPELINE, name)
    assert r.status == 201
    assert list(r.json) == ["id"]
    assert ID_SHAPE.match(r.json["id"])

    got = client.get(f"/pipelines/{r.json['id']}")
    assert got.status == 200
    doc = got.json
    assert list(doc) == ["id", "name", "definition", "created_at_ms"]
    assert doc["id"] == r.json["id"]
    assert doc["name"] == name
    assert doc["definition"] == PIPELINE
    assert isinstance(doc["created_at_ms"], int) and doc["created_at_ms"] > 1_600_000_000_000


def test_get_unknown_pipeline_is_404_not_found(client: Client) -> None:
    r = client.get("/pipelines/00000000-0000-4000-8000-000000000000")
    assert r.status == 404
    assert r.error_code == "not_found"


def test_list_is_a_plain_array_newest_first_with_definition_objects(client: Client) -> None:
    older, newer = create_pipeline(client), create_pipeline(client)
    r = client.get("/pipelines")
    assert r.status == 200
    items = r.json
    assert isinstance(items, list)
    ids = [p["id"] for p in items]
    assert older in ids and newer in ids
    stamps = [p["created_at_ms"] for p in items]
    assert stamps == sorted(stamps, reverse=True)
    by_id = {p["id"]: p for p in items}
    if by_id[newer]["created_at_ms"] > by_id[older]["created_at_ms"]:
        assert ids.index(newer) < ids.index(older)
    for p in items:
        assert set(p) == {"id", "name", "definition", "created_at_ms"}
    assert by_id[newer]["definition"] == PIPELINE


def test_definition_is_stored_compactly_keeping_key_order_and_unknown_keys(client: Client) -> None:
    definition = {
        "x_top": {"nested": [1, 2, {"z": None}], "a": "b"},
        "initial": "todo",
        "states": {
            "todo": {"agent_role": "coder", "x_state": True, "workflow_id": "wf-1"},
            "done": {"terminal": True, "description": "finished", "x_more": 1.5},
        },
        "transitions": [{"trigger": "finish", "to": "done", "from": "todo", "x_tr": []}],
    }
    r = post_pipeline(client, definition)
    assert r.status == 201, r.body
    got = client.get(f"/pipelines/{r.json['id']}")
    assert got.json["definition"] == definition
    assert f'"definition":{compact(definition)}'.encode() in got.body


def test_names_are_case_sensitive_and_may_be_empty(fresh_client: Client) -> None:
    client = fresh_client
    assert post_pipeline(client, PIPELINE, "Build").status == 201
    assert post_pipeline(client, PIPELINE, "build").status == 201
    empty = client.post("/pipelines", {"name": "", "definition": PIPELINE})
    assert empty.status == 201, empty.body
    assert client.get(f"/pipelines/{empty.json['id']}").json["name"] == ""


def test_duplicate_name_is_409_duplicate_name(client: Client) -> None:
    name = unique("pipe")
    assert post_pipeline(client, PIPELINE, name).status == 201
    r = post_pipeline(client, PIPELINE, name)
    assert r.status == 409
    assert r.error_code == "duplicate_name"
    assert [p["name"] for p in client.get("/pipelines").json].count(name) == 1


def test_validation_is_checked_before_the_name(client: Client) -> None:
    name = unique("pipe")
    assert post_pipeline(client, PIPELINE, name).status == 201
    r = post_pipeline(client, with_changes(transitions=[]), name)
    assert r.status == 400
    assert r.error_code == "validation_failed"


# --- body errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"definition": PIPELINE},
        {"name": 5, "definition": PIPELINE},
        {"name": None, "definition": PIPELINE},
        {"name": "x"},
        [],
        "pipeline",
    ],
    ids=["no-name", "name-number", "name-null", "no-definition", "array", "string"],
)
def test_malformed_bodies_are_400_invalid_json(client: Client, body: Any) -> None:
    r = client.post("/pipelines", body)
    assert r.status == 400
    assert r.error_code == "invalid_json"


def test_null_definition_is_400_validation_failed(client: Client) -> None:
    r = client.post("/pipelines", {"name": unique("pipe"), "definition": None})
    assert r.status == 400
    assert r.error_code == "validation_failed"


# --- validation V1..V8 -------------------------------------------------------------------------

STATES_NO_TERMINAL = {"todo": {}, "review": {}}
CASES: list[tuple[str, Any, str]] = [
    ("V1-array", [PIPELINE], "$"),
    ("V1-string", "todo", "$"),
    ("V1-missing-initial", {k: v for k, v in PIPELINE.items() if k != "initial"}, "initial"),
    ("V1-initial-number", with_changes(initial=1), "initial"),
    ("V1-states-array", with_changes(states=[]), "states"),
    (
        "V1-missing-transitions",
        {k: v for k, v in PIPELINE.items() if k != "transitions"},
        "transitions",
    ),
    ("V1-transitions-object", with_changes(transitions={}), "transitions"),
    (
        "V1-terminal-string",
        with_changes(states={**PIPELINE["states"], "done": {"terminal": "yes"}}),
        "terminal",
    ),
    (
        "V1-agent-role-number",
        with_changes(states={**PIPELINE["states"], "todo": {"agent_role": 1}}),
        "agent_role",
    ),
    ("V1-state-not-object", with_changes(states={**PIPELINE["states"], "todo": "coder"}), "todo"),
    (
        "V1-transition-without-trigger",
        with_changes(transitions=[*PIPELINE["transitions"], {"from": "todo", "to": "done"}]),
        "trigger",
    ),
    (
        "V1-gates-not-strings",
        with_changes(
            transitions=[
                {
                    "from": "todo",
                    "to": "review",
                    "trigger": "submit",
                    "required_gates": ["tests", 3],
                },
                *PIPELINE["transitions"][1:],
            ]
        ),
        "required_gates",
    ),
    ("V2-initial-empty", with_changes(initial=""), "initial"),
    ("V3-no-states", with_changes(states={}), "states"),
    ("V4-no-transitions", with_changes(transitions=[]), "transitions"),
    ("V5-initial-not-a-state", with_changes(initial="backlog"), "backlog"),
    (
        "V6-from-not-a-state",
        with_changes(
            transitions=[*PIPELINE["transitions"], {"from": "qa", "to": "done", "trigger": "ok"}]
        ),
        "qa",
    ),
    (
        "V6-to-not-a-state",
        with_changes(
            transitions=[
                *PIPELINE["transitions"],
                {"from": "review", "to": "shipped", "trigger": "ship"},
            ]
        ),
        "shipped",
    ),
    (
        "V7-no-terminal-state",
        {
            "initial": "todo",
            "states": STATES_NO_TERMINAL,
            "transitions": [
                {"from": "todo", "to": "review", "trigger": "a"},
                {"from": "review", "to": "todo", "trigger": "b"},
            ],
        },
        "terminal",
    ),
    ("V8-dead-end-state", with_changes(states={**PIPELINE["states"], "limbo": {}}), "limbo"),
]


@pytest.mark.parametrize(
    ("definition", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_invalid_definitions_are_400_validation_failed_naming_the_reason(
    client: Client, definition: Any, fragment: str
) -> None:
    name = unique("pipe")
    r = post_pipeline(client, definition, name)
    assert r.status == 400, r.body
    assert r.error_code == "validation_failed"
    assert fragment in r.json["error"]["message"]
    assert name not in [p["name"] for p in client.get("/pipelines").json]


def test_each_validation_rule_has_its_own_message(client: Client) -> None:
    first_of_each = {}
    for case_id, definition, _ in CASES:
        first_of_each.setdefault(case_id.split("-")[0], definition)
    messages = {
        rule: post_pipeline(client, d).json["error"]["message"] for rule, d in first_of_each.items()
    }
    assert len(messages) == 8
    assert len(set(messages.values())) == 8, messages


def test_the_first_failing_rule_wins(client: Client) -> None:
    # V2 (empty initial) and V3 (no states) and V4 (no transitions) all apply: V2 is reported.
    both = post_pipeline(client, {"initial": "", "states": {}, "transitions": []})
    only_v3 = post_pipeline(client, {"initial": "todo", "states": {}, "transitions": []})
    assert both.error_code == only_v3.error_code == "validation_failed"
    assert both.json["error"]["message"] != only_v3.json["error"]["message"]
    assert "initial" in both.json["error"]["message"]


def test_definitions_with_unchecked_oddities_are_accepted(client: Client) -> None:
    definition = {
        "initial": "todo",
        "states": {
            "todo": {"agent_role": ""},
            "orphan": {"terminal": True},  # unreachable
            "done": {"terminal": True, "agent_role": "archivist"},  # terminal with a role
        },
        "transitions": [
            {"from": "todo", "to": "done", "trigger": ""},
            {"from": "todo", "to": "orphan", "trigger": ""},  # duplicate (from, trigger)
            {"from": "done", "to": "todo", "trigger": "reopen"},  # leaves a terminal state
        ],
    }
    r = post_pipeline(client, definition)
    assert r.status == 201, r.body
    assert client.get(f"/pipelines/{r.json['id']}").json["definition"] == definition


def test_terminal_must_be_exactly_true(client: Client) -> None:
    states = {**PIPELINE["states"], "done": {"terminal": False}, "dead": {"terminal": None}}
    r = post_pipeline(client, with_changes(states=states))
    assert r.status == 400
    assert r.error_code == "validation_failed"
