"""Claims, runs, leases, fences, failures and checkpoints through the storage port: every
guard is in the statements themselves."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from nulltickets.domain.ids import new_id
from nulltickets.errors import StorageBusy, Unauthorized
from nulltickets.storage.backend import Backend, Ended, Failed, Move, NewPipeline, StagePolicyRow
from nulltickets.storage.backend import Claimed as WholeClaim
from nulltickets.storage.ports import Database
from tests.storage.ops import NOW, Claimed, claim, claimed, covers, make_pipeline, make_task


def one_task(database: Database, **kw: Any) -> str:
    return str(database.write_sync(lambda b: make_task(b, make_pipeline(b), **kw)))


@covers(
    "Backend.claim_candidate",
    "Backend.insert_run",
    "Backend.bump_fence",
    "Backend.insert_lease",
    "Backend.lease_by_run",
    "Backend.lease_by_id",
    "Backend.latest_run",
    "Backend.run_by_id",
    "Backend.run_exists",
    "Backend.run_status",
    "Backend.run_status_of_lease",
    "Backend.task_run_state",
    "Backend.live_lease_of_task",
    "Backend.task_fence_of_run",
    "Backend.task_fence_of_lease",
)
def test_a_claim_starts_a_run_raises_the_fence_and_leases_it(database: Database) -> None:
    task_id = one_task(database)
    assert database.read_sync(lambda b: b.latest_run(task_id)) is None
    assert database.read_sync(lambda b: b.task_run_state(task_id)) is None
    got: Claimed = database.write_sync(lambda b: claimed(b, agent="ann", ttl=5_000))
    assert (got.task.id, got.attempt, got.fence, got.checkpoint) == (task_id, 1, 1, None)
    lease = database.read_sync(lambda b: b.lease_by_run(got.run_id))
    assert lease is not None
    assert (lease.id, lease.run_id, lease.task_id, lease.token_hash) == (
        got.lease_id,
        got.run_id,
        task_id,
        got.token_hash,
    )
    assert (lease.expires_at_ms, lease.ttl_ms, lease.run_status) == (NOW + 5_000, 5_000, "running")
    assert (lease.stage, lease.task_version, lease.fence, lease.agent_id) == ("todo", 1, 1, "ann")
    assert database.read_sync(lambda b: b.lease_by_id(got.lease_id)) == lease
    # In a write, where a backend may lock the lease's rows, the same rows.
    assert database.write_sync(lambda b: b.lease_by_run(got.run_id)) == lease
    assert database.write_sync(lambda b: b.lease_by_id(got.lease_id)) == lease
    assert database.read_sync(lambda b: b.lease_by_run("nope")) is None
    assert database.read_sync(lambda b: b.lease_by_id("nope")) is None
    run = database.read_sync(lambda b: b.latest_run(task_id))
    assert run is not None
    assert (run.id, run.task_id, run.attempt, run.status) == (got.run_id, task_id, 1, "running")
    assert (run.agent_id, run.agent_role, run.started_at_ms, run.ended_at_ms) == (
        "ann",
        "coder",
        NOW,
        None,
    )
    assert database.read_sync(lambda b: b.run_by_id(got.run_id)) == run
    assert database.read_sync(lambda b: b.run_by_id("nope")) is None
    assert database.read_sync(lambda b: b.run_exists(got.run_id))
    assert not database.read_sync(lambda b: b.run_exists("nope"))
    assert database.read_sync(lambda b: b.run_status(got.run_id)) == "running"
    assert database.read_sync(lambda b: b.run_status("nope")) is None
    assert database.read_sync(lambda b: b.run_status_of_lease(got.lease_id)) == "running"
    assert database.read_sync(lambda b: b.run_status_of_lease("nope")) is None
    assert database.read_sync(lambda b: b.task_run_state(task_id)) == got.run_id
    assert database.read_sync(lambda b: b.task_run_state("nope")) is None
    assert database.write_sync(lambda b: b.live_lease_of_task(task_id)) == (
        got.lease_id,
        got.run_id,
        NOW + 5_000,
    )
    assert database.read_sync(lambda b: b.task_fence_of_run(got.run_id)) == 1
    assert database.read_sync(lambda b: b.task_fence_of_lease(got.lease_id)) == 1
    assert database.read_sync(lambda b: b.task_fence_of_run("nope")) is None
    assert database.read_sync(lambda b: b.task_fence_of_lease("nope")) is None
    # A leased task is not claimable again.
    assert database.write_sync(lambda b: claim(b, agent="bob")) is None


@covers("Backend.claim_candidate")
def test_a_claim_takes_the_most_urgent_then_the_oldest_eligible_task(database: Database) -> None:
    """Moved from tests/postgres/test_claims.py, on every backend."""

    def job(b: Backend) -> tuple[str, list[str], str, str]:
        pipeline_id = make_pipeline(b)
        old = make_task(b, pipeline_id, now=1, priority=1)
        same_ms = [make_task(b, pipeline_id, now=2, priority=1) for _ in range(3)]
        urgent = make_task(b, pipeline_id, now=3, priority=5)
        later = make_task(b, pipeline_id, now=NOW + 1, priority=9)
        b.schedule_retry(later, NOW + 1, None, NOW)  # not eligible yet
        make_task(b, pipeline_id, stage="review", priority=9)  # another role's
        return old, same_ms, urgent, later

    old, same_ms, urgent, later = database.write_sync(job)
    order = [database.write_sync(lambda b: claimed(b).task.id) for _ in range(5)]
    assert order == [urgent, old, *same_ms]  # same ms: in the order they were created
    assert database.write_sync(lambda b: claim(b)) is None
    assert database.write_sync(lambda b: claimed(b, now=NOW + 1).task.id) == later


@covers("Backend.claim_candidate")
def test_full_stages_and_pairs_are_passed_over(database: Database) -> None:
    """Moved from tests/postgres/test_claims.py, on every backend."""

    def job(b: Backend) -> tuple[str, str, str, str]:
        first, second = make_pipeline(b), make_pipeline(b)
        return first, second, make_task(b, first, now=1), make_task(b, second, now=2)

    first, _second, a, b_ = database.write_sync(job)
    assert database.write_sync(lambda b: claim(b, full_stages=("todo",))) is None
    got = database.write_sync(lambda b: claim(b, full_pairs=((first, "todo"),)))
    assert got is not None and got.task.id == b_
    got = database.write_sync(lambda b: claim(b, full_stages=("other",)))
    assert got is not None and got.task.id == a


def whole_claim(
    b: Backend,
    *,
    agent: str = "ann",
    token_hash: bytes = b"t" * 32,
    ttl_ms: int | None = None,
    stage_ttls: tuple[tuple[str, str, int], ...] = (),
    full_stages: tuple[str, ...] = (),
    capped: tuple[tuple[str, str, int], ...] = (),
    known: frozenset[str] | None = None,
    now: int = NOW,
) -> tuple[str, str, WholeClaim | NewPipeline | None]:
    """Backend.claim as the service calls it; (run id, lease id, what it answered)."""
    run_id, lease_id = new_id(), new_id()
    got = b.claim(
        agent_role="coder",
        agent_id=agent,
        run_id=run_id,
        lease_id=lease_id,
        token_hash=token_hash,
        ttl_ms=ttl_ms,
        stage_ttls=stage_ttls,
        default_ttl_ms=7_000,
        full_stages=full_stages,
        capped=capped,
        known_pipelines=known,
        now=now,
    )
    return run_id, lease_id, got


@covers("Backend.claim")
def test_a_whole_claim_starts_a_run_raises_the_fence_and_leases_the_best_task(
    database: Database,
) -> None:
    """Backend.claim, which PostgreSQL runs as one statement: the same choice, run, fence
    and lease as its parts, with the lease's TTL from the request, the stage or the default."""

    def job(b: Backend) -> tuple[str, str, str, str]:
        first, second = make_pipeline(b), make_pipeline(b)
        urgent = make_task(b, first, now=1, priority=5)
        old = make_task(b, second, now=2)
        return first, second, urgent, old

    first, _second, urgent, old = database.write_sync(job)
    database.write_sync(lambda b: b.merge_checkpoint(urgent, '{"step": 2, "done": ["a"]}'))
    ttls = ((first, "todo", 3_000),)
    run_id, lease_id, got = database.write_sync(lambda b: whole_claim(b, stage_ttls=ttls))
    assert isinstance(got, WholeClaim)
    assert (got.task.id, got.task.pipeline_id, got.task.stage) == (urgent, first, "todo")
    assert (got.attempt, got.fence, got.previous_failures) == (1, 1, [])
    assert json.loads(got.checkpoint_json or "") == {"step": 2, "done": ["a"]}
    assert got.checkpoint_json == '{"done":["a"],"step":2}' or got.checkpoint_json == (
        '{"step":2,"done":["a"]}'
    )  # compact, in the backend's key order
    assert (got.expires_at_ms, got.ttl_ms) == (NOW + 3_000, 3_000)  # the stage's TTL
    lease = database.read_sync(lambda b: b.lease_by_id(lease_id))
    assert lease is not None
    assert (lease.run_id, lease.task_id, lease.token_hash, lease.fence) == (
        run_id,
        urgent,
        b"t" * 32,
        1,
    )
    assert (lease.expires_at_ms, lease.ttl_ms, lease.agent_id) == (NOW + 3_000, 3_000, "ann")
    run = database.read_sync(lambda b: b.run_by_id(run_id))
    assert run is not None
    assert (run.task_id, run.attempt, run.status, run.agent_role) == (urgent, 1, "running", "coder")
    # The next one: no TTL for its stage, so the default; a requested TTL wins over both.
    _, _, default = database.write_sync(lambda b: whole_claim(b, stage_ttls=ttls))
    assert isinstance(default, WholeClaim) and default.task.id == old
    assert (default.ttl_ms, default.checkpoint_json) == (7_000, None)
    database.write_sync(lambda b: b.end_run(run_id, "failed", "{}", "boom", NOW + 1))
    database.write_sync(lambda b: b.delete_lease(lease_id))
    _, _, again = database.write_sync(lambda b: whole_claim(b, ttl_ms=500, stage_ttls=ttls))
    assert isinstance(again, WholeClaim) and again.task.id == urgent
    assert (again.attempt, again.fence, again.ttl_ms) == (2, 2, 500)
    assert [(f.attempt, f.run_id, f.status, f.error) for f in again.previous_failures] == [
        (1, run_id, "failed", "boom")
    ]
    assert database.write_sync(lambda b: whole_claim(b))[2] is None  # nothing left


