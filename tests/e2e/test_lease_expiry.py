"""The crash proof: an agent that claims and disappears loses its lease after the TTL, its run
goes `stale` with a `lease_expired` event, and the expiry counts as a failed attempt (Q12), so
a task that kills every agent ends in its dead-letter stage."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.conftest import (
    claim,
    kinds,
    make_task,
    now_ms,
    pipeline_with_roles,
    task,
    wait_for,
    wait_until_stale,
)
from tests.server import Client, Response

pytestmark = pytest.mark.e2e

SHORT_TTL = 300
DEAD_LETTER_ELIGIBLE_AT = 9223372036854775000


def event(client: Client, run_id: str, kind: str) -> dict[str, Any]:
    r = client.get(f"/runs/{run_id}/events")
    found = [e for e in r.json["items"] if e["kind"] == kind]
    assert len(found) == 1, r.json
    return dict(found[0])


def claim_when_offered(client: Client, role: str, agent: str, **fields: Any) -> Response:
    def probe() -> Response | None:
        r = claim(client, role, agent, **fields)
        assert r.status in (200, 204), r.body
        return r if r.status == 200 else None

    return wait_for("the task to be offered again", probe)  # type: ignore[no-any-return]


def crash(client: Client, role: str, agent: str = "doomed") -> dict[str, Any]:
    """Claim with a short lease and vanish: no heartbeat, no fail, no transition."""
    r = claim(client, role, agent, lease_ttl_ms=SHORT_TTL)
    assert r.status == 200, r.body
    return dict(r.json)


def test_task_of_a_vanished_agent_becomes_claimable_by_another_agent(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lost = crash(client, coder)
    assert claim(client, coder, "rescuer").status == 204  # still leased right now

    r = claim_when_offered(client, coder, "rescuer")
    assert now_ms() >= lost["expires_at_ms"]
    assert r.json["task"]["id"] == task_id
    assert r.json["task"]["stage"] == "todo"
    assert r.json["task"]["task_version"] == 1
    assert r.json["run"]["attempt"] == 2
    assert r.json["run"]["agent_id"] == "rescuer"
    assert r.json["lease_token"] != lost["lease_token"]

    # The rescuer finishes the work normally.
    t = client.post(
        f"/runs/{r.json['run']['id']}/transition",
        {"trigger": "submit"},
        token=r.json["lease_token"],
    )
    assert t.status == 200, t.body
    assert task(client, task_id)["stage"] == "review"


def test_expired_run_goes_stale_without_anyone_claiming(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lost = crash(client, coder)
    run_id = lost["run"]["id"]

    details = wait_until_stale(client, task_id, run_id)
    run = details["latest_run"]
    assert run["attempt"] == 1
    assert run["agent_id"] == "doomed"
    assert lost["expires_at_ms"] <= run["ended_at_ms"] <= now_ms()
    assert details["stage"] == "todo"
    assert details["task_version"] == 1
    assert "lease_expired" in kinds(client, run_id)


def test_lease_expired_event_is_written_on_the_old_run(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lost = crash(client, coder)
    wait_until_stale(client, task_id, lost["run"]["id"])
    expired = event(client, lost["run"]["id"], "lease_expired")
    assert expired["run_id"] == lost["run"]["id"]
    assert expired["ts_ms"] >= lost["expires_at_ms"]
    assert isinstance(expired["data"], dict)
    # The expiry is a failure with the default retry policy: retry now, attempt 1 failed.
    retry = event(client, lost["run"]["id"], "retry_scheduled")
    assert retry["data"]["failed_attempts"] == 1
    assert retry["data"]["retry_delay_ms"] == 0


def test_vanished_agent_cannot_use_its_lease_after_expiry(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lost = crash(client, coder)
    wait_until_stale(client, task_id, lost["run"]["id"])
    token, run_id = lost["lease_token"], lost["run"]["id"]
    for path, body in [
        (f"/leases/{lost['lease_id']}/heartbeat", None),
        (f"/runs/{run_id}/events", {"kind": "late"}),
        (f"/runs/{run_id}/transition", {"trigger": "submit"}),
        (f"/runs/{run_id}/fail", {"error": "late"}),
    ]:
        r = client.post(path, body, token=token)
        assert r.status == 404, (path, r.status, r.body)
        assert r.error_code == "not_found"
    details = task(client, task_id)
    assert details["stage"] == "todo"
    assert details["task_version"] == 1
    assert details["latest_run"]["status"] == "stale"
    assert "late" not in kinds(client, run_id)


def test_late_agent_cannot_complete_a_task_someone_else_now_holds(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lost = crash(client, coder)
    wait_until_stale(client, task_id, lost["run"]["id"])
    rescue = claim(client, coder, "rescuer")
    assert rescue.status == 200
    r = client.post(
        f"/runs/{lost['run']['id']}/transition", {"trigger": "submit"}, token=lost["lease_token"]
    )
    assert r.status in (404, 410)
    assert task(client, task_id)["latest_run"]["id"] == rescue.json["run"]["id"]
    assert task(client, task_id)["stage"] == "todo"


def test_heartbeats_keep_a_short_lease_alive(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    # Short against the test's length, long against a busy machine's pause between two
    # heartbeats.
    r = claim(client, coder, "steady", lease_ttl_ms=1000)
    assert r.status == 200
    lease_id, token = r.json["lease_id"], r.json["lease_token"]
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        hb = client.post(f"/leases/{lease_id}/heartbeat", token=token)
        assert hb.status == 200, hb.body
        assert claim(client, coder, "thief").status == 204
        time.sleep(0.1)
    details = task(client, task_id)
    assert details["latest_run"]["status"] == "running"
    assert "lease_expired" not in kinds(client, r.json["run"]["id"])


def test_expiry_applies_the_retry_delay(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 60_000})
    lost = crash(client, coder)
    details = wait_until_stale(client, task_id, lost["run"]["id"])
    ended = details["latest_run"]["ended_at_ms"]
    assert details["next_eligible_at_ms"] == ended + 60_000
    retry = event(client, lost["run"]["id"], "retry_scheduled")
    assert retry["data"] == {
        "reason": "retry_scheduled",
        "failed_attempts": 1,
        "retry_delay_ms": 60_000,
        "next_eligible_at_ms": details["next_eligible_at_ms"],
    }
    assert claim(client, coder, "rescuer").status == 204


def test_repeated_expiries_dead_letter_a_poison_task(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(
        client, pipeline_id, retry_policy={"max_attempts": 2, "dead_letter_stage": "dead"}
    )

    first = crash(client, coder, "victim-1")
    details = wait_until_stale(client, task_id, first["run"]["id"])
    assert details["stage"] == "todo"
    assert details["dead_letter_reason"] is None
    assert event(client, first["run"]["id"], "retry_scheduled")["data"]["failed_attempts"] == 1

    second = claim_when_offered(client, coder, "victim-2", lease_ttl_ms=SHORT_TTL)
    assert second.json["task"]["id"] == task_id
    assert second.json["run"]["attempt"] == 2
    second_run = second.json["run"]["id"]

    details = wait_until_stale(client, task_id, second_run)
    assert details["stage"] == "dead"
    assert details["task_version"] == 2
    assert details["dead_letter_reason"] == "max_attempts_exceeded"
    assert details["next_eligible_at_ms"] == DEAD_LETTER_ELIGIBLE_AT
    assert "lease_expired" in kinds(client, second_run)
    dead = event(client, second_run, "dead_letter")
    assert dead["data"] == {
        "reason": "max_attempts_exceeded",
        "failed_attempts": 2,
        "from_stage": "todo",
        "dead_letter_stage": "dead",
    }
    assert claim(client, coder, "victim-3").status == 204


def test_expiry_and_explicit_failure_share_one_attempt_budget(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(
        client, pipeline_id, retry_policy={"max_attempts": 2, "dead_letter_stage": "dead"}
    )
    lost = crash(client, coder)
    wait_until_stale(client, task_id, lost["run"]["id"])
    r = claim_when_offered(client, coder, "honest")
    f = client.post(
        f"/runs/{r.json['run']['id']}/fail", {"error": "gave up"}, token=r.json["lease_token"]
    )
    assert f.status == 200
    details = task(client, task_id)
    assert details["stage"] == "dead"
    assert event(client, r.json["run"]["id"], "dead_letter")["data"]["failed_attempts"] == 2
