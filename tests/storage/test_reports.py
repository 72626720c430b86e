"""The reads behind the operator's reports, /health, /metrics and the event streams, through
the storage port. Each test starts on an empty database of its own, so totals are exact."""

from __future__ import annotations

import json

from nulltickets.storage.backend import Backend
from nulltickets.storage.ports import Database
from tests.storage.ops import NOW, Claimed, claimed, covers, make_pipeline, make_task

PARKED = 2**62  # next_eligible_at_ms of a parked (dead-lettered or cancelled) task


def fail(b: Backend, got: Claimed, error: str, now: int, retry_at: int | None = None) -> None:
    """A failed attempt as the service writes it: the run ends, a retry is scheduled."""
    assert b.end_run(got.run_id, "failed", "{}", error, now)
    b.delete_lease(got.lease_id)
    b.schedule_retry(got.task.id, now if retry_at is None else retry_at, error, now)
    b.insert_event(got.run_id, "retry_scheduled", "{}", now)


@covers(
    "Backend.tasks_by_stage", "Backend.active_leases", "Backend.health_counts", "Backend.engine"
)
def test_health_counts_tasks_by_stage_and_live_leases(database: Database, backend: str) -> None:
    """Also health_counts, /health's reads in one go (on PostgreSQL one statement): what
    tasks_by_stage and active_leases read one by one."""
    assert database.read_sync(lambda b: b.tasks_by_stage()) == []
    assert database.read_sync(lambda b: b.active_leases(NOW)) == 0
    assert database.read_sync(lambda b: b.health_counts(NOW)) == ([], 0)

    def job(b: Backend) -> None:
        pipeline_id = make_pipeline(b)
        for stage in ("todo", "todo", "review", "done"):
            make_task(b, pipeline_id, stage=stage)

    database.write_sync(job)
    database.write_sync(lambda b: claimed(b, ttl=1_000))
    counts = database.read_sync(lambda b: b.tasks_by_stage())
    assert [(c.stage, c.count) for c in counts] == [("done", 1), ("review", 1), ("todo", 2)]
    assert database.read_sync(lambda b: b.active_leases(NOW + 999)) == 1
    assert database.read_sync(lambda b: b.active_leases(NOW + 1_000)) == 0
    for at, leases in ((NOW + 999, 1), (NOW + 1_000, 0)):
        assert database.read_sync(lambda b, at=at: b.health_counts(at)) == (counts, leases)
    engine, version, options = database.read_sync(lambda b: b.engine())
    assert engine == database.capabilities.name and version[0].isdigit()
    assert isinstance(options, list) and all(isinstance(o, str) for o in options)


