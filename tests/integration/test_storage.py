"""The writer, the readers and the claim query on real SQLite files."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from pathlib import Path

import apsw
import pytest

from nulltickets.domain.clock import wall_ms as now_ms
from nulltickets.domain.commands import AppendEvent, Claim, CreatePipeline, CreateTask, MoveTask
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.errors import StorageBusy, TaskNotFound
from nulltickets.service import Tracker
from nulltickets.storage.backend import Backend
from nulltickets.storage.sqlite import connection
from nulltickets.storage.sqlite.backend import Q
from nulltickets.storage.sqlite.database import CHECKPOINT_FRAMES, Checkpointer, Database
from tests.conftest import wait_for
from tests.server import PIPELINE


@pytest.fixture
def db(tmp_path: Path) -> Database:
    database = Database(str(tmp_path / "t.db"))
    database.open()
    yield database  # type: ignore[misc]
    database.close()


def raw(value: object) -> object:
    import msgspec

    return msgspec.Raw(msgspec.json.encode(value))


def seed(db: Database, tracker: Tracker, n: int) -> tuple[str, list[str]]:
    def job(b):  # type: ignore[no-untyped-def]
        now = now_ms()
        pid = tracker.create_pipeline(b, CreatePipeline("p", raw(PIPELINE)), now)  # type: ignore[arg-type]
        ids = [tracker.add_task(b, CreateTask(pid, f"t{i}", ""), now) for i in range(n)]
        return pid, ids

    return db.write_sync(job)  # type: ignore[no-any-return]


def test_every_named_query_prepares_against_the_migrated_schema(tmp_path: Path) -> None:
    conn = connection.connect_writer(str(tmp_path / "q.db"))
    connection.migrate(conn)
    for name, sql in Q.items():
        # EXPLAIN compiles the statement without running it.
        conn.execute("EXPLAIN " + sql, {p: None for p in _params(sql)}).fetchall()
        assert name
    conn.close()


def _params(sql: str) -> set[str]:
    import re

    return set(re.findall(r":([a-z0-9_]+)", sql))


def test_claim_walks_the_claim_index_instead_of_scanning_tasks(tmp_path: Path) -> None:
    conn = connection.connect_writer(str(tmp_path / "plan.db"))
    connection.migrate(conn)
    plan = conn.execute(
        "EXPLAIN QUERY PLAN " + Q["claim_candidate"],
        {p: None for p in _params(Q["claim_candidate"])},
    ).fetchall()
    details = " | ".join(row[3] for row in plan)
    assert "idx_tasks_claim" in details
    assert "SCAN t " not in details and "SCAN tasks" not in details
    conn.close()


def test_queue_report_counts_start_from_live_state_not_from_all_tasks(tmp_path: Path) -> None:
    conn = connection.connect_writer(str(tmp_path / "ops.db"))
    connection.migrate(conn)
    sql = Q["role_stage_queue"]
    plan = conn.execute("EXPLAIN QUERY PLAN " + sql, dict.fromkeys(_params(sql))).fetchall()
    details = [row[3] for row in plan]
    conn.close()
    # Every access to tasks is by primary key or by (pipeline_id, stage): never a whole
    # pipeline (which holds all its finished tasks) and never a scan.
    task_access = [d for d in details if d.startswith(("SEARCH t ", "SCAN t "))]
    assert task_access
    assert all("(pipeline_id=? AND stage=?)" in d or "(id=?)" in d for d in task_access)
    assert any("idx_leases_expires" in d for d in details)
    assert any("idx_runs_running" in d for d in details)


def _partial_indexes(conn: apsw.Connection) -> set[str]:
    return {
        name
        for name, sql in conn.execute("SELECT name, sql FROM sqlite_schema WHERE type = 'index'")
        if sql is not None and " WHERE " in sql.upper().replace("\n", " ")
    }


def _index_of(detail: str) -> str | None:
    """The index a plan line uses (`... USING [COVERING] INDEX name (...)`), if any."""
    words = detail.split()
    return words[words.index("INDEX") + 1] if "INDEX" in words else None


# The failures an operator looks at (GET /ops/failures, its groups, the dead letters of
# /ops/stages and /ops/queue) and the partial index each kind may walk: only its own rows.
FAILURE_QUERIES = ("list_failures", "failure_groups", "parked_totals", "stage_board")
FAILURE_INDEXES = {
    "idx_tasks_dead_letters",
    "idx_tasks_cancelled",
    "idx_tasks_failing",
    "idx_tasks_parked",
}


def test_failures_are_read_from_their_own_partial_indexes_never_from_all_tasks(
    tmp_path: Path,
) -> None:
    conn = connection.connect_writer(str(tmp_path / "failures.db"))
    connection.migrate(conn)
    partial = _partial_indexes(conn)
    assert partial >= FAILURE_INDEXES
    for name in FAILURE_QUERIES:
        sql = Q[name]
        plan = conn.execute("EXPLAIN QUERY PLAN " + sql, dict.fromkeys(_params(sql))).fetchall()
        details = [row[3] for row in plan]
        for detail in details:
            if not detail.startswith(("SCAN ", "SEARCH ")) or detail.startswith("SCAN ("):
                continue
            table = detail.split()[1]
            if table in ("f", "g", "s", "ps", "us", "d", "r"):
                continue  # the page itself, stages, dependencies, runs by task id
            index = _index_of(detail)
            # tasks: by primary key, by one (pipeline, stage) with a role, or a failure index
            assert (
                index in FAILURE_INDEXES
                or "(id=?)" in detail
                or (name == "stage_board" and "(pipeline_id=? AND stage=?)" in detail)
            ), (name, detail)
        used = {_index_of(d) for d in details}
        if name != "stage_board":
            assert used & FAILURE_INDEXES, (name, details)
    # The page of failures looks up each row's runs by task id, never walking all runs.
    plan = conn.execute(
        "EXPLAIN QUERY PLAN " + Q["list_failures"], dict.fromkeys(_params(Q["list_failures"]))
    ).fetchall()
    runs = [row[3] for row in plan if row[3].startswith(("SEARCH r ", "SCAN r "))]
    assert runs and all("(task_id=?)" in d for d in runs), runs
    conn.close()


DROPPED = {
    "idx_tasks_stage",
    "idx_tasks_pipeline",
    "idx_runs_task",
    "idx_tasks_priority_created",
    "idx_tasks_next_eligible",
    "idx_tasks_dead_letter_reason",
    "idx_runs_status",  # 0005: replaced by idx_runs_running
    "idx_runs_task_status",
}


def test_no_query_needs_the_indexes_migrations_0004_and_0005_drop(tmp_path: Path) -> None:
    """Every named query plans without a table scan of tasks or runs (a per-stage count may
    walk a covering index, a count of the dead-lettered a partial index that holds only them)
    once the redundant and unused indexes are gone, and the foreign keys that reach tasks and
    runs stay indexed."""
    conn = connection.connect_writer(str(tmp_path / "idx.db"))
    connection.migrate(conn)
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'index'")}
    assert not names & DROPPED
    partial = _partial_indexes(conn)
    for name, sql in Q.items():
        plan = conn.execute("EXPLAIN QUERY PLAN " + sql, dict.fromkeys(_params(sql))).fetchall()
        for row in plan:
            full_scan = row[3].startswith(("SCAN tasks", "SCAN runs"))
            bounded = "COVERING INDEX" in row[3] or _index_of(row[3]) in partial
            assert not full_scan or bounded, (name, row[3])
    # Deleting a pipeline or a task looks up its children by an index (not a partial one)
    # that starts with the foreign key.
    for table, column in (("tasks", "pipeline_id"), ("runs", "task_id")):
        leading = [
            index
            for _seq, index, _unique, _origin, partial in conn.execute(
                f"PRAGMA index_list({table})"
            )
            if not partial
            and conn.execute(f"PRAGMA index_info({index})").fetchall()[0][2] == column
        ]
        assert leading, (table, column)
    conn.close()


def test_a_failing_job_does_not_fail_its_neighbours_in_the_same_batch(db: Database) -> None:
    tracker = Tracker()
    pid, _ = seed(db, tracker, 0)

    def good(i: int):  # type: ignore[no-untyped-def]
        return lambda b: tracker.add_task(b, CreateTask(pid, f"g{i}", ""), now_ms())

    def bad(b):  # type: ignore[no-untyped-def]
        tracker.add_task(b, CreateTask(pid, "half", ""), now_ms())  # written, then undone
        raise TaskNotFound()

    async def together() -> list[object]:
        # Submitted in one turn of the loop, so they share one transaction.
        return await asyncio.gather(
            db.write(good(0)), db.write(bad), db.write(good(1)), return_exceptions=True
        )

    batches_before = db.writer.batches
    results = asyncio.run(together())
    assert db.writer.batches - batches_before == 1
    assert isinstance(results[1], TaskNotFound)
    assert isinstance(results[0], str) and isinstance(results[2], str)
    titles = db.read_sync(
        lambda b: [t.title for t in b.list_tasks(stage=None, pipeline_id=pid, after=None, limit=10)]
    )
    assert sorted(titles) == ["g0", "g1"]


def test_only_a_job_that_wrote_before_failing_makes_its_neighbours_run_again(
    db: Database,
) -> None:
    tracker = Tracker()
    pid, _ = seed(db, tracker, 0)
    calls: list[str] = []

    def good(b):  # type: ignore[no-untyped-def]
        calls.append("good")
        return tracker.add_task(b, CreateTask(pid, "kept", ""), now_ms())

    def fails_clean(b):  # type: ignore[no-untyped-def]
        raise TaskNotFound()

    def fails_dirty(b):  # type: ignore[no-untyped-def]
        tracker.add_task(b, CreateTask(pid, "undone", ""), now_ms())
        raise TaskNotFound()

    async def batch(failing: object) -> list[object]:
        return await asyncio.gather(
            db.write(good),
            db.write(failing),
            return_exceptions=True,  # type: ignore[arg-type]
        )

    asyncio.run(batch(fails_clean))
    assert calls == ["good"]
    asyncio.run(batch(fails_dirty))
    assert calls == ["good", "good", "good"]  # ran, rolled back with its neighbour, ran again
    titles = db.read_sync(
        lambda b: [t.title for t in b.list_tasks(stage=None, pipeline_id=pid, after=None, limit=10)]
    )
    assert sorted(titles) == ["kept", "kept"]


def test_a_batch_larger_than_the_limit_is_split_and_every_job_answered(db: Database) -> None:
    tracker = Tracker()
    pid, _ = seed(db, tracker, 0)
    db.writer.max_batch = 10

    async def many() -> list[str]:
        return await asyncio.gather(
            *(db.write(lambda b: tracker.add_task(b, CreateTask(pid, "t", ""), now_ms()))
              for _ in range(35))
        )  # fmt: skip

    before = db.writer.batches
    ids = asyncio.run(many())
    assert len(set(ids)) == 35
    assert db.writer.batches - before == 4


def test_threads_claiming_at_once_each_get_a_different_task(db: Database) -> None:
    tracker = Tracker()
    _, ids = seed(db, tracker, 200)
    claimed: list[str] = []
    lock = threading.Lock()

    def agent(name: str) -> None:
        while True:
            result = db.write_sync(lambda b: tracker.claim(b, Claim(name, "coder"), now_ms()))
            if result is None:
                return
            with lock:
                claimed.append(result.task.id)

    threads = [threading.Thread(target=agent, args=(f"a{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == sorted(ids)


def test_a_write_lock_held_by_another_process_becomes_storage_busy(tmp_path: Path) -> None:
    path = str(tmp_path / "locked.db")
    database = Database(path)
    database.open()
    other = apsw.Connection(path)
    other.set_busy_timeout(0)
    other.execute("BEGIN IMMEDIATE")
    database.writer.busy_timeout_s = 0.2  # give up quickly
    try:
        with pytest.raises(StorageBusy):
            database.write_sync(lambda b: b.purge_idempotency(0))
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert database.write_sync(lambda b: b.purge_idempotency(0)) == 0
    database.close()


def test_transitions_signal_wake_ups_only_while_a_long_poll_listens(db: Database) -> None:
    """A "work is here now" notification has an audience only while some claim is
    long-polling (every other claim reads the committed state first), so a transition skips
    them, and the dependents lookup they need, when none is. (The stage it leaves caps no
    leases: no slot freed there is announced.)"""
    tracker = Tracker(db.notifier)
    heard: list[tuple[str, int]] = []
    db.notifier.subscribe(lambda role, at, _agent: heard.append((role, at)))
    seed(db, tracker, 2)
    heard.clear()

    def claim_and_submit(b):  # type: ignore[no-untyped-def]
        now = now_ms()
        result = tracker.claim(b, Claim("agent", "coder"), now)
        assert result is not None
        token_hash = lease_token_hash(result.lease_token)
        lease = tracker.check_run_lease(b, result.run.id, token_hash, now)
        tracker.transition(b, lease, MoveTask("submit"), now)

    db.write_sync(claim_and_submit)
    assert heard == []
    with db.notifier.waiting():
        db.write_sync(claim_and_submit)
    assert heard == [("reviewer", 0)]


def test_the_claim_cycle_runs_on_statements_prepared_once(db: Database) -> None:
    """Once warm, batches of claims, events and transitions never parse SQL again (apsw's
    statement cache, at its default size, evicted them every few cycles)."""
    tracker = Tracker()
    seed(db, tracker, 16 * 41)

    async def agent(n: int) -> None:
        result = await db.write(lambda b: tracker.claim(b, Claim(f"a{n}", "coder"), now_ms()))
        assert result is not None
        run_id, token_hash = result.run.id, lease_token_hash(result.lease_token)
        event = AppendEvent("progress")
        await db.write(lambda b: tracker.append_event(b, run_id, token_hash, event, now_ms()))

        def submit(b):  # type: ignore[no-untyped-def]
            lease = tracker.check_run_lease(b, run_id, token_hash, now_ms())
            return tracker.transition(b, lease, MoveTask("submit"), now_ms())

        await db.write(submit)

    async def rounds(n: int) -> None:
        for _ in range(n):
            await asyncio.gather(*(agent(i) for i in range(16)))

    asyncio.run(rounds(1))
    conn = db.writer._conn
    assert conn is not None
    before = conn.cache_stats()["misses"]
    asyncio.run(rounds(40))
    assert conn.cache_stats()["misses"] == before


def bulk_tasks(tracker: Tracker, pipeline_id: str) -> Callable[[Backend], None]:
    """A write job of 25 tasks with 2 KB descriptions: some 15 pages of WAL."""

    def job(b: Backend) -> None:
        for i in range(25):
            tracker.add_task(b, CreateTask(pipeline_id, f"bulk {i}", "x" * 2000), now_ms())

    return job


def test_checkpoints_run_beside_the_writer(tmp_path: Path) -> None:
    """The writer's commits never checkpoint; the background thread does. Nothing written is
    lost on the way."""
    path = tmp_path / "ck.db"
    database = Database(str(path), durability="normal")
    database.open()
    writer_conn = database.writer._conn
    assert writer_conn is not None
    assert writer_conn.pragma("wal_autocheckpoint") == 0
    checkpointer = database.writer.checkpointer
    tracker = Tracker()
    pid, _ = seed(database, tracker, 1)
    job = bulk_tasks(tracker, pid)
    jobs = 0
    while checkpointer.frames < 2 * CHECKPOINT_FRAMES:  # enough frames to wake the thread
        database.write_sync(job)
        jobs += 1
    wait_for("a background checkpoint", lambda: checkpointer.passes > 0)
    database.close()
    assert not Path(f"{path}-wal").exists()  # the last close copies everything back
    assert _task_count(path) == 1 + jobs * 25


def test_past_its_limit_the_writer_copies_back_itself_and_the_wal_starts_over(
    tmp_path: Path,
) -> None:
    """With no background pass to rely on (the thread stopped: under constant load it never
    quite catches up), the writer copies the WAL back between two transactions once it passes
    its limit, and the next transaction starts the file over: the WAL stays bounded."""
    path = tmp_path / "limit.db"
    database = Database(str(path), durability="normal")
    database.open()
    checkpointer = database.writer.checkpointer
    checkpointer.stop()
    checkpointer.limit = 2 * CHECKPOINT_FRAMES
    tracker = Tracker()
    pid, _ = seed(database, tracker, 1)
    job = bulk_tasks(tracker, pid)
    frames = [checkpointer.frames]
    for _ in range(400):
        database.write_sync(job)
        frames.append(checkpointer.frames)
    assert checkpointer.passes == 0  # every copy-back below was the writer's own
    assert checkpointer.finishes > 0
    # The WAL started over (its frame count fell back) and never grew past its limit by more
    # than one transaction's frames.
    assert any(later < earlier for earlier, later in itertools.pairwise(frames))
    largest_step = max(later - earlier for earlier, later in itertools.pairwise(frames))
    assert max(frames) < checkpointer.limit + largest_step
    database.close()
    assert _task_count(path) == 1 + 400 * 25


def _task_count(path: Path) -> int:
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    (count,) = conn.execute("SELECT count(*) FROM tasks").fetchone()  # type: ignore[misc]
    conn.close()
    return int(count)


def test_a_checkpoint_blocked_by_another_process_does_not_stop_writes(tmp_path: Path) -> None:
    """Another process's read transaction pins the WAL: checkpoints cannot copy past it, the
    writer goes on committing, and the WAL starts over once the reader is gone."""
    path = tmp_path / "pinned.db"
    database = Database(str(path), durability="normal")
    database.open()
    checkpointer = database.writer.checkpointer
    checkpointer.limit = 2 * CHECKPOINT_FRAMES
    tracker = Tracker()
    pid, _ = seed(database, tracker, 1)
    reader = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM tasks").fetchall()  # holds its snapshot

    job = bulk_tasks(tracker, pid)
    for _ in range(200):
        database.write_sync(job)
    pinned = checkpointer.frames
    assert pinned > checkpointer.limit  # could not start over while the snapshot was held
    reader.execute("COMMIT")
    reader.close()
    writes = 200

    def started_over() -> bool:
        # The thread's pass over the pinned frames may still be running (the writer's own
        # copy then waits for the next transaction): writes go on until the WAL starts over.
        nonlocal writes
        database.write_sync(job)
        writes += 1
        return checkpointer.frames < pinned

    wait_for("the WAL to start over once the reader is gone", started_over, interval=0)
    database.close()
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    (count,) = conn.execute("SELECT count(*) FROM tasks").fetchone()  # type: ignore[misc]
    conn.close()
    assert count == 1 + writes * 25


def test_failing_checkpoints_are_reported_once_and_their_recovery_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "f.db")
    checkpointer = Checkpointer(path, "normal", limit=1)
    checkpointer.frames = 5  # past the limit: every call tries
    broken = connection.connect_writer(path)
    broken.close()
    working = connection.connect_writer(path)
    with caplog.at_level("WARNING", logger="nulltickets.storage"):
        for _ in range(3):
            checkpointer.finish(broken)
        checkpointer.finish(working)
        checkpointer.finish(working)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("WAL checkpoint failed")
    assert messages[1] == "WAL checkpoints succeed again"
    assert checkpointer.finishes == 2
    working.close()
