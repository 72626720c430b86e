"""Resume and pause over real HTTP: checkpoints (an RFC 7396 merge kept on the task and handed to
the next claim with the earlier failures) and releases (a run put down on purpose, which frees
the task at once and never counts as a failed attempt)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import (
    claim,
    claimed,
    events,
    kinds,
    make_task,
    now_ms,
    pipeline_with_roles,
    task,
    unique,
    wait_until_stale,
)
from tests.server import Client, Response, Server

pytestmark = pytest.mark.e2e

SHORT_TTL = 300
FAILURE_KEYS = {"attempt", "run_id", "status", "error", "ended_at_ms"}


def put_checkpoint(client: Client, lease: dict[str, Any], patch: Any, **fields: Any) -> Response:
    return client.put(
        f"/runs/{lease['run']['id']}/checkpoint",
        {"checkpoint": patch, **fields},
        token=lease["lease_token"],
    )


def release(client: Client, lease: dict[str, Any], body: Any = None) -> Response:
    return client.post(f"/runs/{lease['run']['id']}/release", body, token=lease["lease_token"])


def fail(client: Client, lease: dict[str, Any], error: str) -> None:
    r = client.post(
        f"/runs/{lease['run']['id']}/fail", {"error": error}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body


# --- writing checkpoints -----------------------------------------------------------------------


def test_checkpoint_returns_the_merged_object_the_extended_lease_and_the_fence(
    client: Client,
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claimed(client, coder, lease_ttl_ms=60_000)
    time.sleep(0.02)  # so that the extension is visible

    before = now_ms()
    r = put_checkpoint(client, lease, {"step": 1, "files": ["a.py"]})
    after = now_ms()

    assert r.status == 200, r.body
    assert r.headers["content-type"] == "application/json"
    assert set(r.json) == {"checkpoint", "expires_at_ms", "fence"}
    assert r.json["checkpoint"] == {"step": 1, "files": ["a.py"]}
    assert r.json["fence"] == lease["fence"] == 1
    assert before + 60_000 <= r.json["expires_at_ms"] <= after + 60_000
    assert r.json["expires_at_ms"] > lease["expires_at_ms"]


def test_checkpoints_merge_as_rfc7396_merge_patches(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)

    first = {
        "step": 1,
        "gone": "soon",
        "nested": {"x": 1, "y": 2, "deep": {"keep": True, "drop": 0}},
        "list": [1, 2, 3],
        "scalar": "text",
    }
    r = put_checkpoint(client, lease, first)
    assert r.status == 200, r.body
    assert r.json["checkpoint"] == first

    patch = {
        "step": 2,  # scalars replace
        "gone": None,  # null removes the key
        "absent": None,  # removing a key that is not there is a no-op
        "nested": {"y": None, "z": 3, "deep": {"drop": None}},  # objects merge recursively
        "list": [9],  # arrays replace, they do not merge
        "scalar": {"now": "an object"},  # a scalar may become an object
        "new": [{"a": 1}],
    }
    r = put_checkpoint(client, lease, patch)
    assert r.status == 200, r.body
    expected = {
        "step": 2,
        "nested": {"x": 1, "z": 3, "deep": {"keep": True}},
        "list": [9],
        "scalar": {"now": "an object"},
        "new": [{"a": 1}],
    }
    assert r.json["checkpoint"] == expected

    # An object replaced by a scalar, and an empty patch that changes nothing.
    r = put_checkpoint(client, lease, {"nested": 5})
    assert r.json["checkpoint"] == {**expected, "nested": 5}
    r = put_checkpoint(client, lease, {})
    assert r.status == 200, r.body
    assert r.json["checkpoint"] == {**expected, "nested": 5}

    stored = client.get(f"/tasks/{task_id}/checkpoint")
    assert stored.status == 200, stored.body
    assert stored.json["checkpoint"] == {**expected, "nested": 5}
    assert task(client, task_id)["checkpoint"] == {**expected, "nested": 5}


@pytest.mark.parametrize("patch", [[], [1, 2], "text", 3, 1.5, True, None], ids=str)
def test_checkpoint_that_is_not_an_object_is_invalid_json(client: Client, patch: Any) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    assert put_checkpoint(client, lease, {"kept": 1}).status == 200

    r = put_checkpoint(client, lease, patch)
    assert r.status == 400, r.body
    assert r.error_code == "invalid_json"
    assert client.get(f"/tasks/{task_id}/checkpoint").json["checkpoint"] == {"kept": 1}
    assert kinds(client, lease["run"]["id"]).count("checkpoint") == 1


@pytest.mark.parametrize(
    "body", ["", "{", "[]", '{"expected_fence": 1}', '{"checkpoint": {}, "expected_fence": "x"}']
)
def test_checkpoint_with_a_malformed_body_is_invalid_json(client: Client, body: str) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claimed(client, coder)
    r = client.put(
        f"/runs/{lease['run']['id']}/checkpoint",
        body=body,
        headers={"Content-Type": "application/json"},
        token=lease["lease_token"],
    )
    assert r.status == 400, r.body
    assert r.error_code == "invalid_json"


def test_each_checkpoint_write_appends_a_checkpoint_event_with_the_patch(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claimed(client, coder)
    patches = [{"a": 1}, {"b": {"c": [1, 2]}}, {"a": None}]
    for patch in patches:
        assert put_checkpoint(client, lease, patch).status == 200
    written = [e for e in events(client, lease["run"]["id"]) if e["kind"] == "checkpoint"]
    assert [e["data"] for e in written] == patches
    assert all(e["run_id"] == lease["run"]["id"] for e in written)


def test_checkpoint_needs_the_runs_lease_token(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    run_id = lease["run"]["id"]

    r = client.put(f"/runs/{run_id}/checkpoint", {"checkpoint": {"x": 1}}, token="0" * 64)
    assert r.status == 401, r.body
    assert r.error_code == "unauthorized"
    r = client.put(f"/runs/{run_id}/checkpoint", {"checkpoint": {"x": 1}})
    assert r.status == 401, r.body
    r = client.put(
        f"/runs/{unique('run')}/checkpoint", {"checkpoint": {"x": 1}}, token=lease["lease_token"]
    )
    assert r.status == 404, r.body
    assert r.error_code == "not_found"
    assert client.get(f"/tasks/{task_id}/checkpoint").json["checkpoint"] is None


def test_checkpoint_with_the_current_fence_is_accepted(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claimed(client, coder)
    r = put_checkpoint(client, lease, {"x": 1}, expected_fence=lease["fence"])
    assert r.status == 200, r.body
    assert r.json["checkpoint"] == {"x": 1}
    assert r.json["fence"] == lease["fence"]


# --- reading checkpoints, and resuming -----------------------------------------------------------


def test_a_task_never_checkpointed_has_a_null_checkpoint(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    r = client.get(f"/tasks/{task_id}/checkpoint")
    assert r.status == 200, r.body
    assert r.json == {"task_id": task_id, "checkpoint": None, "fence": 0, "previous_failures": []}

    lease = claimed(client, coder)
    assert lease["task"]["checkpoint"] is None
    assert lease["task"]["previous_failures"] == []
    assert lease["task"]["fence"] == lease["fence"] == 1


def test_checkpoint_of_an_unknown_task_is_not_found(client: Client) -> None:
    r = client.get(f"/tasks/{unique('task')}/checkpoint")
    assert r.status == 404, r.body
    assert r.error_code == "task_not_found"


def test_next_claim_resumes_from_the_checkpoint_after_a_failure(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    first = claimed(client, coder, "agent-1")
    assert put_checkpoint(client, first, {"done": ["parse"], "cursor": 10}).status == 200
    assert put_checkpoint(client, first, {"cursor": 20}).status == 200
    fail(client, first, "out of memory")

    second = claimed(client, coder, "agent-2")
    assert second["task"]["id"] == task_id
    assert second["run"]["attempt"] == 2
    assert second["task"]["checkpoint"] == {"done": ["parse"], "cursor": 20}
    assert second["fence"] == second["task"]["fence"] == 2
    [failure] = second["task"]["previous_failures"]
    assert set(failure) == FAILURE_KEYS
    assert failure["attempt"] == 1
    assert failure["run_id"] == first["run"]["id"]
    assert failure["status"] == "failed"
    assert failure["error"] == "out of memory"
    assert first["run"]["started_at_ms"] <= failure["ended_at_ms"] <= now_ms()

    # The next attempt keeps merging into what the earlier one left.
    r = put_checkpoint(client, second, {"done": ["parse", "plan"]})
    assert r.json["checkpoint"] == {"done": ["parse", "plan"], "cursor": 20}
    assert r.json["fence"] == 2


def test_previous_failures_are_newest_first_and_name_expired_leases(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    first = claimed(client, coder, "agent-1")
    fail(client, first, "boom")
    second = claimed(client, coder, "agent-2", lease_ttl_ms=SHORT_TTL)  # and it vanishes
    assert put_checkpoint(client, second, {"from": "second"}).status == 200
    wait_until_stale(client, task_id, second["run"]["id"])

    third = claimed(client, coder, "agent-3")
    assert third["run"]["attempt"] == 3
    assert third["fence"] == 3
    assert third["task"]["checkpoint"] == {"from": "second"}
    failures = third["task"]["previous_failures"]
    assert [(f["attempt"], f["run_id"], f["status"], f["error"]) for f in failures] == [
        (2, second["run"]["id"], "stale", "lease_expired"),
        (1, first["run"]["id"], "failed", "boom"),
    ]
    assert failures[0]["ended_at_ms"] >= failures[1]["ended_at_ms"]

    # The task's details and its checkpoint route tell the same story.
    details = task(client, task_id)
    assert details["checkpoint"] == {"from": "second"}
    assert details["fence"] == 3
    assert details["previous_failures"] == failures
    assert client.get(f"/tasks/{task_id}/checkpoint").json == {
        "task_id": task_id,
        "checkpoint": {"from": "second"},
        "fence": 3,
        "previous_failures": failures,
    }


def test_checkpoint_lives_on_the_task_across_stages(client: Client) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    assert put_checkpoint(client, lease, {"branch": "feature/x"}).status == 200
    r = client.post(
        f"/runs/{lease['run']['id']}/transition",
        {"trigger": "submit"},
        token=lease["lease_token"],
    )
    assert r.status == 200, r.body
    review = claimed(client, reviewer, "agent-r")
    assert review["task"]["id"] == task_id
    assert review["task"]["checkpoint"] == {"branch": "feature/x"}
    assert review["task"]["previous_failures"] == []
    assert review["fence"] == 2


# --- releasing a run ---------------------------------------------------------------------------


def test_release_ends_the_run_and_frees_the_task_at_once(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    # A long retry delay: a release must not apply it.
    task_id = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 600_000})
    lease = claimed(client, coder, "pauser")
    assert claim(client, coder, "other").status == 204

    r = release(client, lease, {"reason": "context window full"})
    assert r.status == 200, r.body
    assert r.json == {"status": "released", "run_id": lease["run"]["id"], "task_id": task_id}

    hb = client.post(f"/leases/{lease['lease_id']}/heartbeat", token=lease["lease_token"])
    assert hb.status == 404, hb.body
    assert hb.error_code == "not_found"

    details = task(client, task_id)
    run = details["latest_run"]
    assert run["id"] == lease["run"]["id"]
    assert run["status"] == "released"
    assert run["ended_at_ms"] is not None
    assert details["stage"] == "todo"
    assert details["previous_failures"] == []
    assert details["next_eligible_at_ms"] <= now_ms()

    again = claimed(client, coder, "other")
    assert again["task"]["id"] == task_id
    assert again["run"]["attempt"] == 2
    assert again["task"]["previous_failures"] == []


def test_release_writes_a_released_event_and_no_failure(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claimed(client, coder, "pauser")
    assert release(client, lease, {"reason": "user interrupt"}).status == 200
    run_events = events(client, lease["run"]["id"])
    [released] = [e for e in run_events if e["kind"] == "released"]
    assert released["data"] == {"reason": "user interrupt", "agent_id": "pauser"}
    assert released["run_id"] == lease["run"]["id"]
    found = {e["kind"] for e in run_events}
    assert not found & {"lease_expired", "retry_scheduled", "dead_letter"}


def test_release_without_a_body_works(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder, "quiet")
    r = client.post(f"/runs/{lease['run']['id']}/release", token=lease["lease_token"])
    assert r.status == 200, r.body
    assert r.json == {"status": "released", "run_id": lease["run"]["id"], "task_id": task_id}
    [released] = [e for e in events(client, lease["run"]["id"]) if e["kind"] == "released"]
    assert set(released["data"]) == {"reason", "agent_id"}
    assert released["data"]["agent_id"] == "quiet"


def test_release_never_counts_as_a_failed_attempt(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(
        client, pipeline_id, retry_policy={"max_attempts": 1, "dead_letter_stage": "dead"}
    )
    for n in range(1, 6):
        lease = claimed(client, coder, f"agent-{n}")
        assert lease["task"]["id"] == task_id
        assert lease["run"]["attempt"] == n
        assert lease["fence"] == n
        assert lease["task"]["previous_failures"] == []
        assert release(client, lease, {"reason": f"pause {n}"}).status == 200
        details = task(client, task_id)
        assert details["stage"] == "todo"
        assert details["dead_letter_reason"] is None
        assert details["previous_failures"] == []

    # The one allowed failure is still there to spend: it dead-letters now, not before.
    lease = claimed(client, coder, "agent-last")
    fail(client, lease, "real failure")
    details = task(client, task_id)
    assert details["stage"] == "dead"
    assert details["dead_letter_reason"] == "max_attempts_exceeded"
    assert [f["status"] for f in details["previous_failures"]] == ["failed"]


def test_a_released_run_can_no_longer_write(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    assert put_checkpoint(client, lease, {"before": True}).status == 200
    assert release(client, lease).status == 200
    run_id, token = lease["run"]["id"], lease["lease_token"]
    for method, path, body in [
        ("PUT", f"/runs/{run_id}/checkpoint", {"checkpoint": {"after": True}}),
        ("POST", f"/runs/{run_id}/events", {"kind": "late"}),
        ("POST", f"/runs/{run_id}/transition", {"trigger": "submit"}),
        ("POST", f"/runs/{run_id}/fail", {"error": "late"}),
        ("POST", f"/runs/{run_id}/release", {"reason": "twice"}),
    ]:
        r = client.request(method, path, body, token=token)
        assert r.status == 404, (path, r.status, r.body)
        assert r.error_code == "not_found"
    details = task(client, task_id)
    assert details["stage"] == "todo"
    assert details["checkpoint"] == {"before": True}
    assert details["latest_run"]["status"] == "released"
    assert details["previous_failures"] == []


def test_release_keeps_the_checkpoint_for_the_next_claim(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claimed(client, coder, "first")
    assert put_checkpoint(client, lease, {"progress": 0.5}).status == 200
    assert release(client, lease, {"reason": "handing over"}).status == 200
    resumed = claimed(client, coder, "second")
    assert resumed["task"]["checkpoint"] == {"progress": 0.5}
    assert resumed["task"]["previous_failures"] == []
    assert resumed["fence"] == 2


def test_release_needs_the_runs_lease_token(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    r = client.post(f"/runs/{lease['run']['id']}/release", token="0" * 64)
    assert r.status == 401, r.body
    assert r.error_code == "unauthorized"
    assert task(client, task_id)["latest_run"]["status"] == "running"
    assert claim(client, coder, "other").status == 204


def test_release_with_the_current_fence_is_accepted(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claimed(client, coder)
    r = release(client, lease, {"reason": "done for today", "expected_fence": lease["fence"]})
    assert r.status == 200, r.body
    assert r.json["status"] == "released"


# --- releasing everything an agent holds ---------------------------------------------------------


def test_agent_release_releases_every_live_lease_of_that_agent(client: Client) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    mine = [make_task(client, pipeline_id) for _ in range(2)]
    theirs = make_task(client, pipeline_id)
    agent = unique("agent")
    leases = [claimed(client, coder, agent) for _ in range(2)]
    other = claimed(client, coder, "someone-else")
    assert {lease["task"]["id"] for lease in leases} | {other["task"]["id"]} == {*mine, theirs}

    r = client.post("/agents/release", {"agent_id": agent, "reason": "shutting down"})
    assert r.status == 200, r.body
    assert set(r.json) == {"agent_id", "released"}
    assert r.json["agent_id"] == agent
    assert sorted(r.json["released"], key=lambda x: x["run_id"]) == sorted(
        [
            {"status": "released", "run_id": lease["run"]["id"], "task_id": lease["task"]["id"]}
            for lease in leases
        ],
        key=lambda x: x["run_id"],
    )
    for lease in leases:
        assert task(client, lease["task"]["id"])["latest_run"]["status"] == "released"
        [released] = [e for e in events(client, lease["run"]["id"]) if e["kind"] == "released"]
        assert released["data"] == {"reason": "shutting down", "agent_id": agent}
        hb = client.post(f"/leases/{lease['lease_id']}/heartbeat", token=lease["lease_token"])
        assert hb.status == 404, hb.body

    # The other agent's lease is untouched; the released tasks are claimable at once.
    hb = client.post(f"/leases/{other['lease_id']}/heartbeat", token=other["lease_token"])
    assert hb.status == 200, hb.body
    again = {claimed(client, coder, "next")["task"]["id"] for _ in range(2)}
    assert again == {lease["task"]["id"] for lease in leases}
    assert claim(client, coder, "next").status == 204
    assert claim(client, reviewer, "next").status == 204


def test_agent_release_of_an_agent_holding_nothing_releases_nothing(client: Client) -> None:
    agent = unique("idle")
    r = client.post("/agents/release", {"agent_id": agent})
    assert r.status == 200, r.body
    assert r.json == {"agent_id": agent, "released": []}


def test_agent_release_skips_runs_that_already_ended(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    agent = unique("agent")
    done = claimed(client, coder, agent)
    fail(client, done, "gave up")
    live = claimed(client, coder, agent)  # the same task again, a new run
    assert live["run"]["id"] != done["run"]["id"]
    r = client.post("/agents/release", {"agent_id": agent})
    assert r.status == 200, r.body
    assert r.json["released"] == [
        {"status": "released", "run_id": live["run"]["id"], "task_id": live["task"]["id"]}
    ]
    assert client.post("/agents/release", {"agent_id": agent}).json["released"] == []


def test_agent_release_is_an_admin_route(make_server: Callable[..., Server]) -> None:
    server = make_server(token="admin-secret")
    c = server.client()
    try:
        r = c.post("/agents/release", {"agent_id": "a"})
        assert r.status == 401, r.body
        assert r.error_code == "unauthorized"
        r = c.post("/agents/release", {"agent_id": "a"}, token="admin-secret")
        assert r.status == 200, r.body
        assert r.json == {"agent_id": "a", "released": []}
    finally:
        c.close()
