"""Operator verbs over real HTTP: `POST /tasks/{id}/requeue` brings a dead-lettered, cancelled,
failed or waiting task back to claimable now; `POST /tasks/{id}/cancel` takes a task out of the
claim path for good and revokes a live lease on it. Both record task events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import (
    claim,
    claimed,
    create_pipeline,
    kinds,
    make_task,
    pipeline_with_roles,
    task,
    unique,
    wait_for,
)
from tests.server import TASK_FIELDS, Client, Response, Server

pytestmark = pytest.mark.e2e

LONG_WAIT_MS = 20_000


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


def requeue(client: Client, task_id: str, payload: Any = None, **kw: Any) -> Response:
    return client.post(f"/tasks/{task_id}/requeue", payload, **kw)


def cancel(client: Client, task_id: str, payload: Any = None, **kw: Any) -> Response:
    return client.post(f"/tasks/{task_id}/cancel", payload, **kw)


def task_events(client: Client, task_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/tasks/{task_id}/events")
    assert r.status == 200, r.body
    return list(r.json["items"])


def fail(client: Client, lease: dict[str, Any], error: str = "boom") -> Response:
    return client.post(
        f"/runs/{lease['run']['id']}/fail", {"error": error}, token=lease["lease_token"]
    )


def move(client: Client, lease: dict[str, Any], trigger: str) -> Response:
    return client.post(
        f"/runs/{lease['run']['id']}/transition", {"trigger": trigger}, token=lease["lease_token"]
    )


def dead_lettered(
    client: Client, retry_policy: dict[str, Any] | None = None
) -> tuple[str, str, str]:
    """A task whose only attempt failed under max_attempts 1: (pipeline, coder role, task)."""
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy=retry_policy or {"max_attempts": 1})
    assert fail(client, claimed(client, coder)).status == 200
    details = task(client, task_id)
    assert details["dead_letter_reason"] == "max_attempts_exceeded"
    assert claim(client, coder).status == 204
    return pipeline_id, coder, task_id


def long_poll(pool: ThreadPoolExecutor, server: Server, role: str, wait_ms: int) -> Future[Any]:
    """A long-poll claim in a thread on its own connection; its result is (response, the
    monotonic time it answered). Returns once the claim is waiting on the server."""

    def run() -> tuple[Response, float]:
        c = server.client()
        try:
            r = claim(c, role, unique("poller"), wait_ms=wait_ms)
            return r, time.monotonic()
        finally:
            c.close()

    waiting = pool.submit(run)
    time.sleep(0.3)  # time for the claim to reach the server
    assert not waiting.done(), "the long-poll claim answered before anything happened"
    return waiting


# --- requeue -----------------------------------------------------------------------------------


def test_requeue_of_a_dead_lettered_task_makes_it_claimable_at_once(client: Client) -> None:
    _, coder, task_id = dead_lettered(client)
    r = requeue(client, task_id)
    assert r.status == 200, r.body
    assert r.json == task(client, task_id)  # the answer is the task as GET /tasks/{id} shows it
    assert list(r.json)[: len(TASK_FIELDS)] == TASK_FIELDS
    assert r.json["stage"] == "todo"
    assert r.json["dead_letter_reason"] is None
    assert r.json["next_eligible_at_ms"] == 0
    lease = claimed(client, coder)
    assert lease["task"]["id"] == task_id
    assert lease["run"]["attempt"] == 2


def test_requeue_accepts_an_empty_body_and_an_empty_object(client: Client) -> None:
    _, coder, task_id = dead_lettered(client)
    assert requeue(client, task_id, body=b"").status == 200
    assert fail(client, claimed(client, coder)).status == 200  # dead-lettered again
    assert requeue(client, task_id, {}).status == 200
    assert claimed(client, coder)["task"]["id"] == task_id


def test_requeue_brings_a_task_back_from_its_dead_letter_stage(client: Client) -> None:
    _, coder, task_id = dead_lettered(client, {"max_attempts": 1, "dead_letter_stage": "dead"})
    before = task(client, task_id)
    assert before["stage"] == "dead"
    r = requeue(client, task_id)
    assert r.status == 200, r.body
    assert r.json["stage"] == "todo"  # the stage it was dead-lettered from
    assert r.json["task_version"] == before["task_version"] + 1
    assert r.json["dead_letter_reason"] is None
    assert claimed(client, coder)["task"]["id"] == task_id


def test_requeue_from_a_non_terminal_dead_letter_stage_goes_back_too(client: Client) -> None:
    coder, triager = unique("coder"), unique("triager")
    definition = {
        "initial": "todo",
        "states": {
            "todo": {"agent_role": coder},
            "triage": {"agent_role": triager},
            "done": {"terminal": True},
        },
        "transitions": [
            {"from": "todo", "to": "done", "trigger": "finish"},
            {"from": "triage", "to": "todo", "trigger": "retry"},
        ],
    }
    pipeline_id = create_pipeline(client, definition)
    policy = {"max_attempts": 1, "dead_letter_stage": "triage"}
    task_id = make_task(client, pipeline_id, retry_policy=policy)
    assert fail(client, claimed(client, coder)).status == 200
    assert task(client, task_id)["stage"] == "triage"
    assert claim(client, triager).status == 204  # dead-lettered: not claimable even there
    assert requeue(client, task_id).json["stage"] == "todo"
    assert claimed(client, coder)["task"]["id"] == task_id


def test_a_waiting_long_poll_claim_gets_a_requeued_task(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    _, coder, task_id = dead_lettered(client)
    waiting = long_poll(pool, shared_server, coder, LONG_WAIT_MS)
    fired = time.monotonic()
    assert requeue(client, task_id).status == 200
    r, answered = waiting.result(timeout=LONG_WAIT_MS / 1000 + 10)
    assert r.status == 200, r.body
    assert r.json["task"]["id"] == task_id
    # Woken by the requeue, not by the long poll's last look when its time ran out.
    assert answered - fired < LONG_WAIT_MS / 1000


def test_requeue_clears_a_retry_delay(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 3_600_000})
    assert fail(client, claimed(client, coder)).status == 200
    assert task(client, task_id)["next_eligible_at_ms"] > time.time() * 1000 + 3_000_000
    assert claim(client, coder).status == 204
    r = requeue(client, task_id, {"reason": "do not wait"})
    assert r.json["next_eligible_at_ms"] == 0
    assert claimed(client, coder)["task"]["id"] == task_id
    [event] = task_events(client, task_id)
    assert event["data"]["was"] == "retry_wait"


def test_requeue_into_a_given_stage(client: Client) -> None:
    _, _, task_id = dead_lettered(client)
    pipeline_id = task(client, task_id)["pipeline_id"]
    reviewer = client.get(f"/pipelines/{pipeline_id}").json["definition"]["states"]["review"][
        "agent_role"
    ]
    r = requeue(client, task_id, {"stage": "review"})
    assert r.status == 200, r.body
    assert r.json["stage"] == "review"
    assert [t["trigger"] for t in r.json["available_transitions"]] == ["approve", "reject"]
    assert claimed(client, reviewer)["task"]["id"] == task_id


def test_without_reset_the_next_failure_dead_letters_again(client: Client) -> None:
    _, coder, task_id = dead_lettered(client, {"max_attempts": 1})
    assert requeue(client, task_id).status == 200
    assert fail(client, claimed(client, coder)).status == 200
    assert task(client, task_id)["dead_letter_reason"] == "max_attempts_exceeded"


@pytest.fixture
def twice_failed(client: Client) -> tuple[str, str]:
    """A task dead-lettered after two failed attempts under max_attempts 2: (role, task)."""
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"max_attempts": 2})
    assert fail(client, claimed(client, coder)).status == 200
    assert fail(client, claimed(client, coder)).status == 200
    assert task(client, task_id)["dead_letter_reason"] == "max_attempts_exceeded"
    return coder, task_id


def test_reset_attempts_restarts_the_count_against_max_attempts(
    client: Client, twice_failed: tuple[str, str]
) -> None:
    coder, task_id = twice_failed
    r = requeue(client, task_id, {"reset_attempts": True, "reason": "fixed the command"})
    assert r.status == 200, r.body
    lease = claimed(client, coder)
    assert lease["run"]["attempt"] == 3  # attempt numbers keep counting
    assert len(lease["task"]["previous_failures"]) == 2  # and the history stays
    assert fail(client, lease).status == 200
    details = task(client, task_id)
    assert details["dead_letter_reason"] is None  # one failure of a fresh budget of two
    assert kinds(client, lease["run"]["id"])[-1] == "retry_scheduled"


def test_requeue_without_reset_keeps_counting_failures(
    client: Client, twice_failed: tuple[str, str]
) -> None:
    coder, task_id = twice_failed
    assert requeue(client, task_id, {"reset_attempts": False}).status == 200
    lease = claimed(client, coder)
    assert fail(client, lease).status == 200
    assert task(client, task_id)["dead_letter_reason"] == "max_attempts_exceeded"
    assert kinds(client, lease["run"]["id"])[-1] == "dead_letter"


def test_requeue_records_who_why_and_where(client: Client) -> None:
    _, _, task_id = dead_lettered(client, {"max_attempts": 1, "dead_letter_stage": "dead"})
    body = {"reason": "typo fixed", "actor": "alice", "reset_attempts": True}
    assert requeue(client, task_id, body).status == 200
    [event] = task_events(client, task_id)
    assert event["kind"] == "requeued"
    assert event["task_id"] == task_id
    assert isinstance(event["id"], int) and event["ts_ms"] > 0
    assert event["data"] == {
        "actor": "alice",
        "reason": "typo fixed",
        "was": "dead_lettered",
        "from_stage": "dead",
        "to_stage": "todo",
        "reset_attempts": True,
    }


def test_requeue_to_an_unknown_stage_is_400_invalid_stage(client: Client) -> None:
    _, _, task_id = dead_lettered(client)
    r = requeue(client, task_id, {"stage": "nowhere"})
    assert (r.status, r.error_code) == (400, "invalid_stage")
    assert "nowhere" in r.json["error"]["message"]
    assert task(client, task_id)["dead_letter_reason"] == "max_attempts_exceeded"  # unchanged


def test_requeue_to_a_terminal_stage_is_400_invalid_stage(client: Client) -> None:
    _, _, task_id = dead_lettered(client)
    r = requeue(client, task_id, {"stage": "done"})
    assert (r.status, r.error_code) == (400, "invalid_stage")
    assert "terminal" in r.json["error"]["message"]


def test_requeue_of_an_unknown_task_is_404(client: Client) -> None:
    r = requeue(client, "no-such-task")
    assert (r.status, r.error_code) == (404, "task_not_found")


@pytest.mark.parametrize("body", [b"[1]", b"{", b'{"stage": 5}', b'{"reset_attempts": "yes"}'])
def test_requeue_with_a_bad_body_is_400_invalid_json(client: Client, body: bytes) -> None:
    _, _, task_id = dead_lettered(client)
    r = requeue(client, task_id, body=body, headers={"Content-Type": "application/json"})
    assert (r.status, r.error_code) == (400, "invalid_json")


def test_requeue_of_a_leased_task_is_409_task_leased(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    r = requeue(client, task_id)
    assert (r.status, r.error_code) == (409, "task_leased")
    heartbeat = client.post(f"/leases/{lease['lease_id']}/heartbeat", token=lease["lease_token"])
    assert heartbeat.status == 200  # the lease is untouched
    assert task_events(client, task_id) == []


def test_requeue_of_a_done_task_needs_a_stage(client: Client) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    assert move(client, claimed(client, coder), "submit").status == 200
    assert move(client, claimed(client, reviewer), "approve").status == 200
    r = requeue(client, task_id)
    assert (r.status, r.error_code) == (409, "task_finished")
    r = requeue(client, task_id, {"stage": "review", "reason": "approved by mistake"})
    assert r.status == 200, r.body
    assert r.json["stage"] == "review"
    assert claimed(client, reviewer)["task"]["id"] == task_id


def test_requeue_of_a_waiting_task_leaves_it_where_it_is(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    before = task(client, task_id)
    r = requeue(client, task_id)
    assert r.status == 200
    assert (r.json["stage"], r.json["task_version"]) == ("todo", before["task_version"])
    assert [e["data"]["was"] for e in task_events(client, task_id)] == ["waiting"]
    assert claimed(client, coder)["task"]["id"] == task_id


# --- cancel ------------------------------------------------------------------------------------


def test_a_cancelled_task_is_never_claimed(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    r = cancel(client, task_id, {"reason": "not needed", "actor": "bob"})
    assert r.status == 200, r.body
    assert r.json == task(client, task_id)
    assert list(r.json)[: len(TASK_FIELDS)] == TASK_FIELDS
    assert r.json["stage"] == "todo"  # it stays where it was
    assert r.json["cancel_reason"] == "not needed"
    assert r.json["cancelled_at_ms"] > 0
    assert claim(client, coder).status == 204
    [event] = task_events(client, task_id)
    assert event["kind"] == "cancelled"
    assert event["data"] == {"actor": "bob", "reason": "not needed", "stage": "todo"}


def test_a_task_that_is_not_cancelled_shows_no_cancellation(client: Client) -> None:
    task_id = make_task(client, pipeline_with_roles(client)[0])
    details = task(client, task_id)
    assert "cancelled_at_ms" not in details and "cancel_reason" not in details


def test_cancelling_twice_answers_the_same_and_records_one_event(client: Client) -> None:
    task_id = make_task(client, pipeline_with_roles(client)[0])
    first = cancel(client, task_id, {"reason": "dup"})
    second = cancel(client, task_id)
    assert (first.status, second.status) == (200, 200)
    assert second.json == first.json
    assert [e["kind"] for e in task_events(client, task_id)] == ["cancelled"]


def test_cancel_of_an_unknown_task_is_404(client: Client) -> None:
    r = cancel(client, "no-such-task")
    assert (r.status, r.error_code) == (404, "task_not_found")


def test_cancel_of_a_done_task_is_409_task_finished(client: Client) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    assert move(client, claimed(client, coder), "submit").status == 200
    assert move(client, claimed(client, reviewer), "approve").status == 200
    r = cancel(client, task_id)
    assert (r.status, r.error_code) == (409, "task_finished")
    assert "cancelled_at_ms" not in task(client, task_id)


def test_a_cancelled_task_is_not_counted_claimable_in_the_queue_report(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    keep, drop = make_task(client, pipeline_id), make_task(client, pipeline_id)

    def claimable() -> int:
        roles = {q["role"]: q for q in client.get("/ops/queue").json["roles"]}
        return int(roles[coder]["claimable_count"])

    assert claimable() == 2
    assert cancel(client, drop).status == 200
    assert claimable() == 1
    assert claimed(client, coder)["task"]["id"] == keep


def test_a_waiting_long_poll_claim_does_not_get_a_cancelled_task(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    """The claim waits for the task's retry delay to run out (the wake-up is already set);
    the task is cancelled meanwhile, and the wake-up finds nothing."""
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 4000})
    assert fail(client, claimed(client, coder)).status == 200
    eligible_at = task(client, task_id)["next_eligible_at_ms"]
    waiting = long_poll(pool, shared_server, coder, 8000)
    cancelled = cancel(client, task_id)
    assert cancelled.status == 200
    assert cancelled.json["cancelled_at_ms"] < eligible_at, "cancelled too late to tell"
    r, _ = waiting.result(timeout=30)
    assert r.status == 204, r.body  # the retry time came and went, and nothing was claimed
    assert time.time() * 1000 >= eligible_at
    assert claim(client, coder).status == 204


def test_a_waiting_long_poll_claim_woken_by_other_work_skips_a_cancelled_task(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    urgent = make_task(client, pipeline_id, priority=10)
    assert cancel(client, urgent).status == 200
    waiting = long_poll(pool, shared_server, coder, LONG_WAIT_MS)  # nothing claimable
    other = make_task(client, pipeline_id, priority=0)
    r, _ = waiting.result(timeout=LONG_WAIT_MS / 1000 + 10)
    assert r.status == 200, r.body
    assert r.json["task"]["id"] == other


def test_cancel_revokes_a_live_lease_at_once(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    run_id, token = lease["run"]["id"], lease["lease_token"]
    r = cancel(client, task_id, {"reason": "wrong repo"})
    assert r.status == 200, r.body
    assert r.json["latest_run"]["status"] == "cancelled"
    assert r.json["latest_run"]["ended_at_ms"] is not None
    calls = [
        client.post(f"/leases/{lease['lease_id']}/heartbeat", token=token),
        client.post(f"/leases/{lease['lease_id']}/heartbeat", {"expected_fence": 1}, token=token),
        client.post(f"/runs/{run_id}/events", {"kind": "progress"}, token=token),
        client.put(f"/runs/{run_id}/checkpoint", {"checkpoint": {"step": 1}}, token=token),
        client.post(f"/runs/{run_id}/transition", {"trigger": "submit"}, token=token),
        client.post(f"/runs/{run_id}/fail", {"error": "x"}, token=token),
        client.post(f"/runs/{run_id}/release", token=token),
    ]
    assert [(c.status, c.error_code) for c in calls] == [(409, "task_cancelled")] * len(calls)
    assert kinds(client, run_id) == ["cancelled"]
    [event] = task_events(client, task_id)
    assert event["data"]["revoked_run_id"] == run_id
    details = task(client, task_id)
    assert details["stage"] == "todo" and details["previous_failures"] == []  # not a failure
    assert claim(client, coder).status == 204


def test_requeue_revives_a_cancelled_task_and_the_old_holder_stays_out(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    old = claimed(client, coder)
    assert cancel(client, task_id).status == 200
    r = requeue(client, task_id, {"reason": "needed after all"})
    assert r.status == 200, r.body
    assert "cancelled_at_ms" not in r.json and r.json["dead_letter_reason"] is None
    new = claimed(client, coder, "agent-b")
    assert new["task"]["id"] == task_id and new["run"]["attempt"] == 2
    heartbeat = client.post(f"/leases/{old['lease_id']}/heartbeat", token=old["lease_token"])
    assert (heartbeat.status, heartbeat.error_code) == (409, "task_cancelled")
    assert move(client, new, "submit").status == 200
    events = task_events(client, task_id)
    assert [(e["kind"], e["data"].get("was")) for e in events] == [
        ("cancelled", None),
        ("requeued", "cancelled"),
    ]


def test_dependents_of_a_cancelled_task_stay_blocked_until_it_is_requeued_and_done(
    client: Client,
) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    upstream = make_task(client, pipeline_id)
    downstream = make_task(client, pipeline_id, dependencies=[upstream])
    assert cancel(client, upstream).status == 200
    assert claim(client, coder).status == 204  # the upstream is cancelled, the other blocked
    assert task(client, downstream)["dependencies"] == [
        {"depends_on_task_id": upstream, "resolved": False}
    ]
    assert requeue(client, upstream).status == 200
    lease = claimed(client, coder)
    assert lease["task"]["id"] == upstream
    assert move(client, lease, "submit").status == 200
    assert move(client, claimed(client, reviewer), "approve").status == 200
    assert claimed(client, coder)["task"]["id"] == downstream


# --- both verbs --------------------------------------------------------------------------------


def test_both_verbs_need_the_admin_token_when_one_is_configured(make_server: Any) -> None:
    server = make_server(token="s3cret")
    admin, anonymous, wrong = server.client("s3cret"), server.client(), server.client("wrong")
    try:
        pipeline_id, coder, _ = pipeline_with_roles(admin)
        task_id = make_task(admin, pipeline_id)
        for verb in ("cancel", "requeue"):
            for who in (anonymous, wrong):
                r = who.post(f"/tasks/{task_id}/{verb}", {})
                assert (r.status, r.error_code) == (401, "unauthorized"), verb
            assert admin.post(f"/tasks/{task_id}/{verb}", {}).status == 200
        r = anonymous.get(f"/tasks/{task_id}/events")
        assert (r.status, r.error_code) == (401, "unauthorized")
        assert [e["kind"] for e in task_events(admin, task_id)] == ["cancelled", "requeued"]
        assert claimed(admin, coder)["task"]["id"] == task_id
    finally:
        for c in (admin, anonymous, wrong):
            c.close()


def test_idempotency_key_replays_a_requeue(client: Client) -> None:
    _, coder, task_id = dead_lettered(client)
    key = {"Idempotency-Key": unique("key")}
    first = requeue(client, task_id, {"reason": "r"}, headers=key)
    assert first.status == 200
    claimed(client, coder)  # now leased: a fresh requeue would be 409
    again = requeue(client, task_id, {"reason": "r"}, headers=key)
    assert (again.status, again.body) == (200, first.body)
    other = requeue(client, task_id, {"reason": "other"}, headers=key)
    assert (other.status, other.error_code) == (409, "idempotency_conflict")
    assert len(task_events(client, task_id)) == 1


def test_idempotency_key_replays_a_cancel(client: Client) -> None:
    task_id = make_task(client, pipeline_with_roles(client)[0])
    key = {"Idempotency-Key": unique("key")}
    first = cancel(client, task_id, {"reason": "r"}, headers=key)
    assert requeue(client, task_id).status == 200
    again = cancel(client, task_id, {"reason": "r"}, headers=key)
    assert (again.status, again.body) == (200, first.body)
    assert "cancelled_at_ms" not in task(client, task_id)  # the replay did not cancel again


def test_task_events_of_an_unknown_task_are_404_and_pages_follow_the_cursor(
    client: Client,
) -> None:
    r = client.get("/tasks/no-such-task/events")
    assert (r.status, r.error_code) == (404, "task_not_found")
    task_id = make_task(client, pipeline_with_roles(client)[0])
    for _ in range(3):
        assert cancel(client, task_id).status == 200
        assert requeue(client, task_id).status == 200
    page = client.get(f"/tasks/{task_id}/events?limit=4").json
    assert len(page["items"]) == 4 and page["next_cursor"] is not None
    rest = client.get(f"/tasks/{task_id}/events?limit=4&cursor={page['next_cursor']}").json
    assert rest["next_cursor"] is None
    ids = [e["id"] for e in page["items"] + rest["items"]]
    assert len(ids) == 6 and ids == sorted(ids)


def test_tasks_can_be_listed_by_role(client: Client) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    first, second = make_task(client, pipeline_id), make_task(client, pipeline_id)
    assert move(client, claimed(client, coder), "submit").status == 200  # first -> review

    def ids(query: str) -> list[str]:
        r = client.get(f"/tasks?{query}")
        assert r.status == 200, r.body
        assert all(list(t) == TASK_FIELDS for t in r.json["items"])
        return [t["id"] for t in r.json["items"]]

    assert ids(f"role={coder}") == [second]
    assert ids(f"role={reviewer}") == [first]
    assert ids(f"role={reviewer}&stage=todo") == []
    assert ids(f"role={coder}&stage=todo&pipeline_id={pipeline_id}") == [second]
    assert ids(f"role={unique('nobody')}") == []
    page = client.get(f"/tasks?role={coder}&limit=1").json
    assert [t["id"] for t in page["items"]] == [second] and page["next_cursor"] is None


def test_the_openapi_document_describes_both_verbs(client: Client) -> None:
    doc = client.get("/openapi.json").json
    for verb in ("requeue", "cancel"):
        op = doc["paths"][f"/tasks/{{id}}/{verb}"]["post"]
        assert op.get("security", doc["security"]) == [{"bearerAuth": []}, {}]
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": "#/components/schemas/TaskDetails"}
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("Task")
        assert op["requestBody"]["required"] is False  # the body may be left out
        assert "409" in op["responses"] and "404" in op["responses"]
    details = doc["components"]["schemas"]["TaskDetails"]["properties"]
    assert {"cancelled_at_ms", "cancel_reason"} <= set(details)
    requeue_body = doc["components"]["schemas"]["RequeueTask"]["properties"]
    assert {"stage", "reset_attempts", "reason"} <= set(requeue_body)
    roles = [p["name"] for p in doc["paths"]["/tasks"]["get"]["parameters"]]
    assert "role" in roles


def test_health_stops_counting_a_revoked_lease_and_still_counts_the_task_in_its_stage(
    fresh_server: Server,
) -> None:
    client = fresh_server.client()
    try:
        pipeline_id, coder, _ = pipeline_with_roles(client)
        task_id = make_task(client, pipeline_id)
        claimed(client, coder)
        assert client.get("/health").json["active_leases"] == 1
        assert cancel(client, task_id).status == 200
        doc = client.get("/health").json
        assert doc["active_leases"] == 0
        assert doc["tasks_by_stage"] == [{"stage": "todo", "count": 1}]
    finally:
        client.close()


def _expired(client: Client, coder: str) -> dict[str, Any]:
    """Claim with a short lease and wait until it has expired (reaped or not)."""
    lease = claimed(client, coder, lease_ttl_ms=200)
    while time.time() * 1000 <= lease["expires_at_ms"] + 50:
        time.sleep(0.05)
    return lease


def test_cancel_after_a_lease_expired_counts_the_expiry_and_revokes_nothing(
    client: Client,
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = _expired(client, coder)
    r = cancel(client, task_id)
    assert r.status == 200, r.body
    assert r.json["latest_run"]["status"] == "stale"  # it expired before the cancel came
    assert [f["run_id"] for f in r.json["previous_failures"]] == [lease["run"]["id"]]
    assert "revoked_run_id" not in task_events(client, task_id)[0]["data"]


def test_cancel_after_an_expiry_dead_lettered_the_task_into_a_terminal_stage_is_refused(
    client: Client,
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    policy = {"max_attempts": 1, "dead_letter_stage": "dead"}
    task_id = make_task(client, pipeline_id, retry_policy=policy)
    _expired(client, coder)
    r = cancel(client, task_id)
    assert (r.status, r.error_code) == (409, "task_finished")
    assert "'dead'" in r.json["error"]["message"]
    # A refused write changes nothing, its own expiry of the lease included: the janitor
    # expires it as usual, with the outcome the answer named.
    wait_for(
        "the janitor to dead-letter the task", lambda: task(client, task_id)["stage"] == "dead"
    )
    assert "cancelled_at_ms" not in task(client, task_id)
