"""SqliteBackend: storage.backend.Backend over apsw, running the queries of queries.sql.

Methods run on whatever connection the backend wraps; transactions belong to the caller
(the writer's batch, or a reader's snapshot). What is SQLite's stays here: the runner over
apsw (a new row's id is last_insert_rowid), lists go to json_each as JSON text, search terms
become an FTS5 expression, a few counts come back as one JSON array, and a constraint the
data enforces becomes the contract's error (apsw.ConstraintError never leaves storage).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import apsw

from nulltickets.storage.backend import (
    PRUNE_COUNTED,
    Backend,
    QueueRow,
    StageBoardRow,
    ids_param,
)
from nulltickets.storage.queries import load_backend_queries, parameter_names
from nulltickets.storage.sqlite import connection
from nulltickets.storage.sqlite.search import fts_query

Q = load_backend_queries("nulltickets.storage.sqlite")


def _positional(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """What turns a query's parameters into its values by position. apsw binds a dict by name:
    for each parameter it makes the name a str and looks it up, which cost more than running
    the claim cycle's short statements (measured under callgrind); a tuple it binds directly."""
    if not names:
        return lambda params: ()
    if len(names) == 1:
        (only,) = names
        return lambda params: (params[only],)
    return itemgetter(*names)


# Each query's parameters by position, in the order SQLite numbers them.
ARGS = {name: _positional(parameter_names(sql)) for name, sql in Q.items()}

# What prune_tasks deletes, a statement a table, children before parents: (table, query).
# Task events, dependencies and assignments go with their task (ON DELETE CASCADE).
_TASK_DELETES = (
    ("events", "prune_delete_events"),
    ("leases", "prune_delete_leases"),
    ("artifacts", "prune_delete_artifacts"),
    ("otlp_spans", "prune_delete_spans"),
    ("runs", "prune_delete_runs"),
    ("tasks", "prune_delete_tasks"),
)


class SqliteBackend(Backend):
    _unique_violation = apsw.ConstraintError
    _bad_query = (apsw.SQLError,)

    def __init__(self, conn: apsw.Connection) -> None:
        self.conn = conn

    def _all(self, name: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return self.conn.execute(Q[name], ARGS[name](params or {})).fetchall()

    def _one(self, name: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        for row in self.conn.execute(Q[name], ARGS[name](params)):
            return row  # type: ignore[no-any-return]
        return None

    def _exec(self, name: str, params: dict[str, Any]) -> int:
        self.conn.execute(Q[name], ARGS[name](params))
        changes: int = self.conn.changes()
        return changes

    def _insert(self, name: str, params: dict[str, Any]) -> int:
        self.conn.execute(Q[name], ARGS[name](params))
        return int(self.conn.last_insert_rowid())

    def _search_text(self, terms: Sequence[str]) -> str:
        return fts_query(terms)

    def _rows(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        cursor = self.conn.execute(Q[name], ARGS[name](params))
        try:
            columns = [c[0] for c in cursor.getdescription()]
        except apsw.ExecutionCompleteError:  # no row: the statement has already finished
            return []
        return [dict(zip(columns, row, strict=True)) for row in cursor]

    def prune_tasks(self, ids: Sequence[str]) -> dict[str, int]:
        params = ids_param(ids)
        deleted = {table: self._exec(name, params) for table, name in _TASK_DELETES}
        return {table: deleted[table] for table in PRUNE_COUNTED}

    # The file gives its free pages back (auto_vacuum INCREMENTAL: connection.py sets it on a
    # new file, `nulltickets prune --vacuum` on an older one), a step at a time, each step a
    # short write of its own: never one long VACUUM that holds every writer up.

    def free_pages(self) -> tuple[int, int, bool] | None:
        free = int(self.conn.pragma("freelist_count"))
        pages = int(self.conn.pragma("page_count"))
        return free, pages, int(self.conn.pragma("auto_vacuum")) == connection.INCREMENTAL_VACUUM

    def give_back_pages(self, pages: int) -> None:
        self.conn.pragma("incremental_vacuum", int(pages))

    def engine(self) -> tuple[str, str, list[str]]:
        return "sqlite", connection.sqlite_version(), connection.sqlite_options()

    # One walk of a stage's rows yields its counts as one JSON array (see queries.sql).

    def _board_row(self, row: tuple[Any, ...]) -> StageBoardRow:
        pipeline_id, stage, role, board = row
        c, oldest, leased, delayed, blocked, dead, cancelled = json.loads(board)
        return (pipeline_id, stage, role, c, oldest, leased, delayed, blocked, dead, cancelled)

    def _queue_row(self, row: tuple[Any, ...]) -> QueueRow:
        role, claimable, failed, stuck, near = row
        count, oldest = json.loads(claimable)
        return (role, count, oldest, failed, stuck, near)
