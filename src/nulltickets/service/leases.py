"""Leases and runs: claim, heartbeat, expiry, and what the holder of a run does with it
(events, checkpoint, transition, fail, release)."""

from __future__ import annotations

import msgspec

from nulltickets import core
from nulltickets import errors as e
from nulltickets.domain import commands, fsm, model
from nulltickets.domain.commands import (
    AppendEvent,
    Claim,
    FailRun,
    Heartbeat,
    MoveTask,
    ReleaseRun,
    WriteCheckpoint,
    compact_json,
)
from nulltickets.domain.ids import new_id
from nulltickets.domain.model import (
    AgentReleased,
    CheckpointResult,
    ClaimedTask,
    ClaimResult,
    Event,
    EventIdBody,
    ExpiresBody,
    LeaseRow,
    Released,
    Run,
    RunStatus,
    StatusBody,
    Task,
    TransitionResult,
)
from nulltickets.domain.tokens import (
    new_lease_token,
    same_hash,
)
from nulltickets.errors import (
    InvalidJson,
    LeaseExpired,
    LeaseNotFound,
    LeaseSuperseded,
    RunNotRunning,
    TaskCancelled,
    TaskVersionMismatch,
    TrackerError,
    Unauthorized,
)
from nulltickets.service import params as p
from nulltickets.service.base import (
    _NEVER,
    REAP_BATCH,
    SHARED_REAP_HORIZON_MS,
    TrackerBase,
    _json,
    _page,
)
from nulltickets.service.verbs import LEASE_ERRORS, Guard, Tool, page, paging, said, verb
from nulltickets.storage.backend import (
    Backend,
    Claimed,
    Failed,
    Move,
    NewPipeline,
    StagePolicyRow,
)

# What Leases._moves keeps and sends: the triggers it knows the moves of, and the moves of
# one trigger sent with a transition.
MAX_TRIGGERS = 256
MAX_MOVES = 64
# The most stage policies Leases._stage_policies sends with a failure.
MAX_STAGE_POLICIES = 256


def _transition_data(trigger: str, from_stage: str, to_stage: str, instructions: str | None) -> str:
    """The data of a `transition` event."""
    data = {
        "trigger": trigger,
        "from": from_stage,
        "to": to_stage,
        "instructions": instructions or "",
    }
    return _json(data)


