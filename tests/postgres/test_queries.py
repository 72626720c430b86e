"""The PostgreSQL queries (shared and its own) against the SQLite ones and the migrated schema."""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg
import psycopg.sql
import pytest

from nulltickets.storage.queries import load_backend_queries
from tests.postgres.sql import Q, numbered
from tests.unit.test_queries_shared import SQLITE_ONLY

SQLITE = load_backend_queries("nulltickets.storage.sqlite")
POSTGRES_NAMED = load_backend_queries("nulltickets.storage.postgres")

# Queries only PostgreSQL has, and why (each also says so in postgres/queries.sql).
POSTGRES_ONLY = {
    "lock_idempotency_key": "serialises concurrent replays of one key across servers",
    "server_encoding": "migrate.py: refuse a database that is not UTF8",
    "schema_lock": "migrate.py: one migrator at a time",
    "schema_create": "migrate.py: the table of applied migrations",
    "schema_versions": "migrate.py: which migrations are applied",
    "schema_record": "migrate.py: record an applied migration",
    "doctor_server": "maintenance.py: what doctor reports of the server and the database",
    "doctor_sessions": "maintenance.py: other sessions on the database",
    "doctor_invalid_indexes": "maintenance.py: indexes PostgreSQL will not use",
    "notify": "notifier.py: the wake-ups of a unit of work, sent with its COMMIT",
    "notify_key_revoked": "notifier.py: a revoked key, told to every server with its COMMIT",
    "listen": "notifier.py: the listening connection of each process",
    "lock_lease_by_run": "lease_by_run in a write: lease-protected writes on one lease in turn",
    "lock_lease_by_id": "lease_by_id in a write (the same)",
    "task_view": "Backend.task_view, GET /tasks/{id}'s reads, in one statement (one round trip)",
    "health_counts": "Backend.health_counts, GET /health's reads, in one statement",
    "task_checkpoint": "Backend.task_checkpoint, GET /tasks/{id}/checkpoint's, in one statement",
    "queue_counts": "Backend.queue_counts, GET /ops/queue's reads, in one statement",
    "create_task": "Backend.create_task: POST /tasks in one statement, its wake-up with it",
    "store_put": "Backend.put_value: PUT /store/... in one statement, the key checked in it",
    "store_delete": "Backend.delete_value: DELETE /store/... in one statement, the same",
    "claim_task": "Backend.claim in one statement, its own transaction (one round trip)",
    "transition_run": "Backend.transition_run in one statement, its wake-ups with it",
    "checkpoint_run": "Backend.checkpoint_run in one statement, its own transaction",
    "fail_run": "Backend.fail_run in one statement, its own transaction, its wake-ups with it",
    "expire_lease": "Backend.expire_lease in one statement, in the reaper's unit, its wake-ups",
    "release_run": "Backend.release_run in one statement, its wake-up with it",
    "release_agent": "Backend.release_agent in one statement, its wake-ups with it",
    "prune_lock": "retention: one server prunes at a time",
    "prune_checks_off": "retention: a batch without per-row foreign-key checks, where allowed",
    "prune_lock_runs": "retention: a batch's runs locked before what refers to them goes",
    "prune_delete": "Backend.prune_tasks: a batch's rows of every table in one statement",
}

# Statements PREPARE cannot take (DDL, a DO block); migrate.py runs the DDL in every migration
# test, and every retention test runs prune_checks_off.
NOT_PREPARABLE = {"schema_create", "listen", "prune_checks_off"}


def test_every_sqlite_query_has_a_postgres_translation_of_the_same_name() -> None:
    assert set(SQLITE) - set(Q) == set(SQLITE_ONLY)


def test_postgres_has_no_query_sqlite_lacks_except_its_own_few() -> None:
    assert set(Q) - set(SQLITE) == set(POSTGRES_ONLY)


def test_translations_take_the_same_parameters() -> None:
    """A backend calls both with the same names; what PostgreSQL's own statements take aside."""
    param = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")

    def params(sql: str) -> set[str]:
        code = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
        return set(param.findall(code))

    shared = set(SQLITE) - set(SQLITE_ONLY)
    differing = {n: (params(SQLITE[n]), params(POSTGRES_NAMED[n])) for n in shared}
    assert {n: p for n, p in differing.items() if p[0] != p[1]} == {}


