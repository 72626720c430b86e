"""A unit of work written for a blocking connection, run on an asyncio one, in the event loop's
thread: no thread hop per request.

A unit of work is plain synchronous code over a `PostgresBackend` (the same code runs on
SQLite, where it is in-process). `run` starts it in a greenlet of its own; each time it sends a
statement, `GreenConnection` hands the driver's coroutine up to `run`, which awaits it on the
loop (other requests go on meanwhile) and hands the result, or the error, back down into the
unit of work where it left off. The unit of work never sees a coroutine; the loop never blocks.
The greenlet runs in the caller's context (its context variables).
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import greenlet
import psycopg

T = TypeVar("T")


class _Unit(greenlet.greenlet):  # type: ignore[misc]
    """The greenlet of a unit of work; its parent is the coroutine of `run` that awaits for it."""


def wait(awaitable: Awaitable[T]) -> T:
    """The result of `awaitable`, awaited by the coroutine that runs this unit of work."""
    current = greenlet.getcurrent()
    if not isinstance(current, _Unit):
        raise RuntimeError("a statement on an asyncio connection outside postgres.green.run")
    result: T = current.parent.switch(awaitable)
    return result


async def run(job: Callable[..., T], *args: Any) -> T:
    """`job(*args)`, its statements awaited on this loop."""
    unit = _Unit(job, greenlet.getcurrent())
    unit.gr_context = greenlet.getcurrent().gr_context
    step = unit.switch(*args)
    while not unit.dead:
        try:
            value = await step
        except BaseException:  # into the unit of work, where it may be handled
            step = unit.throw(*sys.exc_info())
        else:
            step = unit.switch(value)
    result: T = step
    return result


class GreenCursor:
    """What a PostgresBackend reads of a cursor, over psycopg's AsyncCursor."""

    __slots__ = ("_cur",)

    def __init__(self, cur: psycopg.AsyncCursor[Any]) -> None:
        self._cur = cur

    @property
    def rowcount(self) -> int:
        return self._cur.rowcount

    @property
    def description(self) -> Sequence[Any] | None:
        return self._cur.description

    def fetchone(self) -> Any:
        return wait(self._cur.fetchone())

    def fetchall(self) -> list[Any]:
        return wait(self._cur.fetchall())

    def nextset(self) -> bool | None:
        return self._cur.nextset()


class GreenConnection:
    """What a PostgresBackend uses of a connection, over psycopg's AsyncConnection."""

    __slots__ = ("_conn",)

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    @property
    def info(self) -> Any:
        return self._conn.info

    @property
    def broken(self) -> bool:
        return self._conn.broken

    @property
    def autocommit(self) -> bool:
        return self._conn.autocommit

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None
    ) -> GreenCursor:
        return GreenCursor(wait(self._conn.execute(query, params, prepare=prepare)))

    def mogrify(self, query: Any, params: Any) -> str:
        """`query` with `params` bound by the driver (no I/O): see PostgresBackend._script."""
        return psycopg.AsyncClientCursor(self._conn).mogrify(query, params)
