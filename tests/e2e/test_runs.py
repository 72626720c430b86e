"""Lease-protected routes over real HTTP: heartbeat (§8.3, Q2), lease-token checks (§8.2, Q36),
run events (§9.1, §9.2), transition (§9.3) and fail with retry / dead-letter (§9.4, Q13)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.conftest import (
    create_pipeline,
    events,
    make_task,
    now_ms,
    pipeline_with_roles,
    task,
    unique,
)
from tests.server import TIME_SCALE, Client, Response

pytestmark = pytest.mark.e2e

DEAD_LETTER_ELIGIBLE_AT = 9223372036854775000
VALID_LOOKING = "0123456789abcdef" * 4
UNKNOWN_RUN = "00000000-0000-4000-8000-000000000000"


class Lease:
    """A claimed task as an agent holds it."""

    def __init__(self, client: Client, doc: dict[str, Any]) -> None:
        self.client = client
        self.doc = doc
        self.task_id: str = doc["task"]["id"]
        self.run_id: str = doc["run"]["id"]
        self.lease_id: str = doc["lease_id"]
        self.token: str = doc["lease_token"]

    def heartbeat(self, body: Any = None, **kw: Any) -> Response:
        kw.setdefault("token", self.token)
        return self.client.post(f"/leases/{self.lease_id}/heartbeat", body, **kw)

    def event(self, kind: str, data: Any = None, **kw: Any) -> Response:
        body: dict[str, Any] = {"kind": kind}
        if data is not None:
            body["data"] = data
        kw.setdefault("token", self.token)
        return self.client.post(f"/runs/{self.run_id}/events", body, **kw)

    def transition(self, trigger: str, **fields: Any) -> Response:
        token = fields.pop("token", self.token)
        return self.client.post(
            f"/runs/{self.run_id}/transition", {"trigger": trigger, **fields}, token=token
        )

    def fail(self, error: str = "boom", **kw: Any) -> Response:
        kw.setdefault("token", self.token)
        return self.client.post(f"/runs/{self.run_id}/fail", {"error": error}, **kw)


def claim(client: Client, role: str, agent: str = "agent-a", **fields: Any) -> Lease:
    r = client.post("/leases/claim", {"agent_id": agent, "agent_role": role, **fields})
    assert r.status == 200, (r.status, r.body)
    return Lease(client, r.json)


def claimed(client: Client, **task_fields: Any) -> tuple[Lease, str, str]:
    """A fresh task, claimed by its coder. Returns (lease, coder role, reviewer role)."""
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, **task_fields)
    lease = claim(client, coder)
    assert lease.task_id == task_id
    return lease, coder, reviewer


def events_of_kind(client: Client, run_id: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in events(client, run_id) if e["kind"] == kind]


def wait_until_expired(lease: Lease, timeout: float = 10.0 * TIME_SCALE) -> Response:
    """Probe the lease without extending it (a transition whose body cannot parse is answered
    400 while the lease is live); return the first answer that is not 400."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = lease.client.post(f"/runs/{lease.run_id}/transition", body="{", token=lease.token)
        if r.status != 400:
            return r
        time.sleep(0.005)
    raise AssertionError("lease did not expire")


# --- heartbeat ---------------------------------------------------------------------------------


def test_heartbeat_extends_the_lease(client: Client) -> None:
    lease, _, _ = claimed(client)
    before = now_ms()
    r = lease.heartbeat()
    after = now_ms()
    assert r.status == 200, r.body
    assert set(r.json) == {"expires_at_ms"}
    assert before + 300_000 <= r.json["expires_at_ms"] <= after + 300_000


def test_heartbeat_keeps_the_ttl_the_lease_was_claimed_with(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claim(client, coder, lease_ttl_ms=600_000)
    before = now_ms()
    r = lease.heartbeat()
    after = now_ms()
    assert r.status == 200, r.body
    assert before + 600_000 <= r.json["expires_at_ms"] <= after + 600_000


def test_heartbeat_keeps_a_short_claimed_ttl_short(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claim(client, coder, lease_ttl_ms=20_000)
    before = now_ms()
    r = lease.heartbeat()
    after = now_ms()
    assert r.status == 200, r.body
    assert before + 20_000 <= r.json["expires_at_ms"] <= after + 20_000


def test_heartbeat_with_a_ttl_sets_a_new_ttl(client: Client) -> None:
    lease, _, _ = claimed(client)
    before = now_ms()
    r = lease.heartbeat({"lease_ttl_ms": 45_000})
    after = now_ms()
    assert r.status == 200, r.body
    assert before + 45_000 <= r.json["expires_at_ms"] <= after + 45_000
    # The new TTL sticks for later heartbeats without a body.
    before = now_ms()
    r = lease.heartbeat()
    after = now_ms()
    assert r.status == 200, r.body
    assert before + 45_000 <= r.json["expires_at_ms"] <= after + 45_000


def test_heartbeat_rejects_a_ttl_that_is_not_positive(client: Client) -> None:
    lease, _, _ = claimed(client)
    r = lease.heartbeat({"lease_ttl_ms": 0})
    assert r.status == 400, r.body
    assert r.error_code == "invalid_lease_ttl"
    assert lease.heartbeat().status == 200


def test_heartbeat_clamps_a_huge_ttl_to_a_day(client: Client) -> None:
    lease, _, _ = claimed(client)
    r = lease.heartbeat({"lease_ttl_ms": 2**62})
    assert r.status == 200, r.body
    assert r.json["expires_at_ms"] <= now_ms() + 24 * 3600 * 1000


def test_heartbeat_does_not_touch_the_run_or_write_events(client: Client) -> None:
    lease, _, _ = claimed(client)
    assert lease.heartbeat().status == 200
    details = task(client, lease.task_id)
    assert details["latest_run"] == lease.doc["run"]
    assert details["task_version"] == 1
    assert events(client, lease.run_id) == []


def test_heartbeat_on_an_unknown_lease_is_not_found(client: Client) -> None:
    r = client.post(f"/leases/{UNKNOWN_RUN}/heartbeat", token=VALID_LOOKING)
    assert r.status == 404
    assert r.error_code == "not_found"


# --- lease-token verification (§8.2, in order) -------------------------------------------------


def lease_routes(lease: Lease) -> list[tuple[str, Any]]:
    return [
        (f"/leases/{lease.lease_id}/heartbeat", None),
        (f"/runs/{lease.run_id}/events", {"kind": "note"}),
        (f"/runs/{lease.run_id}/transition", {"trigger": "submit"}),
        (f"/runs/{lease.run_id}/fail", {"error": "boom"}),
    ]


def assert_lease_untouched(client: Client, lease: Lease) -> None:
    details = task(client, lease.task_id)
    assert details["stage"] == "todo"
    assert details["task_version"] == 1
    assert details["latest_run"]["status"] == "running"
    assert events(client, lease.run_id) == []
    assert lease.heartbeat().status == 200


def test_lease_routes_without_a_bearer_header_are_unauthorized(client: Client) -> None:
    lease, _, _ = claimed(client)
    for path, body in lease_routes(lease):
        r = client.post(path, body)
        assert r.status == 401, (path, r.body)
        assert r.error_code == "unauthorized"
    assert_lease_untouched(client, lease)


@pytest.mark.parametrize(
    "header",
    ["Basic abc", "bearer", "Bearer", "{token}", "Bearer  {token}", "Token {token}"],
    ids=["basic", "lowercase-no-token", "no-token", "no-scheme", "two-spaces", "other-scheme"],
)
def test_lease_routes_reject_a_malformed_authorization_header(client: Client, header: str) -> None:
    lease, _, _ = claimed(client)
    value = header.format(token=lease.token)
    for path, body in lease_routes(lease):
        r = client.post(path, body, headers={"Authorization": value})
        assert r.status == 401, (path, r.body)
        assert r.error_code == "unauthorized"
    assert_lease_untouched(client, lease)


@pytest.mark.parametrize(
    "token",
    [
        "z" * 64,
        "0123456789abcdef" * 4 + "0",
        "0123456789abcdef" * 4 + "00",
        "ab" * 16,
        "a" * 63,
        "",
        "g" + "0" * 63,
    ],
    ids=["non-hex", "odd-65", "too-long", "short-32", "odd-63", "empty", "one-bad-char"],
)
def test_undecodable_or_short_tokens_are_unauthorized_even_for_unknown_runs(
    client: Client, token: str
) -> None:
    lease, _, _ = claimed(client)
    for path, body in lease_routes(lease):
        r = client.post(path, body, token=token)
        assert r.status == 401, (path, r.body)
        assert r.error_code == "unauthorized"
    for path in (f"/runs/{UNKNOWN_RUN}/events", f"/leases/{UNKNOWN_RUN}/heartbeat"):
        r = client.post(path, {"kind": "x"}, token=token)
        assert r.status == 401, (path, r.body)
    assert_lease_untouched(client, lease)


def test_a_prefix_of_the_real_token_is_unauthorized(client: Client) -> None:
    lease, _, _ = claimed(client)
    for length in (2, 32, 62):
        r = lease.heartbeat(token=lease.token[:length])
        assert r.status == 401, (length, r.body)
    assert_lease_untouched(client, lease)


def test_unknown_run_with_a_valid_looking_token_is_not_found(client: Client) -> None:
    for path, body in [
        (f"/runs/{UNKNOWN_RUN}/events", {"kind": "note"}),
        (f"/runs/{UNKNOWN_RUN}/transition", {"trigger": "submit"}),
        (f"/runs/{UNKNOWN_RUN}/fail", {"error": "boom"}),
        (f"/leases/{UNKNOWN_RUN}/heartbeat", None),
    ]:
        r = client.post(path, body, token=VALID_LOOKING)
        assert r.status == 404, (path, r.body)
        assert r.error_code == "not_found"


def test_wrong_token_for_a_live_lease_is_unauthorized(client: Client) -> None:
    lease, _, _ = claimed(client)
    other, _, _ = claimed(client)
    for wrong in (VALID_LOOKING, other.token):
        for path, body in lease_routes(lease):
            r = client.post(path, body, token=wrong)
            assert r.status == 401, (path, r.body)
            assert r.error_code == "unauthorized"
    assert_lease_untouched(client, lease)


def test_uppercase_hex_token_is_accepted(client: Client) -> None:
    lease, _, _ = claimed(client)
    r = lease.heartbeat(token=lease.token.upper())
    assert r.status == 200, r.body


def test_one_lease_token_does_not_open_another_run(client: Client) -> None:
    mine, _, _ = claimed(client)
    theirs, _, _ = claimed(client)
    r = client.post(f"/runs/{theirs.run_id}/transition", {"trigger": "submit"}, token=mine.token)
    assert r.status == 401
    r = client.post(f"/leases/{theirs.lease_id}/heartbeat", token=mine.token)
    assert r.status == 401
    assert_lease_untouched(client, theirs)


def test_expired_lease_is_gone(client: Client) -> None:
    """Between expiry and the reaper the lease answers 410 expired; once reaped, 404. The
    background reaper may win the race, so a few attempts are allowed to observe the 410."""
    pipeline_id, coder, _ = pipeline_with_roles(client)
    seen = []
    for _ in range(5):
        make_task(client, pipeline_id)
        lease = claim(client, coder, lease_ttl_ms=300)
        first = wait_until_expired(lease)
        assert now_ms() >= lease.doc["expires_at_ms"]
        seen.append(first.status)
        assert first.status in (410, 404), first.body
        if first.status == 410:
            assert first.error_code == "expired"
            break
    assert 410 in seen, seen
    # Expired leases cannot be revived.
    for path, body in lease_routes(lease):
        r = client.post(path, body, token=lease.token)
        assert r.status in (410, 404), (path, r.body)


def test_bad_body_with_a_valid_lease_is_invalid_json(client: Client) -> None:
    lease, _, _ = claimed(client)
    for path in (
        f"/runs/{lease.run_id}/events",
        f"/runs/{lease.run_id}/transition",
        f"/runs/{lease.run_id}/fail",
        f"/leases/{lease.lease_id}/heartbeat",
    ):
        r = client.post(path, body='{"kind": ', token=lease.token)
        assert r.status == 400, (path, r.body)
        assert r.error_code == "invalid_json"
    for path, body in [
        (f"/runs/{lease.run_id}/events", {"data": {}}),
        (f"/runs/{lease.run_id}/events", {"kind": 5}),
        (f"/runs/{lease.run_id}/transition", {"instructions": "x"}),
        (f"/runs/{lease.run_id}/transition", {"trigger": "submit", "expected_task_version": "v"}),
        (f"/runs/{lease.run_id}/fail", {}),
        (f"/runs/{lease.run_id}/fail", {"error": ["x"]}),
    ]:
        r = client.post(path, body, token=lease.token)
        assert r.status == 400, (path, body, r.body)
        assert r.error_code == "invalid_json"
    assert_lease_untouched(client, lease)


def test_bad_lease_with_bad_body_reports_the_lease_error(client: Client) -> None:
    lease, _, _ = claimed(client)
    bad = '{"kind": '
    for path in (
        f"/runs/{lease.run_id}/events",
        f"/runs/{lease.run_id}/transition",
        f"/runs/{lease.run_id}/fail",
    ):
        assert client.post(path, body=bad).status == 401
        assert client.post(path, body=bad, token="xyz").status == 401
        assert client.post(path, body=bad, token=VALID_LOOKING).status == 401
    for path in (
        f"/runs/{UNKNOWN_RUN}/events",
        f"/runs/{UNKNOWN_RUN}/transition",
        f"/runs/{UNKNOWN_RUN}/fail",
    ):
        r = client.post(path, body=bad, token=VALID_LOOKING)
        assert r.status == 404, (path, r.body)
        assert r.error_code == "not_found"


# --- events ------------------------------------------------------------------------------------


def test_append_event_returns_its_id(client: Client) -> None:
    lease, _, _ = claimed(client)
    before = now_ms()
    r = lease.event("progress", {"pct": 50, "notes": ["a", "b"]})
    after = now_ms()
    assert r.status == 201, r.body
    assert set(r.json) == {"id"}
    assert isinstance(r.json["id"], int)
    [event] = events(client, lease.run_id)
    assert event["id"] == r.json["id"]
    assert event["run_id"] == lease.run_id
    assert event["kind"] == "progress"
    assert event["data"] == {"pct": 50, "notes": ["a", "b"]}
    assert before <= event["ts_ms"] <= after


def test_event_data_defaults_to_an_empty_object(client: Client) -> None:
    lease, _, _ = claimed(client)
    assert lease.event("absent").status == 201
    r = client.post(
        f"/runs/{lease.run_id}/events", {"kind": "null", "data": None}, token=lease.token
    )
    assert r.status == 201
    assert [(e["kind"], e["data"]) for e in events(client, lease.run_id)] == [
        ("absent", {}),
        ("null", {}),
    ]


def test_event_data_may_be_any_json_value(client: Client) -> None:
    lease, _, _ = claimed(client)
    values = [[1, "two"], "text", 42, True, {"nested": {"deep": [None]}}]
    for value in values:
        assert lease.event("v", value).status == 201
    assert [e["data"] for e in events(client, lease.run_id)] == values


def test_event_ids_grow_across_runs(client: Client) -> None:
    first, _, _ = claimed(client)
    second, _, _ = claimed(client)
    ids = [first.event("a").json["id"], second.event("b").json["id"], first.event("c").json["id"]]
    assert ids == sorted(ids)
    assert len(set(ids)) == 3
    assert [e["kind"] for e in events(client, first.run_id)] == ["a", "c"]
    assert [e["kind"] for e in events(client, second.run_id)] == ["b"]


def test_events_of_an_unknown_run_are_an_empty_page(client: Client) -> None:
    r = client.get(f"/runs/{UNKNOWN_RUN}/events")
    assert r.status == 200
    assert r.json == {"items": [], "next_cursor": None}


def test_event_pages_lose_no_rows(client: Client) -> None:
    lease, _, _ = claimed(client)
    ids = [lease.event(f"e{i}", {"i": i}).json["id"] for i in range(11)]
    seen: list[int] = []
    cursor = None
    for _ in range(20):
        path = f"/runs/{lease.run_id}/events?limit=3"
        if cursor is not None:
            path += f"&cursor={cursor}"
        r = client.get(path)
        assert r.status == 200, r.body
        page = r.json
        assert len(page["items"]) <= 3
        seen += [e["id"] for e in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
        assert isinstance(cursor, str)
        assert int(cursor) == page["items"][-1]["id"]
    assert seen == ids


def test_event_page_of_exact_size_has_no_next_cursor(client: Client) -> None:
    lease, _, _ = claimed(client)
    for i in range(3):
        lease.event(f"e{i}")
    r = client.get(f"/runs/{lease.run_id}/events?limit=3")
    assert len(r.json["items"]) == 3
    assert r.json["next_cursor"] is None


def test_event_cursor_returns_only_later_events(client: Client) -> None:
    lease, _, _ = claimed(client)
    ids = [lease.event(f"e{i}").json["id"] for i in range(4)]
    r = client.get(f"/runs/{lease.run_id}/events?cursor={ids[1]}")
    assert [e["id"] for e in r.json["items"]] == ids[2:]


@pytest.mark.parametrize(
    "query,code",
    [
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("cursor=abc", "invalid_cursor"),
        ("cursor=1:2", "invalid_cursor"),
    ],
)
def test_event_listing_rejects_bad_paging(client: Client, query: str, code: str) -> None:
    r = client.get(f"/runs/{UNKNOWN_RUN}/events?{query}")
    assert r.status == 400, r.body
    assert r.error_code == code


def test_events_are_readable_after_the_run_ended(client: Client) -> None:
    lease, _, _ = claimed(client)
    lease.event("work")
    assert lease.transition("submit").status == 200
    assert [e["kind"] for e in events(client, lease.run_id)] == ["work", "transition"]
    r = lease.event("late")
    assert r.status == 404
    assert r.error_code == "not_found"


# --- transition --------------------------------------------------------------------------------


def test_transition_moves_the_task_and_completes_the_run(client: Client) -> None:
    lease, _, _ = claimed(client)
    created = task(client, lease.task_id)
    before = now_ms()
    r = lease.transition("submit", usage={"tokens": 12})
    after = now_ms()
    assert r.status == 200, r.body
    assert r.json == {"previous_stage": "todo", "new_stage": "review", "trigger": "submit"}

    details = task(client, lease.task_id)
    assert details["stage"] == "review"
    assert details["task_version"] == 2
    assert details["next_eligible_at_ms"] == 0
    assert details["dead_letter_reason"] is None
    assert before <= details["updated_at_ms"] <= after
    assert details["created_at_ms"] == created["created_at_ms"]
    assert [t["trigger"] for t in details["available_transitions"]] == ["approve", "reject"]
    run = details["latest_run"]
    assert run["id"] == lease.run_id
    assert run["status"] == "completed"
    assert before <= run["ended_at_ms"] <= after


def test_transition_releases_the_lease(client: Client) -> None:
    lease, _, _ = claimed(client)
    assert lease.transition("submit").status == 200
    r = lease.heartbeat()
    assert r.status == 404
    assert r.error_code == "not_found"
    r = lease.transition("approve")
    assert r.status == 404
    r = lease.fail()
    assert r.status == 404
    assert task(client, lease.task_id)["task_version"] == 2


def test_transition_event_uses_the_requested_instructions(client: Client) -> None:
    lease, _, _ = claimed(client)
    assert lease.transition("submit", instructions="look at the tests").status == 200
    [event] = events_of_kind(client, lease.run_id, "transition")
    assert event["data"] == {
        "trigger": "submit",
        "from": "todo",
        "to": "review",
        "instructions": "look at the tests",
    }


def test_transition_event_falls_back_to_the_definitions_instructions(client: Client) -> None:
    lease, _, _ = claimed(client)
    assert lease.transition("submit").status == 200
    [event] = events_of_kind(client, lease.run_id, "transition")
    assert event["data"] == {
        "trigger": "submit",
        "from": "todo",
        "to": "review",
        "instructions": "review it",
    }


def test_transition_event_has_empty_instructions_when_none_are_configured(
    client: Client,
) -> None:
    lease, _, reviewer = claimed(client)
    assert lease.transition("submit").status == 200
    review = claim(client, reviewer, "agent-r")
    assert review.transition("approve").status == 200
    [event] = events_of_kind(client, review.run_id, "transition")
    assert event["data"] == {
        "trigger": "approve",
        "from": "review",
        "to": "done",
        "instructions": "",
    }


def test_invalid_transition_leaves_the_lease_valid(client: Client) -> None:
    lease, _, _ = claimed(client)
    for trigger in ("approve", "Submit", "", "nope"):
        r = lease.transition(trigger)
        assert r.status == 400, (trigger, r.body)
        assert r.error_code == "invalid_transition"
    assert_lease_untouched(client, lease)
    r = lease.transition("submit")
    assert r.status == 200, r.body
    assert task(client, lease.task_id)["stage"] == "review"


def test_expected_stage_mismatch_is_a_conflict(client: Client) -> None:
    lease, _, _ = claimed(client)
    r = lease.transition("submit", expected_stage="review")
    assert r.status == 409, r.body
    assert r.error_code == "expected_stage_mismatch"
    assert_lease_untouched(client, lease)
    r = lease.transition("submit", expected_stage="todo")
    assert r.status == 200, r.body


def test_expected_task_version_mismatch_is_a_conflict(client: Client) -> None:
    lease, _, _ = claimed(client)
    for version in (2, 0, 7):
        r = lease.transition("submit", expected_task_version=version)
        assert r.status == 409, r.body
        assert r.error_code == "task_version_mismatch"
    assert_lease_untouched(client, lease)
    r = lease.transition("submit", expected_task_version=1)
    assert r.status == 200, r.body
    assert task(client, lease.task_id)["task_version"] == 2


def test_stage_check_comes_before_the_version_check(client: Client) -> None:
    lease, _, _ = claimed(client)
    r = lease.transition("nope", expected_stage="review", expected_task_version=9)
    assert r.error_code == "expected_stage_mismatch"
    r = lease.transition("nope", expected_stage="todo", expected_task_version=9)
    assert r.error_code == "task_version_mismatch"
    r = lease.transition("nope", expected_stage="todo", expected_task_version=1)
    assert r.error_code == "invalid_transition"


def test_after_submit_the_reviewer_role_can_claim_the_task(client: Client) -> None:
    lease, coder, reviewer = claimed(client)
    assert lease.transition("submit").status == 200
    r = client.post("/leases/claim", {"agent_id": "agent-c", "agent_role": coder})
    assert r.status == 204
    review = claim(client, reviewer, "agent-r")
    assert review.task_id == lease.task_id
    assert review.doc["task"]["stage"] == "review"
    assert review.doc["task"]["task_version"] == 2
    assert review.doc["run"]["attempt"] == 2
    assert review.doc["run"]["agent_role"] == reviewer
    assert [t["trigger"] for t in review.doc["task"]["available_transitions"]] == [
        "approve",
        "reject",
    ]
    # And a rejection hands it back to the coders.
    assert review.transition("reject").status == 200
    again = claim(client, coder, "agent-c")
    assert again.task_id == lease.task_id
    assert again.doc["task"]["task_version"] == 3
    assert again.doc["run"]["attempt"] == 3


def test_task_in_a_terminal_stage_is_no_longer_claimable(client: Client) -> None:
    lease, coder, reviewer = claimed(client)
    assert lease.transition("submit").status == 200
    assert claim(client, reviewer).transition("approve").status == 200
    details = task(client, lease.task_id)
    assert details["stage"] == "done"
    assert details["task_version"] == 3
    assert details["available_transitions"] == []
    for role in (coder, reviewer):
        r = client.post("/leases/claim", {"agent_id": "x", "agent_role": role})
        assert r.status == 204


def test_self_loop_transition_bumps_the_version(client: Client) -> None:
    role = unique("looper")
    definition = {
        "initial": "work",
        "states": {"work": {"agent_role": role}, "done": {"terminal": True}},
        "transitions": [
            {"from": "work", "to": "work", "trigger": "again"},
            {"from": "work", "to": "done", "trigger": "finish"},
        ],
    }
    task_id = make_task(client, create_pipeline(client, definition))
    lease = claim(client, role)
    r = lease.transition("again")
    assert r.json == {"previous_stage": "work", "new_stage": "work", "trigger": "again"}
    details = task(client, task_id)
    assert (details["stage"], details["task_version"]) == ("work", 2)
    assert claim(client, role).doc["run"]["attempt"] == 2


# --- idempotent lease routes (Q9) --------------------------------------------------------------


def test_idempotent_transition_replays_only_for_the_lease_holder(client: Client) -> None:
    lease, _, _ = claimed(client)
    key = {"Idempotency-Key": unique("idem")}
    path, body = f"/runs/{lease.run_id}/transition", {"trigger": "submit"}
    first = client.post(path, body, headers=key, token=lease.token)
    assert first.status == 200, first.body
    again = client.post(path, body, headers=key, token=lease.token)
    assert (again.status, again.json) == (200, first.json)
    assert task(client, lease.task_id)["task_version"] == 2
    assert len(events_of_kind(client, lease.run_id, "transition")) == 1
    stranger = client.post(path, body, headers=key, token=VALID_LOOKING)
    assert stranger.status == 401
    assert stranger.error_code == "unauthorized"


# --- fail --------------------------------------------------------------------------------------


def test_fail_marks_the_run_failed_and_releases_the_lease(client: Client) -> None:
    lease, _, _ = claimed(client)
    before = now_ms()
    r = lease.fail("compiler crashed")
    after = now_ms()
    assert r.status == 200, r.body
    assert r.json == {"status": "failed"}
    details = task(client, lease.task_id)
    assert details["latest_run"]["status"] == "failed"
    assert before <= details["latest_run"]["ended_at_ms"] <= after
    assert details["stage"] == "todo"
    assert details["task_version"] == 1
    assert lease.heartbeat().status == 404
    assert lease.fail().status == 404
    assert lease.transition("submit").status == 404


def test_fail_schedules_a_retry_after_the_delay(client: Client) -> None:
    lease, coder, _ = claimed(client, retry_policy={"retry_delay_ms": 60_000})
    before = now_ms()
    assert lease.fail().status == 200
    after = now_ms()
    details = task(client, lease.task_id)
    eligible = details["next_eligible_at_ms"]
    assert before + 60_000 <= eligible <= after + 60_000
    assert details["stage"] == "todo"
    assert details["task_version"] == 1
    assert details["dead_letter_reason"] is None
    assert before <= details["updated_at_ms"] <= after
    [event] = events_of_kind(client, lease.run_id, "retry_scheduled")
    assert event["data"] == {
        "reason": "retry_scheduled",
        "failed_attempts": 1,
        "retry_delay_ms": 60_000,
        "next_eligible_at_ms": eligible,
    }
    r = client.post("/leases/claim", {"agent_id": "b", "agent_role": coder})
    assert r.status == 204


def test_fail_without_delay_makes_the_task_claimable_again_as_attempt_two(
    client: Client,
) -> None:
    lease, coder, _ = claimed(client)
    assert lease.fail().status == 200
    [event] = events_of_kind(client, lease.run_id, "retry_scheduled")
    assert event["data"]["failed_attempts"] == 1
    assert event["data"]["retry_delay_ms"] == 0
    again = claim(client, coder, "agent-b")
    assert again.task_id == lease.task_id
    assert again.doc["run"]["attempt"] == 2
    assert again.doc["run"]["agent_id"] == "agent-b"
    assert again.fail().status == 200
    [event] = events_of_kind(client, again.run_id, "retry_scheduled")
    assert event["data"]["failed_attempts"] == 2
    assert claim(client, coder).doc["run"]["attempt"] == 3


def test_exhausted_attempts_move_the_task_to_its_dead_letter_stage(client: Client) -> None:
    lease, coder, _ = claimed(client, retry_policy={"max_attempts": 2, "dead_letter_stage": "dead"})
    assert lease.fail("first").status == 200
    assert task(client, lease.task_id)["dead_letter_reason"] is None
    second = claim(client, coder, "agent-b")
    assert second.doc["run"]["attempt"] == 2
    before = now_ms()
    assert second.fail("second").status == 200
    after = now_ms()

    details = task(client, lease.task_id)
    assert details["stage"] == "dead"
    assert details["task_version"] == 2
    assert details["dead_letter_reason"] == "max_attempts_exceeded"
    assert details["next_eligible_at_ms"] == DEAD_LETTER_ELIGIBLE_AT
    assert before <= details["updated_at_ms"] <= after
    assert details["latest_run"]["status"] == "failed"
    [event] = events_of_kind(client, second.run_id, "dead_letter")
    assert event["data"] == {
        "reason": "max_attempts_exceeded",
        "failed_attempts": 2,
        "from_stage": "todo",
        "dead_letter_stage": "dead",
    }
    assert events_of_kind(client, second.run_id, "retry_scheduled") == []
    r = client.post("/leases/claim", {"agent_id": "c", "agent_role": coder})
    assert r.status == 204


def test_dead_letter_stage_in_a_terminal_state_resolves_dependents(client: Client) -> None:
    lease, _, _ = claimed(client, retry_policy={"max_attempts": 1, "dead_letter_stage": "dead"})
    pipeline_id, coder, _ = pipeline_with_roles(client)
    dependent = make_task(client, pipeline_id, dependencies=[lease.task_id])
    assert client.post("/leases/claim", {"agent_id": "x", "agent_role": coder}).status == 204
    assert lease.fail().status == 200
    assert claim(client, coder).task_id == dependent


def test_exhausted_attempts_without_dead_letter_stage_dead_letter_in_place(
    client: Client,
) -> None:
    lease, coder, _ = claimed(client, retry_policy={"max_attempts": 1})
    assert lease.fail().status == 200
    details = task(client, lease.task_id)
    assert (details["stage"], details["task_version"]) == ("todo", 1)
    assert details["dead_letter_reason"] == "max_attempts_exceeded"
    r = client.post("/leases/claim", {"agent_id": "a", "agent_role": coder})
    assert r.status == 204


def test_max_attempts_zero_dead_letters_on_the_first_failure(client: Client) -> None:
    # A negative max_attempts did the same in the original; it is refused now (test_tasks.py).
    lease, _, _ = claimed(client, retry_policy={"max_attempts": 0, "dead_letter_stage": "dead"})
    assert lease.fail().status == 200
    details = task(client, lease.task_id)
    assert details["stage"] == "dead"
    [event] = events_of_kind(client, lease.run_id, "dead_letter")
    assert event["data"]["failed_attempts"] == 1


def test_unlimited_attempts_never_dead_letter(client: Client) -> None:
    # A retry delay of 0, set on purpose: every failure is retried at once, as the original does.
    lease, coder, _ = claimed(client, retry_policy={"retry_delay_ms": 0})
    for attempt in range(1, 6):
        assert lease.doc["run"]["attempt"] == attempt
        assert lease.fail().status == 200
        lease = claim(client, coder)
    assert task(client, lease.task_id)["dead_letter_reason"] is None


def test_without_a_retry_delay_failures_back_off_after_two_immediate_retries(
    client: Client,
) -> None:
    """The default backoff: a task whose policy (and stage) sets no retry delay is offered
    again at once after its first two failures, as the original offers it after every one;
    from the third on it waits 1 s, 2 s, 4 s ... (+/- 20 %), up to 5 minutes. Each retry is
    made claimable early by an operator's requeue, which keeps the failures counting."""
    lease, coder, _ = claimed(client, retry_policy={"max_attempts": 50})
    task_id = lease.task_id
    for attempt in (1, 2):
        assert lease.fail().status == 200
        [event] = events_of_kind(client, lease.run_id, "retry_scheduled")
        assert event["data"]["retry_delay_ms"] == 0
        assert task(client, task_id)["next_eligible_at_ms"] == event["data"]["next_eligible_at_ms"]
        lease = claim(client, coder)  # at once
        assert (lease.task_id, lease.doc["run"]["attempt"]) == (task_id, attempt + 1)
    delays = []
    for failures in range(3, 14):
        assert lease.fail().status == 200
        [event] = events_of_kind(client, lease.run_id, "retry_scheduled")
        data = event["data"]
        assert data["failed_attempts"] == failures
        details = task(client, task_id)
        eligible = details["next_eligible_at_ms"]
        assert eligible == data["next_eligible_at_ms"]
        assert eligible == details["latest_run"]["ended_at_ms"] + data["retry_delay_ms"]
        nominal = 1000 * 2 ** (failures - 3)
        low, high = (min(f * nominal, 300_000) for f in (0.8, 1.2))
        assert low <= data["retry_delay_ms"] <= high, data
        delays.append(data["retry_delay_ms"])
        waiting = client.get("/ops/retrying?limit=1000").json["items"]
        [shown] = [w for w in waiting if w["task_id"] == task_id]
        assert (shown["next_eligible_at_ms"], shown["attempt"]) == (eligible, failures)
        if data["retry_delay_ms"] >= 6_000:  # far off: not offered before then
            r = client.post("/leases/claim", {"agent_id": "eager", "agent_role": coder})
            assert r.status == 204, r.body
        r = client.post(f"/tasks/{task_id}/requeue", {"reason": "try again now"})
        assert r.status == 200, r.body
        lease = claim(client, coder)
        assert (lease.task_id, lease.doc["run"]["attempt"]) == (task_id, failures + 1)
    assert delays[-2:] == [300_000, 300_000]  # the cap


def test_a_retry_delay_of_zero_set_on_purpose_retries_at_once_every_time(client: Client) -> None:
    lease, coder, _ = claimed(client, retry_policy={"retry_delay_ms": 0})
    for attempt in range(1, 6):
        assert lease.fail().status == 200
        [event] = events_of_kind(client, lease.run_id, "retry_scheduled")
        assert event["data"]["retry_delay_ms"] == 0
        lease = claim(client, coder)
        assert lease.doc["run"]["attempt"] == attempt + 1


def test_failures_in_an_earlier_stage_consume_the_attempt_budget(client: Client) -> None:
    lease, coder, reviewer = claimed(
        client, retry_policy={"max_attempts": 2, "dead_letter_stage": "dead"}
    )
    assert lease.fail().status == 200
    coding = claim(client, coder)
    assert coding.transition("submit").status == 200
    review = claim(client, reviewer)
    assert review.doc["run"]["attempt"] == 3
    assert review.fail().status == 200
    details = task(client, lease.task_id)
    assert details["stage"] == "dead"
    assert details["task_version"] == 3
    [event] = events_of_kind(client, review.run_id, "dead_letter")
    assert event["data"] == {
        "reason": "max_attempts_exceeded",
        "failed_attempts": 2,
        "from_stage": "review",
        "dead_letter_stage": "dead",
    }


def test_completed_runs_do_not_count_as_failures(client: Client) -> None:
    lease, coder, reviewer = claimed(
        client, retry_policy={"max_attempts": 2, "dead_letter_stage": "dead"}
    )
    assert lease.transition("submit").status == 200
    assert claim(client, reviewer).transition("reject").status == 200
    again = claim(client, coder)
    assert again.fail().status == 200
    details = task(client, lease.task_id)
    assert details["stage"] == "todo"
    assert details["dead_letter_reason"] is None


def test_fail_rejects_a_body_without_error(client: Client) -> None:
    lease, _, _ = claimed(client)
    r = client.post(f"/runs/{lease.run_id}/fail", {"reason": "x"}, token=lease.token)
    assert r.status == 400
    assert r.error_code == "invalid_json"
    assert_lease_untouched(client, lease)


def test_a_run_is_read_by_its_id_without_its_lease_token(client: Client) -> None:
    lease, _, _ = claimed(client)
    task_id = lease.task_id
    r = client.get(f"/runs/{lease.run_id}")
    assert r.status == 200, r.body
    run = r.json
    assert (run["id"], run["task_id"], run["attempt"], run["status"]) == (
        lease.run_id,
        task_id,
        1,
        "running",
    )
    assert run["agent_id"] == "agent-a" and run["ended_at_ms"] is None
    assert "lease_token" not in run and "token_hash" not in run
    assert lease.transition("submit").status == 200
    done = client.get(f"/runs/{lease.run_id}").json
    assert done["status"] == "completed" and done["ended_at_ms"] >= done["started_at_ms"]


def test_an_unknown_run_is_not_found(client: Client) -> None:
    r = client.get(f"/runs/{UNKNOWN_RUN}")
    assert r.status == 404 and r.error_code == "not_found"
    assert UNKNOWN_RUN in r.json["error"]["message"]
