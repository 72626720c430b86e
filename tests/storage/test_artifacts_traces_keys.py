"""Artifacts, trace spans, idempotency records and API keys through the storage port."""

from __future__ import annotations

import hashlib
import json

from nulltickets.domain.ids import new_id
from nulltickets.domain.model import Access, SpanRow
from nulltickets.storage.backend import Backend
from nulltickets.storage.ports import Database
from tests.storage.ops import NOW, claimed, covers, make_pipeline, make_task


@covers("Backend.insert_artifact", "Backend.list_artifacts")
def test_artifacts_are_listed_in_pages_by_task_and_by_run(database: Database) -> None:
    task_id = database.write_sync(lambda b: make_task(b, make_pipeline(b)))
    run_id = database.write_sync(lambda b: claimed(b).run_id)

    def job(b: Backend) -> list[str]:
        ids = []
        for n, (task, run) in enumerate([(task_id, None), (task_id, run_id), (None, None)]):
            artifact_id = new_id()
            b.insert_artifact(
                id=artifact_id,
                task_id=task,
                run_id=run,
                kind=f"k{n}",
                uri=f"file:///{n}",
                sha256="ab" * 32 if n == 0 else None,
                size_bytes=10 * n if n else None,
                meta_json='{"m":1}',
                now=NOW + n,
            )
            ids.append(artifact_id)
        return ids

    ids = database.write_sync(job)

    def listed(**kw: object) -> list[str]:
        params: dict[str, object] = {"task_id": None, "run_id": None, "after": None, "limit": 10}
        params |= kw
        return [a.id for a in database.read_sync(lambda b: b.list_artifacts(**params))]

    assert listed() == ids
    assert listed(task_id=task_id) == ids[:2]
    assert listed(run_id=run_id) == ids[1:2]
    assert listed(limit=1) == ids[:1]
    assert listed(after=(NOW, ids[0])) == ids[1:]
    first = database.read_sync(
        lambda b: b.list_artifacts(task_id=None, run_id=None, after=None, limit=1)
    )[0]
    assert (first.task_id, first.run_id, first.created_at_ms, first.kind, first.uri) == (
        task_id,
        None,
        NOW,
        "k0",
        "file:///0",
    )
    assert (first.sha256, first.size_bytes, json.loads(bytes(first.meta))) == (
        "ab" * 32,
        None,
        {"m": 1},
    )


def span(run_id: str | None, task_id: str | None, n: int) -> SpanRow:
    return SpanRow(
        trace_id="t" * 32,
        span_id=f"{n:016x}",
        parent_span_id=None if n == 0 else f"{0:016x}",
        name=f"step {n}",
        kind="SPAN_KIND_INTERNAL",
        start_time_unix_nano=10**18 + n,
        end_time_unix_nano=10**18 + n + 5,
        status_code="STATUS_CODE_OK",
        status_message=None,
        scope_name="agent",
        scope_version="1.0",
        run_id=run_id,
        task_id=task_id,
        attributes_json='{"a":1}',
        resource_attributes_json='{"service.name":"x"}',
        raw_json="{}",
    )


@covers("Backend.insert_otlp_batch", "Backend.insert_otlp_span", "Backend.list_run_spans")
def test_trace_batches_keep_their_spans_listed_by_run(database: Database) -> None:
    task_id = database.write_sync(lambda b: make_task(b, make_pipeline(b)))
    run_id = database.write_sync(lambda b: claimed(b).run_id)

    def job(b: Backend) -> tuple[int, int]:
        blob = b.insert_otlp_batch("application/x-protobuf", None, b"\x00\x01", 0, NOW)
        batch = b.insert_otlp_batch("application/json", '{"resourceSpans":[]}', None, 3, NOW)
        for n in range(3):
            b.insert_otlp_span(batch, span(run_id if n < 2 else None, task_id, n))
        return blob, batch

    blob, batch = database.write_sync(job)
    assert batch > blob
    spans = database.read_sync(lambda b: b.list_run_spans(run_id, 0, 10))
    assert [(s.batch_id, s.span_id, s.name, s.run_id, s.task_id) for s in spans] == [
        (batch, f"{n:016x}", f"step {n}", run_id, task_id) for n in range(2)
    ]
    first = spans[0]
    assert (first.trace_id, first.parent_span_id, first.kind, first.start_time_unix_nano) == (
        "t" * 32,
        None,
        "SPAN_KIND_INTERNAL",
        10**18,
    )
    assert (first.end_time_unix_nano, first.status_code, first.status_message) == (
        10**18 + 5,
        "STATUS_CODE_OK",
        None,
    )
    assert (first.scope_name, first.scope_version) == ("agent", "1.0")
    assert json.loads(bytes(first.attributes)) == {"a": 1}
    assert json.loads(bytes(first.resource_attributes)) == {"service.name": "x"}
    after = database.read_sync(lambda b: b.list_run_spans(run_id, first.id, 10))
    assert [s.id for s in after] == [spans[1].id]
    assert len(database.read_sync(lambda b: b.list_run_spans(run_id, 0, 1))) == 1
    assert database.read_sync(lambda b: b.list_run_spans("nope", 0, 10)) == []


