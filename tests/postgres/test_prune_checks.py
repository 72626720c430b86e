"""A retention batch on PostgreSQL without per-row foreign-key checks (prune_checks_off): it
deletes every row that refers to its tasks and runs itself, where the checks are off and where
the role may not turn them off, and a row written to one of its runs while it runs is never
left pointing at nothing."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from nulltickets.service.retention import Pruner
from nulltickets.storage.postgres import PostgresDatabase
from nulltickets.storage.postgres.backend import Q
from tests.conftest import unique, wait_for
from tests.postgres.test_green import opened
from tests.storage.ops import NOW, make_pipeline, make_task
from tests.storage.test_retention import CUTOFF, OLD, finish_run


@pytest.fixture
def db(pg_dsn: str) -> Iterator[PostgresDatabase]:
    yield from opened(pg_dsn)


def references(conn: psycopg.Connection[Any]) -> set[tuple[str, str]]:
    """(table, column) of every foreign key that refers to tasks or runs."""
    rows = conn.execute(
        "SELECT c.conrelid::regclass::text, a.attname"
        " FROM pg_constraint AS c"
        " JOIN pg_attribute AS a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)"
        " WHERE c.contype = 'f' AND c.confrelid IN ('tasks'::regclass, 'runs'::regclass)"
    )
    return {(table, column) for table, column in rows}


def test_prune_delete_deletes_every_row_of_every_table_that_refers_to_a_task_or_a_run(
    pg_conn: psycopg.Connection[Any],
) -> None:
    """With the checks off nothing else would: a table added later with a key to tasks or
    runs must be in prune_delete too, or its rows would point at deleted tasks."""
    found = references(pg_conn)
    assert {("runs", "task_id"), ("events", "run_id"), ("task_dependencies", "task_id")} <= found
    sql = Q["prune_delete"]
    for table, column in sorted(found):
        deletes = re.findall(rf"DELETE FROM {table}\s+WHERE (.*?)\s+RETURNING", sql, re.S)
        assert deletes, f"prune_delete leaves {table}, which refers to tasks or runs"
        assert re.search(rf"(^|\sOR ){column} = ANY", deletes[0]), (table, column, deletes[0])


def setting_after_checks_off(conn: psycopg.Connection[Any]) -> str:
    conn.execute(Q["prune_checks_off"])
    row = conn.execute("SELECT current_setting('session_replication_role')").fetchone()
    assert row is not None
    return str(row[0])


def as_plain_role(conn: psycopg.Connection[Any], *, granted: bool = False) -> None:
    """The rest of `conn`'s transaction as a role that may read, change and delete rows of every
    table and is no superuser (made in the transaction: its rollback removes the role); with
    `granted`, it may also set session_replication_role (PostgreSQL 15 and later)."""
    role = unique("plain").replace("-", "_")
    conn.execute(f"CREATE ROLE {role} NOLOGIN")
    conn.execute(f"GRANT SELECT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
    if granted:
        conn.execute(f"GRANT SET ON PARAMETER session_replication_role TO {role}")
    conn.execute(f"SET LOCAL ROLE {role}")


def test_the_checks_go_off_for_the_batch_only_where_the_role_may_and_else_stay_on(
    pg_conn: psycopg.Connection[Any],
) -> None:
    with pg_conn.transaction(force_rollback=True):  # this cluster's superuser
        assert setting_after_checks_off(pg_conn) == "replica"
    with pg_conn.transaction():
        row = pg_conn.execute("SELECT current_setting('session_replication_role')").fetchone()
        assert row == ("origin",)  # SET LOCAL: the batch's transaction only
    with pg_conn.transaction(force_rollback=True):
        as_plain_role(pg_conn)
        assert setting_after_checks_off(pg_conn) == "origin"  # and no error: the batch goes on


def test_a_role_granted_set_on_the_parameter_prunes_without_the_checks(
    pg_conn: psycopg.Connection[Any],
) -> None:
    """What docs/operating/backup.md tells an operator whose servers are no superuser to do."""
    version = pg_conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
    if version is None or version[0] < 150000:
        pytest.skip("GRANT SET ON PARAMETER came with PostgreSQL 15")
    with pg_conn.transaction(force_rollback=True):
        as_plain_role(pg_conn, granted=True)
        assert setting_after_checks_off(pg_conn) == "replica"


def history(db: PostgresDatabase, n: int) -> list[tuple[str, str]]:
    """`n` finished tasks (each with a run, an event, an artifact and a span), a task event, a
    dependency and an assignment on each; and a live task depending on the last. (task, run)."""
    made: list[tuple[str, str]] = []

    def build(b: Any) -> None:
        role = unique("r")
        p = make_pipeline(b, role)
        for _ in range(n):
            make_task(b, p, now=NOW)
            made.append(finish_run(b, role, "done", OLD))
        for i, (task_id, _) in enumerate(made):
            b.insert_task_event(task_id, "note", "{}", OLD)
            if i:
                b.insert_dependency(task_id, made[i - 1][0], NOW)
            b.upsert_assignment(task_id, "agent", None, OLD)
        b.insert_dependency(make_task(b, p, now=NOW), made[-1][0], NOW)

    db.write_sync(build)
    return made


COUNT_ALL = """
SELECT (SELECT count(*) FROM tasks WHERE id = ANY (%(tasks)s)),
    (SELECT count(*) FROM runs WHERE id = ANY (%(runs)s)),
    (SELECT count(*) FROM events WHERE run_id = ANY (%(runs)s)),
    (SELECT count(*) FROM artifacts WHERE task_id = ANY (%(tasks)s) OR run_id = ANY (%(runs)s)),
    (SELECT count(*) FROM otlp_spans WHERE task_id = ANY (%(tasks)s) OR run_id = ANY (%(runs)s)),
    (SELECT count(*) FROM task_events WHERE task_id = ANY (%(tasks)s)),
    (SELECT count(*) FROM task_dependencies
        WHERE task_id = ANY (%(tasks)s) OR depends_on_task_id = ANY (%(tasks)s)),
    (SELECT count(*) FROM task_assignments WHERE task_id = ANY (%(tasks)s))
