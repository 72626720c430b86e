"""Exclusivity and uniqueness under concurrency, whoever writes at once: threads, processes,
several databases open on one target (several servers). A write that lost a race may raise
StorageBusy, and is then simply tried again, as the service's callers do."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from nulltickets.errors import DuplicateName, StorageBusy
from nulltickets.storage.backend import Backend, NewTask
from nulltickets.storage.ports import Database
from tests.storage.conftest import Target
from tests.storage.ops import NOW, claim, claimed, covers, make_pipeline, make_task
from tests.storage.workers import claim_until_empty

T = TypeVar("T")


def retried(database: Database, job: Callable[[Backend], T]) -> T:
    while True:
        try:
            return database.write_sync(job)
        except StorageBusy:
            continue


def at_once(n: int, act: Callable[[int], Any]) -> list[Any]:
    """`act(i)` on `n` threads released together; their results (in no particular order)."""
    start = threading.Barrier(n)
    results: list[Any] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        start.wait()
        try:
            result = act(i)
        except BaseException as exc:
            failures.append(exc)
            return
        with lock:
            results.append(result)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    return results


@covers("Backend.claim_candidate", "Backend.insert_run", "Backend.bump_fence")
def test_threads_on_several_databases_never_claim_a_task_twice(
    database: Database, opened: Callable[[], Database]
) -> None:
    """Eight agents on four databases open on one target (four servers), claiming at once
    until nothing is left: every task once, none twice, one fence bump each."""
    ids = database.write_sync(lambda b: [make_task(b, make_pipeline(b)) for _ in range(120)])
    servers = [opened() for _ in range(4)]

    def agent(n: int) -> list[str]:
        mine: list[str] = []
        while (got := retried(servers[n % 4], lambda b: claim(b, agent=f"a{n}"))) is not None:
            mine.append(got.task.id)
        return mine

    claimed_ids = [task for mine in at_once(8, agent) for task in mine]
    assert Counter(claimed_ids) == Counter(ids)
    fences = database.read_sync(lambda b: {b.task_resume(t)[1] for t in ids})  # type: ignore[index]
    assert fences == {1}


@pytest.mark.timeout(180)
@covers("Backend.claim_candidate", "Backend.insert_run")
def test_processes_never_claim_a_task_twice(database: Database, target: Target) -> None:
    ids = database.write_sync(lambda b: [make_task(b, make_pipeline(b)) for _ in range(90)])
    url, durability = target
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(3)
    out = context.Queue()
    procs = [
        context.Process(target=claim_until_empty, args=(url, durability, f"p{n}", start, out))
        for n in range(3)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=150) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    claimed_ids = [task_id for _agent, got in results for task_id in got]
    assert Counter(claimed_ids) == Counter(ids)


@covers("Backend.end_run", "Backend.expired_leases", "Backend.delete_lease")
def test_concurrent_reapers_end_an_expired_run_once(
    database: Database, opened: Callable[[], Database]
) -> None:
    """Four servers' janitors end the same expired run at once: one of them ends it, the
    others find nothing (or nothing left) to end."""
    database.write_sync(lambda b: make_task(b, make_pipeline(b)))
    got = database.write_sync(lambda b: claimed(b, ttl=1_000))
    servers = [opened() for _ in range(4)]

    def reap(n: int) -> int:
        def job(b: Backend) -> int:
            ended = 0
            for lease_id, run_id, _task_id in b.expired_leases(NOW + 1_000, 10):
                b.delete_lease(lease_id)
                ended += b.end_run(run_id, "stale", "{}", "lease_expired", NOW + 1_000)
            return ended

        return retried(servers[n], job)

    assert sorted(at_once(4, reap)) == [0, 0, 0, 1]
    assert database.read_sync(lambda b: b.run_status(got.run_id)) == "stale"
    assert database.read_sync(lambda b: b.failed_attempts(got.task.id)) == 1


@covers("Backend.insert_pipeline")
def test_a_pipeline_name_created_at_once_on_two_databases_exists_once(
    opened: Callable[[], Database],
) -> None:
    """Moved from tests/postgres/test_database.py, on every backend."""
    servers = [opened(), opened()]

    def create(n: int) -> str:
        try:
            retried(servers[n % 2], lambda b: make_pipeline(b, name="same"))
        except DuplicateName:
            return "duplicate_name"
        return "created"

    assert sorted(at_once(8, create)) == ["created"] + ["duplicate_name"] * 7
    assert len(servers[0].read_sync(lambda b: b.list_pipelines())) == 1


@covers("Backend.insert_task", "Backend.task_by_idempotency_key")
def test_concurrent_creates_under_one_task_key_make_one_task(
    database: Database, opened: Callable[[], Database]
) -> None:
    """A task's idempotency key is unique per pipeline in the data: creates naming it at once
    on four servers insert one task, and the others find it."""
    pipeline_id = database.write_sync(lambda b: make_pipeline(b))
    servers = [opened() for _ in range(4)]

    def create(n: int) -> str:
        def job(b: Backend) -> str:
            task_id = f"task-{n}"
            task = NewTask(task_id, pipeline_id, "todo", f"from {n}", NOW, idempotency_key="plan-1")
            inserted = b.insert_task(task)
            found = task_id if inserted else b.task_by_idempotency_key(pipeline_id, "plan-1")
            assert found is not None
            return found

        return retried(servers[n], job)

    ids = at_once(4, create)
    assert len(ids) == 4 and len(set(ids)) == 1
    listed = database.read_sync(
        lambda b: b.list_tasks(stage=None, pipeline_id=pipeline_id, after=None, limit=10)
    )
    assert [t.id for t in listed] == ids[:1]


@covers("Backend.get_idempotency", "Backend.put_idempotency")
def test_concurrent_requests_under_one_idempotency_key_record_one_answer(
    database: Database, opened: Callable[[], Database]
) -> None:
    """Each request's unit of work reads the key first and records its answer if there is
    none: on every backend, requests under one key run one after the other, so one records
    and the others replay what it recorded."""
    servers = [opened() for _ in range(4)]

    def request(n: int) -> tuple[str, bytes]:
        def job(b: Backend) -> tuple[str, bytes]:
            found = b.get_idempotency("same-key", "POST", "/tasks")
            if found is not None:
                return "replayed", found[0]
            b.put_value("work", f"done-{n}", "1", NOW)  # the request's own work
            b.put_idempotency(
                key="same-key",
                method="POST",
                path="/tasks",
                request_hash=bytes([n]) * 32,
                auth_hash=None,
                status=201,
                body="{}",
                now=NOW,
            )
            return "recorded", bytes([n]) * 32

        return retried(servers[n], job)

    answers = at_once(4, request)
    assert sorted(kind for kind, _ in answers) == ["recorded"] + ["replayed"] * 3
    assert len({request_hash for _, request_hash in answers}) == 1
    assert len(database.read_sync(lambda b: b.list_namespace("work"))) == 1  # the work once
