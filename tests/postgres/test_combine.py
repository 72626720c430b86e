"""The one-statement writes one turn of a server's loop sends, committed together on PostgreSQL
(postgres.combine): each request still gets its own result, its own error, and nothing of it is
kept twice or lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from nulltickets.domain.clock import wall_ms
from nulltickets.domain.commands import Claim, CreateTask
from nulltickets.errors import InvalidRequest
from nulltickets.service import Tracker
from nulltickets.storage.postgres import PostgresDatabase
from nulltickets.storage.postgres.backend import PostgresBackend
from nulltickets.storage.postgres.combine import FEWEST
from tests.conftest import unique
from tests.pgserver import PostgresServer
from tests.postgres.test_database import seed
from tests.postgres.test_green import backend_pid, opened, wait_gone

WIDTH = 6  # requests in flight at once, each on a connection of its own (the pool holds 8)


@pytest.fixture
def db(pg_dsn: str) -> Iterator[PostgresDatabase]:
    # A database of its own: a lease another test left to expire in a shared one would have a
    # claim end it first, in a transaction, and the claim would not be one statement alone.
    yield from opened(pg_dsn)


def adding(tracker: Tracker, pipeline_id: str, title: str) -> Callable[[PostgresBackend], Any]:
    """A unit of work that is POST /tasks of a task titled `title`: create_task alone."""
    return lambda b: tracker.add_task(b, CreateTask(pipeline_id, title, ""), wall_ms(), whole=True)


def combined(db: PostgresDatabase) -> tuple[float, float]:
    """The commits that carried several requests' writes, and those writes (/metrics)."""
    figures = db.stats().figures
    return figures["combined_commits"], figures["combined_units"]


async def warm(db: PostgresDatabase) -> list[int]:
    """WIDTH idle connections in the loop's pool (their backends' pids): the next WIDTH units
    started at once each take one at once, and reach their first statement in the same turn."""

    async def hold() -> int:
        # Each holds its connection while the others make theirs.
        return await db.write(
            lambda b: (b.conn.execute("SELECT pg_sleep(0.05)"), backend_pid(b))[1]
        )

    return list(await asyncio.gather(*(hold() for _ in range(WIDTH))))


def pipeline_of(db: PostgresDatabase, task_id: str) -> str:
    row = db.read_sync(
        lambda b: b.conn.execute(
            "SELECT pipeline_id FROM tasks WHERE id = %s", (task_id,)
        ).fetchone()
    )
    assert row is not None
    return str(row[0])


def at_once(db: PostgresDatabase, jobs: list[Callable[[PostgresBackend], Any]]) -> list[Any]:
    """Each job a unit of work, all started in the same turn of one loop; each one's result, or
    the error it raised."""

    async def main() -> list[Any]:
        await warm(db)
        return list(await asyncio.gather(*(db.write(job) for job in jobs), return_exceptions=True))

    return asyncio.run(main())


def test_claims_sent_in_one_turn_share_one_commit_and_each_gets_its_own_task(
    db: PostgresDatabase,
) -> None:
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    tasks = seed(db, tracker, role, WIDTH + 2)
    # The tracker reads the role's stages once, in a transaction: from then on a claim is
    # claim_task alone.
    asyncio.run(db.write(lambda b: tracker.claim(b, Claim(unique("agent"), role), wall_ms())))
    before = combined(db)

    def claim(agent: str) -> Callable[[PostgresBackend], Any]:
        return lambda b: tracker.claim(b, Claim(agent, role), wall_ms())

    agents = [unique("agent") for _ in range(WIDTH)]
    claims = at_once(db, [claim(agent) for agent in agents])

    after = combined(db)
    assert after[0] - before[0] == 1 and after[1] - before[1] == WIDTH, (before, after)
    assert not [c for c in claims if isinstance(c, BaseException)], claims
    assert [c.run.agent_id for c in claims] == agents
    claimed = [c.task.id for c in claims]
    assert len(set(claimed)) == WIDTH and set(claimed) <= set(tasks)
    # Each claimed task has the one running run of its claim, and no other.
    running = db.read_sync(
        lambda b: b.conn.execute(
            "SELECT task_id, agent_id FROM runs WHERE status = 'running' AND task_id = ANY(%s)",
            (claimed,),
        ).fetchall()
    )
    assert sorted(running) == sorted(zip(claimed, agents, strict=True))


def test_a_turn_of_fewer_writes_than_a_batch_takes_sends_each_on_its_own(
    db: PostgresDatabase,
) -> None:
    """Fewer than FEWEST writes in a turn cost the server more as a batch than they save
    PostgreSQL: each is sent on its own, at once, and each is kept."""
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    pid = pipeline_of(db, seed(db, tracker, role, 1)[0])
    titles = [unique("task") for _ in range(FEWEST - 1)]
    before = combined(db)
    added = at_once(db, [adding(tracker, pid, title) for title in titles])
    assert all(isinstance(a, str) for a in added), added
    assert combined(db) == before


