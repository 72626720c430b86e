"""The database as the service sees it (storage.ports.Database), on PostgreSQL.

Every unit of work runs in one transaction on a pooled connection. From the event loop (every
request) that is an asyncio connection, in the loop's own thread: the unit of work is the same
synchronous code as on SQLite, and postgres.green awaits each of its statements on the loop,
so other requests go on meanwhile and no thread is involved. From a plain thread (retention,
tools, tests) it is a blocking connection of a pool of its own. Writes run at READ COMMITTED:
what keeps two servers from both claiming a task, or from inserting one name twice, is the
data itself (runs_one_running_per_task, unique keys, ON CONFLICT, row locks taken with SKIP
LOCKED), not a single writer. When PostgreSQL aborts a unit of work for reasons that a second
try settles (a serialization failure, a deadlock, a claim that lost its race to another
server, a connection that died before COMMIT), the whole unit runs again on a fresh
transaction, a few times, with jitter. Reads run in a read-only REPEATABLE READ transaction:
one snapshot per unit of work; a read of one statement runs it with no transaction around it
(the statement's snapshot is the read's), on a connection that is read-only all the same.

Driver errors are translated here, at the edge: no connection (refused, server gone, shutting
down, pool exhausted) is StorageUnavailable (503 with Retry-After), a full disk StorageFull,
a unique violation the backend did not expect is matched by constraint name to the contract's
codes. Nothing of psycopg leaves this package.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import psycopg
import psycopg_pool
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from nulltickets.domain.stats import COMMIT_SECONDS, Histogram
from nulltickets.errors import (
    DuplicateDependency,
    DuplicateName,
    InvalidDependency,
    InvalidRequest,
    StartupError,
    StorageBusy,
    StorageFull,
    StorageReadOnly,
    StorageUnavailable,
)
from nulltickets.storage.dsn import display_name, redact
from nulltickets.storage.ports import Capabilities, StorageStats
from nulltickets.storage.postgres import green
from nulltickets.storage.postgres.backend import LostRace, PostgresBackend, Q, SecondStatement
from nulltickets.storage.postgres.combine import Combiner
from nulltickets.storage.postgres.green import GreenConnection
from nulltickets.storage.postgres.migrate import migrate, migrations
from nulltickets.storage.postgres.notifier import PostgresNotifier
from nulltickets.storage.postgres.pool import LoopPool

log = logging.getLogger("nulltickets.storage")

T = TypeVar("T")
IDLE = TransactionStatus.IDLE


CAPABILITIES = Capabilities(
    name="postgresql",
    cross_process_notifications=True,
    group_commit=False,
    shared_by_servers=True,
)

# How long a unit of work waits for a pooled connection before it is answered 503: long enough
# for a busy pool, short enough that a client hears "unavailable" while PostgreSQL restarts.
POOL_TIMEOUT_S = 3.0
CONNECT_TIMEOUT_S = 3
# How many reads of a kind seen to need more than one statement run in a transaction before
# one is tried as one statement again: the statement spent when it still needs more is one
# in this many reads.
SEVERAL_FOR = 64
# Retries of a whole unit of work: after a serialization failure, deadlock or lost race.
RACE_RETRIES = 8
# ... and after its connection died before COMMIT (the pool checks its idle ones first).
CONNECTION_RETRIES = 2
RETRY_BASE_S = 0.002
RETRY_MAX_S = 0.05

# Connection-level failures: the server is gone, shutting down, or not yet accepting.
_UNAVAILABLE_STATES = {"57P01", "57P02", "57P03", "53300"}

# Constraint names (migration 0001) the contract has a code for.
_UNIQUE_CODES: dict[str, Callable[[], Exception]] = {
    "pipelines_name_key": lambda: DuplicateName("a pipeline of that name already exists"),
    "task_dependencies_pkey": DuplicateDependency,
}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def connection_lost(exc: BaseException, conn: psycopg.Connection[Any] | None = None) -> bool:
    """Whether `exc` means the connection (or the server) is gone, not the statement wrong."""
    if isinstance(exc, psycopg_pool.PoolTimeout):
        return True
    if not isinstance(exc, psycopg.Error):
        return False
    if conn is not None and conn.broken:
        return True
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith("08") or state in _UNAVAILABLE_STATES


def _retryable_race(exc: BaseException) -> bool:
    return isinstance(
        exc,
        LostRace | pg_errors.SerializationFailure | pg_errors.DeadlockDetected,
    )


def storage_error(exc: BaseException, conn: psycopg.Connection[Any] | None = None) -> BaseException:
    """Translate a driver error into ours (others pass through unchanged)."""
    if not isinstance(exc, psycopg.Error | psycopg_pool.PoolTimeout):
        return exc
    if connection_lost(exc, conn):
        return StorageUnavailable(f"PostgreSQL is unavailable: {_first_line(exc)}")
    if isinstance(exc, psycopg.DataError) and (
        exc.sqlstate in ("22P05", "22021") or "NUL" in str(exc)
    ):
        # PostgreSQL text cannot hold the NUL character (SQLite's can): a clear 400, not a 500.
        return InvalidRequest("PostgreSQL cannot store the NUL character (\\u0000) in text")
    if isinstance(exc, pg_errors.DiskFull):
        return StorageFull()
    if isinstance(exc, pg_errors.ReadOnlySqlTransaction):
        return StorageReadOnly()
    if isinstance(exc, pg_errors.UniqueViolation):
        make = _UNIQUE_CODES.get(exc.diag.constraint_name or "")
        if make is not None:
            return make()
        return StorageBusy("a concurrent write took the same key; try again")
    if (
        isinstance(exc, pg_errors.CheckViolation)
        and exc.diag.constraint_name == "task_dependencies_not_self"
    ):
        return InvalidDependency()
    if isinstance(
        exc,
        pg_errors.SerializationFailure
        | pg_errors.DeadlockDetected
        | pg_errors.LockNotAvailable
        | pg_errors.QueryCanceled,
    ):
        return StorageBusy()
    return exc


def with_options(url: str, settings: list[str]) -> str:
    """libpq's `options` for a connection to `url`: the ones the URL gives, then `settings`
    (a keyword argument replaces the URL's own, and a user's `?options=-c ...` would be lost)."""
    try:
        own = str(conninfo_to_dict(url).get("options") or "")
    except psycopg.Error:  # a malformed URL fails on connecting, with its own message
        own = ""
    return " ".join([own, *settings]).strip()


class PostgresDatabase:
    """storage.ports.Database on one PostgreSQL database: a pool of connections for units of
    work that write, a smaller one for reads, and the LISTEN/NOTIFY notifier."""

    capabilities = CAPABILITIES

    def __init__(
        self, url: str, *, durability: str = "full", readers: int = 4, writers: int = 8
    ) -> None:
        self.url = url
        self.durability = durability
        self._readers = max(1, readers)
        self._writers = max(1, writers)
        self._write_pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]] | None = None
        self._read_pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]] | None = None
        # The asyncio connections of units of work from event loops (postgres.green).
        self._loop_write = LoopPool(self._connect_writer, self._writers)
        self._loop_read = LoopPool(self._connect_reader, self._readers)
        self._notifier = PostgresNotifier(url)
        self._combiner = Combiner(connection_lost)
        self._rand = random.Random()
        self._lock = threading.Lock()
        # The kinds of read seen to run more than one statement, and how many more of their
        # reads run in a transaction before one is tried as one statement again.
        self._several: dict[Hashable, int] = {}
        self.retries = 0  # units of work run again (races, lost connections)
        self.commit_durations = Histogram(COMMIT_SECONDS, shared=True)  # the pool's threads

    @property
    def notifier(self) -> PostgresNotifier:
        return self._notifier

    # --- lifecycle -----------------------------------------------------------------------------

    def _kwargs(self, *, writer: bool = False, read_only: bool = False) -> dict[str, Any]:
        # A writer's connection is in autocommit mode: a statement of ALONE is its own
        # transaction with no switch of mode, and a unit of work of several statements opens
        # its transaction itself, in the same message as its first one when it can
        # (PostgresBackend._opens_transaction).
        settings = [
            # No JIT compilation: every statement here is short, and PostgreSQL decides on JIT
            # by the plan's estimated cost, not by what the statement does. A stage board over
            # a few thousand tasks was estimated above jit_above_cost and spent 1.3 to 3.3 s
            # compiling itself for a walk of 7 ms, on every /metrics scrape.
            "-c jit=off",
        ]
        if self.durability != "full":
            # "normal": a commit returns before its WAL reaches the disk (PostgreSQL's
            # synchronous_commit = off); a crash of PostgreSQL may lose the last few.
            settings.append("-c synchronous_commit=off")
        if read_only:
            # Read-only also when a read of one statement runs with no transaction around it.
            settings.append("-c default_transaction_read_only=on")
        return {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "autocommit": writer,
            "options": with_options(self.url, settings),
        }

    def open(self) -> None:
        where = display_name(self.url)
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as c:
                migrate(c)
        except StartupError as exc:
            raise StartupError(f"cannot open PostgreSQL database {where}: {exc}") from None
        except psycopg.Error as exc:
            # libpq may quote the URL, or the password alone, in its message.
            reason = redact(_first_line(exc), self.url)
            raise StartupError(f"cannot open PostgreSQL database {where}: {reason}") from None

        def reader(conn: psycopg.Connection[Any]) -> None:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.read_only = True

        self._write_pool = psycopg_pool.ConnectionPool(
            self.url,
            min_size=0,  # in a server only retention's thread uses it, a batch at a time
            max_size=self._writers,
            kwargs=self._kwargs(writer=True),
            timeout=POOL_TIMEOUT_S,
            reconnect_timeout=24 * 3600,
            name="nulltickets-write",
            open=True,
        )
        self._read_pool = psycopg_pool.ConnectionPool(
            self.url,
            min_size=0,
            max_size=self._readers,
            kwargs=self._kwargs(),
            configure=reader,
            timeout=POOL_TIMEOUT_S,
            reconnect_timeout=24 * 3600,
            name="nulltickets-read",
            open=True,
        )
        self._loop_write = LoopPool(self._connect_writer, self._writers)
        self._loop_read = LoopPool(self._connect_reader, self._readers)
        self._notifier.start()
        # Ready once it listens: a commit before the LISTEN is in place notifies nobody here,
        # and a long-poll that began meanwhile would sleep through work it was waiting for.
        # Should it not listen by then, it listens later and then wakes every long-poll once.
        self._notifier.listening_within(CONNECT_TIMEOUT_S)

    def close(self) -> None:
        self._notifier.stop()
        self._loop_write.close()
        self._loop_read.close()
        for pool in (self._read_pool, self._write_pool):
            if pool is not None:
                pool.close()
        self._read_pool = self._write_pool = None

    async def _connect_writer(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(self.url, **self._kwargs(writer=True))

    async def _connect_reader(self) -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(self.url, **self._kwargs(read_only=True))
        await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        await conn.set_read_only(True)
        return conn

    def stats(self) -> StorageStats:
        """What /metrics shows for this process: the units of work retried, the one-statement
        ones committed together (postgres.combine) and the time of each commit (no WAL
        checkpoints here: those are PostgreSQL's own)."""
        return StorageStats(
            {
                "retries": float(self.retries),
                "combined_commits": float(self._combiner.commits),
                "combined_units": float(self._combiner.units),
                "combined_failures": float(self._combiner.failures),
            },
            {"commit_duration_seconds": self.commit_durations},
        )

    def schema_version(self) -> tuple[int, int]:
        latest = len(migrations())
        with psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as c:
            versions = [row[0] for row in c.execute(Q["schema_versions"])]
        return (max(versions) if versions else 0), latest

    # --- units of work -------------------------------------------------------------------------

    async def write(self, job: Callable[[PostgresBackend], T]) -> T:
        """`job` in a transaction of its own on this loop's pool (postgres.green: no thread),
        again when a retry settles its failure."""
        pool = self._open(self._loop_write)
        tries = _Tries()
        while True:
            committing = False
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                async with pool.connection() as conn:
                    backend = PostgresBackend(GreenConnection(conn, self._combiner), writing=True)
                    try:
                        result: T = await green.run(_unit, job, backend)
                        tail = backend.commit_script()
                        committing = True
                        started = time.perf_counter()
                        if tail is not None:  # what goes with the COMMIT, and the COMMIT
                            await conn.execute(tail, prepare=False)  # (one round trip)
                        elif conn.info.transaction_status != IDLE:
                            await conn.commit()
                        # else: a statement of ALONE was the unit, and committed with itself
                    except BaseException:
                        if not conn.broken and conn.info.transaction_status != IDLE:
                            await conn.rollback()
                        raise
                    self.commit_durations.observe(time.perf_counter() - started)
                self._notifier.committed()
                return result
            except BaseException as exc:
                again = self._again(exc, conn, committing, tries)
                if again is None:
                    raise
                if again:
                    await asyncio.sleep(again)
                else:
                    pool.discard_idle()

    async def read(self, job: Callable[[PostgresBackend], T], *, kind: Hashable | None = None) -> T:
        """`job` in a read-only transaction (one snapshot) on this loop's pool; a job of a
        `kind` not seen to run more than one statement as that one statement on its own (its
        snapshot is the statement's: one round trip, no BEGIN nor ROLLBACK). Should it go on
        to a second statement, it runs again in a transaction (a read changes nothing, so
        running it again is safe), and so do the next SEVERAL_FOR jobs of its kind; then
        one tries again (a read that needed more once, to fill a cache, say, may not since)."""
        pool = self._open(self._loop_read)
        alone = False
        if kind is not None:
            left = self._several.get(kind, 0)
            if left:
                self._several[kind] = left - 1
            alone = not left
        tries = _Tries()
        while True:
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                async with pool.connection() as conn:
                    if alone:
                        await conn.set_autocommit(True)
                        try:
                            backend = PostgresBackend(GreenConnection(conn), one_read=True)
                            return await green.run(job, backend)
                        except SecondStatement:
                            self._several[kind] = SEVERAL_FOR
                            alone = False
                        finally:
                            if not conn.broken:
                                await conn.set_autocommit(False)
                    try:
                        return await green.run(job, PostgresBackend(GreenConnection(conn)))
                    finally:
                        if not conn.broken:
                            await conn.rollback()  # read-only: nothing to keep
            except BaseException as exc:
                again = self._again(exc, conn, False, tries)
                if again is None:
                    raise
                pool.discard_idle()

    def write_sync(self, job: Callable[[PostgresBackend], T]) -> T:
        """`write` from a plain thread (retention, tools, tests), on a pool of its own."""
        pool = self._write_pool
        if pool is None:
            raise StorageUnavailable("the database is closed")
        tries = _Tries()
        while True:
            committing = False
            conn: psycopg.Connection[Any] | None = None
            try:
                with pool.connection() as conn:
                    backend = PostgresBackend(conn, writing=True)
                    try:
                        result = _unit(job, backend)
                        tail = backend.commit_script()
                        committing = True
                        started = time.perf_counter()
                        if tail is None:
                            conn.commit()
                        else:
                            conn.execute(tail, prepare=False)
                    except BaseException:
                        if not conn.broken and conn.info.transaction_status != IDLE:
                            conn.rollback()
                        raise
                    self.commit_durations.observe(time.perf_counter() - started)
                self._notifier.committed()
                return result
            except BaseException as exc:
                again = self._again(exc, conn, committing, tries)
                if again is None:
                    raise
                if again:
                    time.sleep(again)
                else:
                    self._check(pool)

    def read_sync(self, job: Callable[[PostgresBackend], T]) -> T:
        """`read` from a plain thread."""
        pool = self._read_pool
        if pool is None:
            raise StorageUnavailable("the database is closed")
        tries = _Tries()
        while True:
            conn: psycopg.Connection[Any] | None = None
            try:
                with pool.connection() as conn:
                    try:
                        return job(PostgresBackend(conn))
                    finally:
                        if not conn.broken:
                            conn.rollback()  # read-only: nothing to keep, the snapshot ends
            except BaseException as exc:
                again = self._again(exc, conn, False, tries)
                if again is None:
                    raise
                self._check(pool)

    def _again(
        self, exc: BaseException, conn: Any, committing: bool, tries: _Tries
    ) -> float | None:
        """After a unit of work failed with `exc`: the seconds to wait before it runs again on
        a fresh transaction (after a lost race; 0.0: at once, on a connection that works,
        after its connection died before COMMIT), None to raise `exc` as it is; or raise
        what its caller hears instead."""
        if _retryable_race(exc) and tries.races < RACE_RETRIES:
            tries.races += 1
            self.retries += 1
            return self._backoff(tries.races)
        lost = connection_lost(exc, conn)
        if (
            lost
            and not committing
            and tries.lost < CONNECTION_RETRIES
            and not isinstance(exc, psycopg_pool.PoolTimeout)  # waited long enough
        ):
            # Nothing was committed: the next try runs on a connection that works.
            tries.lost += 1
            self.retries += 1
            return 0.0
        if lost and committing:
            raise StorageUnavailable(
                "PostgreSQL went away during COMMIT: the write may or may not have "
                "been kept (retry it with its Idempotency-Key)"
            ) from None
        translated = storage_error(exc, conn)
        if translated is exc:
            return None
        raise translated from None

    def _backoff(self, attempt: int) -> float:
        with self._lock:
            jitter: float = self._rand.random()
        ceiling: float = min(RETRY_MAX_S, RETRY_BASE_S * 2.0 ** (attempt - 1))
        return ceiling * (0.5 + jitter)

    @staticmethod
    def _check(pool: psycopg_pool.ConnectionPool[Any]) -> None:
        """Drop the pool's idle connections that no longer work (after PostgreSQL restarted,
        every one of them)."""
        try:
            pool.check()
        except Exception as exc:  # the pool is closing; the next getconn says so
            log.debug("pool check failed: %s", exc)

    def _open(self, pool: LoopPool) -> LoopPool:
        if pool.closed or self._write_pool is None:
            raise StorageUnavailable("the database is closed")
        return pool


class _Tries:
    """How many times a unit of work ran again, by cause."""

    __slots__ = ("lost", "races")

    def __init__(self) -> None:
        self.races = 0
        self.lost = 0


def _unit(job: Callable[[PostgresBackend], T], backend: PostgresBackend) -> T:
    """A unit of work that writes, with its wake-ups last: sent with its COMMIT
    (PostgresBackend.commit_script), which delivers them, and not at all after a rollback."""
    result = job(backend)
    backend.send_notifications()
    return result
