"""One function per API verb. Each runs inside a transaction the caller provides: writes on the
writer's connection (one savepoint each), reads inside a reader's snapshot. Decisions come from
`core`; rows come from the storage backend.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from nulltickets import __version__, core, otlp
from nulltickets.domain import fsm
from nulltickets.domain.commands import (
    AppendEvent,
    Assign,
    Claim,
    CreateArtifact,
    CreatePipeline,
    CreateTask,
    FailRun,
    Heartbeat,
    MoveTask,
    PutValue,
    ReleaseRun,
    WriteCheckpoint,
    compact_json,
)
from nulltickets.domain.ids import new_id
from nulltickets.domain.model import (
    AgentReleased,
    Artifact,
    Assignment,
    AvailableTransition,
    CheckpointResult,
    ClaimedTask,
    ClaimResult,
    Dependency,
    Event,
    Health,
    LeaseRow,
    Pipeline,
    QueueReport,
    Released,
    RoleQueue,
    Run,
    RunStatus,
    SearchHit,
    Span,
    StoreEntry,
    Task,
    TaskAssignment,
    TaskCheckpoint,
    TaskDetails,
    TraceIngest,
    TransitionResult,
)
from nulltickets.domain.search import fts_query
from nulltickets.domain.tokens import new_lease_token, same_hash
from nulltickets.errors import (
    DependencyTaskNotFound,
    DuplicateDependency,
    DuplicateName,
    IdempotencyConflict,
    InvalidDependency,
    InvalidJson,
    InvalidPipeline,
    InvalidQuery,
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
    TaskNotFound,
    TaskVersionMismatch,
    TrackerError,
    Unauthorized,
)
from nulltickets.otlp import SpanRow
from nulltickets.storage.backend import Backend

RESERVED_NAMESPACE = "search"
IDEMPOTENCY_RETENTION_MS = 24 * 3600 * 1000
REAP_BATCH = 500
_NEVER = 2**63 - 1

_encode = msgspec.json.encode


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _json(value: Any) -> str:
    return _encode(value).decode()


@dataclass(frozen=True, slots=True)
class Reply:
    """An encoded response, as stored for idempotent replay."""

    status: int
    body: bytes


class Tracker:
    """The service. Holds no state but a cache of parsed pipeline definitions (they are
    immutable once created)."""

    def __init__(self) -> None:
        self._pipelines: dict[str, fsm.Pipeline | None] = {}
        self._transitions: dict[tuple[str, str], list[AvailableTransition]] = {}
        self._lock = threading.Lock()
        # A lower bound of every live lease's expiry (0: unknown). Only the writer touches it;
        # the background janitor recomputes it, so a rolled-back batch cannot leave it wrong.
        self._next_expiry = 0
        # (pipeline, stage, max_concurrency) of each role's capped stages, built on demand.
        self._capped: dict[str, list[tuple[str, str, int]]] = {}
        # Roles that may have claimable work now or at a time: (role, at_ms; 0 = now). Filled
        # by writes when `signalling` is on, drained by the server after each commit to wake
        # long-polling claims. A signal from a batch that rolled back only causes a recheck.
        self.signalling = False
        self.signals: list[tuple[str, int]] = []
        # Long-poll claims in progress (the server counts them from before their first attempt
        # to their return). With none, a "work now" signal has nobody to wake: every later
        # claim looks at the committed state first. Signals for later (retry delays) are kept.
        self.long_polls = 0

    @property
    def _listening(self) -> bool:
        return self.signalling and self.long_polls > 0

    def _signal(self, b: Backend, pipeline_id: str, stage: str, at: int = 0) -> None:
        if not self.signalling or (at == 0 and not self.long_polls):
            return
        pipeline = self._definition(b, pipeline_id)
        state = pipeline.states.get(stage) if pipeline is not None else None
        if state is not None and state.agent_role is not None:
            self.signals.append((state.agent_role, at))

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
        if b.pipeline_name_taken(cmd.name):
            raise DuplicateName(f"a pipeline named {cmd.name!r} already exists")
        pipeline_id = new_id()
        b.insert_pipeline(pipeline_id, cmd.name, definition_json, now)
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

    def create_task(self, b: Backend, cmd: CreateTask, now: int) -> str:
        if b.get_pipeline(cmd.pipeline_id) is None:
            raise PipelineNotFound(f"pipeline {cmd.pipeline_id!r} not found")
        pipeline = self._definition(b, cmd.pipeline_id)
        if pipeline is None:
            raise TrackerError("the pipeline's stored definition cannot be read")
        if cmd.idempotency_key is not None:
            existing = b.task_by_idempotency_key(cmd.pipeline_id, cmd.idempotency_key)
            if existing is not None:
                return existing  # the same plan again: the task is already there
        policy = cmd.retry_policy
        task_id = new_id()
        b.insert_task(
            id=task_id,
            pipeline_id=cmd.pipeline_id,
            stage=pipeline.initial,
            title=cmd.title,
            description=cmd.description,
            priority=cmd.priority or 0,
            metadata_json=compact_json(cmd.metadata, "{}"),
            max_attempts=policy.max_attempts if policy else None,
            retry_delay_ms=(policy.retry_delay_ms or 0) if policy else 0,
            dead_letter_stage=policy.dead_letter_stage if policy else None,
            idempotency_key=cmd.idempotency_key,
            retry_delay_set=int(policy is not None and policy.retry_delay_ms is not None),
            now=now,
        )
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
        self._signal(b, cmd.pipeline_id, pipeline.initial)
        return task_id

    def create_tasks(self, b: Backend, cmds: list[CreateTask], now: int) -> list[str]:
        return [self.create_task(b, cmd, now) for cmd in cmds]

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
        task = b.get_task(task_id)
        if task is None:
            raise NotFound("task not found")
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
        details.checkpoint, details.fence = self._resume(b, task_id)
        details.previous_failures = b.previous_failures(task_id)
        if latest is not None:
            details.latest_run = latest
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
            raise NotFound("task not found")
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
    ) -> tuple[list[Task], str | None]:
        rows = b.list_tasks(stage=stage, pipeline_id=pipeline_id, after=after, limit=limit + 1)
        return _page(rows, limit, lambda t: f"{t.created_at_ms}:{t.id}")

    def run_state(self, b: Backend, task_id: str) -> str:
        run_id = b.task_run_state(task_id)
        if run_id is None:
            raise NotFound("task has no run state")
        return run_id

    def add_dependency(self, b: Backend, task_id: str, depends_on: str, now: int) -> None:
        if task_id == depends_on:
            raise InvalidDependency()
        if not b.task_exists(task_id):
            raise TaskNotFound()
        if not b.task_exists(depends_on):
            raise DependencyTaskNotFound()
        if b.dependency_exists(task_id, depends_on):
            raise DuplicateDependency()
        b.insert_dependency(task_id, depends_on, now)

    def list_dependencies(self, b: Backend, task_id: str) -> list[Dependency]:
        return b.list_dependencies(task_id)

    def assign(self, b: Backend, task_id: str, cmd: Assign, now: int) -> None:
        task = b.get_task(task_id)
        if task is None:
            raise TaskNotFound()
        b.deactivate_assignments(task_id, now)
        b.upsert_assignment(task_id, cmd.agent_id, cmd.assigned_by, now)
        self._signal(b, task.pipeline_id, task.stage)

    def unassign(self, b: Backend, task_id: str, agent_id: str, now: int) -> None:
        if not b.unassign(task_id, agent_id, now):
            raise NotFound("no active assignment for this task and agent")
        task = b.get_task(task_id)
        if task is not None:
            self._signal(b, task.pipeline_id, task.stage)

    def list_assignments(self, b: Backend, task_id: str) -> list[Assignment]:
        return b.list_assignments(task_id)

    # --- leases --------------------------------------------------------------------------------

    def reap_expired(self, b: Backend, now: int) -> int:
        """Expire every lease past its time: the run goes stale, a `lease_expired` event is
        written, and the expiry counts as a failed attempt under the task's retry policy."""
        expired = b.expired_leases(now, REAP_BATCH)
        if len(expired) < REAP_BATCH:
            # Nothing can expire before the earliest remaining expiry: claims may skip the
            # janitor until then (claims and heartbeats only ever move that time later).
            self._next_expiry = b.next_lease_expiry() or _NEVER
        for lease_id, run_id, task_id in expired:
            b.delete_lease(lease_id)
            b.end_run(run_id, RunStatus.STALE, "{}", "lease_expired", now)
            task = b.get_task(task_id)
            assert task is not None
            failed = b.failed_attempts(task_id)
            b.insert_event(
                run_id,
                "lease_expired",
                _json({"reason": "lease_expired", "lease_id": lease_id, "failed_attempts": failed}),
                now,
            )
            self._after_failure(b, task, run_id, failed, now)
        return len(expired)

    def _after_failure(self, b: Backend, task: Task, run_id: str, failed: int, now: int) -> None:
        pipeline = self._definition(b, task.pipeline_id)
        policy = pipeline.policy(task.stage) if pipeline is not None else fsm.NO_POLICY
        # The task's own retry delay wins; the stage's applies when the task set none.
        base = task.retry_delay_ms
        if policy.retry_delay_ms is not None and not (base or b.retry_delay_set(task.id)):
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
            rand=random.random(),
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
            b.schedule_retry(task.id, outcome.next_eligible_at_ms, now)
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
        task = b.claim_candidate(
            cmd.agent_role,
            cmd.agent_id,
            _json(full) if full else None,
            now,
            _json(capped) if capped else None,
        )
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
        claimed = ClaimedTask(
            **msgspec.structs.asdict(task),
            available_transitions=self._available(b, task),
            checkpoint=checkpoint,
            fence=fence,
            previous_failures=b.previous_failures(task.id) if attempt > 1 else [],
        )
        return ClaimResult(claimed, run, lease_id, token, expires, fence)

    def _full_pairs(self, b: Backend, role: str) -> list[tuple[str, str]]:
        """(pipeline, stage) of this role whose stage policy's max_concurrency is reached."""
        capped = self._capped.get(role)
        if capped is None:
            capped = []
            for pipeline_id, stage in b.role_stages(role):
                pipeline = self._definition(b, pipeline_id)
                cap = pipeline.policy(stage).max_concurrency if pipeline is not None else None
                if cap is not None:
                    capped.append((pipeline_id, stage, cap))
            self._capped[role] = capped
        return [(p, s) for p, s, cap in capped if b.leased_in_pipeline_stage(p, s) >= cap]

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
        b.end_run(
            lease.run_id, RunStatus.FAILED, compact_json(cmd.usage, "{}") or "{}", cmd.error, now
        )
        b.delete_lease(lease.id)
        self._after_failure(b, task, lease.run_id, b.failed_attempts(task.id), now)

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
            meta_json=compact_json(cmd.meta, "{}"),
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
        query = fts_query(text)
        if query is None:
            raise InvalidQuery("q has no search term")
        if filter_path is not None and not filter_path.startswith("$"):
            raise InvalidQuery("filter_path must be a JSON path such as $.status")
        try:
            return b.search_store(query, namespace, filter_path, filter_value, limit)
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
            b.insert_otlp_span(batch, msgspec.structs.asdict(span))
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
        return QueueReport(list(roles.values()), now)

    # --- health and upkeep ---------------------------------------------------------------------

    def health(self, b: Backend, now: int) -> Health:
        sqlite_version, sqlite_options = b.sqlite()
        return Health(
            "ok", __version__, b.tasks_by_stage(), b.active_leases(now), core.IMPLEMENTATION,
            sqlite_version, sqlite_options,
        )  # fmt: skip

    def purge_idempotency(self, b: Backend, now: int) -> int:
        return b.purge_idempotency(now - IDEMPOTENCY_RETENTION_MS)

    # --- idempotency ---------------------------------------------------------------------------

    def idempotent(
        self,
        b: Backend,
        *,
        key: str,
        method: str,
        path: str,
        request_hash: bytes,
        auth_hash: bytes | None,
        execute: Callable[[], Reply],
        now: int,
        redact: Callable[[bytes], bytes] | None = None,
        revive: Callable[[bytes], bytes] | None = None,
    ) -> Reply:
        """Replay the stored success for this key, or execute and store a success.

        Only successes are stored; failures run again on retry. On lease routes the stored
        lease-token hash must match the presented one before anything is replayed.
        """
        stored = b.get_idempotency(key, method, path)
        if stored is not None:
            stored_hash, stored_auth, status, body = stored
            if not same_hash(stored_hash, request_hash):
                raise IdempotencyConflict()
            if stored_auth is not None and (
                auth_hash is None or not same_hash(stored_auth, auth_hash)
            ):
                raise Unauthorized("lease token does not match")
            raw = body.encode()
            return Reply(status, revive(raw) if revive is not None else raw)
        reply = execute()
        # Only answers with a body are kept: a 204 (no claimable task, a PUT or DELETE done)
        # has nothing to replay, and running it again is what a retry should do.
        if reply.status in (200, 201):
            stored_body = redact(reply.body) if redact is not None else reply.body
            b.put_idempotency(
                key=key,
                method=method,
                path=path,
                request_hash=request_hash,
                auth_hash=auth_hash,
                status=reply.status,
                body=stored_body.decode(),
                now=now,
            )
        return reply


def _clamp(t: int) -> int:
    return max(-(2**63), min(t, 2**63 - 1))


def _page(rows: list[Any], limit: int, cursor_of: Any) -> tuple[list[Any], str | None]:
    """Trim the look-ahead row; the cursor names the last row returned, so nothing is skipped."""
    if len(rows) > limit:
        rows = rows[:limit]
        return rows, cursor_of(rows[-1])
    return rows, None
