"""Tasks: creation, reads, dependencies, assignments and the operator verbs (requeue,
cancel) with their task events."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from nulltickets import core
from nulltickets import errors as e
from nulltickets.domain import commands, model
from nulltickets.domain.commands import (
    Assign,
    CancelTask,
    CancelTasks,
    CreateTask,
    RequeueTask,
    RequeueTasks,
    compact_json,
)
from nulltickets.domain.ids import new_id
from nulltickets.domain.model import (
    Access,
    Assignment,
    AvailableTransition,
    BulkOutcome,
    Dependency,
    IdBody,
    IdsBody,
    RunStateBody,
    RunStatus,
    StatusBody,
    Task,
    TaskAssignment,
    TaskCheckpoint,
    TaskDetails,
    TaskEvent,
    TaskOutcome,
    TaskRun,
)
from nulltickets.errors import (
    DependencyTaskNotFound,
    DuplicateDependency,
    InvalidDependency,
    InvalidRequest,
    InvalidRetryPolicy,
    InvalidStage,
    NotFound,
    PipelineNotFound,
    TaskFinished,
    TaskLeased,
    TaskNotFound,
    TrackerError,
)
from nulltickets.service import params as p
from nulltickets.service.base import (
    _NEVER,
    TrackerBase,
    _bulk,
    _json,
    _page,
)
from nulltickets.service.verbs import Param, Tool, page, paging, said, verb
from nulltickets.storage.backend import Backend, NewTask


class Tasks(TrackerBase):
    # --- tasks ---------------------------------------------------------------------------------

    @verb(
        "POST",
        "/tasks",
        "Create a task in its pipeline's initial stage.",
        request=commands.CreateTask,
        response=IdBody,
        status=201,
        errors=(
            e.InvalidJson,
            e.InvalidRetryPolicy,
            e.PipelineNotFound,
            e.TaskNotFound,
            e.DuplicateDependency,
        ),
        access=Access.AGENT,
        tag="tasks",
        answer=IdBody,
        tool=Tool("create_task", hide=("assigned_by",)),
    )
    def create_task(self, b: Backend, cmd: CreateTask, now: int) -> str:
        """One task, as the whole of its unit of work: a task with no dependencies and no
        assignment is one statement on PostgreSQL, its wake-up with it."""
        return self.add_task(b, cmd, now, whole=True)

    def add_task(
        self,
        b: Backend,
        cmd: CreateTask,
        now: int,
        where: str = "$.retry_policy",
        *,
        whole: bool = False,
    ) -> str:
        """Create the task `cmd` in unit of work `b`. With `whole`, nothing else is to be
        written in `b` (the verb POST /tasks): then, with no dependencies and no assignment,
        Backend.create_task writes all of it, and may commit it at once."""
        pipeline = self._definition(b, cmd.pipeline_id)  # read once per process, then kept
        if pipeline is None:
            if b.get_pipeline(cmd.pipeline_id) is None:
                raise PipelineNotFound(f"pipeline {cmd.pipeline_id!r} not found")
            raise TrackerError("the pipeline's stored definition cannot be read")
        policy = cmd.retry_policy
        dead_letter = policy.dead_letter_stage if policy is not None else None
        if dead_letter is not None and dead_letter not in pipeline.states:
            raise InvalidRetryPolicy(
                f"{where}.dead_letter_stage {dead_letter!r} is not a stage of the pipeline "
                f"(its stages: {', '.join(pipeline.states)})"
            )
        task = NewTask(
            id=new_id(),
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
        if whole and not cmd.dependencies and cmd.assigned_agent_id is None:
            state = pipeline.states.get(pipeline.initial)
            inserted, woken = b.create_task(task, state.agent_role if state else None)
        else:
            inserted, woken = b.insert_task(task), False
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
            b.insert_dependency(task.id, dep, now)
        if cmd.assigned_agent_id is not None:
            b.deactivate_assignments(task.id, now)
            b.upsert_assignment(task.id, cmd.assigned_agent_id, cmd.assigned_by, now)
        if not woken:
            self._signal(b, cmd.pipeline_id, pipeline.initial, agent=cmd.assigned_agent_id)
        return task.id

    @verb(
        "POST",
        "/tasks/bulk",
        "Create many tasks in one transaction.",
        request=commands.CreateTasks,
        response=IdsBody,
        status=201,
        errors=(
            e.InvalidJson,
            e.InvalidRequest,
            e.InvalidRetryPolicy,
            e.PipelineNotFound,
            e.TaskNotFound,
            e.DuplicateDependency,
        ),
        access=Access.AGENT,
        tag="tasks",
        answer=IdsBody,
    )
    def create_tasks(self, b: Backend, cmd: commands.CreateTasks, now: int) -> list[str]:
        if not cmd.tasks:
            raise InvalidRequest("tasks must not be empty")
        return [
            self.add_task(b, task, now, f"$.tasks[{i}].retry_policy")
            for i, task in enumerate(cmd.tasks)
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

    @verb(
        "GET",
        "/tasks/{id}",
        "A task with its latest run, dependencies, assignments and available transitions.",
        response=model.TaskDetails,
        errors=(e.TaskNotFound,),
        tag="tasks",
        cli="tasks show",
        tool=Tool("get_task"),
    )
    def get_task(self, b: Backend, task_id: str) -> TaskDetails:
        view = b.task_view(task_id)  # on PostgreSQL one statement
        if view is None:
            raise TaskNotFound()
        task = view.task
        details = TaskDetails(
            **msgspec.structs.asdict(task),
            dependencies=view.dependencies,
            assignments=[
                TaskAssignment(
                    a.agent_id, a.assigned_by, a.active, a.created_at_ms, a.updated_at_ms
                )
                for a in view.assignments
            ],
            available_transitions=self._available(b, task),
        )
        checkpoint = view.checkpoint_json
        details.checkpoint = msgspec.Raw(checkpoint if checkpoint is not None else "null")
        details.fence = view.fence
        details.previous_failures = view.previous_failures
        if view.latest_run is not None:
            details.latest_run = view.latest_run
        if view.cancelled_at_ms is not None:
            details.cancelled_at_ms, details.cancel_reason = (
                view.cancelled_at_ms,
                view.cancel_reason,
            )
        return details

    @verb(
        "GET",
        "/tasks/{id}/checkpoint",
        "The task's checkpoint, fence and earlier failures.",
        response=model.TaskCheckpoint,
        errors=(e.TaskNotFound,),
        extra=True,
        tag="tasks",
    )
    def get_checkpoint(self, b: Backend, task_id: str) -> TaskCheckpoint:
        found = b.task_checkpoint(task_id)
        if found is None:
            raise TaskNotFound()
        checkpoint, fence, failures = found
        raw = msgspec.Raw(checkpoint if checkpoint is not None else "null")
        return TaskCheckpoint(task_id, raw, fence, failures)

    @verb(
        "GET",
        "/tasks",
        "List tasks, oldest first, by keyset pages.",
        response=model.TaskPage,
        errors=(e.InvalidLimit, e.InvalidCursor),
        query=(
            Param("stage", "Only tasks in this stage."),
            Param("pipeline_id", "Only tasks of this pipeline."),
            Param("role", "Only tasks in stages whose agent_role is this role.", arg="agent_role"),
            Param(
                "q",
                "Only tasks whose title or id contains this text (any case). An addition of "
                "ours, for the dashboard: it walks the pages until it has found `limit`.",
                arg="text",
            ),
            *paging(50),
        ),
        tag="tasks",
        answer=page,
        cli="tasks list",
        tool=Tool("list_tasks"),
    )
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

    @verb(
        "GET",
        "/tasks/{id}/runs",
        "Every run of the task, oldest attempt first (order=desc: newest first): who claimed "
        "it (agent_id, agent_role), when, how it ended and the error it reported.",
        response=model.TaskRunPage,
        errors=(e.TaskNotFound, e.InvalidLimit, e.InvalidCursor, e.InvalidRequest),
        query=(
            Param(
                "order",
                "asc (the default): oldest attempt first; desc: newest first.",
                parse=p.newest_first,
                arg="newest_first",
            ),
            *paging(100, p.optional_id_cursor("an attempt number"), arg="cursor"),
        ),
        extra=True,
        tag="tasks",
        answer=page,
    )
    def list_task_runs(
        self, b: Backend, task_id: str, cursor: int | None, limit: int, newest_first: bool
    ) -> tuple[list[TaskRun], str | None]:
        """A page of the task's runs, oldest attempt first (the runs after attempt `cursor`)
        or newest first (the runs before it). A page with runs says the task exists: only an
        empty one asks (on PostgreSQL, one statement for the rest)."""
        if newest_first:
            before = _NEVER if cursor is None else cursor
            rows = b.list_task_runs_newest(task_id, before, limit + 1)
        else:
            rows = b.list_task_runs(task_id, cursor or 0, limit + 1)
        if not rows and not b.task_exists(task_id):
            raise TaskNotFound()
        return _page(rows, limit, lambda r: str(r.attempt))

    @verb(
        "GET",
        "/tasks/{id}/run-state",
        "The task's current or latest run id.",
        response=RunStateBody,
        errors=(e.TaskNotFound, e.NotFound),
        tag="tasks",
        answer=RunStateBody,
    )
    def run_state(self, b: Backend, task_id: str) -> str:
        run_id = b.task_run_state(task_id)
        if run_id is None:
            if not b.task_exists(task_id):
                raise TaskNotFound()
            raise NotFound("task has no run state")
        return run_id

    @verb(
        "POST",
        "/tasks/{id}/dependencies",
        "Make the task wait for another task.",
        request=commands.AddDependency,
        response=StatusBody,
        status=201,
        errors=(
            e.InvalidJson,
            e.InvalidDependency,
            e.TaskNotFound,
            e.DependencyTaskNotFound,
            e.DuplicateDependency,
        ),
        tag="tasks",
        answer=said("created"),
    )
    def add_dependency(
        self, b: Backend, task_id: str, cmd: commands.AddDependency, now: int
    ) -> None:
        depends_on = cmd.depends_on_task_id
        if task_id == depends_on:
            raise InvalidDependency()
        if not b.task_exists(task_id):
            raise TaskNotFound()
        if not b.task_exists(depends_on):
            raise DependencyTaskNotFound()
        b.insert_dependency(task_id, depends_on, now)  # DuplicateDependency: a key of the data

    @verb(
        "GET",
        "/tasks/{id}/dependencies",
        "The task's dependencies and whether each is resolved.",
        response=list[model.Dependency],
        tag="tasks",
    )
    def list_dependencies(self, b: Backend, task_id: str) -> list[Dependency]:
        return b.list_dependencies(task_id)

    @verb(
        "POST",
        "/tasks/{id}/assignments",
        "Assign the task to one agent (replaces the active assignment).",
        request=commands.Assign,
        response=StatusBody,
        status=201,
        errors=(e.InvalidJson, e.TaskNotFound),
        tag="tasks",
        answer=said("assigned"),
    )
    def assign(self, b: Backend, task_id: str, cmd: Assign, now: int) -> None:
        task = b.get_task(task_id)
        if task is None:
            raise TaskNotFound()
        b.deactivate_assignments(task_id, now)
        b.upsert_assignment(task_id, cmd.agent_id, cmd.assigned_by, now)
        self._signal(b, task.pipeline_id, task.stage, agent=cmd.agent_id)

    @verb(
        "DELETE",
        "/tasks/{id}/assignments/{agent_id+}",
        "End the agent's active assignment.",
        response=StatusBody,
        errors=(e.TaskNotFound, e.NotFound),
        tag="tasks",
        answer=said("unassigned"),
    )
    def unassign(self, b: Backend, task_id: str, agent_id: str, now: int) -> None:
        if not b.unassign(task_id, agent_id, now):
            if not b.task_exists(task_id):
                raise TaskNotFound()
            raise NotFound("no active assignment for this task and agent")
        task = b.get_task(task_id)
        if task is not None:
            self._signal(b, task.pipeline_id, task.stage)

    @verb(
        "GET",
        "/tasks/{id}/assignments",
        "Every assignment of the task, active or not.",
        response=list[model.Assignment],
        tag="tasks",
    )
    def list_assignments(self, b: Backend, task_id: str) -> list[Assignment]:
        return b.list_assignments(task_id)

    # --- operator verbs ------------------------------------------------------------------------

    @verb(
        "POST",
        "/tasks/{id}/requeue",
        "Make a dead-lettered, cancelled, failed or waiting task claimable now: in the given "
        "non-terminal stage, or in the stage it failed in (a task a dead-letter policy moved "
        "goes back to the stage it was dead-lettered from; a task in a terminal stage needs "
        "a stage). Clears the dead-letter, the cancellation and any retry delay; with "
        "reset_attempts its failures so far stop counting against max_attempts. Records a "
        "`requeued` task event. The body is optional.",
        name="requeue_task",
        client="requeue",
        request=commands.RequeueTask,
        response=model.TaskDetails,
        errors=(e.InvalidJson, e.TaskNotFound, e.InvalidStage, e.TaskLeased, e.TaskFinished),
        extra=True,
        optional_body=True,
        tag="tasks",
        cli="tasks requeue",
    )
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
        leased = self._lease_of_task(b, task_id, now) is not None
        task = b.get_task(task_id)
        assert task is not None
        pipeline = self._definition(b, task.pipeline_id)
        if pipeline is None:
            raise TrackerError("the task's pipeline cannot be read")
        if leased:
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

    @verb(
        "POST",
        "/tasks/requeue",
        "Requeue many tasks at once (1..500 ids, e.g. a selection or a group of "
        "GET /ops/failures): each as POST /tasks/{id}/requeue would, with the same stage, "
        "reset_attempts, reason and actor for all, in one transaction. A task that verb would "
        "refuse (not found, leased, finished, a bad stage) is left as it was and answered "
        "`refused` with that error; the others are requeued. Answers per id, in the order "
        "given.",
        name="requeue_tasks",
        request=commands.RequeueTasks,
        response=model.BulkOutcome,
        errors=(e.InvalidJson, e.InvalidRequest),
        extra=True,
        tag="tasks",
    )
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

    @verb(
        "POST",
        "/tasks/{id}/cancel",
        "Cancel a task: it is never claimed again (until requeued). A live lease is revoked "
        "at once: its run ends `cancelled` and the holder's next lease call gets 409 "
        "task_cancelled. A cancelled task does not count as resolved for tasks that depend "
        "on it. Cancelling again answers the same; a task in a terminal stage cannot be "
        "cancelled. Records a `cancelled` task event. The body is optional.",
        name="cancel_task",
        client="cancel",
        request=commands.CancelTask,
        response=model.TaskDetails,
        errors=(e.InvalidJson, e.TaskNotFound, e.TaskFinished),
        extra=True,
        optional_body=True,
        tag="tasks",
        cli="tasks cancel",
    )
    def cancel(self, b: Backend, task_id: str, cmd: CancelTask, now: int) -> TaskDetails:
        """Never claim the task again. A live lease is revoked: its run ends `cancelled` and
        its holder's next lease call gets 409 task_cancelled. Cancelling again changes
        nothing. A task in a terminal stage is finished and cannot be cancelled (409)."""
        self._cancel(b, task_id, cmd, now)
        return self.get_task(b, task_id)

    @verb(
        "POST",
        "/tasks/cancel",
        "Cancel many tasks at once (1..500 ids): each as POST /tasks/{id}/cancel would, in one "
        "transaction. Answers per id, in the order given: `cancelled`, `already_cancelled`, "
        "or `refused` with the error that verb would answer (not found, finished).",
        name="cancel_tasks",
        request=commands.CancelTasks,
        response=model.BulkOutcome,
        errors=(e.InvalidJson, e.InvalidRequest),
        extra=True,
        tag="tasks",
    )
    def cancel_many(self, b: Backend, cmd: CancelTasks, now: int) -> BulkOutcome:
        """POST /tasks/cancel: each id as `cancel` would, in order; a task it refuses is
        reported and left as it was, and the others go on."""
        one = CancelTask(cmd.reason, cmd.actor)

        def act(task_id: str) -> TaskOutcome:
            changed, stage = self._cancel(b, task_id, one, now)
            return TaskOutcome(task_id, "cancelled" if changed else "already_cancelled", stage)

        return _bulk(cmd.ids, act)

    def _lease_of_task(self, b: Backend, task_id: str, now: int) -> tuple[str, str, int] | None:
        """(lease id, run id, expires_at_ms) of the task's live lease, or None, once a lease
        past its time has expired as such (its run stale, the expiry counted). The lease's own
        time decides: `_next_expiry` cannot know of every lease (another server's, or one
        claimed here while the reaper read), and a cancel or requeue must not take an expired
        lease for a live one."""
        if now >= self._next_expiry:
            self.reap_expired(b, now)
        lease = b.live_lease_of_task(task_id)
        # The reaper takes the oldest first, in batches; where rows are locked (PostgreSQL),
        # it skips the rows others hold and never waits, and this one is held here.
        while lease is not None and lease[2] <= now and self.reap_expired(b, now):
            lease = b.live_lease_of_task(task_id)
        return lease

    def _cancel(self, b: Backend, task_id: str, cmd: CancelTask, now: int) -> tuple[bool, str]:
        """`cancel` without the answer: (whether it cancelled the task now, its stage). Raises
        before it writes anything but the reaping of expired leases."""
        if not b.task_exists(task_id):
            raise TaskNotFound()
        # The live lease first: where rows are locked (PostgreSQL), this waits for a write
        # under that lease to end, so the task read next is the one that write left (a
        # transition into the terminal stage makes the cancel a 409, not a cancelled
        # finished task).
        revoked = self._lease_of_task(b, task_id, now)
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

    @verb(
        "GET",
        "/tasks/{id}/events",
        "What operators did to the task (requeued, cancelled), oldest first.",
        response=model.TaskEventPage,
        errors=(e.TaskNotFound, e.InvalidLimit, e.InvalidCursor),
        query=paging(100, p.id_cursor()),
        extra=True,
        tag="tasks",
        answer=page,
    )
    def list_task_events(
        self, b: Backend, task_id: str, after: int, limit: int
    ) -> tuple[list[TaskEvent], str | None]:
        if not b.task_exists(task_id):
            raise TaskNotFound()
        rows = b.list_task_events(task_id, after, limit + 1)
        return _page(rows, limit, lambda e: str(e.id))