def test_a_write_that_fails_in_a_batch_fails_alone_and_the_others_are_kept_once(
    db: PostgresDatabase,
) -> None:
    """One statement of the batch fails: the batch's transaction keeps nothing, and each write
    runs again on its own. The one that failed fails by itself with its own error; the others
    before and after it in the batch are each kept exactly once."""
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    pid = pipeline_of(db, seed(db, tracker, role, 1)[0])
    titles = [unique("task") for _ in range(WIDTH)]
    titles[2] = "no NUL\x00 in PostgreSQL's text"

    before = combined(db)
    broken_up = db.stats().figures["combined_failures"]
    added = at_once(db, [adding(tracker, pid, title) for title in titles])

    assert combined(db) == before  # nothing was committed together
    assert db.stats().figures["combined_failures"] == broken_up + 1  # a batch was tried
    assert isinstance(added[2], InvalidRequest), added
    kept = [title for title, a in zip(titles, added, strict=True) if isinstance(a, str)]
    assert kept == titles[:2] + titles[3:], added
    stored = db.read_sync(
        lambda b: b.conn.execute(
            "SELECT title, count(*) FROM tasks WHERE pipeline_id = %s GROUP BY title", (pid,)
        ).fetchall()
    )
    assert {title: n for title, n in stored if title in kept} == dict.fromkeys(kept, 1)

    # The connections still work, statements prepared in the failed batch included.
    again = [unique("task") for _ in range(WIDTH)]
    before = combined(db)
    assert all(
        isinstance(a, str) for a in at_once(db, [adding(tracker, pid, title) for title in again])
    )
    assert combined(db)[1] - before[1] == WIDTH


def test_when_the_connection_of_a_batch_is_lost_every_write_runs_again_and_is_kept_once(
    db: PostgresDatabase, postgres: PostgresServer
) -> None:
    """PostgreSQL ends every connection of the loop's pool; the writes of the next turn are sent
    as one batch on one of them. Each request hears that the connection was lost, as it would
    have on its own connection, and its unit of work runs again on a fresh one."""
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    pid = pipeline_of(db, seed(db, tracker, role, 1)[0])
    titles = [unique("task") for _ in range(WIDTH)]
    retried = db.stats().figures["retries"]

    async def main() -> list[Any]:
        pids = await warm(db)
        with postgres.admin() as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS p(pid)", (pids,)
            )
        for gone in pids:
            assert wait_gone(db.url, gone)
        jobs = [adding(tracker, pid, title) for title in titles]
        return list(await asyncio.gather(*(db.write(job) for job in jobs), return_exceptions=True))

    added = asyncio.run(main())
    assert all(isinstance(a, str) for a in added), added
    assert db.stats().figures["retries"] >= retried + WIDTH
    stored = db.read_sync(
        lambda b: b.conn.execute(
            "SELECT title, count(*) FROM tasks WHERE pipeline_id = %s GROUP BY title", (pid,)
        ).fetchall()
    )
    assert {title: n for title, n in stored if title in titles} == dict.fromkeys(titles, 1)


def test_a_request_cancelled_while_its_batch_gathers_leaves_the_others_to_run_alone(
    db: PostgresDatabase,
) -> None:
    """The first request of a turn waits for the others to join its batch; cancelled then (the
    server stops), its write is not sent, and every request that joined it is sent on its own,
    none left waiting for a batch that will not come."""
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    pid = pipeline_of(db, seed(db, tracker, role, 1)[0])
    titles = [unique("task") for _ in range(WIDTH)]

    async def main() -> list[Any]:
        await warm(db)
        units = [asyncio.ensure_future(db.write(adding(tracker, pid, title))) for title in titles]
        await asyncio.sleep(0)  # each has sent its statement; the first waits for this turn's end
        units[0].cancel()
        return list(await asyncio.gather(*units, return_exceptions=True))

    before = combined(db)
    added = asyncio.run(asyncio.wait_for(main(), 30))
    assert isinstance(added[0], asyncio.CancelledError), added
    assert all(isinstance(a, str) for a in added[1:]), added
    assert combined(db) == before  # no batch was sent
    stored = db.read_sync(
        lambda b: b.conn.execute(
            "SELECT title FROM tasks WHERE pipeline_id = %s AND title = ANY(%s)", (pid, titles)
        ).fetchall()
    )
    assert sorted(title for (title,) in stored) == sorted(titles[1:])


def test_each_statement_of_a_batch_reads_back_as_its_own_cursor_would(
    db: PostgresDatabase,
) -> None:
    """A batch's results are read out of their cursors at once: each request's rows, row count
    and columns are still its own, a statement that returns rows or one that returns none."""

    def unit(i: int) -> Callable[[PostgresBackend], Any]:
        def read_back(b: PostgresBackend) -> Any:
            if i % 2:  # no rows at all: a command's result
                done = b.conn.execute_alone("UPDATE tasks SET title = title WHERE false", {})
            else:
                done = b.conn.execute_alone(
                    "SELECT %(i)s::int AS n, repeat('x', %(i)s) AS label"
                    " FROM generate_series(1, %(i)s)",
                    {"i": i},
                )
            columns = [c.name for c in done.description] if done.description else None
            return type(done).__name__, columns, done.rowcount, done.fetchall()

        return read_back

    before = combined(db)
    got = at_once(db, [unit(i) for i in range(WIDTH)])
    assert combined(db)[1] - before[1] == WIDTH, got  # one batch carried them all
    for i, (kind, columns, rowcount, rows) in enumerate(got):
        assert kind == "Result"
        if i % 2:
            assert (columns, rowcount, rows) == (None, 0, [])
        else:
            assert columns == ["n", "label"]
            assert rowcount == i
            assert rows == [(i, "x" * i)] * i