@covers("Backend.claim")
def test_a_whole_claim_passes_over_full_stages_and_unknown_pipelines(
    database: Database,
) -> None:
    def job(b: Backend) -> tuple[str, str, str, str]:
        first, second = make_pipeline(b), make_pipeline(b)
        return first, second, make_task(b, first, now=1), make_task(b, second, now=2)

    first, second, a, b_ = database.write_sync(job)
    # A pipeline the caller has not read: nothing is claimed, and the task is still there.
    _, lease_id, got = database.write_sync(lambda b: whole_claim(b, known=frozenset({second})))
    assert got == NewPipeline(first)
    assert database.read_sync(lambda b: b.latest_run(a)) is None
    assert database.read_sync(lambda b: b.lease_by_id(lease_id)) is None
    assert database.write_sync(lambda b: whole_claim(b, full_stages=("todo",)))[2] is None
    # A cap not reached yet passes nothing over; once reached, that (pipeline, stage) is full.
    _, _, got = database.write_sync(lambda b: whole_claim(b, capped=((first, "todo", 1),)))
    assert isinstance(got, WholeClaim) and got.task.id == a
    database.write_sync(lambda b: make_task(b, first, now=0, priority=9))
    _, _, got = database.write_sync(
        lambda b: whole_claim(b, capped=((first, "todo", 1),), known=frozenset({first, second}))
    )
    assert isinstance(got, WholeClaim) and got.task.id == b_


@covers("Backend.extend_held_lease")
def test_a_heartbeat_in_one_statement_needs_its_token_its_time_and_its_fence(
    database: Database,
) -> None:
    one_task(database)
    got = database.write_sync(lambda b: claimed(b, ttl=1_000))
    token = got.token_hash

    def beat(
        token_hash: bytes, fence: int | None, ttl: int | None, now: int = NOW + 10
    ) -> int | None:
        return database.write_sync(  # type: ignore[no-any-return]
            lambda b: b.extend_held_lease(got.lease_id, token_hash, fence, ttl, 9_000, now)
        )

    assert beat(b"x" * 32, None, None) is None  # another token
    assert beat(token, 2, None) is None  # another fence
    assert beat(token, None, None, NOW + 1_000) is None  # expired
    assert database.read_sync(lambda b: b.lease_by_id(got.lease_id)).expires_at_ms == NOW + 1_000
    assert beat(token, None, None) == NOW + 10 + 1_000  # its own TTL
    assert beat(token, 1, 4_000, NOW + 20) == NOW + 20 + 4_000  # the TTL given becomes its own
    lease = database.read_sync(lambda b: b.lease_by_id(got.lease_id))
    assert (lease.expires_at_ms, lease.ttl_ms) == (NOW + 4_020, 4_000)
    assert beat(token, None, None, NOW + 30) == NOW + 4_030
    assert (
        database.write_sync(lambda b: b.extend_held_lease("nope", token, None, None, 9_000, NOW))
        is None
    )


@covers("Backend.transition_run")
def test_a_whole_transition_needs_the_lease_and_a_move_for_the_tasks_stage(
    database: Database,
) -> None:
    """Backend.transition_run, which PostgreSQL runs as one statement: refused, changing
    nothing, unless every condition holds; then the run completed, the task moved, the lease
    gone and the event recorded."""

    def job(b: Backend) -> tuple[str, str, str]:
        pipeline_id = make_pipeline(b)
        task_id = make_task(b, pipeline_id)
        waiting = make_task(b, pipeline_id, stage="review")
        b.insert_dependency(waiting, task_id, NOW)
        return pipeline_id, task_id, waiting

    pipeline_id, task_id, _waiting = database.write_sync(job)
    got = database.write_sync(lambda b: claimed(b, ttl=1_000))
    data = '{"trigger":"ship","from":"todo","to":"review","instructions":""}'
    moves = (Move("other", "todo", "done", "{}"), Move(pipeline_id, "todo", "review", data))

    def move(
        token: bytes = got.token_hash,
        fence: int | None = None,
        stage: str | None = None,
        version: int | None = None,
        moves: tuple[Move, ...] = moves,
        now: int = NOW + 10,
    ) -> Any:
        return database.write_sync(
            lambda b: b.transition_run(
                run_id=got.run_id,
                token_hash=token,
                fence=fence,
                expected_stage=stage,
                expected_task_version=version,
                moves=moves,
                usage_json='{"tokens":3}',
                now=now,
            )
        )

    assert move(token=b"x" * 32) is None
    assert move(fence=2) is None
    assert move(now=NOW + 1_000) is None  # expired
    assert move(stage="review") is None
    assert move(version=2) is None
    assert (
        move(moves=(Move("other", "todo", "done", "{}"), Move(pipeline_id, "review", "done", "{}")))
        is None
    )
    lease = database.read_sync(lambda b: b.lease_by_run(got.run_id))
    assert lease is not None and lease.run_status == "running"  # nothing changed
    assert database.read_sync(lambda b: b.list_events(got.run_id, 0, 10)) == []
    moved = move(fence=1, stage="todo", version=1)
    assert (moved.pipeline_id, moved.task_id, moved.from_stage, moved.to_stage) == (
        pipeline_id,
        task_id,
        "todo",
        "review",
    )
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert (task.stage, task.task_version, task.updated_at_ms) == ("review", 2, NOW + 10)
    run = database.read_sync(lambda b: b.run_by_id(got.run_id))
    assert (run.status, run.ended_at_ms) == ("completed", NOW + 10)
    assert database.read_sync(lambda b: b.lease_by_run(got.run_id)) is None
    events = database.read_sync(lambda b: b.list_events(got.run_id, 0, 10))
    assert [(e.kind, e.ts_ms, json.loads(bytes(e.data))) for e in events] == [
        ("transition", NOW + 10, json.loads(data))
    ]
    assert move(fence=1) is None  # once


