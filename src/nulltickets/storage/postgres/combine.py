"""The one-statement units of work an event loop's requests send at once, committed together.

A statement of ALONE (backend.ALONE) is a whole unit of work, and on its own each costs
PostgreSQL a transaction and a commit (with `synchronous_commit` on, a wait for the WAL to reach
the disk) and costs both sides a round trip. When a server is busy, its loop runs several
requests in one turn, and each sends its statement in that turn. The first of them waits for the
end of the turn; then all of them go to PostgreSQL on its connection as one pipeline: BEGIN,
each statement, COMMIT, in one transaction that keeps all of them or, when one fails, none.
One message, one commit, one answer; each request reads its own statement's result, and its
unit of work goes on on its own connection, as before (when its statement wrote nothing: the
unit's next statements). A request alone in its turn, or one of fewer than FEWEST, sends its
statement as it did: its own transaction.

One transaction for all means that when one statement fails, none is kept. Then each runs again
on its own, on its own connection, as it would have with no batch, and hears its own outcome:
the statement that failed fails again by itself and the others are kept. When the connection was
lost instead, every request hears that, as it would have on its own connection (the unit of
work runs again, on a connection that works: database.PostgresDatabase._again).
"""

from __future__ import annotations

import asyncio
import copy
import weakref
from collections.abc import Callable, Sequence
from typing import Any, LiteralString

import psycopg

from nulltickets.errors import StorageUnavailable

TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK

BEGIN: LiteralString = "BEGIN"
COMMIT: LiteralString = "COMMIT"

# At most this many statements go in one batch; the others of the turn make the next one.
MOST = 32
# Fewer than this many in a turn are each sent on their own, at once. A batch costs the server
# more than its statements sent apart (its BEGIN and COMMIT, the pipeline's own work), and with
# two or three statements that came to more than the commits it saved PostgreSQL (measured
# with 16 agents on one server: docs/operating/postgresql.md).
FEWEST = 4


