"""The service: one async method per API verb, each one unit of work on the database.

`Service` owns the unit of work: it runs each verb's statements in one transaction of the
`Database` (storage.ports), reads the injected clock once per unit, records and replays
idempotent answers inside that same transaction, and tells the `Notifier` which roles may
have work. `Tracker` holds the rules a unit of work applies, given the unit's `Backend` and
its time: decisions come from `core`, rows from the backend. Nothing here knows HTTP, SQL or
which backend it runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

import msgspec

from nulltickets import __version__, core, otlp
from nulltickets.domain import fsm
from nulltickets.domain.clock import Clock, Random, system_random, wall_ms
from nulltickets.domain.commands import (
    MAX_BULK_IDS,
    AppendEvent,
    Assign,
    CancelTask,
    CancelTasks,
    Claim,
    CreateArtifact,
    CreateKey,
    CreatePipeline,
    CreateTask,
    FailRun,
    Heartbeat,
    MoveTask,
    PutValue,
    ReleaseRun,
    RequeueTask,
    RequeueTasks,
    WriteCheckpoint,
    compact_json,
)
from nulltickets.domain.ids import new_id
from nulltickets.domain.model import (
    Access,
    AgentReleased,
    Artifact,
    Assignment,
    AvailableTransition,
    BulkOutcome,
    CheckpointResult,
    ClaimedTask,
    ClaimResult,
    CreatedKey,
    Dependency,
    Event,
    FailedTask,
    FailingReport,
    FailureGroups,
    FeedEvent,
    Health,
    KeyInfo,
    LeaseRow,
    NamespaceSummary,
    OutcomeError,
    Pipeline,
    QueueReport,
    Released,
    RetryReport,
    RoleQueue,
    Run,
    RunStatus,
    SearchHit,
    Span,
    SpanRow,
    StageQueue,
    StageReport,
    StoreEntry,
    Task,
    TaskAssignment,
    TaskCheckpoint,
    TaskDetails,
    TaskEvent,
    TaskOutcome,
    TaskRun,
    TraceIngest,
    TransitionResult,
)
from nulltickets.domain.search import search_terms
from nulltickets.domain.tokens import (
    api_key_hash,
    looks_like_api_key,
    new_api_key,
    new_lease_token,
    same_hash,
)
from nulltickets.errors import (
    DependencyTaskNotFound,
    DuplicateDependency,
    IdempotencyConflict,
    InvalidDependency,
    InvalidJson,
    InvalidPipeline,
    InvalidQuery,
    InvalidRequest,
    InvalidRetryPolicy,
    InvalidStage,
    LeaseExpired,
    LeaseNotFound,
    LeaseSuperseded,
    MissingParam,
    NotFound,
    PipelineNotFound,
    ReservedNamespace,
    RunNotFound,
    RunNotRunning,
    StorageQueryError,
    TaskCancelled,
    TaskFinished,
    TaskLeased,
    TaskNotFound,
    TaskVersionMismatch,
    TrackerError,
    Unauthorized,
)
from nulltickets.storage.backend import Backend, StageBoardRow
from nulltickets.storage.ports import Database, Notifier, StorageStats

RESERVED_NAMESPACE = "search"
IDEMPOTENCY_RETENTION_MS = 24 * 3600 * 1000
# The dashboard's throughput looks at this many of the newest run events at most.
THROUGHPUT_WINDOW = 200_000
REAP_BATCH = 500
_NEVER = 2**63 - 1
# With several servers on one database, another server's claims may create leases that expire
# before the earliest one this process knows of: then `_next_expiry` is trusted for at most
# this long (claims reap at least once per horizon; the janitor reaps on its own timer).
SHARED_REAP_HORIZON_MS = 1000

_encode = msgspec.json.encode

T = TypeVar("T")


def _json(value: Any) -> str:
    return _encode(value).decode()


class Tracker:
    """The rules of every verb, inside one unit of work (a `Backend` and its time).

    Caches, and why each is safe with several processes on one database: parsed pipeline
    definitions and their transitions (a definition never changes once created); each role's
    capped stages (`_capped`, rebuilt when a claim meets a pipeline it was not built with);
    and `_next_expiry`, a lower bound of the live leases' expiry that lets claims skip the
    reaper (this process's claims lower it; on a database shared by servers it is trusted for
    SHARED_REAP_HORIZON_MS at most). A cache a rolled-back batch leaves too low costs one
    extra reap; none can make a decision wrong, since every transition is guarded in the data.
    """

    def __init__(
        self,
        notifier: Notifier | None = None,
        rand: Random = system_random,
        *,
        shared: bool = False,
    ) -> None:
        self._notifier = notifier
        self._rand = rand
        self._shared = shared
        self._pipelines: dict[str, fsm.Pipeline | None] = {}
        self._transitions: dict[tuple[str, str], list[AvailableTransition]] = {}
        self._lock = threading.Lock()
        self._next_expiry = 0  # 0: unknown
        # Per role: the pipelines it was built from, and (pipeline, stage, max_concurrency) of
        # the stages with a limit.
        self._capped: dict[str, tuple[frozenset[str], list[tuple[str, str, int]]]] = {}

    @property
    def _listening(self) -> bool:
        return self._notifier is not None and self._notifier.listening

    def _signal(
        self, b: Backend, pipeline_id: str, stage: str, at: int = 0, agent: str | None = None
    ) -> None:
        """One piece of work in the stage may be claimable at `at` (0: now), by `agent` only
        when given: it wakes one waiting claim of the stage's role (http/wakeups.py)."""
        notifier = self._notifier
        if notifier is None or (at == 0 and not notifier.listening):
            return
        pipeline = self._definition(b, pipeline_id)
        state = pipeline.states.get(stage) if pipeline is not None else None
        if state is not None and state.agent_role is not None:
            notifier.notify(b, state.agent_role, at, agent)

    # --- pipelines -----------------------------------------------------------------------------

    def _definition(self, b: Backend, pipeline_id: str) -> fsm.Pipeline | None:
        """Parsed definition of an existing pipeline; None if it is unknown or unparsable."""
        cached = self._pipelines.get(pipeline_id, False)
        if cached is not False:
            return cached  # type: ignore[return-value]
        row = b.get_pipeline(pipeline_id)
        if row is None:
            return None
        try:
            parsed = fsm.load_definition(msgspec.json.decode(row.definition))
        except msgspec.DecodeError:
            parsed = None
        with self._lock:
            self._pipelines[pipeline_id] = parsed
        return parsed

    def create_pipeline(self, b: Backend, cmd: CreatePipeline, now: int) -> str:
        definition_json = compact_json(cmd.definition, None)
        if definition_json is None:
            raise InvalidPipeline("invalid pipeline definition: $ must be an object")
        pipeline = fsm.parse_definition(json.loads(definition_json))
        pipeline_id = new_id()
        b.insert_pipeline(pipeline_id, cmd.name, definition_json, now)  # DuplicateName
        for state in pipeline.states.values():
            b.insert_pipeline_stage(pipeline_id, state.name, state.agent_role, state.terminal)
        self._capped.clear()
        return pipeline_id

    def get_pipeline(self, b: Backend, pipeline_id: str) -> Pipeline:
        pipeline = b.get_pipeline(pipeline_id)
        if pipeline is None:
            raise NotFound("pipeline not found")
        return pipeline

    def list_pipelines(self, b: Backend) -> list[Pipeline]:
        return b.list_pipelines()

    # --- tasks ---------------------------------------------------------------------------------

    def create_task(
        self, b: Backend, cmd: CreateTask, now: int, where: str = "$.retry_policy"
    ) -> str:
        if b.get_pipeline(cmd.pipeline_id) is None:
            raise PipelineNotFound(f"pipeline {cmd.pipeline_id!r} not found")
        pipeline = self._definition(b, cmd.pipeline_id)
        if pipeline is None:
            raise TrackerError("the pipeline's stored definition cannot be read")
        policy = cmd.retry_policy
        dead_letter = policy.dead_letter_stage if policy is not None else None
        if dead_letter is not None and dead_letter not in pipeline.states:
            raise InvalidRetryPolicy(
                f"{where}.dead_letter_stage {dead_letter!r} is not a stage of the pipeline "
                f"(its stages: {', '.join(pipeline.states)})"
            )
        task_id = new_id()
        inserted = b.insert_task(
            id=task_id,
            pipeline_id=cmd.pipeline_id,
            stage=pipeline.initial,
            title=cmd.title,
            description=cmd.description,
            priority=cmd.priority or 0,
            metadata_json=compact_json(cmd.metadata, "{}") or "{}",
            max_attempts=policy.max_attempts if policy else None,
            retry_delay_ms=(policy.retry_delay_ms or 0) if policy else 0,
            dead_letter_stage=policy.dead_letter_stage if policy else None,
            idempotency_key=cmd.idempotency_key,
            retry_delay_set=policy is not None and policy.retry_delay_ms is not None,
            now=now,
        )
        if not inserted and cmd.idempotency_key is not None:
            # The same plan again (the pipeline's idempotency keys are unique in the data,
            # so concurrent creates insert one task): the task is already there.
            existing = b.task_by_idempotency_key(cmd.pipeline_id, cmd.idempotency_key)
            if existing is not None:
                return existing
            raise TrackerError("a task under this idempotency key could not be read")
        seen: set[str] = set()
        for dep in cmd.dependencies or ():
            if not b.task_exists(dep):
                raise TaskNotFound(f"dependency task {dep!r} not found")
            if dep in seen:
                raise DuplicateDependency(f"dependency {dep!r} listed twice")
            seen.add(dep)
            b.insert_dependency(task_id, dep, now)
        if cmd.assigned_agent_id is not None:
            b.deactivate_assignments(task_id, now)
            b.upsert_assignment(task_id, cmd.assigned_agent_id, cmd.assigned_by, now)
        self._signal(b, cmd.pipeline_id, pipeline.initial, agent=cmd.assigned_agent_id)
        return task_id

    def create_tasks(self, b: Backend, cmds: list[CreateTask], now: int) -> list[str]:
        return [
            self.create_task(b, cmd, now, f"$.tasks[{i}].retry_policy")
            for i, cmd in enumerate(cmds)
        ]

    def _available(self, b: Backend, task: Task) -> list[AvailableTransition]:
        """The transitions out of the task's stage (built once per pipeline and stage: a
        definition never changes, and responses only encode the list)."""
        key = (task.pipeline_id, task.stage)
        found = self._transitions.get(key)
        if found is None:
            pipeline = self._definition(b, task.pipeline_id)
            if pipeline is None:
                return []
            found = [
                AvailableTransition(t.trigger, t.to_stage, list(t.required_gates))
                for t in pipeline.transitions_from(task.stage)
            ]
            with self._lock:
                self._transitions[key] = found
        return found

    def get_task(self, b: Backend, task_id: str) -> TaskDetails:
        row = b.task_details(task_id)
        if row is None:
            raise TaskNotFound()
        task, checkpoint, fence, cancelled_at, cancel_reason = row
        latest = b.latest_run(task_id)
        details = TaskDetails(
            **msgspec.structs.asdict(task),
            dependencies=b.list_dependencies(task_id),
            assignments=[
                TaskAssignment(
                    a.agent_id, a.assigned_by, a.active, a.created_at_ms, a.updated_at_ms
                )
                for a in b.list_assignments(task_id)
            ],
            available_transitions=self._available(b, task),
        )
        details.checkpoint = msgspec.Raw(checkpoint if checkpoint is not None else "null")
        details.fence = fence
        details.previous_failures = b.previous_failures(task_id)
        if latest is not None:
            details.latest_run = latest
        if cancelled_at is not None:
            details.cancelled_at_ms, details.cancel_reason = cancelled_at, cancel_reason
        return details

    @staticmethod
    def _resume(b: Backend, task_id: str) -> tuple[msgspec.Raw, int]:
        row = b.task_resume(task_id)
        if row is None:
            return msgspec.Raw(b"null"), 0
        checkpoint, fence = row
        return msgspec.Raw(checkpoint if checkpoint is not None else "null"), fence

    def get_checkpoint(self, b: Backend, task_id: str) -> TaskCheckpoint:
        if not b.task_exists(task_id):
            raise TaskNotFound()
        checkpoint, fence = self._resume(b, task_id)
        return TaskCheckpoint(task_id, checkpoint, fence, b.previous_failures(task_id))

    def list_tasks(
        self,
        b: Backend,
        *,
        stage: str | None,
        pipeline_id: str | None,
        after: tuple[int, str] | None,
        limit: int,
        agent_role: str | None = None,
        text: str | None = None,
    ) -> tuple[list[Task], str | None]:
        rows = b.list_tasks(
            stage=stage,
            pipeline_id=pipeline_id,
            after=after,
            limit=limit + 1,
            agent_role=agent_role,
            text=text or None,
        )
        return _page(rows, limit, lambda t: f"{t.created_at_ms}:{t.id}")

    def list_task_runs(
        self, b: Backend, task_id: str, cursor: int | None, limit: int, newest_first: bool
    ) -> tuple[list[TaskRun], str | None]:
        """A page of the task's runs, oldest attempt first (the runs after attempt `cursor`)
        or newest first (the runs before it)."""
        if not b.task_exists(task_id):
            raise TaskNotFound()
        if newest_first:
            before = _NEVER if cursor is None else cursor
            rows = b.list_task_runs_newest(task_id, before, limit + 1)
        else:
            rows = b.list_task_runs(task_id, cursor or 0, limit + 1)
        return _page(rows, limit, lambda r: str(r.attempt))

    def run_state(self, b: Backend, task_id: str) -> str:
        run_id = b.task_run_state(task_id)
        if run_id is None:
            if not b.task_exists(task_id):
                raise TaskNotFound()
            raise NotFound("task has no run state")
        return run_id

    def add_dependency(self, b: Backend, task_id: str, depends_on: str, now: int) -> None:
        if task_id == depends_on:
            raise InvalidDependency()
        if not b.task_exists(task_id):
            raise TaskNotFound()
        if not b.task_exists(depends_on):
            raise DependencyTaskNotFound()
        b.insert_dependency(task_id, depends_on, now)  # DuplicateDependency: a key of the data

    def list_dependencies(self, b: Backend, task_id: str) -> list[Dependency]:
        return b.list_dependencies(task_id)

    def assign(self, b: Backend, task_id: str, cmd: Assign, now: int) -> None:
        task = b.get_task(task_id)
        if task is None:
            raise TaskNotFound()
        b.deactivate_assignments(task_id, now)
        b.upsert_assignment(task_id, cmd.agent_id, cmd.assigned_by, now)
        self._signal(b, task.pipeline_id, task.stage, agent=cmd.agent_id)

    def unassign(self, b: Backend, task_id: str, agent_id: str, now: int) -> None:
        if not b.unassign(task_id, agent_id, now):
            if not b.task_exists(task_id):
                raise TaskNotFound()
            raise NotFound("no active assignment for this task and agent")
        task = b.get_task(task_id)
        if task is not None:
            self._signal(b, task.pipeline_id, task.stage)

    def list_assignments(self, b: Backend, task_id: str) -> list[Assignment]:
        return b.list_assignments(task_id)

    # --- operator verbs ------------------------------------------------------------------------

    def requeue(self, b: Backend, task_id: str, cmd: RequeueTask, now: int) -> TaskDetails:
        """Make a task claimable now: dead-lettered, cancelled, waiting out a retry delay or
        simply waiting. Without `cmd.stage` it stays in its stage, except that a task a
        dead-letter policy moved goes back to the stage it was dead-lettered from; a task in
        a terminal stage (done) needs an explicit stage. A task under a live lease: 409."""
        self._requeue(b, task_id, cmd, now)
        return self.get_task(b, task_id)

    def _requeue(self, b: Backend, task_id: str, cmd: RequeueTask, now: int) -> str:
        """`requeue` without the answer: the stage the task is now claimable in. Raises
        before it writes anything but the reaping of expired leases."""
        if not b.task_exists(task_id):
            raise TaskNotFound()
        if now >= self._next_expiry:  # an expired lease ends as such (and counts), first
            self.reap_expired(b, now)
        task = b.get_task(task_id)
        assert task is not None
        pipeline = self._definition(b, task.pipeline_id)
        if pipeline is None:
            raise TrackerError("the task's pipeline cannot be read")
        if b.live_lease_of_task(task_id) is not None:
            raise TaskLeased("the task is held under a live lease; cancel it first")
        cancelled_at, _ = b.task_cancellation(task_id)
        if cmd.stage is not None:
            state = pipeline.states.get(cmd.stage)
            if state is None:
                raise InvalidStage(f"stage {cmd.stage!r} is not a state of the task's pipeline")
            if state.terminal:
                raise InvalidStage(f"stage {cmd.stage!r} is terminal: nothing would claim it")
            target = cmd.stage
        else:
            target = self._stage_before_dead_letter(b, task) or task.stage
            if pipeline.is_terminal(target):
                raise TaskFinished(
                    f"the task is in the terminal stage {target!r}; requeue it with a stage"
                )
        was = (
            "cancelled"
            if cancelled_at is not None
            else "dead_lettered"
            if task.dead_letter_reason is not None
            else "retry_wait"
            if task.next_eligible_at_ms > now
            else "waiting"
        )
        b.requeue_task(
            task_id,
            stage=target,
            version_bump=int(target != task.stage),
            reset_attempts=bool(cmd.reset_attempts),
            now=now,
        )
        data = {
            "actor": cmd.actor,
            "reason": cmd.reason,
            "was": was,
            "from_stage": task.stage,
            "to_stage": target,
            "reset_attempts": bool(cmd.reset_attempts),
        }
        b.insert_task_event(task_id, "requeued", _json(data), now)
        self._signal(b, task.pipeline_id, target)
        return target

    def requeue_many(self, b: Backend, cmd: RequeueTasks, now: int) -> BulkOutcome:
        """POST /tasks/requeue: each id as `requeue` would, in order; a task it refuses is
        reported and left as it was, and the others go on."""
        one = RequeueTask(cmd.stage, cmd.reset_attempts, cmd.reason, cmd.actor)

        def act(task_id: str) -> TaskOutcome:
            return TaskOutcome(task_id, "requeued", self._requeue(b, task_id, one, now))

        return _bulk(cmd.ids, act)

    @staticmethod
    def _stage_before_dead_letter(b: Backend, task: Task) -> str | None:
        """The stage a dead-lettered task was moved out of by its dead-letter policy (None if
        it is not dead-lettered, or stayed where it failed)."""
        if task.dead_letter_reason is None or task.dead_letter_reason == "cancelled":
            return None
        raw = b.last_dead_letter(task.id)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("dead_letter_stage") != task.stage:
            return None
        from_stage = data.get("from_stage")
        return from_stage if isinstance(from_stage, str) else None

    def cancel(self, b: Backend, task_id: str, cmd: CancelTask, now: int) -> TaskDetails:
        """Never claim the task again. A live lease is revoked: its run ends `cancelled` and
        its holder's next lease call gets 409 task_cancelled. Cancelling again changes
        nothing. A task in a terminal stage is finished and cannot be cancelled (409)."""
        self._cancel(b, task_id, cmd, now)
        return self.get_task(b, task_id)

    def cancel_many(self, b: Backend, cmd: CancelTasks, now: int) -> BulkOutcome:
        """POST /tasks/cancel: each id as `cancel` would, in order; a task it refuses is
        reported and left as it was, and the others go on."""
        one = CancelTask(cmd.reason, cmd.actor)

        def act(task_id: str) -> TaskOutcome:
            changed, stage = self._cancel(b, task_id, one, now)
            return TaskOutcome(task_id, "cancelled" if changed else "already_cancelled", stage)

        return _bulk(cmd.ids, act)

    def _cancel(self, b: Backend, task_id: str, cmd: CancelTask, now: int) -> tuple[bool, str]:
        """`cancel` without the answer: (whether it cancelled the task now, its stage). Raises
        before it writes anything but the reaping of expired leases."""
        if not b.task_exists(task_id):
            raise TaskNotFound()
        if now >= self._next_expiry:  # an expired lease ends as such (and counts), first
            self.reap_expired(b, now)
        # The live lease first: where rows are locked (PostgreSQL), this waits for a write
        # under that lease to end, so the task read next is the one that write left (a
        # transition into the terminal stage makes the cancel a 409, not a cancelled
        # finished task).
        revoked = b.live_lease_of_task(task_id)
        task = b.get_task(task_id)
        assert task is not None
        cancelled_at, _ = b.task_cancellation(task_id)
        if cancelled_at is not None:
            return False, task.stage  # cancelled already: the same answer again
        pipeline = self._definition(b, task.pipeline_id)
        if pipeline is not None and pipeline.is_terminal(task.stage):
            raise TaskFinished(f"the task is in the terminal stage {task.stage!r}")
        data: dict[str, Any] = {"actor": cmd.actor, "reason": cmd.reason, "stage": task.stage}
        if revoked is not None:
            lease_id, run_id, _expires = revoked
            b.end_run(run_id, RunStatus.CANCELLED, "{}", cmd.reason or "cancelled", now)
            b.delete_lease(lease_id)
            b.insert_event(run_id, "cancelled", _json({**data, "lease_id": lease_id}), now)
            self._signal(b, task.pipeline_id, task.stage)  # capacity is free in the stage
            data["revoked_run_id"] = run_id
        b.cancel_task(task_id, cmd.reason, core.DEAD_LETTER_ELIGIBLE_AT, now)
        b.insert_task_event(task_id, "cancelled", _json(data), now)
        return True, task.stage

    def list_task_events(
        self, b: Backend, task_id: str, after: int, limit: int
    ) -> tuple[list[TaskEvent], str | None]:
        if not b.task_exists(task_id):
            raise TaskNotFound()
        rows = b.list_task_events(task_id, after, limit + 1)
        return _page(rows, limit, lambda e: str(e.id))

    # --- leases --------------------------------------------------------------------------------

    def reap_expired(self, b: Backend, now: int) -> int:
        """Expire every lease past its time: the run goes stale, a `lease_expired` event is
        written, and the expiry counts as a failed attempt under the task's retry policy."""
        expired = b.expired_leases(now, REAP_BATCH)
        if len(expired) < REAP_BATCH:
            # Nothing can expire before the earliest remaining expiry: claims may skip the
            # janitor until then (claims and heartbeats only ever move that time later).
            upcoming = b.next_lease_expiry() or _NEVER
            if self._shared:
                upcoming = min(upcoming, now + SHARED_REAP_HORIZON_MS)
            self._next_expiry = upcoming
        reaped = 0
        for lease_id, run_id, task_id in expired:
            b.delete_lease(lease_id)
            if not b.end_run(run_id, RunStatus.STALE, "{}", "lease_expired", now):
                continue  # another reaper (or the run's own end) came first: counted there
            reaped += 1
            task = b.get_task(task_id)
            assert task is not None
            failed = b.failed_attempts(task_id)
            b.insert_event(
                run_id,
                "lease_expired",
                _json({"reason": "lease_expired", "lease_id": lease_id, "failed_attempts": failed}),
                now,
            )
            self._after_failure(b, task, run_id, failed, "lease_expired", now)
        return reaped

    def _after_failure(
        self, b: Backend, task: Task, run_id: str, failed: int, error: str | None, now: int
    ) -> None:
        """Retry the task later or dead-letter it, by its policy, after the failed attempt
        `run_id` (its `failed`-th) that reported `error`."""
        pipeline = self._definition(b, task.pipeline_id)
        policy = pipeline.policy(task.stage) if pipeline is not None else fsm.NO_POLICY
        # The task's own retry delay wins; the stage's applies when the task set none; the
        # default backoff when neither did (None).
        base: int | None = task.retry_delay_ms
        if not (base or b.retry_delay_set(task.id)):
            base = policy.retry_delay_ms
        outcome = core.decide_failure(
            stage=task.stage,
            max_attempts=task.max_attempts,
            retry_delay_ms=base,
            dead_letter_stage=task.dead_letter_stage,
            pipeline=pipeline,
            failed_attempts=failed,
            now=now,
            backoff=policy.retry_backoff,
            max_delay_ms=policy.retry_max_delay_ms,
            jitter=policy.retry_jitter,
            rand=self._rand(),
        )
        self._signal(b, task.pipeline_id, task.stage)  # a lease ended: capacity is free
        if isinstance(outcome, core.DeadLettered):
            target = outcome.dead_letter_stage
            b.dead_letter_task(
                task.id,
                stage=target if target is not None else task.stage,
                version_bump=1 if target is not None else 0,
                reason=outcome.reason,
                next_eligible_at_ms=core.DEAD_LETTER_ELIGIBLE_AT,
                error=error,
                now=now,
            )
            data = {
                "reason": outcome.reason,
                "failed_attempts": failed,
                "from_stage": outcome.from_stage,
                "dead_letter_stage": target,
            }
            b.insert_event(run_id, "dead_letter", _json(data), now)
            if self._listening and target is not None and pipeline is not None:
                self._signal(b, task.pipeline_id, target)
                if pipeline.is_terminal(target):  # dependents count this as resolved
                    for pipeline_id, stage in b.dependent_stages(task.id):
                        self._signal(b, pipeline_id, stage)
        else:
            b.schedule_retry(task.id, outcome.next_eligible_at_ms, error, now)
            self._signal(b, task.pipeline_id, task.stage, outcome.next_eligible_at_ms)
            data = {
                "reason": "retry_scheduled",
                "failed_attempts": failed,
                "retry_delay_ms": outcome.retry_delay_ms,
                "next_eligible_at_ms": outcome.next_eligible_at_ms,
            }
            b.insert_event(run_id, "retry_scheduled", _json(data), now)

    def claim(self, b: Backend, cmd: Claim, now: int) -> ClaimResult | None:
        core.lease_ttl(cmd.lease_ttl_ms)  # a bad TTL is refused before anything happens
        if now >= self._next_expiry:  # some lease may have expired: reap before choosing
            self.reap_expired(b, now)
        full = self._full_stages(b, cmd) if cmd.concurrency is not None else []
        capped = self._full_pairs(b, cmd.agent_role)
        task = b.claim_candidate(cmd.agent_role, cmd.agent_id, now, full, capped)
        if task is None:
            return None
        if task.pipeline_id not in self._capped[cmd.agent_role][0]:
            # A pipeline created since the role's limits were read (by another server): read
            # them again, and choose again under them.
            del self._capped[cmd.agent_role]
            capped = self._full_pairs(b, cmd.agent_role)
            task = b.claim_candidate(cmd.agent_role, cmd.agent_id, now, full, capped)
            if task is None:
                return None
        pipeline = self._definition(b, task.pipeline_id)
        policy = pipeline.policy(task.stage) if pipeline is not None else fsm.NO_POLICY
        ttl = core.lease_ttl(
            cmd.lease_ttl_ms, default=policy.lease_ttl_ms or core.DEFAULT_LEASE_TTL_MS
        )
        run_id, lease_id = new_id(), new_id()
        attempt = b.insert_run(run_id, task.id, cmd.agent_id, cmd.agent_role, now, lease_id)
        fence, checkpoint_json = b.bump_fence(task.id)
        token, token_hash = new_lease_token()
        expires = now + ttl
        self._next_expiry = min(self._next_expiry, expires)
        b.insert_lease(
            id=lease_id,
            run_id=run_id,
            agent_id=cmd.agent_id,
            token_hash=token_hash,
            expires_at_ms=expires,
            ttl_ms=ttl,
            fence=fence,
            now=now,
        )
        run = Run(
            run_id, task.id, attempt, RunStatus.RUNNING, cmd.agent_id, cmd.agent_role, now, None
        )
        checkpoint = msgspec.Raw(checkpoint_json if checkpoint_json is not None else b"null")
        claimed = ClaimedTask(*msgspec.structs.astuple(task))  # the Task's fields, then:
        claimed.available_transitions = self._available(b, task)
        claimed.checkpoint = checkpoint
        claimed.fence = fence
        if attempt > 1:
            claimed.previous_failures = b.previous_failures(task.id)
        return ClaimResult(claimed, run, lease_id, token, expires, fence)

    def _full_pairs(self, b: Backend, role: str) -> list[tuple[str, str]]:
        """(pipeline, stage) of this role whose stage policy's max_concurrency is reached."""
        known = self._capped.get(role)
        if known is None:
            capped = []
            pipelines = set()
            for pipeline_id, stage in b.role_stages(role):
                pipelines.add(pipeline_id)
                pipeline = self._definition(b, pipeline_id)
                cap = pipeline.policy(stage).max_concurrency if pipeline is not None else None
                if cap is not None:
                    capped.append((pipeline_id, stage, cap))
            known = self._capped[role] = (frozenset(pipelines), capped)
        return [(p, s) for p, s, cap in known[1] if b.leased_in_pipeline_stage(p, s) >= cap]

    def _full_stages(self, b: Backend, cmd: Claim) -> list[str]:
        """Stages whose per-state concurrency limit is reached (non-numeric or <= 0: no limit)."""
        if cmd.concurrency is None or cmd.concurrency.per_state is msgspec.UNSET:
            return []
        limits = msgspec.json.decode(cmd.concurrency.per_state)
        if not isinstance(limits, dict):
            return []
        full = []
        for stage, raw in limits.items():
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                continue
            try:
                limit = int(raw)
            except (OverflowError, ValueError):  # inf, nan
                continue
            if limit > 0 and b.leased_in_stage(stage) >= limit:
                full.append(stage)
        return full

    def rotate_claim_token(self, b: Backend, lease_id: str) -> str:
        """A replayed claim gets the same lease under a fresh token (tokens are never stored)."""
        token, token_hash = new_lease_token()
        b.rotate_lease_token(lease_id, token_hash)
        return token

    @staticmethod
    def _live_lease(lease: LeaseRow | None, token_hash: bytes, now: int) -> LeaseRow:
        if lease is None:
            raise LeaseNotFound()
        if not same_hash(lease.token_hash, token_hash):
            raise Unauthorized("lease token does not match")
        if lease.expires_at_ms <= now:
            raise LeaseExpired()
        return lease

    def check_run_lease(
        self,
        b: Backend,
        run_id: str,
        token_hash: bytes,
        now: int,
        expected_fence: int | None = None,
    ) -> LeaseRow:
        """The live lease of `run_id` held with `token_hash`. With `expected_fence`, a task
        that has been claimed again since that fence is 409 lease_superseded, whether or not
        the old lease still exists."""
        lease = b.lease_by_run(run_id)
        if expected_fence is not None:
            current = lease.fence if lease is not None else b.task_fence_of_run(run_id)
            if current is not None and current != expected_fence:
                raise LeaseSuperseded(
                    f"the task was claimed again: fence {current}, not {expected_fence}"
                )
        if lease is None and b.run_status(run_id) == RunStatus.CANCELLED:
            raise TaskCancelled()
        return self._live_lease(lease, token_hash, now)

    def heartbeat(
        self, b: Backend, lease_id: str, token_hash: bytes, cmd: Heartbeat, now: int
    ) -> int:
        lease = b.lease_by_id(lease_id)
        if cmd.expected_fence is not None:
            current = lease.fence if lease is not None else b.task_fence_of_lease(lease_id)
            if current is not None and current != cmd.expected_fence:
                raise LeaseSuperseded(
                    f"the task was claimed again: fence {current}, not {cmd.expected_fence}"
                )
        if lease is None and b.run_status_of_lease(lease_id) == RunStatus.CANCELLED:
            raise TaskCancelled()
        return self._extend(b, self._live_lease(lease, token_hash, now), cmd.lease_ttl_ms, now)

    def _extend(self, b: Backend, lease: LeaseRow, requested_ttl: int | None, now: int) -> int:
        ttl = core.lease_ttl(requested_ttl, default=lease.ttl_ms or core.DEFAULT_LEASE_TTL_MS)
        expires = now + ttl
        b.extend_lease(lease.id, expires, ttl, now)
        return expires

    # --- runs ----------------------------------------------------------------------------------

    def append_event(
        self, b: Backend, run_id: str, token_hash: bytes, cmd: AppendEvent, now: int
    ) -> int:
        """Record an event under the run's lease. With the lease in order (nearly always) that
        is one statement; otherwise `check_run_lease` says what is wrong with it."""
        try:
            data = compact_json(cmd.data, "{}") or "{}"
        except InvalidJson:
            self.check_run_lease(b, run_id, token_hash, now, cmd.expected_fence)
            raise  # a lease error, if any, comes first
        event_id = b.insert_event_under_lease(
            run_id, token_hash, cmd.expected_fence, cmd.kind, data, now
        )
        if event_id is None:
            self.check_run_lease(b, run_id, token_hash, now, cmd.expected_fence)
            # The lease passed the check the statement refused (a stored hash SQL compares
            # differently): the check is the authority.
            event_id = b.insert_event(run_id, cmd.kind, data, now)
        return event_id

    def list_events(
        self, b: Backend, run_id: str, after: int, limit: int
    ) -> tuple[list[Event], str | None]:
        rows = b.list_events(run_id, after, limit + 1)
        return _page(rows, limit, lambda e: str(e.id))

    def transition(self, b: Backend, lease: LeaseRow, cmd: MoveTask, now: int) -> TransitionResult:
        if lease.run_status != RunStatus.RUNNING:
            raise RunNotRunning()
        pipeline = self._definition(b, lease.pipeline_id)
        if pipeline is None:
            raise TrackerError("the task's pipeline cannot be read")
        move = core.decide_transition(
            pipeline=pipeline,
            stage=lease.stage,
            task_version=lease.task_version,
            trigger=cmd.trigger,
            expected_stage=cmd.expected_stage,
            expected_task_version=cmd.expected_task_version,
        )
        usage = compact_json(cmd.usage, "{}") or "{}"
        if not b.end_run(lease.run_id, RunStatus.COMPLETED, usage, None, now):
            raise RunNotRunning()
        if not b.move_task(lease.task_id, move.to_stage, lease.task_version, now):
            raise TaskVersionMismatch()
        b.delete_lease(lease.id)
        instructions = cmd.instructions if cmd.instructions is not None else move.instructions
        data = {
            "trigger": cmd.trigger,
            "from": lease.stage,
            "to": move.to_stage,
            "instructions": instructions or "",
        }
        b.insert_event(lease.run_id, "transition", _json(data), now)
        if self._listening:
            self._signal(b, lease.pipeline_id, lease.stage)  # capacity freed in the old stage
            self._signal(b, lease.pipeline_id, move.to_stage)  # new work in the new one
            if pipeline.is_terminal(move.to_stage):  # dependents may be unblocked
                for pipeline_id, stage in b.dependent_stages(lease.task_id):
                    self._signal(b, pipeline_id, stage)
        return TransitionResult(lease.stage, move.to_stage, cmd.trigger)

    def fail(self, b: Backend, lease: LeaseRow, cmd: FailRun, now: int) -> None:
        task = b.get_task(lease.task_id)
        if task is None:
            raise TrackerError("the run's task cannot be read")
        usage = compact_json(cmd.usage, "{}") or "{}"
        if not b.end_run(lease.run_id, RunStatus.FAILED, usage, cmd.error, now):
            raise RunNotRunning()  # ended meanwhile (a reaper, a cancel): its end counted
        b.delete_lease(lease.id)
        self._after_failure(b, task, lease.run_id, b.failed_attempts(task.id), cmd.error, now)

    def checkpoint(
        self, b: Backend, lease: LeaseRow, cmd: WriteCheckpoint, now: int
    ) -> CheckpointResult:
        """Merge the patch into the task's checkpoint, extend the lease, record an event."""
        patch = compact_json(cmd.checkpoint, None)
        if patch is None or not patch.startswith("{"):
            raise InvalidJson("checkpoint must be a JSON object (an RFC 7396 merge patch)")
        merged = b.merge_checkpoint(lease.task_id, patch)
        expires = self._extend(b, lease, None, now)
        b.insert_event(lease.run_id, "checkpoint", patch, now)
        return CheckpointResult(msgspec.Raw(merged), expires, lease.fence)

    def release(self, b: Backend, lease: LeaseRow, cmd: ReleaseRun, now: int) -> Released:
        """Put the task down on purpose: claimable again at once, not a failed attempt."""
        if not b.end_run(lease.run_id, RunStatus.RELEASED, "{}", cmd.reason, now):
            raise RunNotRunning()
        b.delete_lease(lease.id)
        data = {"reason": cmd.reason or "released", "agent_id": lease.agent_id}
        b.insert_event(lease.run_id, "released", _json(data), now)
        self._signal(b, lease.pipeline_id, lease.stage)
        return Released("released", lease.run_id, lease.task_id)

    def release_agent(
        self, b: Backend, agent_id: str, reason: str | None, now: int
    ) -> AgentReleased:
        """Release every live lease `agent_id` holds (an agent stopping on purpose)."""
        released = []
        for run_id in b.leases_of_agent(agent_id):
            lease = b.lease_by_run(run_id)
            if lease is not None and lease.expires_at_ms > now:
                released.append(self.release(b, lease, ReleaseRun(reason or "agent paused"), now))
        return AgentReleased(agent_id, released)

    # --- artifacts -----------------------------------------------------------------------------

    def create_artifact(self, b: Backend, cmd: CreateArtifact, now: int) -> str:
        if cmd.task_id is not None and not b.task_exists(cmd.task_id):
            raise TaskNotFound()
        if cmd.run_id is not None and not b.run_exists(cmd.run_id):
            raise RunNotFound("run not found")
        artifact_id = new_id()
        b.insert_artifact(
            id=artifact_id,
            task_id=cmd.task_id,
            run_id=cmd.run_id,
            now=now,
            kind=cmd.kind,
            uri=cmd.uri,
            sha256=cmd.sha256,
            size_bytes=cmd.size_bytes,
            meta_json=compact_json(cmd.meta, "{}") or "{}",
        )
        return artifact_id

    def list_artifacts(
        self,
        b: Backend,
        *,
        task_id: str | None,
        run_id: str | None,
        after: tuple[int, str] | None,
        limit: int,
    ) -> tuple[list[Artifact], str | None]:
        rows = b.list_artifacts(task_id=task_id, run_id=run_id, after=after, limit=limit + 1)
        return _page(rows, limit, lambda a: f"{a.created_at_ms}:{a.id}")

    # --- store ---------------------------------------------------------------------------------

    def put_value(self, b: Backend, namespace: str, key: str, cmd: PutValue, now: int) -> None:
        if namespace == RESERVED_NAMESPACE:
            raise ReservedNamespace()
        b.put_value(namespace, key, compact_json(cmd.value, "null") or "null", now)

    def get_value(self, b: Backend, namespace: str, key: str) -> StoreEntry:
        entry = b.get_value(namespace, key)
        if entry is None:
            raise NotFound("no value under this key")
        return entry

    def delete_value(self, b: Backend, namespace: str, key: str) -> None:
        b.delete_value(namespace, key)

    def list_namespace(self, b: Backend, namespace: str) -> list[StoreEntry]:
        return b.list_namespace(namespace)

    def list_namespaces(
        self, b: Backend, after: str, limit: int
    ) -> tuple[list[NamespaceSummary], str | None]:
        rows = b.list_namespaces(after, limit + 1)
        return _page(rows, limit, lambda n: n.namespace)

    def delete_namespace(self, b: Backend, namespace: str) -> None:
        b.delete_namespace(namespace)

    def search(
        self,
        b: Backend,
        *,
        text: str | None,
        namespace: str | None,
        filter_path: str | None,
        filter_value: str | None,
        limit: int,
    ) -> list[SearchHit]:
        if text is None:
            raise MissingParam("q is required")
        terms = search_terms(text)
        if not terms:
            raise InvalidQuery("q has no search term")
        if filter_path is not None and not filter_path.startswith("$"):
            raise InvalidQuery("filter_path must be a JSON path such as $.status")
        try:
            return b.search_store(terms, namespace, filter_path, filter_value, limit)
        except StorageQueryError as exc:
            raise InvalidQuery(f"cannot search with this filter_path: {exc}") from None

    # --- traces --------------------------------------------------------------------------------

    def ingest_traces(
        self,
        b: Backend,
        content_type: str,
        spans: list[SpanRow] | None,
        payload: bytes,
        now: int,
    ) -> TraceIngest:
        """Store one export. `spans` is None when the payload could not be decoded: then only
        the raw bytes are kept. JSON payloads keep their text; decoded protobuf keeps spans."""
        if spans is None:
            batch = b.insert_otlp_batch(content_type, None, payload, 0, now)
            return TraceIngest(batch, 0, "blob")
        as_json = otlp.is_json(content_type)
        batch = b.insert_otlp_batch(
            content_type, payload.decode() if as_json else None, None, len(spans), now
        )
        for span in spans:
            b.insert_otlp_span(batch, span)
        return TraceIngest(batch, len(spans), "json" if as_json else "protobuf")

    def list_spans(
        self, b: Backend, run_id: str, after: int, limit: int
    ) -> tuple[list[Span], str | None]:
        rows = b.list_run_spans(run_id, after, limit + 1)
        return _page(rows, limit, lambda s: str(s.id))

    # --- queue report --------------------------------------------------------------------------

    def queue_report(self, b: Backend, now: int, near_expiry_ms: int, stuck_ms: int) -> QueueReport:
        roles: dict[str, RoleQueue] = {}
        rows = b.role_stage_queue(now, _clamp(now - stuck_ms), _clamp(now + near_expiry_ms))
        for role, claimable, oldest, failed, stuck, near in rows:
            q = roles.get(role)
            if q is None:
                q = roles[role] = RoleQueue(role, 0, None, 0, 0, 0)
            q.claimable_count += claimable
            if oldest is not None:
                age = now - oldest
                q.oldest_claimable_age_ms = max(age, q.oldest_claimable_age_ms or age)
            q.failed_count += failed
            q.stuck_count += stuck
            q.near_expiry_leases += near
        dead, cancelled = b.parked_totals()
        return QueueReport(list(roles.values()), now, dead, cancelled)

    def retry_report(self, b: Backend, now: int, limit: int) -> RetryReport:
        return RetryReport(b.retry_waiting(now, limit), now)

    def list_failures(
        self,
        b: Backend,
        *,
        kind: str | None,
        pipeline_id: str | None,
        error: str | None,
        before: tuple[int, str] | None,
        limit: int,
    ) -> tuple[list[FailedTask], str | None]:
        """Dead-lettered, cancelled and failing tasks, newest first (see FailedTask)."""
        rows = b.list_failures(
            states=failure_states(kind),
            pipeline_id=pipeline_id,
            error=error,
            before=before,
            limit=limit + 1,
        )
        return _page(rows, limit, lambda f: f"{f.at_ms}:{f.id}")

    def failure_groups(
        self, b: Backend, *, kind: str | None, pipeline_id: str | None, limit: int, now: int
    ) -> FailureGroups:
        states = failure_states(kind)
        groups = b.failure_groups(states=states, pipeline_id=pipeline_id, limit=limit)
        return FailureGroups(groups, now)

    def failing_report(
        self, b: Backend, now: int, window_ms: int, min_failures: int, limit: int
    ) -> FailingReport:
        rows = b.failing_tasks(now - window_ms, min_failures, THROUGHPUT_WINDOW, limit)
        return FailingReport(rows, window_ms, min_failures, now)

    def stage_report(self, b: Backend, now: int) -> StageReport:
        stages = [
            StageQueue(p, s, r, c, None if oldest is None else now - oldest, *counts)
            for p, s, r, c, oldest, *counts in b.stage_board(now)
        ]
        since = now - 3_600_000 + 60_000 - now % 60_000  # the start of the oldest of 60 minutes
        per_minute = [0] * 60
        for minute, count in b.transitions_since(since, THROUGHPUT_WINDOW):
            if 0 <= minute < 60:
                per_minute[minute] = count
        return StageReport(stages, per_minute, now)

    # --- health and upkeep ---------------------------------------------------------------------

    def health(self, b: Backend, now: int) -> Health:
        engine, version, options = b.engine()
        health = Health(
            "ok", __version__, b.tasks_by_stage(), b.active_leases(now), core.IMPLEMENTATION
        )
        if engine == "sqlite":
            health.sqlite_version, health.sqlite_options = version, options
        return health

    def purge_idempotency(self, b: Backend, now: int) -> int:
        return b.purge_idempotency(now - IDEMPOTENCY_RETENTION_MS)