@covers("Backend.checkpoint_run")
def test_a_whole_checkpoint_needs_the_lease_merges_extends_and_records_the_patch(
    database: Database,
) -> None:
    """Backend.checkpoint_run, which PostgreSQL runs as one statement: refused, changing
    nothing, unless the lease is held, live and of the fence given."""
    task_id = one_task(database)
    got = database.write_sync(lambda b: claimed(b, ttl=1_000))

    def save(
        patch: str, token: bytes = got.token_hash, fence: int | None = None, now: int = NOW + 10
    ) -> Any:
        return database.write_sync(
            lambda b: b.checkpoint_run(got.run_id, token, fence, patch, 9_000, now)
        )

    assert save('{"a":1}', token=b"x" * 32) is None
    assert save('{"a":1}', fence=2) is None
    assert save('{"a":1}', now=NOW + 1_000) is None  # expired
    assert database.read_sync(lambda b: b.task_resume(task_id)) == (None, 1)
    assert database.read_sync(lambda b: b.list_events(got.run_id, 0, 10)) == []
    merged, expires, fence = save('{"a":1,"b":{"c":2}}', fence=1)
    assert (json.loads(merged), expires, fence) == ({"a": 1, "b": {"c": 2}}, NOW + 1_010, 1)
    merged, expires, _ = save('{"b":{"c":null,"d":3}}', now=NOW + 20)
    assert (merged, expires) == ('{"a":1,"b":{"d":3}}', NOW + 1_020)  # compact on both
    checkpoint, _ = database.read_sync(lambda b: b.task_resume(task_id))
    assert json.loads(checkpoint) == {"a": 1, "b": {"d": 3}}
    lease = database.read_sync(lambda b: b.lease_by_run(got.run_id))
    assert (lease.expires_at_ms, lease.ttl_ms) == (NOW + 1_020, 1_000)
    events = database.read_sync(lambda b: b.list_events(got.run_id, 0, 10))
    assert [(e.kind, json.loads(bytes(e.data))) for e in events] == [
        ("checkpoint", {"a": 1, "b": {"c": 2}}),
        ("checkpoint", {"b": {"c": None, "d": 3}}),
    ]


def stage_policies(
    pipeline_id: str,
    delay: int | None = 1_000,
    backoff: float = 2.0,
    max_delay: int | None = 5_000,
    jitter: float = 0.0,
) -> tuple[StagePolicyRow, ...]:
    """What Backend.fail_run is given of the policy of make_pipeline's `todo` (a row only when
    it has one) and of another pipeline's."""
    policy = (delay, backoff, max_delay, jitter)
    other: StagePolicyRow = ("other", "todo", 1, 1.0, None, 0.0)
    if policy == (None, 1.0, None, 0.0):
        return (other,)
    return other, (pipeline_id, "todo", *policy)


def fail(
    database: Database,
    got: Claimed,
    *,
    token: bytes | None = None,
    fence: int | None = None,
    retryable: bool | None = None,
    known: int | None = None,
    unreadable: tuple[str, ...] = (),
    policies: tuple[StagePolicyRow, ...] = (),
    rand: float = 0.5,
    now: int = NOW + 10,
) -> Failed | None:
    """Backend.fail_run of the claim's run; `known`: how many pipelines the caller has read
    (None: all there are)."""

    def job(b: Backend) -> Failed | None:
        return b.fail_run(
            run_id=got.run_id,
            token_hash=got.token_hash if token is None else token,
            fence=fence,
            usage_json='{"tokens":3}',
            error="boom",
            retryable=retryable,
            known_pipelines=len(b.list_pipelines()) if known is None else known,
            unreadable=unreadable,
            policies=policies,
            rand=rand,
            now=now,
        )

    return database.write_sync(job)  # type: ignore[no-any-return]


def events_of(database: Database, run_id: str) -> list[tuple[str, int, Any]]:
    events = database.read_sync(lambda b: b.list_events(run_id, 0, 10))
    return [(e.kind, e.ts_ms, json.loads(bytes(e.data))) for e in events]


@covers("Backend.fail_run")
def test_a_whole_failure_needs_the_lease_and_the_stages_policy_then_retries_and_dead_letters(
    database: Database,
) -> None:
    """Backend.fail_run, which PostgreSQL runs as one statement: refused, changing nothing,
    unless the lease is held, live, of the fence given, its run running and the policy of
    its task's stage given; then the run failed, the lease gone, and the task retried after
    the stage's backoff until its attempts are used up, then dead-lettered."""

    def job(b: Backend) -> tuple[str, str]:
        pipeline_id = make_pipeline(b)
        task_id = make_task(b, pipeline_id, max_attempts=3, dead_letter_stage="dead")
        b.insert_dependency(make_task(b, pipeline_id, stage="review"), task_id, NOW)
        return pipeline_id, task_id

    pipeline_id, task_id = database.write_sync(job)
    stages = stage_policies(pipeline_id)
    got = database.write_sync(lambda b: claimed(b, ttl=1_000))
    assert fail(database, got, policies=stages, token=b"x" * 32) is None
    assert fail(database, got, policies=stages, fence=2) is None
    assert fail(database, got, policies=stages, now=NOW + 1_000) is None  # expired
    pipelines = database.read_sync(lambda b: len(b.list_pipelines()))
    assert fail(database, got, policies=stages, known=pipelines - 1) is None  # one not read
    assert fail(database, got, policies=stages, unreadable=(pipeline_id,)) is None
    lease = database.read_sync(lambda b: b.lease_by_run(got.run_id))
    assert lease is not None and lease.run_status == "running"  # nothing changed
    assert events_of(database, got.run_id) == []

    failed = fail(database, got, policies=stages, fence=1)
    assert failed is not None
    assert (failed.pipeline_id, failed.task_id, failed.stage, failed.failed_attempts) == (
        pipeline_id,
        task_id,
        "todo",
        1,
    )
    assert (failed.dead_lettered, failed.dead_letter_stage) == (False, None)
    assert failed.next_eligible_at_ms == NOW + 10 + 1_000  # the stage's delay
    run = database.read_sync(lambda b: b.run_by_id(got.run_id))
    assert (run.status, run.ended_at_ms) == ("failed", NOW + 10)
    assert database.read_sync(lambda b: b.lease_by_run(got.run_id)) is None
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert (task.stage, task.task_version, task.next_eligible_at_ms) == ("todo", 1, NOW + 1_010)
    failing = database.read_sync(
        lambda b: b.list_failures(
            states=frozenset({"failing"}), pipeline_id=pipeline_id, error=None, before=None, limit=9
        )
    )
    assert [(f.id, f.at_ms, f.failures, f.last_error) for f in failing] == [
        (task_id, NOW + 10, 1, "boom")
    ]
    retry = {
        "reason": "retry_scheduled",
        "failed_attempts": 1,
        "retry_delay_ms": 1_000,
        "next_eligible_at_ms": NOW + 1_010,
    }
    assert events_of(database, got.run_id) == [("retry_scheduled", NOW + 10, retry)]
    assert fail(database, got, policies=stages) is None  # once

    # The second failure: twice the delay (the backoff); the third: dead-lettered.
    got = database.write_sync(lambda b: claimed(b, now=NOW + 2_000))
    failed = fail(database, got, policies=stages, now=NOW + 2_010)
    assert failed is not None and (failed.failed_attempts, failed.next_eligible_at_ms) == (
        2,
        NOW + 4_010,
    )
    got = database.write_sync(lambda b: claimed(b, now=NOW + 5_000))
    failed = fail(database, got, policies=stages, now=NOW + 5_010)
    assert failed is not None
    assert (failed.failed_attempts, failed.dead_lettered, failed.dead_letter_stage) == (
        3,
        True,
        "dead",
    )
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert (task.stage, task.task_version, task.dead_letter_reason) == (
        "dead",
        2,
        "max_attempts_exceeded",
    )
    assert task.next_eligible_at_ms == failed.next_eligible_at_ms
    assert events_of(database, got.run_id) == [
        (
            "dead_letter",
            NOW + 5_010,
            {
                "reason": "max_attempts_exceeded",
                "failed_attempts": 3,
                "from_stage": "todo",
                "dead_letter_stage": "dead",
            },
        )
    ]