"""


@pytest.mark.parametrize("as_superuser", [True, False], ids=["checks-off", "checks-on"])
def test_a_batch_leaves_no_row_of_its_tasks_with_the_checks_off_or_on(
    db: PostgresDatabase, pg_dsn: str, as_superuser: bool
) -> None:
    made = history(db, 30)
    tasks, runs = [t for t, _ in made], [r for _, r in made]
    ids = json.dumps(tasks)
    with psycopg.connect(pg_dsn) as conn:
        if not as_superuser:  # the same statements, with every check and cascade running
            as_plain_role(conn)
        before = conn.execute(COUNT_ALL, {"tasks": tasks, "runs": runs}).fetchone()
        assert before == (30, 30, 30, 30, 30, 30, 30, 30)
        assert setting_after_checks_off(conn) == ("replica" if as_superuser else "origin")
        locked = conn.execute(Q["prune_lock_runs"], {"ids": ids}).fetchall()
        assert sorted(r for (r,) in locked) == sorted(runs)
        cur = conn.execute(Q["prune_delete"], {"ids": ids})
        row = cur.fetchone()
        assert row is not None
        counts = dict(zip([c.name for c in cur.description or ()], row, strict=True))
        after = conn.execute(COUNT_ALL, {"tasks": tasks, "runs": runs}).fetchone()
        conn.rollback()
    assert after == (0,) * 8
    assert counts["tasks"] == counts["runs"] == counts["events"] == 30
    assert counts["task_dependencies"] == 30  # 29 between them, 1 of the live task's


def test_an_event_written_to_a_run_while_its_batch_runs_is_never_left_behind(
    db: PostgresDatabase, pg_dsn: str
) -> None:
    """An event insert holds its run (its key check) in a transaction still open when the
    batch starts: the batch waits for it, then deletes it with the run. Without the batch's
    lock on its runs it would delete the run after the event was committed, with no check
    left to notice: an event of no run."""
    made = history(db, 3)
    task_id, run_id = made[1]
    writer = psycopg.connect(pg_dsn)
    writer.execute(
        "INSERT INTO events (run_id, ts_ms, kind, data_json) VALUES (%s, %s, 'late', '{}')",
        (run_id, OLD),
    )  # not committed yet
    reports: list[Any] = []
    pruning = threading.Thread(
        target=lambda: reports.append(Pruner(db, batch=10).prune(CUTOFF, vacuum=False))
    )
    pruning.start()
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as watch:

            def batch_waits() -> bool:
                row = watch.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                ).fetchone()
                return row is not None and row[0] > 0

            wait_for("the batch to wait for the event's transaction", batch_waits)
            writer.commit()
            pruning.join(60)
            assert not pruning.is_alive()
            orphans = watch.execute(
                "SELECT count(*) FROM events AS e"
                " WHERE NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.id = e.run_id)"
            ).fetchone()
            left = watch.execute("SELECT count(*) FROM tasks WHERE id = %s", (task_id,)).fetchone()
    finally:
        writer.close()
        pruning.join(60)
    assert orphans == (0,)
    assert left == (0,)
    assert reports and reports[0].deleted["tasks"] == 3
    assert reports[0].deleted["events"] == 4  # the three runs' own, and the late one
