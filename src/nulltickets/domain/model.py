"""The resources a client sees, as msgspec Structs. They are both what storage returns and what
the HTTP layer encodes, so the OpenAPI schemas derive from the same definitions.

Free-form JSON columns (definition, metadata, data, meta, value) travel as `msgspec.Raw`: the
stored compact JSON text is embedded in responses without being parsed again.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec
from msgspec import UNSET, Raw, Struct, UnsetType


class RunStatus(StrEnum):
    RUNNING = "running"  # left by transition (completed), fail (failed), lease expiry (stale)
    #                      a deliberate release (released) or a cancel of its task (cancelled)
    COMPLETED = "completed"  # final
    FAILED = "failed"  # final; counts as a failed attempt
    STALE = "stale"  # final; its lease expired, which also counts as a failed attempt
    RELEASED = "released"  # final; put down on purpose, not a failed attempt
    CANCELLED = "cancelled"  # final; its task was cancelled while leased, not a failed attempt


class Pipeline(Struct):
    id: str
    name: str
    definition: Raw
    created_at_ms: int


class Task(Struct):
    id: str
    pipeline_id: str
    stage: str
    title: str
    description: str
    priority: int
    metadata: Raw
    task_version: int
    next_eligible_at_ms: int
    retry_delay_ms: int
    max_attempts: int | None
    dead_letter_stage: str | None
    dead_letter_reason: str | None
    created_at_ms: int
    updated_at_ms: int


class Run(Struct):
    id: str
    task_id: str
    attempt: int
    status: str
    agent_id: str | None
    agent_role: str | None
    started_at_ms: int | None
    ended_at_ms: int | None


class TaskRun(Run):
    """A run as GET /tasks/{id}/runs lists it: with the error its agent reported, if any."""

    error: str | None = None


class TaskRunPage(Struct):
    items: list[TaskRun]
    next_cursor: str | None


class RetryWaiting(Struct):
    """A task waiting on a retry delay: claimable again at `next_eligible_at_ms`, with its
    latest failed (or stale) attempt, `error` being what that run reported."""

    task_id: str
    pipeline_id: str
    stage: str
    title: str
    next_eligible_at_ms: int
    attempt: int | None
    status: str | None
    error: str | None
    failed_at_ms: int | None


class RetryReport(Struct):
    items: list[RetryWaiting]
    generated_at_ms: int


class FailingTask(Struct):
    """A task failing in a loop: `failures` attempts in a row failed (or their lease expired)
    within the window, with no completed run since, and it is still to be retried. `error` is
    what its latest failed attempt reported; it is claimable again at `next_eligible_at_ms`."""

    task_id: str
    pipeline_id: str
    stage: str
    title: str
    failures: int
    error: str | None
    last_failed_at_ms: int
    next_eligible_at_ms: int


class FailingReport(Struct):
    items: list[FailingTask]
    window_ms: int
    min_failures: int
    generated_at_ms: int


class NamespaceSummary(Struct):
    """A namespace of the shared store: how many keys it holds, when one last changed."""

    namespace: str
    keys: int
    updated_at_ms: int


class NamespacePage(Struct):
    items: list[NamespaceSummary]
    next_cursor: str | None


class Dependency(Struct):
    depends_on_task_id: str
    resolved: bool


class Assignment(Struct):
    task_id: str
    agent_id: str
    assigned_by: str | None
    active: bool
    created_at_ms: int
    updated_at_ms: int


class TaskAssignment(Struct):
    """An assignment as shown inside task details (the contract leaves out task_id there)."""

    agent_id: str
    assigned_by: str | None
    active: bool
    created_at_ms: int
    updated_at_ms: int


class AvailableTransition(Struct):
    trigger: str
    to: str
    required_gates: list[str]


class Failure(Struct):
    """An earlier attempt that failed: `stale` when its lease expired (the agent vanished)."""

    attempt: int
    run_id: str
    status: str
    error: str | None
    ended_at_ms: int | None


class TaskDetails(Task):
    latest_run: Run | UnsetType = UNSET
    dependencies: list[Dependency] = msgspec.field(default_factory=list)
    assignments: list[TaskAssignment] = msgspec.field(default_factory=list)
    available_transitions: list[AvailableTransition] = msgspec.field(default_factory=list)
    checkpoint: Raw = msgspec.field(default_factory=lambda: Raw(b"null"))
    fence: int = 0
    previous_failures: list[Failure] = msgspec.field(default_factory=list)
    # Only on a cancelled task: when and why (POST /tasks/{id}/cancel; a requeue clears both).
    cancelled_at_ms: int | UnsetType = UNSET
    cancel_reason: str | UnsetType | None = UNSET


class ClaimedTask(Task):
    """The claimed task, with what the agent needs to resume: the checkpoint the previous
    attempts left (null if none), their failures, and the fence of this claim."""

    available_transitions: list[AvailableTransition] = msgspec.field(default_factory=list)
    checkpoint: Raw = msgspec.field(default_factory=lambda: Raw(b"null"))
    fence: int = 0
    previous_failures: list[Failure] = msgspec.field(default_factory=list)


class Event(Struct):
    id: int
    run_id: str
    ts_ms: int
    kind: str
    data: Raw


class TaskEvent(Struct):
    """Something an operator did to a task (`requeued`, `cancelled`), with who and why."""

    id: int
    task_id: str
    ts_ms: int
    kind: str
    data: Raw


class Artifact(Struct):
    id: str
    task_id: str | None
    run_id: str | None
    created_at_ms: int
    kind: str
    uri: str
    sha256: str | None
    size_bytes: int | None
    meta: Raw


class StageCount(Struct):
    stage: str
    count: int


class HeldLease(Struct):
    """The lease an agent holds, as an MCP session on the server finds it (never sent)."""

    id: str
    run_id: str
    task_id: str
    token_hash: bytes
    fence: int
    expires_at_ms: int


class LeaseRow(Struct):
    """A lease with what lease-protected writes need of its run and task (never sent)."""

    id: str
    run_id: str
    task_id: str
    token_hash: bytes
    expires_at_ms: int
    ttl_ms: int | None
    run_status: str
    stage: str
    task_version: int
    pipeline_id: str
    fence: int
    agent_id: str


class ClaimResult(Struct):
    task: ClaimedTask
    run: Run
    lease_id: str
    lease_token: str
    expires_at_ms: int
    fence: int = 0


class CheckpointResult(Struct):
    checkpoint: Raw
    expires_at_ms: int
    fence: int


class TaskCheckpoint(Struct):
    task_id: str
    checkpoint: Raw
    fence: int
    previous_failures: list[Failure]


class Released(Struct):
    status: str
    run_id: str
    task_id: str


class AgentReleased(Struct):
    agent_id: str
    released: list[Released]


class TransitionResult(Struct):
    previous_stage: str
    new_stage: str
    trigger: str


class Health(Struct):
    status: str
    version: str
    tasks_by_stage: list[StageCount]
    active_leases: int
    core: str
    # The SQLite the server runs on: its version and chosen compile options.
    sqlite_version: str = ""
    sqlite_options: list[str] = []


class TaskPage(Struct):
    items: list[Task]
    next_cursor: str | None


class EventPage(Struct):
    items: list[Event]
    next_cursor: str | None


class TaskEventPage(Struct):
    items: list[TaskEvent]
    next_cursor: str | None


class ArtifactPage(Struct):
    items: list[Artifact]
    next_cursor: str | None


class StoreEntry(Struct):
    namespace: str
    key: str
    value: Raw
    created_at_ms: int
    updated_at_ms: int


class SearchHit(StoreEntry):
    """A store entry found by search: bm25 `score` (lower is better) and a `snippet` of the
    match with the matched terms in [brackets]."""

    score: float = 0.0
    snippet: str = ""


class RoleQueue(Struct):
    role: str
    claimable_count: int
    oldest_claimable_age_ms: int | None
    failed_count: int
    stuck_count: int
    near_expiry_leases: int


class QueueReport(Struct):
    """The queue per role (contract §15), and how many tasks are dead-lettered and how many
    cancelled in every pipeline and stage (dead-letter stages without a role included)."""

    roles: list[RoleQueue]
    generated_at_ms: int
    dead_lettered: int = 0
    cancelled: int = 0


class StageQueue(Struct):
    """Where the tasks of one (pipeline, stage) with a role stand. Each task counts once:
    leased first, then dead-lettered or cancelled, then waiting on a retry delay, then blocked
    by unfinished dependencies; the rest are claimable. A stage without a role (`role` null)
    is listed when dead-lettered or cancelled tasks landed there (a dead-letter stage)."""

    pipeline_id: str
    stage: str
    role: str | None
    claimable: int
    oldest_claimable_age_ms: int | None
    leased: int
    waiting_retry: int
    blocked: int
    dead_lettered: int
    cancelled: int


class StageReport(Struct):
    """The queue per stage, and the transitions of each of the last 60 minutes (oldest first)."""

    stages: list[StageQueue]
    transitions_per_minute: list[int]
    generated_at_ms: int


class FailedTask(Struct):
    """A task on the failures listing (GET /ops/failures). `state`: `dead_lettered` (its retry
    policy gave up; wherever it landed), `cancelled` (an operator cancelled it), or `failing`
    (it failed since its last transition and will be retried, or is being retried now:
    `leased`). `at_ms`, the listing's order: the end of its latest failed attempt, or its
    cancellation. `last_error`: what the latest failed attempt reported (`lease_expired` when
    its lease ran out); `failures`: its failed attempts over its whole life.
    `next_eligible_at_ms`: for a failing task, when it may be claimed again."""

    id: str
    pipeline_id: str
    stage: str
    title: str
    priority: int
    state: str
    at_ms: int
    failures: int
    last_error: str | None
    failed_at_ms: int | None
    dead_letter_reason: str | None
    cancelled_at_ms: int | None
    cancel_reason: str | None
    next_eligible_at_ms: int | None
    leased: bool


class FailurePage(Struct):
    items: list[FailedTask]
    next_cursor: str | None


class FailureGroup(Struct):
    """Failed tasks of one state with the same last error (null: none reported): how many,
    and the newest and oldest `at_ms` among them."""

    state: str
    error: str | None
    count: int
    newest_at_ms: int
    oldest_at_ms: int


class FailureGroups(Struct):
    groups: list[FailureGroup]
    generated_at_ms: int


class OutcomeError(Struct):
    code: str
    message: str


class TaskOutcome(Struct, omit_defaults=True):
    """What a bulk verb did to one task: `requeued` (now in `stage`), `cancelled`,
    `already_cancelled`, or `refused` with the `error` the single verb would have answered
    (only then present)."""

    id: str
    outcome: str
    stage: str | None = None
    error: OutcomeError | None = None


class BulkOutcome(Struct):
    """Per id, in the order given (an id given twice is acted on once); `done` counts the
    tasks changed, `refused` those left as they were because of an error."""

    items: list[TaskOutcome]
    done: int
    refused: int


class FeedEvent(Struct):
    """A run event as GET /events/stream sends it: with its run's task and pipeline."""

    id: int
    run_id: str
    task_id: str
    pipeline_id: str
    ts_ms: int
    kind: str
    data: Raw