@covers("Backend.fail_run")
def test_a_whole_failure_decides_the_delay_as_the_policy_says(database: Database) -> None:
    """The delay of Backend.fail_run on every backend: the default backoff when neither the
    task nor its stage sets one (the stage has no row in `policies`), the task's own delay
    first (0 set on purpose: none), the jitter placed by `rand`, the cap; `retryable` false
    dead-letters at once, and a dead-letter stage that is not one of its pipeline's leaves
    the task where it is."""

    def attempt(
        delay: int | None = 1_000,
        backoff: float = 1.0,
        max_delay: int | None = None,
        jitter: float = 0.0,
        rand: float = 0.5,
        retryable: bool | None = None,
        failures: int = 1,
        **task: Any,
    ) -> tuple[Failed, Any]:
        role = new_id()  # a pipeline of its own: the task is the role's only one
        pipeline_id = database.write_sync(lambda b: make_pipeline(b, role))
        task_id = database.write_sync(lambda b: make_task(b, pipeline_id, **task))
        stages = stage_policies(pipeline_id, delay, backoff, max_delay, jitter)
        now = NOW
        for _ in range(failures):
            got = database.write_sync(lambda b, now=now: claimed(b, role, now=now))
            assert got.task.id == task_id
            failed = fail(database, got, policies=stages, rand=rand, retryable=retryable, now=now)
            assert failed is not None
            now = max(failed.next_eligible_at_ms, now + 1)
        events = events_of(database, got.run_id)
        return failed, events[0][2]

    def delay_of(**kw: Any) -> int:
        _, data = attempt(**kw)
        assert data["reason"] == "retry_scheduled"
        return int(data["retry_delay_ms"])

    assert delay_of(delay=None) == 0  # the default backoff: the first retries at once
    assert delay_of(delay=None, failures=3) == 1_000  # then 1 s, +/- 20 % (rand 0.5: none)
    assert delay_of(delay=None, failures=4) == 2_000
    assert delay_of(delay=None, failures=4, rand=0.0) == 1_600
    assert delay_of(delay=1_000, jitter=0.5, rand=0.0) == 500
    assert delay_of(delay=1_000, jitter=0.5, rand=0.75) == 1_250
    assert delay_of(delay=1_000, backoff=3.0, failures=3) == 9_000
    assert delay_of(delay=1_000, backoff=3.0, max_delay=4_000, failures=3) == 4_000
    assert delay_of(delay=1_000, retry_delay_ms=300) == 300  # the task's own first
    assert delay_of(delay=1_000, retry_delay_ms=300, backoff=2.0, failures=2) == 600
    assert delay_of(delay=1_000, retry_delay_set=True) == 0  # 0 set on purpose
    failed, data = attempt(delay=10**18, backoff=10.0, failures=2)  # 10**19 ms: saturated
    assert (data["retry_delay_ms"], failed.next_eligible_at_ms) == (2**63 - 1, 2**63 - 1)
    failed, data = attempt(retryable=False, dead_letter_stage="dead")
    assert (failed.dead_lettered, failed.dead_letter_stage, failed.failed_attempts) == (
        True,
        "dead",
        1,
    )
    assert data == {
        "reason": "not_retryable",
        "failed_attempts": 1,
        "from_stage": "todo",
        "dead_letter_stage": "dead",
    }
    failed, data = attempt(max_attempts=0, dead_letter_stage="nowhere")
    assert (failed.dead_lettered, failed.dead_letter_stage) == (True, None)
    assert data["reason"] == "max_attempts_exceeded" and data["dead_letter_stage"] is None
    task = database.read_sync(lambda b: b.get_task(failed.task_id))
    assert (task.stage, task.task_version, task.dead_letter_reason) == (
        "todo",
        1,
        "max_attempts_exceeded",
    )


@covers("Backend.expire_lease")
def test_an_expiry_in_one_go_needs_the_lease_past_its_time_and_counts_as_a_failure(
    database: Database,
) -> None:
    """Backend.expire_lease, the reaper's work on one lease, which PostgreSQL runs as one
    statement: refused, changing nothing, while the lease is live, for a lease that is not
    there, or when a pipeline is not read or cannot be parsed; then the run stale, the lease
    gone, the `lease_expired` event and then the retry's, the task retried after its stage's
    delay; the next expiry past its attempts dead-letters it."""

    def job(b: Backend) -> tuple[str, str]:
        pipeline_id = make_pipeline(b)
        return pipeline_id, make_task(b, pipeline_id, max_attempts=2, dead_letter_stage="dead")

    pipeline_id, task_id = database.write_sync(job)
    stages = stage_policies(pipeline_id)
    pipelines = database.read_sync(lambda b: len(b.list_pipelines()))

    def expire(
        lease_id: str, *, known: int = pipelines, unreadable: tuple[str, ...] = (), now: int
    ) -> Failed | None:
        return database.write_sync(  # type: ignore[no-any-return]
            lambda b: b.expire_lease(
                lease_id=lease_id,
                known_pipelines=known,
                unreadable=unreadable,
                policies=stages,
                rand=0.5,
                now=now,
            )
        )

    got = database.write_sync(lambda b: claimed(b, ttl=1_000))
    expiry = got.expires_at_ms
    assert expire(got.lease_id, now=expiry - 1) is None  # still live
    assert expire(got.lease_id, known=pipelines - 1, now=expiry) is None  # one not read
    assert expire(got.lease_id, unreadable=(pipeline_id,), now=expiry) is None
    assert expire(new_id(), now=expiry) is None
    lease = database.read_sync(lambda b: b.lease_by_run(got.run_id))
    assert lease is not None and lease.run_status == "running"  # nothing changed
    assert events_of(database, got.run_id) == []

    ended = expire(got.lease_id, now=expiry)
    assert ended is not None
    assert (ended.pipeline_id, ended.task_id, ended.stage, ended.failed_attempts) == (
        pipeline_id,
        task_id,
        "todo",
        1,
    )
    assert (ended.dead_lettered, ended.dead_letter_stage) == (False, None)
    assert ended.next_eligible_at_ms == expiry + 1_000  # the stage's delay
    run = database.read_sync(lambda b: b.run_by_id(got.run_id))
    assert (run.status, run.ended_at_ms) == ("stale", expiry)
    assert database.read_sync(lambda b: b.lease_by_id(got.lease_id)) is None
    expired = {"reason": "lease_expired", "lease_id": got.lease_id, "failed_attempts": 1}
    retry = {
        "reason": "retry_scheduled",
        "failed_attempts": 1,
        "retry_delay_ms": 1_000,
        "next_eligible_at_ms": expiry + 1_000,
    }
    assert events_of(database, got.run_id) == [
        ("lease_expired", expiry, expired),
        ("retry_scheduled", expiry, retry),
    ]
    failing = database.read_sync(
        lambda b: b.list_failures(
            states=frozenset({"failing"}), pipeline_id=pipeline_id, error=None, before=None, limit=9
        )
    )
    assert [(f.id, f.failures, f.last_error) for f in failing] == [(task_id, 1, "lease_expired")]
    assert expire(got.lease_id, now=expiry + 5) is None  # once

    # The second expiry uses up the task's attempts: dead-lettered.
    got = database.write_sync(lambda b: claimed(b, now=expiry + 1_000, ttl=1_000))
    ended = expire(got.lease_id, now=got.expires_at_ms + 7)
    assert ended is not None
    assert (ended.failed_attempts, ended.dead_lettered, ended.dead_letter_stage) == (
        2,
        True,
        "dead",
    )
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert (task.stage, task.dead_letter_reason) == ("dead", "max_attempts_exceeded")
    assert [e[0] for e in events_of(database, got.run_id)] == ["lease_expired", "dead_letter"]


