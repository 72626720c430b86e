"""Backend: the only storage interface the service sees.

Each method runs one named query (or a few, for the paging variants) on the connection the
backend wraps, inside whatever transaction the caller holds: the writer's batch for writes, a
reader's snapshot for reads. Methods return domain types and raise our exceptions
(StorageBusy, StorageFull, StorageQueryError), never driver ones. `SqliteBackend` is the
implementation; a PostgreSQL one would keep these names.
"""

from __future__ import annotations

from typing import Any, Protocol

from nulltickets.domain.model import (
    Artifact,
    Assignment,
    Dependency,
    Event,
    Failure,
    LeaseRow,
    Pipeline,
    Run,
    SearchHit,
    Span,
    StageCount,
    StoreEntry,
    Task,
)


class Backend(Protocol):
    conn: Any  # the driver connection (for bulk loads in tools and benchmarks)

    def sqlite(self) -> tuple[str, list[str]]: ...  # (version, chosen compile options)

    def insert_pipeline(self, id: str, name: str, definition_json: str, now: int) -> None: ...

    def insert_pipeline_stage(
        self, pipeline_id: str, stage: str, agent_role: str | None, terminal: bool
    ) -> None: ...

    def pipeline_name_taken(self, name: str) -> bool: ...

    def get_pipeline(self, id: str) -> Pipeline | None: ...

    def list_pipelines(self) -> list[Pipeline]: ...

    def insert_task(self, **params: Any) -> None: ...

    def get_task(self, id: str) -> Task | None: ...

    def task_exists(self, id: str) -> bool: ...

    def list_tasks(
        self,
        *,
        stage: str | None,
        pipeline_id: str | None,
        after: tuple[int, str] | None,
        limit: int,
    ) -> list[Task]: ...

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

    def insert_dependency(self, task_id: str, depends_on_task_id: str, now: int) -> None: ...

    def dependency_exists(self, task_id: str, depends_on_task_id: str) -> bool: ...

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
        full_stages_json: str | None,
        now: int,
        full_pairs_json: str | None = None,
    ) -> Task | None:
        """The best claimable task of the role, skipping full stages (JSON arrays of stage
        names and of [pipeline, stage] pairs; None when there are none)."""
        ...

    def insert_run(
        self, id: str, task_id: str, agent_id: str, agent_role: str, now: int, lease_id: str
    ) -> int:
        """Insert a running run under `lease_id`; returns its attempt number."""
        ...

    def insert_lease(self, **params: Any) -> None: ...

    def get_run(self, id: str) -> Run | None: ...

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

    def insert_artifact(self, **params: Any) -> None: ...

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
        query: str,
        namespace: str | None,
        filter_path: str | None,
        filter_value: str | None,
        limit: int,
    ) -> list[SearchHit]: ...

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

    def insert_otlp_span(self, batch_id: int, span: dict[str, Any]) -> None: ...

    def list_run_spans(self, run_id: str, after_id: int, limit: int) -> list[Span]: ...

    def tasks_by_stage(self) -> list[StageCount]: ...

    def active_leases(self, now: int) -> int: ...

    def get_idempotency(
        self, key: str, method: str, path: str
    ) -> tuple[bytes, bytes | None, int, str] | None: ...

    def put_idempotency(self, **params: Any) -> None: ...

    def purge_idempotency(self, before: int) -> int: ...