class Result:
    """What a statement's cursor held, read out of it: a request's own result of a batch."""

    __slots__ = ("_cur", "_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int, cur: psycopg.AsyncCursor[Any]) -> None:
        self._rows = rows
        self.rowcount = rowcount
        self._cur = cur  # its own, done with: nothing runs on it again

    @classmethod
    async def of(cls, cur: psycopg.AsyncCursor[Any]) -> Result:
        # Whether it has rows, from its result's status, not its `description`: psycopg builds
        # that anew at each reading, an object per column (for a claim's 21 columns, 15 us of
        # the server's CPU each time, ten times the cost of loading its row). The backend reads
        # these rows by position; `description` is built only if something asks for it.
        res = cur.pgresult
        rows = await cur.fetchall() if res is not None and res.status == TUPLES_OK else []
        return cls(rows, cur.rowcount, cur)

    @property
    def description(self) -> Sequence[Any] | None:
        return self._cur.description

    def fetchone(self) -> Any:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[Any]:
        rows, self._rows = self._rows, []
        return rows

    def nextset(self) -> bool | None:
        return None


class _Alone:
    """A request's answer from the batch's leader: run your statement on your own."""


ALONE_AGAIN = _Alone()


class _Request:
    __slots__ = ("answer", "params", "query")

    def __init__(self, query: LiteralString, params: Any, answer: asyncio.Future[Any] | None):
        self.query = query
        self.params = params
        self.answer = answer  # None: the leader's own


class Combiner:
    """The batches of one PostgresDatabase, each loop's its own (a batch runs on one loop)."""

    def __init__(self, lost: Callable[[BaseException, Any], bool]) -> None:
        # Whether an error means the connection (or the server) is gone, not a statement wrong.
        self._lost = lost
        # The batch each loop is gathering in this turn, its leader's request first.
        self._gathering: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[_Request]] = (
            weakref.WeakKeyDictionary()
        )
        self.commits = 0  # batches of more than one statement committed
        self.units = 0  # the statements those carried
        self.failures = 0  # batches refused as a whole, their statements then sent one by one

    async def execute(
        self, conn: psycopg.AsyncConnection[Any], query: LiteralString, params: Any
    ) -> Result | psycopg.AsyncCursor[Any]:
        """`query` run as a unit of work of its own (`conn` is in autocommit mode and idle),
        with the other requests of this turn of the loop when there are some."""
        loop = asyncio.get_running_loop()
        batch = self._gathering.get(loop)
        if batch is not None and len(batch) < MOST:
            answer_of = loop.create_future()
            batch.append(_Request(query, params, answer_of))
            answer = await answer_of
            if answer is ALONE_AGAIN:
                return await _alone(conn, query, params)
            result: Result = answer
            return result
        batch = self._gathering[loop] = [_Request(query, params, None)]
        try:
            await asyncio.sleep(0)  # the turn's other requests join
        except BaseException:
            self._end_gathering(loop, batch)
            _answer_all(batch, ALONE_AGAIN)
            raise
        self._end_gathering(loop, batch)
        if len(batch) < FEWEST:  # each on its own connection, at once
            _answer_all(batch, ALONE_AGAIN)
            return await _alone(conn, query, params)
        result = await self._lead(conn, batch)
        if isinstance(result, Result):  # the batch committed
            self.commits += 1
            self.units += len(batch)
        return result

    async def _lead(
        self, conn: psycopg.AsyncConnection[Any], batch: list[_Request]
    ) -> Result | Any:
        """The batch as one transaction on `conn`, each request answered; the leader's result."""
        try:
            results = await _send(conn, batch)
        except BaseException as exc:
            if isinstance(exc, psycopg.Error) and not self._lost(exc, conn):
                # A statement failed and took the batch with it: each on its own, its own outcome.
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    await conn.rollback()
                self.failures += 1
                _answer_all(batch, ALONE_AGAIN)
                return await _alone(conn, batch[0].query, batch[0].params)
            for request in batch[1:]:
                _answer(request, _own(exc))
            raise
        for request, result in zip(batch[1:], results[1:], strict=True):
            _answer(request, result)
        return results[0]

    def _end_gathering(self, loop: asyncio.AbstractEventLoop, batch: list[_Request]) -> None:
        if self._gathering.get(loop) is batch:
            del self._gathering[loop]


async def _alone(
    conn: psycopg.AsyncConnection[Any], query: LiteralString, params: Any
) -> psycopg.AsyncCursor[Any]:
    # Prepared on its first use on this connection, not its sixth (psycopg's default): these
    # are the verbs every agent sends, and until then each run of the claim or the transition
    # is parsed and planned again (milliseconds of PostgreSQL's CPU).
    return await conn.execute(query, params, prepare=True)


async def _send(conn: psycopg.AsyncConnection[Any], batch: list[_Request]) -> list[Result]:
    """The statements in one pipeline, in one transaction of their own: `conn` is in autocommit
    mode, where psycopg's pipeline would commit each statement by itself."""
    async with conn.pipeline():
        await conn.execute(BEGIN, prepare=False)
        cursors = [await conn.execute(r.query, r.params, prepare=True) for r in batch]
        await conn.execute(COMMIT, prepare=False)
    return [await Result.of(cur) for cur in cursors]


def _own(exc: BaseException) -> BaseException:
    """A copy of `exc` for another request to raise (each its own traceback)."""
    if isinstance(exc, asyncio.CancelledError):
        return StorageUnavailable(
            "the server stopped during a commit: the write may or may not have been kept "
            "(retry it with its Idempotency-Key)"
        )
    return copy.copy(exc)


def _answer(request: _Request, answer: Any) -> None:
    future = request.answer
    if future is None or future.done():
        return
    if isinstance(answer, BaseException):
        future.set_exception(answer)
    else:
        future.set_result(answer)


def _answer_all(batch: list[_Request], answer: Any) -> None:
    for request in batch[1:]:
        _answer(request, answer)