@covers("Backend.get_idempotency", "Backend.put_idempotency", "Backend.purge_idempotency")
def test_an_idempotent_answer_is_recorded_by_key_method_and_path_and_purged_when_old(
    database: Database,
) -> None:
    key = {"key": "k1", "method": "POST", "path": "/tasks"}
    assert database.write_sync(lambda b: b.get_idempotency(**key)) is None

    def record(b: Backend, k: str, auth: bytes | None, now: int) -> None:
        b.put_idempotency(
            key=k,
            method="POST",
            path="/tasks",
            request_hash=b"r" * 32,
            auth_hash=auth,
            status=201,
            body='{"id":"t"}',
            now=now,
        )

    database.write_sync(lambda b: record(b, "k1", None, NOW))
    database.write_sync(lambda b: record(b, "k2", b"a" * 32, NOW + 10))
    assert database.write_sync(lambda b: b.get_idempotency(**key)) == (
        b"r" * 32,
        None,
        201,
        '{"id":"t"}',
    )
    assert database.read_sync(lambda b: b.get_idempotency("k2", "POST", "/tasks")) == (
        b"r" * 32,
        b"a" * 32,
        201,
        '{"id":"t"}',
    )
    assert database.read_sync(lambda b: b.get_idempotency("k1", "PUT", "/tasks")) is None
    assert database.read_sync(lambda b: b.get_idempotency("k1", "POST", "/other")) is None
    assert database.write_sync(lambda b: b.purge_idempotency(NOW)) == 0  # strictly older
    assert database.write_sync(lambda b: b.purge_idempotency(NOW + 1)) == 1
    assert database.read_sync(lambda b: b.get_idempotency("k1", "POST", "/tasks")) is None
    assert database.read_sync(lambda b: b.get_idempotency("k2", "POST", "/tasks")) is not None


@covers(
    "Backend.insert_api_key",
    "Backend.api_key_by_hash",
    "Backend.api_key_by_id",
    "Backend.list_api_keys",
    "Backend.delete_api_key",
)
def test_a_key_is_kept_as_its_hash_found_by_it_and_deleted_once(database: Database) -> None:
    agent_hash = hashlib.sha256(b"ntk_agent").digest()
    read_hash = hashlib.sha256(b"ntk_read").digest()

    def job(b: Backend) -> None:
        b.insert_api_key(
            id="k-agent",
            key_hash=agent_hash,
            name="ci",
            access="agent",
            roles=["coder", "reviewer"],
            now=NOW,
        )
        b.insert_api_key(
            id="k-read", key_hash=read_hash, name="dash", access="read", roles=[], now=NOW + 1
        )

    database.write_sync(job)
    agent = database.read_sync(lambda b: b.api_key_by_hash(agent_hash))
    assert agent is not None
    assert (agent.id, agent.name, agent.access, agent.roles, agent.created_at_ms) == (
        "k-agent",
        "ci",
        Access.AGENT,
        ["coder", "reviewer"],
        NOW,
    )
    assert database.read_sync(lambda b: b.api_key_by_id("k-agent")) == agent
    assert database.read_sync(lambda b: b.api_key_by_hash(b"x" * 32)) is None
    assert database.read_sync(lambda b: b.api_key_by_id("nope")) is None
    listed = database.read_sync(lambda b: b.list_api_keys())
    assert sorted((k.id, k.access) for k in listed) == [
        ("k-agent", Access.AGENT),
        ("k-read", Access.READ),
    ]
    assert database.write_sync(lambda b: b.delete_api_key("k-agent")) == agent
    assert database.write_sync(lambda b: b.delete_api_key("k-agent")) is None
    assert database.read_sync(lambda b: b.api_key_by_hash(agent_hash)) is None
    assert [k.id for k in database.read_sync(lambda b: b.list_api_keys())] == ["k-read"]