@covers(
    "Backend.stage_board",
    "Backend.role_stage_queue",
    "Backend.parked_totals",
    "Backend.queue_counts",
    "Backend.cancel_task",
    "Backend.dead_letter_task",
)
def test_the_stage_board_and_the_queue_count_where_tasks_stand(database: Database) -> None:
    assert database.read_sync(lambda b: b.queue_counts(NOW, NOW, NOW)) == ([], 0, 0)

    def job(b: Backend) -> tuple[str, list[str]]:
        pipeline_id = make_pipeline(b)
        ids = [make_task(b, pipeline_id, now=NOW - 100 + i) for i in range(6)]
        b.insert_dependency(ids[5], ids[4], NOW)  # blocked
        b.schedule_retry(ids[3], NOW + 5_000, "e", NOW)  # waiting on a retry delay
        b.cancel_task(ids[2], "no", PARKED, NOW)
        b.dead_letter_task(ids[1], "dead", 1, "max_attempts_exceeded", PARKED, "e", NOW)
        return pipeline_id, ids

    pipeline_id, ids = database.write_sync(job)
    assert database.read_sync(lambda b: b.parked_totals()) == (1, 1)
    got = database.write_sync(lambda b: claimed(b, ttl=1_000))
    assert got.task.id == ids[0]
    # Another claimable task, created later than the others.
    later = database.write_sync(lambda b: make_task(b, pipeline_id, now=NOW + 1))
    board = database.read_sync(lambda b: b.stage_board(NOW))
    # (pipeline, stage, role, claimable, oldest claimable, leased, delayed, blocked, dead,
    # cancelled): stages with a role first, then the dead-letter stage that holds one task.
    assert sorted(board[:2], key=str) == [
        (pipeline_id, "review", "reviewer", 0, None, 0, 0, 0, 0, 0),
        (pipeline_id, "todo", "coder", 2, NOW - 96, 1, 1, 1, 0, 1),
    ]
    assert board[2:] == [(pipeline_id, "dead", None, 0, None, 0, 0, 0, 1, 0)]
    assert later not in (got.task.id,)
    queue = database.read_sync(lambda b: sorted(b.role_stage_queue(NOW, NOW, NOW + 1_000)))
    # (role, claimable, oldest claimable, failed, stuck, near expiry)
    assert queue == [("coder", 2, NOW - 96, 0, 1, 1), ("reviewer", 0, None, 0, 0, 0)]
    queue = database.read_sync(lambda b: sorted(b.role_stage_queue(NOW, NOW - 1, NOW + 999)))
    assert queue[0] == ("coder", 2, NOW - 96, 0, 0, 0)
    # queue_counts, /ops/queue's reads in one go (on PostgreSQL one statement): the same rows
    # in the same order, then the parked totals.
    for window in ((NOW, NOW + 1_000), (NOW - 1, NOW + 999)):
        rows = database.read_sync(lambda b, w=window: b.role_stage_queue(NOW, *w))
        assert database.read_sync(lambda b, w=window: b.queue_counts(NOW, *w)) == (rows, 1, 1)
    database.write_sync(lambda b: b.end_run(got.run_id, "failed", "{}", "e", NOW + 2))
    queue = database.read_sync(lambda b: sorted(b.role_stage_queue(NOW, NOW, NOW + 1_000)))
    assert queue[0] == ("coder", 3, NOW - 100, 1, 0, 1)  # the lease is left: near expiry
    rows, dead, cancelled = database.read_sync(lambda b: b.queue_counts(NOW, NOW, NOW + 1_000))
    assert (sorted(rows), dead, cancelled) == (queue, 1, 1)


@covers("Backend.list_failures", "Backend.failure_groups", "Backend.failing_tasks")
def test_failures_are_listed_newest_first_grouped_and_found_looping(database: Database) -> None:
    def job(b: Backend) -> tuple[str, str, list[str]]:
        one, two = make_pipeline(b), make_pipeline(b, "writer")
        return one, two, [make_task(b, one), make_task(b, one), make_task(b, two, title="w")]

    _one, two, (looping, parked, other) = database.write_sync(job)
    for n in range(3):  # three failures in a row: a task failing in a loop

        def failed(b: Backend, n: int = n) -> str:
            got = claimed(b, now=NOW + 10 * n)
            fail(b, got, f"boom {n}", NOW + 10 * n + 1)
            return got.task.id

        assert database.write_sync(failed) == looping
    got = database.write_sync(lambda b: claimed(b, "writer", now=NOW + 40))
    database.write_sync(lambda b: fail(b, got, "bang", NOW + 41, retry_at=NOW + 10_000))

    def park(b: Backend) -> None:
        b.cancel_task(parked, "stop", PARKED, NOW + 50)

    database.write_sync(park)
    failures = database.read_sync(
        lambda b: b.list_failures(
            states=frozenset({"dead_lettered", "cancelled", "failing"}),
            pipeline_id=None,
            error=None,
            before=None,
            limit=10,
        )
    )
    assert [f.at_ms for f in failures] == sorted((f.at_ms for f in failures), reverse=True)
    by_id = {f.id: f for f in failures}
    assert set(by_id) >= {parked, other} and by_id[parked].state == "cancelled"
    assert (by_id[parked].cancelled_at_ms, by_id[parked].cancel_reason) == (NOW + 50, "stop")
    assert by_id[parked].dead_letter_reason is None  # a cancel is no dead letter
    assert (by_id[other].state, by_id[other].last_error, by_id[other].failures) == (
        "failing",
        "bang",
        1,
    )
    assert by_id[other].next_eligible_at_ms == NOW + 10_000 and not by_id[other].leased
    only = database.read_sync(
        lambda b: b.list_failures(
            states=frozenset({"failing"}), pipeline_id=two, error="bang", before=None, limit=10
        )
    )
    assert [f.id for f in only] == [other]
    first = failures[0]
    rest = database.read_sync(
        lambda b: b.list_failures(
            states=frozenset({"dead_lettered", "cancelled", "failing"}),
            pipeline_id=None,
            error=None,
            before=(first.at_ms, first.id),
            limit=10,
        )
    )
    assert [f.id for f in rest] == [f.id for f in failures[1:]]
    groups = database.read_sync(
        lambda b: b.failure_groups(
            states=frozenset({"cancelled", "failing"}), pipeline_id=None, limit=10
        )
    )
    assert [(g.state, g.error, g.count, g.newest_at_ms, g.oldest_at_ms) for g in groups] == [
        ("cancelled", None, 1, NOW + 50, NOW + 50),
        ("failing", "bang", 1, NOW + 41, NOW + 41),
        ("failing", "boom 2", 1, NOW + 21, NOW + 21),
    ]
    assert sum(g.count for g in groups) == len(failures)
    assert all(g.newest_at_ms >= g.oldest_at_ms for g in groups)
    looping_now = database.read_sync(lambda b: b.failing_tasks(NOW, 2, 1_000, 10))
    # The oldest task was claimed each time (it was eligible again at once): 3 in a row.
    assert [
        (f.task_id, f.failures, f.error, f.last_failed_at_ms, f.next_eligible_at_ms)
        for f in looping_now
    ] == [(looping, 3, "boom 2", NOW + 21, NOW + 21)]
    assert database.read_sync(lambda b: b.failing_tasks(NOW, 4, 1_000, 10)) == []
    counted = database.read_sync(lambda b: b.failing_tasks(NOW, 1, 1_000, 10))
    assert other in [f.task_id for f in counted]
    assert database.read_sync(lambda b: b.failing_tasks(NOW + 100, 1, 1_000, 10)) == []