def test_runtime_sql_never_reads_the_clock() -> None:
    clock = re.compile(
        r"\b(now\(\)|current_timestamp|clock_timestamp|statement_timestamp|localtimestamp)",
        re.IGNORECASE,
    )
    for name, sql in POSTGRES_NAMED.items():
        code = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
        assert not clock.search(code), name


def test_no_sqlite_dialect_is_left_in_the_translations() -> None:
    sqlite_only = re.compile(
        r"\b(rowid|INDEXED BY|MATCH|INSERT OR|CROSS JOIN \w+ AS \w+ ON)\b"
        r"|\b(json_each|json_extract|json_type|json_patch|json_array|bm25|snippet)\s*\(",
        re.IGNORECASE,
    )
    for name, sql in POSTGRES_NAMED.items():
        code = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
        assert not sqlite_only.search(code), (name, sqlite_only.findall(code))


@pytest.mark.parametrize("name", sorted(set(Q) - NOT_PREPARABLE))
def test_every_query_prepares_and_plans_against_the_migrated_schema(
    pg_conn: psycopg.Connection[Any], name: str
) -> None:
    """PREPARE parses the statement and resolves every table, column, function and parameter
    type; EXPLAIN EXECUTE with NULLs plans it, inside a transaction that is rolled back."""
    sql, names = numbered(Q[name])
    with pg_conn.transaction(force_rollback=True):
        pg_conn.execute(f"PREPARE q AS {sql}")
        types = pg_conn.execute(
            "SELECT parameter_types::text[] FROM pg_prepared_statements WHERE name = 'q'"
        ).fetchone()
        assert types is not None and len(types[0]) == len(names)
        assert "unknown" not in types[0], (name, dict(zip(names, types[0], strict=True)))
        nulls = ", ".join(["NULL"] * len(names))
        pg_conn.execute(f"EXPLAIN EXECUTE q({nulls})" if names else "EXPLAIN EXECUTE q")


# The failures an operator looks at, and the partial indexes (migration 0004) that hold only
# the tasks of each kind: with sequential scans priced out, each reads tasks through them.
FAILURE_QUERIES = ("list_failures", "failure_groups", "parked_totals", "stage_board")
FAILURE_INDEXES = (
    "idx_tasks_dead_letters",
    "idx_tasks_cancelled",
    "idx_tasks_failing",
    "idx_tasks_parked",
)