# The kinds GET /ops/failures lists, by the names its `kind` takes, and the state each is.
FAILURE_KINDS = {
    "dead": "dead_lettered",
    "dead_lettered": "dead_lettered",
    "cancelled": "cancelled",
    "failing": "failing",
}
# What one task of a bulk verb may be refused for; anything else fails the whole request.
BULK_REFUSALS = (TaskNotFound, TaskLeased, TaskFinished, InvalidStage)


def failure_states(kind: str | None) -> frozenset[str]:
    """The states a `kind` of GET /ops/failures names: a comma-separated list of dead,
    cancelled and failing (absent or empty: all three)."""
    if not kind:
        return frozenset(FAILURE_KINDS.values())
    states = set()
    for name in kind.split(","):
        state = FAILURE_KINDS.get(name.strip())
        if state is None:
            raise InvalidRequest(
                "kind must be dead, cancelled or failing, or a comma-separated list of them"
            )
        states.add(state)
    return frozenset(states)


def _bulk(ids: list[str], act: Callable[[str], TaskOutcome]) -> BulkOutcome:
    """Run `act` once for each id, in the order of the ids (so that two bulk verbs on one
    PostgreSQL lock their tasks in one order), and answer in the order given. A refusal is
    that id's outcome, not the request's."""
    if not ids:
        raise InvalidRequest("ids must not be empty")
    if len(ids) > MAX_BULK_IDS:
        raise InvalidRequest(f"ids may hold at most {MAX_BULK_IDS} task ids")
    done: dict[str, TaskOutcome] = {}
    for task_id in sorted(set(ids)):
        try:
            done[task_id] = act(task_id)
        except BULK_REFUSALS as exc:
            error = OutcomeError(exc.code, exc.message)
            done[task_id] = TaskOutcome(task_id, "refused", None, error)
    items = [done[task_id] for task_id in ids]
    changed = sum(1 for o in done.values() if o.outcome in ("requeued", "cancelled"))
    refused = sum(1 for o in done.values() if o.outcome == "refused")
    return BulkOutcome(items, changed, refused)


