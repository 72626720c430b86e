"""Long-poll claims over real HTTP: `POST /leases/claim` with `wait_ms` waits for work of its
role and claims it as soon as some may have become eligible (a task created or moved into the
stage, a release, an expired lease, a retry delay running out, a dependency resolved, an
assignment removed), else answers 204 when the time is up. A new task wakes one waiting claim,
not all of them: the one that waited longest, the agent it is assigned to, or, when the woken
one's per-state limits keep it from the task, one without them."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
from tests.server import Client, Response, Server

pytestmark = pytest.mark.e2e

LONG_WAIT_MS = 10_000
PROMPT_S = 3.0  # a woken claim answers well within this after its trigger
SETTLE_S = 0.3  # time for a long-poll claim to reach the server and start waiting

Waiting = Future[tuple[Response, float]]


def transition(client: Client, lease: dict[str, Any], trigger: str) -> None:
    r = client.post(
        f"/runs/{lease['run']['id']}/transition", {"trigger": trigger}, token=lease["lease_token"]
    )
    assert r.status == 200, r.body


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


def long_poll(
    pool: ThreadPoolExecutor,
    server: Server,
    role: str,
    agent: str,
    wait_ms: int = LONG_WAIT_MS,
    settle: bool = True,
    **fields: Any,
) -> Waiting:
    """Start a long-poll claim on its own connection in a thread; its result is the response and
    the monotonic time it arrived. By default, return once the claim is surely waiting."""

    def run() -> tuple[Response, float]:
        c = server.client()
        try:
            r = claim(c, role, agent, wait_ms=wait_ms, **fields)
            return r, time.monotonic()
        finally:
            c.close()

    waiting = pool.submit(run)
    if settle:
        time.sleep(SETTLE_S)
        assert not waiting.done(), "the long-poll claim answered before anything happened"
    return waiting


def woken_by(waiting: Waiting, trigger: Callable[[], Any]) -> dict[str, Any]:
    """Fire `trigger` and check the waiting claim got a task promptly, and not before."""
    assert not waiting.done(), "the long-poll claim answered before its trigger"
    fired_at = time.monotonic()
    trigger()
    r, answered_at = waiting.result(timeout=LONG_WAIT_MS / 1000 + 5)
    assert r.status == 200, (r.status, r.body)
    assert answered_at >= fired_at
    assert answered_at - fired_at < PROMPT_S, answered_at - fired_at
    return dict(r.json)


# --- waiting, and the time running out ---------------------------------------------------------


def test_long_poll_claims_at_once_when_work_is_there(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    started = time.monotonic()
    r = claim(client, coder, wait_ms=LONG_WAIT_MS)
    assert time.monotonic() - started < 1.0
    assert r.status == 200, r.body
    assert r.json["task"]["id"] == task_id


def test_long_poll_answers_204_when_nothing_comes(client: Client) -> None:
    _, coder, _ = pipeline_with_roles(client)
    started = time.monotonic()
    r = claim(client, coder, wait_ms=800)
    elapsed = time.monotonic() - started
    assert r.status == 204, (r.status, r.body)
    assert r.body == b""
    assert 0.75 <= elapsed < 2.5, elapsed


def test_long_poll_is_not_woken_by_work_of_another_role(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    _, coder, _ = pipeline_with_roles(client)
    other_pipeline, other_coder, _ = pipeline_with_roles(client)
    waiting = long_poll(pool, shared_server, coder, "waiter", wait_ms=1_000)
    make_task(client, other_pipeline)
    r, _ = waiting.result(timeout=5)
    assert r.status == 204, (r.status, r.body)
    assert claimed(client, other_coder)["run"]["attempt"] == 1


def test_long_poll_accepts_a_wait_longer_than_the_cap(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    waiting = long_poll(pool, shared_server, coder, "patient", wait_ms=10**9)
    lease = woken_by(waiting, lambda: make_task(client, pipeline_id))
    assert lease["run"]["agent_id"] == "patient"


# --- what wakes a waiting claim ----------------------------------------------------------------


@pytest.mark.parametrize("route", ["/tasks", "/tasks/bulk"])
def test_long_poll_is_woken_by_a_task_created_in_its_stage(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor, route: str
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    waiting = long_poll(pool, shared_server, coder, "waiter")
    created: list[str] = []

    def create() -> None:
        body = {"pipeline_id": pipeline_id, "title": unique("task"), "description": ""}
        r = client.post(route, {"tasks": [body]} if route.endswith("bulk") else body)
        assert r.status == 201, r.body
        created.extend(r.json["ids"] if route.endswith("bulk") else [r.json["id"]])

    lease = woken_by(waiting, create)
    assert lease["task"]["id"] == created[0]
    assert lease["run"]["agent_id"] == "waiter"
    assert lease["run"]["attempt"] == 1


def test_long_poll_is_woken_by_a_task_moved_into_its_stage(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    work = claimed(client, coder, "coder-agent")
    waiting = long_poll(pool, shared_server, reviewer, "reviewer-agent")
    lease = woken_by(waiting, lambda: transition(client, work, "submit"))
    assert lease["task"]["id"] == task_id
    assert lease["task"]["stage"] == "review"


def test_long_poll_is_woken_by_a_release(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    held = claimed(client, coder, "holder")
    waiting = long_poll(pool, shared_server, coder, "waiter")

    def release() -> None:
        r = client.post(f"/runs/{held['run']['id']}/release", token=held["lease_token"])
        assert r.status == 200, r.body

    lease = woken_by(waiting, release)
    assert lease["task"]["id"] == task_id
    assert lease["run"]["attempt"] == 2


def test_long_poll_is_woken_by_an_expired_lease(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lost = claimed(client, coder, "doomed", lease_ttl_ms=300)
    waiting = long_poll(pool, shared_server, coder, "rescuer", settle=False)
    started = time.monotonic()
    r, answered_at = waiting.result(timeout=LONG_WAIT_MS / 1000 + 5)
    assert r.status == 200, (r.status, r.body)
    assert answered_at - started < PROMPT_S, answered_at - started
    assert r.json["task"]["id"] == task_id
    assert r.json["run"]["attempt"] == 2
    assert r.json["run"]["started_at_ms"] >= lost["expires_at_ms"]


def test_long_poll_is_woken_when_a_retry_delay_runs_out(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, retry_policy={"retry_delay_ms": 700})
    first = claimed(client, coder, "first")
    failed_at = time.monotonic()
    r = client.post(
        f"/runs/{first['run']['id']}/fail", {"error": "flaky"}, token=first["lease_token"]
    )
    assert r.status == 200, r.body
    eligible_at = client.get(f"/tasks/{task_id}").json["next_eligible_at_ms"]

    waiting = long_poll(pool, shared_server, coder, "second", settle=False)
    r, answered_at = waiting.result(timeout=LONG_WAIT_MS / 1000 + 5)
    assert r.status == 200, (r.status, r.body)
    assert r.json["task"]["id"] == task_id
    assert r.json["run"]["attempt"] == 2
    # Right after the delay, not before it.
    assert r.json["run"]["started_at_ms"] >= eligible_at
    assert 0.65 <= answered_at - failed_at < PROMPT_S, answered_at - failed_at


def test_long_poll_is_woken_when_a_dependency_is_resolved(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    up_pipeline, up_coder, up_reviewer = pipeline_with_roles(client)
    upstream = make_task(client, up_pipeline)
    pipeline_id, coder, _ = pipeline_with_roles(client)
    downstream = make_task(client, pipeline_id, dependencies=[upstream])
    work = claimed(client, up_coder, "up")
    transition(client, work, "submit")  # upstream in a later, not yet terminal, stage
    review = claimed(client, up_reviewer, "up")

    waiting = long_poll(pool, shared_server, coder, "waiter")
    lease = woken_by(waiting, lambda: transition(client, review, "approve"))
    assert lease["task"]["id"] == downstream


def test_long_poll_is_woken_when_a_dependency_is_dead_lettered_into_a_terminal_stage(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    up_pipeline, up_coder, _ = pipeline_with_roles(client)
    upstream = make_task(
        client, up_pipeline, retry_policy={"max_attempts": 1, "dead_letter_stage": "dead"}
    )
    pipeline_id, coder, _ = pipeline_with_roles(client)
    downstream = make_task(client, pipeline_id, dependencies=[upstream])
    work = claimed(client, up_coder, "up")

    def fail_upstream() -> None:
        r = client.post(
            f"/runs/{work['run']['id']}/fail", {"error": "poison"}, token=work["lease_token"]
        )
        assert r.status == 200, r.body

    waiting = long_poll(pool, shared_server, coder, "waiter")
    lease = woken_by(waiting, fail_upstream)  # "dead" is terminal: the dependency resolves
    assert lease["task"]["id"] == downstream


def test_long_poll_is_woken_when_an_assignment_is_removed(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id, assigned_agent_id="bob")
    waiting = long_poll(pool, shared_server, coder, "alice")

    def unassign() -> None:
        r = client.delete(f"/tasks/{task_id}/assignments/bob")
        assert r.status == 200, r.body

    lease = woken_by(waiting, unassign)
    assert lease["task"]["id"] == task_id
    assert lease["run"]["agent_id"] == "alice"


# --- several waiters, and waiters that go away -------------------------------------------------


def test_one_new_task_goes_to_exactly_one_of_two_waiters(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    started = time.monotonic()
    waiters = [
        long_poll(pool, shared_server, coder, f"waiter-{n}", wait_ms=1_500, settle=False)
        for n in range(2)
    ]
    time.sleep(SETTLE_S)
    assert not any(w.done() for w in waiters)
    created_at = time.monotonic()
    task_id = make_task(client, pipeline_id)

    results = [w.result(timeout=10) for w in waiters]
    winners = [(r, t) for r, t in results if r.status == 200]
    losers = [(r, t) for r, t in results if r.status == 204]
    assert len(winners) == 1 and len(losers) == 1, [(r.status, r.body) for r, _ in results]
    won, won_at = winners[0]
    assert won.json["task"]["id"] == task_id
    assert won_at - created_at < PROMPT_S
    # The other one kept waiting until its time was up.
    lost, lost_at = losers[0]
    assert lost.body == b""
    assert lost_at - started >= 1.4, lost_at - started
    details = client.get(f"/tasks/{task_id}").json
    assert details["latest_run"]["agent_id"] == won.json["run"]["agent_id"]
    assert details["latest_run"]["attempt"] == 1


@pytest.mark.process
def test_a_waiter_that_disconnects_never_gets_a_lease(
    client: Client, shared_server: Server
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    ghost = unique("ghost")
    body = json.dumps({"agent_id": ghost, "agent_role": coder, "wait_ms": LONG_WAIT_MS}).encode()
    head = (
        "POST /leases/claim HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", shared_server.port), timeout=5)
    try:
        sock.sendall(head + body)
        time.sleep(SETTLE_S)  # the claim is waiting now
    finally:
        sock.close()
    time.sleep(SETTLE_S)  # the server notices the hang-up

    task_id = make_task(client, pipeline_id)
    r = claim(client, coder, "rescuer")
    assert r.status == 200, (r.status, r.body)
    assert r.json["task"]["id"] == task_id
    assert r.json["run"]["attempt"] == 1

    time.sleep(0.2)  # a late claim by the ghost would show up here
    latest = client.get(f"/tasks/{task_id}").json["latest_run"]
    assert latest["agent_id"] == "rescuer"
    assert latest["attempt"] == 1
    assert client.post("/agents/release", {"agent_id": ghost}).json["released"] == []


# --- one wake-up per piece of work -------------------------------------------------------------


def wakeups(client: Client) -> float:
    r = client.get("/metrics")
    assert r.status == 200, r.body
    for line in r.body.decode().splitlines():
        if line.startswith("nulltickets_long_poll_wakeups_total "):
            return float(line.split()[1])
    raise AssertionError("no nulltickets_long_poll_wakeups_total in /metrics")


def test_a_new_task_wakes_one_of_many_waiting_claims(fresh_server: Server) -> None:
    client = fresh_server.client()
    pipeline_id, coder, _ = pipeline_with_roles(client)
    with ThreadPoolExecutor(max_workers=8) as many:
        waiters = [
            long_poll(many, fresh_server, coder, f"waiter-{n}", wait_ms=3_000, settle=False)
            for n in range(8)
        ]
        wait_for("8 waiting claims", lambda: waiting_claims(client) == 8)
        before = wakeups(client)
        task_id = make_task(client, pipeline_id)
        done, _ = wait_first(waiters)
        r, _ = done.result()
        assert r.status == 200, r.body
        assert r.json["task"]["id"] == task_id
        assert wakeups(client) - before == 1  # one claim woken, not eight
        assert sum(not w.done() for w in waiters) == 7
        results = [w.result(timeout=10)[0].status for w in waiters]
    assert sorted(results) == [200] + [204] * 7
    client.close()


def waiting_claims(client: Client) -> float:
    for line in client.get("/metrics").body.decode().splitlines():
        if line.startswith("nulltickets_long_poll_waiters "):
            return float(line.split()[1])
    return 0.0


def wait_first(waiters: list[Waiting]) -> tuple[Waiting, list[Waiting]]:
    from concurrent.futures import FIRST_COMPLETED, wait

    done, pending = wait(waiters, timeout=PROMPT_S, return_when=FIRST_COMPLETED)
    assert done, "no waiting claim answered"
    return next(iter(done)), list(pending)


@pytest.mark.parametrize("how", ["created", "assigned"])
def test_a_task_for_an_agent_wakes_that_agent_not_the_claim_that_waited_longest(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor, how: str
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    # Made before anyone waits: its own wake-up must not reorder the waiting claims.
    task_id = make_task(client, pipeline_id, assigned_agent_id="carol") if how == "assigned" else ""
    alice = long_poll(pool, shared_server, coder, "alice", wait_ms=4_000)
    bob = unique("bob")
    waiting = long_poll(pool, shared_server, coder, bob)

    def give_bob() -> None:
        if how == "created":
            make_task(client, pipeline_id, assigned_agent_id=bob)
        else:
            r = client.post(f"/tasks/{task_id}/assignments", {"agent_id": bob})
            assert r.status == 201, r.body

    lease = woken_by(waiting, give_bob)
    assert lease["run"]["agent_id"] == bob
    assert not alice.done(), "the claim that waited longest was answered too"
    assert alice.result(timeout=10)[0].status == 204


def test_a_claim_held_back_by_its_per_state_limit_hands_the_task_to_one_without(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    claimed(client, coder, "holder")  # todo now has one task leased
    limited = long_poll(
        pool, shared_server, coder, "limited", wait_ms=4_000, concurrency={"per_state": {"todo": 1}}
    )
    plain = long_poll(pool, shared_server, coder, "plain")
    lease = woken_by(plain, lambda: make_task(client, pipeline_id))
    assert lease["run"]["agent_id"] == "plain"
    assert limited.result(timeout=10)[0].status == 204


def test_a_claim_held_back_by_its_per_state_limit_takes_the_task_once_the_slot_frees_elsewhere(
    client: Client, shared_server: Server, pool: ThreadPoolExecutor
) -> None:
    """A per-state limit counts the stage's name in every pipeline: the slot frees when a
    task of another pipeline and role leaves a stage of that name, which wakes nobody of this
    role. A waiting claim so held back tries again by itself (each second) and takes its
    task before its wait ends."""
    stage, coder, other = unique("build"), unique("coder"), unique("other")

    def pipeline(role: str) -> str:
        return create_pipeline(
            client,
            {
                "initial": stage,
                "states": {stage: {"agent_role": role}, "done": {"terminal": True}},
                "transitions": [{"from": stage, "to": "done", "trigger": "finish"}],
            },
        )

    mine, theirs = pipeline(coder), pipeline(other)
    make_task(client, theirs)
    held = claimed(client, other, "holder")  # one task leased in a stage of that name
    make_task(client, mine)
    limited = long_poll(
        pool, shared_server, coder, "limited", concurrency={"per_state": {stage: 1}}
    )
    lease = woken_by(limited, lambda: transition(client, held, "finish"))
    assert lease["run"]["agent_id"] == "limited"
