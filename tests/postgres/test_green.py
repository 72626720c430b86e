"""Units of work from the event loop (every request's) on PostgreSQL: asyncio connections, the
unit's statements awaited on the loop by postgres.green, in the loop's own thread."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import greenlet
import psycopg
import pytest

from nulltickets.domain.clock import wall_ms
from nulltickets.domain.commands import Claim, CreatePipeline
from nulltickets.errors import DuplicateName, StorageUnavailable
from nulltickets.service import Tracker
from nulltickets.storage.postgres import PostgresDatabase, green
from nulltickets.storage.postgres.backend import PostgresBackend
from tests.conftest import unique
from tests.pgserver import PostgresServer
from tests.postgres.test_database import pipeline, seed


def opened(dsn: str) -> Iterator[PostgresDatabase]:
    """A PostgresDatabase on `dsn`, open for the test, closed after it."""
    database = PostgresDatabase(dsn)
    database.open()
    yield database
    database.close()


@pytest.fixture
def db(pg_shared_dsn: str) -> Iterator[PostgresDatabase]:
    yield from opened(pg_shared_dsn)


def run(main: Callable[[], Any], db: PostgresDatabase) -> Any:
    """`main()` on a loop of its own, as a server's worker runs its requests (or a tool's
    `asyncio.run`): nothing of the database is left to that loop when it ends."""
    return asyncio.run(main())


def backend_pid(b: PostgresBackend) -> int:
    """The PostgreSQL backend of the unit of work's connection."""
    row = b.conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def test_units_run_in_the_loops_thread_and_wait_for_each_other_there(
    db: PostgresDatabase,
) -> None:
    """One unit of work takes a lock and holds it until another session waits for it; a second
    unit, started after it, is that session. Run one after the other (or with the loop blocked
    while the first waits) the first would wait for ever; on the loop both are in flight at
    once, and each ran in the loop's thread."""
    key = wall_ms() % 1_000_000
    threads: list[int] = []

    def holder(b: PostgresBackend) -> int:
        threads.append(threading.get_ident())
        b.begin()  # the lock is the transaction's: sent directly, no statement opens it
        b.conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
        for polls in range(1000):
            waiting = b.conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid::bigint = %s "
                "AND NOT granted",
                (key,),
            ).fetchone()
            if waiting[0]:
                return polls
            b.conn.execute("SELECT pg_sleep(0.01)")
        raise AssertionError("nobody waited for the lock: the second unit never ran")

    def waiter(b: PostgresBackend) -> str:
        threads.append(threading.get_ident())
        b.begin()
        b.conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
        return "got it"

    async def main() -> tuple[int, str]:
        first = asyncio.ensure_future(db.write(holder))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(db.write(waiter))
        return await first, await second

    polls, got = run(main, db)
    assert got == "got it" and polls >= 0
    assert threads == [threading.get_ident()] * 2


def test_an_error_of_a_statement_reaches_the_unit_and_the_caller_as_ours(
    db: PostgresDatabase,
) -> None:
    """A unique violation inside a unit of work surfaces as the contract's error; the unit's
    earlier writes are rolled back with it; the loop goes on serving the next one."""
    tracker = Tracker(db.notifier, shared=True)
    name = unique("pipe")
    made = pipeline(unique("coder"))
    first = CreatePipeline(name, made.definition)

    async def main() -> tuple[str, bool]:
        pid = await db.write(lambda b: tracker.create_pipeline(b, first, wall_ms()))
        other = unique("pipe")

        def twice(b: PostgresBackend) -> None:
            tracker.create_pipeline(b, CreatePipeline(other, made.definition), wall_ms())
            tracker.create_pipeline(b, first, wall_ms())  # the name is taken

        with pytest.raises(DuplicateName):
            await db.write(twice)
        kept = await db.read(lambda b: any(p.name == other for p in b.list_pipelines()))
        return pid, kept

    pid, kept = run(main, db)
    assert pid and not kept


def test_a_unit_sees_the_context_variables_of_its_request(db: PostgresDatabase) -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("who")

    async def one(who: str) -> str:
        var.set(who)
        return await db.read(lambda b: var.get())

    async def main() -> list[str]:
        return list(await asyncio.gather(one("a"), one("b"), one("c")))

    assert run(main, db) == ["a", "b", "c"]


def test_a_statement_outside_a_unit_of_the_loop_is_refused() -> None:
    """green.wait only works inside green.run: a coroutine is never dropped unawaited in
    silence."""

    async def nothing() -> None:
        return None

    coroutine = nothing()
    with pytest.raises(RuntimeError, match="outside"):
        green.wait(coroutine)
    coroutine.close()


def test_after_a_restart_the_loops_pool_runs_the_unit_again_on_a_fresh_connection(
    db: PostgresDatabase, postgres: PostgresServer, pg_shared_dsn: str
) -> None:
    """The loop's pool, like the threads' (test_database), replaces the connections PostgreSQL
    dropped, and the unit of work runs again instead of failing; the server counts it."""
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    seed(db, tracker, role, 2)
    retried = db.stats().figures["retries"]

    async def main() -> Any:
        name = await db.read(lambda b: b.conn.execute("SELECT current_database()").fetchone())
        # The loop's pool now holds an idle connection that writes: PostgreSQL ends it.
        held = await db.write(backend_pid)
        with postgres.admin() as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid() "
                "AND query NOT LIKE '%%LISTEN nulltickets_claimable%%'",
                (name[0],),
            )
        assert wait_gone(pg_shared_dsn, held)
        return await db.write(lambda b: tracker.claim(b, Claim("a", role), wall_ms()))

    assert run(main, db) is not None
    # Run again on a fresh connection, and counted where /metrics shows it
    # (nulltickets_storage_retries_total).
    assert db.stats().figures["retries"] > retried


