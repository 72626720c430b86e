"""Claims are exclusive, whoever claims at once: threads, processes, several databases open
on one target (several servers); transitions are guarded; fences order the holders."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable

import msgspec
import pytest

from nulltickets.domain.clock import FixedClock
from nulltickets.domain.commands import (
    AppendEvent,
    Claim,
    CreateTask,
    FailRun,
    Heartbeat,
    MoveTask,
    WriteCheckpoint,
)
from nulltickets.domain.ids import new_id
from nulltickets.domain.model import ClaimResult
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.errors import (
    LeaseNotFound,
    LeaseSuperseded,
    RunNotRunning,
    StorageBusy,
    TaskVersionMismatch,
)
from nulltickets.service import Service, Tracker
from nulltickets.storage.ports import Database
from tests.contract.conftest import make_pipeline, run, value
from tests.contract.workers import claim_until_empty


def tasks(service: Service, pipeline_id: str, n: int) -> list[str]:
    cmds = [CreateTask(pipeline_id, f"t{i}", "") for i in range(n)]
    return value(run(service.create_tasks(cmds)))


def claim(service: Service, agent: str = "a", ttl: int | None = None) -> ClaimResult:
    result = value(run(service.claim(Claim(agent, "coder", lease_ttl_ms=ttl))))
    assert result is not None
    return result


def test_threads_on_several_databases_never_claim_a_task_twice(
    service: Service, opened: Callable[[], Database]
) -> None:
    """Eight agents on four databases open on one target (four servers), claiming at once."""
    pipeline_id = make_pipeline(service)
    ids = tasks(service, pipeline_id, 120)
    servers = [(db, Tracker(db.notifier)) for db in (opened() for _ in range(4))]
    start = threading.Barrier(8)
    claimed: list[str] = []
    lock = threading.Lock()

    def agent(n: int) -> None:
        database, tracker = servers[n % len(servers)]
        from nulltickets.domain.clock import wall_ms

        start.wait()
        while True:
            try:
                result = database.write_sync(
                    lambda b: tracker.claim(b, Claim(f"a{n}", "coder"), wall_ms())
                )
            except StorageBusy:
                continue
            if result is None:
                return
            with lock:
                claimed.append(result.task.id)

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert Counter(claimed) == Counter(ids)  # every task once, none twice


@pytest.mark.timeout(180)
def test_processes_never_claim_a_task_twice(service: Service, database_url: str) -> None:
    pipeline_id = make_pipeline(service)
    ids = tasks(service, pipeline_id, 90)
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(3)
    out = context.Queue()
    procs = [
        context.Process(target=claim_until_empty, args=(database_url, f"p{n}", start, out))
        for n in range(3)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=150) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    claimed = [task_id for _agent, got in results for task_id in got]
    assert Counter(claimed) == Counter(ids)


def test_the_data_refuses_a_second_running_run_of_a_task(
    service: Service, database: Database, clock: FixedClock
) -> None:
    """Whatever chooses the task, the database itself keeps one running run per task."""
    pipeline_id = make_pipeline(service)
    [task_id] = tasks(service, pipeline_id, 1)
    result = claim(service)
    assert result.task.id == task_id

    def second_run(b):  # type: ignore[no-untyped-def]
        b.insert_run(new_id(), task_id, "intruder", "coder", clock(), new_id())

    with pytest.raises(StorageBusy):
        database.write_sync(second_run)
    runs = run(service.get_task(task_id)).latest_run
    assert runs is not msgspec.UNSET and runs.id == result.run.id and runs.attempt == 1


def test_a_run_ends_once_and_a_stale_version_moves_nothing(
    service: Service, database: Database, clock: FixedClock
) -> None:
    pipeline_id = make_pipeline(service)
    [task_id] = tasks(service, pipeline_id, 1)
    result = claim(service)
    token = lease_token_hash(result.lease_token)
    with pytest.raises(TaskVersionMismatch):
        run(
            service.transition(
                result.run.id, token, lambda: MoveTask("submit", expected_task_version=7)
            )
        )
    moved = value(run(service.transition(result.run.id, token, lambda: MoveTask("submit"))))
    assert (moved.previous_stage, moved.new_stage) == ("todo", "review")
    # The same lease again: the run is over.
    with pytest.raises(LeaseNotFound):
        run(service.transition(result.run.id, token, lambda: MoveTask("submit")))
    # The guards are in the statements themselves.
    now = clock()
    assert not database.write_sync(lambda b: b.end_run(result.run.id, "failed", "{}", None, now))
    assert not database.write_sync(lambda b: b.move_task(task_id, "done", 1, now))
    details = run(service.get_task(task_id))
    assert (details.stage, details.task_version) == ("review", 2)


def test_a_run_that_ended_under_its_lease_cannot_fail_or_count_again(
    service: Service, database: Database
) -> None:
    """fail checks that its end of the run changed the run (a cancel or a reaper may have
    ended it in between): RunNotRunning, and no failure counted."""
    pipeline_id = make_pipeline(service)
    [task_id] = tasks(service, pipeline_id, 1)
    result = claim(service)
    lease = database.read_sync(lambda b: b.lease_by_run(result.run.id))
    assert lease is not None
    database.write_sync(lambda b: b.end_run(result.run.id, "cancelled", "{}", "x", 1))
    with pytest.raises(RunNotRunning):
        database.write_sync(lambda b: service.tracker.fail(b, lease, FailRun("boom"), 2))
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 0


def test_fences_rise_with_each_claim_and_refuse_the_previous_holder(
    service: Service, clock: FixedClock
) -> None:
    pipeline_id = make_pipeline(service)
    [task_id] = tasks(service, pipeline_id, 1)
    first = claim(service, "first", ttl=1000)
    assert first.fence == 1
    first_token = lease_token_hash(first.lease_token)
    checkpoint = WriteCheckpoint(msgspec.Raw(b'{"step":1}'))
    value(run(service.checkpoint(first.run.id, first_token, lambda: checkpoint)))
    clock.advance(1001)
    second = claim(service, "second")
    assert (second.task.id, second.fence) == (task_id, 2)
    assert bytes(second.task.checkpoint) == b'{"step":1}'
    with pytest.raises(LeaseSuperseded):
        run(service.heartbeat(first.lease_id, first_token, lambda: Heartbeat(expected_fence=1)))
    with pytest.raises(LeaseSuperseded):
        run(
            service.append_event(
                first.run.id, first_token, lambda: AppendEvent("late", expected_fence=1)
            )
        )
    second_token = lease_token_hash(second.lease_token)
    event = AppendEvent("progress", expected_fence=2)
    assert value(run(service.append_event(second.run.id, second_token, lambda: event))) > 0