def _clamp(t: int) -> int:
    return max(-(2**63), min(t, 2**63 - 1))


def _page(rows: list[Any], limit: int, cursor_of: Any) -> tuple[list[Any], str | None]:
    """Trim the look-ahead row; the cursor names the last row returned, so nothing is skipped."""
    if len(rows) > limit:
        rows = rows[:limit]
        return rows, cursor_of(rows[-1])
    return rows, None


# --- the unit of work --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    now: int
    stages: list[StageBoardRow]
    leases: int
    kinds: list[tuple[str, int, int]]  # (kind, count, newest id) of events after the cursor
    newest: int  # the newest event id counted


class Kind(Enum):
    """What a write did, for the caller to answer with (HTTP: 201, 200, 204)."""

    CREATED = "created"
    OK = "ok"
    EMPTY = "empty"  # nothing to say: no claimable task, a value stored or deleted


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """A write's typed result."""

    kind: Kind
    value: T


@dataclass(frozen=True, slots=True)
class Recorded:
    """An answer as an idempotency record keeps it and a replay returns it: a status and the
    exact body bytes (contract §3)."""

    status: int
    body: bytes


# How the caller turns an outcome into the answer it sends; the service stores that answer
# under the request's Idempotency-Key, in the same transaction as the write.
Record = Callable[[Outcome[Any]], Recorded]


