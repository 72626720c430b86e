"""Per-stage policy in a pipeline definition (lease TTL, retry delay with backoff, a cap and
jitter, a concurrency cap), validated when the pipeline is created and applied to claims and
failures; and task idempotency keys, which make re-running a plan create nothing twice."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import (
    claim,
    claimed,
    create_pipeline,
    make_task,
    pipeline_with_roles,
    unique,
    wait_for,
)
from tests.server import Client, Response

pytestmark = pytest.mark.e2e

DEFAULT_TTL_MS = 300_000


def claim_when_offered(client: Client, role: str, agent: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        r = claim(client, role, agent)
        assert r.status in (200, 204), r.body
        return dict(r.json) if r.status == 200 else None

    return dict(wait_for("the task to be offered again", probe))


def fail(client: Client, lease: dict[str, Any], error: str = "boom") -> dict[str, Any]:
    """Fail the run; returns the data of its retry_scheduled event."""
    run_id = lease["run"]["id"]
    r = client.post(f"/runs/{run_id}/fail", {"error": error}, token=lease["lease_token"])
    assert r.status == 200, r.body
    r = client.get(f"/runs/{run_id}/events")
    [retry] = [e for e in r.json["items"] if e["kind"] == "retry_scheduled"]
    return dict(retry["data"])


def policy_pipeline(
    client: Client, todo_policy: dict[str, Any], review_policy: dict[str, Any] | None = None
) -> tuple[str, str, str]:
    """todo -submit-> review -approve-> done, with unique roles and the given stage policies.
    Returns (pipeline_id, coder_role, reviewer_role)."""
    coder, reviewer = unique("coder"), unique("reviewer")
    definition = {
        "initial": "todo",
        "states": {
            "todo": {"agent_role": coder, **todo_policy},
            "review": {"agent_role": reviewer, **(review_policy or {})},
            "done": {"terminal": True},
            "dead": {"terminal": True},
        },
        "transitions": [
            {"from": "todo", "to": "review", "trigger": "submit"},
            {"from": "review", "to": "done", "trigger": "approve"},
        ],
    }
    return create_pipeline(client, definition), coder, reviewer


def post_pipeline(client: Client, policy: dict[str, Any]) -> Response:
    definition = {
        "initial": "todo",
        "states": {"todo": {"agent_role": unique("role"), **policy}, "done": {"terminal": True}},
        "transitions": [{"from": "todo", "to": "done", "trigger": "submit"}],
    }
    return client.post("/pipelines", {"name": unique("pipe"), "definition": definition})


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lease_ttl_ms", 0),
        ("lease_ttl_ms", -1),
        ("lease_ttl_ms", 86_400_001),
        ("lease_ttl_ms", 1.5),
        ("lease_ttl_ms", "60000"),
        ("lease_ttl_ms", True),
        ("retry_delay_ms", -1),
        ("retry_delay_ms", 0.5),
        ("retry_delay_ms", "1000"),
        ("retry_backoff", 0.5),
        ("retry_backoff", 0),
        ("retry_backoff", 100.5),
        ("retry_backoff", "2"),
        ("retry_backoff", False),
        ("retry_max_delay_ms", -1),
        ("retry_max_delay_ms", 2.5),
        ("retry_jitter", -0.1),
        ("retry_jitter", 1.01),
        ("retry_jitter", "0.5"),
        ("max_concurrency", 0),
        ("max_concurrency", -3),
        ("max_concurrency", 1.5),
        ("max_concurrency", [1]),
    ],
)
def test_invalid_stage_policy_is_refused_naming_the_key(
    client: Client, key: str, value: Any
) -> None:
    r = post_pipeline(client, {key: value})
    assert r.status == 400, (key, value, r.status, r.body)
    assert r.error_code == "validation_failed"
    assert key in r.json["error"]["message"], r.json


@pytest.mark.parametrize(
    "key",
    [
        "retry_delay",
        "retry_delay_s",
        "retry_max_delay",
        "Retry_Backoff",
        "lease_ttl",
        "lease_ms",
        "max_concurency",
        "maxconcurrency",
        "max_attempts",
        "dead_letter_stage",
        "retry_policy",
    ],
)
def test_an_unknown_stage_policy_key_is_refused_naming_it(client: Client, key: str) -> None:
    r = post_pipeline(client, {key: 1000})
    assert r.status == 400, (key, r.body)
    assert r.error_code == "validation_failed"
    message = r.json["error"]["message"]
    assert f"$.states.todo.{key}" in message and "retry_delay_ms" in message, message


def test_other_keys_of_a_state_are_kept_and_ignored(client: Client) -> None:
    """The contract ignores unknown keys of a state: only ones that look like a policy key
    are refused."""
    extra = {"x_state": True, "model": "m-1", "max_tokens": 4000, "prompt": "review it"}
    r = post_pipeline(client, {"retry_delay_ms": 10, **extra})
    assert r.status == 201, r.body
    stored = client.get(f"/pipelines/{r.json['id']}").json["definition"]["states"]["todo"]
    assert {k: stored[k] for k in extra} == extra


@pytest.mark.parametrize(
    "policy",
    [
        {"lease_ttl_ms": 1},
        {"lease_ttl_ms": 86_400_000},
        {"retry_delay_ms": 0},
        {"retry_delay_ms": 3_600_000},
        {"retry_backoff": 1},
        {"retry_backoff": 2.5},
        {"retry_backoff": 100},
        {"retry_max_delay_ms": 0},
        {"retry_jitter": 0},
        {"retry_jitter": 0.25},
        {"retry_jitter": 1},
        {"max_concurrency": 1},
        {"max_concurrency": 50},
        {
            "lease_ttl_ms": 60_000,
            "retry_delay_ms": 1_000,
            "retry_backoff": 2,
            "retry_max_delay_ms": 30_000,
            "retry_jitter": 0.1,
            "max_concurrency": 3,
        },
    ],
    ids=str,
)
def test_valid_stage_policy_is_accepted(client: Client, policy: dict[str, Any]) -> None:
    r = post_pipeline(client, policy)
    assert r.status == 201, (policy, r.body)


# --- the stage's lease TTL ---------------------------------------------------------------------


def test_claim_without_a_ttl_gets_the_stages_lease_ttl(client: Client) -> None:
    pipeline_id, coder, reviewer = policy_pipeline(
        client, {"lease_ttl_ms": 45_000}, {"lease_ttl_ms": 7_000}
    )
    make_task(client, pipeline_id)
    lease = claimed(client, coder)
    assert lease["expires_at_ms"] - lease["run"]["started_at_ms"] == 45_000

    r = client.post(
        f"/runs/{lease['run']['id']}/transition", {"trigger": "submit"}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body
    review = claimed(client, reviewer)
    assert review["expires_at_ms"] - review["run"]["started_at_ms"] == 7_000


def test_a_claims_own_ttl_wins_over_the_stages(client: Client) -> None:
    pipeline_id, coder, _ = policy_pipeline(client, {"lease_ttl_ms": 45_000})
    make_task(client, pipeline_id)
    lease = claimed(client, coder, lease_ttl_ms=120_000)
    assert lease["expires_at_ms"] - lease["run"]["started_at_ms"] == 120_000


def test_a_stage_without_a_ttl_keeps_the_default(client: Client) -> None:
    pipeline_id, coder, _ = policy_pipeline(client, {"max_concurrency": 5})
    make_task(client, pipeline_id)
    lease = claimed(client, coder)
    assert lease["expires_at_ms"] - lease["run"]["started_at_ms"] == DEFAULT_TTL_MS


# --- the stage's retry delay -------------------------------------------------------------------


def test_stage_retry_delay_grows_by_the_backoff_up_to_the_cap(client: Client) -> None:
    pipeline_id, coder, _ = policy_pipeline(
        client, {"retry_delay_ms": 100, "retry_backoff": 2, "retry_max_delay_ms": 300}
    )
    task_id = make_task(client, pipeline_id)
    delays = []
    for n in range(1, 5):
        lease = claim_when_offered(client, coder, f"agent-{n}")
        assert lease["task"]["id"] == task_id
        assert lease["run"]["attempt"] == n
        retry = fail(client, lease)
        assert retry["failed_attempts"] == n
        details = client.get(f"/tasks/{task_id}").json
        ended = details["latest_run"]["ended_at_ms"]
        assert retry["next_eligible_at_ms"] == details["next_eligible_at_ms"]
        assert retry["next_eligible_at_ms"] == ended + retry["retry_delay_ms"]
        delays.append(retry["retry_delay_ms"])
    # 100, 100 * 2, 100 * 4 capped at 300, 100 * 8 capped at 300.
    assert delays == [100, 200, 300, 300]


def test_stage_retry_delay_example_from_the_docs(client: Client) -> None:
    """delay 1000, backoff 2, cap 3000: 1000, 2000, then 3000 (not 4000). The retries are
    scheduled but never waited for: each failure is of a fresh task at its n-th attempt."""
    pipeline_id, coder, _ = policy_pipeline(
        client, {"retry_delay_ms": 1_000, "retry_backoff": 2, "retry_max_delay_ms": 3_000}
    )
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    assert fail(client, lease)["retry_delay_ms"] == 1_000
    assert claim(client, coder).status == 204  # not before the delay
    details = client.get(f"/tasks/{task_id}").json
    assert details["next_eligible_at_ms"] == details["latest_run"]["ended_at_ms"] + 1_000


def test_stage_backoff_without_a_cap_keeps_growing(client: Client) -> None:
    pipeline_id, coder, _ = policy_pipeline(client, {"retry_delay_ms": 50, "retry_backoff": 3})
    make_task(client, pipeline_id)
    delays = []
    for n in range(1, 4):
        lease = claim_when_offered(client, coder, f"agent-{n}")
        delays.append(fail(client, lease)["retry_delay_ms"])
    assert delays == [50, 150, 450]


def test_a_tasks_own_retry_delay_wins_over_the_stages(client: Client) -> None:
    pipeline_id, coder, _ = policy_pipeline(client, {"retry_delay_ms": 600_000})
    own = make_task(client, pipeline_id, priority=3, retry_policy={"retry_delay_ms": 5_000})
    unset = make_task(client, pipeline_id, priority=2, retry_policy={"max_attempts": 5})
    bare = make_task(client, pipeline_id, priority=1)
    zero = make_task(client, pipeline_id, priority=0, retry_policy={"retry_delay_ms": 0})
    got = {}
    for task_id in (own, unset, bare, zero):
        lease = claimed(client, coder)
        assert lease["task"]["id"] == task_id
        got[task_id] = fail(client, lease)["retry_delay_ms"]
    assert got == {own: 5_000, unset: 600_000, bare: 600_000, zero: 0}


def test_an_expired_lease_also_uses_the_stages_retry_delay(client: Client) -> None:
    pipeline_id, coder, _ = policy_pipeline(client, {"retry_delay_ms": 60_000, "lease_ttl_ms": 200})
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    assert lease["expires_at_ms"] - lease["run"]["started_at_ms"] == 200

    def stale() -> dict[str, Any] | None:
        details = client.get(f"/tasks/{task_id}").json
        return details if details["latest_run"]["status"] == "stale" else None

    details = wait_for("the lease to expire", stale)
    assert details["next_eligible_at_ms"] == details["latest_run"]["ended_at_ms"] + 60_000


# --- the stage's concurrency cap ---------------------------------------------------------------


def test_max_concurrency_one_holds_back_a_second_claim_until_the_first_lease_ends(
    client: Client,
) -> None:
    pipeline_id, coder, _ = policy_pipeline(client, {"max_concurrency": 1})
    first_id = make_task(client, pipeline_id, priority=1)
    second_id = make_task(client, pipeline_id)
    first = claimed(client, coder, "agent-1")
    assert first["task"]["id"] == first_id
    assert claim(client, coder, "agent-2").status == 204
    assert claim(client, coder, "agent-2").status == 204

    r = client.post(
        f"/runs/{first['run']['id']}/transition", {"trigger": "submit"}, token=first["lease_token"]
    )
    assert r.status == 200, r.body
    second = claimed(client, coder, "agent-2")
    assert second["task"]["id"] == second_id

    # A release frees the slot as well.
    third_id = make_task(client, pipeline_id)
    assert claim(client, coder, "agent-3").status == 204
    r = client.post(f"/runs/{second['run']['id']}/release", token=second["lease_token"])
    assert r.status == 200, r.body
    assert claimed(client, coder, "agent-3")["task"]["id"] in (second_id, third_id)
    assert claim(client, coder, "agent-4").status == 204


def test_max_concurrency_counts_only_its_own_stage(client: Client) -> None:
    pipeline_id, coder, reviewer = policy_pipeline(client, {"max_concurrency": 1})
    make_task(client, pipeline_id, priority=1)
    make_task(client, pipeline_id)
    first = claimed(client, coder)
    r = client.post(
        f"/runs/{first['run']['id']}/transition", {"trigger": "submit"}, token=first["lease_token"]
    )
    assert r.status == 200, r.body
    claimed(client, reviewer)  # a lease in `review` does not fill `todo`
    claimed(client, coder)
    assert claim(client, coder).status == 204


def test_max_concurrency_counts_per_pipeline(client: Client) -> None:
    """Two pipelines share a role and a stage name; each caps its own leases."""
    role = unique("coder")
    ids = []
    for _ in range(2):
        definition = {
            "initial": "todo",
            "states": {
                "todo": {"agent_role": role, "max_concurrency": 2},
                "done": {"terminal": True},
            },
            "transitions": [{"from": "todo", "to": "done", "trigger": "submit"}],
        }
        pipeline_id = create_pipeline(client, definition)
        ids.append(pipeline_id)
        for _ in range(3):
            make_task(client, pipeline_id)
    leases = [claimed(client, role, f"agent-{n}") for n in range(4)]
    per_pipeline = [sum(1 for x in leases if x["task"]["pipeline_id"] == p) for p in ids]
    assert per_pipeline == [2, 2]
    assert claim(client, role, "agent-5").status == 204


def test_max_concurrency_frees_the_slot_when_a_lease_expires(client: Client) -> None:
    pipeline_id, coder, _ = policy_pipeline(client, {"max_concurrency": 1, "lease_ttl_ms": 200})
    first_id = make_task(client, pipeline_id, priority=1)
    second_id = make_task(client, pipeline_id)
    doomed = claimed(client, coder, "doomed")
    assert doomed["task"]["id"] == first_id
    assert claim(client, coder, "next").status == 204

    def offered() -> dict[str, Any] | None:
        r = claim(client, coder, "next", lease_ttl_ms=60_000)
        return dict(r.json) if r.status == 200 else None

    lease = wait_for("the slot to be freed", offered)
    assert lease["run"]["started_at_ms"] >= doomed["expires_at_ms"]
    # The expired task is retried at once and outranks the other; the slot is full again.
    assert lease["task"]["id"] == first_id
    assert claim(client, coder, "other").status == 204
    assert claim(client, coder, "other").status == 204
    assert client.get(f"/tasks/{second_id}").json.get("latest_run") is None


# --- task idempotency keys ---------------------------------------------------------------------


def count_tasks(client: Client, pipeline_id: str) -> int:
    r = client.get(f"/tasks?pipeline_id={pipeline_id}&limit=1000")
    assert r.status == 200, r.body
    return len(r.json["items"])


def test_same_idempotency_key_in_the_same_pipeline_returns_the_existing_task(
    client: Client,
) -> None:
    pipeline_id, _, _ = pipeline_with_roles(client)
    key = unique("key")
    body = {"pipeline_id": pipeline_id, "title": "build it", "description": "", "priority": 2}
    first = client.post("/tasks", {**body, "idempotency_key": key})
    assert first.status == 201, first.body
    again = client.post("/tasks", {**body, "idempotency_key": key})
    assert again.status == 201, again.body
    assert again.json == first.json
    assert count_tasks(client, pipeline_id) == 1
    assert client.get(f"/tasks/{first.json['id']}").json["task_version"] == 1

    # A different key, or no key at all, creates a new task as before.
    other = client.post("/tasks", {**body, "idempotency_key": unique("key")})
    assert other.status == 201 and other.json["id"] != first.json["id"]
    plain = [client.post("/tasks", body) for _ in range(2)]
    assert len({r.json["id"] for r in plain} | {first.json["id"], other.json["id"]}) == 4
    assert count_tasks(client, pipeline_id) == 4


def test_same_idempotency_key_in_another_pipeline_creates_a_new_task(client: Client) -> None:
    first_pipeline, _, _ = pipeline_with_roles(client)
    second_pipeline, _, _ = pipeline_with_roles(client)
    key = unique("key")
    a = make_task(client, first_pipeline, idempotency_key=key)
    b = make_task(client, second_pipeline, idempotency_key=key)
    assert a != b
    assert client.get(f"/tasks/{b}").json["pipeline_id"] == second_pipeline
    assert make_task(client, first_pipeline, idempotency_key=key) == a
    assert make_task(client, second_pipeline, idempotency_key=key) == b
    assert count_tasks(client, first_pipeline) == count_tasks(client, second_pipeline) == 1


def test_rerunning_a_bulk_plan_returns_the_same_ids_and_creates_nothing(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    plan_id = unique("plan")
    plan = [
        {
            "pipeline_id": pipeline_id,
            "title": f"step {n}",
            "description": "",
            "idempotency_key": f"{plan_id}/step-{n}",
        }
        for n in range(4)
    ]
    first = client.post("/tasks/bulk", {"tasks": plan})
    assert first.status == 201, first.body
    ids = first.json["ids"]
    assert len(set(ids)) == 4
    assert count_tasks(client, pipeline_id) == 4

    for _ in range(2):
        again = client.post("/tasks/bulk", {"tasks": plan})
        assert again.status == 201, again.body
        assert again.json["ids"] == ids
    assert count_tasks(client, pipeline_id) == 4

    # A plan that grows by one step creates only that step; the others keep their ids.
    grown = [*plan, {**plan[0], "title": "step 4", "idempotency_key": f"{plan_id}/step-4"}]
    r = client.post("/tasks/bulk", {"tasks": grown})
    assert r.status == 201, r.body
    assert r.json["ids"][:4] == ids
    assert r.json["ids"][4] not in ids
    assert count_tasks(client, pipeline_id) == 5

    # Single and bulk creation share the keys.
    assert make_task(client, pipeline_id, idempotency_key=f"{plan_id}/step-2") == ids[2]
    assert count_tasks(client, pipeline_id) == 5

    # Re-running a plan does not make a claimed task claimable twice.
    claimed(client, coder)
    assert client.post("/tasks/bulk", {"tasks": plan}).json["ids"] == ids
    assert count_tasks(client, pipeline_id) == 5


def test_a_repeated_key_within_one_bulk_request_creates_one_task(client: Client) -> None:
    pipeline_id, _, _ = pipeline_with_roles(client)
    key = unique("key")
    element = {"pipeline_id": pipeline_id, "title": "t", "description": "", "idempotency_key": key}
    r = client.post("/tasks/bulk", {"tasks": [element, element]})
    assert r.status == 201, r.body
    first, second = r.json["ids"]
    assert first == second
    assert count_tasks(client, pipeline_id) == 1
