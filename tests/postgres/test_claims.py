"""Claims on PostgreSQL: claim_candidate with FOR UPDATE SKIP LOCKED, run by real threads on
their own connections, never hands one task to two claimers. How a claim chooses, on every
backend, is tests/storage/test_leases_and_runs.py."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from nulltickets.domain.ids import new_id
from nulltickets.storage.backend import NewPipeline
from nulltickets.storage.postgres.backend import LostRace, PostgresBackend
from tests.conftest import unique
from tests.postgres.sql import all_rows, make_pipeline, make_task, one, run

Conn = psycopg.Connection[Any]
NOW = 10_000


def claim(
    conn: Conn, role: str, agent: str, now: int = NOW, **limits: str | None
) -> tuple[str | None, bool]:
    """One claim as the service makes it: (task id or None, whether a race was lost)."""
    with conn.transaction():
        task = one(
            conn,
            "claim_candidate",
            agent_role=role,
            agent_id=agent,
            full_stages=limits.get("full_stages"),
            full_pairs=limits.get("full_pairs"),
            now=now,
        )
        if task is None:
            return None, False
        task_id = task[0]
        run_id, lease_id = new_id(), new_id()
        attempt = one(
            conn,
            "insert_run",
            id=run_id,
            task_id=task_id,
            agent_id=agent,
            agent_role=role,
            now=now,
            lease_id=lease_id,
        )
        if attempt is None:  # another claim of this task committed first
            return None, True
        fence, _checkpoint = one(conn, "bump_fence", id=task_id)
        run(
            conn,
            "insert_lease",
            id=lease_id,
            run_id=run_id,
            agent_id=agent,
            token_hash=b"hash",
            expires_at_ms=now + 60_000,
            ttl_ms=60_000,
            fence=fence,
            now=now,
        )
        return task_id, False


def claim_all(
    dsn: str,
    role: str,
    claimers: int,
    claim_once: Callable[[Conn, str, str], tuple[str | None, bool]] | None = None,
) -> tuple[list[str], int]:
    """`claimers` threads, each on its own connection, released together by a barrier, claim
    until nothing is left: (every task id claimed, in any order; races lost)."""
    claimed: list[str] = []
    lost: list[int] = []
    failures: list[BaseException] = []
    barrier = threading.Barrier(claimers)

    def claimer(n: int) -> None:
        try:
            with psycopg.connect(dsn) as conn:
                barrier.wait(timeout=30)
                while True:
                    task_id, race = (claim_once or claim)(conn, role, f"agent-{n}")
                    if race:
                        lost.append(n)
                    elif task_id is None:
                        return
                    else:
                        claimed.append(task_id)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert failures == []
    assert not any(t.is_alive() for t in threads)
    return claimed, len(lost)


def test_concurrent_claimers_never_get_the_same_task(pg_shared_dsn: str, pg_conn: Conn) -> None:
    for _round in range(6):
        role = unique("coder")
        pipeline_id = make_pipeline(pg_conn, role)
        created = {make_task(pg_conn, pipeline_id, priority=i % 3) for i in range(40)}
        pg_conn.commit()
        claimed, _lost = claim_all(pg_shared_dsn, role, claimers=4)
        twice = [task for task, count in Counter(claimed).items() if count > 1]
        assert twice == []
        assert set(claimed) == created
        fences = pg_conn.execute(
            "SELECT DISTINCT fence FROM tasks WHERE pipeline_id = %s", (pipeline_id,)
        ).fetchall()
        assert fences == [(1,)]  # one claim (one fence bump) per task


def whole_claim(conn: Conn, role: str, agent: str) -> tuple[str | None, bool]:
    """One claim as PostgresBackend.claim makes it, the one statement claim_task: (task id
    or None, whether a race was lost), on the connection in autocommit mode as a writer's is."""
    conn.autocommit = True
    backend = PostgresBackend(conn, writing=True)
    try:
        got = backend.claim(
            agent_role=role,
            agent_id=agent,
            run_id=new_id(),
            lease_id=new_id(),
            token_hash=b"hash",
            ttl_ms=60_000,
            stage_ttls=(),
            default_ttl_ms=60_000,
            full_stages=(),
            capped=(),
            known_pipelines=None,
            now=NOW,
        )
    except LostRace:
        return None, True
    assert not isinstance(got, NewPipeline)
    return (got.task.id if got is not None else None), False


