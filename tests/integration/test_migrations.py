"""Migrations on real SQLite files: fresh databases, re-runs, and files the original created."""

from __future__ import annotations

from pathlib import Path

import apsw
import pytest

from nulltickets.errors import StartupError
from nulltickets.storage.sqlite import connection
from tests.fixtures.reference import (
    CRASHED,
    FINISHED,
    PIPELINE_ID,
    WAITING,
    build_reference_db,
)


def schema_of(path: Path) -> dict[str, set[str]]:
    """Tables, indexes and triggers by kind (auto-indexes and FTS shadow tables left out)."""
    conn = apsw.Connection(str(path))
    rows = conn.execute(
        "SELECT type, name FROM sqlite_schema WHERE name NOT LIKE 'sqlite_%' "
        "AND name NOT LIKE 'store_fts_%' OR type = 'trigger'"
    ).fetchall()
    conn.close()
    kinds: dict[str, set[str]] = {}
    for kind, name in rows:
        kinds.setdefault(kind, set()).add(name)
    return kinds


def columns_of(path: Path, table: str) -> list[str]:
    conn = apsw.Connection(str(path))
    cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
    conn.close()
    return cols


def migrated(path: Path) -> int:
    conn = connection.connect_writer(str(path))
    try:
        return connection.migrate(conn)
    finally:
        conn.close()


def test_fresh_database_gets_every_migration_and_our_application_id(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    version = migrated(db)
    conn = apsw.Connection(str(db))
    assert conn.pragma("user_version") == version == len(connection.migrations())
    assert conn.pragma("application_id") == connection.APPLICATION_ID
    assert conn.pragma("journal_mode") == "wal"
    conn.close()


def test_migrating_twice_changes_nothing(tmp_path: Path) -> None:
    db = tmp_path / "twice.db"
    migrated(db)
    before = schema_of(db)
    migrated(db)
    assert schema_of(db) == before


def test_reference_database_migrates_to_the_same_tables_and_columns_as_a_fresh_one(
    tmp_path: Path,
) -> None:
    ref = build_reference_db(tmp_path / "ref.db")
    fresh = tmp_path / "fresh.db"
    migrated(ref)
    migrated(fresh)
    ref_schema, fresh_schema = schema_of(ref), schema_of(fresh)
    assert ref_schema["table"] == fresh_schema["table"]
    assert ref_schema["trigger"] == fresh_schema["trigger"]
    for table in fresh_schema["table"]:
        assert columns_of(ref, table) == columns_of(fresh, table), table
    # Every index a fresh database has exists in the adopted one (it may keep extra old ones).
    ours = {n for n in fresh_schema["index"] if n.startswith("idx_tasks_") or "claim" in n}
    assert ours <= ref_schema["index"]


def test_reference_rows_survive_and_the_stage_table_is_built_from_definitions(
    tmp_path: Path,
) -> None:
    ref = build_reference_db(tmp_path / "ref.db")
    migrated(ref)
    conn = apsw.Connection(str(ref))
    titles = dict(conn.execute("SELECT id, title FROM tasks").fetchall())
    assert titles == {FINISHED: "finished", WAITING: "waiting", CRASHED: "crashed"}
    stages = conn.execute(
        "SELECT stage, agent_role, terminal FROM pipeline_stages WHERE pipeline_id = ? "
        "ORDER BY stage",
        (PIPELINE_ID,),
    ).fetchall()
    assert stages == [("done", None, 1), ("review", "reviewer", 0), ("todo", "coder", 0)]
    # The full-text index now covers the store rows the original wrote, and checks clean.
    hits = conn.execute("SELECT key FROM store_fts WHERE store_fts MATCH 'legacy'").fetchall()
    assert hits == [("greeting",)]
    conn.execute("INSERT INTO store_fts(store_fts) VALUES ('integrity-check')")
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    conn.close()


def test_store_writes_after_adoption_keep_the_index_consistent(tmp_path: Path) -> None:
    ref = build_reference_db(tmp_path / "ref.db")
    migrated(ref)
    conn = apsw.Connection(str(ref))
    with conn:
        conn.execute('UPDATE store SET value_json = \'{"text":"renewed"}\'')
        conn.execute("INSERT INTO store VALUES ('n2', 'k', '\"legacy again\"', 1, 1)")
    conn.execute("INSERT INTO store_fts(store_fts) VALUES ('integrity-check')")
    found = conn.execute("SELECT key FROM store_fts WHERE store_fts MATCH 'legacy'").fetchall()
    assert found == [("k",)]
    conn.close()


def test_a_database_from_a_newer_nulltickets_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "future.db"
    migrated(db)
    conn = apsw.Connection(str(db))
    conn.pragma("user_version", 99)
    conn.close()
    with pytest.raises(StartupError, match="newer"):
        migrated(db)


def test_failed_tasks_of_an_older_file_are_listed_after_migration_0008(tmp_path: Path) -> None:
    """Tasks dead-lettered, failing or cancelled before 0008 take their latest failed run's
    end and error (a dead letter without one its last update), so the failures listing and
    its groups show them as they are."""
    from nulltickets.storage.sqlite.backend import SqliteBackend

    conn = connection.connect_writer(str(tmp_path / "old.db"))
    for number, _name, sql in connection.migrations()[:7]:
        with conn:
            conn.execute(sql).fetchall()
            conn.pragma("user_version", number)
    with conn:
        conn.execute(
            "INSERT INTO pipelines (id, name, definition_json, created_at_ms) "
            "VALUES ('p', 'p', '{}', 1)"
        )
        tasks = [
            # id, stage, dead_letter_reason, next_eligible_at_ms, cancelled_at_ms, updated
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
                "updated_at_ms) VALUES (?, 'p', ?, ?, '', ?, ?, ?, 1, ?)",
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
                "error_text) VALUES (?, ?, ?, ?, 1, ?, ?)",
                (run_id, task_id, attempt, status, ended, error),
            )
    assert connection.migrate(conn) == len(connection.migrations())
    b = SqliteBackend(conn)
    states = frozenset({"dead_lettered", "cancelled", "failing"})
    listed = b.list_failures(states=states, pipeline_id="p", error=None, before=None, limit=10)
    assert [(f.id, f.state, f.at_ms, f.last_error) for f in listed] == [
        ("no-runs", "dead_lettered", 450, None),
        ("cancelled", "cancelled", 400, None),
        ("failing", "failing", 250, "lease_expired"),
        ("dead", "dead_lettered", 200, "second"),
    ]
    assert [f.failures for f in listed] == [0, 0, 1, 2]
    groups = b.failure_groups(states=states, pipeline_id="p", limit=10)
    assert {(g.state, g.error, g.count) for g in groups} == {
        ("dead_lettered", None, 1),
        ("dead_lettered", "second", 1),
        ("cancelled", None, 1),
        ("failing", "lease_expired", 1),
    }
    conn.close()
