"""Backend: the statements of one unit of work, as the service sees them.

Each method runs one named query (or a few, for the paging variants) inside the transaction
of the unit of work it was given to (storage.ports.Database.write/read). Methods are named
after their queries, take and return domain types, and raise our exceptions (StorageBusy,
StorageFull, StorageQueryError, DuplicateName, ...), never driver ones. Nothing here is a
dialect's: lists are lists (they go to both dialects' SQL as JSON arrays), search takes the
user's terms (each backend builds its own full-text query), and a uniqueness the data
guarantees is reported as the contract's error code.

The mapping from rows to domain types is written once, here. A backend supplies what is its
own: the query runner (`_all`, `_one`, `_exec`, `_insert` over its driver and its
queries.sql), the driver's error classes, how search terms become its full-text query, and
the few methods whose statements differ (each says why where it overrides). Implementations:
storage/sqlite/backend.py (SqliteBackend), storage/postgres/backend.py (PostgresBackend).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeGuard

import msgspec
from msgspec import Raw

from nulltickets import core
from nulltickets.domain.model import (
    Access,
    Artifact,
    Assignment,
    Dependency,
    Event,
    FailedTask,
    FailingTask,
    Failure,
    FailureGroup,
    FeedEvent,
    HeldLease,
    KeyInfo,
    LeaseRow,
    NamespaceSummary,
    Pipeline,
    RetryWaiting,
    Run,
    SearchHit,
    Span,
    SpanRow,
    StageCount,
    StoreEntry,
    Task,
    TaskEvent,
    TaskRun,
)
from nulltickets.errors import (
    DuplicateDependency,
    DuplicateName,
    StorageBusy,
    StorageQueryError,
    Unauthorized,
)

# (pipeline_id, stage, role (None: a stage without one that holds dead-lettered or cancelled
#  tasks), claimable, oldest claimable created_at_ms or None, leased, waiting on a retry delay,
#  blocked, dead-lettered, cancelled)
StageBoardRow = tuple[str, str, str | None, int, int | None, int, int, int, int, int]
# (role, claimable, oldest claimable created_at_ms or None, failed, stuck, near expiry)
QueueRow = tuple[str, int, int | None, int, int, int]


@dataclass(frozen=True, slots=True)
class Claimed:
    """What `Backend.claim` did: the task, the attempt its new run is, the fence the claim
    raised it to, its checkpoint JSON (or None), when the new lease expires and its TTL, and
    the earlier failed attempts (read only when this is not the first attempt)."""

    task: Task
    attempt: int
    fence: int
    checkpoint_json: str | None
    expires_at_ms: int
    ttl_ms: int
    previous_failures: list[Failure]


class Move(NamedTuple):
    """A move `Backend.transition_run` may make: a task of `pipeline_id` in `from_stage` goes
    to `to_stage`, its `transition` event carrying `data_json`. `frees_capacity`: the stage it
    leaves caps its leases (a policy's `max_concurrency`), so leaving it wakes a claim of the
    stage's role that the cap held back. A claim held back by its own per-state limits does
    not wait for that wake-up: its server tries it again each second (service/wakeups.py)."""

    pipeline_id: str
    from_stage: str
    to_stage: str
    data_json: str
    frees_capacity: bool = False


@dataclass(frozen=True, slots=True)
class Moved:
    """What `Backend.transition_run` did: the task of the pipeline moved from a stage to
    another; `notified` when it also sent the wake-ups of those stages and of the tasks that
    depend on it (else the caller does)."""

    pipeline_id: str
    task_id: str
    from_stage: str
    to_stage: str
    notified: bool


@dataclass(frozen=True, slots=True)
class Failed:
    """What `Backend.fail_run` did: the run of the task of the pipeline, in `stage`, ended
    failed (its `failed_attempts`-th); the task was dead-lettered (into `dead_letter_stage`,
    None: it stays in `stage`) or given a retry at `next_eligible_at_ms`. `notified` when the
    wake-ups went with it (else the caller sends them)."""

    pipeline_id: str
    task_id: str
    stage: str
    failed_attempts: int
    dead_lettered: bool
    dead_letter_stage: str | None
    next_eligible_at_ms: int
    notified: bool


@dataclass(frozen=True, slots=True)
class TaskView:
    """What `Backend.task_view` read of a task for GET /tasks/{id}: the task, its checkpoint
    JSON (or None), fence and cancellation (as task_details), its latest run (or None), its
    dependencies, assignments and previous failures."""

    task: Task
    checkpoint_json: str | None
    fence: int
    cancelled_at_ms: int | None
    cancel_reason: str | None
    latest_run: Run | None
    dependencies: list[Dependency]
    assignments: list[Assignment]
    previous_failures: list[Failure]


@dataclass(frozen=True, slots=True)
class Ended:
    """What `Backend.release_run` (or `release_agent`, for each lease) did: the run of the
    task of the pipeline, in `stage`, was released; `notified` when the wake-up of that stage
    went with it (else the caller sends it)."""

    pipeline_id: str
    task_id: str
    stage: str
    notified: bool


# What Backend.fail_run is given of a stage with a retry policy: (pipeline, stage, its
# retry_delay_ms or None, retry_backoff, retry_max_delay_ms or None, retry_jitter).
StagePolicyRow = tuple[str, str, int | None, float, int | None, float]
# The retry policy of a stage that sets none (fsm.NO_POLICY's).
_NO_RETRY_POLICY: tuple[int | None, float, int | None, float] = (None, 1.0, None, 0.0)


@dataclass(frozen=True, slots=True)
class NewTask:
    """A task to insert (`Backend.insert_task`, `Backend.create_task`): in its pipeline's
    `stage`, at `now`; `idempotency_key` unique in its pipeline; `retry_delay_set` when the
    retry delay was given rather than defaulted. The defaults are those of a task created
    with nothing but a title."""

    id: str
    pipeline_id: str
    stage: str
    title: str
    now: int
    description: str = ""
    priority: int = 0
    metadata_json: str = "{}"
    max_attempts: int | None = None
    retry_delay_ms: int = 0
    dead_letter_stage: str | None = None
    idempotency_key: str | None = None
    retry_delay_set: bool = False

    def params(self) -> dict[str, Any]:
        """The statement parameters of insert_task (and create_task)."""
        return {
            "id": self.id,
            "pipeline_id": self.pipeline_id,
            "stage": self.stage,
            "title": self.title,
            "description": self.description,
            "priority": self.priority,
            "metadata_json": self.metadata_json,
            "max_attempts": self.max_attempts,
            "retry_delay_ms": self.retry_delay_ms,
            "dead_letter_stage": self.dead_letter_stage,
            "idempotency_key": self.idempotency_key,
            "retry_delay_set": bool(self.retry_delay_set),
            "now": self.now,
        }


@dataclass(frozen=True, slots=True)
class NewPipeline:
    """`Backend.claim` chose a task of a pipeline the caller's limits were not read from (one
    created since): nothing was claimed; read the limits again and claim again."""

    pipeline_id: str


_MIN_TIME = -(2**63)
_MAX_TIME = 2**63 - 1
_encode = msgspec.json.encode


def ids_param(ids: Sequence[Any]) -> dict[str, str]:
    """The `:ids` parameter of the prune statements: the ids as one JSON array."""
    return {"ids": _encode(list(ids)).decode()}


def _task(row: Sequence[Any]) -> Task:
    (
        id_,
        pipeline_id,
        stage,
        title,
        description,
        priority,
        metadata,
        version,
        eligible,
        delay,
        max_attempts,
        dl_stage,
        dl_reason,
        created,
        updated,
    ) = row
    return Task(
        id_,
        pipeline_id,
        stage,
        title,
        description,
        priority,
        Raw(metadata),
        version,
        eligible,
        delay,
        max_attempts,
        dl_stage,
        dl_reason,
        created,
        updated,
    )


def _held(
    lease: LeaseRow | None, token_hash: bytes, fence: int | None, now: int
) -> TypeGuard[LeaseRow]:
    """The lease is there, held with `token_hash`, live at `now` and (when given) of `fence`."""
    return (
        lease is not None
        and hmac.compare_digest(bytes(lease.token_hash), token_hash)
        and lease.expires_at_ms > now
        and (fence is None or lease.fence == fence)
    )


def _run(row: Sequence[Any]) -> Run:
    return Run(*row)


def _failure_flags(states: frozenset[str]) -> dict[str, bool]:
    """The flags of list_failures and failure_groups: which kinds of failed task to read."""
    return {
        "dead": "dead_lettered" in states,
        "cancelled": "cancelled" in states,
        "failing": "failing" in states,
    }


def _keyset(after: tuple[int, str] | None, limit: int) -> dict[str, Any]:
    """The parameters of a page ordered by (created_at_ms, id), after the last one seen."""
    after_created, after_id = after if after is not None else (_MIN_TIME, "")
    return {"after_created": after_created, "after_id": after_id, "limit": limit}


class Backend:
    # --- what each backend supplies ------------------------------------------------------------

    # The driver's error for a violated unique constraint or primary key.
    _unique_violation: ClassVar[type[Exception]]
    # What a claim that lost the race for its task raises (the database may run it again).
    _claim_race: ClassVar[type[StorageBusy]] = StorageBusy
    # The driver's errors for a query the request made unreadable (a bad JSON path).
    _bad_query: ClassVar[tuple[type[Exception], ...]]

    def _all(self, name: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Every row of query `name`."""
        raise NotImplementedError

    def _one(self, name: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """The first row of query `name`, if any."""
        raise NotImplementedError

    def _exec(self, name: str, params: dict[str, Any]) -> int:
        """Run statement `name`; the number of rows it changed."""
        raise NotImplementedError

    def _insert(self, name: str, params: dict[str, Any]) -> int:
        """Run INSERT `name`; the id of the row it made."""
        raise NotImplementedError

    def _later(self, name: str, params: dict[str, Any]) -> None:
        """Statement `name`, whose result nothing reads, as the last of its unit of work: run
        here at once; a backend may send it with the unit's COMMIT (PostgreSQL)."""
        self._exec(name, params)

    def _search_text(self, terms: Sequence[str]) -> str:
        """The user's terms as this backend's full-text query, where no term is an operator."""
        raise NotImplementedError

    def _query_error(self, exc: Exception) -> str:
        """The message of a `_bad_query` error, for the client."""
        return str(exc)

    def _board_row(self, row: tuple[Any, ...]) -> StageBoardRow:
        """A row of stage_board (the backends' queries return its counts in two shapes)."""
        raise NotImplementedError

    def _queue_row(self, row: tuple[Any, ...]) -> QueueRow:
        """A row of role_stage_queue (the backends' queries return its counts in two shapes)."""
        raise NotImplementedError

    def engine(self) -> tuple[str, str, list[str]]:
        """(engine name, its version, the compile options we chose) for /health."""
        raise NotImplementedError

    def _value(self, name: str, params: dict[str, Any]) -> Any:
        row = self._one(name, params)
        return None if row is None else row[0]

    # --- pipelines -----------------------------------------------------------------------------

    def insert_pipeline(self, id: str, name: str, definition_json: str, now: int) -> None:
        """Raises DuplicateName if a pipeline of that name exists (a constraint of the data)."""
        params = {"id": id, "name": name, "definition_json": definition_json, "now": now}
        try:
            self._exec("insert_pipeline", params)
        except self._unique_violation:  # the pipeline's name is unique
            raise DuplicateName(f"a pipeline named {name!r} already exists") from None

    def insert_pipeline_stage(
        self, pipeline_id: str, stage: str, agent_role: str | None, terminal: bool
    ) -> None:
        self._exec(
            "insert_pipeline_stage",
            {
                "pipeline_id": pipeline_id,
                "stage": stage,
                "agent_role": agent_role,
                "terminal": bool(terminal),  # SQLite stores it as 0 or 1
            },
        )

    def get_pipeline(self, id: str) -> Pipeline | None:
        row = self._one("get_pipeline", {"id": id})
        return None if row is None else Pipeline(row[0], row[1], Raw(row[2]), row[3])

    def list_pipelines(self) -> list[Pipeline]:
        return [Pipeline(r[0], r[1], Raw(r[2]), r[3]) for r in self._all("list_pipelines")]

    # --- tasks ---------------------------------------------------------------------------------

    def insert_task(self, task: NewTask) -> bool:
        """Insert a task; False (nothing inserted) if the pipeline already has a task under
        its idempotency key (a unique constraint: concurrent creates insert one)."""
        # ON CONFLICT DO NOTHING on idx_tasks_idempotency_key (pipeline_id, idempotency_key).
        return self._exec("insert_task", task.params()) > 0

    def create_task(self, task: NewTask, wake_role: str | None) -> tuple[bool, bool]:
        """Everything a unit of work that creates one task writes: insert_task, and where the
        backend can, the wake-up of `wake_role` (the role of the task's stage, None for none)
        sent with it when the task was inserted. (inserted, whether that wake-up was sent).
        Composed here of insert_task alone, the wake-up left to the caller; PostgreSQL runs
        one statement (create_task) which, first in its unit of work, is that unit's own
        transaction: nothing may follow it."""
        return self.insert_task(task), False

    def get_task(self, id: str) -> Task | None:
        row = self._one("get_task", {"id": id})
        return None if row is None else _task(row)

    def task_details(self, id: str) -> tuple[Task, str | None, int, int | None, str | None] | None:
        """(task, checkpoint JSON or None, fence, cancelled_at_ms, cancel_reason): one trip."""
        row = self._one("task_details", {"id": id})
        if row is None:
            return None
        return _task(row[:15]), row[15], row[16], row[17], row[18]

    def task_view(self, id: str) -> TaskView | None:
        """Everything GET /tasks/{id} reads of the store, in one snapshot; None when there is
        no such task. Composed here of the statements it names; a backend may run it as one
        statement (PostgreSQL: task_view)."""
        details = self.task_details(id)
        if details is None:
            return None
        return TaskView(
            *details,
            latest_run=self.latest_run(id),
            dependencies=self.list_dependencies(id),
            assignments=self.list_assignments(id),
            previous_failures=self.previous_failures(id),
        )

    def task_exists(self, id: str) -> bool:
        return self._one("task_exists", {"id": id}) is not None

    def list_tasks(
        self,
        *,
        stage: str | None,
        pipeline_id: str | None,
        after: tuple[int, str] | None,
        limit: int,
        agent_role: str | None = None,
        text: str | None = None,
    ) -> list[Task]:
        """A page of tasks after `after` (created_at_ms, id); `text`: only those whose title or
        id holds it (any case)."""
        params = _keyset(after, limit)
        if text is not None:
            params.update(stage=stage, pipeline_id=pipeline_id, agent_role=agent_role, q=text)
            return [_task(r) for r in self._all("list_tasks_matching", params)]
        if agent_role is not None:
            params.update(agent_role=agent_role, stage=stage, pipeline_id=pipeline_id)
            return [_task(r) for r in self._all("list_tasks_by_role", params)]
        if stage is not None and pipeline_id is not None:
            name = "list_tasks_by_pipeline_and_stage"
        elif stage is not None:
            name = "list_tasks_by_stage"
        elif pipeline_id is not None:
            name = "list_tasks_by_pipeline"
        else:
            name = "list_tasks"
        if stage is not None:
            params["stage"] = stage
        if pipeline_id is not None:
            params["pipeline_id"] = pipeline_id
        return [_task(r) for r in self._all(name, params)]

    def task_run_state(self, id: str) -> str | None:
        value: str | None = self._value("task_run_state", {"id": id})
        return value

    def latest_run(self, task_id: str) -> Run | None:
        row = self._one("latest_run", {"task_id": task_id})
        return None if row is None else _run(row)

    def run_by_id(self, id: str) -> Run | None:
        row = self._one("run_by_id", {"id": id})
        return None if row is None else _run(row)

    def task_by_idempotency_key(self, pipeline_id: str, key: str) -> str | None:
        value: str | None = self._value(
            "task_by_idempotency_key", {"pipeline_id": pipeline_id, "idempotency_key": key}
        )
        return value

    def task_resume(self, id: str) -> tuple[str | None, int] | None:
        """(checkpoint JSON or None, fence) of a task."""
        row = self._one("task_resume", {"id": id})
        return None if row is None else (row[0], row[1])

    def task_checkpoint(self, id: str) -> tuple[str | None, int, list[Failure]] | None:
        """What GET /tasks/{id}/checkpoint reads, in one snapshot: (checkpoint JSON or None,
        fence) as task_resume, and previous_failures; None when there is no such task.
        Composed here of the statements it names; a backend may run it as one statement
        (PostgreSQL: task_checkpoint)."""
        resume = self.task_resume(id)
        if resume is None:
            return None
        return resume[0], resume[1], self.previous_failures(id)

    def list_task_runs(self, task_id: str, after: int, limit: int) -> list[TaskRun]:
        """The task's runs after attempt `after`, oldest first."""
        rows = self._all("list_task_runs", {"task_id": task_id, "after": after, "limit": limit})
        return [TaskRun(*r) for r in rows]

    def list_task_runs_newest(self, task_id: str, before: int, limit: int) -> list[TaskRun]:
        """The task's runs before attempt `before`, newest first."""
        params = {"task_id": task_id, "before": before, "limit": limit}
        return [TaskRun(*r) for r in self._all("list_task_runs_newest", params)]

    def retry_waiting(self, now: int, limit: int) -> list[RetryWaiting]:
        """Tasks waiting on a retry delay at `now`, soonest claimable first."""
        return [RetryWaiting(*r) for r in self._all("retry_waiting", {"now": now, "limit": limit})]

    def failing_tasks(
        self, since: int, min_failures: int, window: int, limit: int
    ) -> list[FailingTask]:
        """Tasks with `min_failures` or more failures in a row since `since` (among the newest
        `window` events), most failures first."""
        params = {"since": since, "min_failures": min_failures, "window": window, "limit": limit}
        return [FailingTask(*r) for r in self._all("failing_tasks", params)]

    def list_namespaces(self, after: str, limit: int) -> list[NamespaceSummary]:
        """The store's namespaces after `after`, by name."""
        rows = self._all("list_namespaces", {"after": after, "limit": limit})
        return [NamespaceSummary(r[0], int(r[1]), int(r[2])) for r in rows]

    def previous_failures(self, task_id: str, limit: int = 20) -> list[Failure]:
        rows = self._all("previous_failures", {"task_id": task_id, "limit": limit})
        return [Failure(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    def retry_delay_set(self, id: str) -> bool:
        return bool(self._value("retry_delay_set", {"id": id}))

    def bump_fence(self, id: str) -> tuple[int, str | None]:
        """Raise a task's fence; (the new fence, its checkpoint JSON or None)."""
        row = self._one("bump_fence", {"id": id})
        assert row is not None  # the claimed task exists in this transaction
        return int(row[0]), row[1]

    def task_fence_of_run(self, run_id: str) -> int | None:
        value: int | None = self._value("task_fence_of_run", {"run_id": run_id})
        return value

    def task_fence_of_lease(self, lease_id: str) -> int | None:
        value: int | None = self._value("task_fence_of_lease", {"lease_id": lease_id})
        return value

    def merge_checkpoint(self, id: str, patch_json: str) -> str:
        return str(self._value("merge_checkpoint", {"id": id, "patch": patch_json}))

    def leases_of_agent(self, agent_id: str) -> list[str]:
        return [r[0] for r in self._all("leases_of_agent", {"agent_id": agent_id})]

    def held_by_agent(self, agent_id: str) -> HeldLease | None:
        """The lease `agent_id` holds (the latest to expire, should it hold more), expired
        or not: the verbs under it say which."""
        row = self._one("held_by_agent", {"agent_id": agent_id})
        if row is None:
            return None
        return HeldLease(row[0], row[1], row[2], bytes(row[3]), int(row[4]), int(row[5]))

    def dependent_stages(self, id: str) -> list[tuple[str, str]]:
        return [(r[0], r[1]) for r in self._all("dependent_stages", {"id": id})]

    def leased_in_pipeline_stage(self, pipeline_id: str, stage: str) -> int:
        params = {"pipeline_id": pipeline_id, "stage": stage}
        return int(self._value("leased_in_pipeline_stage", params))

    def role_stages(self, agent_role: str) -> list[tuple[str, str]]:
        return [(r[0], r[1]) for r in self._all("role_stages", {"agent_role": agent_role})]

    # --- dependencies and assignments ----------------------------------------------------------

    def insert_dependency(self, task_id: str, depends_on_task_id: str, now: int) -> None:
        """Raises DuplicateDependency if the dependency exists (a constraint of the data)."""
        params = {"task_id": task_id, "depends_on_task_id": depends_on_task_id, "now": now}
        try:
            self._exec("insert_dependency", params)
        except self._unique_violation:  # PRIMARY KEY (task_id, depends_on_task_id)
            raise DuplicateDependency() from None

    def list_dependencies(self, task_id: str) -> list[Dependency]:
        rows = self._all("list_dependencies", {"task_id": task_id})
        return [Dependency(r[0], bool(r[1])) for r in rows]

    def deactivate_assignments(self, task_id: str, now: int) -> None:
        self._exec("deactivate_assignments", {"task_id": task_id, "now": now})

    def upsert_assignment(
        self, task_id: str, agent_id: str, assigned_by: str | None, now: int
    ) -> None:
        self._exec(
            "upsert_assignment",
            {"task_id": task_id, "agent_id": agent_id, "assigned_by": assigned_by, "now": now},
        )

    def unassign(self, task_id: str, agent_id: str, now: int) -> bool:
        params = {"task_id": task_id, "agent_id": agent_id, "now": now}
        return self._exec("unassign", params) > 0

    def list_assignments(self, task_id: str) -> list[Assignment]:
        rows = self._all("list_assignments", {"task_id": task_id})
        return [Assignment(r[0], r[1], r[2], bool(r[3]), r[4], r[5]) for r in rows]

    # --- leases and runs -----------------------------------------------------------------------

    def expired_leases(self, now: int, limit: int) -> list[tuple[str, str, str]]:
        """(lease id, run id, task id) of expired leases. A backend with concurrent writers
        locks them for this unit of work, and every other reaper skips them (SKIP LOCKED)."""
        rows = self._all("expired_leases", {"now": now, "limit": limit})
        return [(r[0], r[1], r[2]) for r in rows]

    def next_lease_expiry(self) -> int | None:
        value: int | None = self._value("next_lease_expiry", {})
        return value

    def leased_in_stage(self, stage: str) -> int:
        return int(self._value("leased_in_stage", {"stage": stage}))

    def claim_candidate(
        self,
        agent_role: str,
        agent_id: str,
        now: int,
        full_stages: Sequence[str] = (),
        full_pairs: Sequence[tuple[str, str]] = (),
    ) -> Task | None:
        """The best claimable task of the role, skipping the stages in `full_stages` and the
        (pipeline, stage) pairs in `full_pairs` (their concurrency limits are reached). A
        backend with concurrent writers locks the row it returns (FOR UPDATE SKIP LOCKED)."""
        # The lists go as JSON arrays (SQLite's json_each, PostgreSQL's jsonb); NULL (no list)
        # skips their tests altogether.
        params = {
            "agent_role": agent_role,
            "agent_id": agent_id,
            "full_stages": _encode(full_stages).decode() if full_stages else None,
            "full_pairs": _encode(full_pairs).decode() if full_pairs else None,
            "now": now,
        }
        row = self._one("claim_candidate", params)
        return None if row is None else _task(row)

    def claim(
        self,
        *,
        agent_role: str,
        agent_id: str,
        run_id: str,
        lease_id: str,
        token_hash: bytes,
        ttl_ms: int | None,
        stage_ttls: Sequence[tuple[str, str, int]],
        default_ttl_ms: int,
        full_stages: Sequence[str],
        capped: Sequence[tuple[str, str, int]],
        known_pipelines: frozenset[str] | None,
        now: int,
    ) -> Claimed | NewPipeline | None:
        """A whole claim: choose the best claimable task of the role (as claim_candidate,
        passing over `full_stages` and the (pipeline, stage, cap) of `capped` whose running
        runs reached their cap), start run `run_id` on it, raise its fence, and lease it as
        `lease_id` under `token_hash` for `ttl_ms` (None: the TTL `stage_ttls` gives its
        (pipeline, stage), else `default_ttl_ms`). None when nothing is claimable;
        NewPipeline, having claimed nothing, when the task's pipeline is not among
        `known_pipelines` (None: any pipeline will do). A claim that lost its task to another
        raises as insert_run does. Composed here of the statements it names; a backend may
        run it as one statement (PostgreSQL: claim_task)."""
        full_pairs = [
            (pipeline_id, stage)
            for pipeline_id, stage, cap in capped
            if self.leased_in_pipeline_stage(pipeline_id, stage) >= cap
        ]
        task = self.claim_candidate(agent_role, agent_id, now, full_stages, full_pairs)
        if task is None:
            return None
        if known_pipelines is not None and task.pipeline_id not in known_pipelines:
            return NewPipeline(task.pipeline_id)
        if ttl_ms is None:
            ttls = {(p, s): t for p, s, t in stage_ttls}
            ttl_ms = ttls.get((task.pipeline_id, task.stage), default_ttl_ms)
        attempt = self.insert_run(run_id, task.id, agent_id, agent_role, now, lease_id)
        fence, checkpoint_json = self.bump_fence(task.id)
        expires = now + ttl_ms
        self.insert_lease(
            id=lease_id,
            run_id=run_id,
            agent_id=agent_id,
            token_hash=token_hash,
            expires_at_ms=expires,
            ttl_ms=ttl_ms,
            fence=fence,
            now=now,
        )
        failures = self.previous_failures(task.id) if attempt > 1 else []
        return Claimed(task, attempt, fence, checkpoint_json, expires, ttl_ms, failures)

    def insert_run(
        self, id: str, task_id: str, agent_id: str, agent_role: str, now: int, lease_id: str
    ) -> int:
        """Insert a running run under `lease_id`; returns its attempt number. At most one run
        of a task is running (a unique constraint): a second raises StorageBusy (the claim
        lost a race and may simply be tried again)."""
        params = {
            "id": id,
            "task_id": task_id,
            "agent_id": agent_id,
            "agent_role": agent_role,
            "now": now,
            "lease_id": lease_id,
        }
        # The task has a running run already: SQLite refuses the row (idx_runs_running), the
        # PostgreSQL statement inserts nothing and returns no row (runs_one_running_per_task).
        try:
            row = self._one("insert_run", params)
        except self._unique_violation:
            row = None
        if row is None:
            raise self._claim_race("the task was claimed at the same moment; claim again")
        return int(row[0])

    def insert_lease(
        self,
        *,
        id: str,
        run_id: str,
        agent_id: str,
        token_hash: bytes,
        expires_at_ms: int,
        ttl_ms: int,
        fence: int,
        now: int,
    ) -> None:
        params = {
            "id": id,
            "run_id": run_id,
            "agent_id": agent_id,
            "token_hash": token_hash,
            "expires_at_ms": expires_at_ms,
            "ttl_ms": ttl_ms,
            "fence": fence,
            "now": now,
        }
        self._exec("insert_lease", params)

    def lease_by_run(self, run_id: str) -> LeaseRow | None:
        row = self._one("lease_by_run", {"run_id": run_id})
        return None if row is None else LeaseRow(*row)

    def lease_by_id(self, id: str) -> LeaseRow | None:
        row = self._one("lease_by_id", {"id": id})
        return None if row is None else LeaseRow(*row)

    def extend_lease(self, id: str, expires_at_ms: int, ttl_ms: int, now: int) -> None:
        self._exec(
            "extend_lease", {"id": id, "expires_at_ms": expires_at_ms, "ttl_ms": ttl_ms, "now": now}
        )

    def transition_run(
        self,
        *,
        run_id: str,
        token_hash: bytes,
        fence: int | None,
        expected_stage: str | None,
        expected_task_version: int | None,
        moves: Sequence[Move],
        usage_json: str,
        now: int,
    ) -> Moved | None:
        """A transition in one go: when run `run_id` is running under a live lease held with
        `token_hash` (with `fence`, when given), its task is in `expected_stage` at
        `expected_task_version` (each when given), and `moves` holds a Move for the task's
        pipeline and stage: complete the run with
        `usage_json`, move the task to that stage (its version raised), delete the lease and
        record the `transition` event with that data. None when any of that is not so, and
        nothing was changed (the caller finds out why). Composed here of the statements it
        names; a backend may run it as one statement (PostgreSQL: transition_run), which
        also sends the wake-ups of the stages concerned (Moved.notified)."""
        lease = self.lease_by_run(run_id)
        if (
            lease is None
            or not hmac.compare_digest(bytes(lease.token_hash), token_hash)
            or lease.expires_at_ms <= now
            or (fence is not None and lease.fence != fence)
            or lease.run_status != "running"
            or (expected_stage is not None and lease.stage != expected_stage)
            or (expected_task_version is not None and lease.task_version != expected_task_version)
        ):
            return None
        found = [m for m in moves if m[0] == lease.pipeline_id and m[1] == lease.stage]
        if not found:
            return None
        from_stage, to_stage, data_json = found[0].from_stage, found[0].to_stage, found[0].data_json
        # The lease is held and its run is running in this unit of work: neither can fail.
        if not self.end_run(run_id, "completed", usage_json, None, now):
            raise StorageBusy("the run ended at the same moment")
        if not self.move_task(lease.task_id, to_stage, lease.task_version, now):
            raise StorageBusy("the task moved at the same moment")
        self.delete_lease(lease.id)
        self.insert_event(run_id, "transition", data_json, now)
        return Moved(lease.pipeline_id, lease.task_id, from_stage, to_stage, notified=False)

    def checkpoint_run(
        self,
        run_id: str,
        token_hash: bytes,
        fence: int | None,
        patch_json: str,
        default_ttl_ms: int,
        now: int,
    ) -> tuple[str, int, int] | None:
        """A checkpoint in one go: when run `run_id` has a live lease held with `token_hash`
        (with `fence`, when given), merge the JSON object `patch_json` into its task's
        checkpoint (merge_checkpoint), extend the lease by its TTL (else `default_ttl_ms`) and
        record the `checkpoint` event of the patch. (The checkpoint merged, the lease's new
        expiry, its fence); None when the lease is not so, and nothing was changed (the
        caller finds out why). Composed here of the statements it names; a backend may run
        it as one statement (PostgreSQL: checkpoint_run)."""
        lease = self.lease_by_run(run_id)
        if (
            lease is None
            or not hmac.compare_digest(bytes(lease.token_hash), token_hash)
            or lease.expires_at_ms <= now
            or (fence is not None and lease.fence != fence)
        ):
            return None
        merged = self.merge_checkpoint(lease.task_id, patch_json)
        ttl = lease.ttl_ms or default_ttl_ms
        self.extend_lease(lease.id, now + ttl, ttl, now)
        self.insert_event(run_id, "checkpoint", patch_json, now)
        return merged, now + ttl, lease.fence

    def fail_run(
        self,
        *,
        run_id: str,
        token_hash: bytes,
        fence: int | None,
        usage_json: str,
        error: str | None,
        retryable: bool | None,
        known_pipelines: int,
        unreadable: Sequence[str],
        policies: Sequence[StagePolicyRow],
        rand: float,
        now: int,
    ) -> Failed | None:
        """A failed attempt in one go: when run `run_id` is running under a live lease held
        with `token_hash` (with `fence`, when given), there are `known_pipelines` pipelines
        (the caller read them all; `policies` are the retry policies of their stages that have
        one, the others have none) and the task's is not one of `unreadable` (whose definition
        could not be parsed): end the run failed with `usage_json` and `error`, delete
        the lease, and, by the task's retry policy (its max_attempts, retry delay and
        dead-letter stage; its stage's delay, backoff, cap and jitter, `rand` in [0, 1)
        placing the delay in the jitter; core.decide_failure), dead-letter the task (at once
        when `retryable` is false; into its dead-letter stage when that is a stage of its
        pipeline) or schedule its retry, and record the `dead_letter` or `retry_scheduled`
        event. None when any of that is not so, and nothing was changed (the caller finds out
        why). Composed here of the statements it names; a backend may run it as one statement
        (PostgreSQL: fail_run), which also sends the wake-ups (Failed.notified)."""
        lease = self.lease_by_run(run_id)
        if not _held(lease, token_hash, fence, now) or lease.run_status != "running":
            return None
        return self._fail_attempt(
            lease,
            status="failed",
            usage_json=usage_json,
            error=error,
            retryable=retryable,
            known_pipelines=known_pipelines,
            unreadable=unreadable,
            policies=policies,
            rand=rand,
            now=now,
        )

    def expire_lease(
        self,
        *,
        lease_id: str,
        known_pipelines: int,
        unreadable: Sequence[str],
        policies: Sequence[StagePolicyRow],
        rand: float,
        now: int,
    ) -> Failed | None:
        """The reaper's work on one lease in one go: when lease `lease_id` is past its time at
        `now` and its run is running, and the pipelines are as fail_run requires: end the run
        stale (error text "lease_expired"), delete the lease, record the `lease_expired`
        event (the lease and the failed attempts), then decide and record what fail_run does
        (the expiry counts as a failed attempt). None when any of that is not so, and nothing
        was changed (the reaper then goes step by step). Composed here of the statements it
        names; a backend may run it as one statement (PostgreSQL: expire_lease), which also
        sends the wake-ups (Failed.notified)."""
        lease = self.lease_by_id(lease_id)
        if lease is None or lease.expires_at_ms > now or lease.run_status != "running":
            return None
        return self._fail_attempt(
            lease,
            status="stale",
            usage_json="{}",
            error="lease_expired",
            retryable=None,
            known_pipelines=known_pipelines,
            unreadable=unreadable,
            policies=policies,
            rand=rand,
            now=now,
        )

    def _fail_attempt(
        self,
        lease: LeaseRow,
        *,
        status: str,
        usage_json: str,
        error: str | None,
        retryable: bool | None,
        known_pipelines: int,
        unreadable: Sequence[str],
        policies: Sequence[StagePolicyRow],
        rand: float,
        now: int,
    ) -> Failed | None:
        """fail_run and expire_lease after their lease's checks: the run ended `status`
        (stale: an expiry, recorded as the `lease_expired` event first), and the decision."""
        if self._value("pipeline_count", {}) != known_pipelines:
            return None  # one the caller has not read: its policies are not in `policies`
        if lease.pipeline_id in unreadable:
            return None
        run_id, stage = lease.run_id, lease.stage
        found = [p[2:] for p in policies if p[0] == lease.pipeline_id and p[1] == stage]
        stage_delay, backoff, max_delay_ms, jitter = found[0] if found else _NO_RETRY_POLICY
        task = self.get_task(lease.task_id)
        assert task is not None  # the lease's task, in this unit of work
        # The lease is checked and its run is running in this unit of work: the end cannot fail.
        if not self.end_run(run_id, status, usage_json, error, now):
            raise StorageBusy("the run ended at the same moment")
        self.delete_lease(lease.id)
        failed = self.failed_attempts(task.id)
        if status == "stale":
            expired = {"reason": "lease_expired", "lease_id": lease.id, "failed_attempts": failed}
            self.insert_event(run_id, "lease_expired", _encode(expired).decode(), now)
        # The task's own retry delay wins; the stage's applies when the task set none; the
        # default backoff when neither did (None).
        base: int | None = task.retry_delay_ms
        if not (base or self.retry_delay_set(task.id)):
            base = stage_delay
        allowed = 0 if retryable is False else task.max_attempts
        if allowed is not None and failed >= allowed:
            target = task.dead_letter_stage
            if target is not None and not self._value(
                "pipeline_has_stage", {"pipeline_id": lease.pipeline_id, "stage": target}
            ):
                target = None  # not a stage of the task's pipeline: it stays where it is
            reason = "not_retryable" if retryable is False else "max_attempts_exceeded"
            self.dead_letter_task(
                task.id,
                stage=target if target is not None else stage,
                version_bump=1 if target is not None else 0,
                reason=reason,
                next_eligible_at_ms=core.DEAD_LETTER_ELIGIBLE_AT,
                error=error,
                now=now,
            )
            data: dict[str, Any] = {
                "reason": reason,
                "failed_attempts": failed,
                "from_stage": stage,
                "dead_letter_stage": target,
            }
            self.insert_event(run_id, "dead_letter", _encode(data).decode(), now)
            parked = core.DEAD_LETTER_ELIGIBLE_AT
            return Failed(lease.pipeline_id, task.id, stage, failed, True, target, parked, False)
        if base is None:
            delay = core.default_retry_delay(failed, rand)
        else:
            delay = core.retry_delay(
                base,
                backoff=backoff,
                max_delay_ms=max_delay_ms,
                jitter=jitter,
                failed_attempts=failed,
                rand=rand,
            )
        at = max(0, min(now + delay, _MAX_TIME))
        self.schedule_retry(task.id, at, error, now)
        data = {
            "reason": "retry_scheduled",
            "failed_attempts": failed,
            "retry_delay_ms": delay,
            "next_eligible_at_ms": at,
        }
        self.insert_event(run_id, "retry_scheduled", _encode(data).decode(), now)
        return Failed(lease.pipeline_id, task.id, stage, failed, False, None, at, False)

    def release_run(
        self, *, run_id: str, token_hash: bytes, fence: int | None, reason: str | None, now: int
    ) -> Ended | None:
        """A release in one go: when run `run_id` is running under a live lease held with
        `token_hash` (with `fence`, when given): end the run released (its error text
        `reason`), delete the lease and record the `released` event (the reason, else
        "released", and the lease's agent): the task is claimable again at once. None when
        any of that is not so, and nothing was changed (the caller finds out why). Composed
        here of the statements it names; a backend may run it as one statement (PostgreSQL:
        release_run), which also sends the wake-up of the task's stage (Ended.notified)."""
        lease = self.lease_by_run(run_id)
        if not _held(lease, token_hash, fence, now) or lease.run_status != "running":
            return None
        return self._release(lease, reason, now)

    def release_agent(self, *, agent_id: str, reason: str, now: int) -> list[tuple[str, Ended]]:
        """Every live lease `agent_id` holds released in one go, in order of expiry: for each,
        what release_run does (its run ended released with error text `reason`, the lease
        deleted, the `released` event with `reason` and the agent). (run id, what ended) of
        each. Composed here of the statements it names; a backend may run it as one statement
        (PostgreSQL: release_agent), which also sends the wake-ups (Ended.notified)."""
        released: list[tuple[str, Ended]] = []
        for run_id in self.leases_of_agent(agent_id):
            lease = self.lease_by_run(run_id)
            if lease is None or lease.expires_at_ms <= now or lease.run_status != "running":
                continue
            released.append((run_id, self._release(lease, reason, now)))
        return released

    def _release(self, lease: LeaseRow, reason: str | None, now: int) -> Ended:
        """Release `lease`, live and its run running in this unit of work (so the end cannot
        fail): the run ended released (error text `reason`), the lease deleted, the
        `released` event (the reason, else "released", and the lease's agent)."""
        if not self.end_run(lease.run_id, "released", "{}", reason, now):
            raise StorageBusy("the run ended at the same moment")
        self.delete_lease(lease.id)
        data = {"reason": reason or "released", "agent_id": lease.agent_id}
        self.insert_event(lease.run_id, "released", _encode(data).decode(), now)
        return Ended(lease.pipeline_id, lease.task_id, lease.stage, False)

    def extend_held_lease(
        self,
        id: str,
        token_hash: bytes,
        fence: int | None,
        ttl_ms: int | None,
        default_ttl_ms: int,
        now: int,
    ) -> int | None:
        """A heartbeat in one statement: extend lease `id`, only if it is held with
        `token_hash`, is live at `now` and (when given) still has `fence`, by `ttl_ms` (None:
        its own TTL, else `default_ttl_ms`), which becomes its TTL. The new expiry, or None
        when one of those failed (nothing changed; the caller finds out which)."""
        params = {
            "id": id,
            "token_hash": token_hash,
            "fence": fence,
            "ttl_ms": ttl_ms,
            "default_ttl_ms": default_ttl_ms,
            "key_id": None,  # confirm_key checked it (a backend may put it here instead)
            "now": now,
        }
        value: int | None = self._value("extend_held_lease", params)
        return value

    def rotate_lease_token(self, id: str, token_hash: bytes) -> bool:
        return self._exec("rotate_lease_token", {"id": id, "token_hash": token_hash}) > 0

    def delete_lease(self, id: str) -> None:
        self._exec("delete_lease", {"id": id})

    def insert_event(self, run_id: str, kind: str, data_json: str, now: int) -> int:
        params = {"run_id": run_id, "kind": kind, "data_json": data_json, "now": now}
        return self._insert("insert_event", params)

    def insert_event_under_lease(
        self,
        run_id: str,
        token_hash: bytes,
        fence: int | None,
        kind: str,
        data_json: str,
        now: int,
    ) -> int | None:
        """Insert the event only if the run's live lease matches; its id, or None."""
        value: int | None = self._value(
            "insert_event_under_lease",
            {
                "run_id": run_id,
                "token_hash": token_hash,
                "fence": fence,
                "kind": kind,
                "data_json": data_json,
                "key_id": None,  # confirm_key checked it (a backend may put it here instead)
                "now": now,
            },
        )
        return value

    def list_events(self, run_id: str, after_id: int, limit: int) -> list[Event]:
        rows = self._all("list_events", {"run_id": run_id, "after_id": after_id, "limit": limit})
        return [Event(r[0], r[1], r[2], r[3], Raw(r[4])) for r in rows]

    def events_feed(self, after_id: int, limit: int, task_id: str | None = None) -> list[FeedEvent]:
        """Run events after `after_id` of every run (or of one task's runs), oldest first."""
        params = {"after_id": after_id, "limit": limit, "task_id": task_id}
        return [
            FeedEvent(r[0], r[1], r[2], r[3], r[4], r[5], Raw(r[6]))
            for r in self._all("events_feed", params)
        ]

    def last_event_id(self) -> int:
        return int(self._value("last_event_id", {}))

    def event_kinds_since(self, after_id: int) -> list[tuple[str, int, int]]:
        """(kind, count, newest id) of the run events after `after_id`."""
        rows = self._all("event_kinds_since", {"after_id": after_id})
        return [(str(k), int(n), int(m)) for k, n, m in rows]

    def stage_board(self, now: int) -> list[StageBoardRow]:
        """Per (pipeline, stage) with a role, then per stage without one that holds
        dead-lettered or cancelled tasks (role None): (pipeline_id, stage, role, claimable,
        oldest claimable created_at_ms, leased, delayed, blocked, dead-lettered, cancelled)."""
        return [self._board_row(r) for r in self._all("stage_board", {"now": now})]

    def transitions_since(self, since: int, window: int) -> list[tuple[int, int]]:
        """(minute since `since`, transitions) among the newest `window` events."""
        rows = self._all("transitions_since", {"since": since, "window": window})
        return [(int(m), int(n)) for m, n in rows]

    def end_run(
        self, id: str, status: str, usage_json: str, error_text: str | None, now: int
    ) -> bool:
        params = {
            "id": id,
            "status": status,
            "usage_json": usage_json,
            "error_text": error_text,
            "now": now,
        }
        return self._exec("end_run", params) > 0

    def move_task(self, id: str, stage: str, task_version: int, now: int) -> bool:
        params = {"id": id, "stage": stage, "task_version": task_version, "now": now}
        return self._exec("move_task", params) > 0

    def failed_attempts(self, task_id: str) -> int:
        return int(self._value("failed_attempts", {"task_id": task_id}))

    def schedule_retry(
        self, id: str, next_eligible_at_ms: int, error: str | None, now: int
    ) -> None:
        """After a failed attempt that reported `error`: claimable again from the time given."""
        params = {"id": id, "next_eligible_at_ms": next_eligible_at_ms, "error": error, "now": now}
        self._exec("schedule_retry", params)

    def dead_letter_task(
        self,
        id: str,
        stage: str,
        version_bump: int,
        reason: str,
        next_eligible_at_ms: int,
        error: str | None,
        now: int,
    ) -> None:
        self._exec(
            "dead_letter_task",
            {
                "id": id,
                "stage": stage,
                "version_bump": version_bump,
                "reason": reason,
                "next_eligible_at_ms": next_eligible_at_ms,
                "error": error,
                "now": now,
            },
        )

    def cancel_task(self, id: str, reason: str | None, next_eligible_at_ms: int, now: int) -> bool:
        """Cancel a task that is not cancelled yet; False if it already was."""
        params = {
            "id": id,
            "reason": reason,
            "next_eligible_at_ms": next_eligible_at_ms,
            "now": now,
        }
        return self._exec("cancel_task", params) > 0

    def requeue_task(
        self, id: str, stage: str, version_bump: int, reset_attempts: bool, now: int
    ) -> None:
        params = {
            "id": id,
            "stage": stage,
            "version_bump": version_bump,
            "reset": bool(reset_attempts),
            "now": now,
        }
        self._exec("requeue_task", params)

    def task_cancellation(self, id: str) -> tuple[int | None, str | None]:
        """(cancelled_at_ms, cancel_reason) of a task; both None if it is not cancelled."""
        row = self._one("task_cancellation", {"id": id})
        return (None, None) if row is None else (row[0], row[1])

    def live_lease_of_task(self, task_id: str) -> tuple[str, str, int] | None:
        """(lease id, run id, expires_at_ms) of the task's running run, if it has one."""
        row = self._one("live_lease_of_task", {"task_id": task_id})
        return None if row is None else (row[0], row[1], row[2])

    def run_status(self, id: str) -> str | None:
        value: str | None = self._value("run_status", {"id": id})
        return value

    def run_status_of_lease(self, lease_id: str) -> str | None:
        value: str | None = self._value("run_status_of_lease", {"lease_id": lease_id})
        return value

    def last_dead_letter(self, task_id: str) -> str | None:
        """The data JSON of the task's latest dead_letter event, if any."""
        value: str | None = self._value("last_dead_letter", {"task_id": task_id})
        return value

    def insert_task_event(self, task_id: str, kind: str, data_json: str, now: int) -> int:
        params = {"task_id": task_id, "kind": kind, "data_json": data_json, "now": now}
        return self._insert("insert_task_event", params)

    def list_task_events(self, task_id: str, after_id: int, limit: int) -> list[TaskEvent]:
        params = {"task_id": task_id, "after_id": after_id, "limit": limit}
        rows = self._all("list_task_events", params)
        return [TaskEvent(r[0], r[1], r[2], r[3], Raw(r[4])) for r in rows]

    # --- artifacts -----------------------------------------------------------------------------

    def insert_artifact(
        self,
        *,
        id: str,
        task_id: str | None,
        run_id: str | None,
        kind: str,
        uri: str,
        sha256: str | None,
        size_bytes: int | None,
        meta_json: str,
        now: int,
    ) -> None:
        params = {
            "id": id,
            "task_id": task_id,
            "run_id": run_id,
            "kind": kind,
            "uri": uri,
            "sha256": sha256,
            "size_bytes": size_bytes,
            "meta_json": meta_json,
            "now": now,
        }
        self._exec("insert_artifact", params)

    def run_exists(self, id: str) -> bool:
        return self._one("run_exists", {"id": id}) is not None

    def list_artifacts(
        self,
        *,
        task_id: str | None,
        run_id: str | None,
        after: tuple[int, str] | None,
        limit: int,
    ) -> list[Artifact]:
        params = {"task_id": task_id, "run_id": run_id, **_keyset(after, limit)}
        rows = self._all("list_artifacts", params)
        return [Artifact(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], Raw(r[8])) for r in rows]

    # --- store ---------------------------------------------------------------------------------

    def put_value(self, namespace: str, key: str, value_json: str, now: int) -> None:
        self._exec(
            "put_value", {"namespace": namespace, "key": key, "value_json": value_json, "now": now}
        )

    def get_value(self, namespace: str, key: str) -> StoreEntry | None:
        row = self._one("get_value", {"namespace": namespace, "key": key})
        return None if row is None else StoreEntry(row[0], row[1], Raw(row[2]), row[3], row[4])

    def delete_value(self, namespace: str, key: str) -> None:
        self._exec("delete_value", {"namespace": namespace, "key": key})

    def list_namespace(self, namespace: str) -> list[StoreEntry]:
        rows = self._all("list_namespace", {"namespace": namespace})
        return [StoreEntry(r[0], r[1], Raw(r[2]), r[3], r[4]) for r in rows]

    def delete_namespace(self, namespace: str) -> None:
        self._exec("delete_namespace", {"namespace": namespace})

    def search_store(
        self,
        terms: Sequence[str],
        namespace: str | None,
        filter_path: str | None,
        filter_value: str | None,
        limit: int,
    ) -> list[SearchHit]:
        """Values matching every one of `terms` (the user's words, none empty: the backend
        builds its own full-text query, where no term is an operator), best first, each with
        a score (lower is better) and a snippet marking the matches with [ and ]. A bad
        `filter_path` raises StorageQueryError."""
        params = {
            "query": self._search_text(terms),
            "namespace": namespace,
            "filter_path": filter_path,
            "filter_value": filter_value,
            "limit": limit,
        }
        try:
            rows = self._all("search_store", params)
        except self._bad_query as exc:  # e.g. a malformed JSON path from the request
            raise StorageQueryError(self._query_error(exc)) from None
        return [
            SearchHit(r[0], r[1], Raw(r[2]), r[3], r[4], score=float(r[5]), snippet=r[6])
            for r in rows
        ]

    def parked_totals(self) -> tuple[int, int]:
        """(dead-lettered, cancelled) tasks in every pipeline and stage."""
        row = self._one("parked_totals", {})
        return (0, 0) if row is None else (int(row[0] or 0), int(row[1] or 0))

    def list_failures(
        self,
        *,
        states: frozenset[str],
        pipeline_id: str | None,
        error: str | None,
        before: tuple[int, str] | None,
        limit: int,
    ) -> list[FailedTask]:
        """Tasks in `states` (of dead_lettered, cancelled, failing), newest `at_ms` first,
        strictly before `before` (at_ms, id)."""
        before_at, before_id = before if before is not None else (_MAX_TIME, "")
        params = {
            **_failure_flags(states),
            "pipeline_id": pipeline_id,
            "error": error,
            "before_at": before_at,
            "before_id": before_id,
            "limit": limit,
        }
        return [
            FailedTask(
                id=r[0],
                pipeline_id=r[1],
                stage=r[2],
                title=r[3],
                priority=r[4],
                state=r[5],
                at_ms=r[6],
                failed_at_ms=r[7],
                last_error=r[8],
                # A cancel parks a task under the reason "cancelled": that is no dead letter.
                dead_letter_reason=None if r[9] == "cancelled" else r[9],
                cancelled_at_ms=r[10],
                cancel_reason=r[11],
                next_eligible_at_ms=r[12],
                failures=int(r[13]),
                leased=bool(r[14]),
            )
            for r in self._all("list_failures", params)
        ]

    def failure_groups(
        self, *, states: frozenset[str], pipeline_id: str | None, limit: int
    ) -> list[FailureGroup]:
        """The tasks in `states` grouped by state and last error, the largest groups first."""
        params = {**_failure_flags(states), "pipeline_id": pipeline_id, "limit": limit}
        return [
            FailureGroup(r[0], r[1] or None, int(r[2]), int(r[3]), int(r[4]))
            for r in self._all("failure_groups", params)
        ]

    def role_stage_queue(
        self, now: int, stuck_before: int, near_expiry_before: int
    ) -> list[QueueRow]:
        """Per (pipeline, stage) that names a role: (role, claimable, oldest claimable
        created_at_ms, failed, stuck, near expiry)."""
        params = {
            "now": now,
            "stuck_before": stuck_before,
            "near_expiry_before": near_expiry_before,
        }
        return [self._queue_row(r) for r in self._all("role_stage_queue", params)]

    def queue_counts(
        self, now: int, stuck_before: int, near_expiry_before: int
    ) -> tuple[list[QueueRow], int, int]:
        """What GET /ops/queue reads of the store, in one snapshot: role_stage_queue's rows,
        then parked_totals' dead-lettered and cancelled tasks. Composed here of those two; a
        backend may run it as one statement (PostgreSQL: queue_counts)."""
        rows = self.role_stage_queue(now, stuck_before, near_expiry_before)
        dead, cancelled = self.parked_totals()
        return rows, dead, cancelled

    # --- traces --------------------------------------------------------------------------------

    def insert_otlp_batch(
        self,
        content_type: str,
        payload_json: str | None,
        payload_blob: bytes | None,
        parsed_spans: int,
        now: int,
    ) -> int:
        params = {
            "content_type": content_type,
            "payload_json": payload_json,
            "payload_blob": payload_blob,
            "parsed_spans": parsed_spans,
            "now": now,
        }
        return self._insert("insert_otlp_batch", params)

    def insert_otlp_span(self, batch_id: int, span: SpanRow) -> None:
        self._exec("insert_otlp_span", {"batch_id": batch_id, **msgspec.structs.asdict(span)})

    def list_run_spans(self, run_id: str, after_id: int, limit: int) -> list[Span]:
        rows = self._all("list_run_spans", {"run_id": run_id, "after_id": after_id, "limit": limit})
        return [
            Span(
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                r[5],
                r[6],
                r[7],
                r[8],
                r[9],
                r[10],
                r[11],
                r[12],
                r[13],
                r[14],
                Raw(r[15]),
                Raw(r[16]),
            )
            for r in rows
        ]

    # --- health --------------------------------------------------------------------------------

    def tasks_by_stage(self) -> list[StageCount]:
        return [StageCount(r[0], int(r[1])) for r in self._all("tasks_by_stage")]

    def active_leases(self, now: int) -> int:
        return int(self._value("active_leases", {"now": now}))

    def health_counts(self, now: int) -> tuple[list[StageCount], int]:
        """What GET /health reads of the store, in one snapshot: the tasks per stage
        (tasks_by_stage) and the live leases (active_leases). Composed here of those two; a
        backend may run it as one statement (PostgreSQL: health_counts)."""
        return self.tasks_by_stage(), self.active_leases(now)

    # --- idempotency ---------------------------------------------------------------------------

    def get_idempotency(
        self, key: str, method: str, path: str
    ) -> tuple[bytes, bytes | None, int, str] | None:
        """(request hash, auth hash, status, body) recorded under the key, if any. The first
        statement of an idempotent unit of work: a backend with concurrent writers holds the
        key until the unit commits (PostgreSQL: lock_idempotency_key), so that concurrent
        requests under one key run once and the others replay its answer."""
        row = self._one("get_idempotency", {"key": key, "method": method, "path": path})
        return None if row is None else (row[0], row[1], row[2], row[3])

    def put_idempotency(
        self,
        *,
        key: str,
        method: str,
        path: str,
        request_hash: bytes,
        auth_hash: bytes | None,
        status: int,
        body: str,
        now: int,
    ) -> None:
        params = {
            "key": key,
            "method": method,
            "path": path,
            "request_hash": request_hash,
            "auth_hash": auth_hash,
            "status": status,
            "body": body,
            "now": now,
        }
        self._later("put_idempotency", params)

    def purge_idempotency(self, before: int) -> int:
        return self._exec("purge_idempotency", {"before": before})

    # --- retention (service/retention.py) -----------------------------------------------------

    def try_prune_lock(self) -> bool:
        """Whether this unit of work may prune: a backend shared by servers lets one at a time
        (PostgreSQL: an advisory lock held until the unit ends). One writer needs none."""
        return True

    def prune_candidates(
        self, before: int, after: tuple[int, str], limit: int
    ) -> list[tuple[str, int]]:
        """(id, created_at_ms) of up to `limit` finished tasks last changed before `before`,
        in (created_at_ms, id) order after `after`; on a backend shared by servers, locked."""
        params = {"before": before, "after_created": after[0], "after_id": after[1], "limit": limit}
        return [(str(r[0]), int(r[1])) for r in self._all("prune_candidates", params)]

    def prune_export(self, ids: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
        """Every row `prune_tasks(ids)` deletes (and those that go with them), as (table, row
        by column name), parents before children."""
        params = ids_param(ids)
        found: list[tuple[str, dict[str, Any]]] = []
        for table, name in _TASK_EXPORTS:
            found.extend((table, row) for row in self._rows(name, params))
        return found

    def prune_tasks(self, ids: Sequence[str]) -> dict[str, int]:
        """Delete the tasks `ids` and their history: leases, runs (with their usage), run
        events, artifacts, spans, task events, dependencies (either way) and assignments.
        Rows deleted, by table (PRUNE_COUNTED)."""
        raise NotImplementedError

    def prune_span_batches(
        self, before: int, after: tuple[int, int], limit: int
    ) -> list[tuple[int, int]]:
        """(id, received_at_ms) of up to `limit` OTLP batches received before `before`, in
        that order after `after`."""
        params = {"before": before, "after_at": after[0], "after_id": after[1], "limit": limit}
        return [(int(r[0]), int(r[1])) for r in self._all("prune_span_batches", params)]

    def prune_spans(
        self, batch_ids: Sequence[int], *, export: bool = False
    ) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, int]]:
        """Delete the spans of those batches that belong to no task or run still kept (spans
        of unknown or pruned tasks), then the batches left without a span. Returns the rows
        deleted as prune_export gives them (when `export`; else []) and the count by table."""
        params = ids_param(batch_ids)
        spans: list[tuple[str, dict[str, Any]]] = []
        batches: list[tuple[str, dict[str, Any]]] = []
        if export:
            spans = [("otlp_spans", r) for r in self._rows("prune_export_loose_spans", params)]
        span_count = self._exec("prune_delete_loose_spans", params)
        if export:
            batches = [
                ("otlp_batches", r) for r in self._rows("prune_export_empty_batches", params)
            ]
        batch_count = self._exec("prune_delete_empty_batches", params)
        # A batch before its spans, in the order a restore writes them.
        return batches + spans, {"otlp_spans": span_count, "otlp_batches": batch_count}

    def prune_idempotency(self, before: int, limit: int) -> int:
        """Delete up to `limit` recorded answers older than `before`; how many."""
        return self._exec("prune_idempotency", {"before": before, "limit": limit})

    def free_pages(self) -> tuple[int, int, bool] | None:
        """(pages on the free list, pages in the file, whether the file gives free pages back
        to the file system) where the backend's database is one file; None otherwise."""
        return None

    def give_back_pages(self, pages: int) -> None:
        """Give up to `pages` free pages back to the file system (SQLite's incremental vacuum);
        nothing on a backend that manages its own space."""

    def _rows(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        """The query's rows as dicts by column name (for exports of whole rows)."""
        raise NotImplementedError

    # --- keys ----------------------------------------------------------------------------------

    def insert_api_key(
        self, *, id: str, key_hash: bytes, name: str, access: str, roles: list[str], now: int
    ) -> None:
        params = {
            "id": id,
            "key_hash": key_hash,
            "name": name,
            "access": access,
            "roles_json": _encode(roles).decode(),
            "now": now,
        }
        self._exec("insert_api_key", params)

    def api_key_by_hash(self, key_hash: bytes) -> KeyInfo | None:
        row = self._one("api_key_by_hash", {"key_hash": key_hash})
        return None if row is None else _key(row)

    def api_key_by_id(self, id: str) -> KeyInfo | None:
        row = self._one("api_key_by_id", {"id": id})
        return None if row is None else _key(row)

    def confirm_key(self, key_id: str) -> None:
        """This unit of work acts for key `key_id`, which must still exist (another server may
        have revoked it): Unauthorized when it does not, before anything is changed. A backend
        may check it with the unit's first statement instead of one of its own (PostgreSQL:
        each statement of PostgresBackend.ALONE refuses to change anything without the key)."""
        if self.api_key_by_id(key_id) is None:
            raise Unauthorized("the key was revoked")

    def list_api_keys(self) -> list[KeyInfo]:
        return [_key(r) for r in self._all("list_api_keys")]

    def delete_api_key(self, id: str) -> KeyInfo | None:
        """Delete the key; what it was, or None if there was none."""
        row = self._one("delete_api_key", {"id": id})
        return None if row is None else _key(row)


_roles = msgspec.json.Decoder(list[str])

# What prune_export reads, in the order a restore writes it: (table, query).
_TASK_EXPORTS = (
    ("tasks", "prune_export_tasks"),
    ("task_dependencies", "prune_export_dependencies"),
    ("task_assignments", "prune_export_assignments"),
    ("task_events", "prune_export_task_events"),
    ("runs", "prune_export_runs"),
    ("events", "prune_export_events"),
    ("artifacts", "prune_export_artifacts"),
    ("otlp_spans", "prune_export_spans"),
)
# What prune_tasks counts: a finished run's lease is gone already (a leftover is no history),
# and the task events, dependencies and assignments that go with a task are not counted.
PRUNE_COUNTED = ("events", "artifacts", "otlp_spans", "runs", "tasks")


def _key(row: Sequence[Any]) -> KeyInfo:
    id_, name, access, roles_json, created = row
    return KeyInfo(id_, name, Access(access), _roles.decode(roles_json), created)