@covers("Backend.task_checkpoint")
def test_a_tasks_checkpoint_is_what_its_parts_read_one_by_one(database: Database) -> None:
    """Backend.task_checkpoint, GET /tasks/{id}/checkpoint's reads, which PostgreSQL runs as
    one statement: task_resume and previous_failures, before and after a checkpoint and two
    failures; None for no task."""

    def job(b: Backend) -> tuple[str, str]:
        pipeline_id = make_pipeline(b)
        return pipeline_id, make_task(b, pipeline_id, max_attempts=9)

    pipeline_id, task_id = database.write_sync(job)

    def parts(b: Backend) -> Any:
        resume = b.task_resume(task_id)
        assert resume is not None
        return (*resume, b.previous_failures(task_id))

    assert database.read_sync(lambda b: b.task_checkpoint(task_id)) == (None, 0, [])
    stages = stage_policies(pipeline_id, delay=None)
    for attempt in range(2):
        got = database.write_sync(lambda b, at=NOW + 10 * attempt: claimed(b, now=at))
        assert fail(database, got, policies=stages, now=NOW + 10 * attempt + 5) is not None
    database.write_sync(lambda b: b.merge_checkpoint(task_id, '{"step": 2}'))
    found = database.read_sync(lambda b: b.task_checkpoint(task_id))
    assert found == database.read_sync(parts)
    assert found is not None and found[:2] == ('{"step":2}', 2)
    assert [f.attempt for f in found[2]] == [2, 1]
    assert database.read_sync(lambda b: b.task_checkpoint("nope")) is None


@covers("Backend.task_view")
def test_a_task_view_is_what_its_parts_read_one_by_one(database: Database) -> None:
    """Backend.task_view, GET /tasks/{id}'s reads, which PostgreSQL runs as one statement:
    the task, its checkpoint, fence and cancellation, its latest run, dependencies (one
    finished, one not), assignments and previous failures (newest first), each as the
    operation that reads it alone; a task with none of those, and no task at all."""

    def job(b: Backend) -> tuple[str, str, str]:
        pipeline_id = make_pipeline(b)
        task_id = make_task(b, pipeline_id, title="viewed", max_attempts=9)
        return pipeline_id, task_id, make_task(b, pipeline_id, stage="done")

    pipeline_id, task_id, done = database.write_sync(job)
    stages = stage_policies(pipeline_id, delay=None)
    for attempt in range(2):
        got = database.write_sync(lambda b, at=NOW + 10 * attempt: claimed(b, now=at))
        assert got.task.id == task_id
        assert fail(database, got, policies=stages, now=NOW + 10 * attempt + 5) is not None
    running = database.write_sync(lambda b: claimed(b, now=NOW + 100))

    def depend_and_assign(b: Backend) -> None:
        b.insert_dependency(task_id, make_task(b, pipeline_id, stage="review"), NOW)
        b.insert_dependency(task_id, done, NOW + 1)
        b.upsert_assignment(task_id, "agent", "lead", NOW)
        b.upsert_assignment(task_id, "other", None, NOW + 1)

    database.write_sync(depend_and_assign)

    def parts(b: Backend, id: str) -> tuple[Any, ...]:
        return (
            b.task_details(id),
            b.latest_run(id),
            b.list_dependencies(id),
            b.list_assignments(id),
            b.previous_failures(id),
        )

    view = database.read_sync(lambda b: b.task_view(task_id))
    assert view is not None
    whole = (view.task, view.checkpoint_json, view.fence, view.cancelled_at_ms)
    assert (*whole, view.cancel_reason) == database.read_sync(lambda b: b.task_details(task_id))
    rest = (view.latest_run, view.dependencies, view.assignments, view.previous_failures)
    assert rest == database.read_sync(lambda b: parts(b, task_id))[1:]
    assert view.task.title == "viewed"
    assert view.latest_run is not None and view.latest_run.id == running.run_id
    assert [(d.depends_on_task_id == done, d.resolved) for d in view.dependencies] == [
        (False, False),
        (True, True),
    ]
    assert [(a.agent_id, a.assigned_by) for a in view.assignments] == [
        ("agent", "lead"),
        ("other", None),
    ]
    assert [(f.attempt, f.error) for f in view.previous_failures] == [(2, "boom"), (1, "boom")]

    bare = database.read_sync(lambda b: b.task_view(done))
    assert bare is not None
    assert (bare.latest_run, bare.dependencies, bare.assignments, bare.previous_failures) == (
        None,
        [],
        [],
        [],
    )
    assert database.read_sync(lambda b: b.task_view("nope")) is None


@covers("Backend.release_agent")
def test_releasing_an_agent_puts_down_each_live_lease_it_holds_and_no_other(
    database: Database,
) -> None:
    """Backend.release_agent, which PostgreSQL runs as one statement: each live lease of the
    agent, in order of expiry, released as release_run releases one (the run released with
    the reason, the lease gone, the event recorded, the task claimable again); its expired
    lease and another agent's lease untouched."""
    pipeline_id = database.write_sync(lambda b: make_pipeline(b))
    tasks = [database.write_sync(lambda b: make_task(b, pipeline_id)) for _ in range(4)]
    agent = 'ann "the\\agent"\n é'
    late = database.write_sync(lambda b: claimed(b, agent=agent, ttl=5_000))
    early = database.write_sync(lambda b: claimed(b, agent=agent, ttl=3_000))
    expired = database.write_sync(lambda b: claimed(b, agent=agent, ttl=10))
    other = database.write_sync(lambda b: claimed(b, agent="bob", ttl=5_000))
    assert {late.task.id, early.task.id, expired.task.id, other.task.id} == set(tasks)

    def release(who: str) -> list[tuple[str, Ended]]:
        return database.write_sync(  # type: ignore[no-any-return]
            lambda b: b.release_agent(agent_id=who, reason="stopping", now=NOW + 100)
        )

    got = release(agent)
    assert [(run_id, e.pipeline_id, e.task_id, e.stage) for run_id, e in got] == [
        (early.run_id, pipeline_id, early.task.id, "todo"),
        (late.run_id, pipeline_id, late.task.id, "todo"),
    ]
    for held in (early, late):
        runs = database.read_sync(lambda b, held=held: b.list_task_runs(held.task.id, 0, 10))
        assert [(r.id, r.status, r.ended_at_ms, r.error) for r in runs] == [
            (held.run_id, "released", NOW + 100, "stopping")
        ]
        assert database.read_sync(lambda b, held=held: b.lease_by_run(held.run_id)) is None
        events = database.read_sync(lambda b, held=held: b.list_events(held.run_id, 0, 10))
        assert [(e.kind, e.ts_ms) for e in events] == [("released", NOW + 100)]
        want = msgspec.json.encode({"reason": "stopping", "agent_id": agent})
        assert bytes(events[0].data) == want
    for untouched in (expired, other):
        lease = database.read_sync(lambda b, u=untouched: b.lease_by_run(u.run_id))
        assert lease is not None and lease.run_status == "running"
    assert release(agent) == []  # once
    again = [database.write_sync(lambda b: claimed(b, agent="cy", now=NOW + 101)) for _ in "12"]
    assert [(c.task.id, c.attempt) for c in again] == [(late.task.id, 2), (early.task.id, 2)]


@covers("Backend.release_run")
def test_a_whole_release_needs_the_lease_ends_the_run_and_records_who_put_it_down(
    database: Database,
) -> None:
    """Backend.release_run, which PostgreSQL runs as one statement: refused, changing
    nothing, unless the lease is held, live and of the fence given; then the run released,
    the lease gone, the event recorded (the same JSON on every backend, whatever the agent's
    name holds) and the task claimable again at once."""
    pipeline_id = database.write_sync(lambda b: make_pipeline(b))
    task_id = database.write_sync(lambda b: make_task(b, pipeline_id))
    agent = 'ann "the\\agent"\n\x01\x7f é 🙂'
    got = database.write_sync(lambda b: claimed(b, agent=agent, ttl=1_000))

    def release(
        token: bytes = got.token_hash,
        fence: int | None = None,
        reason: str | None = "later",
        now: int = NOW + 10,
    ) -> Ended | None:
        return database.write_sync(  # type: ignore[no-any-return]
            lambda b: b.release_run(
                run_id=got.run_id, token_hash=token, fence=fence, reason=reason, now=now
            )
        )

    assert release(token=b"x" * 32) is None
    assert release(fence=2) is None
    assert release(now=NOW + 1_000) is None  # expired
    lease = database.read_sync(lambda b: b.lease_by_run(got.run_id))
    assert lease is not None and lease.run_status == "running"  # nothing changed
    ended = release(fence=1)
    assert ended is not None
    assert (ended.pipeline_id, ended.task_id, ended.stage) == (pipeline_id, task_id, "todo")
    run = database.read_sync(lambda b: b.run_by_id(got.run_id))
    assert (run.status, run.ended_at_ms) == ("released", NOW + 10)
    assert database.read_sync(lambda b: b.lease_by_run(got.run_id)) is None
    events = database.read_sync(lambda b: b.list_events(got.run_id, 0, 10))
    assert [(e.kind, e.ts_ms) for e in events] == [("released", NOW + 10)]
    assert bytes(events[0].data) == msgspec.json.encode({"reason": "later", "agent_id": agent})
    assert release() is None  # once
    again = database.write_sync(lambda b: claimed(b, now=NOW + 11))
    assert (again.task.id, again.attempt, again.fence) == (task_id, 2, 2)  # claimable at once

    for reason in (None, ""):  # no reason: "released"
        got = again if reason is None else database.write_sync(lambda b: claimed(b, now=NOW + 20))
        ended = database.write_sync(
            lambda b, got=got, reason=reason: b.release_run(
                run_id=got.run_id,
                token_hash=got.token_hash,
                fence=None,
                reason=reason,
                now=NOW + 12,
            )
        )
        assert ended is not None
        data = events_of(database, got.run_id)[0][2]
        assert data == {"reason": "released", "agent_id": "agent"}


@covers("Backend.confirm_key")
def test_a_unit_of_work_for_a_key_that_is_gone_changes_nothing(database: Database) -> None:
    """A unit of work made with a key checks it: one whose key was revoked (on any server)
    raises Unauthorized, from confirm_key or from its next statement (PostgreSQL checks it in
    the statement of the cycle itself), and has changed nothing."""
    pipeline_id = database.write_sync(lambda b: make_pipeline(b))
    database.write_sync(lambda b: make_task(b, pipeline_id))
    database.write_sync(
        lambda b: b.insert_api_key(
            id="k1", key_hash=b"k" * 32, name="k", access="agent", roles=["coder"], now=NOW
        )
    )

    def gone(job: Any) -> None:
        def unit(b: Backend) -> None:
            b.confirm_key("gone")
            job(b)
            b.task_exists(pipeline_id)  # the statement after it, whatever it was

        with pytest.raises(Unauthorized):
            database.write_sync(unit)

    gone(lambda b: whole_claim(b))
    assert database.read_sync(lambda b: b.list_task_runs_newest(pipeline_id, 9, 9)) == []
    assert database.read_sync(lambda b: b.active_leases(NOW)) == 0

    def claim_with_key(b: Backend) -> Any:
        b.confirm_key("k1")
        return whole_claim(b, token_hash=b"t" * 32)

    run_id, lease_id, got = database.write_sync(claim_with_key)
    assert isinstance(got, WholeClaim)
    token = b"t" * 32
    gone(lambda b: b.extend_held_lease(lease_id, token, None, 5_000, 9_000, NOW + 1))
    gone(lambda b: b.insert_event_under_lease(run_id, token, None, "k", "{}", NOW + 1))
    gone(lambda b: b.checkpoint_run(run_id, token, None, '{"a":1}', 9_000, NOW + 1))
    move = Move(got.task.pipeline_id, "todo", "review", "{}")
    gone(
        lambda b: b.transition_run(
            run_id=run_id,
            token_hash=token,
            fence=None,
            expected_stage=None,
            expected_task_version=None,
            moves=(move,),
            usage_json="{}",
            now=NOW + 1,
        )
    )
    gone(
        lambda b: b.fail_run(
            run_id=run_id,
            token_hash=token,
            fence=None,
            usage_json="{}",
            error="boom",
            retryable=None,
            known_pipelines=1,
            unreadable=(),
            policies=stage_policies(got.task.pipeline_id),
            rand=0.5,
            now=NOW + 1,
        )
    )
    gone(lambda b: b.release_run(run_id=run_id, token_hash=token, fence=None, reason=None, now=NOW))
    gone(lambda b: b.lease_by_run(run_id))
    lease = database.read_sync(lambda b: b.lease_by_run(run_id))
    assert lease is not None and (lease.expires_at_ms, lease.stage) == (got.expires_at_ms, "todo")
    assert database.read_sync(lambda b: b.list_events(run_id, 0, 10)) == []
    assert database.read_sync(lambda b: b.task_resume(got.task.id)) == (None, 1)

    def beat_with_key(b: Backend) -> int | None:
        b.confirm_key("k1")
        return b.extend_held_lease(lease_id, token, None, 5_000, 9_000, NOW + 1)

    assert database.write_sync(beat_with_key) == NOW + 5_001


@covers("Backend.insert_run", "Backend.end_run", "Backend.list_task_runs")
def test_the_data_keeps_one_running_run_per_task(database: Database) -> None:
    """Whatever chooses the task, the database itself refuses a second running run (and the
    claim that lost may simply try again); once the run ends, the task can run again."""
    task_id = one_task(database)
    got = database.write_sync(lambda b: claimed(b))
    with pytest.raises(StorageBusy):
        database.write_sync(lambda b: b.insert_run(new_id(), task_id, "x", "coder", NOW, new_id()))
    runs = database.read_sync(lambda b: b.list_task_runs(task_id, 0, 10))
    assert [(r.id, r.attempt) for r in runs] == [(got.run_id, 1)]
    assert database.read_sync(lambda b: b.leased_in_stage("todo")) == 1
    assert database.write_sync(lambda b: b.end_run(got.run_id, "failed", "{}", "x", NOW + 3))
    second = database.write_sync(lambda b: b.insert_run(new_id(), task_id, "b", "r", NOW, new_id()))
    assert second == 2


@covers("Backend.insert_lease")
def test_a_run_has_at_most_one_lease(database: Database) -> None:
    task_id = one_task(database)

    def lease(b: Backend, run_id: str) -> None:
        b.insert_lease(
            id=new_id(),
            run_id=run_id,
            agent_id="a",
            token_hash=b"h" * 32,
            expires_at_ms=NOW + 9,
            ttl_ms=5,
            fence=1,
            now=NOW,
        )

    run_id = new_id()
    database.write_sync(lambda b: b.insert_run(run_id, task_id, "a", "coder", NOW, new_id()))
    database.write_sync(lambda b: lease(b, run_id))
    with pytest.raises(Exception) as refused:
        database.write_sync(lambda b: lease(b, run_id))
    assert "unique" in str(refused.value).lower() or isinstance(refused.value, StorageBusy)
    assert database.read_sync(lambda b: b.leases_of_agent("a")) == [run_id]