@dataclass(frozen=True, slots=True)
class Idem:
    """A request under an Idempotency-Key: what identifies it, and how its answer is made."""

    key: str
    method: str
    path: str
    request_hash: bytes
    auth_hash: bytes | None  # on lease routes: a replay needs the same lease token
    record: Record


Written = Outcome[T] | Recorded  # a fresh outcome, or the recorded answer of a replay


def _claim_outcome(result: ClaimResult | None) -> Outcome[ClaimResult | None]:
    return Outcome(Kind.EMPTY if result is None else Kind.OK, result)


# How long a revocation waits to hear itself back from the notifier (PostgreSQL: its NOTIFY,
# delivered to every listening server at once) before it answers anyway.
REVOCATION_ECHO_S = 1.0
# Unknown key hashes remembered, so that a sender repeating a wrong key costs no query.
UNKNOWN_KEYS_MAX = 4096
KEY_NAME_MAX = 200
_MISS: Any = object()


class KeyRing:
    """The keys this process has seen, by the SHA-256 of their text and by id, so that a
    request's key costs no query once known (a query would about double the cost of a claim).

    Trusted only while the notifier hears every revocation (`revocations_heard`); otherwise
    every lookup reads the database. A revocation, made by this process or (on PostgreSQL)
    any other, removes the key as the notifier delivers it; `None` forgets everything. A
    lookup that read the database while a revocation went by keeps nothing it read
    (`generation`). Unknown hashes are remembered too, at most UNKNOWN_KEYS_MAX: a key is
    random, so a hash seen before the key was made cannot become that key's.
    """

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier
        self._by_hash: dict[bytes, KeyInfo] = {}
        self._by_id: dict[str, KeyInfo] = {}
        self._unknown: dict[bytes, None] = {}
        self._lock = threading.Lock()
        self.generation = 0
        # Revocations of this process waiting to hear themselves back (see Service.revoke_key).
        self._echoes: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}
        notifier.on_revoke(self.forget)

    def by_hash(self, key_hash: bytes) -> Any:
        """The key with this hash, None if there is none, or _MISS: ask the database."""
        if not self._notifier.revocations_heard:
            return _MISS
        found = self._by_hash.get(key_hash, _MISS)
        if found is _MISS and key_hash in self._unknown:
            return None
        return found

    def by_id(self, key_id: str) -> Any:
        """The key with this id, or _MISS: ask the database."""
        if not self._notifier.revocations_heard:
            return _MISS
        return self._by_id.get(key_id, _MISS)

    def learn(self, key_hash: bytes | None, info: KeyInfo | None, seen: int) -> None:
        """Keep what a lookup read, unless a revocation went by since it began (`seen`)."""
        with self._lock:
            if seen != self.generation or not self._notifier.revocations_heard:
                return
            if info is not None:
                self._by_id[info.id] = info
                if key_hash is not None:
                    self._by_hash[key_hash] = info
            elif key_hash is not None:
                self._unknown[key_hash] = None
                if len(self._unknown) > UNKNOWN_KEYS_MAX:
                    del self._unknown[next(iter(self._unknown))]

    def forget(self, key_id: str | None) -> None:
        """The notifier's callback (any thread): `key_id` was revoked; None: forget all."""
        self.drop(key_id)
        if key_id is None:
            return
        with self._lock:
            echoes = self._echoes.pop(key_id, [])
        for loop, heard in echoes:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle, heard)

    def drop(self, key_id: str | None) -> None:
        """Forget the key `key_id` (None: every key) in this process."""
        with self._lock:
            self.generation += 1
            if key_id is None:
                self._by_hash.clear()
                self._by_id.clear()
                return
            self._by_id.pop(key_id, None)
            for key_hash, info in list(self._by_hash.items()):  # few keys; revocations are rare
                if info.id == key_id:
                    del self._by_hash[key_hash]

    def expect(self, key_id: str) -> asyncio.Future[None]:
        """A future that completes when the revocation of `key_id` is heard back."""
        loop = asyncio.get_running_loop()
        heard: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._echoes.setdefault(key_id, []).append((loop, heard))
        return heard

    def unexpect(self, key_id: str, heard: asyncio.Future[None]) -> None:
        with self._lock:
            waiting = self._echoes.get(key_id, [])
            waiting[:] = [(lp, f) for lp, f in waiting if f is not heard]
            if not waiting:
                self._echoes.pop(key_id, None)


