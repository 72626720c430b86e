"""Backend: the statements of one unit of work, as the service sees them.

Each method runs one named query (or a few, for the paging variants) inside the transaction
of the unit of work it was given to (storage.ports.Database.write/read). Methods are named
after their queries, take and return domain types, and raise our exceptions (StorageBusy,
StorageFull, StorageQueryError, DuplicateName, ...), never driver ones. Nothing here is a
dialect's: lists are lists (each backend encodes them for its SQL), search takes the user's
terms (each backend builds its own full-text query), and a uniqueness the data guarantees is
reported as the contract's error code.

Implementations: storage/sqlite/backend.py (SqliteBackend), storage/postgres (in progress).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from nulltickets.domain.model import (
    Artifact,
    Assignment,
    Dependency,
    Event,
    Failure,
    FeedEvent,
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

# (pipeline_id, stage, role, claimable, oldest claimable created_at_ms or None, leased,
#  waiting on a retry delay, blocked, dead-lettered, cancelled)
StageBoardRow = tuple[str, str, str, int, int | None, int, int, int, int, int]


class Backend(Protocol):
    def engine(self) -> tuple[str, str, list[str]]:
        """(engine name, its version, the compile options we chose) for /health."""
        ...

    def insert_pipeline(self, id: str, name: str, definition_json: str, now: int) -> None:
        """Raises DuplicateName if a pipeline of that name exists (a constraint of the data)."""
        ...

    def insert_pipeline_stage(
        self, pipeline_id: str, stage: str, agent_role: str | None, terminal: bool
    ) -> None: ...

    def get_pipeline(self, id: str) -> Pipeline | None: ...

    def list_pipelines(self) -> list[Pipeline]: ...

    def insert_task(
        self,
        *,
        id: str,
        pipeline_id: str,
        stage: str,
        title: str,
        description: str,
        priority: int,
        metadata_json: str,
        max_attempts: int | None,
        retry_delay_ms: int,
        dead_letter_stage: str | None,
        idempotency_key: str | None,
        retry_delay_set: bool,
        now: int,
    ) -> bool:
        """Insert a task; False (nothing inserted) if the pipeline already has a task under
        this idempotency key (a unique constraint: concurrent creates insert one)."""
        ...

    def get_task(self, id: str) -> Task | None: ...

    def task_details(self, id: str) -> tuple[Task, str | None, int, int | None, str | None] | None:
        """(task, checkpoint JSON or None, fence, cancelled_at_ms, cancel_reason): one trip."""
        ...

    def task_exists(self, id: str) -> bool: ...

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
        ...

    def list_task_runs(self, task_id: str, after: int, limit: int) -> list[TaskRun]:
        """The task's runs after attempt `after`, oldest first."""
        ...

    def retry_waiting(self, now: int, limit: int) -> list[RetryWaiting]:
        """Tasks waiting on a retry delay at `now`, soonest claimable first."""
        ...

    def list_namespaces(self, after: str, limit: int) -> list[NamespaceSummary]:
        """The store's namespaces after `after`, by name."""
        ...

    def task_run_state(self, id: str) -> str | None: ...

    def latest_run(self, task_id: str) -> Run | None: ...

    def task_by_idempotency_key(self, pipeline_id: str, key: str) -> str | None: ...

    def task_resume(self, id: str) -> tuple[str | None, int] | None:
        """(checkpoint JSON or None, fence) of a task."""
        ...

    def previous_failures(self, task_id: str, limit: int = 20) -> list[Failure]: ...

    def retry_delay_set(self, id: str) -> bool: ...

    def bump_fence(self, id: str) -> tuple[int, str | None]:
        """Raise a task's fence; (the new fence, its checkpoint JSON or None)."""
        ...

    def task_fence_of_run(self, run_id: str) -> int | None: ...

    def task_fence_of_lease(self, lease_id: str) -> int | None: ...

    def merge_checkpoint(self, id: str, patch_json: str) -> str: ...

    def leases_of_agent(self, agent_id: str) -> list[str]: ...

    def dependent_stages(self, id: str) -> list[tuple[str, str]]: ...

    def leased_in_pipeline_stage(self, pipeline_id: str, stage: str) -> int: ...

    def role_stages(self, agent_role: str) -> list[tuple[str, str]]: ...

    def insert_dependency(self, task_id: str, depends_on_task_id: str, now: int) -> None:
        """Raises DuplicateDependency if the dependency exists (a constraint of the data)."""
        ...

    def list_dependencies(self, task_id: str) -> list[Dependency]: ...

    def deactivate_assignments(self, task_id: str, now: int) -> None: ...

    def upsert_assignment(
        self, task_id: str, agent_id: str, assigned_by: str | None, now: int
    ) -> None: ...

    def unassign(self, task_id: str, agent_id: str, now: int) -> bool: ...

    def list_assignments(self, task_id: str) -> list[Assignment]: ...

    def expired_leases(self, now: int, limit: int) -> list[tuple[str, str, str]]: ...

    def next_lease_expiry(self) -> int | None: ...

    def leased_in_stage(self, stage: str) -> int: ...

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
        ...

    def insert_run(
        self, id: str, task_id: str, agent_id: str, agent_role: str, now: int, lease_id: str
    ) -> int:
        """Insert a running run under `lease_id`; returns its attempt number. At most one run
        of a task is running (a unique constraint): a second raises StorageBusy (the claim
        lost a race and may simply be tried again)."""
        ...

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
    ) -> None: ...

    def lease_by_run(self, run_id: str) -> LeaseRow | None: ...

    def lease_by_id(self, id: str) -> LeaseRow | None: ...

    def extend_lease(self, id: str, expires_at_ms: int, ttl_ms: int, now: int) -> None: ...

    def rotate_lease_token(self, id: str, token_hash: bytes) -> bool: ...

    def delete_lease(self, id: str) -> None: ...

    def insert_event(self, run_id: str, kind: str, data_json: str, now: int) -> int: ...

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
        ...

    def list_events(self, run_id: str, after_id: int, limit: int) -> list[Event]: ...

    def events_feed(self, after_id: int, limit: int, task_id: str | None = None) -> list[FeedEvent]:
        """Run events after `after_id` of every run (or of one task's runs), oldest first."""
        ...

    def last_event_id(self) -> int: ...

    def event_kinds_since(self, after_id: int) -> list[tuple[str, int, int]]:
        """(kind, count, newest id) of the run events after `after_id`."""
        ...

    def stage_board(self, now: int) -> list[StageBoardRow]:
        """Per (pipeline, stage) with a role: (pipeline_id, stage, role, claimable, oldest
        claimable created_at_ms, leased, delayed, blocked, dead-lettered, cancelled)."""
        ...

    def transitions_since(self, since: int, window: int) -> list[tuple[int, int]]:
        """(minute since `since`, transitions) among the newest `window` events."""
        ...

    def end_run(
        self, id: str, status: str, usage_json: str, error_text: str | None, now: int
    ) -> bool: ...

    def move_task(self, id: str, stage: str, task_version: int, now: int) -> bool: ...

    def failed_attempts(self, task_id: str) -> int: ...

    def schedule_retry(self, id: str, next_eligible_at_ms: int, now: int) -> None: ...

    def dead_letter_task(
        self,
        id: str,
        stage: str,
        version_bump: int,
        reason: str,
        next_eligible_at_ms: int,
        now: int,
    ) -> None: ...

    def cancel_task(self, id: str, reason: str | None, next_eligible_at_ms: int, now: int) -> bool:
        """Cancel a task that is not cancelled yet; False if it already was."""
        ...

    def requeue_task(
        self, id: str, stage: str, version_bump: int, reset_attempts: bool, now: int
    ) -> None: ...

    def task_cancellation(self, id: str) -> tuple[int | None, str | None]:
        """(cancelled_at_ms, cancel_reason) of a task; both None if it is not cancelled."""
        ...

    def live_lease_of_task(self, task_id: str) -> tuple[str, str, int] | None:
        """(lease id, run id, expires_at_ms) of the task's running run, if it has one."""
        ...

    def run_status(self, id: str) -> str | None: ...

    def run_status_of_lease(self, lease_id: str) -> str | None: ...

    def last_dead_letter(self, task_id: str) -> str | None:
        """The data JSON of the task's latest dead_letter event, if any."""
        ...

    def insert_task_event(self, task_id: str, kind: str, data_json: str, now: int) -> int: ...

    def list_task_events(self, task_id: str, after_id: int, limit: int) -> list[TaskEvent]: ...

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
    ) -> None: ...

    def run_exists(self, id: str) -> bool: ...

    def list_artifacts(
        self,
        *,
        task_id: str | None,
        run_id: str | None,
        after: tuple[int, str] | None,
        limit: int,
    ) -> list[Artifact]: ...

    def put_value(self, namespace: str, key: str, value_json: str, now: int) -> None: ...

    def get_value(self, namespace: str, key: str) -> StoreEntry | None: ...

    def delete_value(self, namespace: str, key: str) -> None: ...

    def list_namespace(self, namespace: str) -> list[StoreEntry]: ...

    def delete_namespace(self, namespace: str) -> None: ...

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
        ...

    def role_stage_queue(
        self, now: int, stuck_before: int, near_expiry_before: int
    ) -> list[tuple[str, int, int | None, int, int, int]]: ...

    def insert_otlp_batch(
        self,
        content_type: str,
        payload_json: str | None,
        payload_blob: bytes | None,
        parsed_spans: int,
        now: int,
    ) -> int: ...

    def insert_otlp_span(self, batch_id: int, span: SpanRow) -> None: ...

    def list_run_spans(self, run_id: str, after_id: int, limit: int) -> list[Span]: ...

    def tasks_by_stage(self) -> list[StageCount]: ...

    def active_leases(self, now: int) -> int: ...

    def get_idempotency(
        self, key: str, method: str, path: str
    ) -> tuple[bytes, bytes | None, int, str] | None:
        """(request hash, auth hash, status, body) recorded under the key, if any. The first
        statement of an idempotent unit of work: a backend with concurrent writers holds the
        key until the unit commits (PostgreSQL: lock_idempotency_key), so that concurrent
        requests under one key run once and the others replay its answer."""
        ...

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
    ) -> None: ...

    def purge_idempotency(self, before: int) -> int: ...