@covers(
    "Backend.end_run",
    "Backend.move_task",
    "Backend.delete_lease",
    "Backend.list_task_runs",
    "Backend.list_task_runs_newest",
)
def test_a_run_ends_once_and_a_stale_version_moves_nothing(database: Database) -> None:
    task_id = one_task(database)
    got = database.write_sync(lambda b: claimed(b))
    assert not database.write_sync(lambda b: b.move_task(task_id, "review", 7, NOW))
    assert database.write_sync(lambda b: b.end_run(got.run_id, "completed", '{"t":1}', None, NOW))
    assert not database.write_sync(lambda b: b.end_run(got.run_id, "failed", "{}", None, NOW))
    assert database.write_sync(lambda b: b.move_task(task_id, "review", 1, NOW + 1))
    assert not database.write_sync(lambda b: b.move_task(task_id, "done", 1, NOW + 2))
    database.write_sync(lambda b: b.delete_lease(got.lease_id))
    assert database.read_sync(lambda b: b.lease_by_id(got.lease_id)) is None
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert (task.stage, task.task_version, task.updated_at_ms) == ("review", 2, NOW + 1)
    run = database.read_sync(lambda b: b.latest_run(task_id))
    assert (run.status, run.ended_at_ms) == ("completed", NOW)
    # Three more runs, for the pages of the timeline.
    for n in range(3):

        def fail(b: Backend, n: int = n) -> None:
            got = claimed(b, "reviewer", f"r{n}")
            b.end_run(got.run_id, "failed", "{}", f"e{n}", NOW + n)
            b.delete_lease(got.lease_id)

        database.write_sync(fail)
    runs = database.read_sync(lambda b: b.list_task_runs(task_id, 0, 10))
    assert [(r.attempt, r.status, r.error) for r in runs] == [
        (1, "completed", None),
        (2, "failed", "e0"),
        (3, "failed", "e1"),
        (4, "failed", "e2"),
    ]
    assert [r.attempt for r in database.read_sync(lambda b: b.list_task_runs(task_id, 1, 2))] == [
        2,
        3,
    ]
    newest = database.read_sync(lambda b: b.list_task_runs_newest(task_id, 2**31, 3))
    assert [r.attempt for r in newest] == [4, 3, 2]
    assert [
        r.attempt for r in database.read_sync(lambda b: b.list_task_runs_newest(task_id, 2, 5))
    ] == [1]
    assert (newest[0].agent_id, newest[0].agent_role) == ("r2", "reviewer")


@covers(
    "Backend.extend_lease",
    "Backend.rotate_lease_token",
    "Backend.expired_leases",
    "Backend.next_lease_expiry",
    "Backend.active_leases",
    "Backend.leases_of_agent",
)
def test_leases_expire_at_their_time_and_a_heartbeat_moves_it(database: Database) -> None:
    database.write_sync(lambda b: [make_task(b, make_pipeline(b)) for _ in range(2)])
    assert database.read_sync(lambda b: b.next_lease_expiry()) is None
    early = database.write_sync(lambda b: claimed(b, agent="a", ttl=1_000))
    late = database.write_sync(lambda b: claimed(b, agent="a", ttl=5_000))
    assert database.read_sync(lambda b: b.next_lease_expiry()) == NOW + 1_000
    assert database.read_sync(lambda b: b.leases_of_agent("a")) == [early.run_id, late.run_id]
    assert database.read_sync(lambda b: b.leases_of_agent("b")) == []
    assert database.read_sync(lambda b: b.active_leases(NOW)) == 2
    assert database.read_sync(lambda b: b.active_leases(NOW + 1_000)) == 1
    assert database.write_sync(lambda b: b.expired_leases(NOW + 999, 10)) == []
    assert database.write_sync(lambda b: b.expired_leases(NOW + 1_000, 10)) == [
        (early.lease_id, early.run_id, early.task.id)
    ]
    both = database.write_sync(lambda b: b.expired_leases(NOW + 5_000, 10))
    assert [e[0] for e in both] == [early.lease_id, late.lease_id]  # the oldest first
    assert len(database.write_sync(lambda b: b.expired_leases(NOW + 5_000, 1))) == 1
    database.write_sync(lambda b: b.extend_lease(early.lease_id, NOW + 9_000, 8_000, NOW + 900))
    lease = database.read_sync(lambda b: b.lease_by_id(early.lease_id))
    assert (lease.expires_at_ms, lease.ttl_ms) == (NOW + 9_000, 8_000)
    assert database.read_sync(lambda b: b.next_lease_expiry()) == NOW + 5_000
    assert database.read_sync(lambda b: b.leases_of_agent("a")) == [late.run_id, early.run_id]
    assert database.write_sync(lambda b: b.rotate_lease_token(early.lease_id, b"n" * 32))
    assert database.read_sync(lambda b: b.lease_by_id(early.lease_id)).token_hash == b"n" * 32
    assert not database.write_sync(lambda b: b.rotate_lease_token("nope", b"n" * 32))


@covers("Backend.insert_event_under_lease", "Backend.insert_event", "Backend.list_events")
def test_an_event_under_a_lease_needs_its_token_its_time_and_its_fence(database: Database) -> None:
    one_task(database)
    got = database.write_sync(lambda b: claimed(b, ttl=1_000))
    token = got.token_hash

    def under(token_hash: bytes, fence: int | None, now: int = NOW) -> int | None:
        return database.write_sync(  # type: ignore[no-any-return]
            lambda b: b.insert_event_under_lease(got.run_id, token_hash, fence, "k", "{}", now)
        )

    first = under(token, None)
    second = under(token, 1)
    assert first is not None and second is not None and second > first
    assert under(b"x" * 32, None) is None  # another token
    assert under(token, 2) is None  # another fence
    assert under(token, None, NOW + 1_000) is None  # expired
    plain = database.write_sync(lambda b: b.insert_event(got.run_id, "note", '{"a":1}', NOW + 5))
    assert plain > second
    events = database.read_sync(lambda b: b.list_events(got.run_id, 0, 10))
    assert [(e.id, e.run_id, e.kind) for e in events] == [
        (first, got.run_id, "k"),
        (second, got.run_id, "k"),
        (plain, got.run_id, "note"),
    ]
    assert (events[2].ts_ms, json.loads(bytes(events[2].data))) == (NOW + 5, {"a": 1})
    assert [e.id for e in database.read_sync(lambda b: b.list_events(got.run_id, first, 1))] == [
        second
    ]


@covers(
    "Backend.failed_attempts",
    "Backend.previous_failures",
    "Backend.schedule_retry",
    "Backend.retry_waiting",
)
def test_failed_attempts_count_and_a_retry_waits_out_its_delay(database: Database) -> None:
    task_id = one_task(database)
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 0
    first = database.write_sync(lambda b: claimed(b))
    database.write_sync(lambda b: b.end_run(first.run_id, "failed", "{}", "boom", NOW + 1))
    database.write_sync(lambda b: b.delete_lease(first.lease_id))
    database.write_sync(lambda b: b.schedule_retry(task_id, NOW + 500, "boom", NOW + 1))
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert (task.next_eligible_at_ms, task.updated_at_ms) == (NOW + 500, NOW + 1)
    assert database.write_sync(lambda b: claim(b, now=NOW + 499)) is None
    waiting = database.read_sync(lambda b: b.retry_waiting(NOW + 2, 10))
    assert [
        (w.task_id, w.stage, w.next_eligible_at_ms, w.attempt, w.status, w.error, w.failed_at_ms)
        for w in waiting
    ] == [(task_id, "todo", NOW + 500, 1, "failed", "boom", NOW + 1)]
    assert database.read_sync(lambda b: b.retry_waiting(NOW + 500, 10)) == []
    second = database.write_sync(lambda b: claimed(b, now=NOW + 500))
    assert second.attempt == 2
    assert database.read_sync(lambda b: b.retry_waiting(NOW + 2, 10)) == []  # leased
    database.write_sync(lambda b: b.end_run(second.run_id, "stale", "{}", "lease_expired", NOW + 9))
    database.write_sync(lambda b: b.delete_lease(second.lease_id))
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 2
    failures = database.read_sync(lambda b: b.previous_failures(task_id))
    assert [(f.attempt, f.run_id, f.status, f.error, f.ended_at_ms) for f in failures] == [
        (2, second.run_id, "stale", "lease_expired", NOW + 9),
        (1, first.run_id, "failed", "boom", NOW + 1),
    ]
    assert len(database.read_sync(lambda b: b.previous_failures(task_id, 1))) == 1
    # A completed or released run is no failure.
    third = database.write_sync(lambda b: claimed(b, now=NOW + 500))
    database.write_sync(lambda b: b.end_run(third.run_id, "released", "{}", None, NOW + 10))
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 2


@covers(
    "Backend.dead_letter_task",
    "Backend.last_dead_letter",
    "Backend.requeue_task",
    "Backend.insert_event",
)
def test_a_dead_letter_parks_the_task_and_a_requeue_forgives_its_failures(
    database: Database,
) -> None:
    task_id = one_task(database, max_attempts=1, dead_letter_stage="dead")
    got = database.write_sync(lambda b: claimed(b))
    assert database.read_sync(lambda b: b.last_dead_letter(task_id)) is None

    def fail(b: Backend) -> None:
        b.end_run(got.run_id, "failed", "{}", "boom", NOW + 1)
        b.delete_lease(got.lease_id)
        b.dead_letter_task(task_id, "dead", 1, "max_attempts_exceeded", 2**62, "boom", NOW + 1)
        b.insert_event(got.run_id, "dead_letter", '{"from_stage":"todo"}', NOW + 1)

    database.write_sync(fail)
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert (task.stage, task.task_version, task.dead_letter_reason) == (
        "dead",
        2,
        "max_attempts_exceeded",
    )
    assert database.read_sync(lambda b: b.last_dead_letter(task_id)) == '{"from_stage":"todo"}'
    assert database.write_sync(lambda b: claim(b)) is None
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 1
    database.write_sync(lambda b: b.requeue_task(task_id, "todo", 1, True, NOW + 2))
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert (task.stage, task.task_version, task.dead_letter_reason) == ("todo", 3, None)
    assert (task.next_eligible_at_ms, task.updated_at_ms) == (0, NOW + 2)
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 0  # written off
    again = database.write_sync(lambda b: claimed(b, now=NOW + 3))
    assert (again.task.id, again.attempt) == (task_id, 2)
    database.write_sync(lambda b: b.end_run(again.run_id, "failed", "{}", "x", NOW + 4))
    database.write_sync(lambda b: b.requeue_task(task_id, "todo", 0, False, NOW + 5))
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 1  # kept


@covers("Backend.cancel_task", "Backend.task_cancellation", "Backend.requeue_task")
def test_a_cancel_happens_once_and_a_requeue_undoes_it(database: Database) -> None:
    task_id = one_task(database)
    assert database.read_sync(lambda b: b.task_cancellation(task_id)) == (None, None)
    assert database.write_sync(lambda b: b.cancel_task(task_id, "wrong plan", 2**62, NOW))
    assert not database.write_sync(lambda b: b.cancel_task(task_id, "twice", 2**62, NOW + 1))
    assert database.read_sync(lambda b: b.task_cancellation(task_id)) == (NOW, "wrong plan")
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert task.dead_letter_reason == "cancelled"
    details = database.read_sync(lambda b: b.task_details(task_id))
    assert details[3:] == (NOW, "wrong plan")
    assert database.write_sync(lambda b: claim(b)) is None
    database.write_sync(lambda b: b.requeue_task(task_id, "todo", 0, False, NOW + 2))
    assert database.read_sync(lambda b: b.task_cancellation(task_id)) == (None, None)
    assert database.write_sync(lambda b: claimed(b).task.id) == task_id


@covers("Backend.merge_checkpoint", "Backend.task_resume", "Backend.bump_fence")
def test_checkpoints_merge_as_rfc_7396_patches_and_come_back_with_the_next_claim(
    database: Database,
) -> None:
    """Folded from tests/postgres/test_merge_patch.py (merge_checkpoint against SQLite's
    json_patch there) and the contract suite's checkpoint test, on every backend."""
    task_id = one_task(database)
    assert database.read_sync(lambda b: b.task_resume(task_id)) == (None, 0)
    assert database.read_sync(lambda b: b.task_resume("nope")) is None
    patches: list[tuple[object, object]] = [
        (
            {"a": 1, "b": {"c": 2, "keep": True}, "list": [1, 2]},
            {"a": 1, "b": {"c": 2, "keep": True}, "list": [1, 2]},
        ),
        (
            {"b": {"c": None, "d": 3}, "list": [3], "a": None, "n": None},
            {"b": {"keep": True, "d": 3}, "list": [3]},
        ),
        (
            {"files": {"a.py": "done"}},
            {"b": {"keep": True, "d": 3}, "list": [3], "files": {"a.py": "done"}},
        ),
        ({"files": {"a.py": None}, "list": None}, {"b": {"keep": True, "d": 3}, "files": {}}),
    ]
    for patch, merged in patches:
        got = database.write_sync(lambda b, p=patch: b.merge_checkpoint(task_id, json.dumps(p)))
        assert json.loads(got) == merged
    checkpoint, fence = database.read_sync(lambda b: b.task_resume(task_id))
    assert (json.loads(checkpoint), fence) == (patches[-1][1], 0)
    fence, checkpoint = database.write_sync(lambda b: b.bump_fence(task_id))
    assert (fence, json.loads(checkpoint)) == (1, patches[-1][1])
    got = database.write_sync(lambda b: claimed(b))
    assert got.fence == 2 and json.loads(got.checkpoint) == patches[-1][1]
    assert database.read_sync(lambda b: b.task_details(task_id))[1:3] == (got.checkpoint, 2)


@covers("Backend.leased_in_stage", "Backend.leased_in_pipeline_stage")
def test_leased_tasks_are_counted_by_stage_and_by_pipeline_stage(database: Database) -> None:
    first, second = database.write_sync(lambda b: (make_pipeline(b), make_pipeline(b)))
    database.write_sync(lambda b: [make_task(b, p) for p in (first, first, second)])
    assert database.read_sync(lambda b: b.leased_in_stage("todo")) == 0
    database.write_sync(lambda b: claimed(b, full_pairs=((second, "todo"),)))
    database.write_sync(lambda b: claimed(b, full_pairs=((second, "todo"),)))
    got = database.write_sync(lambda b: claimed(b))
    assert database.read_sync(lambda b: b.leased_in_stage("todo")) == 3
    assert database.read_sync(lambda b: b.leased_in_stage("review")) == 0
    assert database.read_sync(lambda b: b.leased_in_pipeline_stage(first, "todo")) == 2
    assert database.read_sync(lambda b: b.leased_in_pipeline_stage(second, "todo")) == 1
    database.write_sync(lambda b: b.end_run(got.run_id, "released", "{}", None, NOW))
    assert database.read_sync(lambda b: b.leased_in_pipeline_stage(second, "todo")) == 0
    assert database.read_sync(lambda b: b.leased_in_stage("todo")) == 2


@covers("Backend.merge_checkpoint", "Backend.task_resume", "Backend.bump_fence")
def test_merge_checkpoint_folds_every_write_into_the_task(database: Database) -> None:
    """Moved from tests/postgres/test_merge_patch.py (which still checks PostgreSQL's
    jsonb_merge_patch against SQLite's json_patch), on every backend."""
    task_id = one_task(database)
    patches = [
        {"step": 1, "files": {"a.py": "done"}},
        {"files": {"b.py": "wip"}},
        {"files": {"a.py": None}, "step": 2},
        {"notes": ["x"]},
    ]
    steps = [
        {"step": 1, "files": {"a.py": "done"}},
        {"step": 1, "files": {"a.py": "done", "b.py": "wip"}},
        {"step": 2, "files": {"b.py": "wip"}},
        {"step": 2, "files": {"b.py": "wip"}, "notes": ["x"]},
    ]
    assert database.read_sync(lambda b: b.task_resume(task_id)) == (None, 0)
    for patch, expected in zip(patches, steps, strict=True):
        merged = database.write_sync(lambda b, p=patch: b.merge_checkpoint(task_id, json.dumps(p)))
        assert json.loads(merged) == expected
    fence, checkpoint = database.write_sync(lambda b: b.bump_fence(task_id))
    assert (json.loads(checkpoint), fence) == (steps[-1], 1)


@covers("Backend.held_by_agent")
def test_the_lease_an_agent_holds_is_the_latest_to_expire_with_its_hash_and_fence(
    database: Database,
) -> None:
    database.write_sync(lambda b: [make_task(b, make_pipeline(b)) for _ in range(2)])
    assert database.read_sync(lambda b: b.held_by_agent("a")) is None
    database.write_sync(lambda b: claimed(b, agent="a", ttl=1_000))
    late = database.write_sync(lambda b: claimed(b, agent="a", ttl=5_000))
    held = database.read_sync(lambda b: b.held_by_agent("a"))
    assert held is not None
    assert (held.id, held.run_id, held.task_id) == (late.lease_id, late.run_id, late.task.id)
    assert (held.token_hash, held.fence) == (late.token_hash, late.fence)
    assert held.expires_at_ms == NOW + 5_000
    assert database.read_sync(lambda b: b.held_by_agent("b")) is None