# The key the current request speaks with, while each of its units of work must confirm it
# (Service.speaking_with). Every request runs as a task of its own, with a context of its own.
_speaking: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nulltickets_speaking", default=None
)


def _confirm_key(b: Backend, key_id: str) -> None:
    if b.api_key_by_id(key_id) is None:
        raise Unauthorized("the key was revoked")


def _settle(heard: asyncio.Future[None]) -> None:
    if not heard.done():
        heard.set_result(None)


def check_new_key(command: CreateKey) -> tuple[str, list[str]]:
    """The new key's name and roles, or InvalidRequest saying what is wrong."""
    name = command.name.strip()
    if not name or len(name) > KEY_NAME_MAX:
        raise InvalidRequest(f"name must be 1..{KEY_NAME_MAX} characters")
    roles = list(dict.fromkeys(command.roles or []))
    if command.access is Access.AGENT:
        if not roles:
            raise InvalidRequest("an agent key needs roles: the agent roles it may claim for")
        if any(not role.strip() for role in roles):
            raise InvalidRequest("roles must not be empty")
    elif roles:
        raise InvalidRequest(f"roles apply to agent keys only, not to {command.access} keys")
    return name, roles


class Service:
    """One async method per API verb, each one unit of work on `db`.

    Writes return `Outcome | Recorded`: the typed outcome, or, when `idem` names a request
    already answered, the answer recorded then. Reads return their value. The clock is read
    once per unit of work and the random source feeds retry jitter: tests pass fixed ones.
    """

    def __init__(
        self, db: Database, *, clock: Clock = wall_ms, rand: Random = system_random
    ) -> None:
        self.db = db
        self.clock = clock
        self.notifier = db.notifier
        self._shared = db.capabilities.shared_by_servers
        self.tracker = Tracker(db.notifier, rand, shared=self._shared)
        self.keys = KeyRing(db.notifier)

    # --- plumbing ------------------------------------------------------------------------------

    async def _write(
        self,
        idem: Idem | None,
        act: Callable[[Backend, int], Outcome[T]],
        *,
        redact: Callable[[Outcome[T]], Outcome[T]] | None = None,
        revive: Callable[[Backend, bytes], bytes] | None = None,
    ) -> Written[T]:
        clock = self.clock
        key_id = _speaking.get()
        if idem is None and key_id is None:
            return await self.db.write(lambda b: act(b, clock()))

        def job(b: Backend) -> Written[T]:
            if key_id is not None:
                _confirm_key(b, key_id)
            now = clock()
            if idem is None:
                return act(b, now)
            return _idempotent(b, idem, now, act, redact, revive)

        return await self.db.write(job)

    async def _read(self, job: Callable[[Backend], T]) -> T:
        key_id = _speaking.get()
        if key_id is None:
            return await self.db.read(job)

        def confirmed(b: Backend) -> T:
            _confirm_key(b, key_id)
            return job(b)

        return await self.db.read(confirmed)

    @contextlib.contextmanager
    def speaking_with(self, key_id: str | None) -> Iterator[None]:
        """Run the block (a request's handler) on behalf of key `key_id`. On a database shared
        by servers, each unit of work the block runs first confirms, in its own transaction,
        that the key still exists: another server's revocation reaches this server's KeyRing
        only as fast as its notification, the database at once; one statement of a unit of
        work that runs anyway costs far less than a lookup of its own. On SQLite (one server
        per file) the KeyRing hears every revocation before it is answered: nothing to do.
        The key travels in a context variable, which the block's own tasks inherit."""
        if key_id is None or not self._shared:
            yield
            return
        token = _speaking.set(key_id)
        try:
            yield
        finally:
            _speaking.reset(token)

    # --- pipelines -----------------------------------------------------------------------------

    async def create_pipeline(self, cmd: CreatePipeline, idem: Idem | None = None) -> Written[str]:
        t = self.tracker
        return await self._write(
            idem, lambda b, now: Outcome(Kind.CREATED, t.create_pipeline(b, cmd, now))
        )

    async def list_pipelines(self) -> list[Pipeline]:
        return await self._read(self.tracker.list_pipelines)

    async def get_pipeline(self, pipeline_id: str) -> Pipeline:
        return await self._read(lambda b: self.tracker.get_pipeline(b, pipeline_id))

    # --- tasks ---------------------------------------------------------------------------------

    async def create_task(self, cmd: CreateTask, idem: Idem | None = None) -> Written[str]:
        t = self.tracker
        return await self._write(
            idem, lambda b, now: Outcome(Kind.CREATED, t.create_task(b, cmd, now))
        )

    async def create_tasks(
        self, cmds: list[CreateTask], idem: Idem | None = None
    ) -> Written[list[str]]:
        t = self.tracker
        return await self._write(
            idem, lambda b, now: Outcome(Kind.CREATED, t.create_tasks(b, cmds, now))
        )

    async def list_tasks(
        self,
        *,
        stage: str | None,
        pipeline_id: str | None,
        after: tuple[int, str] | None,
        limit: int,
        agent_role: str | None = None,
        text: str | None = None,
    ) -> tuple[list[Task], str | None]:
        return await self._read(
            lambda b: self.tracker.list_tasks(
                b,
                stage=stage,
                pipeline_id=pipeline_id,
                after=after,
                limit=limit,
                agent_role=agent_role,
                text=text,
            )
        )

    async def list_task_runs(
        self, task_id: str, cursor: int | None, limit: int, *, newest_first: bool = False
    ) -> tuple[list[TaskRun], str | None]:
        return await self._read(
            lambda b: self.tracker.list_task_runs(b, task_id, cursor, limit, newest_first)
        )

    async def get_task(self, task_id: str) -> TaskDetails:
        return await self._read(lambda b: self.tracker.get_task(b, task_id))

    async def get_checkpoint(self, task_id: str) -> TaskCheckpoint:
        return await self._read(lambda b: self.tracker.get_checkpoint(b, task_id))

    async def run_state(self, task_id: str) -> str:
        return await self._read(lambda b: self.tracker.run_state(b, task_id))

    async def requeue(
        self, task_id: str, cmd: RequeueTask, idem: Idem | None = None
    ) -> Written[TaskDetails]:
        t = self.tracker
        return await self._write(
            idem, lambda b, now: Outcome(Kind.OK, t.requeue(b, task_id, cmd, now))
        )

    async def cancel(
        self, task_id: str, cmd: CancelTask, idem: Idem | None = None
    ) -> Written[TaskDetails]:
        t = self.tracker
        return await self._write(
            idem, lambda b, now: Outcome(Kind.OK, t.cancel(b, task_id, cmd, now))
        )

    async def list_task_events(
        self, task_id: str, after: int, limit: int
    ) -> tuple[list[TaskEvent], str | None]:
        return await self._read(lambda b: self.tracker.list_task_events(b, task_id, after, limit))

    async def requeue_many(
        self, cmd: RequeueTasks, idem: Idem | None = None
    ) -> Written[BulkOutcome]:
        t = self.tracker
        return await self._write(idem, lambda b, now: Outcome(Kind.OK, t.requeue_many(b, cmd, now)))

    async def cancel_many(self, cmd: CancelTasks, idem: Idem | None = None) -> Written[BulkOutcome]:
        t = self.tracker
        return await self._write(idem, lambda b, now: Outcome(Kind.OK, t.cancel_many(b, cmd, now)))

    async def add_dependency(
        self, task_id: str, depends_on: str, idem: Idem | None = None
    ) -> Written[None]:
        t = self.tracker

        def act(b: Backend, now: int) -> Outcome[None]:
            t.add_dependency(b, task_id, depends_on, now)
            return Outcome(Kind.CREATED, None)

        return await self._write(idem, act)

    async def list_dependencies(self, task_id: str) -> list[Dependency]:
        return await self._read(lambda b: self.tracker.list_dependencies(b, task_id))

    async def assign(self, task_id: str, cmd: Assign, idem: Idem | None = None) -> Written[None]:
        t = self.tracker

        def act(b: Backend, now: int) -> Outcome[None]:
            t.assign(b, task_id, cmd, now)
            return Outcome(Kind.CREATED, None)

        return await self._write(idem, act)

    async def unassign(
        self, task_id: str, agent_id: str, idem: Idem | None = None
    ) -> Written[None]:
        t = self.tracker

        def act(b: Backend, now: int) -> Outcome[None]:
            t.unassign(b, task_id, agent_id, now)
            return Outcome(Kind.OK, None)

        return await self._write(idem, act)

    async def list_assignments(self, task_id: str) -> list[Assignment]:
        return await self._read(lambda b: self.tracker.list_assignments(b, task_id))

    # --- leases and runs -----------------------------------------------------------------------

    async def claim(self, cmd: Claim, idem: Idem | None = None) -> Written[ClaimResult | None]:
        """One attempt to claim (a long poll repeats it while its role's wake-ups come)."""
        t = self.tracker

        def redact(outcome: Outcome[ClaimResult | None]) -> Outcome[ClaimResult | None]:
            # Lease tokens are never stored in clear, not even in the idempotency record.
            result = outcome.value
            if result is None:
                return outcome
            return Outcome(outcome.kind, msgspec.structs.replace(result, lease_token=""))

        def revive(b: Backend, body: bytes) -> bytes:
            # A replayed claim gets the same lease under a fresh token.
            result = msgspec.json.decode(body, type=ClaimResult)
            result.lease_token = t.rotate_claim_token(b, result.lease_id)
            return _encode(result)

        return await self._write(
            idem, lambda b, now: _claim_outcome(t.claim(b, cmd, now)), redact=redact, revive=revive
        )

    async def heartbeat(
        self,
        lease_id: str,
        token_hash: bytes,
        command: Callable[[], Heartbeat],
        idem: Idem | None = None,
    ) -> Written[int]:
        """`command` gives the body, decoded: called only after the lease checks, so that a
        bad body is reported after a bad lease."""
        t = self.tracker
        return await self._write(
            idem,
            lambda b, now: Outcome(Kind.OK, t.heartbeat(b, lease_id, token_hash, command(), now)),
        )

    async def append_event(
        self,
        run_id: str,
        token_hash: bytes,
        command: Callable[[], AppendEvent],
        idem: Idem | None = None,
    ) -> Written[int]:
        t = self.tracker

        def act(b: Backend, now: int) -> Outcome[int]:
            try:
                event = command()
            except InvalidJson:  # the lease's errors come before the body's
                t.check_run_lease(b, run_id, token_hash, now)
                raise
            return Outcome(Kind.CREATED, t.append_event(b, run_id, token_hash, event, now))

        return await self._write(idem, act)

    async def check_run_lease(self, run_id: str, token_hash: bytes) -> LeaseRow:
        """The run's live lease held with this token (for reads a lease authorises)."""
        now = self.clock()
        return await self._read(lambda b: self.tracker.check_run_lease(b, run_id, token_hash, now))

    async def list_events(
        self, run_id: str, after: int, limit: int
    ) -> tuple[list[Event], str | None]:
        return await self._read(lambda b: self.tracker.list_events(b, run_id, after, limit))

    async def _under_run_lease(
        self,
        run_id: str,
        token_hash: bytes,
        command: Callable[[], Any],
        act: Callable[[Backend, LeaseRow, Any, int], Outcome[T]],
        idem: Idem | None,
    ) -> Written[T]:
        """A write on /runs/{id}/...: the run's lease (and any expected_fence) is checked
        first, then `act` runs with the lease and the body, only then required to be valid."""
        t = self.tracker

        def checked(b: Backend, now: int) -> Outcome[T]:
            lease = t.check_run_lease(b, run_id, token_hash, now, _fence(command))
            return act(b, lease, command(), now)

        return await self._write(idem, checked)

    async def transition(
        self,
        run_id: str,
        token_hash: bytes,
        command: Callable[[], MoveTask],
        idem: Idem | None = None,
    ) -> Written[TransitionResult]:
        t = self.tracker
        return await self._under_run_lease(
            run_id,
            token_hash,
            command,
            lambda b, lease, move, now: Outcome(Kind.OK, t.transition(b, lease, move, now)),
            idem,
        )

    async def fail(
        self,
        run_id: str,
        token_hash: bytes,
        command: Callable[[], FailRun],
        idem: Idem | None = None,
    ) -> Written[None]:
        t = self.tracker

        def act(b: Backend, lease: LeaseRow, failure: FailRun, now: int) -> Outcome[None]:
            t.fail(b, lease, failure, now)
            return Outcome(Kind.OK, None)

        return await self._under_run_lease(run_id, token_hash, command, act, idem)

    async def checkpoint(
        self,
        run_id: str,
        token_hash: bytes,
        command: Callable[[], WriteCheckpoint],
        idem: Idem | None = None,
    ) -> Written[CheckpointResult]:
        t = self.tracker
        return await self._under_run_lease(
            run_id,
            token_hash,
            command,
            lambda b, lease, patch, now: Outcome(Kind.OK, t.checkpoint(b, lease, patch, now)),
            idem,
        )

    async def release(
        self,
        run_id: str,
        token_hash: bytes,
        command: Callable[[], ReleaseRun],
        idem: Idem | None = None,
    ) -> Written[Released]:
        t = self.tracker
        return await self._under_run_lease(
            run_id,
            token_hash,
            command,
            lambda b, lease, reason, now: Outcome(Kind.OK, t.release(b, lease, reason, now)),
            idem,
        )

    async def release_agent(
        self, agent_id: str, reason: str | None, idem: Idem | None = None
    ) -> Written[AgentReleased]:
        t = self.tracker
        return await self._write(
            idem, lambda b, now: Outcome(Kind.OK, t.release_agent(b, agent_id, reason, now))
        )

    # --- artifacts -----------------------------------------------------------------------------

    async def create_artifact(self, cmd: CreateArtifact, idem: Idem | None = None) -> Written[str]:
        t = self.tracker
        return await self._write(
            idem, lambda b, now: Outcome(Kind.CREATED, t.create_artifact(b, cmd, now))
        )

    async def list_artifacts(
        self,
        *,
        task_id: str | None,
        run_id: str | None,
        after: tuple[int, str] | None,
        limit: int,
    ) -> tuple[list[Artifact], str | None]:
        return await self._read(
            lambda b: self.tracker.list_artifacts(
                b, task_id=task_id, run_id=run_id, after=after, limit=limit
            )
        )

    # --- store ---------------------------------------------------------------------------------

    async def put_value(
        self, namespace: str, key: str, cmd: PutValue, idem: Idem | None = None
    ) -> Written[None]:
        t = self.tracker

        def act(b: Backend, now: int) -> Outcome[None]:
            t.put_value(b, namespace, key, cmd, now)
            return Outcome(Kind.EMPTY, None)

        return await self._write(idem, act)

    async def get_value(self, namespace: str, key: str) -> StoreEntry:
        return await self._read(lambda b: self.tracker.get_value(b, namespace, key))

    async def delete_value(
        self, namespace: str, key: str, idem: Idem | None = None
    ) -> Written[None]:
        t = self.tracker

        def act(b: Backend, now: int) -> Outcome[None]:
            t.delete_value(b, namespace, key)
            return Outcome(Kind.EMPTY, None)

        return await self._write(idem, act)

    async def list_namespace(self, namespace: str) -> list[StoreEntry]:
        return await self._read(lambda b: self.tracker.list_namespace(b, namespace))

    async def list_namespaces(
        self, after: str, limit: int
    ) -> tuple[list[NamespaceSummary], str | None]:
        return await self._read(lambda b: self.tracker.list_namespaces(b, after, limit))

    async def delete_namespace(self, namespace: str, idem: Idem | None = None) -> Written[None]:
        t = self.tracker

        def act(b: Backend, now: int) -> Outcome[None]:
            t.delete_namespace(b, namespace)
            return Outcome(Kind.EMPTY, None)

        return await self._write(idem, act)

    async def search(
        self,
        *,
        text: str | None,
        namespace: str | None,
        filter_path: str | None,
        filter_value: str | None,
        limit: int,
    ) -> list[SearchHit]:
        return await self._read(
            lambda b: self.tracker.search(
                b,
                text=text,
                namespace=namespace,
                filter_path=filter_path,
                filter_value=filter_value,
                limit=limit,
            )
        )

    # --- traces --------------------------------------------------------------------------------

    async def ingest_traces(
        self,
        content_type: str,
        spans: list[SpanRow] | None,
        payload: bytes,
        idem: Idem | None = None,
    ) -> Written[TraceIngest]:
        t = self.tracker
        return await self._write(
            idem,
            lambda b, now: Outcome(Kind.OK, t.ingest_traces(b, content_type, spans, payload, now)),
        )

    async def list_spans(
        self, run_id: str, after: int, limit: int
    ) -> tuple[list[Span], str | None]:
        return await self._read(lambda b: self.tracker.list_spans(b, run_id, after, limit))

    # --- keys ----------------------------------------------------------------------------------

    async def create_key(self, command: CreateKey) -> CreatedKey:
        """Make a key; the answer is the only place its text ever appears (the database keeps
        its SHA-256). Not idempotent by Idempotency-Key: a recorded answer would hold it."""
        name, roles = check_new_key(command)
        key, key_hash = new_api_key()
        key_id = new_id()

        def act(b: Backend, now: int) -> Outcome[CreatedKey]:
            b.insert_api_key(
                id=key_id, key_hash=key_hash, name=name, access=command.access, roles=roles, now=now
            )
            return Outcome(Kind.CREATED, CreatedKey(key_id, key, name, command.access, roles, now))

        made = await self._write(None, act)
        assert isinstance(made, Outcome)  # no Idempotency-Key: never a replay
        return made.value

    async def list_keys(self) -> list[KeyInfo]:
        return await self._read(lambda b: b.list_api_keys())

    async def revoke_key(self, key_id: str, idem: Idem | None = None) -> Written[KeyInfo]:
        """Delete the key. When this answers, no request of this process accepts it any more,
        and every other server (PostgreSQL) has been sent the revocation: it arrived here, and
        PostgreSQL delivers a notification to every listener at the same time."""
        notifier = self.notifier

        def act(b: Backend, now: int) -> Outcome[KeyInfo]:
            info = b.delete_api_key(key_id)
            if info is None:
                raise NotFound(f"no key with id {key_id!r}")
            notifier.revoke(b, key_id)
            return Outcome(Kind.OK, info)

        heard = self.keys.expect(key_id)
        try:
            result = await self._write(idem, act)
            self.keys.drop(key_id)  # here at once, whatever the notifier does
            if isinstance(result, Outcome):
                # Without its echo in time the listening connection is down; other servers
                # then trust no cache of keys until theirs is back.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(heard, REVOCATION_ECHO_S)
        finally:
            self.keys.unexpect(key_id, heard)
        return result

    async def authenticate(self, key: str) -> KeyInfo | None:
        """The key a bearer presents, or None when it is not a (live) key."""
        if not looks_like_api_key(key):
            return None
        key_hash = api_key_hash(key)
        ring = self.keys
        found = ring.by_hash(key_hash)
        if found is not _MISS:
            info: KeyInfo | None = found
            return info
        seen = ring.generation
        info = await self._read(lambda b: b.api_key_by_hash(key_hash))
        ring.learn(key_hash, info, seen)
        return info

    async def key_by_id(self, key_id: str) -> KeyInfo | None:
        """A live key by its id (a dashboard session names its key so)."""
        ring = self.keys
        found = ring.by_id(key_id)
        if found is not _MISS:
            known: KeyInfo = found
            return known
        seen = ring.generation
        info = await self._read(lambda b: b.api_key_by_id(key_id))
        ring.learn(None, info, seen)
        return info

    # --- operations and upkeep -----------------------------------------------------------------

    async def queue_report(self, near_expiry_ms: int, stuck_ms: int) -> QueueReport:
        now = self.clock()
        return await self._read(
            lambda b: self.tracker.queue_report(b, now, near_expiry_ms, stuck_ms)
        )

    async def health(self) -> Health:
        now = self.clock()
        return await self._read(lambda b: self.tracker.health(b, now))

    async def stage_report(self) -> StageReport:
        now = self.clock()
        return await self._read(lambda b: self.tracker.stage_report(b, now))

    async def retry_report(self, limit: int) -> RetryReport:
        now = self.clock()
        return await self._read(lambda b: self.tracker.retry_report(b, now, limit))

    async def list_failures(
        self,
        *,
        kind: str | None,
        pipeline_id: str | None,
        error: str | None,
        before: tuple[int, str] | None,
        limit: int,
    ) -> tuple[list[FailedTask], str | None]:
        return await self._read(
            lambda b: self.tracker.list_failures(
                b, kind=kind, pipeline_id=pipeline_id, error=error, before=before, limit=limit
            )
        )

    async def failure_groups(
        self, *, kind: str | None, pipeline_id: str | None, limit: int
    ) -> FailureGroups:
        now = self.clock()
        return await self._read(
            lambda b: self.tracker.failure_groups(
                b, kind=kind, pipeline_id=pipeline_id, limit=limit, now=now
            )
        )

    async def failing_report(self, window_ms: int, min_failures: int, limit: int) -> FailingReport:
        """Tasks failing in a loop: `min_failures` or more failures in a row within the last
        `window_ms`, most failures first."""
        now = self.clock()
        return await self._read(
            lambda b: self.tracker.failing_report(b, now, window_ms, min_failures, limit)
        )

    # --- the event stream and metrics ----------------------------------------------------------

    async def events_feed(
        self, after: int, limit: int, task_id: str | None = None
    ) -> list[FeedEvent]:
        """Run events after the id `after`, oldest first (of one task, if given)."""
        return await self._read(lambda b: b.events_feed(after, limit, task_id))

    async def last_event_id(self) -> int:
        return await self._read(lambda b: b.last_event_id())

    async def metrics_snapshot(self, after: int | None) -> MetricsSnapshot:
        """What /metrics reads from the database, in one snapshot: the stage board, live
        leases, and run events by kind after the id `after` (None: none counted, only the
        newest id)."""
        now = self.clock()

        def job(b: Backend) -> MetricsSnapshot:
            stages = b.stage_board(now)
            leases = b.active_leases(now)
            if after is None:
                return MetricsSnapshot(now, stages, leases, [], b.last_event_id())
            kinds = b.event_kinds_since(after)
            newest = max((m for _, _, m in kinds), default=after)
            return MetricsSnapshot(now, stages, leases, kinds, newest)

        return await self._read(job)

    def storage_stats(self) -> StorageStats:
        """This process's storage figures and timings (writer batches, WAL size, commit
        durations ...): see Database.stats."""
        return self.db.stats()

    async def reap_expired(self) -> int:
        """End every lease past its time (the janitor; claims also reap when one may be)."""
        return await self.db.write(lambda b: self.tracker.reap_expired(b, self.clock()))

    async def purge_idempotency(self) -> int:
        return await self.db.write(lambda b: self.tracker.purge_idempotency(b, self.clock()))


