"""The exception tree. Every error a client can see has a stable snake_case `code`.

Nothing here knows about HTTP: http/errors.py maps classes to statuses.
"""

from __future__ import annotations


class TrackerError(Exception):
    """Unexpected failure."""

    code = "internal_error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or self.code).strip())

    @property
    def message(self) -> str:
        return str(self.args[0])


# --- request shape -----------------------------------------------------------------------------


class InvalidJson(TrackerError):
    """Request body is not valid JSON for this route."""

    code = "invalid_json"


class InvalidRequest(TrackerError):
    """Request is not valid."""

    code = "invalid_request"


class InvalidLimit(TrackerError):
    """limit must be between 1 and 1000."""

    code = "invalid_limit"


class InvalidCursor(TrackerError):
    """cursor is malformed."""

    code = "invalid_cursor"


class InvalidLeaseTtl(TrackerError):
    """lease_ttl_ms must be a positive integer."""

    code = "invalid_lease_ttl"


class PayloadTooLarge(TrackerError):
    """Request is larger than the configured limit."""

    code = "payload_too_large"


class RequestTimeout(TrackerError):
    """Request body was not received in time."""

    code = "request_timeout"


class MissingParam(TrackerError):
    """A required query parameter is missing."""

    code = "missing_param"


class InvalidQuery(TrackerError):
    """Query has no searchable term."""

    code = "invalid_query"


# --- lookups -----------------------------------------------------------------------------------


class NotFound(TrackerError):
    """Not found."""

    code = "not_found"


class MethodNotAllowed(TrackerError):
    """This path does not take that method."""

    code = "method_not_allowed"

    def __init__(self, message: str | None = None, allowed: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.allowed = allowed


class PipelineNotFound(TrackerError):
    """Pipeline not found."""

    code = "pipeline_not_found"


class TaskNotFound(TrackerError):
    """Task not found."""

    code = "task_not_found"


class DependencyTaskNotFound(TrackerError):
    """Dependency task not found."""

    code = "dependency_task_not_found"


class RunNotFound(NotFound):
    """Run not found."""


class LeaseNotFound(NotFound):
    """No active lease."""


# --- conflicts and rules -----------------------------------------------------------------------


class Unauthorized(TrackerError):
    """Missing or invalid bearer token."""

    code = "unauthorized"


class Forbidden(TrackerError):
    """This request is not allowed."""

    code = "forbidden"


class ForeignOrigin(Forbidden):
    """A page of another origin may not call this server."""


class UnknownHost(Forbidden):
    """This server does not answer to that Host name."""


class KeysNeedToken(TrackerError):
    """Keys need a server started with --token (without one, every request is admitted)."""

    code = "keys_need_token"


class LeaseExpired(TrackerError):
    """Lease has expired."""

    code = "expired"


class RunNotRunning(TrackerError):
    """Run is not running."""

    code = "conflict"


class InvalidPipeline(TrackerError):
    """Pipeline definition is invalid."""

    code = "validation_failed"


class InvalidRetryPolicy(TrackerError):
    """The task's retry_policy is invalid: an unknown key, a value out of range, or a
    dead_letter_stage that is not a stage of the task's pipeline."""

    code = "invalid_retry_policy"


class DuplicateName(TrackerError):
    """A pipeline with this name already exists."""

    code = "duplicate_name"


class DuplicateDependency(TrackerError):
    """Dependency already exists."""

    code = "duplicate_dependency"


class InvalidDependency(TrackerError):
    """A task cannot depend on itself."""

    code = "invalid_dependency"


class IllegalTransition(TrackerError):
    """No transition for this trigger from the current stage."""

    code = "invalid_transition"


class ExpectedStageMismatch(TrackerError):
    """Task is not in the expected stage."""

    code = "expected_stage_mismatch"


class TaskVersionMismatch(TrackerError):
    """Task version does not match expected_task_version."""

    code = "task_version_mismatch"


class LeaseSuperseded(TrackerError):
    """The task was claimed again since this lease's fence; this agent no longer holds it."""

    code = "lease_superseded"


class TaskCancelled(TrackerError):
    """The task was cancelled by an operator; this lease was revoked."""

    code = "task_cancelled"


class TaskLeased(TrackerError):
    """The task is held under a live lease; cancel it, or wait for the lease to end."""

    code = "task_leased"


class TaskFinished(TrackerError):
    """The task sits in a terminal stage."""

    code = "task_finished"


class InvalidStage(TrackerError):
    """The stage is not a non-terminal stage of the task's pipeline."""

    code = "invalid_stage"


class IdempotencyConflict(TrackerError):
    """Idempotency-Key was already used with a different request body."""

    code = "idempotency_conflict"


class ReservedNamespace(TrackerError):
    """The namespace 'search' is reserved."""

    code = "reserved_namespace"


# --- capacity ----------------------------------------------------------------------------------


class Overloaded(TrackerError):
    """The server holds as many open event streams as it is set to; retry later."""

    code = "overloaded"


# --- storage -----------------------------------------------------------------------------------


class StorageBusy(TrackerError):
    """Database is busy; retry shortly."""

    code = "storage_busy"


class StorageFull(TrackerError):
    """Database disk is full; writes are refused until space is freed."""

    code = "storage_full"


class StorageUnavailable(TrackerError):
    """The database could not be written; retry later."""

    code = "storage_unavailable"


class McpUnavailable(TrackerError):
    """The MCP server could not start on this server (its log says why); the HTTP API works."""

    code = "mcp_unavailable"


class StorageReadOnly(TrackerError):
    """Database is read-only."""

    code = "storage_read_only"


class StorageQueryError(TrackerError):
    """The database rejected a query built from request input."""

    code = "invalid_query"


class StartupError(TrackerError):
    """The server cannot start."""

    code = "startup_error"


class MaintenanceError(TrackerError):
    """The database could not be backed up or inspected."""

    code = "maintenance_failed"
