"""GET /ops/queue: per-role health of the queue (contract §15)."""

from __future__ import annotations

from typing import Any

from tests.conftest import pipeline_with_roles
from tests.server import Client, Server


def role_report(client: Client, role: str, query: str = "") -> dict[str, Any]:
    r = client.get(f"/ops/queue{query}")
    assert r.status == 200, r.body
    assert isinstance(r.json["generated_at_ms"], int)
    [report] = [x for x in r.json["roles"] if x["role"] == role]
    return dict(report)


def add_tasks(client: Client, pipeline_id: str, n: int, **extra: Any) -> list[str]:
    r = client.post(
        "/tasks/bulk",
        {
            "tasks": [
                {"pipeline_id": pipeline_id, "title": f"t{i}", "description": "", **extra}
                for i in range(n)
            ]
        },
    )
    assert r.status == 201, r.body
    return list(r.json["ids"])


def claim(client: Client, role: str, **extra: Any) -> dict[str, Any]:
    r = client.post("/leases/claim", {"agent_id": "ops-agent", "agent_role": role, **extra})
    assert r.status == 200, r.body
    return dict(r.json)


def test_a_fresh_server_lists_no_roles(fresh_server: Server) -> None:
    c = fresh_server.client()
    try:
        assert c.get("/ops/queue").json["roles"] == []
    finally:
        c.close()


def test_roles_are_listed_even_with_nothing_to_do(client: Client) -> None:
    _, coder, reviewer = pipeline_with_roles(client)
    for role in (coder, reviewer):
        assert role_report(client, role) == {
            "role": role,
            "claimable_count": 0,
            "oldest_claimable_age_ms": None,
            "failed_count": 0,
            "stuck_count": 0,
            "near_expiry_leases": 0,
        }


def test_claimable_count_excludes_leased_delayed_blocked_and_dead_tasks(client: Client) -> None:
    pid, coder, _ = pipeline_with_roles(client)
    upstream = add_tasks(client, pid, 1)[0]
    add_tasks(client, pid, 3)
    blocked = client.post(
        "/tasks", {"pipeline_id": pid, "title": "b", "description": "", "dependencies": [upstream]}
    )
    assert blocked.status == 201
    report = role_report(client, coder)
    assert report["claimable_count"] == 4
    assert report["oldest_claimable_age_ms"] >= 0
    claim(client, coder)
    assert role_report(client, coder)["claimable_count"] == 3


def test_failures_stuck_runs_and_near_expiry_leases_are_counted(client: Client) -> None:
    pid, coder, _ = pipeline_with_roles(client)
    add_tasks(client, pid, 2, retry_policy={"retry_delay_ms": 3_600_000})
    failed = claim(client, coder)
    r = client.post(
        f"/runs/{failed['run']['id']}/fail", {"error": "boom"}, token=failed["lease_token"]
    )
    assert r.status == 200
    claim(client, coder, lease_ttl_ms=30_000)
    report = role_report(client, coder, "?stuck_ms=0&near_expiry_ms=60000")
    assert report["failed_count"] == 1
    assert report["stuck_count"] == 1
    assert report["near_expiry_leases"] == 1
    assert report["claimable_count"] == 0  # one waits for its retry delay, one is leased
    calm = role_report(client, coder, "?stuck_ms=3600000&near_expiry_ms=1")
    assert calm["stuck_count"] == 0 and calm["near_expiry_leases"] == 0


def test_bad_window_parameters_fall_back_to_the_defaults(client: Client) -> None:
    _, coder, _ = pipeline_with_roles(client)
    assert role_report(client, coder, "?stuck_ms=abc&near_expiry_ms=")["stuck_count"] == 0
