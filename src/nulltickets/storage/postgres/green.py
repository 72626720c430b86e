"""A unit of work written for a blocking connection, run on an asyncio one, in the event loop's
thread: no thread hop per request.

A unit of work is plain synchronous code over a `PostgresBackend` (the same code runs on
SQLite, where it is in-process). `run` runs it in a greenlet of its own (kept for a later unit
once it is over); each time it sends a statement, `GreenConnection` hands the driver's coroutine
up to `run`, which awaits it on the loop (other requests go on meanwhile) and hands the result,
or the error, back down into the unit of work where it left off. The unit of work never sees a
coroutine; the loop never blocks. The greenlet runs in the caller's context (its context
variables).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import greenlet
import psycopg

from nulltickets.storage.postgres.combine import Combiner, Result

T = TypeVar("T")


# Units kept for the next run, per thread (a greenlet runs only in the thread that made it).
# A greenlet that finishes gives back its own stack of Python frames, memory the interpreter maps
# and unmaps for each one; a kept unit keeps it, so a request costs no mmap and munmap (and no
# flush of the other cores' TLBs that unmapping asks for).
_KEPT = 64
_idle = threading.local()


class _Outcome:
    """What a unit hands back when its job is over: the result, or the exception it raised."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self.value = value
        self.error = error


class _Unit(greenlet.greenlet):  # type: ignore[misc]
    """A greenlet that runs one job after another; between jobs it waits for the next one in
    its parent, the coroutine of `run` that awaits for it."""

    def __init__(self) -> None:
        super().__init__(self._serve)

    def _serve(self, job: Callable[..., Any], args: tuple[Any, ...]) -> None:
        while True:
            try:
                outcome = _Outcome(job(*args), None)
            except greenlet.GreenletExit:  # the unit itself is being collected mid-job
                raise
            except BaseException as error:  # handed to the caller, who raises it
                outcome = _Outcome(None, error)
            del job, args
            job, args = self.parent.switch(outcome)


def wait(awaitable: Awaitable[T]) -> T:
    """The result of `awaitable`, awaited by the coroutine that runs this unit of work."""
    current = greenlet.getcurrent()
    if not isinstance(current, _Unit):
        raise RuntimeError("a statement on an asyncio connection outside postgres.green.run")
    result: T = current.parent.switch(awaitable)
    return result


async def run(job: Callable[..., T], *args: Any) -> T:
    """`job(*args)`, its statements awaited on this loop."""
    idle: list[_Unit] = _idle.__dict__.setdefault("units", [])
    unit = idle.pop() if idle else _Unit()
    here = greenlet.getcurrent()
    if unit.parent is not here:
        unit.parent = here
    unit.gr_context = here.gr_context
    step = unit.switch(job, args)
    while not isinstance(step, _Outcome):
        try:
            value = await step
        except BaseException:  # into the unit of work, where it may be handled
            step = unit.throw(*sys.exc_info())
        else:
            step = unit.switch(value)
    unit.gr_context = None  # a kept unit holds on to nothing of this request's context
    if len(idle) < _KEPT:
        idle.append(unit)
    result: T = step.value
    error = step.error
    step.value = step.error = None  # the kept unit holds on to neither
    if error is not None:
        raise error
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

    __slots__ = ("_combiner", "_conn")

    def __init__(
        self, conn: psycopg.AsyncConnection[Any], combiner: Combiner | None = None
    ) -> None:
        self._conn = conn
        self._combiner = combiner

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

    def execute_alone(self, query: Any, params: Any) -> GreenCursor | Result:
        """`query` as a whole unit of work (the connection is in autocommit mode and idle),
        committed with the other requests of this turn of the loop (postgres.combine)."""
        if self._combiner is None:  # only the connections of writes have one (database.py)
            raise RuntimeError("a statement of ALONE on a connection that does not write")
        done = wait(self._combiner.execute(self._conn, query, params))
        return done if isinstance(done, Result) else GreenCursor(done)

    def mogrify(self, query: Any, params: Any) -> str:
        """`query` with `params` bound by the driver (no I/O): see PostgresBackend._script."""
        return psycopg.AsyncClientCursor(self._conn).mogrify(query, params)