class Span(Struct):
    """A stored OpenTelemetry span (ids in hex, times in Unix nanoseconds)."""

    id: int
    batch_id: int
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str | None
    start_time_unix_nano: int | None
    end_time_unix_nano: int | None
    status_code: str | None
    status_message: str | None
    scope_name: str | None
    scope_version: str | None
    run_id: str | None
    task_id: str | None
    attributes: Raw
    resource_attributes: Raw


class SpanPage(Struct):
    items: list[Span]
    next_cursor: str | None


class TraceIngest(Struct):
    batch_id: int
    accepted_spans: int
    stored: str


class SpanRow(Struct):
    """One `otlp_spans` row (contract §17), without its id and batch id."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str | None
    start_time_unix_nano: int | None
    end_time_unix_nano: int | None
    status_code: str | None
    status_message: str | None
    scope_name: str | None
    scope_version: str | None
    run_id: str | None
    task_id: str | None
    attributes_json: str
    resource_attributes_json: str
    raw_json: str


class Access(StrEnum):
    """What a key may do; each level may do everything the one before it may. The server's
    `--token` is the root key, with `admin` access."""

    READ = "read"  # every read (GET) route, /metrics, /events/stream, the dashboard
    AGENT = "agent"  # reads, claims for the key's roles, and the writes agents make
    ADMIN = "admin"  # everything, as the --token


ACCESS_ORDER = (Access.READ, Access.AGENT, Access.ADMIN)


def allows(held: Access, needed: Access) -> bool:
    """Whether a key with access `held` may call a route that needs `needed`."""
    return ACCESS_ORDER.index(held) >= ACCESS_ORDER.index(needed)


class KeyInfo(Struct):
    """A key as GET /keys lists it: never the key itself, nor its hash. `roles`: the agent
    roles an `agent` key claims for (empty for the other levels)."""

    id: str
    name: str
    access: Access
    roles: list[str]
    created_at_ms: int


class CreatedKey(Struct):
    """The answer to POST /keys: the only time the key is shown (the server keeps its
    SHA-256)."""

    id: str
    key: str
    name: str
    access: Access
    roles: list[str]
    created_at_ms: int


# --- small answers -----------------------------------------------------------------------------


class IdBody(msgspec.Struct):
    id: str


class IdsBody(msgspec.Struct):
    ids: list[str]


class StatusBody(msgspec.Struct):
    status: str


class ExpiresBody(msgspec.Struct):
    expires_at_ms: int


class EventIdBody(msgspec.Struct):
    id: int


class RunStateBody(msgspec.Struct):
    run_id: str
