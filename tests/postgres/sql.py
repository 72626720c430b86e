"""The PostgreSQL queries as psycopg runs them, for tests that exercise them one by one."""

from __future__ import annotations

import re
from typing import Any

from nulltickets.storage.queries import load_backend_queries

Q = load_backend_queries("nulltickets.storage.postgres", "pyformat")

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")


def one(conn: Any, name: str, /, **params: Any) -> Any:
    return conn.execute(Q[name], params).fetchone()


def all_rows(conn: Any, name: str, /, **params: Any) -> list[Any]:
    return list(conn.execute(Q[name], params).fetchall())


def run(conn: Any, name: str, /, **params: Any) -> int:
    return int(conn.execute(Q[name], params).rowcount)


def numbered(sql: str) -> tuple[str, list[str]]:
    """`sql` with psycopg's %(name)s turned into $1, $2... (one number per name), and the
    names in number order: the text PostgreSQL's own PREPARE takes."""
    names: list[str] = []

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PLACEHOLDER.sub(replace, sql), names


def make_pipeline(conn: Any, role: str, now: int = 1_000) -> str:
    """A pipeline todo (worked by `role`) -> done (terminal), written with the backend's queries."""
    from nulltickets.domain.ids import new_id
    from tests.conftest import unique

    pipeline_id = new_id()
    run(conn, "insert_pipeline", id=pipeline_id, name=unique("pipe"), definition_json="{}", now=now)
    for stage, agent_role, terminal in (("todo", role, False), ("done", None, True)):
        run(
            conn,
            "insert_pipeline_stage",
            pipeline_id=pipeline_id,
            stage=stage,
            agent_role=agent_role,
            terminal=terminal,
        )
    return pipeline_id


def make_task(
    conn: Any,
    pipeline_id: str,
    *,
    now: int = 1_000,
    priority: int = 0,
    stage: str = "todo",
    idempotency_key: str | None = None,
) -> str | None:
    """A task in `stage`; its id, or None when the idempotency key was already taken."""
    from nulltickets.domain.ids import new_id

    row = one(
        conn,
        "insert_task",
        id=new_id(),
        pipeline_id=pipeline_id,
        stage=stage,
        title="t",
        description="",
        priority=priority,
        metadata_json="{}",
        max_attempts=None,
        retry_delay_ms=0,
        dead_letter_stage=None,
        idempotency_key=idempotency_key,
        retry_delay_set=False,
        now=now,
    )
    return None if row is None else str(row[0])


def start_run(conn: Any, task_id: str, agent: str = "agent", now: int = 2_000) -> int | None:
    """insert_run for `task_id`: its attempt, or None when the task already has a running run."""
    from nulltickets.domain.ids import new_id

    row = one(
        conn,
        "insert_run",
        id=new_id(),
        task_id=task_id,
        agent_id=agent,
        agent_role="r",
        now=now,
        lease_id=new_id(),
    )
    return None if row is None else int(row[0])