class Leases(TrackerBase):
    # --- leases --------------------------------------------------------------------------------

    def reap_expired(self, b: Backend, now: int) -> int:
        """Expire every lease past its time: the run goes stale, a `lease_expired` event is
        written, and the expiry counts as a failed attempt under the task's retry policy.
        With the task's pipeline read by this process (nearly always), each lease is one call
        of `Backend.expire_lease` (on PostgreSQL one statement); otherwise step by step."""
        expired = b.expired_leases(now, REAP_BATCH)
        if len(expired) < REAP_BATCH:
            # Nothing can expire before the earliest remaining expiry: claims may skip the
            # janitor until then (claims and heartbeats only ever move that time later).
            upcoming = b.next_lease_expiry() or _NEVER
            if self._shared:
                upcoming = min(upcoming, now + SHARED_REAP_HORIZON_MS)
            self._next_expiry = upcoming
        reaped = 0
        known = self._stage_policies() if expired else None
        for lease_id, run_id, task_id in expired:
            if known is not None:
                # Nearly always: one call (on PostgreSQL one statement) with its wake-ups.
                ended = b.expire_lease(
                    lease_id=lease_id,
                    known_pipelines=known[0],
                    unreadable=known[1],
                    policies=known[2],
                    rand=self._rand(),
                    now=now,
                )
                if ended is not None:
                    reaped += 1
                    self._woken_after(b, ended)
                    continue
            # Step by step: a pipeline this process has not read (it is read below), one
            # that cannot be parsed, or a run that ended meanwhile.
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
            if known is not None and task.pipeline_id not in known[1]:
                self._read_every_pipeline(b)  # the next leases go in one call again
                known = self._stage_policies()
        return reaped

    def _after_failure(
        self,
        b: Backend,
        task: Task,
        run_id: str,
        failed: int,
        error: str | None,
        now: int,
        retryable: bool | None = None,
    ) -> None:
        """Retry the task later or dead-letter it, by its policy, after the failed attempt
        `run_id` (its `failed`-th) that reported `error`; `retryable` false: dead-letter it
        now."""
        pipeline = self._definition(b, task.pipeline_id)
        policy = pipeline.policy(task.stage) if pipeline is not None else fsm.NO_POLICY
        # The task's own retry delay wins; the stage's applies when the task set none; the
        # default backoff when neither did (None).
        base: int | None = task.retry_delay_ms
        if not (base or b.retry_delay_set(task.id)):
            base = policy.retry_delay_ms
        outcome = core.decide_failure(
            stage=task.stage,
            max_attempts=0 if retryable is False else task.max_attempts,
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
        if isinstance(outcome, core.DeadLettered):
            if retryable is False:
                outcome = core.DeadLettered(
                    failed, outcome.from_stage, outcome.dead_letter_stage, "not_retryable"
                )
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
            self._failure_wakeups(b, task.pipeline_id, task.id, task.stage, True, target, 0)
        else:
            b.schedule_retry(task.id, outcome.next_eligible_at_ms, error, now)
            data = {
                "reason": "retry_scheduled",
                "failed_attempts": failed,
                "retry_delay_ms": outcome.retry_delay_ms,
                "next_eligible_at_ms": outcome.next_eligible_at_ms,
            }
            b.insert_event(run_id, "retry_scheduled", _json(data), now)
            at = outcome.next_eligible_at_ms
            self._failure_wakeups(b, task.pipeline_id, task.id, task.stage, False, None, at)

    def _woken_after(self, b: Backend, failed: Failed) -> None:
        """The wake-ups of a failed attempt Backend.fail_run or expire_lease decided, unless
        they went with its statement."""
        if not failed.notified:
            self._failure_wakeups(
                b,
                failed.pipeline_id,
                failed.task_id,
                failed.stage,
                failed.dead_lettered,
                failed.dead_letter_stage,
                failed.next_eligible_at_ms,
            )

    def _failure_wakeups(
        self,
        b: Backend,
        pipeline_id: str,
        task_id: str,
        stage: str,
        dead_lettered: bool,
        dead_letter_stage: str | None,
        next_eligible_at_ms: int,
    ) -> None:
        """The wake-ups of a failed attempt: capacity freed in its stage; then new work in the
        dead-letter stage and, when that is terminal, for the tasks that depend on it; or the
        retry, at its time."""
        self._signal(b, pipeline_id, stage)  # a lease ended: capacity is free
        if dead_lettered:
            pipeline = self._definition(b, pipeline_id)
            if self._listening and dead_letter_stage is not None and pipeline is not None:
                self._signal(b, pipeline_id, dead_letter_stage)
                if pipeline.is_terminal(dead_letter_stage):  # dependents count it as resolved
                    for dependent_pipeline, dependent_stage in b.dependent_stages(task_id):
                        self._signal(b, dependent_pipeline, dependent_stage)
        else:
            self._signal(b, pipeline_id, stage, next_eligible_at_ms)

    def claim(self, b: Backend, cmd: Claim, now: int) -> ClaimResult | None:
        """Claim the role's best claimable task: one call of `Backend.claim` (on PostgreSQL one
        statement), with the run and lease ids and the token made here beforehand."""
        requested = core.lease_ttl(cmd.lease_ttl_ms, default=0) or None  # refused if bad
        if now >= self._next_expiry:  # some lease may have expired: reap before choosing
            self.reap_expired(b, now)
        full = self._full_stages(b, cmd) if cmd.concurrency is not None else []
        run_id, lease_id = new_id(), new_id()
        token, token_hash = new_lease_token()
        got: Claimed | NewPipeline | None = None
        for _ in range(3):
            known, capped, ttls = self._role_limits(b, cmd.agent_role)
            got = b.claim(
                agent_role=cmd.agent_role,
                agent_id=cmd.agent_id,
                run_id=run_id,
                lease_id=lease_id,
                token_hash=token_hash,
                ttl_ms=requested,
                stage_ttls=ttls,
                default_ttl_ms=core.DEFAULT_LEASE_TTL_MS,
                full_stages=full,
                capped=capped,
                known_pipelines=known,
                now=now,
            )
            if not isinstance(got, NewPipeline):
                break
            # A pipeline created since the role's limits were read (by another server): read
            # them again, and choose again under them (a task of a pipeline whose definition
            # this process has read is what the claim answers with, with no read after it).
            self._capped.pop(cmd.agent_role, None)
        if got is None or isinstance(got, NewPipeline):
            return None
        task = got.task
        self._next_expiry = min(self._next_expiry, got.expires_at_ms)
        run = Run(
            run_id, task.id, got.attempt, RunStatus.RUNNING, cmd.agent_id, cmd.agent_role, now, None
        )
        checkpoint = got.checkpoint_json
        claimed = ClaimedTask(*msgspec.structs.astuple(task))  # the Task's fields, then:
        claimed.available_transitions = self._available(b, task)
        claimed.checkpoint = msgspec.Raw(checkpoint if checkpoint is not None else b"null")
        claimed.fence = got.fence
        claimed.previous_failures = got.previous_failures
        return ClaimResult(claimed, run, lease_id, token, got.expires_at_ms, got.fence)

    def _role_limits(
        self, b: Backend, role: str
    ) -> tuple[frozenset[str], list[tuple[str, str, int]], list[tuple[str, str, int]]]:
        """The pipelines the role's limits were read from; (pipeline, stage, max_concurrency)
        of this role's stages whose policy caps them; and (pipeline, stage, lease TTL) of
        those whose policy sets a TTL. Read once per role (a definition never changes; a new
        pipeline empties the cache, and a claim that meets one reads them again). Claims run
        at once in threads on PostgreSQL: what was read is returned, never looked up again."""
        known = self._capped.get(role)
        if known is None:
            capped = []
            ttls = []
            pipelines = set()
            for pipeline_id, stage in b.role_stages(role):
                pipelines.add(pipeline_id)
                pipeline = self._definition(b, pipeline_id)
                policy = pipeline.policy(stage) if pipeline is not None else fsm.NO_POLICY
                if policy.max_concurrency is not None:
                    capped.append((pipeline_id, stage, policy.max_concurrency))
                if policy.lease_ttl_ms:
                    ttls.append((pipeline_id, stage, policy.lease_ttl_ms))
            known = self._capped[role] = (frozenset(pipelines), capped, ttls)
        return known

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

    @verb(
        "GET",
        "/runs/{id}",
        "A run: its task, attempt, status, the agent that claimed it, when it started and "
        "ended. Any key that reads may ask; the run's lease token is not needed.",
        response=model.Run,
        errors=(e.RunNotFound,),
        extra=True,
        tag="runs",
    )
    def get_run(self, b: Backend, run_id: str) -> Run:
        run = b.run_by_id(run_id)
        if run is None:
            raise e.RunNotFound(f"no run with id {run_id!r}")
        return run

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

    @verb(
        "POST",
        "/leases/{id}/heartbeat",
        "Extend a lease by its TTL (or the lease_ttl_ms given).",
        guard=Guard.LEASE,
        request=commands.Heartbeat,
        response=ExpiresBody,
        errors=(*LEASE_ERRORS, e.InvalidJson, e.InvalidLeaseTtl),
        trailing=True,
        optional_body=True,
        tag="leases",
        answer=ExpiresBody,
        tool=Tool(
            "heartbeat",
            "Extend the lease on the task this session holds (the lease ends unless it is "
            "extended, by this or by any other tool on the task).",
        ),
    )
    def heartbeat(
        self, b: Backend, lease_id: str, token_hash: bytes, cmd: Heartbeat, now: int
    ) -> int:
        """Extend the lease. With the lease in order (nearly always) that is one statement;
        otherwise the lease is read, and what is wrong with it said, in the order below."""
        requested = cmd.lease_ttl_ms
        if requested is None or requested > 0:  # a bad TTL is said after the lease's errors
            ttl = None if requested is None else core.lease_ttl(requested)
            expires = b.extend_held_lease(
                lease_id, token_hash, cmd.expected_fence, ttl, core.DEFAULT_LEASE_TTL_MS, now
            )
            if expires is not None:
                return expires
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

    @verb(
        "POST",
        "/runs/{id}/events",
        "Append an event to a run.",
        guard=Guard.LEASE,
        client="event",
        request=commands.AppendEvent,
        response=EventIdBody,
        status=201,
        errors=(*LEASE_ERRORS, e.InvalidJson),
        trailing=True,
        tag="runs",
        answer=EventIdBody,
        tool=Tool(
            "add_event",
            "Record an event (progress, a note, a result) on the run of the task this session "
            "holds.",
        ),
    )
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

    @verb(
        "GET",
        "/runs/{id}/events",
        "A run's events, oldest first.",
        guard=Guard.LEASE,
        response=model.EventPage,
        errors=(e.Unauthorized, e.InvalidLimit, e.InvalidCursor),
        query=paging(100, p.id_cursor()),
        trailing=True,
        tag="runs",
        answer=page,
        custom=True,
        cli="runs tail",
    )
    def list_events(
        self, b: Backend, run_id: str, after: int, limit: int
    ) -> tuple[list[Event], str | None]:
        rows = b.list_events(run_id, after, limit + 1)
        return _page(rows, limit, lambda e: str(e.id))

    @verb(
        "POST",
        "/runs/{id}/transition",
        "Complete the run and move its task along a transition.",
        guard=Guard.LEASE,
        name="transition",
        request=commands.MoveTask,
        response=model.TransitionResult,
        errors=(
            *LEASE_ERRORS,
            e.InvalidJson,
            e.RunNotRunning,
            e.IllegalTransition,
            e.ExpectedStageMismatch,
            e.TaskVersionMismatch,
        ),
        trailing=True,
        tag="runs",
        tool=Tool(
            "transition_task",
            "Move the held task along one of its available transitions (claim_task lists them); "
            "the lease ends.",
            hide=("expected_stage", "expected_task_version"),
            ends_lease=True,
        ),
    )
    def move(
        self, b: Backend, run_id: str, token_hash: bytes, cmd: MoveTask, now: int
    ) -> TransitionResult:
        """Complete the run and move its task. With the lease in order and the move known
        (nearly always), that is one call of `Backend.transition_run` (on PostgreSQL one
        statement); otherwise the lease is checked and the move decided step by step, which
        says what is wrong, if anything."""
        moves = self._moves(cmd.trigger, cmd.instructions)
        try:
            usage = compact_json(cmd.usage, "{}") or "{}"
        except InvalidJson:
            usage, moves = "", None  # said after the lease's errors, below
        if moves is not None:
            moved = b.transition_run(
                run_id=run_id,
                token_hash=token_hash,
                fence=cmd.expected_fence,
                expected_stage=cmd.expected_stage,
                expected_task_version=cmd.expected_task_version,
                moves=moves,
                usage_json=usage,
                now=now,
            )
            if moved is not None:
                if not moved.notified:
                    self._moved(
                        b, moved.pipeline_id, moved.task_id, moved.from_stage, moved.to_stage
                    )
                return TransitionResult(moved.from_stage, moved.to_stage, cmd.trigger)
        lease = self.check_run_lease(b, run_id, token_hash, now, cmd.expected_fence)
        return self.transition(b, lease, cmd, now)

    def transition(self, b: Backend, lease: LeaseRow, cmd: MoveTask, now: int) -> TransitionResult:
        """The transition step by step, under the lease checked."""
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
        data = _transition_data(cmd.trigger, lease.stage, move.to_stage, instructions)
        b.insert_event(lease.run_id, "transition", data, now)
        self._moved(b, lease.pipeline_id, lease.task_id, lease.stage, move.to_stage)
        return TransitionResult(lease.stage, move.to_stage, cmd.trigger)

    def _moved(
        self, b: Backend, pipeline_id: str, task_id: str, from_stage: str, to_stage: str
    ) -> None:
        """The wake-ups of a task moved (those Backend.transition_run sends itself): capacity
        freed in the old stage when its policy caps it, new work in the new one, and, when that
        one is terminal, the tasks that depend on it."""
        if not self._listening:
            return
        pipeline = self._definition(b, pipeline_id)
        if pipeline is not None and _caps(pipeline, from_stage):
            self._signal(b, pipeline_id, from_stage)
        self._signal(b, pipeline_id, to_stage)
        if pipeline is not None and pipeline.is_terminal(to_stage):
            for dependent_pipeline, stage in b.dependent_stages(task_id):
                self._signal(b, dependent_pipeline, stage)

    def _moves(self, trigger: str, instructions: str | None) -> list[Move] | None:
        """Every move `trigger` makes in the pipelines this process has read: what
        Backend.transition_run chooses from. None when there is none (or too many to send):
        the transition then goes step by step, reading the pipeline it needs."""
        pipelines = self._pipelines
        known = self._by_trigger.get(trigger)
        if known is None or known[0] != len(pipelines):
            found = []
            for pipeline_id, pipeline in list(pipelines.items()):
                if pipeline is None:
                    continue
                for t in pipeline.transitions:
                    if (
                        t.trigger == trigger
                        and pipeline.find_transition(t.from_stage, trigger) is t
                    ):
                        capped = _caps(pipeline, t.from_stage)
                        found.append(
                            (pipeline_id, t.from_stage, t.to_stage, t.instructions, capped)
                        )
            if len(self._by_trigger) >= MAX_TRIGGERS:  # triggers come from requests
                self._by_trigger.clear()
            known = self._by_trigger[trigger] = (len(pipelines), found)
        moves = known[1]
        if not moves or len(moves) > MAX_MOVES:
            return None
        return [
            Move(
                pipeline_id,
                from_stage,
                to_stage,
                _transition_data(
                    trigger,
                    from_stage,
                    to_stage,
                    instructions if instructions is not None else default,
                ),
                capped,
            )
            for pipeline_id, from_stage, to_stage, default, capped in moves
        ]

    @verb(
        "POST",
        "/runs/{id}/fail",
        "Fail the run: retry later or dead-letter by the task's policy.",
        guard=Guard.LEASE,
        name="fail",
        request=commands.FailRun,
        response=StatusBody,
        errors=(*LEASE_ERRORS, e.InvalidJson),
        trailing=True,
        tag="runs",
        answer=said("failed"),
        tool=Tool(
            "fail_task",
            "Fail this attempt at the held task: it is retried later by its policy, or dead-"
            "lettered (retryable false: at once); the lease ends.",
            ends_lease=True,
        ),
    )
    def fail_run(self, b: Backend, run_id: str, token_hash: bytes, cmd: FailRun, now: int) -> None:
        """End the run failed and retry or dead-letter its task. With the lease in order and
        the task's pipeline read by this process (nearly always), that is one call of
        `Backend.fail_run` (on PostgreSQL one statement); otherwise the lease is checked and
        the failure decided step by step, which says what is wrong, if anything."""
        known = self._stage_policies()
        try:
            usage = compact_json(cmd.usage, "{}") or "{}"
        except InvalidJson:
            usage, known = "", None  # said after the lease's errors, below
        if known is not None:
            failed = b.fail_run(
                run_id=run_id,
                token_hash=token_hash,
                fence=cmd.expected_fence,
                usage_json=usage,
                error=cmd.error,
                retryable=cmd.retryable,
                known_pipelines=known[0],
                unreadable=known[1],
                policies=known[2],
                rand=self._rand(),
                now=now,
            )
            if failed is not None:
                self._woken_after(b, failed)
                return
        lease = self.check_run_lease(b, run_id, token_hash, now, cmd.expected_fence)
        self.fail(b, lease, cmd, now)
        if known is not None and lease.pipeline_id not in known[1]:
            # The lease was in order: a pipeline this process has not read, most likely.
            self._read_every_pipeline(b)

    def _stage_policies(self) -> tuple[int, list[str], list[StagePolicyRow]] | None:
        """How many pipelines this process has read, those whose definition it could not
        parse, and the retry policies of the others' stages that have one, as (pipeline,
        stage, retry_delay_ms, backoff, max delay, jitter): what Backend.fail_run decides from
        (it goes on only when there are that many pipelines, and the task's is parsed). None
        when the policies are too many to send: the failure then goes step by step."""
        pipelines = self._pipelines
        known = self._policies
        if known is None or known[0] != len(pipelines):
            unreadable: list[str] = []
            rows: list[StagePolicyRow] = []
            for pipeline_id, pipeline in list(pipelines.items()):
                if pipeline is None:
                    unreadable.append(pipeline_id)
                    continue
                for name in pipeline.states:
                    policy = pipeline.policy(name)
                    retry = (
                        policy.retry_delay_ms,
                        policy.retry_backoff,
                        policy.retry_max_delay_ms,
                        policy.retry_jitter,
                    )
                    if retry != (None, 1.0, None, 0.0):
                        rows.append((pipeline_id, name, *retry))
            known = self._policies = (len(pipelines), unreadable, rows)
        if len(known[1]) + len(known[2]) > MAX_STAGE_POLICIES:
            return None
        return known

    def fail(self, b: Backend, lease: LeaseRow, cmd: FailRun, now: int) -> None:
        """The failure step by step, under the lease checked."""
        task = b.get_task(lease.task_id)
        if task is None:
            raise TrackerError("the run's task cannot be read")
        usage = compact_json(cmd.usage, "{}") or "{}"
        if not b.end_run(lease.run_id, RunStatus.FAILED, usage, cmd.error, now):
            raise RunNotRunning()  # ended meanwhile (a reaper, a cancel): its end counted
        b.delete_lease(lease.id)
        failed = b.failed_attempts(task.id)
        self._after_failure(b, task, lease.run_id, failed, cmd.error, now, cmd.retryable)

    @verb(
        "PUT",
        "/runs/{id}/checkpoint",
        "Merge a JSON object into the task's checkpoint (RFC 7396) and extend the lease.",
        guard=Guard.LEASE,
        name="write_checkpoint",
        client="checkpoint",
        request=commands.WriteCheckpoint,
        response=model.CheckpointResult,
        errors=(*LEASE_ERRORS, e.InvalidJson),
        trailing=True,
        extra=True,
        tag="runs",
        tool=Tool(
            "save_checkpoint",
            "Merge a JSON object into the held task's checkpoint (RFC 7396: a key set to null is "
            "removed) and extend the lease. The next agent to claim the task receives the "
            "checkpoint: save what it needs to resume.",
        ),
    )
    def write_checkpoint(
        self, b: Backend, run_id: str, token_hash: bytes, cmd: WriteCheckpoint, now: int
    ) -> CheckpointResult:
        """Merge the patch into the task's checkpoint, extend the lease, record an event. With
        the lease in order and the patch an object (nearly always), that is one call of
        `Backend.checkpoint_run` (on PostgreSQL one statement); otherwise the lease is checked
        first, which says what is wrong, if anything."""
        try:
            patch = compact_json(cmd.checkpoint, None)
        except InvalidJson:
            patch = None  # said after the lease's errors, below
        if patch is not None and patch.startswith("{"):
            done = b.checkpoint_run(
                run_id, token_hash, cmd.expected_fence, patch, core.DEFAULT_LEASE_TTL_MS, now
            )
            if done is not None:
                merged, expires, fence = done
                return CheckpointResult(msgspec.Raw(merged), expires, fence)
        lease = self.check_run_lease(b, run_id, token_hash, now, cmd.expected_fence)
        return self.checkpoint(b, lease, cmd, now)

    def checkpoint(
        self, b: Backend, lease: LeaseRow, cmd: WriteCheckpoint, now: int
    ) -> CheckpointResult:
        """The checkpoint step by step, under the lease checked."""
        patch = compact_json(cmd.checkpoint, None)
        if patch is None or not patch.startswith("{"):
            raise InvalidJson("checkpoint must be a JSON object (an RFC 7396 merge patch)")
        merged = b.merge_checkpoint(lease.task_id, patch)
        expires = self._extend(b, lease, None, now)
        b.insert_event(lease.run_id, "checkpoint", patch, now)
        return CheckpointResult(msgspec.Raw(merged), expires, lease.fence)

    @verb(
        "POST",
        "/runs/{id}/release",
        "Put the task down on purpose: claimable again at once, not a failed attempt.",
        guard=Guard.LEASE,
        name="release",
        request=commands.ReleaseRun,
        response=model.Released,
        errors=(*LEASE_ERRORS, e.InvalidJson),
        trailing=True,
        extra=True,
        optional_body=True,
        tag="runs",
        tool=Tool(
            "release_task",
            "Put the held task down on purpose: claimable again at once, with its checkpoint; not "
            "a failed attempt. The lease ends.",
            ends_lease=True,
        ),
    )
    def release_run(
        self, b: Backend, run_id: str, token_hash: bytes, cmd: ReleaseRun, now: int
    ) -> Released:
        """Put the task down on purpose: claimable again at once, not a failed attempt. With
        the lease in order (nearly always), that is one call of `Backend.release_run` (on
        PostgreSQL one statement); otherwise the lease is checked, which says what is wrong."""
        ended = b.release_run(
            run_id=run_id,
            token_hash=token_hash,
            fence=cmd.expected_fence,
            reason=cmd.reason,
            now=now,
        )
        if ended is not None:
            if not ended.notified:
                self._signal(b, ended.pipeline_id, ended.stage)
            return Released("released", run_id, ended.task_id)
        lease = self.check_run_lease(b, run_id, token_hash, now, cmd.expected_fence)
        return self.release(b, lease, cmd, now)

    def release(self, b: Backend, lease: LeaseRow, cmd: ReleaseRun, now: int) -> Released:
        """The release step by step, under the lease checked."""
        if not b.end_run(lease.run_id, RunStatus.RELEASED, "{}", cmd.reason, now):
            raise RunNotRunning()
        b.delete_lease(lease.id)
        data = {"reason": cmd.reason or "released", "agent_id": lease.agent_id}
        b.insert_event(lease.run_id, "released", _json(data), now)
        self._signal(b, lease.pipeline_id, lease.stage)
        return Released("released", lease.run_id, lease.task_id)

    @verb(
        "POST",
        "/agents/release",
        "Release every task an agent holds (a stop hook for coding agents).",
        request=commands.ReleaseAgent,
        response=model.AgentReleased,
        errors=(e.InvalidJson,),
        extra=True,
        tag="leases",
        cli="pause",
    )
    def release_agent(self, b: Backend, cmd: commands.ReleaseAgent, now: int) -> AgentReleased:
        """Release every live lease `cmd.agent_id` holds (an agent stopping on purpose): one
        call of `Backend.release_agent` (on PostgreSQL one statement)."""
        released = []
        ended_all = b.release_agent(
            agent_id=cmd.agent_id, reason=cmd.reason or "agent paused", now=now
        )
        for run_id, ended in ended_all:
            if not ended.notified:
                self._signal(b, ended.pipeline_id, ended.stage)
            released.append(Released("released", run_id, ended.task_id))
        return AgentReleased(cmd.agent_id, released)


def _caps(pipeline: fsm.Pipeline, stage: str) -> bool:
    """The stage's policy caps its leases: a claim may wait for a slot there, so a task that
    leaves it wakes a claim of its role. (A claim held back by its own per-state limits does
    not wait for that: its server tries it again each second, service/wakeups.py.)"""
    return pipeline.policy(stage).max_concurrency is not None
