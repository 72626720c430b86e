"""Bulk loads for tools and benchmarks: SQLite only, outside the Backend protocol (the service
never needs them)."""

from __future__ import annotations

from collections.abc import Iterable

from nulltickets.storage.backend import Backend
from nulltickets.storage.sqlite.backend import Q, SqliteBackend


def insert_tasks(b: Backend, rows: Iterable[tuple[str, str, str, str, int]]) -> None:
    """Insert plain tasks, (id, pipeline_id, stage, title, created_at_ms) each, in the unit of
    work `b` (a SQLite one), with one prepared statement."""
    if not isinstance(b, SqliteBackend):
        raise TypeError("bulk loads need a SQLite database")
    names = ("id", "pipeline_id", "stage", "title", "now")
    b.conn.executemany(Q["bulk_insert_task"], (dict(zip(names, row, strict=True)) for row in rows))
