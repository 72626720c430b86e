"""PostgreSQL migrations on real databases: fresh, re-run, raced by two processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from nulltickets.errors import StartupError
from nulltickets.storage.postgres import migrate
from nulltickets.storage.sqlite import connection as sqlite_connection
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]


def catalog(dsn: str) -> dict[str, Any]:
    """Everything migrations create in the public schema, and the record of them."""
    with psycopg.connect(dsn) as conn:
        return {
            "columns": conn.execute(
                "SELECT table_name, column_name, data_type, column_default, is_nullable"
                " FROM information_schema.columns WHERE table_schema = 'public'"
                " ORDER BY table_name, ordinal_position"
            ).fetchall(),
            "indexes": conn.execute(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"
                " ORDER BY indexname"
            ).fetchall(),
            "constraints": conn.execute(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
                " WHERE connamespace = 'public'::regnamespace ORDER BY conname"
            ).fetchall(),
            "functions": conn.execute(
                "SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace"
                " ORDER BY proname"
            ).fetchall(),
            "schema": conn.execute("SELECT * FROM nulltickets_schema ORDER BY version").fetchall(),
        }


def catalog_tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {name for (name,) in rows}


def migrated(dsn: str, now_ms: int | None = None) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return migrate.migrate(conn, now_ms)


def test_migrations_are_numbered_from_one_without_gaps() -> None:
    numbers = [n for n, _, _ in migrate.migrations()]
    assert numbers == list(range(1, len(numbers) + 1))


def test_migrating_a_migrated_database_again_changes_nothing(pg_shared_dsn: str) -> None:
    before = catalog(pg_shared_dsn)
    assert [v for v, _, _ in before["schema"]] == [n for n, _, _ in migrate.migrations()]
    assert migrated(pg_shared_dsn) == len(migrate.migrations())
    assert catalog(pg_shared_dsn) == before  # applied_at_ms as it was: nothing ran again


def test_two_processes_migrating_an_empty_database_at_once_apply_each_migration_once(
    pg_empty_dsn: str, tmp_path: Path
) -> None:
    assert catalog_tables(pg_empty_dsn) == set()
    go = tmp_path / "go"
    script = (
        "import pathlib, sys, time, psycopg\n"
        "from nulltickets.storage.postgres.migrate import migrate\n"
        "conn = psycopg.connect(sys.argv[1], autocommit=True)\n"
        "pathlib.Path(sys.argv[2] + '.ready.' + sys.argv[3]).touch()\n"
        "while not pathlib.Path(sys.argv[2]).exists():\n"
        "    time.sleep(0.005)\n"
        "print(migrate(conn))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, pg_empty_dsn, str(go), str(n)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    try:
        wait_for(
            "both migrators to connect",
            lambda: all(Path(f"{go}.ready.{n}").exists() for n in range(2)),
            timeout=60,
        )
        go.touch()  # both start at once
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    version = len(migrate.migrations())
    assert [(p.returncode, out.strip()) for p, (out, _) in zip(procs, results, strict=True)] == [
        (0, str(version)),
        (0, str(version)),
    ], [err for _, err in results]
    schema = catalog(pg_empty_dsn)["schema"]
    assert [(v, name) for v, name, _ in schema] == [(n, f) for n, f, _ in migrate.migrations()]
    assert "tasks" in catalog_tables(pg_empty_dsn)


def test_a_database_from_a_newer_nulltickets_is_refused(pg_shared_dsn: str) -> None:
    with psycopg.connect(pg_shared_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO nulltickets_schema VALUES (99, '0099_future.sql', 0)")
        try:
            with pytest.raises(StartupError, match="version 99 is newer"):
                migrate.migrate(conn)
        finally:
            conn.execute("DELETE FROM nulltickets_schema WHERE version = 99")


def test_the_migrator_wants_its_own_transactions(pg_shared_dsn: str) -> None:
    with psycopg.connect(pg_shared_dsn) as conn, pytest.raises(ValueError, match="autocommit"):
        migrate.migrate(conn)


def test_every_sqlite_table_and_column_has_its_place_in_postgres(
    pg_shared_dsn: str, tmp_path: Path
) -> None:
    """So a copy from SQLite can keep every row; PostgreSQL adds only seq and search columns."""
    db = sqlite_connection.connect_writer(str(tmp_path / "s.db"))
    sqlite_connection.migrate(db)
    tables = {
        name
        for (name,) in db.execute(
            "SELECT name FROM sqlite_schema WHERE type = 'table'"
            " AND name NOT LIKE 'sqlite_%' AND name NOT LIKE 'store_fts%'"
        )
    }
    sqlite_columns = {t: [r[1] for r in db.execute(f"PRAGMA table_info({t})")] for t in tables}
    db.close()
    pg_columns: dict[str, list[str]] = {}
    for table, column, *_ in catalog(pg_shared_dsn)["columns"]:
        pg_columns.setdefault(table, []).append(column)
    assert set(pg_columns) - {"nulltickets_schema"} == tables
    for table, columns in sqlite_columns.items():
        extra = [c for c in pg_columns[table] if c not in columns]
        assert set(columns) <= set(pg_columns[table]), table
        assert set(extra) <= {"seq", "search"}, table


def test_no_column_takes_its_time_from_the_database_clock(pg_shared_dsn: str) -> None:
    columns = catalog(pg_shared_dsn)["columns"]
    defaults = {f"{t}.{c}": d for t, c, _, d, _ in columns if d}
    clock = {k: d for k, d in defaults.items() if "now()" in d or "current_" in d.lower()}
    assert clock == {}
    times = [(t, c, ty) for t, c, ty, _, _ in columns if c.endswith("_ms")]
    assert {ty for _, _, ty in times} == {"bigint"}, times


def test_the_server_runs_with_fsync_on(pg_conn: psycopg.Connection[Any]) -> None:
    row = pg_conn.execute(
        "SELECT current_setting('fsync'), current_setting('synchronous_commit')"
    ).fetchone()
    assert row == ("on", "on")


def test_failed_tasks_of_an_older_database_are_listed_after_migration_0004(
    pg_empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As SQLite's 0008: tasks dead-lettered, failing or cancelled before the migration take
    their latest failed run's end and error (a dead letter without one its last update)."""
    from nulltickets.storage.postgres.backend import PostgresBackend

    every = migrate.migrations()
    monkeypatch.setattr(migrate, "migrations", lambda: every[:3])
    assert migrated(pg_empty_dsn) == 3
    with psycopg.connect(pg_empty_dsn) as conn:
        conn.execute(
            "INSERT INTO pipelines (id, name, definition_json, created_at_ms) "
            "VALUES ('p', 'p', '{}', 1)"
        )
        tasks = [
            ("dead", "dead", "max_attempts_exceeded", 9_223_372_036_854_775_000, None, 500),
            ("no-runs", "dead", "max_attempts_exceeded", 9_223_372_036_854_775_000, None, 450),
            ("failing", "todo", None, 10_000, None, 300),
            ("cancelled", "todo", "cancelled", 9_223_372_036_854_775_000, 400, 400),
            ("moved-on", "review", None, 0, None, 350),
        ]
        for task_id, stage, reason, eligible, cancelled, updated in tasks:
            conn.execute(
                "INSERT INTO tasks (id, pipeline_id, stage, title, description, "
                "dead_letter_reason, next_eligible_at_ms, cancelled_at_ms, created_at_ms, "
                "updated_at_ms) VALUES (%s, 'p', %s, %s, '', %s, %s, %s, 1, %s)",
                (task_id, stage, task_id, reason, eligible, cancelled, updated),
            )
        runs = [
            ("r1", "dead", 1, "failed", 100, "first"),
            ("r2", "dead", 2, "failed", 200, "second"),
            ("r3", "failing", 1, "stale", 250, "lease_expired"),
            ("r4", "moved-on", 1, "failed", 150, "fixed since"),
            ("r5", "moved-on", 2, "completed", 160, None),
        ]
        for run_id, task_id, attempt, status, ended, error in runs:
            conn.execute(
                "INSERT INTO runs (id, task_id, attempt, status, started_at_ms, ended_at_ms, "
                "error_text) VALUES (%s, %s, %s, %s, 1, %s, %s)",
                (run_id, task_id, attempt, status, ended, error),
            )
    monkeypatch.setattr(migrate, "migrations", lambda: every)
    assert migrated(pg_empty_dsn) == len(every)
    with psycopg.connect(pg_empty_dsn) as conn:
        b = PostgresBackend(conn)
        states = frozenset({"dead_lettered", "cancelled", "failing"})
        listed = b.list_failures(states=states, pipeline_id="p", error=None, before=None, limit=10)
        assert [(f.id, f.state, f.at_ms, f.last_error) for f in listed] == [
            ("no-runs", "dead_lettered", 450, None),
            ("cancelled", "cancelled", 400, None),
            ("failing", "failing", 250, "lease_expired"),
            ("dead", "dead_lettered", 200, "second"),
        ]
        assert [f.failures for f in listed] == [0, 0, 1, 2]
