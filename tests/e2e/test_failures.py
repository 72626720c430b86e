"""What the operator sees of failures is true: dead letters count where they land (a
dead-letter stage without a role) on every surface, agreeing with /health; GET /ops/failures
lists the dead-lettered, cancelled and failing tasks newest first with their last error, in
pages; GET /ops/failures/groups groups them by error; POST /tasks/requeue and /tasks/cancel act
on a selection and answer per id."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cli import run_cli
from tests.conftest import claim, claimed, create_pipeline, make_task, unique
from tests.server import Client, Server

pytestmark = pytest.mark.e2e

DEAD_LETTER = {"max_attempts": 1, "dead_letter_stage": "dead"}


def pipeline_with_dead_letters(client: Client) -> tuple[str, str]:
    """todo (a role of its own) -submit-> done, and `dead`, a terminal stage without a role
    where exhausted tasks are sent. Returns (pipeline_id, role)."""
    role = unique("coder")
    definition = {
        "initial": "todo",
        "states": {
            "todo": {"agent_role": role},
            "done": {"terminal": True},
            "dead": {"terminal": True},
        },
        "transitions": [{"from": "todo", "to": "done", "trigger": "submit"}],
    }
    return create_pipeline(client, definition), role


def fail_next(client: Client, role: str, error: str) -> str:
    """Claim the role's next task and fail its run with `error`; the task's id."""
    lease = claimed(client, role)
    r = client.post(
        f"/runs/{lease['run']['id']}/fail", {"error": error}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body
    time.sleep(0.003)  # the next failure ends on a later millisecond: an order to check
    return str(lease["task"]["id"])


def dead_letters(client: Client, pipeline_id: str, role: str, errors: list[str]) -> list[str]:
    """One task per error, each dead-lettered into `dead` by its first failure, in order."""
    ids = []
    for error in errors:
        task_id = make_task(client, pipeline_id, retry_policy=DEAD_LETTER)
        assert fail_next(client, role, error) == task_id
        ids.append(task_id)
    return ids


def failures(client: Client, query: str) -> dict[str, Any]:
    r = client.get(f"/ops/failures?{query}")
    assert r.status == 200, r.body
    return dict(r.json)


def every_page(client: Client, query: str, limit: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = failures(client, f"{query}&limit={limit}" + (f"&cursor={cursor}" if cursor else ""))
        assert len(page["items"]) <= limit
        items.extend(page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            return items


def gauge(client: Client, **labels: str) -> float:
    r = client.get("/metrics")
    assert r.status == 200, r.body
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(r.body.decode())
        for sample in family.samples
        if sample.name == "nulltickets_queue_tasks"
        and all(sample.labels.get(k) == v for k, v in labels.items())
    )


# --- dead letters count where they land ------------------------------------------------------


@pytest.mark.process
def test_dead_letters_in_a_dead_letter_stage_count_on_every_surface(
    fresh_server: Server, fresh_client: Client, tmp_path: Path
) -> None:
    client = fresh_client
    pipeline_id, role = pipeline_with_dead_letters(client)
    dead = dead_letters(client, pipeline_id, role, ["boom 1", "boom 2", "boom 3", "boom 4"])
    cancelled = make_task(client, pipeline_id)
    assert client.post(f"/tasks/{cancelled}/cancel", {"reason": "not needed"}).status == 200
    make_task(client, pipeline_id)  # one still claimable

    health = {s["stage"]: s["count"] for s in client.get("/health").json["tasks_by_stage"]}
    assert health["dead"] == 4

    stages = client.get("/ops/stages").json["stages"]
    [landing] = [s for s in stages if s["pipeline_id"] == pipeline_id and s["stage"] == "dead"]
    assert landing["role"] is None
    assert landing["dead_lettered"] == 4 and landing["cancelled"] == 0
    assert landing["claimable"] == landing["leased"] == landing["waiting_retry"] == 0
    [todo] = [s for s in stages if s["pipeline_id"] == pipeline_id and s["stage"] == "todo"]
    assert todo["role"] == role and todo["cancelled"] == 1 and todo["dead_lettered"] == 0
    assert todo["claimable"] == 1
    # What the overview adds up: the same truth.
    assert sum(s["dead_lettered"] for s in stages) == 4
    assert sum(s["cancelled"] for s in stages) == 1
    assert [s["role"] is None for s in stages] == sorted(s["role"] is None for s in stages)

    queue = client.get("/ops/queue").json
    assert queue["dead_lettered"] == 4 and queue["cancelled"] == 1

    labels = {"pipeline_id": pipeline_id, "stage": "dead"}
    assert gauge(client, state="dead_lettered", role="", **labels) == 4
    assert gauge(client, state="cancelled", role="", **labels) == 0
    assert gauge(client, state="cancelled", role=role, stage="todo") == 1
    assert gauge(client, state="dead_lettered") == 4

    cli = run_cli(
        "tasks", "list", "--state", "dead", "--json", "--base", fresh_server.base, home=tmp_path
    )
    assert cli.returncode == 0, cli
    listed = json.loads(cli.stdout)
    assert [t["id"] for t in listed] == dead[::-1]  # newest first
    assert {t["state"] for t in listed} == {"dead_lettered"}
    assert {t["stage"] for t in listed} == {"dead"}
    table = run_cli("tasks", "list", "--state", "dead", "--base", fresh_server.base, home=tmp_path)
    assert table.returncode == 0, table
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["ID", "STAGE", "STATE", "FAILURES", "AT", "ERROR", "TITLE"]
    assert [line.split()[:4] for line in lines[1:]] == [
        [task_id, "dead", "dead_lettered", "1"] for task_id in dead[::-1]
    ]
    assert "boom 4" in lines[1]
    plain = run_cli("tasks", "list", "--base", fresh_server.base, home=tmp_path)
    states = {line.split()[0]: line.split()[2] for line in plain.stdout.splitlines()[1:]}
    assert [states[t] for t in dead] == ["dead_lettered"] * 4
    assert states[cancelled] == "cancelled"


def test_dead_letters_of_a_pipeline_left_in_place_count_in_their_own_stage(
    client: Client,
) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    task_id = make_task(client, pipeline_id, retry_policy={"max_attempts": 1})
    fail_next(client, role, "no dead-letter stage")
    stages = client.get("/ops/stages").json["stages"]
    mine = {s["stage"]: s for s in stages if s["pipeline_id"] == pipeline_id}
    assert set(mine) == {"todo"}  # nothing landed elsewhere
    assert mine["todo"]["dead_lettered"] == 1
    [item] = failures(client, f"pipeline_id={pipeline_id}")["items"]
    assert (item["id"], item["state"], item["stage"]) == (task_id, "dead_lettered", "todo")


# --- the failures listing --------------------------------------------------------------------


def test_failures_come_newest_first_with_their_last_error_and_failure_count(
    client: Client,
) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    policy = {"max_attempts": 3, "dead_letter_stage": "dead", "retry_delay_ms": 0}
    first = make_task(client, pipeline_id, retry_policy=policy)
    for error in ("first error", "second error", "third error"):
        assert fail_next(client, role, error) == first
    failing = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 3_600_000})
    assert fail_next(client, role, "flaky network") == failing
    cancelled = make_task(client, pipeline_id)
    assert client.post(f"/tasks/{cancelled}/cancel", {"reason": "duplicate"}).status == 200
    untouched = make_task(client, pipeline_id)

    page = failures(client, f"pipeline_id={pipeline_id}")
    assert page["next_cursor"] is None
    items = page["items"]
    assert [i["id"] for i in items] == [cancelled, failing, first]
    assert untouched not in {i["id"] for i in items}
    by_id = {i["id"]: i for i in items}
    dead = by_id[first]
    assert dead["state"] == "dead_lettered" and dead["stage"] == "dead"
    assert dead["last_error"] == "third error"  # the last, not the first
    assert dead["failures"] == 3
    assert dead["dead_letter_reason"] == "max_attempts_exceeded"
    assert dead["next_eligible_at_ms"] is None  # no parked sentinel time
    assert dead["at_ms"] == dead["failed_at_ms"]
    retrying = by_id[failing]
    assert retrying["state"] == "failing" and retrying["last_error"] == "flaky network"
    assert retrying["failures"] == 1 and not retrying["leased"]
    assert retrying["next_eligible_at_ms"] > retrying["failed_at_ms"]
    gone = by_id[cancelled]
    assert gone["state"] == "cancelled" and gone["cancel_reason"] == "duplicate"
    assert gone["dead_letter_reason"] is None and gone["failures"] == 0
    assert gone["at_ms"] == gone["cancelled_at_ms"]

    def kinds(kind: str) -> list[str]:
        return [
            i["id"] for i in failures(client, f"pipeline_id={pipeline_id}&kind={kind}")["items"]
        ]

    assert kinds("dead") == [first]
    assert kinds("cancelled") == [cancelled]
    assert kinds("failing") == [failing]
    assert kinds("dead,cancelled") == [cancelled, first]
    assert kinds("failing,dead") == [failing, first]


def test_a_failing_task_leaves_the_listing_once_it_moves_on(client: Client) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    task_id = make_task(client, pipeline_id, retry_policy={"max_attempts": 5})
    fail_next(client, role, "try again")
    lease = claimed(client, role)
    assert lease["task"]["id"] == task_id
    [item] = failures(client, f"pipeline_id={pipeline_id}")["items"]
    assert item["state"] == "failing" and item["leased"]  # retried right now
    r = client.post(
        f"/runs/{lease['run']['id']}/transition", {"trigger": "submit"}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body
    assert failures(client, f"pipeline_id={pipeline_id}")["items"] == []


def test_the_listing_pages_through_every_failure_once_newest_first(client: Client) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    dead = dead_letters(client, pipeline_id, role, [f"error {i}" for i in range(7)])
    for size in (1, 2, 3, 7, 50):
        items = every_page(client, f"pipeline_id={pipeline_id}", size)
        assert [i["id"] for i in items] == dead[::-1], size
    keys = [(i["at_ms"], i["id"]) for i in every_page(client, f"pipeline_id={pipeline_id}", 2)]
    assert keys == sorted(keys, reverse=True)


def test_failures_are_grouped_by_error_with_counts_and_newest_occurrence(
    client: Client,
) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    ids = dead_letters(
        client, pipeline_id, role, ["disk full", "timeout", "disk full", "disk full"]
    )
    r = client.get(f"/ops/failures/groups?pipeline_id={pipeline_id}")
    assert r.status == 200, r.body
    groups = r.json["groups"]
    assert [(g["state"], g["error"], g["count"]) for g in groups] == [
        ("dead_lettered", "disk full", 3),
        ("dead_lettered", "timeout", 1),
    ]
    items = {i["id"]: i for i in failures(client, f"pipeline_id={pipeline_id}")["items"]}
    assert groups[0]["newest_at_ms"] == items[ids[3]]["at_ms"]
    assert groups[0]["oldest_at_ms"] == items[ids[0]]["at_ms"]
    # A group's tasks: the listing filtered by its error.
    disk = failures(client, f"pipeline_id={pipeline_id}&kind=dead&error=disk+full")["items"]
    assert [i["id"] for i in disk] == [ids[3], ids[2], ids[0]]
    assert (
        client.get(f"/ops/failures/groups?pipeline_id={pipeline_id}&kind=cancelled").json["groups"]
        == []
    )


# --- bulk requeue and cancel -----------------------------------------------------------------


def test_bulk_requeue_answers_per_id_and_leaves_the_refused_as_they_were(
    client: Client,
) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    dead = dead_letters(client, pipeline_id, role, ["a", "b"])
    leased_id = make_task(client, pipeline_id)
    lease = claimed(client, role)
    assert lease["task"]["id"] == leased_id
    missing = unique("no-such-task")
    r = client.post(
        "/tasks/requeue", {"ids": [dead[1], missing, leased_id, dead[0]], "reason": "fixed"}
    )
    assert r.status == 200, r.body
    body = r.json
    assert [(i["id"], i["outcome"]) for i in body["items"]] == [
        (dead[1], "requeued"),
        (missing, "refused"),
        (leased_id, "refused"),
        (dead[0], "requeued"),
    ]
    assert body["items"][1]["error"]["code"] == "task_not_found"
    assert body["items"][2]["error"]["code"] == "task_leased"
    assert body["items"][0]["stage"] == "todo"  # back where it failed
    assert (body["done"], body["refused"]) == (2, 2)
    # Requeued: claimable again, and no longer dead-lettered (now retrying after failures).
    assert {claimed(client, role)["task"]["id"] for _ in range(2)} == set(dead)
    assert claim(client, role).status == 204
    states = {i["id"]: i["state"] for i in failures(client, f"pipeline_id={pipeline_id}")["items"]}
    assert states == {dead[0]: "failing", dead[1]: "failing"}
    # The leased task was left under its lease.
    assert client.get(f"/tasks/{leased_id}").json["latest_run"]["status"] == "running"
    events = client.get(f"/tasks/{dead[0]}/events").json["items"]
    assert [(e["kind"], e["data"]["reason"]) for e in events] == [("requeued", "fixed")]


def test_bulk_cancel_answers_per_id(client: Client) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    waiting = make_task(client, pipeline_id)
    done = make_task(client, pipeline_id)
    already = make_task(client, pipeline_id)
    assert client.post(f"/tasks/{already}/cancel", {}).status == 200
    lease = claimed(client, role)
    assert lease["task"]["id"] == waiting
    r = client.post(
        f"/runs/{lease['run']['id']}/transition", {"trigger": "submit"}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body
    waiting, done = done, waiting  # the first one finished; the second still waits
    r = client.post("/tasks/cancel", {"ids": [waiting, done, already], "reason": "scope cut"})
    assert r.status == 200, r.body
    outcomes = [(i["id"], i["outcome"]) for i in r.json["items"]]
    assert outcomes == [(waiting, "cancelled"), (done, "refused"), (already, "already_cancelled")]
    assert r.json["items"][1]["error"]["code"] == "task_finished"
    assert (r.json["done"], r.json["refused"]) == (1, 1)
    assert client.get(f"/tasks/{waiting}").json["cancel_reason"] == "scope cut"
    assert claim(client, role).status == 204
    listed = failures(client, f"pipeline_id={pipeline_id}&kind=cancelled")["items"]
    assert {i["id"] for i in listed} == {waiting, already}


def test_a_bulk_verb_replays_its_answer_under_the_same_idempotency_key(client: Client) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    [task_id] = dead_letters(client, pipeline_id, role, ["once"])
    key = {"Idempotency-Key": unique("bulk")}
    first = client.post("/tasks/requeue", {"ids": [task_id]}, headers=key)
    again = client.post("/tasks/requeue", {"ids": [task_id]}, headers=key)
    assert first.status == again.status == 200
    assert first.json == again.json
    events = client.get(f"/tasks/{task_id}/events").json["items"]
    assert [e["kind"] for e in events] == ["requeued"]  # requeued once


@pytest.mark.parametrize(
    ("method", "path", "body", "code"),
    [
        ("POST", "/tasks/requeue", {"ids": []}, "invalid_request"),
        ("POST", "/tasks/requeue", {"ids": [f"t{i}" for i in range(501)]}, "invalid_request"),
        ("POST", "/tasks/requeue", {"ids": "t1"}, "invalid_json"),
        ("POST", "/tasks/requeue", {}, "invalid_json"),
        ("POST", "/tasks/cancel", {"ids": []}, "invalid_request"),
        ("POST", "/tasks/cancel", [1, 2], "invalid_json"),
        ("GET", "/ops/failures?kind=everything", None, "invalid_request"),
        ("GET", "/ops/failures?kind=dead,,failing", None, "invalid_request"),
        ("GET", "/ops/failures?cursor=abc", None, "invalid_cursor"),
        ("GET", "/ops/failures?limit=0", None, "invalid_limit"),
        ("GET", "/ops/failures/groups?kind=bogus", None, "invalid_request"),
        ("GET", "/ops/failures/groups?limit=1001", None, "invalid_limit"),
    ],
)
def test_bad_input_gets_a_clear_400(
    client: Client, method: str, path: str, body: Any, code: str
) -> None:
    r = client.request(method, path, body)
    assert r.status == 400, (r.status, r.body)
    assert r.error_code == code


def test_a_bad_body_that_is_not_json_is_400(client: Client) -> None:
    r = client.request("POST", "/tasks/cancel", body=b"{not json")
    assert r.status == 400 and r.error_code == "invalid_json"


def test_the_failure_routes_need_the_admin_token(make_server: Any) -> None:
    token = unique("secret")
    server: Server = make_server(token=token)
    c = server.client()
    try:
        for method, path, body in (
            ("GET", "/ops/failures", None),
            ("GET", "/ops/failures/groups", None),
            ("POST", "/tasks/requeue", {"ids": ["t1"]}),
            ("POST", "/tasks/cancel", {"ids": ["t1"]}),
        ):
            r = c.request(method, path, body)
            assert r.status == 401 and r.error_code == "unauthorized", (path, r.body)
            assert c.request(method, path, body, token=token).status == 200, path
    finally:
        c.close()


@pytest.mark.process
def test_the_python_clients_list_group_and_act_in_bulk(shared_server: Server) -> None:
    import asyncio

    from nulltickets.client import AsyncClient
    from nulltickets.client import Client as ApiClient

    raw = shared_server.client()
    try:
        pipeline_id, role = pipeline_with_dead_letters(raw)
        ids = dead_letters(raw, pipeline_id, role, ["x", "y"])
    finally:
        raw.close()
    with ApiClient(shared_server.base) as api:
        page = api.list_failures(kind="dead", pipeline_id=pipeline_id, limit=1)
        assert [f.id for f in page.items] == [ids[1]] and page.next_cursor
        rest = api.list_failures(kind="dead", pipeline_id=pipeline_id, cursor=page.next_cursor)
        assert [f.id for f in rest.items] == [ids[0]]
        groups = api.failure_groups(pipeline_id=pipeline_id)
        assert sorted((g.error, g.count) for g in groups.groups) == [("x", 1), ("y", 1)]
        outcome = api.requeue_tasks([ids[0]])
        assert [(o.id, o.outcome) for o in outcome.items] == [(ids[0], "requeued")]

    async def cancel() -> list[str]:
        async with AsyncClient(shared_server.base) as api:
            done = await api.cancel_tasks(ids, reason="enough")
            listed = await api.list_failures(kind="cancelled", pipeline_id=pipeline_id)
            assert [f.id for f in listed.items] == [ids[0]]
            return [o.outcome for o in done.items]

    # ids[0] was requeued into todo; ids[1] still sits in the terminal stage `dead`.
    assert asyncio.run(cancel()) == ["cancelled", "refused"]


# --- the operator's commands -----------------------------------------------------------------


@pytest.mark.process
def test_tasks_show_prints_no_parked_eligibility_for_dead_or_cancelled_tasks(
    shared_server: Server, client: Client, tmp_path: Path
) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    [dead] = dead_letters(client, pipeline_id, role, ["gave up"])
    cancelled = make_task(client, pipeline_id)
    assert client.post(f"/tasks/{cancelled}/cancel", {"reason": "dropped"}).status == 200
    waiting = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 3_600_000})
    assert fail_next(client, role, "later") == waiting

    def show(task_id: str) -> str:
        result = run_cli("tasks", "show", task_id, "--base", shared_server.base, home=tmp_path)
        assert result.returncode == 0, result
        return result.stdout

    out = show(dead)
    assert "292278994" not in out and "eligible" not in out
    assert "dead letter max_attempts_exceeded (claimable again once requeued)" in out
    out = show(cancelled)
    assert "292278994" not in out and "eligible" not in out
    assert "dead letter" not in out  # a cancelled task is no dead letter
    assert "cancelled" in out and "dropped" in out
    out = show(waiting)
    [line] = [x for x in out.splitlines() if x.startswith("eligible")]
    year = int(line.split()[-1][:4])
    assert year == time.gmtime().tm_year or year == time.gmtime().tm_year + 1


@pytest.mark.process
def test_tasks_list_by_state_takes_a_pipeline_but_no_stage_or_role(
    shared_server: Server, client: Client, tmp_path: Path
) -> None:
    pipeline_id, role = pipeline_with_dead_letters(client)
    waiting = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 3_600_000})
    fail_next(client, role, "try later")
    base = ("--base", shared_server.base)
    result = run_cli(
        "tasks", "list", "--state", "failing", "--pipeline", pipeline_id, "--json", *base,
        home=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result
    [item] = json.loads(result.stdout)
    assert (item["id"], item["state"], item["last_error"]) == (waiting, "failing", "try later")
    plain = run_cli("tasks", "list", "--pipeline", pipeline_id, *base, home=tmp_path)
    assert plain.stdout.splitlines()[1].split()[:3] == [waiting, "todo", "waiting_retry"]
    refused = run_cli("tasks", "list", "--state", "dead", "--stage", "todo", *base, home=tmp_path)
    assert refused.returncode == 1
    assert "--state" in refused.stderr and "Traceback" not in refused.stderr
    unknown = run_cli("tasks", "list", "--state", "zombie", *base, home=tmp_path)
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr
