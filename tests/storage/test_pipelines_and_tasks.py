"""Pipelines, tasks, dependencies, assignments and task events through the storage port."""

from __future__ import annotations

import msgspec
import pytest

from nulltickets.errors import DuplicateDependency, DuplicateName
from nulltickets.storage.backend import Backend, NewTask
from nulltickets.storage.ports import Database
from tests.storage.ops import NOW, claimed, covers, make_pipeline, make_task


@covers(
    "Backend.insert_pipeline",
    "Backend.insert_pipeline_stage",
    "Backend.get_pipeline",
    "Backend.list_pipelines",
    "Backend.role_stages",
)
def test_a_pipeline_is_stored_with_its_stages_and_found_by_role(database: Database) -> None:
    def job(b: Backend) -> tuple[str, str]:
        first = make_pipeline(b, "coder", name="first", now=NOW)
        second = make_pipeline(b, "coder", name="second", now=NOW + 1)
        return first, second

    first, second = database.write_sync(job)
    got = database.read_sync(lambda b: b.get_pipeline(first))
    assert got is not None and (got.id, got.name, got.created_at_ms) == (first, "first", NOW)
    assert bytes(got.definition) == b"{}"
    assert database.read_sync(lambda b: b.get_pipeline("nope")) is None
    listed = database.read_sync(lambda b: b.list_pipelines())
    assert sorted(p.name for p in listed) == ["first", "second"]
    roles = database.read_sync(lambda b: sorted(b.role_stages("coder")))
    assert roles == sorted([(first, "todo"), (second, "todo")])
    assert database.read_sync(lambda b: b.role_stages("reviewer")) != []
    assert database.read_sync(lambda b: b.role_stages("nobody")) == []


@covers("Backend.insert_pipeline")
def test_pipeline_names_are_unique_in_the_data(database: Database) -> None:
    database.write_sync(lambda b: make_pipeline(b, name="taken"))
    with pytest.raises(DuplicateName):
        database.write_sync(lambda b: make_pipeline(b, name="taken"))
    assert [p.name for p in database.read_sync(lambda b: b.list_pipelines())] == ["taken"]


@covers(
    "Backend.insert_task",
    "Backend.get_task",
    "Backend.task_exists",
    "Backend.task_details",
    "Backend.retry_delay_set",
)
def test_a_task_is_stored_as_written(database: Database) -> None:
    def job(b: Backend) -> str:
        pipeline_id = make_pipeline(b)
        return make_task(
            b,
            pipeline_id,
            title="Write it",
            description="all of it",
            priority=3,
            metadata_json='{"a":[1,2]}',
            max_attempts=4,
            retry_delay_ms=250,
            retry_delay_set=True,
            dead_letter_stage="dead",
        )

    task_id = database.write_sync(job)
    task = database.read_sync(lambda b: b.get_task(task_id))
    assert task is not None
    assert (task.stage, task.title, task.description, task.priority) == (
        "todo",
        "Write it",
        "all of it",
        3,
    )
    assert msgspec.json.decode(task.metadata) == {"a": [1, 2]}
    assert (task.task_version, task.next_eligible_at_ms) == (1, 0)
    assert (task.retry_delay_ms, task.max_attempts, task.dead_letter_stage) == (250, 4, "dead")
    assert (task.dead_letter_reason, task.created_at_ms, task.updated_at_ms) == (None, NOW, NOW)
    details = database.read_sync(lambda b: b.task_details(task_id))
    assert details == (task, None, 0, None, None)
    assert database.read_sync(lambda b: b.task_exists(task_id))
    assert not database.read_sync(lambda b: b.task_exists("nope"))
    assert database.read_sync(lambda b: b.get_task("nope")) is None
    assert database.read_sync(lambda b: b.task_details("nope")) is None
    assert database.read_sync(lambda b: b.retry_delay_set(task_id))
    other = database.write_sync(lambda b: make_task(b, task.pipeline_id))
    assert not database.read_sync(lambda b: b.retry_delay_set(other))


@covers("Backend.create_task")
def test_creating_a_task_inserts_what_insert_task_does_and_may_send_its_wake_up(
    database: Database, backend: str
) -> None:
    """create_task, the whole of POST /tasks's unit of work (on PostgreSQL one statement that
    commits itself): the task as insert_task writes it; nothing under a taken idempotency
    key; a wake-up sent only where the backend sends it with the insert (PostgreSQL), for a
    task inserted and a role given."""
    pipeline_id = database.write_sync(lambda b: make_pipeline(b))

    def new(id: str, key: str | None = None) -> NewTask:
        return NewTask(
            id=id,
            pipeline_id=pipeline_id,
            stage="todo",
            title=f"t {id}",
            description="d",
            priority=2,
            metadata_json='{"k":1}',
            max_attempts=3,
            retry_delay_ms=10,
            dead_letter_stage="dead",
            idempotency_key=key,
            retry_delay_set=True,
            now=NOW,
        )

    sends = backend == "postgresql"
    assert database.write_sync(lambda b: b.create_task(new("a", "k"), "coder")) == (True, sends)
    assert database.write_sync(lambda b: b.create_task(new("b", "k"), "coder")) == (False, False)
    assert database.write_sync(lambda b: b.create_task(new("c"), None)) == (True, False)
    assert database.write_sync(lambda b: b.insert_task(new("d")))
    assert database.read_sync(lambda b: b.task_by_idempotency_key(pipeline_id, "k")) == "a"
    assert database.read_sync(lambda b: b.task_exists("b")) is False
    created, inserted = database.read_sync(lambda b: (b.get_task("c"), b.get_task("d")))
    assert created is not None and inserted is not None
    assert msgspec.structs.replace(created, id="d", title="t d") == inserted
    assert database.read_sync(lambda b: b.retry_delay_set("c"))


@covers("Backend.insert_task", "Backend.task_by_idempotency_key")
def test_an_idempotency_key_names_one_task_per_pipeline(database: Database) -> None:
    first, second = database.write_sync(lambda b: (make_pipeline(b), make_pipeline(b)))
    task = database.write_sync(lambda b: make_task(b, first, idempotency_key="k"))

    def again(b: Backend, pipeline_id: str) -> bool:
        task = NewTask("another", pipeline_id, "todo", "t", NOW, idempotency_key="k")
        return b.insert_task(task)

    assert database.write_sync(lambda b: again(b, first)) is False  # the key is taken
    assert database.read_sync(lambda b: b.task_by_idempotency_key(first, "k")) == task
    assert database.read_sync(lambda b: b.task_exists("another")) is False
    assert database.write_sync(lambda b: again(b, second)) is True  # another pipeline
    assert database.read_sync(lambda b: b.task_by_idempotency_key(second, "k")) == "another"
    assert database.read_sync(lambda b: b.task_by_idempotency_key(first, "nope")) is None
    # No key: no limit.
    assert database.write_sync(lambda b: make_task(b, first) != make_task(b, first))


@covers("Backend.list_tasks")
def test_tasks_are_listed_in_pages_by_every_filter(database: Database) -> None:
    def job(b: Backend) -> tuple[str, str, list[str], list[str]]:
        one = make_pipeline(b, "coder")
        two = make_pipeline(b, "writer")
        mine = [make_task(b, one, title=f"Alpha {i}", now=NOW + i) for i in range(3)]
        mine.append(make_task(b, one, title="beta", stage="review", now=NOW + 3))
        theirs = [make_task(b, two, title=f"ALPHA {i}", now=NOW + 10 + i) for i in range(2)]
        return one, two, mine, theirs

    one, two, mine, theirs = database.write_sync(job)

    def ids(**kw: object) -> list[str]:
        params: dict[str, object] = {"stage": None, "pipeline_id": None, "after": None}
        params |= {"limit": 100, **kw}
        return [t.id for t in database.read_sync(lambda b: b.list_tasks(**params))]

    assert ids() == mine + theirs
    assert ids(limit=2) == mine[:2]
    first_two = database.read_sync(
        lambda b: b.list_tasks(stage=None, pipeline_id=None, after=None, limit=2)
    )
    last = first_two[-1]
    assert ids(after=(last.created_at_ms, last.id)) == mine[2:] + theirs
    assert ids(stage="review") == mine[3:]
    assert ids(pipeline_id=two) == theirs
    assert ids(stage="todo", pipeline_id=one) == mine[:3]
    assert ids(stage="todo", pipeline_id=two) == theirs
    assert ids(agent_role="writer") == theirs
    assert ids(agent_role="reviewer") == mine[3:]
    assert ids(agent_role="coder", stage="review") == []
    assert ids(agent_role="coder", pipeline_id=one, limit=1) == mine[:1]
    assert ids(text="alpha") == mine[:3] + theirs  # any case
    assert ids(text="alpha", pipeline_id=two, limit=1) == theirs[:1]
    assert ids(text=mine[3][-8:]) == mine[3:]  # a part of its id
    assert ids(text="alpha", agent_role="writer", stage="todo") == theirs
    assert ids(text="nothing") == []


@covers(
    "Backend.insert_dependency",
    "Backend.list_dependencies",
    "Backend.dependent_stages",
)
def test_a_dependency_is_recorded_once_and_resolves_when_its_task_finishes(
    database: Database,
) -> None:
    def job(b: Backend) -> tuple[str, str, str]:
        pipeline_id = make_pipeline(b)
        return make_task(b, pipeline_id), make_task(b, pipeline_id), pipeline_id

    a, upstream, pipeline_id = database.write_sync(job)
    database.write_sync(lambda b: b.insert_dependency(a, upstream, NOW))
    with pytest.raises(DuplicateDependency):
        database.write_sync(lambda b: b.insert_dependency(a, upstream, NOW + 1))
    deps = database.read_sync(lambda b: b.list_dependencies(a))
    assert [(d.depends_on_task_id, d.resolved) for d in deps] == [(upstream, False)]
    assert database.read_sync(lambda b: b.list_dependencies(upstream)) == []
    assert database.read_sync(lambda b: b.dependent_stages(upstream)) == [(pipeline_id, "todo")]
    assert database.read_sync(lambda b: b.dependent_stages(a)) == []
    assert database.write_sync(lambda b: b.move_task(upstream, "done", 1, NOW + 2))
    deps = database.read_sync(lambda b: b.list_dependencies(a))
    assert [(d.depends_on_task_id, d.resolved) for d in deps] == [(upstream, True)]


