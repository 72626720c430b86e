"""GET /metrics: Prometheus's own parser reads it, and its counters follow what the API did."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import claim, claimed, make_task, pipeline_with_roles, unique, wait_for
from tests.server import Client, Server


def scrape(client: Client, **kw: Any) -> dict[str, list[Any]]:
    r = client.get("/metrics", **kw)
    assert r.status == 200, r.body
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(r.body.decode()):
        families[family.name] = list(family.samples)
    return families


def value(families: dict[str, list[Any]], name: str, **labels: str) -> float:
    """The sample `name` with these labels (0 when there is none yet)."""
    for family in families.values():
        for sample in family:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_metrics_parse_and_carry_build_info_and_the_process_figures(client: Client) -> None:
    families = scrape(client)
    [info] = families["nulltickets_build_info"]
    assert info.labels["version"]
    assert info.labels["core"] == client.get("/health").json["core"]
    assert info.labels["core"] in ("compiled", "python")
    for name in (
        "nulltickets_live_leases",
        "nulltickets_long_poll_waiters",
        "nulltickets_sse_clients",
        "nulltickets_writer_batches",
        "nulltickets_writer_jobs",
        "nulltickets_wal_bytes",
        "nulltickets_http_request_duration_seconds",
    ):
        assert name in families, sorted(families)


def test_counters_move_as_the_api_is_used(client: Client) -> None:
    before = scrape(client)
    pipeline_id, coder, reviewer = pipeline_with_roles(client)
    task_id = make_task(client, pipeline_id)
    lease = claimed(client, coder)
    assert claim(client, coder).status == 204
    r = client.post(
        f"/runs/{lease['run']['id']}/transition",
        {"trigger": "submit", "gates": {"tests": True}},
        token=lease["lease_token"],
    )
    assert r.status == 200, r.body
    second = claimed(client, reviewer)
    r = client.post(
        f"/runs/{second['run']['id']}/fail", {"error": "boom"}, token=second["lease_token"]
    )
    assert r.status == 200, r.body
    client.get(f"/tasks/{task_id}")
    after = scrape(client)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("nulltickets_claims_total", result="hit") == 2
    assert moved("nulltickets_claims_total", result="empty") == 1
    assert moved("nulltickets_transitions_total") == 1
    assert moved("nulltickets_run_failures_total") == 1
    assert moved("nulltickets_retries_total") + moved("nulltickets_dead_letters_total") == 1
    assert moved("nulltickets_run_events_total", kind="transition") == 1
    route = {"method": "GET", "route": "/tasks/{id}"}
    assert moved("nulltickets_http_requests_total", status="200", **route) == 1
    assert moved("nulltickets_http_request_duration_seconds_count", **route) == 1
    assert moved("nulltickets_http_request_duration_seconds_bucket", le="+Inf", **route) == 1
    assert moved("nulltickets_writer_jobs_total") >= 5


def test_queue_depth_per_role_and_stage(client: Client) -> None:
    pipeline_id, coder, _ = pipeline_with_roles(client)
    for _ in range(3):
        make_task(client, pipeline_id)
    claimed(client, coder)
    families = scrape(client)
    labels = {"role": coder, "pipeline_id": pipeline_id, "stage": "todo"}
    assert value(families, "nulltickets_queue_tasks", state="claimable", **labels) == 2
    assert value(families, "nulltickets_queue_tasks", state="leased", **labels) == 1
    assert value(families, "nulltickets_queue_oldest_claimable_age_seconds", **labels) >= 0
    assert value(families, "nulltickets_live_leases") >= 1


def test_lease_expiries_count(make_server: Any) -> None:
    server: Server = make_server()
    c = server.client()
    pipeline_id, coder, _ = pipeline_with_roles(c)
    make_task(c, pipeline_id)
    claimed(c, coder, lease_ttl_ms=100)
    wait_for("the expiry counted", lambda: value(scrape(c), "nulltickets_lease_expiries_total"))
    assert value(scrape(c), "nulltickets_lease_expiries_total") == 1
    c.close()


def test_metrics_are_gated_by_the_admin_token(make_server: Any) -> None:
    token = unique("metrics")
    server: Server = make_server(token=token)
    c = server.client()
    r = c.get("/metrics")
    assert (r.status, r.error_code) == (401, "unauthorized")
    assert "nulltickets_build_info" in scrape(c, token=token)
    c.close()
