"""Exclusivity and uniqueness hold in the PostgreSQL data itself, whoever writes: its
constraints by name, and the locks that order concurrent writers. The same rules through the
storage port, on every backend, are tests/storage."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from psycopg import errors

from nulltickets.domain.ids import new_id
from tests.conftest import unique, wait_for
from tests.postgres.sql import make_pipeline, make_task, one, run, start_run

Conn = psycopg.Connection[Any]


def raw_running_run(conn: Conn, task_id: str, attempt: int) -> None:
    conn.execute(
        "INSERT INTO runs (id, task_id, attempt, status) VALUES (%s, %s, %s, 'running')",
        (new_id(), task_id, attempt),
    )


def test_a_second_running_run_for_a_task_is_a_unique_violation(pg_conn: Conn) -> None:
    task = make_task(pg_conn, make_pipeline(pg_conn, unique("role")))
    assert task is not None
    raw_running_run(pg_conn, task, 1)
    with pytest.raises(errors.UniqueViolation) as caught:
        raw_running_run(pg_conn, task, 2)
    assert caught.value.diag.constraint_name == "runs_one_running_per_task"


def test_a_run_status_outside_the_run_state_machine_is_refused(pg_conn: Conn) -> None:
    task = make_task(pg_conn, make_pipeline(pg_conn, unique("role")))
    assert task is not None
    start_run(pg_conn, task)
    (run_id,) = one(pg_conn, "latest_run", task_id=task)[:1]
    with pytest.raises(errors.CheckViolation):
        run(pg_conn, "end_run", id=run_id, status="done", usage_json="{}", error_text=None, now=3)


def test_a_run_has_at_most_one_lease(pg_conn: Conn) -> None:
    task = make_task(pg_conn, make_pipeline(pg_conn, unique("role")))
    assert task is not None
    start_run(pg_conn, task)
    (run_id,) = one(pg_conn, "latest_run", task_id=task)[:1]
    lease = {"run_id": run_id, "agent_id": "a", "token_hash": b"h", "expires_at_ms": 9}
    lease |= {"ttl_ms": 5, "fence": 1, "now": 4}
    run(pg_conn, "insert_lease", id=new_id(), **lease)
    with pytest.raises(errors.UniqueViolation) as caught:
        run(pg_conn, "insert_lease", id=new_id(), **lease)
    assert caught.value.diag.constraint_name == "leases_run_id_key"


def test_pipeline_names_are_unique(pg_conn: Conn) -> None:
    name, pipeline_id = unique("pipe"), new_id()
    run(pg_conn, "insert_pipeline", id=pipeline_id, name=name, definition_json="{}", now=1)
    assert one(pg_conn, "get_pipeline", id=pipeline_id)[1] == name
    with pytest.raises(errors.UniqueViolation) as caught:
        run(pg_conn, "insert_pipeline", id=new_id(), name=name, definition_json="{}", now=1)
    assert caught.value.diag.constraint_name == "pipelines_name_key"


def test_an_idempotency_key_names_one_task_per_pipeline(pg_conn: Conn) -> None:
    role = unique("role")
    first, second = make_pipeline(pg_conn, role), make_pipeline(pg_conn, role)
    task = make_task(pg_conn, first, idempotency_key="k")
    assert task is not None
    assert make_task(pg_conn, first, idempotency_key="k") is None  # the key is taken
    assert one(pg_conn, "task_by_idempotency_key", pipeline_id=first, idempotency_key="k") == (
        task,
    )
    assert make_task(pg_conn, second, idempotency_key="k") is not None  # another pipeline
    assert make_task(pg_conn, first) and make_task(pg_conn, first)  # no key: no limit
    with pytest.raises(errors.UniqueViolation) as caught:
        pg_conn.execute(
            "INSERT INTO tasks (id, pipeline_id, stage, title, description, created_at_ms,"
            " updated_at_ms, idempotency_key) VALUES (%s, %s, 'todo', '', '', 1, 1, 'k')",
            (new_id(), first),
        )
    assert caught.value.diag.constraint_name == "idx_tasks_idempotency_key"


def test_two_servers_creating_one_idempotent_task_at_once_make_one(
    pg_shared_dsn: str, pg_conn: Conn
) -> None:
    pipeline_id = make_pipeline(pg_conn, unique("role"))
    pg_conn.commit()
    key = unique("key")
    with psycopg.connect(pg_shared_dsn) as a, psycopg.connect(pg_shared_dsn) as b:
        winner = make_task(a, pipeline_id, idempotency_key=key)  # not committed yet
        assert winner is not None
        b_pid = b.info.backend_pid
        outcome: list[Any] = []
        loser = threading.Thread(
            target=lambda: outcome.append(make_task(b, pipeline_id, idempotency_key=key))
        )
        loser.start()

        def b_waits_on_a_lock() -> bool:
            row = pg_conn.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (b_pid,)
            ).fetchone()
            pg_conn.rollback()  # a fresh snapshot of pg_stat_activity each time
            return row is not None and row[0] == "Lock"

        wait_for("the second insert to wait for the first", b_waits_on_a_lock)
        a.commit()
        loser.join(timeout=30)
        assert outcome == [None]  # no error, no second task
        found = one(b, "task_by_idempotency_key", pipeline_id=pipeline_id, idempotency_key=key)
        assert found == (winner,)


def test_a_dependency_is_recorded_once_and_never_on_itself(pg_conn: Conn) -> None:
    pipeline_id = make_pipeline(pg_conn, unique("role"))
    a, b = make_task(pg_conn, pipeline_id), make_task(pg_conn, pipeline_id)
    run(pg_conn, "insert_dependency", task_id=a, depends_on_task_id=b, now=1)
    with pytest.raises(errors.UniqueViolation) as dup, pg_conn.transaction():
        run(pg_conn, "insert_dependency", task_id=a, depends_on_task_id=b, now=2)
    assert dup.value.diag.constraint_name == "task_dependencies_pkey"
    with pytest.raises(errors.CheckViolation) as self_dep, pg_conn.transaction():
        run(pg_conn, "insert_dependency", task_id=a, depends_on_task_id=a, now=2)
    assert self_dep.value.diag.constraint_name == "task_dependencies_not_self"
    assert one(pg_conn, "list_dependencies", task_id=a) == (b, False)
    assert (
        len(pg_conn.execute("SELECT 1 FROM task_dependencies WHERE task_id = %s", (a,)).fetchall())
        == 1
    )


def test_a_store_key_holds_one_value(pg_conn: Conn) -> None:
    ns = unique("ns")
    run(pg_conn, "put_value", namespace=ns, key="k", value_json='{"v": 1}', now=1)
    run(pg_conn, "put_value", namespace=ns, key="k", value_json='{"v": 2}', now=5)
    rows = pg_conn.execute(
        "SELECT value_json::jsonb->>'v', created_at_ms, updated_at_ms FROM store"
        " WHERE namespace = %s",
        (ns,),
    ).fetchall()
    assert rows == [("2", 1, 5)]
    with pytest.raises(errors.UniqueViolation) as caught:
        pg_conn.execute(
            "INSERT INTO store (namespace, key, value_json, created_at_ms, updated_at_ms)"
            " VALUES (%s, 'k', '1', 1, 1)",
            (ns,),
        )
    assert caught.value.diag.constraint_name == "store_pkey"


def test_stage_roles_follow_pipeline_stages(pg_conn: Conn) -> None:
    role = unique("role")
    pipeline_id = make_pipeline(pg_conn, role)
    rows = pg_conn.execute(
        "SELECT stage, agent_role FROM pipeline_stage_roles WHERE pipeline_id = %s",
        (pipeline_id,),
    ).fetchall()
    assert rows == [("todo", role)]
    assert one(pg_conn, "role_stages", agent_role=role) == (pipeline_id, "todo")


def test_replays_of_one_idempotency_key_run_one_after_the_other(
    pg_shared_dsn: str, pg_conn: Conn
) -> None:
    key = {"key": unique("idem"), "method": "POST", "path": "/tasks"}
    with psycopg.connect(pg_shared_dsn) as first, psycopg.connect(pg_shared_dsn) as second:
        one(first, "lock_idempotency_key", **key)
        assert one(first, "get_idempotency", **key) is None
        other_key = {**key, "key": unique("idem")}
        one(second, "lock_idempotency_key", **other_key)  # another key: not held up
        second.commit()
        waited: list[Any] = []
        pid = second.info.backend_pid

        def replay() -> None:
            one(second, "lock_idempotency_key", **key)
            waited.append(one(second, "get_idempotency", **key))

        replaying = threading.Thread(target=replay)
        replaying.start()

        def second_waits() -> bool:
            row = pg_conn.execute(
                "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s",
                (pid,),
            ).fetchone()
            pg_conn.rollback()
            return row == ("Lock", "advisory")

        wait_for("the replay to wait for the first request", second_waits)
        assert waited == []
        run(first, "put_idempotency", **key, request_hash=b"r", auth_hash=None, status=201,
            body='{"id": "t"}', now=5)  # fmt: skip
        first.commit()
        replaying.join(timeout=30)
        assert waited == [(b"r", None, 201, '{"id": "t"}')]  # the stored answer, not a rerun