@covers(
    "Backend.upsert_assignment",
    "Backend.list_assignments",
    "Backend.deactivate_assignments",
    "Backend.unassign",
)
def test_assignments_are_made_moved_and_ended(database: Database) -> None:
    task_id = database.write_sync(lambda b: make_task(b, make_pipeline(b)))
    database.write_sync(lambda b: b.upsert_assignment(task_id, "ann", "lead", NOW))
    got = database.read_sync(lambda b: b.list_assignments(task_id))
    assert [(a.task_id, a.agent_id, a.assigned_by, a.active) for a in got] == [
        (task_id, "ann", "lead", True)
    ]
    assert (got[0].created_at_ms, got[0].updated_at_ms) == (NOW, NOW)

    def reassign(b: Backend) -> None:
        b.deactivate_assignments(task_id, NOW + 1)
        b.upsert_assignment(task_id, "bob", None, NOW + 1)

    database.write_sync(reassign)
    got = database.read_sync(lambda b: b.list_assignments(task_id))
    assert sorted((a.agent_id, a.active) for a in got) == [("ann", False), ("bob", True)]
    assert database.write_sync(lambda b: b.unassign(task_id, "bob", NOW + 2))
    assert not database.write_sync(lambda b: b.unassign(task_id, "bob", NOW + 3))  # done once
    assert not database.write_sync(lambda b: b.unassign(task_id, "carl", NOW + 3))
    got = database.read_sync(lambda b: b.list_assignments(task_id))
    assert not any(a.active for a in got)
    database.write_sync(lambda b: b.upsert_assignment(task_id, "ann", "lead2", NOW + 4))
    got = database.read_sync(lambda b: b.list_assignments(task_id))
    ann = [a for a in got if a.agent_id == "ann"]
    assert len(ann) == 1 and ann[0].active and ann[0].assigned_by == "lead2"


@covers("Backend.claim_candidate", "Backend.insert_dependency", "Backend.upsert_assignment")
def test_blocked_and_assigned_tasks_wait_for_their_turn(database: Database) -> None:
    """Moved from tests/postgres/test_claims.py, on every backend."""

    def job(b: Backend) -> tuple[str, str, str]:
        pipeline_id = make_pipeline(b)
        upstream = make_task(b, pipeline_id, now=1)
        blocked = make_task(b, pipeline_id, now=2)
        mine = make_task(b, pipeline_id, now=3)
        b.insert_dependency(blocked, upstream, 3)
        b.upsert_assignment(mine, "me", None, 3)
        return upstream, blocked, mine

    upstream, blocked, mine = database.write_sync(job)
    assert database.read_sync(lambda b: b.list_assignments(mine))[0].active is True
    assert database.write_sync(lambda b: claimed(b, agent="other").task.id) == upstream
    # blocked waits for its dependency, mine is not theirs
    assert database.write_sync(lambda b: b.claim_candidate("coder", "other", NOW)) is None
    assert database.write_sync(lambda b: claimed(b, agent="me").task.id) == mine
    assert database.write_sync(lambda b: b.move_task(upstream, "done", 1, NOW))
    deps = database.read_sync(lambda b: b.list_dependencies(blocked))
    assert [(d.depends_on_task_id, d.resolved) for d in deps] == [(upstream, True)]
    assert database.write_sync(lambda b: claimed(b, agent="other").task.id) == blocked
    queue = database.read_sync(lambda b: b.role_stage_queue(NOW, NOW, NOW + 60_000))
    # (role, claimable, oldest claimable, failed, stuck, near expiry): the two left are leased
    assert [r for r in queue if r[0] == "coder"] == [("coder", 0, None, 0, 2, 2)]


@covers("Backend.insert_task_event", "Backend.list_task_events")
def test_task_events_are_listed_in_order_after_an_id(database: Database) -> None:
    task_id = database.write_sync(lambda b: make_task(b, make_pipeline(b)))

    def job(b: Backend) -> list[int]:
        return [b.insert_task_event(task_id, f"k{i}", f'{{"n":{i}}}', NOW + i) for i in range(3)]

    ids = database.write_sync(job)
    assert ids == sorted(ids) and len(set(ids)) == 3
    events = database.read_sync(lambda b: b.list_task_events(task_id, 0, 10))
    assert [(e.id, e.task_id, e.ts_ms, e.kind) for e in events] == [
        (ids[i], task_id, NOW + i, f"k{i}") for i in range(3)
    ]
    assert msgspec.json.decode(events[2].data) == {"n": 2}
    assert [e.id for e in database.read_sync(lambda b: b.list_task_events(task_id, ids[0], 1))] == [
        ids[1]
    ]
    assert database.read_sync(lambda b: b.list_task_events("nope", 0, 10)) == []