@pytest.mark.parametrize("how", ["step by step", "one statement"])
def test_claimers_at_once_lose_no_race(pg_shared_dsn: str, pg_conn: Conn, how: str) -> None:
    """A claim passes over a task another claim took and committed after the claim's
    snapshot was taken (claim_candidate's fence condition). Without it, the task's row lock
    and recheck let it through, and the run's insert lost to runs_one_running_per_task: with
    six claimers at once, about one claim in five, each a statement spent for nothing."""
    claim_once = whole_claim if how == "one statement" else claim
    for _round in range(6):
        role = unique("coder")
        pipeline_id = make_pipeline(pg_conn, role)
        created = {make_task(pg_conn, pipeline_id, priority=i % 3) for i in range(60)}
        pg_conn.commit()
        claimed, lost = claim_all(pg_shared_dsn, role, claimers=6, claim_once=claim_once)
        assert sorted(claimed) == sorted(created)
        assert lost == 0


def test_a_claim_rewrites_its_task_on_the_same_page(pg_dsn: str) -> None:
    """A claim raises the task's fence, which no index holds. tasks keeps room on each page
    (migration 0006), so the task's new version goes on the page of the old one, as a HOT update
    that adds no index entry for later claims to step over. A page of tasks filled to the brim
    by inserts would have no room left, and the new version would go to another page."""
    with psycopg.connect(pg_dsn) as conn:
        role = unique("coder")
        pipeline_id = make_pipeline(conn, role)
        first = make_task(conn, pipeline_id, priority=10)
        for _ in range(300):
            make_task(conn, pipeline_id)
        conn.commit()

        def page(task_id: str | None) -> int:
            row = conn.execute(
                "SELECT (ctid::text::point)[0]::int FROM tasks WHERE id = %s", (task_id,)
            ).fetchone()
            assert row is not None
            return int(row[0])

        before = page(first)
        neighbours = conn.execute(
            "SELECT count(*) FROM tasks WHERE (ctid::text::point)[0]::int = %s", (before,)
        ).fetchone()
        assert neighbours is not None and neighbours[0] > 10  # a page full of new tasks

        assert claim(conn, role, "agent-1") == (first, False)
        assert page(first) == before


def test_concurrent_reapers_share_the_expired_leases(pg_shared_dsn: str, pg_conn: Conn) -> None:
    """Each expired lease goes to one reaper: the others skip the rows it holds."""
    # This test's clock runs long before every other test's on the shared database, so its
    # leases are the only ones expired at its `later`.
    epoch = -(10**12)
    role = unique("coder")
    pipeline_id = make_pipeline(pg_conn, role)
    for _ in range(6):
        task_id = make_task(pg_conn, pipeline_id)
        run(pg_conn, "schedule_retry", id=task_id, next_eligible_at_ms=epoch, now=epoch, error=None)
    while claim(pg_conn, role, "a", now=epoch)[0] is not None:
        pass
    pg_conn.commit()
    later = epoch + 120_000
    with psycopg.connect(pg_shared_dsn) as a, psycopg.connect(pg_shared_dsn) as b:
        first = {r[0] for r in all_rows(a, "expired_leases", now=later, limit=4)}
        second = {r[0] for r in all_rows(b, "expired_leases", now=later, limit=100)}
        assert len(first) == 4
        assert len(second) == 2
        assert not first & second
        a.rollback()  # a reaper that gave up: its leases are there for the next one
        assert len(all_rows(b, "expired_leases", now=later, limit=100)) == 6
        assert all_rows(b, "expired_leases", now=epoch + 59_999, limit=100) == []  # not yet
