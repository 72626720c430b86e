"""Retention through the storage port: which rows a prune takes (exactly the finished tasks
older than the cutoff and their history; never a live task's, a running task's or anything
newer), the export of those rows, loose spans, recorded answers, and giving pages back."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nulltickets.domain.model import SpanRow
from nulltickets.service.retention import Export, Pruner, PruneReport, Stopped
from nulltickets.storage.backend import Backend
from nulltickets.storage.ports import Database
from tests.storage.ops import NOW, claimed, covers, make_pipeline, make_task, new_id

OLD, CUTOFF, NEW = NOW + 10, NOW + 5_000, NOW + 10_000
PARKED = 2**62
MIN = -(2**63)


def span(task_id: str | None, run_id: str | None) -> SpanRow:
    return SpanRow(
        new_id(), new_id()[:16], None, "s", None, 1, 2, None, None, None, None,
        run_id, task_id, "[]", "[]", "{}",
    )  # fmt: skip


def finish(b: Backend, role: str, stage: str, now: int, *, event: bool = True) -> str:
    """Claim the next task of `role`, record an event, an artifact and a span of its run, and
    move it to `stage` at `now`; its id."""
    return finish_run(b, role, stage, now, event=event)[0]


def finish_run(
    b: Backend, role: str, stage: str, now: int, *, event: bool = True
) -> tuple[str, str]:
    """`finish`; the task's id and its run's."""
    got = claimed(b, role, now=NOW)
    if event:
        b.insert_event(got.run_id, "progress", '{"n":1}', NOW + 1)
    b.insert_artifact(
        id=new_id(), task_id=got.task.id, run_id=got.run_id, kind="log", uri="file:///x",
        sha256=None, size_bytes=1, meta_json="{}", now=NOW + 1,
    )  # fmt: skip
    batch = b.insert_otlp_batch("application/json", "{}", None, 1, NOW + 1)
    b.insert_otlp_span(batch, span(got.task.id, got.run_id))
    assert b.end_run(got.run_id, "completed", '{"tokens":7}', None, now)
    b.delete_lease(got.lease_id)
    assert b.move_task(got.task.id, stage, got.task.task_version, now)
    return got.task.id, got.run_id


def world(b: Backend) -> dict[str, Any]:
    """Tasks of every kind, old and new, with history."""
    p = make_pipeline(b, "a")
    ids: dict[str, Any] = {}
    make_task(b, p, now=NOW)
    ids["done_old"] = finish(b, "a", "done", OLD)
    make_task(b, p, now=NOW)
    ids["done_new"] = finish(b, "a", "done", NEW)
    # Old, but in a stage that is not terminal: still live.
    make_task(b, p, now=NOW)
    ids["review_old"] = finish(b, "a", "review", OLD)
    # Running since long ago, with an event: never pruned.
    running = make_task(b, p, now=NOW)
    got = claimed(b, "a", now=NOW)
    assert got.task.id == running
    b.insert_event(got.run_id, "progress", "{}", NOW + 1)
    ids["running"], ids["running_run"] = running, got.run_id
    ids["queued_old"] = make_task(b, p, now=NOW)
    # Parked long ago: pruned, unless a task depends on it.
    ids["dead_old"] = make_task(b, p, now=NOW)
    b.dead_letter_task(ids["dead_old"], "dead", 1, "max_attempts_exceeded", PARKED, "e", OLD)
    # Parked where it failed (no terminal dead-letter stage): its dependent waits on it.
    ids["dead_needed"] = make_task(b, p, now=NOW)
    b.dead_letter_task(ids["dead_needed"], "todo", 0, "max_attempts_exceeded", PARKED, "e", OLD)
    b.insert_dependency(ids["queued_old"], ids["dead_needed"], NOW)
    ids["cancelled_old"] = make_task(b, p, now=NOW)
    assert b.cancel_task(ids["cancelled_old"], "no", PARKED, OLD)
    b.insert_task_event(ids["cancelled_old"], "cancelled", "{}", OLD)
    ids["cancelled_new"] = make_task(b, p, now=NOW)
    assert b.cancel_task(ids["cancelled_new"], "no", PARKED, NEW)
    # Spans of no task, received long ago and lately; and an old batch of a running task.
    old_batch = b.insert_otlp_batch("application/json", "{}", None, 1, NOW)
    b.insert_otlp_span(old_batch, span(None, None))
    b.insert_otlp_span(old_batch, span("unknown-task", None))
    new_batch = b.insert_otlp_batch("application/json", "{}", None, 1, NEW)
    b.insert_otlp_span(new_batch, span(None, None))
    live_batch = b.insert_otlp_batch("application/json", "{}", None, 1, NOW)
    b.insert_otlp_span(live_batch, span(running, got.run_id))
    ids["batches"] = (old_batch, new_batch, live_batch)
    for key, at in (("old", NOW), ("new", NEW)):
        b.put_idempotency(
            key=key, method="POST", path="/tasks", request_hash=b"h" * 32, auth_hash=None,
            status=201, body="{}", now=at,
        )  # fmt: skip
    return ids


def prune_all(b: Backend, before: int, *, batch: int = 100) -> tuple[list[str], dict[str, int]]:
    """Every finished task before `before`, batch by batch, as the service walks them."""
    pruned: list[str] = []
    deleted: dict[str, int] = {}
    after: tuple[int, str] = (MIN, "")
    while True:
        found = b.prune_candidates(before, after, batch)
        if found:
            ids = [i for i, _ in found]
            for table, n in b.prune_tasks(ids).items():
                deleted[table] = deleted.get(table, 0) + n
            pruned += ids
        if len(found) < batch:
            return pruned, deleted
        after = (found[-1][1], found[-1][0])


@covers(
    "Backend.prune_candidates",
    "Backend.prune_tasks",
    "Backend.try_prune_lock",
    "Backend.insert_task_event",
)
def test_a_prune_takes_exactly_the_finished_tasks_older_than_the_cutoff(
    database: Database,
) -> None:
    ids = database.write_sync(world)
    assert database.write_sync(lambda b: b.try_prune_lock())
    pruned, deleted = database.write_sync(lambda b: prune_all(b, CUTOFF, batch=2))
    assert sorted(pruned) == sorted([ids["done_old"], ids["dead_old"], ids["cancelled_old"]])
    # One run each for the done task (its event, artifact and span too); none for the parked.
    assert deleted == {"tasks": 3, "runs": 1, "events": 1, "artifacts": 1, "otlp_spans": 1}

    def left(b: Backend) -> dict[str, Any]:
        return {
            "tasks": {k for k, v in ids.items() if isinstance(v, str) and b.task_exists(v)},
            "running_run": b.run_status(ids["running_run"]),
            "running_events": len(b.list_events(ids["running_run"], 0, 100)),
            "task_events": len(b.list_task_events(ids["cancelled_old"], 0, 100)),
        }

    after = database.read_sync(left)
    assert after["tasks"] == {
        "done_new", "review_old", "running", "running_run", "queued_old", "dead_needed",
        "cancelled_new",
    } - {"running_run"}  # fmt: skip
    assert after["running_run"] == "running" and after["running_events"] == 1
    assert after["task_events"] == 0  # went with its task
    # Nothing is left to take: a second pass finds nothing.
    assert database.write_sync(lambda b: prune_all(b, CUTOFF)) == ([], {})
    # Later, what was new is old too; the live tasks still stay.
    pruned, _ = database.write_sync(lambda b: prune_all(b, NEW + 1))
    assert sorted(pruned) == sorted([ids["done_new"], ids["cancelled_new"]])


@covers("Backend.prune_export")
def test_the_export_holds_every_row_a_prune_deletes(database: Database) -> None:
    ids = database.write_sync(world)

    def job(b: Backend) -> list[tuple[str, dict[str, Any]]]:
        found = b.prune_candidates(CUTOFF, (MIN, ""), 100)
        return b.prune_export([i for i, _ in found])

    rows = database.write_sync(job)  # the candidates are locked: a write (it deletes nothing)
    tables = [t for t, _ in rows]
    assert tables == sorted(tables, key=[
        "tasks", "task_dependencies", "task_assignments", "task_events", "runs", "events",
        "artifacts", "otlp_spans",
    ].index)  # fmt: skip
    by_table: dict[str, list[dict[str, Any]]] = {}
    for table, row in rows:
        by_table.setdefault(table, []).append(row)
    assert sorted(r["id"] for r in by_table["tasks"]) == sorted(
        [ids["done_old"], ids["dead_old"], ids["cancelled_old"]]
    )
    [run] = by_table["runs"]
    assert run["task_id"] == ids["done_old"] and json.loads(run["usage_json"]) == {"tokens": 7}
    assert [e["kind"] for e in by_table["events"]] == ["progress"]
    assert [e["task_id"] for e in by_table["task_events"]] == [ids["cancelled_old"]]
    assert [a["uri"] for a in by_table["artifacts"]] == ["file:///x"]
    assert [s["run_id"] for s in by_table["otlp_spans"]] == [run["id"]]
    assert all(r["title"] == "t" for r in by_table["tasks"])  # whole rows


@covers("Backend.prune_span_batches", "Backend.prune_spans")
def test_loose_spans_and_their_batches_go_once_old(database: Database) -> None:
    ids = database.write_sync(world)
    old_batch, new_batch, live_batch = ids["batches"]

    def job(b: Backend) -> tuple[list[tuple[int, int]], Any]:
        found = b.prune_span_batches(CUTOFF, (MIN, 0), 100)
        return found, b.prune_spans([i for i, _ in found], export=True)

    found, (rows, deleted) = database.write_sync(job)
    # The old batches (the finished tasks' own were made at NOW + 1); not the new one.
    assert new_batch not in [i for i, _ in found]
    assert {old_batch, live_batch} <= {i for i, _ in found}
    # The two loose spans of the old batch, and the old batch itself; the finished tasks'
    # spans are still there (their tasks are kept until pruned), and so is the running one's.
    assert deleted == {"otlp_spans": 2, "otlp_batches": 1}
    assert [t for t, _ in rows] == ["otlp_batches", "otlp_spans", "otlp_spans"]
    assert rows[0][1]["id"] == old_batch
    spans = database.read_sync(lambda b: b.list_run_spans(ids["running_run"], 0, 10))
    assert len(spans) == 1


@covers("Backend.prune_idempotency", "Backend.put_idempotency")
def test_recorded_answers_go_by_age_a_batch_at_a_time(database: Database) -> None:
    database.write_sync(world)
    assert database.write_sync(lambda b: b.prune_idempotency(CUTOFF, 100)) == 1
    assert database.read_sync(lambda b: b.get_idempotency("old", "POST", "/tasks")) is None
    assert database.read_sync(lambda b: b.get_idempotency("new", "POST", "/tasks")) is not None

    def many(b: Backend) -> None:
        for i in range(5):
            b.put_idempotency(
                key=f"k{i}", method="POST", path="/x", request_hash=b"h" * 32, auth_hash=None,
                status=200, body="{}", now=NOW,
            )  # fmt: skip

    database.write_sync(many)
    assert database.write_sync(lambda b: b.prune_idempotency(CUTOFF, 2)) == 2
    assert database.write_sync(lambda b: b.prune_idempotency(CUTOFF, 10)) == 3


@covers("Backend.free_pages", "Backend.give_back_pages")
def test_a_file_gives_its_free_pages_back(database: Database, backend: str) -> None:
    if database.capabilities.name != "sqlite":
        assert database.read_sync(lambda b: b.free_pages()) is None
        database.write_sync(lambda b: b.give_back_pages(10))  # nothing to do, no error
        return

    def fill(b: Backend) -> list[str]:
        p = make_pipeline(b, "a", stages=(("todo", "a", False), ("done", None, True)))
        return [make_task(b, p, stage="done", description="x" * 2000, now=NOW) for _ in range(400)]

    database.write_sync(fill)
    before = database.read_sync(lambda b: b.free_pages())
    assert before is not None and before[2]  # a new file gives pages back
    database.write_sync(lambda b: prune_all(b, CUTOFF))
    freed = database.read_sync(lambda b: b.free_pages())
    assert freed is not None and freed[0] > 100
    while (pages := database.read_sync(lambda b: b.free_pages())) and pages[0]:
        database.write_sync(lambda b: b.give_back_pages(64))
    after = database.read_sync(lambda b: b.free_pages())
    assert after is not None and after[0] == 0 and after[1] < before[1] - 100


def test_two_servers_pruning_at_once_delete_each_task_once(
    opened: Callable[[], Database],
) -> None:
    """Two databases on one target (two servers) prune the same finished tasks at once, in
    small batches: every task is deleted exactly once, and neither fails."""
    first, second = opened(), opened()

    def fill(b: Backend) -> list[str]:
        p = make_pipeline(b, "a", stages=(("todo", "a", False), ("done", None, True)))
        return [make_task(b, p, stage="done", now=NOW) for _ in range(300)]

    ids = first.write_sync(fill)
    reports: list[PruneReport] = []
    errors: list[BaseException] = []

    def prune(database: Database) -> None:
        try:
            reports.append(Pruner(database, batch=10).prune(CUTOFF, vacuum=False))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=prune, args=(d,)) for d in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # A pass that found the other server pruning stopped at once (PostgreSQL); what the other
    # did not finish the next pass does.
    while True:
        report = Pruner(first, batch=10).prune(CUTOFF, vacuum=False)
        reports.append(report)
        if not report.skipped and not report.deleted.get("tasks"):
            break
    assert sum(r.deleted.get("tasks", 0) for r in reports) == len(ids)
    assert not any(first.read_sync(lambda b: [b.task_exists(i) for i in ids]))


def test_one_server_prunes_at_a_time_on_a_shared_database(
    opened: Callable[[], Database],
) -> None:
    first, second = opened(), opened()
    if not first.capabilities.shared_by_servers:
        # One server per file: its single writer runs one unit of work at a time anyway.
        assert first.write_sync(lambda b: b.try_prune_lock())
        return
    holding, release = threading.Event(), threading.Event()

    def hold(b: Backend) -> bool:
        got = b.try_prune_lock()
        holding.set()
        release.wait(10)
        return got

    thread = threading.Thread(target=lambda: first.write_sync(hold))
    thread.start()
    try:
        assert holding.wait(10)
        assert second.write_sync(lambda b: b.try_prune_lock()) is False
        assert Pruner(second).prune(CUTOFF).skipped
    finally:
        release.set()
        thread.join()
    assert second.write_sync(lambda b: b.try_prune_lock()) is True  # released with its unit


def test_batches_bounded_by_time_still_delete_every_old_finished_task_whole(
    database: Database, tmp_path: Path
) -> None:
    """A time per batch that no task fits in: each batch then takes one task, and the pass
    still deletes every finished task older than the cutoff, never a live one; between two
    batches each task is whole (its run and event with it) or gone with all of its history,
    and the export holds every row once."""

    def fill(b: Backend) -> tuple[list[tuple[str, str]], str]:
        p = make_pipeline(b, "a")
        done: list[tuple[str, str]] = []
        for _ in range(12):
            make_task(b, p, now=NOW)
            done.append(finish_run(b, "a", "done", OLD))
        return done, make_task(b, p, now=NOW)

    done, queued = database.write_sync(fill)

    def whole_or_gone(b: Backend) -> list[str]:
        wrong = []
        for task_id, run_id in done:
            task, run = b.task_exists(task_id), b.run_status(run_id) is not None
            events = len(b.list_events(run_id, 0, 10)) if run else 0
            if (task, run, events) not in ((True, True, 1), (False, False, 0)):
                wrong.append(task_id)
        return wrong

    seen: list[list[str]] = []

    def between() -> bool:  # asked before each batch
        seen.append(database.read_sync(whole_or_gone))
        return False

    export = Export(str(tmp_path / "x.jsonl"))
    try:
        report = Pruner(database, export, batch_s=0.0, stopping=between).prune(CUTOFF, vacuum=False)
    finally:
        export.close()
    assert report.deleted["tasks"] == len(done)
    assert report.batches >= len(done)  # one task a batch
    assert len(seen) > len(done) and not any(seen)
    assert not any(database.read_sync(lambda b: [b.task_exists(t) for t, _ in done]))
    assert database.read_sync(lambda b: b.task_exists(queued))
    rows = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    tasks = [r["row"]["id"] for r in rows if r["table"] == "tasks"]
    assert sorted(tasks) == sorted(t for t, _ in done)


def test_batches_run_as_writes_of_a_servers_loop_and_give_up_when_it_stops(
    database: Database,
) -> None:
    """A server's pruner hands each batch to its event loop's writer: the pass deletes what a
    pass from its own thread would. A server stopping while a batch waits for a loop that no
    longer runs ends the pass at once (Stopped), without waiting for ever."""

    def fill(b: Backend) -> list[str]:
        p = make_pipeline(b, "a", stages=(("todo", "a", False), ("done", None, True)))
        return [make_task(b, p, stage="done", now=NOW) for _ in range(30)]

    ids = database.write_sync(fill)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        report = Pruner(database, batch=10, loop=loop).prune(CUTOFF, vacuum=False)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    assert report.deleted["tasks"] == len(ids)
    assert not any(database.read_sync(lambda b: [b.task_exists(i) for i in ids]))

    more = database.write_sync(fill)
    asked = iter([False])  # running at the first batch, stopping from then on
    pruner = Pruner(database, loop=loop, stopping=lambda: next(asked, True))
    with pytest.raises(Stopped):
        pruner.prune(CUTOFF, vacuum=False)
    loop.close()
    assert all(database.read_sync(lambda b: [b.task_exists(i) for i in more]))