@pytest.mark.parametrize("name", FAILURE_QUERIES)
def test_failures_are_read_from_their_own_partial_indexes_never_from_all_tasks(
    pg_conn: psycopg.Connection[Any], name: str
) -> None:
    sql, names = numbered(Q[name])
    with pg_conn.transaction(force_rollback=True):
        pg_conn.execute("SET LOCAL enable_seqscan = off")
        pg_conn.execute(f"PREPARE q AS {sql}")
        # Every kind asked for (a NULL flag would plan that kind away), the rest NULL.
        flags = {"dead", "cancelled", "failing"}
        args = ", ".join("TRUE" if n in flags else "NULL" for n in names)
        rows = pg_conn.execute(f"EXPLAIN EXECUTE q({args})" if names else "EXPLAIN EXECUTE q")
        plan = "\n".join(row[0] for row in rows)
    assert "Seq Scan on tasks" not in plan, plan
    assert any(index in plan for index in FAILURE_INDEXES), plan


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_the_queues_failed_count_reads_only_the_failed_runs(
    pg_dsn: str, plan_cache_mode: str
) -> None:
    """GET /ops/queue counts a role stage's failed and expired attempts through
    idx_runs_failed (migration 0007), which holds only them: never a read of every run, which
    grows with every finished task."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pipelines (id, name, definition_json, created_at_ms)"
            " VALUES ('p', 'p', '{}', 0)"
        )
        conn.execute(
            "INSERT INTO pipeline_stages (pipeline_id, stage, agent_role, terminal)"
            " VALUES ('p', 'todo', 'worker', false), ('p', 'done', NULL, true)"
        )
        # 5,000 finished tasks, each with the run that completed it; 50 waiting ones, 20 of
        # them after a failed attempt and 5 after an expired one.
        conn.execute(
            "INSERT INTO tasks (id, pipeline_id, stage, title, description, created_at_ms,"
            " updated_at_ms)"
            " SELECT CASE WHEN g <= 50 THEN 'w' ELSE 'd' END || g, 'p',"
            " CASE WHEN g <= 50 THEN 'todo' ELSE 'done' END, 't', '', g, g"
            " FROM generate_series(1, 5050) AS g"
        )
        conn.execute(
            "INSERT INTO runs (id, task_id, attempt, status, started_at_ms, ended_at_ms)"
            " SELECT 'r' || g, CASE WHEN g <= 50 THEN 'w' ELSE 'd' END || g, 1,"
            " CASE WHEN g <= 20 THEN 'failed' WHEN g <= 25 THEN 'stale' ELSE 'completed' END,"
            " g, g FROM generate_series(1, 5050) AS g WHERE g > 50 OR g <= 25"
        )
        conn.execute("ANALYZE tasks")
        conn.execute("ANALYZE runs")
        conn.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        sql, names = numbered(Q["queue_counts"])
        conn.execute(f"PREPARE q AS {sql}")
        values = {"now": 10_000, "stuck_before": 0, "near_expiry_before": 20_000}
        args = ", ".join(str(values[n]) for n in names)
        plan = "\n".join(row[0] for row in conn.execute(f"EXPLAIN EXECUTE q({args})"))
        row = conn.execute(f"EXECUTE q({args})").fetchone()
    assert row is not None
    # (role, claimable, oldest, failed, stuck, near): 25 of the 50 waiting tasks hold a run.
    assert json.loads(row[2]) == [["worker", 50, 1, 25, 0, 0]]
    assert "idx_runs_failed" in plan, plan
    assert "Seq Scan on runs" not in plan, plan


# Retention's statements on one batch: of tasks (:ids, a JSON array of task ids) and of OTLP
# batches (:ids, of batch ids). Leases are left out: the table holds only live leases.
PRUNE_TASK_STATEMENTS = (
    "prune_export_tasks",
    "prune_export_dependencies",
    "prune_export_assignments",
    "prune_export_task_events",
    "prune_export_runs",
    "prune_export_events",
    "prune_export_artifacts",
    "prune_export_spans",
    "prune_lock_runs",
    "prune_delete",
)
PRUNE_SPAN_BATCH_STATEMENTS = (
    "prune_export_loose_spans",
    "prune_delete_loose_spans",
    "prune_export_empty_batches",
    "prune_delete_empty_batches",
)
HISTORY_TABLES = {
    "tasks",
    "runs",
    "events",
    "artifacts",
    "otlp_spans",
    "otlp_batches",
    "task_events",
    "task_dependencies",
    "task_assignments",
}
HISTORY_TASKS = 20_000


@pytest.fixture(scope="module")
def history_dsn(postgres: Any) -> str:
    """A database that has kept a long history: 20,000 finished tasks, each with a run, two run
    events, a task event, an artifact (of the task or of its run) and a span (in an OTLP
    batch of its own); half of them assigned, half depending on the one before."""
    from tests.conftest import migrated_database

    dsn = migrated_database(postgres)
    n = HISTORY_TASKS
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in (
            "INSERT INTO pipelines (id, name, definition_json, created_at_ms)"
            " VALUES ('p', 'p', '{}', 0)",
            "INSERT INTO pipeline_stages (pipeline_id, stage, agent_role, terminal)"
            " VALUES ('p', 'todo', 'worker', false), ('p', 'done', NULL, true)",
            "INSERT INTO tasks (id, pipeline_id, stage, title, description, created_at_ms,"
            f" updated_at_ms) SELECT 't' || g, 'p', 'done', 't', '', g, g"
            f" FROM generate_series(1, {n}) AS g",
            "INSERT INTO runs (id, task_id, attempt, status, started_at_ms, ended_at_ms)"
            f" SELECT 'r' || g, 't' || g, 1, 'completed', g, g FROM generate_series(1, {n}) AS g",
            "INSERT INTO events (run_id, ts_ms, kind, data_json)"
            f" SELECT 'r' || (g % {n} + 1), g, 'progress', '{{}}'"
            f" FROM generate_series(1, {2 * n}) AS g",
            "INSERT INTO task_events (task_id, ts_ms, kind, data_json)"
            f" SELECT 't' || g, g, 'created', '{{}}' FROM generate_series(1, {n}) AS g",
            "INSERT INTO artifacts (id, task_id, run_id, created_at_ms, kind, uri)"
            " SELECT 'a' || g, CASE WHEN g % 2 = 0 THEN 't' || g END,"
            " CASE WHEN g % 2 = 1 THEN 'r' || g END, g, 'file', 'file:///a'"
            f" FROM generate_series(1, {n}) AS g",
            "INSERT INTO otlp_batches (id, received_at_ms, content_type)"
            f" SELECT g, g, 'application/json' FROM generate_series(1, {n}) AS g",
            "INSERT INTO otlp_spans (batch_id, trace_id, span_id, name, run_id, task_id,"
            " raw_json) SELECT g, 'trace', 's' || g, 'work', 'r' || g, 't' || g, '{}'"
            f" FROM generate_series(1, {n}) AS g",
            "INSERT INTO task_assignments (task_id, agent_id, created_at_ms, updated_at_ms)"
            f" SELECT 't' || g, 'agent', g, g FROM generate_series(2, {n}, 2) AS g",
            "INSERT INTO task_dependencies (task_id, depends_on_task_id, created_at_ms)"
            f" SELECT 't' || g, 't' || (g - 1), g FROM generate_series(2, {n}, 2) AS g",
            "ANALYZE",
        ):
            conn.execute(statement)
    return dsn


def _plan_of_batch(dsn: str, name: str, ids: list[Any], plan_cache_mode: str) -> str:
    """The plan PostgreSQL runs statement `name` of a batch of these ids with, as the server's
    connections run it once prepared (EXPLAIN: nothing is deleted)."""
    sql, names = numbered(Q[name])
    assert names == ["ids"], names
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        conn.execute(f"PREPARE q AS {sql}")
        rows = conn.execute(
            psycopg.sql.SQL("EXPLAIN EXECUTE q({})").format(psycopg.sql.Literal(json.dumps(ids)))
        )
        return "\n".join(row[0] for row in rows)


def _tables_read_whole(plan: str) -> set[str]:
    return set(re.findall(r"Seq Scan on (\w+)", plan)) & HISTORY_TABLES


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", PRUNE_TASK_STATEMENTS)
def test_a_prune_batch_reads_its_tasks_history_by_index_never_whole_tables(
    history_dsn: str, name: str, plan_cache_mode: str
) -> None:
    """Each statement of a batch of 100 tasks finds their runs, events, artifacts, spans and
    the rest through an index: its cost is the batch's, whatever the history kept (a read
    of every run or span for each batch grew with the retention and slowed every claim
    that shared the machine with it)."""
    oldest = [f"t{g}" for g in range(1, 101)]
    plan = _plan_of_batch(history_dsn, name, oldest, plan_cache_mode)
    assert _tables_read_whole(plan) == set(), plan


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", PRUNE_SPAN_BATCH_STATEMENTS)
def test_a_prune_of_otlp_batches_reads_their_spans_by_index_never_all_spans(
    history_dsn: str, name: str, plan_cache_mode: str
) -> None:
    plan = _plan_of_batch(history_dsn, name, list(range(1, 11)), plan_cache_mode)
    assert _tables_read_whole(plan) == set(), plan


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_a_prune_batch_finds_its_tasks_by_walking_them_in_order_never_reading_all_history(
    history_dsn: str, plan_cache_mode: str
) -> None:
    """prune_candidates walks idx_tasks_page from the pass's cursor; whether a parked task
    has a dependent is a probe of idx_task_dependencies_depends_on for that task, not a hash
    of every dependency built for each batch."""
    sql, names = numbered(Q["prune_candidates"])
    values = {"before": "1000000000", "after_created": "-1", "after_id": "''", "limit": "100"}
    with psycopg.connect(history_dsn, autocommit=True) as conn:
        conn.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        conn.execute(f"PREPARE q AS {sql}")
        args = ", ".join(values[n] for n in names)
        plan = "\n".join(row[0] for row in conn.execute(f"EXPLAIN EXECUTE q({args})"))
        found = conn.execute(f"EXECUTE q({args})").fetchall()
    assert [task_id for task_id, _ in found] == [f"t{g}" for g in range(1, 101)]
    assert "idx_tasks_page" in plan, plan
    assert _tables_read_whole(plan) == set(), plan