@covers(
    "Backend.events_feed",
    "Backend.last_event_id",
    "Backend.event_kinds_since",
    "Backend.transitions_since",
)
def test_the_event_feed_reads_every_run_event_after_an_id(database: Database) -> None:
    assert database.read_sync(lambda b: b.last_event_id()) == 0
    database.write_sync(lambda b: [make_task(b, make_pipeline(b)) for _ in range(2)])
    one = database.write_sync(lambda b: claimed(b))
    two = database.write_sync(lambda b: claimed(b))

    def job(b: Backend) -> list[int]:
        return [
            b.insert_event(one.run_id, "progress", '{"n":1}', NOW),
            b.insert_event(two.run_id, "transition", "{}", NOW + 60_000),
            b.insert_event(one.run_id, "transition", "{}", NOW + 61_000),
        ]

    ids = database.write_sync(job)
    assert database.read_sync(lambda b: b.last_event_id()) == ids[-1]
    feed = database.read_sync(lambda b: b.events_feed(0, 10))
    assert [(e.id, e.run_id, e.task_id, e.kind) for e in feed] == [
        (ids[0], one.run_id, one.task.id, "progress"),
        (ids[1], two.run_id, two.task.id, "transition"),
        (ids[2], one.run_id, one.task.id, "transition"),
    ]
    assert feed[0].pipeline_id == one.task.pipeline_id and json.loads(bytes(feed[0].data)) == {
        "n": 1
    }
    assert [e.id for e in database.read_sync(lambda b: b.events_feed(ids[0], 1))] == [ids[1]]
    mine = database.read_sync(lambda b: b.events_feed(0, 10, one.task.id))
    assert [e.id for e in mine] == [ids[0], ids[2]]
    kinds = database.read_sync(lambda b: sorted(b.event_kinds_since(0)))
    assert kinds == [("progress", 1, ids[0]), ("transition", 2, ids[2])]
    assert database.read_sync(lambda b: b.event_kinds_since(ids[2])) == []
    per_minute = database.read_sync(lambda b: b.transitions_since(NOW, 100))
    assert per_minute == [(1, 2)]
    assert database.read_sync(lambda b: b.transitions_since(NOW - 120_000, 100)) == [(3, 2)]
    assert database.read_sync(lambda b: b.transitions_since(NOW, 1)) == [(1, 1)]  # the newest