def _fence(command: Callable[[], Any]) -> int | None:
    """The expected_fence of a body decoded later (None if absent or the body is bad)."""
    try:
        fence: int | None = command().expected_fence
    except InvalidJson:
        return None
    return fence


def _idempotent(
    b: Backend,
    idem: Idem,
    now: int,
    act: Callable[[Backend, int], Outcome[T]],
    redact: Callable[[Outcome[T]], Outcome[T]] | None,
    revive: Callable[[Backend, bytes], bytes] | None,
) -> Written[T]:
    """Replay the answer recorded under this key, or act and record the answer, in the unit
    of work `b`.

    Only answers with a body are recorded: an EMPTY outcome (no claimable task, a value
    stored or deleted) has nothing to replay, and running it again is what a retry should
    do; failures are never recorded. On lease routes the recorded lease-token hash must
    match the presented one before anything is replayed.
    """
    stored = b.get_idempotency(idem.key, idem.method, idem.path)
    if stored is not None:
        stored_hash, stored_auth, status, body = stored
        if not same_hash(stored_hash, idem.request_hash):
            raise IdempotencyConflict()
        if stored_auth is not None and (
            idem.auth_hash is None or not same_hash(stored_auth, idem.auth_hash)
        ):
            raise Unauthorized("lease token does not match")
        raw = body.encode()
        return Recorded(status, revive(b, raw) if revive is not None else raw)
    outcome = act(b, now)
    if outcome.kind is not Kind.EMPTY:
        answer = idem.record(redact(outcome) if redact is not None else outcome)
        b.put_idempotency(
            key=idem.key,
            method=idem.method,
            path=idem.path,
            request_hash=idem.request_hash,
            auth_hash=idem.auth_hash,
            status=answer.status,
            body=answer.body.decode(),
            now=now,
        )
    return outcome
