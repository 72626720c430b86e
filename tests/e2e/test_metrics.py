"""GET /metrics: Prometheus's own parser reads it, and its counters follow what the API did."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import (
    TEST_BACKEND,
    claim,
    claimed,
    make_task,
    pipeline_with_roles,
    unique,
    wait_for,
)
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
    """The sum of the samples `name` with these labels (whatever their other labels; 0 when
    there is none yet)."""
    return sum(
        float(sample.value)
        for family in families.values()
        for sample in family
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def delta(before: dict[str, list[Any]], after: dict[str, list[Any]]) -> Callable[..., float]:
    """moved(name, **labels): how far the samples `name` with these labels moved from one scrape
    to the next."""

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    return moved


def pipeline_and_three_tasks(client: Client) -> None:
    """Four writes, each answered before the next is sent."""
    pipeline_id, _, _ = pipeline_with_roles(client)
    for _ in range(3):
        make_task(client, pipeline_id)


def test_metrics_parse_and_carry_build_info_and_the_process_figures(client: Client) -> None:
    families = scrape(client)
    [info] = families["nulltickets_build_info"]
    assert info.labels["version"]
    assert info.labels["core"] == client.get("/health").json["core"]
    assert info.labels["core"] in ("compiled", "python")
    names = [
        "nulltickets_live_leases",
        "nulltickets_long_poll_waiters",
        "nulltickets_sse_clients",
        "nulltickets_waiting_limit",
        "nulltickets_admissions",
        "nulltickets_long_poll_wakeups",
        "nulltickets_http_request_duration_seconds",
        "nulltickets_claim_wait_seconds",
        "nulltickets_commit_duration_seconds",
    ]
    sqlite_only = [
        "nulltickets_writer_batches",
        "nulltickets_writer_jobs",
        "nulltickets_wal_bytes",
        "nulltickets_checkpoint_duration_seconds",
        "nulltickets_writer_batch_size",
    ]
    # Units of work run again (lost races, connections gone before COMMIT), and one-statement
    # writes of one turn of the loop committed together: PostgreSQL's alone.
    postgres_only = [
        "nulltickets_storage_retries",
        "nulltickets_storage_combined_commits",
        "nulltickets_storage_combined_units",
        "nulltickets_storage_combined_failures",
    ]
    if TEST_BACKEND == "sqlite":
        names += sqlite_only
        assert not set(postgres_only) & set(families), sorted(families)
    else:  # PostgreSQL has no writer batches nor WAL checkpoints of ours: no such series
        assert not set(sqlite_only) & set(families), sorted(families)
        names += postgres_only
    for name in names:
        assert name in families, sorted(families)
    for family in text_string_to_metric_families(client.get("/metrics").body.decode()):
        if family.name in ("nulltickets_commit_duration_seconds", "nulltickets_claim_wait_seconds"):
            assert family.type == "histogram"
    # The server's own limits on waiting, set at start from what it can hold.
    for kind in ("long_poll", "event_stream"):
        assert value(families, "nulltickets_waiting_limit", kind=kind) > 0


def test_counters_move_as_the_api_is_used(fresh_client: Client) -> None:
    # Its own server: on the shared one, a lease another test left behind can expire between
    # the two scrapes and move the retry counter.
    client = fresh_client
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
    moved = delta(before, after)

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
    assert moved("nulltickets_commit_duration_seconds_count") >= 1
    if TEST_BACKEND == "sqlite":  # the writer's batches are SQLite's
        assert moved("nulltickets_writer_jobs_total") >= 5
    else:  # one commit per unit of work
        assert moved("nulltickets_commit_duration_seconds_count") >= 5


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


def test_commits_and_batches_are_timed_and_sized(client: Client) -> None:
    before = scrape(client)
    pipeline_and_three_tasks(client)
    after = scrape(client)
    moved = delta(before, after)

    # Each write is committed (alone or with others): at least one commit, timed.
    assert moved("nulltickets_commit_duration_seconds_count") >= 1
    assert moved("nulltickets_commit_duration_seconds_bucket", le="+Inf") >= 1
    assert moved("nulltickets_commit_duration_seconds_sum") > 0
    if TEST_BACKEND == "sqlite":
        # Each committed batch is one observation of its size; the sizes add up to the jobs.
        assert moved("nulltickets_writer_batch_size_count") == moved(
            "nulltickets_writer_batches_total"
        )
        assert moved("nulltickets_writer_batch_size_sum") == moved("nulltickets_writer_jobs_total")
        assert moved("nulltickets_writer_batch_size_sum") >= 4  # the pipeline and three tasks


def test_wal_syncs_and_the_wait_for_them_are_timed_with_durability_full(make_server: Any) -> None:
    """With `full` (the default) on SQLite the WAL is synced apart from the commits: each sync
    is timed, and so is each batch's wait for one; with `normal` there is neither series."""
    full = make_server().client()
    normal = make_server(args=["--durability", "normal"]).client()
    if TEST_BACKEND != "sqlite":
        for c in (full, normal):
            assert "nulltickets_wal_sync_duration_seconds" not in scrape(c)
            c.close()
        return
    before = scrape(full)
    pipeline_and_three_tasks(full)
    after = scrape(full)
    moved = delta(before, after)

    for family in ("nulltickets_wal_sync_duration_seconds", "nulltickets_durable_wait_seconds"):
        assert family in after, sorted(after)
    # Every answered write waited for a sync: at least one, each timed.
    syncs = moved("nulltickets_wal_sync_duration_seconds_count")
    assert syncs >= 1
    assert moved("nulltickets_wal_sync_duration_seconds_bucket", le="+Inf") == syncs
    assert moved("nulltickets_wal_sync_duration_seconds_sum") > 0
    # One wait per committed batch at most (a batch re-run after a failed write commits twice),
    # and at least one per request answered here, each made in its own batch.
    waits = moved("nulltickets_durable_wait_seconds_count")
    assert 4 <= waits <= moved("nulltickets_writer_batches_total")
    assert moved("nulltickets_durable_wait_seconds_sum") > 0
    families = scrape(normal)
    assert "nulltickets_writer_batches" in families
    assert "nulltickets_wal_sync_duration_seconds" not in families
    assert "nulltickets_durable_wait_seconds" not in families
    full.close()
    normal.close()