def test_connections_made_on_one_loop_serve_the_next_and_close_with_the_database(
    pg_shared_dsn: str,
) -> None:
    """Each asyncio.run is a loop of its own; the connections one made serve the next (no
    task of the pool outlives its loop), and closing the database closes them all."""
    database = PostgresDatabase(pg_shared_dsn)
    database.open()
    first = run(lambda: database.write(backend_pid), database)
    second = run(lambda: database.write(backend_pid), database)
    assert first == second
    database.close()
    with psycopg.connect(pg_shared_dsn) as conn:
        alive = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (first,))
        found = alive.fetchone()
        assert found is not None
    assert found[0] == 0 or wait_gone(pg_shared_dsn, first)


def wait_gone(dsn: str, pid: int) -> bool:
    from tests.conftest import wait_for

    def gone() -> bool:
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
            found = row.fetchone()
            return found is not None and found[0] == 0

    wait_for("the closed connection's backend to end", gone)
    return True


def test_a_closed_database_is_unavailable_to_the_loop(pg_shared_dsn: str) -> None:
    database = PostgresDatabase(pg_shared_dsn)
    database.open()

    async def main() -> None:
        assert await database.read(lambda b: 1) == 1
        database.close()
        with pytest.raises(StorageUnavailable):
            await database.read(lambda b: 1)

    run(main, database)


def test_a_unit_is_kept_for_the_next_one_whatever_the_last_one_did() -> None:
    """The greenlet that ran a unit runs the next one (a finished greenlet would give its stack
    of frames back for a new one to map again), after a result, after an error that reached the
    caller as raised, and after a cancellation; each unit sees its own context variables."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("who")
    seen: list[tuple[Any, str]] = []

    def job(value: str) -> str:
        seen.append((greenlet.getcurrent(), var.get()))
        return green.wait(asyncio.sleep(0, value))

    def failing() -> None:
        seen.append((greenlet.getcurrent(), var.get()))
        raise DuplicateName("taken")

    def slow() -> None:
        seen.append((greenlet.getcurrent(), var.get()))
        green.wait(asyncio.sleep(30))

    async def one(who: str, *work: Any) -> Any:
        var.set(who)
        return await green.run(*work)

    async def main() -> list[Any]:
        results: list[Any] = [await one("a", job, "x")]
        with pytest.raises(DuplicateName, match="taken") as raised:
            await one("b", failing)
        assert any(frame.name == "failing" for frame in traceback.extract_tb(raised.tb))
        pending = asyncio.ensure_future(one("c", slow))
        await asyncio.sleep(0.01)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        results.append(await one("d", job, "y"))
        return results

    assert asyncio.run(main()) == ["x", "y"]
    assert [who for _, who in seen] == ["a", "b", "c", "d"]
    assert len({id(unit) for unit, _ in seen}) == 1


def test_units_in_flight_at_once_each_have_their_own_greenlet() -> None:
    """Kept units are handed out one to a unit: two in flight never share one."""
    units: list[Any] = []

    def job() -> None:
        units.append(greenlet.getcurrent())
        green.wait(asyncio.sleep(0.01))
        units.append(greenlet.getcurrent())

    async def main() -> None:
        await green.run(job)  # one unit kept
        await asyncio.gather(*(green.run(job) for _ in range(3)))

    asyncio.run(main())
    assert len({id(u) for u in units[2:]}) == 3
    assert units[0] in units[2:]


def test_a_kept_unit_holds_on_to_nothing_of_the_unit_before() -> None:
    """Neither the context of the request a kept unit ran last nor its job's result stay
    alive through it."""

    class Payload:
        pass

    var: contextvars.ContextVar[Payload] = contextvars.ContextVar("payload")
    refs: list[weakref.ref[Payload]] = []

    def job() -> Payload:
        green.wait(asyncio.sleep(0))
        result = Payload()
        refs.append(weakref.ref(result))
        return result

    async def main() -> None:
        payload = Payload()
        refs.append(weakref.ref(payload))
        var.set(payload)
        del payload
        assert isinstance(await green.run(job), Payload)

    asyncio.run(main())
    gc.collect()
    assert len(refs) == 2 and [ref() for ref in refs] == [None, None]


def test_the_verbs_every_agent_sends_are_prepared_on_their_first_use(
    db: PostgresDatabase,
) -> None:
    """A statement of ALONE (a claim, a transition, an event...) is prepared on the connection
    the first time it runs there as its unit of work, not the sixth: until then PostgreSQL
    parses and plans each run of it again, which for the claim costs milliseconds of its CPU
    per run, and a server that has just started (or reconnected) pays that on every one of its
    connections."""
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    seed(db, tracker, role, 3)

    def claim(b: PostgresBackend) -> None:
        assert tracker.claim(b, Claim(unique("agent"), role), wall_ms()) is not None

    def prepared(b: PostgresBackend) -> tuple[int, int]:
        """This connection's backend, and its prepared statements that are claim_task."""
        row = b.conn.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'WITH candidate AS%%'"
        ).fetchone()
        assert row is not None
        return backend_pid(b), int(row[0])

    async def main() -> list[tuple[int, int]]:
        # One loop, one unit at a time: every unit runs on the same connection of its pool.
        # The first claim reads the role's stages for the tracker, in a transaction: from the
        # second on, a claim is claim_task alone.
        seen = [await db.write(prepared)]
        await db.write(claim)
        seen.append(await db.write(prepared))
        await db.write(claim)
        seen.append(await db.write(prepared))
        return seen

    seen = run(main, db)
    assert len({pid for pid, _ in seen}) == 1, seen
    # Not before its first run alone; once after it, and still once after the next.
    counts = [n for _, n in seen]
    assert counts[0] == 0 and counts[-1] == 1, seen
