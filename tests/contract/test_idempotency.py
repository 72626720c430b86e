"""Idempotent writes: a replay returns the recorded answer byte for byte, concurrent replays
of one key do the work once, and uniqueness the data guarantees holds under concurrency."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Callable

import msgspec
import pytest

from nulltickets.domain.commands import Claim, CreatePipeline, CreateTask
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.errors import (
    DuplicateDependency,
    DuplicateName,
    IdempotencyConflict,
    StorageBusy,
    Unauthorized,
)
from nulltickets.service import Idem, Outcome, Recorded, Service
from nulltickets.storage.ports import Database
from tests.contract.conftest import make_pipeline, record, run, value
from tests.server import PIPELINE


def idem(key: str, body: bytes, path: str = "/tasks", auth: bytes | None = None) -> Idem:
    return Idem(key, "POST", path, hashlib.sha256(body).digest(), auth, record)


def answer(result: Outcome[object] | Recorded) -> Recorded:
    return result if isinstance(result, Recorded) else record(result)


def test_a_replay_returns_the_recorded_answer_and_does_nothing_again(service: Service) -> None:
    pipeline_id = make_pipeline(service)
    cmd = CreateTask(pipeline_id, "once", "")
    first = run(service.create_task(cmd, idem("k1", b"body")))
    assert isinstance(first, Outcome)
    again = run(service.create_task(cmd, idem("k1", b"body")))
    assert again == record(first)  # the same status and the same bytes
    items, _ = run(service.list_tasks(stage=None, pipeline_id=pipeline_id, after=None, limit=10))
    assert [t.id for t in items] == [first.value]
    with pytest.raises(IdempotencyConflict):
        run(service.create_task(cmd, idem("k1", b"another body")))


def test_concurrent_replays_of_one_key_create_one_task(
    service: Service, opened: Callable[[], Database]
) -> None:
    """The same request, with the same key, sent to four servers at once."""
    pipeline_id = make_pipeline(service)
    services = [Service(opened(), clock=service.clock) for _ in range(4)]
    start = threading.Barrier(len(services))
    answers: list[Recorded] = []
    lock = threading.Lock()
    cmd = CreateTask(pipeline_id, "once", "")

    def send(s: Service) -> None:
        start.wait()
        while True:
            try:
                result = asyncio.run(s.create_task(cmd, idem("same-key", b"same body")))
            except StorageBusy:
                continue
            with lock:
                answers.append(answer(result))
            return

    threads = [threading.Thread(target=send, args=(s,)) for s in services]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(answers) == 4 and len(set(answers)) == 1
    items, _ = run(service.list_tasks(stage=None, pipeline_id=pipeline_id, after=None, limit=10))
    assert len(items) == 1
    assert answers[0].body == msgspec.json.encode(items[0].id)


def test_concurrent_creates_under_one_task_key_make_one_task(
    service: Service, opened: Callable[[], Database]
) -> None:
    """CreateTask.idempotency_key is unique per pipeline in the data: different requests
    (no Idempotency-Key) naming one task key all get the one task."""
    pipeline_id = make_pipeline(service)
    services = [Service(opened(), clock=service.clock) for _ in range(4)]
    start = threading.Barrier(len(services))
    ids: list[str] = []
    lock = threading.Lock()

    def send(s: Service, n: int) -> None:
        cmd = CreateTask(pipeline_id, f"from {n}", "", idempotency_key="plan-1")
        start.wait()
        while True:
            try:
                task_id = value(asyncio.run(s.create_task(cmd)))
            except StorageBusy:
                continue
            with lock:
                ids.append(task_id)
            return

    threads = [threading.Thread(target=send, args=(s, n)) for n, s in enumerate(services)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(ids) == 4 and len(set(ids)) == 1
    items, _ = run(service.list_tasks(stage=None, pipeline_id=pipeline_id, after=None, limit=10))
    assert [t.id for t in items] == ids[:1]


def test_a_replayed_claim_is_the_same_lease_under_a_fresh_token(service: Service) -> None:
    make_pipeline(service)
    pipeline_id = run(service.list_pipelines())[0].id
    value(run(service.create_task(CreateTask(pipeline_id, "t", ""))))
    key = idem("claim-1", b"claim", path="/leases/claim")
    first = run(service.claim(Claim("a", "coder"), key))
    assert isinstance(first, Outcome) and first.value is not None
    replay = run(service.claim(Claim("a", "coder"), key))
    assert isinstance(replay, Recorded) and replay.status == 200
    again = msgspec.json.decode(replay.body)
    assert again["lease_id"] == first.value.lease_id
    assert again["run"]["id"] == first.value.run.id
    assert again["lease_token"] not in ("", first.value.lease_token)
    # The fresh token is the live one; the first no longer is.
    assert run(service.check_run_lease(first.value.run.id, lease_token_hash(again["lease_token"])))
    with pytest.raises(Unauthorized):
        run(service.check_run_lease(first.value.run.id, lease_token_hash(first.value.lease_token)))


def test_a_replay_on_a_lease_route_needs_the_same_lease_token(service: Service) -> None:
    pipeline_id = make_pipeline(service)
    value(run(service.create_task(CreateTask(pipeline_id, "t", ""))))
    claimed = value(run(service.claim(Claim("a", "coder"))))
    assert claimed is not None
    token = lease_token_hash(claimed.lease_token)
    from nulltickets.domain.commands import AppendEvent

    path = f"/runs/{claimed.run.id}/events"
    first = run(
        service.append_event(
            claimed.run.id, token, lambda: AppendEvent("x"), idem("e1", b"x", path, token)
        )
    )
    assert isinstance(first, Outcome)
    with pytest.raises(Unauthorized):
        run(
            service.append_event(
                claimed.run.id, token, lambda: AppendEvent("x"), idem("e1", b"x", path, b"o" * 32)
            )
        )


def test_names_and_dependencies_are_unique_in_the_data(service: Service) -> None:
    make_pipeline(service, "taken")
    with pytest.raises(DuplicateName):
        run(
            service.create_pipeline(
                CreatePipeline("taken", msgspec.Raw(msgspec.json.encode(PIPELINE)))
            )
        )
    assert [p.name for p in run(service.list_pipelines())] == ["taken"]
    pipeline_id = run(service.list_pipelines())[0].id
    a = value(run(service.create_task(CreateTask(pipeline_id, "a", ""))))
    b = value(run(service.create_task(CreateTask(pipeline_id, "b", ""))))
    value(run(service.add_dependency(a, b)))
    with pytest.raises(DuplicateDependency):
        run(service.add_dependency(a, b))
    assert [d.depends_on_task_id for d in run(service.list_dependencies(a))] == [b]
