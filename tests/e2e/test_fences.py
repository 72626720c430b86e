"""Fenced leases over real HTTP: every claim of a task returns a fence one higher than the last,
and a lease-protected write that names an `expected_fence` the task has moved past is refused
with 409 lease_superseded, even when the old lease is long gone (a zombie agent)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import (
    claimed,
    kinds,
    make_task,
    pipeline_with_roles,
    task,
    wait_until_stale,
)
from tests.server import Client, Response, Server

pytestmark = pytest.mark.e2e

SHORT_TTL = 300


def release(client: Client, lease: dict[str, Any]) -> None:
    r = client.post(f"/runs/{lease['run']['id']}/release", token=lease["lease_token"])
    assert r.status == 200, r.body


def lease_writes(lease: dict[str, Any]) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Every lease-protected write of `lease`, by name: (method, path, body without fence)."""
    run_id = lease["run"]["id"]
    return {
        "heartbeat": ("POST", f"/leases/{lease['lease_id']}/heartbeat", {}),
        "events": ("POST", f"/runs/{run_id}/events", {"kind": "progress", "data": {"n": 1}}),
        "checkpoint": ("PUT", f"/runs/{run_id}/checkpoint", {"checkpoint": {"zombie": True}}),
        "transition": ("POST", f"/runs/{run_id}/transition", {"trigger": "submit"}),
        "fail": ("POST", f"/runs/{run_id}/fail", {"error": "zombie"}),
        "release": ("POST", f"/runs/{run_id}/release", {"reason": "zombie"}),
    }


def write(client: Client, lease: dict[str, Any], name: str, fence: int | None) -> Response:
    method, path, body = lease_writes(lease)[name]
    if fence is not None:
        body = {**body, "expected_fence": fence}
    return client.request(method, path, body, token=lease["lease_token"])


