"""The asyncio connections of event loops' units of work: a pool with no task of its own.

A pool of psycopg_pool runs tasks of its own on the loop that opened it (a scheduler, workers),
so it lives and dies with that loop. Units of work come from whichever loop runs them (a
server's one, or each `asyncio.run` of a tool or a test), so this pool is plain data instead:
idle connections on a stack, made when none is idle, and a turn per unit of work. An
asyncio connection is not bound to a loop (psycopg waits on whichever loop is running), so a
connection made on one loop serves the next. Each loop has its own queue of turns: at most
`size` units of work of a loop hold a connection at once; the others wait for their turn for as
long as it takes, as the units of a busy server waited for a thread. Making a connection waits
`connect_timeout` at most, so a unit whose turn came hears soon when PostgreSQL is gone.

A connection goes back on the stack only when it is idle and not broken; a failure that means
the server went away empties the stack (`discard_idle`), so the unit of work runs again on a
fresh one. Closing finishes every idle connection at once (libpq's own close needs no loop),
and each one in use as it comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

Connect = Callable[[], Awaitable["psycopg.AsyncConnection[Any]"]]


class LoopPool:
    def __init__(self, connect: Connect, size: int) -> None:
        self._connect = connect
        self.size = max(1, size)
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self.closed = False

    def _turn(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        turn = self._turns.get(loop)
        if turn is None:
            turn = self._turns[loop] = asyncio.Semaphore(self.size)
        return turn

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection for one unit of work, back on the stack after it when still usable."""
        async with self._turn():
            if self.closed:
                raise psycopg.OperationalError("the pool is closed")
            conn = self._idle.pop() if self._idle else await self._connect()
            try:
                yield conn
            finally:
                if (
                    not self.closed
                    and not conn.broken
                    and conn.info.transaction_status == TransactionStatus.IDLE
                ):
                    self._idle.append(conn)
                else:
                    _finish(conn)

    def discard_idle(self) -> None:
        """Finish the idle connections: after PostgreSQL restarted, none of them works."""
        idle, self._idle = self._idle, []
        for conn in idle:
            _finish(conn)

    def close(self) -> None:
        self.closed = True
        self.discard_idle()


def _finish(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close the connection's socket (libpq's PQfinish), from any thread, with or without a
    loop: what AsyncConnection.close does, less the wait for a lock no unit of work holds."""
    with contextlib.suppress(Exception):
        conn.pgconn.finish()