def test_wal_checkpoints_are_timed(make_server: Any) -> None:
    server: Server = make_server()
    c = server.client()
    if TEST_BACKEND != "sqlite":
        assert "nulltickets_checkpoint_duration_seconds" not in scrape(c)
        c.close()
        return
    assert value(scrape(c), "nulltickets_checkpoint_duration_seconds_count") == 0
    # About 60 KB a write: the WAL passes the 1000 frames that wake the checkpointer.
    ns = unique("bulk")
    for i in range(100):
        body = {"value": {"text": f"{i}-{unique('x') * 1400}"}}
        assert c.put(f"/store/{ns}/k{i}", body).status == 204

    def checkpoints() -> float:
        families = scrape(c)
        count = value(families, "nulltickets_checkpoint_duration_seconds_count")
        total = value(families, "nulltickets_wal_checkpoints_total") + value(
            families, "nulltickets_wal_checkpoints_forced_total"
        )
        return count if count == total else 0

    count = wait_for("a timed WAL checkpoint", checkpoints)
    families = scrape(c)
    assert value(families, "nulltickets_checkpoint_duration_seconds_sum") > 0
    assert value(families, "nulltickets_checkpoint_duration_seconds_bucket", le="+Inf") >= count
    c.close()


def test_long_poll_claims_count_their_wait_by_outcome(shared_server: Server) -> None:
    c = shared_server.client()
    pipeline_id, coder, _ = pipeline_with_roles(c)
    before = scrape(c)
    # An empty long poll: answers 204 once its 100 ms have passed.
    assert claim(c, coder, wait_ms=100).status == 204
    # A long poll that waits until a task is created, then gets it.
    answers: list[int] = []

    def agent() -> None:
        waiting = shared_server.client()
        try:
            answers.append(claim(waiting, coder, wait_ms=20_000).status)
        finally:
            waiting.close()

    worker = threading.Thread(target=agent)
    worker.start()
    try:
        wait_for(
            "the claim waiting", lambda: value(scrape(c), "nulltickets_long_poll_waiters") >= 1
        )
        make_task(c, pipeline_id)
    finally:
        worker.join(30)
    assert answers == [200]
    after = scrape(c)
    moved = delta(before, after)

    wait = "nulltickets_claim_wait_seconds"
    assert moved(f"{wait}_count", outcome="hit") == 1
    assert moved(f"{wait}_bucket", outcome="hit", le="+Inf") == 1
    assert moved(f"{wait}_sum", outcome="hit") > 0
    assert moved(f"{wait}_count", outcome="empty") == 1
    assert moved(f"{wait}_bucket", outcome="empty", le="0.05") == 0  # it waited its 100 ms
    # It waited its 100 ms: the sum is a difference of clock readings, and the loop's timer
    # may fire a hair before its deadline.
    assert moved(f"{wait}_sum", outcome="empty") >= 0.095
    assert moved("nulltickets_claims_total", result="hit", mode="long_poll") == 1
    assert moved("nulltickets_claims_total", result="empty", mode="long_poll") == 1
    assert moved("nulltickets_claims_total", mode="immediate") == 0
    # An immediate claim counts as such, and does not enter the wait histogram.
    make_task(c, pipeline_id)
    claimed(c, coder)
    again = scrape(c)
    assert (
        value(again, "nulltickets_claims_total", result="hit", mode="immediate")
        - value(after, "nulltickets_claims_total", result="hit", mode="immediate")
        == 1
    )
    assert value(again, f"{wait}_count") == value(after, f"{wait}_count")
    c.close()


@pytest.mark.process
def test_start_up_is_frozen_and_collections_are_rare_and_timed(make_server: Any) -> None:
    """What start-up made is out of every garbage collection, a young collection waits for
    tens of thousands of new objects (with CPython's default, 700, 16 agents made one about
    every 30 requests, and a full one every few thousand), and each collection is timed."""
    server: Server = make_server()
    client = server.client()
    before = scrape(client)
    assert value(before, "nulltickets_gc_frozen_objects") > 10_000
    pauses = {s.labels["generation"] for s in before["nulltickets_gc_pause_seconds"]}
    assert pauses == {"0", "1", "2"}

    def agent() -> None:  # 3 writes a cycle: a task, its claim and its run's transition
        own = server.client()
        pipeline_id, coder, _ = pipeline_with_roles(own)  # roles of its own: no races
        for _ in range(60):
            make_task(own, pipeline_id)
            lease = claimed(own, coder)
            r = own.post(
                f"/runs/{lease['run']['id']}/transition",
                {"trigger": "submit", "gates": {"tests": True}},
                token=lease["lease_token"],
            )
            assert r.status == 200, r.body
        own.close()

    agents = [threading.Thread(target=agent) for _ in range(16)]
    for t in agents:
        t.start()
    for t in agents:
        t.join()
    after = scrape(client)
    moved = delta(before, after)
    assert value(after, "nulltickets_transitions_total") == 16 * 60
    assert moved("nulltickets_gc_pause_seconds_count", generation="0") <= 1
    assert moved("nulltickets_gc_pause_seconds_count", generation="2") == 0
    client.close()