def superseded(client: Client) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Agent A claims with a short lease and vanishes; once it expired, agent B claims the task.
    Returns (task_id, A's claim, B's claim)."""
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    zombie = claimed(client, coder, "agent-a", lease_ttl_ms=SHORT_TTL)
    assert zombie["fence"] == 1
    wait_until_stale(client, task_id, zombie["run"]["id"])
    holder = claimed(client, coder, "agent-b")
    assert holder["task"]["id"] == task_id
    assert holder["fence"] == holder["task"]["fence"] == 2
    return task_id, zombie, holder


# --- fences grow with each claim -----------------------------------------------------------------


def test_each_claim_of_a_task_gets_the_next_fence(client: Client) -> None:
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    other_id = make_task(client, pipeline_id)
    assert task(client, task_id)["fence"] == 0

    fences = []
    for n in range(3):
        lease = claimed(client, coder, f"agent-{n}")
        assert lease["task"]["id"] == task_id
        assert lease["task"]["fence"] == lease["fence"]
        assert task(client, task_id)["fence"] == lease["fence"]
        fences.append(lease["fence"])
        if n < 2:
            release(client, lease)
    assert fences == [1, 2, 3]

    # Fences are per task: the other task starts at 1.
    assert claimed(client, coder, "agent-x")["fence"] == 1
    assert task(client, other_id)["fence"] == 1

    # A claim in the next stage counts too.
    r = client.post(
        f"/runs/{lease['run']['id']}/transition",
        {"trigger": "submit", "expected_fence": 3},
        token=lease["lease_token"],
    )
    assert r.status == 200, r.body
    review = claimed(client, reviewer, "agent-r")
    assert review["task"]["id"] == task_id
    assert review["fence"] == 4
    assert client.get(f"/tasks/{task_id}/checkpoint").json["fence"] == 4


@pytest.mark.parametrize(
    "name", ["heartbeat", "events", "checkpoint", "transition", "fail", "release"]
)
def test_a_write_with_the_current_fence_works_as_before(client: Client, name: str) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claimed(client, coder)
    r = write(client, lease, name, lease["fence"])
    assert r.status in (200, 201), (name, r.status, r.body)


@pytest.mark.parametrize(
    "name", ["heartbeat", "events", "checkpoint", "transition", "fail", "release"]
)
def test_a_write_without_a_fence_works_as_before(client: Client, name: str) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline_id)
    lease = claimed(client, coder)
    r = write(client, lease, name, None)
    assert r.status in (200, 201), (name, r.status, r.body)


# --- a zombie agent ----------------------------------------------------------------------------


def test_a_zombie_with_an_old_fence_is_superseded_on_every_run_write(client: Client) -> None:
    task_id, zombie, holder = superseded(client)
    outcomes = {}
    for name in ("events", "checkpoint", "transition", "fail", "release"):
        r = write(client, zombie, name, zombie["fence"])
        outcomes[name] = (r.status, r.json["error"]["code"] if r.status >= 400 else r.body)
    assert outcomes == {
        name: (409, "lease_superseded")
        for name in ("events", "checkpoint", "transition", "fail", "release")
    }

    # Nothing the zombie tried touched the task or the holder's run.
    details = task(client, task_id)
    assert details["stage"] == "todo"
    assert details["task_version"] == 1
    assert details["checkpoint"] is None
    assert details["fence"] == 2
    assert details["latest_run"]["id"] == holder["run"]["id"]
    assert details["latest_run"]["status"] == "running"
    assert "progress" not in kinds(client, zombie["run"]["id"])

    # The holder, with its fence, carries on.
    r = write(client, holder, "checkpoint", 2)
    assert r.status == 200, r.body
    assert r.json["fence"] == 2
    r = write(client, holder, "transition", 2)
    assert r.status == 200, r.body
    assert task(client, task_id)["stage"] == "review"


def test_a_zombie_heartbeat_with_an_old_fence_is_superseded(client: Client) -> None:
    _, zombie, holder = superseded(client)
    r = write(client, zombie, "heartbeat", zombie["fence"])
    assert r.status == 409, (r.status, r.body)
    assert r.error_code == "lease_superseded"
    r = write(client, holder, "heartbeat", holder["fence"])
    assert r.status == 200, r.body


def test_zombie_transition_and_checkpoint_race_the_new_holder(client: Client) -> None:
    task_id, zombie, holder = superseded(client)
    r = write(client, zombie, "transition", 1)
    assert r.status == 409, r.body
    assert r.error_code == "lease_superseded"
    r = write(client, zombie, "checkpoint", 1)
    assert r.status == 409, r.body
    assert r.error_code == "lease_superseded"

    r = write(client, holder, "checkpoint", 2)
    assert r.status == 200, r.body
    assert r.json["checkpoint"] == {"zombie": True}  # the body the helper sends
    r = write(client, holder, "transition", 2)
    assert r.status == 200, r.body
    assert r.json == {"previous_stage": "todo", "new_stage": "review", "trigger": "submit"}
    details = task(client, task_id)
    assert details["stage"] == "review"
    assert details["latest_run"]["id"] == holder["run"]["id"]
    assert details["latest_run"]["status"] == "completed"


def test_the_holder_with_a_stale_fence_of_its_own_is_superseded_after_a_release(
    client: Client,
) -> None:
    """An agent that released and whose task was claimed again cannot write with its old fence
    and token, whether or not its lease row still exists."""
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    first = claimed(client, coder, "first")
    release(client, first)
    second = claimed(client, coder, "second")
    assert second["fence"] == 2
    r = write(client, first, "checkpoint", first["fence"])
    assert r.status == 409, r.body
    assert r.error_code == "lease_superseded"
    assert task(client, task_id)["checkpoint"] is None


# --- concurrent writes of one holder -------------------------------------------------------------


def race_checkpoint_and_release(
    pool: ThreadPoolExecutor, clients: list[Client], lease: dict[str, Any], patch: dict[str, Any]
) -> tuple[Response, Response]:
    """The holder of `lease` writes a checkpoint and releases at the same moment, on two
    connections. Returns (checkpoint response, release response)."""
    run_id, token, fence = lease["run"]["id"], lease["lease_token"], lease["fence"]
    barrier = threading.Barrier(2)

    def do_checkpoint() -> Response:
        barrier.wait(timeout=5)
        return clients[0].put(
            f"/runs/{run_id}/checkpoint",
            {"checkpoint": patch, "expected_fence": fence},
            token=token,
        )

    def do_release() -> Response:
        barrier.wait(timeout=5)
        return clients[1].post(
            f"/runs/{run_id}/release", {"reason": "race", "expected_fence": fence}, token=token
        )

    cp, rel = pool.submit(do_checkpoint), pool.submit(do_release)
    return cp.result(timeout=10), rel.result(timeout=10)


def test_concurrent_checkpoint_and_release_end_consistently(
    client: Client, shared_server: Server
) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    clients = [shared_server.client(), shared_server.client()]
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            for round_no in range(12):
                lease = claimed(client, coder, f"agent-{round_no}")
                assert lease["task"]["id"] == task_id
                cp, rel = race_checkpoint_and_release(
                    pool, clients, lease, {f"round-{round_no}": True}
                )

                assert rel.status == 200, (round_no, rel.status, rel.body)
                assert cp.status in (200, 404), (round_no, cp.status, cp.body)
                run_kinds = kinds(client, lease["run"]["id"])
                stored = client.get(f"/tasks/{task_id}/checkpoint").json
                if cp.status == 200:
                    assert cp.json["checkpoint"][f"round-{round_no}"] is True
                    assert stored["checkpoint"][f"round-{round_no}"] is True
                    assert run_kinds.index("checkpoint") < run_kinds.index("released")
                else:
                    assert cp.error_code == "not_found"
                    assert f"round-{round_no}" not in (stored["checkpoint"] or {})
                    assert "checkpoint" not in run_kinds
                assert run_kinds.count("released") == 1
                details = task(client, task_id)
                assert details["latest_run"]["id"] == lease["run"]["id"]
                assert details["latest_run"]["status"] == "released"
                assert details["previous_failures"] == []
                assert details["fence"] == round_no + 1
    finally:
        for c in clients:
            c.close()
