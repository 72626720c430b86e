"""POST /leases/claim over real HTTP: the claim result, eligibility rules and ordering (§8.1),
input checks and the Q3 / Q10 improvements."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from tests.conftest import claim, create_pipeline, make_task, now_ms, pipeline_with_roles, unique
from tests.server import TASK_FIELDS, Client, Response

pytestmark = pytest.mark.e2e

HEX64 = re.compile(r"[0-9a-f]{64}")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
DAY_MS = 24 * 3600 * 1000
RUN_KEYS = {
    "id",
    "task_id",
    "attempt",
    "status",
    "agent_id",
    "agent_role",
    "started_at_ms",
    "ended_at_ms",
}
TASK_KEYS = set(TASK_FIELDS)


def claimed_id(r: Response) -> str:
    assert r.status == 200, (r.status, r.body)
    return str(r.json["task"]["id"])


def assert_nothing_to_claim(r: Response) -> None:
    assert r.status == 204, (r.status, r.body)
    assert r.body == b""


def finish(client: Client, task_id: str, coder: str, reviewer: str) -> None:
    """Drive a task of a `pipeline_with_roles` pipeline to its terminal stage `done`."""
    c = claim(client, coder, "finisher")
    assert claimed_id(c) == task_id
    r = client.post(
        f"/runs/{c.json['run']['id']}/transition",
        {"trigger": "submit"},
        token=c.json["lease_token"],
    )
    assert r.status == 200, r.body
    c = claim(client, reviewer, "finisher")
    assert claimed_id(c) == task_id
    r = client.post(
        f"/runs/{c.json['run']['id']}/transition",
        {"trigger": "approve"},
        token=c.json["lease_token"],
    )
    assert r.status == 200, r.body


def single_stage_pipeline(client: Client) -> tuple[str, str, str]:
    """A pipeline whose working stage name is unique too (per-state limits count by stage
    name across all pipelines). Returns (pipeline_id, role, stage)."""
    role, stage, done = unique("role"), unique("stage"), unique("done")
    definition = {
        "initial": stage,
        "states": {stage: {"agent_role": role}, done: {"terminal": True}},
        "transitions": [{"from": stage, "to": done, "trigger": "submit"}],
    }
    return create_pipeline(client, definition), role, stage


# --- the claim result --------------------------------------------------------------------------


def test_claim_returns_task_run_and_lease(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, priority=3, metadata={"k": [1, 2]})
    before_claim = client.get(f"/tasks/{task_id}").json

    before = now_ms()
    r = claim(client, coder, "agent-7", lease_ttl_ms=120_000)
    after = now_ms()

    assert r.status == 200, r.body
    assert r.headers["content-type"] == "application/json"
    doc = r.json
    # The original's keys, plus the fence of this claim (an addition of ours).
    assert set(doc) == {"task", "run", "lease_id", "lease_token", "expires_at_ms", "fence"}
    assert doc["fence"] == doc["task"]["fence"] == 1
    task, run = doc["task"], doc["run"]
    assert set(task) >= TASK_KEYS
    assert task["id"] == task_id
    assert task["pipeline_id"] == pipeline_id
    assert task["stage"] == "todo"
    assert task["priority"] == 3
    assert task["metadata"] == {"k": [1, 2]}
    assert task["available_transitions"] == [
        {"trigger": "submit", "to": "review", "required_gates": ["tests"]}
    ]
    # Claiming does not modify the task.
    assert task["task_version"] == 1
    assert task["updated_at_ms"] == before_claim["updated_at_ms"]

    assert set(run) == RUN_KEYS
    assert UUID.fullmatch(run["id"])
    assert run["task_id"] == task_id
    assert run["attempt"] == 1
    assert run["status"] == "running"
    assert run["agent_id"] == "agent-7"
    assert run["agent_role"] == coder
    assert before <= run["started_at_ms"] <= after
    assert run["ended_at_ms"] is None

    assert UUID.fullmatch(doc["lease_id"])
    assert HEX64.fullmatch(doc["lease_token"])
    assert before + 120_000 <= doc["expires_at_ms"] <= after + 120_000
    assert doc["expires_at_ms"] == run["started_at_ms"] + 120_000


def test_claim_without_ttl_leases_for_five_minutes(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    before = now_ms()
    r = claim(client, coder)
    after = now_ms()
    assert r.status == 200, r.body
    assert before + 300_000 <= r.json["expires_at_ms"] <= after + 300_000


def test_claimed_task_shows_running_run_in_details(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    assert "latest_run" not in client.get(f"/tasks/{task_id}").json
    run = claim(client, coder, "agent-d").json["run"]
    details = client.get(f"/tasks/{task_id}").json
    assert details["latest_run"] == run
    assert details["stage"] == "todo"


def test_each_claim_gets_a_distinct_lease_token(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    for _ in range(3):
        make_task(client, pipeline_id)
    claims = [claim(client, coder).json for _ in range(3)]
    assert len({c["lease_token"] for c in claims}) == 3
    assert len({c["lease_id"] for c in claims}) == 3
    assert len({c["task"]["id"] for c in claims}) == 3


def test_claim_answers_204_with_empty_body_when_nothing_is_claimable(client: Client) -> None:
    _, coder, _ = pipeline_with_roles(client)
    assert_nothing_to_claim(claim(client, coder))


def test_claim_for_an_unknown_role_answers_204(client: Client) -> None:
    assert_nothing_to_claim(claim(client, unique("nobody")))


# --- who may claim what ------------------------------------------------------------------------


def test_claim_matches_the_role_exactly(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    for near_miss in (coder.upper(), coder[:-1], coder + "x", f" {coder}", ""):
        assert_nothing_to_claim(claim(client, near_miss))
    assert claimed_id(claim(client, coder)) == task_id


def test_claim_does_not_offer_a_stage_to_another_role(client: Client) -> None:
    pipeline_id, _, reviewer = pipeline_with_roles(client)
    make_task(client, pipeline_id)  # sits in `todo`, which belongs to the coder role
    assert_nothing_to_claim(claim(client, reviewer))


def test_claim_takes_highest_priority_first_then_oldest(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    ids: dict[str, str] = {}
    for name, priority in [
        ("low", 1),
        ("high-old", 5),
        ("mid", 3),
        ("high-new", 5),
        ("negative", -2),
    ]:
        ids[name] = make_task(client, pipeline_id, priority=priority)
        time.sleep(0.003)  # distinct created_at_ms, so "oldest" is well defined
    order = [claimed_id(claim(client, coder)) for _ in range(5)]
    assert order == [ids["high-old"], ids["high-new"], ids["mid"], ids["low"], ids["negative"]]
    assert_nothing_to_claim(claim(client, coder))


def test_claim_skips_tasks_leased_by_others(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    first = make_task(client, pipeline_id, priority=2)
    second = make_task(client, pipeline_id, priority=1)
    assert claimed_id(claim(client, coder, "agent-a")) == first
    assert claimed_id(claim(client, coder, "agent-b")) == second
    assert_nothing_to_claim(claim(client, coder, "agent-c"))
    # The same agent cannot take its own leased task a second time either.
    assert_nothing_to_claim(claim(client, coder, "agent-a"))


def test_claim_skips_tasks_not_yet_eligible(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 60_000})
    c = claim(client, coder)
    r = client.post(
        f"/runs/{c.json['run']['id']}/fail", {"error": "boom"}, token=c.json["lease_token"]
    )
    assert r.status == 200, r.body
    task = client.get(f"/tasks/{task_id}").json
    assert task["next_eligible_at_ms"] > now_ms() + 50_000
    assert_nothing_to_claim(claim(client, coder, "agent-b"))


def test_claim_offers_a_task_again_once_its_retry_delay_has_passed(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 400})
    c = claim(client, coder)
    r = client.post(
        f"/runs/{c.json['run']['id']}/fail", {"error": "boom"}, token=c.json["lease_token"]
    )
    assert r.status == 200, r.body
    eligible_at = client.get(f"/tasks/{task_id}").json["next_eligible_at_ms"]
    assert_nothing_to_claim(claim(client, coder, "agent-b"))
    deadline = time.monotonic() + 10
    r = claim(client, coder, "agent-b")
    while r.status == 204 and time.monotonic() < deadline:
        time.sleep(0.05)
        r = claim(client, coder, "agent-b")
    assert claimed_id(r) == task_id
    assert r.json["run"]["started_at_ms"] >= eligible_at
    assert r.json["run"]["attempt"] == 2


# --- dependencies ------------------------------------------------------------------------------


def test_claim_waits_for_dependencies_to_reach_a_terminal_stage(client: Client) -> None:
    up_pipeline, up_coder, up_reviewer = pipeline_with_roles(client)
    upstream = make_task(client, up_pipeline)
    pipeline_id, coder, _ = pipeline_with_roles(client)
    downstream = make_task(client, pipeline_id, dependencies=[upstream])

    assert_nothing_to_claim(claim(client, coder))

    # Upstream in a non-terminal later stage: still blocked.
    c = claim(client, up_coder)
    r = client.post(
        f"/runs/{c.json['run']['id']}/transition",
        {"trigger": "submit"},
        token=c.json["lease_token"],
    )
    assert r.status == 200, r.body
    assert client.get(f"/tasks/{upstream}").json["stage"] == "review"
    assert_nothing_to_claim(claim(client, coder))

    c = claim(client, up_reviewer)
    r = client.post(
        f"/runs/{c.json['run']['id']}/transition",
        {"trigger": "approve"},
        token=c.json["lease_token"],
    )
    assert r.status == 200, r.body
    assert client.get(f"/tasks/{downstream}/dependencies").json == [
        {"depends_on_task_id": upstream, "resolved": True}
    ]
    assert claimed_id(claim(client, coder)) == downstream


def test_claim_honours_dependencies_added_after_creation(client: Client) -> None:
    up_pipeline, up_coder, up_reviewer = pipeline_with_roles(client)
    upstream = make_task(client, up_pipeline)
    pipeline_id, coder, _ = pipeline_with_roles(client)
    downstream = make_task(client, pipeline_id)
    r = client.post(f"/tasks/{downstream}/dependencies", {"depends_on_task_id": upstream})
    assert r.status == 201, r.body
    assert_nothing_to_claim(claim(client, coder))
    finish(client, upstream, up_coder, up_reviewer)
    assert claimed_id(claim(client, coder)) == downstream


def test_claim_needs_every_dependency_resolved(client: Client) -> None:
    up_pipeline, up_coder, up_reviewer = pipeline_with_roles(client)
    first = make_task(client, up_pipeline, priority=1)
    second = make_task(client, up_pipeline)
    pipeline_id, coder, _ = pipeline_with_roles(client)
    downstream = make_task(client, pipeline_id, dependencies=[first, second])
    finish(client, first, up_coder, up_reviewer)
    assert_nothing_to_claim(claim(client, coder))
    finish(client, second, up_coder, up_reviewer)
    assert claimed_id(claim(client, coder)) == downstream


def test_claim_passes_over_a_blocked_task_to_an_unblocked_one(client: Client) -> None:
    up_pipeline, _, _ = pipeline_with_roles(client)
    upstream = make_task(client, up_pipeline)
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id, priority=10, dependencies=[upstream])
    free = make_task(client, pipeline_id, priority=0)
    assert claimed_id(claim(client, coder)) == free
    assert_nothing_to_claim(claim(client, coder))


# --- assignments -------------------------------------------------------------------------------


def test_task_assigned_to_another_agent_is_not_claimable_by_me(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id, assigned_agent_id="bob", assigned_by="lead")
    assert_nothing_to_claim(claim(client, coder, "alice"))


def test_task_assigned_to_me_is_claimable_by_me(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, assigned_agent_id="bob")
    assert claimed_id(claim(client, coder, "bob")) == task_id


def test_assignment_through_the_route_reserves_the_task(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    r = client.post(f"/tasks/{task_id}/assignments", {"agent_id": "bob"})
    assert r.status == 201, r.body
    assert_nothing_to_claim(claim(client, coder, "alice"))
    assert claimed_id(claim(client, coder, "bob")) == task_id


def test_reassignment_moves_the_reservation(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, assigned_agent_id="bob")
    r = client.post(f"/tasks/{task_id}/assignments", {"agent_id": "carol"})
    assert r.status == 201, r.body
    assert_nothing_to_claim(claim(client, coder, "bob"))
    assert claimed_id(claim(client, coder, "carol")) == task_id


def test_task_is_open_to_everyone_again_after_unassignment(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, assigned_agent_id="bob")
    assert_nothing_to_claim(claim(client, coder, "alice"))
    r = client.delete(f"/tasks/{task_id}/assignments/bob")
    assert r.status == 200, r.body
    assert r.json == {"status": "unassigned"}
    assert claimed_id(claim(client, coder, "alice")) == task_id


# --- per-state concurrency ---------------------------------------------------------------------


def test_per_state_limit_blocks_claims_while_the_stage_is_full(client: Client) -> None:
    pipeline_id, role, stage = single_stage_pipeline(client)
    first = make_task(client, pipeline_id, priority=1)
    second = make_task(client, pipeline_id)
    limit = {"per_state": {stage: 1}}

    c = claim(client, role, "agent-a", concurrency=limit)
    assert claimed_id(c) == first
    assert_nothing_to_claim(claim(client, role, "agent-b", concurrency=limit))

    # Releasing the lease frees the slot.
    r = client.post(
        f"/runs/{c.json['run']['id']}/transition",
        {"trigger": "submit"},
        token=c.json["lease_token"],
    )
    assert r.status == 200, r.body
    assert claimed_id(claim(client, role, "agent-b", concurrency=limit)) == second


def test_per_state_limit_allows_up_to_the_limit(client: Client) -> None:
    pipeline_id, role, stage = single_stage_pipeline(client)
    for _ in range(3):
        make_task(client, pipeline_id)
    limit = {"per_state": {stage: 2}}
    assert claim(client, role, "a", concurrency=limit).status == 200
    assert claim(client, role, "b", concurrency=limit).status == 200
    assert_nothing_to_claim(claim(client, role, "c", concurrency=limit))


def test_per_state_limit_truncates_fractional_limits(client: Client) -> None:
    pipeline_id, role, stage = single_stage_pipeline(client)
    make_task(client, pipeline_id)
    make_task(client, pipeline_id)
    assert claim(client, role, "a").status == 200
    assert_nothing_to_claim(claim(client, role, "b", concurrency={"per_state": {stage: 1.9}}))


@pytest.mark.parametrize(
    "value",
    ["1", 0, -1, 0.5, None, True, [1], {"max": 1}],
    ids=["string", "zero", "negative", "half", "null", "bool", "array", "object"],
)
def test_per_state_limit_that_is_not_a_positive_number_means_no_limit(
    client: Client, value: Any
) -> None:
    pipeline_id, role, stage = single_stage_pipeline(client)
    make_task(client, pipeline_id)
    make_task(client, pipeline_id)
    assert claim(client, role, "a").status == 200
    r = claim(client, role, "b", concurrency={"per_state": {stage: value}})
    assert r.status == 200, r.body


def test_per_state_limit_for_another_stage_does_not_apply(client: Client) -> None:
    pipeline_id, role, _ = single_stage_pipeline(client)
    make_task(client, pipeline_id)
    make_task(client, pipeline_id)
    assert claim(client, role, "a").status == 200
    r = claim(client, role, "b", concurrency={"per_state": {unique("other"): 1}})
    assert r.status == 200, r.body


# --- Q3: no starvation behind blocked work ------------------------------------------------------


def test_claim_finds_eligible_work_behind_thirty_tasks_blocked_by_dependencies(
    client: Client,
) -> None:
    up_pipeline, _, _ = pipeline_with_roles(client)
    unfinished = make_task(client, up_pipeline)
    pipeline_id, coder, _ = pipeline_with_roles(client)
    blocked = [
        {
            "pipeline_id": pipeline_id,
            "title": f"blocked {i}",
            "description": "",
            "priority": 100,
            "dependencies": [unfinished],
        }
        for i in range(30)
    ]
    r = client.post("/tasks/bulk", {"tasks": blocked})
    assert r.status == 201, r.body
    eligible = make_task(client, pipeline_id, priority=-5)
    assert claimed_id(claim(client, coder)) == eligible
    assert_nothing_to_claim(claim(client, coder, "agent-b"))


def test_claim_finds_eligible_work_behind_thirty_tasks_assigned_to_others(
    client: Client,
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    reserved = [
        {
            "pipeline_id": pipeline_id,
            "title": f"reserved {i}",
            "description": "",
            "priority": 100,
            "assigned_agent_id": "someone-else",
        }
        for i in range(30)
    ]
    r = client.post("/tasks/bulk", {"tasks": reserved})
    assert r.status == 201, r.body
    eligible = make_task(client, pipeline_id, priority=-5)
    assert claimed_id(claim(client, coder, "me")) == eligible


# --- input checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        "",
        "{",
        "[]",
        '{"agent_id": "a"}',
        '{"agent_role": "r"}',
        '{"agent_id": 1, "agent_role": "r"}',
        '{"agent_id": "a", "agent_role": "r", "lease_ttl_ms": 1.5}',
        '{"agent_id": "a", "agent_role": "r", "lease_ttl_ms": "soon"}',
        '{"agent_id": "a", "agent_role": "r", "concurrency": "lots"}',
    ],
    ids=[
        "empty",
        "truncated",
        "array",
        "no-role",
        "no-agent",
        "agent-not-string",
        "fractional-ttl",
        "text-ttl",
        "concurrency-not-object",
    ],
)
def test_claim_rejects_a_malformed_body_as_invalid_json(client: Client, body: str) -> None:
    r = client.post("/leases/claim", body=body, headers={"Content-Type": "application/json"})
    assert r.status == 400, r.body
    assert r.error_code == "invalid_json"


@pytest.mark.parametrize("ttl", [0, -1, -300_000])
def test_claim_rejects_a_lease_ttl_that_is_not_positive(client: Client, ttl: int) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    r = claim(client, coder, lease_ttl_ms=ttl)
    assert r.status == 400, r.body
    assert r.error_code == "invalid_lease_ttl"
    # Nothing was leased: the task is still there for a well-formed claim.
    assert "latest_run" not in client.get(f"/tasks/{task_id}").json
    assert claimed_id(claim(client, coder)) == task_id


@pytest.mark.parametrize("ttl", [DAY_MS * 365, 2**53, 2**63 - 1])
def test_claim_clamps_huge_lease_ttls_to_a_day(client: Client, ttl: int) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    before = now_ms()
    r = claim(client, coder, lease_ttl_ms=ttl)
    after = now_ms()
    assert r.status == 200, r.body
    assert before < r.json["expires_at_ms"] <= after + DAY_MS


def test_claim_ignores_unknown_fields(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    r = claim(client, coder, extra={"x": 1}, concurrency={"per_state": {}, "other": 3})
    assert claimed_id(r) == task_id


# --- idempotent claims (§3, Q9) ----------------------------------------------------------------


def test_idempotent_claim_replays_the_same_lease_with_a_working_token(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    make_task(client, pipeline_id)
    key = {"Idempotency-Key": unique("idem")}
    body = {"agent_id": "agent-i", "agent_role": coder}
    first = client.post("/leases/claim", body, headers=key)
    again = client.post("/leases/claim", body, headers=key)
    assert first.status == again.status == 200
    assert again.json["lease_id"] == first.json["lease_id"]
    assert again.json["run"] == first.json["run"]
    assert again.json["task"]["id"] == first.json["task"]["id"]
    assert HEX64.fullmatch(again.json["lease_token"])
    r = client.post(f"/leases/{again.json['lease_id']}/heartbeat", token=again.json["lease_token"])
    assert r.status == 200, r.body
    # The replay did not lease the second task.
    assert claim(client, coder, "agent-j").status == 200
    assert_nothing_to_claim(claim(client, coder, "agent-k"))


def test_idempotency_key_reused_with_another_body_is_a_conflict(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    key = {"Idempotency-Key": unique("idem")}
    assert (
        client.post("/leases/claim", {"agent_id": "a", "agent_role": coder}, headers=key).status
        == 200
    )
    r = client.post("/leases/claim", {"agent_id": "b", "agent_role": coder}, headers=key)
    assert r.status == 409
    assert r.error_code == "idempotency_conflict"
